"""Before/after on this machine in one process: this checkout's engine against an earlier commit's engine.

    .venv/bin/python scripts/compare_commit.py --commit 2c6fa6d [--limit 40] [--max-tokens 96] [--json out.json]
        [--tasks wild,text] [--mix | --bursts N] [--compile-drafter] [--temperature 0.7]

The earlier commit's ``glance_sgl`` is exported with ``git archive`` into a temporary folder and imported under
another name (``glance_base``), so both engines load the same bundled checkpoints side by side. For every task
and prompt the methods run back to back in an order that rotates from prompt to prompt: this checkout's AR path,
GLANCE (planner auto), GLANCE (fixed tree), the width-1 chain, GLANCE with the drafter and n-gram matches merged
(``merged``), and the earlier commit's AR path, GLANCE and width-1 chain (and its merged sources, ``base_merged``,
where it has them).
Each GLANCE speedup is over its own engine's AR path, and so is each lossless check ("lossless": this checkout's
GLANCE runs against its AR path; "(base)": the earlier commit's GLANCE against its AR path). The earlier commit's AR
path may answer some prompts differently from this one's (its prompt preparation), which is reported as
``base_ar_matches_ar``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import json
import math
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_commit(commit: str, name: str = "glance_base"):
    """``glance_sgl`` as of ``commit``, importable as ``name`` (absolute self-imports rewritten)."""
    from glance_sgl.sglang.runner import export_package

    tmp = export_package(commit, Path(tempfile.mkdtemp(prefix="glance-base-")))
    (tmp / "glance_sgl").rename(tmp / name)
    for py in (tmp / name).rglob("*.py"):
        py.write_text(py.read_text().replace("glance_sgl.", f"{name}.").replace("from glance_sgl ", f"from {name} "))
    sys.path.insert(0, str(tmp))
    return importlib.import_module(f"{name}.engine"), tmp / name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", required=True)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tasks", default="caption,text,chart,document,open,wild")
    order = ap.add_mutually_exclusive_group()
    order.add_argument("--mix", action="store_true",
                       help="the tasks' prompts interleaved one by one (mixed traffic) instead of task after task")
    order.add_argument("--bursts", type=int, default=0, metavar="N",
                       help="the tasks' prompts in bursts of N, task by task in turn (traffic that switches: "
                            "`--tasks wild,text --bursts 10`); --mix is bursts of 1")
    ap.add_argument("--json")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature, the i-th prompt seeded i in both engines (default: greedy)")
    ap.add_argument("--cpu-clock", action="store_true",
                    help="one torch thread, and every timing in CPU time of this process instead of wall time: "
                         "what each method costs, unaffected by other processes on a busy shared machine")
    ap.add_argument("--compile-drafter", action="store_true",
                    help="this checkout's drafter pass through torch.compile, as `glance serve` runs it on a CPU "
                         "(the earlier commit's engine keeps its own drafter, eager)")
    args = ap.parse_args(argv)
    if args.bursts < 0:
        ap.error(f"--bursts must be 0 (task after task) or more, got {args.bursts}")

    import time

    import torch

    if args.cpu_clock:
        torch.set_num_threads(1)
        time.perf_counter = time.process_time  # the engines, the planner and the bench all read this clock
    from tqdm import tqdm

    from glance_sgl.demo.bench import bench_examples
    from glance_sgl.engine import GlanceEngine, SamplingParams
    from glance_sgl.demo.paths import bundled_drafter, bundled_target

    base_engine_mod, base_dir = import_commit(args.commit)
    new = GlanceEngine.load(bundled_target(), bundled_drafter(), compile_drafter=args.compile_drafter)
    merged = GlanceEngine(new.target, new.drafter, budget=new.budget, branch_k=new.branch_k, mode="glance",
                          max_nodes=new.max_nodes, draft_sources=("drafter", "ngram"))
    old = base_engine_mod.GlanceEngine.load(base_dir / "demo/assets/target", base_dir / "demo/assets/drafter")
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    params, old_params = SamplingParams(**sampling), base_engine_mod.SamplingParams(**sampling)
    runs = {
        "ar": lambda m: new.generate(m, params, mode="ar"),
        "auto": lambda m: new.generate(m, params, planner="auto"),
        "fixed": lambda m: new.generate(m, params, planner="fixed"),
        "chain": lambda m: new.generate(m, params, mode="chain"),
        "merged": lambda m: merged.generate(m, params, planner="auto"),
        "base_ar": lambda m: old.generate(m, old_params, mode="ar"),
        "base_glance": lambda m: old.generate(m, old_params, mode="glance"),
        "base_chain": lambda m: old.generate(m, old_params, mode="chain"),
    }
    if "draft_sources" in inspect.signature(base_engine_mod.GlanceEngine.__init__).parameters:
        old_merged = base_engine_mod.GlanceEngine(old.target, old.drafter, budget=old.budget, branch_k=old.branch_k,
                                                  mode="glance", max_nodes=old.max_nodes,
                                                  draft_sources=("drafter", "ngram"))
        runs["base_merged"] = lambda m: old_merged.generate(m, old_params, planner="auto")
    names = list(runs)
    warm = bench_examples("caption", 1)[0].messages()
    for fn in runs.values():
        fn(warm)
    tasks = args.tasks.split(",")
    per_task = [[(t, ex) for ex in bench_examples(t, args.limit)] for t in tasks]
    size = 1 if args.mix else args.bursts
    if size:  # each task's prompts in chunks of ``size``, the tasks' chunks in turn
        chunks = [[jobs[i:i + size] for i in range(0, len(jobs), size)] for jobs in per_task]
        jobs = [job for group in itertools.zip_longest(*chunks, fillvalue=[]) for chunk in group for job in chunk]
    else:
        jobs = [job for group in per_task for job in group]
    tot = {t: {n: [0.0, 0, 0] for n in names} for t in tasks}  # decode ms, decode tokens, rounds
    same = {t: {n: 0 for n in names} for t in tasks}
    same_base = {t: 0 for t in tasks}
    count = {t: 0 for t in tasks}
    with torch.no_grad():
        for i, (task, ex) in enumerate(tqdm(jobs, desc="compare", dynamic_ncols=True)):
            messages = ex.messages()
            if args.temperature:  # both engines' methods draw with this prompt's seed
                params.seed = old_params.seed = i
            order = names[i % len(names):] + names[: i % len(names)]
            out = {n: runs[n](messages) for n in order}
            count[task] += 1
            for n, r in out.items():
                m = r.metrics
                tot[task][n][0] += m.decode_ms
                tot[task][n][1] += m.decode_tokens
                tot[task][n][2] += m.rounds
                same[task][n] += int(r.token_ids == out["ar"].token_ids)
            same_base[task] += int(out["base_glance"].token_ids == out["base_ar"].token_ids)
    report: dict = {"commit": args.commit, "limit": args.limit, "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "clock": "process CPU time, 1 thread" if args.cpu_clock else "wall",
                    "drafter_compiled": args.compile_drafter, "tasks": {}}
    shown = ("auto", "fixed", "chain", "merged", "base_glance", "base_chain") + tuple(
        n for n in ("base_merged",) if n in runs)
    print(f"{'task':>9} | {'AR ms/tok':>9} | " + " | ".join(f"{n + ' x':>13} {'tau':>5} {'rc':>5}" for n in shown)
          + " | lossless (base)")
    for task in tasks:
        t = tot[task]

        def mspt(n: str) -> float:
            return t[n][0] / max(t[n][1], 1)

        row = {}
        for n in shown:
            ar = "base_ar" if n.startswith("base_") else "ar"
            row[n] = {"speedup": mspt(ar) / mspt(n), "tau": t[n][1] / max(t[n][2], 1),
                      "round_cost_ar_steps": (t[n][0] / max(t[n][2], 1)) / mspt(ar)}
        row["ar_ms_per_token"] = mspt("ar")
        # this checkout's GLANCE runs against its AR path, the earlier commit's GLANCE against its own AR path
        # (an earlier commit may prepare some prompts differently, e.g. chat templates: that is not a GLANCE loss)
        row["lossless"] = min(same[task][n] for n in ("auto", "fixed", "chain", "merged")) / count[task]
        row["base_lossless"] = same_base[task] / count[task]
        row["base_ar_matches_ar"] = same[task]["base_ar"] / count[task]
        report["tasks"][task] = row
        print(f"{task:>9} | {row['ar_ms_per_token']:9.2f} | " + " | ".join(
            f"{row[n]['speedup']:13.2f} {row[n]['tau']:5.2f} {row[n]['round_cost_ar_steps']:5.2f}" for n in shown)
            + f" | {row['lossless']:.2f} ({row['base_lossless']:.2f})")
    demo = [t for t in tasks if t != "wild"]
    for n in shown:
        vals = [report["tasks"][t][n]["speedup"] for t in demo]
        report[f"geomean_{n}"] = math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None
    if report.get("geomean_base_glance"):
        print(f"geomean over {', '.join(demo)}: auto {report['geomean_auto']:.2f}x, fixed "
              f"{report['geomean_fixed']:.2f}x, chain {report['geomean_chain']:.2f}x, merged "
              f"{report['geomean_merged']:.2f}x; {args.commit}: GLANCE "
              f"{report['geomean_base_glance']:.2f}x, chain {report['geomean_base_chain']:.2f}x "
              f"(auto / base = {report['geomean_auto'] / report['geomean_base_glance']:.2f})"
              + (f"; merged / base merged = {report['geomean_merged'] / report['geomean_base_merged']:.2f}"
                 if report.get("geomean_base_merged") else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
