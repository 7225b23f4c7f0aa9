"""Keeping a verify step's accepted rows by reordering the window's slots (``accept_window``) reads the same K/V
at every committed position as moving the K/V there (``glance_kernels.compact_kv``), and the window keeps its
slots (the allocator's accounting is untouched)."""

from __future__ import annotations

import pytest
import torch

import glance_kernels as gk

pytest.importorskip("sglang")


@pytest.mark.parametrize("seed", range(6))
def test_reordered_slots_read_what_moved_kv_would(seed: int) -> None:
    from glance_sgl.sglang.glance_info import accept_window

    gen = torch.Generator().manual_seed(seed)
    bs, n, width = 4, 9, 64
    slots = (bs + 1) * width + 5
    table = torch.randperm(slots, generator=gen)[: (bs + 1) * width].view(bs + 1, width).to(torch.int32)
    pool = torch.tensor([2, 0, 4, 1])  # request b's row of the slot table (row 3: another request's)
    seq = torch.randint(0, width - n, (bs,), generator=gen)
    rows = torch.full((bs, n), -1, dtype=torch.long)
    for b in range(bs):  # an accepted path: increasing rows from the root, of any length
        k = int(torch.randint(0, n, (1,), generator=gen))
        rows[b, : k + 1] = torch.cat([torch.zeros(1, dtype=torch.long),
                                      torch.randperm(n - 1, generator=gen)[:k].sort().values + 1])
    kv = torch.randn(slots, 3, generator=gen)
    moved = kv.clone()
    gk.compact_kv([moved], table[pool].long(), 1, seq, rows)
    reordered = table.clone()
    accept_window(reordered, pool, seq, rows, n)
    for b in range(bs):
        r, s = int(pool[b]), int(seq[b])
        path = int((rows[b] >= 0).sum())
        for j in range(path):  # the committed positions read the accepted rows' K/V
            assert torch.equal(kv[int(reordered[r, s + j])], moved[int(table[r, s + j])])
        assert sorted(reordered[r, s:s + n].tolist()) == sorted(table[r, s:s + n].tolist())
        assert torch.equal(reordered[r, :s], table[r, :s]) and torch.equal(reordered[r, s + n:], table[r, s + n:])
    assert torch.equal(reordered[3], table[3])
