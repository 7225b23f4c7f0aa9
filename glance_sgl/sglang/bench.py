"""Benchmark through SGLang on this machine: GLANCE (auto / fixed planner) vs no speculation vs SGLang's NGRAM.

    python -m glance_sgl.sglang.bench [--model DIR --drafter DIR] [--prompts 32] [--max-tokens 64]
        [--methods none,ngram,glance,glance-fixed,glance+ngram] [--concurrency 1,4,16] [--wild 16]
        [--wild-concurrency 1,8] [--interleave] [--step-stats --log-dir DIR]

``glance+ngram`` is GLANCE (auto planner) with the n-gram source's candidates merged into the drafter's tree
(``GLANCE_DRAFT_SOURCES=drafter,ngram``). ``--step-stats`` (with ``--log-dir``) logs every GLANCE step
(``GLANCE_SGL_PROFILE=1``, a small cost for the GLANCE methods alike) and adds the mean rows verified per request
and step to the table (NGRAM verifies ``--ngram-draft-tokens`` rows, no speculation 1).

The same harness for every method, each method in a fresh engine in its own process (``runner.EngineProcess``),
one method after the other, or with ``--interleave`` all engines alive at once and each scenario's request chunks
run by every method in a rotating order (robust to a busy shared machine); every engine is warmed up at every
concurrency level first (the auto planner calibrates its cost model on the first batches of
each size, or loads its cached calibration). Scenarios:

- ``demo c=K``: the demo evaluation prompts (images included) with K requests in flight (a new one starts when
  one finishes); output tokens/s = completion tokens / wall time (prefill included);
- ``demo c=1`` also gives the decode speedup: decode time per request = latency of the full request minus
  latency of the same request with ``max_new_tokens=1``; decode tokens/s = (completion - 1) / that;
- ``wild c=K``: noise and photo-like images of other sizes with generic prompts (``runner.wild_requests``).

tau = (completion - 1) / verify steps, pooled (design §1; an AR step of the planner counts as a verify step of
accept length 1). Outputs are compared token for token with the no-speculation run. ``--device cuda`` runs the
same on a GPU (FlashInfer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .runner import EngineProcess, cpu_engine_kwargs, demo_requests, wild_requests

import re

METHODS = ("none", "ngram", "glance", "glance-fixed", "glance+ngram")
GLANCE_METHODS = ("glance", "glance-fixed", "glance+ngram")


def engine_kwargs(method: str, model: Path, drafter: Path, device: str, ngram_tokens: int,
                  glance_tokens: int | None = None, cuda_graphs: bool = True) -> dict[str, Any]:
    algo = {"none": None, "ngram": "NGRAM", "glance": "GLANCE", "glance-fixed": "GLANCE",
            "glance+ngram": "GLANCE"}[method]
    if device == "cpu":
        kw = cpu_engine_kwargs(model, drafter, algorithm=algo)
    else:
        kw = dict(model_path=str(model), dtype="bfloat16", log_level="warning", random_seed=0,
                  mem_fraction_static=0.5, disable_cuda_graph=not cuda_graphs)
        if algo == "GLANCE":
            kw.update(speculative_algorithm="GLANCE", speculative_draft_model_path=str(drafter))
        elif algo == "NGRAM":
            kw.update(speculative_algorithm="NGRAM")
    if algo == "NGRAM":
        kw["speculative_num_draft_tokens"] = ngram_tokens
    if algo == "GLANCE" and glance_tokens:
        kw["speculative_num_draft_tokens"] = glance_tokens
    return kw


def engine_env(method: str, step_stats: bool = False) -> dict[str, str]:
    """The planner of a GLANCE method (``GLANCE_PLANNER``; see glance_sgl/sglang/planning.py), its candidate
    sources (``GLANCE_DRAFT_SOURCES``) and, with ``step_stats``, its per-step log (``GLANCE_SGL_PROFILE``)."""
    env = {"GLANCE_PLANNER": "fixed" if method == "glance-fixed" else "auto"}
    if method == "glance+ngram":
        env["GLANCE_DRAFT_SOURCES"] = "drafter,ngram"
    if step_stats and method in GLANCE_METHODS:
        env["GLANCE_SGL_PROFILE"] = "1"
    return env


_STEP = re.compile(r"GLANCE step bs=(\d+) .*? target\[(\d+)\]")


def rows_per_step(log: Path) -> float | None:
    """Mean rows verified per request and decode step in a GLANCE engine's profile log (warm-up included)."""
    if not log.is_file():
        return None
    rows = [int(m.group(2)) for m in _STEP.finditer(log.read_text(errors="replace"))]
    return sum(rows) / len(rows) if rows else None


