"""The SGLang worker's planning pieces without an engine: GLANCE_PLANNER parsing, the batch-aware cost model and
its cache round trip, the test-only random policy, the batched drafter contexts (one extend call per drafter
pass gives the same drafts as per-request extends, across batch changes and AR steps), AR / calibration trees."""

from __future__ import annotations

import random

import pytest
import torch

from tests.glance_testing import tiny_bound_drafter

sglang = pytest.importorskip("sglang")


def test_batch_cost_model_interpolates_refines_and_round_trips(tmp_path, monkeypatch):
    from glance_sgl.costs import save_costs
    from glance_sgl.sglang.planning import BatchCostModel, load_batch_costs

    c = BatchCostModel.prior("k1")
    c.add_curve(1, [1, 2, 4], [10.0, 9.0, 12.0])  # made non-decreasing
    c.add_curve(4, [1, 2, 4], [20.0, 24.0, 32.0])
    c.add_draft_point(1, 3.0)
    c.add_draft_point(4, 6.0)
    assert c.curves[1][1] == [10.0, 10.0, 12.0]
    assert c.pass_ms(4, 1) == pytest.approx(12.0) and c.pass_ms(2, 4) == pytest.approx(24.0)
    assert c.pass_ms(1, 2) == pytest.approx(10.0 + (20.0 - 10.0) / 3)  # between the calibrated batch sizes
    assert c.pass_ms(3, 8) > c.pass_ms(3, 4)  # linear extrapolation past the largest
    assert c.draft_ms(4) == pytest.approx(6.0)
    c.observe_step(4, 2.0)
    assert c.verify_ms(2, 4) == pytest.approx(26.0) and c.ar_ms(4) == pytest.approx(22.0)
    # the tree-size choice reads the costs of every size at once: the same per-batch curves and scheduler time
    assert c.verify_ms_many([1, 2, 3, 4], 4) == pytest.approx([c.verify_ms(r, 4) for r in (1, 2, 3, 4)])
    before = c.pass_ms(4, 4)
    for _ in range(20):
        c.observe_verify(4, 4, 16.0)  # the machine got faster
    assert c.pass_ms(4, 4) < before and c.scale < 1.0
    c.observe_overhead(1.5)
    assert c.overhead_ms == pytest.approx(1.5)  # the first measurement is the prior
    monkeypatch.setenv("GLANCE_COST_CACHE", str(tmp_path))
    assert save_costs(c) is not None
    again = load_batch_costs("k1")
    assert load_batch_costs("other") is None
    assert again.curves == c.curves and again.step_ms == c.step_ms and again.draft_ms_at == c.draft_ms_at


def test_calibrated_drafter_points_replace_the_prior_and_stay_non_decreasing(tmp_path, monkeypatch):
    """The uncalibrated prior's drafter placeholders (1 ms at 1 request, 8 ms at 64) go once calibrations say
    otherwise: past the largest calibrated batch the drafter's price is extrapolated from the calibrated points,
    not read off a placeholder below them; a cached curve written before holds no such point once loaded."""
    import json

    from glance_sgl.sglang.planning import BatchCostModel, load_batch_costs

    c = BatchCostModel.prior("k2")
    for batch, ms in ((1, 3.4), (16, 12.6), (32, 25.3)):
        c.add_draft_point(batch, ms)
    assert c.draft_batch == [1, 16, 32]
    assert c.draft_ms(48) == pytest.approx(25.3 + (25.3 - 12.6) / 16 * 16)
    c.add_draft_point(8, 30.0)  # a calibration on other traffic: the cheaper larger batches it contradicts go
    assert c.draft_batch == [1, 8] and c.draft_ms(8) == pytest.approx(30.0)
    monkeypatch.setenv("GLANCE_COST_CACHE", str(tmp_path))
    cached = {"key": "k3", "verify_rows": [1, 2], "verify_ms": [5.0, 6.0], "draft_batch": [1, 16, 32, 64],
              "draft_ms": [3.4, 12.6, 25.3, 12.6], "overhead_ms": 1.0}
    (tmp_path / "k3.json").write_text(json.dumps(cached))
    loaded = load_batch_costs("k3")
    assert loaded.draft_batch == [1, 16, 32] and loaded.draft_ms(64) > 25.3


@pytest.mark.parametrize("seed", range(3))
def test_batch_cost_model_weighs_every_tree_size_as_it_weighs_one(seed):
    """``verify_ms_many`` (one lookup of the batch's bracketing curves) equals ``verify_ms`` row count by row
    count, with one curve or several, between, below and past the calibrated batch sizes."""
    from glance_sgl.sglang.planning import BatchCostModel

    rng = random.Random(seed)
    for _ in range(50):
        c = BatchCostModel.prior()
        for b in rng.sample([1, 2, 4, 8, 16, 32], rng.randint(1, 4)):
            rows = sorted(rng.sample(range(1, 40), rng.randint(1, 6)))
            c.add_curve(b, rows, [rng.uniform(1, 50) for _ in rows])
        c.observe_step(rng.choice([1, 3, 8]), rng.uniform(0, 5))
        c.scale = rng.uniform(0.5, 2.0)
        for batch in (1, 3, 9, 40):
            assert c.verify_ms_many(list(range(1, 33)), batch) == \
                pytest.approx([c.verify_ms(r, batch) for r in range(1, 33)], rel=1e-12)


