"""The drafter's context K/V in SGLang's token slots: one draft KV pool beside the target's.

A GLANCE drafter reads, for every committed token but the newest, K/V projected from the target's tap features at
that token (KV injection). Those K/V depend on the token and its position only, like the target's own K/V, so
they live in a pool addressed by the same slot indices SGLang gives the target's K/V (``req_to_token``): per
drafter layer a K and a V buffer ``[slots, kv_heads, head_dim]``. Consequences:

- no per-request state and no per-step concatenation: a decode step gathers the batch's context straight from the
  pool through ``req_to_token`` (one index per layer), and writes the committed rows' K/V at their slots;
- memory is SGLang's: the pool has exactly the target pool's slots, its bytes per token are added to SGLang's
  per-token cell size (:func:`install_memory_accounting`, a HookRegistry hook), so ``--mem-fraction-static`` /
  ``--max-total-tokens`` budget both pools, and slots are freed with the request by SGLang's allocator;
- the radix cache works: a prefix hit shares the prefix's slots, and with them the draft K/V written when the
  prefix was first computed (every pass that writes a token's target K/V also writes its draft K/V).

Slot 0 is SGLang's padding slot: masked writes go there, so a step's writes have a fixed shape.

A decode step's writes can wait (:meth:`DraftKVPool.defer`) and be projected together with the following steps'
in one call (:meth:`DraftKVPool.flush`), so a run of plain AR steps costs one projection when drafting resumes.
Whoever reads the pool or writes a prefill flushes first; within a flush, a slot written twice (freed and given
to another token in between) keeps the later write.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from glance_sgl.drafter import DrafterCache, GlanceDrafter

logger = logging.getLogger(__name__)

PAD_SLOT = 0


def draft_cell_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes per token slot of the draft pool: K and V of every drafter layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


MAX_DEFERRED = 64  # deferred writes (steps) kept before a flush projects them: one projection per 64 AR steps


class DraftKVPool:
    """Per drafter layer, K and V ``[size, kv_heads, head_dim]`` indexed by SGLang token slots."""

    def __init__(self, drafter: GlanceDrafter, size: int, device: torch.device | str, dtype: torch.dtype) -> None:
        cfg = drafter.config
        self.drafter = drafter
        self.size = int(size)
        shape = (self.size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._last = torch.empty(self.size, dtype=torch.long, device=device)  # scratch of flush's dedupe

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @torch.no_grad()
    def write(self, slots: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Project tap features and store the K/V at their slots.

        ``slots`` [T] long (``PAD_SLOT`` for rows to drop); ``taps`` [T, L*H]; ``positions`` [T] long, each
        token's index in its request's sequence (the drafter's 1-D position). One projection for all T rows.
        """
        if slots.numel() == 0:
            return
        w = self.drafter.fc.weight
        keys, values = self.drafter.context_key_values(taps[None].to(w.dtype), positions[None].to(w.device))
        slots = slots.to(self.k[0].device, torch.long)
        for k_buf, v_buf, k, v in zip(self.k, self.v, keys, values):
            k_buf[slots] = k[0].transpose(0, 1).to(k_buf.dtype)  # [kv, T, d] -> [T, kv, d]
            v_buf[slots] = v[0].transpose(0, 1).to(v_buf.dtype)

    def defer(self, slots: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """:meth:`write` later, at the next :meth:`flush` (same arguments); flushed at once when
        ``MAX_DEFERRED`` writes wait (a batch whose requests all stopped drafting holds no more than that)."""
        self._pending.append((slots.to(self.k[0].device, torch.long), taps, positions))
        if len(self._pending) >= MAX_DEFERRED:
            self.flush()

    def flush(self) -> None:
        """Write every deferred row in one projection; of two writes to one slot, the later one stays (on a CPU
        only the kept rows are projected: padding and superseded rows are dropped first)."""
        if not self._pending:
            return
        if len(self._pending) == 1:
            slots, taps, positions = self._pending[0]
        else:
            slots, taps, positions = (torch.cat(parts) for parts in zip(*self._pending))
            order = torch.arange(slots.numel(), device=slots.device)
            self._last.scatter_reduce_(0, slots, order, reduce="amax", include_self=False)
            slots = torch.where(self._last[slots] == order, slots, PAD_SLOT)
        if slots.device.type == "cpu":
            # the projection is the flush's cost, and a CPU runs it at once: project the kept rows only (a verify
            # step defers a padded [bs, width] block; at 8 in flight about 6 of its 16 columns are committed). An
            # accelerator keeps the fixed shapes: selecting the rows would wait for the step's outcome
            keep = (slots != PAD_SLOT).nonzero().squeeze(1)
            slots, taps, positions = slots[keep], taps[keep], positions[keep]
        self._pending = []
        self.write(slots, taps, positions)

    def drop_pending(self) -> None:
        self._pending = []

    def gather(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lengths: torch.Tensor,
               max_length: int) -> DrafterCache:
        """The batch's drafter context as a dense cache: request b's first ``lengths[b]`` tokens.

        ``req_to_token`` [reqs, max_context] (SGLang's slot table); ``req_pool_indices`` / ``lengths`` [B];
        ``max_length``: an upper bound of ``lengths`` known on the host (no device sync). Positions past a
        request's length read the padding slot and are masked by the drafter through ``lengths``.
        """
        dev = self.k[0].device
        cols = torch.arange(max_length, device=dev)
        lengths = lengths.to(dev, torch.long)
        slots = req_to_token[req_pool_indices.to(dev).long()[:, None], cols[None, :]].long()  # [B, C]
        slots = torch.where(cols[None, :] < lengths[:, None], slots, PAD_SLOT)
        keys = [k_buf[slots].permute(0, 2, 1, 3) for k_buf in self.k]  # [B, kv, C, d]
        values = [v_buf[slots].permute(0, 2, 1, 3) for v_buf in self.v]
        return DrafterCache(keys, values, lengths)


def committed_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    counts: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots and positions of the rows a step committed: request b's ``counts[b]`` rows at positions
    ``seq_lens[b] + j`` (j < counts[b]); the rest of the ``width`` columns go to the padding slot.
    Returns (slots [B * width], positions [B * width]), fixed shapes, no host sync."""
    dev = seq_lens.device
    j = torch.arange(width, device=dev)[None, :]
    pos = seq_lens.long()[:, None] + j
    valid = j < counts.to(dev)[:, None]
    rows = req_pool_indices.long()[:, None].expand(-1, width)
    slots = req_to_token[rows, pos.clamp(max=req_to_token.shape[1] - 1)].long()
    return torch.where(valid, slots, PAD_SLOT).reshape(-1), pos.reshape(-1)


# -------------------------------------------------------------------------------------------- memory accounting
def drafter_cell_bytes_from_checkpoint(path: str | Path, dtype: torch.dtype) -> int:
    """Draft pool bytes per token for the drafter checkpoint at ``path`` in ``dtype``."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return draft_cell_bytes(int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads", heads)), head_dim,
                            dtype)


