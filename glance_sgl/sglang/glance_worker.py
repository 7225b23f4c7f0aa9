"""GlanceWorker: GLANCE in SGLang's scheduler (the worker half, as ``ngram_worker.py`` is for NGRAM).

Per batch it does what ``glance_sgl.engine.GlanceEngine.speculative_round`` does per request, calling the same
algorithm (``glance_sgl.drafter`` / ``tree`` / ``verify`` and ``glance_kernels``):

- extend (prefill, chunked or not): the target's forward with its tap layers captured (SGLang's aux
  hidden-state capture, ``set_eagle3_layers_to_capture``); every prompt token's tap features go into the
  drafter's own context cache (KV injection), one cache per request;
- decode step: one drafter pass per request block ``[root, MASK x (B-1)]`` (batched), the budget tree from the
  per-offset top-k, the TARGET_VERIFY input (FULL mask, positions ``prefix + depth``; SGLang adds the M-RoPE
  delta), the target's verify pass, the walk (greedy at T = 0, seeded lossless sampling at T > 0), the accepted
  rows' K/V moved to the front of the verify window (``glance_kernels.compact_kv``), the accepted rows' tap
  features appended to the drafter cache, and a ``GenerationBatchResult`` whose accept lengths include the bonus
  token (SGLang then fills ``spec_verify_ct``, ``spec_accept_length``... in ``meta_info``).
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from typing import Optional

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.runtime_context import get_spec
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

import glance_kernels
from glance_sgl.drafter import DrafterCache, GlanceDrafter, draft_logprobs
from glance_sgl.tree import build_tree, topk_per_offset
from glance_sgl.verify import SamplingSpec, target_choices, verify_tree

from .drafter_model import GlanceDrafterForSGLang
from .glance_info import GlanceVerifyInput, build_verify_input

logger = logging.getLogger(__name__)


def stack_caches(caches: list[DrafterCache]) -> DrafterCache:
    """One batched drafter cache from per-request caches (capacity padded to the largest)."""
    if len(caches) == 1:
        return caches[0]
    cap = max(c.capacity for c in caches)
    for c in caches:
        c.reserve(cap)
    keys = [torch.cat([c.keys[i][:, :, :cap] for c in caches]) for i in range(len(caches[0].keys))]
    values = [torch.cat([c.values[i][:, :, :cap] for c in caches]) for i in range(len(caches[0].values))]
    return DrafterCache(keys, values, torch.cat([c.lengths for c in caches]))


def sampling_spec(req) -> SamplingSpec:
    """The request's sampling as ``glance_sgl.verify`` reads it (greedy when SGLang treats it as greedy)."""
    sp = req.sampling_params
    temperature = float(getattr(sp, "temperature", 0.0) or 0.0)
    if temperature < 1e-5 or getattr(sp, "top_k", -1) == 1:
        return SamplingSpec(0.0, 1.0, 0)
    seed = getattr(sp, "sampling_seed", None)
    if seed is None:
        seed = zlib.crc32(str(req.rid).encode())
    return SamplingSpec(temperature, float(getattr(sp, "top_p", 1.0) or 1.0), int(seed))


class _Profile:
    """Per-phase wall times of a decode step, logged when ``GLANCE_SGL_PROFILE=1``."""

    def __init__(self, on: bool) -> None:
        self.on, self.t, self.parts = on, time.perf_counter(), []

    def mark(self, name: str) -> None:
        if self.on:
            now = time.perf_counter()
            self.parts.append(f"{name}={1000 * (now - self.t):.1f}ms")
            self.t = now

    def done(self, bs: int) -> None:
        if self.on:
            logger.warning("GLANCE step bs=%d %s", bs, " ".join(self.parts))


