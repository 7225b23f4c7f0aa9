"""The cost-aware planner: cost model, acceptance predictor, policy (glance_sgl.planner)."""

from __future__ import annotations

import math

import pytest
import torch

from glance_sgl.acceptance import DepthCalibration, EntropyTable
from glance_sgl.costs import CostModel, default_row_grid
from glance_sgl.planner import (EXPLORE, FIRST_RECHECK, GAIN_EVIDENCE, FIRST_TREND, MAX_PROBE_INTERVAL, MIN_PROBE_INTERVAL, START_HOLD, START_HOLD_LONG,
                                Planner, RoundReport, pay_score)
from glance_sgl.tree import DraftTree, build_tree, topk_per_offset
from glance_sgl.verify import SamplingSpec, verify_tree


def linear_costs(per_row: float = 0.1, base: float = 1.0, draft: float = 0.5) -> CostModel:
    rows = default_row_grid(64)
    return CostModel(rows, [base + per_row * r for r in rows], [1, 8], [draft, 4 * draft])


def gate(planner: Planner, rids, leads) -> bool:
    """The planner's gate with these lead entropies (as the previous round's report would have left them)."""
    for r, h in zip(rids, leads):
        planner.begin(r, h)
    return planner.gate(rids)


def report(planner: Planner, rids, plan, accepted, tree=None, walk=None) -> None:
    """A drafted round's report without timings (the cost model stays as it is)."""
    planner.report(RoundReport(rids, plan, plan.nodes + 1, accepted, tree, walk))


def random_tree(seed: int, budget: int, depth: int = 7, k: int = 3, vocab: int = 50, sharp: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, depth, vocab, generator=gen) * sharp
    values, ids = topk_per_offset(torch.log_softmax(logits, -1), k)
    return build_tree(values, ids, torch.tensor([1]), budget)


def test_a_prefix_of_the_best_first_tree_is_the_tree_of_that_budget():
    big = random_tree(0, 40)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 7, 50, generator=gen) * 3.0
    values, ids = topk_per_offset(torch.log_softmax(logits, -1), 3)
    for n in (0, 1, 5, 17, 40):
        small = build_tree(values, ids, torch.tensor([1]), n) if n else None
        pre = big.prefix(n + 1)
        if small is not None:
            assert torch.equal(pre.tokens, small.tokens) and torch.equal(pre.parents, small.parents)
        assert pre.num_nodes == n


def test_expected_accept_is_the_sum_of_path_probabilities():
    tree = random_tree(1, 20)
    depth = DepthCalibration(7)  # prior: factor 1 at every depth
    planner = Planner(linear_costs(), max_nodes=20, max_depth=7)
    curve = planner.expected_accept(tree.scores, tree.depths)
    probs = tree.scores.exp()
    probs[:, 0] = 0
    assert torch.allclose(curve, torch.cumsum(probs, 1), atol=1e-6)
    assert torch.allclose(depth.node_probs(tree.scores, tree.depths)[:, 1:], tree.scores.exp()[:, 1:], atol=1e-6)


@pytest.mark.parametrize("bs", [1, 5])
def test_choose_host_curves_equal_the_tensor_curves(bs, monkeypatch):
    """``Planner.choose`` sums a small host batch's expected acceptance in Python: the same curves as
    ``expected_accept``'s tensor ops, with a calibration far from 1, a merged tree's tags (the drafter's nodes are
    calibrated, the others not) and candidates without the drafter; the same plans."""
    import glance_sgl.planner as planner_mod
    from glance_sgl.tree import SOURCE_DRAFTER, SOURCE_NGRAM

    trees = [random_tree(40 + b, 24, depth=9) for b in range(bs)]
    tree = DraftTree(*(torch.cat([getattr(t, f) for t in trees]) for f in ("tokens", "parents", "depths", "scores")))
    gen = torch.Generator().manual_seed(bs)
    tags = torch.where(torch.rand(tuple(tree.tokens.shape), generator=gen) < 0.6, SOURCE_DRAFTER, SOURCE_NGRAM)
    planner = Planner(linear_costs(), max_nodes=23, max_depth=7)
    planner.depth.hits[1:] *= torch.linspace(1.6, 0.2, 7, dtype=torch.float64)  # beyond the cap too: depth 9 > 7
    rids = [f"r{b}" for b in range(bs)]
    for sources, drafter in ((None, True), (tags, True), (tags, False)):
        host = planner._accept_curves(tree.scores, tree.depths, sources, drafter)
        tensor = planner.expected_accept(tree.scores, tree.depths, sources, drafter).tolist()
        assert len(host) == bs and all(h == pytest.approx(t, rel=1e-5, abs=1e-6) for h, t in zip(host, tensor))
        plans = []
        for limit in (16, 0):  # the host lists, then the tensor ops
            monkeypatch.setattr(planner_mod, "HOST_CHOOSE_MAX_BATCH", limit)
            plans.append(planner.choose(rids, tree.scores, tree.depths, sources, drafter_ran=drafter))
        assert plans[0].nodes == plans[1].nodes
        assert plans[0].expected_tokens == pytest.approx(plans[1].expected_tokens, rel=1e-5)


def test_depth_calibration_learns_how_often_the_target_agrees():
    """Against a target that never takes the drafter's depth-2 guesses, the depth-2 factor goes to 0."""
    depth = DepthCalibration(7, decay=1.0)
    tree = random_tree(2, 20, sharp=6.0)
    rows_d1 = (tree.depths[0] == 1).nonzero().flatten()
    best_d1 = int(rows_d1[0])
    for _ in range(50):
        accepted = torch.tensor([[0, best_d1]])
        depth.observe(tree.parents, tree.scores, tree.depths, accepted, torch.tensor([1]))
    factor = (depth.hits / depth.predicted)
    assert factor[2] < 0.05
    assert factor[1] > 0.5


@pytest.mark.parametrize("counted", ["all", "mask"])
@pytest.mark.parametrize("bs", [1, 3])
def test_depth_calibration_host_and_tensor_paths_agree(bs, counted, monkeypatch):
    """The host-list path (small CPU batches) and the tensor path learn the same sums from the same walks:
    random trees, random target choices (every walk depth), a depth cap below the trees' depths; with every node
    the drafter's (no mask, or a mask of every node: the same sums) and with a random set of them (a merged tree's
    drafter nodes)."""
    import glance_sgl.acceptance as acceptance_mod

    gen = torch.Generator().manual_seed(bs)
    paths = {}
    for path in ("host", "tensor", "host-masked-all"):
        if counted == "mask" and path == "host-masked-all":
            continue
        monkeypatch.setattr(acceptance_mod, "HOST_OBSERVE_MAX_BATCH", 0 if path == "tensor" else 16)
        depth = DepthCalibration(5, decay=0.9)
        gen.manual_seed(bs)
        for step in range(12):
            trees = [random_tree(100 * bs + 7 * step + b, 24, depth=7) for b in range(bs)]
            tree = DraftTree(*(torch.cat([getattr(t, f) for t in trees]) for f in ("tokens", "parents", "depths",
                                                                                    "scores")))
            # mostly each row's first child (walks past the depth cap), else a random token (walks that stop)
            choices = torch.randint(0, 50, tuple(tree.tokens.shape), generator=gen)
            follow = torch.rand(tuple(tree.tokens.shape), generator=gen) < 0.85
            for b in range(bs):
                for row in range(tree.num_rows - 1, 0, -1):  # descending: the smallest child row wins
                    parent = int(tree.parents[b, row])
                    if follow[b, parent]:
                        choices[b, parent] = tree.tokens[b, row]
            walk = verify_tree(tree.tokens, tree.parents, tree.depths, torch.nn.functional.one_hot(
                choices, 50).float(), torch.zeros(bs, dtype=torch.long), [SamplingSpec()] * bs)
            mask = None
            if counted == "mask":
                mask = torch.rand(tuple(tree.tokens.shape), generator=gen) < 0.7
            elif path == "host-masked-all":
                mask = torch.ones(tuple(tree.tokens.shape), dtype=torch.bool)
            depth.observe(tree.parents, tree.scores, tree.depths, walk.accepted_rows, walk.accept_lens, mask)
        paths[path] = (depth.predicted.clone(), depth.hits.clone())
    # the host path sums its conditional probabilities in double precision, the tensor path in float32
    assert torch.allclose(paths["host"][0], paths["tensor"][0], rtol=1e-6, atol=1e-9)
    assert torch.equal(paths["host"][1], paths["tensor"][1])
    if counted == "all":
        assert paths["host"][1][-1] > 0.9 ** 11  # some walks reached the cap
        assert torch.allclose(paths["host"][0], paths["host-masked-all"][0]) and \
            torch.equal(paths["host"][1], paths["host-masked-all"][1])


