"""Reports of a run: the final table (in the layout of ``sglang.bench_serving``), JSON, CSV and PNG plots."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from .runner import RunResult
from .stats import RequestRecord

WIDTH = 60


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _row(label: str, value: Any, digits: int = 2) -> str:
    return f"{label:<42}{_fmt(value, digits):>{WIDTH - 42}}"


def _title(text: str, fill: str = "-") -> str:
    return f"{text:{fill}^{WIDTH}}"


def table(result: RunResult) -> str:
    s, cfg, meta = result.summary, result.config, result.meta
    lines = [_title(" GLANCE load test result ", "=")]
    shape = (f"open loop, {cfg['request_rate']} req/s" if meta["open_loop"] else
             f"closed loop, {cfg['users']} users")
    lines += [_row("Target:", meta["target"]), _row("Model:", meta["model"]), _row("Load:", shape),
              _row("Max concurrency:", cfg["max_concurrency"]), _row("Dataset:", meta["dataset"]["name"]),
              _row("Stopped by:", meta["stop_reason"])]
    lines += [_row("Requests sent:", s["requests"]), _row("Successful requests:", s["completed"]),
              _row("Failed requests:", s["failed"]), _row("Streaming requests:", s["streaming"]),
              _row("Benchmark duration (s):", s["duration_s"]),
              _row("Total input tokens:", s["total_input_tokens"]),
              _row("Total generated tokens:", s["total_output_tokens"]),
              _row("Request throughput (req/s):", s["request_throughput"]),
              _row("Input token throughput (tok/s):", s["input_token_throughput"]),
              _row("Output token throughput (tok/s):", s["output_token_throughput"]),
              _row("Total token throughput (tok/s):", s["total_token_throughput"]),
              _row("Concurrency (mean in flight):", s["concurrency"])]
    gp = s["goodput"]
    if gp["slos_ms"]:
        slos = " ".join(f"{k}:{v:g}" for k, v in gp["slos_ms"].items())
        lines += [_row("Goodput SLOs (ms):", slos), _row("Request goodput (req/s):", gp["request_goodput"]),
                  _row("Requests within SLOs (%):", 100 * gp["fraction"] if gp["fraction"] is not None else None)]
    for key, name in (("e2e_ms", "End-to-End Latency"), ("ttft_ms", "Time to First Token"),
                      ("tpot_ms", "Time per Output Token (excl. 1st token)"), ("itl_ms", "Inter-token Latency")):
        d = s[key]
        short = {"e2e_ms": "E2E Latency", "ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL"}[key]
        lines.append(_title(name))
        lines += [_row(f"Mean {short} (ms):", d["mean"]), _row(f"Median {short} (ms):", d["median"]),
                  _row(f"P90 {short} (ms):", d["p90"]), _row(f"P99 {short} (ms):", d["p99"])]
    lines.append(_title("Other"))
    lines += [_row("Tokens per stream chunk (mean):", s["tokens_per_chunk"]),
              _row("Server queue time mean / P99 (ms):", _pair(s["queue_ms"]["mean"], s["queue_ms"]["p99"]))]
    sp = s["speculative"]
    lines.append(_title("Speculative decoding (from responses)"))
    lines += [_row("Decoding modes:", " ".join(f"{k}={v}" for k, v in sp["modes"].items()) or None),
              _row("Tau, pooled over rounds (incl. bonus):", sp["tau_pooled"]),
              _row("Tau per request mean / median:", _pair(sp["tau"]["mean"], sp["tau"]["median"])),
              _row("Tau per request min / P90 / P99:",
                   f"{_fmt(sp['tau']['min'])} / {_fmt(sp['tau']['p90'])} / {_fmt(sp['tau']['p99'])}"),
              _row("Tau - 1 (accepted drafts/round) mean:", sp["tau_minus_1"]["mean"]),
              _row("Acceptance rate mean:", sp["acceptance_rate"]["mean"], 3),
              _row("Planners:", " ".join(f"{k}={v}" for k, v in sp["planners"].items()) or None),
              _row("Rows verified per round (pooled):", sp["mean_rows_per_round"]),
              _row("Rounds without drafting (%):", 100 * sp["rounds_without_drafting_fraction"]
                   if sp["rounds_without_drafting_fraction"] is not None else None),
              _row("Predicted / committed tokens per round:",
                   _pair(sp["predicted_tokens_per_round"], sp["committed_tokens_per_planned_round"])),
              _row("Estimated speedup mean / median:",
                   _pair(sp["estimated_speedup"]["mean"], sp["estimated_speedup"]["median"])),
              _row("Estimated speedup P90 / P99:",
                   _pair(sp["estimated_speedup"]["p90"], sp["estimated_speedup"]["p99"]))]
    if sp["measured_speedup"]["count"]:
        lm = sp["lossless_match"]
        lines += [_row("Measured decode speedup mean / median:",
                       _pair(sp["measured_speedup"]["mean"], sp["measured_speedup"]["median"])),
                  _row("Measured speedup requests / lossless:", f"{lm['checked']} / {lm['matched']}")]
    if s["errors"]:
        lines.append(_title("Errors"))
        lines += [_row(f"{k}:", v) for k, v in s["errors"].items()]
    lines.append(_title("By task"))
    lines.append(f"{'task':<14}{'sent':>7}{'ok':>7}{'fail':>6}{'E2E mean':>10}{'E2E p99':>9}{'tau':>7}")
    for name, t in s["by_task"].items():
        lines.append(f"{name:<14}{t['requests']:>7}{t['ok']:>7}{t['failed']:>6}{_fmt(t['e2e_ms_mean'], 0):>10}"
                     f"{_fmt(t['e2e_ms_p99'], 0):>9}{_fmt(t['tau_mean']):>7}")
    if result.server is not None:
        c = s.get("consistency", {})
        lines.append(_title("Server /metrics during the run"))
        lines += [_row("Requests by status (server):", _statuses(c.get("server_by_status", {}))),
                  _row("Requests by status (client):", _statuses(c.get("client_by_status", {}))),
                  _row("Counts match:", "yes" if c.get("counts_match") else "NO"),
                  _row("Completion tokens server / client:",
                       f"{result.server['completion_tokens']} / {c.get('client_completion_tokens')}"),
                  _row("Server tau mean (histogram):", result.server["tau_mean"]),
                  _row("Server rows per round / no-draft rounds:",
                       f"{_fmt(result.server['mean_rows_per_round'])} / {result.server['rounds_without_drafting']}"
                       f" of {result.server['rounds']}"),
                  _row("Engine errors (server):", result.server["engine_errors"])]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _pair(a: Any, b: Any) -> str:
    return f"{_fmt(a)} / {_fmt(b)}"


def _statuses(d: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in d.items()) or "-"


def write_json(result: RunResult, path: str | Path, with_records: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(with_records), indent=2, default=_json_default) + "\n")
    return path


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return str(x)


def write_csv(records: list[RequestRecord], path: str | Path) -> Path:
    """One row per request (``itl_ms`` as space-separated values)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RequestRecord.columns())
        writer.writeheader()
        for r in records:
            writer.writerow(r.as_row())
    return path


