"""Verify-pass tree attention: the dense reference on CPU; FlashInfer against it on CUDA."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import DEVICE, PREFIXES, random_parents

from glance_kernels.attention import kv_indices, tree_attention_reference
from glance_sgl.tree import ancestor_mask


def _case(prefix: list[int], n: int, page_size: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    bs, h_q, h_kv, dim = len(prefix), 4, 2, 64
    pages = max((p + n + page_size - 1) // page_size for p in prefix)
    table = torch.randperm(bs * pages, generator=gen).view(bs, pages)
    k = torch.randn(bs * pages, page_size, h_kv, dim, generator=gen)
    v = torch.randn(bs * pages, page_size, h_kv, dim, generator=gen)
    q = torch.randn(bs * n, h_q, dim, generator=gen)
    tree = ancestor_mask(random_parents("random", n, bs, gen))
    return [t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), table.int())] + [tree.to(DEVICE)]


@pytest.mark.parametrize("prefix", sorted(PREFIXES))
def test_reference_is_masked_softmax(prefix: str) -> None:
    """The dense reference equals softmax(q k^T / sqrt(d), masked) v written out per request, head and row."""
    pre = PREFIXES[prefix]
    n, page_size = 9, 4
    q, k, v, table, tree = _case(pre, n, page_size, torch.float32, 3)
    out = tree_attention_reference(q, k, v, table, pre, tree)
    b, i, h = len(pre) - 1, n - 1, 3
    length = pre[b] + n
    slots = [int(table[b, pos // page_size]) * page_size + pos % page_size for pos in range(length)]
    keys, vals = k.flatten(0, 1)[slots, h // 2], v.flatten(0, 1)[slots, h // 2]
    allowed = torch.cat([torch.ones(pre[b], dtype=torch.bool), tree[b, i].cpu()])
    logits = (keys @ q[b * n + i, h]) / math.sqrt(q.shape[-1])
    expect = torch.softmax(logits.masked_fill(~allowed, float("-inf")), 0) @ vals
    assert torch.allclose(out[b * n + i, h], expect, atol=1e-5)


def test_kv_indices() -> None:
    table = torch.tensor([[5, 2, 9], [1, 0, 7]])
    indptr, idx, last = kv_indices(table, 4, [9, 4])
    assert indptr.tolist() == [0, 3, 4] and idx.tolist() == [5, 2, 9, 1] and last.tolist() == [1, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer runs on CUDA only")
@pytest.mark.parametrize("prefix", sorted(PREFIXES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_tree_attention_matches_sdpa(prefix: str, page_size: int) -> None:
    pytest.importorskip("flashinfer")
    from glance_kernels.attention import FlashInferTreeAttention

    pre = PREFIXES[prefix]
    q, k, v, table, tree = _case(pre, 32, page_size, torch.bfloat16, 11)
    attn = FlashInferTreeAttention(DEVICE)
    attn.plan(table, page_size, torch.tensor(pre, device=DEVICE), tree, 4, 2, 64, torch.bfloat16, prefix_cpu=pre)
    out = attn.run(q, k, v)
    ref = tree_attention_reference(q, k, v, table, pre, tree)
    assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
