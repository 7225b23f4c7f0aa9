"""The FULL verify mask (SGLang's TARGET_VERIFY layout): Triton == torch reference == the NGRAM worker's layout."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.kernel_helpers import DEVICE, PREFIXES, assert_same, both, random_parents

import glance_kernels as gk
from glance_sgl.tree import ancestor_mask


def _tree_mask(kind: str, n: int, bs: int, seed: int) -> torch.Tensor:
    return ancestor_mask(random_parents(kind, n, bs, torch.Generator().manual_seed(seed))).to(DEVICE)


@pytest.mark.parametrize("kind", ["chain", "star", "random"])
@pytest.mark.parametrize("n", [1, 7, 32])
@pytest.mark.parametrize("prefix", sorted(PREFIXES))
def test_full_mask(kind: str, n: int, prefix: str) -> None:
    tree = _tree_mask(kind, n, 3, n)
    pre = PREFIXES[prefix]
    lens = torch.tensor(pre, device=DEVICE)
    full_ref, full_tri = both(gk.full_mask, tree, lens, pre)
    assert_same(full_ref, full_tri)
    # the FULL layout the NGRAM worker builds: per request cat(ones(N, prefix), tree).flatten()
    expect = torch.cat([torch.cat([torch.ones(n, p, dtype=torch.bool), tree[b].cpu()], 1).flatten()
                        for b, p in enumerate(pre)])
    assert torch.equal(full_ref.cpu(), expect)
    assert gk.mask_indptr(n, pre) == [0] + [sum(n * (p + n) for p in pre[: b + 1]) for b in range(len(pre))]


def test_empty_batch() -> None:
    tree = torch.zeros(0, 4, 4, dtype=torch.bool, device=DEVICE)
    lens = torch.zeros(0, dtype=torch.long, device=DEVICE)
    ref, tri = both(gk.full_mask, tree, lens, [])
    assert ref.numel() == 0 and tri.numel() == 0


@pytest.mark.parametrize("n", [1, 7])
def test_full_mask_per_request_and_flat_gathers_agree(n: int) -> None:
    """The reference builds the mask per request (on a CPU always, elsewhere up to ``SMALL_BATCH`` requests) or
    with flat gathers (beyond that off a CPU): the same layout either way, at every batch size."""
    from glance_kernels import reference

    pre = [0, 5, 17, 2, 9, 31, 300, 1][: reference.SMALL_BATCH + 4]
    tree = _tree_mask("random", n, len(pre), 3 + n)
    for bs in range(1, len(pre) + 1):
        flat = reference.full_mask_flat(tree[:bs], pre[:bs])
        assert torch.equal(reference.full_mask(tree[:bs], pre[:bs]).cpu(), flat.cpu())
        one_by_one = torch.cat([reference.full_mask(tree[b:b + 1], [p]) for b, p in enumerate(pre[:bs])])
        assert torch.equal(one_by_one.cpu(), flat.cpu())
