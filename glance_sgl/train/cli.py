"""`glance distill`, `glance train-drafter` and `glance train-pipeline`: the drafter pipeline for any supported
target.

- ``distill``: the target answers the requests of a data file (GLANCE JSONL, LLaVA / ShareGPT JSON or JSONL, the
  ``messages`` variant; :mod:`glance_sgl.train.formats`) through the embedded engine (CPU, one at a time) or an
  SGLang server (``--backend sglang``: ``--upstream URL``, or one launched for the run; many in flight), and
  caches the answers (+ the tap features unless ``--no-features``).
- ``train-drafter``: trains on that directory, cached features or ``--online`` (the frozen target computes
  them in the step); one process or ``torchrun --nproc-per-node N -m glance_sgl.cli train-drafter ...``.
- ``train-pipeline``: data -> distill (answers only) -> online training -> tau, in one command (``--quick``: a
  seconds-to-minutes smoke run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator


def read_requests(path: str, strict: bool = False) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(task, messages) of the good rows of a data file (any format of :mod:`glance_sgl.train.formats`)."""
    from .formats import SkipLog, read_dataset

    for spec in read_dataset(path, SkipLog(strict=strict)):
        yield spec.task, spec.messages()


def _mkdir(path: str | Path) -> Path:
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def _distill(args: argparse.Namespace, out: str, features: bool) -> dict[str, Any]:
    """Run the distillation stage of ``args``; returns the written meta (distill.json)."""
    from ..cli import CLIError
    from ..engine import RequestError, SamplingParams
    from .data import META, PromptOnlyTarget, build_distill_data
    from .formats import DataError, SkipLog, count_rows, read_dataset
    if not Path(args.data).is_file():
        raise CLIError(f"--data {args.data}: no such file")
    try:
        SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature).validate()
    except RequestError as exc:
        raise CLIError(f"--temperature / --max-new-tokens: {exc}") from exc
    if args.backend == "embedded" and args.upstream:
        raise CLIError("--upstream needs --backend sglang")
    skips = SkipLog(strict=args.strict)
    engine = answerer = server = None
    try:
        if args.backend == "embedded":
            from ..engine import GlanceEngine

            engine = GlanceEngine.load(args.target, None, device=args.device)
            target = engine.target
        else:
            from ..target import TargetAdapter
            from .sglang_distill import SGLangAnswerer, launch_target_server

            url = args.upstream
            if not url:  # it starts while the target's processor (and weights, for features) load here
                import shlex

                print("launching SGLang for the target ...", file=sys.stderr, flush=True)
                server = launch_target_server(args.target, device=args.sglang_device,
                                              extra_args=shlex.split(args.sglang_args or ""),
                                              seeded=args.temperature > 0, wait=False,
                                              log_path=_mkdir(out) / "sglang.log")
                url = server.url
            target = TargetAdapter.load(args.target, device=args.device) if features else \
                PromptOnlyTarget(args.target)
            if server is not None:
                server.wait_ready(timeout=900)
            answerer = SGLangAnswerer(url, target.tokenizer, concurrency=args.concurrency)
        from ..config import GlanceConfig
        from .trainer import mask_token_for

        taps = GlanceConfig.for_target(target.text_config, mask_token_for(target), num_hidden_layers=args.layers,
                                       num_taps=args.taps).tap_layers
        total = count_rows(args.data) if args.limit is None else args.limit
        build_distill_data(engine, read_dataset(args.data, skips, image_root=args.image_root, limit=args.limit),
                           out, taps=taps, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           seed=args.seed, answerer=answerer, target=target, features=features, skips=skips,
                           max_length=args.max_length, total=total, shard_size=args.shard_size,
                           chunk=max(64, 4 * args.concurrency))
    except DataError as exc:
        raise CLIError(str(exc)) from exc
    finally:
        if answerer is not None:
            answerer.close()
        if server is not None:
            server.stop()
    meta = json.loads((Path(out) / META).read_text())
    print(f"wrote {out}: {meta['sequences']} sequences (tap layers {taps}, features "
          f"{'cached' if features else 'none: train with --online'}); {skips.summary()}")
    return meta


def cmd_distill(args: argparse.Namespace) -> int:
    _distill(args, args.out, features=not args.no_features)
    return 0


def train_config(args: argparse.Namespace):
    from .trainer import DrafterTrainConfig

    return DrafterTrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, block_size=args.block_size,
                              num_layers=args.layers, budget=args.budget, branch_k=args.branch_k,
                              checkpoint_every=args.checkpoint_every, seed=args.seed, grad_accum=args.grad_accum,
                              eval_every=args.eval_every, eval_size=args.eval_size, bf16=not args.no_bf16,
                              max_anchors=args.max_anchors)