def _measure(eng: EngineProcess, reqs: list[dict[str, Any]], c: int, decode: bool) -> dict[str, Any]:
    """One engine on ``reqs`` with ``c`` in flight: sums to pool (``decode``: also the max_tokens=1 latencies)."""
    one = eng.generate([{**r, "max_tokens": 1} for r in reqs])["results"] if decode else None
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
    return part


def _pool(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A scenario's row from its measured parts (pooled sums)."""
    tot = {k: sum(p[k] for p in parts) for k in parts[0] if k != "outputs"}
    row = {"tokens": tot["tokens"], "wall_s": tot["wall_s"],
           "tokens_per_s": tot["tokens"] / tot["wall_s"] if tot["wall_s"] > 0 else float("nan"),
           "tau": tot["spec_tokens"] / tot["verify"] if tot["verify"] else 1.0,
           "outputs": [o for p in parts for o in p["outputs"]]}
    if "decode_s" in tot:
        row["decode_tokens_per_s"] = tot["decode_tokens"] / tot["decode_s"] if tot["decode_s"] > 0 else float("nan")
    return row


def _warm_up(eng: EngineProcess, scenarios: dict[str, tuple[list[dict[str, Any]], int]]) -> None:
    for reqs, c in scenarios.values():  # every level (short answers): calibration lands here, not in the runs
        eng.generate([{**r, "max_tokens": 16} for r in reqs[: 2 * c]], concurrency=c)


def run_method(method: str, kwargs: dict[str, Any], scenarios: dict[str, tuple[list[dict[str, Any]], int]],
               log_dir: Path | None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Every scenario (name -> (requests, requests in flight)) on one fresh engine; ``demo c=1`` (if present)
    also gives decode tokens/s."""
    log = (log_dir / f"{method}.log") if log_dir else None
    out: dict[str, Any] = {"method": method, "scenarios": {}}
    with EngineProcess(kwargs, env=env, log_path=log) as eng:
        _warm_up(eng, scenarios)
        for name, (reqs, c) in scenarios.items():
            row = out["scenarios"][name] = _pool([_measure(eng, reqs, c, name == "demo c=1")])
            print(f"[bench] {method} {name}: {row['tokens_per_s']:.1f} tok/s, tau {row['tau']:.2f}",
                  file=sys.stderr, flush=True)
        out["startup_s"] = eng.startup_s
    return out


def run_interleaved(methods: list[str], kwargs: dict[str, dict[str, Any]], envs: dict[str, dict[str, str]],
                    scenarios: dict[str, tuple[list[dict[str, Any]], int]], log_dir: Path | None
                    ) -> list[dict[str, Any]]:
    """Every method's fresh engine alive at once; each scenario's requests in chunks (2 x in flight, at least
    4), every chunk run by every method in an order that rotates from chunk to chunk, so that a busy spell on a
    shared machine hits all methods alike."""
    engines = {m: EngineProcess(kwargs[m], env=envs[m], log_path=(log_dir / f"{m}.log") if log_dir else None,
                                wait=False) for m in methods}
    try:
        for eng in engines.values():
            eng.wait_ready()
        for eng in engines.values():
            _warm_up(eng, scenarios)
        rows = {m: {"method": m, "scenarios": {}, "startup_s": engines[m].startup_s} for m in methods}
        for name, (reqs, c) in scenarios.items():
            size = max(2 * c, 4)
            parts: dict[str, list] = {m: [] for m in methods}
            for k, i in enumerate(range(0, len(reqs), size)):
                order = methods[k % len(methods):] + methods[: k % len(methods)]
                for m in order:
                    parts[m].append(_measure(engines[m], reqs[i:i + size], c, name == "demo c=1"))
            for m in methods:
                row = rows[m]["scenarios"][name] = _pool(parts[m])
                print(f"[bench] {m} {name}: {row['tokens_per_s']:.1f} tok/s, tau {row['tau']:.2f}", file=sys.stderr,
                      flush=True)
        return [rows[m] for m in methods]
    finally:
        for eng in engines.values():
            eng.close()


def format_table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["method"] == "none"), None)
    lines = [f"{'scenario':<11} {'method':<13} {'output tok/s':>12} {'vs none':>8} {'decode tok/s':>12} "
             f"{'vs none':>8} {'tau':>6} {'identical':>10}"]
    if any(r.get("rows_per_step") is not None for r in rows):
        lines.insert(0, "rows verified per request and step: " + ", ".join(
            f"{r['method']} {r['rows_per_step']:.1f}" for r in rows if r.get("rows_per_step") is not None))
    for name in rows[0]["scenarios"]:
        b = base["scenarios"][name] if base else None
        for r in rows:
            s = r["scenarios"][name]
            ratio = s["tokens_per_s"] / b["tokens_per_s"] if b else float("nan")
            dec = s.get("decode_tokens_per_s")
            dratio = dec / b["decode_tokens_per_s"] if b and dec else float("nan")
            same = f"{sum(x == y for x, y in zip(s['outputs'], b['outputs']))}/{len(s['outputs'])}" if b else "-"
            lines.append(f"{name:<11} {r['method']:<13} {s['tokens_per_s']:>12.1f} {ratio:>7.2f}x "
                         f"{dec if dec else float('nan'):>12.1f} {dratio:>7.2f}x {s['tau']:>6.2f} {same:>10}")
    return "\n".join(lines)


def _levels(text: str, flag: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag} takes comma-separated integers, got {text!r}")
    if any(c < 1 for c in levels):
        p.error(f"{flag}: requests in flight must be >= 1, got {text!r}")
    return levels


def main(argv: list[str] | None = None) -> int:
    from glance_sgl.demo.paths import bundled_drafter, bundled_target

    p = argparse.ArgumentParser(prog="python -m glance_sgl.sglang.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=bundled_target(), help="target VLM (default: the bundled demo)")
    p.add_argument("--drafter", type=Path, default=bundled_drafter(), help="GLANCE drafter checkpoint")
    p.add_argument("--prompts", type=int, default=32, help="demo evaluation prompts (round-robin over tasks)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--concurrency", default="1,4,16", help="demo requests in flight, comma-separated")
    p.add_argument("--wild", type=int, default=16, help="wild requests (noise / photo-like images; 0: none)")
    p.add_argument("--wild-concurrency", default="1,8", help="wild requests in flight, comma-separated")
    p.add_argument("--ngram-draft-tokens", type=int, default=8)
    p.add_argument("--glance-draft-tokens", type=int, default=None,
                   help="GLANCE rows reserved per step (tree budget + 1; default 32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--disable-cuda-graph", action="store_true", help="CUDA: every engine without CUDA graphs")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--log-dir", type=Path, help="keep each engine's log here")
    p.add_argument("--step-stats", action="store_true",
                   help="with --log-dir: log every GLANCE step and report rows verified per step")
    p.add_argument("--interleave", action="store_true",
                   help="all methods' engines alive at once, request chunks alternating between them (a shared, "
                        "busy machine); default: one method after the other")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if bad := sorted(set(methods) - set(METHODS)):
        p.error(f"unknown methods {bad}; choose from {', '.join(METHODS)}")
    if args.prompts < 1 or args.max_tokens < 1 or args.wild < 0:
        p.error("--prompts and --max-tokens must be >= 1, --wild >= 0")
    for path, what in ((args.model, "--model"), (args.drafter, "--drafter")):
        if not (path / "config.json").is_file():
            p.error(f"{what} {path}: no config.json (build the demo with `glance demo build` or pass a directory)")
    stats = args.step_stats and args.log_dir is not None
    if args.step_stats and not stats:
        p.error("--step-stats reads the engines' logs: give --log-dir")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    demo, _ = demo_requests(args.model, args.prompts, args.max_tokens)
    scenarios: dict[str, tuple[list[dict[str, Any]], int]] = {
        f"demo c={c}": (demo, c) for c in _levels(args.concurrency, "--concurrency", p)}
    if args.wild:
        wild = wild_requests(args.model, args.wild, args.max_tokens)
        scenarios.update({f"wild c={c}": (wild, c) for c in _levels(args.wild_concurrency, "--wild-concurrency", p)})
    kwargs = {m: engine_kwargs(m, args.model, args.drafter, args.device, args.ngram_draft_tokens,
                               args.glance_draft_tokens, not args.disable_cuda_graph) for m in methods}
    if args.interleave:
        print(f"[bench] {', '.join(methods)}: starting SGLang ({args.device}), interleaved", file=sys.stderr,
              flush=True)
        rows = run_interleaved(methods, kwargs, {m: engine_env(m, stats) for m in methods}, scenarios,
                               args.log_dir)
    else:
        rows = []
        for m in methods:
            print(f"[bench] {m}: starting SGLang ({args.device})", file=sys.stderr, flush=True)
            rows.append(run_method(m, kwargs[m], scenarios, args.log_dir, env=engine_env(m, stats)))
    for r in rows:
        m = r["method"]
        r["rows_per_step"] = (rows_per_step(args.log_dir / f"{m}.log") if stats and m in GLANCE_METHODS
                              else {"none": 1.0, "ngram": float(args.ngram_draft_tokens)}.get(m) if stats else None)
    print(format_table(rows))
    if args.json:
        report = {"device": args.device, "prompts": args.prompts, "wild": args.wild, "max_tokens": args.max_tokens,
                  "model": str(args.model), "drafter": str(args.drafter),
                  "methods": [{**r, "scenarios": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                                                  for k, v in r["scenarios"].items()}} for r in rows]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
