"""One speculative round, for both engines: a batch of one in the embedded engine, SGLang's batch in the worker.

It reads top to bottom like gpt-fast's ``speculative_decode``::

    cheap candidates -> gate -> drafter candidates -> choose rows -> build the verify tree -> target pass
         -> walk -> keep KV -> feed the sources -> observe

Torch and the planner only: no Hugging Face or SGLang types. What differs between the engines comes in through
small adapters:

- :class:`TargetRows`: the target pass over a packed tree and the KV keep (the Hugging Face cache and
  ``keep_rows`` in ``glance_sgl.target``; SGLang's verify / AR forward and ``compact_kv`` in the worker);
- :class:`CandidateSource`: proposes a candidate tree and is fed what each round committed, whether it ran or
  not (the block drafter over its context store: ``glance_sgl.drafter.CachedDrafter`` in the embedded engine,
  the draft KV pool in the worker; n-gram matches: ``glance_sgl.ngram_source.NgramCandidates``). ``source_id``
  is the source's tag (``glance_sgl.tree.SOURCE_*``). Sources without a model pass (n-gram matches) propose
  first, and the planner plans the best round they allow; its gate then decides whether the drafter
  (``SOURCE_DRAFTER``, a model pass) pays over that round; the trees of several sources are merged under one
  row budget (``glance_sgl.tree.merge_trees``). So a round is, per the gate, the candidates and the configured
  sources: no draft (a plain AR step), n-gram candidates only, the drafter only, or merged;
- the policy (:class:`glance_sgl.planner.Planner`, or ``AlwaysDraft`` for an ablation): ``cheap_rows`` (which
  requests look up the sources without a model pass), ``draft_mask`` (for which requests the drafter drafts: the
  others verify the cheap sources' candidates, or the root alone, in the same target pass), ``skip``,
  ``merge_worth`` (whose matches join the drafter's tree), ``choose`` and one ``report`` per round; it owns every
  per-request statistic, the lead entropy included.

Lossless whatever the adapters and the policy pick: every prefix of a best-first tree (the root alone included) is
a valid tree, and the walk (``glance_sgl.verify``) commits only the target's own choices.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol, Sequence

import torch

from .host_transfers import on_host
from .metrics import entropy_tensor
from .costs import CostModel, calibrate
from .planner import Plan, RoundReport
from .tree import (SOURCE_DRAFTER, SOURCE_NONE, DraftTree, accepted_alone, merge_trees, spread_requests,
                   without_ended)
from .verify import SamplingSpec, WalkResult, verify_tree


DRAFT_SOURCES = ("drafter", "ngram")  # the candidate sources a round can draw on, in canonical order
# What a served GLANCE drafts from unless told otherwise, in both engines (``glance serve``, the SGLang worker): the
# drafter and n-gram matches in one merged tree. The embedded engine's constructor keeps the drafter alone (the
# ablations' baseline); ``glance serve`` falls back to it where SGLang's NgramCorpus cannot run.
DEFAULT_DRAFT_SOURCES = ("drafter", "ngram")


def check_draft_sources(names: str | Sequence[str]) -> tuple[str, ...]:
    """Candidate-source names (:data:`DRAFT_SOURCES`), validated and deduplicated in canonical order; ValueError
    on an unknown name or none."""
    names = [names] if isinstance(names, str) else list(names)
    bad = [n for n in names if n not in DRAFT_SOURCES]
    if bad or not names:
        raise ValueError(f"draft sources must be a non-empty subset of {', '.join(DRAFT_SOURCES)}, got {names!r}")
    return tuple(n for n in DRAFT_SOURCES if n in names)

@dataclass
class RoundBatch:
    """The requests of one round.

    ``rids``: planner keys, one per request; ``roots`` [bs] long: each request's newest committed token (the root
    of its tree); ``next_index`` [bs] long: the output index of the token after the root (the sampling noise's
    counter); ``specs``: each request's sampling; ``tokens``: each request's tokens so far (prompt + output), for
    sources that match on them (None where no source needs them); ``roots_host``: the roots as a host list where
    the engine knows them without reading the device (else :meth:`host_roots` reads them once); ``members``: the
    requests' indices in the engine's batch where this is a part of it (:meth:`select`), None: the whole batch;
    ``context``: set by the round for the sources it feeds, the requests whose drafter context it keeps (None: every
    one; ``RoundPolicy.context_mask``). ``stops``: each request's token ids that end it (EOS and its stop tokens;
    empty where none does) and ``room``: the tokens each may still commit, this round's included: the round drops
    the candidate rows past either end (:func:`glance_sgl.tree.without_ended`; None: not known, nothing dropped).
    """

    rids: Sequence[Hashable]
    roots: torch.Tensor
    next_index: torch.Tensor
    specs: Sequence[SamplingSpec]
    tokens: Sequence[Sequence[int]] | None = None
    roots_host: list[int] | None = None
    members: list[int] | None = None
    context: Sequence[bool] | None = None
    stops: Sequence[frozenset[int]] | None = None
    room: Sequence[int] | None = None

    def select(self, members: Sequence[int]) -> "RoundBatch":
        """The requests ``members`` (indices into this batch) as a batch of their own, for a source that
        proposes for some requests only (the drafter, for those :meth:`RoundPolicy.draft_mask` picked); its
        ``members`` index the engine's batch."""
        members = list(members)
        idx = torch.tensor(members, dtype=torch.long, device=self.roots.device)
        outer = members if self.members is None else [self.members[b] for b in members]
        return RoundBatch([self.rids[b] for b in members], self.roots[idx], self.next_index[idx],
                          [self.specs[b] for b in members],
                          None if self.tokens is None else [self.tokens[b] for b in members],
                          None if self.roots_host is None else [self.roots_host[b] for b in members], outer,
                          None if self.context is None else [self.context[b] for b in members],
                          None if self.stops is None else [self.stops[b] for b in members],
                          None if self.room is None else [self.room[b] for b in members])

    def host_roots(self) -> list[int]:
        """``roots`` as a host list (read once per round, where the engine did not hand them over)."""
        if self.roots_host is None:
            self.roots_host = [int(t) for t in self.roots.tolist()]
        return self.roots_host

    @property
    def size(self) -> int:
        return len(self.rids)


