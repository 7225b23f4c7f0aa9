"""`glance demo build` and `glance bench`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_demo_build(args: argparse.Namespace) -> int:
    from .build import DemoRecipe, build_demo, quick_recipe
    from .target_training import TargetRecipe

    recipe = quick_recipe(args.target_arch) if args.quick else DemoRecipe(target=TargetRecipe(arch=args.target_arch))
    report = build_demo(args.work, recipe, install=not args.no_install)
    print(json.dumps({k: v for k, v in report.items() if k != "recipe"}, indent=2))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from ..cli import CLIError, default_checkpoints
    from ..engine import GlanceEngine
    from .bench import (BENCH_TASKS, PLANNERS, format_sweep, format_table, parse_sweep, run_bench, run_sweep,
                        save_json, write_plots)
    from .tasks import TASKS

    demo_model, demo_drafter = default_checkpoints()
    model = Path(args.model) if args.model else demo_model
    drafter = Path(args.drafter) if args.drafter else demo_drafter
    if model is None or drafter is None:
        raise CLIError("no bundled demo checkpoints (run `glance demo build`) and no --model/--drafter given")
    tasks = tuple(dict.fromkeys(args.task)) if args.task else (TASKS if args.sweep else BENCH_TASKS)
    bad = [t for t in tasks if t not in BENCH_TASKS]
    if bad:
        raise CLIError(f"unknown task(s) {bad}; tasks: {', '.join(BENCH_TASKS)}")
    planners = (args.planner,) if args.planner else PLANNERS
    if args.limit < 1:
        raise CLIError("--limit must be >= 1")
    if not 0.0 <= args.temperature <= 2.0:
        raise CLIError(f"--temperature must be in [0, 2], got {args.temperature}")
    sweep = None
    if args.sweep:
        try:
            sweep = parse_sweep(args.sweep)
        except ValueError as exc:
            raise CLIError(f"--sweep: {exc}") from None
    torch.manual_seed(0)
    engine = GlanceEngine.load(model, drafter, budget=args.budget, branch_k=args.branch_k,
                               compile_drafter=args.compile_drafter == "on")
    engine.freeze_gc()  # as a served engine (glance serve): no full collection walks the start-up objects mid-run
    if sweep:
        result = run_sweep(engine, sweep, limit=args.limit, max_tokens=args.max_tokens, tasks=tasks,
                           planners=planners, temperature=args.temperature)
        print(format_sweep(result))
        if args.json:
            save_json(result, args.json)
            print(f"wrote {args.json}")
        return 0
    report = run_bench(engine, limit=args.limit, max_tokens=args.max_tokens, tasks=tasks,
                       peers=not args.no_peers, planners=planners, temperature=args.temperature)
    print(format_table(report))
    if args.json:
        save_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        for p in write_plots(report, args.plot):
            print(f"wrote {p}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..cli import int_in

    demo = sub.add_parser("demo", help="the bundled demo VLM and drafter")
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    build = demo_sub.add_parser("build", help="rebuild the demo VLM and its drafter from scratch (fixed seeds)")
    build.add_argument("--work", default="runs/demo", help="working directory (stages resume from it)")
    build.add_argument("--quick", action="store_true", help="a minutes-long smoke build (poor answers)")
    build.add_argument("--no-install", action="store_true", help="do not copy the result into the package")
    build.add_argument("--target-arch", choices=["qwen2_5_vl", "qwen2_vl", "qwen3_vl"], default="qwen2_5_vl",
                       help="the demo VLM's architecture (the bundled demo: qwen2_5_vl)")
    build.set_defaults(func=cmd_demo_build)

    bench = sub.add_parser("bench", help="AR vs GLANCE (auto and fixed planner), the chain and peers, per task")
    bench.add_argument("--limit", type=int, default=10, help="prompts per task")
    bench.add_argument("--task", action="append",
                       help="only this task (repeatable): caption, text, chart, document, open, wild (default: all "
                       "six; --sweep: the five demo tasks)")
    bench.add_argument("--planner", choices=["auto", "fixed"], default=None,
                       help="run only this GLANCE planner (default: both, auto and the fixed tree)")
    bench.add_argument("--max-tokens", type=int_in(1), default=96)
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="sample at this temperature (prompt i seeded i, every method alike: each must give "
                            "AR's tokens); default 0, greedy. The HF peers run greedy only (skipped at T > 0)")
    bench.add_argument("--budget", type=int_in(1), default=None, help="tree budget (default: the drafter's)")
    bench.add_argument("--branch-k", type=int_in(1), default=None)
    bench.add_argument("--model", help="target directory (default: bundled demo)")
    bench.add_argument("--drafter", help="drafter directory (default: bundled demo)")
    bench.add_argument("--no-peers", action="store_true", help="skip the Hugging Face generate peers")
    bench.add_argument("--compile-drafter", choices=["on", "off"], default="on",
                       help="on a CPU, the drafter's block pass through torch.compile, as glance serve runs it "
                            "(default: on)")
    bench.add_argument("--sweep", metavar="BxK,...",
                       help="compare tree budgets x branch_k (e.g. 15x2,15x4,31x4) against the chain; no HF peers")
    bench.add_argument("--json", help="write the report as JSON")
    bench.add_argument("--plot", help="directory for PNG plots")
    bench.set_defaults(func=cmd_bench)
