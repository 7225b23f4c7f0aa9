"""The GLANCE drafter trainer (self-distillation; target embedding and LM head frozen and shared).

Works for any supported target checkpoint: it needs the target directory (for the shared embedding / LM head
and the drafter's shape) and a self-distillation directory from :mod:`glance_sgl.train.data`. Progress bar,
periodic checkpoints (``OUT/checkpoint``: drafter + optimizer state), resume, and a final save of the drafter
to ``OUT``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..checkpoints import MASK_TOKEN
from ..config import default_gamma
from ..drafter import GlanceDrafter
from ..target import TargetAdapter
from .blocks import glance_loss, make_block_batch
from .data import DistillDataset

STATE_FILE = "trainer_state.pt"


@dataclass
class DrafterTrainConfig:
    """Reference settings from design §1: lr 6e-4, warmup 4%, grad clip 1.0, up to 512 anchors."""

    steps: int = 2000
    batch_size: int = 16  # sequences per step
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_anchors: int = 512
    block_size: int = 16
    num_layers: int = 1
    num_taps: int | None = None
    gamma: float | None = None
    budget: int = 63
    branch_k: int = 8
    seed: int = 0
    checkpoint_every: int = 250
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def effective_gamma(self) -> float:
        return self.gamma if self.gamma is not None else default_gamma(self.block_size)


def lr_at(step: int, cfg: DrafterTrainConfig) -> float:
    warm = max(1, int(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def mask_token_for(target: TargetAdapter) -> int:
    """The target vocabulary's MASK token (``<|mask|>``), else its pad token."""
    tok = target.tokenizer
    mid = tok.convert_tokens_to_ids(MASK_TOKEN)
    if mid is None or mid == tok.unk_token_id:
        mid = tok.pad_token_id
    if mid is None:
        raise ValueError("the target's tokenizer has neither a <|mask|> nor a pad token to use as MASK")
    return int(mid)


def new_drafter_for(target: TargetAdapter, cfg: DrafterTrainConfig, tap_layers: list[int] | None = None) -> GlanceDrafter:
    overrides: dict[str, Any] = dict(num_hidden_layers=cfg.num_layers, block_size=cfg.block_size,
                                     budget=cfg.budget, branch_k=cfg.branch_k)
    if tap_layers is not None:
        overrides["tap_layers"] = list(tap_layers)
    else:
        overrides["num_taps"] = cfg.num_taps
    return GlanceDrafter.for_target(target.text_config, mask_token_for(target), seed=cfg.seed, **overrides)


def train_drafter(
    target: TargetAdapter,
    data: DistillDataset,
    out_dir: str | Path,
    cfg: DrafterTrainConfig,
    resume: bool = True,
    progress: bool = True,
    on_log: Callable[[int, dict[str, float]], None] | None = None,
) -> GlanceDrafter:
    """Train a drafter on ``data`` (whose tap layers fix the drafter's taps) and save it to ``out_dir``."""
    from tqdm import tqdm

    out = Path(out_dir)
    ckpt = out / "checkpoint"
    drafter = new_drafter_for(target, cfg, tap_layers=data.tap_layers)
    drafter.bind_target(target.input_embeddings(), target.lm_head())
    for p in list(target.input_embeddings().parameters()) + list(target.lm_head().parameters()):
        p.requires_grad_(False)
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    start = 0
    if resume and (ckpt / STATE_FILE).is_file():
        loaded = GlanceDrafter.from_pretrained(ckpt)
        drafter.load_state_dict(loaded.state_dict())
        state = torch.load(ckpt / STATE_FILE, weights_only=False)
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    rng = random.Random(f"drafter:{cfg.seed}:{start}")
    gen_order = list(range(len(data)))
    history: list[dict[str, float]] = []
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train drafter",
               disable=not progress, dynamic_ncols=True)
    ema: float | None = None
    for step in bar:
        seqs = [data[i] for i in rng.sample(gen_order, min(cfg.batch_size, len(gen_order)))]
        batch = make_block_batch(seqs, cfg.block_size, drafter.config.mask_token_id, cfg.max_anchors, rng)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss, stats = glance_loss(drafter, batch, cfg.effective_gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        record = {"step": step, "loss": loss.item(), **stats}
        history.append(record)
        bar.set_postfix(loss=f"{ema:.3f}", acc=f"{stats['acc']:.2f}")
        if on_log is not None:
            on_log(step, record)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            drafter.save_pretrained(ckpt)
            torch.save({"optimizer": opt.state_dict(), "step": step + 1, "config": asdict(cfg)}, ckpt / STATE_FILE)
    drafter.eval()
    drafter.save_pretrained(out)
    log_path = out / "train_log.jsonl"
    with log_path.open("a") as f:
        for rec in history:
            f.write(json.dumps(rec) + "\n")
    return drafter


def evaluate_tau(engine, examples_by_task: dict[str, list[list[dict[str, Any]]]], max_tokens: int = 96,
                 progress: bool = True) -> dict[str, float]:
    """Pooled tau per task of ``engine`` (GLANCE mode with the fixed tree every round, greedy) on the given
    requests: what the drafter accepts, whatever the planner would choose to verify."""
    from tqdm import tqdm

    from ..engine import SamplingParams

    out = {}
    for task, requests in examples_by_task.items():
        committed = rounds = 0
        for messages in tqdm(requests, desc=f"tau {task}", disable=not progress, leave=False):
            m = engine.generate(messages, SamplingParams(max_tokens=max_tokens), mode="glance", planner="fixed").metrics
            committed += sum(m.committed_per_round)
            rounds += m.rounds
        out[task] = committed / rounds if rounds else 1.0
    return out
