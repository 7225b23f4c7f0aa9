"""The ``glance`` command.

Subcommands live next to the code they drive: each module listed in ``SUBCOMMAND_MODULES`` exposes
``add_parser(subparsers)``, which registers its subcommand and sets ``func`` (taking the parsed args and
returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

SUBCOMMAND_MODULES = [
    "glance_sgl.cli",  # generate (below)
    "glance_sgl.demo.cli",  # demo build, bench
    "glance_sgl.train.cli",  # distill, train-drafter
    "glance_server.cli",  # serve (issue 4)
    "glance_loadtest.cli",  # loadtest (issue 8)
]


class CLIError(Exception):
    """A user-facing error: printed as ``glance: error: ...`` with exit code 2."""


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``low .. high`` (``high`` None: no upper bound); anything else is
    argparse's error naming the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            rule = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def default_checkpoints() -> tuple[Path | None, Path | None]:
    """The bundled demo target and drafter, when present."""
    try:
        from .demo import paths
    except ImportError:
        return None, None
    model, drafter = paths.bundled_target(), paths.bundled_drafter()
    return (model if model.is_dir() else None), (drafter if drafter.is_dir() else None)


def load_image(path: str):
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise CLIError(f"image not found: {path}")
    try:
        with Image.open(p) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise CLIError(f"not a readable image: {path} ({exc})") from exc


def build_messages(prompt: str, images: list[Any]) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
    content.append({"type": "text", "text": prompt})
    return [{"role": "user", "content": content}]


def format_metrics(m: dict[str, Any]) -> str:
    ent = m["mean_root_entropy"]
    planner = f", planner {m['planner']}" if m.get("planner") else ""
    predicted = m.get("predicted_tokens_per_round")
    lines = [
        f"mode {m['mode']}{planner}: {m['completion_tokens']} tokens, prompt {m['prompt_tokens']} tokens",
        f"tau {m['tau']:.2f} (tau-1 {m['tau_minus_1']:.2f}) over {m['rounds']} rounds; "
        f"drafted {m['drafted_tokens']}, accepted {m['accepted_tokens']}",
        f"acceptance histogram {m['acceptance_histogram']}",
        f"rows verified per round {m.get('rows_histogram')}, {m.get('rounds_without_drafting')} rounds without "
        "drafting" + (f"; planner predicted {predicted:.2f} tokens per round" if predicted is not None else ""),
        f"prefill {m['prefill_ms']:.1f} ms, decode {m['decode_ms']:.1f} ms "
        f"({m['decode_ms_per_token']:.2f} ms/token, {m['decode_tokens_per_s']:.1f} tokens/s)",
        "mean root entropy " + (f"{ent:.3f} nats" if ent is not None else "n/a"),
    ]
    if m.get("draft_sources"):
        per = ", ".join(f"{k} {v['accepted_tokens']} ({v['rounds']} rounds)" for k, v in m["sources"].items())
        lines.append(f"draft sources {','.join(m['draft_sources'])}; accepted tokens per source: {per}")
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .engine import GlanceEngine, RequestError, SamplingParams
    from .target import TargetError

    demo_model, demo_drafter = default_checkpoints()
    model = Path(args.model) if args.model else demo_model
    drafter = Path(args.drafter) if args.drafter else (demo_drafter if not args.model else None)
    if model is None:
        raise CLIError("no --model given and no bundled demo model found (build it with `glance demo build`)")
    if not (model / "config.json").is_file():
        raise CLIError(f"--model {model}: not a Hugging Face model directory (config.json missing)")
    if drafter is None and not args.ar:
        raise CLIError("--drafter is needed for speculative decoding (or pass --ar)")
    if drafter is not None and not (drafter / "config.json").is_file():
        raise CLIError(f"--drafter {drafter}: not a GLANCE drafter directory (config.json missing)")
    if args.max_tokens < 1:
        raise CLIError("--max-tokens must be >= 1")
    images = [load_image(p) for p in args.image]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.planner is not None and (args.ar or args.mode != "glance"):
        raise CLIError("--planner applies to GLANCE tree decoding (--mode glance), not to --ar or --mode chain")
    sources = None
    if args.draft_sources is not None:
        from .round import check_draft_sources

        if args.ar or args.mode != "glance":
            raise CLIError("--draft-sources applies to GLANCE tree decoding (--mode glance), not to --ar or --mode "
                           "chain")
        try:
            sources = check_draft_sources([n.strip() for n in args.draft_sources.split(",") if n.strip()])
        except ValueError as exc:
            raise CLIError(f"--draft-sources {args.draft_sources!r}: {exc}") from None
    drafter = None if args.ar and drafter is None else drafter
    planner: dict[str, Any] = {"planner": args.planner} if args.planner is not None and drafter is not None else {}
    if sources is not None:
        planner["draft_sources"] = sources
    try:
        engine = GlanceEngine.load(model, drafter, **planner)
    except ValueError as exc:  # e.g. the n-gram source is unavailable here
        raise CLIError(f"--draft-sources {args.draft_sources}: {exc}") from None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            stop=args.stop or [], seed=args.seed)
    try:
        result = engine.generate(build_messages(args.prompt, images), params, mode="ar" if args.ar else args.mode)
    except (RequestError, TargetError) as exc:
        raise CLIError(str(exc)) from exc
    if args.json:
        print(json.dumps(result.to_dict(per_round=True)))
    else:
        print(result.text)
        print("---", file=sys.stderr)
        print(format_metrics(result.metrics.to_dict()), file=sys.stderr)
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    """Build a tiny random target and drafter: a smoke-test checkpoint pair for trying the engine."""
    from .checkpoints import build_random_pair

    target, drafter = build_random_pair(args.out, arch=args.arch, seed=args.seed)
    print(f"target:  {target}\ndrafter: {drafter}")
    return 0


def convert_drafter(src: str | Path, out: str | Path | None = None) -> Path:
    """Rewrite a drafter checkpoint (the former ``glance_drafter`` layout, or any DFlash one we can run) as a
    DFlash checkpoint: ``config.json`` in the DFlash layout (GLANCE settings in its ``glance`` section) and the
    same tensors in ``model.safetensors``. ``out`` defaults to ``src`` (in place). Returns the output directory."""
    from .drafter import GlanceDrafter

    src = Path(src)
    if not (src / "config.json").is_file():
        raise CLIError(f"{src}: not a drafter directory (config.json missing)")
    try:
        drafter = GlanceDrafter.from_pretrained(src)
    except (ValueError, FileNotFoundError) as exc:
        raise CLIError(f"{src}: {exc}") from exc
    return drafter.save_pretrained(Path(out) if out else src)


def cmd_convert(args: argparse.Namespace) -> int:
    out = convert_drafter(args.src, args.out)
    print(f"DFlash-format drafter: {out}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    conv = sub.add_parser("convert", help="rewrite a drafter checkpoint in the DFlash format (SGLang's DFLASH and "
                          "DFlash's reference code read it)")
    conv.add_argument("src", help="drafter directory (former glance_drafter layout or DFlash)")
    conv.add_argument("--out", help="output directory (default: rewrite SRC in place)")
    conv.set_defaults(func=cmd_convert)
    tiny = sub.add_parser("tiny", help="build a tiny RANDOM target + drafter pair (smoke tests, not answers)")
    tiny.add_argument("--out", required=True, help="directory to write target/ and drafter/ into")
    tiny.add_argument("--arch", choices=["qwen2_5_vl", "qwen2_vl", "qwen3_vl"], default="qwen2_5_vl")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_tiny)
    gen = sub.add_parser("generate", help="answer one image + prompt with GLANCE (or autoregressively with --ar)")
    gen.add_argument("--model", help="Hugging Face Qwen2.5-VL / Qwen2-VL directory (default: bundled demo)")
    gen.add_argument("--drafter", help="GLANCE drafter directory (default: bundled demo drafter)")
    gen.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    gen.add_argument("--prompt", required=True, help="the question or instruction")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--mode", choices=["glance", "chain"], default="glance", help="tree (default) or width-1 chain")
    gen.add_argument("--planner", choices=["auto", "fixed"], default=None,
                     help="GLANCE tree size per round: auto (cost-aware, may skip drafting; the engine's default) "
                     "or fixed (the drafter's budget tree every round, the ablation)")
    gen.add_argument("--draft-sources", metavar="SOURCES", default=None,
                     help="candidate sources of the verify tree, comma-separated: drafter (default), ngram (n-gram "
                     "matches over the prompt and the output, no drafter pass) or drafter,ngram (one merged tree)")
    gen.add_argument("--ar", action="store_true", help="plain autoregressive decoding (the baseline)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, metrics")
    gen.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glance", description="GLANCE speculative decoding for VLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        if name == "glance_sgl.cli":
            add_parser(sub)
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:  # rooms of the product that are not built yet are simply absent
            importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        parser.exit(2, f"glance: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # `python -m glance_sgl.cli` runs this file as __main__; subcommands raise glance_sgl.cli.CLIError, a
    # different class from __main__.CLIError, so dispatch through the imported module
    from glance_sgl.cli import main as package_main

    sys.exit(package_main())