def test_choose_weighs_expected_tokens_against_cost():
    tree = random_tree(3, 40, sharp=8.0)  # a confident drafter: long expected paths
    cheap = Planner(linear_costs(per_row=0.001), max_nodes=40, max_depth=7)
    assert cheap.choose(["a"], tree.scores, tree.depths).nodes >= 7
    dear = Planner(linear_costs(per_row=5.0), max_nodes=40, max_depth=7)
    assert dear.choose(["a"], tree.scores, tree.depths).nodes <= 2
    fixed = Planner(linear_costs(per_row=5.0), max_nodes=40, max_depth=7, mode="fixed", fixed_nodes=15)
    plan = fixed.choose(["a"], tree.scores, tree.depths)
    assert plan.nodes == 15 and len(plan.expected_tokens) == 1 and plan.expected_tokens[0] >= 1
    with pytest.raises(ValueError, match="planner must be one of"):
        Planner(linear_costs(), max_nodes=4, max_depth=3, mode="sometimes")



def test_choose_charges_the_tree_host_work_to_trees_only():
    """A tree costs its pass and the round's host work (``overhead_ms``); the root alone is an AR step, whose host
    work the curve's one-row point holds (``observe_ar``): weak matches (0.3 expected drafts for one more row) do
    not pay for a tree's host work, strong ones do."""
    from glance_sgl.tree import SOURCE_NGRAM, SOURCE_NONE

    costs = CostModel([1, 2, 4, 8], [1.0, 1.1, 1.3, 1.7], [1], [0.5], overhead_ms=0.5)
    planner = Planner(costs, max_nodes=3, max_depth=3)
    tags = torch.tensor([[SOURCE_NONE] + [SOURCE_NGRAM] * 3])
    depths = torch.tensor([[0, 1, 2, 3]])
    weak = torch.tensor([[0.0, math.log(0.3), math.log(0.05), math.log(0.01)]])
    # 1.3 tokens for 1.1 + 0.5 ms against 1 token for 1.0 ms: the root alone (charging the AR step the host work
    # as well, 1 / 1.5, the tree looked better)
    assert planner.choose(["a"], weak, depths, tags, drafter_ran=False).nodes == 0
    strong = torch.tensor([[0.0, math.log(0.95), math.log(0.9), math.log(0.85)]])
    assert planner.choose(["a"], strong, depths, tags, drafter_ran=False).nodes == 3

def test_ragged_choice_gives_each_request_its_own_rows_and_beats_one_size_for_all():
    """Where the engine verifies each request's own number of rows (``Planner.ragged``), a batch of a long sure
    chain, a middling match and a weak one verifies the chain deep and the weak one not at all (the root alone),
    each a best-first prefix of its tree, at a better expected rate than the best one size for all (priced by the
    same curve of total rows). One request alone: one size, as without it."""
    from glance_sgl.tree import SOURCE_NGRAM, SOURCE_NONE

    costs = CostModel([1, 8, 64], [2.0, 2.4, 8.0], [1], [0.5], overhead_ms=0.1)
    tags = torch.tensor([[SOURCE_NONE] + [SOURCE_NGRAM] * 7] * 3)
    depths = torch.tensor([list(range(8))] * 3)
    sure = [math.log(0.97 ** d) for d in range(8)]
    middling = [0.0] + [math.log(0.7 * 0.5 ** d) for d in range(7)]
    weak = [0.0] + [math.log(0.04 * 0.5 ** d) for d in range(7)]
    scores = torch.tensor([sure, middling, weak])
    ragged = Planner(costs, max_nodes=7, max_depth=7, ragged=True)
    plan = ragged.choose(["a", "b", "c"], scores, depths, tags, drafter_ran=False)
    assert plan.rows is not None and plan.rows[0] == 8 and plan.rows[2] == 1 and 1 <= plan.rows[1] < 8
    assert plan.nodes == max(plan.rows) - 1 and plan.total_rows(3) == sum(plan.rows)
    uniform = Planner(costs, max_nodes=7, max_depth=7).choose(["a", "b", "c"], scores, depths, tags,
                                                              drafter_ran=False)
    assert uniform.rows is None

    def rate(p):
        total = p.total_rows(3)
        return sum(p.expected_tokens) / (costs.verify_ms(total, 1) + (costs.overhead_ms if total > 3 else 0.0))

    assert rate(plan) > rate(uniform)
    curves = ragged.expected_accept(scores, depths, tags, drafter_nodes=False)
    assert plan.expected_tokens == pytest.approx([1.0 + float(curves[b, r - 1]) for b, r in enumerate(plan.rows)])
    alone = ragged.choose(["a"], scores[:1], depths[:1], tags[:1], drafter_ran=False)
    assert alone.rows is None and alone.nodes == 7


def test_a_ragged_cost_curve_prices_the_mean_rows_of_the_batch():
    """The SGLang worker's batch-aware curves price a ragged pass of ``T`` rows for ``bs`` requests at ``T / bs``
    rows each, as a uniform pass of that many rows, with the scheduler's time on top."""
    from glance_sgl.sglang.planning import BatchCostModel
    import numpy as np

    costs = BatchCostModel.prior()
    costs.add_curve(4, [1, 4, 8, 16], [3.0, 3.5, 4.5, 7.0])
    costs.add_curve(16, [1, 4, 8, 16], [6.0, 8.0, 11.0, 19.0])
    costs.observe_step(8, 1.5)
    totals = np.array([8.0, 32.0, 64.0, 128.0])
    got = costs.verify_ms_totals(totals, 8)
    assert got == pytest.approx([costs.verify_ms(t / 8, 8) for t in totals])
    base = linear_costs()
    assert base.verify_ms_totals(totals, 8) == pytest.approx([base.verify_ms(int(t), 1) for t in totals])


def test_choose_picks_from_the_row_menu_of_captured_graphs():
    """With CUDA graphs at a few widths, the planner weighs only the trees those widths run (row counts include
    the root), and the best of them: what the unrestricted planner picks, rounded to a width near it."""
    tree = random_tree(3, 40, sharp=8.0)
    free = Planner(linear_costs(per_row=0.02), max_nodes=31, max_depth=7)
    menu = Planner(linear_costs(per_row=0.02), max_nodes=31, max_depth=7, row_menu=[1, 4, 8, 16, 32])
    n_free = free.choose(["a"], tree.scores, tree.depths).nodes
    n_menu = menu.choose(["a"], tree.scores, tree.depths).nodes
    assert n_menu + 1 in (1, 4, 8, 16, 32)
    assert n_free + 1 not in (1, 4, 8, 16, 32) or n_menu == n_free
    dear = Planner(linear_costs(per_row=5.0), max_nodes=31, max_depth=7, row_menu=[1, 8, 32])
    assert dear.choose(["a"], tree.scores, tree.depths).nodes == 0  # the root alone: a 1-row verify


