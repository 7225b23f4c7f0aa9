"""How often n-gram candidates would be accepted on the demo tasks, next to the drafter's chain (a measurement).

    .venv/bin/python scripts/ngram_acceptance.py [--limit 20] [--max-tokens 96] [--json out.json]

For every demo task (and ``wild``) and prompt, in the bench's order, the embedded engine decodes the bundled demo
pair greedily twice: autoregressively (the reference answer) and with the drafter's width-1 chain (mode
``chain``: every round verifies the drafter's 15-token spine; its rounds are observed through ``on_delta``).
At each chain round's position the n-gram source (SGLang's NgramCorpus over the prompt, the answer so far and,
for ``shared``, the answers of the prompts before) proposes a 16-row tree, scored by the acceptance it has learned
so far (``SourceAcceptance``, fed by every walk); the real walk
(``glance_sgl.verify.greedy_walk``, the target's choices read off the reference answer) says how many of its
tokens the target would have taken. Reported per task and scope (``shared``, ``off``):

- rounds, mean accepted drafts per round of the chain and of the n-gram tree, of the better of the two (what a
  merged tree holding both would take: the walk's path lies in one source's tree), the share of rounds where the
  n-gram tree beats / ties / loses to the chain, and where it proposes anything;
- P(accepted >= d) for d = 1..15 (per round position) for the chain and the n-gram tree;
- tau of n-gram-only decoding (a separate simulation along the reference answer: rounds of n-gram candidates
  alone, 16 rows), the chain's tau, and the n-gram source's learned conditional acceptance per depth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from glance_sgl.demo import paths  # noqa: E402
from glance_sgl.demo.bench import BENCH_TASKS, bench_examples  # noqa: E402
from glance_sgl.engine import GlanceEngine, SamplingParams  # noqa: E402
from glance_sgl.ngram_source import NgramSettings, NgramSource  # noqa: E402
from glance_sgl.acceptance import SourceAcceptance  # noqa: E402
from glance_sgl.tree import SOURCE_NGRAM  # noqa: E402
from glance_sgl.verify import greedy_walk  # noqa: E402

ROWS = 16
DEPTH = 15


def walk_accept(tree, answer: list[int], p: int) -> tuple[int, torch.Tensor]:
    """Accepted drafts of ``tree`` (root = answer[p - 1]) against the reference answer, by the real walk."""
    depths = tree.depths[0].tolist()
    choices = [answer[p + d] if p + d < len(answer) else -1 for d in depths]
    walk = greedy_walk(tree.tokens, tree.parents, torch.tensor([choices]), DEPTH)
    return int(walk.accept_lens[0]), walk.accepted_rows


def ngram_only_tau(src: NgramSource, rid: str, prompt: list[int], answer: list[int], key: str,
                   acceptance: SourceAcceptance) -> tuple[int, int]:
    """(rounds, committed tokens) of decoding the reference answer with n-gram candidates alone (scored by
    ``acceptance``, which this simulation reads but does not update)."""
    src.add_request(rid, prompt, key=key)
    src.commit(rid, answer[:1])
    p, rounds = 1, 0
    while p < len(answer):
        tree = src.propose([rid], ROWS, acceptance)
        acc, _ = walk_accept(tree, answer, p)
        acc = min(acc, len(answer) - p - 1)
        src.commit(rid, answer[p: p + acc + 1])
        p += acc + 1
        rounds += 1
    src.finish(rid)  # the answer joins the cross-request corpus (shared)
    return rounds, len(answer) - 1


def summarise(rows: list[tuple[int, int]], only: tuple[int, int]) -> dict:
    n = len(rows)
    chain = [a for a, _ in rows]
    ngram = [g for _, g in rows]
    best = [max(a, g) for a, g in rows]
    return {
        "rounds": n,
        "chain_mean": sum(chain) / n, "ngram_mean": sum(ngram) / n, "best_of_both_mean": sum(best) / n,
        "ngram_beats_chain": sum(g > a for a, g in rows) / n, "ties": sum(g == a for a, g in rows) / n,
        "chain_beats_ngram": sum(a > g for a, g in rows) / n,
        "p_ge_chain": [sum(a >= d for a in chain) / n for d in range(1, DEPTH + 1)],
        "p_ge_ngram": [sum(g >= d for g in ngram) / n for d in range(1, DEPTH + 1)],
        "chain_tau": (sum(chain) + n) / n,
        "ngram_only_tau": only[1] / only[0] if only[0] else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tasks", default=",".join(BENCH_TASKS))
    ap.add_argument("--lookup-nodes", type=int, default=ROWS - 1,
                    help="candidates per corpus lookup (NgramSettings.max_nodes), of which the best 15 are kept")
    ap.add_argument("--max-trie-depth", type=int, default=18)
    ap.add_argument("--max-bfs-breadth", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    engine = GlanceEngine.load(paths.bundled_target(), paths.bundled_drafter())
    cfg = engine.target.model.config
    skip = tuple(int(t) for t in (getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None))
                 if t is not None)
    scopes = ("shared", "off")
    def settings(scope: str) -> NgramSettings:
        return NgramSettings(scope=scope, max_nodes=args.lookup_nodes, max_depth=DEPTH, skip_tokens=skip,
                             max_trie_depth=args.max_trie_depth, max_bfs_breadth=args.max_bfs_breadth)

    sources = {s: NgramSource(settings(s)) for s in scopes}
    sim = {s: NgramSource(settings(s)) for s in scopes}
    if not sources["shared"].available:
        raise SystemExit(sources["shared"].reason)
    acceptance = {s: SourceAcceptance(max_depth=DEPTH, decay=1.0) for s in scopes}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    report: dict = {"limit": args.limit, "max_tokens": args.max_tokens, "settings": vars(settings("shared")),
                    "tasks": {}}
    t0 = time.perf_counter()
    lossless = True
    for task in args.tasks.split(","):
        rounds = {s: [] for s in scopes}
        only = {s: [0, 0] for s in scopes}
        for i, ex in enumerate(bench_examples(task, args.limit)):
            prepared = engine.prepare(ex.messages())
            prompt = prepared.input_ids[0].tolist()
            answer = engine.generate(prepared, params, mode="ar").token_ids
            deltas: list[list[int]] = []
            chain = engine.generate(prepared, params, mode="chain", on_delta=lambda d: deltas.append(d.token_ids))
            lossless &= chain.token_ids == answer
            for s in scopes:
                rid = f"{task}-{i}"
                r, c = ngram_only_tau(sim[s], rid, prompt, answer, "demo", acceptance[s])
                only[s][0] += r
                only[s][1] += c
                src = sources[s]
                src.add_request(rid, prompt, key="demo")
                src.commit(rid, answer[:1])
                p = 1
                for committed in deltas[1:]:  # deltas[0]: the prefill's token
                    tree = src.propose([rid], ROWS, acceptance[s])  # scored by what it has learned so far
                    got, accepted_rows = walk_accept(tree, answer, p)
                    acceptance[s].observe(tree, accepted_rows)
                    rounds[s].append((len(committed) - 1, min(got, len(answer) - p - 1)))
                    src.commit(rid, committed)
                    p += len(committed)
                src.finish(rid)  # its answer joins the cross-request corpus (shared)
        report["tasks"][task] = {s: summarise(rounds[s], tuple(only[s])) for s in scopes}
        print(f"{task}: {time.perf_counter() - t0:.0f} s", flush=True)
    report["lossless_chain_equals_ar"] = lossless
    report["ngram_conditional_acceptance"] = {
        s: [round(float(x), 3) for x in acceptance[s].probs(SOURCE_NGRAM)[1:, 0]] for s in scopes}
    report["ngram_tries_per_depth"] = {
        s: [int(x) for x in acceptance[s].tries[SOURCE_NGRAM][1:, 0]] for s in scopes}
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def print_table(report: dict) -> None:
    print(f"\nsettings {report['settings']}")
    print(f"chain == AR on every prompt: {report['lossless_chain_equals_ar']}")
    print("\n| task | scope | rounds | chain acc/round | n-gram acc/round | best of both | n-gram > chain | "
          "= | < | chain tau | n-gram-only tau |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for task, by in report["tasks"].items():
        for s, r in by.items():
            print(f"| {task} | {s} | {r['rounds']} | {r['chain_mean']:.2f} | {r['ngram_mean']:.2f} | "
                  f"{r['best_of_both_mean']:.2f} | {r['ngram_beats_chain']:.0%} | {r['ties']:.0%} | "
                  f"{r['chain_beats_ngram']:.0%} | {r['chain_tau']:.2f} | {r['ngram_only_tau']:.2f} |")
    print("\nP(accepted >= d) per round position d (shared scope): chain / n-gram")
    print("| task | " + " | ".join(f"d{d}" for d in range(1, DEPTH + 1)) + " |")
    print("|---|" + "---|" * DEPTH)
    for task, by in report["tasks"].items():
        r = by["shared"]
        print(f"| {task} | " + " | ".join(f"{a:.2f}/{g:.2f}" for a, g in zip(r["p_ge_chain"], r["p_ge_ngram"]))
              + " |")
    for s in report["ngram_conditional_acceptance"]:
        print(f"\nn-gram P(taken | parent reached), rank 0, depth 1..{DEPTH} ({s}): "
              f"{report['ngram_conditional_acceptance'][s]}  (tries {report['ngram_tries_per_depth'][s]})")


if __name__ == "__main__":
    main()
