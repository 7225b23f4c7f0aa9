"""Greedy tree verification: Triton == torch reference == glance_sgl.verify.greedy_walk == SGLang 0.5.23."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, assert_same, both, greedy_predictions, load_sglang_module, random_parents

import glance_kernels as gk
from glance_sgl.tree import build_tree, topk_per_offset, tree_pointers
from glance_sgl.verify import greedy_walk


def _case(kind: str, n: int, bs: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if kind == "budget":  # a GLANCE budget tree (distinct sibling tokens)
        logp = torch.log_softmax(torch.randn(bs, 6, 40, generator=gen) * 3, -1)
        vals, ids = topk_per_offset(logp, 4)
        tree = build_tree(vals, ids, torch.randint(0, 40, (bs,), generator=gen), n - 1)
        tokens, parents = tree.tokens, tree.parents
    else:  # arbitrary trees; few distinct tokens so that siblings may repeat a token (first one wins)
        parents = random_parents(kind, n, bs, gen)
        tokens = torch.randint(0, 6, (bs, n), generator=gen)
    pred = greedy_predictions(tokens, parents, gen)
    first, nxt = tree_pointers(parents)
    return [t.to(DEVICE) for t in (tokens, parents, first, nxt, pred)]


KINDS = ["chain", "star", "random", "budget"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 16, 64])
def test_verify_matches_reference_and_walk(kind: str, n: int) -> None:
    for seed in range(3):
        tokens, parents, first, nxt, pred = _case(kind, n, 5, seed * 31 + n)
        ref, tri = both(gk.verify_greedy, tokens, first, nxt, pred)
        assert_same(ref, tri)
        walk = greedy_walk(tokens, parents, pred)
        w = walk.accepted_rows.shape[1]
        assert torch.equal(ref.accept_lens, walk.accept_lens) and torch.equal(ref.bonus, walk.bonus)
        assert torch.equal(ref.accepted_rows[:, :w], walk.accepted_rows)
        assert bool((ref.accepted_rows[:, w:] == -1).all())


@pytest.mark.parametrize("width", [1, 2, 4])
def test_verify_width_cap(width: int) -> None:
    tokens, parents, first, nxt, pred = _case("chain", 12, 4, 9)
    pred = torch.roll(tokens, -1, 1)  # the target agrees with the whole chain
    ref, tri = both(gk.verify_greedy, tokens, first, nxt, pred, width)
    assert_same(ref, tri)
    assert ref.accept_lens.tolist() == [width - 1] * 4
    assert torch.equal(ref.bonus, tokens[:, width])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 16, 33])
@pytest.mark.parametrize("width", [None, 5])
def test_verify_matches_sglang(kind: str, n: int, width: int | None) -> None:
    """SGLang's ``verify_tree_greedy_triton`` (interpreted on CPU) on the same inputs."""
    pytest.importorskip("sglang")
    spec_tree = load_sglang_module("spec_tree")
    bs = 4
    tokens, parents, first, nxt, pred = _case(kind, n, bs, n + 1000)
    w = n if width is None else width
    predicts = torch.full((bs * n,), -7, dtype=torch.long, device=DEVICE)
    accept_index = torch.full((bs, w), -1, dtype=torch.long, device=DEVICE)
    accept_num = torch.zeros(bs, dtype=torch.long, device=DEVICE)
    retrieve_index = torch.arange(bs * n, device=DEVICE).view(bs, n)
    spec_tree.verify_tree_greedy_triton(
        predicts, accept_index, accept_num, tokens, retrieve_index, first, nxt, pred
    )
    with gk.backend("triton"):
        ours = gk.verify_greedy(tokens, first, nxt, pred, width)
    base = torch.arange(bs, device=DEVICE)[:, None] * n
    assert torch.equal(accept_num, ours.accept_lens)
    assert torch.equal(accept_index, torch.where(ours.accepted_rows >= 0, ours.accepted_rows + base, -1))
    # SGLang writes the target's token at every accepted row (root included); the last one is the bonus
    for b in range(bs):
        path = ours.accepted_rows[b, : int(ours.accept_lens[b]) + 1]
        assert torch.equal(predicts.view(bs, n)[b, path], pred[b, path])
        assert int(predicts.view(bs, n)[b, path[-1]]) == int(ours.bonus[b])
