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

from glance_sgl.tree import ancestor_mask, tree_pointers


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


class VerifyResult(NamedTuple):
    """Outcome of greedy verification.

    accepted_rows: long [bs, W], the accepted path as tree rows starting with the root (row 0), -1 padding
    accept_lens:   long [bs], accepted drafted nodes (root and bonus excluded)
    bonus:         long [bs], the target's choice after the last accepted row
    """

    accepted_rows: torch.Tensor
    accept_lens: torch.Tensor
    bonus: torch.Tensor


class DeviceTree(NamedTuple):
    """A batch of budget trees built on device; the fields of ``glance_sgl.tree.DraftTree``.

    tokens:  long [bs, n+1] (row 0 = root)
    parents: long [bs, n+1] (-1 for the root)
    depths:  long [bs, n+1]
    scores:  float32 [bs, n+1] (cumulative log-probability, 0 at the root)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor


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


def mask_indptr(num_rows: int, prefix_lens: Sequence[int], packed: bool) -> list[int]:
    """Offsets of each request's segment in the flat FULL mask (bits) or in the packed mask (bytes)."""
    out = [0]
    for p in prefix_lens:
        bits = num_rows * (int(p) + num_rows)
        out.append(out[-1] + ((bits + 7) // 8 if packed else bits))
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


def _segments(num_rows: int, prefix_lens: Sequence[int], packed: bool, device: torch.device):
    """Every flat offset of the FULL layout (bits, or bytes when ``packed``) with its request, its offset inside
    that request's segment, and the requests' prefix lengths: (request [L], local offset [L], prefix [bs])."""
    indptr = mask_indptr(num_rows, prefix_lens, packed=packed)
    flat = torch.arange(indptr[-1], device=device)
    b = _segment_of(flat, indptr, device)
    start = torch.tensor(indptr[:-1], dtype=torch.long, device=device)
    prefix = torch.tensor([int(x) for x in prefix_lens], dtype=torch.long, device=device)
    return b, flat - start[b], prefix


def full_mask(tree_mask: torch.Tensor, prefix_lens: Sequence[int]) -> torch.Tensor:
    """SGLang's flat bool FULL mask for TARGET_VERIFY: per request ``N x (prefix + N)`` (the prefix all True,
    then the tree mask), row-major, concatenated over requests. ``tree_mask`` bool [bs, N, N] -> [sum]."""
    b, local, prefix = _segments(tree_mask.shape[1], prefix_lens, False, tree_mask.device)
    return _full_bits(tree_mask.bool(), prefix, b, local)


def packbits_little(bits: torch.Tensor) -> torch.Tensor:
    """``numpy.packbits(bits, bitorder="little")`` in torch: bool/int [L] -> uint8 [ceil(L/8)]."""
    length = bits.numel()
    padded = torch.zeros((length + 7) // 8 * 8, dtype=torch.uint8, device=bits.device)
    padded[:length] = bits.reshape(-1).ne(0).to(torch.uint8)
    weights = (1 << torch.arange(8, device=bits.device, dtype=torch.int32)).to(torch.uint8)
    return (padded.view(-1, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def segment_packbits(bits: torch.Tensor, indptr: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """FlashInfer's ``segment_packbits(bits, indptr, bitorder="little")``: each segment packed on its own (padded
    to a byte). Returns (uint8 [new_indptr[-1]], new_indptr)."""
    segs = [packbits_little(bits[int(indptr[i]) : int(indptr[i + 1])]) for i in range(len(indptr) - 1)]
    new = [0]
    for s in segs:
        new.append(new[-1] + s.numel())
    return (torch.cat(segs) if segs else bits.new_zeros(0, dtype=torch.uint8)), new


def packed_mask(tree_mask: torch.Tensor, prefix_lens: Sequence[int]) -> torch.Tensor:
    """FlashInfer's packed custom mask: each request's FULL segment packed little-endian on its own.
    ``tree_mask`` bool [bs, N, N] -> uint8 [sum_b ceil(N (prefix_b + N) / 8)]."""
    dev = tree_mask.device
    b, local_byte, prefix = _segments(tree_mask.shape[1], prefix_lens, True, dev)
    p = local_byte[:, None] * 8 + torch.arange(8, device=dev)
    bits = _full_bits(tree_mask.bool(), prefix, b[:, None].expand_as(p), p)
    return packbits_little(bits.flatten())


# ---------------------------------------------------------------------------------------------- verify


def verify_greedy(
    candidates: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    width: int | None = None,
) -> VerifyResult:
    """Greedy walk over first-child / next-sibling pointers (SGLang's ``verify_tree_greedy`` semantics).

    ``candidates`` / ``first_child`` / ``next_sibling`` / ``target_predict``: [bs, N] (tokens per row, pointers,
    the target's argmax per row). ``width``: columns of ``accepted_rows`` (at most ``width - 1`` nodes are
    accepted, like SGLang's ``num_speculative_tokens``); default N (no cap). One step per visited row, N steps.
    """
    bs, n = candidates.shape
    width = n if width is None else width
    dev = candidates.device
    batch = torch.arange(bs, device=dev)
    cur = torch.zeros(bs, dtype=torch.long, device=dev)  # last accepted row
    cand = first_child[:, 0].long()  # child of ``cur`` being compared
    lens = torch.zeros(bs, dtype=torch.long, device=dev)
    rows = torch.full((bs, width), -1, dtype=torch.long, device=dev)
    rows[:, 0] = 0
    for _ in range(n):
        live = (cand >= 0) & (lens < width - 1)
        safe = cand.clamp(min=0)
        hit = live & (candidates[batch, safe] == target_predict[batch, cur])
        lens = lens + hit.long()
        col = torch.where(hit, lens, torch.zeros_like(lens))
        rows[batch, col] = torch.where(hit, safe, rows[batch, col])
        cur = torch.where(hit, safe, cur)
        cand = torch.where(hit, first_child[batch, safe].long(), torch.where(live, next_sibling[batch, safe].long(), cand))
        cand = torch.where(live | hit, cand, torch.full_like(cand, -1))
    return VerifyResult(rows, lens, target_predict[batch, cur].long())


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
    # fixed shapes (no boolean indexing, which syncs a device): padding columns copy slot 0 onto itself, rows
    # already in place copy onto themselves
    src, dst = torch.where(valid, src, 0).reshape(-1), torch.where(valid, dst, 0).reshape(-1)
    for cache in caches:
        cache[dst] = cache[src]  # the right side is gathered before any write
    return prefix_lens.long() + valid.sum(-1)


# ---------------------------------------------------------------------------------------------- budget tree


def budget_tree(
    topk_values: torch.Tensor, topk_ids: torch.Tensor, root_tokens: torch.Tensor, num_nodes: int
) -> DeviceTree:
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
    return DeviceTree(tokens, parents, depths, scores.float())
