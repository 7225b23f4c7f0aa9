"""The budget tree on device: Triton == torch reference == glance_sgl.tree.build_tree (same nodes, same order)."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.kernel_helpers import DEVICE, assert_same, both

import glance_kernels as gk
from glance_sgl.tree import DraftTree, build_tree, max_tree_size, topk_per_offset


def _topk(bs: int, depth: int, k: int, seed: int, ties: bool = False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, 50, generator=gen) * 2
    if ties:  # coarse log-probs: many equal scores, so the insertion-order tie-break decides
        logits = torch.zeros(bs, depth, 50).scatter_(-1, torch.randint(0, 50, (bs, depth, 6), generator=gen), 1.0)
    vals, ids = topk_per_offset(torch.log_softmax(logits, -1), k)
    return vals.to(DEVICE), ids.to(DEVICE), torch.randint(0, 50, (bs,), generator=gen).to(DEVICE)


def _fields(tree: DraftTree) -> tuple[torch.Tensor, ...]:
    return tree.tokens.cpu(), tree.parents.cpu(), tree.depths.cpu(), tree.scores.cpu()


def _check(vals, ids, roots, budget):
    ref, tri = both(gk.budget_tree, vals, ids, roots, budget)
    assert isinstance(ref, DraftTree) and isinstance(tri, DraftTree)  # one tree type, whichever path built it
    assert_same(_fields(ref), _fields(tri))
    core = build_tree(vals.cpu(), ids.cpu(), roots.cpu(), budget)
    assert_same(_fields(ref), _fields(core))
    return ref


@pytest.mark.parametrize(("depth", "k", "budget"), [
    (15, 8, 63), (15, 8, 31), (6, 4, 1), (1, 8, 63), (3, 3, 39), (4, 2, 100), (15, 1, 63), (7, 5, 20),
])
def test_budget_tree_matches_build_tree(depth: int, k: int, budget: int) -> None:
    ref = _check(*_topk(3, depth, k, depth * 10 + k + budget), budget)
    assert ref.tokens.shape[1] == min(budget, max_tree_size(depth, k)) + 1


@pytest.mark.parametrize("seed", range(3))
def test_budget_tree_ties(seed: int) -> None:
    _check(*_topk(4, 5, 6, seed, ties=True), 40)


def test_budget_tree_chain_and_max_budget() -> None:
    vals, ids, roots = _topk(2, 3, 3, 7)
    full = _check(vals, ids, roots, 10**6)  # the whole 3-ary tree of depth 3
    assert full.tokens.shape[1] == 3 + 9 + 27 + 1
    chain = _check(vals[..., :1], ids[..., :1], roots, 3)  # width 1: the greedy spine
    assert chain.parents[0].tolist() == [-1, 0, 1, 2]
