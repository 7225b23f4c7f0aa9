"""Soak: a long bounded load on one gateway, watching errors and the server's memory.

    python -m glance_loadtest.soak --minutes 30                 # starts its own gateway on loopback
    python -m glance_loadtest.soak --minutes 30 --url http://127.0.0.1:8000 --server-pid 1234

Without ``--url`` it starts ``glance serve`` on a free loopback port (the bundled demo checkpoints, or
``--model/--drafter``, or with ``--tiny`` a tiny random pair built in a temporary directory) and stops it at
the end. The run has a warm-up phase (caches, allocator pools and the tokenizer settle), then the measured
phase; the server's RSS (``/proc/PID/status``) is sampled all along. It passes when no request failed and
the RSS at the end is within ``--rss-tolerance`` (10 %) of the RSS after warm-up. Exit code 0 on pass, 1 on
fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from .cli import add_arguments, config_from_args
from .runner import RunResult, run_load
from .stats import summarize


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RssSampler:
    """Samples a process's RSS every ``period`` seconds in a thread."""

    def __init__(self, pid: int, period: float = 2.0) -> None:
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, RuntimeError):
                self.samples.append((time.monotonic() - self._t0, rss_bytes(self.pid)))
            self._stop.wait(self.period)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with code {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", timeout=5, trust_env=False).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the gateway at {url} was not ready after {timeout:.0f} s")


def glance_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from glance_sgl.cli import main; sys.exit(main(sys.argv[1:]))",
            *args]


