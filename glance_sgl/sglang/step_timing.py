"""Where any SGLang engine's scheduler spends a step, for side-by-side benchmarks (``GLANCE_SGL_STEP_TIMING=1``).

SGLang's scheduler runs every batch through ``Scheduler.run_batch``: the speculative worker's whole step (its
drafting or lookups, the target's pass, the walk and its bookkeeping) or the plain model step without
speculation. The target model's forward is ``TpModelWorker.forward_batch_generation`` inside it (once per step
for NGRAM and for GLANCE, whose drafter passes run outside it). With the setting on, two AROUND hooks (SGLang's
``HookRegistry``) time both, whatever the algorithm (none, NGRAM, GLANCE, DFLASH), and the scheduler's internal
state (``/get_server_info``'s ``internal_states``, one per scheduler) carries the sums under
:data:`STEP_TIMING_KEY`: per kind of batch (``decode``: a decode or verify step; ``prefill``: an extend batch),
``steps``, ``requests`` (summed batch sizes), ``rows`` (the input rows of the target's forwards: a verify pass's
rows for every request, padding included), ``step_ms`` (wall ms of ``run_batch``) and ``forward_ms`` (of the
target's forwards in it); for decode steps that follow a decode step also ``gaps`` and ``gap_ms``: the wall ms from
the previous step's ``run_batch`` to this one's, where the scheduler processes the previous step's results
(SGLang's speculative result handling, the detokenizer's queue) and builds the next batch (its KV reservation).
``python -m glance_sgl.sglang.bench --step-stats`` reads them before and after every measured chunk.

The wall time of ``run_batch`` is the step's only where the scheduler runs synchronously (SGLang's CPU default);
under the overlap scheduler it is the launch. The time between steps is not in it: that is ``gap_ms``.
"""

from __future__ import annotations

import time
from typing import Any

STEP_TIMING_KEY = "glance_step_timing"
_RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
_FORWARD = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"

_sums: dict[str, dict[str, float]] = {}  # this scheduler process's sums, per batch kind
_installed = False  # register_step_timing ran in this process
_forward_ms = 0.0  # the target's forwards inside the running run_batch: their wall ms ...
_forward_rows = 0  # ... and their input rows
_last: tuple[str | None, float] | None = None  # the previous run_batch's batch kind and when it returned


def batch_kind(batch: Any) -> str | None:
    """``prefill`` (an extend batch, mixed ones included), ``decode`` (a decode or verify step) or None (an idle
    batch, or none)."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not getattr(batch, "reqs", None):
        return None
    if mode.is_extend():
        return "prefill"
    return "decode" if mode.is_decode() or mode.is_target_verify() else None


def _time_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    global _forward_ms, _forward_rows, _last
    kind = batch_kind(batch)
    _forward_ms, _forward_rows = 0.0, 0
    t0 = time.perf_counter()
    result = original(scheduler, batch, *args, **kwargs)
    t1 = time.perf_counter()
    if kind is not None:
        s = _sums.setdefault(kind, {"steps": 0, "requests": 0, "rows": 0, "step_ms": 0.0, "forward_ms": 0.0})
        s["steps"] += 1
        s["requests"] += len(batch.reqs)
        s["rows"] += _forward_rows
        s["step_ms"] += 1000.0 * (t1 - t0)
        s["forward_ms"] += _forward_ms
        if kind == "decode" and _last is not None and _last[0] == "decode":
            s["gaps"] = s.get("gaps", 0) + 1
            s["gap_ms"] = s.get("gap_ms", 0.0) + 1000.0 * (t0 - _last[1])
    _last = (kind, t1)
    return result


def _time_forward(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``TpModelWorker.forward_batch_generation(self, batch, forward_batch=None, ...)``: its wall ms and input rows
    (the schedule batch's ``input_ids``, else the forward batch's; metadata, no device read)."""
    global _forward_ms, _forward_rows
    batch = args[1] if len(args) > 1 else kwargs.get("batch")
    if batch is None:
        batch = args[2] if len(args) > 2 else kwargs.get("forward_batch")
    ids = getattr(batch, "input_ids", None)
    _forward_rows += int(ids.numel()) if ids is not None else 0
    t0 = time.perf_counter()
    try:
        return original(*args, **kwargs)
    finally:
        _forward_ms += 1000.0 * (time.perf_counter() - t0)


def step_timing() -> dict[str, dict[str, float]] | None:
    """This scheduler process's sums so far (a copy), or None where the hooks are not installed."""
    return {kind: dict(s) for kind, s in _sums.items()} if _installed else None


def register_step_timing() -> None:
    """Register the two timing hooks with SGLang's HookRegistry (idempotent). The plugin calls it at load where
    ``GLANCE_SGL_STEP_TIMING`` is on, before any of its hooks are applied (HookRegistry patches a target once)."""
    global _installed
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in ((_RUN_BATCH, _time_run_batch), (_FORWARD, _time_forward)):
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, HookType.AROUND)
    _installed = True