def test_gate_stops_drafting_for_a_request_that_never_accepts_and_probes_with_back_off():
    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7)
    tree = random_tree(4, 15)
    drafted_rounds, probes = 0, []
    for step in range(400):
        if gate(planner, ["wild"], [0.01]):
            drafted_rounds += 1
            if planner.state("wild").ar_streak:
                probes.append(step)
            plan = planner.choose(["wild"], tree.scores, tree.depths)
            report(planner, ["wild"], plan, [0], tree.prefix(plan.nodes + 1), None)
        else:
            planner.skip(["wild"])
    assert drafted_rounds < 40  # most rounds are plain AR steps
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and max(gaps) >= MAX_PROBE_INTERVAL // 2  # probes thin out
    # the back-off is per request: a new request at the same entropy (which the table now says does not pay)
    # is probed after the shortest interval
    fresh = [gate(planner, ["fresh"], [0.01]) or planner.skip(["fresh"]) is None for _ in range(3)]
    assert fresh[-1] and not fresh[0]
    planner.forget("wild")
    assert "wild" not in planner.requests


def drafted_steps(planner: Planner, rid: str, tree: DraftTree, accepted: int, steps: int,
                  forget: bool = True) -> list[int]:
    """Run ``steps`` rounds of request ``rid`` whose drafts always get ``accepted`` drafts; the drafted steps
    (``forget``: the request ends after them)."""
    drafted = []
    for step in range(steps):
        if gate(planner, [rid], [0.5]):
            drafted.append(step)
            plan = planner.choose([rid], tree.scores, tree.depths)
            report(planner, [rid], plan, [min(accepted, plan.nodes)], tree.prefix(plan.nodes + 1), None)
        else:
            planner.skip([rid])
    if forget:
        planner.forget(rid)
    return drafted


def test_where_probes_rarely_pay_new_requests_wait_before_drafting_and_back_off_faster():
    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7)
    tree = random_tree(6, 15, sharp=8.0)
    first = drafted_steps(planner, "wild0", tree, accepted=0, steps=40)
    # nothing known yet: draft at once; that first round is a probe, so its failure backs off (8 AR rounds)
    assert first[:2] == [0, 9]
    holds = []
    for i in range(1, 8):  # a run of requests the drafter does not know
        drafted = drafted_steps(planner, f"wild{i}", tree, accepted=0, steps=60, forget=False)
        if not planner.state(f"wild{i}").explorer:  # (explorers probe at once)
            holds.append(drafted[0])
            held = drafted
        planner.forget(f"wild{i}")
    assert planner.probe_success() < 0.25
    # first rounds stop paying: new requests wait START_HOLD, then (almost never paying) START_HOLD_LONG rounds
    assert START_HOLD in holds and holds[-1] == START_HOLD_LONG
    assert held == [START_HOLD_LONG]  # ... and a failed probe then waits MAX_PROBE_INTERVAL rounds
    # a request the drafter knows: its first probe pays, drafting goes on every round, and the next new request
    # drafts at once again
    known = drafted_steps(planner, "doc", tree, accepted=6, steps=30)
    assert known == list(range(START_HOLD_LONG, 30))
    assert drafted_steps(planner, "doc2", tree, accepted=6, steps=5) == list(range(5))


def test_a_probe_counts_by_how_much_it_paid_not_only_whether_it_did():
    """The shares of paying first rounds and probes (what decides holds, faster back-off and idling) count a round
    by its ratio over the rate it had to reach: nothing at break-even, fully at twice it. First rounds that one
    extra token carries just past break-even (here 2 accepted drafts against an AR step) keep the shares near a
    half, where rounds that pay well over (6 accepted) keep them near one; rounds that do not pay leave the
    drafter idling."""
    assert pay_score(0.5) == 0.0 and pay_score(1.0) == 0.0 and pay_score(1.5) == pytest.approx(0.5)
    assert pay_score(2.0) == 1.0 and pay_score(7.0) == 1.0
    tree = random_tree(6, 15, sharp=8.0)
    shares = {}
    for accepted in (1, 2, 6):
        planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7)
        for i in range(6):
            drafted_steps(planner, f"r{i}", tree, accepted=accepted, steps=40)
        shares[accepted] = (planner.starts_paid / planner.starts, planner.probe_success(), planner.drafter_idle())
    assert shares[1][2] and not shares[2][2] and not shares[6][2]
    assert 0.25 < shares[2][0] < 0.75 and 0.25 < shares[2][1] < 0.75  # counted as full successes: above 0.9
    assert shares[6][0] > 0.9 and shares[6][1] > 0.85


def test_where_the_drafter_knows_nothing_of_the_traffic_a_failed_probe_retires_the_request():
    """Where first rounds and probes almost never pay, a request whose probe fails is retired: it never drafts or
    probes again, and a retired request's drafter context is no longer kept (``context_mask``); a new request
    still probes after its hold (it may be one the drafter knows)."""
    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7)
    tree = random_tree(6, 15, sharp=8.0)
    for i in range(6):  # a run of requests the drafter does not know
        drafted_steps(planner, f"wild{i}", tree, accepted=0, steps=60)
    assert planner.drafter_idle()
    # its probe after the hold (not retired before it), and nothing after it (MAX_PROBE_INTERVAL would probe again)
    assert drafted_steps(planner, "late", tree, accepted=0, steps=300, forget=False) == [START_HOLD_LONG]
    assert planner.state("late").retired and planner.context_mask(["late", "new"]) == [False, True]
    assert not planner.state("new").retired
    planner.mode = "fixed"  # only "auto" retires
    assert not planner.drafter_idle()


def test_where_the_drafter_idles_new_requests_are_retired_at_birth_except_explorers():
    """``admit`` (before a request's prefill): where the drafter idles, a new request keeps no drafter context
    and never drafts, except every ``explore_interval()``-th (an explorer), which keeps it and probes at once; where
    such a probe pays, the idling ends and new requests keep their context again. Planners that do not idle admit
    every request."""
    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7)
    tree = random_tree(6, 15, sharp=8.0)
    assert planner.admit("first") and not planner.drafter_idle()  # nothing known yet: every request admitted
    planner.forget("first")
    for i in range(6):  # a run of requests the drafter does not know
        drafted_steps(planner, f"wild{i}", tree, accepted=0, steps=60)
    assert planner.drafter_idle()
    rids = [f"new{i}" for i in range(2 * EXPLORE)]
    admitted = []
    for rid in rids:  # one request at a time; the explorers' probes fail
        admitted.append(planner.admit(rid))
        assert admitted[-1] == planner.state(rid).explorer
        drafted_steps(planner, rid, tree, accepted=0, steps=4)
    assert sum(admitted) == 2 and planner.drafter_idle()
    rids = [f"next{i}" for i in range(EXPLORE)]
    admitted = [planner.admit(r) for r in rids]  # in flight together (the interval grows with them)
    born_retired = rids[admitted.index(False)]
    assert planner.context_mask([born_retired]) == [False]
    assert drafted_steps(planner, born_retired, tree, accepted=6, steps=100, forget=False) == []
    assert not planner.admit(born_retired)  # asked again (a prompt prefilled in chunks): the answer stands
    # an explorer that ends before its first round (a one-token request) hands its role to the next new request
    planner.forget(rids[admitted.index(True)])
    fillers = 0
    while planner.since_explorer + 1 >= planner.explore_interval():  # the next does not explore by its count
        fillers += 1
        planner.admit(f"filler{fillers}")
    assert planner.admit("next") and planner.state("next").explorer
    assert drafted_steps(planner, "next", tree, accepted=6, steps=6)[0] <= MIN_PROBE_INTERVAL
    assert not planner.drafter_idle() and planner.admit("after")
    fixed = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7, mode="fixed")
    fixed.starts_paid, fixed.probes_paid = 0.0, 0.0  # statistics of an idle drafter: "fixed" retires nothing
    assert all(fixed.admit(r) for r in rids)


