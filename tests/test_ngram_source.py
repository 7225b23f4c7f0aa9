"""The n-gram candidate source over SGLang's real NgramCorpus: settings, matches over the request's prompt and
output, the cross-request corpus and its scopes, bounded memory (eviction), the source unavailable without
SGLang, the round adapter, and lossless decoding with its candidates merged into the drafter's trees."""

from __future__ import annotations

import math

import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from glance_sgl.ngram_source import NgramCandidates, NgramSettings, NgramSource, ngram_corpus_class
from glance_sgl.acceptance import CONTEXT_ANY, CONTEXT_CHAIN, CONTEXT_ON_TRACK, SourceAcceptance
from glance_sgl.tree import (
    SOURCE_DRAFTER,
    SOURCE_NGRAM,
    SOURCE_NONE,
    CandidateTrie,
    merge_trees,
    pack_trees,
)
from glance_sgl.verify import WalkResult
from tests.test_tree import (
    SPECS,
    TableTarget,
    ar_decode,
    check_tree_invariants,
    noisy_drafter_tree,
    speculative_decode,
    tree_paths,
)

if ngram_corpus_class()[0] is None:  # the project's venv has SGLang; the subprocess test covers its absence
    pytest.skip(ngram_corpus_class()[1], allow_module_level=True)


def small(**kw) -> NgramSettings:
    base = dict(max_trie_depth=8, max_nodes=7, max_depth=6, corpus_capacity=4096, own_capacity=1024)
    base.update(kw)
    return NgramSettings(**base)


def paths_of(tree, b: int = 0) -> set[tuple[int, ...]]:
    return set(tree_paths(tree, b))


def leaves(tree, b: int = 0) -> set[tuple[int, ...]]:
    """The token paths of request ``b``'s tree that no other path extends."""
    paths = paths_of(tree, b)
    return {p for p in paths if not any(len(q) > len(p) and q[:len(p)] == p for q in paths)}


def test_settings_are_validated():
    assert NgramSettings().validate().scope == "shared"
    for bad in (dict(scope="tenant"), dict(match_type="DFS"), dict(max_trie_depth=1), dict(max_nodes=0),
                dict(max_depth=0), dict(min_bfs_breadth=3, max_bfs_breadth=2), dict(corpus_capacity=10),
                dict(own_capacity=10**9), dict(max_keys=0), dict(max_answer_tokens=-1),
                dict(publish="never")):
        with pytest.raises(ValueError):
            NgramSettings(**bad).validate()
        with pytest.raises(ValueError):
            NgramSource(NgramSettings(**bad))


def test_unavailable_without_sglang_says_so_and_proposes_nothing():
    code = (
        "import sys; sys.modules['sglang'] = None\n"  # makes `import sglang` fail, as where it is not installed
        "from glance_sgl.ngram_source import NgramSource\n"
        "src = NgramSource()\n"
        "assert not src.available, 'available without sglang'\n"
        "src.add_request('r', [1, 2, 3]); src.commit('r', [4]); src.finish('r')\n"
        "tree = src.propose(['a', 'b'], 8, roots=[5, 6])\n"
        "assert tree.tokens.tolist() == [[5], [6]], tree\n"
        "print(src.reason)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "n-gram source unavailable" in res.stdout and "sglang" in res.stdout.lower()


def test_matches_the_prompt_and_the_output():
    src = NgramSource(small(scope="off"))
    prompt = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 70, 71]
    src.add_request("r", prompt)
    src.commit("r", [52])  # the answer starts quoting the prompt: 52 -> 53 54 55 ...
    tree = src.propose(["r"], rows=16)
    check_tree_invariants(tree)
    assert tree.tokens[0, 0].item() == 52
    assert (53, 54, 55, 56, 57, 58) in paths_of(tree), "the prompt's continuation, down to max_depth"
    assert int(tree.depths.max()) <= 6 and tree.num_rows <= 16
    assert tree.source_tags()[0, 0] == SOURCE_NONE and bool((tree.source_tags()[0, 1:] == SOURCE_NGRAM).all())
    sco = tree.scores[0, 1:].tolist()
    assert all(a >= b for a, b in zip(sco, sco[1:])), "best-first"
    assert src.propose(["r"], rows=3).num_rows == 3
    # the request's own output: after 90 91 92 93 once, a second 90 proposes 91 92 93
    src.commit("r", [90, 91, 92, 93, 94, 90])
    assert (91, 92, 93, 94) in paths_of(src.propose(["r"], rows=8))
    with pytest.raises(ValueError):
        src.propose(["r"], rows=8, roots=[7])  # the source was not told about the round's root
    assert src.propose(["r"], rows=8, roots=[7], strict=False).tokens.tolist() == [[7]]
    with pytest.raises(ValueError):
        src.add_request("r", [1, 2])
    src.add_request("empty", [])  # no token yet: nothing to start from but the round's root
    with pytest.raises(ValueError):
        src.propose(["empty"], rows=8)
    assert src.propose(["empty"], rows=8, roots=[3]).tokens.tolist() == [[3]]
    src.commit("empty", [53])
    assert src.propose(["empty"], rows=8).tokens[0, 0] == 53


