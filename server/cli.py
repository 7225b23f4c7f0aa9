"""``glance serve``: the gateway under uvicorn, on the bundled demo checkpoints by default."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from .config import MiB, ServerConfig


def _fail(message: str):
    from glance_sgl.cli import CLIError

    raise CLIError(message)


def resolve_checkpoints(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """--model / --drafter, else the bundled demo pair; a clear error when they are missing."""
    from glance_sgl.demo import paths

    if args.model:
        model = Path(args.model)
        drafter = Path(args.drafter) if args.drafter else None
    else:
        model = paths.bundled_target()
        drafter = Path(args.drafter) if args.drafter else paths.bundled_drafter()
        if not (model / "config.json").is_file():
            _fail(f"the bundled demo model is missing ({model}); build it with `glance demo build`, or pass "
                  "--model DIR (and --drafter DIR); `glance tiny --out DIR` makes a random smoke-test pair")
    if not (model / "config.json").is_file():
        _fail(f"--model {model}: not a Hugging Face model directory (config.json missing)")
    if drafter is not None and not (drafter / "config.json").is_file():
        if args.drafter or args.backend == "embedded" and args.mode != "ar":
            _fail(f"drafter {drafter}: not a GLANCE drafter directory (config.json missing); pass --drafter DIR "
                  "or --mode ar")
        drafter = None
    if args.backend == "embedded" and drafter is None and args.mode != "ar":
        _fail("speculative decoding needs a drafter: pass --drafter DIR (or --mode ar)")
    return model, drafter


def build_config(args: argparse.Namespace) -> ServerConfig:
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            _fail(f"--api-key-env {args.api_key_env}: the variable is unset or empty")
    upstream_key = None
    if args.upstream_api_key_env:
        upstream_key = os.environ.get(args.upstream_api_key_env)
        if not upstream_key:
            _fail(f"--upstream-api-key-env {args.upstream_api_key_env}: the variable is unset or empty")
    if args.upstream and args.backend != "sglang":
        _fail("--upstream is for --backend sglang")
    if args.upstream and args.planner:
        _fail("--planner cannot reach a running SGLang server (--upstream): start it with GLANCE_PLANNER=auto|fixed")
    if args.allow_remote_images and not args.remote_image_host:
        _fail("--allow-remote-images needs at least one --remote-image-host")
    return ServerConfig(
        served_model_name=args.served_model_name, api_key=api_key, max_body_bytes=int(args.max_body_mb * MiB),
        max_images=args.max_images, max_image_bytes=int(args.max_image_mb * MiB),
        max_image_pixels=args.max_image_pixels, max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=min(args.default_max_tokens, args.max_tokens_limit), max_queue=args.max_queue,
        upstream_concurrency=args.upstream_concurrency, request_timeout_s=args.request_timeout,
        allow_remote_images=args.allow_remote_images, remote_image_hosts=args.remote_image_host or [],
        trusted_image_networks=args.trusted_image_network or [], calibrate=not args.no_calibrate,
        upstream_url=args.upstream, upstream_api_key=upstream_key, ar_ms_per_token=args.ar_ms_per_token, debug_faults=args.debug_faults,
    )


def build_app(args: argparse.Namespace):
    """Load what the backend needs and return (ASGI app, description)."""
    import torch
    from transformers import AutoProcessor

    from glance_sgl.engine import GlanceEngine

    from .app import create_app

    config = build_config(args)
    model, drafter = resolve_checkpoints(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.backend == "sglang":
        from .sglang import SGLangBackend

        managed = None
        if not args.upstream:  # no URL: launch SGLang with the GLANCE plugin as a managed subprocess
            managed = launch_managed_sglang(args, model, drafter)
            args.upstream = config.upstream_url = managed.url
        processor = AutoProcessor.from_pretrained(model)
        backend = SGLangBackend(args.upstream, processor, config)
        backend.managed_upstream = managed
        return create_app(config, backend, processor), f"sglang upstream {args.upstream} (prompts: {model})"
    from .embedded import EmbeddedBackend

    planner = {"planner": args.planner} if drafter is not None and args.planner else {}
    engine = GlanceEngine.load(model, drafter, mode=args.mode if drafter is not None else "ar",
                               budget=args.budget, branch_k=args.branch_k, **planner)
    backend = EmbeddedBackend(engine, config)
    return create_app(config, backend, engine.target.processor), f"embedded {model} + {drafter or 'no drafter'}"


def launch_managed_sglang(args: argparse.Namespace, model: Path, drafter: Path | None):
    """Start ``sglang.launch_server`` (GLANCE when there is a drafter) on loopback; the gateway's shutdown stops
    it (and atexit, for exits that skip the shutdown). Returns the server handle."""
    import atexit
    import shlex

    import torch

    from glance_sgl.sglang.launch import launch_sglang
    from glance_sgl.sglang.planning import PLANNER_ENV

    cpu = args.sglang_device == "cpu" or (args.sglang_device == "auto" and not torch.cuda.is_available())
    logging.getLogger("glance_server").info("launching SGLang (%s) on 127.0.0.1:%d", "CPU mode" if cpu else "GPU",
                                            args.sglang_port)
    try:
        handle = launch_sglang(model, drafter, port=args.sglang_port, cpu=cpu,
                               extra_args=shlex.split(args.sglang_args or ""), timeout=args.sglang_timeout,
                               env={PLANNER_ENV: args.planner} if args.planner else None)
    except (RuntimeError, TimeoutError, OSError) as exc:
        _fail(f"could not start SGLang: {exc}")
    atexit.register(handle.stop)
    return handle


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, what = build_app(args)
    logging.getLogger("glance_server").info("serving %s on http://%s:%d", what, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10,
                limit_concurrency=args.limit_concurrency)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible gateway (embedded engine or an SGLang upstream)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", choices=["embedded", "sglang"], default="embedded")
    p.add_argument("--upstream", help="SGLang server URL for --backend sglang (without it, the gateway launches "
                   "SGLang with the GLANCE plugin itself)")
    p.add_argument("--sglang-port", type=int, default=30000, help="port of a launched SGLang server")
    p.add_argument("--sglang-device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="launched SGLang: CPU mode or GPU (auto: GPU when CUDA is available)")
    p.add_argument("--sglang-args", default="", help="extra arguments for a launched sglang.launch_server")
    p.add_argument("--sglang-timeout", type=float, default=900.0, help="seconds to wait for a launched SGLang")
    p.add_argument("--upstream-api-key-env", metavar="VAR", help="bearer token for the upstream server")
    p.add_argument("--model", help="Hugging Face model directory (default: the bundled demo); with --backend "
                   "sglang it supplies the chat template")
    p.add_argument("--drafter", help="GLANCE drafter directory (default: the bundled demo drafter)")
    p.add_argument("--mode", choices=["glance", "chain", "ar"], default="glance", help="default decoding")
    p.add_argument("--planner", choices=["auto", "fixed"], default=None,
                   help="GLANCE planner (default auto; embedded requests may choose with \"glance\": {\"planner\": "
                   "...}): auto picks the tree size per round from measured costs and predicted acceptance, down to "
                   "no draft; fixed verifies the --budget tree every round (the ablation). A launched SGLang server "
                   "gets it as GLANCE_PLANNER")
    p.add_argument("--budget", type=int, default=None, help="tree budget (default: the drafter's)")
    p.add_argument("--branch-k", type=int, default=None)
    p.add_argument("--served-model-name", default="glance-demo")
    p.add_argument("--api-key-env", metavar="VAR", help="require 'Authorization: Bearer $VAR'")
    p.add_argument("--max-queue", type=int, default=32, help="waiting requests before 429")
    p.add_argument("--upstream-concurrency", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--max-body-mb", type=float, default=32.0)
    p.add_argument("--max-images", type=int, default=4)
    p.add_argument("--max-image-mb", type=float, default=8.0)
    p.add_argument("--max-image-pixels", type=int, default=16_777_216)
    p.add_argument("--max-tokens-limit", type=int, default=2048)
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--allow-remote-images", action="store_true", help="fetch http(s) image URLs (allowlist)")
    p.add_argument("--remote-image-host", action="append", metavar="HOST", help="allowed host or *.domain")
    p.add_argument("--trusted-image-network", action="append", metavar="CIDR",
                   help="private network remote images may come from anyway")
    p.add_argument("--ar-ms-per-token", type=float, default=None, help="sglang backend: AR cost for estimates")
    p.add_argument("--no-calibrate", action="store_true", help="skip the start-up AR calibration")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--limit-concurrency", type=int, default=None, help="uvicorn connection limit")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--debug-faults", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_serve)
