"""The budget tree: structure, optimality (brute force), pointers vs. mask; source tags, merged trees (the union
of the sources' paths, best-first under one budget), per-source acceptance, and the walk over merged trees
(lossless: greedy and seeded sampling)."""

from __future__ import annotations

import heapq
import itertools

import random

import pytest
import torch

from glance_sgl.round import only_requests
from glance_sgl.acceptance import CONTEXT_ON_TRACK, HindsightTree, SourceAcceptance
from glance_sgl.tree import (
    SOURCE_BOTH,
    SOURCE_DRAFTER,
    SOURCE_NGRAM,
    SOURCE_NONE,
    CandidateTrie,
    DraftTree,
    accepted_alone,
    accepted_per_source,
    ancestor_mask,
    build_tree,
    chain_tree,
    max_tree_size,
    merge_trees,
    pack_trees,
    spread_requests,
    topk_per_offset,
    tree_pointers,
    without_ended,
)
from glance_sgl.tree import _without_ended_batch
from glance_sgl.verify import SamplingSpec, target_choices, verify_tree


def random_topk(bs: int, depth: int, k: int, vocab: int = 50, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=gen) * 3
    return topk_per_offset(torch.log_softmax(logits, -1), k)


def full_tree_nodes(values, ids, depth: int, k: int):
    """All nodes of the full candidate tree of one request as (path tuple of ranks) -> (score, token)."""
    nodes = {}
    for d in range(1, depth + 1):
        for path in itertools.product(range(k), repeat=d):
            score = sum(float(values[i, j]) for i, j in enumerate(path))
            nodes[path] = (score, int(ids[d - 1, path[-1]]))
    return nodes


@pytest.mark.parametrize("depth,k", [(3, 2), (2, 3), (4, 1)])
def test_tree_is_best_prefix_closed_set(depth, k):
    values, ids = random_topk(3, depth, k, seed=depth * 10 + k)
    nodes_by_b = [full_tree_nodes(values[b], ids[b], depth, k) for b in range(3)]
    paths = list(nodes_by_b[0])
    for b in range(3):
        nodes = nodes_by_b[b]
        best = {}
        for mask in range(1, 1 << len(paths)):
            chosen = [paths[i] for i in range(len(paths)) if mask >> i & 1]
            chosen_set = set(chosen)
            if all(len(p) == 1 or p[:-1] in chosen_set for p in chosen):
                total = sum(nodes[p][0] for p in chosen)
                n = len(chosen)
                best[n] = max(best.get(n, -1e9), total)
        for budget in range(1, len(paths) + 1):
            tree = build_tree(values[b : b + 1], ids[b : b + 1], torch.tensor([7]), budget)
            assert tree.num_nodes == budget
            assert tree.scores[0, 1:].sum().item() == pytest.approx(best[budget], abs=1e-4)


def test_tree_structure_and_scores():
    depth, k, budget = 6, 4, 40
    values, ids = random_topk(4, depth, k, seed=1)
    tree = build_tree(values, ids, torch.arange(4), budget)
    assert tree.tokens.shape == (4, budget + 1)
    assert torch.equal(tree.tokens[:, 0], torch.arange(4))
    for b in range(4):
        seen_paths = set()
        for r in range(1, budget + 1):
            p = int(tree.parents[b, r])
            assert 0 <= p < r, "parents come before children"
            assert tree.depths[b, r] == tree.depths[b, p] + 1
            d = int(tree.depths[b, r])
            tok = int(tree.tokens[b, r])
            rank = ids[b, d - 1].tolist().index(tok)
            assert tree.scores[b, r].item() == pytest.approx(tree.scores[b, p].item() + values[b, d - 1, rank].item(), abs=1e-5)
            # siblings carry distinct tokens
            assert (p, tok) not in seen_paths
            seen_paths.add((p, tok))
        # best-first: scores never increase along the packing order
        assert torch.all(tree.scores[b, 2:] <= tree.scores[b, 1:-1] + 1e-6)


def test_budget_is_capped_and_chain_is_the_spine():
    values, ids = random_topk(2, 3, 2, seed=2)
    assert max_tree_size(3, 2) == 14
    assert build_tree(values, ids, torch.zeros(2, dtype=torch.long), budget=1000).num_nodes == 14
    one = build_tree(values, ids, torch.zeros(2, dtype=torch.long), budget=1)
    assert one.num_nodes == 1 and torch.equal(one.tokens[:, 1], ids[:, 0, 0])
    chain = chain_tree(values, ids, torch.zeros(2, dtype=torch.long))
    assert chain.num_nodes == 3
    assert torch.equal(chain.parents[0], torch.tensor([-1, 0, 1, 2]))
    assert torch.equal(chain.tokens[:, 1:], ids[:, :, 0])


def test_ancestor_mask_and_pointers_agree():
    values, ids = random_topk(3, 5, 3, seed=4)
    tree = build_tree(values, ids, torch.zeros(3, dtype=torch.long), budget=30)
    mask = ancestor_mask(tree.parents)
    first, nxt = tree_pointers(tree.parents)
    r = tree.num_rows
    for b in range(3):
        assert mask[b, 0].tolist() == [True] + [False] * (r - 1)
        for i in range(1, r):
            p = int(tree.parents[b, i])
            expect = mask[b, p].clone()
            expect[i] = True
            assert torch.equal(mask[b, i], expect)
        depth = mask[b].sum(-1) - 1
        assert torch.equal(depth, tree.depths[b])
        for i in range(r):
            # children by the mask: rows that see i and are one level deeper
            by_mask = [j for j in range(r) if mask[b, j, i] and depth[j] == depth[i] + 1]
            by_pointers, c = [], int(first[b, i])
            while c != -1:
                by_pointers.append(c)
                c = int(nxt[b, c])
            assert by_pointers == by_mask


