"""Tree metadata (ancestor mask, positions, pointers): Triton == torch reference == glance_sgl.tree == SGLang."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.kernels.kernel_helpers import DEVICE, PREFIXES, assert_same, both, load_sglang_module, random_parents, sglang_function

import glance_kernels as gk
from glance_sgl.tree import ancestor_mask, tree_pointers

KINDS = ["chain", "star", "random"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 9, 32])
@pytest.mark.parametrize("prefix", sorted(PREFIXES))
def test_tree_meta_matches_reference_and_core(kind: str, n: int, prefix: str) -> None:
    gen = torch.Generator().manual_seed(n * 7 + len(kind))
    parents = random_parents(kind, n, 3, gen).to(DEVICE)
    prefix_lens = torch.tensor(PREFIXES[prefix], device=DEVICE)
    ref, tri = both(gk.tree_meta, parents, prefix_lens)
    assert_same(ref, tri)
    assert torch.equal(ref.tree_mask, ancestor_mask(parents))
    first, nxt = tree_pointers(parents)
    assert torch.equal(ref.first_child, first) and torch.equal(ref.next_sibling, nxt)
    depth = ref.tree_mask.sum(-1) - 1
    assert torch.equal(ref.positions, prefix_lens[:, None] + depth)
    lean = gk.tree_meta(parents, prefix_lens, pointers=False)  # the embedded engine's call: mask and positions
    assert torch.equal(lean.tree_mask, ref.tree_mask) and torch.equal(lean.positions, ref.positions)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 8, 21])
def test_pointer_layout_matches_sglang(kind: str, n: int) -> None:
    """Same tree mask into SGLang 0.5.23's ``reconstruct_indices_from_tree_mask`` (Triton kernel, interpreted
    on CPU) and the NGRAM worker's host-side ``_derive_tree_links``."""
    pytest.importorskip("sglang")
    recon = load_sglang_module("reconstruct_tree")
    gen = torch.Generator().manual_seed(100 + n)
    bs = 3
    parents = random_parents(kind, n, bs, gen).to(DEVICE)
    seq = torch.tensor([0, 4, 19], device=DEVICE)
    with gk.backend("triton"):
        meta = gk.tree_meta(parents, seq)
    positions = torch.empty(bs * n, dtype=torch.long, device=DEVICE)
    index, next_token, next_sibling = (torch.empty_like(positions) for _ in range(3))
    recon.reconstruct_indices_from_tree_mask_triton(
        meta.tree_mask.contiguous(), seq, positions, index, next_token, next_sibling, bs, n
    )
    assert torch.equal(positions.view(bs, n), meta.positions)
    assert torch.equal(next_token.view(bs, n), meta.first_child)
    assert torch.equal(next_sibling.view(bs, n), meta.next_sibling)
    assert torch.equal(index, torch.arange(bs * n, device=DEVICE))
    # SGLang's host-side derivation of the same links (NGRAM worker)
    derive = sglang_function("sglang.srt.speculative.ngram_worker", "_derive_tree_links", {"np": np, "torch": torch})
    host_next, host_sibling = derive(meta.tree_mask.cpu().numpy().reshape(-1), bs, n)
    assert torch.equal(host_next, meta.first_child.cpu()) and torch.equal(host_sibling, meta.next_sibling.cpu())