def test_requests_in_flight_never_match_each_others_tokens(monkeypatch):
    """Every request's own tokens share one corpus (a namespace each): concurrent requests, a finished one and
    requests across a namespace rollover match only their own prompt and output there."""
    import glance_sgl.ngram_source as ngram_source

    monkeypatch.setattr(ngram_source, "NAMESPACES", 2)  # a fresh corpus every second request
    src = NgramSource(small(scope="off", skip_tokens=(-1,)))
    src.add_request("a", [50, 51, 52, 53, 54, 55])
    src.add_request("b", [-1, 60, 50, 61, 62, 63])  # the same token 50, another continuation
    src.add_request("c", [50, 71, 72, 73])  # past the rollover: a corpus of its own
    for rid in ("a", "b", "c"):
        src.commit(rid, [50])
    tree = src.propose(["a", "b", "c"], rows=8)
    check_tree_invariants(tree)
    assert [leaves(tree, b) for b in range(3)] == [{(51, 52, 53, 54, 55, 50)}, {(61, 62, 63, 50)},
                                                   {(71, 72, 73, 50)}]
    src.commit("a", [80, 81, 82])
    src.finish("a")  # its tokens stay in the corpus, in a namespace no later request gets
    src.add_request("d", [50, 90])
    src.commit("d", [80])
    assert src.propose(["d"], rows=8).num_rows == 1
    src.commit("b", [-1, 50])  # a skipped position in the output: never stored, never proposed
    assert all(-1 not in p and p[0] != -1 for p in paths_of(src.propose(["b"], rows=8)))


@pytest.mark.parametrize("scope", ["shared", "per-key"])
def test_a_request_matches_its_output_through_the_live_corpus(scope):
    """Where answers are published round by round, a request's output is stored once, in its cross-request corpus,
    and matched there; its own corpus keeps the prompt."""
    src = NgramSource(small(scope=scope))
    src.add_request("r", [50, 51, 52, 53, 54, 55, 56], key="k")
    src.commit("r", [52])
    assert (53, 54, 55, 56) in paths_of(src.propose(["r"], rows=16)), "the prompt's continuation"
    src.commit("r", [90, 91, 92, 93, 94, 90])
    assert (91, 92, 93, 94) in paths_of(src.propose(["r"], rows=8)), "its own output's continuation"


def test_skip_tokens_split_the_prompt():
    src = NgramSource(small(scope="off", skip_tokens=(99,)))
    src.add_request("r", [10, 11, 99, 12, 13, 14, 10, 11])
    tree = src.propose(["r"], rows=8)
    assert all(99 not in p for p in paths_of(tree)), "the placeholder is never proposed"
    assert not any(p[:1] == (12,) for p in paths_of(tree)), "no n-gram spans the placeholder"


def answer(src: NgramSource, rid: str, key: str | None, tokens: list[int]) -> None:
    src.add_request(rid, [1, 2, 3], key=key)
    src.commit(rid, tokens)
    src.finish(rid)


@pytest.mark.parametrize("scope", ["shared", "per-key", "off"])
def test_cross_request_corpus_scopes(scope):
    src = NgramSource(small(scope=scope))
    answer(src, "a1", "tenant-a", [40, 41, 42, 43, 44, 45])
    src.add_request("a2", [1, 2, 3], key="tenant-a")
    src.add_request("b1", [1, 2, 3], key="tenant-b")
    for rid in ("a2", "b1"):
        src.commit(rid, [40])
    tree = src.propose(["a2", "b1"], rows=8)
    check_tree_invariants(tree)
    same, other = (41, 42, 43, 44, 45) in paths_of(tree, 0), (41, 42, 43, 44, 45) in paths_of(tree, 1)
    assert (same, other) == {"shared": (True, True), "per-key": (True, False), "off": (False, False)}[scope]
    assert src.stats()["corpora"] == {"shared": 1, "per-key": 2, "off": 0}[scope]  # b1's answer started one