@contextlib.contextmanager
def own_gateway(args: argparse.Namespace, log_path: Path) -> Iterator[tuple[str, int]]:
    """Starts ``glance serve`` on a free loopback port; yields (url, pid); stops it at the end."""
    with tempfile.TemporaryDirectory(prefix="glance-soak-") as tmp:
        model, drafter = args.server_model, args.server_drafter
        if args.tiny:
            subprocess.run(glance_cmd("tiny", "--out", tmp), check=True, stdout=subprocess.DEVNULL)
            model, drafter = f"{tmp}/target", f"{tmp}/drafter"
        port = free_port()
        cmd = glance_cmd("serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                         "--max-queue", str(args.server_max_queue))
        for flag, value in (("--model", model), ("--drafter", drafter), ("--threads", args.server_threads)):
            if value:
                cmd += [flag, str(value)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, args.ready_timeout)
            yield url, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def phase(args: argparse.Namespace, url: str, seconds: float, seed: int) -> RunResult:
    args = argparse.Namespace(**vars(args))
    args.url, args.run_time, args.seed, args.num_requests = url, seconds, seed, None
    return run_load(config_from_args(args), None if args.quiet else sys.stderr)


def soak(args: argparse.Namespace) -> dict[str, Any]:
    total = args.minutes * 60.0
    warmup = args.warmup if args.warmup is not None else min(60.0, 0.2 * total)
    if not 0 < warmup < total:
        raise ValueError("--warmup must be shorter than the run")
    log_path = Path(args.server_log or tempfile.mktemp(prefix="glance-soak-server-", suffix=".log"))
    ctx = contextlib.nullcontext((args.url, args.server_pid)) if args.url else own_gateway(args, log_path)
    with ctx as (url, pid):
        sampler = RssSampler(pid, args.rss_period) if pid else None
        with sampler or contextlib.nullcontext():
            print(f"soak: {url}, {args.minutes:g} min ({warmup:.0f} s warm-up), server pid {pid or '-'}",
                  file=sys.stderr)
            warm = phase(args, url, warmup, args.seed)
            time.sleep(args.settle)
            rss_warm = rss_bytes(pid) if pid else None
            main = phase(args, url, total - warmup, args.seed + 1)
            time.sleep(args.settle)
            rss_end = rss_bytes(pid) if pid else None
    records = main.records
    write_outputs(args, main)
    errors = summarize(warm.records)["errors"]
    for k, v in main.summary["errors"].items():
        errors[k] = errors.get(k, 0) + v
    growth = (rss_end - rss_warm) / rss_warm if rss_warm else None
    rss_ok = growth is None or abs(growth) <= args.rss_tolerance
    samples = sampler.samples if sampler else []
    report = {
        "url": url, "minutes": args.minutes, "warmup_s": warmup,
        "requests": len(warm.records) + len(records),
        "failed": warm.summary["failed"] + main.summary["failed"],
        "errors": errors,
        "measured_phase": {k: main.summary[k] for k in ("requests", "completed", "failed", "request_throughput",
                                                         "output_token_throughput", "e2e_ms", "ttft_ms", "tpot_ms")},
        "tau_mean": main.summary["speculative"]["tau"]["mean"],
        "counts_match": all(r.summary.get("consistency", {}).get("counts_match", True) for r in (warm, main)),
        "rss_mb_after_warmup": rss_warm / 2**20 if rss_warm else None,
        "rss_mb_end": rss_end / 2**20 if rss_end else None,
        "rss_mb_max": max(s[1] for s in samples) / 2**20 if samples else None,
        "rss_growth": growth,
        "rss_tolerance": args.rss_tolerance,
        "rss_samples_mb": [(round(t, 1), round(b / 2**20, 1)) for t, b in samples],
        "server_log": None if args.url else str(log_path),
    }
    report["passed"] = report["failed"] == 0 and rss_ok and report["counts_match"]
    return report


def write_outputs(args: argparse.Namespace, result: RunResult) -> None:
    """--json / --csv / --plot describe the measured phase."""
    from . import report

    if args.json:
        report.write_json(result, args.json)
    if args.csv:
        report.write_csv(result.records, args.csv)
    if args.plot:
        report.write_plots(result, args.plot)


def format_report(r: dict[str, Any]) -> str:
    m = r["measured_phase"]

    def f(x, d=1):
        return "-" if x is None else f"{x:.{d}f}"

    growth = "-" if r["rss_growth"] is None else f"{100 * r['rss_growth']:+.1f}%"
    lines = [f"soak {'PASSED' if r['passed'] else 'FAILED'}: {r['minutes']:g} min against {r['url']}",
             f"  requests {r['requests']}, failed {r['failed']}" + (f" ({r['errors']})" if r["errors"] else ""),
             f"  measured phase: {f(m['request_throughput'], 2)} req/s, {f(m['output_token_throughput'])} tok/s, "
             f"E2E p50 {f(m['e2e_ms']['median'], 0)} ms p99 {f(m['e2e_ms']['p99'], 0)} ms, "
             f"TTFT p99 {f(m['ttft_ms']['p99'], 0)} ms, tau {f(r['tau_mean'], 2)}",
             f"  client/server counts match: {'yes' if r['counts_match'] else 'NO'}",
             f"  server RSS: {f(r['rss_mb_after_warmup'])} MiB after warm-up, {f(r['rss_mb_end'])} MiB at the end "
             f"({growth}; tolerance "
             f"{100 * r['rss_tolerance']:.0f}%), max {f(r['rss_mb_max'])} MiB"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m glance_loadtest.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(users=4, wait_time=(0.0, 0.5), max_tokens=32)
    g = p.add_argument_group("soak")
    g.add_argument("--minutes", type=float, required=True, help="total length of the soak (warm-up included)")
    g.add_argument("--warmup", type=float, default=None, help="warm-up seconds (default: 20%%, at most 60 s)")
    g.add_argument("--server-pid", type=int, default=None, help="with --url: the server process to watch")
    g.add_argument("--tiny", action="store_true", help="own gateway on a tiny random target + drafter")
    g.add_argument("--server-model", default=None, help="own gateway: model directory (default: bundled demo)")
    g.add_argument("--server-drafter", default=None, help="own gateway: drafter directory (default: bundled demo)")
    g.add_argument("--server-threads", type=int, default=1, help="own gateway: torch threads")
    g.add_argument("--server-max-queue", type=int, default=64)
    g.add_argument("--server-log", default=None, help="own gateway: log file")
    g.add_argument("--ready-timeout", type=float, default=300.0)
    g.add_argument("--rss-tolerance", type=float, default=0.10)
    g.add_argument("--rss-period", type=float, default=2.0, help="seconds between RSS samples")
    g.add_argument("--settle", type=float, default=2.0, help="pause before each RSS reading (s)")
    g.add_argument("--report-json", metavar="PATH", help="write the soak report as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.url == parser.get_default("url") and "--url" not in (argv if argv is not None else sys.argv[1:]):
        args.url = None  # no --url: start our own gateway
    if args.url and args.tiny:
        parser.error("--tiny starts its own gateway; drop --url")
    try:
        report = soak(args)
    except (ValueError, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"soak: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
