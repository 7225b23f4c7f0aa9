"""The one speculative round (glance_sgl.round) on the embedded engine's adapters, driven directly: a batch of one
over a real Hugging Face cache and drafter context, one planner report per round, the cache holding exactly the
committed prefix, greedy output equal to the AR path's, and calibration passes that leave nothing behind."""

from __future__ import annotations

import time

import torch

from glance_sgl.drafter import CachedDrafter
from glance_sgl.engine import SamplingParams
from glance_sgl.metrics import entropy_nats
from glance_sgl.planner import Planner, RandomPlanner, RoundReport
from glance_sgl.round import PHASES, RoundBatch, calibrate_round, speculative_round
from glance_sgl.target import CachePass
from glance_sgl.verify import SamplingSpec

from tests.glance_testing import make_prompts


class RecordingPlanner(RandomPlanner):
    """The random test policy (AR rounds, the root alone, any tree size), keeping every report it gets."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reports: list[RoundReport] = []

    def report(self, report: RoundReport) -> None:
        self.reports.append(report)
        super().report(report)


def test_round_reports_once_keeps_the_committed_prefix_and_matches_ar(engines):
    engine = engines["qwen2_5_vl"]
    target, taps = engine.target, engine.drafter.config.tap_layers
    messages = make_prompts(2, seed=21)[1]
    ar = engine.generate(messages, SamplingParams(max_tokens=20), mode="ar").token_ids
    planner = RecordingPlanner(engine.cost_model(), engine.max_nodes, engine.block_size - 1, seed=5)
    prompt = target.prepare(messages)
    state, rows = target.prefill(prompt, taps=taps)
    source = CachedDrafter.start(engine.drafter, rows.taps, engine.branch_k)
    rows_pass = CachePass(target, state, taps)
    committed = [int(rows.logits[-1].argmax())]
    planner.begin("r", entropy_nats(rows.logits[-1]))
    rounds, drafted, plain = 0, 0, 0
    while len(committed) < len(ar):
        batch = RoundBatch(["r"], torch.tensor([committed[-1]]), torch.tensor([len(committed)]), [SamplingSpec()])
        retired = planner.retired("r")  # the random policy retires requests now and then
        t0 = time.perf_counter()
        r = speculative_round(batch, planner, [source], rows_pass, max_depth=engine.block_size - 1)
        wall_ms = 1000.0 * (time.perf_counter() - t0)
        rounds += 1
        drafted += r.drafted
        committed += r.walk.committed()[0]
        # the cache holds the prompt and every committed token but the newest (the next round's root)
        assert state.length == prompt.num_tokens + len(committed) - 1
        if retired:  # plain steps from then on, nothing planned or reported
            assert r.tree.num_rows == 1 and list(r.phases) == ["tree", "pass", "walk", "report"]
            plain += 1
            continue
        # every part of the round timed, in order, adding up to no more than the round's wall time
        assert list(r.phases) == list(PHASES) and all(ms >= 0 for ms in r.phases.values())
        assert sum(r.phases.values()) <= wall_ms
        rep = planner.reports[-1]
        assert rep is r.report and rep.rows == r.tree.num_rows and rep.accepted == r.walk.accept_lens.tolist()
        assert (rep.tree is not None) == r.drafted
        # the lead entropy is computed where the planner keeps it: a drafting round, or a batch not all held back
        assert (rep.lead_entropies is not None) == (r.drafted or r.plan.keeps_leads)
        assert rep.lead_entropies is None or len(rep.lead_entropies) == 1
        # committed tokens wait in the drafter's stash until its next pass (which flushed the earlier ones)
        assert source.stash and (not r.drafted or len(source.stash) == 1)
    assert committed[: len(ar)] == ar
    assert len(planner.reports) == rounds - plain and 0 < drafted < rounds
    # calibration passes through the same adapters leave the cache and the drafter's context as they were
    length, context = state.length, int(source.cache.lengths[0])
    batch = RoundBatch(["cal"], torch.tensor([committed[-1]]), torch.tensor([0]), [SamplingSpec()])
    costs = calibrate_round(rows_pass, [source], batch, [1, 2, 4, 8], engine.max_nodes + 1, repeats=1)
    assert costs.verify_rows == [1, 2, 4, 8] and costs.draft_batch == [1]
    assert state.length == length and int(source.cache.lengths[0]) >= context and not source.stash


def test_a_planner_owns_the_lead_entropy_through_the_round(engines):
    """The lead entropy the gate reads is the one of the row that produced the newest token: the planner computes
    it from the round's report (no handshake with the engine)."""
    engine = engines["qwen2_5_vl"]
    target, taps = engine.target, engine.drafter.config.tap_layers
    planner = Planner(engine.cost_model(), max_nodes=engine.budget, max_depth=engine.block_size - 1, mode="fixed")
    state, rows = target.prefill(target.prepare(make_prompts(1, seed=22)[0]), taps=taps)
    source = CachedDrafter.start(engine.drafter, rows.taps, engine.branch_k)
    committed = [int(rows.logits[-1].argmax())]
    planner.begin("r", entropy_nats(rows.logits[-1]))
    batch = RoundBatch(["r"], torch.tensor([committed[-1]]), torch.tensor([1]), [SamplingSpec()])
    r = speculative_round(batch, planner, [source], CachePass(target, state, taps), max_depth=engine.block_size - 1)
    last = int(r.walk.accepted_rows[0, int(r.walk.accept_lens[0])])
    assert r.drafted and r.tree.num_nodes == engine.budget
    assert abs(planner.lead_entropy("r") - entropy_nats(r.out.logits[0, last])) < 1e-5
    planner.forget("r")
    assert planner.lead_entropy("r") is None and "r" not in planner.known()


