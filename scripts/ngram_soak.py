"""Soak of the n-gram source: resident memory must stay flat however many requests and tenants pass through.

    .venv/bin/python scripts/ngram_soak.py [--requests 20000] [--in-flight 8] [--keys 40] [--scope per-key]

Requests (a prompt, then an answer committed a few tokens per round with a proposal before every round) run
``--in-flight`` at a time through one ``NgramSource``, each under one of ``--keys`` API keys (more keys than the
source keeps: tenant corpora are dropped and rebuilt all along). Prompts and answers mix phrases drawn from a
shared phrase book (so matches happen) with random tokens (so every trie fills and evicts). RSS (from
/proc/self/statm) is printed every ``--every`` requests; the last line compares the last RSS with the RSS after
the first quarter of the run (the warm-up: every pool and corpus allocated once) and with the source's own bound
(``memory_bound_nodes``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glance_sgl.ngram_source import NgramSettings, NgramSource  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--keys", type=int, default=40)
    ap.add_argument("--scope", default="per-key", choices=["shared", "per-key", "off"])
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--answer-tokens", type=int, default=120)
    ap.add_argument("--every", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    settings = NgramSettings(scope=args.scope, max_keys=8, corpus_capacity=50_000, own_capacity=65_536)
    src = NgramSource(settings)
    if not src.available:
        raise SystemExit(src.reason)
    rng = random.Random(args.seed)
    phrases = [[rng.randrange(100, 150_000) for _ in range(rng.randint(4, 12))] for _ in range(500)]

    def text(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += rng.choice(phrases) if rng.random() < 0.6 else [rng.randrange(100, 150_000)
                                                                    for _ in range(rng.randint(1, 8))]
        return out[:n]

    live: dict[str, list[int]] = {}  # rid -> answer tokens still to commit
    started = done = rounds = 0
    t0 = time.perf_counter()
    base = None
    print(f"scope {args.scope}: {args.requests} requests, {args.in_flight} in flight, {args.keys} keys; "
          f"bound {src.memory_bound_nodes(args.in_flight):,} trie nodes; RSS at start {rss_mib():.1f} MiB")
    while done < args.requests:
        while len(live) < args.in_flight and started < args.requests:
            rid = f"r{started}"
            src.add_request(rid, text(args.prompt_tokens), key=f"key-{rng.randrange(args.keys)}")
            src.commit(rid, text(1))
            live[rid] = text(args.answer_tokens)
            started += 1
        rids = list(live)
        src.propose(rids, rows=16)
        rounds += 1
        for rid in rids:
            step, live[rid] = live[rid][: rng.randint(1, 6)], live[rid][rng.randint(1, 6):]
            src.commit(rid, step)
            if not live[rid]:
                del live[rid]
                src.finish(rid)
                done += 1
                if done % args.every == 0:
                    rss = rss_mib()
                    if base is None and done >= args.requests // 4:
                        base = rss
                    print(f"  {done:6d} requests  {rounds:7d} batched proposals  RSS {rss:8.1f} MiB  "
                          f"{src.stats()}  {time.perf_counter() - t0:6.1f} s", flush=True)
    end = rss_mib()
    print(f"RSS after warm-up {base:.1f} MiB, at the end {end:.1f} MiB: {end - base:+.1f} MiB over the last "
          f"{args.requests - args.requests // 4} requests")


if __name__ == "__main__":
    main()
