"""The GPU check: one short run on a GPU machine that says whether GLANCE works there and how fast.

Steps (each with its own time limit; the whole run stays under 8 minutes):

1. ``env``: GPU, driver, torch / SGLang / FlashInfer / Triton versions;
2. ``gpu-tests``: the Triton kernels against their torch references (``tests/kernels``), GLANCE vs no
   speculation token for token through SGLang (FlashInfer's custom-mask attention) with CUDA graphs on and off and
   the radix cache on, fp32, and the bf16 match rate with its first divergence (``tests/sglang/test_gpu.py``);
3. ``scale-timing``: a random-weight target with Qwen2.5-VL-7B's text shapes and a drafter sized for it, built on
   the device: verify pass at 1 / 8 / 16 / 32 rows and drafter pass at batch 1 / 8 / 32, with and without CUDA
   graphs, and the speedup each tau would give (``python -m glance_sgl.scale_timing``);
4. ``bench``: ``python -m glance_sgl.sglang.bench --device cuda`` on the demo pair (none, NGRAM, GLANCE) at 1 and 8
   requests in flight.

Writes ``report.json`` (every step's command, exit status, seconds, output tail, and its parsed results) and
``summary.txt`` to the output folder. Without CUDA it writes a report with ``"status": "skipped"``, prints what it
would run and exits 0.

    tests/gpu/run.sh [OUT_DIR]        # default: $OUT if set, else gpu-report/
    python tests/gpu/run.py --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_check  # noqa: E402  (tests/gpu/device_check.py: the shared step runner)

BUDGET_S = 470  # under 8 minutes in all


def steps(out: Path, python: str) -> list[dict]:
    """The steps: name, command, time limit (s)."""
    env_probe = ("import torch, importlib.metadata as m; "
                 "print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None); "
                 "print('torch', torch.__version__, 'cuda', torch.version.cuda); "
                 "[print(p, m.version(p)) for p in ('sglang', 'flashinfer-python', 'triton', 'transformers') "
                 "if __import__('importlib.util').util.find_spec(p.replace('-python', '').replace('-', '_'))]")
    return [
        dict(name="env", limit=30, cmd=[python, "-c", env_probe]),
        dict(name="gpu-tests", limit=210, cmd=[python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                "--timeout=200", "tests/kernels", "tests/sglang/test_gpu.py"],
             env={"GLANCE_GPU_REPORT": str(out / "gpu_tests.json")}),
        dict(name="scale-timing", limit=110, cmd=[python, "-m", "glance_sgl.scale_timing", "--device", "cuda",
                                                   "--rows", "1,8,16,32", "--context", "1024", "--repeats", "8",
                                                   "--json", str(out / "scale_timing.json")]),
        dict(name="bench", limit=120, cmd=[python, "-m", "glance_sgl.sglang.bench", "--device", "cuda",
                                           "--methods", "none,ngram,glance", "--prompts", "16",
                                           "--concurrency", "1,8", "--wild", "0", "--json", str(out / "bench.json"),
                                           "--log-dir", str(out / "bench-logs")]),
    ]


def cuda_available(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                           text=True, cwd=ROOT)
    return probe.stdout.strip().endswith("True")


def run_step(step: dict, deadline: float) -> dict:
    """One step under its limit: the device check's runner (same report fields), offline, with the step's env."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **step.get("env", {})}
    return device_check.run_step(step, env, deadline)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GLANCE's GPU check (tests/gpu/run.sh)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu-report"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--dry-run", action="store_true", help="list the steps, run nothing")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    plan = steps(args.out, args.python)
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": []}
    skip = None
    if args.dry_run:
        skip = "dry run (--dry-run)"
    elif not cuda_available(args.python):
        skip = "no CUDA device: torch.cuda.is_available() is False"
    if skip:
        report.update(status="skipped", reason=skip, would_run=[
            {"name": s["name"], "cmd": " ".join(s["cmd"]), "limit_s": s["limit"]} for s in plan])
        lines = [f"GPU check skipped: {skip}. It would run:"] + [
            f"  {s['name']} (<= {s['limit']} s): {' '.join(s['cmd'])}" for s in plan]
    else:
        deadline = time.monotonic() + BUDGET_S
        for step in plan:
            if time.monotonic() > deadline - 5:
                report["steps"].append({"name": step["name"], "rc": None, "skipped": "time budget spent"})
                continue
            print(f"[gpu] {step['name']} ...", file=sys.stderr, flush=True)
            report["steps"].append(run_step(step, deadline))
        for name in ("gpu_tests", "scale_timing", "bench"):
            f = args.out / f"{name}.json"
            if f.is_file():
                report[name] = json.loads(f.read_text())
        ok = all(s.get("rc") == 0 for s in report["steps"])
        report["status"] = "passed" if ok else "failed"
        lines = [f"GPU check {report['status']}:"] + [
            f"  {s['name']}: rc={s.get('rc')} in {s.get('seconds', '-')} s" + (f" ({s['skipped']})" if
                                                                               s.get("skipped") else "")
            for s in report["steps"]]
        for s in report["steps"]:
            if s.get("rc") not in (0, None):
                lines.append(f"--- {s['name']} (last lines)\n" + "\n".join(s["tail"].splitlines()[-15:]))
        timing = next((s for s in report["steps"] if s["name"] == "scale-timing"), None)
        if timing:
            lines.append("--- scale timing\n" + "\n".join(l for l in timing["tail"].splitlines() if l.startswith("  ")))
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"report: {args.out / 'report.json'}", file=sys.stderr)
    return 0 if report["status"] in ("passed", "skipped") else 1


if __name__ == "__main__":
    raise SystemExit(main())
