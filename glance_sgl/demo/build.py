"""`glance demo build`: rebuild the bundled demo VLM and its GLANCE drafter from scratch, with fixed seeds.

Stages (each skipped when its output exists, so an interrupted build resumes):
1. train the demo VLM (``WORK/target``), report its accuracy per grounded task;
2. self-distillation data: the VLM's answers sampled at temperature 1 (seeded) + tap features (``WORK/distill``);
3. train the drafter (``WORK/drafter``, checkpoints in ``WORK/drafter/checkpoint``), report tau per task;
4. with ``bench_limit`` > 0 (``--quick``), the benchmark (AR vs GLANCE, ``glance bench``'s engine methods) on that
   many prompts per task;
5. install both into the package's assets (weights in float32), unless ``--no-install``.

``TargetRecipe.arch`` (``--target-arch``) picks the target's architecture: Qwen2.5-VL (the bundled demo),
Qwen2-VL or Qwen3-VL.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import paths
from .tasks import TASKS, eval_set, train_example
from .target_training import TargetRecipe, target_accuracy, train_target

DISTILL_PER_TASK = 300


@dataclass
class DemoRecipe:
    target: TargetRecipe
    distill_per_task: int = DISTILL_PER_TASK
    distill_temperature: float = 1.0  # sampled answers: the drafter learns the VLM's distribution (train/data.py)
    drafter_steps: int = 1000
    drafter_layers: int = 2
    block_size: int = 16
    budget: int = 15  # on 2 CPU cores a 15-node tree (the chain's row count) beat 23 and 31 (`glance bench --sweep`)
    branch_k: int = 2
    seed: int = 0
    bench_limit: int = 0  # prompts per task of the closing benchmark (0: none)
    tau_limit: int = 10  # prompts per task of the tau evaluation
    accuracy_limit: int = 20  # prompts per grounded task of the target's accuracy report
    eval_max_tokens: int = 96  # answer length of the tau evaluation (the bench: at most 32)


def quick_recipe(arch: str = "qwen2_5_vl") -> DemoRecipe:
    """A minutes-long smoke version of the recipe for a target of architecture ``arch`` (answers will be poor)."""
    return DemoRecipe(target=TargetRecipe(steps=30, batch_size=4, arch=arch), distill_per_task=4, drafter_steps=20,
                      bench_limit=1)


def build_demo(work_dir: str | Path, recipe: DemoRecipe | None = None, install: bool = True,
               progress: bool = True) -> dict:
    """Run the stages; returns a report dict (also written to ``WORK/report.json``)."""
    from ..drafter import GlanceDrafter
    from ..engine import GlanceEngine
    from ..target import TargetAdapter
    from ..train.data import DistillDataset, build_distill_data
    from ..train.trainer import DrafterTrainConfig, evaluate_tau, new_drafter_for, train_drafter

    recipe = recipe or DemoRecipe(target=TargetRecipe())
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"recipe": asdict(recipe)}
    timings: dict[str, float] = {}

    t0 = time.time()
    target_dir = work / "target"
    if not (target_dir / "model.safetensors").is_file() or not (work / "target.done").is_file():
        train_target(target_dir, recipe.target, progress=progress)
        (work / "target.done").write_text("ok\n")
    timings["target_s"] = time.time() - t0

    target = TargetAdapter.load(target_dir)
    ar_engine = GlanceEngine(target, None, mode="ar")
    report["target_accuracy"] = target_accuracy(ar_engine, n_per_task=recipe.accuracy_limit)
    print("demo VLM accuracy per grounded task:", json.dumps(report["target_accuracy"]), flush=True)

    t0 = time.time()
    dcfg = DrafterTrainConfig(steps=recipe.drafter_steps, block_size=recipe.block_size,
                              num_layers=recipe.drafter_layers, budget=recipe.budget, branch_k=recipe.branch_k,
                              seed=recipe.seed)
    taps = new_drafter_for(target, dcfg).config.tap_layers
    distill_dir = work / "distill"
    if not (distill_dir / "distill.json").is_file():
        requests = ((task, train_example(task, i).messages()) for i in range(recipe.distill_per_task)
                    for task in TASKS)
        build_distill_data(ar_engine, requests, distill_dir, taps=taps, total=recipe.distill_per_task * len(TASKS),
                           progress=progress, temperature=recipe.distill_temperature, seed=recipe.seed)
    timings["distill_s"] = time.time() - t0

    t0 = time.time()
    drafter_dir = work / "drafter"
    if not (drafter_dir / "model.safetensors").is_file():
        train_drafter(target, DistillDataset(distill_dir), drafter_dir, dcfg, progress=progress)
    timings["drafter_s"] = time.time() - t0

    drafter = GlanceDrafter.from_pretrained(drafter_dir)
    engine = GlanceEngine(target, drafter)
    report["tau"] = evaluate_tau(engine, {t: [e.messages() for e in eval_set(t)[:recipe.tau_limit]] for t in TASKS},
                                 max_tokens=recipe.eval_max_tokens, progress=progress)
    print("tau per task:", json.dumps(report["tau"]), flush=True)
    if recipe.bench_limit > 0:
        from .bench import format_table, run_bench

        bench = run_bench(engine, limit=recipe.bench_limit, max_tokens=min(32, recipe.eval_max_tokens),
                          progress=progress, peers=False)
        report["bench"] = {k: v for k, v in bench.items() if k in ("geomean_decode_speedup", "glance_method")}
        print(format_table(bench), flush=True)
    report["timings"] = timings
    if install:
        install_assets(target_dir, drafter_dir)
        report["installed"] = str(paths.ASSETS)
    (work / "report.json").write_text(json.dumps(report, indent=2))
    return report


def install_assets(target_dir: Path, drafter_dir: Path) -> None:
    """Copy the checkpoint files (no training state) into the package's assets."""
    for src, dst in ((target_dir, paths.bundled_target()), (drafter_dir, paths.bundled_drafter())):
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix in (".json", ".safetensors", ".jinja", ".txt") and f.name != "train_log.jsonl":
                shutil.copy2(f, dst / f.name)