def test_a_round_no_gate_reads_computes_no_lead_entropy(engines):
    """While every request of a batch has its drafting off (paused), no gate reads its lead entropy: the round
    without the drafter computes none, and the planner holds none for it."""
    engine = engines["qwen2_5_vl"]
    target, taps = engine.target, engine.drafter.config.tap_layers
    planner = Planner(engine.cost_model(), max_nodes=engine.budget, max_depth=engine.block_size - 1)
    state, rows = target.prefill(target.prepare(make_prompts(1, seed=24)[0]), taps=taps)
    source = CachedDrafter.start(engine.drafter, rows.taps, engine.branch_k)
    committed = [int(rows.logits[-1].argmax())]
    planner.begin("r", entropy_nats(rows.logits[-1]))
    st = planner.state("r")
    st.paused, st.probe_interval, st.ar_streak = True, 10**6, 0  # held back, no probe due
    batch = RoundBatch(["r"], torch.tensor([committed[-1]]), torch.tensor([1]), [SamplingSpec()])
    r = speculative_round(batch, planner, [source], CachePass(target, state, taps), max_depth=engine.block_size - 1)
    assert not r.drafted and not r.plan.keeps_leads and r.report.lead_entropies is None
    assert planner.lead_entropy("r") is None
    st.paused, st.hold = False, 0  # a request not held back, which the gate declines: its lead is kept
    planner.margin = 1e9
    r = speculative_round(batch, planner, [source], CachePass(target, state, taps), max_depth=engine.block_size - 1)
    assert not r.drafted and r.plan.keeps_leads and r.report.lead_entropies is not None
    assert planner.lead_entropy("r") == r.report.lead_entropies[0]
    planner.mode = "off"  # a planner that never drafts reads no lead
    r = speculative_round(batch, planner, [source], CachePass(target, state, taps), max_depth=engine.block_size - 1)
    assert not r.plan.keeps_leads and r.report.lead_entropies is None


class _CountingSource:
    """A candidate source wrapper that counts proposals (and forwards everything else)."""

    def __init__(self, inner) -> None:
        self.inner, self.proposed, self.committed, self.source_id = inner, 0, 0, inner.source_id

    def propose(self, batch, rows):
        self.proposed += 1
        return self.inner.propose(batch, rows)

    def commit(self, batch, taps, walk):
        self.committed += 1
        self.inner.commit(batch, taps, walk)


