"""What the planner learns about how often the target takes a candidate, online, from the rounds it verifies.

- :class:`DepthCalibration`: a per-depth factor between the drafter's conditional probability of a child and how
  often the target takes it (the drafter's node scores become acceptance probabilities);
- :class:`EntropyTable`: accepted drafts per round by the round's lead entropy (the entropy law, learned, not
  assumed): what the gate expects from drafting before the drafter runs;
- :class:`SourceAcceptance`: per candidate source, depth and sibling rank, the conditional acceptance of a node,
  which scores the nodes of sources without probabilities of their own (n-gram matches); a source labelled in
  hindsight (:class:`HindsightTree`: every node it proposed, verified or not, against what the request committed
  next) learns per *context* (``CONTEXTS``).

Torch and numbers only; ``glance_sgl.planner`` reads them, ``glance_sgl.ngram_source`` scores and labels its
proposals with a ``SourceAcceptance``.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .tree import SOURCE_DRAFTER, SOURCE_NGRAM, DraftTree

# acceptance contexts of a hindsight-labelled source (SourceAcceptance): its proposals in general, those made while
# the request's latest committed tokens were the source's own predictions (glance_sgl.ngram_source: a copy), and
# those whose lookup found one long chain, a single continuation as deep as a lookup goes (a replayed answer, a
# quoted passage: nearly every node is taken there, where other matches' deep nodes often fail)
CONTEXT_ANY = 0
CONTEXT_ON_TRACK = 1
CONTEXT_CHAIN = 2
CONTEXTS = (CONTEXT_ANY, CONTEXT_ON_TRACK, CONTEXT_CHAIN)

# Entropy bins (nats) of the entropy table; the last bin is open-ended.
ENTROPY_EDGES = (0.02, 0.05, 0.1, 0.2, 0.35, 0.6, 1.0, 1.6, 2.5)

HOST_OBSERVE_MAX_BATCH = 16  # DepthCalibration.observe: host lists up to this batch size, tensor ops above


class DepthCalibration:
    """Per-depth factor between the drafter's conditional probability of a child and how often the target takes it.

    At depth d, over rounds whose walk reached depth d-1: ``predicted[d]`` sums the drafter's conditional
    probabilities of the tree's children of the path node (the chance, by the drafter, that the walk goes on),
    ``hits[d]`` counts rounds where it did. ``factor[d] = hits / predicted`` (decayed sums with a prior of one
    round at factor 1). Node i's acceptance probability is then ``exp(score_i) * prod_{d <= depth_i} factor[d]``.
    """

    def __init__(self, max_depth: int, decay: float = 0.995, prior: float = 1.0) -> None:
        self.max_depth = max_depth
        self.decay = decay
        self.predicted = torch.full((max_depth + 1,), prior, dtype=torch.float64)
        self.hits = torch.full((max_depth + 1,), prior, dtype=torch.float64)
        self._log_cumulative: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._log_cumulative_host: tuple[tuple[int, ...], list[float]] | None = None

    def _sums_key(self) -> tuple[int, ...]:
        """Changes whenever the sums do (in place included)."""
        return id(self.hits), self.hits._version, id(self.predicted), self.predicted._version

    def log_cumulative(self) -> torch.Tensor:
        """[max_depth + 1] float32: ``C[d] = sum_{1..d} log factor``, C[0] = 0. Made again only after the sums
        changed (every choice reads it; only a drafting round's report changes them)."""
        key = self._sums_key()
        if self._log_cumulative is None or self._log_cumulative[0] != key:
            factor = (self.hits / self.predicted).clamp(1e-3, 1e3)
            logf = factor.log()
            logf[0] = 0.0
            self._log_cumulative = key, torch.cumsum(logf, 0).float()
        return self._log_cumulative[1]

    def log_cumulative_host(self) -> list[float]:
        """:meth:`log_cumulative` as a host list (in double precision), for the host path of
        :meth:`Planner.choose`; made again only after the sums changed."""
        key = self._sums_key()
        if self._log_cumulative_host is None or self._log_cumulative_host[0] != key:
            total, out = 0.0, [0.0]
            for hit, pred in zip(self.hits.tolist()[1:], self.predicted.tolist()[1:]):
                total += math.log(min(max(hit / pred, 1e-3), 1e3))
                out.append(total)
            self._log_cumulative_host = key, out
        return self._log_cumulative_host[1]

    def node_probs(self, scores: torch.Tensor, depths: torch.Tensor, sources: torch.Tensor | None = None,
                   drafter_nodes: bool = True) -> torch.Tensor:
        """Calibrated acceptance probability of every row, [B, R] (1 at the root), capped at 1. ``sources``: the
        rows' source tags (``glance_sgl.tree``); only the drafter's own nodes are calibrated here (another source's
        scores are its calibrated estimates already); None: every node is the drafter's. ``drafter_nodes`` False:
        none is (candidates of sources without a model pass), and the scores are the probabilities' logs."""
        if not drafter_nodes:
            return torch.exp(scores.float()).clamp(max=1.0)
        c = self.log_cumulative().to(scores.device)[depths.clamp(max=self.max_depth)]
        if sources is not None:
            c = torch.where(sources.to(c.device) == SOURCE_DRAFTER, c, 0.0)
        return torch.exp(scores.float() + c).clamp(max=1.0)

    def observe(self, parents: torch.Tensor, scores: torch.Tensor, depths: torch.Tensor,
                accepted_rows: torch.Tensor, accept_lens: torch.Tensor, counted: torch.Tensor | None = None
                ) -> None:
        """One verified batch of trees ([B, R] each; ``accepted_rows`` [B, >=1] with -1 padding, [B] lengths).
        ``counted`` (bool [B, R]): the drafter's own nodes of a merged tree (the others' scores are not the
        drafter's): only they count, a depth is a hit where the walk took one of them; None: every node.
        Host tensors of a small batch (the round's host copies) take :meth:`_observe_host`: the same sums in a few
        list passes instead of some twenty tiny tensor ops (about 0.1 ms of a round on 2 cores)."""
        on_host = all(t.device.type == "cpu" for t in (parents, scores, depths, accepted_rows, accept_lens))
        if on_host and self.predicted.device.type == "cpu" and parents.shape[0] <= HOST_OBSERVE_MAX_BATCH:
            self._observe_host(parents, scores, depths, accepted_rows, accept_lens, counted)
            return
        bs, r = parents.shape
        dev = parents.device
        on_path = torch.zeros(bs, r + 1, dtype=torch.bool, device=dev)
        rows = accepted_rows.to(dev).clamp(min=-1)
        on_path.scatter_(1, torch.where(rows >= 0, rows, r), True)
        on_path = on_path[:, :r]
        parent_on_path = on_path.gather(1, parents.clamp(min=0)) & (parents >= 0)
        if counted is not None:
            parent_on_path &= counted.to(dev)
        # children of a path node (one per reached depth): the drafter's chances, given their parent, that the
        # walk goes on through them
        cond = torch.exp(scores.float() - scores.float().gather(1, parents.clamp(min=0))) * parent_on_path
        pred = torch.zeros(bs, self.max_depth + 2, dtype=torch.float64, device=dev)
        pred.scatter_add_(1, depths.clamp(max=self.max_depth + 1), cond.double())
        if counted is None:
            reach = torch.arange(self.max_depth + 2, device=dev)[None, :] <= accept_lens.to(dev)[:, None]
            hit = reach.double()
        else:  # the accepted rows the drafter proposed, by their depth
            took = counted.to(dev).gather(1, rows.clamp(min=0)) & (rows >= 0)
            hit = torch.zeros(bs, self.max_depth + 2, dtype=torch.float64, device=dev)
            hit.scatter_add_(1, depths.gather(1, rows.clamp(min=0)).clamp(max=self.max_depth + 1), took.double())
        hit[:, 0] = 0.0
        # the sums live where the trees do: a device-resident step reads nothing back for them
        self.predicted = self.predicted.to(dev).mul_(self.decay).add_(pred.sum(0)[: self.max_depth + 1])
        self.hits = self.hits.to(dev).mul_(self.decay).add_(hit.sum(0)[: self.max_depth + 1])

    def _observe_host(self, parents: torch.Tensor, scores: torch.Tensor, depths: torch.Tensor,
                      accepted_rows: torch.Tensor, accept_lens: torch.Tensor, counted: torch.Tensor | None = None
                      ) -> None:
        """:meth:`observe` on host lists (the same sums; the conditional probabilities in double precision, of the
        path children only, instead of float32 tensor ops over every row)."""
        top = self.max_depth + 1
        pred, hit = [0.0] * top, [0.0] * top
        par, dep, acc, lens = parents.tolist(), depths.tolist(), accepted_rows.tolist(), accept_lens.tolist()
        sc = scores.tolist()
        mine = None if counted is None else counted.tolist()
        for b in range(len(par)):
            on_path = {row for row in acc[b] if row >= 0}
            for i, p in enumerate(par[b]):
                if p >= 0 and p in on_path and dep[b][i] < top and (mine is None or mine[b][i]):
                    pred[dep[b][i]] += math.exp(sc[b][i] - sc[b][p])  # exp(score - parent's score)
            if mine is None:
                for d in range(1, min(int(lens[b]), top - 1) + 1):
                    hit[d] += 1.0
            else:
                for row in on_path:
                    if row > 0 and mine[b][row] and dep[b][row] < top:
                        hit[dep[b][row]] += 1.0
        new = torch.tensor([pred, hit], dtype=torch.float64)
        self.predicted.mul_(self.decay).add_(new[0])
        self.hits.mul_(self.decay).add_(new[1])


class EntropyTable:
    """Accepted drafts per round by the round's lead entropy: decayed means per entropy bin, each shrunk towards
    the decayed mean over all bins (worth ``shrink`` rounds), which starts from ``prior_mean`` (worth
    ``prior_weight`` rounds).

    Whether, and how, entropy predicts acceptance is learned, not assumed: a bin the engine has not drafted in yet
    reads the overall mean, so a rarely visited entropy is never locked out of drafting by a prior. ``seen``: the
    observations so far (decayed like the sums).
    """

    def __init__(self, max_accept: int, prior_mean: float = 2.0, prior_weight: float = 2.0, shrink: float = 3.0,
                 decay: float = 0.99) -> None:
        n = len(ENTROPY_EDGES) + 1
        self.weight = [0.0] * n
        self.total = [0.0] * n
        self.all_weight, self.all_total = prior_weight, min(prior_mean, max_accept) * prior_weight
        self.shrink, self.decay = shrink, decay
        self.seen = 0.0

    @staticmethod
    def bin(entropy: float) -> int:
        return bisect.bisect_right(ENTROPY_EDGES, entropy)

    def expected(self, entropy: float) -> float:
        i = self.bin(entropy)
        overall = self.all_total / self.all_weight
        return (self.total[i] + self.shrink * overall) / (self.weight[i] + self.shrink)

    def observe(self, entropy: float, accepted: float) -> None:
        i = self.bin(entropy)
        self.weight[i] = self.weight[i] * self.decay + 1.0
        self.total[i] = self.total[i] * self.decay + float(accepted)
        self.all_weight = self.all_weight * self.decay + 1.0
        self.all_total = self.all_total * self.decay + float(accepted)
        self.seen = self.seen * self.decay + 1.0


class SourceAcceptance:
    """Online estimates of how often the target takes a node of each source, per depth and per sibling rank.

    Cell (source s, depth d, rank k): over the nodes tagged s at depth d whose parent the walk reached, with k
    earlier siblings tagged s (ranks ``ranks - 1`` and above share the last cell), the share the walk took: the
    conditional acceptance ``P(node taken | parent reached)``. Counts are decayed by ``decay`` per observed batch
    and start from a prior worth ``prior_weight`` nodes at ``prior_mean[k]`` (the last entry for higher ranks).
    A node's calibrated score is the sum of its path's log cells (``log_table`` and ``CandidateTrie.rescore``).

    A source in ``hindsight`` is labelled by ``observe_hindsight`` instead of ``observe``: every node it proposed,
    verified or not, against the tokens the request committed afterwards. A verified tree only labels the nodes a
    planner chose to verify, so cells it rarely verifies (deep n-gram nodes) keep their prior and stay unverified:
    the estimate is biased by the choice it drives. The committed continuation is the target's own (greedy: the
    same tokens whatever was verified; sampling: its samples), so hindsight labels are unbiased at every depth.

    Hindsight cells also come per ``context`` (``CONTEXTS``: ``CONTEXT_ANY``, ``CONTEXT_ON_TRACK`` for a
    proposal made while the request's latest tokens were the source's own predictions, ``NgramSource``'s streak, or
    ``CONTEXT_CHAIN`` for one whose lookup found a single long chain):
    a request copying a passage or replaying an answer takes nearly every node, while matches elsewhere mostly
    fail, and one table for both would score the copy by the failures.
    """

    def __init__(self, max_depth: int = 16, ranks: int = 2, decay: float = 0.995,
                 prior_mean: Sequence[float] = (0.5, 0.1), prior_weight: float = 2.0,
                 sources: Sequence[int] = (SOURCE_DRAFTER, SOURCE_NGRAM)) -> None:
        if max_depth < 1 or ranks < 1 or not 0.0 < decay <= 1.0 or prior_weight <= 0 or not prior_mean:
            raise ValueError("SourceAcceptance: max_depth, ranks >= 1, 0 < decay <= 1, prior_weight > 0 required")
        if any(not 0.0 < p < 1.0 for p in prior_mean):
            raise ValueError(f"prior_mean entries must lie in (0, 1), got {list(prior_mean)}")
        self.max_depth, self.ranks, self.decay = max_depth, ranks, decay
        means = torch.tensor([prior_mean[min(k, len(prior_mean) - 1)] for k in range(ranks)], dtype=torch.float64)
        self._prior_hits = (means * prior_weight).expand(max_depth + 1, ranks)
        self._prior_tries = torch.full((max_depth + 1, ranks), float(prior_weight), dtype=torch.float64)
        self.hits = {s: torch.zeros(max_depth + 1, ranks, dtype=torch.float64) for s in sources}
        self.tries = {s: torch.zeros(max_depth + 1, ranks, dtype=torch.float64) for s in sources}
        # the cells of contexts other than 0 (hindsight sources), (source, context) -> (hits, tries), made on first use
        self._context_cells: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.hindsight: set[int] = set()  # sources labelled by observe_hindsight (see the class doc)
        # log_table's host lists, read at every lookup and changed only by a labelled batch: (source, context) ->
        # (the version of the counts it was made from, the table); the counts change only through _add
        self._version = 0
        self._log_tables: dict[tuple[int, int], tuple[int, list[list[float]]]] = {}

    def cells(self, source: int, context: int = CONTEXT_ANY) -> tuple[torch.Tensor, torch.Tensor]:
        """(hits, tries) of ``source`` in ``context``, each [max_depth + 1, ranks] float64 decayed counts."""
        if context == CONTEXT_ANY:
            return self.hits[source], self.tries[source]
        if context not in CONTEXTS:
            raise ValueError(f"acceptance context must be one of {CONTEXTS}, got {context}")
        key = (source, context)
        if key not in self._context_cells:
            self._context_cells[key] = (torch.zeros_like(self.hits[source]), torch.zeros_like(self.tries[source]))
        return self._context_cells[key]

    def probs(self, source: int, context: int = CONTEXT_ANY) -> torch.Tensor:
        """[max_depth + 1, ranks] float64 conditional acceptance of ``source`` in ``context`` (row 0 unused)."""
        hits, tries = self.cells(source, context)
        return (hits + self._prior_hits) / (tries + self._prior_tries)

    def log_table(self, source: int, context: int = CONTEXT_ANY) -> list[list[float]]:
        """``probs(source, context)``'s logs as host lists ``[depth][rank]``, for ``CandidateTrie.rescore`` (made
        again only after the counts changed; read-only)."""
        cached = self._log_tables.get((source, context))
        if cached is None or cached[0] != self._version:
            cached = self._log_tables[(source, context)] = (self._version, self.probs(source, context).log().tolist())
        return cached[1]

    def observe(self, tree: DraftTree, accepted_rows: torch.Tensor) -> dict[int, list[int]]:
        """One verified batch: ``tree`` [B, R] (its tags), ``accepted_rows`` the walk's [B, D+1] (-1 padding).
        Returns, per source, the accepted drafts of each request [B] that that source alone proposed (what it
        added to the round).

        Host lists: a round's tree is a few dozen rows, where a loop over them costs less than the dozen tensor
        ops a vectorised count would."""
        tags, parents = tree.source_tags().tolist(), tree.parents.tolist()
        depths, accepted = tree.depths.tolist(), accepted_rows.tolist()
        n, ranks, top = (self.max_depth + 1) * self.ranks, self.ranks, self.max_depth
        tries = {src: [0.0] * n for src in self.hits}
        hits = {src: [0.0] * n for src in self.hits}
        only: dict[int, list[int]] = {src: [0] * len(tags) for src in self.hits}
        for b, (tag_b, par_b, dep_b, acc_b) in enumerate(zip(tags, parents, depths, accepted)):
            on_path = {r for r in acc_b if r >= 0}
            for r in on_path:
                if r > 0 and tag_b[r] in only:
                    only[tag_b[r]][b] += 1
            seen: dict[tuple[int, int], int] = {}  # (parent row, source): earlier siblings of that source
            for i in range(1, len(par_b)):
                p, tag = par_b[i], tag_b[i]
                for src in tries:
                    if not tag & src or src in self.hindsight:
                        continue
                    rank = seen.get((p, src), 0)
                    seen[(p, src)] = rank + 1
                    if p >= 0 and p in on_path:
                        cell = min(dep_b[i], top) * ranks + min(rank, ranks - 1)
                        tries[src][cell] += 1.0
                        if i in on_path:
                            hits[src][cell] += 1.0
        for src in self.hits:
            if src not in self.hindsight:
                self._add(src, tries[src], hits[src])
        return only

    def _add(self, source: int, tries: Sequence[float], hits: Sequence[float], context: int = CONTEXT_ANY) -> None:
        """One batch's counts of ``source`` in ``context`` (flat ``[depth * ranks + rank]`` host lists), after one
        decay step."""
        cell_hits, cell_tries = self.cells(source, context)
        cell_tries.mul_(self.decay).view(-1).add_(torch.tensor(tries, dtype=torch.float64))
        cell_hits.mul_(self.decay).view(-1).add_(torch.tensor(hits, dtype=torch.float64))
        self._version += 1

    def observe_hindsight(self, source: int, trees: Sequence["HindsightTree"]) -> None:
        """One round's matured proposals of ``source`` (each a :class:`HindsightTree` with the tokens committed
        after it), as one decayed batch per context of theirs: a node is tried where its parent is on the committed
        path and its depth within the known continuation, and hit where its token is the continuation's."""
        for context in sorted({t.context for t in trees}):
            self._observe_context(source, [t for t in trees if t.context == context], context)

    def _observe_context(self, source: int, trees: Sequence["HindsightTree"], context: int) -> None:
        n, ranks, top = (self.max_depth + 1) * self.ranks, self.ranks, self.max_depth
        tries, hits = [0.0] * n, [0.0] * n
        for t in trees:
            future, known = t.future, len(t.future)
            on_path = [True] + [False] * (len(t.tokens) - 1)
            for i in range(1, len(t.tokens)):
                d, rank = t.depths[i], t.ranks[i]
                if rank < 0 or d > known or not on_path[t.parents[i]]:
                    continue
                cell = min(d, top) * ranks + min(rank, ranks - 1)
                tries[cell] += 1.0
                if t.tokens[i] == future[d - 1]:
                    on_path[i] = True
                    hits[cell] += 1.0
        self._add(source, tries, hits, context)


@dataclass
class HindsightTree:
    """A proposed candidate trie awaiting its labels (``SourceAcceptance.observe_hindsight``): its nodes' tokens,
    parents (every parent before its children; node 0 the root), depths and sibling ranks (-1: not the labelled
    source's), ``future``: the tokens committed after its root so far, and ``context``: the acceptance context
    it was scored in (``SourceAcceptance``). ``depth``: its deepest node's."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    ranks: list[int]
    future: list[int] = field(default_factory=list)
    context: int = CONTEXT_ANY
    depth: int = field(init=False)

    def __post_init__(self) -> None:
        self.depth = max(self.depths)  # read on every commit while the tree is pending: computed once

    def foreseen(self, tokens: Sequence[int]) -> tuple[int, bool]:
        """How ``tokens`` (committed right after the root) went along the tree's first choices (rank-0 nodes):
        (how many of them, from the first, were the first choice after the previous one; whether the tree never
        put another first: they were all first choices, or the first-choice path ended in a leaf)."""
        node, hit = 0, 0
        for token in tokens:
            first = next((i for i in range(node + 1, len(self.tokens))
                          if self.parents[i] == node and self.ranks[i] == 0), None)
            if first is None:
                return hit, True  # a leaf: nothing foreseen past it, nothing contradicted
            if self.tokens[first] != token:
                return hit, False
            node, hit = first, hit + 1
        return hit, True

    @property
    def mature(self) -> bool:
        """Whether every node's depth lies within the known continuation."""
        return len(self.future) >= self.depth


__all__ = ["CONTEXTS", "CONTEXT_ANY", "CONTEXT_ON_TRACK", "CONTEXT_CHAIN", "ENTROPY_EDGES", "DepthCalibration",
           "EntropyTable", "SourceAcceptance", "HindsightTree"]