@dataclass
class PassOutput:
    """The target pass over R rows per request: ``logits`` [bs, R, V] (on the device the walk runs on), ``taps``
    [bs, R, L*H] (tap features, for the drafter's context), ``handle``: the engine's own result object.
    ``device_ms``: where the pass runs asynchronously (CUDA), its device time in ms, readable once the round's
    outcome has been read back (the read waits for the pass); None: the pass returned when done (its wall time)."""

    logits: torch.Tensor
    taps: torch.Tensor
    handle: Any = None
    device_ms: Callable[[], float] | None = None


class TargetRows(Protocol):
    """The engine's target pass, bound to one round's requests."""

    def forward(self, tree: DraftTree, taps: bool = True, rows: Sequence[int] | None = None) -> PassOutput:
        """One pass over every request's packed tree [bs, R] (R = 1: a plain AR step), K/V written after each
        prefix; ``taps``: whether the drafter's context needs the pass's tap features (False: they may be None);
        ``rows``: where the planner gave each request its own number of rows (``Plan.rows``; asked only of an
        engine whose policy is ``ragged``), the first ``rows[b]`` rows of request ``b`` alone are verified (its
        later rows are unreachable, ``DraftTree.truncated``; their logits and taps may be anything)."""

    def keep(self, tree: DraftTree, walk: WalkResult) -> None:
        """Keep the K/V of each request's root and accepted rows (``walk.accepted_rows``), in order."""

    def drop(self, tree: DraftTree) -> None:
        """Forget a pass's rows altogether (a calibration pass)."""

    def agree(self, value: int) -> int:
        """The value every rank takes (tensor parallelism: rank 0's); identity for one process."""

    def width(self, rows: int) -> int:
        """The rows the pass runs for ``rows`` planned rows (>= rows: a captured CUDA-graph width)."""


class CandidateSource(Protocol):
    """A source of candidate tokens for the verify tree."""

    source_id: int

    def propose(self, batch: RoundBatch, rows: int | Sequence[int]) -> DraftTree:
        """Candidate trees [bs, <= rows] (row 0 the root), best-first: every prefix is a tree. ``rows``: one
        budget for the batch, or one per request (sources without a model pass: 1 = no lookup for it). A source
        with a model pass may be asked for part of the engine's batch (``batch.members``)."""

    def commit(self, batch: RoundBatch, taps: torch.Tensor, walk: WalkResult) -> None:
        """What the round committed (``walk``: root + accepted rows of the pass whose tap features are ``taps``
        [bs, R, L*H]), every round, whether this source proposed or not (writes may be deferred)."""


