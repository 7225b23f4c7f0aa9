"""The GPU check: one short run on a GPU machine that says whether GLANCE works there and how fast, with what a
serving engineer checks first.

Lines (steps), each with its own time limit and each reported on its own (one failing or running out of time hides
none of the others); the whole run stays under 8 minutes:

1. ``env``: GPU, driver, torch / SGLang / FlashInfer / Triton versions;
2. ``gpu-tests``: the Triton kernels against their torch references (``tests/kernels``), GLANCE vs no
   speculation token for token through SGLang (FlashInfer's custom-mask attention) with CUDA graphs on and off and
   the radix cache on, fp32, and the bf16 match rate with its first divergence (``tests/sglang/test_gpu.py``);
3. ``bench``: ``python -m glance_sgl.sglang.bench --device cuda --overlap on`` on the demo pair: no speculation,
   SGLang's NGRAM, SGLang's DFLASH loading the bundled drafter unchanged, and GLANCE, at 1, 8 and 32 requests in
   flight, every speculative engine under SGLang's overlap scheduler (GLANCE fails this line clearly while its
   server refuses overlap or runs without it; the other methods' numbers stand);
4. ``overlap-off``: GLANCE again with the overlap scheduler off (``--overlap off``): against ``bench``'s GLANCE,
   overlap on vs off;
5. ``never-hurts``: GLANCE with drafting forced off (``GLANCE_PLANNER=off``: every step an AR step through the
   speculative worker) against no speculation, the engines' default scheduling: the cost GLANCE adds where it does
   not draft;
6. ``host-reads``: GLANCE and GLANCE-off with the worker counting its device-to-host reads per decode step
   (``GLANCE_SGL_COUNT_HOST_READS=1``, parsed from the engine logs): max / mean per step by batch size and step kind;
7. ``scale-timing``: a random-weight target with Qwen2.5-VL-7B's text shapes and a drafter sized for it, built on
   the device: verify pass at 1 / 8 / 16 / 32 rows and drafter pass at batch 1 / 8 / 32, with and without CUDA
   graphs, and the speedup each tau would give (``python -m glance_sgl.scale_timing``).

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
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_check  # noqa: E402  (tests/gpu/device_check.py: the shared step runner)

BUDGET_S = 470  # under 8 minutes in all (the steps' limits add up to this)
BENCH_STEPS = ("bench", "overlap-off", "never-hurts", "host-reads")


def steps(out: Path, python: str) -> list[dict]:
    """The steps: name, command, time limit (s), and the JSON file each writes (parsed into its result)."""
    env_probe = ("import torch, importlib.metadata as m; "
                 "print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None); "
                 "print('torch', torch.__version__, 'cuda', torch.version.cuda); "
                 "[print(p, m.version(p)) for p in ('sglang', 'flashinfer-python', 'triton', 'transformers') "
                 "if __import__('importlib.util').util.find_spec(p.replace('-python', '').replace('-', '_'))]")

    def bench(name: str, limit: int, methods: str, *extra: str, prompts: int = 32, concurrency: str = "1,8,32",
              max_tokens: int = 48) -> dict:
        json_path = out / f"{name.replace('-', '_')}.json"
        return dict(name=name, limit=limit, json=json_path, cmd=[
            python, "-m", "glance_sgl.sglang.bench", "--device", "cuda", "--methods", methods, "--prompts",
            str(prompts), "--max-tokens", str(max_tokens), "--concurrency", concurrency, "--wild", "0", *extra,
            "--json", str(json_path), "--log-dir", str(out / f"{name}-logs")])

    return [
        dict(name="env", limit=20, cmd=[python, "-c", env_probe]),
        dict(name="gpu-tests", limit=145, json=out / "gpu_tests.json",
             cmd=[python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=135", "tests/kernels",
                  "tests/sglang/test_gpu.py"],
             env={"GLANCE_GPU_REPORT": str(out / "gpu_tests.json")}),
        bench("bench", 120, "none,ngram,dflash,glance", "--overlap", "on"),
        bench("overlap-off", 40, "glance", "--overlap", "off"),
        bench("never-hurts", 55, "none,glance-off"),
        bench("host-reads", 45, "glance,glance-off", "--count-host-reads", prompts=16, concurrency="1,4,8",
              max_tokens=32),
        dict(name="scale-timing", limit=45, json=out / "scale_timing.json",
             cmd=[python, "-m", "glance_sgl.scale_timing", "--device", "cuda", "--rows", "1,8,16,32", "--context",
                  "1024", "--repeats", "4", "--json", str(out / "scale_timing.json")]),
    ]


def cuda_available(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                           text=True, cwd=ROOT)
    return probe.stdout.strip().endswith("True")


def run_step(step: dict, deadline: float) -> dict:
    """One step under its limit: the device check's runner (same report fields), offline, with the step's env."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **step.get("env", {})}
    return device_check.run_step(step, env, deadline)