def test_where_first_rounds_never_pay_one_new_request_in_explore_drafts_at_once():
    """Requests the drafter knows but whose answers are shorter than the hold still bring drafting back: every
    EXPLORE-th new request (one at a time) probes at its first round."""
    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7)
    tree = random_tree(6, 15, sharp=8.0)
    for i in range(6):
        drafted_steps(planner, f"wild{i}", tree, accepted=0, steps=20)
    assert planner.explore_interval() == EXPLORE
    firsts = [drafted_steps(planner, f"short{i}", tree, accepted=6, steps=6) for i in range(EXPLORE + 2)]
    explorer = next(i for i, d in enumerate(firsts) if d)
    assert all(not d for d in firsts[:explorer])  # too short for the hold: no drafting at all
    # the explorer probes at once (or after the shortest interval, where the entropy table alone says no), its
    # probe pays, and the requests after it draft from their first round
    assert firsts[explorer][0] <= MIN_PROBE_INTERVAL
    assert all(d == list(range(6)) for d in firsts[explorer + 1:]) and explorer < EXPLORE


def test_explorers_grow_rarer_with_the_requests_in_flight():
    """An explorer's probe drafts for its whole batch: with 8 requests in flight, one new request in 8 x EXPLORE
    explores while the drafter idles, not one in EXPLORE."""
    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7)
    tree = random_tree(6, 15, sharp=8.0)
    for i in range(6):
        drafted_steps(planner, f"wild{i}", tree, accepted=0, steps=60)
    assert planner.drafter_idle() and planner.explore_interval() == EXPLORE
    flight = [f"b{i}" for i in range(8)]
    for rid in flight:
        planner.admit(rid)
    explorers = 0
    for i in range(4 * 8 * EXPLORE):  # one ends, one comes: 8 in flight
        planner.forget(flight.pop(0))
        assert planner.explore_interval() == 8 * EXPLORE
        if planner.admit(f"new{i}"):
            explorers += 1
            planner.state(f"new{i}").drafted_rounds = 1  # its probe ran (else it hands its role on when it ends)
        flight.append(f"new{i}")
    assert explorers == 4 and planner.drafter_idle()


def test_a_paying_request_is_not_paused_by_noisy_rounds_but_one_that_stops_paying_is():
    """Open-ended answers accept a few drafts on average, some rounds none: drafting goes on. A request whose
    rounds stop accepting is paused (AR rounds) and probed again."""
    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7)
    tree = random_tree(6, 15, sharp=8.0)
    noisy = []
    for step in range(60):
        if gate(planner, ["open"], [1.5]):
            noisy.append(step)
            plan = planner.choose(["open"], tree.scores, tree.depths)
            report(planner, ["open"], plan, [(5, 0, 0)[step % 3]], tree.prefix(plan.nodes + 1), None)
        else:
            planner.skip(["open"])
    assert noisy == list(range(60))
    stopped = []
    for step in range(40):
        if gate(planner, ["open"], [1.5]):
            stopped.append(True)
            plan = planner.choose(["open"], tree.scores, tree.depths)
            report(planner, ["open"], plan, [0], tree.prefix(plan.nodes + 1), None)
        else:
            stopped.append(False)
            planner.skip(["open"])
    # a long paying record fades in ~RECENT's memory (some 20 rounds here), then the request is paused and mostly
    # runs AR rounds (probes between them)
    assert planner.state("open").paused and stopped.index(False) < 30 and stopped[30:].count(False) >= 8


def test_gate_keeps_drafting_where_it_pays_and_a_probe_that_pays_resets_the_back_off():
    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7)
    tree = random_tree(5, 15, sharp=8.0)
    for _ in range(50):
        assert gate(planner, ["doc"], [0.01])
        plan = planner.choose(["doc"], tree.scores, tree.depths)
        report(planner, ["doc"], plan, [6], tree.prefix(plan.nodes + 1), None)
    st = planner.state("doc")
    st.paused, st.ar_streak, st.probe_interval = True, 8, 8  # as after a spell of AR rounds: a probe is due
    assert gate(planner, ["doc"], [3.0])
    plan = planner.choose(["doc"], tree.scores, tree.depths)
    report(planner, ["doc"], plan, [6], None, None)
    assert st.ar_streak == 0 and st.probe_interval == 2 and not st.paused


def test_entropy_table_learns_per_bin_and_shrinks_unvisited_bins_to_the_mean():
    table = EntropyTable(max_accept=15)
    assert table.expected(0.0) == table.expected(5.0) == pytest.approx(2.0)  # the prior: no entropy assumed
    for _ in range(300):
        table.observe(0.03, 9.0)
        table.observe(2.0, 1.0)
    assert table.expected(0.03) == pytest.approx(9.0, rel=0.05)
    assert table.expected(2.0) == pytest.approx(1.0, rel=0.15)  # a little of the overall mean stays
    assert table.expected(0.5) == pytest.approx(5.0, rel=0.05)  # never seen: the overall mean


def test_fixed_tree_walk_feedback_runs_on_a_real_walk():
    """observe() with a real walk result (the engines' path), batch of two."""
    planner = Planner(linear_costs(), max_nodes=10, max_depth=7)
    t1, t2 = random_tree(6, 10), random_tree(7, 10)
    tokens = torch.cat([t1.tokens, t2.tokens])
    parents = torch.cat([t1.parents, t2.parents])
    depths = torch.cat([t1.depths, t2.depths])
    scores = torch.cat([t1.scores, t2.scores])
    plan = planner.choose(["a", "b"], scores, depths)
    plan.nodes = max(plan.nodes, 1)
    tree = DraftTree(tokens, parents, depths, scores).prefix(plan.nodes + 1)
    logits = torch.randn(2, tree.num_rows, 50)
    logits[0, 0, int(tree.tokens[0, 1])] = 100.0  # request a accepts its first node
    walk = verify_tree(tree.tokens, tree.parents, tree.depths, logits, torch.tensor([0, 0]),
                       [SamplingSpec(), SamplingSpec()])
    before = planner.depth.hits.clone()
    report(planner, ["a", "b"], plan, walk.accept_lens.tolist(), tree, walk)
    assert planner.depth.hits[1] > before[1] * planner.depth.decay


def test_in_a_batch_probes_wait_until_half_the_batch_is_due_and_one_drafted_batch_probes_all():
    """A batch drafts (the drafter pass and rows for every request) when half its requests' probes are due, not
    for each one's: staggered back-offs then align, so probes cost a batch a few drafted steps, not one each."""
    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=7)
    tree = random_tree(2, 15)
    rids = ["a", "b", "c", "d"]
    for i, r in enumerate(rids):  # paused requests whose next probes fall due at different steps
        st = planner.state(r)
        st.drafted_rounds, st.paused, st.probe_interval, st.ar_streak = 5, True, 8, 2 * i
    drafted = []
    for step in range(40):
        if gate(planner, rids, [None] * 4):
            drafted.append(step)
            batch_tree = DraftTree(*(t.expand(4, -1) for t in (tree.tokens, tree.parents, tree.depths, tree.scores)))
            plan = planner.choose(rids, batch_tree.scores, batch_tree.depths)
            report(planner, rids, plan, [0] * 4)
        else:
            planner.skip(rids)
    # "d" and "c" are due at steps 2 and 4: the batch's first probe waits for the second of them
    assert drafted[0] == 4
    assert all(planner.state(r).ar_streak == planner.state("a").ar_streak for r in rids)  # aligned since
    assert len(drafted) <= 3


