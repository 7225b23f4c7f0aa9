"""``python -m glance_loadtest`` / ``glance loadtest``: a headless, bounded load test of a GLANCE gateway."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from .dataset import DEMO_TASKS, parse_size
from .runner import LoadConfig, run_load

EPILOG = """examples:
  glance loadtest --users 8 --spawn-rate 2 --run-time 60                    # closed loop, 8 users
  glance loadtest --request-rate 4 --max-concurrency 16 --num-requests 200  # open loop (Poisson)
  glance loadtest --dataset demo --demo-tasks chart,document --goodput ttft:500 tpot:100 \\
                  --json out/run.json --csv out/requests.csv --plot out/plots
Every run stops by itself (--run-time, default 60 s; --num-requests) and talks to --url only."""


def _weights(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        name, sep, w = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"task weight {item!r}: use NAME=WEIGHT")
        try:
            out[name.strip()] = float(w)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"task weight {item!r}: {w!r} is not a number") from exc
    return out


def _range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    try:
        return float(lo), float(hi or lo)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: use SECONDS or LO-HI") from exc


_DURATION = re.compile(r"(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?")


def parse_duration(text: str) -> float:
    """Seconds in Locust's ``--run-time`` format: ``15s``, ``2m``, ``1h30m``, ``1h2m3s``, or plain seconds
    (``90``, ``2.5``). Raises ValueError otherwise."""
    value = text.strip().lower()
    try:
        seconds = float(value)
    except ValueError:
        seconds = None
    if seconds is not None:
        if not math.isfinite(seconds):
            raise ValueError(f"{text!r} is not a finite duration")
        return seconds
    match = _DURATION.fullmatch(value)
    if not value or match is None or not any(match.groupdict().values()):
        raise ValueError(f"{text!r} is not a duration: use seconds (90) or Locust's format (15s, 2m, 1h30m)")
    h, m, sec = (float(match.group(k) or 0) for k in ("h", "m", "s"))
    return h * 3600 + m * 60 + sec


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _size(text: str) -> tuple[int, int]:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _rate(text: str) -> float:
    return math.inf if text.lower() in ("inf", "infinity") else float(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL (the only host loaded)")
    g.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--api-key-env", metavar="VAR", help="send 'Authorization: Bearer $VAR'")
    g = p.add_argument_group("load shape")
    g.add_argument("-u", "--users", type=int, default=4, help="closed loop: concurrent users")
    g.add_argument("-r", "--spawn-rate", type=float, default=None, help="users started per second (default: all)")
    g.add_argument("--wait-time", type=_range, default=(0.0, 0.0), metavar="S|LO-HI",
                   help="closed loop: pause between a user's tasks (uniform)")
    g.add_argument("--request-rate", type=_rate, default=None, metavar="RPS",
                   help="open loop: Poisson arrivals per second ('inf': all at once); replaces --users")
    g.add_argument("--burstiness", type=float, default=1.0, help="open loop: gamma shape (1 = Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g = p.add_argument_group("bounds")
    g.add_argument("-t", "--run-time", type=_duration, default=60.0, metavar="DURATION",
                   help="seconds or Locust's format (15s, 2m, 1h30m); the run stops sending then")
    g.add_argument("-n", "--num-requests", type=int, default=None, help="stop after this many requests")
    g.add_argument("--request-timeout", type=float, default=120.0, help="deadline of one request (s)")
    g.add_argument("--stop-timeout", type=float, default=30.0, help="grace for in-flight requests at the end (s)")
    g = p.add_argument_group("requests")
    g.add_argument("--dataset", choices=["random", "demo"], default="random")
    g.add_argument("--demo-tasks", default=",".join(DEMO_TASKS), help="demo dataset: comma-separated tasks")
    g.add_argument("--image-size", type=_size, default=(224, 224), metavar="WxH", help="random dataset")
    g.add_argument("--prompt-words", type=_range, default=(4, 12), metavar="LO-HI", help="random dataset")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--stream-fraction", type=float, default=0.75, help="share of streaming chat requests")
    g.add_argument("--task-weights", type=_weights, default=None, metavar="NAME=W,...",
                   help="override task weights (ChatUser: chat_one_image=3,chat_two_images=1,chat_text=1,generate_multipart=0)")
    g.add_argument("--user-class", default=None, metavar="MODULE:CLASS", help="your own glance_loadtest.User")
    g.add_argument("--mode", choices=["glance", "chain", "ar"], default=None, help="decoding mode to request")
    g.add_argument("--measure-speedup", type=float, default=0.0, metavar="FRACTION",
                   help="share of requests asking the gateway for a measured AR speedup (costs an AR decode)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("output")
    g.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput: ttft, tpot, e2el, itl in ms (e.g. --goodput ttft:500 tpot:50)")
    g.add_argument("--json", metavar="PATH", help="write summary, server counts, timeline and per-request records")
    g.add_argument("--csv", metavar="PATH", help="write one row per request")
    g.add_argument("--plot", metavar="DIR", help="write latency_cdf.png, throughput.png, tau_hist.png")
    g.add_argument("--no-metrics", action="store_true", help="do not scrape the gateway's /metrics")
    g.add_argument("-q", "--quiet", action="store_true", help="no live progress line")
    g.add_argument("--print-json", action="store_true", help="print the summary as JSON instead of the table")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env {args.api_key_env}: the variable is empty or unset")
    demo_tasks = tuple(t.strip() for t in args.demo_tasks.split(",") if t.strip())
    prompt_words = (int(args.prompt_words[0]), int(args.prompt_words[1]))
    return LoadConfig(
        url=args.url, users=args.users, spawn_rate=args.spawn_rate, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, wait_time=args.wait_time,
        run_time=args.run_time, num_requests=args.num_requests, request_timeout=args.request_timeout,
        stop_timeout=args.stop_timeout, dataset=args.dataset, demo_tasks=demo_tasks, image_size=args.image_size,
        prompt_words=prompt_words, max_tokens=args.max_tokens, temperature=args.temperature,
        stream_fraction=args.stream_fraction, task_weights=args.task_weights, user_class=args.user_class,
        mode=args.mode, measure_speedup=args.measure_speedup, model=args.model, api_key=api_key, seed=args.seed,
        goodput=args.goodput, scrape_metrics=not args.no_metrics, progress=not args.quiet)


def cmd_loadtest(args: argparse.Namespace) -> int:
    from . import report

    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        print(f"glance loadtest: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_load(config, None if args.quiet else sys.stderr)
    except (ValueError, ImportError) as exc:
        print(f"glance loadtest: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("glance loadtest: interrupted", file=sys.stderr)
        return 130
    if args.print_json:
        print(json.dumps(result.to_json(with_records=False), indent=2, default=str))
    else:
        print(report.table(result))
    if args.json:
        print(f"wrote {report.write_json(result, args.json)}", file=sys.stderr)
    if args.csv:
        print(f"wrote {report.write_csv(result.records, args.csv)}", file=sys.stderr)
    if args.plot:
        for path in report.write_plots(result, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    if result.summary["requests"] == 0:
        print("glance loadtest: error: no request was sent", file=sys.stderr)
        return 1
    return 0 if result.summary["completed"] > 0 else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("loadtest", help="bounded load test of a GLANCE gateway (throughput, latency, tau)",
                              description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_loadtest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m glance_loadtest", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cmd_loadtest(args)
