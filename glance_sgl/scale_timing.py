"""Timing at real scale: the planner's cost model for a 7B-class VLM target, measured on this device.

Builds, from a config (no download), a random-weight target with Qwen2.5-VL-7B's text shapes (28 layers, hidden
3584, GQA 28 / 4 heads, intermediate 18944, vocabulary 152064; Hugging Face ``Qwen2ForCausalLM``, the text
backbone of Qwen2.5-VL: M-RoPE costs what 1-D RoPE costs) and a GLANCE drafter sized for it
(``GlanceDrafter.for_target``: 5 layers and 5 tap layers by default, block 16). Then it times

- the verify pass: ``rows`` tree rows per request (1 = an AR step; default 1 / 4 / 8 / 16 / 32 / 64) over each
  context of ``--context`` tokens (default 1k and 4k) in a static KV cache, with a tree attention mask, for every
  batch size, eagerly and replayed from a CUDA graph;
- the drafter pass of a decode step (gather from a draft KV pool, drafter, top-k, budget tree) through the
  worker's own ``DraftPassRunner``, eagerly (static shapes) and from its CUDA graphs;

and derives (:func:`derive`) the round cost in AR steps per tree size, ``(t_verify(rows) + t_drafter) /
t_verify(1)``, the decode speedup each tau would give (``tau / round cost``; the published 2.9-4.7 among them),
and, given a measured tau-per-rows curve (``--tau-curve``: the demo's, from the device check), the best tree size
per tau. Medians of ``--repeats`` timed calls after warm-up (CUDA events on a GPU). ``--tiny`` runs the same code
on a tiny config (what the CPU test does). ``--eager-contexts`` limits the eager passes to some contexts (they are
host-bound on a GPU: one context says what they cost). Each configuration prints a line and, with ``--json``,
rewrites the report so far, so a run cut short by a time limit keeps what it measured.

    python -m glance_sgl.scale_timing --device cuda --json scale.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

SHAPES_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                 max_position_embeddings=32768)
SHAPES_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                   max_position_embeddings=4096)


def build_target(shapes: dict[str, Any], device: str, dtype: torch.dtype):
    """A random-weight ``Qwen2ForCausalLM`` of ``shapes``, initialised on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**shapes)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval(), cfg


def timed(fn: Callable[[], Any], device: str, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - t0))
    return statistics.median(out)


def graphed(fn: Callable[[], Any], device: str) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph (warm-up on a side stream first); returns the replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def verify_call(target, cfg, bs: int, rows: int, context: int, device: str) -> Callable[[], Any]:
    """One verify pass of ``rows`` chain rows per request at positions ``context ..`` (a chain costs what any tree
    of as many rows costs), attending to ``context`` cached tokens and causally within the rows."""
    from transformers import StaticCache

    cache = StaticCache(config=cfg, max_cache_len=context + rows)
    ids = torch.randint(0, cfg.vocab_size, (bs, rows), device=device)
    pos = torch.arange(context, context + rows, device=device)
    mask = torch.zeros(bs, 1, rows, context + rows, dtype=torch.bool, device=device)
    mask[..., :context] = True
    mask[..., context:] = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device=device))
    position_ids = pos[None].expand(bs, -1).contiguous()

    @torch.no_grad()
    def run():
        return target(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos,
                      position_ids=position_ids, attention_mask=mask).logits

    return run


def build_drafter(target, cfg, device: str, dtype: torch.dtype, layers: int):
    """A random-weight drafter of ``layers`` layers sized for ``cfg``, bound to ``target``'s embedding and head.
    Built once per run: at 7B shapes its CPU initialisation took 12-14 s per configuration on the H200 machine."""
    from glance_sgl.drafter import GlanceDrafter

    drafter = GlanceDrafter.for_target(cfg, mask_token_id=0, num_hidden_layers=layers, num_taps=5,
                                       seed=0).to(device=device, dtype=dtype).eval()
    drafter.bind_target(target.model.embed_tokens, target.lm_head)
    return drafter


