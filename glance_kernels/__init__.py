"""glance_kernels: the device-side pieces of a GLANCE verification round.

One dispatcher for every kernel: the Triton kernel (:mod:`glance_kernels.triton_ops`) when the inputs live on
CUDA, the torch reference (:mod:`glance_kernels.reference`) elsewhere. ``GLANCE_KERNELS_BACKEND`` (``auto``,
``triton``, ``torch``) or the :func:`backend` context manager overrides the choice; forcing Triton on CPU
tensors needs ``TRITON_INTERPRET=1`` in the environment before the first kernel call (the tests do this).

Kernels (shapes in the function docstrings):

- :func:`tree_meta`: parent rows -> ancestor mask (the query-only ``[bs, N, N]`` layout), positions,
  first-child / next-sibling pointers (SGLang's ``retrive_next_token`` / ``retrive_next_sibling``).
- :func:`full_mask`: tree mask + per-request prefix lengths -> SGLang's flat FULL mask for TARGET_VERIFY (the
  SGLang worker's verify input on GPU; FlashInfer packs it itself).
- :func:`compact_kv`: move the accepted rows to the front of each verify window in a paged KV cache.
- :func:`budget_tree`: the best-first budget tree from per-offset top-k, equal to ``glance_sgl.tree.build_tree``
  (the SGLang worker's drafter pass on device), as a ``glance_sgl.tree.DraftTree``.

Each kernel serves an engine; the greedy walk itself is ``glance_sgl.verify`` (one implementation).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from . import reference
from glance_sgl.tree import DraftTree

from .reference import TreeMeta, mask_indptr

__all__ = ["TreeMeta", "backend", "budget_tree", "compact_kv", "full_mask", "mask_indptr", "tree_meta", "use_triton"]

BACKEND_ENV = "GLANCE_KERNELS_BACKEND"
_BACKENDS = ("auto", "triton", "torch")
_forced: list[str] = []


def _backend_from_env() -> str:
    """The process-wide default backend, read once at import (a bad value fails there, naming the variable)."""
    mode = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if mode not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {_BACKENDS}, not {mode!r}")
    return mode


_DEFAULT = _backend_from_env()


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Force a backend (``auto``, ``triton`` or ``torch``) inside a ``with`` block."""
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, not {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the dispatcher runs the Triton kernel for these inputs."""
    mode = _forced[-1] if _forced else _DEFAULT
    if mode == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if mode == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton on CPU tensors needs TRITON_INTERPRET=1 set before the first kernel call")
    return mode == "triton" or on_cuda


def _triton():  # imported on first use, so that TRITON_INTERPRET set by the caller is honoured
    from . import triton_ops

    return triton_ops


def _host_list(prefix_lens: torch.Tensor, prefix_cpu: Sequence[int] | None) -> list[int]:
    return [int(p) for p in (prefix_lens.tolist() if prefix_cpu is None else prefix_cpu)]


def tree_meta(parents: torch.Tensor, prefix_lens: torch.Tensor | None = None, pointers: bool = True) -> TreeMeta:
    """Ancestor mask (bool [bs, N, N]), positions (``prefix + depth``, long [bs, N]) and first-child /
    next-sibling pointers (long [bs, N], -1 where none) from parent rows (long [bs, N], -1 for the root).

    ``pointers=False`` lets the torch path skip the pointers (None then); the Triton kernel computes all of it
    in the same pass, so it always returns them."""
    if use_triton(parents):
        return _triton().tree_meta(parents, prefix_lens)
    return reference.tree_meta(parents, prefix_lens, pointers=pointers)


def full_mask(
    tree_mask: torch.Tensor, prefix_lens: torch.Tensor, prefix_cpu: Sequence[int] | None = None
) -> torch.Tensor:
    """SGLang's flat bool FULL verify mask: per request ``N x (prefix + N)`` row-major, concatenated.

    ``tree_mask`` bool [bs, N, N]; ``prefix_lens`` [bs] on the device; ``prefix_cpu`` the same lengths on the
    host (sizes the output without a device sync). Segment offsets: ``mask_indptr(N, prefix_cpu)``.
    """
    host = _host_list(prefix_lens, prefix_cpu)
    if use_triton(tree_mask):
        return _triton().full_mask(tree_mask, prefix_lens, host)
    return reference.full_mask(tree_mask, host)


def compact_kv(
    caches: Sequence[torch.Tensor],
    page_table: torch.Tensor,
    page_size: int,
    prefix_lens: torch.Tensor,
    accepted_rows: torch.Tensor,
) -> torch.Tensor:
    """Move the accepted rows to the front of each request's verify window, in place, in every cache.

    ``caches``: contiguous tensors [num_slots, ...] (a paged ``[pages, page_size, H, D]`` cache as
    ``cache.flatten(0, 1)``); ``page_table`` [bs, max_pages] page ids; ``prefix_lens`` [bs] (the root sits at
    position ``prefix_lens[b]``); ``accepted_rows`` [bs, W] (the walk's rows, root first, -1 padding). Returns the new
    sequence lengths [bs] (prefix + root + accepted nodes).
    """
    if use_triton(accepted_rows, *caches):
        return _triton().compact_kv(caches, page_table, page_size, prefix_lens, accepted_rows)
    return reference.compact_kv(caches, page_table, page_size, prefix_lens, accepted_rows)


def budget_tree(
    topk_values: torch.Tensor, topk_ids: torch.Tensor, root_tokens: torch.Tensor, budget: int
) -> DraftTree:
    """The best-first budget tree of ``glance_sgl.tree.build_tree`` on device (same nodes, same order).

    ``topk_values`` / ``topk_ids``: [bs, D, k], sorted decreasing (``glance_sgl.tree.topk_per_offset``);
    ``root_tokens`` [bs]. Keeps ``min(budget, max_tree_size(D, k))`` nodes: fields [bs, n + 1].
    """
    from glance_sgl.tree import max_tree_size

    n = min(int(budget), max_tree_size(topk_ids.shape[1], topk_ids.shape[2]))
    if use_triton(topk_values, topk_ids):
        return _triton().budget_tree(topk_values, topk_ids, root_tokens, n)
    return reference.budget_tree(topk_values, topk_ids, root_tokens, n)