def test_random_planner_mixes_ar_steps_and_every_tree_size():
    from glance_sgl.planner import RandomPlanner
    from glance_sgl.sglang.planning import BatchCostModel, make_planner

    p = make_planner("random", BatchCostModel.prior(), max_nodes=7, max_depth=4, seed=3)
    assert isinstance(p, RandomPlanner)
    scores = torch.sort(-torch.rand(2, 8), dim=1, descending=True).values
    scores[:, 0] = 0
    depths = torch.tensor([[0, 1, 1, 2, 2, 3, 3, 4]] * 2)
    drafted, sizes = 0, set()
    for _ in range(200):
        if p.gate(["a", "b"]):
            drafted += 1
            plan = p.choose(["a", "b"], scores, depths)
            sizes.add(plan.nodes)
            assert len(plan.expected_tokens) == 2 and plan.drafted
        else:
            assert p.skip(["a", "b"]).nodes == 0
    assert 80 < drafted < 190 and sizes == set(range(8))
    assert make_planner("fixed", BatchCostModel.prior(), 7, 4).mode == "fixed"


def _drafter():
    return tiny_bound_drafter(block_size=5, branch_k=2)


class _Req:
    def __init__(self, rid):
        self.rid, self.done = rid, False

    def finished(self):
        return self.done


def test_draft_kv_pool_equals_per_request_extends():
    """The draft KV pool addressed by SGLang-like token slots: prompts of different lengths written at scattered
    slots, verify-like steps committing random accepted paths (``committed_slots``, padding to the padding slot),
    AR steps (1 row), a request sharing another's prefix slots (a radix-cache hit: only its own tokens are
    written) and batches in any order: the gathered context drafts what a per-request cache fed token by token
    drafts."""
    from glance_sgl.sglang.draft_pool import PAD_SLOT, DraftKVPool, committed_slots

    d = _drafter()
    dim = 2 * 32
    rng = random.Random(0)
    g = torch.Generator().manual_seed(1)
    pool = DraftKVPool(d, size=600, device="cpu", dtype=torch.float32)
    req_to_token = torch.zeros(8, 128, dtype=torch.int32)
    free = list(range(1, 600))
    rng.shuffle(free)  # slots are not in order, as after many allocations and frees
    row, length, ref = {}, {}, {}

    def alloc(rid, n):
        r = row[rid]
        for j in range(length[rid], length[rid] + n):
            req_to_token[r, j] = free.pop()

    def start(rid, n, prefix_of=None, shared=0):
        row[rid], length[rid] = len(row), 0
        ref[rid] = d.new_cache(1, capacity=4)
        if prefix_of is not None:  # the radix cache's prefix: same slots, draft K/V already there
            req_to_token[row[rid], :shared] = req_to_token[row[prefix_of], :shared]
            d.extend_context(ref[rid], ref_taps[prefix_of][:shared][None], torch.tensor([shared]))
            length[rid] = shared
        taps = torch.randn(n, dim, generator=g)
        alloc(rid, n)
        slots = req_to_token[row[rid], length[rid]:length[rid] + n]
        pool.write(slots, taps, torch.arange(length[rid], length[rid] + n))
        d.extend_context(ref[rid], taps[None], torch.tensor([n]))
        ref_taps[rid] = torch.cat([ref_taps[prefix_of][:shared], taps]) if prefix_of else taps
        length[rid] += n

    def step(rids, rows):
        """One verify-like pass of ``rows`` rows per request (reserved slots after the context); commits a random
        accepted path, moved to the front like compact_kv does."""
        taps = torch.randn(len(rids), rows, dim, generator=g)
        counts = [rng.randint(1, rows) for _ in rids]
        acc = torch.full((len(rids), rows), -1, dtype=torch.long)
        for b, (rid, k) in enumerate(zip(rids, counts)):  # the root, then accepted rows in tree order
            acc[b, :k] = torch.tensor([0] + sorted(rng.sample(range(1, rows), k - 1)))
            alloc(rid, rows)
        kept = taps.gather(1, acc.clamp(min=0)[:, :, None].expand(-1, -1, dim)).reshape(-1, dim)
        idx = torch.tensor([row[r] for r in rids])
        lens = torch.tensor([length[r] for r in rids])
        slots, pos = committed_slots(req_to_token, idx, lens, torch.tensor(counts), rows)
        assert (slots.view(len(rids), rows)[acc < 0] == PAD_SLOT).all()
        pool.write(slots, kept, pos)
        for b, (rid, k) in enumerate(zip(rids, counts)):
            d.extend_context(ref[rid], taps[b, acc[b, :k]][None], torch.tensor([k]))
            ref_taps[rid] = torch.cat([ref_taps[rid], taps[b, acc[b, :k]]])
            length[rid] += k  # the unused reserved slots stay the request's (as in SGLang) but are not read

    def check(rids):
        roots = torch.tensor([rng.randrange(40) for _ in rids])
        lens = [length[r] for r in rids]
        cache = pool.gather(req_to_token, torch.tensor([row[r] for r in rids]), torch.tensor(lens), max(lens))
        got = d.draft_block(cache, roots, context_len=max(lens))
        for b, rid in enumerate(rids):
            want = d.draft_block(ref[rid], roots[b:b + 1])
            assert torch.allclose(got[b:b + 1], want, atol=1e-5), rid

    ref_taps = {}
    start("a", 7)
    start("b", 3)
    check(["a", "b"])
    step(["a", "b"], 4)
    check(["a", "b"])
    step(["a", "b"], 1)  # AR steps
    step(["a", "b"], 1)
    step(["a", "b"], 3)
    check(["b", "a"])
    start("c", 5, prefix_of="a", shared=6)  # a prefix hit on 6 of a's tokens
    check(["b", "c"])
    step(["b", "c"], 5)
    step(["b"], 1)
    check(["c", "a", "b"])
    check(["c"])