def test_a_batch_probe_leaves_out_the_requests_whose_matches_cover_the_block():
    """A probe drafts for the requests it probes and the rest of the batch with them, except those whose n-gram
    round already expects most of the block and were not due a probe worth it: the drafter pass would cost them
    their share and its nodes would take rows from their matches. Without matches every request is probed."""
    from glance_sgl.planner import Plan

    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=15)
    rids = ["a", "b", "c", "d"]
    for i, r in enumerate(rids):  # paused requests; "a" and "b" are due a probe, "c" and "d" not yet
        planner.begin(r, 0.01)
        st = planner.state(r)
        st.drafted_rounds, st.paused, st.probe_interval, st.ar_streak = 5, True, 8, 8 if r in "ab" else 1
    covered = Plan(7, [1.0, 1.0, 8.0, 1.0], drafted=False)  # "c": a 7-node chain it expects to be accepted
    assert planner.draft_mask(rids, covered) == [True, True, False, True]
    assert planner.draft_mask(rids, Plan(7, [1.0] * 4, drafted=False)) == [True] * 4
    assert planner.draft_mask(rids) == [True] * 4  # an AR step's batch: nothing covered


def test_one_report_per_round_carries_the_lead_entropy_and_the_round_costs():
    """The planner owns each request's lead entropy: a report's bonus-row entropy gives the next one, dropped where no
    gate reads it (a paused request's AR round); the same report's timings move the cost model."""
    planner = Planner(linear_costs(), max_nodes=15, max_depth=7)
    tree = random_tree(3, 15)
    coin = [math.log(2)]  # the bonus row: a fair coin, ln 2 nats
    planner.begin("a", 0.3)
    assert planner.lead_entropy("a") == 0.3 and planner.known() == {"a"}
    plan = planner.choose(["a"], tree.scores, tree.depths)
    overhead = planner.costs.overhead_ms
    planner.report(RoundReport(["a"], plan, plan.nodes + 1, [1], tree.prefix(plan.nodes + 1), None, coin,
                               drafter_ms=0.5, pass_ms=2.0, host_ms=0.8))
    assert planner.lead_entropy("a") == pytest.approx(math.log(2), abs=1e-5)
    assert planner.costs.overhead_ms > overhead and planner.state("a").drafted_rounds == 1
    planner.state("a").paused = True  # drafting paused: the AR round's entropy is not kept
    ar = planner.costs.ar_ms()
    planner.report(RoundReport(["a"], planner.skip(["a"]), 1, [0], None, None, coin, drafter_ms=0.0, pass_ms=3 * ar,
                               host_ms=0.0))
    assert planner.lead_entropy("a") is None and planner.costs.ar_ms() > ar
    planner.forget("a")
    assert planner.known() == set()


def test_candidates_without_the_drafter_pass_cost_no_drafter_time_and_leave_its_record():
    """N-gram candidates alone (``drafter_ran=False``): the plan is not a drafting round, its nodes' scores are
    taken as calibrated (no per-depth factor of the drafter), and the drafter's reference tree size is untouched."""
    from glance_sgl.tree import SOURCE_NGRAM

    planner = Planner(linear_costs(draft=5.0), max_nodes=15, max_depth=7)
    tree = random_tree(3, 15, sharp=8.0)
    planner.depth.hits[1:] *= 0.25  # the drafter's nodes are taken a quarter as often as it says
    drafted = planner.choose(["a"], tree.scores, tree.depths)
    tags = torch.full_like(tree.tokens, SOURCE_NGRAM)
    tags[:, 0] = 0
    ngram = planner.choose(["a"], tree.scores, tree.depths, tags, drafter_ran=False)
    assert drafted.drafted and not ngram.drafted
    assert planner.state("a").last_nodes == drafted.nodes
    assert sum(planner.expected_accept(tree.scores, tree.depths, tags)[0]) > sum(
        planner.expected_accept(tree.scores, tree.depths)[0])


def test_the_drafters_gain_is_learned_apart_where_the_matches_already_cover_the_block():
    """Where the n-gram round expects most of the block (a replayed answer) the drafter adds nothing; where it
    finds nothing the drafter adds six drafts a round. The gains are learned per bin of the n-gram round's
    expectation: the gate passes up the drafter over a long match and keeps it where matches are missing."""
    from glance_sgl.planner import Plan

    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=15)
    tree = random_tree(5, 15, sharp=8.0)
    matched = Plan(7, [8.0], drafted=False)  # the n-gram round: a 7-node chain it expects to be accepted
    for i in range(40):
        planner.begin(f"fresh{i}", 0.01)
        planner.begin(f"replay{i}", 0.01)
        plan = planner.choose([f"fresh{i}"], tree.scores, tree.depths)  # no match: the drafter adds 6
        planner.report(RoundReport([f"fresh{i}"], plan, plan.nodes + 1, [6], None, None, [0.01]))
        plan = planner.choose([f"replay{i}"], tree.scores, tree.depths)  # the matches found all it found
        planner.report(RoundReport([f"replay{i}"], plan, plan.nodes + 1, [7], None, None, [0.01],
                                   alternative=matched, alone=[7]))
    assert planner.gain_table(8.0).expected(0.01) < 0.5 < 5.0 < planner.gain_table(1.0).expected(0.01)
    planner.begin("new-replay", 0.01)
    planner.begin("new-fresh", 0.01)
    planner.state("new-replay").hold = planner.state("new-fresh").hold = 0
    assert planner.predicted_accept("new-replay", 0.01, rival_tokens=8.0) < 0.5
    assert not planner.gate(["new-replay"], matched)
    assert planner.gate(["new-fresh"], None)
    # a probe due over such matches is not worth a drafter pass (the gain table expects too little even at
    # PROBE_OPTIMISM times its value); with no match it runs
    for rid in ("new-replay", "new-fresh"):
        st = planner.state(rid)
        st.explorer, st.ar_streak = False, MIN_PROBE_INTERVAL
        assert st.probe_due
    assert not planner.gate(["new-replay"], matched)
    assert planner.gate(["new-fresh"], None)


def test_a_request_whose_drafting_is_off_is_left_out_of_a_pass_the_others_use():
    """In a batch whose drafting pays, a request whose drafting is paused (and no probe due) is left out of the
    drafter's pass (which costs by the requests it drafts for): it verifies the round without the drafter in the
    same target pass. The round's report counts a drafting round for the others only, leaves the paused one's
    record as a round without the drafter, and learns the drafter pass's time at the subset's size."""
    from glance_sgl.planner import Plan

    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=15)
    tree = random_tree(5, 15, sharp=8.0)
    for i in range(40):  # the drafter adds 6 drafts a round where matches are missing
        planner.begin(f"fresh{i}", 0.01)
        plan = planner.choose([f"fresh{i}"], tree.scores, tree.depths)
        planner.report(RoundReport([f"fresh{i}"], plan, plan.nodes + 1, [6], None, None, [0.01]))
    rids = ["a", "paused", "b"]
    for r in rids:
        planner.begin(r, 0.01)
        planner.state(r).hold = 0
    st = planner.state("paused")
    st.drafted_rounds, st.paused, st.ar_streak = 3, True, 0
    assert not st.probe_due and st.drafting_off
    assert planner.draft_mask(rids) == [True, False, True]
    assert planner.gate(rids)
    st.paused = False  # every request on: the whole batch
    assert planner.draft_mask(rids) == [True, True, True]
    st.paused = True
    # the plan of that round: only the drafted requests' records move
    plan = planner.choose(rids, tree.scores.expand(3, -1), tree.depths.expand(3, -1), drafted=[True, False, True])
    assert plan.drafted and plan.drafted_for(3) == [True, False, True]
    assert planner.state("a").last_nodes == plan.nodes and st.last_nodes < 0
    before = {r: (planner.state(r).drafted_rounds, planner.state(r).ar_streak) for r in rids}
    draft2 = planner.costs.draft_ms(2)
    planner.report(RoundReport(rids, plan, plan.nodes + 1, [6, 1, 6], None, None, [0.01] * 3, drafter_ms=3.0,
                               pass_ms=planner.costs.verify_ms(plan.nodes + 1, 3), host_ms=0.1))
    assert [planner.state(r).drafted_rounds for r in rids] == [before["a"][0] + 1, 3, before["b"][0] + 1]
    assert st.ar_streak == before["paused"][1] + 1 and st.paused
    # 3 ms measured where two requests' blocks were drafted: the curve moves most near two requests
    assert planner.costs.draft_ms(2) / draft2 > planner.costs.draft_ms(8) / linear_costs(draft=0.6).draft_ms(8)
    assert Plan(0, [1.0], drafted=False).drafted_for(2) == [False, False]
    assert Plan(3, [1.0, 1.0]).drafted_for(2) == [True, True]