@pytest.mark.parametrize("publish", ["live", "finished"])
def test_live_publishing_lets_concurrent_requests_match(publish):
    src = NgramSource(small(scope="shared", publish=publish))
    src.add_request("writer", [1, 2, 3])
    src.commit("writer", [60, 61, 62, 63, 64])
    src.add_request("reader", [7, 8])
    src.commit("reader", [60])
    live = (61, 62, 63, 64) in paths_of(src.propose(["reader"], rows=8))
    assert live == (publish == "live")
    src.finish("writer")
    src.commit("reader", [9, 60])
    assert (61, 62, 63, 64) in paths_of(src.propose(["reader"], rows=8)), "a finished answer is there either way"
    assert src.stats()["published_tokens"] == {"live": 5 + 3, "finished": 5}[publish]  # live: the reader's too


@pytest.mark.parametrize("publish", ["live", "finished"])
def test_a_prompt_asked_again_gets_the_earlier_answer_from_its_first_token(publish):
    """Answers are published led by the prompt's last tokens (as SGLang's NGRAM inserts them): a request ending
    like an earlier one matches that one's answer before it has committed anything; the rest of a prompt never
    joins the cross-request corpus."""
    src = NgramSource(small(scope="shared", publish=publish))
    src.add_request("first", [1, 2, 3, 4, 5, 6, 7, 8, 90, 91, 92])  # lead: its last 7 tokens (max_trie_depth 8)
    src.commit("first", [70, 71, 72, 73])
    src.finish("first")
    src.add_request("again", [50, 51, 90, 91, 92])  # another opening, the same last tokens
    assert (70, 71, 72, 73) in paths_of(src.propose(["again"], rows=8))
    src.add_request("opening", [60, 1, 2])  # the first prompt's opening was never published
    assert not any(p[:2] == (3, 4) for p in paths_of(src.propose(["opening"], rows=8)))


def test_the_likeliest_continuation_is_proposed_first():
    """Siblings come in the order SGLang's BFS found them, whatever order its result keeps them in: the longest
    match's continuation before a shorter match's, and of one match the most recent continuation first."""
    src = NgramSource(small(scope="shared"))
    for rid, answer in (("old", [20, 21, 22, 40, 41]), ("new", [20, 21, 22, 50, 51])):  # two answers after 20 21 22
        src.add_request(rid, [9, 9])
        src.commit(rid, answer)
        src.finish(rid)
    src.add_request("asks", [1, 2])
    src.commit("asks", [20, 21, 22])
    tree = src.propose(["asks"], rows=8)
    assert tree.tokens[0, 1].item() == 50, "the more recent continuation first"
    assert tree.parents[0, 1].item() == 0 and {40, 50} <= set(tree.tokens[0].tolist())
    long_src = NgramSource(small(scope="shared"))
    for rid, answer in (("long", [30, 31, 32, 33, 60, 61]), ("short", [70, 33, 80, 81])):
        long_src.add_request(rid, [9, 9])
        long_src.commit(rid, answer)
        long_src.finish(rid)
    long_src.add_request("asks", [1, 2])
    long_src.commit("asks", [30, 31, 32, 33])  # matches 30 31 32 33 (-> 60) and, shorter, 33 (-> 80)
    tree = long_src.propose(["asks"], rows=8)
    assert tree.tokens[0, 1].item() == 60, "the longest match's continuation first"


def test_rows_go_to_the_likeliest_nodes_first():
    """A proposal keeps its best nodes by the acceptance table (depth and sibling rank), not the level order of the
    lookup: where the first choice is taken far more often than its sibling, a small budget follows the first
    choice's continuation instead of stopping at the sibling."""
    src = NgramSource(small(scope="shared"))
    for rid, answer_tokens in (("old", [20, 21, 22, 40, 41, 42]), ("new", [20, 21, 22, 50, 51, 52])):
        src.add_request(rid, [9, 9])
        src.commit(rid, answer_tokens)
        src.finish(rid)
    src.add_request("asks", [1, 2])
    src.commit("asks", [20, 21, 22])
    acc = SourceAcceptance(max_depth=6, decay=1.0)
    hits, tries = acc.cells(SOURCE_NGRAM, CONTEXT_ANY)
    tries += 100.0
    hits[:, 0] += 90.0  # first choices taken 9 times in 10 (their continuations too), second choices once in 10
    hits[:, 1] += 10.0
    tree = src.propose(["asks"], rows=4, acceptance=acc)
    check_tree_invariants(tree)
    assert tree.tokens[0].tolist() == [22, 50, 51, 52], "the first choice's path, not its sibling 40"
    sco = tree.scores[0, 1:].tolist()
    assert all(a >= b for a, b in zip(sco, sco[1:])), "best-first"
    assert 40 in src.propose(["asks"], rows=8, acceptance=acc).tokens[0].tolist()


