"""``glance serve``: the gateway under uvicorn, on the bundled demo checkpoints by default."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import sys
import urllib.parse
from pathlib import Path

from glance_sgl.cli import int_in, positive_float

from .config import MiB, RestartPolicy, ServerConfig, parse_api_keys


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


def default_draft_sources() -> tuple[str, ...]:
    """What the embedded engine drafts from unless ``--draft-sources`` says otherwise: the drafter and n-gram matches
    merged, as the SGLang worker does (``glance_sgl.round.DEFAULT_DRAFT_SOURCES``), or the drafter alone, said on
    stderr, where SGLang's ``NgramCorpus`` cannot run here."""
    from glance_sgl.ngram_source import ngram_corpus_class
    from glance_sgl.round import DEFAULT_DRAFT_SOURCES

    reason = ngram_corpus_class()[1]
    if reason is None:
        return DEFAULT_DRAFT_SOURCES
    print(f"glance serve: drafting from the drafter alone ({reason})", file=sys.stderr)
    return ("drafter",)


def draft_settings(args: argparse.Namespace) -> tuple[tuple[str, ...] | None, str | None]:
    """``--draft-sources`` (validated, canonical order; None: the default, :func:`default_draft_sources`) and
    ``--ngram-corpus`` (None: the n-gram source's default, shared); a CLI error naming the flag otherwise."""
    from glance_sgl.round import check_draft_sources

    sources = None
    if args.draft_sources is not None:
        try:
            sources = check_draft_sources([n.strip() for n in args.draft_sources.split(",") if n.strip()])
        except ValueError as exc:
            _fail(f"--draft-sources {args.draft_sources!r}: {exc}")
    from glance_sgl.round import DEFAULT_DRAFT_SOURCES

    # what the engine drafts from: the sources given, else the default (the n-gram source drafts in mode glance)
    drafts = sources or (DEFAULT_DRAFT_SOURCES if args.mode == "glance" or args.backend == "sglang" else ())
    if args.ngram_corpus is not None and "ngram" not in drafts:
        _fail("--ngram-corpus scopes the n-gram source's corpus: pass --draft-sources with ngram "
              "(e.g. --draft-sources drafter,ngram)")
    if args.upstream and sources is not None:
        _fail("--draft-sources cannot reach a running SGLang server (--upstream): start it with "
              "GLANCE_DRAFT_SOURCES=drafter,ngram (and GLANCE_NGRAM_CORPUS)")
    if args.backend == "sglang" and args.ngram_corpus == "per-key":
        _fail("--ngram-corpus per-key: the SGLang worker is not told the requests' API keys, so every request "
              "would share one corpus; use shared or off with --backend sglang")
    if sources is not None and "ngram" in sources and args.mode != "glance":
        _fail(f"--draft-sources {args.draft_sources}: the n-gram source drafts in --mode glance, not {args.mode}")
    return sources, args.ngram_corpus


def build_config(args: argparse.Namespace) -> ServerConfig:
    api_keys: tuple[str, ...] = ()
    if args.api_key_env:
        try:
            api_keys = parse_api_keys(os.environ.get(args.api_key_env, ""), f"--api-key-env {args.api_key_env}")
        except ValueError as exc:
            _fail(str(exc))
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
    if args.default_max_tokens > args.max_tokens_limit:
        _fail(f"--default-max-tokens {args.default_max_tokens} is above --max-tokens-limit {args.max_tokens_limit}")
    try:
        restart = RestartPolicy(max_restarts=args.sglang_max_restarts, window_s=args.sglang_restart_window,
                                backoff_s=args.sglang_restart_backoff, max_backoff_s=args.sglang_restart_max_backoff)
    except ValueError as exc:
        _fail(str(exc))
    try:  # the flags' own types check them first; ServerConfig names a setting they let through
        return ServerConfig(
            served_model_name=args.served_model_name, api_keys=api_keys, max_body_bytes=int(args.max_body_mb * MiB),
            max_images=args.max_images, max_image_bytes=int(args.max_image_mb * MiB),
            max_image_pixels=args.max_image_pixels, max_tokens_limit=args.max_tokens_limit,
            default_max_tokens=args.default_max_tokens, max_queue=args.max_queue,
            upstream_concurrency=args.upstream_concurrency, request_timeout_s=args.request_timeout,
            allow_remote_images=args.allow_remote_images, remote_image_hosts=args.remote_image_host or [],
            trusted_image_networks=args.trusted_image_network or [], calibrate=not args.no_calibrate,
            upstream_url=args.upstream, upstream_api_key=upstream_key, ar_ms_per_token=args.ar_ms_per_token,
            sglang_restart=restart, debug_faults=args.debug_faults, threads=args.threads,
        )
    except ValueError as exc:
        _fail(str(exc))


