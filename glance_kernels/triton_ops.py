"""Triton kernels of a verification round, with their launchers.

Imported lazily by the dispatcher (:mod:`glance_kernels`), so that ``TRITON_INTERPRET=1`` set by a CPU caller
before the first kernel call takes effect. Every launcher returns exactly what its torch reference in
:mod:`glance_kernels.reference` returns; shapes are documented there. Grids are small on purpose (one program
per request, or per block of requests), and every kernel is synchronisation-free on the host, except where a
launcher needs an output size (the masks: pass the prefix lengths as a host list to avoid the sync).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from glance_sgl.tree import DraftTree

from .reference import TreeMeta, mask_indptr


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


# ---------------------------------------------------------------------------------------------- tree metadata


@triton.jit
def _tree_meta_kernel(parents_ptr, prefix_ptr, mask_ptr, pos_ptr, first_ptr, next_ptr, N, BLOCK_N: tl.constexpr):
    """One program per request: ancestor mask (pointer chase, one step per tree level), positions, pointers."""
    b = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK_N)
    row = idx[:, None]
    col = idx[None, :]
    inb = idx < N
    base = parents_ptr + b * N
    par = tl.load(base + idx, mask=inb, other=-2).to(tl.int64)  # -2 on padding: matches no row, not the root
    anc = (row == col) & (row < N)
    cur = tl.where(inb, par, -1)
    while tl.max(cur) >= 0:
        anc = anc | ((col == cur[:, None]) & (cur[:, None] >= 0))
        cur = tl.load(base + tl.where(cur >= 0, cur, 0), mask=cur >= 0, other=-1).to(tl.int64)
    depth = tl.sum(anc.to(tl.int32), axis=1) - 1
    positions = depth.to(tl.int64) + tl.load(prefix_ptr + b).to(tl.int64)
    first = tl.min(tl.where(par[None, :] == row, col, N), axis=1)
    same = (par[None, :] == par[:, None]) & (col > row) & (par[:, None] >= 0)
    nxt = tl.min(tl.where(same, col, N), axis=1)
    tl.store(mask_ptr + b * N * N + row * N + col, anc.to(tl.uint8), mask=(row < N) & (col < N))
    tl.store(pos_ptr + b * N + idx, positions, mask=inb)
    tl.store(first_ptr + b * N + idx, tl.where(first < N, first, -1).to(tl.int64), mask=inb)
    tl.store(next_ptr + b * N + idx, tl.where(nxt < N, nxt, -1).to(tl.int64), mask=inb)


def tree_meta(parents: torch.Tensor, prefix_lens: torch.Tensor | None = None) -> TreeMeta:
    bs, n = parents.shape
    dev = parents.device
    parents = parents.contiguous()
    prefix = torch.zeros(bs, dtype=torch.long, device=dev) if prefix_lens is None else prefix_lens.contiguous()
    mask = torch.empty(bs, n, n, dtype=torch.uint8, device=dev)
    pos, first, nxt = (torch.empty(bs, n, dtype=torch.long, device=dev) for _ in range(3))
    if bs:
        _tree_meta_kernel[(bs,)](parents, prefix, mask, pos, first, nxt, n, BLOCK_N=_pow2(n, 16))
    return TreeMeta(mask.view(torch.bool), pos, first, nxt)


# ---------------------------------------------------------------------------------------------- masks


@triton.jit
def _full_bits(tree_ptr, b, p, prefix, N):
    """Bits ``p`` (any shape, int64) of request ``b``'s FULL segment: N rows of ``prefix + N`` columns."""
    width = prefix + N
    valid = p < N * width
    i = p // width
    c = p % width
    in_tree = valid & (c >= prefix)
    t = tl.load(tree_ptr + b * N * N + i * N + tl.where(in_tree, c - prefix, 0), mask=in_tree, other=0)
    return valid & ((c < prefix) | (t != 0))


