"""The drafter pass of a decode step at static shapes, replayed from CUDA graphs on a GPU.

A drafting step runs, for a batch of ``bs`` requests with contexts of at most ``C`` tokens: the gather of the
context's draft K/V from the draft KV pool through ``req_to_token``, one drafter forward of every request's
block, the per-offset top-k, and the best-first budget tree (``glance_kernels.budget_tree``). Its shapes depend
on ``bs`` and ``C`` only, so it can be captured once per ``(bs bucket, C bucket)`` and replayed, the way SGLang's
DFLASH v2 worker captures its draft pass:

- the batch is padded to the bucket: padding requests read request-pool row 0 with context length 0 and root 0,
  and their rows of the output are dropped;
- the context is padded to the bucket: columns past a request's length read SGLang's padding slot and are masked
  (``GlanceDrafter.draft_block(padded=True)``), so the logits equal the unpadded pass's up to float rounding;
- on CUDA (``use_graphs``) each bucket's pass is captured with ``torch.cuda.graph`` on first use (after a warm-up
  on a side stream) and replayed; the inputs are copied into the graph's static buffers and the outputs are
  cloned out of them. Anywhere else the same static-shape function runs eagerly, which is what the CPU tests
  compare with the eager pass.

The tree only steers speed: the target's verify pass decides every committed token, so a rounding difference in
the draft logits can change what is drafted, never what is output.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Callable

import torch

import glance_kernels
from glance_sgl.drafter import GlanceDrafter, draft_logprobs
from glance_sgl.tree import DraftTree, topk_per_offset

from .draft_pool import DraftKVPool

logger = logging.getLogger(__name__)


def draft_pass(drafter: GlanceDrafter, pool: DraftKVPool, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               lengths: torch.Tensor, roots: torch.Tensor, capacity: int, *, max_depth: int, branch_k: int,
               budget: int, padded: bool = False, build: Callable | None = None) -> DraftTree:
    """One drafting pass for a batch: the context (request b's first ``lengths[b]`` tokens, ``capacity`` >= every
    length, known on the host) gathered from ``pool``, the drafter over every block ``[root, MASK x (B-1)]``
    (``roots`` [bs]), the per-offset top-``branch_k`` of the first ``max_depth`` offsets and the best-first tree of
    ``budget`` nodes by ``build`` (default ``glance_kernels.budget_tree``; ``glance_sgl.tree.build_tree`` is the
    host heap). ``padded``: ``capacity`` may exceed every length (static shapes). Returns fields [bs, budget+1]."""
    pool.flush()
    cache = pool.gather(req_to_token, req_pool_indices, lengths, capacity)
    logits = drafter.draft_block(cache, roots, context_len=capacity, padded=padded)[:, :max_depth]
    values, ids = topk_per_offset(draft_logprobs(logits), branch_k)
    t = (build or glance_kernels.budget_tree)(values, ids, roots, budget)
    return DraftTree(t.tokens, t.parents, t.depths, t.scores)


def batch_buckets(max_bs: int) -> list[int]:
    """Batch sizes the pass is captured for: 1, 2, 4, 8, then every 8 up to ``max_bs`` (SGLang's own spacing)."""
    out = [b for b in (1, 2, 4, 8) if b <= max_bs]
    out += list(range(16, max_bs + 1, 8))
    if not out or out[-1] < max_bs:
        out.append(max_bs)
    return out


def context_buckets(max_context: int, smallest: int = 64) -> list[int]:
    """Context capacities: powers of two from ``smallest`` up to ``max_context`` (the last one exactly it)."""
    out, c = [], smallest
    while c < max_context:
        out.append(c)
        c *= 2
    out.append(max_context)
    return out


def bucket_of(buckets: list[int], value: int) -> int:
    """The smallest bucket >= ``value``; ValueError when ``value`` exceeds the largest."""
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{value} exceeds the largest captured size {buckets[-1]}")
    return buckets[i]


@dataclass
class StaticDraftInputs:
    """The static input buffers of one bucket: ``req_pool_indices`` / ``lengths`` / ``roots`` [bs] long."""

    req_pool_indices: torch.Tensor
    lengths: torch.Tensor
    roots: torch.Tensor

    @classmethod
    def zeros(cls, bs: int, device) -> "StaticDraftInputs":
        z = lambda: torch.zeros(bs, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(), z(), z())

    def load(self, req_pool_indices: torch.Tensor, lengths: torch.Tensor, roots: torch.Tensor) -> None:
        """Copy a batch of ``n <= bs`` requests in; the padding rows read row 0 with length 0 and root 0."""
        n = roots.shape[0]
        for buf, src in ((self.req_pool_indices, req_pool_indices), (self.lengths, lengths), (self.roots, roots)):
            buf[:n].copy_(src.to(buf.device, torch.long))
            buf[n:].zero_()


class DraftPassRunner:
    """The drafting step's pass (gather, drafter, top-k, budget tree) at bucketed static shapes.

    ``drafter``: the bound drafter; ``pool``: the draft KV pool; ``req_to_token``: SGLang's slot table
    [reqs, max_context]; ``max_depth`` / ``branch_k`` / ``budget``: the tree's limits (as the worker's);
    ``max_bs``: the largest batch to capture (``--cuda-graph-max-bs``); ``use_graphs``: capture and replay CUDA
    graphs (a CUDA device only).
    """

    def __init__(self, drafter: GlanceDrafter, pool: DraftKVPool, req_to_token: torch.Tensor, *, max_depth: int,
                 branch_k: int, budget: int, max_bs: int, use_graphs: bool) -> None:
        self.drafter, self.pool, self.req_to_token = drafter, pool, req_to_token
        self.max_depth, self.branch_k, self.budget = max_depth, branch_k, budget
        self.device = pool.k[0].device
        self.use_graphs = bool(use_graphs) and self.device.type == "cuda"
        self.bs_buckets = batch_buckets(max_bs)
        self.ctx_buckets = context_buckets(int(req_to_token.shape[1]))
        self._inputs: dict[int, StaticDraftInputs] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, DraftTree]] = {}
        self._pool_handle = None  # one memory pool shared by every captured bucket

    def fits(self, bs: int, max_length: int) -> bool:
        """Whether a batch of ``bs`` requests with contexts up to ``max_length`` has a bucket."""
        return bs <= self.bs_buckets[-1] and max_length <= self.ctx_buckets[-1]

    def static_pass(self, inputs: StaticDraftInputs, capacity: int) -> DraftTree:
        """The pass on ``inputs`` with contexts padded to ``capacity``: fixed shapes, no host sync.
        Returns the full budget tree, fields [bs, budget + 1]."""
        return draft_pass(self.drafter, self.pool, self.req_to_token, inputs.req_pool_indices, inputs.lengths,
                          inputs.roots, capacity, max_depth=self.max_depth, branch_k=self.branch_k,
                          budget=self.budget, padded=True)

    def run(self, req_pool_indices: torch.Tensor, lengths: torch.Tensor, roots: torch.Tensor, max_length: int
            ) -> DraftTree:
        """The full budget trees [n, budget + 1] of a batch of ``n`` requests (``lengths``: context tokens before
        each root; ``max_length``: their maximum, known on the host)."""
        n = roots.shape[0]
        bs, cap = bucket_of(self.bs_buckets, n), bucket_of(self.ctx_buckets, max(int(max_length), 1))
        inputs = self._inputs.get(bs)
        if inputs is None:
            inputs = self._inputs[bs] = StaticDraftInputs.zeros(bs, self.device)
        self.pool.flush()  # pending writes go in before a graph reads the pool (the flush is not captured)
        inputs.load(req_pool_indices, lengths, roots)
        if self.use_graphs:
            graph, out = self._graphs.get((bs, cap)) or self._capture(bs, cap, inputs)
            graph.replay()
        else:
            out = self.static_pass(inputs, cap)
        return DraftTree(*(t[:n].clone() for t in (out.tokens, out.parents, out.depths, out.scores)))

    def _capture(self, bs: int, cap: int, inputs: StaticDraftInputs) -> tuple["torch.cuda.CUDAGraph", DraftTree]:
        """Capture the pass of bucket ``(bs, cap)`` on its static inputs (a warm-up on a side stream first, as
        ``torch.cuda.graph`` needs)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.static_pass(inputs, cap)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool_handle):
            out = self.static_pass(inputs, cap)
        self._graphs[(bs, cap)] = (graph, out)
        logger.info("GLANCE drafter pass captured: batch %d, context %d (%d graphs)", bs, cap, len(self._graphs))
        return graph, out
