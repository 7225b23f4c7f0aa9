"""Verify-pass tree attention over a paged KV cache: FlashInfer (CUDA) and a dense masked-SDPA reference.

Layout (FlashInfer's ``NHD`` paged cache): ``k_cache`` / ``v_cache`` [num_pages, page_size, H_kv, D]; request b
owns the pages ``page_table[b, :ceil(kv_len_b / page_size)]`` and its KV length is ``prefix_b + N``: the
committed prefix, then the N tree rows of the verify window (already written, as SGLang does before the
attention). Queries: the N tree rows of every request, ``q`` [bs * N, H_q, D]. Row i of request b sees the
whole prefix and, inside the window, its ancestors and itself (``tree_mask[b, i]``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from . import packed_mask


def kv_indices(page_table: torch.Tensor, page_size: int, kv_lens: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """FlashInfer's ragged page description: (kv_indptr [bs+1], kv_indices [pages used], last_page_len [bs]),
    int32 on the page table's device."""
    pages = [(int(n) + page_size - 1) // page_size for n in kv_lens]
    dev = page_table.device
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    indices = torch.cat([page_table[b, :p] for b, p in enumerate(pages)]).to(torch.int32)
    last = torch.tensor([int(n) - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return indptr.to(dev), indices, last.to(dev)


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: Sequence[int],
    tree_mask: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Dense masked SDPA per request (fp32 math), the oracle of :class:`FlashInferTreeAttention`.

    ``q`` [bs * N, H_q, D]; caches [num_pages, page_size, H_kv, D]; ``page_table`` [bs, max_pages];
    ``prefix_lens`` host ints [bs]; ``tree_mask`` bool [bs, N, N]. Returns [bs * N, H_q, D] in ``q``'s dtype.
    """
    bs, n, _ = tree_mask.shape
    page_size, h_kv, dim = k_cache.shape[1:]
    h_q = q.shape[1]
    scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    outs = []
    for b in range(bs):
        length = int(prefix_lens[b]) + n
        pos = torch.arange(length, device=q.device)
        slots = page_table[b, pos // page_size].long() * page_size + pos % page_size
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(h_q // h_kv, dim=1)  # [L, H_q, D]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(h_q // h_kv, dim=1)
        allow = torch.cat([tree_mask.new_ones(n, int(prefix_lens[b])), tree_mask[b]], dim=1)
        qb = q[b * n : (b + 1) * n].float().transpose(0, 1)  # [H_q, N, D]
        out = torch.nn.functional.scaled_dot_product_attention(
            qb, k.transpose(0, 1), v.transpose(0, 1), attn_mask=allow[None], scale=scale
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


class FlashInferTreeAttention:
    """Tree attention for a verify pass through ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` with the
    packed custom mask of :func:`glance_kernels.packed_mask` (CUDA only).

    ``plan`` once per verify round (page description, packed mask), then ``run`` once per layer.
    """

    def __init__(self, device: torch.device | str = "cuda", workspace_bytes: int = 128 << 20) -> None:
        import flashinfer  # CUDA-only at run time; imported here so that the module imports everywhere

        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")

    def plan(
        self,
        page_table: torch.Tensor,
        page_size: int,
        prefix_lens: torch.Tensor,
        tree_mask: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        prefix_cpu: Sequence[int] | None = None,
        sm_scale: float | None = None,
    ) -> None:
        """Describe this round: ``page_table`` [bs, max_pages], ``prefix_lens`` [bs] (device; ``prefix_cpu`` the
        same on the host), ``tree_mask`` bool [bs, N, N]."""
        bs, n, _ = tree_mask.shape
        host = [int(p) for p in (prefix_lens.tolist() if prefix_cpu is None else prefix_cpu)]
        kv_indptr, indices, last = kv_indices(page_table, page_size, [p + n for p in host])
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=page_table.device) * n
        self.wrapper.plan(
            qo_indptr, kv_indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,
            packed_custom_mask=packed_mask(tree_mask, prefix_lens, host),
            q_data_type=dtype, kv_data_type=dtype, sm_scale=sm_scale,
        )

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``q`` [bs * N, H_q, D], caches [num_pages, page_size, H_kv, D] -> [bs * N, H_q, D]."""
        return self.wrapper.run(q, (k_cache, v_cache))