class RoundPolicy(Protocol):
    """What the round asks of the planner (:class:`glance_sgl.planner.Planner`)."""

    max_nodes: int
    speculates: bool  # False: no source proposes (every round a plain AR step)

    def draft_mask(self, rids: Sequence[Hashable], alternative: Plan | None = None) -> list[bool]: ...

    def skip(self, rids: Sequence[Hashable], alternative: Plan | None = None) -> Plan: ...

    def cheap_rows(self, rids: Sequence[Hashable], rows: int) -> list[int]: ...

    def merge_worth(self, rids: Sequence[Hashable], alternative: Plan) -> list[bool]: ...

    def context_mask(self, rids: Sequence[Hashable]) -> list[bool]: ...

    def retired(self, rid: Hashable) -> bool: ...

    def choose(self, rids: Sequence[Hashable], scores: torch.Tensor, depths: torch.Tensor,
               sources: torch.Tensor | None = None, drafter_ran: bool = True,
               drafted: Sequence[bool] | None = None) -> Plan: ...

    def report(self, report: RoundReport) -> None: ...


# a round's parts (RoundResult.phases): the lookups of the sources without a model pass, the plan of their round,
# the drafter's gate, the drafter's pass with the merge and the plan of its round (or the record of a round without
# it), the verify tree, the target pass, the walk, the KV keep, the drafter's context and the lead entropies, the
# outcome's read with the other sources' feeding, the planner's report
PHASES = ("lookup", "plan", "gate", "draft", "tree", "pass", "walk", "keep", "feed", "commit", "report")


@dataclass
class RoundResult:
    """One round: the verified ``tree`` [bs, R], its ``walk``, the policy's ``plan``, the pass's output and the
    report the planner got (its ms fields are the round's timings); ``ended``: ``time.perf_counter()`` at the
    report (an engine measures what happens between rounds from it). A round whose outcome is read later
    (``speculative_round(defer_outcome=True)``) has no report until :meth:`settle`. ``phases``: wall ms of the
    round's parts in order (:data:`PHASES`, each present, a skipped one near 0; a plain round's ``tree``, ``pass``,
    ``walk`` and ``report`` only; a deferred round's ``commit`` and ``report`` arrive with :meth:`settle`; on an
    asynchronous device ``pass`` is the launch, the device time is the report's ``pass_ms``): where a round's host
    time goes (``GLANCE_SGL_PROFILE=1`` logs them)."""

    tree: DraftTree
    walk: WalkResult
    plan: Plan
    out: PassOutput
    report: RoundReport | None
    ended: float
    _settle: Callable[[], RoundReport] | None = None
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    def settle(self) -> RoundReport:
        """Read the outcome back, feed the sources without a model pass and report to the planner, once (a no-op
        where that happened in the round, or before). A deferred round's ``ended`` stays the end of its launch."""
        if self.report is None:
            self.report, self._settle = self._settle(), None
        return self.report

    @property
    def drafted(self) -> bool:
        """Whether the drafter ran (other sources may have proposed without it)."""
        return self.plan.drafted


def ragged_rows(plan: Plan, width: int) -> list[int] | None:
    """Rows per request the pass verifies where the planner sized each request's tree (``Plan.rows``, capped at
    the tree's ``width``); None where every request verifies all ``width`` rows (one size for the batch)."""
    if plan.rows is None:
        return None
    rows = [min(r, width) for r in plan.rows]
    return None if min(rows) >= width else rows


def alternative_tree(candidates: DraftTree, plan: Plan) -> DraftTree:
    """The tree the round of ``plan`` would verify from ``candidates`` (its best-first prefix; each request's own
    where the planner sized them one by one)."""
    tree = candidates.prefix(plan.nodes + 1)
    rows = ragged_rows(plan, tree.num_rows)
    return tree if rows is None else tree.truncated(rows)


def root_tree(roots: torch.Tensor) -> DraftTree:
    """The 1-row tree of a plain AR step: only the roots [bs] are verified. Its parents / depths / scores are
    constants of the batch size, made once (an AR step's host work is the cost of "never hurts")."""
    parents, depths, scores = _root_constants(roots.shape[0], roots.device)
    return DraftTree(roots.view(-1, 1), parents, depths, scores)