def test_ar_and_calibration_trees_verify_inputs():
    from glance_sgl.sglang.glance_info import build_verify_input
    from glance_sgl.metrics import entropies_nats
    from glance_sgl.round import chain_of, root_tree

    roots = torch.tensor([5, 9])
    seq_lens = torch.tensor([4, 6])
    req_to_token = torch.arange(3 * 16).view(3, 16)
    vt = build_verify_input(root_tree(roots), seq_lens, [4, 6], torch.tensor([2, 0]), req_to_token)
    assert vt.spec_info.draft_token_num == 1 and vt.input_ids.tolist() == [5, 9]
    assert vt.spec_info.positions.tolist() == [4, 6]
    assert vt.spec_info.custom_mask.bool().all() and vt.spec_info.custom_mask.numel() == 5 + 7
    assert vt.out_cache_loc.tolist() == [2 * 16 + 4, 6]
    chain = chain_of(roots, 3)
    vt = build_verify_input(chain, seq_lens, [4, 6], torch.tensor([2, 0]), req_to_token)
    assert vt.spec_info.positions.view(2, 3).tolist() == [[4, 5, 6], [6, 7, 8]]
    assert vt.spec_info.draft_token_num == 3
    h = entropies_nats(torch.tensor([[0.0, 0.0], [100.0, 0.0]]))
    assert h[0] == pytest.approx(0.6931, abs=1e-4) and h[1] == pytest.approx(0.0, abs=1e-6)


def test_deferred_draft_kv_writes_keep_the_later_write_of_a_slot():
    """Deferred writes (AR steps) are projected in one flush; a slot written twice in between (freed and given
    to another token) keeps the later write, whatever the order inside the flushed batch."""
    from glance_sgl.sglang.draft_pool import DraftKVPool

    d = _drafter()
    g = torch.Generator().manual_seed(3)
    deferred, direct = (DraftKVPool(d, size=64, device="cpu", dtype=torch.float32) for _ in range(2))
    steps = [(torch.tensor([5, 9, 0]), torch.randn(3, 64, generator=g), torch.tensor([10, 11, 0])),
             (torch.tensor([7]), torch.randn(1, 64, generator=g), torch.tensor([12])),
             (torch.tensor([9, 5]), torch.randn(2, 64, generator=g), torch.tensor([3, 4]))]  # 9 and 5 reused
    for slots, taps, pos in steps:
        deferred.defer(slots, taps, pos)
        direct.write(slots, taps, pos)  # one step at a time: the later write wins by order
    deferred.flush()
    for a, b in zip(deferred.k + deferred.v, direct.k + direct.v):
        assert torch.allclose(a[1:], b[1:], atol=1e-6)  # slot 0 is the padding slot
    # on a CPU a flush projects the committed rows only: the padding rows never reach the pool
    assert not any(t[0].any() for t in deferred.k + deferred.v) and any(t[0].any() for t in direct.k + direct.v)
    deferred.flush()  # nothing pending: a no-op


def test_deferred_draft_kv_writes_are_bounded():
    """A batch that never drafts again does not hoard deferred writes: after ``MAX_DEFERRED`` of them they are
    projected (the pool then equals writing each at once) and the queue starts over."""
    from glance_sgl.sglang.draft_pool import MAX_DEFERRED, DraftKVPool

    d = _drafter()
    g = torch.Generator().manual_seed(4)
    deferred, direct = (DraftKVPool(d, size=4 * MAX_DEFERRED, device="cpu", dtype=torch.float32) for _ in range(2))
    for step in range(MAX_DEFERRED + 3):
        slots, taps, pos = torch.tensor([1 + step]), torch.randn(1, 64, generator=g), torch.tensor([step])
        deferred.defer(slots, taps, pos)
        direct.write(slots, taps, pos)
        assert len(deferred._pending) == (step + 1) % MAX_DEFERRED
    written = 1 + MAX_DEFERRED  # slots 1 .. MAX_DEFERRED went in at the bound's flush, the last three wait
    for a, b in zip(deferred.k + deferred.v, direct.k + direct.v):
        assert torch.allclose(a[1:written], b[1:written], atol=1e-6)
        assert not a[written:written + 3].any()
