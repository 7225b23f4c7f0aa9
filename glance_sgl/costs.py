"""The cost model of speculative rounds: milliseconds of the target's pass by the rows it processes (batch size x
rows per request, piecewise linear between calibrated points) and of the drafter pass by batch size, with the host
work of a round besides the two passes.

It is calibrated at start-up by the engine (:func:`calibrate`, through ``glance_sgl.round.calibrate_round``), cached
per device + model + threads (:func:`cost_key`, :func:`load_costs` / :func:`save_costs`, ``$GLANCE_COST_CACHE``) and
refined online from real rounds (:meth:`CostModel.observe_round`); ``glance_sgl.planner.Planner`` weighs it.
Torch and numbers only: no Hugging Face or SGLang types.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

ONLINE_RATE = 0.05  # weight of one timing observation in the cost model's overall scale
SHAPE_RATE = 0.02  # ... and in the shape of its curves


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation; linear extrapolation past the ends (never below 0)."""
    if len(xs) == 1:
        return ys[0] * max(x, 1.0) / max(xs[0], 1.0)
    return _on_segment(xs, ys, min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1), x)


def _interp_many(xs: Sequence[float], ys: Sequence[float], points: Sequence[float]) -> list[float]:
    """:func:`_interp` at each of ``points``; for ascending points one walk along the curve instead of a search per
    point (the tree sizes ``Planner.choose`` weighs, every round)."""
    n = len(xs)
    if n == 1 or any(b < a for a, b in zip(points, points[1:])):
        return [_interp(xs, ys, x) for x in points]
    out, i = [], 1
    for x in points:
        while i < n - 1 and xs[i] < x:  # the segment _interp picks: bisect_left, kept within [1, n - 1]
            i += 1
        out.append(_on_segment(xs, ys, i, x))
    return out


