"""The cost model the planner weighs: interpolation, online refinement, calibration and its cache
(glance_sgl.costs)."""

from __future__ import annotations

import math

import pytest

from glance_sgl.costs import CostModel, _smooth_rows, calibrate, cost_key, default_row_grid, load_costs, save_costs


def test_cost_model_interpolates_and_extrapolates():
    costs = CostModel([1, 4, 16], [1.0, 2.0, 5.0], [1, 4], [0.5, 1.0])
    assert costs.ar_ms() == 1.0
    assert costs.verify_ms(2) == pytest.approx(1 + 1 / 3)
    assert costs.verify_ms(4, batch=2) == pytest.approx(2 + 3 * 4 / 12)  # 8 rows in all
    assert costs.verify_ms(32) == pytest.approx(5 + 3 * 16 / 12)  # past the last point: the last slope
    assert costs.draft_ms(2) == pytest.approx(0.5 + 0.5 / 3)
    assert costs.round_ms(3) == pytest.approx(costs.draft_ms() + costs.verify_ms(4))


def test_cost_model_online_scale_follows_the_machine_and_keeps_the_shape_monotone():
    rows = default_row_grid(64)
    costs = CostModel(rows, [1.0 + 0.1 * r for r in rows], [1, 8], [0.5, 2.0])  # 1 ms + 0.1 a row
    shape = costs.verify_ms(16) / costs.ar_ms()
    for _ in range(200):  # the machine got twice as slow: every pass takes twice its curve
        costs.observe_verify(1, 1, 2 * (1.0 + 0.1))
        costs.observe_draft(1, 2 * 0.5)
    assert costs.ar_ms() == pytest.approx(2.2, rel=0.05)
    assert costs.draft_ms() == pytest.approx(1.0, rel=0.1)
    assert costs.verify_ms(16) / costs.ar_ms() == pytest.approx(shape, rel=0.2)
    ys = costs.verify_ms_at
    assert all(b >= a for a, b in zip(ys, ys[1:]))
    costs.observe_verify(4, 1, float("nan"))  # a broken timing is ignored
    assert math.isfinite(costs.verify_ms(4))


def test_calibrate_keeps_the_fastest_sweep_and_the_cache_round_trips(tmp_path, monkeypatch):
    calls = {"verify": [], "draft": []}

    def run_verify(rows, batch):
        calls["verify"].append((rows, batch))
        sum(range(2000 * rows * batch))  # real work, more for more rows

    def run_draft(batch):
        calls["draft"].append(batch)

    key = cost_key("test", 1)
    costs = calibrate(run_verify, run_draft, [(r, 1) for r in (1, 4, 16)] + [(4, 4)], [1, 2], repeats=3, key=key)
    assert costs.verify_rows == [1, 4, 16]  # (4, 4) and (16, 1) are the same 16 rows
    assert len(calls["verify"]) == 4 * 4 and len(calls["draft"]) == 2 * 4  # a warm-up sweep + 3
    assert costs.verify_ms(16) >= costs.verify_ms(4) >= costs.verify_ms(1) > 0
    monkeypatch.setenv("GLANCE_COST_CACHE", str(tmp_path))
    assert load_costs(key) is None
    assert save_costs(costs) == tmp_path / f"{key}.json"
    again = load_costs(key)
    assert again is not None and again.to_dict() == costs.to_dict()
    assert load_costs(cost_key("test", 2)) is None
    # one slow sweep (a busy spell) sets no point: the fastest does
    sweeps = iter(range(100))

    def once_slow(rows, batch):
        sum(range(200000 if next(sweeps) == 2 else 2000))

    odd = calibrate(once_slow, run_draft, [(1, 1)], [1], repeats=4)
    usual = calibrate(lambda rows, batch: sum(range(2000)), run_draft, [(1, 1)], [1], repeats=4)
    assert odd.verify_ms(1) < 5 * usual.verify_ms(1)
    monkeypatch.setenv("GLANCE_COST_CACHE", "off")
    assert save_costs(costs) is None and load_costs(key) is None


def test_verify_ms_many_walks_the_curve_like_verify_ms():
    costs = CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.1, 1.3, 1.9, 2.5, 4.0], [1], [0.5])
    costs.scale = 1.25
    rows = list(range(0, 70))  # below the first point and past the last: the end segments extrapolate
    for batch in (1, 3):
        assert costs.verify_ms_many(rows, batch) == pytest.approx([costs.verify_ms(r, batch) for r in rows])
        shuffled = rows[::7] + rows[3::7]  # not ascending: one point at a time
        assert costs.verify_ms_many(shuffled, batch) == pytest.approx([costs.verify_ms(r, batch) for r in shuffled])
    one = CostModel([8], [2.0], [1], [0.5])  # a one-point curve scales with the rows
    assert one.verify_ms_many([1, 4, 16]) == pytest.approx([one.verify_ms(r) for r in (1, 4, 16)])


def test_calibrated_rows_are_smoothed_beyond_the_ar_step():
    """One noisy point does not bend the per-row slope: beyond 1 row a least-squares line, the AR step as
    measured, never decreasing."""
    xs = [1, 2, 4, 8, 16, 32]
    line = [5.0] + [6.0 + 0.1 * x for x in xs[1:]]
    assert _smooth_rows(xs, line) == pytest.approx(line)
    bumped = list(line)
    bumped[4] += 2.0  # a busy spell at 16 rows
    smooth = _smooth_rows(xs, bumped)
    assert smooth[0] == 5.0 and abs(smooth[4] - line[4]) < 1.0 and smooth == sorted(smooth)
    assert _smooth_rows([1, 2], [5.0, 4.0]) == [5.0, 5.0]  # too few points for a line: only made non-decreasing
