"""Accepted-path KV compaction in a paged cache: Triton == torch reference == an explicit per-token model."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.kernel_helpers import DEVICE, assert_same

import glance_kernels as gk


def _case(page_size: int, prefix: list[int], n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix)
    pages_per_req = max((p + n + page_size - 1) // page_size for p in prefix)
    perm = torch.randperm(bs * pages_per_req + 3, generator=gen)[: bs * pages_per_req]  # scattered pages
    table = perm.view(bs, pages_per_req)
    slots = (bs * pages_per_req + 3) * page_size
    rows = torch.full((bs, n), -1, dtype=torch.long)
    for b in range(bs):  # an accepted path: increasing rows starting at the root
        k = int(torch.randint(0, n, (1,), generator=gen))
        rest = torch.randperm(n - 1, generator=gen)[:k].sort().values + 1
        rows[b, : k + 1] = torch.cat([torch.zeros(1, dtype=torch.long), rest])
    k_cache = torch.randn(slots, 2, 8, generator=gen)
    v_cache = torch.randn(slots, 2, 8, generator=gen).to(torch.bfloat16)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE), torch.tensor(prefix, device=DEVICE), rows.to(DEVICE)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("prefix", [[0, 0, 0], [0, 5, 37], [3, 64, 17]])
@pytest.mark.parametrize("n", [1, 9, 32])
def test_compact_kv(page_size: int, prefix: list[int], n: int) -> None:
    k, v, table, lens, rows = _case(page_size, prefix, n, page_size * 100 + n)
    k_ref, v_ref, k_tri, v_tri = k.clone(), v.clone(), k.clone(), v.clone()
    with gk.backend("torch"):
        new_ref = gk.compact_kv([k_ref, v_ref], table, page_size, lens, rows)
    with gk.backend("triton"):
        new_tri = gk.compact_kv([k_tri, v_tri], table, page_size, lens, rows)
    assert_same((new_ref, k_ref, v_ref), (new_tri, k_tri, v_tri))
    expect_k = k.clone()
    for b, p in enumerate(prefix):
        path = [int(r) for r in rows[b] if r >= 0]
        assert int(new_ref[b]) == p + len(path)
        slot = lambda pos: int(table[b, pos // page_size]) * page_size + pos % page_size  # noqa: E731
        for j, r in enumerate(path):
            expect_k[slot(p + j)] = k[slot(p + r)]
    assert torch.equal(k_ref, expect_k)  # moved rows in place, everything else untouched


def test_compact_kv_paged_view() -> None:
    """A ``[pages, page_size, H, D]`` cache goes in as ``flatten(0, 1)``, a view: moved in place."""
    k, _, table, lens, rows = _case(4, [2, 9], 8, 1)
    paged = k.view(-1, 4, 2, 8).clone()
    flat_ref = k.clone()
    with gk.backend("triton"):
        gk.compact_kv([paged.flatten(0, 1)], table, 4, lens, rows)
    with gk.backend("torch"):
        gk.compact_kv([flat_ref], table, 4, lens, rows)
    assert torch.equal(paged.flatten(0, 1), flat_ref)
