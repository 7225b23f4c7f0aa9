"""The device check: one short run that turns an accelerator machine, as it is, into real GPU numbers.

It runs under that machine's own ``python3`` (the lent H200's image: Python 3.12, torch, Triton, transformers,
no SGLang / FlashInfer / FastAPI / pydantic, no network) with the working tree and at most a few carried wheels
(``--wheels``, default ``.device-wheels/``: ``scripts/fetch_device_wheels.sh`` fetches them). The project is not
installed there: its folders are its import names, so the repository root on ``PYTHONPATH`` is enough.

Steps, each a subprocess with its own time limit, each reported on its own (one failing hides nothing):

1. ``env``: versions, the GPU, its memory, and the bf16 matmul and copy-bandwidth ceilings (``device_env.py``);
2. ``imports``: the import surface, imported and used once (``import_surface.py``);
3. ``kernels``: ``tests/kernels`` on CUDA: the Triton kernels against their torch references;
4. ``engine``: the embedded engine with the bundled demo pair (``device_engine.py``): lossless in fp32 on the demo
   and wild prompts, the bf16 match rate and first divergence, tau / speedup / round cost per task, tau per tree
   size;
5. ``scale-timing``: ``glance_sgl.scale_timing`` at Qwen2.5-VL-7B's text shapes in bf16: verify at 1-64 rows over
   1k and 4k contexts, the drafter at batch 1 / 8 / 32, eager and graphed; round cost in AR steps, speedup per tau
   and the best tree size per tau (from the engine step's tau curve);
6. ``ngram``: SGLang's n-gram corpus, or a line saying the n-gram source is off where SGLang is absent.

Writes ``report.json`` (every step: command, exit status, seconds, output tail, parsed results) and
``summary.txt`` to ``$OUT`` when set, else ``gpu-report/`` (or ``--out``). Without CUDA (or with ``--dry-run``) it
lists the steps, writes a report with ``"status": "skipped"`` and exits 0. Under 6 minutes on one H200.

    tests/gpu/device_check.sh [--out DIR] [--wheels DIR] [--steps env,engine,...] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 340  # under 6 minutes with the start-up, so that a rerun fits a 15-minute lease
CARRY_LIMIT_BYTES = 64 * 2**20  # the device tool carries at most 64 MiB: working tree + wheels
# what scripts/fetch_device_wheels.sh fetches by default (bytes): SGLang 0.5.23's transformers pin
DEFAULT_WHEELS = {"transformers-5.19.0-py3-none-any.whl": 12_599_123}


def steps(work: Path, python: str) -> list[dict[str, Any]]:
    """The steps: name, command, time limit (s; they add up to :data:`BUDGET_S`), the JSON file the step writes
    (merged into the report), and ``optional``: exit status 3 means "off here", not a failure."""
    gpu = ROOT / "tests" / "gpu"
    return [
        dict(name="env", limit=20, json=work / "env.json",
             cmd=[python, str(gpu / "device_env.py"), "--json", str(work / "env.json")]),
        dict(name="imports", limit=30, json=work / "imports.json",
             cmd=[python, str(gpu / "import_surface.py"), "--device", "cuda", "--json", str(work / "imports.json")]),
        dict(name="kernels", limit=30, cmd=[python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels"]),
        dict(name="engine", limit=80, json=work / "engine.json",
             cmd=[python, str(gpu / "device_engine.py"), "--device", "cuda", "--json", str(work / "engine.json")]),
        dict(name="scale-timing", limit=175, json=work / "scale_timing.json",
             cmd=[python, "-m", "glance_sgl.scale_timing", "--device", "cuda", "--rows", "1,4,8,16,32,64",
                  "--context", "1024,4096", "--eager-contexts", "1024", "--batches", "1,8,32", "--repeats", "5",
                  "--tau-curve", str(work / "engine.json"), "--json", str(work / "scale_timing.json")]),
        dict(name="ngram", limit=5, optional=True, cmd=[python, str(gpu / "device_ngram.py")]),
    ]


def carried_bytes(wheels: Path | None = None) -> dict[str, Any]:
    """What the device tool would carry: the working tree (tracked files and untracked ones git does not
    ignore) plus the wheels in ``wheels``, in bytes, against the 64 MiB limit."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    tree = sum((ROOT / f).stat().st_size for f in out.split("\0") if f and (ROOT / f).is_file())
    wheel_sizes = {w.name: w.stat().st_size for w in sorted(wheels.glob("*.whl"))} if wheels and wheels.is_dir() \
        else {}
    total = tree + sum(wheel_sizes.values())
    return {"tree_bytes": tree, "wheels": wheel_sizes, "total_bytes": total, "limit_bytes": CARRY_LIMIT_BYTES,
            "fits": total <= CARRY_LIMIT_BYTES}


def install_wheels(python: str, wheels: Path | None, work: Path) -> tuple[Path | None, str]:
    """Install the carried wheels into a private folder (no index, no dependencies) and check that
    ``transformers`` still imports with them; on failure the image's own packages are used. Returns the folder
    (None: none used) and a line for the report."""
    found = sorted(wheels.glob("*.whl")) if wheels and wheels.is_dir() else []
    if not found:
        return None, "no carried wheels: the image's own packages"
    site = work / "site"
    proc = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                           str(site), *map(str, found)], capture_output=True, text=True)
    if proc.returncode != 0:
        return None, f"installing {[w.name for w in found]} failed, using the image's packages: {proc.stderr[-400:]}"
    probe = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(site)})
    if probe.returncode != 0:
        return None, (f"carried wheels {[w.name for w in found]} do not import here, using the image's packages: "
                      + probe.stderr.strip().splitlines()[-1][:300])
    return site, f"carried wheels {[w.name for w in found]}: transformers {probe.stdout.strip()}"