def test_memory_is_bounded_and_old_answers_are_evicted():
    src = NgramSource(small(scope="per-key", max_keys=2, corpus_capacity=512))
    for k in range(5):
        answer(src, f"k{k}", f"tenant-{k}", [200 + k, 300 + k, 301 + k, 302 + k])
    assert src.stats()["corpora"] == 2
    src.add_request("late", [1], key="tenant-0")
    src.commit("late", [200])
    assert src.propose(["late"], rows=8).num_rows == 1, "the least recently used tenant's corpus was dropped"
    src.finish("late")
    # tenant-4's corpus is tenant-2's trie, emptied and reused: none of tenant-2's answers are left in it
    src.add_request("t4", [1], key="tenant-4")
    src.commit("t4", [202])
    assert src.propose(["t4"], rows=8).num_rows == 1
    src.commit("t4", [204])
    assert (304, 305, 306) in paths_of(src.propose(["t4"], rows=8))
    src.finish("t4", publish=False)
    assert src.memory_bound_nodes(active_requests=4) == 2 * 512 + 2 * 1024
    # one tenant's corpus full: the oldest answers go, the newest stay, matching keeps working
    src = NgramSource(small(scope="shared", corpus_capacity=512))
    rng = random.Random(0)
    first = [1000, 1001, 1002, 1003, 1004]
    answer(src, "first", None, first)
    for i in range(200):
        answer(src, f"x{i}", None, [rng.randrange(2000, 60000) for _ in range(30)])
    last = [5000, 5001, 5002, 5003]
    answer(src, "last", None, last)
    src.add_request("q", [1])
    src.commit("q", [1000])
    assert src.propose(["q"], rows=8).num_rows == 1, "the first answer was evicted"
    src.commit("q", [5000])
    assert (5001, 5002, 5003) in paths_of(src.propose(["q"], rows=8))


@dataclass
class Batch:
    """The fields of a round batch (``glance_sgl.round.RoundBatch``) that the adapter reads."""

    rids: list[str]
    roots: torch.Tensor
    tokens: list[list[int]]


def test_round_adapter_feeds_and_proposes():
    cands = NgramCandidates(NgramSource(small(scope="per-key")))
    cands.set_key("r", "tenant-a")
    tokens = [[7, 8, 9, 10, 11, 7]]
    batch = Batch(["r"], torch.tensor([7]), tokens)
    tree = cands.propose(batch, rows=6)
    assert tree.tokens[0, 0] == 7 and (8, 9, 10, 11) in paths_of(tree)
    # the round committed 8 9 (accepted) and 12 (bonus)
    walk = WalkResult(torch.tensor([[0, 1, 2]]), torch.tensor([2]), torch.tensor([12]), torch.tensor([[8, 9, 12]]))
    cands.commit(batch, torch.zeros(1, 3, 1), walk)
    assert cands.source.root("r") == 12 and cands.source._requests["r"].total == 9
    # the engine dropped tokens (a stop string): the next batch's tokens re-seed the request
    batch = Batch(["r"], torch.tensor([9]), [tokens[0] + [8, 9]])
    assert cands.propose(batch, rows=6).tokens[0, 0] == 9
    assert cands.source._requests["r"].answer == [8, 9], "its answer so far, less the dropped bonus"
    cands.finish("r")
    # published live as committed (the dropped bonus included: it had been committed when it was published)
    assert cands.source.stats()["requests"] == 0 and cands.source.stats()["published_tokens"] == 3