@functools.lru_cache(maxsize=64)
def _root_constants(bs: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parents -1, depths 0, scores 0.0), each [bs, 1], of a root-only tree (shared: never written)."""
    zeros = torch.zeros(bs, 1, dtype=torch.long, device=device)
    return zeros - 1, zeros, zeros.float()


def chain_of(roots: torch.Tensor, rows: int) -> DraftTree:
    """A ``rows``-row chain repeating each root [bs] (calibration input: the shape matters, not the tokens)."""
    bs = roots.shape[0]
    ar = torch.arange(rows, device=roots.device)[None, :].expand(bs, -1)
    return DraftTree(roots[:, None].expand(-1, rows).contiguous(), (ar - 1).contiguous(), ar.contiguous(),
                     torch.zeros(bs, rows, device=roots.device))


def lead_rows(logits: torch.Tensor, walk: WalkResult) -> torch.Tensor:
    """[bs, V]: each request's logits at the row that produced its bonus token (the last accepted row)."""
    if logits.shape[1] == 1:  # an AR step: the root's row
        return logits[:, 0]
    dev = logits.device
    last = walk.accepted_rows.to(dev).gather(1, walk.accept_lens.to(dev)[:, None]).squeeze(1)
    return logits[torch.arange(logits.shape[0], device=dev), last]


def propose(sources: Sequence[CandidateSource], batch: RoundBatch, rows: int | Sequence[int],
            max_depth: int | None = None) -> DraftTree:
    """The candidates of every active source in one best-first tree of at most ``rows`` rows per request (several
    sources: merged by token path, ``glance_sgl.tree.merge_trees``, nodes no deeper than ``max_depth``)."""
    return one_tree([s.propose(batch, rows) for s in sources], rows, max_depth)


def agree_mask(agree: Callable[[int], int], mask: Sequence[bool]) -> list[bool]:
    """``mask`` as every rank takes it (rank 0's: ``agree``, e.g. :meth:`TargetRows.agree`, of its bits as one
    int)."""
    bits = agree(sum(1 << b for b, m in enumerate(mask) if m))
    return [bool(bits >> b & 1) for b in range(len(mask))]


def only_requests(tree: DraftTree, keep: Sequence[bool]) -> DraftTree:
    """``tree`` with the nodes of the requests not in ``keep`` [bs] untagged (``SOURCE_NONE``: a merge leaves them
    out; the tree itself as it is where every request is kept)."""
    if all(keep):
        return tree
    tags = tree.source_tags().clone()
    tags[torch.tensor([not k for k in keep], device=tags.device)] = SOURCE_NONE
    return DraftTree(tree.tokens, tree.parents, tree.depths, tree.scores, tags)


def one_tree(trees: Sequence[DraftTree], rows: int | Sequence[int], max_depth: int | None = None) -> DraftTree:
    """Several sources' candidate trees as one best-first tree of at most ``rows`` rows per request (one tree:
    as it is)."""
    return trees[0] if len(trees) == 1 else merge_trees(list(trees), rows, max_depth)


