"""Torch references of the verification kernels (the CPU path of the dispatcher, and the tests' oracle).

Every function here is batched, device-agnostic torch code without host synchronisation unless a docstring
says otherwise; the Triton kernels in :mod:`glance_kernels.triton_ops` must agree with them exactly.

Conventions (shared with ``glance_sgl.tree`` and SGLang's NGRAM / EAGLE verify path):

- A tree is packed as ``N`` rows ``[root] + nodes``; ``parents[b, i]`` is the parent row (-1 for the root) and
  every parent precedes its children.
- ``tree_mask[b, i, j]`` (bool ``[bs, N, N]``) is True iff row ``j`` is row ``i`` or one of its ancestors: the
  query-only ("QLEN") layout.
- ``first_child`` / ``next_sibling`` are SGLang's ``retrive_next_token`` / ``retrive_next_sibling``: the smallest
  child row / the smallest later row with the same parent, -1 where none.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from glance_sgl.tree import DraftTree, ancestor_mask, tree_pointers


class TreeMeta(NamedTuple):
    """Per-row metadata of a batch of packed trees.

    tree_mask:    bool [bs, N, N], row j is row i or an ancestor of it
    positions:    long [bs, N], ``prefix_len + depth``
    first_child:  long [bs, N] (None when not asked for)
    next_sibling: long [bs, N] (None when not asked for)
    """

    tree_mask: torch.Tensor
    positions: torch.Tensor
    first_child: torch.Tensor | None
    next_sibling: torch.Tensor | None


# ---------------------------------------------------------------------------------------------- tree metadata


def tree_meta(parents: torch.Tensor, prefix_lens: torch.Tensor | None = None, pointers: bool = True) -> TreeMeta:
    """Ancestor mask, positions and first-child / next-sibling pointers from parent rows.

    ``parents``: long [bs, N]; ``prefix_lens``: [bs] (committed tokens before the root; zeros when None);
    ``pointers``: False skips the pointers (None), which only SGLang's verify kernel reads.
    The algorithm is ``glance_sgl.tree``'s (one implementation); its level loop syncs with the host once per
    tree level, which the CPU path of the dispatcher does not mind (the Triton kernel has no sync).
    """
    parents = parents.long()
    mask = ancestor_mask(parents)
    depth = mask.sum(-1) - 1
    base = torch.zeros(parents.shape[0], dtype=torch.long, device=parents.device) if prefix_lens is None else prefix_lens.long()
    first_child, next_sibling = tree_pointers(parents) if pointers else (None, None)
    return TreeMeta(mask, depth + base[:, None], first_child, next_sibling)


# ---------------------------------------------------------------------------------------------- masks


SMALL_BATCH = 4  # off a CPU, up to this many requests full_mask is built per request (beyond: flat gathers)


def mask_indptr(num_rows: int, prefix_lens: Sequence[int]) -> list[int]:
    """Offsets of each request's segment in the flat FULL mask (bits): request b spans
    ``num_rows * (prefix_b + num_rows)`` bits."""
    out = [0]
    for p in prefix_lens:
        out.append(out[-1] + num_rows * (int(p) + num_rows))
    return out


def _segment_of(offsets: torch.Tensor, indptr: Sequence[int], device: torch.device) -> torch.Tensor:
    """Request of each flat offset, given segment offsets ``indptr`` [bs + 1]."""
    bounds = torch.tensor([int(x) for x in indptr[1:]], dtype=torch.long, device=device)
    return torch.searchsorted(bounds, offsets, right=True)


def _full_bits(tree_mask: torch.Tensor, prefix: torch.Tensor, b: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Bit ``p`` of request ``b``'s FULL segment (``N`` rows of ``prefix + N`` columns); False past its end."""
    n = tree_mask.shape[1]
    width = prefix[b] + n
    valid = p < n * width
    i, c = (p // width).clamp(max=n - 1), p % width
    in_tree = tree_mask[b, i, (c - prefix[b]).clamp(0, n - 1)]
    return valid & ((c < prefix[b]) | in_tree)


def _segments(num_rows: int, prefix_lens: Sequence[int], device: torch.device):
    """Every flat bit of the FULL layout with its request, its offset inside that request's segment, and the
    requests' prefix lengths: (request [L], local offset [L], prefix [bs])."""
    indptr = mask_indptr(num_rows, prefix_lens)
    flat = torch.arange(indptr[-1], device=device)
    b = _segment_of(flat, indptr, device)
    start = torch.tensor(indptr[:-1], dtype=torch.long, device=device)
    prefix = torch.tensor([int(x) for x in prefix_lens], dtype=torch.long, device=device)
    return b, flat - start[b], prefix


def full_mask(tree_mask: torch.Tensor, prefix_lens: Sequence[int]) -> torch.Tensor:
    """SGLang's flat bool FULL mask for TARGET_VERIFY: per request ``N x (prefix + N)`` (the prefix all True,
    then the tree mask), row-major, concatenated over requests. ``tree_mask`` bool [bs, N, N] -> [sum].

    Built per request on a CPU whatever the batch (two ops each: at 300-token prefixes 0.05 ms for 8 requests and
    0.1 ms for 16, where the flat gathers took 0.5 and 1.8 ms, every verify step), and off a CPU for up to
    ``SMALL_BATCH`` requests; beyond that with flat gathers (:func:`full_mask_flat`: a dozen ops whatever the
    batch)."""
    if len(prefix_lens) and (tree_mask.device.type == "cpu" or len(prefix_lens) <= SMALL_BATCH):
        n, mask, parts = tree_mask.shape[1], tree_mask.bool(), []
        for b, p in enumerate(prefix_lens):
            rows = torch.ones(n, int(p) + n, dtype=torch.bool, device=mask.device)
            rows[:, int(p):] = mask[b]
            parts.append(rows.view(-1))
        return torch.cat(parts)
    return full_mask_flat(tree_mask, prefix_lens)


def full_mask_flat(tree_mask: torch.Tensor, prefix_lens: Sequence[int]) -> torch.Tensor:
    """:func:`full_mask` with flat gathers over every bit of the layout (no per-request ops)."""
    b, local, prefix = _segments(tree_mask.shape[1], prefix_lens, tree_mask.device)
    return _full_bits(tree_mask.bool(), prefix, b, local)


# ---------------------------------------------------------------------------------------------- KV compaction


def kv_slots(
    page_table: torch.Tensor, page_size: int, positions: torch.Tensor
) -> torch.Tensor:
    """Cache slot of each token position: ``page_table[b, pos // page_size] * page_size + pos % page_size``.
    ``page_table`` [bs, max_pages]; ``positions`` long [bs, W] (>= 0) -> long [bs, W]."""
    pages = torch.gather(page_table.long(), 1, positions // page_size)
    return pages * page_size + positions % page_size


def compact_kv(
    caches: Sequence[torch.Tensor],
    page_table: torch.Tensor,
    page_size: int,
    prefix_lens: torch.Tensor,
    accepted_rows: torch.Tensor,
) -> torch.Tensor:
    """Move the accepted rows of every request's verify window to its front, in place.

    The verify window of request b holds tree row i at position ``prefix_lens[b] + i``; accepted row j
    (``accepted_rows[b, j]``, -1 padding, row 0 = root) moves to position ``prefix_lens[b] + j``. ``caches``:
    tensors [num_slots, ...] (K and V of every layer; pass a paged ``[pages, page_size, H, D]`` cache as the view
    ``cache.flatten(0, 1)``). Returns the new sequence lengths ``prefix + 1 + accepted nodes`` [bs].
    """
    prefix = prefix_lens.long()[:, None]
    rows = accepted_rows.long()
    valid = rows >= 0
    cols = torch.arange(rows.shape[1], device=rows.device)[None, :]
    src = kv_slots(page_table, page_size, prefix + rows.clamp(min=0))
    dst = kv_slots(page_table, page_size, prefix + cols)
    if rows.device.type == "cpu":  # no device to sync: copy only the rows that move (most stay where they are)
        move = valid & (rows != cols)
        src, dst = src[move], dst[move]
        for cache in caches:
            cache.index_copy_(0, dst, cache.index_select(0, src))
        return prefix_lens.long() + valid.sum(-1)
    # fixed shapes (no boolean indexing, which syncs a device): padding columns copy slot 0 onto itself, rows
    # already in place copy onto themselves
    src, dst = torch.where(valid, src, 0).reshape(-1), torch.where(valid, dst, 0).reshape(-1)
    for cache in caches:
        cache[dst] = cache[src]  # the right side is gathered before any write
    return prefix_lens.long() + valid.sum(-1)


# ---------------------------------------------------------------------------------------------- budget tree


def budget_tree(
    topk_values: torch.Tensor, topk_ids: torch.Tensor, root_tokens: torch.Tensor, num_nodes: int
) -> DraftTree:
    """Best-first budget tree, batched and without host synchronisation; equals ``glance_sgl.tree.build_tree``.

    Formulation: in the best-first heap, a parent's pending children pop in rank order (the top-k lists are
    sorted and ties go to the earlier push), so the heap is equivalent to one *frontier* entry per popped row:
    its next child rank. Each of the ``num_nodes`` steps pops the frontier entry with the highest score, ties to
    the smallest parent row (earlier push), and appends that child as the next row. Scores accumulate in float64
    like the heap's Python floats.

    ``topk_values`` / ``topk_ids``: [bs, D, k], sorted decreasing; ``root_tokens``: [bs]; ``num_nodes``: nodes
    to keep, at most ``max_tree_size(D, k)``. Returns [bs, num_nodes + 1] fields.
    """
    bs, depth_max, k = topk_ids.shape
    r = num_nodes + 1
    dev = topk_ids.device
    vals = topk_values.double()
    ids = topk_ids.long()
    batch = torch.arange(bs, device=dev)
    rows = torch.arange(r, device=dev)[None, :].expand(bs, r)
    tokens = torch.zeros(bs, r, dtype=torch.long, device=dev)
    tokens[:, 0] = root_tokens.long()
    parents = torch.full((bs, r), -1, dtype=torch.long, device=dev)
    depths = torch.zeros(bs, r, dtype=torch.long, device=dev)
    scores = torch.zeros(bs, r, dtype=torch.float64, device=dev)
    rank = torch.zeros(bs, r, dtype=torch.long, device=dev)  # next child rank of each row
    live = rows == 0  # frontier entries: rows whose next child exists
    cand = torch.where(live, vals[:, 0, 0][:, None], torch.zeros_like(scores))  # score of that child
    neg_inf = torch.full_like(scores, float("-inf"))
    for t in range(1, r):
        best = torch.where(live, cand, neg_inf).amax(-1, keepdim=True)
        pick = torch.where(live & (cand == best), rows, r).amin(-1)  # [bs]
        d, j, sc = depths[batch, pick], rank[batch, pick], cand[batch, pick]
        tokens[:, t], parents[:, t], depths[:, t], scores[:, t] = ids[batch, d, j], pick, d + 1, sc
        # the popped parent moves on to its next child
        more = j + 1 < k
        rank[batch, pick] = j + 1
        live[batch, pick] = more
        cand[batch, pick] = scores[batch, pick] + vals[batch, d, (j + 1).clamp(max=k - 1)]
        # the new row offers its best child
        deeper = d + 1 < depth_max
        live[:, t] = deeper
        cand[:, t] = sc + vals[batch, (d + 1).clamp(max=depth_max - 1), 0]
    return DraftTree(tokens, parents, depths, scores.float())