def test_an_explorer_drafts_the_batch_at_once_only_where_its_matches_cover_little():
    """An explorer's first probe drafts its whole batch, unless its n-gram round already expects most of the block:
    there the batch's drafter pass would buy one request a look at little, and it waits like any due probe."""
    from glance_sgl.planner import Plan

    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=15)
    rids = [f"r{i}" for i in range(8)]
    for r in rids:
        planner.begin(r, 0.01)
        st = planner.state(r)
        st.explorer, st.hold, st.ar_streak = r == "r0", 0 if r == "r0" else START_HOLD, 0
    planner.state("r0").ar_streak = MIN_PROBE_INTERVAL
    assert planner.state("r0").exploring and planner.state("r0").probe_due
    assert [planner.state(r).drafting_off for r in rids] == [False] + [True] * 7
    covered = Plan(7, [8.0] + [1.0] * 7, drafted=False)  # r0's matches: a 7-node chain it expects to be accepted
    uncovered = Plan(7, [1.0] * 8, drafted=False)
    # where the drafter's gain over such matches was never measured, r0's first round drafts for r0 alone (a look
    # at one request's price, until GAIN_EVIDENCE rounds measured it), not for the batch
    assert planner.draft_mask(rids, covered) == [True] + [False] * 7
    planner.gain_table(8.0).seen = GAIN_EVIDENCE
    assert not planner.gate(rids, covered)
    assert planner.gate(rids, uncovered)



def _merged_round(planner: Planner, rid: str, ngram_only: int, accepted: int = 6, alone: int = 0) -> None:
    """A drafting round over a merged tree whose accepted path holds ``ngram_only`` nodes that only the n-gram
    source proposed (the rest the drafter's), reported with its lookup's cost; ``alone``: what the matches' round
    alone would have accepted."""
    from glance_sgl.planner import Plan
    from glance_sgl.tree import SOURCE_DRAFTER, SOURCE_NGRAM

    rows = accepted + 1
    tags = torch.tensor([[0] + [SOURCE_NGRAM] * ngram_only + [SOURCE_DRAFTER] * (accepted - ngram_only)])
    chain = DraftTree(torch.arange(rows)[None], torch.arange(-1, rows - 1)[None], torch.arange(rows)[None],
                      torch.zeros(1, rows), tags)
    walk = verify_tree(chain.tokens, chain.parents, chain.depths,
                       torch.nn.functional.one_hot(torch.arange(1, rows + 1), rows + 1).float()[None] * 10,
                       torch.tensor([0]), [SamplingSpec()], max_depth=accepted)
    assert walk.accept_lens.tolist() == [accepted]
    planner.report(RoundReport([rid], Plan(accepted, [1.0 + accepted], drafted=True, raw_accept=[accepted]), rows,
                               [accepted], chain, walk, [0.01], cheap_ms=0.5,
                               alternative=Plan(accepted, [1.0 + alone], drafted=False) if alone else None,
                               alone=[alone] if alone else None))


def test_lookups_are_skipped_for_drafting_requests_they_add_nothing_to():
    """The sources without a model pass are looked up for a drafting request alone in its batch only where their
    candidates add to its rounds what the lookup costs: a request the drafter serves alone skips them (every
    NGRAM_RECHECK-th skip over all requests looks after all, and so does a request after NGRAM_RECHECK skips), one
    whose accepted paths hold n-gram-only nodes keeps looking, and so does one whose matches alone would accept
    nearly as much (their round may replace the drafter's); a request whose drafting is off always looks, every
    request of a batch of several looks (the gate can leave a request out of the batch's drafter pass only where it
    knows its matches), and the fixed planner never decides."""
    from glance_sgl.planner import NGRAM_RECHECK

    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=15)
    assert planner.cheap_rows(["a"], 16) == [16], "nothing measured yet: look"
    names = ["served", "copied", "replayed"]
    for i in range(6):
        for name in names:
            planner.cheap_rows([name], 16)
        _merged_round(planner, "served", ngram_only=0)
        _merged_round(planner, "copied", ngram_only=4)
        _merged_round(planner, "replayed", ngram_only=0, alone=6)
    looks = [[planner.cheap_rows([name], 16)[0] for name in names] for _ in range(3 * NGRAM_RECHECK)]
    assert all(rows[1] == 16 for rows in looks), "the lookups pay for the request they add to"
    assert all(rows[2] == 16 for rows in looks), "... and for the one whose matches alone could do the round"
    served = [rows[0] for rows in looks]
    assert served.count(1) > len(served) // 2 and 16 in served, "skipped, with a look now and then"
    assert all(planner.cheap_rows(names, 16) == [16] * 3 for _ in range(2 * NGRAM_RECHECK)), \
        "in a batch of several every request looks"
    st = planner.state("served")
    st.paused = True  # drafting off: the lookup is the round
    assert planner.cheap_rows(["served"], 16) == [16]
    fixed = Planner(linear_costs(), max_nodes=15, max_depth=15, mode="fixed")
    fixed.cheap_ms, fixed.lookups_all.looks = 0.5, 5.0
    assert fixed.cheap_rows(["x", "y"], 8) == [8, 8]


def test_weak_matches_stand_as_the_rival_but_take_no_rows_from_the_drafter():
    """Per request, the matches join the drafter's tree only where their own round expects half a draft or
    more; ``only_requests`` leaves the others' nodes out of the merge (untagged), the tree itself unchanged."""
    from glance_sgl.planner import Plan
    from glance_sgl.round import only_requests
    from glance_sgl.tree import SOURCE_NGRAM, merge_trees

    planner = Planner(linear_costs(), max_nodes=15, max_depth=15)
    assert planner.merge_worth(["a", "b", "c"], Plan(3, [1.2, 2.5, 1.5], drafted=False)) == [False, True, True]
    tokens = torch.tensor([[5, 6, 7], [5, 8, 9]])
    matches = DraftTree(tokens, torch.tensor([[-1, 0, 1]] * 2), torch.tensor([[0, 1, 2]] * 2),
                        torch.zeros(2, 3), torch.tensor([[0, SOURCE_NGRAM, SOURCE_NGRAM]] * 2))
    drafter = DraftTree(torch.tensor([[5, 1], [5, 2]]), torch.tensor([[-1, 0]] * 2), torch.tensor([[0, 1]] * 2),
                        torch.zeros(2, 2))
    assert only_requests(matches, [True, True]) is matches
    merged = merge_trees([drafter, only_requests(matches, [False, True])], 8)
    assert sorted(merged.tokens[0][merged.source_tags()[0] > 0].tolist()) == [1]
    assert sorted(merged.tokens[1][merged.source_tags()[1] > 0].tolist()) == [2, 8, 9]


