"""The budget tree: structure, optimality (brute force), pointers vs. mask."""

from __future__ import annotations

import itertools

import random

import pytest
import torch

from glance_sgl.tree import ancestor_mask, build_tree, chain_tree, max_tree_size, topk_per_offset, tree_pointers


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