def _interp_array(xs: Sequence[float], ys: Sequence[float], x: np.ndarray) -> np.ndarray:
    """:func:`_interp` at every point of ``x`` (float64 array), in array ops."""
    x = np.asarray(x, dtype=np.float64)
    if len(xs) == 1:
        return ys[0] * np.maximum(x, 1.0) / max(xs[0], 1.0)
    fx, fy = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    i = np.clip(np.searchsorted(fx, x, side="left"), 1, len(fx) - 1)
    x0, x1, y0, y1 = fx[i - 1], fx[i], fy[i - 1], fy[i]
    return np.maximum(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


def _on_segment(xs: Sequence[float], ys: Sequence[float], i: int, x: float) -> float:
    """The line through points ``i - 1`` and ``i`` at ``x`` (never below 0)."""
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


@dataclass
class CostModel:
    """Milliseconds of the target's pass by total rows and of the drafter pass by batch size.

    ``verify_rows`` / ``verify_ms``: ascending total rows (batch size x rows per request) and the pass's ms there;
    ``draft_batch`` / ``draft_ms``: ascending batch sizes and the drafter pass's ms (one block per request).
    ``overhead_ms``: per-round host work of a drafting round besides the two passes (tree, mask, walk, keep).
    Observations move an overall ``scale`` (the machine's speed now: load, clocks) quickly and the curves' shape
    slowly, so a busy spell does not bend the curves.
    """

    verify_rows: list[int]
    verify_ms_at: list[float]
    draft_batch: list[int]
    draft_ms_at: list[float]
    overhead_ms: float = 0.0
    key: str = ""
    scale: float = 1.0  # the machine's speed now relative to the curves (online; not saved)

    def verify_ms(self, rows: int, batch: int = 1) -> float:
        """The target's pass over ``rows`` rows for each of ``batch`` requests (1 row = an AR step)."""
        return _interp(self.verify_rows, self.verify_ms_at, float(rows * batch)) * self.scale

    def verify_ms_many(self, rows: Sequence[int], batch: int = 1) -> list[float]:
        """:meth:`verify_ms` at each of ``rows``: the costs of the tree sizes :meth:`Planner.choose` weighs
        (ascending rows: one walk along the curve instead of a search per point)."""
        return [ms * self.scale for ms in _interp_many(self.verify_rows, self.verify_ms_at,
                                                        [float(r * batch) for r in rows])]

    def verify_ms_totals(self, totals: np.ndarray, batch: int = 1) -> np.ndarray:
        """:meth:`verify_ms` of passes over ``totals`` rows in all (float64 array, any order) for ``batch``
        requests that each verify their own number of rows: the costs of the row allocations
        :meth:`Planner.choose` weighs for a ragged pass (this curve is by total rows already)."""
        return _interp_array(self.verify_rows, self.verify_ms_at, totals) * self.scale

    def draft_ms(self, batch: int = 1) -> float:
        return _interp(self.draft_batch, self.draft_ms_at, float(batch)) * self.scale

    def ar_ms(self, batch: int = 1) -> float:
        return self.verify_ms(1, batch)

    def round_ms(self, nodes: int, batch: int = 1, draft_batch: int | None = None) -> float:
        """A drafting round verifying ``nodes`` nodes per request of ``batch`` (0 nodes still pays the drafter pass),
        the drafter drafting for ``draft_batch`` of them (default: all)."""
        return self.draft_ms(batch if draft_batch is None else draft_batch) + self.verify_ms(nodes + 1, batch) \
            + self.overhead_ms

    @staticmethod
    def _refine(xs: list[int], ys: list[float], x: float, ratio: float) -> None:
        """Move the curve near ``x`` by a (scale-corrected) observed/predicted ``ratio``; keep it non-decreasing."""
        if len(xs) == 1:
            ys[0] *= 1 + SHAPE_RATE * (ratio - 1)
            return
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        w1 = min(max((x - xs[i - 1]) / (xs[i] - xs[i - 1]), 0.0), 1.0)
        for j, w in ((i - 1, 1.0 - w1), (i, w1)):
            ys[j] *= 1 + SHAPE_RATE * w * (ratio - 1)
        for j in range(1, len(ys)):  # a pass over more rows never costs less
            ys[j] = max(ys[j], ys[j - 1])

    def _observe(self, xs: list[int], ys: list[float], x: float, ms: float, pred: float | None = None) -> None:
        """One measured time ``ms`` at ``x`` on the curve ``(xs, ys)``: the scale moves quickly, the curve's shape
        near ``x`` slowly. ``pred``: the model's prediction of ``ms`` (default: the curve's at ``x``, scaled)."""
        pred = _interp(xs, ys, x) * self.scale if pred is None else pred
        if pred <= 0 or not math.isfinite(ms) or ms <= 0:
            return
        ratio = min(max(ms / pred, 0.5), 2.0)  # one slow round (GC, a noisy neighbour) moves little
        # most of a change is the machine's speed (load, clocks), which moves every cost alike: the scale;
        # the curves' shape follows slowly
        self.scale *= 1 + ONLINE_RATE * (ratio - 1)
        self._refine(xs, ys, x, ratio)

    def observe_verify(self, rows: int, batch: int, ms: float) -> None:
        """Refine the target-pass curve near ``rows * batch`` from one measured pass."""
        self._observe(self.verify_rows, self.verify_ms_at, float(rows * batch), ms)

    def observe_draft(self, batch: int, ms: float) -> None:
        self._observe(self.draft_batch, self.draft_ms_at, float(batch), ms)

    def observe_overhead(self, ms: float) -> None:
        if math.isfinite(ms) and ms >= 0:
            self.overhead_ms += ONLINE_RATE * (min(ms, 4 * self.overhead_ms + 1.0) - self.overhead_ms)

    def observe_round(self, rows: int, batch: int, drafted: bool, drafter_ms: float, pass_ms: float,
                      host_ms: float, draft_batch: int | None = None) -> None:
        """One round's measured parts (ms): a drafting round refines the target-pass curve at ``rows`` per request,
        the drafter pass at ``draft_batch`` (the requests it drafted for; default ``batch``) and the host overhead;
        a one-row round without the drafter is an AR step, whose host work (the choice, the drafter's deferred
        context) is part of what an AR step costs (:meth:`observe_ar`); a tree of other sources alone (n-gram
        matches) refines the pass curve and the overhead."""
        if drafted or rows > 1:
            self.observe_verify(rows, batch, pass_ms)
            if drafted:
                self.observe_draft(batch if draft_batch is None else draft_batch, drafter_ms)
            self.observe_overhead(host_ms)
        else:
            self.observe_ar(batch, pass_ms, host_ms)

    def observe_ar(self, batch: int, pass_ms: float, host_ms: float) -> None:
        """An AR step of ``batch`` requests: the one-row point of the curve, host work included."""
        self.observe_verify(1, batch, pass_ms + host_ms)

    def to_dict(self) -> dict:
        return {"key": self.key, "verify_rows": list(self.verify_rows), "verify_ms": list(self.verify_ms_at),
                "draft_batch": list(self.draft_batch), "draft_ms": list(self.draft_ms_at),
                "overhead_ms": self.overhead_ms}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls([int(x) for x in d["verify_rows"]], [float(x) for x in d["verify_ms"]],
                   [int(x) for x in d["draft_batch"]], [float(x) for x in d["draft_ms"]],
                   float(d.get("overhead_ms", 0.0)), str(d.get("key", "")))


def default_row_grid(max_rows: int) -> list[int]:
    """Total-row points to calibrate at: 1, 2, 4, 8, ... up to ``max_rows`` (always included)."""
    grid, r = [], 1
    while r < max_rows:
        grid.append(r)
        r *= 2
    grid.append(max_rows)
    return sorted(set(grid))


def _sync() -> None:
    """Wait for queued CUDA work (a calibration times passes, not their launches); nothing on a CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], None]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t0) * 1000.0


def calibrate(
    run_verify: Callable[[int, int], None],
    run_draft: Callable[[int], None],
    row_grid: Iterable[tuple[int, int]],
    batch_grid: Iterable[int],
    repeats: int = 7,
    key: str = "",
    smooth: bool = False,
) -> CostModel:
    """Measure a cost model. ``run_verify(rows, batch)`` runs one target pass of ``rows`` rows for each of
    ``batch`` requests; ``run_draft(batch)`` one drafter pass. ``row_grid``: (rows, batch) pairs, their products
    being the curve's points. Every point is timed once per sweep over the grid, ``repeats`` sweeps after a
    warm-up one, and keeps its fastest time: a busy spell on a shared machine hits one sweep, not one point, and
    the curves keep the machine's unloaded shape (the online ``scale`` follows its load). On the demo (2 busy
    cores) the fastest passes predicted the fixed tree's round at 2.39 AR steps where rounds measured 2.26-2.46;
    the medians of the same sweeps said 2.55 (a noisy sweep bends their shape). ``smooth``: one request's curve
    (the embedded engine) is smoothed beyond its first point (:func:`_smooth_rows`)."""
    grid, batches = list(row_grid), list(batch_grid)
    best: dict[int, float] = {}
    dbest: dict[int, float] = {}
    for sweep in range(repeats + 1):
        for rows, batch in grid:
            ms = _time_ms(lambda: run_verify(rows, batch))
            if sweep:
                best[rows * batch] = min(best.get(rows * batch, math.inf), ms)
        for batch in batches:
            ms = _time_ms(lambda: run_draft(batch))
            if sweep:
                dbest[batch] = min(dbest.get(batch, math.inf), ms)
    xs = sorted(best)
    ys = [best[x] for x in xs]
    ys = _smooth_rows(xs, ys) if smooth else _non_decreasing(ys)
    bs = sorted(dbest)
    return CostModel(xs, ys, bs, [dbest[b] for b in bs], 0.0, key)


CALIBRATION_VERSION = 6  # bumped when calibrate() measures differently: older cached calibrations are not reused


def _non_decreasing(ys: list[float]) -> list[float]:
    """A pass over more rows never costs less (noise aside)."""
    out = list(ys)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1])
    return out


def _smooth_rows(xs: list[int], ys: list[float]) -> list[float]:
    """One request's calibrated pass times by rows, smoothed: beyond one row (the AR step, kept as measured) a
    least-squares line through the points, since one noisy point otherwise bends the per-row slope the tree-size
    choice weighs (fastest-of-5 ratios of the 16-row pass to the AR step ranged 1.23-1.46 on one idle machine);
    then non-decreasing. Not for batches, whose curves are not lines over hundreds of rows."""
    out = list(ys)
    pts = [(x, y) for x, y in zip(xs, ys) if x > 1]
    if len(pts) >= 3:
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        var = sum((x - mx) ** 2 for x, _ in pts)
        slope = max(sum((x - mx) * (y - my) for x, y in pts) / var, 0.0) if var > 0 else 0.0
        out = [y if x <= 1 else my + slope * (x - mx) for x, y in zip(xs, ys)]
    return _non_decreasing(out)


def cost_key(*parts: object) -> str:
    """A short stable key for a (device, model, threads, ...) combination (and the calibration method)."""
    return hashlib.sha256(json.dumps([CALIBRATION_VERSION, *[str(p) for p in parts]]).encode()).hexdigest()[:16]


def cost_cache_dir() -> Path | None:
    """Where calibrations are cached: ``$GLANCE_COST_CACHE`` (``off`` disables), else ~/.cache/glance_sgl/costs."""
    env = os.environ.get("GLANCE_COST_CACHE")
    if env is not None and env.strip().lower() in ("", "0", "off", "none"):
        return None
    return Path(env) if env else Path.home() / ".cache" / "glance_sgl" / "costs"


def load_costs(key: str) -> CostModel | None:
    directory = cost_cache_dir()
    if directory is None:
        return None
    path = directory / f"{key}.json"
    try:
        model = CostModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return model if model.key == key else None


def save_costs(model: CostModel) -> Path | None:
    directory = cost_cache_dir()
    if directory is None or not model.key:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{model.key}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(model.to_dict()))
        tmp.replace(path)
        return path
    except OSError:
        return None  # a read-only home is not an error: calibration just runs again next start


__all__ = ["CostModel", "calibrate", "cost_key", "cost_cache_dir", "load_costs", "save_costs", "default_row_grid",
           "CALIBRATION_VERSION"]