def test_planner_off_never_proposes_and_decodes_as_ar(engines):
    """``mode="off"`` (``GLANCE_PLANNER=off``): every round a plain AR step, no source asked for candidates, the
    output the AR path's."""
    engine = engines["qwen2_5_vl"]
    target, taps = engine.target, engine.drafter.config.tap_layers
    messages = make_prompts(1, seed=23)[0]
    ar = engine.generate(messages, SamplingParams(max_tokens=12), mode="ar").token_ids
    planner = Planner(engine.cost_model(), max_nodes=engine.budget, max_depth=engine.block_size - 1, mode="off")
    assert not planner.speculates
    state, rows = target.prefill(target.prepare(messages), taps=taps)
    source = _CountingSource(CachedDrafter.start(engine.drafter, rows.taps, engine.branch_k))
    rows_pass = CachePass(target, state, taps)
    committed = [int(rows.logits[-1].argmax())]
    while len(committed) < len(ar):
        batch = RoundBatch(["r"], torch.tensor([committed[-1]]), torch.tensor([len(committed)]), [SamplingSpec()])
        r = speculative_round(batch, planner, [source], rows_pass, max_depth=engine.block_size - 1)
        assert not r.drafted and r.tree.num_rows == 1
        assert list(r.phases) == ["tree", "pass", "walk", "report"]  # nothing planned, looked up or fed
        committed += r.walk.committed()[0]
    assert committed[: len(ar)] == ar and source.proposed == 0 and source.committed == 0  # nothing fed either


class _TapsRecordingPass(CachePass):
    """The embedded pass, recording whether each pass was asked for tap features."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.asked: list[bool] = []

    def forward(self, tree, taps=True):
        self.asked.append(taps)
        return super().forward(tree, taps)


def test_rounds_of_retired_requests_keep_no_drafter_context(engines):
    """Once the planner retires a request (it never drafts for it again), its rounds capture no tap features and
    feed the drafter nothing: with the drafter its only source, each is a plain AR step (``plain_round``: no gate,
    plan or report); the output stays the AR path's."""
    engine = engines["qwen2_5_vl"]
    target, taps = engine.target, engine.drafter.config.tap_layers
    messages = make_prompts(1, seed=31)[0]
    ar = engine.generate(messages, SamplingParams(max_tokens=16), mode="ar").token_ids
    planner = Planner(engine.cost_model(), max_nodes=engine.budget, max_depth=engine.block_size - 1)
    state, rows = target.prefill(target.prepare(messages), taps=taps)
    source = _CountingSource(CachedDrafter.start(engine.drafter, rows.taps, engine.branch_k))
    rows_pass = _TapsRecordingPass(target, state, taps)
    committed = [int(rows.logits[-1].argmax())]
    planner.begin("r", entropy_nats(rows.logits[-1]))
    reported = []
    planner.report = lambda report, _own=planner.report: (reported.append(report), _own(report))
    while len(committed) < len(ar):
        if len(rows_pass.asked) == 3:
            planner.state("r").retired = True
            fed, reports = source.committed, len(reported)
        batch = RoundBatch(["r"], torch.tensor([committed[-1]]), torch.tensor([len(committed)]), [SamplingSpec()])
        r = speculative_round(batch, planner, [source], rows_pass, max_depth=engine.block_size - 1)
        assert not (r.drafted and planner.state("r").retired)
        if planner.state("r").retired:
            assert r.tree.num_rows == 1 and list(r.phases) == ["tree", "pass", "walk", "report"]
        committed += r.walk.committed()[0]
    assert committed[: len(ar)] == ar
    assert rows_pass.asked[:3] == [True] * 3 and not any(rows_pass.asked[3:]) and len(rows_pass.asked) > 3
    assert source.committed == fed == 3 and len(reported) == reports == 3  # nothing reported once retired


class _AsyncTimedPass(CachePass):
    """The embedded pass, reporting a device time of its own as an asynchronous (CUDA) pass does, and sleeping
    ``lag_s`` in its forward (the wall time the host spends there)."""

    def __init__(self, *args, device_ms: float, lag_s: float) -> None:
        super().__init__(*args)
        self.ms, self.lag_s, self.read = device_ms, lag_s, 0

    def forward(self, tree, taps=True):
        import dataclasses
        import time

        time.sleep(self.lag_s)
        out = super().forward(tree, taps)

        def device_ms() -> float:
            self.read += 1
            return self.ms

        return dataclasses.replace(out, device_ms=device_ms)