def speculative_round(batch: RoundBatch, planner: RoundPolicy, sources: Sequence[CandidateSource],
                      target: TargetRows, *, max_depth: int, device_resident: bool = False,
                      on_walk: Callable[[WalkResult], None] | None = None,
                      defer_outcome: bool = False) -> RoundResult:
    """One speculative round over ``batch``; returns what it verified and committed.

    ``max_depth``: the deepest node any source proposes (the walk's cap); ``device_resident``: the walk stays on
    the logits' device (``glance_sgl.verify.verify_tree``); ``on_walk``: called with the walk as soon as it is
    known, before the KV keep and the sources' writes (SGLang's overlap scheduler publishes the new lengths
    there). Timings (wall ms) go to the planner in its report: the sources' time (gate included), the target
    pass's, and the rest (choice, walk, keep, feeding the sources). ``defer_outcome``: the round returns once its
    device work is queued, without reading the outcome back; :meth:`RoundResult.settle` (before the next round
    plans: SGLang's overlap scheduler, whose next step starts before this one's results are processed) reads it,
    feeds the sources without a model pass and reports to the planner.

    The planner works on host copies: the sources without a model pass propose on the host, the drafter's tree
    is read back once after its pass (``DraftTree.host_copy``) and merged there, and the round's outcome is read
    back once after the walk (``WalkResult.host_copy``, the lead entropies in the same read). So a round reads the
    device at most twice, whatever the batch, the tree and the sources (``glance_sgl.host_transfers``).
    """
    # sources with a model pass (the drafter) and without (n-gram matches); every one of them is fed each round
    with_pass = [s for s in sources if s.source_id == SOURCE_DRAFTER]
    without_pass = [s for s in sources if s.source_id != SOURCE_DRAFTER]
    # nothing can propose: a planner that never speculates, or the drafter alone for requests that never draft again
    if not planner.speculates or (not without_pass and all(planner.retired(r) for r in batch.rids)):
        return plain_round(batch, planner, target, device_resident=device_resident, on_walk=on_walk)
    t0 = time.perf_counter()
    drafters, cheap = with_pass, without_pass
    rows = planner.max_nodes + 1

    def ended(tree: DraftTree) -> DraftTree:  # no rows past a request's end (a stop token, its token limit)
        return without_ended(tree, batch.stops, batch.room)

    # 1. the sources without a model pass propose first (host lookups, skipped for requests whose drafting
    #    rounds they add nothing to: those look after the gate if it leaves them out), and their best round is
    #    planned: the round to beat
    # a request with room for one more token at most (its limit) gains nothing from candidates: an AR step
    last = [r <= 1 for r in batch.room] if batch.room is not None else [False] * batch.size
    looks = [1 if end else n for n, end in zip(planner.cheap_rows(batch.rids, rows), last)] if cheap else []
    looked = sum(1 for n in looks if n > 1)
    with on_host():
        fallback = ended(propose(cheap, batch, looks, max_depth)) if looked else None
        t_look = time.perf_counter()
        alternative = None if fallback is None else planner.choose(batch.rids, fallback.scores, fallback.depths,
                                                                   fallback.sources, drafter_ran=False)
    t_plan = time.perf_counter()
    cheap_s = t_plan - t0
    # 2. gate: for which requests does the drafter's pass pay now, over that round? (every rank takes rank 0's)
    #    ... and whose drafter context is kept through this round (not a retired request's: the drafter never drafts
    #    for it again), agreed in the same broadcast
    n = batch.size
    if drafters:
        agreed = agree_mask(target.agree, planner.draft_mask(batch.rids, alternative)
                            + planner.context_mask(batch.rids))
        mask, context = [m and not end for m, end in zip(agreed[:n], last)], agreed[n:]
    else:
        mask, context = [False] * n, [False] * n
    keep = any(context)
    drafting = any(mask)
    # 2b. a request that skipped its lookup for the drafter's round (its matches add little there) but that the gate
    #     left out of it looks now: the round without the drafter is its round too, not an AR step
    #     (its plan sizes the verify tree of a round without the drafter; the planner's records keep the round
    #     the gate weighed, ``alternative``)
    late = [b for b in range(n) if looks[b] <= 1 and not mask[b] and not last[b]] if cheap else []
    late_s, verify_plan = 0.0, alternative
    if late:
        tl = time.perf_counter()
        with on_host():
            wanted = set(late)
            extra = ended(propose(cheap, batch, [rows if b in wanted else 1 for b in range(n)], max_depth))
            fallback = extra if fallback is None else merge_trees([fallback, extra], rows, max_depth)
            verify_plan = planner.choose(batch.rids, fallback.scores, fallback.depths, fallback.sources,
                                         drafter_ran=False)
        looked += len(late)
        late_s = time.perf_counter() - tl
        cheap_s += late_s
    t_gate = time.perf_counter()
    keeps_leads = True  # whether the planner keeps this round's lead entropies (a drafting round's: always)
    if drafting:
        # 3. the drafter's candidates (read back once) merged with the others, and how many rows of them to verify;
        #    the requests it does not draft for keep their matches (or the root alone) in the same pass
        whole = all(mask)
        members = [b for b, m in enumerate(mask) if m]
        trees = [d.propose(batch, rows) for d in drafters] if whole else \
            [spread_requests(d.propose(batch.select(members), rows), members, batch.roots) for d in drafters]
        hosts = [t.host_copy() for t in trees]
        tm = time.perf_counter()
        if fallback is not None:  # the matches of the requests where they are worth rows next to the drafter's
            worth = planner.merge_worth(batch.rids, alternative)
            hosts.append(only_requests(fallback, [w or not m for w, m in zip(worth, mask)]))
        with on_host():
            merged = one_tree(hosts, rows, max_depth)
            planned = ended(merged)
            t1 = time.perf_counter()
            plan = planner.choose(batch.rids, planned.scores, planned.depths, planned.sources, True, mask)
        cheap_s += t1 - tm if fallback is not None else 0.0
        # unmerged and nothing dropped: the drafter's tree where it lies
        candidates = trees[0] if len(hosts) == 1 and planned is merged else planned
    else:
        t1 = time.perf_counter()
        skipped = planner.skip(batch.rids, alternative)  # the drafter's record: a round without it
        keeps_leads = skipped.keeps_leads and bool(drafters)  # without a drafter no gate reads a lead
        candidates, plan = ((None, skipped) if verify_plan is None else
                            (fallback, dataclasses.replace(verify_plan, keeps_leads=keeps_leads)))
        planned = candidates
    # 4. the verify tree: a best-first prefix, rounded up to a width the pass runs (the root alone: an AR step),
    #    or each request's own best-first prefix where the planner sized them one by one
    t_draft = time.perf_counter()
    active = candidates is not None
    width = target.agree(target.width(plan.nodes + 1)) if active else 1
    tree = candidates.prefix(width).to(batch.roots.device) if active else root_tree(batch.roots)
    rows_each = ragged_rows(plan, tree.num_rows) if active else None
    if rows_each is not None:
        tree = tree.truncated(rows_each)
    t2 = time.perf_counter()
    # 5. one target pass over every request's tree, capturing the tap features where the drafter's context is kept
    feeds = drafting or keep
    out = target.forward(tree, taps=feeds) if rows_each is None else target.forward(tree, taps=feeds, rows=rows_each)
    t3 = time.perf_counter()
    # 6. the walk: the target's own choices (greedy, or seeded sampling), lossless whatever the tree
    walk = verify_tree(tree.tokens, tree.parents, tree.depths, out.logits, batch.next_index, list(batch.specs),
                       max_depth=min(max_depth, tree.num_rows - 1), device_resident=device_resident)
    if on_walk is not None:
        on_walk(walk)
    t_walk = time.perf_counter()
    # 7. keep the root's and the accepted rows' K/V, 8. feed the drafter what was committed (device work, queued
    #    before the read), read the outcome back, feed the other sources from it
    if tree.num_rows > 1:
        target.keep(tree, walk)
    t_keep = time.perf_counter()
    if feeds and with_pass:
        fed = batch if all(context) else dataclasses.replace(batch, context=context)
        for source in with_pass:
            source.commit(fed, out.taps, walk)
    lead_logits = lead_rows(out.logits, walk) if drafting or keeps_leads else None
    lead_tensor = None if lead_logits is None else entropy_tensor(lead_logits)
    launched = time.perf_counter()

    def settle() -> RoundReport:
        ts = time.perf_counter()
        host_walk, lead = walk.host_copy(lead_tensor)
        with on_host():
            for source in without_pass:
                source.commit(batch, out.taps, walk)
            t_commit = time.perf_counter()
            # what the round the drafter had to beat would have accepted on its own (its share of this round's
            # tokens)
            rival = drafting and alternative is not None and alternative.nodes > 0
            ta = time.perf_counter()
            alone = accepted_alone(alternative_tree(fallback, alternative), host_walk.committed_tokens).tolist() \
                if rival else None
            lookup_s = cheap_s + (time.perf_counter() - ta if rival else 0.0)
            accepted = host_walk.accept_lens.tolist()
            t4 = time.perf_counter()
            # 9. observe: one report, the planner learns acceptance, lead entropies and costs from it (an
            #    asynchronous pass's device time is known now; the host work is the rest of the wall time from its
            #    launch; a deferred outcome's: the launch's work after the pass and the read's)
            pass_ms = 1000.0 * (t3 - t2) if out.device_ms is None else out.device_ms()
            if defer_outcome:
                host_ms = 1000.0 * ((t2 - t1) + (launched - t3) + (t4 - ts))
            else:
                host_ms = max(1000.0 * ((t2 - t1) + (t4 - t2)) - pass_ms, 0.0)
            verified = planned.prefix(width) if active else None
            if rows_each is not None:
                verified = verified.truncated(rows_each)
            report = RoundReport(batch.rids, plan, tree.num_rows if rows_each is None else sum(rows_each) / n,
                                 accepted, verified, host_walk if active else None,
                                 None if lead is None else lead.tolist(), drafter_ms=1000.0 * (t1 - t0),
                                 pass_ms=pass_ms, host_ms=host_ms, alternative=alternative if rival else None,
                                 alone=alone, cheap_ms=1000.0 * lookup_s / looked if looked else None)
            planner.report(report)
        result.phases.update(commit=1000.0 * (t_commit - ts), report=1000.0 * (time.perf_counter() - t_commit))
        return report

    ms = [1000.0 * (b - a) for a, b in ((t0, t_look), (t_look, t_plan), (t_plan, t_gate), (t_gate, t_draft),
                                         (t_draft, t2), (t2, t3), (t3, t_walk), (t_walk, t_keep), (t_keep, launched))]
    phases = dict(zip(PHASES, ms))
    phases["lookup"] += 1000.0 * late_s  # the late lookups (2b) ran inside the gate's interval
    phases["gate"] -= 1000.0 * late_s
    result = RoundResult(tree, walk, plan, out, None, launched, settle, phases)
    if not defer_outcome:
        result.settle()
        result.ended = time.perf_counter()
    return result


