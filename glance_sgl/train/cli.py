"""`glance distill` and `glance train-drafter`: the drafter pipeline for any supported target."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator


def read_requests(path: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """JSONL rows ``{"image": PATH or [PATHS], "prompt": TEXT, "task": NAME?}`` -> (task, messages)."""
    from ..cli import CLIError, build_messages, load_image

    base = Path(path).parent
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CLIError(f"{path}:{n}: expected a JSON object with 'prompt' (and 'image'): {exc}") from exc
            images = row.get("image") or []
            images = [images] if isinstance(images, str) else images
            yield row.get("task", "default"), build_messages(prompt, [load_image(str(base / p)) for p in images])


def cmd_distill(args: argparse.Namespace) -> int:
    from ..cli import CLIError
    from ..engine import GlanceEngine, RequestError, SamplingParams
    from .data import build_distill_data
    from .trainer import DrafterTrainConfig, new_drafter_for

    if not Path(args.data).is_file():
        raise CLIError(f"--data {args.data}: no such file")
    try:
        SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature).validate()
    except RequestError as exc:
        raise CLIError(f"--temperature / --max-new-tokens: {exc}") from exc
    engine = GlanceEngine.load(args.target, None, device=args.device)
    cfg = DrafterTrainConfig(num_layers=args.layers, num_taps=args.taps)
    taps = new_drafter_for(engine.target, cfg).config.tap_layers
    build_distill_data(engine, read_requests(args.data), args.out, taps=taps, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, seed=args.seed)
    print(f"wrote {args.out} (tap layers {taps})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from ..target import TargetAdapter
    from .data import DistillDataset
    from .trainer import DrafterTrainConfig, train_drafter

    target = TargetAdapter.load(args.target, device=args.device)
    cfg = DrafterTrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, block_size=args.block_size,
                             num_layers=args.layers, budget=args.budget, branch_k=args.branch_k,
                             checkpoint_every=args.checkpoint_every, seed=args.seed)
    train_drafter(target, DistillDataset(args.data), args.out, cfg, resume=not args.no_resume)
    print(f"wrote {args.out}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("distill", help="self-distillation data: the target's answers + tap features")
    d.add_argument("--target", required=True, help="Hugging Face Qwen2.5-VL / Qwen2-VL directory")
    d.add_argument("--data", required=True, help='JSONL of {"image": PATH, "prompt": TEXT}')
    d.add_argument("--out", required=True)
    d.add_argument("--layers", type=int, default=1, help="drafter layers (fixes the default taps)")
    d.add_argument("--taps", type=int, default=None, help="number of tap layers (default: = layers)")
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--temperature", type=float, default=1.0,
                   help="sample the target's answers at this temperature (0: greedy answers)")
    d.add_argument("--seed", type=int, default=0, help="request i is sampled with seed SEED + i")
    d.add_argument("--device", default="cpu")
    d.set_defaults(func=cmd_distill)

    t = sub.add_parser("train-drafter", help="train a GLANCE drafter on self-distillation data")
    t.add_argument("--target", required=True)
    t.add_argument("--data", required=True, help="directory written by `glance distill`")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--layers", type=int, default=1)
    t.add_argument("--budget", type=int, default=63)
    t.add_argument("--branch-k", type=int, default=8)
    t.add_argument("--checkpoint-every", type=int, default=250)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument("--no-resume", action="store_true")
    t.set_defaults(func=cmd_train)
