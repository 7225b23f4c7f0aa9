"""The GLANCE drafter trainer (self-distillation; target embedding and LM head frozen and shared).

Works for any supported target checkpoint: it needs the target (for the shared embedding / LM head and the
drafter's shape) and a self-distillation directory from :mod:`glance_sgl.train.data`, read with cached features
or online (the frozen target computes each sequence's tap features inside the training step).

- One process, or ``torchrun --nproc-per-node N`` (PyTorch DDP: gloo on CPU, NCCL on GPU). The data order does
  not depend on the world size: step s trains global batch s of a seeded per-epoch permutation, each sequence's
  anchors drawn from a generator seeded by (seed, step, position in the batch); rank r takes its contiguous
  share of the batch, split into ``grad_accum`` micro-batches. Every rank divides its summed weighted
  cross-entropy by the global batch's weight sum (known from the sequence lengths and anchors before any
  feature is read, all-reduced), so the gradient DDP averages (times the world size) is the whole batch's:
  N processes reproduce one process step for step.
- bf16 autocast on GPU (``bf16``), gradient clipping, AdamW, warmup + cosine learning rate.
- Rank 0 writes: ``OUT/checkpoint`` (drafter + ``trainer_state.pt``: optimizer, step, best eval) every
  ``checkpoint_every`` steps, resumed automatically; ``OUT/train_log.jsonl`` (per step: loss, accuracy per
  depth ``acc_k1..``, learning rate; eval steps add ``tau``); ``OUT/loss_curve.png``; ``OUT/best`` (the
  checkpoint of the best held-out simulated tau, with ``eval.json``); the last drafter in ``OUT``. A progress
  bar on rank 0.
- Evaluation every ``eval_every`` steps on a held-out split of ``eval_size`` sequences: simulated tau
  (:func:`simulated_tau`, teacher-forced acceptance of the drafter's budget tree).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..checkpoints import MASK_TOKEN
from ..config import default_gamma
from ..drafter import GlanceDrafter, draft_logprobs
from ..target import TargetAdapter
from ..tree import build_tree, topk_per_offset
from .blocks import (BlockBatch, anchor_candidates, anchors_weight_sum, block_loss_sums, loss_weights,
                     make_block_batch, plan_anchors)
from .data import DistillDataset, DistillSequence

STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
CURVE_FILE = "loss_curve.png"


@dataclass
class DrafterTrainConfig:
    """Reference settings from design §1: lr 6e-4, warmup 4%, grad clip 1.0, up to 512 anchors.

    ``batch_size`` is the global batch (sequences per optimizer step, over all ranks and micro-batches); it must
    divide by world size x ``grad_accum``.
    """

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
    grad_accum: int = 1
    eval_every: int = 0  # 0: no evaluation during training
    eval_size: int = 0  # held-out sequences (taken out of training)
    bf16: bool = True  # autocast on CUDA (ignored on CPU)
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


# ---------------------------------------------------------------------------------------------- checkpoints
def save_drafter(drafter: GlanceDrafter, directory: str | Path) -> Path:
    """Write the drafter checkpoint (the drafter's own format: config + weights, never the shared modules)."""
    return drafter.save_pretrained(directory)


def load_drafter_weights(drafter: GlanceDrafter, directory: str | Path) -> None:
    """Load a checkpoint written by :func:`save_drafter` into ``drafter`` (same config)."""
    loaded = GlanceDrafter.from_pretrained(directory)
    drafter.load_state_dict(loaded.state_dict())


# ---------------------------------------------------------------------------------------------- data order
def split_indices(n: int, eval_size: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) sequence indices: ``eval_size`` of a seeded permutation held out."""
    if eval_size <= 0:
        return list(range(n)), []
    if eval_size >= n:
        raise ValueError(f"eval_size {eval_size} leaves no training sequences (of {n})")
    perm = random.Random(f"split:{seed}").sample(range(n), n)
    return sorted(perm[eval_size:]), sorted(perm[:eval_size])


def global_batch(step: int, train_idx: list[int], batch_size: int, seed: int) -> list[int]:
    """Sequence indices of global batch ``step``: positions ``step*B .. step*B+B-1`` of the concatenated
    per-epoch permutations of ``train_idx`` (seeded by epoch): independent of world size and of resume."""
    n = len(train_idx)
    out = []
    perms: dict[int, list[int]] = {}
    for p in range(step * batch_size, (step + 1) * batch_size):
        epoch = p // n
        if epoch not in perms:
            perms[epoch] = random.Random(f"order:{seed}:{epoch}").sample(train_idx, n)
        out.append(perms[epoch][p % n])
    return out


@dataclass
class _Item:
    index: int  # sequence index in the dataset
    anchors: list[int]
    weight: float  # its share of the loss normaliser


def plan_step(data: DistillDataset, step: int, train_idx: list[int], cfg: DrafterTrainConfig) -> list[_Item]:
    """The global batch of ``step`` with each sequence's anchors and loss weight sum (no features read)."""
    w = loss_weights(cfg.block_size, cfg.effective_gamma)
    items = []
    for j, i in enumerate(global_batch(step, train_idx, cfg.batch_size, cfg.seed)):
        ids, _, start, _ = data.sequences[i]
        rng = random.Random(f"anchors:{cfg.seed}:{step}:{j}")
        anchors = plan_anchors(len(ids), start, cfg.max_anchors, rng)
        items.append(_Item(i, anchors, anchors_weight_sum(len(ids), anchors, w)))
    return items


# ---------------------------------------------------------------------------------------------- distributed
def dist_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialised process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(device: str) -> tuple[int, int, str]:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): join the process group (NCCL on CUDA, gloo on CPU) and return
    (rank, world size, this rank's device: ``cuda:LOCAL_RANK`` on CUDA). Else (0, 1, ``device``)."""
    import os

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, device
    cuda = device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def _all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


class _LossModule(nn.Module):
    """The drafter as one module whose ``forward`` gives the block loss sums (what DDP wraps)."""

    def __init__(self, drafter: GlanceDrafter, gamma: float) -> None:
        super().__init__()
        self.drafter, self.gamma = drafter, gamma

    def forward(self, taps, ctx_positions, block_tokens, block_positions, labels, offsets, mask):
        batch = BlockBatch(taps, ctx_positions, block_tokens, block_positions, labels, offsets, mask)
        return block_loss_sums(self.drafter, batch, self.gamma)


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def simulated_tau(drafter: GlanceDrafter, seqs: Iterable[DistillSequence], budget: int | None = None,
                  branch_k: int | None = None) -> dict[str, float]:
    """Teacher-forced acceptance of the drafter's budget tree on the answers of ``seqs``.

    Rounds walk each answer as decoding would: a round at anchor ``a`` (the last committed token; context =
    features strictly before it) drafts one block, builds the best-first tree of ``budget`` nodes (branch
    ``branch_k``; default the drafter's config) and accepts the longest path that matches the answer's next
    tokens; the round commits that many + 1 (the target's bonus token) and the next one starts there. For greedy
    answers this is the tau the engine's fixed planner gets on these prompts. Returns ``{"tau", "rounds",
    "accepted_mean"}``.
    """
    cfg = drafter.config
    budget, branch_k = budget or cfg.budget, branch_k or cfg.branch_k
    blk = cfg.block_size
    committed = rounds = accepted = 0
    dev = drafter.fc.weight.device
    for seq in seqs:
        t = len(seq.ids)
        anchors = anchor_candidates(t, seq.answer_start)
        if not anchors:
            continue
        batch = make_block_batch([DistillSequence(seq.ids, seq.taps.to(dev), seq.answer_start, seq.task)],
                                 blk, cfg.mask_token_id, len(anchors), None, anchors=[anchors])
        ctx = drafter.project_context(batch.taps.to(drafter.fc.weight.dtype))
        hidden = drafter.forward_blocks(ctx, batch.ctx_positions, batch.block_tokens, batch.block_positions,
                                        batch.mask)[0].view(len(anchors), blk, -1)
        ids = seq.ids.tolist()
        a = seq.answer_start
        while a < t - 1:
            row = a - seq.answer_start
            lp = draft_logprobs(drafter.logits(hidden[row:row + 1, 1:]))  # [1, B-1, V]
            values, top = topk_per_offset(lp, branch_k)
            tree = build_tree(values, top, torch.tensor([ids[a]]), budget)
            toks, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
            node, depth = 0, 0
            while a + depth + 1 < t:
                want = ids[a + depth + 1]
                child = next((r for r in range(1, len(toks)) if parents[r] == node and toks[r] == want), None)
                if child is None:
                    break
                node, depth = child, depth + 1
            step = min(depth + 1, t - 1 - a)
            committed += step
            accepted += depth
            rounds += 1
            a += step
    return {"tau": committed / rounds if rounds else 1.0, "rounds": float(rounds),
            "accepted_mean": accepted / rounds if rounds else 0.0}


# ---------------------------------------------------------------------------------------------- logging
def write_loss_curve(log_path: str | Path, png_path: str | Path) -> Path | None:
    """Loss (and held-out tau, where logged) per step from ``train_log.jsonl`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    if not recs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=1, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    evals = [r for r in recs if "tau" in r]
    if evals:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in evals], [r["tau"] for r in evals], "o-", color="tab:orange",
                 label="held-out simulated tau")
        ax2.set_ylabel("simulated tau")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    ax.set_title("GLANCE drafter training")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)


def train_drafter(
    target: TargetAdapter,
    data: DistillDataset,
    out_dir: str | Path,
    cfg: DrafterTrainConfig,
    resume: bool = True,
    progress: bool = True,
    on_log: Callable[[int, dict[str, float]], None] | None = None,
) -> GlanceDrafter:
    """Train a drafter on ``data`` (whose tap layers fix the drafter's taps) and save it to ``out_dir``.

    Runs under ``torchrun`` when a process group is initialised (:func:`init_distributed`); ``on_log`` gets
    every step's record on rank 0 (``loss``: the global batch's loss; ``acc``, ``acc_k1``..; ``lr``; ``tau`` on
    eval steps). See the module doc for the files written.
    """
    from tqdm import tqdm

    rank, world = dist_info()
    out = Path(out_dir)
    ckpt, best_dir = out / "checkpoint", out / "best"
    device = target.device
    per_rank, rem = divmod(cfg.batch_size, world * cfg.grad_accum)
    if rem or per_rank < 1:
        raise ValueError(f"batch size {cfg.batch_size} must divide by world size {world} x grad_accum "
                         f"{cfg.grad_accum}")
    micro = per_rank
    drafter = new_drafter_for(target, cfg, tap_layers=data.tap_layers).to(device)
    drafter.bind_target(target.input_embeddings(), target.lm_head())
    for p in list(target.input_embeddings().parameters()) + list(target.lm_head().parameters()):
        p.requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    start, best = 0, -math.inf
    if resume and (ckpt / STATE_FILE).is_file():
        load_drafter_weights(drafter, ckpt)
        state = torch.load(ckpt / STATE_FILE, weights_only=False, map_location=device)
        opt.load_state_dict(state["optimizer"])
        start, best = int(state["step"]), float(state.get("best", -math.inf))
    drafter.train()
    module: nn.Module = _LossModule(drafter, cfg.effective_gamma)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    train_idx, eval_idx = split_indices(len(data), cfg.eval_size if cfg.eval_every else 0, cfg.seed)
    eval_seqs: list[DistillSequence] | None = None
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cfg.bf16 and device.type == "cuda"
                else contextlib.nullcontext())
    log_path = out / LOG_FILE
    log_file = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        kept = []
        if start and log_path.is_file():
            kept = [ln for ln in log_path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < start]
        log_path.write_text("".join(ln + "\n" for ln in kept))
        log_file = log_path.open("a")
    blk = cfg.block_size
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train drafter",
               disable=not progress or rank != 0, dynamic_ncols=True)
    ema: float | None = None
    t0 = time.perf_counter()
    for step in bar:
        items = plan_step(data, step, train_idx, cfg)
        mine = items[rank * per_rank * cfg.grad_accum:(rank + 1) * per_rank * cfg.grad_accum]
        norm = sum(it.weight for it in items)  # the global batch's weight sum: every rank plans the whole batch
        lr = lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        sums = torch.zeros(1 + 2 * blk, dtype=torch.float64, device=device)  # ce sum, hits[B], counts[B]
        for m in range(cfg.grad_accum):
            part = mine[m * micro:(m + 1) * micro]
            seqs = [data[it.index] for it in part]  # online mode: the target's pass is here
            batch = make_block_batch(seqs, blk, drafter.config.mask_token_id, cfg.max_anchors, None,
                                     anchors=[it.anchors for it in part]).to(device)
            sync = module.no_sync() if world > 1 and m < cfg.grad_accum - 1 else contextlib.nullcontext()
            with sync:
                with autocast:
                    total, hits, counts = module(batch.taps, batch.ctx_positions, batch.block_tokens,
                                                 batch.block_positions, batch.labels, batch.offsets, batch.mask)
                (total * (world / max(norm, 1e-6))).backward()
            sums[0] += total.detach().double()
            sums[1:1 + blk] += hits.double()
            sums[1 + blk:] += counts.double()
        _all_reduce(sums, world)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        loss = float(sums[0] / max(norm, 1e-6))
        if math.isnan(loss):
            raise FloatingPointError(f"drafter loss is NaN at step {step}")
        hits_k, counts_k = sums[1:1 + blk], sums[1 + blk:]
        record: dict[str, Any] = {"step": step, "loss": loss,
                                  "acc": float(hits_k.sum() / counts_k.sum().clamp(min=1)), "lr": lr}
        for k in range(1, blk):
            record[f"acc_k{k}"] = float(hits_k[k] / counts_k[k].clamp(min=1))
        done = step + 1
        if cfg.eval_every and eval_idx and (done % cfg.eval_every == 0 or done == cfg.steps):
            if rank == 0:
                if data.online:  # recomputed each time: held in memory they would cost 140 KB per token
                    held_out = (data[i] for i in eval_idx)
                else:
                    eval_seqs = eval_seqs or [data[i] for i in eval_idx]
                    held_out = iter(eval_seqs)
                drafter.eval()
                ev = simulated_tau(drafter, held_out)
                drafter.train()
                record["tau"] = ev["tau"]
                if ev["tau"] > best:
                    best = ev["tau"]
                    save_drafter(drafter, best_dir)
                    (best_dir / "eval.json").write_text(json.dumps({"step": done, **ev}, indent=2))
            _barrier(world)
        record["elapsed_s"] = time.perf_counter() - t0
        if rank == 0:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            bar.set_postfix(loss=f"{ema:.3f}", acc=f"{record['acc']:.2f}",
                            **({"tau": f"{record['tau']:.2f}"} if "tau" in record else {}))
            if on_log is not None:
                on_log(step, record)
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
            if rank == 0:
                save_drafter(drafter, ckpt)
                torch.save({"optimizer": opt.state_dict(), "step": done, "best": best, "config": asdict(cfg)},
                           ckpt / STATE_FILE)
                write_loss_curve(log_path, out / CURVE_FILE)
            _barrier(world)
    drafter.eval()
    if rank == 0:
        log_file.close()
        save_drafter(drafter, out)
        write_loss_curve(log_path, out / CURVE_FILE)
    _barrier(world)
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