def drafter_call(drafter, bs: int, context: int, device: str, dtype: torch.dtype, vocab: int,
                 use_graphs: bool) -> Callable[[], Any]:
    """The worker's drafter pass (``DraftPassRunner``) for ``bs`` requests with ``context`` tokens each."""
    from glance_sgl.sglang.draft_graph import DraftPassRunner
    from glance_sgl.sglang.draft_pool import DraftKVPool

    pool = DraftKVPool(drafter, size=bs * context + 1, device=device, dtype=dtype)
    req_to_token = (1 + torch.arange(bs * context, device=device, dtype=torch.int32)).view(bs, context)
    runner = DraftPassRunner(drafter, pool, req_to_token, max_depth=drafter.config.block_size - 1,
                             branch_k=drafter.config.branch_k, budget=31, max_bs=max(bs, 1), use_graphs=use_graphs)
    rpi = torch.arange(bs, device=device)
    lengths = torch.full((bs,), context - 1, device=device)
    roots = torch.randint(0, vocab, (bs,), device=device)
    return lambda: runner.run(rpi, lengths, roots, context - 1)


TAUS = (2.0, 2.9, 3.0, 4.0, 4.7, 5.0, 6.0)  # 2.9-4.7: the published range (Qwen3-VL-8B, 32-token tree)
CURVE_ANCHOR_ROWS = 32  # the published taus were measured at a 32-token tree (root included)


def measure(device: str, dtype: torch.dtype, shapes: dict[str, Any], batches: list[int], rows: list[int],
            contexts: list[int], repeats: int, drafter_layers: int, progress: bool = True,
            drafter_batches: list[int] | None = None, partial: Path | None = None,
            eager_contexts: list[int] | None = None) -> dict[str, Any]:
    """The report: verify ms per (context, batch, rows) and drafter ms per (context, batch), eager and (on CUDA)
    from CUDA graphs. Keys: ``{mode}/ctx{C}/bs{B}/rows{R}`` and ``{mode}/ctx{C}/bs{B}``; a configuration that
    fails (out of memory, say) is listed under ``errors`` and the others still run. Each finished configuration
    prints a line (key, ms, seconds spent) and, with ``partial``, rewrites the report so far there: a run cut
    short by a time limit keeps what it measured."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    target, cfg = build_target(shapes, device, dtype)
    drafter = None  # built at the first drafter configuration
    print(f"  built the target ({shapes.get('num_hidden_layers')} layers, {dtype}) in "
          f"{time.perf_counter() - t_start:.1f} s", flush=True)
    cuda = device.startswith("cuda")
    modes = ["graph", "eager"] if cuda else ["eager"]  # graphed passes first: what a serving engine runs
    dbatches = drafter_batches or batches
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                              "dtype": str(dtype).removeprefix("torch."), "shapes": shapes, "contexts": contexts,
                              "batches": batches, "rows": rows, "drafter_batches": dbatches,
                              "drafter_layers": drafter_layers, "verify_ms": {}, "drafter_ms": {}, "errors": []}
    # per context and mode: the verify passes, then the drafter's (r None); on CUDA, eager passes only at
    # ``eager_contexts`` (they are host-bound: one context tells what they cost)
    shapes_of = [(b, r) for b in batches for r in rows] + [(b, None) for b in dbatches]
    jobs = [(m, c, b, r) for c in contexts for m in modes
            if m == "graph" or not cuda or eager_contexts is None or c in eager_contexts for b, r in shapes_of]
    for mode, ctx, bs, r in tqdm(jobs, desc="scale timing", disable=not progress):
        key = f"{mode}/ctx{ctx}/bs{bs}" + (f"/rows{r}" if r is not None else "")
        t_job = time.perf_counter()
        try:
            if r is not None:
                fn = verify_call(target, cfg, bs, r, ctx, device)
                fn = graphed(fn, device) if mode == "graph" else fn
                report["verify_ms"][key] = round(timed(fn, device, repeats), 4)
            else:
                if drafter is None:
                    drafter = build_drafter(target, cfg, device, dtype, drafter_layers)
                fn = drafter_call(drafter, bs, ctx, device, dtype, cfg.vocab_size, mode == "graph")
                report["drafter_ms"][key] = round(timed(fn, device, repeats), 4)
        except Exception as exc:  # a failed configuration is reported, the others still run
            report["errors"].append(f"{key}: {type(exc).__name__}: {exc}"[:400])
        got = report["verify_ms"].get(key, report["drafter_ms"].get(key))
        print(f"  job {key}: {'failed' if got is None else f'{got} ms'} ({time.perf_counter() - t_job:.1f} s)",
              flush=True)
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(report, indent=2))
        fn = None
        if cuda:
            torch.cuda.empty_cache()
    derive(report)
    return report


def _round_costs(report: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Per ``{mode}/ctx{C}/bs{B}`` (where the AR step and the drafter pass were measured): rows -> the round's cost
    in AR steps, ``(t_verify(rows) + t_drafter) / t_verify(1)``; rows 1 costs 1 (an AR step drafts nothing)."""
    out: dict[str, dict[int, float]] = {}
    for key, ar in report["verify_ms"].items():
        if not key.endswith("/rows1"):
            continue
        base = key.removesuffix("/rows1")
        draft = report["drafter_ms"].get(base)
        if draft is None:  # no drafter timing (a run cut short): no round cost, rather than "1 row is best"
            continue
        costs = {1: 1.0}
        for r in report["rows"]:
            v = report["verify_ms"].get(f"{base}/rows{r}")
            if r > 1 and v is not None:
                costs[r] = (v + draft) / ar
        out[base] = costs
    return out