def build_app(args: argparse.Namespace):
    """Load what the backend needs and return (ASGI app, description)."""
    import torch
    from transformers import AutoProcessor

    from glance_sgl.engine import GlanceEngine

    from .app import create_app

    config = build_config(args)
    sources, corpus = draft_settings(args)
    model, drafter = resolve_checkpoints(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.backend == "sglang":
        from glance_sgl.sglang.launch import model_context_length

        from .sglang import SGLangBackend

        managed, note = None, "the upstream server was started with its own --context-length"
        if not args.upstream:  # no URL: launch SGLang with the GLANCE plugin as a managed, supervised subprocess
            managed = launch_managed_sglang(args, config, model, drafter, sources, corpus)
            args.upstream = config.upstream_url = managed.url
            note = ("--sglang-args sets --context-length" if "--context-length" in (args.sglang_args or "")
                    else "the launched SGLang server derived its own (see its log)")
        processor = AutoProcessor.from_pretrained(model)
        backend = SGLangBackend(args.upstream, processor, config, managed=managed,
                                model_context_length=model_context_length(model), context_note=note)
        what = f"sglang upstream {args.upstream}{' (launched, supervised)' if managed else ''} (prompts: {model})"
        return create_app(config, backend, processor), what
    from .embedded import EmbeddedBackend

    options: dict = {"planner": args.planner} if drafter is not None and args.planner else {}
    defaulted = sources is None and drafter is not None and args.mode == "glance"
    if defaulted:
        sources = default_draft_sources()
    if sources is not None:
        if drafter is None and sources != ("drafter",):
            _fail(f"--draft-sources {args.draft_sources}: speculative decoding needs a drafter (--drafter DIR)")
        options["draft_sources"] = sources

    def load(**extra):
        return GlanceEngine.load(model, drafter, mode=args.mode if drafter is not None else "ar", budget=args.budget,
                                 branch_k=args.branch_k, ngram_corpus=corpus,
                                 compile_drafter=args.compile_drafter == "on", **{**options, **extra})

    try:
        engine = load()
    except ValueError as exc:  # e.g. the n-gram source is unavailable (SGLang's NgramCorpus did not build)
        if not (defaulted and "ngram" in sources and "n-gram source unavailable" in str(exc)):
            _fail(f"--draft-sources {args.draft_sources}: {exc}")
        print(f"glance serve: drafting from the drafter alone ({exc})", file=sys.stderr)
        engine = load(draft_sources=("drafter",))
    engine.freeze_gc()  # the start-up objects leave the collector's view, as SGLang's server does after its warm-up
    backend = EmbeddedBackend(engine, config)
    return create_app(config, backend, engine.target.processor), f"embedded {model} + {drafter or 'no drafter'}"


def launch_managed_sglang(args: argparse.Namespace, config: ServerConfig, model: Path, drafter: Path | None,
                          sources: tuple[str, ...] | None = None, corpus: str | None = None):
    """Start ``sglang.launch_server`` (GLANCE when there is a drafter) on loopback and wait until it is ready (a
    clear start-up error otherwise); returns its supervisor (:class:`~glance_server.supervisor.ManagedSGLang`,
    which restarts it by ``config.sglang_restart``). The gateway's shutdown stops it (and atexit, for exits that
    skip the shutdown). ``--planner``, ``--draft-sources`` and ``--ngram-corpus`` reach it as the GLANCE worker's
    environment (``GLANCE_PLANNER``, ``GLANCE_DRAFT_SOURCES``, ``GLANCE_NGRAM_CORPUS``)."""
    import atexit
    import functools
    import shlex
    import tempfile

    import torch

    from glance_sgl.sglang.launch import launch_sglang

    from .supervisor import ManagedSGLang

    cpu = args.sglang_device == "cpu" or (args.sglang_device == "auto" and not torch.cuda.is_available())
    log_path = Path(args.sglang_log or Path(tempfile.gettempdir()) / f"glance-sglang-{args.sglang_port}.log")
    logging.getLogger("glance_server").info("launching SGLang (%s) on 127.0.0.1:%d, its log: %s",
                                            "CPU mode" if cpu else "GPU", args.sglang_port, log_path)
    launch = functools.partial(launch_sglang, model, drafter, port=args.sglang_port, cpu=cpu,
                               extra_args=shlex.split(args.sglang_args or ""), log_path=log_path,
                               env=worker_env(args.planner, sources, corpus) or None)
    try:
        handle = launch(timeout=args.sglang_timeout)
    except (RuntimeError, TimeoutError, OSError) as exc:
        _fail(f"could not start SGLang: {exc}")
    managed = ManagedSGLang(handle, functools.partial(launch, wait=False, append_log=True), config.sglang_restart,
                            ready_timeout_s=args.sglang_timeout)
    atexit.register(lambda: managed.server.stop())
    return managed


def worker_env(planner: str | None, sources: tuple[str, ...] | None, corpus: str | None) -> dict[str, str]:
    """The GLANCE worker's settings for a launched SGLang server (``glance_sgl.sglang.settings``)."""
    from glance_sgl.sglang.settings import PLANNER_ENV

    env = {PLANNER_ENV: planner} if planner else {}
    if sources is not None:
        env["GLANCE_DRAFT_SOURCES"] = ",".join(sources)
    if corpus is not None:
        env["GLANCE_NGRAM_CORPUS"] = corpus
    return env


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until stopped: 0 on a normal shutdown, :data:`~glance_server.supervisor.EXIT_UPSTREAM_FAILED` when the
    gateway gave up on the SGLang server it launched (its restarts were used up)."""
    import uvicorn

    from .supervisor import EXIT_UPSTREAM_FAILED

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, what = build_app(args)
    logging.getLogger("glance_server").info("serving %s on http://%s:%d", what, args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=10, limit_concurrency=args.limit_concurrency))
    managed = getattr(app.gateway.backend, "managed", None)
    if managed is not None:
        managed.on_give_up = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on (as uvicorn.run, a clean stop)
        pass
    if managed is not None and managed.gave_up:
        logging.getLogger("glance_server").critical("exiting with status %d: %s", EXIT_UPSTREAM_FAILED,
                                                    managed.reason())
        return EXIT_UPSTREAM_FAILED
    return 0


_HOST_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def host_pattern(text: str) -> str:
    """An argparse ``type`` for ``--remote-image-host``: a host name, ``*.`` and a domain, or an IP address."""
    pattern = text.strip().lower().rstrip(".")
    name = pattern[2:] if pattern.startswith("*.") else pattern
    try:
        ipaddress.ip_address(name.strip("[]"))
        return pattern
    except ValueError:
        pass
    if not name or len(name) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in name.split(".")):
        raise argparse.ArgumentTypeError(f"not a host name, *.domain or IP address: {text!r}")
    return pattern


def network(text: str) -> str:
    """An argparse ``type`` for ``--trusted-image-network``: a network in CIDR notation (``10.0.0.0/8``)."""
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def upstream_url(text: str) -> str:
    """An argparse ``type`` for ``--upstream``: an http(s) URL with a host."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL with a host: {text!r}")
    return text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible gateway (embedded engine or an SGLang upstream)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_in(0, 65535), default=8000,
                   help="0: a free port the system picks (the log says which)")
    p.add_argument("--backend", choices=["embedded", "sglang"], default="embedded")
    p.add_argument("--upstream", type=upstream_url, help="SGLang server URL for --backend sglang (without it, the "
                   "gateway launches SGLang with the GLANCE plugin itself)")
    p.add_argument("--sglang-port", type=int_in(1, 65535), default=30000, help="port of a launched SGLang server")
    p.add_argument("--sglang-device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="launched SGLang: CPU mode or GPU (auto: GPU when CUDA is available)")
    p.add_argument("--sglang-args", default="", help="extra arguments for a launched sglang.launch_server")
    p.add_argument("--sglang-timeout", type=positive_float, default=900.0, help="seconds to wait for a launched SGLang "
                   "(at start-up and at each restart)")
    p.add_argument("--sglang-log", metavar="FILE", default=None, help="the launched SGLang server's output, "
                   "appended across restarts (default: glance-sglang-PORT.log in the temp directory)")
    p.add_argument("--sglang-max-restarts", type=int, default=RestartPolicy.max_restarts,
                   help="a launched SGLang server that dies is started again; after more failures than this "
                   "within --sglang-restart-window the gateway exits with status 3 (0: at the first failure)")
    p.add_argument("--sglang-restart-window", type=float, default=RestartPolicy.window_s, metavar="SECONDS",
                   help="the window --sglang-max-restarts counts failures in")
    p.add_argument("--sglang-restart-backoff", type=float, default=RestartPolicy.backoff_s, metavar="SECONDS",
                   help="wait before the first restart, doubled for each further failure within the window")
    p.add_argument("--sglang-restart-max-backoff", type=float, default=RestartPolicy.max_backoff_s,
                   metavar="SECONDS", help="the longest wait before a restart")
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
    p.add_argument("--draft-sources", metavar="SOURCES", default=None,
                   help="candidate sources of the verify tree, comma-separated: drafter (the block drafter), ngram "
                   "(n-gram matches over the request's prompt, its output and recent answers: SGLang's NgramCorpus, "
                   "no model pass) or drafter,ngram (one merged tree; the default, in both engines). Embedded requests may "
                   "choose a subset with \"glance\": {\"draft_sources\": ...}; a launched SGLang server gets it "
                   "as GLANCE_DRAFT_SOURCES")
    p.add_argument("--ngram-corpus", choices=["shared", "per-key", "off"], default=None,
                   help="which recent answers the n-gram source matches besides the request's own tokens: shared "
                   "(every tenant's; the default), per-key (the same API key's only; requests without a key share "
                   "one anonymous corpus) or off. A shared corpus is a timing side channel between tenants "
                   "(docs/operations.md)")
    p.add_argument("--compile-drafter", choices=["on", "off"], default="on",
                   help="embedded backend on a CPU: the drafter's block pass through torch.compile (compiled "
                        "at start-up; default: on)")
    p.add_argument("--budget", type=int_in(1), default=None, help="tree budget (default: the drafter's)")
    p.add_argument("--branch-k", type=int_in(1), default=None)
    p.add_argument("--served-model-name", default="glance-demo")
    p.add_argument("--api-key-env", metavar="VAR", help="require 'Authorization: Bearer KEY' where KEY is $VAR, or "
                   "one of its comma-separated keys (one per tenant: --ngram-corpus per-key keeps their corpora "
                   "apart)")
    p.add_argument("--max-queue", type=int_in(1), default=32, help="waiting requests before 429")
    p.add_argument("--upstream-concurrency", type=int_in(1), default=16)
    p.add_argument("--request-timeout", type=positive_float, default=600.0)
    p.add_argument("--max-body-mb", type=positive_float, default=32.0)
    p.add_argument("--max-images", type=int_in(0), default=4)
    p.add_argument("--max-image-mb", type=positive_float, default=8.0)
    p.add_argument("--max-image-pixels", type=int_in(1), default=16_777_216)
    p.add_argument("--max-tokens-limit", type=int_in(1), default=2048)
    p.add_argument("--default-max-tokens", type=int_in(1), default=256)
    p.add_argument("--allow-remote-images", action="store_true", help="fetch http(s) image URLs (allowlist)")
    p.add_argument("--remote-image-host", action="append", metavar="HOST", type=host_pattern,
                   help="allowed host or *.domain")
    p.add_argument("--trusted-image-network", action="append", metavar="CIDR", type=network,
                   help="private network remote images may come from anyway")
    p.add_argument("--ar-ms-per-token", type=positive_float, default=None, help="sglang backend: AR cost for estimates")
    p.add_argument("--no-calibrate", action="store_true", help="skip the start-up AR calibration")
    p.add_argument("--threads", type=int_in(1), default=None,
                   help="torch CPU threads of the engine (default: the faster of torch's count and 1, timed at "
                        "start-up in the engine thread)")
    p.add_argument("--limit-concurrency", type=int_in(1), default=None, help="uvicorn connection limit")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--debug-faults", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_serve)
