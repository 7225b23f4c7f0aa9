"""Benchmark through SGLang on this machine: GLANCE vs SGLang without speculation vs SGLang's NGRAM.

    python -m glance_sgl.sglang.bench [--model DIR --drafter DIR] [--prompts 20] [--max-tokens 64] [--cpu]

Same demo evaluation prompts (images included) for every method, batch 1, one engine at a time, each in its
own process (``runner.EngineProcess``). Decode time per request = latency of the full request minus latency of
the same request with ``max_new_tokens=1`` (so prefill is excluded); decode tokens/s = (completion - 1) / that.
Accept length is reported both ways: SGLang's ``spec_accept_length`` (completion / verify steps, the prefill
token counted) and tau = (completion - 1) / verify steps (design §1's convention). Outputs are compared token
for token with the no-speculation run. ``--device cuda`` runs the same on a GPU (FlashInfer, CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .runner import EngineProcess, cpu_engine_kwargs, demo_requests

METHODS = ("none", "ngram", "glance")


def engine_kwargs(method: str, model: Path, drafter: Path, device: str, ngram_tokens: int,
                  glance_tokens: int | None = None) -> dict[str, Any]:
    algo = {"none": None, "ngram": "NGRAM", "glance": "GLANCE"}[method]
    if device == "cpu":
        kw = cpu_engine_kwargs(model, drafter, algorithm=algo)
    else:
        kw = dict(model_path=str(model), dtype="bfloat16", disable_radix_cache=True, log_level="warning",
                  random_seed=0, mem_fraction_static=0.5)
        if algo == "GLANCE":
            kw.update(speculative_algorithm="GLANCE", speculative_draft_model_path=str(drafter))
        elif algo == "NGRAM":
            kw.update(speculative_algorithm="NGRAM")
    if algo == "NGRAM":
        kw["speculative_num_draft_tokens"] = ngram_tokens
    if algo == "GLANCE" and glance_tokens:
        kw["speculative_num_draft_tokens"] = glance_tokens
    return kw


def run_method(method: str, kwargs: dict[str, Any], requests: list[dict[str, Any]], log_dir: Path | None
               ) -> dict[str, Any]:
    log = (log_dir / f"{method}.log") if log_dir else None
    with EngineProcess(kwargs, log_path=log) as eng:
        eng.generate(requests[:1])  # warm-up
        one = eng.generate([{**r, "max_tokens": 1} for r in requests])["results"]
        t0 = time.perf_counter()
        full = eng.generate(requests)["results"]
        wall = time.perf_counter() - t0
        startup = eng.startup_s
    decode_s = decode_tokens = verify = spec_tokens = 0.0
    for o, f in zip(one, full):
        n = f["meta_info"]["completion_tokens"]
        decode_tokens += max(n - 1, 0)
        decode_s += max(f["meta_info"]["e2e_latency"] - o["meta_info"]["e2e_latency"], 0.0)
        ct = f["meta_info"].get("spec_verify_ct") or 0
        if ct:
            verify += ct
            spec_tokens += n - 1
    return {
        "method": method,
        "decode_tokens": int(decode_tokens),
        "decode_s": decode_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
        "tau": spec_tokens / verify if verify else 1.0,
        "sglang_accept_length": (spec_tokens + sum(1 for f in full if f["meta_info"].get("spec_verify_ct"))) / verify
        if verify else 1.0,
        "wall_s": wall,
        "startup_s": startup,
        "outputs": [f["output_ids"] for f in full],
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["method"] == "none"), None)
    lines = [f"{'method':<8} {'decode tok/s':>12} {'vs none':>8} {'tau':>6} {'sglang acc.len':>14} "
             f"{'identical':>10}"]
    for r in rows:
        ratio = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base else float("nan")
        same = f"{r['identical']}/{r['prompts']}" if base else "-"
        lines.append(f"{r['method']:<8} {r['decode_tokens_per_s']:>12.1f} {ratio:>7.2f}x {r['tau']:>6.2f} "
                     f"{r['sglang_accept_length']:>14.2f} {same:>10}")
    by = {r["method"]: r for r in rows}
    if "glance" in by and "ngram" in by:
        lines.append(f"GLANCE / NGRAM decode tokens/s: "
                     f"{by['glance']['decode_tokens_per_s'] / by['ngram']['decode_tokens_per_s']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from glance_sgl.demo.paths import bundled_drafter, bundled_target

    p = argparse.ArgumentParser(prog="python -m glance_sgl.sglang.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=bundled_target(), help="target VLM (default: the bundled demo)")
    p.add_argument("--drafter", type=Path, default=bundled_drafter(), help="GLANCE drafter checkpoint")
    p.add_argument("--prompts", type=int, default=20, help="demo evaluation prompts (round-robin over tasks)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of none,ngram,glance")
    p.add_argument("--ngram-draft-tokens", type=int, default=8)
    p.add_argument("--glance-draft-tokens", type=int, default=None,
                   help="GLANCE rows verified per step (tree budget + 1; default 32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--log-dir", type=Path, help="keep each engine's log here")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if bad := sorted(set(methods) - set(METHODS)):
        p.error(f"unknown methods {bad}; choose from {', '.join(METHODS)}")
    for path, what in ((args.model, "--model"), (args.drafter, "--drafter")):
        if not (path / "config.json").is_file():
            p.error(f"{what} {path}: no config.json (build the demo with `glance demo build` or pass a directory)")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    requests, _ = demo_requests(args.model, args.prompts, args.max_tokens)
    rows = []
    for m in methods:
        print(f"[bench] {m}: starting SGLang ({args.device})", file=sys.stderr, flush=True)
        rows.append(run_method(m, engine_kwargs(m, args.model, args.drafter, args.device, args.ngram_draft_tokens,
                                             args.glance_draft_tokens),
                               requests, args.log_dir))
    base = next((r for r in rows if r["method"] == "none"), None)
    for r in rows:
        r["prompts"] = len(requests)
        r["identical"] = sum(a == b for a, b in zip(r["outputs"], base["outputs"])) if base else None
    print(format_table(rows))
    if args.json:
        report = {"device": args.device, "prompts": len(requests), "max_tokens": args.max_tokens,
                  "model": str(args.model), "drafter": str(args.drafter),
                  "methods": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