@triton.jit
def _full_mask_kernel(tree_ptr, prefix_ptr, indptr_ptr, out_ptr, N, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    prefix = tl.load(prefix_ptr + b).to(tl.int64)
    bits = _full_bits(tree_ptr, b, p, prefix, N)
    start = tl.load(indptr_ptr + b).to(tl.int64)
    tl.store(out_ptr + start + p, bits.to(tl.uint8), mask=p < N * (prefix + N))


_MASK_BITS_PER_PROGRAM = 4096


def full_mask(tree_mask: torch.Tensor, prefix_lens: torch.Tensor, prefix_cpu: Sequence[int]) -> torch.Tensor:
    bs, n, _ = tree_mask.shape
    dev = tree_mask.device
    indptr = mask_indptr(n, prefix_cpu)
    out = torch.empty(indptr[-1], dtype=torch.uint8, device=dev)
    longest = max((n * (int(p) + n) for p in prefix_cpu), default=0)
    if bs and longest:
        grid = (bs, triton.cdiv(longest, _MASK_BITS_PER_PROGRAM))
        _full_mask_kernel[grid](tree_mask.contiguous().view(torch.uint8), prefix_lens.contiguous(),
                                torch.tensor(indptr, dtype=torch.long, device=dev), out, n,
                                BLOCK=_MASK_BITS_PER_PROGRAM)
    return out.view(torch.bool)


# ---------------------------------------------------------------------------------------------- KV compaction


@triton.jit
def _compact_kv_kernel(
    cache_ptr, table_ptr, table_stride, prefix_ptr, rows_ptr, W, F, page_size,
    BLOCK_W: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """Program (request, feature block): gather every accepted row of the block, barrier, then scatter, so an
    in-place move never reads a slot already overwritten (accepted row j lands on window slot j <= row j)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_W).to(tl.int64)
    row = tl.load(rows_ptr + b * W + j, mask=j < W, other=-1).to(tl.int64)
    valid = row >= 0
    prefix = tl.load(prefix_ptr + b).to(tl.int64)
    src_pos = prefix + tl.where(valid, row, 0)
    dst_pos = prefix + j
    table = table_ptr + b * table_stride
    src = tl.load(table + src_pos // page_size, mask=valid, other=0).to(tl.int64) * page_size + src_pos % page_size
    dst = tl.load(table + dst_pos // page_size, mask=valid, other=0).to(tl.int64) * page_size + dst_pos % page_size
    move = valid & (src != dst)
    f = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = move[:, None] & (f < F)[None, :]
    x = tl.load(cache_ptr + src[:, None] * F + f[None, :], mask=m)
    tl.debug_barrier()
    tl.store(cache_ptr + dst[:, None] * F + f[None, :], x, mask=m)


def compact_kv(
    caches: Sequence[torch.Tensor],
    page_table: torch.Tensor,
    page_size: int,
    prefix_lens: torch.Tensor,
    accepted_rows: torch.Tensor,
) -> torch.Tensor:
    bs, w = accepted_rows.shape
    rows = accepted_rows.contiguous()
    prefix = prefix_lens.contiguous()
    table = page_table.contiguous()
    for cache in caches:
        if not cache.is_contiguous():
            raise ValueError("compact_kv needs contiguous caches (it moves whole token slots)")
        feat = cache[0].numel()
        block_f = min(_pow2(feat, 16), 1024)
        if bs:
            grid = (bs, triton.cdiv(feat, block_f))
            _compact_kv_kernel[grid](
                cache.view(cache.shape[0], feat), table, table.stride(0), prefix, rows, w, feat, page_size,
                BLOCK_W=_pow2(w, 2), BLOCK_F=block_f,
            )
    return prefix_lens.long() + (accepted_rows >= 0).sum(-1)


# ---------------------------------------------------------------------------------------------- budget tree


@triton.jit
def _budget_tree_kernel(
    vals_ptr, ids_ptr, root_ptr, tok_ptr, par_ptr, dep_ptr, score_ptr, D, K, R, BLOCK_R: tl.constexpr
):
    """One program per request; the frontier formulation of ``reference.budget_tree`` in registers: one entry
    per row (its next child rank and that child's float64 score), R - 1 pops."""
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_R)
    vbase = vals_ptr + b * D * K
    ibase = ids_ptr + b * D * K
    out = b * R
    depth = tl.zeros((BLOCK_R,), dtype=tl.int64)
    score = tl.zeros((BLOCK_R,), dtype=tl.float64)
    rank = tl.zeros((BLOCK_R,), dtype=tl.int64)
    live = rows == 0
    cand = tl.where(live, tl.load(vbase).to(tl.float64), 0.0)
    tl.store(tok_ptr + out, tl.load(root_ptr + b).to(tl.int64))
    tl.store(par_ptr + out, -1)
    tl.store(dep_ptr + out, 0)
    tl.store(score_ptr + out, 0.0)
    for t in range(1, R):
        best = tl.max(tl.where(live, cand, float("-inf")), axis=0)
        pick = tl.min(tl.where(live & (cand == best), rows, BLOCK_R), axis=0)
        at = rows == pick
        d = tl.sum(tl.where(at, depth, 0), axis=0)
        j = tl.sum(tl.where(at, rank, 0), axis=0)
        parent_score = tl.sum(tl.where(at, score, 0.0), axis=0)
        tl.store(tok_ptr + out + t, tl.load(ibase + d * K + j).to(tl.int64))
        tl.store(par_ptr + out + t, pick.to(tl.int64))
        tl.store(dep_ptr + out + t, d + 1)
        tl.store(score_ptr + out + t, best.to(tl.float32))
        # the popped parent moves on to its next child
        more = j + 1 < K
        nxt = tl.load(vbase + d * K + j + 1, mask=more, other=0.0).to(tl.float64)
        rank = tl.where(at, j + 1, rank)
        live = tl.where(at, more, live)
        cand = tl.where(at, parent_score + nxt, cand)
        # the new row offers its best child
        new = rows == t
        deeper = d + 1 < D
        first = tl.load(vbase + (d + 1) * K, mask=deeper, other=0.0).to(tl.float64)
        depth = tl.where(new, d + 1, depth)
        score = tl.where(new, best, score)
        rank = tl.where(new, 0, rank)
        live = tl.where(new, deeper, live)
        cand = tl.where(new, best + first, cand)


def budget_tree(
    topk_values: torch.Tensor, topk_ids: torch.Tensor, root_tokens: torch.Tensor, num_nodes: int
) -> DraftTree:
    bs, d, k = topk_ids.shape
    r = num_nodes + 1
    dev = topk_ids.device
    tokens, parents, depths = (torch.empty(bs, r, dtype=torch.long, device=dev) for _ in range(3))
    scores = torch.empty(bs, r, dtype=torch.float32, device=dev)
    if bs:
        _budget_tree_kernel[(bs,)](
            topk_values.contiguous(), topk_ids.contiguous(), root_tokens.contiguous(),
            tokens, parents, depths, scores, d, k, r, BLOCK_R=_pow2(r, 16),
        )
    return DraftTree(tokens, parents, depths, scores)