def _methods(result: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {m["method"]: m for m in (result or {}).get("methods", [])}


def _tps(row: dict[str, Any] | None, scenario: str) -> float | None:
    s = (row or {}).get("scenarios", {}).get(scenario) if row and not row.get("error") else None
    return s["tokens_per_s"] if s and s.get("tokens_per_s") else None


def bench_lines(results: dict[str, dict[str, Any] | None]) -> list[str]:
    """What a person reads of the bench steps, from their JSON (``results``: step name -> its bench report, None
    if the step wrote none): per scenario each method's output tok/s against no speculation, tau and token
    identity; GLANCE overlap on vs off; GLANCE-off vs none; host reads per step; every method that failed."""
    lines: list[str] = []
    for name in BENCH_STEPS:
        res = results.get(name)
        if res is None:
            lines.append(f"--- {name}: no results (see the step's last lines)")
            continue
        rows = _methods(res)
        lines.append(f"--- {name} (overlap {res.get('overlap') or 'engine default'})")
        if name in ("bench", "never-hurts"):
            scen = list(dict.fromkeys(s for r in rows.values() for s in r.get("scenarios", {})))
            for sc in scen:
                base = _tps(rows.get("none"), sc)
                cells = []
                for m, r in rows.items():
                    s = r.get("scenarios", {}).get(sc)
                    if not s:
                        continue
                    same = "/".join(map(str, s["identical"])) if s.get("identical") else "-"
                    rel = f" = {s['tokens_per_s'] / base:.2f}x none" if base and m != "none" else ""
                    flag = " [failed, see below]" if r.get("error") else ""
                    cells.append(f"{m} {s['tokens_per_s']:.0f} tok/s{rel} (tau {s['tau']:.2f}, same {same}){flag}")
                lines.append(f"  {sc}: " + "; ".join(cells))
        if name == "overlap-off":  # this step: GLANCE with overlap off; the bench step's GLANCE: with it on
            off, on = rows.get("glance"), _methods(results.get("bench")).get("glance")
            for sc in (off or {}).get("scenarios", {}):
                b, a = _tps(off, sc), _tps(on, sc)
                line = f"  {sc}: GLANCE overlap off {b:.0f} tok/s" if b else f"  {sc}: GLANCE overlap off -"
                if a and b:
                    line += f", on {a:.0f} tok/s (bench): on/off {a / b:.2f}x"
                elif on is not None and on.get("error"):
                    line += "; overlap on failed (bench)"
                lines.append(line)
        if name == "host-reads":
            for m, r in rows.items():
                h = r.get("host_reads")
                if h:
                    lines.append(f"  {m}: max {h['max']}, mean {h['mean']:.2f} per step over {h['steps']} steps; "
                                 + ", ".join(f"{k} max {v['max']} mean {v['mean']:.2f}"
                                             for k, v in (h.get("by_kind") or h.get("by_shape") or {}).items()))
                elif m.startswith("glance") and not r.get("error"):
                    lines.append(f"  {m}: no host-read lines in its log")
        for m, r in rows.items():
            if r.get("error"):
                lines.append(f"  {m}: FAILED: {r['error']}")
        for p in res.get("dflash_preflight") or []:
            lines.append(f"  dflash preflight: {p}")
    return lines


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
        lines = [f"GPU check skipped: {skip}. It would run (budget {BUDGET_S} s):"] + [
            f"  {s['name']} (<= {s['limit']} s): {' '.join(s['cmd'])}" for s in plan]
    else:
        deadline = time.monotonic() + BUDGET_S
        for step in plan:
            if time.monotonic() > deadline - 5:
                report["steps"].append({"name": step["name"], "status": "skipped", "rc": None,
                                        "skipped": "time budget spent"})
                continue
            print(f"[gpu] {step['name']} ...", file=sys.stderr, flush=True)
            report["steps"].append(run_step(step, deadline))
        ok = all(s.get("rc") == 0 for s in report["steps"])
        report["status"] = "passed" if ok else "failed"
        lines = [f"GPU check {report['status']}:"] + [
            f"  {s['name']}: rc={s.get('rc')} in {s.get('seconds', '-')} s" + (f" ({s['skipped']})" if
                                                                               s.get("skipped") else "")
            for s in report["steps"]]
        by_name = {s["name"]: s for s in report["steps"]}
        lines += bench_lines({n: by_name.get(n, {}).get("result") for n in BENCH_STEPS})
        for s in report["steps"]:
            if s.get("rc") not in (0, None):
                lines.append(f"--- {s['name']} (last lines)\n" + "\n".join(s["tail"].splitlines()[-15:]))
        timing = by_name.get("scale-timing")
        if timing and timing.get("tail"):
            lines.append("--- scale timing\n" + "\n".join(l for l in timing["tail"].splitlines() if l.startswith("  ")))
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"report: {args.out / 'report.json'}", file=sys.stderr)
    return 0 if report["status"] in ("passed", "skipped") else 1


if __name__ == "__main__":
    raise SystemExit(main())