class GlanceWorker(BaseSpecWorker):
    def __init__(self, server_args: ServerArgs, gpu_id: int, nccl_port: int, target_worker: TpModelWorker,
                 **kwargs):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        spec = get_spec()
        self.draft_token_num = int(spec.speculative_num_draft_tokens)
        self.speculative_num_draft_tokens = self.draft_token_num
        self.budget = self.draft_token_num - 1
        self.branch_k = int(spec.speculative_eagle_topk)
        self.max_depth = int(spec.speculative_num_steps)
        self.topk = self.branch_k

        target = self.model_runner.model
        self.drafter_module = GlanceDrafterForSGLang.from_checkpoint(
            spec.speculative_draft_model_path, device=self.device, dtype=self.model_runner.dtype)
        self.drafter: GlanceDrafter = self.drafter_module.bind_target(target)
        cfg = self.drafter.config
        text_cfg = getattr(self.model_runner.model_config.hf_config, "text_config",
                           self.model_runner.model_config.hf_config)
        n_layers = int(text_cfg.num_hidden_layers)
        if cfg.num_target_layers != n_layers:
            raise ValueError(f"GLANCE drafter was built for a {cfg.num_target_layers}-layer target; this target "
                             f"has {n_layers} layers")
        taps = list(cfg.tap_layers)
        if min(taps) < 0 or max(taps) >= n_layers - 1:
            # SGLang captures the input of layer t+1 (= the output of layer t), so the last layer is not tappable.
            raise ValueError(f"GLANCE tap layers {taps} must lie within [0, {n_layers - 2}] for this target")
        if not hasattr(target, "set_eagle3_layers_to_capture"):
            raise ValueError(f"{type(target).__name__} cannot capture hidden states (no "
                             "set_eagle3_layers_to_capture); GLANCE needs the target's tap layers")
        captured = sorted(set(taps))  # SGLang captures each layer once, in layer order
        target.set_eagle3_layers_to_capture(captured)
        self._tap_order = None if captured == taps else torch.tensor([captured.index(t) for t in taps])
        self._hidden = int(text_cfg.hidden_size)
        self.block_size = cfg.block_size
        # rid -> (request, drafter context cache)
        self.states: dict[str, tuple[object, DrafterCache]] = {}
        self._profile = os.environ.get("GLANCE_SGL_PROFILE", "") not in ("", "0")
        logger.info("GLANCE worker: block %d, tree budget %d, branch_k %d, max depth %d, taps %s", cfg.block_size,
                    self.budget, self.branch_k, self.max_depth, taps)

    # ------------------------------------------------------------------ BaseSpecWorker plumbing
    def alloc_memory_pool(self, **kwargs):
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    @property
    def target_worker(self) -> TpModelWorker:
        return self._target_worker

    @property
    def draft_worker(self):
        return None  # the drafter runs inside this worker; it has no ModelRunner of its own

    def clear_cache_pool(self):
        self.states.clear()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.states.pop(rid, None)

    def _purge(self, live: set[str]) -> None:
        for rid in [r for r, (req, _) in self.states.items() if r not in live and req.finished()]:
            del self.states[rid]

    @property
    def num_drafter_states(self) -> int:
        return len(self.states)

    # ------------------------------------------------------------------ the step
    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, pp_proxy_tensors=None
                                 ) -> GenerationBatchResult:
        self._purge({req.rid for req in batch.reqs})
        if batch.forward_mode.is_decode():
            return self._decode(batch, on_publish, pp_proxy_tensors)
        return self._extend(batch, on_publish, pp_proxy_tensors)

    def _extend(self, batch: ScheduleBatch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        bs = len(batch.reqs)
        result = self.target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors, capture_hidden_mode=CaptureHiddenMode.FULL)
        logits_output = result.logits_output
        if batch.forward_mode.is_extend() and bs > 0:
            hidden = logits_output.hidden_states
            self._feed_prompt(batch, None if hidden is None else self._taps(hidden))
            # Keep SGLang's output processing off the tap features (they are not the final hidden states).
            logits_output.hidden_states = None
        predict = result.next_token_ids
        if predict is not None and bs > 0 and batch.forward_mode.is_extend():
            predict = self._first_tokens(batch, logits_output, predict)
        new_seq_lens = batch.seq_lens.clone()
        accept_tokens = torch.zeros(bs, self.draft_token_num, dtype=torch.int32, device=self.device)
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        if predict is not None and bs > 0:
            accept_tokens[:, 0] = predict
        return self._result(result, logits_output, predict, accept_tokens.flatten(), accept_lens, new_seq_lens,
                            on_publish)

    def _result(self, result, logits_output, next_token_ids, accept_tokens, accept_lens, new_seq_lens, on_publish
                ) -> GenerationBatchResult:
        """The step's result; the draft input it carries (accepted tokens, lengths) follows SGLang's batch
        filtering and merging, like NGRAM's."""
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=next_token_ids,
            can_run_cuda_graph=result.can_run_cuda_graph,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=GlanceVerifyInput(draft_token_num=self.draft_token_num, new_seq_lens=new_seq_lens,
                                               accept_tokens=accept_tokens, accept_lens=accept_lens),
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
        )

    def _first_tokens(self, batch: ScheduleBatch, logits_output, predict: torch.Tensor) -> torch.Tensor:
        """At T > 0 the prompt's next token is drawn like every later one (glance_sgl.verify: Gumbel noise keyed
        by the request's seed and the output index), so that a seeded request's whole output is reproducible
        and equals the embedded engine's. Greedy requests keep SGLang's own choice."""
        specs = [sampling_spec(req) for req in batch.reqs]
        if all(s.greedy for s in specs):
            return predict
        rows = logits_output.next_token_logits.float().cpu()
        out = predict.clone()
        for b, (req, spec) in enumerate(zip(batch.reqs, specs)):
            if spec.greedy:
                continue
            row = rows[b]
            if float(row.min()) >= 0.0 and abs(float(row.sum()) - 1.0) < 1e-3:
                # SGLang's sampler leaves softmax(logits / T) in place: its log is the tempered distribution.
                row, spec = row.clamp_min(1e-30).log(), SamplingSpec(1.0, spec.top_p, spec.seed)
            choice = target_choices(row[None, None], torch.zeros(1, 1, dtype=torch.long),
                                    torch.tensor([len(req.output_ids)]), [spec])
            out[b] = int(choice[0, 0])
        return out

    def _taps(self, packed: torch.Tensor) -> torch.Tensor:
        """SGLang's packed captures [T, U*H] (unique layers in order) -> the drafter's tap order [T, L*H]."""
        if self._tap_order is None:
            return packed
        t = packed.shape[0]
        return packed.view(t, -1, self._hidden)[:, self._tap_order.to(packed.device)].reshape(t, -1)

    def _feed_prompt(self, batch: ScheduleBatch, taps: torch.Tensor) -> None:
        """Append every extended token's tap features to its request's drafter cache."""
        lens = list(batch.extend_lens)
        prefix = list(batch.prefix_lens)
        if taps is None or taps.shape[0] != sum(lens):
            raise RuntimeError(f"GLANCE: expected tap features for {sum(lens)} extend tokens, got "
                               f"{None if taps is None else tuple(taps.shape)}")
        start = 0
        for req, n, pre in zip(batch.reqs, lens, prefix):
            state = self.states.get(req.rid)
            if state is None or pre == 0:  # a new request, or one re-prefilled after retraction
                cache = self.drafter.new_cache(1, capacity=max(256, 2 * (pre + n)))
                self.states[req.rid] = (req, cache)
            else:
                cache = state[1]
            self.drafter.extend_context(cache, taps[start:start + n][None].to(self.drafter.fc.weight.dtype),
                                        torch.tensor([n], device=self.device))
            start += n

    def draft_trees(self, batch: ScheduleBatch):
        """One drafter pass for every request's block and the budget trees (the embedded engine's draft_tree)."""
        roots = torch.tensor([req.output_ids[-1] if len(req.output_ids) else req.origin_input_ids[-1]
                              for req in batch.reqs], dtype=torch.long, device=self.device)
        caches = [self.states[req.rid][1] for req in batch.reqs]
        logits = self.drafter.draft_block(stack_caches(caches), roots)[:, : self.max_depth]
        values, ids = topk_per_offset(draft_logprobs(logits), self.branch_k)
        if roots.is_cuda:  # the same tree built on device (Triton), no host round trip
            return glance_kernels.budget_tree(values, ids, roots, self.budget)
        return build_tree(values, ids, roots, self.budget)  # on the host the heap is the fastest

    def _decode(self, batch: ScheduleBatch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        prof = _Profile(self._profile)
        bs = len(batch.reqs)
        n = self.draft_token_num
        missing = [req.rid for req in batch.reqs if req.rid not in self.states]
        if missing:
            raise RuntimeError(f"GLANCE: no drafter context for requests {missing} (prefix cache hit?)")
        tree = self.draft_trees(batch)
        prof.mark("draft")
        assert tree.tokens.shape[1] == n, (tuple(tree.tokens.shape), n)
        seq_lens = batch.seq_lens
        seq_lens_cpu = [int(x) for x in (batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None
                                         else seq_lens.tolist())]
        vt = build_verify_input(tree, seq_lens, seq_lens_cpu, batch.req_pool_indices,
                                self.req_to_token_pool.req_to_token)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = vt.input_ids
        batch.out_cache_loc = vt.out_cache_loc
        batch.spec_info = vt.spec_info
        prof.mark("verify_input")

        result = self.target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True, capture_hidden_mode=CaptureHiddenMode.FULL)
        logits_output = result.logits_output
        logits = logits_output.next_token_logits.view(bs, n, -1)
        taps = self._taps(logits_output.hidden_states).view(bs, n, -1)
        logits_output.hidden_states = None
        prof.mark("target")

        specs = [sampling_spec(req) for req in batch.reqs]
        next_index = torch.tensor([len(req.output_ids) for req in batch.reqs])
        walk = verify_tree(tree.tokens.cpu(), tree.parents.cpu(), tree.depths.cpu(), logits.float().cpu(),
                           next_index, specs)
        accepted = walk.accept_lens  # drafted nodes accepted, bonus excluded
        committed = walk.committed(tree.tokens.cpu())
        prof.mark("walk")

        # Accepted rows' K/V to the front of each verify window (root first), in every layer's K and V buffer.
        kv = self.token_to_kv_pool_allocator.get_kvcache()
        rows = walk.accepted_rows.to(self.device)
        glance_kernels.compact_kv(list(kv.k_buffer) + list(kv.v_buffer),
                                  self.req_to_token_pool.req_to_token[batch.req_pool_indices.long()], 1,
                                  seq_lens.long(), rows)
        # The drafter's context grows by the root and the accepted path.
        for b, req in enumerate(batch.reqs):
            k = int(accepted[b]) + 1
            path = walk.accepted_rows[b, :k].to(self.device)
            self.drafter.extend_context(self.states[req.rid][1], taps[b, path][None].to(self.drafter.fc.weight.dtype),
                                        torch.tensor([k], device=self.device))

        prof.mark("kv+drafter_extend")
        accept_lens = (accepted + 1).to(torch.int32)
        accept_tokens = torch.zeros(bs, n, dtype=torch.int32)
        for b, toks in enumerate(committed):
            accept_tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
        accept_tokens = accept_tokens.to(self.device).flatten()
        accept_lens = accept_lens.to(self.device)
        new_seq_lens = seq_lens + accept_lens
        batch.forward_mode = ForwardMode.DECODE
        prof.done(bs)
        return self._result(result, logits_output, accept_tokens, accept_tokens, accept_lens, new_seq_lens, on_publish)