@pytest.mark.parametrize("scope", ["shared", "off"])
def test_lossless_with_ngram_candidates(scope):
    """Two waves of requests (the second sees the first's answers where the scope shares them): drafter-like trees
    merged with the real n-gram source's, random budgets and AR rounds, commit exactly the target's greedy output
    and seeded samples."""
    rng = random.Random(7)
    target = TableTarget(vocab=10, seed=3, sharpness=4.0)
    src = NgramSource(small(scope=scope))
    acc = SourceAcceptance(max_depth=6)
    n = 40
    accepted_ngram = 0
    for wave in range(2):
        prompts = [[rng.randrange(10) for _ in range(rng.randint(3, 10))] for _ in SPECS]
        rids = [f"w{wave}-{i}" for i in range(len(SPECS))]
        for rid, prompt in zip(rids, prompts):
            src.add_request(rid, prompt)

        def propose(ctxs, _outs):
            ngram = src.propose(rids, rows=12, acceptance=acc)
            assert ngram.tokens[:, 0].tolist() == [c[-1] for c in ctxs]
            return [noisy_drafter_tree(target, ctxs, rng, hit=0.3), ngram]

        def fed(merged, walk):
            for rid, toks in zip(rids, walk.committed()):
                src.commit(rid, toks)

        got, accepted = speculative_decode(target, prompts, SPECS, n, propose, rng, acceptance=acc, on_round=fed)
        for prompt, spec, out in zip(prompts, SPECS, got):
            assert out == ar_decode(target, prompt, spec, n)
        accepted_ngram += sum(v for k, v in accepted.items() if k & SOURCE_NGRAM)
        for rid in rids:
            src.finish(rid)
    assert accepted_ngram > 0
    assert acc.tries[SOURCE_NGRAM][1].sum() > 0 and acc.tries[SOURCE_DRAFTER][1].sum() > 0


def test_merged_with_the_drafter_under_one_budget():
    src = NgramSource(small(scope="off"))
    src.add_request("r", [5, 6, 7, 8, 9, 5])
    ngram = src.propose(["r"], rows=8)
    drafter_paths = {(6,), (6, 7), (3,)}
    trie = CandidateTrie(5)
    for path in sorted(drafter_paths, key=len):
        node = 0
        for tok in path:
            node = trie.add(node, tok, -0.1 * len(path), SOURCE_DRAFTER)
    drafter = pack_trees([trie.best_first(10)])
    merged = merge_trees([drafter, ngram], rows=6)
    check_tree_invariants(merged)
    tags = {p: t for p, (_, t) in tree_paths(merged, 0).items()}
    assert tags[(6,)] == tags[(6, 7)] == SOURCE_DRAFTER | SOURCE_NGRAM and tags[(3,)] == SOURCE_DRAFTER
    assert merged.num_rows == 6


def test_proposals_are_labelled_in_hindsight_beyond_the_verified_rows():
    """Deep n-gram nodes are learned even when the round verifies one row of them: every proposed node is
    labelled against the tokens committed after it (the planner's choice does not bias the table)."""
    src = NgramSource(small(scope="off"))
    cands = NgramCandidates(src, SourceAcceptance(max_depth=6, decay=1.0))
    acc = cands.acceptance
    assert SOURCE_NGRAM in acc.hindsight
    src.add_request("r", [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1])
    tree = src.propose(["r"], rows=2, acceptance=acc)  # one candidate verified: 2
    assert tree.num_rows == 2 and tree.tokens[0, 1].item() == 2
    src.propose(["r"], rows=2, acceptance=acc)  # the same position again: one pending proposal, not two
    for tok in (2, 3, 4, 5, 6, 9):  # the chain 2..6 comes true, then 9 breaks it
        src.commit("r", [tok])
    tries, hits = acc.tries[SOURCE_NGRAM], acc.hits[SOURCE_NGRAM]
    assert tries[1, 0] == 1 and hits[1, 0] == 1
    assert tries[2:6, 0].tolist() == [1, 1, 1, 1] and hits[2:6, 0].tolist() == [1, 1, 1, 1]
    assert tries[6, 0] == 1 and hits[6, 0] == 0  # depth 6 predicted 1, the target said 9
    assert acc.probs(SOURCE_NGRAM)[5, 0] > acc.probs(SOURCE_NGRAM)[6, 0]
    # a request that ends labels its pending proposals as far as its answer went
    src.commit("r", [1])
    src.propose(["r"], rows=2, acceptance=acc)
    before = tries.sum().item()
    src.commit("r", [2])
    assert tries.sum().item() == before  # not mature yet: its deeper nodes wait for their tokens
    src.finish("r")
    assert tries.sum().item() > before


