"""Candidate trees from one-pass per-offset marginals (design §1, "Candidate tree").

A tree is packed as rows ``[root] + nodes``: row 0 is the root (the last committed token), rows 1..N are
drafted nodes in best-first order, so every parent precedes its children. Node scores are sums of per-offset
log-probabilities along the path (offsets treated as independent); the N nodes kept are the N best of the
(infinite) candidate tree, which is prefix-closed because scores only decrease with depth.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A batch of packed trees, all with the same number of rows ``N + 1``.

    tokens:  [B, N+1] long, row 0 = root token
    parents: [B, N+1] long, parent row of each row (-1 for the root)
    depths:  [B, N+1] long, 0 for the root; a node at depth d drafts offset d (the token d steps after the root)
    scores:  [B, N+1] float32, cumulative log-probability of the path (0 at the root)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1] - 1

    def prefix(self, rows: int) -> "DraftTree":
        """The first ``rows`` rows (root included): a best-first tree's prefix is the best-first tree of budget
        ``rows - 1``, prefix-closed because parents precede children."""
        if rows >= self.num_rows:
            return self
        return DraftTree(self.tokens[:, :rows], self.parents[:, :rows], self.depths[:, :rows], self.scores[:, :rows])

    def ancestor_mask(self) -> torch.Tensor:
        return ancestor_mask(self.parents)

    def pointers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return tree_pointers(self.parents)


def max_tree_size(max_depth: int, branch_k: int) -> int:
    """Number of nodes of the full k-ary candidate tree of depth ``max_depth`` (the largest useful budget)."""
    if branch_k == 1:
        return max_depth
    total, level = 0, 1
    for _ in range(max_depth):
        level *= branch_k
        total += level
        if total > 1 << 20:
            break
    return total


def topk_per_offset(logprobs: torch.Tensor, branch_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each offset's distribution. ``logprobs`` [B, D, V] -> (values, token ids), each [B, D, k],
    sorted by decreasing log-probability."""
    k = min(branch_k, logprobs.shape[-1])
    values, ids = torch.topk(logprobs.float(), k, dim=-1, sorted=True)
    return values, ids


def build_tree(
    topk_values: torch.Tensor, topk_ids: torch.Tensor, root_tokens: torch.Tensor, budget: int
) -> DraftTree:
    """Best-first budget tree over per-offset top-k lists.

    ``topk_values`` / ``topk_ids``: [B, D, k] (sorted, offset d-1 in row d-1 drafts depth d); ``root_tokens``:
    [B]. Keeps ``min(budget, max_tree_size(D, k))`` nodes per request. Ties pop in insertion order (a node's
    k children are pushed in top-k order), so the result is deterministic.
    """
    bs, depth_max, k = topk_ids.shape
    n = min(budget, max_tree_size(depth_max, k))
    vals = topk_values.detach().float().cpu().tolist()
    ids = topk_ids.detach().cpu().tolist()
    roots = root_tokens.detach().cpu().tolist()
    # plain lists, one tensor each at the end: per-element tensor writes cost more than the whole search
    tokens, parents, depths, scores = [], [], [], []
    for b in range(bs):
        v, t = vals[b], ids[b]
        tok, par, dep, sco = [roots[b]], [-1], [0], [0.0]
        # heap entries: (-score, tie-break counter, parent row, depth, rank in the depth's top-k list)
        heap = [(-v[0][j], j, 0, 1, j) for j in range(k)]
        heapq.heapify(heap)
        counter = k
        for row in range(1, n + 1):
            neg, _, parent, d, j = heapq.heappop(heap)
            tok.append(t[d - 1][j])
            par.append(parent)
            dep.append(d)
            sco.append(-neg)
            if d < depth_max:
                for jj in range(k):
                    heapq.heappush(heap, (neg - v[d][jj], counter, row, d + 1, jj))
                    counter += 1
        tokens.append(tok)
        parents.append(par)
        depths.append(dep)
        scores.append(sco)
    dev = topk_ids.device
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long, device=dev), torch.tensor(parents, dtype=torch.long, device=dev),
        torch.tensor(depths, dtype=torch.long, device=dev), torch.tensor(scores, dtype=torch.float32, device=dev),
    )