@pytest.mark.parametrize("rows", [1, 2, 17, 64, 65, 300])
def test_ancestor_mask_matches_walking_up_any_row_order(rows):
    """Both strategies (squaring for small trees, level walk for large ones) equal the definition, for trees
    whose rows are not in topological order."""
    rng = random.Random(rows)
    order = list(range(rows))
    rng.shuffle(order)  # order[k] is the row of the k-th node in a random tree
    parents = [-1] * rows
    for k in range(1, rows):
        parents[order[k]] = order[rng.randrange(k)]
    mask = ancestor_mask(torch.tensor([parents, [-1] + list(range(rows - 1))]))
    for i in range(rows):
        want, j = {i}, parents[i]
        while j >= 0:
            want.add(j)
            j = parents[j]
        assert set(mask[0, i].nonzero().flatten().tolist()) == want
        assert set(mask[1, i].nonzero().flatten().tolist()) == set(range(i + 1))


# ---------------------------------------------------------------------- candidate sources: tags, merge, walk

def lookup_tree(contexts: list[list[int]], rows: int, acceptance: SourceAcceptance, depth: int = 6,
                matches: int = 3) -> DraftTree:
    """An n-gram-like candidate tree per request (a test fixture, not a source): the continuations of the most
    recent earlier occurrences of the context's last token, tagged ``SOURCE_NGRAM`` and scored by ``acceptance``."""
    packed = []
    for ctx in contexts:
        trie = CandidateTrie(ctx[-1])
        starts = [i + 1 for i in range(len(ctx) - 2, -1, -1) if ctx[i] == ctx[-1]][:matches]
        for s in starts:
            node = 0
            for tok in ctx[s: s + depth]:
                node = trie.add(node, tok, 0.0, SOURCE_NGRAM)
        trie.rescore(acceptance.log_table(SOURCE_NGRAM), SOURCE_NGRAM)
        packed.append(trie.best_first(rows - 1))
    return pack_trees(packed)


def random_path_tree(rng: random.Random, roots: list[int], vocab: int, paths: int, depth: int,
                     acceptance: SourceAcceptance) -> DraftTree:
    """Random token paths per request under the given roots, tagged ``SOURCE_NGRAM``, rescored."""
    packed = []
    for root in roots:
        trie = CandidateTrie(root)
        for _ in range(paths):
            node = 0
            for _ in range(rng.randint(1, depth)):
                node = trie.add(node, rng.randrange(vocab), 0.0, SOURCE_NGRAM)
        trie.rescore(acceptance.log_table(SOURCE_NGRAM), SOURCE_NGRAM)
        packed.append(trie.best_first(10_000))
    return pack_trees(packed)


def tree_paths(tree: DraftTree, b: int) -> dict[tuple[int, ...], tuple[float, int]]:
    """Request b's nodes as token path -> (score, tag), padding rows left out."""
    tok, par = tree.tokens[b].tolist(), tree.parents[b].tolist()
    sco, tag = tree.scores[b].tolist(), tree.source_tags()[b].tolist()
    path_of: list[tuple[int, ...]] = [()]
    out = {}
    for r in range(1, len(tok)):
        path_of.append(path_of[par[r]] + (tok[r],))
        if tag[r] != SOURCE_NONE:
            out[path_of[r]] = (sco[r], tag[r])
    return out


def check_tree_invariants(tree: DraftTree) -> None:
    for b in range(tree.batch_size):
        par, dep, tok = tree.parents[b].tolist(), tree.depths[b].tolist(), tree.tokens[b].tolist()
        tags = tree.source_tags()[b].tolist()
        assert par[0] == -1 and dep[0] == 0 and tags[0] == SOURCE_NONE
        seen = set()
        for r in range(1, len(par)):
            assert 0 <= par[r] < r, "parents come before children"
            assert dep[r] == dep[par[r]] + 1
            if tags[r] != SOURCE_NONE:
                assert (par[r], tok[r]) not in seen, "merged siblings carry distinct tokens"
                seen.add((par[r], tok[r]))
                assert tags[par[r]] != SOURCE_NONE or par[r] == 0, "no real node under a padding row"


def test_untagged_trees_are_the_drafters_and_prefix_keeps_tags():
    values, ids = random_topk(2, 4, 3, seed=5)
    tree = build_tree(values, ids, torch.tensor([3, 4]), budget=10)
    assert tree.sources is None
    tags = tree.source_tags()
    assert tags[:, 0].tolist() == [SOURCE_NONE] * 2 and bool((tags[:, 1:] == SOURCE_DRAFTER).all())
    assert tree.prefix(4).sources is None and tree.prefix(4).num_rows == 4
    merged = merge_trees([tree], rows=11)
    assert torch.equal(merged.tokens, tree.tokens) and torch.equal(merged.parents, tree.parents)
    assert torch.equal(merged.scores, tree.scores) and torch.equal(merged.source_tags(), tags)
    cut = merged.prefix(5)
    assert cut.sources.shape == (2, 5) and torch.equal(cut.sources, merged.sources[:, :5])