def test_the_gate_weighs_a_requests_matches_at_what_they_actually_gave():
    """The matches' scores are learned over all traffic, where most matches fail: a replayed answer's chain is
    predicted a couple of drafts and gives the whole block. A request whose rounds without the drafter gave more
    than predicted (n-gram rounds, or ``alone`` inside drafting rounds) has them weighed at that ratio (capped) by
    the gate, so it passes up the drafter there; another request keeps the calibrated prediction. The row choice
    does not read the ratio."""
    from glance_sgl.planner import MATCH_RATIO_MAX, Plan

    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=15)
    weak = Plan(7, [3.0], drafted=False, raw_accept=[2.0])  # the matches' round as the scores see it
    for _ in range(6):  # replay: the n-gram rounds take the whole chain, and a drafting round credits it too
        planner.report(RoundReport(["replay"], weak, 8, [7], None, None, [0.01]))
    planner.report(RoundReport(["replay"], Plan(9, [9.0], drafted=True, raw_accept=[8.0]), 10, [8], None, None,
                               [0.01], alternative=weak, alone=[7]))
    st, fresh = planner.state("replay"), planner.state("fresh")
    assert 2.0 < st.match_ratio <= MATCH_RATIO_MAX and fresh.match_ratio == 1.0
    other, _, _ = planner._stakes([st, fresh], Plan(7, [3.0, 3.0], drafted=False, raw_accept=[2.0, 2.0]))
    assert other[0] == pytest.approx(1.0 + 2.0 * st.match_ratio) and other[1] == 3.0
    # the gain the drafter has to show over the matches: none left over a whole replayed block
    planner.begin("replay", 0.01)
    planner.begin("fresh", 0.01)
    for _ in range(30):  # the drafter's gain over matches like these: 3 drafts a round
        planner.begin("other", 0.01)
        planner.report(RoundReport(["other"], Plan(9, [9.0], drafted=True, raw_accept=[8.0]), 10, [5], None, None,
                                   [0.01], alternative=weak, alone=[2]))
    assert planner.gate(["fresh"], weak)
    assert not planner.gate(["replay"], weak)


def test_merged_rounds_calibrate_the_drafter_on_its_own_nodes_only():
    """A merged tree calibrates the drafter's depth factors from the drafter's nodes: a walk through an n-gram
    node is no drafter hit, and an n-gram node's score is no drafter prediction. (Before, merged trees were
    skipped, which left the calibration to the rounds without a lookup and biased it.)"""
    from glance_sgl.planner import Plan
    from glance_sgl.tree import SOURCE_DRAFTER, SOURCE_NGRAM, SOURCE_NONE

    # root -> 1 (drafter, p 0.5) -> 2 (drafter, p 0.5 of 1); root -> 3 (n-gram)
    tree = DraftTree(torch.tensor([[0, 11, 12, 13]]), torch.tensor([[-1, 0, 1, 0]]), torch.tensor([[0, 1, 2, 1]]),
                     torch.log(torch.tensor([[1.0, 0.5, 0.25, 0.9]])),
                     torch.tensor([[SOURCE_NONE, SOURCE_DRAFTER, SOURCE_DRAFTER, SOURCE_NGRAM]]))
    planner = Planner(linear_costs(), max_nodes=3, max_depth=3)
    before = (planner.depth.predicted.clone(), planner.depth.hits.clone())
    through_ngram = verify_tree(tree.tokens, tree.parents, tree.depths,
                                torch.nn.functional.one_hot(torch.tensor([[13, 0, 0, 0]]), 20).float(),
                                torch.zeros(1, dtype=torch.long), [SamplingSpec()])
    planner.report(RoundReport(["r"], Plan(3, [2.0], raw_accept=[1.0]), 4, [1], tree, through_ngram, [0.1]))
    pred, hits = planner.depth.predicted - before[0] * planner.depth.decay, planner.depth.hits - before[1] * planner.depth.decay
    assert pred[1] == pytest.approx(0.5) and hits[1] == pytest.approx(0.0)  # the drafter's child, not taken
    assert pred[2] == pytest.approx(0.0)  # its grandchild: its parent was not on the path
    through_drafter = verify_tree(tree.tokens, tree.parents, tree.depths,
                                  torch.nn.functional.one_hot(torch.tensor([[11, 12, 0, 0]]), 20).float(),
                                  torch.zeros(1, dtype=torch.long), [SamplingSpec()])
    before = (planner.depth.predicted.clone(), planner.depth.hits.clone())
    planner.report(RoundReport(["r"], Plan(3, [2.0], raw_accept=[1.0]), 4, [2], tree, through_drafter, [0.1]))
    pred, hits = planner.depth.predicted - before[0] * planner.depth.decay, planner.depth.hits - before[1] * planner.depth.decay
    assert hits[1] == pytest.approx(1.0) and hits[2] == pytest.approx(1.0)
    assert pred[1] == pytest.approx(0.5) and pred[2] == pytest.approx(0.5)


def test_candidates_without_the_drafter_read_their_scores_as_they_are():
    """Without the drafter's pass no node is the drafter's: the calibrated probabilities are the scores' exps
    (the shortcut ``drafter_nodes=False`` equals the general path with the nodes' tags), whatever the drafter's
    per-depth calibration says."""
    from glance_sgl.tree import SOURCE_NGRAM, SOURCE_NONE

    depth = DepthCalibration(7, decay=1.0)
    depth.hits[1:] *= 0.3  # a calibration far from 1: it must not touch another source's nodes
    scores = torch.tensor([[0.0, -0.1, -0.7, -2.0, 0.3]])
    depths = torch.tensor([[0, 1, 1, 2, 3]])
    tags = torch.tensor([[SOURCE_NONE] + [SOURCE_NGRAM] * 4])
    fast = depth.node_probs(scores, depths, tags, drafter_nodes=False)
    assert torch.allclose(fast, depth.node_probs(scores, depths, tags))
    assert torch.allclose(fast, scores.exp().clamp(max=1.0))
    assert not torch.allclose(fast, depth.node_probs(scores, depths))  # as the drafter's nodes they would differ


def test_a_request_that_yields_to_the_matches_drafts_again_where_they_are_missing():
    """A drafting round that does not beat the matches' round (a template opening both found) but beats an AR step
    pauses the request for rounds whose matches expect drafts only: where the matches find nothing, the gate weighs
    drafting again, with no probe back-off. A request whose probe beats neither waits for its next probe, and a
    request that stops drafting in a round without matches does not yield."""
    from glance_sgl.planner import Plan

    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=15)
    matched = Plan(4, [4.0], drafted=False)
    _merged_round(planner, "opening", ngram_only=0, accepted=4, alone=3)  # the drafter added one draft
    st = planner.state("opening")
    assert st.paused and st.yielded and st.probe_interval == MIN_PROBE_INTERVAL
    assert not planner.gate(["opening"], matched)  # the matches' round stays the better one ...
    assert planner.gate(["opening"], None)  # ... and where there is none the drafter runs
    assert not planner._leads_unread(["opening"])  # so its lead entropy is kept for that gate

    planner.begin("unknown", 0.01)
    planner.report(RoundReport(["unknown"], Plan(15, [8.0], drafted=True, raw_accept=[7.0]), 16, [0], None, None,
                               [0.01]))
    st = planner.state("unknown")
    assert st.paused and not st.yielded and st.probe_interval > MIN_PROBE_INTERVAL
    assert not planner.gate(["unknown"], None)

    for rid, alternative, yields in (("covered", Plan(7, [6.0], drafted=False), True), ("bare", None, False)):
        planner.begin(rid, 0.01)
        planner.report(RoundReport([rid], Plan(15, [11.0], drafted=True, raw_accept=[10.0]), 16, [10], None, None,
                                   [0.01]))
        assert not planner.state(rid).paused
        planner.skip([rid], alternative)
        assert planner.state(rid).paused and planner.state(rid).yielded == yields


