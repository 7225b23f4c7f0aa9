"""Benchmark through SGLang on this machine: GLANCE (auto / fixed / off planner) vs no speculation vs SGLang's
NGRAM and DFLASH.

    python -m glance_sgl.sglang.bench [--model DIR --drafter DIR] [--prompts 32] [--max-tokens 64]
        [--methods none,ngram,dflash,glance,glance-fixed,glance-off,glance+ngram,glance-ngram,glance-drafter]
        [--concurrency 1,4,16]
        [--wild 16] [--wild-concurrency 1,8] [--interleave [--engine-runs N]] [--overlap on|off] [--step-stats]
        [--count-host-reads]
        [--log-dir DIR] [--json FILE]

``glance`` is GLANCE as it ships (auto planner, the n-gram source's candidates merged into the drafter's tree:
``GLANCE_DRAFT_SOURCES=drafter,ngram``, the worker's default; ``glance+ngram`` says so explicitly);
``glance-drafter`` is the drafter alone; ``glance-ngram`` the n-gram source alone (no drafter pass: SGLang's
``NgramCorpus`` as NGRAM uses it, GLANCE's tree, planner and walk); ``glance-fixed`` the drafter's full tree every
step; ``glance-off`` is GLANCE with drafting forced off (``GLANCE_PLANNER=off``:
every step an AR step through the speculative worker, the "never hurts" cost against ``none``). ``dflash`` is
SGLang's own DFLASH loading the GLANCE drafter unchanged (our checkpoints are DFlash checkpoints: the same weights,
chain verification, SGLang's implementation), with ``speculative_num_draft_tokens`` = the drafter's ``block_size``;
SGLang runs DFLASH on CUDA / NPU / XPU only (:data:`DFLASH_CPU_REASON`): on the CPU the method fails at once with
that reason and the other methods still run. ``--overlap on`` / ``off`` starts the speculative engines (GLANCE,
DFLASH, NGRAM) with SGLang's overlap scheduler on / off (``disable_overlap_schedule``; default: the engine's own
choice, on the CPU off); an engine that refuses is reported as failed, the others still run. A method name with
``@overlap`` or ``@sync`` (``glance@overlap``, ``ngram@sync``) sets it for that method alone, so that both modes run
side by side in one interleaved run.

Before / after: a method name with ``#REV`` (``glance#e506600``) runs that method's engine on the ``glance_sgl``
package of commit ``REV`` of this checkout (``runner.export_package``: ``git archive`` into a temporary folder, the
child engine's working directory and ``PYTHONPATH``), beside this checkout's own methods in the same run: with
``--interleave``, ``--methods none,ngram,glance,glance#REV`` measures a change through SGLang in one interleaved
harness, chunk by chunk.

``--step-stats`` (with ``--log-dir``) logs every GLANCE step (``GLANCE_SGL_PROFILE=1``, a small cost for the GLANCE
methods alike) and adds the mean rows verified per request and step to the table (NGRAM verifies
``--ngram-draft-tokens`` rows, DFLASH its block size, no speculation 1), and, per GLANCE method and step kind, the
mean wall ms per step of each part of its round, per scenario (``host_ms_per_step`` of each scenario: the engine's
step parts read from SGLang's internal state before and after each measured chunk, ``STEP_PARTS_KEY``) and over the
engine's life (the method's ``host_ms_per_step``: the worker's last ``GLANCE host ms per step`` log line, warm-up
included; with ``--engine-runs`` the last run's engine); printed one line per step kind: where a step's time goes.
It also times every engine's scheduler steps, whatever the method (``GLANCE_SGL_STEP_TIMING=1``,
:mod:`glance_sgl.sglang.step_timing`): per scenario, each method's decode steps, their mean batch and rows per
request, their mean wall ms (the target's forward, its us per row, and the rest), the scheduler's ms between two
decode steps, that step against no speculation's step in the same scenario (a step's cost in plain decode steps,
NGRAM's included) and the prefill's ms per request, read around each measured chunk (``step_timing`` of each
scenario in the JSON).
``--count-host-reads`` (with ``--log-dir``) has the GLANCE worker count its device-to-host reads per decode step
(``GLANCE_SGL_COUNT_HOST_READS=1``, a cost: do not read its speeds) and reports the max / mean per step, overall and
by (batch size, rows verified per request).

A method whose engine fails (start-up refused, crash) is reported with its error, one line, and the rest run; the
exit status is then 1. With ``--json`` the report is rewritten after every method, so that a run cut short keeps
what finished.

The same harness for every method, each method in a fresh engine in its own process (``runner.EngineProcess``),
one method after the other, or with ``--interleave`` all engines alive at once and each scenario's request chunks
run by every method in a rotating order (robust to a busy shared machine); every engine is warmed up at every
concurrency level first (the auto planner calibrates its cost model on the first batches of
each size, or loads its cached calibration) with requests that are never measured (other demo prompts, other
wild pictures: no n-gram corpus holds the start of a measured answer). Scenarios:

- ``demo c=K``: the demo evaluation prompts (images included) with K requests in flight (a new one starts when
  one finishes); output tokens/s = completion tokens / wall time (prefill included);
- ``demo c=1`` also gives the decode speedup: decode time per request = latency of the full request minus
  latency of the same request with ``max_new_tokens=1``; decode tokens/s = (completion - 1) / that;
- ``wild c=K``: noise and photo-like images of other sizes with generic prompts (``runner.wild_requests``).

``--repeat N`` runs every scenario but the first of each kind (``demo c=1``, ``wild c=1``: the requests seen for the
first time) N times, chunk by chunk, and pools the runs: the later scenarios replay answers every corpus holds
already, so more runs of them measure the same thing with less noise (a scenario of 32 requests at 16 in flight is
two chunks of about 0.3 s each). ``--engine-runs N`` (with ``--interleave``) runs all of that N times, every engine
started afresh each time, and pools the runs: two engine processes running the same code can differ by 5-10 % for
their whole lives on a CPU, more than the differences between methods worth measuring. Each run's rate is kept
too (``runs_tokens_per_s``), and every method's rate over NGRAM's is printed pooled and run by run, with the runs'
range (:func:`run_spread`): how far a single engine run strays from the pool.

tau = (completion - 1) / verify steps, pooled (design §1; an AR step of the planner counts as a verify step of
accept length 1). Outputs are compared token for token with the no-speculation run. ``--device cuda`` runs the
same on a GPU (FlashInfer).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..cli import int_in
from ..metrics import add_ms, ms_per_step
from .plugin import STEP_PARTS_KEY
from .step_timing import GAP_HEAD, STEP_HEAD, STEP_TIMING_KEY, gap_table, step_table
from .runner import EngineProcess, cpu_engine_kwargs, demo_requests, export_package, wild_requests

METHODS = ("none", "ngram", "dflash", "glance", "glance-fixed", "glance-off", "glance+ngram", "glance-ngram",
           "glance-drafter")
GLANCE_METHODS = ("glance", "glance-fixed", "glance-off", "glance+ngram", "glance-ngram", "glance-drafter")
ALGORITHMS = {"none": None, "ngram": "NGRAM", "dflash": "DFLASH", **{m: "GLANCE" for m in GLANCE_METHODS}}
PLANNERS = {"glance": "auto", "glance-fixed": "fixed", "glance-off": "off", "glance+ngram": "auto",
            "glance-ngram": "auto", "glance-drafter": "auto"}
# GLANCE_DRAFT_SOURCES of a method (the others: the worker's default, drafter + n-gram merged)
SOURCES = {"glance+ngram": "drafter,ngram", "glance-ngram": "ngram", "glance-drafter": "drafter",
           "glance-fixed": "drafter"}
OVERLAP_SUFFIXES = {"overlap": "on", "sync": "off"}


def method_parts(method: str) -> tuple[str, str | None]:
    """``"glance+ngram@overlap"`` -> ``("glance+ngram", "on")``: the method and its own overlap setting ("on" /
    "off", None: the run's ``--overlap``; a ``#REV`` tail, :func:`method_commit`, is not part of either).
    ValueError on an unknown method or suffix."""
    base, at, suffix = method.partition("#")[0].partition("@")
    if base not in METHODS or (at and suffix not in OVERLAP_SUFFIXES):
        raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}, optionally with "
                         f"@{' or @'.join(OVERLAP_SUFFIXES)}")
    return base, OVERLAP_SUFFIXES.get(suffix)

def method_commit(method: str) -> str | None:
    """``"glance#e506600"`` -> ``"e506600"``: the commit whose ``glance_sgl`` runs the method's engine (None: this
    checkout's). ValueError on an empty one."""
    _, hash_, rev = method.partition("#")
    if hash_ and not rev.strip():
        raise ValueError(f"method {method!r}: give a commit after '#'")
    return rev.strip() or None


# Why SGLang 0.5.23 cannot run DFLASH on a CPU: the first check its server arguments meet. On an in-tree platform
# (the CPU is one) ``_handle_dflash`` accepts only devices starting with "cuda", "npu" or "xpu" and raises
# otherwise; the CPU engine never reaches the worker. Past that check the worker itself is CUDA-bound too
# (``dflash_worker_v2.py``: ``torch.cuda.synchronize`` / ``torch.cuda.memory_stats`` in its memory probe, the
# fused KV materialisation and verify kernels behind ``is_cuda() or is_hip() or is_xpu()``).
DFLASH_CPU_REASON = ("SGLang's DFLASH does not run on a CPU: sglang/srt/arg_groups/speculative_hook.py:291-301 "
                     "(_handle_dflash) accepts only device cuda*, npu or xpu on an in-tree platform and raises "
                     "ValueError(\"DFLASH speculative decoding is not supported by SRTPlatform on device 'cpu'.\"); "
                     "run it with --device cuda")
NGRAM_SAMPLING_CPU_REASON = (
    "SGLang's NGRAM cannot sample on a CPU: at T > 0 its verify (sglang/srt/speculative/eagle_utils.py, eagle_sample) "
    "calls tree_speculative_sampling_target_only, which sglang/kernels/ops/speculative/verify_sampling.py sets to "
    "None off CUDA and MUSA (the scheduler dies with TypeError: 'NoneType' object is not callable); run it greedy "
    "or with --device cuda")


def drafter_block_size(drafter: Path) -> int:
    """The drafter's block size as SGLang's DFLASH reads it (``dflash_config.block_size``, else the top-level
    ``block_size``; 16 when neither is set, SGLang's default)."""
    cfg = json.loads((Path(drafter) / "config.json").read_text())
    raw = (cfg.get("dflash_config") or {}).get("block_size", cfg.get("block_size"))
    return int(raw) if raw is not None else 16


def dflash_preflight(model: Path, drafter: Path) -> list[str]:
    """What SGLang 0.5.23's DFLASH will object to in this target / drafter pair, read from the config files and
    SGLang's source without starting it (empty: nothing found). Warnings, not a verdict: a plugin may patch the
    target class at run time."""

    problems: list[str] = []
    d = json.loads((Path(drafter) / "config.json").read_text())
    t = json.loads((Path(model) / "config.json").read_text())
    tt = t.get("text_config", t)
    dc = d.get("dflash_config") or {}
    if "DFlashDraftModel" not in (d.get("architectures") or []):
        problems.append(f"drafter architectures {d.get('architectures')}: DFLASH loads DFlashDraftModel")
    n_target = int(tt.get("num_hidden_layers", 0))
    ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
    if ids is None:
        problems.append("drafter config names no dflash_config.target_layer_ids: SGLang would pick its own layers")
    elif any(not 0 <= int(i) < n_target - 1 for i in ids):
        problems.append(f"target_layer_ids {ids} outside 0..{n_target - 2} (the target has {n_target} layers; "
                        "the last one cannot be captured)")
    if d.get("num_target_layers") not in (None, n_target):
        problems.append(f"num_target_layers {d.get('num_target_layers')} != the target's {n_target} layers")
    for key in ("hidden_size", "vocab_size"):
        if d.get(key) != tt.get(key, t.get(key)):
            problems.append(f"drafter {key} {d.get(key)} != target {tt.get(key, t.get(key))} (DFLASH shares the "
                            "target's embedding and LM head)")
    if dc.get("mask_token_id", d.get("mask_token_id")) is None:
        problems.append("no dflash_config.mask_token_id: DFLASH then looks up or adds the token '<|MASK|>'")
    return problems


def engine_kwargs(method: str, model: Path, drafter: Path, device: str, ngram_tokens: int,
                  glance_tokens: int | None = None, cuda_graphs: bool = True, overlap: str | None = None
                  ) -> dict[str, Any]:
    """``sglang.Engine`` arguments of a method; ``overlap`` ("on" / "off" / None: the engine's default) sets
    ``disable_overlap_schedule`` of the speculative engines (on the CPU it overrides the CPU mode's "off"); a
    method's own ``@overlap`` / ``@sync`` wins."""
    method, own = method_parts(method)
    overlap = own or overlap
    algo = ALGORITHMS[method]
    if device == "cpu":
        kw = cpu_engine_kwargs(model, drafter, algorithm=algo)
    else:
        kw = dict(model_path=str(model), dtype="bfloat16", log_level="warning", random_seed=0,
                  mem_fraction_static=0.5, disable_cuda_graph=not cuda_graphs)
        if algo is not None:
            kw.update(speculative_algorithm=algo)
    if algo in ("GLANCE", "DFLASH"):
        kw["speculative_draft_model_path"] = str(drafter)
    if algo == "NGRAM":
        kw["speculative_num_draft_tokens"] = ngram_tokens
    if algo == "GLANCE" and glance_tokens:
        kw["speculative_num_draft_tokens"] = glance_tokens
    if algo == "DFLASH":
        kw["speculative_num_draft_tokens"] = drafter_block_size(drafter)
    if algo is not None and overlap is not None:
        kw["disable_overlap_schedule"] = overlap == "off"
    return kw


def engine_env(method: str, step_stats: bool = False, count_host_reads: bool = False, overlap: str | None = None
               ) -> dict[str, str]:
    """The planner of a GLANCE method (``GLANCE_PLANNER``; see glance_sgl/sglang/planning.py), its candidate
    sources (``GLANCE_DRAFT_SOURCES``) and, with ``step_stats``, its per-step log (``GLANCE_SGL_PROFILE``) and every
    method's step timing (``GLANCE_SGL_STEP_TIMING``), with
    ``count_host_reads`` its host-read count per step (``GLANCE_SGL_COUNT_HOST_READS``); with the overlap scheduler
    asked for (``overlap`` or the method's ``@overlap``), ``GLANCE_SGL_CPU_OVERLAP=1`` (on a CPU GLANCE turns it
    off otherwise)."""
    method, own = method_parts(method)
    timing = {"GLANCE_SGL_STEP_TIMING": "1"} if step_stats else {}  # every engine's steps, side by side
    if method not in GLANCE_METHODS:
        return timing
    env = {"GLANCE_PLANNER": PLANNERS[method], **timing}
    if (own or overlap) == "on":
        env["GLANCE_SGL_CPU_OVERLAP"] = "1"
    if method in SOURCES:
        env["GLANCE_DRAFT_SOURCES"] = SOURCES[method]
    if step_stats:
        env["GLANCE_SGL_PROFILE"] = "1"
    if count_host_reads:
        env["GLANCE_SGL_COUNT_HOST_READS"] = "1"
    return env


def method_unavailable(method: str, device: str, temperature: float = 0.0) -> str | None:
    """Why ``method`` cannot run on ``device`` (at ``temperature``) at all (None: try it)."""
    name = method_parts(method)[0]
    if name == "dflash" and device == "cpu":
        return DFLASH_CPU_REASON
    if name == "ngram" and device == "cpu" and temperature > 0.0:
        return NGRAM_SAMPLING_CPU_REASON
    return None


_ERROR = re.compile(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$", re.M)


def error_line(exc: BaseException) -> str:
    """One line for a method that failed: the last ``SomethingError: message`` in the engine's log tail (what
    SGLang raised), else the exception itself."""
    text = str(exc)
    found = _ERROR.findall(text)
    if found:
        kind, msg = found[-1]
        return f"{kind}: {msg.strip()}"[:500]
    return f"{type(exc).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"[:500]


def failed_row(method: str, exc: BaseException | str) -> dict[str, Any]:
    if isinstance(exc, str):
        return {"method": method, "error": exc, "scenarios": {}}
    return {"method": method, "error": error_line(exc), "error_tail": str(exc)[-3000:], "scenarios": {}}


_STEP = re.compile(r"GLANCE step bs=(\d+) .*? target\[([\d.]+)\]")
_PHASES = re.compile(r"GLANCE host ms per step by kind: (\{[^\n]*\})")
_HOST_READS = re.compile(r"GLANCE host reads bs=(\d+) rows=(\d+): (\d+) (\{[^\n]*\})?")


def host_reads(log: Path) -> dict[str, Any] | None:
    """Device-to-host reads per decode step from a GLANCE engine's log (``GLANCE_SGL_COUNT_HOST_READS=1``: lines
    ``GLANCE host reads bs=B rows=R: N {method: count}``; warm-up included): steps counted, max and mean reads per
    step, overall, by ``bs=B ar`` / ``bs=B tree`` (rows verified per request <= 1: an AR step, else a tree
    verify) and by ``bs=B rows=R``, and the reads by tensor method summed over all steps. None: no log or no such
    line."""
    import ast
    from collections import Counter

    if not log.is_file():
        return None
    per: dict[str, list[int]] = {}
    calls: Counter[str] = Counter()
    every: list[int] = []
    for m in _HOST_READS.finditer(log.read_text(errors="replace")):
        n = int(m.group(3))
        every.append(n)
        per.setdefault(f"bs={m.group(1)} rows={m.group(2)}", []).append(n)
        if m.group(4):
            try:
                calls.update({str(k): int(v) for k, v in ast.literal_eval(m.group(4)).items()})
            except (ValueError, SyntaxError, AttributeError):
                pass
    if not every:
        return None

    def stats(xs: list[int]) -> dict[str, Any]:
        return {"steps": len(xs), "max": max(xs), "mean": round(sum(xs) / len(xs), 3)}

    kinds: dict[str, list[int]] = {}
    for k, xs in per.items():  # rows <= 1: an AR step (the planner off or choosing no draft), else a tree verify
        bs, rows = (int(x.split("=")[1]) for x in k.split())
        kinds.setdefault(f"bs={bs} {'ar' if rows <= 1 else 'tree'}", []).extend(xs)
    key = lambda k: tuple(int(x.split("=")[1]) for x in k.split())  # noqa: E731
    kind_key = lambda k: (int(k.split()[0].split("=")[1]), k.split()[1])  # noqa: E731
    return {**stats(every), "by_kind": {k: stats(kinds[k]) for k in sorted(kinds, key=kind_key)},
            "by_shape": {k: stats(per[k]) for k in sorted(per, key=key)}, "calls": dict(sorted(calls.items()))}


def host_ms_per_step(log: Path) -> dict[str, dict[str, float]] | None:
    """The last ``GLANCE host ms per step by kind`` line of a GLANCE engine's profile log (``StepStats``): per step
    kind its steps and the mean ms of each part of the round. None: no log or no such line."""
    import ast

    if not log.is_file():
        return None
    found = _PHASES.findall(log.read_text(errors="replace"))
    try:
        return ast.literal_eval(found[-1]) if found else None
    except (ValueError, SyntaxError):
        return None


def rows_per_step(log: Path) -> float | None:
    """Mean rows verified per request and decode step in a GLANCE engine's profile log (warm-up included)."""
    if not log.is_file():
        return None
    rows = [float(m.group(2)) for m in _STEP.finditer(log.read_text(errors="replace"))]
    return sum(rows) / len(rows) if rows else None


def step_parts(eng: EngineProcess, key: str = STEP_PARTS_KEY) -> dict[str, dict[str, float]] | None:
    """A profiling GLANCE engine's step parts so far (SGLang's internal state, ``STEP_PARTS_KEY``: per step kind,
    steps and ms summed), or with ``key=STEP_TIMING_KEY`` any engine's step timing
    (:mod:`glance_sgl.sglang.step_timing`); None where it has none."""
    states = eng.info().get("internal_states") or []
    return (states[0] or {}).get(key) if states else None


def parts_between(before: dict[str, dict[str, float]] | None, after: dict[str, dict[str, float]] | None
                  ) -> dict[str, dict[str, float]]:
    """The step parts (or timing) of the steps between two :func:`step_parts` readings (kinds without a step left
    out)."""
    out = {}
    for kind, parts in (after or {}).items():
        old = (before or {}).get(kind, {})
        diff = {k: v - old.get(k, 0.0) for k, v in parts.items()}
        if diff.get("steps", 0) > 0:
            out[kind] = diff
    return out


def _measure(eng: EngineProcess, reqs: list[dict[str, Any]], c: int, decode: bool, parts: bool = False,
             timing: bool = False) -> dict[str, Any]:
    """One engine on ``reqs`` with ``c`` in flight: sums to pool (``decode``: also the max_tokens=1 latencies;
    ``parts``: the step parts of its steps, ``timing``: its step timing, each read from the engine before and
    after, outside the timed span)."""
    one = eng.generate([{**r, "max_tokens": 1} for r in reqs])["results"] if decode else None
    before = step_parts(eng) if parts else None
    clock = step_parts(eng, STEP_TIMING_KEY) if timing else None
    t0 = time.perf_counter()
    res = eng.generate(reqs, concurrency=c)["results"]
    part = {"wall_s": time.perf_counter() - t0, "outputs": [r["output_ids"] for r in res],
            "tokens": sum(r["meta_info"]["completion_tokens"] for r in res),
            "verify": sum(r["meta_info"].get("spec_verify_ct") or 0 for r in res),
            "spec_tokens": sum(r["meta_info"]["completion_tokens"] - 1 for r in res
                               if r["meta_info"].get("spec_verify_ct"))}
    if decode:
        part["decode_s"] = sum(max(f["meta_info"]["e2e_latency"] - o["meta_info"]["e2e_latency"], 0.0)
                               for o, f in zip(one, res))
        part["decode_tokens"] = sum(max(f["meta_info"]["completion_tokens"] - 1, 0) for f in res)
    if parts:
        part["step_parts"] = parts_between(before, step_parts(eng))
    if timing:
        part["step_timing"] = parts_between(clock, step_parts(eng, STEP_TIMING_KEY))
    return part


def sum_parts(sums: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per step kind, every field summed over several :func:`parts_between` (step parts or step timing)."""
    total: dict[str, dict[str, float]] = {}
    for one in sums:
        for kind, parts in one.items():
            add_ms(total.setdefault(kind, {}), parts)
    return total


def mean_parts(sums: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per step kind, the steps and the mean ms per step of each part, over several :func:`parts_between`."""
    return ms_per_step(sum_parts(sums))


def _pool(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A scenario's row from its measured parts (pooled sums)."""
    tot = {k: sum(p[k] for p in parts) for k in parts[0] if k not in ("outputs", "step_parts", "step_timing")}
    row = {"tokens": tot["tokens"], "wall_s": tot["wall_s"],
           "tokens_per_s": tot["tokens"] / tot["wall_s"] if tot["wall_s"] > 0 else float("nan"),
           "tau": tot["spec_tokens"] / tot["verify"] if tot["verify"] else 1.0,
           "outputs": [o for p in parts for o in p["outputs"]]}
    if "decode_s" in tot:
        row["decode_tokens_per_s"] = tot["decode_tokens"] / tot["decode_s"] if tot["decode_s"] > 0 else float("nan")
    if "step_parts" in parts[0]:
        row["host_ms_per_step"] = mean_parts([p["step_parts"] for p in parts])
    if "step_timing" in parts[0]:
        row["step_timing"] = sum_parts([p["step_timing"] for p in parts])
    return row


Warm = list[tuple[list[dict[str, Any]], int]]  # (requests, requests in flight) an engine runs before measuring


def warm_up_requests(model: Path, scenarios: dict[str, tuple[list[dict[str, Any]], int]], prompts: int,
                     max_tokens: int) -> Warm:
    """What every engine runs first, at every level of ``scenarios`` (2 x in flight, short answers): the auto
    planner calibrates there, not in the runs. Requests of the same kinds that are never measured (demo: the
    evaluation prompts after the first ``prompts``; wild: other pictures), so that no corpus (NGRAM's, GLANCE's
    n-gram source) holds the start of a measured answer before its run."""
    from glance_sgl.demo.tasks import TASKS, eval_set

    widest = max((c for _, c in scenarios.values()), default=1)
    other = wild_requests(model, 2 * widest, max_tokens, seed=1)
    room = min(len(eval_set(t)) for t in TASKS) * len(TASKS) - prompts  # evaluation prompts never measured
    spare = demo_requests(model, prompts + 2 * widest, max_tokens)[0][prompts:] if room >= 2 * widest else other
    return [((spare if name.startswith("demo") else other)[: 2 * c], c) for name, (_, c) in scenarios.items()]


def replay_repeats(scenarios: dict[str, tuple[list[dict[str, Any]], int]], repeat: int) -> dict[str, int]:
    """Runs per scenario for ``--repeat``: the first scenario of each kind (``demo``, ``wild``: its requests seen for
    the first time) once, every later one (replaying answers seen before) ``repeat`` times."""
    seen: set[str] = set()
    out = {}
    for name in scenarios:
        kind = name.split()[0]
        out[name] = repeat if kind in seen else 1
        seen.add(kind)
    return out


def _warm_up(eng: EngineProcess, warm: Warm) -> None:
    for reqs, c in warm:
        eng.generate([{**r, "max_tokens": 16} for r in reqs], concurrency=c)


def run_method(method: str, kwargs: dict[str, Any], scenarios: dict[str, tuple[list[dict[str, Any]], int]],
               log_dir: Path | None, env: dict[str, str] | None = None, warm: Warm = (),
               code_root: Path | None = None, repeats: dict[str, int] | None = None) -> dict[str, Any]:
    """Every scenario (name -> (requests, requests in flight)) on one fresh engine, after ``warm``
    (:func:`warm_up_requests`), ``repeats[name]`` times (default once; pooled); ``demo c=1`` (if present) also gives
    decode tokens/s. An engine that fails gives a row with ``error`` (and what it measured before)."""
    log = (log_dir / f"{method}.log") if log_dir else None
    out: dict[str, Any] = {"method": method, "scenarios": {}}
    profiled = (env or {}).get("GLANCE_SGL_PROFILE") == "1"
    timed = (env or {}).get("GLANCE_SGL_STEP_TIMING") == "1"
    try:
        with EngineProcess(kwargs, env=env, log_path=log, code_root=code_root) as eng:
            out["startup_s"] = eng.startup_s
            _warm_up(eng, warm)
            for name, (reqs, c) in scenarios.items():
                runs = (repeats or {}).get(name, 1)
                row = out["scenarios"][name] = _pool([_measure(eng, reqs, c, name == "demo c=1", profiled, timed)
                                                      for _ in range(runs)])
                print(f"[bench] {method} {name}: {row['tokens_per_s']:.1f} tok/s, tau {row['tau']:.2f}",
                      file=sys.stderr, flush=True)
    except Exception as exc:  # one method's failure hides none of the others
        out.update({k: v for k, v in failed_row(method, exc).items() if k != "scenarios"})
        print(f"[bench] {method} FAILED: {out['error']}", file=sys.stderr, flush=True)
    return out


def run_interleaved(methods: list[str], kwargs: dict[str, dict[str, Any]], envs: dict[str, dict[str, str]],
                    scenarios: dict[str, tuple[list[dict[str, Any]], int]], log_dir: Path | None, warm: Warm = (),
                    code_roots: dict[str, Path] | None = None,
                    repeats: dict[str, int] | None = None, engine_runs: int = 1) -> list[dict[str, Any]]:
    """Every method's fresh engine alive at once; each scenario's requests in chunks (2 x in flight, at least
    4), every chunk run by every method in an order that rotates from chunk to chunk, so that a busy spell on a
    shared machine hits all methods alike; a scenario's chunks ``repeats[name]`` times over (default once). An
    engine that fails to start (or dies) gives a row with ``error``; the others go on. ``code_roots``: per method,
    another commit's package to run (``EngineProcess``). ``engine_runs``: all of it that many times over, every
    method's engine started afresh each time (logs appended), pooled: one engine process runs the same code up to
    5-10 % faster or slower than another for its whole life (on a CPU at least), so that several engines per method
    average out what one engine's draw would decide."""
    rows = {m: {"method": m, "scenarios": {}} for m in methods}
    # per scenario and method, each engine run's measured chunks, in the order they ran
    run_parts: dict[str, dict[str, dict[int, list]]] = {name: {m: {} for m in methods} for name in scenarios}
    profiled = {m for m in methods if envs[m].get("GLANCE_SGL_PROFILE") == "1"}
    timed = {m for m in methods if envs[m].get("GLANCE_SGL_STEP_TIMING") == "1"}
    engines: dict[str, EngineProcess] = {}

    def fail(m: str, exc: BaseException) -> None:
        rows[m].update({k: v for k, v in failed_row(m, exc).items() if k != "scenarios"})
        rows[m]["scenarios"] = {}
        print(f"[bench] {m} FAILED: {rows[m]['error']}", file=sys.stderr, flush=True)
        eng = engines.pop(m, None)
        if eng is not None:
            eng.close()

    def start(run: int) -> None:
        """Every method's engine that has not failed, started (logs appended after the first run) and warmed up."""
        for m in methods:
            if rows[m].get("error"):
                continue
            try:
                engines[m] = EngineProcess(kwargs[m], env=envs[m], wait=False,
                                           log_path=(log_dir / f"{m}.log") if log_dir else None,
                                           code_root=(code_roots or {}).get(m), append_log=run > 0)
            except Exception as exc:
                fail(m, exc)
        for m in list(engines):
            try:
                rows[m].setdefault("startup_s", engines[m].wait_ready().startup_s)
                _warm_up(engines[m], warm)
            except Exception as exc:
                fail(m, exc)

    def measure(run: int) -> None:
        """Every scenario's chunks, each run by every live engine in a rotating order, into ``run_parts``."""
        for name, (reqs, c) in scenarios.items():
            size = max(2 * c, 4)
            live = [m for m in methods if m in engines]
            if not live:
                continue
            starts = list(range(0, len(reqs), size)) * (repeats or {}).get(name, 1)
            for k, i in enumerate(starts):
                for m in live[k % len(live):] + live[: k % len(live)]:
                    if m not in engines:
                        continue
                    try:
                        measured = _measure(engines[m], reqs[i:i + size], c, name == "demo c=1", m in profiled,
                                            m in timed)
                        run_parts[name][m].setdefault(run, []).append(measured)
                    except Exception as exc:
                        fail(m, exc)

    for run in range(engine_runs):
        if engine_runs > 1:
            print(f"[bench] engine run {run + 1}/{engine_runs}", file=sys.stderr, flush=True)
        try:
            start(run)
            measure(run)
        finally:
            for eng in engines.values():
                eng.close()
            engines.clear()
    for name in scenarios:
        for m in methods:
            per_run = run_parts[name][m]
            if not rows[m].get("error") and per_run:
                row = rows[m]["scenarios"][name] = _pool([p for r in sorted(per_run) for p in per_run[r]])
                if engine_runs > 1:  # each engine run's own rate (None: the engine failed before it measured)
                    row["runs_tokens_per_s"] = [_pool(per_run[r])["tokens_per_s"] if r in per_run else None
                                                for r in range(engine_runs)]
                print(f"[bench] {m} {name}: {row['tokens_per_s']:.1f} tok/s, tau {row['tau']:.2f}",
                      file=sys.stderr, flush=True)
    return [rows[m] for m in methods]


def run_spread(rows: list[dict[str, Any]], reference: str = "ngram",
               label: Callable[[str], str] = lambda m: m) -> list[list[str]]:
    """Per scenario and method, its output tok/s over ``reference``'s: pooled, then in each engine run alone
    (``--engine-runs``: each run's ``runs_tokens_per_s``), and the runs' range: [scenario, method, pooled, per run,
    range]. Nothing where the reference did not run or no scenario has per-run rates."""
    ref = next((r for r in rows if r["method"] == reference and not r.get("error")), None)
    out: list[list[str]] = []
    if ref is None:
        return out
    for name, base in ref["scenarios"].items():
        first = True
        for r in rows:
            s = r["scenarios"].get(name) if not r.get("error") else None
            if r is ref or s is None or not s.get("runs_tokens_per_s") or not base.get("runs_tokens_per_s"):
                continue
            per = [a / b for a, b in zip(s["runs_tokens_per_s"], base["runs_tokens_per_s"]) if a and b]
            if not per:
                continue
            out.append([name if first else "", label(r["method"]), f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}",
                        " ".join(f"{x:.2f}" for x in per), f"{min(per):.2f}-{max(per):.2f}"])
            first = False
    return out


SPREAD_HEAD = ["scenario", "method", "over NGRAM, pooled", "each engine run", "range"]


def _aligned(head: list[str], rows: list[list[str]]) -> list[str]:
    """``head`` and ``rows`` as console lines: the first two columns (scenario, method) left-aligned, the numbers
    right-aligned, each column as wide as its widest cell."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    return ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in [head] + rows]


def format_table(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if not r.get("error")]
    base = next((r for r in ok if r["method"] == "none"), None)
    lines = [f"{'scenario':<11} {'method':<13} {'output tok/s':>12} {'vs none':>8} {'decode tok/s':>12} "
             f"{'vs none':>8} {'tau':>6} {'identical':>10}"]
    if any(r.get("rows_per_step") is not None for r in rows):
        lines.insert(0, "rows verified per request and step: " + ", ".join(
            f"{r['method']} {r['rows_per_step']:.1f}" for r in rows if r.get("rows_per_step") is not None))
    names = list(dict.fromkeys(n for r in rows for n in r["scenarios"]))
    for name in names:
        b = base["scenarios"].get(name) if base else None
        for r in rows:
            s = r["scenarios"].get(name)
            if s is None:
                continue
            ratio = s["tokens_per_s"] / b["tokens_per_s"] if b else float("nan")
            dec = s.get("decode_tokens_per_s")
            dratio = dec / b["decode_tokens_per_s"] if b and dec and b.get("decode_tokens_per_s") else float("nan")
            same = "/".join(map(str, s["identical"])) if s.get("identical") else "-"
            lines.append(f"{name:<11} {r['method']:<13} {s['tokens_per_s']:>12.1f} {ratio:>7.2f}x "
                         f"{dec if dec else float('nan'):>12.1f} {dratio:>7.2f}x {s['tau']:>6.2f} {same:>10}")
    spread = run_spread(ok)
    if spread:
        lines.append("output tok/s over NGRAM's, pooled and in each engine run (--engine-runs):")
        lines += _aligned(SPREAD_HEAD, spread)
    steps = step_table(ok)
    if steps:
        lines.append("decode steps side by side (the scheduler's run_batch, per scenario; --step-stats):")
        lines += _aligned(STEP_HEAD, steps)
    gaps = gap_table(ok)
    if gaps:
        lines.append("decode steps against NGRAM's: tokens per ms, and with NGRAM's time outside the forward:")
        lines += _aligned(GAP_HEAD, gaps)
    for r in rows:  # per scenario where the engine reported its step parts, else its log's whole-life line
        per = [(f"{r['method']} {name}", s["host_ms_per_step"]) for name, s in r["scenarios"].items()
               if s.get("host_ms_per_step")] or [(r["method"], r.get("host_ms_per_step") or {})]
        for label, kinds in per:
            for kind, parts in kinds.items():
                lines.append(f"ms per step, {label} {kind} ({parts['steps']} steps): " + ", ".join(
                    f"{k} {v:.2f}" for k, v in parts.items() if k != "steps"))
    for r in rows:
        if r.get("host_reads"):
            h = r["host_reads"]
            lines.append(f"host reads per decode step, {r['method']}: max {h['max']}, mean {h['mean']:.2f} over "
                         f"{h['steps']} steps; " + ", ".join(f"{k}: max {v['max']} mean {v['mean']:.2f} "
                                                             f"({v['steps']})" for k, v in h["by_kind"].items()))
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['method']}: FAILED: {r['error']}")
    return "\n".join(lines)


def _levels(text: str, flag: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag} takes comma-separated integers, got {text!r}")
    if any(c < 1 for c in levels):
        p.error(f"{flag}: requests in flight must be >= 1, got {text!r}")
    return levels


def sampled(requests: list[dict[str, Any]], temperature: float) -> list[dict[str, Any]]:
    """``requests`` at ``temperature``, request ``i`` seeded ``i`` (every method gets the same seeds)."""
    return [{**r, "temperature": temperature, "seed": i} for i, r in enumerate(requests)]


def identity_base(method: str, temperature: float) -> str | None:
    """The method whose outputs ``method``'s must equal token for token: no speculation's when greedy; at T > 0
    GLANCE's own path with drafting off (``glance-off``, at the method's commit: the same seeded sampling, which
    SGLang's sampler does not share), for the GLANCE methods only (NGRAM's and DFLASH's sampling keeps the
    distribution, not the tokens)."""
    if temperature == 0.0:
        return None if method == "none" else "none"
    name, rev = method_parts(method)[0], method_commit(method)
    if not name.startswith("glance") or name == "glance-off":
        return None
    return "glance-off" if rev is None else f"glance-off#{rev}"  # a commit's outputs against its own


def mark_identical(rows: list[dict[str, Any]], temperature: float) -> None:
    """Each scenario's ``identical`` [equal outputs, outputs] against its method's :func:`identity_base` (kept in
    the JSON, which drops the outputs); absent where there is none to compare with."""
    by_method = {r["method"]: r for r in rows if not r.get("error")}
    for r in rows:
        base = by_method.get(identity_base(r["method"], temperature) or "")
        for name, s in r["scenarios"].items():
            b = base["scenarios"].get(name) if base else None
            if b is not None:
                s["identical"] = [sum(x == y for x, y in zip(s["outputs"], b["outputs"])), len(s["outputs"])]


def _report(args: argparse.Namespace, rows: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    return {"device": args.device, "prompts": args.prompts, "wild": args.wild, "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "repeat": args.repeat, "engine_runs": args.engine_runs,
            "model": str(args.model), "drafter": str(args.drafter), "overlap": args.overlap, **extra,
            "methods": [{**r, "scenarios": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                                            for k, v in r["scenarios"].items()}} for r in rows]}


# Log lines that say a speculative engine runs without the overlap scheduler (SGLang's CPU rule for its own
# algorithms, SGLang's supports_overlap=False notice, GLANCE's CPU default).
SYNC_MARKERS = ("Overlap schedule is not implemented for speculative decoding on CPU",
                "registered with supports_overlap=False",
                "GLANCE on CPU: overlap scheduling is off")


def overlap_note(log: Path | None) -> str | None:
    """The first line of an engine's log that says it runs synchronously (None: none found, or no log)."""
    if log is None or not log.is_file():
        return None
    for line in log.read_text(errors="replace").splitlines():
        if any(m in line for m in SYNC_MARKERS):
            return line.strip()[:300]
    return None


def _log_stats(args: argparse.Namespace, r: dict[str, Any], stats: bool) -> None:
    """From the method's engine log (in place): rows verified per step, host reads per step, and whether a
    speculative engine ran with the overlap scheduler (``overlap_effective``; with ``--overlap on`` an engine
    that ran synchronously is marked failed, its measurements kept)."""
    log = args.log_dir / f"{r['method']}.log" if args.log_dir else None
    m, own = method_parts(r["method"])
    wanted = own or args.overlap
    if ALGORITHMS[m] is not None and not r.get("error"):
        note = overlap_note(log)
        if note is not None:
            r["overlap_effective"], r["overlap_note"] = False, note
        elif wanted is not None and log is not None:
            r["overlap_effective"] = wanted == "on"
        if wanted == "on" and note is not None:
            r["error"] = f"--overlap on, but the engine ran without the overlap scheduler: {note}"
    if stats:
        r["rows_per_step"] = (rows_per_step(log) if m in GLANCE_METHODS else
                              {"none": 1.0, "ngram": float(args.ngram_draft_tokens),
                               "dflash": float(drafter_block_size(args.drafter))}.get(m))
        if m in GLANCE_METHODS and log is not None:
            r["host_ms_per_step"] = host_ms_per_step(log)
    if args.count_host_reads and log is not None and m in GLANCE_METHODS:
        r["host_reads"] = host_reads(log)


def main(argv: list[str] | None = None) -> int:
    from glance_sgl.demo.paths import bundled_drafter, bundled_target

    p = argparse.ArgumentParser(prog="python -m glance_sgl.sglang.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=bundled_target(), help="target VLM (default: the bundled demo)")
    p.add_argument("--drafter", type=Path, default=bundled_drafter(), help="GLANCE drafter checkpoint")
    p.add_argument("--prompts", type=int, default=32, help="demo evaluation prompts (round-robin over tasks)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature, request i seeded i (default 0: greedy); GLANCE's outputs are "
                        "then checked against glance-off's (the same seeded sampling), where it runs")
    p.add_argument("--methods", default="none,ngram,glance,glance-drafter,glance-ngram",
                   help=f"comma-separated subset of {','.join(METHODS)}, each optionally with @overlap or @sync, "
                        "and #REV: that method at commit REV of this checkout (before / after in one run)")
    p.add_argument("--concurrency", default="1,4,16", help="demo requests in flight, comma-separated")
    p.add_argument("--wild", type=int, default=16, help="wild requests (noise / photo-like images; 0: none)")
    p.add_argument("--wild-concurrency", default="1,8", help="wild requests in flight, comma-separated")
    p.add_argument("--ngram-draft-tokens", type=int_in(2), default=8, help="NGRAM's rows per step (root included)")
    p.add_argument("--glance-draft-tokens", type=int_in(2), default=None,
                   help="GLANCE rows reserved per step (tree budget + 1; default 32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--disable-cuda-graph", action="store_true", help="CUDA: every engine without CUDA graphs")
    p.add_argument("--overlap", choices=["on", "off"], default=None,
                   help="the speculative engines (GLANCE, DFLASH, NGRAM) with SGLang's overlap scheduler on / off "
                        "(disable_overlap_schedule; default: the engine's choice, on the CPU off)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of every scenario but the first of each kind (those replay answers seen before), "
                        "pooled (default 1)")
    p.add_argument("--json", type=Path, help="write the report here (rewritten after every method)")
    p.add_argument("--log-dir", type=Path, help="keep each engine's log here")
    p.add_argument("--step-stats", action="store_true",
                   help="with --log-dir: log every GLANCE step and report rows verified per step")
    p.add_argument("--count-host-reads", action="store_true",
                   help="with --log-dir: count the GLANCE worker's device-to-host reads per decode step and report "
                        "max / mean per step (a cost: not for speed)")
    p.add_argument("--interleave", action="store_true",
                   help="all methods' engines alive at once, request chunks alternating between them (a shared, "
                        "busy machine); default: one method after the other")
    p.add_argument("--engine-runs", type=int, default=1,
                   help="with --interleave: the whole run N times, every engine started afresh each time, pooled "
                        "(one engine process can run 5-10 %% faster or slower than another for its whole life)")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        try:
            method_parts(m)
            method_commit(m)
        except ValueError as exc:
            p.error(str(exc))
    if len(set(methods)) != len(methods):
        p.error("--methods: a method is named twice")
    if args.prompts < 1 or args.max_tokens < 1 or args.wild < 0:
        p.error("--prompts and --max-tokens must be >= 1, --wild >= 0")
    if not 0.0 <= args.temperature <= 2.0:
        p.error(f"--temperature must be in [0, 2], got {args.temperature}")
    if not 1 <= args.repeat <= 100:
        p.error(f"--repeat must be in [1, 100], got {args.repeat}")
    if not 1 <= args.engine_runs <= 10:
        p.error(f"--engine-runs must be in [1, 10], got {args.engine_runs}")
    if args.engine_runs > 1 and not args.interleave:
        p.error("--engine-runs runs the interleaved harness again with fresh engines: give --interleave")
    for path, what in ((args.model, "--model"), (args.drafter, "--drafter")):
        if not (path / "config.json").is_file():
            p.error(f"{what} {path}: no config.json (build the demo with `glance demo build` or pass a directory)")
    stats = args.step_stats and args.log_dir is not None
    if args.step_stats and not stats:
        p.error("--step-stats reads the engines' logs: give --log-dir")
    if args.count_host_reads and args.log_dir is None:
        p.error("--count-host-reads reads the engines' logs: give --log-dir")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    extra: dict[str, Any] = {}
    if "dflash" in methods:
        extra["dflash_block_size"] = drafter_block_size(args.drafter)
        extra["dflash_preflight"] = dflash_preflight(args.model, args.drafter)
        for line in extra["dflash_preflight"]:
            print(f"[bench] dflash preflight: {line}", file=sys.stderr, flush=True)
    demo, _ = demo_requests(args.model, args.prompts, args.max_tokens)
    if args.temperature:
        demo = sampled(demo, args.temperature)
    scenarios: dict[str, tuple[list[dict[str, Any]], int]] = {
        f"demo c={c}": (demo, c) for c in _levels(args.concurrency, "--concurrency", p)}
    if args.wild:
        wild = wild_requests(args.model, args.wild, args.max_tokens)
        if args.temperature:
            wild = sampled(wild, args.temperature)
        scenarios.update({f"wild c={c}": (wild, c) for c in _levels(args.wild_concurrency, "--wild-concurrency", p)})
    warm = warm_up_requests(args.model, scenarios, args.prompts, args.max_tokens)
    repeats = replay_repeats(scenarios, args.repeat)
    kwargs = {m: engine_kwargs(m, args.model, args.drafter, args.device, args.ngram_draft_tokens,
                               args.glance_draft_tokens, not args.disable_cuda_graph, args.overlap) for m in methods}
    envs = {m: engine_env(m, stats, args.count_host_reads, args.overlap) for m in methods}
    code_roots: dict[str, Path] = {}
    exported: dict[str, Path] = {}
    for m in methods:
        if (rev := method_commit(m)) is not None:
            try:
                code_roots[m] = exported[rev] if rev in exported else exported.setdefault(rev, export_package(rev))
            except ValueError as exc:
                p.error(str(exc))
    unavailable = {m: why for m in methods if (why := method_unavailable(m, args.device, args.temperature))}
    for m, why in unavailable.items():
        print(f"[bench] {m} FAILED: {why}", file=sys.stderr, flush=True)
    runnable = [m for m in methods if m not in unavailable]

    def write(rows: list[dict[str, Any]]) -> None:
        if args.json:
            args.json.write_text(json.dumps(_report(args, rows, extra), indent=2) + "\n")

    done: dict[str, dict[str, Any]] = {m: failed_row(m, why) for m, why in unavailable.items()}
    ordered = lambda: [done[m] for m in methods if m in done]  # noqa: E731
    if args.interleave and runnable:
        print(f"[bench] {', '.join(runnable)}: starting SGLang ({args.device}), interleaved", file=sys.stderr,
              flush=True)
        for r in run_interleaved(runnable, kwargs, envs, scenarios, args.log_dir, warm, code_roots, repeats,
                                 args.engine_runs):
            _log_stats(args, r, stats)
            done[r["method"]] = r
    else:
        for m in runnable:
            print(f"[bench] {m}: starting SGLang ({args.device})", file=sys.stderr, flush=True)
            r = done[m] = run_method(m, kwargs[m], scenarios, args.log_dir, env=envs[m], warm=warm,
                                     code_root=code_roots.get(m), repeats=repeats)
            _log_stats(args, r, stats)
            write(ordered())
    rows = ordered()
    mark_identical(rows, args.temperature)
    print(format_table(rows))
    write(rows)
    for folder in exported.values():  # the earlier commits' exported packages (their engines have ended)
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