@pytest.mark.parametrize("seed", range(4))
def test_merge_is_the_best_prefix_closed_part_of_the_union(seed):
    rng = random.Random(seed)
    bs, vocab, depth = 3, 4, 5  # a small vocabulary: the sources share many prefixes
    acc = SourceAcceptance(max_depth=depth)
    values, ids = random_topk(bs, depth, 3, vocab=vocab, seed=seed)
    roots = [rng.randrange(vocab) for _ in range(bs)]
    drafter = build_tree(values, ids, torch.tensor(roots), budget=60)
    ngram = random_path_tree(rng, roots, vocab, paths=12, depth=depth, acceptance=acc)
    full = merge_trees([drafter, ngram], rows=10_000)
    check_tree_invariants(full)
    both = 0
    for b in range(bs):
        d, n, m = tree_paths(drafter, b), tree_paths(ngram, b), tree_paths(full, b)
        assert set(m) == set(d) | set(n), "the full merge is the union of the paths"
        for path, (score, tag) in m.items():
            want_tag = (SOURCE_DRAFTER if path in d else 0) | (SOURCE_NGRAM if path in n else 0)
            assert tag == want_tag
            assert score == pytest.approx(max(s[0] for s in (d.get(path), n.get(path)) if s is not None))
            both += tag == SOURCE_BOTH
    assert both > 0, "the sources share prefixes here"
    for rows in (1, 2, 7, 20):
        part = merge_trees([drafter, ngram], rows=rows)
        check_tree_invariants(part)
        assert part.num_rows == rows
        assert torch.equal(part.tokens, full.prefix(rows).tokens), "a merged tree's prefix is the smaller merge"
        assert torch.equal(part.sources, full.prefix(rows).sources)
        for b in range(bs):
            kept, union = tree_paths(part, b), tree_paths(full, b)
            sco = part.scores[b, 1:].tolist()
            assert all(a >= c - 1e-6 for a, c in zip(sco, sco[1:])), "best-first"
            if kept:
                left = [s for p, (s, _) in union.items() if p not in kept]
                assert not left or max(left) <= min(s for s, _ in kept.values()) + 1e-6


@pytest.mark.parametrize("seed", range(6))
def test_merge_of_one_proposing_source_equals_the_trie_merge(seed):
    """Where one source alone proposes for a request (the others root-only, or untagged), ``merge_trees`` packs that
    tree's rows without a trie: the same rows, scores and tags as the trie's best-first walk, ties and the depth
    cap included, and trees that are not best-first (shuffled scores, padding between nodes) still go through it."""
    from glance_sgl.tree import CandidateTrie

    def trie_merge(trees, rows, max_depth):
        packed = []
        for b in range(trees[0].batch_size):
            trie = CandidateTrie(int(trees[0].tokens[b, 0]))
            for t in trees:
                trie.add_tree(t.tokens[b].tolist(), t.parents[b].tolist(), t.scores[b].float().tolist(),
                              t.source_tags()[b].tolist(), max_depth)
            packed.append(trie.best_first(rows - 1))
        return pack_trees(packed)

    rng = random.Random(seed)
    bs, depth = 4, 6
    values, ids = random_topk(bs, depth, 3, vocab=6, seed=seed)
    if seed % 2:  # ties: equal log-probabilities among siblings and across depths
        values = values.round(decimals=0)
    roots = torch.tensor([rng.randrange(6) for _ in range(bs)])
    drafter = build_tree(values, ids, roots, budget=30)
    acc = SourceAcceptance(max_depth=depth)
    ngram = only_requests(random_path_tree(rng, roots.tolist(), 6, paths=5, depth=depth, acceptance=acc),
                          [b % 2 == 0 for b in range(bs)])  # requests 1 and 3: the drafter alone
    shuffled = DraftTree(drafter.tokens, drafter.parents, drafter.depths,
                         drafter.scores[:, torch.randperm(drafter.num_rows)].clone(), drafter.source_tags())
    for trees in ([drafter, ngram], [ngram, drafter], [drafter], [shuffled, ngram], [ngram]):
        for rows, cap in ((1, None), (7, None), (31, None), (40, 3), (12, 2)):
            fast, slow = merge_trees(trees, rows, cap), trie_merge(trees, rows, cap)
            for name in ("tokens", "parents", "depths", "scores", "sources"):
                assert torch.equal(getattr(fast, name), getattr(slow, name)), (name, rows, cap)


@pytest.mark.parametrize("seed", range(4))
def test_a_drafter_pass_for_some_requests_spreads_over_the_batch(seed):
    """The drafter's trees of part of a batch (``Planner.draft_mask``) spread over the whole batch: its requests keep
    their rows (tagged as the drafter's), the others hold their root and padding that no merge takes, so merged with
    the n-gram trees every request gets what the merge of its own sources gives, and the tree stays valid."""
    rng = random.Random(seed)
    bs, depth = 5, 5
    roots = torch.tensor([rng.randrange(6) for _ in range(bs)])
    members = sorted(rng.sample(range(bs), rng.randint(1, bs - 1)))
    values, ids = random_topk(len(members), depth, 3, vocab=6, seed=seed)
    part = build_tree(values, ids, roots[members], budget=20)
    spread = spread_requests(part, members, roots)
    assert spread.batch_size == bs and spread.num_rows == part.num_rows
    check_tree_invariants(spread)
    tags = spread.source_tags()
    for j, b in enumerate(members):
        for name in ("tokens", "parents", "depths", "scores"):
            assert torch.equal(getattr(spread, name)[b], getattr(part, name)[j])
        assert tags[b, 0] == SOURCE_NONE and bool((tags[b, 1:] == SOURCE_DRAFTER).all())
    for b in set(range(bs)) - set(members):
        assert spread.tokens[b].tolist() == [int(roots[b])] * part.num_rows
        assert bool((tags[b] == SOURCE_NONE).all()) and bool(torch.isinf(spread.scores[b, 1:]).all())
    ngram = random_path_tree(rng, roots.tolist(), 6, paths=4, depth=depth, acceptance=SourceAcceptance(depth))
    merged = merge_trees([spread, ngram], 12)
    idx = torch.tensor(members)
    ours = merge_trees([part, DraftTree(*(getattr(ngram, n)[idx] for n in ("tokens", "parents", "depths", "scores",
                                                                         "sources")))], 12)
    alone = merge_trees([ngram], 12)
    for b in range(bs):  # members: their drafter and n-gram trees merged; the others: their matches alone
        ref, j = (ours, members.index(b)) if b in members else (alone, b)
        w = int((ref.source_tags()[j] != SOURCE_NONE).sum()) + 1
        for name in ("tokens", "parents", "depths", "sources"):
            assert getattr(merged, name)[b, :w].tolist() == getattr(ref, name)[j, :w].tolist(), (b, name)
    check_tree_invariants(merged)