@pytest.mark.parametrize("scope", ["shared", "off"])
def test_a_long_verbatim_copy_is_proposed_deeper_than_one_lookup(scope):
    """A lookup returns at most ``max_nodes`` candidates; where they are one chain the corpus is asked again from
    its end, so a replayed answer (shared corpus) or a passage copied from the prompt (own corpus) is drafted down
    to ``max_depth``, as one path under the budget, while a lookup that branches is not continued."""
    passage = list(range(100, 130))
    src = NgramSource(small(scope=scope, max_nodes=4, max_depth=13))
    if scope == "shared":
        answer(src, "first", None, passage)
        src.add_request("copy", [1, 2, 3])
    else:
        src.add_request("copy", [1, 2] + passage + [3])
    src.commit("copy", passage[:2])
    tree = src.propose(["copy"], rows=32)
    check_tree_invariants(tree)
    assert tuple(passage[2:15]) in paths_of(tree)  # 13 deep: three lookups of 4
    assert int(tree.depths.max()) == 13
    src.finish("copy")
    # two continuations of the same context: the lookup branches, nothing to continue
    src = NgramSource(small(scope="off", max_nodes=4, max_depth=13))
    src.add_request("fork", [7, 8, 1, 2, 10, 11, 12, 13, 14, 7, 8, 1, 2, 30, 31, 32, 33, 34, 7, 8, 1, 2])
    tree = src.propose(["fork"], rows=32)
    check_tree_invariants(tree)
    assert {p[:2] for p in paths_of(tree)} >= {(10, 11), (30, 31)} and int(tree.depths.max()) <= 4


def _replay_with_a_learned_chain_table(rid: str):
    """A shared corpus holding one answer (a 30-token passage), a chain table that learned every node is taken, and
    request ``rid`` two tokens into the passage: (passage, source, acceptance)."""
    passage = list(range(100, 130))
    src = NgramSource(small(scope="shared", max_nodes=4, max_depth=13))
    acc = NgramCandidates(src, SourceAcceptance(max_depth=13, decay=1.0)).acceptance
    hits, tries = acc.cells(SOURCE_NGRAM, CONTEXT_CHAIN)
    hits += 50.0
    tries += 50.0
    answer(src, "first", None, passage)
    src.add_request(rid, [1, 2, 3])
    src.commit(rid, passage[:2])
    return passage, src, acc


def test_a_lookup_that_finds_one_long_chain_is_scored_and_labelled_as_a_chain():
    """A proposal whose lookup found one chain as deep as a lookup goes (a replayed answer) is scored by the chain
    context's table, and its hindsight labels go there: a replay takes nearly every node of such a chain, where
    other matches' deep nodes often fail, and one table for both scored replays at half what they commit. A
    lookup that branches stays in its request's own context."""
    passage, src, acc = _replay_with_a_learned_chain_table("copy")
    chain = src.propose(["copy"], rows=14, acceptance=acc)
    # scored by the chain table (0.98 a node), not the prior (0.5 a node): 13 deep, still above 0.7
    assert int(chain.depths.max()) == 13 and chain.scores[0, 1:].min() > math.log(0.7)
    src.commit("copy", passage[2:8])
    src.finish("copy")
    chain_hits, chain_tries = acc.cells(SOURCE_NGRAM, CONTEXT_CHAIN)
    assert float(chain_tries.sum()) > 100.0 and float(chain_hits.sum()) > 100.0  # labelled there: 6 more taken
    assert float(acc.cells(SOURCE_NGRAM, CONTEXT_ANY)[1].sum()) == 0.0
    src = NgramSource(small(scope="off", max_nodes=4, max_depth=13))
    acc = NgramCandidates(src, SourceAcceptance(max_depth=13, decay=1.0)).acceptance
    src.add_request("fork", [7, 8, 1, 2, 10, 11, 12, 13, 14, 7, 8, 1, 2, 30, 31, 32, 33, 34, 7, 8, 1, 2])
    src.propose(["fork"], rows=32, acceptance=acc)
    src.commit("fork", [10, 11])
    src.finish("fork")
    assert float(acc.cells(SOURCE_NGRAM, CONTEXT_CHAIN)[1].sum()) == 0.0
    assert float(acc.cells(SOURCE_NGRAM, CONTEXT_ANY)[1].sum()) > 0.0