def test_an_asynchronous_pass_is_timed_by_its_device_time(engines):
    """A pass that reports its device time (CUDA events, no synchronize after the pass) is timed by it once the
    outcome is read: the report's pass ms is that time, its host ms the rest of the wall time from the launch."""
    engine = engines["qwen2_5_vl"]
    target, taps = engine.target, engine.drafter.config.tap_layers
    planner = RecordingPlanner(engine.cost_model(), engine.max_nodes, engine.block_size - 1, seed=3)
    state, rows = target.prefill(target.prepare(make_prompts(1, seed=5)[0]), taps=taps)
    source = CachedDrafter.start(engine.drafter, rows.taps, engine.branch_k)
    committed = [int(rows.logits[-1].argmax())]
    planner.begin("r", entropy_nats(rows.logits[-1]))
    for device_ms in (0.0, 7.5, 1e6):  # 1e6: more than the whole round's wall time: host time 0, not negative
        timed = _AsyncTimedPass(target, state, taps, device_ms=device_ms, lag_s=0.01)
        batch = RoundBatch(["r"], torch.tensor([committed[-1]]), torch.tensor([len(committed)]), [SamplingSpec()])
        r = speculative_round(batch, planner, [source], timed, max_depth=engine.block_size - 1)
        committed += r.walk.committed()[0]
        rep = planner.reports[-1]
        assert timed.read == 1 and rep.pass_ms == device_ms
        assert rep.host_ms >= (10.0 if device_ms == 0.0 else 0.0) and (device_ms < 1e6 or rep.host_ms == 0.0)


def test_a_deferred_outcome_is_read_and_reported_when_settled(engines):
    """``defer_outcome`` (SGLang's overlap scheduler): the round returns with its device work queued and no report;
    settled before the next round plans, the rounds plan, report and commit exactly what in-round reads give
    (same random planner seed, greedy output equal to AR)."""
    engine = engines["qwen2_5_vl"]
    target, taps = engine.target, engine.drafter.config.tap_layers
    messages = make_prompts(3, seed=8)[2]
    ar = engine.generate(messages, SamplingParams(max_tokens=24), mode="ar").token_ids
    runs = {}
    for defer in (False, True):
        planner = RecordingPlanner(engine.cost_model(), engine.max_nodes, engine.block_size - 1, seed=11)
        state, rows = target.prefill(target.prepare(messages), taps=taps)
        source = CachedDrafter.start(engine.drafter, rows.taps, engine.branch_k)
        committed = [int(rows.logits[-1].argmax())]
        planner.begin("r", entropy_nats(rows.logits[-1]))
        pending = None
        while len(committed) < len(ar):
            if pending is not None:  # the previous round's outcome, read where this one starts
                report = pending.settle()
                assert report is planner.reports[-1] and pending.settle() is report  # once
                pending = None
            batch = RoundBatch(["r"], torch.tensor([committed[-1]]), torch.tensor([len(committed)]),
                               [SamplingSpec()])
            reports_before = len(planner.reports)
            r = speculative_round(batch, planner, [source], CachePass(target, state, taps),
                                  max_depth=engine.block_size - 1, defer_outcome=defer)
            assert (r.report is None) == defer and len(planner.reports) == reports_before + (not defer)
            # a deferred round's outcome read and report are timed when it settles
            assert ("commit" in r.phases and "report" in r.phases) != defer
            committed += r.walk.committed()[0]
            pending = r if defer else None
        if pending is not None:
            pending.settle()
        runs[defer] = (committed[: len(ar)], [(p.rows, p.accepted, p.drafted) for p in planner.reports])
    assert runs[False][0] == runs[True][0] == ar
    assert runs[False][1] == runs[True][1]


