"""The planner as the SGLang worker uses it: mode selection, a batch-aware cost model, a test-only random policy.

``GLANCE_PLANNER`` (``WorkerSettings.planner``, :mod:`glance_sgl.sglang.settings`) picks the policy:

- ``auto`` (default): :class:`glance_sgl.planner.Planner` in ``auto`` mode chooses per batch whether to draft
  and how many of the ``--speculative-num-draft-tokens - 1`` reserved tree rows to verify;
- ``fixed``: today's behaviour, the full tree every step (ablations, benchmarks);
- ``random[:SEED]``: test-only; random tree sizes and plain AR steps (no drafter pass), to check that every
  mix of step shapes stays token-identical to decoding without speculation.

The cost model is :class:`BatchCostModel`, a :class:`glance_sgl.costs.CostModel` whose target-pass curve is
kept per calibrated batch size (on SGLang the pass's cost depends on the batch size, not only on total rows:
per-request attention work and launch overheads), plus the scheduler's own per-step time between two decode
steps (which every step pays, AR included). It is calibrated inside the running server (see
``GlanceWorker._calibrate``), cached per device + model by :func:`glance_sgl.costs.save_costs`, and refined
online.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field

import numpy as np

from glance_sgl.costs import CostModel, _interp, _interp_array, _interp_many, cost_cache_dir
from glance_sgl.planner import Planner, RandomPlanner

STEP_RATE = 0.1  # weight of one measured scheduler gap
Curve = tuple[list[int], list[float]]  # a calibrated target-pass curve: rows per request, ms


# ---------------------------------------------------------------------------------------------- costs
@dataclass
class BatchCostModel(CostModel):
    """A :class:`CostModel` with one target-pass curve per calibrated batch size.

    ``curves[bs] = (rows, ms)``: rows per request (ascending) and the pass's ms at that batch size. A query at
    another batch size interpolates linearly between the two nearest calibrated sizes (linear extrapolation
    past the ends). ``step_ms[bs]``: the scheduler's time between two decode steps (result processing, the next
    batch's preparation), paid by every step; it is added to :meth:`verify_ms`, so an AR step costs
    ``pass + step`` and a drafting round ``draft + pass + step + overhead``. Without curves the base model's
    total-rows curve is used.
    """

    curves: dict[int, Curve] = field(default_factory=dict)
    step_ms: dict[int, float] = field(default_factory=dict)
    ar_host_ms: float = 0.0  # host work of the last round when it was an AR step (online; not saved)

    # ------------------------------------------------------------------ queries
    def pass_ms(self, rows: int, batch: int = 1) -> float:
        """The target's pass alone (ms) over ``rows`` rows for each of ``batch`` requests."""
        if not self.curves:
            return super().verify_ms(rows, batch)
        return self._pass_ms_many([rows], batch)[0]

    def _bracket(self, batch: int) -> tuple[Curve, Curve | None, float]:
        """The calibrated curves a query at ``batch`` reads, found once: ``(curve, None, f)`` with one curve (the
        pass proportional to the batch size: ``ms * f``), else the two nearest sizes' curves and the weight ``w``
        of the upper one (linear in the batch size between them, extrapolated past the ends: ``lo + (hi - lo) *
        w``)."""
        sizes = sorted(self.curves)
        if len(sizes) == 1:  # _interp's one-point rule
            (curve,) = self.curves.values()
            return curve, None, max(float(batch), 1.0) / max(sizes[0], 1.0)
        i = min(max(bisect.bisect_left(sizes, float(batch)), 1), len(sizes) - 1)
        w = (float(batch) - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return self.curves[sizes[i - 1]], self.curves[sizes[i]], w

    def _pass_ms_many(self, rows: list[int], batch: int) -> list[float]:
        """:meth:`pass_ms` at each of ``rows``, the batch size's curves (:meth:`_bracket`) found once."""
        low, high, w = self._bracket(batch)
        points = [float(r) for r in rows]
        if high is None:
            return [max(ms * w, 0.0) * self.scale for ms in _interp_many(*low, points)]
        return [max(lo + (hi - lo) * w, 0.0) * self.scale
                for lo, hi in zip(_interp_many(*low, points), _interp_many(*high, points))]

    def verify_ms_many(self, rows: list[int], batch: int = 1) -> list[float]:
        """:meth:`verify_ms` at each of ``rows`` (the sizes ``Planner.choose`` weighs), with the batch's curves and
        the scheduler's time found once instead of once per row count."""
        if not self.curves:
            return super().verify_ms_many(rows, batch)
        step = self.scheduler_ms(batch)
        return [ms + step for ms in self._pass_ms_many(rows, batch)]

    def verify_ms_totals(self, totals: np.ndarray, batch: int = 1) -> np.ndarray:
        """:meth:`verify_ms` of ragged passes over ``totals`` rows in all for ``batch`` requests: the batch's
        curves (:meth:`_bracket`) at the mean rows per request (``totals / batch``), in array ops, plus the
        scheduler's time."""
        if not self.curves:
            return super().verify_ms_totals(totals, batch) + self.scheduler_ms(batch)
        rows = np.asarray(totals, dtype=np.float64) / max(batch, 1)
        low, high, w = self._bracket(batch)
        if high is None:
            ms = _interp_array(*low, rows) * w
        else:
            lo, hi = _interp_array(*low, rows), _interp_array(*high, rows)
            ms = lo + (hi - lo) * w
        return np.maximum(ms, 0.0) * self.scale + self.scheduler_ms(batch)

    def scheduler_ms(self, batch: int = 1) -> float:
        if not self.step_ms:
            return 0.0
        sizes = sorted(self.step_ms)
        return _interp(sizes, [self.step_ms[b] for b in sizes], float(batch))

    def verify_ms(self, rows: int, batch: int = 1) -> float:
        return self.pass_ms(rows, batch) + self.scheduler_ms(batch)

    def calibrated_batches(self) -> list[int]:
        return sorted(self.curves)

    # ------------------------------------------------------------------ measurements
    def add_curve(self, batch: int, rows: list[int], ms: list[float]) -> None:
        """A calibrated curve at ``batch`` (ms made non-decreasing in rows)."""
        order = sorted(range(len(rows)), key=rows.__getitem__)
        xs, ys = [int(rows[i]) for i in order], [float(ms[i]) for i in order]
        for i in range(1, len(ys)):
            ys[i] = max(ys[i], ys[i - 1])
        self.curves[int(batch)] = (xs, ys)
        if batch == min(self.curves):  # the base fields stay a valid total-rows curve
            self.verify_rows, self.verify_ms_at = [x * batch for x in xs], list(ys)

    def add_draft_point(self, batch: int, ms: float) -> None:
        """A calibrated drafter pass of ``ms`` at ``batch`` requests. The points it contradicts go (a larger batch
        priced lower, a smaller one higher: a pass over more requests never costs less): the uncalibrated prior's
        placeholders (:meth:`prior`: 8 ms at 64 requests, which stood beside a calibrated 25 ms at 32 and halved
        the drafter's price past it) and points of a calibration on other traffic."""
        b, ms = int(batch), float(ms)
        pts = {x: y for x, y in zip(self.draft_batch, self.draft_ms_at) if (x < b and y <= ms) or (x > b and y >= ms)}
        pts[b] = ms
        self.draft_batch = sorted(pts)
        self.draft_ms_at = [pts[x] for x in self.draft_batch]

    def _nearest(self, table, batch: int) -> int:
        return min(table, key=lambda b: abs(math.log(b / batch)))

    def observe_verify(self, rows: int, batch: int, ms: float) -> None:
        """One measured target pass (``ms``: the pass alone): the overall scale moves quickly, the nearest
        calibrated curve's shape near ``rows`` slowly (a busy spell does not bend the curves)."""
        if not self.curves:
            return super().observe_verify(rows, batch, ms)
        xs, ys = self.curves[self._nearest(self.curves, batch)]
        self._observe(xs, ys, float(rows), ms, pred=self.pass_ms(rows, batch))  # the base model's update

    def observe_ar(self, batch: int, pass_ms: float, host_ms: float) -> None:
        """An AR step: the pass refines the one-row curve; its host work is paid by every step, so it joins the
        scheduler's time (:meth:`observe_gap`) rather than a drafting round's overhead."""
        self.observe_verify(1, batch, pass_ms)
        self.ar_host_ms = host_ms

    def observe_round(self, rows: int, batch: int, drafted: bool, drafter_ms: float, pass_ms: float,
                      host_ms: float, draft_batch: int | None = None) -> None:
        if drafted or rows > 1:
            self.ar_host_ms = 0.0
        super().observe_round(rows, batch, drafted, drafter_ms, pass_ms, host_ms, draft_batch)

    def observe_gap(self, batch: int, ms: float) -> None:
        """The time between the end of one round and the start of the next (the scheduler's result processing and
        batch preparation, the worker's own plumbing), plus the host work of the previous round when it was an AR
        step: what every step pays besides its passes (:meth:`observe_step`)."""
        self.observe_step(batch, ms + self.ar_host_ms)
        self.ar_host_ms = 0.0

    def observe_step(self, batch: int, ms: float) -> None:
        """The scheduler's time between two consecutive decode steps of ``batch`` requests."""
        if not math.isfinite(ms) or ms < 0:
            return
        if batch not in self.step_ms:
            near = self.step_ms.get(self._nearest(self.step_ms, batch)) if self.step_ms else None
            self.step_ms[batch] = ms if near is None else near
        cur = self.step_ms[batch]
        self.step_ms[batch] = cur + STEP_RATE * (min(ms, 4 * cur + 1.0) - cur)

    def observe_overhead(self, ms: float) -> None:
        if self.overhead_ms <= 0.0 and math.isfinite(ms) and ms > 0:
            self.overhead_ms = ms  # the first measurement is the prior (the base model starts at 0)
            return
        super().observe_overhead(ms)

    # ------------------------------------------------------------------ cache format
    def to_dict(self) -> dict:
        d = super().to_dict()
        d["curves"] = {str(b): [list(xs), list(ys)] for b, (xs, ys) in self.curves.items()}
        d["step_ms"] = {str(b): v for b, v in self.step_ms.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BatchCostModel":
        base = CostModel.from_dict(d)
        curves = {int(b): ([int(x) for x in xs], [float(y) for y in ys])
                  for b, (xs, ys) in (d.get("curves") or {}).items()}
        steps = {int(b): float(v) for b, v in (d.get("step_ms") or {}).items()}
        model = cls(base.verify_rows, base.verify_ms_at, [], [], overhead_ms=base.overhead_ms, key=base.key,
                    curves=curves, step_ms=steps)
        # the drafter's curve as non-decreasing points (a cache written before add_draft_point dropped what it
        # contradicts may hold a prior placeholder below a calibrated point): each point kept where it is no lower
        # than every smaller batch's (the kept points' last: they only rise)
        for b, ms in zip(base.draft_batch, base.draft_ms_at):
            if not model.draft_ms_at or ms >= model.draft_ms_at[-1]:
                model.draft_batch.append(b)
                model.draft_ms_at.append(ms)
        return model

    @classmethod
    def prior(cls, key: str = "") -> "BatchCostModel":
        """An uncalibrated model (target pass ~ rows, drafter pass ~ one AR step) until calibration runs."""
        return cls([1, 64], [1.0, 4.0], [1, 64], [1.0, 8.0], overhead_ms=0.0, key=key)


def load_batch_costs(key: str) -> BatchCostModel | None:
    """The cached :class:`BatchCostModel` of ``key`` (written by ``glance_sgl.costs.save_costs``), or None
    when there is none (or it is unreadable / of another key)."""
    directory = cost_cache_dir()
    if directory is None:
        return None
    try:
        model = BatchCostModel.from_dict(json.loads((directory / f"{key}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return model if model.key == key else None


# ---------------------------------------------------------------------------------------------- policies
def make_planner(mode: str, costs: CostModel, max_nodes: int, max_depth: int, seed: int = 0) -> Planner:
    """The worker's planner for ``mode`` (``WorkerSettings.planner``: ``GLANCE_PLANNER``)."""
    if mode == "random":
        return RandomPlanner(costs, max_nodes, max_depth, mode="auto", seed=seed)
    return Planner(costs, max_nodes, max_depth, mode=mode)


__all__ = ["BatchCostModel", "load_batch_costs", "make_planner"]