def write_plots(result: RunResult, out_dir: str | Path) -> list[Path]:
    """``latency_cdf.png`` (TTFT, TPOT, ITL, E2E), ``throughput.png`` (over time), ``tau_hist.png``
    (tau and estimated speedup per request)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in result.records if r.ok]
    stream = [r for r in ok if r.stream]
    series = {"TTFT": [r.ttft_ms for r in stream if r.ttft_ms is not None],
              "TPOT": [r.tpot_ms for r in stream if r.tpot_ms is not None],
              "ITL": [x for r in stream for x in r.itl_ms], "E2E": [r.e2e_ms for r in ok if r.e2e_ms is not None]}
    paths = []

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, vals) in zip(axes.flat, series.items()):
        if vals:
            xs = np.sort(np.asarray(vals))
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
            for p, style in ((50, ":"), (99, "--")):
                ax.axvline(np.percentile(xs, p), color="grey", linestyle=style, label=f"p{p} {np.percentile(xs, p):.0f} ms")
            ax.legend(fontsize=8, loc="lower right")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name} CDF (n={len(vals)})")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle("Latency CDFs")
    fig.tight_layout()
    paths.append(out / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    tl = result.timeline
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ax1.plot(tl["t"], tl["output_tokens_per_s"], color="tab:blue", marker=".")
    ax1.set_ylabel("output tokens / s")
    ax1.set_ylim(bottom=0)
    ax1.set_title("Throughput over time (1 s bins, by finish time)")
    ax2.plot(tl["t"], tl["requests_per_s"], label="completed requests / s", color="tab:green", marker=".")
    if any(tl["errors_per_s"]):
        ax2.plot(tl["t"], tl["errors_per_s"], label="failed requests / s", color="tab:red", marker=".")
    spans = [(r.start_s, r.end_s) for r in result.records if not math.isnan(r.end_s)]
    in_flight = [sum(a <= t < b for a, b in spans) for t in tl["t"]]
    ax2.step(tl["t"], in_flight, where="mid", label="in flight (at bin centre)", color="tab:grey")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("time since start (s)")
    ax2.legend(loc="upper left", fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    taus = [r.tau for r in ok if r.tau is not None]
    speedups = [r.estimated_speedup for r in ok if r.estimated_speedup is not None]
    for ax, vals, name in ((a, taus, "tau (tokens per round, incl. bonus)"),
                           (b, speedups, "estimated decode speedup")):
        if vals:
            ax.hist(vals, bins=min(30, max(5, len(vals) // 3)), color="tab:purple", alpha=0.8)
            ax.axvline(float(np.mean(vals)), color="black", linestyle="--", label=f"mean {np.mean(vals):.2f}")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name} (n={len(vals)})")
        ax.set_ylabel("requests")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "tau_hist.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