def test_merge_pads_per_request_budgets_and_caps_depth():
    values, ids = random_topk(3, 6, 2, seed=9)
    roots = torch.tensor([1, 2, 3])
    drafter = build_tree(values, ids, roots, budget=40)
    merged = merge_trees([drafter], rows=[1, 5, 12])
    assert merged.num_rows == 12
    tags, scores = merged.source_tags(), merged.scores
    assert tags[0, 1:].tolist() == [SOURCE_NONE] * 11 and bool(torch.isinf(scores[0, 1:]).all())
    assert merged.tokens[0].tolist() == [1] * 12 and merged.parents[0, 1:].tolist() == [0] * 11
    assert merged.depths[0, 1:].tolist() == [1] * 11
    assert tags[1, 5:].tolist() == [SOURCE_NONE] * 7 and bool((tags[1, 1:5] == SOURCE_DRAFTER).all())
    assert bool((tags[2, 1:] == SOURCE_DRAFTER).all())
    check_tree_invariants(merged)
    capped = merge_trees([drafter], rows=41, max_depth=2)
    assert int(capped.depths.max()) <= 2
    assert merge_trees([drafter], rows=1).num_rows == 1
    with pytest.raises(ValueError):
        merge_trees([drafter, build_tree(values, ids, roots + 1, budget=4)], rows=8)
    with pytest.raises(ValueError):
        merge_trees([drafter], rows=0)
    with pytest.raises(ValueError):
        merge_trees([drafter], rows=[3, 3])
    with pytest.raises(ValueError):
        merge_trees([], rows=3)


def test_acceptance_learns_per_source_depth_and_rank():
    # root 9; row 1 (drafter, d1) -> row 3 (both, d2); row 2 (ngram, d1, rank 0) -> row 4 (ngram, d2); row 5
    # (ngram, d1, rank 1). The walk takes rows 1 and 3.
    tree = DraftTree(torch.tensor([[9, 1, 2, 3, 4, 5]]), torch.tensor([[-1, 0, 0, 1, 2, 0]]),
                     torch.tensor([[0, 1, 1, 2, 2, 1]]), torch.zeros(1, 6),
                     torch.tensor([[SOURCE_NONE, SOURCE_DRAFTER, SOURCE_NGRAM, SOURCE_BOTH, SOURCE_NGRAM,
                                    SOURCE_NGRAM]]))
    walk = torch.tensor([[0, 1, 3]])
    acc = SourceAcceptance(max_depth=3, ranks=2, decay=1.0)
    acc.observe(tree, walk)
    assert acc.tries[SOURCE_DRAFTER][1].tolist() == [1, 0] and acc.hits[SOURCE_DRAFTER][1].tolist() == [1, 0]
    assert acc.tries[SOURCE_DRAFTER][2].tolist() == [1, 0] and acc.hits[SOURCE_DRAFTER][2].tolist() == [1, 0]
    assert acc.tries[SOURCE_NGRAM][1].tolist() == [1, 1] and acc.hits[SOURCE_NGRAM][1].tolist() == [0, 0]
    # row 3 (both) was reached (its parent, row 1, is on the path); row 4's parent (row 2) was not
    assert acc.tries[SOURCE_NGRAM][2].tolist() == [1, 0] and acc.hits[SOURCE_NGRAM][2].tolist() == [1, 0]
    assert acc.probs(SOURCE_DRAFTER)[1, 0] > acc.probs(SOURCE_NGRAM)[1, 0]
    counts = accepted_per_source(tree, walk)
    assert counts[SOURCE_DRAFTER].tolist() == [2] and counts[SOURCE_NGRAM].tolist() == [1]
    with pytest.raises(ValueError):
        SourceAcceptance(prior_mean=(1.5,))


def test_hindsight_labels_every_proposed_node_against_the_committed_tokens():
    # root 9 -> 1 (rank 0) -> 2 -> 3; root -> 4 (rank 1) -> 5; committed after the root: 1, 2, 7
    tree = HindsightTree(tokens=[9, 1, 4, 2, 5, 3], parents=[-1, 0, 0, 1, 2, 3], depths=[0, 1, 1, 2, 2, 3],
                         ranks=[-1, 0, 1, 0, 0, 0])
    assert tree.depth == 3 and not tree.mature
    tree.future = [1, 2, 7]
    assert tree.mature
    acc = SourceAcceptance(max_depth=3, ranks=2, decay=1.0)
    acc.observe_hindsight(SOURCE_NGRAM, [tree])
    t, h = acc.tries[SOURCE_NGRAM], acc.hits[SOURCE_NGRAM]
    assert t[1].tolist() == [1, 1] and h[1].tolist() == [1, 0]  # 1 taken, 4 not
    assert t[2].tolist() == [1, 0] and h[2].tolist() == [1, 0]  # 2 (under 1) taken; 5's parent was never reached
    assert t[3].tolist() == [1, 0] and h[3].tolist() == [0, 0]  # 3 tried against 7
    # a partial continuation labels only the depths it reaches
    short = HindsightTree([9, 1, 2], [-1, 0, 1], [0, 1, 2], [-1, 0, 0], future=[1])
    acc.observe_hindsight(SOURCE_NGRAM, [short])
    assert t[1].tolist() == [2, 1] and t[2].tolist() == [1, 0]


def test_verified_trees_do_not_count_for_a_hindsight_source():
    tree = DraftTree(torch.tensor([[9, 1, 2]]), torch.tensor([[-1, 0, 0]]), torch.tensor([[0, 1, 1]]),
                     torch.zeros(1, 3), torch.tensor([[SOURCE_NONE, SOURCE_DRAFTER, SOURCE_NGRAM]]))
    acc = SourceAcceptance(max_depth=2, decay=1.0)
    acc.hindsight.add(SOURCE_NGRAM)
    acc.observe(tree, torch.tensor([[0, 2]]))
    assert acc.tries[SOURCE_NGRAM].sum() == 0 and acc.tries[SOURCE_DRAFTER][1, 0] == 1