def test_a_request_whose_chain_broke_scores_its_chains_by_its_own_record_until_on_track():
    """A chain that breaks (the request committed something else before its end: an opening like an earlier
    answer's, over another picture) sends the request's later chains to its own context: they are scored and
    labelled there, not by the chain table, which is learned where chains hold. Once its proposals' first choices
    are taken ``ON_TRACK_TOKENS`` times in a row, its chains are scored as chains again."""
    from glance_sgl.ngram_source import ON_TRACK_TOKENS

    passage, src, acc = _replay_with_a_learned_chain_table("other")
    trusted = src.propose(["other"], rows=14, acceptance=acc)
    assert trusted.scores[0, 1:].min() > math.log(0.7)
    src.commit("other", [passage[2], 999])  # the chain breaks at its second node
    src.commit("other", passage[8:10])  # ... and the answer comes back to the passage further on
    distrusted = src.propose(["other"], rows=14, acceptance=acc)
    assert int(distrusted.depths.max()) == 13, "still the whole chain..."
    assert distrusted.scores[0, 1:].min() < math.log(0.1), "... scored by the request's own context (prior 0.5)"
    src.commit("other", passage[10:10 + ON_TRACK_TOKENS])  # its first choices, taken: on track
    again = src.propose(["other"], rows=14, acceptance=acc)
    assert again.scores[0, 1:].min() > math.log(0.7), "on track: a chain again"
    src.finish("other")


def test_queued_inserts_reach_lookups_and_never_another_tenant():
    """Inserts wait until a lookup reads their corpus (one insert call per lookup, not per round): a lookup sees
    everything committed before it, and an evicted tenant's queued n-grams are dropped with its corpus, not
    inserted into the next tenant's."""
    src = NgramSource(small(scope="per-key", max_keys=1))
    src.add_request("a", [1, 2, 3], key="tenant-a")
    for t in (40, 41, 42, 43, 44):  # one commit per round; nothing looks yet
        src.commit("a", [t])
    src.add_request("a2", [9], key="tenant-a")
    src.commit("a2", [40])
    assert (41, 42, 43, 44) in paths_of(src.propose(["a2"], rows=8))
    src.commit("a", [45])  # inserted at once: the last lookup read tenant-a's corpus (see the next test)
    src.commit("a", [46, 47])  # queued for tenant-a's corpus: no lookup since ...
    src.add_request("b", [9], key="tenant-b")
    src.commit("b", [44])  # ... which tenant-b's corpus replaces (max_keys 1)
    assert not any(p[:2] == (46, 47) for p in paths_of(src.propose(["b"], rows=8)))


def test_queued_rounds_of_a_request_go_in_as_one_window_with_the_same_ngrams():
    """Rounds committed while nothing reads the corpus extend their request's queued window (the trie walks the
    context once, not once per round), and a lookup then matches exactly what separate windows gave: every n-gram
    of the answer, across the rounds' boundaries. A window of another request in between, or the request added
    again under its id, starts a window of its own."""
    answer = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    puts: dict[str, list[list[int]]] = {}
    found = {}
    for name, lookups in (("queued", False), ("flushed", True)):
        src = NgramSource(small(scope="shared"))
        corpus = src._cross("", create=False)
        real_put = corpus.batch_put
        puts[name] = []
        corpus.batch_put = lambda windows, real=real_put, out=puts[name]: (out.extend(list(w) for w in windows),
                                                                           real(windows))[1]
        src.add_request("a", [1, 2, 3])
        for i in range(0, len(answer), 2):  # five rounds of two tokens
            src.commit("a", answer[i:i + 2])
            if lookups:
                src.propose(["a"], rows=8)
        src.add_request("q", [7, 8])
        found[name] = {}
        for root in (41, 43, 46):  # the answer's n-grams from rounds' boundaries and within them
            src.commit("q", [root])
            found[name][root] = paths_of(src.propose(["q"], rows=8))
    assert found["queued"] == found["flushed"]
    assert (42, 43, 44, 45, 46, 47) in found["queued"][41]
    assert (47, 48, 49) in found["queued"][46]
    assert sum(len(w) for w in puts["queued"]) < sum(len(w) for w in puts["flushed"])
    assert [1, 2, 3] + answer in puts["queued"]  # the prompt's last tokens, then the whole answer, once

    src = NgramSource(small(scope="shared"))
    src.add_request("a", [1, 2, 3])
    src.add_request("b", [5, 6])
    src.commit("a", [40, 41])
    src.commit("b", [50])
    src.commit("a", [42])  # b's window is queued last: a's continues in a window of its own
    src.finish("a")
    src.add_request("a", [1, 2, 3])  # again under its id: no continuation of the old answer's window
    src.commit("a", [60])
    _, windows, _ = src._queued[id(src._cross("", create=False))]
    assert windows == [[1, 2, 3, 40, 41], [5, 6, 50], [1, 2, 3, 40, 41, 42], [1, 2, 3, 60]]