def plain_round(batch: RoundBatch, planner: RoundPolicy, target: TargetRows, *, device_resident: bool = False,
                on_walk: Callable[[WalkResult], None] | None = None) -> RoundResult:
    """The round of a planner that never speculates (mode "off"), or of a batch whose requests all never draft again
    with the drafter as their only source: a plain AR step, the cost of "never hurts".
    Nothing is planned, captured, fed or observed, and the outcome is not read back (it commits each root's one
    choice, the bonus: the engine reads that itself). Its report says so: every request accepted no drafts."""
    t0 = time.perf_counter()
    tree = root_tree(batch.roots)
    t2 = time.perf_counter()
    out = target.forward(tree, taps=False)
    t3 = time.perf_counter()
    walk = verify_tree(tree.tokens, tree.parents, tree.depths, out.logits, batch.next_index, list(batch.specs),
                       max_depth=0, device_resident=device_resident)
    if on_walk is not None:
        on_walk(walk)
    t_walk = time.perf_counter()
    plan = planner.skip(batch.rids)
    ended = time.perf_counter()
    pass_ms = 1000.0 * (t3 - t2) if out.device_ms is None else None  # an asynchronous pass is not timed here
    report = RoundReport(batch.rids, plan, 1, [0] * batch.size, drafter_ms=0.0, pass_ms=pass_ms,
                         host_ms=1000.0 * ((t2 - t0) + (ended - t3)))
    phases = {"tree": 1000.0 * (t2 - t0), "pass": 1000.0 * (t3 - t2), "walk": 1000.0 * (t_walk - t3),
              "report": 1000.0 * (ended - t_walk)}
    return RoundResult(tree, walk, plan, out, report, ended, phases=phases)