def _add_draft_cell(result: Any, configurator: Any, kvc: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of SGLang's ``DefaultPoolConfigurator.__init__``: the per-token cell size SGLang divides its
    KV budget by gains the draft pool's bytes per token, so both pools fit the budget (where the drafter is among
    the worker's sources, ``GLANCE_DRAFT_SOURCES``: without it there is no draft pool)."""
    from sglang.srt.runtime_context import get_spec

    from . import ALGORITHM
    from .settings import WorkerSettings

    algo = getattr(kvc, "spec_algorithm", None)
    if getattr(kvc, "is_draft_worker", False) or getattr(algo, "name", None) != ALGORITHM:
        return None
    if "drafter" not in WorkerSettings.from_env().draft_sources:
        return None  # n-gram candidates alone: the worker allocates no draft pool (GlanceWorker.alloc_memory_pool)
    path = get_spec().speculative_draft_model_path
    dtype = getattr(kvc.model_config, "dtype", torch.float32)
    extra = drafter_cell_bytes_from_checkpoint(path, dtype)
    configurator._cell_size += extra
    logger.info("GLANCE: %d bytes per token added to the KV cell size for the draft KV pool", extra)
    return None


def install_memory_accounting() -> None:
    """Register the cell-size hook with SGLang's HookRegistry (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    target = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__"
    if not any(hook is _add_draft_cell for _, hook, _ in HookRegistry._hooks.get(target, [])):
        HookRegistry.register(target, _add_draft_cell, HookType.AFTER)
    HookRegistry.apply_hooks()  # idempotent; also when registered outside load_plugins (tests, scripts)


__all__ = ["DraftKVPool", "committed_slots", "draft_cell_bytes", "drafter_cell_bytes_from_checkpoint",
           "install_memory_accounting", "PAD_SLOT"]
