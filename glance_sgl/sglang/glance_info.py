"""The verify input GLANCE hands to SGLang's target pass (the data half, as ``ngram_info.py`` is for NGRAM).

A GLANCE tree is an arbitrary tree packed as ``[root] + nodes`` (``N = budget + 1`` rows per request), so its
verify input has exactly the fields of SGLang's NGRAM verify input: the packed tokens, SGLang's FULL custom mask
(per request ``N x (prefix + N)``, row-major), positions ``prefix + depth`` (SGLang adds the M-RoPE delta of
Qwen-VL targets from them), and the first-child / next-sibling links. Subclassing ``NgramVerifyInput`` keeps
every attention backend that understands an NGRAM tree verify (FlashInfer's custom mask on GPU, the
``glance_cpu`` backend here) working unchanged.

Between steps a request carries :class:`GlanceDraftInput`: its newest committed token (the root of its next
tree, the ``bonus_tokens`` of SGLang's V2 relay). Synchronously the scheduler hands it to the next step as it is;
under overlap scheduling it travels through SGLang's ``FutureMap`` (``stash`` of ``bonus_tokens`` by request
pool slot, resolved into the next batch's ``spec_info.bonus_tokens``), as EAGLE's and DFLASH's do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

import glance_kernels


class GlanceVerifyInput(NgramVerifyInput):
    """Verify input of one GLANCE step (also the draft input between steps, like NGRAM's)."""

    def __init__(self, *args, depths: torch.Tensor | None = None, parents: torch.Tensor | None = None,
                 ragged_rows: list[int] | None = None, ragged_tree_mask: torch.Tensor | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.depths = depths
        self.parents = parents
        # a ragged pass (``build_verify_input(rows=...)``): rows verified per request, and the trees' ancestor
        # mask [bs, N, N] that the ``glance_cpu`` backend masks each request's rows with (no flat FULL mask)
        self.ragged_rows = ragged_rows
        self.ragged_tree_mask = ragged_tree_mask


@dataclass
class GlanceDraftInput(SpecInput):
    """What a request carries from one GLANCE step to the next: ``bonus_tokens`` [bs] long, its newest committed
    token (the root of its next tree). The other fields are the ones SGLang's overlap relay reads of every V2 draft
    input (``RelayPayload.from_draft_input``); GLANCE relays nothing else (its drafter's context lives in the draft
    KV pool, indexed by SGLang's own token slots). ``future_indices``: set by the scheduler under overlap (the
    requests' pool slots in the ``FutureMap``), after which filtering and merging follow them instead."""

    bonus_tokens: torch.Tensor
    topk_p: Optional[torch.Tensor] = None
    topk_index: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None
    future_indices: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        # carried between rounds, never the input of a forward (the worker builds each step's own)
        super().__init__(spec_input_type=SpecInputType.DFLASH_DRAFT)
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu: Optional[list[int]] = None) -> None:
        if self.future_indices is not None:
            self.future_indices = self.future_indices[new_indices]
            return
        self.bonus_tokens = self.bonus_tokens[new_indices]

    def merge_batch(self, spec_info: "GlanceDraftInput") -> None:
        if self.future_indices is not None:
            assert spec_info.future_indices is not None
            self.future_indices = torch.cat([self.future_indices, spec_info.future_indices])
            return
        self.bonus_tokens = torch.cat([self.bonus_tokens, spec_info.bonus_tokens])


@dataclass
class VerifyTensors:
    """What :func:`build_verify_input` derives from a batch of trees (all on the target's device)."""

    spec_info: GlanceVerifyInput
    input_ids: torch.Tensor  # [bs * N], or [T] rows of a ragged pass
    out_cache_loc: torch.Tensor  # the same
    tree_mask: torch.Tensor  # [bs, N, N]
    rows: torch.Tensor | None = None  # a ragged pass: each verified row's index in the [bs * N] layout, [T]
    left_out: torch.Tensor | None = None  # ... and the indices of the rows it leaves out, [bs * N - T]


@functools.lru_cache(maxsize=64)
def _verify_constants(bs: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row offsets [1, n], flat row index [bs, n]) of a verify pass of ``n`` rows per request: constants of the
    shape, made once (never written)."""
    rows = torch.arange(n, device=device)
    return rows[None, :], torch.arange(bs, device=device)[:, None] * n + rows[None, :]


def build_verify_input(tree, seq_lens: torch.Tensor, seq_lens_cpu: list[int],
                       req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                       rows: list[int] | None = None) -> VerifyTensors:
    """The TARGET_VERIFY input for a batch of packed trees (``tree``: a ``DraftTree`` / ``DeviceTree``, [bs, N]).

    ``seq_lens`` [bs]: tokens already in the KV cache per request (the root sits at position ``seq_lens[b]``);
    the verify rows write their K/V into ``req_to_token[r, seq_lens[b] : seq_lens[b] + N]``, slots the
    scheduler has reserved for the step. ``rows``: a ragged pass (the ``glance_cpu`` backend): request ``b``'s
    first ``rows[b]`` rows alone, ``T = sum(rows)`` of them in request order, masked by the spec's
    ``ragged_tree_mask`` and ``ragged_rows`` (no flat FULL mask).
    """
    device = seq_lens.device
    bs, n = tree.tokens.shape
    parents = tree.parents.to(device)
    meta = glance_kernels.tree_meta(parents, seq_lens)  # Triton on CUDA, torch reference elsewhere
    offsets, retrieve_index = _verify_constants(bs, n, device)
    out_cache_loc = req_to_token[req_pool_indices.long()[:, None], seq_lens.long()[:, None] + offsets]
    out_cache_loc = out_cache_loc.reshape(-1).to(torch.int64)
    tokens = tree.tokens.to(device).reshape(-1)
    positions = meta.positions.reshape(-1).to(torch.int64)
    kept = left_out = None
    if rows is None:
        custom_mask = glance_kernels.full_mask(meta.tree_mask, seq_lens, seq_lens_cpu)
    else:
        custom_mask = torch.zeros(0, dtype=torch.bool, device=device)  # none: the backend masks by tree_mask
        inside = (offsets < torch.tensor(rows, dtype=torch.long, device=device)[:, None]).reshape(-1)
        kept, left_out = inside.nonzero().squeeze(1), (~inside).nonzero().squeeze(1)
        tokens, positions, out_cache_loc = tokens[kept], positions[kept], out_cache_loc[kept]
    spec = GlanceVerifyInput(
        draft_token=tokens,
        custom_mask=custom_mask,
        positions=positions,
        retrieve_index=retrieve_index,
        retrieve_next_token=meta.first_child,
        retrieve_next_sibling=meta.next_sibling,
        draft_token_num=n,
        depths=tree.depths.to(device),
        parents=parents,
        ragged_rows=None if rows is None else list(rows),
        ragged_tree_mask=None if rows is None else meta.tree_mask,
    )
    return VerifyTensors(spec, tokens, out_cache_loc, meta.tree_mask, kept, left_out)


def accept_window(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                  accepted_rows: torch.Tensor, n: int) -> None:
    """Keep a verify step's accepted rows by reordering the slots of each request's verify window, not by moving
    K/V: the window ``req_to_token[r, seq_lens[b] : seq_lens[b] + n]`` (row ``j``'s K/V at its ``j``-th slot)
    becomes the accepted rows' slots in path order (``accepted_rows`` [bs, D+1], root first, -1 padding; D < n),
    then the other rows' slots, in row order. The window keeps the same slots (the request's, reserved for the
    step): only which position each serves changes, so the allocator's accounting is untouched. In place, on the
    table's device, no host read. For token-level slots (page size 1): a page of several tokens must stay whole."""
    device = req_to_token.device
    bs = accepted_rows.shape[0]
    offsets, _ = _verify_constants(bs, n, device)  # [1, n]
    rows = req_pool_indices.long()[:, None]
    cols = seq_lens.long()[:, None] + offsets
    window = req_to_token[rows, cols]  # [bs, n]
    acc = accepted_rows.to(device).long()
    rank = torch.arange(acc.shape[1], device=device).expand(bs, -1)
    # sort key: an accepted row's rank on the path, every other row after them (n + row); padding (-1) writes the
    # root's key again (0), so that duplicate indices of the scatter all carry the same value
    key = (offsets + n).expand(bs, -1).scatter(1, acc.clamp(min=0), torch.where(acc >= 0, rank, 0))
    req_to_token[rows, cols] = window.gather(1, key.argsort(dim=1))

