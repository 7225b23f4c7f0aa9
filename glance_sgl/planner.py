"""Cost-aware planning of speculative rounds: how many tree nodes to verify, or none at all.

Engine-agnostic (torch and numbers; no Hugging Face or SGLang types). ``glance_sgl.round`` calls it the same way
for both engines, once per round (a batch of one in the embedded engine, SGLang's batch in the worker):

1. before the drafter runs, :meth:`Planner.draft_mask` says for which requests of the batch drafting pays this
   round (the drafter pass costs by the requests it drafts for; a request whose drafting is off verifies the
   round without it in the same target pass), from signals that cost nothing: each request's *lead entropy*
   (the entropy, nats, of the target distribution that produced the round's root token; the planner computed it
   from the previous round's report) through an online entropy table, scaled by the request's own recent yield;
   a request that stopped drafting is probed again after a back-off interval;
2. after the drafter pass, :meth:`Planner.choose` picks the number of nodes ``n`` (0 = the root alone) that
   maximises expected committed tokens per millisecond. A best-first tree of budget ``n`` is the first ``n`` nodes
   of the best-first tree of any larger budget, so one tree of the largest budget gives every candidate: node i's
   acceptance probability is ``exp(score_i + C[depth_i])`` (the drafter's path probability with a per-depth
   calibration ``C``), and the expected accepted drafts of budget ``n`` are the sum over its first ``n`` nodes;
3. after the walk, :meth:`Planner.report` takes one :class:`RoundReport`: what was accepted (per-depth
   calibration, entropy table, per-request yield), the rows of the pass that produced each bonus token (the next
   lead entropies, computed only where a gate will read them) and how long the round's parts took (the
   :class:`CostModel`).

The planner owns every piece of per-request state (its :class:`RequestPlanState` and the lead entropy); an
engine hands a request's first lead entropy to :meth:`Planner.begin` at prefill and calls :meth:`Planner.forget`
when the request ends.

The milliseconds it weighs come from the cost model (:class:`glance_sgl.costs.CostModel`: calibrated at start-up,
cached per device + model, refined online from the rounds' reports).
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from typing import Hashable, Literal, Sequence

import numpy as np
import torch

from .costs import CostModel
from .acceptance import DepthCalibration, EntropyTable, SourceAcceptance
from .tree import SOURCE_DRAFTER, SOURCE_NGRAM

PlannerMode = Literal["auto", "fixed", "off"]
# "off": never speculate (every round a plain AR step, no source proposes): the fixed cost of the speculative path
PLANNER_MODES = ("auto", "fixed", "off")

MIN_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 2, 64
PROBE_BACKOFF = 4  # a failed probe waits this many times longer for the next (2, 8, 32, 64 rounds) ...
PROBE_BACKOFF_FAST = 16  # ... or this many, while probes across requests rarely pay (2, 32, 64 rounds)
PROBE_RARE = 0.25  # "rarely": the decayed share of probes that paid, over all requests, below this
PROBE_DECAY = 0.9  # memory of that share: ~10 probes
START_DECAY = 0.6  # memory of how requests' first drafting rounds went: ~2.5 requests
START_HOLD = 8  # while first rounds rarely pay, a new request's first probe waits this many rounds ...
START_HOLD_LONG = 16  # ... and this many while they almost never do (share below START_RARE)
START_RARE = 0.1
EXPLORE = 2  # while first rounds rarely pay, one new request in EXPLORE x (requests in flight) drafts at once all
# the same, so a return of requests the drafter knows is noticed even when their answers are shorter than the hold.
# An explorer's probe costs its round's batch a drafter pass, so the interval grows with the requests in flight (the
# planner's: those it keeps state for): one request at a time every 2nd explores (bursts of 10 `wild` then 8 demo
# requests, the embedded engine, both sources: the demo ones ran 3.24x AR against 2.08x with every 8th, the `wild`
# ones 1.24x against 1.25x); at 8 in flight every 16th
# ... and a new request drafts in its first round all the same while at least START_TRUST of recent requests' first
# drafting rounds beat what it would run instead (the matches' round, of those that had matches, where it has
# matches; else an AR step; decayed shares, START_DECAY, with no prior: none measured, none trusted): the gain
# tables remember about a hundred rounds, so after a spell of traffic the drafter does not know they priced it at
# nothing over the matches, also for the traffic it does know, and requests that came back to it kept to their
# matches (the embedded engine with both sources, 20 `wild` answers then 20 `text` ones: the `text` answers after
# the explorer's, 8.5 tokens a round, ran at tau 2.7-3.4)
START_TRUST = 0.5
GAIN_EVIDENCE = 3.0  # a gain table of a rival bin with matches (one per bin) with fewer observations than this is
# still being explored: a new request whose matches fall in its bin drafts in its first round (else the gate would
# only ever read the table's prior there)
TREND = 0.95  # decay per drafted round of a request's tree-prediction sums: ~20 rounds (per-round acceptance is noisy)
RECENT = 0.97  # decay per round (AR rounds too) of what a request's drafting rounds accepted: ~30 rounds of memory
PRIOR_ROUNDS = 1.0  # weight, in rounds, of the entropy table's value in a request's expected acceptance
# Accepted drafts the round without the drafter (n-gram matches) expects: the bins of the drafter's gain tables.
# What the drafter adds depends on what the matches already cover: little over a long confident match (a replayed
# answer), much where there is none. One entropy table per bin, so traffic of one kind does not set the other's prior
RIVAL_EDGES = (0.5, 2.0, 4.0)
PROBE_OPTIMISM = 2.0  # a due probe runs where the drafter's gain could be this many times what its gain table expects
# The lookup of the sources without a model pass (n-gram matches) is skipped for a drafting request whose merged
# rounds got nothing from them the drafter did not propose too; it looks again after NGRAM_RECHECK skipped rounds
# (and every NGRAM_RECHECK-th skip over all requests looks).
# NGRAM_TREND: weight of the past in a request's record of what its lookups added (per drafting round that looked)
NGRAM_RECHECK = 8
NGRAM_TREND = 0.7
NGRAM_PRIOR = 1.0  # weight, in looks, of what lookups added over all requests (a request's prior)
NGRAM_ALL_TREND = 0.98  # weight of the past in that over-all record (per drafting round that looked)
# A request that has not drafted yet looks where the lookups of recent such requests paid (a record of its own, of
# their first drafting rounds and their rounds without the drafter; weight of the past FIRST_TREND per such round,
# as the traffic changes), and every FIRST_RECHECK-th skip of such a request looks all the same, so the record
# notices traffic whose matches pay again
FIRST_TREND = 0.6
FIRST_RECHECK = 4
# ... and it keeps looking where the matches' round alone would come within 1 / RIVAL_SLACK of the drafting
# round's tokens per ms (verifying RIVAL_ROWS rows): there the lookup is what lets the gate drop the drafter pass
RIVAL_SLACK = 1.25
RIVAL_ROWS = 8
# A request's matches join the drafter's tree only where their own round expects at least this many drafts: weak
# matches otherwise take rows from the drafter's nodes (their scores are learned over all traffic)
MERGE_MIN_DRAFTS = 0.5
COST_TREND = 0.9  # weight of the past in the measured ms of a lookup
# What a request's matches actually give against what their calibrated scores predict (the scores are learned over
# all traffic, where most matches are short and fail; a replayed answer's chain is taken whole): the gate weighs
# the round without the drafter at its predicted drafts times this ratio (a request's own record, decayed by
# MATCH_TREND per round that measured it, with a prior of one predicted draft that came true), capped at
# MATCH_RATIO_MAX. Only the gate: the row choice keeps the calibrated scores.
MATCH_TREND = 0.7
MATCH_RATIO_MAX = 4.0
# A request whose matches carry it (CARRY_ROUNDS rounds in a row without the drafter, each accepting CARRY_DRAFTS
# drafts or more and ending at a leaf of the verified tree: the proposal ran out, nothing it proposed was wrong) is
# copying what the corpora hold (a replayed answer, a quoted passage): it is retired, so the drafter's context stops
# being kept for it and no probe spends a drafter pass on it (``RequestPlanState.carried``)
CARRY_ROUNDS = 3
CARRY_DRAFTS = 3
# Planner.choose: host lists up to this batch size (its lists grow with batch x rows: at 32 rows the tensor ops are
# as fast from 8 requests on, 2 cores)
HOST_CHOOSE_MAX_BATCH = 4


def pay_score(ratio: float) -> float:
    """How much a probe or a first drafting round counts as paying in the planner's shares of paying rounds
    (``starts_paid``, ``probes_paid``), from ``ratio``: its tokens per ms over the rate it had to reach (> 1: it
    paid). 0 up to 1, rising to 1 at twice that rate: on traffic the drafter does not know, a round that one lucky
    token carries just past break-even is common (a quarter of the probes on the wild requests through SGLang), and
    counting it as a full success kept the drafter probing traffic whose probes lose on average."""
    return min(max(ratio - 1.0, 0.0), 1.0)


@dataclass
class RequestPlanState:
    """What the planner keeps per request: what its drafting rounds accepted, and its probe back-off.

    ``recent_accepted`` / ``recent_rounds``: drafts the drafter's rounds accepted beyond what the round without it
    would have (``RoundReport.alone``) and drafted rounds, both decayed by ``RECENT`` every round (AR rounds too,
    so a long spell without drafting leaves little of what came before); ``tree_ratio``: actual / tree-predicted
    accepted drafts (the tree-size choice's correction); ``paused``: drafting is off until
    a probe pays; ``ar_streak``: consecutive rounds without drafting; ``probe_interval``: rounds without drafting
    before the next probe; ``drafted_rounds``: rounds that ran the drafter (a request's first one is a probe:
    nothing is known about it yet); ``hold``: AR rounds before the first drafting round (set at the request's
    start from how recent requests' first rounds went); ``yielded``: paused because the round of the sources without
    a model pass (n-gram matches) did better, while its drafting pays over an AR step (its rounds without matches
    still weigh drafting, :meth:`off_for`); ``retired``: drafting is off for the rest of the request and no probe
    comes (where every request of a round is retired the engine stops keeping the drafter's context,
    :meth:`Planner.context_mask`, so the drafter costs nothing on traffic it does not know).
    """

    recent_accepted: float = 0.0
    recent_rounds: float = 0.0
    tree_actual: float = 1.0
    tree_pred: float = 1.0
    paused: bool = False
    ar_streak: int = 0
    probe_interval: int = MIN_PROBE_INTERVAL
    last_nodes: int = -1
    drafted_rounds: int = 0
    hold: int = 0
    explorer: bool = False  # one of the new requests that probe at once however rarely first rounds pay
    yielded: bool = False
    # the sources without a model pass (``Planner.cheap_rows``): what its lookups added to its drafting rounds
    # (decayed by NGRAM_TREND per such round); whether this round looked; rounds skipped in a row
    lookups: "LookupRecord" = field(default_factory=lambda: LookupRecord())
    looked: bool = True
    cheap_skipped: int = 0
    # rounds without the drafter that this request verified or was credited with (``RoundReport.alone``): their
    # predicted and their actual accepted drafts, decayed by MATCH_TREND (see ``match_ratio``)
    match_pred: float = 1.0
    match_actual: float = 1.0
    retired: bool = False
    carried: int = 0  # rounds in a row without the drafter that its matches carried (CARRY_ROUNDS)

    @property
    def probe_due(self) -> bool:
        """Whether this request's next round is a probe: while drafting is paused, once ``probe_interval`` AR
        rounds have passed; before its first drafting round, once ``hold`` of them have (and at least
        ``probe_interval``, for a request the entropy table alone kept from drafting)."""
        if self.retired:
            return False
        if self.drafted_rounds == 0:
            return self.ar_streak >= max(self.probe_interval, self.hold)
        return self.paused and self.ar_streak >= self.probe_interval

    @property
    def exploring(self) -> bool:
        """An explorer that has not drafted yet: its first probe runs at once, whatever the batch."""
        return self.explorer and self.drafted_rounds == 0

    @property
    def drafting_off(self) -> bool:
        """Paused, or a new request still held back from drafting: only a probe drafts for it."""
        return self.retired or self.paused or (self.drafted_rounds == 0 and self.ar_streak < self.hold)

    def off_for(self, matched: bool) -> bool:
        """Whether drafting is off for this request in a round whose matches expect drafts (``matched``) or none:
        :attr:`drafting_off`, except that a request that yielded to the matches weighs drafting where they expect
        none (a template opening found by the matches does not stop the drafter for the rest of the answer)."""
        return self.drafting_off and not (self.yielded and not matched and not self.retired)

    @property
    def tree_ratio(self) -> float:
        return min(self.tree_actual / self.tree_pred, 1.5)

    @property
    def match_ratio(self) -> float:
        """Actual / predicted accepted drafts of this request's rounds without the drafter (MATCH_RATIO_MAX)."""
        return min(self.match_actual / self.match_pred, MATCH_RATIO_MAX)

    def decay(self) -> None:
        self.recent_accepted *= RECENT
        self.recent_rounds *= RECENT


@dataclass
class LookupRecord:
    """What the lookups of the sources without a model pass (n-gram matches) gave the drafting rounds that made
    them, as decayed sums: the share of a round's committed tokens that only they proposed, what their round alone
    would have accepted (``RoundReport.alone``), the tokens those rounds committed, and the rounds."""

    share: float = 0.0
    alone: float = 0.0
    tokens: float = 0.0
    looks: float = 0.0

    def add(self, share: float, alone: float, tokens: float, trend: float) -> None:
        """One drafting round that looked (the past weighs ``trend``)."""
        self.share = trend * self.share + share
        self.alone = trend * self.alone + alone
        self.tokens = trend * self.tokens + tokens
        self.looks = trend * self.looks + 1.0

    def means(self, prior: "LookupRecord | None" = None, weight: float = 0.0) -> tuple[float, float, float]:
        """(share, alone, tokens) per round, with ``prior``'s means worth ``weight`` rounds (0, 0, 0: no round)."""
        if prior is None or prior.looks <= 0:
            prior, weight = LookupRecord(), 0.0
        n = weight + self.looks
        if n <= 0:
            return 0.0, 0.0, 0.0
        p = weight / prior.looks if weight else 0.0  # each prior sum scaled to ``weight`` rounds
        return ((p * prior.share + self.share) / n, (p * prior.alone + self.alone) / n,
                (p * prior.tokens + self.tokens) / n)


# ---------------------------------------------------------------------------------------------------- policy
@dataclass
class Plan:
    """The planner's pick for one batch: ``nodes`` per request (0 = a plain AR step) and what it expects to commit
    per request (``expected_tokens``, bonus included)."""

    nodes: int
    expected_tokens: list[float]
    drafted: bool = True
    raw_accept: list[float] = field(default_factory=list)  # tree-predicted accepted drafts before tree_ratio
    # a round without the drafter (``skip``): whether its lead entropies are kept for the next gate (False while
    # every request of the batch has its drafting off: the round need not compute them)
    keeps_leads: bool = True
    # a drafting round: the requests the drafter drafted for (``Planner.draft_mask``); None: every one
    drafted_mask: list[bool] | None = None
    # rows per request to verify, root included, where the engine verifies each request's own number of rows in
    # one pass (``Planner.ragged``: each <= nodes + 1); None: nodes + 1 for every request
    rows: list[int] | None = None

    def total_rows(self, bs: int) -> int:
        """Rows the target pass verifies for the batch of ``bs`` requests (before any rounding up to a width)."""
        return sum(self.rows) if self.rows is not None else bs * (self.nodes + 1)

    def drafted_for(self, bs: int) -> list[bool]:
        """Per request of the batch (``bs``), whether the drafter drafted for it this round."""
        if not self.drafted:
            return [False] * bs
        return [True] * bs if self.drafted_mask is None else list(self.drafted_mask)


@dataclass
class RoundReport:
    """What one round did, for :meth:`Planner.report` (one call per round, whatever the engine).

    ``rids``: the batch's requests; ``plan``: what the planner picked (``skip``'s plan for a round without
    drafting); ``rows``: rows per request the target pass verified (1 = an AR step; may exceed ``plan.nodes + 1``
    where the engine rounds up to a captured width; the mean where each request verified its own number,
    ``Plan.rows``); ``accepted``: accepted drafted nodes per request (bonus
    excluded); ``tree`` / ``walk``: the verified ``DraftTree`` and its ``WalkResult`` (the per-depth calibration;
    None skips it); ``lead_entropies``: [bs] the entropy (nats) of the target's distribution at the row that
    produced each request's bonus token (the next lead entropies; None: not computed, where no gate would read
    them, ``Plan.keeps_leads``: after a round without the drafter the planner then holds none); ``drafter_ms`` /
    ``pass_ms`` / ``host_ms``: the candidate sources' time, the target pass's, and the round's other host work
    (choice, walk, KV keep, feeding the sources), wall ms; None where not measured (the cost model is left as it
    is). ``alternative`` / ``alone``: in a drafting round that merged other sources' candidates, the round without
    the drafter that the gate weighed it against (``choose`` with ``drafter_ran=False``) and the drafted nodes per
    request that round alone would have accepted (``glance_sgl.tree.accepted_alone``): the drafter is credited
    with what it added, not with what the other sources found anyway. ``cheap_ms``: the ms per request that looked
    them up of the sources without a model pass (their lookup, merging their candidates, crediting the drafter),
    None where no request looked (``Planner.cheap_rows``).
    """

    rids: Sequence[Hashable]
    plan: "Plan"
    rows: float
    accepted: Sequence[int]
    tree: object = None
    walk: object = None
    lead_entropies: Sequence[float] | None = None
    drafter_ms: float | None = None
    pass_ms: float | None = None
    host_ms: float | None = None
    alternative: "Plan | None" = None
    alone: Sequence[int] | None = None
    cheap_ms: float | None = None

    @property
    def batch(self) -> int:
        return len(self.rids)

    @property
    def drafted(self) -> bool:
        return self.plan.drafted


@dataclass
class Planner:
    """Per-round tree sizes from a cost model and an acceptance predictor (see the module docstring).

    ``max_nodes``: the largest tree (nodes per request) the engine can verify; ``fixed_nodes``: the tree of
    ``mode="fixed"`` (today's behaviour: always draft, always that many nodes). ``max_depth``: deepest node.
    ``row_menu``: where the engine can only run some row counts fast (CUDA graphs captured at a few widths), those
    row counts (root included); ``choose`` then picks among their trees only. None: any size.
    """

    costs: CostModel
    max_nodes: int
    max_depth: int
    mode: PlannerMode = "auto"
    fixed_nodes: int | None = None
    margin: float = 1.02  # drafting must beat AR by this factor, so noise does not make it flap
    # choose: the smallest tree within this factor of the best expected tokens per ms. 1.0: the best. A 2 % hedge
    # against deep nodes' uncertain predictions cost more than it saved: on 2 cores the demo's verify cost is
    # nearly flat from 8 to 24 rows, and the smaller trees it took lost tau (caption 8.31 vs 9.42, open 3.05 vs
    # 3.26; geomean decode speedup 2.67x vs 2.79x, one interleaved run, 20 prompts per task)
    size_margin: float = 1.0
    row_menu: list[int] | None = None
    # the engine verifies each request's own number of rows in one pass (SGLang's CPU backend): ``choose`` then
    # gives every request of a batch its own rows (``Plan.rows``) instead of one size for all
    ragged: bool = False
    depth: DepthCalibration = field(init=False)
    gains: list[EntropyTable] = field(init=False)  # the drafter's gain by lead entropy, one per RIVAL_EDGES bin
    requests: dict[object, RequestPlanState] = field(default_factory=dict)
    # per request: the entropy (nats) of the target distribution that produced its newest token, None where no
    # gate will read it (kept apart from ``requests``, whose entry a request gets at its first gate)
    leads: dict[object, float | None] = field(default_factory=dict)
    # decayed counts over all requests of probes that paid and of all probes (a prior of one paying probe in two)
    probes_paid: float = 1.0
    probes: float = 2.0
    # ... and of requests' first drafting rounds (a prior of one that paid)
    starts_paid: float = 1.0
    starts: float = 1.0
    # ... and, decayed with no prior (START_TRUST), those that beat an AR step out of all of them, and those that beat
    # the matches' round out of those that had matches: [AR step, matches]
    starts_beat: list[float] = field(default_factory=lambda: [0.0, 0.0])
    starts_seen: list[float] = field(default_factory=lambda: [0.0, 0.0])
    since_explorer: int = 0  # new requests since the last explorer
    explore_debt: bool = False  # an explorer ended before its first round (a one-token request): the next explores
    cheap_ms: float | None = None  # measured ms per request of a lookup of the sources without a model pass
    # ... what they gave drafting rounds over all requests (NGRAM_ALL_TREND), and requests' first ones (FIRST_TREND)
    lookups_all: LookupRecord = field(default_factory=LookupRecord)
    lookups_first: LookupRecord = field(default_factory=LookupRecord)
    carried_retired: int = 0  # requests retired because their matches carried them (CARRY_ROUNDS)
    cheap_skips: int = 0  # lookups skipped so far, over all requests
    first_skips: int = 0  # ... of those, in requests' first drafting rounds

    def __post_init__(self) -> None:
        if self.mode not in PLANNER_MODES:
            raise ValueError(f"planner must be one of {PLANNER_MODES}, got {self.mode!r}")
        self.fixed_nodes = self.max_nodes if self.fixed_nodes is None else min(self.fixed_nodes, self.max_nodes)
        self.depth = DepthCalibration(self.max_depth)
        self.gains = [EntropyTable(self.max_depth) for _ in range(len(RIVAL_EDGES) + 1)]
        self.acceptance = SourceAcceptance(max_depth=max(self.max_depth, 1))

    # ------------------------------------------------------------ per request
    def state(self, rid: object) -> RequestPlanState:
        st = self.requests.get(rid)
        if st is None:
            share = self.starts_paid / self.starts
            hold = START_HOLD_LONG if share < START_RARE else START_HOLD if share < PROBE_RARE else 0
            self.since_explorer += 1
            explorer = self.since_explorer >= self.explore_interval()
            if not explorer and self.explore_debt:
                explorer, self.explore_debt = True, False
            if explorer:
                self.since_explorer = 0
            st = self.requests[rid] = RequestPlanState(hold=0 if explorer else hold, explorer=explorer)
        return st

    def explore_interval(self) -> int:
        """New requests from one explorer to the next: ``EXPLORE`` per request in flight, the next new one
        included (an explorer's probe drafts for its batch)."""
        return EXPLORE * (len(self.requests) + 1)

    def drafter_idle(self) -> bool:
        """Whether the drafter knows almost nothing of today's traffic: requests' first drafting rounds and probes
        both rarely pay (``START_RARE``, ``PROBE_RARE``). Then a request whose probe failed is retired
        (``RequestPlanState.retired``) instead of waiting ``MAX_PROBE_INTERVAL`` rounds for the next, and a new
        request is retired at birth (:meth:`admit`) unless it explores. A request that started before keeps its
        hold and its probe: it may be one the drafter knows."""
        return self.mode == "auto" and self.starts_paid / self.starts < START_RARE \
            and self.probe_success() < PROBE_RARE

    def admit(self, rid: object) -> bool:
        """A new request, before its prefill: whether the engine keeps the drafter's context for it. Not where the
        drafter idles (:meth:`drafter_idle`): the request is retired at birth, so the drafter costs it next to
        nothing (its decode steps feed no context, no probe; the embedded engine projects no prompt context either,
        while SGLang writes the prompt's, which its radix cache may lend to a later request), except every
        :meth:`explore_interval`-th new request (an explorer), which keeps its context and probes at once, so that a
        return of traffic the drafter knows is still noticed (its paying first round ends the idling; at most the
        interval less one such requests lose theirs). Asked again (a prompt prefilled in chunks, or again after a
        retraction), the answer stands."""
        known = rid in self.requests
        st = self.state(rid)
        if not known and not st.explorer and self.drafter_idle():
            st.retired = True
        return not st.retired

    def retired(self, rid: object) -> bool:
        """Whether request ``rid`` never drafts again (retired at birth, after a failed probe while the drafter
        idles, or carried by its matches; mode "off" never drafts): where the drafter is its only source, its
        rounds are plain steps (``round.plain_round``)."""
        return self.mode == "off" or self.state(rid).retired

    def context_mask(self, rids: Sequence[object]) -> list[bool]:
        """Per request of ``rids``, whether the engine keeps its drafter context current through this round (its
        committed rows fed to the drafter; the pass captures the tap features where any request's is kept): not
        for a retired request (nor any where the planner never speculates). A retired request never drafts again,
        so the context it misses is never read."""
        if self.mode == "off":
            return [False] * len(rids)
        return [not self.state(r).retired for r in rids]

    def forget(self, rid: object) -> None:
        """Drop everything kept for request ``rid`` (it ended). An explorer that ended before it drafted (a request
        of one token) hands its role to the next new request."""
        st = self.requests.pop(rid, None)
        if st is not None and st.explorer and st.drafted_rounds == 0:
            self.explore_debt = True
        self.leads.pop(rid, None)

    def known(self) -> set:
        """Requests the planner keeps state for."""
        return set(self.requests) | set(self.leads)

    def begin(self, rid: object, lead_entropy: float | None) -> None:
        """A request's first lead entropy (nats; from the prefill pass's last row), or a new one after the engine
        recomputed its prefix (SGLang's retraction)."""
        self.leads[rid] = lead_entropy

    def lead_entropy(self, rid: object) -> float | None:
        """The request's lead entropy: of the distribution that produced its newest token (None: not computed)."""
        return self.leads.get(rid)

    # ------------------------------------------------------------ step 1: draft or not
    @staticmethod
    def rival_bin(rival_tokens: float) -> int:
        """The ``RIVAL_EDGES`` bin of a round without the drafter that expects ``rival_tokens`` committed tokens
        per request (0: under half a draft beyond the bonus token, e.g. an AR step)."""
        return bisect.bisect_right(RIVAL_EDGES, rival_tokens - 1.0)

    def gain_table(self, rival_tokens: float) -> EntropyTable:
        """The entropy table of the drafter's gain where the round without it expects ``rival_tokens`` committed
        tokens per request (1.0: an AR step, nothing proposed)."""
        return self.gains[self.rival_bin(rival_tokens)]

    def predicted_accept(self, rid: object, lead_entropy: float | None, prior_cap: float | None = None,
                         rival_tokens: float = 1.0) -> float:
        """Accepted drafts expected from drafting now beyond the round without the drafter, before the drafter
        pass: what the request's own recent drafting rounds added, with the gain table's value at
        ``lead_entropy`` (the table of ``rival_tokens``: what that round expects to commit) as a prior worth
        ``PRIOR_ROUNDS`` rounds (all there is for a request that has not drafted yet); ``prior_cap``: the prior
        counts up to this value only."""
        st = self.state(rid)
        prior = self.gain_table(rival_tokens).expected(lead_entropy if lead_entropy is not None else 0.0)
        if prior_cap is not None:
            prior = min(prior, prior_cap)
        return (PRIOR_ROUNDS * prior + st.recent_accepted) / (PRIOR_ROUNDS + st.recent_rounds)

    @property
    def speculates(self) -> bool:
        """False for mode "off": no candidate source proposes, every round is a plain AR step."""
        return self.mode != "off"

    def cheap_rows(self, rids: Sequence[object], rows: int) -> list[int]:
        """Rows per request (root included) for the candidate sources without a model pass this round; 1: no
        lookup. Every request of a batch of several looks: the drafter pass costs by the requests it drafts for, and
        the gate can leave a request out of it only where it knows the round its matches allow (new requests at 16
        in flight that skipped their lookups sent replayed answers through the drafter, 0.76-0.91x of the round with
        their lookups; drafting requests that skipped theirs, the same at 8 and 32 in flight: 0.97 and 0.87 of
        NGRAM against 1.01 and 0.94 looking, docs/planner.md). So does a request whose drafting is off (the lookup
        is then the round's only candidates). A drafting request alone in its batch (every embedded request) skips
        the lookup where what lookups added to its drafting rounds is worth less than the lookup costs: the share
        of a round's committed tokens that no drafter node proposed (its own record, with the record over all
        requests as a prior worth ``NGRAM_PRIOR`` rounds) times its share of a round's ms, against the measured ms
        per lookup (``cheap_ms``), unless the matches' round alone would come close to the drafting round
        (:meth:`_lookup_pays`). It looks again after ``NGRAM_RECHECK`` skipped rounds, and so does every
        ``NGRAM_RECHECK``-th skip over all requests (so the record over all requests stays current where answers
        last a few rounds). One that has not drafted yet is judged by what the lookups of recent such requests gave
        their rounds (``lookups_first``: first drafting rounds and rounds without the drafter; the over-all record
        as a prior worth ``NGRAM_PRIOR`` rounds), and every ``FIRST_RECHECK``-th such skip looks all the same.
        Only the "auto" mode decides; the others always look."""
        bs = len(rids)
        if self.mode != "auto" or self.cheap_ms is None or self.lookups_all.looks < NGRAM_PRIOR:
            return [rows] * bs
        out = []
        for r in rids:
            st = self.state(r)
            if st.drafting_off or bs > 1:
                skip = False
            elif st.drafted_rounds == 0:
                skip = self.lookups_first.looks > 0 and not self._lookup_pays(
                    self.lookups_first.means(self.lookups_all, NGRAM_PRIOR), st, bs)
                if skip:
                    self.first_skips += 1
                    skip = self.first_skips % FIRST_RECHECK != 0
            else:
                skip = st.cheap_skipped < NGRAM_RECHECK and not self._lookup_pays(
                    st.lookups.means(self.lookups_all, NGRAM_PRIOR), st, bs)
                if skip:
                    self.cheap_skips += 1
                    skip = self.cheap_skips % NGRAM_RECHECK != 0
            st.looked = not skip
            st.cheap_skipped = st.cheap_skipped + 1 if skip else 0
            out.append(1 if skip else rows)
        return out

    def looks_first(self) -> bool:
        """Whether a request starting now, alone in its batch, looks up the sources without a model pass in its
        first round: :meth:`cheap_rows`'s rule for such a request, its counters untouched (the embedded engine then
        hands the request's prompt to the n-gram source before the prefill, so SGLang's insert thread stores it
        meanwhile, instead of in the first lookup's way)."""
        if self.mode != "auto" or self.cheap_ms is None or self.lookups_all.looks < NGRAM_PRIOR:
            return True
        if self.lookups_first.looks <= 0:
            return True
        record = self.lookups_first.means(self.lookups_all, NGRAM_PRIOR)
        return self._lookup_pays(record, RequestPlanState(), 1) or (self.first_skips + 1) % FIRST_RECHECK == 0

    def merge_worth(self, rids: Sequence[object], alternative: "Plan") -> list[bool]:
        """Per request of ``rids``, whether the matches' candidates join the drafter's tree: where the round they
        allow alone (``alternative``, :meth:`choose` with ``drafter_ran=False``) expects ``MERGE_MIN_DRAFTS``
        drafts or more. Weaker matches still stand as the round the drafter has to beat."""
        return [t - 1.0 >= MERGE_MIN_DRAFTS for t in alternative.expected_tokens]

    def _lookup_pays(self, record: tuple[float, float, float], st: RequestPlanState, bs: int) -> bool:
        """Whether a drafting request's lookup is worth its ms (:meth:`cheap_rows`), by ``record``: the mean
        share, alone and tokens per round of :meth:`LookupRecord.means`."""
        share, alone, tokens = record
        nodes = self.fixed_nodes if st.last_nodes < 0 else st.last_nodes
        round_ms = self.costs.round_ms(nodes, bs) / bs
        cheap_ms = self.cheap_ms or 0.0
        if share * round_ms > self.margin * cheap_ms:  # what the matches add to drafting rounds pays for it
            return True
        # ... or their round alone comes close enough to the drafting round to take over from it
        rival_ms = self.costs.verify_ms(RIVAL_ROWS, bs) / bs + cheap_ms
        return RIVAL_SLACK * (1.0 + alone) / rival_ms > tokens / round_ms

    def gate(self, rids: Sequence[object], alternative: "Plan | None" = None) -> bool:
        """Whether the drafter runs this round for any request of the batch (:meth:`draft_mask`)."""
        return any(self.draft_mask(rids, alternative))

    def draft_mask(self, rids: Sequence[object], alternative: "Plan | None" = None) -> list[bool]:
        """Per request of ``rids``, whether the drafter drafts for it this round, from each request's lead entropy
        and record. Cheap: no tensor work. Counts a probe as drafting. ``alternative``: the round without the
        drafter that the other sources' candidates allow (:meth:`choose` with ``drafter_ran=False``); None: an AR
        step. A probe drafts for the whole batch, less the requests whose matches cover the block (unless their
        own probe is due and worth it, or their drafting is on); otherwise the requests whose drafting is on draft
        where what they are expected to add pays for the round, the drafter pass priced at their number (it costs by
        the requests it drafts for: on a CPU about 0.8 ms a request at 16 in flight). Those whose drafting is off
        (paused, held back) verify the round without the drafter in the same target pass."""
        bs = len(rids)
        if self.mode == "fixed":
            return [True] * bs
        if self.mode == "off":
            return [False] * bs
        states = [self.state(r) for r in rids]
        leads = [self.leads.get(r) for r in rids]
        stakes = None  # (other, round_ms, rate): weighed only where a probe is due or some request drafts
        due = [b for b, st in enumerate(states) if st.probe_due]
        off = [st.off_for(self.rival_bin(o) > 0) for st, o in zip(states, self._rivals(alternative, bs))]
        # a probe: a request's drafting may pay (again); the tree size still gets chosen. In a batch the whole
        # batch pays for it, so a probe waits until half the batch's are due (or an explorer's is), unless the
        # batch's drafting pays anyway; every request of a drafted batch is probed by it. Where n-gram matches
        # cover part of the block, a due request counts only where drafting could pay over them: where the
        # drafter's gain, at PROBE_OPTIMISM times what its gain table expects, reaches what this batch's drafting
        # round needs (probing requests whose matches already cover the block costs a drafter pass for nothing),
        # or once it has waited MAX_PROBE_INTERVAL rounds. An explorer drafts the whole batch at once only where
        # its matches cover little of the block (where they do, the drafter has little to show, and the batch's
        # drafter pass would be paid for one request's look: at 16 in flight about half a target pass)
        if due:
            other, round_ms, rate = stakes = self._stakes(states, alternative)
            need = self.margin * rate * round_ms / bs - sum(other) / bs
            worth = [b for b in due if self.rival_bin(other[b]) == 0 or states[b].ar_streak >= MAX_PROBE_INTERVAL
                     or states[b].exploring or PROBE_OPTIMISM
                     * self.gain_table(other[b]).expected(leads[b] if leads[b] is not None else 0.0) >= need]
            if worth and (2 * len(worth) >= bs
                          or any(states[b].exploring and self.rival_bin(other[b]) == 0 for b in worth)):
                # every request is probed with them but those whose matches cover the block and were not worth a
                # probe: the drafter pass would cost them their share (on a CPU it costs by the requests it drafts
                # for) and its nodes would take rows from their matches; a retired request's context may have gaps
                probed = set(worth)
                return [not st.retired and (b in probed or not off[b] or self.rival_bin(other[b]) == 0)
                        for b, st in enumerate(states)]
        if all(off):
            return [False] * bs
        other, round_ms, rate = stakes or self._stakes(states, alternative)
        # the requests whose drafting is on, priced with the drafter pass at their number
        on = [b for b in range(bs) if not off[b]]
        tokens = sum(other) + sum(self.predicted_accept(rids[b], leads[b], rival_tokens=other[b]) for b in on)
        ms = round_ms + self.costs.draft_ms(len(on)) - self.costs.draft_ms(bs)
        if not tokens / ms > self.margin * rate:
            # ... except a new request whose first round the gain tables may misjudge (:meth:`_first_round_trusted`)
            return [not off[b] and states[b].drafted_rounds == 0 and self._first_round_trusted(other[b])
                    for b in range(bs)]
        return [not o for o in off]

    def _first_round_trusted(self, rival_tokens: float) -> bool:
        """Whether a new request drafts in its first round where the gain tables say drafting does not pay: while
        at least ``START_TRUST`` of recent requests' first drafting rounds paid (against the matches' round where its
        matches expect ``rival_tokens``, else against an AR step), or where the drafter's gain over such matches was
        hardly ever measured (``GAIN_EVIDENCE``: a template opening the matches know would stand for the whole answer
        the drafter drafts, and the gate would weigh the table's prior forever)."""
        kind = int(self.rival_bin(rival_tokens) > 0)
        trusted = self.starts_beat[kind] >= START_TRUST * self.starts_seen[kind] > 0.0
        return trusted or (kind == 1 and self.gain_table(rival_tokens).seen < GAIN_EVIDENCE)

    @staticmethod
    def _rivals(alternative: "Plan | None", bs: int) -> list[float]:
        """Tokens per request the round without the drafter expects (``alternative``; none: an AR step, 1 each)."""
        return list(alternative.expected_tokens) if alternative is not None and alternative.nodes > 0 else [1.0] * bs

    def _stakes(self, states: Sequence[RequestPlanState], alternative: "Plan | None" = None
                ) -> tuple[list[float], float, float]:
        """What drafting this batch is weighed against: the tokens per request the round without the drafter
        expects (``alternative``, else an AR step: 1 each), a drafting round's ms (at the tree size the batch last
        chose, whose rounds the acceptance record comes from, or the fixed budget) and that round's tokens per
        ms."""
        bs = len(states)
        tree_round = alternative is not None and alternative.nodes > 0
        other = [1.0 + (o - 1.0) * st.match_ratio for o, st in zip(alternative.expected_tokens, states)] \
            if tree_round else [1.0] * bs
        last = max((st.last_nodes for st in states), default=-1)
        ref = self.fixed_nodes if last <= 0 else min(last, self.fixed_nodes)
        if tree_round:
            rate = sum(other) / (self.plan_verify_ms(alternative, bs) + self.costs.overhead_ms)
        else:
            rate = bs / self.costs.ar_ms(bs)
        return other, self.costs.round_ms(ref, bs), rate

    def skip(self, rids: Sequence[object], alternative: "Plan | None" = None) -> Plan:
        """Record a round without drafting (an AR step, or the round of ``alternative``, for every request of the
        batch). A request that was drafting is paused: it drafts again when a probe pays, or, where it gave way to
        matches that expected drafts (``RequestPlanState.yielded``), when the gate finds drafting pays in a round
        without them. Mode "off" records nothing (no gate reads it)."""
        if self.mode == "off":
            return Plan(0, [1.0] * len(rids), drafted=False, keeps_leads=False)
        for r, o in zip(rids, self._rivals(alternative, len(rids))):
            st = self.state(r)
            st.ar_streak += 1
            st.decay()
            if st.drafted_rounds and not st.paused:
                st.paused, st.probe_interval = True, MIN_PROBE_INTERVAL
                st.yielded = self.rival_bin(o) > 0
        return Plan(0, [1.0] * len(rids), drafted=False, keeps_leads=not self._leads_unread(rids))

    def _leads_unread(self, rids: Sequence[object]) -> bool:
        """Whether no gate reads these requests' lead entropies after a round without the drafter: the planner is
        ``off`` (its gate reads nothing), or every one of them has its drafting off (paused or held back; a probe
        then reads none), none of them for matches only (``RequestPlanState.yielded``)."""
        return self.mode == "off" or all(self.state(r).off_for(matched=False) for r in rids)

    # ------------------------------------------------------------ step 2: how many nodes
    def expected_accept(self, scores: torch.Tensor, depths: torch.Tensor, sources: torch.Tensor | None = None,
                        drafter_nodes: bool = True) -> torch.Tensor:
        """[B, R] expected accepted drafts of budget n = 0 .. R-1 per request, by the calibrated node
        probabilities, from the best-first tree's node scores / depths / source tags [B, R] (row 0 the root;
        ``drafter_nodes``: :meth:`DepthCalibration.node_probs`)."""
        probs = self.depth.node_probs(scores, depths, sources, drafter_nodes)
        probs[:, 0] = 0.0
        return torch.cumsum(probs, dim=1)

    def _accept_curves(self, scores: torch.Tensor, depths: torch.Tensor, sources: torch.Tensor | None,
                       drafter_nodes: bool) -> list[list[float]]:
        """:meth:`expected_accept` as host lists [B][R]. A small batch on the host (the round's host copies, up to
        ``HOST_CHOOSE_MAX_BATCH`` requests) is summed in Python, in double precision: some ten tiny tensor ops
        and a read cost more there (about 0.15 ms of a round on 2 cores)."""
        if scores.device.type != "cpu" or scores.shape[0] > HOST_CHOOSE_MAX_BATCH:
            return self.expected_accept(scores, depths, sources, drafter_nodes).tolist()
        top = self.depth.max_depth
        logc = self.depth.log_cumulative_host() if drafter_nodes else None
        tags = sources.tolist() if sources is not None and drafter_nodes else None
        out = []
        for b, (row_scores, row_depths) in enumerate(zip(scores.tolist(), depths.tolist())):
            total, curve = 0.0, [0.0]
            for i in range(1, len(row_scores)):
                x = row_scores[i]
                if logc is not None and (tags is None or tags[b][i] == SOURCE_DRAFTER):
                    x += logc[min(row_depths[i], top)]
                total += min(math.exp(x), 1.0)
                curve.append(total)
            out.append(curve)
        return out

    def _accept_array(self, scores: torch.Tensor, depths: torch.Tensor, sources: torch.Tensor | None,
                      drafter_nodes: bool) -> np.ndarray:
        """:meth:`expected_accept` as a float64 array [B, R] on the host, in array ops (the ragged choice)."""
        x = scores.detach().cpu().numpy().astype(np.float64)
        if drafter_nodes:
            logc = np.asarray(self.depth.log_cumulative_host())
            add = logc[np.minimum(depths.cpu().numpy(), self.depth.max_depth)]
            if sources is not None:
                add = np.where(sources.cpu().numpy() == SOURCE_DRAFTER, add, 0.0)
            x = x + add
        probs = np.minimum(np.exp(x), 1.0)
        probs[:, 0] = 0.0
        return np.cumsum(probs, axis=1)

    def choose(self, rids: Sequence[object], scores: torch.Tensor, depths: torch.Tensor,
               sources: torch.Tensor | None = None, drafter_ran: bool = True,
               drafted: Sequence[bool] | None = None) -> Plan:
        """The tree size for this batch after the candidate sources ran (the same for every request of the batch).
        ``sources``: the candidates' source tags (None: the drafter's tree); ``drafter_ran``: False for candidates
        of sources without a model pass (n-gram matches alone): the round then costs no drafter pass, and the
        drafter's own record (its tree-size correction, the size its gate weighs) is left alone; ``drafted``: where
        it ran, the requests it drafted for (:meth:`draft_mask`; None: all), the only ones whose record it
        touches."""
        bs, rows = scores.shape
        mask = self._subset(drafter_ran, drafted)
        if rows == 1:  # nothing proposed (no n-gram match): the root alone, no tensor work
            return Plan(0, [1.0] * bs, drafted=drafter_ran, raw_accept=[0.0] * bs, drafted_mask=mask)
        limit = min(rows - 1, self.max_nodes)
        sources = None if sources is None else sources[:, : limit + 1]
        # without the drafter's pass the candidates hold none of its nodes: nothing to calibrate, no tree ratio;
        # every request's raw acceptance and expected tokens at every budget [bs][limit + 1], as lists (the round
        # plans on host copies of the candidates: not a device read)
        ratios = [self.state(r).tree_ratio if mask is None or mask[b] else 1.0 for b, r in enumerate(rids)] \
            if drafter_ran else None
        if self.mode != "fixed" and self.ragged and bs > 1:  # each request its own size, in array ops
            raw = self._accept_array(scores[:, : limit + 1], depths[:, : limit + 1], sources, drafter_ran)
            curves = 1.0 + (raw if ratios is None else raw * np.asarray(ratios)[:, None])
            draft = self.costs.draft_ms(bs if mask is None else sum(mask)) if drafter_ran else 0.0
            counts = self._ragged_nodes(curves, draft)
            self._note_nodes(rids, drafter_ran, mask, counts)
            at = (np.arange(bs), np.asarray(counts))
            return Plan(max(counts), curves[at].tolist(), drafted=drafter_ran, raw_accept=raw[at].tolist(),
                        drafted_mask=mask, rows=[c + 1 for c in counts])
        raw_host = self._accept_curves(scores[:, : limit + 1], depths[:, : limit + 1], sources, drafter_ran)
        if ratios is not None:
            curve_host = [[1.0 + x * q for x in row] for row, q in zip(raw_host, ratios)]
        else:
            curve_host = [[1.0 + x for x in row] for row in raw_host]
        per_n = [sum(col) for col in zip(*curve_host)]  # [limit + 1]: the batch's expected tokens for budget n
        if self.mode == "fixed":
            n = min(self.fixed_nodes, limit)
        else:
            drafts = bs if mask is None else sum(mask)
            draft = self.costs.draft_ms(drafts) if drafter_ran else 0.0
            sizes = list(range(limit + 1)) if not self.row_menu else \
                sorted({min(w - 1, limit) for w in self.row_menu if w >= 1})
            verify = self.costs.verify_ms_many([n + 1 for n in sizes], bs)
            # a tree's host work (mask, walk, keep: ``overhead_ms``) comes on top of its pass; the root alone is an
            # AR step, whose host work the one-row point of the curve holds already (``CostModel.observe_ar``)
            rates = [per_n[n] / (draft + v + (self.costs.overhead_ms if n > 0 else 0.0))
                     for n, v in zip(sizes, verify)]
            # the smallest tree within ``size_margin`` of the best rate
            best = max(rates)
            n = next(size for size, rate in zip(sizes, rates) if rate >= best / self.size_margin)
        self._note_nodes(rids, drafter_ran, mask, n)
        return Plan(n, [row[n] for row in curve_host], drafted=drafter_ran, raw_accept=[row[n] for row in raw_host],
                    drafted_mask=mask)

    def plan_verify_ms(self, plan: Plan, bs: int) -> float:
        """The target pass of ``plan``'s tree over ``bs`` requests (``CostModel.verify_ms``): ``nodes + 1`` rows
        each, or each request's own rows (``Plan.rows``)."""
        if plan.rows is None:
            return self.costs.verify_ms(plan.nodes + 1, bs)
        return float(self.costs.verify_ms_totals(np.array([float(plan.total_rows(bs))]), bs)[0])

    def _ragged_nodes(self, curves: np.ndarray, draft_ms: float) -> list[int]:
        """Nodes per request where every request verifies its own number of rows (:attr:`ragged`): the allocation
        of the batch's rows with the best expected tokens per ms, the pass priced by its total rows.

        ``curves`` [bs, limit + 1]: each request's expected tokens (bonus included) with its best ``n`` nodes;
        ``draft_ms``: the round's drafter pass (0 without it). Each request's marginal tokens per node are taken
        non-increasing along its tree (a running minimum), so that ranking every request's nodes by them takes
        each request's best-first prefix; the batch verifies the first ``t`` nodes of that ranking, for the
        smallest ``t`` within ``size_margin`` of the best rate (``t = 0``: an AR step, whose host work the curve's
        one-row point holds; a tree adds ``overhead_ms``)."""
        c = curves
        bs, limit = c.shape[0], c.shape[1] - 1
        gains = np.diff(c, axis=1)  # [bs, limit]
        order = np.argsort(-np.minimum.accumulate(gains, axis=1).ravel(), kind="stable")  # ties: shallower first
        tokens = c[:, 0].sum() + np.concatenate(([0.0], np.cumsum(gains.ravel()[order])))
        ms = draft_ms + self.costs.verify_ms_totals(bs + np.arange(order.size + 1, dtype=np.float64), bs)
        ms[1:] += self.costs.overhead_ms
        rates = tokens / ms
        t = int(np.argmax(rates >= rates.max() / self.size_margin))
        return np.bincount(order[:t] // limit, minlength=bs).tolist() if t else [0] * bs

    @staticmethod
    def _subset(drafter_ran: bool, drafted: Sequence[bool] | None) -> list[bool] | None:
        """:meth:`choose`'s ``drafted`` as ``Plan.drafted_mask``: None where the drafter did not run or drafted for
        every request."""
        return None if not drafter_ran or drafted is None or all(drafted) else list(drafted)

    def _note_nodes(self, rids: Sequence[object], drafter_ran: bool, mask: list[bool] | None,
                    n: int | Sequence[int]) -> None:
        """The tree size a drafting round chose (one for the batch, or one per request), in the record of each
        request it drafted for (``mask``; None: all)."""
        if drafter_ran:
            for b, r in enumerate(rids):
                if mask is None or mask[b]:
                    self.state(r).last_nodes = n if isinstance(n, int) else n[b]

    # ------------------------------------------------------------ step 3: feedback
    def report(self, report: RoundReport) -> None:
        """One round's outcome: acceptance (drafting rounds), the next lead entropies and the measured costs (none
        in mode "off": no decision reads them)."""
        if self.mode == "off":
            return
        leads = [self.leads.get(r) for r in report.rids]
        only = None
        if getattr(report.tree, "sources", None) is not None and report.walk is not None and report.rows > 1 \
                and (report.drafted or SOURCE_NGRAM not in self.acceptance.hindsight):
            # per source and depth, from trees that hold other sources' nodes (the drafter's own trees calibrate
            # ``depth``); a round without the drafter holds n-gram nodes alone, labelled in hindsight by their
            # source (nothing to count here, and ``only`` is read by drafting rounds only)
            only = self.acceptance.observe(report.tree, report.walk.accepted_rows)
        if report.cheap_ms is not None:
            self.cheap_ms = report.cheap_ms if self.cheap_ms is None else \
                COST_TREND * self.cheap_ms + (1.0 - COST_TREND) * report.cheap_ms
        self._observe_matches(report)
        self._observe_carried(report)
        if not report.drafted and report.cheap_ms is not None:
            self._observe_first_lookups(report)
        if report.drafted:
            self._observe_accepts(report, leads, only)
        # kept only where the next gate may read it (not while every request of a batch that did not draft is
        # paused or held back: such a round computes none, ``Plan.keeps_leads``, nor does one without a drafter)
        if not report.drafted and (report.lead_entropies is None or self._leads_unread(report.rids)):
            self.leads.update((r, None) for r in report.rids)
        elif report.lead_entropies is not None:
            self.leads.update(zip(report.rids, report.lead_entropies))
        if None not in (report.drafter_ms, report.pass_ms, report.host_ms):
            self.costs.observe_round(report.rows, report.batch, report.drafted, report.drafter_ms, report.pass_ms,
                                     report.host_ms, sum(report.plan.drafted_for(report.batch)))

    def _observe_first_lookups(self, report: RoundReport) -> None:
        """A round without the drafter that looked the matches up: for each request that has not drafted yet, what
        its lookup gave (``lookups_first``; its committed drafts were all the matches', none where it found nothing).
        Without it the record saw only the first rounds that drafted, those whose matches were too weak to stand
        alone, and told the next requests to skip lookups a replayed answer would have paid for."""
        for r, a in zip(report.rids, report.accepted):
            st = self.state(r)
            if st.drafted_rounds == 0 and st.looked:
                self.lookups_first.add(a / (1.0 + a), float(a), 1.0 + a, FIRST_TREND)

    def _observe_carried(self, report: RoundReport) -> None:
        """Counts, per request, the rounds in a row that its matches carried without the drafter (CARRY_DRAFTS
        drafts or more, the walk ending at a leaf of the verified tree) and retires it at CARRY_ROUNDS (mode
        "auto"): it is copying what the corpora hold, which the drafter cannot beat, and keeping its context (tap
        capture, deferred draft K/V) or probing it would cost every step for nothing. Any other round resets the
        count."""
        if self.mode != "auto":
            return
        mask = report.plan.drafted_for(report.batch)
        carried = [False] * report.batch
        deep = [b for b, (a, d) in enumerate(zip(report.accepted, mask)) if a >= CARRY_DRAFTS and not d]
        if deep and report.rows > 1 and report.tree is not None and report.walk is not None:
            parents = report.tree.parents.tolist()
            ends = report.walk.accepted_rows.tolist()
            for b in deep:
                last = ends[b][report.accepted[b]]
                carried[b] = last > 0 and last not in parents[b]  # a leaf: the proposal ran out
        for r, c in zip(report.rids, carried):
            st = self.state(r)
            st.carried = st.carried + 1 if c else 0
            if st.carried >= CARRY_ROUNDS and not st.retired:
                st.retired = True
                self.carried_retired += 1

    def _observe_matches(self, report: RoundReport) -> None:
        """Each request's predicted and actual drafts of the round without the drafter: the round itself where it
        ran (n-gram candidates only), else what it would have accepted inside a drafting round that weighed it
        (``alternative`` / ``alone``)."""
        if report.drafted:
            plan, actual = report.alternative, report.alone
        else:
            plan, actual = (report.plan, report.accepted) if report.rows > 1 else (None, None)
        if plan is None or actual is None or not plan.raw_accept or plan.nodes <= 0:
            return
        for r, pred, got in zip(report.rids, plan.raw_accept, actual):
            st = self.state(r)
            st.match_pred = MATCH_TREND * st.match_pred + float(pred)
            st.match_actual = MATCH_TREND * st.match_actual + float(got)

    def _observe_accepts(self, report: RoundReport, lead_entropies: Sequence[float | None],
                         only: dict[int, list[int]] | None = None) -> None:
        """What a drafted round accepted: per-depth calibration, entropy table, each request's record, probes.
        ``only``: per source, accepted drafts per request that no other source proposed (merged trees)."""
        plan, tree, walk = report.plan, report.tree, report.walk
        # the drafter's per-depth calibration, from its own nodes (a merged tree's other nodes are calibrated by
        # ``acceptance``): calibrating from its unmerged trees only left it to the rounds without a lookup, whose
        # acceptance differs (a request's first round always looks)
        if tree is not None and walk is not None and plan.nodes > 0:
            tags = getattr(tree, "sources", None)
            self.depth.observe(tree.parents, tree.scores, tree.depths, walk.accepted_rows, walk.accept_lens,
                               None if tags is None else tags == SOURCE_DRAFTER)
        bs = report.batch
        mask = plan.drafted_for(bs)
        round_ms = self.costs.draft_ms(sum(mask)) + self.plan_verify_ms(plan, bs) + self.costs.overhead_ms
        # the round drafting had to beat: the other sources' round, or an AR step
        rival = report.alternative if report.alternative is not None and report.alone is not None else None
        rival_ms = self.costs.ar_ms(bs) if rival is None else \
            self.plan_verify_ms(rival, bs) + self.costs.overhead_ms
        alone = [0] * bs if rival is None else report.alone
        rival_tokens = [1.0] * bs if rival is None else rival.expected_tokens
        raw = plan.raw_accept or [0.0] * bs
        cheap_only = [0] * bs if only is None else only.get(SOURCE_NGRAM, [0] * bs)
        for r, h, a, s, o, pred, extra, drafted in zip(report.rids, lead_entropies, report.accepted, alone,
                                                       rival_tokens, raw, cheap_only, mask):
            st = self.state(r)
            if not drafted:  # left out of the drafter's pass this round: not paused (the next gate weighs it again)
                st.ar_streak += 1
                st.decay()
                continue
            a, s = float(a), float(s)
            if st.looked and only is not None and plan.nodes > 0:  # what its lookup added to this round
                share = float(extra) / (1.0 + a)
                st.lookups.add(share, s, 1.0 + a, NGRAM_TREND)
                self.lookups_all.add(share, s, 1.0 + a, NGRAM_ALL_TREND)
                if st.drafted_rounds == 0:
                    self.lookups_first.add(share, s, 1.0 + a, FIRST_TREND)
            gain = max(a - s, 0.0)  # what the drafter added over the rival round's own acceptance
            if plan.nodes > 0 and h is not None:
                self.gain_table(o).observe(h, gain)
                st.tree_actual = TREND * st.tree_actual + a
                st.tree_pred = TREND * st.tree_pred + float(pred)
            st.decay()
            st.recent_accepted += gain
            st.recent_rounds += 1.0
            # did drafting pay for this request (its share of the batch's round against its share of the rival's)?
            # Against an AR step, this round's tokens say. Against the other sources' round, what it commits
            # depends on how lucky their matches were this round (the same luck on both sides), so the drafter's
            # expected gain, this round now in the request's record, is weighed against that round's expected
            # tokens: a round the matches happened to find as well (a template opening) does not pause a request
            # the drafter serves well. The entropy table's prior counts only up to what this round accepted: it
            # was learned on other traffic, and a round that accepted little is this request's evidence against it
            # (as ratios: the round's tokens per ms over what it had to reach, > 1: it paid)
            if rival is None:
                ratio = (1.0 + a) / round_ms * rival_ms / self.margin
                ratio_ar = ratio
            else:
                ratio = (o + self.predicted_accept(r, h, prior_cap=a, rival_tokens=o)) / round_ms * rival_ms / \
                    (self.margin * o)
                # ... and over an AR step, on the drafts that were not the matches' alone: the drafter serves this
                # request where the matches are missing (it yields to them where they are found)
                ratio_ar = max(ratio, (1.0 + a - float(extra)) / round_ms * self.costs.ar_ms(bs) / self.margin)
            paid, paid_ar, score = ratio > 1.0, ratio_ar > 1.0, pay_score(ratio_ar)
            if st.drafted_rounds == 0:
                self.starts = START_DECAY * self.starts + 1.0
                self.starts_paid = START_DECAY * self.starts_paid + score
                for kind, beat in ((0, paid_ar), (1, paid)) if rival is not None else ((0, paid_ar),):
                    self.starts_seen[kind] = START_DECAY * self.starts_seen[kind] + 1.0
                    self.starts_beat[kind] = START_DECAY * self.starts_beat[kind] + float(beat)
            if st.drafted_rounds == 0 or st.paused:
                self._probed(st, paid, score, yielded=paid_ar and not paid)
            st.drafted_rounds += 1
            st.ar_streak = 0

    def probe_success(self) -> float:
        """The decayed share of probes (first rounds included) that paid, over all requests."""
        return self.probes_paid / self.probes

    def _probed(self, st: RequestPlanState, paid: bool, score: float, yielded: bool = False) -> None:
        """A probe's outcome: back to drafting, or a longer wait for the next probe. Where probes rarely pay
        (traffic the drafter does not know) the wait grows faster, so probes do not eat what AR rounds save.
        ``score``: how well it paid (:func:`pay_score`), what the share of paying probes counts. ``yielded``: it
        did not pay over the matches' round but would have over an AR step: paused for the matches, drafting where
        they are missing (``RequestPlanState.yielded``), no longer wait."""
        self.probes = PROBE_DECAY * self.probes + 1.0
        self.probes_paid = PROBE_DECAY * self.probes_paid + score
        st.paused, st.yielded = not paid, yielded
        if paid or yielded:
            st.probe_interval = MIN_PROBE_INTERVAL
        elif self.starts_paid / self.starts < START_RARE:
            st.probe_interval = MAX_PROBE_INTERVAL  # the drafter knows almost nothing of today's traffic
            st.retired = self.drafter_idle()
        else:
            backoff = PROBE_BACKOFF_FAST if self.probe_success() < PROBE_RARE else PROBE_BACKOFF
            st.probe_interval = min(backoff * st.probe_interval, MAX_PROBE_INTERVAL)


class AlwaysDraft:
    """The policy of an ablation without planning (the width-1 chain, mode "chain"): every round drafts and
    verifies every candidate the source proposed; nothing is learned, timed or computed for it."""

    mode = "always"
    speculates = True

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes

    def draft_mask(self, rids: Sequence[object], alternative: Plan | None = None) -> list[bool]:
        return [True] * len(rids)

    def skip(self, rids: Sequence[object], alternative: Plan | None = None) -> Plan:
        return Plan(0, [1.0] * len(rids), drafted=False)

    def cheap_rows(self, rids: Sequence[object], rows: int) -> list[int]:
        return [rows] * len(rids)

    def merge_worth(self, rids: Sequence[object], alternative: Plan) -> list[bool]:
        return [True] * len(rids)

    def admit(self, rid: object) -> bool:
        return True

    def retired(self, rid: object) -> bool:
        return False

    def context_mask(self, rids: Sequence[object]) -> list[bool]:
        return [True] * len(rids)

    acceptance = None  # other sources score their nodes with their own priors

    def choose(self, rids: Sequence[object], scores: torch.Tensor, depths: torch.Tensor,
               sources: torch.Tensor | None = None, drafter_ran: bool = True,
               drafted: Sequence[bool] | None = None) -> Plan:
        """Every proposed node; no prediction (``expected_tokens`` empty)."""
        return Plan(scores.shape[1] - 1, [], drafted=drafter_ran)

    def report(self, report: RoundReport) -> None:
        return None

    def begin(self, rid: object, lead_entropy: float | None) -> None:
        return None

    def lead_entropy(self, rid: object) -> float | None:
        return None

    def forget(self, rid: object) -> None:
        return None


class RandomPlanner(Planner):
    """A test policy: each batch drafts with probability 2/3 (for each of its requests with probability 3/4, at
    least one) and then verifies a random number of nodes (0 .. max; where the engine verifies ragged rows,
    ``ragged``, half the batches of several requests give each request its own random number), otherwise runs a
    plain AR step; seeded.
    Lossless must hold whatever a planner picks, since every prefix of a best-first tree (the root alone included)
    is a valid tree. Requests retire at random, at birth (:meth:`admit`) or later (:meth:`draft_mask`). Feedback and
    costs are recorded as usual."""

    def __init__(self, *args, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rng = random.Random(seed)
        self.birth_rng = random.Random(seed + 1)  # apart, so that the rounds' draws do not depend on admissions

    def admit(self, rid) -> bool:
        """Retires one new request in 8 at birth (no drafter context from its prompt on); asked again, the answer
        stands."""
        if rid not in self.requests:
            self.state(rid).retired = self.birth_rng.random() < 1 / 8
        return not self.state(rid).retired

    def draft_mask(self, rids, alternative: Plan | None = None) -> list[bool]:
        """Also retires each request with probability 1/64 a round (never drafted for again: the engine stops
        keeping the drafter's context where a whole round is retired)."""
        states = [self.state(r) for r in rids]
        for st in states:
            st.retired = st.retired or self.rng.random() < 1 / 64
        live = [b for b, st in enumerate(states) if not st.retired]
        if not live or self.rng.random() >= 2 / 3:
            return [False] * len(rids)
        mask = [not st.retired and self.rng.random() < 3 / 4 for st in states]
        mask[self.rng.choice(live)] = True
        return mask

    def cheap_rows(self, rids, rows: int) -> list[int]:
        """A batch skips the lookups of the sources without a model pass with probability 1/4 (a drafting round
        then verifies the drafter's tree alone, at any batch size), else each request looks up with probability
        3/4."""
        if self.rng.random() < 1 / 4:
            return [1] * len(rids)
        return [rows if self.rng.random() < 3 / 4 else 1 for _ in rids]

    def merge_worth(self, rids, alternative: Plan) -> list[bool]:
        """Each request's matches join the drafter's tree with probability 3/4."""
        return [self.rng.random() < 3 / 4 for _ in rids]

    def choose(self, rids, scores: torch.Tensor, depths: torch.Tensor, sources: torch.Tensor | None = None,
               drafter_ran: bool = True, drafted: Sequence[bool] | None = None) -> Plan:
        limit = min(scores.shape[1] - 1, self.max_nodes)
        mask = self._subset(drafter_ran, drafted)
        if self.ragged and len(rids) > 1 and self.rng.random() < 1 / 2:  # every request its own random size
            counts = [self.rng.randint(0, limit) for _ in rids]
            tags = None if sources is None else sources[:, : limit + 1]
            raw_all = self.expected_accept(scores[:, : limit + 1], depths[:, : limit + 1], tags).tolist()
            raw_host = [float(row[c]) for row, c in zip(raw_all, counts)]
            self._note_nodes(rids, drafter_ran, mask, counts)
            return Plan(max(counts), [1.0 + a for a in raw_host], drafted=drafter_ran, raw_accept=raw_host,
                        drafted_mask=mask, rows=[c + 1 for c in counts])
        n = self.rng.randint(0, limit)
        tags = None if sources is None else sources[:, : n + 1]
        raw = self.expected_accept(scores[:, : n + 1], depths[:, : n + 1], tags)[:, n]
        self._note_nodes(rids, drafter_ran, mask, n)
        raw_host = raw.tolist()  # as Planner.choose's: lists of the host copy's numbers
        return Plan(n, [1.0 + float(a) for a in raw_host], drafted=drafter_ran, raw_accept=raw_host,
                    drafted_mask=mask)


__all__ = ["Planner", "RandomPlanner", "AlwaysDraft", "Plan", "RoundReport", "PlannerMode", "PLANNER_MODES",
           "RequestPlanState"]
