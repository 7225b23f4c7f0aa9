"""Candidate trees from one-pass per-offset marginals (design §1, "Candidate tree").

A tree is packed as rows ``[root] + nodes``: row 0 is the root (the last committed token), rows 1..N are
drafted nodes in best-first order, so every parent precedes its children. Node scores are sums of per-offset
log-probabilities along the path (offsets treated as independent); the N nodes kept are the N best of the
(infinite) candidate tree, which is prefix-closed because scores only decrease with depth.

Candidate sources (issue 27): every node may carry a source tag, a bitmask of the sources that proposed it
(``SOURCE_DRAFTER``, ``SOURCE_NGRAM``; a node reached by both carries ``SOURCE_BOTH``). ``merge_trees`` merges the
trees of several sources under one row budget: branches with a shared token prefix become one branch, and the
rows kept are the best-scored ones, best-first, so the result keeps the invariants above (prefix-closed, parents
before children, any prefix of it is itself the best-first merged tree of that budget).
``glance_sgl.acceptance.SourceAcceptance`` learns online how often the target takes a node of each source at each
depth, which gives sources without probabilities of their own (n-gram matches) a calibrated score. The walk
(``glance_sgl.verify``) never reads the tags: a merged tree is verified exactly like a drafter tree, so
losslessness does not depend on the sources.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

from .host_transfers import read_stacked

# Source tags: a bitmask per node (a node proposed by several sources carries the OR of their bits).
SOURCE_NONE = 0  # the root (row 0) and the padding rows of a merged batch (never proposed by any source)
SOURCE_DRAFTER = 1  # the block drafter (every node of a tree whose ``sources`` is None)
SOURCE_NGRAM = 2  # n-gram matches (glance_sgl.ngram_source)
SOURCE_BOTH = SOURCE_DRAFTER | SOURCE_NGRAM
SOURCE_NAMES = {SOURCE_DRAFTER: "drafter", SOURCE_NGRAM: "ngram"}


@dataclass
class DraftTree:
    """A batch of packed trees, all with the same number of rows ``N + 1``.

    tokens:  [B, N+1] long, row 0 = root token
    parents: [B, N+1] long, parent row of each row (-1 for the root)
    depths:  [B, N+1] long, 0 for the root; a node at depth d drafts offset d (the token d steps after the root)
    scores:  [B, N+1] float32, cumulative log-probability of the path (0 at the root); in a merged tree the
             estimated log-probability that the walk reaches the node (``merge_trees``); -inf on padding rows
    sources: [B, N+1] long source tags (bitmask of ``SOURCE_*``; ``SOURCE_NONE`` at the root and on padding
             rows), or None: every node is the drafter's (``source_tags()`` fills it in)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    sources: torch.Tensor | None = None

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
        sources = None if self.sources is None else self.sources[:, :rows]
        return DraftTree(self.tokens[:, :rows], self.parents[:, :rows], self.depths[:, :rows], self.scores[:, :rows],
                         sources)

    def truncated(self, rows: Sequence[int]) -> "DraftTree":
        """Each request's first ``rows[b]`` rows (root included, ``rows[b] >= 1``) as they are and its later rows
        detached: no parent (-1: no walk or traversal from the root reaches them), depth 0, token -1 (no target
        choice equals it), score -inf, untagged. A pass verifying ``rows[b]`` rows per request leaves them out; the
        tree itself where every request keeps all its rows."""
        n = self.num_rows
        if min(rows) >= n:
            return self
        dev = self.tokens.device
        cut = torch.arange(n, device=dev)[None, :] >= torch.tensor(list(rows), device=dev)[:, None]
        sources = None if self.sources is None else self.sources.masked_fill(cut, SOURCE_NONE)
        return DraftTree(self.tokens.masked_fill(cut, -1), self.parents.masked_fill(cut, -1),
                         self.depths.masked_fill(cut, 0), self.scores.masked_fill(cut, float("-inf")), sources)

    def to(self, device: torch.device | str) -> "DraftTree":
        """The tree on ``device`` (itself where it is there already)."""
        if self.tokens.device == torch.device(device):
            return self
        return DraftTree(*(None if t is None else t.to(device) for t in
                           (self.tokens, self.parents, self.depths, self.scores, self.sources)))

    def host_copy(self) -> "DraftTree":
        """The tree on the host in one device-to-host read (its fields stacked). A CPU tree is its own host copy;
        it still makes the one read call (a no-op there), so a CPU device counts the reads a GPU makes."""
        if self.tokens.device.type == "cpu":
            self.tokens.cpu()
            return self
        return self._copy_to_host()

    def _copy_to_host(self) -> "DraftTree":
        fields = [self.tokens, self.parents, self.depths, self.scores] + ([] if self.sources is None else [self.sources])
        tok, par, dep, sco, *tag = read_stacked(*fields)
        return DraftTree(tok, par, dep, sco, tag[0] if tag else None)

    def source_tags(self) -> torch.Tensor:
        """[B, N+1] long source tags: ``sources``, or for an untagged (drafter) tree ``SOURCE_DRAFTER`` on every
        node and ``SOURCE_NONE`` at the root."""
        if self.sources is not None:
            return self.sources
        tags = torch.full_like(self.tokens, SOURCE_DRAFTER)
        tags[:, 0] = SOURCE_NONE
        return tags

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
# up to this many mask cells (B * R * R) a host tree's mask is built as plain lists: beyond, converting the lists
# costs more than the squaring (8 trees of 6 rows: 36 us either way; 16 of 12: 194 us vs 49; 1 of 33: 85 vs 49)
HOST_MASK_CELLS = 512


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, R] parent rows -> bool [B, R, R]; ``mask[b, i, j]`` is True iff row j is row i or an ancestor of it.

    A few small packed trees on the host (the embedded engine's round): one pass over plain lists. Other small trees:
    reachability by repeated squaring of ``I + parent one-hot`` (ceil(log2 R) tiny matmuls). Large trees: walk up
    one level at a time (one scatter + gather per level). The last two accept rows in any order.
    """
    bs, r = parents.shape
    if bs * r * r <= HOST_MASK_CELLS and parents.device.type == "cpu":
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
    if r <= SQUARING_MAX_ROWS and parents.device.type == "cpu":  # the per-round case: one pass over host lists
        first, nxt = zip(*(_pointer_rows(par) for par in parents.tolist())) if bs else ((), ())
        return (torch.tensor(first, dtype=torch.long).view(bs, r), torch.tensor(nxt, dtype=torch.long).view(bs, r))
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


def _pointer_rows(parents: list[int]) -> tuple[list[int], list[int]]:
    """One tree's first-child and next-sibling rows (-1 where none) as plain lists, any row order: a row's first
    child is its smallest child row, its next sibling the smallest later row with the same parent."""
    first = [-1] * len(parents)
    nxt = [-1] * len(parents)
    last: dict[int, int] = {}  # parent -> its latest child row seen so far
    for c, p in enumerate(parents):
        if p < 0:
            continue
        if first[p] < 0:
            first[p] = c
        prev = last.get(p)
        if prev is not None:
            nxt[prev] = c
        last[p] = c
    return first, nxt


# ------------------------------------------------------------------------------------------ candidate sources
def is_chain(depths: Sequence[int]) -> bool:
    """Whether a tree whose rows (parents before children, row 0 the root) have these ``depths`` is one chain: its
    last row is as deep as there are rows below the root, so its path holds every row, in row order."""
    return depths[-1] == len(depths) - 1


class CandidateTrie:
    """One request's candidates from any number of sources, as a trie over token paths (host lists).

    Node 0 is the root (the last committed token). ``add(parent, token, score, tag)`` returns the child of
    ``parent`` carrying ``token``, creating it if no source proposed it yet; a node proposed again keeps the best
    score and the OR of the tags. Nodes are numbered in creation order, so every parent precedes its children and
    siblings carry distinct tokens. ``best_first(n)`` packs the best ``n`` nodes as rows.
    """

    __slots__ = ("tokens", "parents", "depths", "scores", "tags", "children", "_index")

    def __init__(self, root: int) -> None:
        self.tokens: list[int] = [int(root)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.scores: list[float] = [0.0]
        self.tags: list[int] = [SOURCE_NONE]
        self.children: list[list[int]] = [[]]
        self._index: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        """Nodes, the root included."""
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float, tag: int) -> int:
        """The node for ``token`` under node ``parent`` (created if new); ``score`` a log-probability (NaN reads
        as -inf), ``tag`` a ``SOURCE_*`` bitmask. Returns the node's index."""
        if score != score:
            score = float("-inf")
        key = (parent, int(token))
        node = self._index.get(key)
        if node is None:
            node = len(self.tokens)
            self._index[key] = node
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.scores.append(float(score))
            self.tags.append(int(tag))
            self.children.append([])
            self.children[parent].append(node)
        else:
            if score > self.scores[node]:
                self.scores[node] = float(score)
            self.tags[node] |= int(tag)
        return node

    def add_tree(self, tokens: Sequence[int], parents: Sequence[int], scores: Sequence[float], tags: Sequence[int],
                 max_depth: int | None = None, under: int = 0) -> list[int]:
        """Rows 1.. of one packed tree (row 0 is the root, or the trie's node ``under``, whose token it carries;
        every parent row before its children). Padding rows (tag ``SOURCE_NONE``), rows deeper than ``max_depth`` in
        the trie and their descendants are left out. Returns every row's node (-1: left out)."""
        node_of = [under] + [-1] * (len(tokens) - 1)
        add, depths = self.add, self.depths
        top = depths[under] + len(tokens) if max_depth is None else max_depth
        for r in range(1, len(tokens)):
            p = parents[r]
            if tags[r] == SOURCE_NONE or p < 0 or p >= r or node_of[p] < 0 or depths[node_of[p]] >= top:
                continue
            node_of[r] = add(node_of[p], tokens[r], scores[r], tags[r])
        return node_of

    def rescore(self, log_table: Sequence[Sequence[float]], tag: int) -> list[int]:
        """Scores of every node tagged ``tag`` alone (e.g. n-gram nodes, which carry no probabilities) from a
        per-depth, per-sibling-rank table of conditional log-acceptance ``log_table[depth][rank]`` (depths and
        ranks beyond the table read its last entry): a node's score is its parent's plus its own entry, so scores
        never increase along a path. ``rank`` counts the earlier siblings carrying ``tag`` (the source's own order
        of preference: add a node's siblings best first). Nodes carrying other bits too keep the best of their
        score and this one. Returns every node's rank (-1: not tagged ``tag``; the root's -1), for
        ``SourceAcceptance.observe_hindsight``."""
        rank_seen = [0] * len(self.tokens)
        ranks = [-1] * len(self.tokens)
        for node in range(1, len(self.tokens)):
            if not self.tags[node] & tag:
                continue
            parent = self.parents[node]
            rank = ranks[node] = rank_seen[parent]
            rank_seen[parent] += 1
            row = log_table[min(self.depths[node], len(log_table) - 1)]
            score = self.scores[parent] + row[min(rank, len(row) - 1)]
            if self.tags[node] == tag or score > self.scores[node]:
                self.scores[node] = score
        return ranks

    def best_first(self, nodes: int) -> tuple[list[int], list[int], list[int], list[float], list[int]]:
        """The best ``nodes`` nodes (fewer if the trie is smaller) packed as rows ``[root] + nodes``: tokens,
        parent rows, depths, scores, tags. A frontier walk from the root (pop the best-scored node whose parent is
        packed, ties in creation order), so the rows are prefix-closed and parents precede children whatever the
        scores; where scores do not increase along paths the rows are the best-scored prefix-closed set."""
        if is_chain(self.depths):  # in order
            k = min(nodes, len(self.tokens) - 1) + 1
            return self.tokens[:k], self.parents[:k], self.depths[:k], self.scores[:k], self.tags[:k]
        tok, par, dep, sco, tag = [self.tokens[0]], [-1], [0], [0.0], [SOURCE_NONE]
        row_of = [0] * len(self.tokens)
        heap = [(-self.scores[c], c) for c in self.children[0]]
        heapq.heapify(heap)
        while heap and len(tok) <= nodes:
            _, node = heapq.heappop(heap)
            row_of[node] = len(tok)
            tok.append(self.tokens[node])
            par.append(row_of[self.parents[node]])
            dep.append(self.depths[node])
            sco.append(self.scores[node])
            tag.append(self.tags[node])
            for c in self.children[node]:
                heapq.heappush(heap, (-self.scores[c], c))
        return tok, par, dep, sco, tag


def pack_trees(packed: Sequence[tuple[list[int], list[int], list[int], list[float], list[int]]],
               device: torch.device | str = "cpu") -> DraftTree:
    """Per-request packed rows (``CandidateTrie.best_first``) as one batched ``DraftTree`` with ``sources`` set.

    Requests with fewer rows than the widest are padded with rows that no source proposed (tag ``SOURCE_NONE``,
    score -inf): a child of the root carrying the root's token. A padding row is a real candidate to the walk
    (taken only when it is the target's own choice), so padding never changes what is committed."""
    width = max(len(p[0]) for p in packed)
    tokens, parents, depths, scores, tags = [], [], [], [], []
    for tok, par, dep, sco, tag in packed:
        pad = width - len(tok)
        tokens.append(tok + [tok[0]] * pad)
        parents.append(par + [0] * pad)
        depths.append(dep + [1] * pad)
        scores.append(sco + [float("-inf")] * pad)
        tags.append(tag + [SOURCE_NONE] * pad)
    # the integer fields in one tensor (a host tree is a few dozen values: the calls cost more than the copies)
    ints = torch.tensor([tokens, parents, depths, tags], dtype=torch.long, device=device)
    return DraftTree(ints[0], ints[1], ints[2], torch.tensor(scores, dtype=torch.float32, device=device), ints[3])


def _rows_per_request(rows: int | Sequence[int], bs: int) -> list[int]:
    per = [int(rows)] * bs if isinstance(rows, int) else [int(r) for r in rows]
    if len(per) != bs:
        raise ValueError(f"rows: one budget per request expected ({bs}), got {len(per)}")
    if any(r < 1 for r in per):
        raise ValueError(f"rows must be >= 1 (the root), got {per}")
    return per


def merge_trees(trees: Sequence[DraftTree], rows: int | Sequence[int], max_depth: int | None = None) -> DraftTree:
    """Several sources' candidate trees of one batch merged into one tree per request under one row budget.

    ``trees``: DraftTrees of the same B requests (any number of rows each; the same root token per request), e.g.
    the drafter's best-first tree and the n-gram source's tree. ``rows``: rows per request, root included (one int,
    or one per request); ``max_depth``: nodes deeper are left out (None: no cap).

    Per request, the trees' nodes are merged by token path (a path proposed by several trees is one branch; the
    node carries the OR of their tags, e.g. ``SOURCE_BOTH``, and the best of their scores), then the best
    ``rows - 1`` nodes are kept best-first (``CandidateTrie.best_first``). Scores must be comparable across
    sources: log-probabilities that the walk reaches the node (the drafter's path log-probability; for n-gram
    nodes ``SourceAcceptance`` estimates). Returns a DraftTree [B, W] with ``sources`` set, W the widest request's
    kept rows (narrower requests padded, see ``pack_trees``), on the first tree's device. Since a merged tree is a
    tree of candidate tokens like any other, ``verify_tree`` commits exactly what it commits for any tree: the
    target's own choices (lossless).
    """
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    bs = trees[0].batch_size
    if any(t.batch_size != bs for t in trees):
        raise ValueError(f"trees of different batch sizes: {[t.batch_size for t in trees]}")
    budgets = _rows_per_request(rows, bs)
    lists = [(t.tokens.tolist(), t.parents.tolist(), t.scores.float().tolist(), t.source_tags().tolist(),
              t.depths.tolist()) for t in trees]
    packed = []
    for b in range(bs):
        root = lists[0][0][b][0]
        if any(tok[b][0] != root for tok, *_ in lists):
            raise ValueError(f"request {b}: the trees have different roots {[tok[b][0] for tok, *_ in lists]}")
        proposing = [tree for tree in lists if any(t != SOURCE_NONE for t in tree[3][b][1:])]
        alone = _best_first_prefix(proposing[0], b, budgets[b], max_depth) if len(proposing) == 1 else None
        if alone is not None:  # one source proposed for this request: its rows as they are
            packed.append(alone)
            continue
        trie = CandidateTrie(root)
        for tok, par, sco, tag, _ in lists:
            trie.add_tree(tok[b], par[b], sco[b], tag[b], max_depth)
        packed.append(trie.best_first(budgets[b] - 1))
    return pack_trees(packed, trees[0].tokens.device)


def _best_first_prefix(tree: tuple[list, list, list, list, list], b: int, rows: int, max_depth: int | None
                       ) -> tuple[list[int], list[int], list[int], list[float], list[int]] | None:
    """Request ``b``'s first ``rows`` rows of one packed tree (tokens, parents, scores, tags, depths lists), as
    ``CandidateTrie.best_first`` would pack that tree alone, without the trie: where its nodes come first, then
    only padding (``SOURCE_NONE``), every node lies within ``max_depth`` one level below an earlier row, and scores
    never increase in row order (a best-first tree: the frontier walk then pops the rows in order). None where the
    tree is not such a tree (the trie merges it)."""
    tok, par, sco, tag, dep = (field[b] for field in tree)
    n = len(tok)
    while n > 1 and tag[n - 1] == SOURCE_NONE:
        n -= 1
    top = float("inf") if max_depth is None else max_depth
    prev = 0.0
    for r in range(1, n):
        p, s = par[r], sco[r]
        if tag[r] == SOURCE_NONE or not 0 <= p < r or dep[r] != dep[p] + 1 or dep[r] > top or s != s or s > prev:
            return None
        prev = s
    k = min(rows, n)
    return tok[:k], [-1] + par[1:k], [0] + dep[1:k], [0.0] + sco[1:k], [SOURCE_NONE] + tag[1:k]


def without_ended(tree: DraftTree, stops: Sequence[frozenset[int]] | None, room: Sequence[int] | None
                  ) -> DraftTree:
    """``tree`` (on the host) without the rows that cannot add a committed token to their request.

    ``stops``: per request, the token ids that end it (EOS, its stop tokens; empty: none, e.g. ``ignore_eos``);
    ``room``: per request, the tokens it may still commit, this round's included (None: no limit). Dropped: a row
    carrying a stop token (where the walk reaches it, the target's own choice there is that token, committed as the
    round's bonus just the same), every row below one (never committed: the request ends first), and rows deeper
    than ``room - 1`` (a round commits its accepted rows and one bonus token; the rest is cut off at the limit).
    Where an answer ends inside a round, the drafter still proposes a full block past its end: a sixth of the rows
    of the demo tasks' rounds. The rows kept keep their order, so the tree stays best-first and prefix-closed;
    a request left with fewer rows than the widest is padded as :func:`pack_trees` pads (an untagged tree stays
    untagged: its padding's scores of -inf keep it out of every plan), and the tree is as wide as its widest
    request's kept rows. What the walk commits is unchanged on any tree (lossless); the round verifies fewer rows
    and the planner does not count on tokens after the end. Returns ``tree`` itself where nothing is dropped (a few
    list passes for a few small trees, tensor ops for a large batch)."""
    if tree.num_rows == 1 or (stops is None and room is None):
        return tree
    bs, n = tree.tokens.shape
    no_stops: frozenset[int] = frozenset()
    stops = [no_stops] * bs if stops is None else stops
    caps = [n] * bs if room is None else [max(int(r) - 1, 0) for r in room]
    if bs * n > HOST_MASK_CELLS:
        return _without_ended_batch(tree, stops, caps)
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    kept: list[list[int]] = []
    for tok, par, dep, ids, cap in zip(tokens, parents, depths, stops, caps):
        if max(dep) <= cap and not (ids and any(t in ids for t in tok[1:])):
            kept.append(list(range(n)))
            continue
        dead = [False] * n
        for i in range(1, n):
            p = par[i]
            dead[i] = tok[i] in ids or dep[i] > cap or (p > 0 and dead[p])
        kept.append([i for i in range(n) if not dead[i]])
    if min(len(k) for k in kept) == n:
        return tree
    scores, tags = tree.scores.tolist(), tree.source_tags().tolist()
    packed = []
    for b, rows in enumerate(kept):
        new_row = {old: new for new, old in enumerate(rows)}
        packed.append(([tokens[b][i] for i in rows], [new_row.get(parents[b][i], -1) for i in rows],
                       [depths[b][i] for i in rows], [scores[b][i] for i in rows], [tags[b][i] for i in rows]))
    out = pack_trees(packed, tree.tokens.device)
    return out if tree.sources is not None else DraftTree(out.tokens, out.parents, out.depths, out.scores, None)


def _without_ended_batch(tree: DraftTree, stops: Sequence[frozenset[int]], caps: list[int]) -> DraftTree:
    """:func:`without_ended` with tensor ops (a large batch; ``caps``: each request's deepest useful row)."""
    tok, dep = tree.tokens, tree.depths
    bs, n = tok.shape
    dead = dep > torch.tensor(caps, dtype=dep.dtype)[:, None]
    groups: dict[frozenset[int], list[int]] = {}
    for b, ids in enumerate(stops):
        if ids:
            groups.setdefault(ids, []).append(b)
    for ids, members in groups.items():
        ends = torch.tensor(sorted(ids), dtype=tok.dtype)
        if len(members) == bs:
            dead |= torch.isin(tok, ends)
        else:
            idx = torch.tensor(members)
            dead[idx] |= torch.isin(tok[idx], ends)
    dead[:, 0] = False
    if not bool(dead.any()):
        return tree
    up = tree.parents.clamp(min=0)
    for _ in range(max(n - 1, 1).bit_length()):  # below a dropped row: pointer jumping, log2(rows) passes
        dead |= dead.gather(1, up)
        up = up.gather(1, up)
    dead[:, 0] = False
    order = torch.argsort(dead.to(torch.int8), dim=1, stable=True)  # each request's kept rows first, in order
    return _kept_first(tree, order, (~dead).sum(dim=1).tolist())


def _kept_first(tree: DraftTree, order: torch.Tensor, kept: list[int]) -> DraftTree:
    """``tree``'s rows in ``order`` ([B, R]: each request's ``kept[b]`` rows first, in their order), parents
    renumbered, as wide as the most rows kept; a request's rows past its kept ones are padding (:func:`pack_trees`'s:
    a child of the root carrying its token, score -inf, untagged)."""
    bs, n = order.shape
    width = max(kept)
    order = order[:, :width]
    # each row's new index (read for kept rows only: their parents are kept too)
    new_row = torch.zeros(bs, n, dtype=torch.long).scatter_(1, order, torch.arange(width).expand(bs, width).clone())
    old_parents = tree.parents.gather(1, order)
    parents = torch.where(old_parents >= 0, new_row.gather(1, old_parents.clamp(min=0)), old_parents)
    pad = torch.arange(width)[None, :] >= torch.tensor(kept)[:, None]
    sources = None if tree.sources is None else tree.sources.gather(1, order).masked_fill(pad, SOURCE_NONE)
    tokens = torch.where(pad, tree.tokens[:, :1], tree.tokens.gather(1, order))
    return DraftTree(tokens, parents.masked_fill(pad, 0), tree.depths.gather(1, order).masked_fill(pad, 1),
                     tree.scores.gather(1, order).masked_fill(pad, float("-inf")), sources)


def accepted_per_source(tree: DraftTree, accepted_rows: torch.Tensor) -> dict[int, torch.Tensor]:
    """Accepted drafted nodes per request that each source proposed: ``{SOURCE_DRAFTER: [B], SOURCE_NGRAM: [B]}``
    (long, on the tree's device); a node proposed by both counts for both. ``accepted_rows``: the walk's
    [B, D+1] accepted rows (-1 padding, ``WalkResult.accepted_rows``)."""
    tags = tree.source_tags()
    rows = accepted_rows.to(tags.device)
    taken = torch.where(rows > 0, tags.gather(1, rows.clamp(min=0)), 0)  # the root (row 0) is not a draft
    return {src: ((taken & src) != 0).sum(dim=1) for src in SOURCE_NAMES}


def spread_requests(tree: DraftTree, members: Sequence[int], roots: torch.Tensor) -> DraftTree:
    """The trees of some requests of a batch (``tree`` [k, R], those of ``members``, k indices into the batch) as
    a tree of the whole batch [bs, R] (``roots`` [bs], each request's root token, on ``tree``'s device): the
    other requests hold their root and padding rows (``pack_trees``'s: a child of the root carrying its token,
    score -inf, ``SOURCE_NONE``), so a merge takes none of them and the walk commits only the target's choice
    there. The members' nodes keep their tags (untagged: the drafter's)."""
    bs, rows, dev = roots.shape[0], tree.num_rows, tree.tokens.device
    idx = torch.tensor(list(members), dtype=torch.long, device=dev)
    tokens = roots.to(dev, torch.long)[:, None].expand(bs, rows).clone()
    parents = torch.zeros(bs, rows, dtype=torch.long, device=dev)
    parents[:, 0] = -1
    depths = torch.ones(bs, rows, dtype=torch.long, device=dev)
    depths[:, 0] = 0
    scores = torch.full((bs, rows), float("-inf"), dtype=torch.float32, device=dev)
    scores[:, 0] = 0.0
    tags = torch.full((bs, rows), SOURCE_NONE, dtype=torch.long, device=dev)
    for out, part in ((tokens, tree.tokens), (parents, tree.parents), (depths, tree.depths),
                      (scores, tree.scores.float()), (tags, tree.source_tags())):
        out[idx] = part
    return DraftTree(tokens, parents, depths, scores, tags)


def accepted_alone(tree: DraftTree, committed_tokens: torch.Tensor) -> torch.Tensor:
    """[B] long: the drafted nodes a walk of ``tree`` alone would have accepted, given what a round over a larger
    tree committed (``committed_tokens`` [B, D+1], -1 padding: ``WalkResult.committed_tokens``): the depth of
    ``tree``'s deepest node whose path is a prefix of those tokens. Exact for greedy and seeded sampling alike,
    since the target's choice after a path does not depend on the tree around it; a path longer than what was
    committed is cut there (what the target would have done past it is unknown). On the tree's device, no host
    read (the loop runs over rows, not over values)."""
    tok, dep = tree.tokens, tree.depths
    committed = committed_tokens.to(tok.device)
    width = committed.shape[1]
    at_depth = committed.gather(1, (dep - 1).clamp(0, width - 1))
    on_path = (tok == at_depth) & (dep >= 1) & (dep <= width) & (at_depth >= 0)
    on_path[:, 0] = True
    parents = tree.parents.clamp(min=0)
    for _ in range(min(tree.num_rows - 1, width)):  # a node is on the path when its parent is: one level per pass
        on_path = on_path & on_path.gather(1, parents)
    return torch.where(on_path, dep, 0).max(dim=1).values