def chain_tree(topk_values: torch.Tensor, topk_ids: torch.Tensor, root_tokens: torch.Tensor) -> DraftTree:
    """The width-1 ablation: the greedy spine (top-1 at every offset), depth D."""
    return build_tree(topk_values[..., :1], topk_ids[..., :1], root_tokens, budget=topk_ids.shape[1])


SQUARING_MAX_ROWS = 64  # above this, R^3 matmuls cost more than one scatter per tree level


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, R] parent rows -> bool [B, R, R]; ``mask[b, i, j]`` is True iff row j is row i or an ancestor of it.

    Small packed trees on the host (the per-round case): one pass over plain lists. Other small trees:
    reachability by repeated squaring of ``I + parent one-hot`` (ceil(log2 R) tiny matmuls). Large trees: walk up
    one level at a time (one scatter + gather per level). The last two accept rows in any order.
    """
    bs, r = parents.shape
    if r <= SQUARING_MAX_ROWS and parents.device.type == "cpu":
        packed = parents.tolist()
        if all(p < i for par in packed for i, p in enumerate(par)):  # parents precede children
            return torch.tensor([_ancestor_rows(par) for par in packed], dtype=torch.bool)
    if r <= SQUARING_MAX_ROWS:
        reach = torch.eye(r, dtype=torch.float32, device=parents.device).expand(bs, r, r).clone()
        batch, rows = (parents >= 0).nonzero(as_tuple=True)
        reach[batch, rows, parents[batch, rows]] = 1.0
        span = 1  # reach covers ancestors up to `span` levels up
        while span < r - 1:
            reach = torch.bmm(reach, reach).clamp_(max=1.0)
            span *= 2
        return reach.bool()
    mask = torch.zeros(bs, r, r + 1, dtype=torch.bool, device=parents.device)  # column r: "no ancestor here"
    mask.scatter_(2, torch.arange(r, device=parents.device).expand(bs, r)[..., None], True)
    cur = parents
    while bool((cur >= 0).any()):
        mask.scatter_(2, torch.where(cur >= 0, cur, r)[..., None], True)
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), cur)
    return mask[..., :r]


def _ancestor_rows(parents: list[int]) -> list[list[bool]]:
    """One packed tree's ancestor mask as plain lists (every parent row before its children): on the host this
    one pass is cheaper than a dozen tiny tensor ops."""
    mask: list[list[bool]] = []
    for i, p in enumerate(parents):
        row = mask[p].copy() if p >= 0 else [False] * len(parents)
        row[i] = True
        mask.append(row)
    return mask


def tree_pointers(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child and next-sibling pointers (SGLang's ``retrive_next_token`` / ``retrive_next_sibling``).

    First child = the smallest row whose parent is this row; next sibling = the smallest later row with the
    same parent. -1 where none. ``parents`` [B, R] -> two [B, R] long tensors.
    """
    bs, r = parents.shape
    rows = torch.arange(r, device=parents.device)
    big = torch.full((bs, r, r), r, dtype=torch.long, device=parents.device)
    # is_child[b, p, c]: row c's parent is p
    is_child = parents[:, None, :] == rows[None, :, None]
    first_child = torch.where(is_child, rows[None, None, :].expand(bs, r, r), big).min(dim=-1).values
    # later sibling[b, i, c]: c > i and parent[c] == parent[i] (roots have no siblings)
    same_parent = (parents[:, :, None] == parents[:, None, :]) & (parents[:, :, None] >= 0)
    later = rows[None, None, :] > rows[None, :, None]
    next_sibling = torch.where(same_parent & later, rows[None, None, :].expand(bs, r, r), big).min(dim=-1).values
    first_child = torch.where(first_child == r, -1, first_child)
    next_sibling = torch.where(next_sibling == r, -1, next_sibling)
    return first_child, next_sibling
