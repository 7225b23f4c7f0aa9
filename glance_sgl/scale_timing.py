"""Timing at real scale: the planner's cost model for a 7B-class VLM target, measured on this device.

Builds, from a config (no download), a random-weight target with Qwen2.5-VL-7B's text shapes (28 layers, hidden
3584, GQA 28 / 4 heads, intermediate 18944, vocabulary 152064; Hugging Face ``Qwen2ForCausalLM``, the text
backbone of Qwen2.5-VL: M-RoPE costs what 1-D RoPE costs) and a GLANCE drafter sized for it
(``GlanceDrafter.for_target``: 5 layers and 5 tap layers by default, block 16). Then it times

- the verify pass: ``rows`` tree rows per request (1 = an AR step) over a context of ``--context`` tokens in a
  static KV cache, with a tree attention mask, for every batch size, eagerly and replayed from a CUDA graph;
- the drafter pass of a decode step (gather from a draft KV pool, drafter, top-k, budget tree) through the
  worker's own ``DraftPassRunner``, eagerly (static shapes) and from its CUDA graphs;

and derives the decode speedup each tau would give: ``tau * t_verify(1 row) / (t_verify(rows) + t_drafter)``.
Medians of ``--repeats`` timed calls after warm-up (CUDA events on a GPU). ``--tiny`` runs the same code on a
tiny config (what the CPU test does).

    python -m glance_sgl.scale_timing --device cuda --json scale.json
"""

from __future__ import annotations

import argparse
import json
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


def drafter_call(target, cfg, bs: int, context: int, device: str, dtype: torch.dtype, layers: int,
                 use_graphs: bool) -> Callable[[], Any]:
    """The worker's drafter pass (``DraftPassRunner``) for ``bs`` requests with ``context`` tokens each."""
    from glance_sgl.drafter import GlanceDrafter
    from glance_sgl.sglang.draft_graph import DraftPassRunner
    from glance_sgl.sglang.draft_pool import DraftKVPool

    drafter = GlanceDrafter.for_target(cfg, mask_token_id=0, num_hidden_layers=layers, num_taps=5,
                                       seed=0).to(device=device, dtype=dtype).eval()
    drafter.bind_target(target.model.embed_tokens, target.lm_head)
    pool = DraftKVPool(drafter, size=bs * context + 1, device=device, dtype=dtype)
    req_to_token = (1 + torch.arange(bs * context, device=device, dtype=torch.int32)).view(bs, context)
    runner = DraftPassRunner(drafter, pool, req_to_token, max_depth=drafter.config.block_size - 1,
                             branch_k=drafter.config.branch_k, budget=31, max_bs=max(bs, 1), use_graphs=use_graphs)
    rpi = torch.arange(bs, device=device)
    lengths = torch.full((bs,), context - 1, device=device)
    roots = torch.randint(0, cfg.vocab_size, (bs,), device=device)
    return lambda: runner.run(rpi, lengths, roots, context - 1)


def measure(device: str, dtype: torch.dtype, shapes: dict[str, Any], batches: list[int], rows: list[int],
            context: int, repeats: int, drafter_layers: int, progress: bool = True) -> dict[str, Any]:
    """The report: verify / drafter ms per (batch, rows) with and without CUDA graphs, and the speedups."""
    from tqdm import tqdm

    target, cfg = build_target(shapes, device, dtype)
    cuda = device.startswith("cuda")
    modes = ["eager", "graph"] if cuda else ["eager"]
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                              "dtype": str(dtype).removeprefix("torch."), "shapes": shapes, "context": context,
                              "drafter_layers": drafter_layers, "verify_ms": {}, "drafter_ms": {}, "errors": []}
    jobs = [(m, b, r) for m in modes for b in batches for r in rows]
    bar = tqdm(jobs + [(m, b, None) for m in modes for b in batches], desc="scale timing", disable=not progress)
    for mode, bs, r in bar:
        key = f"{mode}/bs{bs}" + (f"/rows{r}" if r is not None else "")
        try:
            if r is not None:
                fn = verify_call(target, cfg, bs, r, context, device)
                fn = graphed(fn, device) if mode == "graph" else fn
                report["verify_ms"][key] = round(timed(fn, device, repeats), 4)
            else:
                fn = drafter_call(target, cfg, bs, context, device, dtype, drafter_layers, mode == "graph")
                report["drafter_ms"][key] = round(timed(fn, device, repeats), 4)
        except Exception as exc:  # a failed configuration is reported, the others still run
            report["errors"].append(f"{key}: {type(exc).__name__}: {exc}"[:400])
        if cuda:
            torch.cuda.empty_cache()
    report["speedup_by_tau"] = speedups(report, modes, batches, rows)
    return report


def speedups(report: dict[str, Any], modes: list[str], batches: list[int], rows: list[int],
             taus: tuple[float, ...] = (2.0, 3.0, 4.0, 5.0, 6.0)) -> dict[str, dict[str, float]]:
    """``tau * t_verify(1 row) / (t_verify(rows) + t_drafter)`` per mode / batch / rows > 1."""
    out: dict[str, dict[str, float]] = {}
    for mode in modes:
        for bs in batches:
            ar = report["verify_ms"].get(f"{mode}/bs{bs}/rows1")
            draft = report["drafter_ms"].get(f"{mode}/bs{bs}")
            for r in rows:
                v = report["verify_ms"].get(f"{mode}/bs{bs}/rows{r}")
                if r == 1 or None in (ar, draft, v):
                    continue
                out[f"{mode}/bs{bs}/rows{r}"] = {f"tau{t:g}": round(t * ar / (v + draft), 3) for t in taus}
    return out


def summary(report: dict[str, Any]) -> str:
    """A few lines for a person: per mode and batch, the AR step, the verify at each row count, the drafter."""
    lines = [f"scale timing on {report['device']} ({report['dtype']}, context {report['context']}):"]
    for key, ms in report["verify_ms"].items():
        lines.append(f"  verify {key}: {ms:.3f} ms")
    for key, ms in report["drafter_ms"].items():
        lines.append(f"  drafter {key}: {ms:.3f} ms")
    for key, s in report["speedup_by_tau"].items():
        lines.append(f"  speedup {key}: " + ", ".join(f"{k}={v}" for k, v in s.items()))
    lines += [f"  error: {e}" for e in report["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glance_sgl.scale_timing", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--tiny", action="store_true", help="a tiny config instead of the 7B shapes (tests, CPU)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--rows", default="1,8,16,32")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per request (an image prompt)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("scale timing: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    try:
        batches = [int(x) for x in args.batches.split(",")]
        rows = [int(x) for x in args.rows.split(",")]
    except ValueError:
        p.error("--batches and --rows are comma-separated integers")
    if 1 not in rows:
        rows = [1] + rows  # the AR step: the speedups are relative to it
    report = measure(args.device, dtype, SHAPES_TINY if args.tiny else SHAPES_7B, batches, rows, args.context,
                     args.repeats, args.drafter_layers)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(summary(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