def calibrate_round(target: TargetRows, sources: Sequence[CandidateSource], batch: RoundBatch,
                    row_grid: Sequence[int], max_rows: int, *, repeats: int, key: str = "",
                    smooth: bool = False) -> CostModel:
    """The costs of ``batch``'s rounds on this machine: the target pass over chains of every row count of
    ``row_grid`` (rows per request; 1 = the AR step's pass) and the sources' proposal at ``max_rows`` rows,
    measured by :func:`glance_sgl.costs.calibrate` (``repeats`` sweeps, the fastest of each point;
    ``smooth``: one request's curve). The passes leave nothing behind (:meth:`TargetRows.drop`)."""
    bs = batch.size

    def run_verify(rows: int, _batch: int) -> None:
        chain = chain_of(batch.roots, rows)
        target.forward(chain)
        target.drop(chain)

    def run_draft(_batch: int) -> None:
        propose(sources, batch, max_rows)

    return calibrate(run_verify, run_draft, [(r, bs) for r in row_grid], [bs], repeats=repeats, key=key, smooth=smooth)


__all__ = ["DRAFT_SOURCES", "PHASES", "DEFAULT_DRAFT_SOURCES", "check_draft_sources",
           "RoundBatch", "PassOutput", "TargetRows", "CandidateSource", "RoundPolicy", "RoundResult",
           "speculative_round", "calibrate_round", "root_tree", "chain_of", "lead_rows", "propose", "ragged_rows",
           "alternative_tree",
           "one_tree", "only_requests", "agree_mask"]
