"""Training blocks and the GLANCE loss (design §1, "Training").

Per sequence, anchors are sampled inside the answer. Each anchor ``a`` starts a block whose position 0 is the
real token ``x_a`` and positions 1..B-1 are MASK, at positions ``a .. a+B-1``; the label of offset k is
``x_{a+k}``. A block sees the context features strictly before its anchor, attends bidirectionally within
itself and never sees other blocks. Loss: cross-entropy over k >= 1 weighted by ``exp(-(k-1)/gamma)``,
normalised by the weight sum.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..drafter import GlanceDrafter
from .data import DistillSequence


@dataclass
class BlockBatch:
    """Shapes: S sequences, T context tokens (padded), M = anchors x block_size block rows (padded).

    taps [S, T, L*H]; ctx_positions [S, T]; block_tokens / block_positions / labels [S, M]
    (labels -100 where ignored); offsets [S, M] (k of each row); mask bool [S, 1, M, T + M].
    """

    taps: torch.Tensor
    ctx_positions: torch.Tensor
    block_tokens: torch.Tensor
    block_positions: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor
    mask: torch.Tensor

    def to(self, device: torch.device | str) -> "BlockBatch":
        return BlockBatch(*(getattr(self, f).to(device) for f in ("taps", "ctx_positions", "block_tokens",
                                                                  "block_positions", "labels", "offsets", "mask")))


def anchor_candidates(length: int, answer_start: int) -> list[int]:
    """Anchors inside the answer that have at least one label after them."""
    # anchor a = answer_start is the first answer token, whose block at inference follows the prefill
    return list(range(answer_start, length - 1))


def sample_anchors(seq: DistillSequence, max_anchors: int, rng: random.Random) -> list[int]:
    """Anchors inside the answer that have at least one label after them (all of them if few)."""
    return plan_anchors(len(seq.ids), seq.answer_start, max_anchors, rng)


def plan_anchors(length: int, answer_start: int, max_anchors: int, rng: random.Random) -> list[int]:
    """Up to ``max_anchors`` anchors (sorted) of a sequence of ``length`` tokens whose answer starts at
    ``answer_start``: needs only the lengths, so a step's loss normaliser is known before any feature is read."""
    candidates = anchor_candidates(length, answer_start)
    if len(candidates) > max_anchors:
        candidates = sorted(rng.sample(candidates, max_anchors))
    return candidates


def anchors_weight_sum(length: int, anchors: list[int], weights: torch.Tensor) -> float:
    """Sum of the loss weights of the labelled rows of ``anchors`` (``weights`` [B] from :func:`loss_weights`):
    the loss normaliser's share of one sequence."""
    cum = torch.cumsum(weights.double(), 0).tolist()  # cum[k] = w_0 + .. + w_k
    blk = weights.shape[0]
    return float(sum(cum[min(blk - 1, length - 1 - a)] for a in anchors))


def make_block_batch(seqs: list[DistillSequence], block_size: int, mask_token_id: int, max_anchors: int,
                     rng: random.Random | None, anchors: list[list[int]] | None = None) -> BlockBatch:
    """Blocks of ``seqs`` at sampled anchors (or at the given ``anchors`` per sequence); tensors on the device
    of the sequences' features."""
    if anchors is None:
        anchors = [sample_anchors(s, max_anchors, rng) for s in seqs]
    s_n, t_n = len(seqs), max(len(s.ids) for s in seqs)
    m_n = max(1, max(len(a) for a in anchors)) * block_size
    width = seqs[0].taps.shape[-1]
    taps = torch.zeros(s_n, t_n, width, device=seqs[0].taps.device)
    tokens = torch.full((s_n, m_n), mask_token_id, dtype=torch.long)
    positions = torch.zeros(s_n, m_n, dtype=torch.long)
    labels = torch.full((s_n, m_n), -100, dtype=torch.long)
    offsets = torch.arange(m_n).remainder(block_size).expand(s_n, m_n).clone()
    mask = torch.zeros(s_n, 1, m_n, t_n + m_n, dtype=torch.bool)
    k = torch.arange(block_size)
    for i, (seq, anc) in enumerate(zip(seqs, anchors)):
        t = len(seq.ids)
        taps[i, :t] = seq.taps.to(taps.device, taps.dtype)
        ids = seq.ids.cpu()
        for j in range(m_n // block_size):
            rows = slice(j * block_size, (j + 1) * block_size)
            mask[i, 0, rows, t_n + j * block_size : t_n + (j + 1) * block_size] = True  # own block
            if j >= len(anc):
                continue
            a = anc[j]
            tokens[i, j * block_size] = ids[a]
            positions[i, rows] = a + k
            target_idx = a + k[1:]
            valid = target_idx < t
            lab = torch.full((block_size - 1,), -100, dtype=torch.long)
            lab[valid] = ids[target_idx[valid]]
            labels[i, j * block_size + 1 : (j + 1) * block_size] = lab
            mask[i, 0, rows, :a] = True  # context strictly before the anchor
    ctx_positions = torch.arange(t_n).expand(s_n, t_n).clone()
    dev = taps.device
    return BlockBatch(taps, ctx_positions.to(dev), tokens.to(dev), positions.to(dev), labels.to(dev),
                      offsets.to(dev), mask.to(dev))


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``w_k = exp(-(k-1)/gamma)`` for k = 0..B-1 (k = 0, the anchor itself, gets weight 0)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def block_loss_sums(drafter: GlanceDrafter, batch: BlockBatch, gamma: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Un-normalised block loss: (sum of ``w_k * CE`` over labelled rows (scalar, with grad), hits per offset
    [B] and labelled rows per offset [B] (long, no grad)). Dividing the first by the batch's weight sum gives
    :func:`glance_loss`; summed over the parts of a batch (ranks, micro-batches) it is the whole batch's."""
    ctx = drafter.project_context(batch.taps.to(drafter.fc.weight.dtype))
    hidden = drafter.forward_blocks(ctx, batch.ctx_positions, batch.block_tokens, batch.block_positions, batch.mask)
    logits = drafter.logits(hidden).float()
    valid = batch.labels != -100
    blk = drafter.config.block_size
    w = loss_weights(blk, gamma).to(logits.device)[batch.offsets] * valid
    ce = F.cross_entropy(logits.transpose(1, 2), batch.labels.clamp(min=0), reduction="none")
    with torch.no_grad():
        hit = (logits.argmax(-1) == batch.labels) & valid
        hits = torch.zeros(blk, dtype=torch.long, device=logits.device).index_add_(
            0, batch.offsets.reshape(-1), hit.reshape(-1).long())
        counts = torch.zeros(blk, dtype=torch.long, device=logits.device).index_add_(
            0, batch.offsets.reshape(-1), valid.reshape(-1).long())
    return (ce * w).sum(), hits, counts


def glance_loss(drafter: GlanceDrafter, batch: BlockBatch, gamma: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted block cross-entropy. Returns (loss, stats: per-offset accuracy at k=1 and overall)."""
    total, hits, counts = block_loss_sums(drafter, batch, gamma)
    valid = batch.labels != -100
    wsum = (loss_weights(drafter.config.block_size, gamma).to(total.device)[batch.offsets] * valid).sum()
    loss = total / wsum.clamp(min=1e-6)
    stats = {"acc": float(hits.sum() / counts.sum().clamp(min=1)),
             "acc_k1": float(hits[1] / counts[1].clamp(min=1))}
    if math.isnan(loss.item()):
        raise FloatingPointError("drafter loss is NaN")
    return loss, stats