STEP_HEAD = ["scenario", "method", "decode steps", "requests / step", "rows / request", "ms / step",
             "target forward", "us / row", "other", "between steps", "step / none's", "prefill ms / request"]


def step_table(methods: list[dict[str, Any]], label: Any = str) -> list[list[str]]:
    """Rows of :data:`STEP_HEAD` from a benchmark's method rows (each ``{"method", "scenarios": {name:
    {"step_timing": sums}}}``; ``label(method)`` names a method): per scenario and method, its decode steps,
    their mean batch and rows verified per request (padding included), mean wall ms (the target's forward and its
    us per row, the rest: drafting, lookups, the step's host work), the scheduler's ms between two decode steps
    (``gap_ms``), that step against no speculation's in the same scenario (what one step costs in plain decode
    steps), and the prefill's wall ms per request. Empty without any timing."""
    base = next((m for m in methods if m["method"] == "none"), None)
    names = list(dict.fromkeys(n for m in methods for n, sc in m["scenarios"].items() if sc.get("step_timing")))
    out = []
    for name in names:
        b = ((base or {}).get("scenarios", {}).get(name) or {}).get("step_timing", {}).get("decode")
        b_ms = b["step_ms"] / b["steps"] if b and b.get("steps") else None
        first = True
        for m in methods:
            t = (m["scenarios"].get(name) or {}).get("step_timing")
            if not t:
                continue
            d, p = t.get("decode") or {}, t.get("prefill") or {}
            n = d.get("steps", 0)
            ms = d["step_ms"] / n if n else None
            fwd = d["forward_ms"] / n if n else None
            rows = d.get("rows", 0)
            cells = [name if first else "", label(m["method"]), str(int(n)), _fmt(d["requests"] / n if n else None, 1),
                     _fmt(rows / d["requests"] if rows and d.get("requests") else None, 1), _fmt(ms), _fmt(fwd),
                     _fmt(1000.0 * d["forward_ms"] / rows if rows else None, 0), _fmt(ms - fwd if n else None),
                     _fmt(d["gap_ms"] / d["gaps"] if d.get("gaps") else None),
                     _fmt(ms / b_ms if ms and b_ms else None),
                     _fmt(p["step_ms"] / p["requests"] if p.get("requests") else None)]
            out.append(cells)
            first = False
    return out


GAP_HEAD = ["scenario", "method", "decode rate over NGRAM's", "at NGRAM's host time", "host ms / step",
            "NGRAM's host ms / step"]


def _decode_rate(scenario: dict[str, Any], outside_ms: float | None = None) -> tuple[float, float] | None:
    """(tokens per ms of decode steps: tau x requests per step / ms per step, the ms per step outside the target
    forward) of a scenario row with ``tau`` and ``step_timing``; ``outside_ms``: the rate with that in place of its
    own. None without them."""
    d = (scenario.get("step_timing") or {}).get("decode") or {}
    n, tau = d.get("steps"), scenario.get("tau")
    if not n or not tau or not d.get("requests"):
        return None
    fwd, ms = d["forward_ms"] / n, d["step_ms"] / n
    rest = ms - fwd
    return tau * d["requests"] / n / (fwd + (rest if outside_ms is None else outside_ms)), rest


def gap_table(methods: list[dict[str, Any]], label: Any = str, reference: str = "ngram") -> list[list[str]]:
    """Rows of :data:`GAP_HEAD`: where each method's decode steps stand against ``reference``'s (SGLang's NGRAM),
    per scenario: the tokens per ms of its decode steps (tau x requests per step / ms per step) over the
    reference's; the same with its own target forward but the reference's time outside the forward per step (its
    lookups, verify input, walk, KV move and bookkeeping; a drafter's passes), i.e. what host parity would give;
    and both times outside the forward. The reference, no speculation, a method that never drafted in the
    scenario (tau 1) and rows without ``tau`` or step timing give none."""
    ref = next((m for m in methods if m["method"] == reference), None)
    if ref is None:
        return []
    out = []
    for name, ref_sc in ref["scenarios"].items():
        base = _decode_rate(ref_sc)
        if base is None:
            continue
        first = True
        for m in methods:
            if m["method"] in (reference, "none") or m.get("error"):
                continue
            sc = m["scenarios"].get(name) or {}
            own = _decode_rate(sc)
            if own is None or sc["tau"] <= 1.0:  # never drafted here: plain decode steps, nothing to compare
                continue
            parity = _decode_rate(sc, outside_ms=base[1])
            out.append([name if first else "", label(m["method"]), _fmt(own[0] / base[0]), _fmt(parity[0] / base[0]),
                        _fmt(own[1]), _fmt(base[1])])
            first = False
    return out


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


__all__ = ["GAP_HEAD", "STEP_HEAD", "STEP_TIMING_KEY", "batch_kind", "gap_table", "register_step_timing",
           "step_table", "step_timing"]