class TableTarget:
    """A deterministic toy target for the walk: next-token logits [V] from the context's last two tokens (a fixed
    random trigram table times ``sharpness``: a sharp table repeats itself, so n-gram candidates get taken)."""

    def __init__(self, vocab: int = 8, seed: int = 0, sharpness: float = 3.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = torch.randn(vocab, vocab, vocab, generator=g) * sharpness

    def logits(self, context: list[int]) -> torch.Tensor:
        return self.table[context[-2], context[-1]]

    def tree_logits(self, contexts: list[list[int]], tree: DraftTree) -> torch.Tensor:
        """[B, R, V]: each row's logits given the context then the row's path (the root is the context's end)."""
        out = torch.empty(tree.batch_size, tree.num_rows, self.vocab)
        for b, ctx in enumerate(contexts):
            paths: list[list[int]] = [[]]
            for r, (tok, par) in enumerate(zip(tree.tokens[b].tolist(), tree.parents[b].tolist())):
                if r:
                    paths.append(paths[par] + [tok])
                out[b, r] = self.logits(ctx + paths[r])
        return out

    def greedy_chain(self, context: list[int], n: int) -> list[int]:
        ctx = list(context)
        for _ in range(n):
            ctx.append(int(self.logits(ctx).argmax()))
        return ctx[len(context):]


def ar_decode(target: TableTarget, prompt: list[int], spec: SamplingSpec, n: int) -> list[int]:
    """The target's own output: one choice per step (greedy, or the seeded sample of output index i)."""
    ctx, out = list(prompt), []
    while len(out) < n:
        logits = target.logits(ctx)[None, None]
        tok = int(target_choices(logits, torch.zeros(1, 1, dtype=torch.long), torch.tensor([len(out)]), [spec])[0, 0])
        out.append(tok)
        ctx.append(tok)
    return out


def noisy_drafter_tree(target: TableTarget, contexts: list[list[int]], rng: random.Random, depth: int = 5,
                       k: int = 2, budget: int = 12, hit: float = 0.6) -> DraftTree:
    """A drafter-like best-first tree: per-offset logits that favour the target's greedy chain with chance
    ``hit`` per offset (random otherwise)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = torch.randn(len(contexts), depth, target.vocab, generator=g)
    for b, ctx in enumerate(contexts):
        for d, tok in enumerate(target.greedy_chain(ctx, depth)):
            if rng.random() < hit:
                logits[b, d, tok] += 4.0
    values, ids = topk_per_offset(torch.log_softmax(logits, -1), k)
    return build_tree(values, ids, torch.tensor([c[-1] for c in contexts]), budget)


def speculative_decode(target: TableTarget, prompts: list[list[int]], specs: list[SamplingSpec], n: int,
                       propose, rng: random.Random, acceptance: SourceAcceptance | None = None,
                       on_round=None) -> tuple[list[list[int]], dict[int, int]]:
    """Rounds of merged trees (``propose(contexts, outputs) -> [DraftTree, ...]``, random row budgets, AR rounds
    among them) verified by ``verify_tree``; returns each request's first ``n`` committed tokens and the accepted
    nodes per source tag."""
    ctxs, outs = [list(p) for p in prompts], [[] for _ in prompts]
    accepted = {SOURCE_DRAFTER: 0, SOURCE_NGRAM: 0, SOURCE_BOTH: 0}
    while min(len(o) for o in outs) < n:
        trees = propose(ctxs, outs)
        rows = [rng.choice([1, 2, 3, 6, 10, 17, 33]) for _ in prompts]
        merged = merge_trees(trees, rows)
        check_tree_invariants(merged)
        logits = target.tree_logits(ctxs, merged)
        walk = verify_tree(merged.tokens, merged.parents, merged.depths, logits,
                           torch.tensor([len(o) for o in outs]), specs)
        tags = merged.source_tags()
        for b, row in enumerate(walk.accepted_rows.tolist()):
            for r in row[1:]:
                if r > 0:
                    accepted[int(tags[b, r])] = accepted.get(int(tags[b, r]), 0) + 1
        if acceptance is not None:
            acceptance.observe(merged, walk.accepted_rows)
        for b, toks in enumerate(walk.committed()):
            outs[b] += toks
            ctxs[b] += toks
        if on_round is not None:
            on_round(merged, walk)
    return [o[:n] for o in outs], accepted


SPECS = [SamplingSpec(), SamplingSpec(temperature=0.8, seed=11), SamplingSpec(temperature=1.0, top_p=0.9, seed=-3),
         SamplingSpec(), SamplingSpec(temperature=0.6, seed=2**40 + 5)]


@pytest.mark.parametrize("seed", range(3))
def test_merged_trees_are_lossless(seed):
    """Random merged trees (drafter-like + n-gram-like candidates, random budgets, AR rounds among them) commit
    exactly the target's greedy output and its seeded samples, token for token."""
    rng = random.Random(seed)
    target = TableTarget(vocab=8, seed=seed, sharpness=3.0)
    prompts = [[rng.randrange(8) for _ in range(rng.randint(3, 12))] for _ in SPECS]
    acc = SourceAcceptance(max_depth=6)

    def propose(ctxs, _outs):
        return [noisy_drafter_tree(target, ctxs, rng), lookup_tree(ctxs, 24, acc)]

    n = 40
    got, accepted = speculative_decode(target, prompts, SPECS, n, propose, rng, acceptance=acc)
    for prompt, spec, out in zip(prompts, SPECS, got):
        assert out == ar_decode(target, prompt, spec, n)
    assert accepted[SOURCE_NGRAM] + accepted[SOURCE_BOTH] > 0 and accepted[SOURCE_DRAFTER] > 0


def test_rescore_scores_by_depth_and_rank_and_packs_best_first():
    """Rescoring a source's nodes by a depth/rank table: a node's score is its parent's plus its cell, siblings
    ranked in the order they were added; best_first then takes the likeliest prefix-closed rows (here a depth-1
    sibling before the chain's third node), scores never increasing along them."""
    table = [[0.0, 0.0]] + [[-0.1, -0.15]] * 8  # deep rank-0 cells cost more in sum than a depth-1 rank-1 one
    trie = CandidateTrie(0)
    node = 0
    for tok in (1, 2, 3, 4):  # the chain, its nodes each its parent's first choice
        node = trie.add(node, tok, 0.0, SOURCE_NGRAM)
    trie.add(0, 9, 0.0, SOURCE_NGRAM)  # the root's second choice
    ranks = trie.rescore(table, SOURCE_NGRAM)
    assert ranks == [-1, 0, 0, 0, 0, 1]
    assert trie.scores[4] == pytest.approx(-0.4) and trie.scores[5] == pytest.approx(-0.15)
    tokens, parents, depths, scores, _ = trie.best_first(3)
    assert tokens == [0, 1, 9, 2] and parents == [-1, 0, 0, 1]
    assert all(a >= b for a, b in zip(scores[1:], scores[2:]))


@pytest.mark.parametrize("seed", range(6))
def test_best_first_of_a_chain_or_a_tree_is_the_frontier_walk(seed):
    """best_first packs the frontier walk's rows (best score whose parent is packed, ties in creation order); a
    trie that is one chain takes a shortcut (its rows in creation order), with the same rows."""
    rng = random.Random(seed)
    trie = CandidateTrie(7)
    chain = seed % 2 == 0
    for i in range(rng.randrange(1, 14)):
        parent = len(trie) - 1 if chain else rng.randrange(len(trie))
        trie.add(parent, rng.randrange(50) + 100 * i, -rng.uniform(0, 3) - trie.depths[parent], SOURCE_NGRAM)
    for n in (0, 1, 3, len(trie) - 1, len(trie) + 2):
        rows, row_of = [0], {0: 0}
        heap = [(-trie.scores[c], c) for c in trie.children[0]]
        heapq.heapify(heap)
        while heap and len(rows) <= n:
            _, node = heapq.heappop(heap)
            row_of[node] = len(rows)
            rows.append(node)
            for c in trie.children[node]:
                heapq.heappush(heap, (-trie.scores[c], c))
        tok, par, dep, sco, tag = trie.best_first(n)
        assert tok == [trie.tokens[i] for i in rows] and dep == [trie.depths[i] for i in rows]
        assert par == [-1] + [row_of[trie.parents[i]] for i in rows[1:]]
        assert sco == [0.0] + [trie.scores[i] for i in rows[1:]]
        assert tag == [SOURCE_NONE] + [SOURCE_NGRAM] * (len(rows) - 1)


@pytest.mark.parametrize("seed", range(3))
def test_accepted_alone_is_what_a_walk_of_the_smaller_tree_accepts(seed):
    """What the n-gram tree alone would have accepted, read off a merged round's committed tokens, equals what a
    walk of that tree alone accepts (greedy and seeded sampling), cut at what the merged round committed."""
    rng = random.Random(seed)
    target = TableTarget(vocab=6, seed=seed, sharpness=3.0)
    acc = SourceAcceptance(max_depth=6)
    checked = 0
    for _ in range(12):
        ctxs = [[rng.randrange(6) for _ in range(rng.randint(4, 14))] for _ in SPECS]
        index = torch.tensor([rng.randrange(50) for _ in SPECS])
        alone_tree = lookup_tree(ctxs, rng.choice([2, 4, 8]), acc)
        merged = merge_trees([noisy_drafter_tree(target, ctxs, rng), alone_tree], rng.choice([3, 9, 17]))
        big = verify_tree(merged.tokens, merged.parents, merged.depths, target.tree_logits(ctxs, merged), index,
                          SPECS)
        small = verify_tree(alone_tree.tokens, alone_tree.parents, alone_tree.depths,
                            target.tree_logits(ctxs, alone_tree), index, SPECS)
        got = accepted_alone(alone_tree, big.committed_tokens)
        expect = torch.minimum(small.accept_lens, big.accept_lens + 1)
        assert got.tolist() == expect.tolist()
        checked += int((expect > 0).sum())
    assert checked > 0  # the n-gram trees were taken now and then: the check is not vacuous


def test_host_pointers_equal_the_tensor_pointers():
    """Small trees on the host take one pass over lists; the same rows padded past ``SQUARING_MAX_ROWS`` (extra
    roots: no children, no siblings) take the tensor path, and the two agree, rows in any order."""
    from glance_sgl.tree import SQUARING_MAX_ROWS

    gen = torch.Generator().manual_seed(11)
    for r in (1, 2, 9, 33, SQUARING_MAX_ROWS):
        parents = torch.randint(-1, r, (4, r), generator=gen)
        pad = torch.full((4, SQUARING_MAX_ROWS + 1), -1, dtype=torch.long)
        first, nxt = tree_pointers(parents)
        wide_first, wide_nxt = tree_pointers(torch.cat([parents, pad], dim=1))
        assert torch.equal(first, wide_first[:, :r]) and torch.equal(nxt, wide_nxt[:, :r])


def test_hindsight_contexts_are_learned_apart():
    """A proposal made while its request was on track (copying) is labelled in its own context, so a copy's
    successes do not lift the estimate of matches elsewhere, nor their failures sink the copy's."""
    acc = SourceAcceptance(max_depth=2, ranks=1, decay=1.0)
    chain = ([9, 1, 2], [-1, 0, 1], [0, 1, 2], [-1, 0, 0])
    acc.observe_hindsight(SOURCE_NGRAM, [HindsightTree(*chain, future=[1, 2], context=CONTEXT_ON_TRACK),
                                         HindsightTree(*chain, future=[7, 7])])
    assert acc.cells(SOURCE_NGRAM, CONTEXT_ON_TRACK)[1][1:, 0].tolist() == [1, 1]
    assert acc.hits[SOURCE_NGRAM][1:, 0].tolist() == [0, 0] and acc.tries[SOURCE_NGRAM][1:, 0].tolist() == [1, 0]
    assert acc.probs(SOURCE_NGRAM, CONTEXT_ON_TRACK)[1, 0] > 0.5 > acc.probs(SOURCE_NGRAM)[1, 0]
    assert acc.log_table(SOURCE_NGRAM, CONTEXT_ON_TRACK)[2][0] > acc.log_table(SOURCE_NGRAM)[2][0]
    with pytest.raises(ValueError):
        acc.probs(SOURCE_NGRAM, 5)


def test_foreseen_follows_the_first_choices():
    # root 9 -> 1 (rank 0) -> 2 (rank 0) -> 3; root -> 4 (rank 1)
    tree = HindsightTree([9, 1, 4, 2, 3], [-1, 0, 0, 1, 3], [0, 1, 1, 2, 3], [-1, 0, 1, 0, 0])
    assert tree.foreseen([1, 2]) == (2, True)
    assert tree.foreseen([1, 2, 3, 8]) == (3, True)  # past the leaf: nothing contradicted
    assert tree.foreseen([1, 5]) == (1, False)
    assert tree.foreseen([4]) == (0, False)  # in the tree, but not its first choice


def test_the_log_table_follows_every_labelled_batch():
    """The host table a lookup scores with is made once per change of the counts, and a labelled batch changes it."""
    acc = SourceAcceptance(max_depth=2, ranks=1, decay=1.0)
    first = acc.log_table(SOURCE_NGRAM)
    assert acc.log_table(SOURCE_NGRAM) is first  # no change: the same lists
    acc.observe_hindsight(SOURCE_NGRAM, [HindsightTree([9, 1], [-1, 0], [0, 1], [-1, 0], future=[1])])
    after = acc.log_table(SOURCE_NGRAM)
    assert after[1][0] > first[1][0]
    assert after == acc.probs(SOURCE_NGRAM).log().tolist()
    assert acc.log_table(SOURCE_NGRAM, CONTEXT_ON_TRACK) == acc.probs(SOURCE_NGRAM, CONTEXT_ON_TRACK).log().tolist()


def test_a_truncated_tree_keeps_each_requests_prefix_and_detaches_the_rest():
    """``DraftTree.truncated``: request b keeps its first ``rows[b]`` rows; its later rows are detached (no parent,
    token -1, untagged), so neither walk takes them even where the target's choices would match the tokens they
    had, and ``accepted_alone`` never counts them."""
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 1, 2]])
    depths = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    tree = DraftTree(tokens, parents, depths, torch.zeros(2, 4), None)
    assert tree.truncated([4, 4]) is tree
    cut = tree.truncated([2, 4])
    assert cut.tokens.tolist() == [[5, 6, -1, -1], [5, 6, 7, 8]]
    assert cut.parents.tolist() == [[-1, 0, -1, -1], [-1, 0, 1, 2]]
    assert cut.sources is None and torch.isinf(cut.scores[0, 2:]).all()
    choices = torch.tensor([[6, 7, 8, 9], [6, 7, 8, 9]])
    for device_resident in (False, True):
        logits = torch.nn.functional.one_hot(choices, 16).float()
        walk = verify_tree(cut.tokens, cut.parents, cut.depths, logits, torch.zeros(2, dtype=torch.long),
                           [SamplingSpec()] * 2, device_resident=device_resident)
        assert walk.accept_lens.tolist() == [1, 3] and walk.bonus.tolist() == [7, 9]
    tagged = DraftTree(tokens, parents, depths, torch.zeros(2, 4), torch.full((2, 4), SOURCE_NGRAM)).truncated([2, 4])
    assert tagged.sources[0].tolist() == [SOURCE_NGRAM, SOURCE_NGRAM, SOURCE_NONE, SOURCE_NONE]
    committed = torch.tensor([[6, 7, 8, 9], [6, 7, 8, 9]])
    assert accepted_alone(cut, committed).tolist() == [1, 3]