def scaled_curve(curve: dict[int, float], tau_at_anchor: float, anchor: int = CURVE_ANCHOR_ROWS) -> dict[int, float]:
    """A measured tau-per-rows curve rescaled so that it reaches ``tau_at_anchor`` at ``anchor`` rows:
    ``1 + (tau(r) - 1) * (tau_at_anchor - 1) / (tau(anchor) - 1)`` (the accepted drafts scale, the bonus stays).
    The anchor is interpolated (log rows) when it was not measured."""
    pts = sorted(curve.items())
    if anchor in curve:
        at = curve[anchor]
    else:
        lo = max((p for p in pts if p[0] < anchor), default=pts[0])
        hi = min((p for p in pts if p[0] > anchor), default=pts[-1])
        if lo[0] == hi[0]:
            at = lo[1]
        else:
            w = (math.log(anchor) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
            at = lo[1] + w * (hi[1] - lo[1])
    k = (tau_at_anchor - 1.0) / (at - 1.0) if at > 1.0 else 0.0
    return {r: 1.0 + (t - 1.0) * k for r, t in curve.items()}


def derive(report: dict[str, Any], taus: tuple[float, ...] = TAUS) -> None:
    """Adds to ``report``: ``round_cost_ar_steps`` (per configuration and rows), ``speedup_by_tau`` (the decode
    speedup a round of each tau would give: ``tau / round cost``), and, when ``report["tau_curve"]`` holds a
    measured tau per rows (the demo's fixed tree), ``best_rows``: per configuration and anchor tau (the curve
    rescaled to that tau at 32 rows: the published 2.9 and 4.7, and the demo's own), the tree size with the best
    speedup among the measured ones."""
    costs = _round_costs(report)
    report["round_cost_ar_steps"] = {base: {str(r): round(c, 3) for r, c in cs.items()} for base, cs in costs.items()}
    report["speedup_by_tau"] = {f"{base}/rows{r}": {f"tau{t:g}": round(t / c, 3) for t in taus}
                                for base, cs in costs.items() for r, c in cs.items() if r > 1}
    curve_raw = report.get("tau_curve")
    if not curve_raw:
        report["best_rows"] = None
        return
    curve = {int(r): float(t) for r, t in curve_raw.items()}
    curves = {"paper_tau2.9": scaled_curve(curve, 2.9), "paper_tau4.7": scaled_curve(curve, 4.7), "demo": curve}
    best: dict[str, dict[str, Any]] = {}
    for base, cs in costs.items():
        for name, taus_at in curves.items():
            scaled = {**taus_at, 1: 1.0}
            options = {r: scaled[r] / c for r, c in cs.items() if r in scaled}
            if not options:
                continue
            r_best = max(options, key=options.get)
            best.setdefault(base, {})[name] = {"rows": r_best, "tau": round(scaled[r_best], 3),
                                               "speedup": round(options[r_best], 3)}
    report["best_rows"] = best


def summary(report: dict[str, Any]) -> str:
    """A few lines for a person: per configuration the AR step, the round cost per rows, the drafter, and the
    best tree size per tau."""
    lines = [f"scale timing on {report['device']} ({report['dtype']}, contexts {report['contexts']}):"]
    for base, cs in report.get("round_cost_ar_steps", {}).items():
        ar = report["verify_ms"].get(f"{base}/rows1")
        draft = report["drafter_ms"].get(base)
        lines.append(f"  {base}: AR step {ar:.3f} ms, drafter {draft if draft is None else round(draft, 3)} ms, "
                     "round cost in AR steps " + ", ".join(f"{r} rows {c:.2f}" for r, c in cs.items() if r != "1"))
    for key, ms in report["verify_ms"].items():
        lines.append(f"  verify {key}: {ms:.3f} ms")
    for key, ms in report["drafter_ms"].items():
        lines.append(f"  drafter {key}: {ms:.3f} ms")
    for base, anchors in (report.get("best_rows") or {}).items():
        lines.append(f"  best rows {base}: " + ", ".join(f"{n} -> {b['rows']} rows (tau {b['tau']}, "
                                                         f"x{b['speedup']})" for n, b in anchors.items()))
    lines += [f"  error: {e}" for e in report["errors"]]
    return "\n".join(lines)


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"scale timing: {name} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"scale timing: {name} takes positive integers, got {text!r}")
    return values


def load_tau_curve(path: Path) -> dict[str, float]:
    """A tau-per-rows curve from a JSON file: ``{"4": 2.1, ...}``, or the device check's engine report (its
    ``tau_by_rows`` section)."""
    data = json.loads(path.read_text())
    data = data.get("tau_by_rows", data)
    data = data.get("tau_by_rows", data)
    curve = {str(int(r)): float(t) for r, t in data.items()}
    if not curve:
        raise ValueError(f"{path}: no tau per rows")
    return curve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glance_sgl.scale_timing", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--tiny", action="store_true", help="a tiny config instead of the 7B shapes (tests, CPU)")
    p.add_argument("--batches", default="1,8,32", help="batch sizes of the verify pass")
    p.add_argument("--drafter-batches", default=None, help="batch sizes of the drafter pass (default: --batches)")
    p.add_argument("--rows", default="1,4,8,16,32,64", help="verified rows per request (1: an AR step)")
    p.add_argument("--context", default="1024,4096",
                   help="cached tokens per request (an image prompt), comma-separated")
    p.add_argument("--eager-contexts", default=None,
                   help="on CUDA, the contexts also timed eagerly (default: every --context)")
    p.add_argument("--tau-curve", type=Path, default=None,
                   help="JSON of tau per rows ({\"4\": 2.1, ...} or the device check's engine report): adds the "
                        "best tree size per tau")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("scale timing: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    batches, rows, contexts = _ints(args.batches, "--batches"), _ints(args.rows, "--rows"), _ints(args.context,
                                                                                                 "--context")
    dbatches = _ints(args.drafter_batches, "--drafter-batches") if args.drafter_batches else None
    if 1 not in rows:
        rows = [1] + rows  # the AR step: the speedups are relative to it
    curve = None
    if args.tau_curve is not None:
        try:
            curve = load_tau_curve(args.tau_curve)
        except (OSError, ValueError, AttributeError) as exc:
            print(f"scale timing: --tau-curve {args.tau_curve}: {exc}; no best tree size", file=sys.stderr)
    report = measure(args.device, dtype, SHAPES_TINY if args.tiny else SHAPES_7B, batches, rows, contexts,
                     args.repeats, args.drafter_layers, drafter_batches=dbatches, partial=args.json,
                     eager_contexts=_ints(args.eager_contexts, "--eager-contexts") if args.eager_contexts else None)
    if curve:
        report["tau_curve"] = curve
        derive(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(summary(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