def cuda_available(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                           text=True, cwd=ROOT)
    return probe.stdout.strip().endswith("True")


def run_step(step: dict[str, Any], env: dict[str, str], deadline: float) -> dict[str, Any]:
    """Run one step under its limit (and the run's deadline); its JSON, if written, is parsed into the result."""
    limit = max(5, min(step["limit"], int(deadline - time.monotonic())))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(step["cmd"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        text = "".join(raw.decode(errors="replace") if isinstance(raw, bytes) else raw
                       for raw in (exc.stdout or "", exc.stderr or "")) + f"\n[timed out after {limit} s]"
    status = "passed" if rc == 0 else "off" if rc == 3 and step.get("optional") else "failed"
    result: dict[str, Any] = {"name": step["name"], "status": status, "cmd": " ".join(step["cmd"]), "rc": rc,
                              "seconds": round(time.monotonic() - t0, 1), "limit_s": limit, "tail": text[-4000:]}
    path = step.get("json")
    if path is not None and Path(path).is_file():
        try:
            result["result"] = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            result["result_error"] = str(exc)
    return result


def _print_lines(text: str, prefix: str = "  ") -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def summarise(report: dict[str, Any]) -> list[str]:
    """The summary a person reads: each step's status and time, then the lines each step printed for people."""
    lines = [f"device check {report['status']} in {report.get('seconds', 0)} s on "
             f"{report.get('gpu') or 'no GPU'} ({report.get('wheels_note', '')}):"]
    for s in report["steps"]:
        lines.append(f"  {s['name']}: {s['status']} (rc={s.get('rc')}) in {s.get('seconds', '-')} s"
                     + (f" ({s['skipped']})" if s.get("skipped") else ""))
    for s in report["steps"]:
        if s.get("skipped"):
            continue
        if s["name"] == "kernels":
            body = [l for l in s["tail"].splitlines() if " passed" in l or " failed" in l or "error" in l.lower()][-3:]
        elif s["name"] == "scale-timing":
            body = [l for l in _print_lines(s["tail"]) if not l.startswith(("  verify ", "  drafter ", "  job "))]
        else:
            body = _print_lines(s["tail"])
        if s["status"] == "failed":
            body += ["  (last lines)"] + ["    " + l for l in s["tail"].splitlines()[-12:]]
        if body:
            lines.append(f"--- {s['name']}")
            lines += body
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu-report"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--wheels", type=Path, default=ROOT / ".device-wheels", help="carried wheels to install first")
    p.add_argument("--dry-run", action="store_true", help="list the steps, run nothing")
    p.add_argument("--steps", default=None, help="comma-separated step names to run (default: all)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="glance-device-check-"))
    plan = steps(work, args.python)
    if args.steps:
        wanted = [n.strip() for n in args.steps.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {s["name"] for s in plan})
        if unknown:
            p.error(f"--steps: unknown step(s) {unknown}; the steps are {[s['name'] for s in plan]}")
        plan = [s for s in plan if s["name"] in wanted]
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": [],
                              "carry": carried_bytes(args.wheels)}
    skip = "dry run (--dry-run)" if args.dry_run else None
    if skip is None and not cuda_available(args.python):
        skip = "no CUDA device: torch.cuda.is_available() is False"
    t_start = time.monotonic()
    if skip:
        report.update(status="skipped", reason=skip, would_run=[
            {"name": s["name"], "cmd": " ".join(s["cmd"]), "limit_s": s["limit"]} for s in plan])
        lines = [f"device check skipped: {skip}. It would run (budget {BUDGET_S} s):"] + [
            f"  {s['name']} (<= {s['limit']} s): {' '.join(s['cmd'])}" for s in plan]
        carry = report["carry"]
        lines.append(f"  carried: tree {carry['tree_bytes'] / 2**20:.1f} MiB + wheels "
                     f"{sum(carry['wheels'].values()) / 2**20:.1f} MiB {list(carry['wheels'])} of 64 MiB")
    else:
        site, report["wheels_note"] = install_wheels(args.python, args.wheels, work)
        paths = ([str(site)] if site else []) + [str(ROOT)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(":"),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "GLANCE_COST_CACHE": str(work / "costs")}
        deadline = time.monotonic() + BUDGET_S
        for step in plan:
            if time.monotonic() > deadline - 5:
                report["steps"].append({"name": step["name"], "status": "skipped", "rc": None,
                                        "skipped": "time budget spent"})
                continue
            print(f"[device check] {step['name']} ...", file=sys.stderr, flush=True)
            report["steps"].append(run_step(step, env, deadline))
        env_result = next((s.get("result") for s in report["steps"] if s["name"] == "env"), None) or {}
        report["gpu"] = env_result.get("gpu")
        report["status"] = "passed" if all(s["status"] in ("passed", "off") for s in report["steps"]) else "failed"
        report["seconds"] = round(time.monotonic() - t_start, 1)
        lines = summarise(report)
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"report: {args.out / 'report.json'}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if report["status"] in ("passed", "skipped") else 1


if __name__ == "__main__":
    raise SystemExit(main())