def test_commits_after_a_lookup_insert_at_once():
    """A round's commits to a corpus its lookup read are inserted at commit (SGLang's insert thread stores them
    while the engine finishes the round, so the next lookup does not wait for the insert); a round without a lookup
    leaves its commits queued."""
    src = NgramSource(small(scope="shared"))
    src.add_request("a", [1, 2, 3])
    src.commit("a", [40])
    src.propose(["a"], rows=8)  # reads the shared and the own corpus
    src.commit("a", [41])
    assert not src._queued
    src.commit("a", [42])  # no lookup in between
    assert src._queued
    src.propose(["a"], rows=8)
    assert not src._queued


def test_a_request_copying_its_matches_is_scored_on_track():
    """After ON_TRACK_TOKENS committed tokens its proposals foresaw as first choices, a request's proposals are
    scored (and labelled) in the on-track context; a miss puts it back."""
    src = NgramSource(small(scope="off"))
    acc = NgramCandidates(src, SourceAcceptance(max_depth=6, decay=1.0)).acceptance
    hits, tries = acc.cells(SOURCE_NGRAM, CONTEXT_ON_TRACK)
    hits += 50.0  # a learned on-track table: every node taken
    tries += 50.0
    src.add_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1])
    assert src.context("r") == CONTEXT_ANY
    first = src.propose(["r"], rows=4, acceptance=acc)
    src.commit("r", [2, 3])
    assert src.context("r") == CONTEXT_ANY  # 2 foreseen: not yet
    src.propose(["r"], rows=4, acceptance=acc)
    src.commit("r", [4, 5])
    assert src.context("r") == CONTEXT_ON_TRACK
    copy = src.propose(["r"], rows=4, acceptance=acc)
    assert copy.scores[0, 1:].min() > first.scores[0, 1:].min()  # the copy's nodes score as likely
    src.commit("r", [9])  # the first choice was 6
    assert src.context("r") == CONTEXT_ANY
    src.commit("r", [1])  # no proposal made there: the streak stays broken
    assert src.context("r") == CONTEXT_ANY


def test_a_prompt_goes_in_only_when_its_request_looks():
    """A prompt is inserted before its request's first own lookup, or before its first output window where the own
    corpus takes the output too (scope off), and never for a request whose rounds skip the lookups while its output
    goes to a cross-request corpus: inserting costs SGLang's trie about 6 us a prompt token."""
    prompt = [50, 51, 52, 53, 54, 55, 56, 57]
    for scope in ("shared", "off"):
        src = NgramSource(small(scope=scope))
        puts: list[list[int]] = []
        own = src._own.corpus
        real_put = own.batch_put
        own.batch_put = lambda windows: (puts.extend(list(w) for w in windows), real_put(windows))[1]
        src.add_request("quiet", prompt)
        src.commit("quiet", [90])  # its rounds never look
        src.add_request("r", prompt)
        src.commit("r", [52])
        assert not puts, "nothing inserted before a lookup reads the corpus"
        assert (53, 54, 55) in paths_of(src.propose(["r"], rows=8)), "the prompt's continuation"
        for rid in ("quiet", "r"):
            offset = src._requests[rid].offset
            mine = [w for w in puts if w and offset <= w[-1] < offset + (1 << 19)]
            if rid == "quiet" and scope == "shared":
                assert not mine, "a request that never looked never inserted its prompt"
                continue
            assert mine[0] == [offset + t for t in prompt], (scope, rid, "its prompt before anything of it")
            if scope == "off":
                assert len(mine) == 2 and mine[1][-1] == offset + (90 if rid == "quiet" else 52), "then its output"
        src.finish("quiet")
        src.finish("r")
    # where the first round will look (the planner's looks_first), the engine inserts the prompt before the prefill
    src = NgramSource(small(scope="shared"))
    src.add_request("eager", prompt)
    src.insert_prompt("eager")
    assert not src._queued and src._requests["eager"].prompt_windows is None