def test_new_requests_look_the_matches_up_where_recent_new_requests_lookups_paid():
    """A request that has not drafted yet, alone in its batch, looks the matches up by what recent such requests'
    lookups gave: where their first drafting rounds got nothing from them it skips (every FIRST_RECHECK-th still
    looks); once rounds without the drafter ride on matches (replayed answers), new requests look again. In a
    batch of several, new requests always look. ``looks_first`` foresees the decision without taking it."""
    from glance_sgl.planner import Plan

    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=15)
    planner.cheap_ms = 0.5
    planner.lookups_all.add(0.0, 0.0, 10.0, 1.0)
    for _ in range(3):  # grounded answers: the drafter's first rounds commit 10 tokens, none only the matches'
        planner.lookups_first.add(0.0, 0.0, 10.0, FIRST_TREND)
    looks, foreseen = [], []
    for i in range(2 * FIRST_RECHECK):
        foreseen.append(planner.looks_first())  # what the embedded engine asks before the prefill
        looks.append(planner.cheap_rows([f"new{i}"], 16)[0])
    assert looks.count(16) == 2 and looks.count(1) == 2 * FIRST_RECHECK - 2
    assert foreseen == [n > 1 for n in looks], "looks_first foresees the first round's lookup"
    # in a batch of several, new requests look all the same (a skip could make the batch pay the drafter pass)
    assert planner.cheap_rows([f"batch{i}" for i in range(4)], 16) == [16] * 4
    for i in range(3):  # replayed answers: the matches' rounds carry them without the drafter
        planner.report(RoundReport([f"replay{i}"], Plan(7, [8.0], drafted=False, raw_accept=[7.0]), 8, [7], None,
                                   None, [0.01], cheap_ms=0.5))
    assert planner.looks_first()
    assert [planner.cheap_rows([f"next{i}"], 16)[0] for i in range(2 * FIRST_RECHECK)] == [16] * 2 * FIRST_RECHECK


def test_the_depth_factors_are_made_again_only_after_their_sums_change():
    depth = DepthCalibration(5)
    first = depth.log_cumulative()
    assert depth.log_cumulative() is first  # every choice reads it: no recomputation between reports
    depth.hits[2:] *= 0.5  # an in-place change (a report's, or a test's) is seen
    halved = depth.log_cumulative()
    assert halved is not first and float(halved[2]) == pytest.approx(float(first[2]) + math.log(0.5), abs=1e-6)
    tree = random_tree(3, 7)
    walk = verify_tree(tree.tokens, tree.parents, tree.depths, torch.randn(1, tree.num_rows, 50), torch.tensor([0]),
                       [SamplingSpec()], max_depth=7)
    depth.observe(tree.parents, tree.scores, tree.depths, walk.accepted_rows, walk.accept_lens)
    assert not torch.equal(depth.log_cumulative(), halved)


def test_a_request_its_matches_carry_round_after_round_is_retired():
    """A request whose rounds without the drafter each take CARRY_DRAFTS drafts or more and end at a leaf of the
    verified tree (the proposal ran out, nothing it proposed was wrong) is copying what the corpora hold: after
    CARRY_ROUNDS such rounds in a row it is retired (its drafter context no longer kept, never drafted for). A
    round that ends on a mismatch, or one the drafter drafted, starts the count again; mode "fixed" never
    retires."""
    from glance_sgl.planner import CARRY_DRAFTS, CARRY_ROUNDS, Plan
    from glance_sgl.verify import WalkResult

    chain = DraftTree(torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[-1, 0, 1, 2, 3]]),
                      torch.tensor([[0, 1, 2, 3, 4]]), torch.zeros(1, 5))
    branchy = DraftTree(torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[-1, 0, 1, 2, 2]]),
                        torch.tensor([[0, 1, 2, 3, 3]]), torch.zeros(1, 5))

    def walk(rows: list[int]) -> WalkResult:
        padded = rows + [-1] * (5 - len(rows))
        return WalkResult(accepted_rows=torch.tensor([padded]), accept_lens=torch.tensor([len(rows) - 1]),
                          bonus=torch.tensor([1]), committed_tokens=torch.tensor([[1] * 5]))

    ngram = Plan(4, [4.0], drafted=False, raw_accept=[3.0])

    def round_(planner: Planner, tree: DraftTree, rows: list[int], plan: Plan = ngram) -> None:
        planner.report(RoundReport(["r"], plan, 5, [len(rows) - 1], tree, walk(rows)))

    assert CARRY_DRAFTS <= 4
    planner = Planner(linear_costs(), max_nodes=15, max_depth=15)
    for _ in range(CARRY_ROUNDS - 1):
        round_(planner, chain, [0, 1, 2, 3, 4])  # the whole chain: a leaf
    round_(planner, branchy, [0, 1, 2, 3])  # ends on row 3, whose sibling 4 is a leaf too: row 3 is a leaf
    assert planner.state("r").retired and planner.carried_retired == 1
    assert planner.context_mask(["r"]) == [False] and not planner.gate(["r"])

    planner = Planner(linear_costs(), max_nodes=15, max_depth=15)
    round_(planner, chain, [0, 1, 2, 3, 4])
    round_(planner, chain, [0, 1, 2, 3])  # a mismatch at row 4: not carried, the count starts again
    for _ in range(CARRY_ROUNDS - 1):
        round_(planner, chain, [0, 1, 2, 3, 4])
    assert not planner.state("r").retired
    round_(planner, chain, [0, 1, 2, 3, 4], Plan(4, [4.0], drafted=True, raw_accept=[3.0]))  # the drafter's round
    round_(planner, chain, [0, 1, 2, 3, 4])
    assert not planner.state("r").retired and planner.state("r").carried == 1

    fixed = Planner(linear_costs(), max_nodes=15, max_depth=15, mode="fixed")
    for _ in range(2 * CARRY_ROUNDS):
        round_(fixed, chain, [0, 1, 2, 3, 4])
    assert not fixed.state("r").retired


def test_first_rounds_that_beat_the_matches_bring_new_requests_back_to_drafting():
    """After traffic where the drafter added nothing over the n-gram matches (its gain tables, which remember about
    a hundred rounds, price it at nothing there), requests whose first drafting rounds beat the matches again make
    the next new request draft in its first round; where first rounds lose to the matches (replayed answers), new
    requests keep to the matches."""
    from glance_sgl.planner import Plan

    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=15)
    matches = Plan(3, [2.0], drafted=False, raw_accept=[1.0])  # each request's n-gram round: one draft expected
    for _ in range(30):
        planner.gain_table(2.0).observe(0.01, 0.0)

    def drafts_first(rid: str) -> bool:
        planner.begin(rid, 0.01)
        return planner.draft_mask([rid], matches)[0]

    def first_round(rid: str, accepted: int) -> None:
        planner.begin(rid, 0.01)
        plan = Plan(10, [1.0 + accepted], drafted=True, raw_accept=[float(accepted)])
        planner.report(RoundReport([rid], plan, 11, [accepted], None, None, [0.01], alternative=matches, alone=[1]))

    assert not drafts_first("new0"), "the gain table says the drafter adds nothing over these matches"
    for i in range(3):
        first_round(f"won{i}", 10)
    assert drafts_first("new1"), "first rounds beat the matches again: a new request drafts at once"
    for i in range(4):
        first_round(f"lost{i}", 1)
    assert not drafts_first("new2"), "first rounds lost to the matches: new requests keep to them"


def test_first_rounds_that_pay_again_bring_new_requests_back_to_drafting_without_matches():
    """The same without matches: after first rounds that did not pay over an AR step (the gain table of rounds
    without matches learned nothing to draft for), first rounds that pay again make new requests draft at once."""
    from glance_sgl.planner import Plan

    planner = Planner(linear_costs(per_row=0.05, draft=0.6), max_nodes=15, max_depth=15)

    def first_round(rid: str, accepted: int) -> None:
        planner.begin(rid, 0.01)
        plan = Plan(10, [1.0 + accepted], drafted=True, raw_accept=[float(accepted)])
        planner.report(RoundReport([rid], plan, 11, [accepted], None, None, [0.01]))

    for i in range(60):
        first_round(f"unknown{i}", 0)
    planner.begin("new0", 0.01)
    assert not planner.draft_mask(["new0"])[0]
    for i in range(2):
        first_round(f"known{i}", 10)
    planner.begin("new1", 0.01)
    assert planner.state("new1").hold == 0 and planner.draft_mask(["new1"])[0]