def test_a_tree_added_under_a_node_is_the_same_as_its_whole_path():
    """``CandidateTrie.add_tree(..., under=node)`` hangs a tree's rows under an existing node (a chain's
    continuation under the chain's end): the same trie as adding the whole path from the root again, and the depth
    cap counts from the root."""
    from glance_sgl.tree import CandidateTrie

    chain, more = [5, 6, 7, 8], [8, 9, 10]  # the continuation's row 0 is the chain's end
    a, b = CandidateTrie(5), CandidateTrie(5)
    ends = a.add_tree(chain, [-1, 0, 1, 2], [0.0] * 4, [SOURCE_NGRAM] * 4, max_depth=4)
    assert ends == [0, 1, 2, 3]
    assert a.add_tree(more, [-1, 0, 1], [0.0] * 3, [SOURCE_NGRAM] * 3, max_depth=4, under=ends[-1]) == [3, 4, -1]
    b.add_tree(chain, [-1, 0, 1, 2], [0.0] * 4, [SOURCE_NGRAM] * 4, max_depth=4)
    b.add_tree(chain + more[1:], [-1, 0, 1, 2, 3, 4], [0.0] * 6, [SOURCE_NGRAM] * 6, max_depth=4)
    assert (a.tokens, a.parents, a.depths) == (b.tokens, b.parents, b.depths) == (
        [5, 6, 7, 8, 9], [-1, 0, 1, 2, 3], [0, 1, 2, 3, 4])