def _train(args: argparse.Namespace, data_dir: str, out: str, online: bool, progress: bool = True):
    import torch

    from ..cli import CLIError
    from ..target import TargetAdapter
    from .data import DistillDataset
    from .trainer import init_distributed, train_drafter

    rank, world, device = init_distributed(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = TargetAdapter.load(args.target, device=device)
    try:
        data = DistillDataset(data_dir, target=target, online=online or None)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from exc
    try:
        drafter = train_drafter(target, data, out, train_config(args), resume=not args.no_resume,
                                progress=progress)
        if world > 1:  # every rank done before the group goes: one torn down early aborted its peer (gloo, SIGABRT)
            import torch.distributed as dist

            dist.barrier()
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank == 0:
        print(f"wrote {out} ({'online' if data.online else 'cached'} features, {world} process(es))")
    return target, data, drafter


def cmd_train(args: argparse.Namespace) -> int:
    _train(args, args.data, args.out, online=args.online)
    return 0


QUICK = dict(limit=8, max_new_tokens=8, steps=6, batch_size=2, eval_every=3, eval_size=2, checkpoint_every=3,
             block_size=8, budget=7, branch_k=2, no_engine_tau=True)


def cmd_pipeline(args: argparse.Namespace) -> int:
    """data -> distill (answers only) -> online training -> tau (held-out simulated tau during training, then
    the engine's tau decoding the held-out requests with the best checkpoint, fixed tree)."""
    from ..drafter import GlanceDrafter
    from ..engine import GlanceEngine
    from .trainer import evaluate_tau, split_indices

    import os

    from ..cli import CLIError

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CLIError("train-pipeline runs in one process; under torchrun run `glance distill`, then "
                       "`glance train-drafter --online`")
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    out = Path(args.out)
    distill_dir, drafter_dir = out / "distill", out / "drafter"
    if not (distill_dir / "distill.json").is_file():
        _distill(args, str(distill_dir), features=False)
    target, data, drafter = _train(args, str(distill_dir), str(drafter_dir), online=True)
    _, eval_idx = split_indices(len(data), args.eval_size if args.eval_every else 0, args.seed)
    best = drafter_dir / "best"
    report: dict[str, Any] = {"sequences": len(data)}
    if (best / "eval.json").is_file():
        report["best"] = json.loads((best / "eval.json").read_text())
    if eval_idx and not args.no_engine_tau:
        chosen = GlanceDrafter.from_pretrained(best if best.is_dir() else drafter_dir, device=str(target.device))
        engine = GlanceEngine(target, chosen)
        by_task: dict[str, list] = {}
        for i in eval_idx:
            by_task.setdefault(data.requests[i].task, []).append(data.requests[i].messages())
        report["engine_tau"] = evaluate_tau(engine, by_task, max_tokens=args.max_new_tokens, progress=False)
    (out / "pipeline.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


def _distill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=1, help="drafter layers (fixes the default taps)")
    p.add_argument("--taps", type=int, default=None, help="number of tap layers (default: = layers)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sample the target's answers at this temperature (0: greedy answers)")
    p.add_argument("--seed", type=int, default=0, help="the request of row i (0-based) is sampled with seed SEED + i")
    p.add_argument("--device", default="cpu", help="device of the Hugging Face target (features, embedded)")
    p.add_argument("--backend", choices=["embedded", "sglang"], default="embedded",
                   help="who answers: the embedded engine (one at a time) or an SGLang server (many in flight)")
    p.add_argument("--upstream", help="SGLang server URL serving the target (default: launch one)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (--backend sglang)")
    p.add_argument("--sglang-device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--sglang-args", default="", help="extra sglang.launch_server flags of a launched server")
    p.add_argument("--strict", action="store_true", help="a bad row is an error instead of a skip")
    p.add_argument("--image-root", default=None, help="image paths relative to this (default: the data file)")
    p.add_argument("--limit", type=int, default=None, help="the first N good rows only")
    p.add_argument("--max-length", type=int, default=None,
                   help="context length a prompt must fit (default: the target's)")
    p.add_argument("--shard-size", type=int, default=256)


def _train_args(p: argparse.ArgumentParser, with_shared: bool = True) -> None:
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (all ranks and micro-batches)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step on each rank")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=63)
    p.add_argument("--branch-k", type=int, default=8)
    p.add_argument("--max-anchors", type=int, default=512)
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=0, help="simulated tau on the held-out split every K steps")
    p.add_argument("--eval-size", type=int, default=0, help="held-out sequences")
    p.add_argument("--no-bf16", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    if with_shared:
        p.add_argument("--layers", type=int, default=1)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--device", default="cpu", help="cpu or cuda (torchrun: cuda:LOCAL_RANK)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("distill", help="self-distillation data: the target's answers (+ tap features)")
    d.add_argument("--target", required=True, help="Hugging Face Qwen2.5-VL / Qwen2-VL directory")
    d.add_argument("--data", required=True, help="GLANCE JSONL, LLaVA / ShareGPT JSON(L) or messages JSON(L)")
    d.add_argument("--out", required=True)
    _distill_args(d)
    d.add_argument("--no-features", action="store_true",
                   help="answers only (no feature cache): train with `train-drafter --online`")
    d.set_defaults(func=cmd_distill)

    t = sub.add_parser("train-drafter", help="train a GLANCE drafter on self-distillation data (torchrun: DDP)")
    t.add_argument("--target", required=True)
    t.add_argument("--data", required=True, help="directory written by `glance distill`")
    t.add_argument("--out", required=True)
    t.add_argument("--online", action="store_true", help="the frozen target computes the features in the step")
    _train_args(t)
    t.set_defaults(func=cmd_train)

    p = sub.add_parser("train-pipeline", help="data -> distill -> online drafter training -> tau, one command")
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, help="OUT/distill, OUT/drafter (+ best/), OUT/pipeline.json")
    p.add_argument("--quick", action="store_true",
                   help="a tiny smoke run (8 rows, 6 steps, simulated tau only)")
    p.add_argument("--no-engine-tau", action="store_true",
                   help="skip decoding the held-out requests with the engine (its cost model calibrates first)")
    _distill_args(p)
    _train_args(p, with_shared=False)
    p.set_defaults(func=cmd_pipeline)