class _SkipLookups(Planner):
    """The auto planner, but every request skips its lookup in ``cheap_rows`` (as a drafting request whose matches
    add little to its drafter's rounds does) and the gate drafts for ``drafts`` only."""

    def __init__(self, *args, drafts: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafts = drafts

    def cheap_rows(self, rids, rows):
        return [1] * len(rids)

    def draft_mask(self, rids, alternative=None):
        return [self.drafts] * len(rids)


def test_a_request_that_skipped_its_lookup_looks_when_the_gate_leaves_it_out(engines):
    """A request skips its n-gram lookup for the drafter's round; where the gate then leaves it out of that round,
    it looks after the gate and verifies its matches (not the root alone); where the gate drafts for it, it does
    not look. Either way the output is the AR path's."""
    from glance_sgl.ngram_source import NgramCandidates, NgramSettings, NgramSource

    engine = engines["qwen2_5_vl"]
    target, taps = engine.target, engine.drafter.config.tap_layers
    messages = make_prompts(3, seed=31)[2]
    ar = engine.generate(messages, SamplingParams(max_tokens=24), mode="ar").token_ids
    for drafts in (False, True):
        ngram = NgramCandidates(NgramSource(NgramSettings(max_depth=engine.block_size - 1, scope="off")))
        planner = _SkipLookups(engine.cost_model(), engine.max_nodes, engine.block_size - 1, drafts=drafts)
        prompt = target.prepare(messages)
        state, rows = target.prefill(prompt, taps=taps)
        drafter = CachedDrafter.start(engine.drafter, rows.taps, engine.branch_k)
        committed = [int(rows.logits[-1].argmax())]
        # the request's own tokens so far hold its answer: its matches are the AR path's continuation
        ngram.start("r", prompt.input_ids[0].tolist() + ar + ar)
        ngram.source.commit("r", committed)
        rows_pass, looked = CachePass(target, state, taps), []
        while len(committed) < len(ar):
            batch = RoundBatch(["r"], torch.tensor([committed[-1]]), torch.tensor([len(committed)]),
                               [SamplingSpec()])
            r = speculative_round(batch, planner, [drafter, ngram], rows_pass, max_depth=engine.block_size - 1)
            assert r.drafted == drafts
            looked.append(r.report.cheap_ms is not None)
            if not drafts:  # the late lookup's candidates, verified without the drafter
                assert r.tree.num_rows > 1 and r.tree.sources is not None
            committed += r.walk.committed()[0]
        assert committed[: len(ar)] == ar
        assert all(looked) if not drafts else not any(looked)
        ngram.finish("r")


def test_no_candidate_past_a_requests_end_and_an_ar_step_at_its_last_token(engines):
    """``RoundBatch.stops`` / ``room``: no verified row carries a stop token or lies deeper than the room allows, a
    round with room for one token is an AR step (no drafter pass), and the committed tokens, cut at the first stop
    token or the limit, are the AR path's."""
    engine = engines["qwen2_5_vl"]
    target, taps = engine.target, engine.drafter.config.tap_layers
    last_steps = 0
    for seed, (stop_at, limit) in enumerate([(None, 9), (6, 40), (3, 5), (None, 4)]):
        messages = make_prompts(4, seed=31 + seed)[seed]
        ar = engine.generate(messages, SamplingParams(max_tokens=40), mode="ar").token_ids
        stops = frozenset() if stop_at is None else frozenset({ar[stop_at]})
        end = min([limit] + [i + 1 for i, t in enumerate(ar) if t in stops])  # what the request keeps
        planner = RecordingPlanner(engine.cost_model(), engine.max_nodes, engine.block_size - 1, seed=seed)
        state, rows = target.prefill(target.prepare(messages), taps=taps)
        source = CachedDrafter.start(engine.drafter, rows.taps, engine.branch_k)
        committed = [int(rows.logits[-1].argmax())]
        planner.begin("r", entropy_nats(rows.logits[-1]))
        while len(committed) < end:
            room = limit - len(committed)
            batch = RoundBatch(["r"], torch.tensor([committed[-1]]), torch.tensor([len(committed)]), [SamplingSpec()],
                               stops=[stops], room=[room])
            r = speculative_round(batch, planner, [source], CachePass(target, state, taps),
                                  max_depth=engine.block_size - 1)
            nodes = r.tree.tokens[0, 1:].tolist()
            assert not stops & set(nodes) and int(r.tree.depths.max()) <= room - 1
            assert room > 1 or (not r.drafted and r.tree.num_rows == 1)
            last_steps += room == 1
            committed += r.walk.committed()[0]
        assert committed[:end] == ar[:end]
    assert last_steps > 0

