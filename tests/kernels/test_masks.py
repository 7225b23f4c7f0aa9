"""Verify masks: FULL (SGLang), packed (FlashInfer), query-only; Triton == torch reference == numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_helpers import DEVICE, PREFIXES, assert_same, both, random_parents

import glance_kernels as gk
from glance_kernels import reference
from glance_sgl.tree import ancestor_mask


def _tree_mask(kind: str, n: int, bs: int, seed: int) -> torch.Tensor:
    return ancestor_mask(random_parents(kind, n, bs, torch.Generator().manual_seed(seed))).to(DEVICE)


@pytest.mark.parametrize("kind", ["chain", "star", "random"])
@pytest.mark.parametrize("n", [1, 7, 32])
@pytest.mark.parametrize("prefix", sorted(PREFIXES))
def test_full_and_packed_masks(kind: str, n: int, prefix: str) -> None:
    tree = _tree_mask(kind, n, 3, n)
    pre = PREFIXES[prefix]
    lens = torch.tensor(pre, device=DEVICE)
    full_ref, full_tri = both(gk.full_mask, tree, lens, pre)
    assert_same(full_ref, full_tri)
    packed_ref, packed_tri = both(gk.packed_mask, tree, lens)  # host lengths read from the device tensor
    assert_same(packed_ref, packed_tri)
    # the FULL layout the NGRAM worker builds: per request cat(ones(N, prefix), tree).flatten()
    expect = torch.cat([torch.cat([torch.ones(n, p, dtype=torch.bool), tree[b].cpu()], 1).flatten()
                        for b, p in enumerate(pre)])
    assert torch.equal(full_ref.cpu(), expect)
    # packed = numpy.packbits(little) of each request's FULL segment
    bits_ptr, byte_ptr = gk.mask_indptr(n, pre, False), gk.mask_indptr(n, pre, True)
    for b in range(len(pre)):
        seg = expect[bits_ptr[b] : bits_ptr[b + 1]].numpy()
        got = packed_ref[byte_ptr[b] : byte_ptr[b + 1]].cpu().numpy()
        assert np.array_equal(got, np.packbits(seg, bitorder="little"))


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 64, 1000, 9001])
def test_packbits_matches_numpy(length: int) -> None:
    bits = torch.rand(length, generator=torch.Generator().manual_seed(length)) < 0.5
    assert np.array_equal(reference.packbits_little(bits).numpy(), np.packbits(bits.numpy(), bitorder="little"))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_segment_packbits(dtype: torch.dtype) -> None:
    lens = [0, 1, 13, 8, 4100, 3]
    indptr = np.concatenate([[0], np.cumsum(lens)]).tolist()
    bits = (torch.rand(indptr[-1], generator=torch.Generator().manual_seed(3)) < 0.5).to(dtype).to(DEVICE)
    ref, tri = both(gk.segment_packbits, bits, indptr)
    assert_same(ref, tri)
    packed, new = ref
    for i in range(len(lens)):
        seg = bits[indptr[i] : indptr[i + 1]].cpu().numpy().astype(bool)
        assert np.array_equal(packed[new[i] : new[i + 1]].cpu().numpy(), np.packbits(seg, bitorder="little"))


def test_empty_batch() -> None:
    tree = torch.zeros(0, 4, 4, dtype=torch.bool, device=DEVICE)
    lens = torch.zeros(0, dtype=torch.long, device=DEVICE)
    for fn in (gk.full_mask, gk.packed_mask):
        ref, tri = both(fn, tree, lens, [])
        assert ref.numel() == 0 and tri.numel() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer runs on CUDA only")
@pytest.mark.parametrize("prefix", sorted(PREFIXES))
def test_packed_mask_matches_flashinfer(prefix: str) -> None:
    flashinfer = pytest.importorskip("flashinfer")
    tree = _tree_mask("random", 32, 3, 5)
    pre = PREFIXES[prefix]
    full = gk.full_mask(tree, torch.tensor(pre, device=DEVICE), pre)
    indptr = torch.tensor(gk.mask_indptr(32, pre, False), device=DEVICE)
    fi_packed, fi_indptr = flashinfer.segment_packbits(full, indptr, bitorder="little")
    with gk.backend("triton"):
        ours = gk.packed_mask(tree, torch.tensor(pre, device=DEVICE), pre)
        seg, new = gk.segment_packbits(full, indptr.tolist())
    assert torch.equal(ours, fi_packed) and torch.equal(seg, fi_packed)
    assert fi_indptr.tolist() == gk.mask_indptr(32, pre, True) == new
    assert torch.equal(flashinfer.packbits(full[: indptr[1]], bitorder="little"), ours[: gk.mask_indptr(32, pre, True)[1]])