def test_is_chain_tells_one_path_from_a_branching_tree():
    """A tree is one chain exactly where its last row is as deep as there are rows below the root."""
    from glance_sgl.tree import is_chain

    assert is_chain([0]) and is_chain([0, 1, 2, 3])
    assert not is_chain([0, 1, 1]) and not is_chain([0, 1, 2, 2])


def _until_end(tokens: list[int], stops: frozenset[int], room: int) -> list[int]:
    """What a request keeps of committed tokens: up to its first stop token (included) and ``room`` tokens."""
    out = []
    for t in tokens[:room]:
        out.append(t)
        if t in stops:
            break
    return out


def test_rows_past_a_requests_end_are_dropped_and_the_rest_keeps_its_order():
    """``without_ended``: a stop token's row and every row below it go, and rows deeper than ``room - 1``; the
    others keep their order (best-first, parents renumbered), a request with fewer rows left than the widest is
    padded as ``pack_trees`` pads, an untagged tree stays untagged, and a tree with nothing to drop is returned as
    it is; a large batch's tensor ops drop the same rows."""
    #          root  a  b  EOS  c(a) d(EOS) e(c)  f(b)
    tokens = torch.tensor([[5, 1, 2, 9, 3, 4, 6, 7],
                           [5, 1, 2, 9, 3, 4, 6, 7]])
    parents = torch.tensor([[-1, 0, 0, 0, 1, 3, 4, 2]] * 2)
    depths = torch.tensor([[0, 1, 1, 1, 2, 2, 3, 2]] * 2)
    scores = -torch.arange(8, dtype=torch.float32).expand(2, 8)
    tree = DraftTree(tokens, parents, depths, scores.clone(), None)
    assert without_ended(tree, [frozenset({8})] * 2, None) is tree
    assert without_ended(tree, None, [4, 4]) is tree and without_ended(tree, None, None) is tree
    out = without_ended(tree, [frozenset({9}), frozenset()], [10, 3])
    # request 0: EOS (row 3) and its child (row 5) dropped; request 1: depth 3 (row 6) dropped (room 3: depth <= 2)
    assert out.tokens.tolist() == [[5, 1, 2, 3, 6, 7, 5], [5, 1, 2, 9, 3, 4, 7]]
    assert out.parents.tolist() == [[-1, 0, 0, 1, 3, 2, 0], [-1, 0, 0, 0, 1, 3, 2]]
    assert out.depths.tolist() == [[0, 1, 1, 2, 3, 2, 1], [0, 1, 1, 1, 2, 2, 2]]
    assert out.scores[0, :6].tolist() == [0.0, -1.0, -2.0, -4.0, -6.0, -7.0] and out.scores[0, 6] == float("-inf")
    assert out.sources is None
    tagged_tree = DraftTree(tokens, parents, depths, scores.clone(), torch.full((2, 8), SOURCE_NGRAM))
    tagged = without_ended(tagged_tree, [frozenset({9}), frozenset()], [10, 3])
    assert tagged.tokens.tolist() == out.tokens.tolist()
    assert tagged.sources.tolist() == [[SOURCE_NGRAM] * 6 + [SOURCE_NONE], [SOURCE_NGRAM] * 7]
    for t in (tree, tagged_tree):
        a, b = without_ended(t, [frozenset({9}), frozenset()], [10, 3]), _without_ended_batch(t, [frozenset({9}),
                                                                                              frozenset()], [9, 2])
        for field in ("tokens", "parents", "depths", "scores"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert (a.sources is None and b.sources is None) or torch.equal(a.sources, b.sources)
    only_root = without_ended(tree, [frozenset({1, 2, 9})] * 2, [1, 1])
    assert only_root.num_rows == 1 and only_root.tokens.tolist() == [[5], [5]]


@pytest.mark.parametrize("seed", range(3))
def test_dropping_the_rows_past_the_end_commits_the_same_tokens(seed):
    """Random merged trees with random stop tokens and token limits: the walk over the tree without the rows past
    each request's end commits, up to that end, the target's own output (greedy and seeded sampling), at least as
    many tokens as the walk over the whole tree, and never verifies more rows."""
    rng = random.Random(seed)
    target = TableTarget(vocab=8, seed=seed, sharpness=3.0)
    acc = SourceAcceptance(max_depth=6)
    dropped = 0
    for _ in range(30):
        prompts = [[rng.randrange(8) for _ in range(rng.randint(3, 12))] for _ in SPECS]
        tree = merge_trees([noisy_drafter_tree(target, prompts, rng, hit=0.8), lookup_tree(prompts, 24, acc)],
                           rng.choice([6, 12, 24]))
        stops = [frozenset(rng.sample(range(8), rng.randint(0, 2))) for _ in SPECS]
        room = [rng.randint(1, 7) for _ in SPECS]
        cut = without_ended(tree, stops, room)
        check_tree_invariants(cut)
        if cut is not tree:  # a large batch's tensor ops drop the same rows as the host lists
            batch = _without_ended_batch(tree, stops, [max(r - 1, 0) for r in room])
            for field in ("tokens", "parents", "depths", "scores", "sources"):
                assert torch.equal(getattr(batch, field), getattr(cut, field)), field
        assert cut.num_rows <= tree.num_rows
        dropped += int((tree.scores > float("-inf")).sum() - (cut.scores > float("-inf")).sum())
        index = torch.zeros(len(prompts), dtype=torch.long)  # the first output token of each request
        whole, part = (verify_tree(t.tokens, t.parents, t.depths, target.tree_logits(prompts, t), index, SPECS)
                       for t in (tree, cut))
        for b, (a, c) in enumerate(zip(whole.committed(), part.committed())):
            own = _until_end(ar_decode(target, prompts[b], SPECS[b], 8), stops[b], room[b])
            a, c = _until_end(a, stops[b], room[b]), _until_end(c, stops[b], room[b])
            assert c == own[:len(c)] and a == own[:len(a)] and len(c) >= len(a)
    assert dropped > 0
