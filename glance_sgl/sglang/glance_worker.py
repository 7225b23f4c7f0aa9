"""GlanceWorker: GLANCE in SGLang's scheduler (the worker half, as ``ngram_worker.py`` is for NGRAM).

The decode step is ``glance_sgl.round.speculative_round``, the embedded engine's round too; this module keeps the
SGLang plumbing around it:

- extend (prefill, chunked or not, after a radix-cache prefix hit or not): the target's forward with its tap
  layers captured (SGLang's aux hidden-state capture, ``set_eagle3_layers_to_capture``); every extended token's
  draft K/V (projected from its tap features: KV injection) go into the draft KV pool at the token's slot
  (``draft_pool.DraftKVPool``: one slot per SGLang token slot, so cached prefixes come with theirs), and the
  entropy of the row that produced the first token becomes the request's lead entropy (``planner.begin``);
- decode step, planned per batch by ``glance_sgl.planner`` (``GLANCE_PLANNER``: auto / fixed, see
  ``planning.py``), through two adapters bound to the batch: :class:`PoolDrafter` (the candidate source: one
  drafter pass for every request's block ``[root, MASK x (B-1)]`` over its context gathered from the draft KV
  pool through ``req_to_token``, the best-first tree at the full budget, ``N - 1`` nodes,
  ``N = --speculative-num-draft-tokens``; the committed rows' draft K/V written at their slots, deferred) and
  :class:`SGLangRows` (the target pass: a tree of R > 1 rows gets the TARGET_VERIFY input, FULL mask, positions
  ``prefix + depth``, SGLang adding the M-RoPE delta; a 1-row tree, a plain AR step, is SGLang's own DECODE
  forward of the root; either way the pass writes the first R of the N KV slots SGLang reserved per request
  after its prefix; grammar masks; the accepted rows' K/V kept at the front of the verify window by reordering its
  slots, ``glance_info.accept_window``). The round returns a ``GenerationBatchResult`` whose accept lengths include the
  bonus token (an AR step is a verify step with accept length 1; SGLang fills ``spec_verify_ct``,
  ``spec_accept_length``... in ``meta_info``). On CUDA (or with ``GLANCE_SGL_STEP=device``) tree, walk and
  commits stay on the device: a step reads a few numbers per batch on the host (the planner's), never logits or
  trees.

KV accounting does not depend on R: SGLang reserves at least ``N`` tokens of headroom per request for every
speculative step (``eagle_prepare_for_decode``) and commits ``accept_lens`` tokens per step; the unused reserved
slots stay the request's until it finishes. The result's token rows keep the stride ``N`` whatever R was.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_spec
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

import glance_kernels
from glance_sgl.drafter import GlanceDrafter
from glance_sgl.host_transfers import count_host_transfers
from glance_sgl.metrics import add_ms, entropies_nats, ms_per_step
from glance_sgl.ngram_source import NgramCandidates, NgramSettings, NgramSource
from glance_sgl.costs import cost_key, default_row_grid, save_costs
from glance_sgl.round import (PHASES, PassOutput, RoundBatch, RoundResult, calibrate_round,
                              speculative_round)
from glance_sgl.tree import SOURCE_DRAFTER, DraftTree, build_tree
from glance_sgl.verify import LogitRules, SamplingSpec, WalkResult, target_choices

from .cpu import BACKEND_NAME as CPU_BACKEND
from .draft_graph import DraftPassRunner, draft_pass
from .draft_pool import PAD_SLOT, DraftKVPool, committed_slots
from .drafter_model import GlanceDrafterForSGLang
from .glance_info import GlanceDraftInput, accept_window, build_verify_input
from .graphs import VerifyGraphs, graph_widths
from .planning import BatchCostModel, load_batch_costs, make_planner
from .sampling import logit_rules, request_end, sampling_spec, stop_ids, unit_temperature
from .settings import WorkerSettings

logger = logging.getLogger(__name__)


def _prefill_entropies(rows: torch.Tensor) -> list[float]:
    """Lead entropies from SGLang's prefill logits [bs, V]: a row its sampler already turned into
    probabilities (softmax(logits / T), sampled requests) is read as one."""
    out = []
    for row in rows.float():
        if float(row.min()) >= 0.0 and abs(float(row.sum()) - 1.0) < 1e-3:
            p = row.clamp_min(1e-30)
            out.append(float(-(p * p.log()).sum()))
        else:
            out.append(entropies_nats(row[None])[0])
    return out


class StepStats:
    """Counts of decode steps by rows verified per request (0 = an AR step: no candidate verified), and the mean
    wall ms per step of each part of the round (``RoundResult.phases``) and of the time between rounds
    (``between``: SGLang's scheduler and result processing; ``prepare``: this worker's) by step kind
    (:func:`step_kind`), logged every 200 steps when ``GLANCE_SGL_PROFILE=1`` (since the start; the bench's
    ``--step-stats`` reads the last)."""

    def __init__(self, log: bool) -> None:
        self.log, self.steps, self.rows = log, 0, {}
        self.kinds: dict[str, dict[str, float]] = {}  # kind -> phase -> ms summed, and "steps"

    def record(self, bs: int, rows: int) -> None:
        self.steps += 1
        self.rows[rows] = self.rows.get(rows, 0) + 1
        if self.log and self.steps % 200 == 0:
            logger.warning("GLANCE steps %d, rows per request (0 = no draft): %s", self.steps,
                           dict(sorted(self.rows.items())))
            logger.warning("GLANCE host ms per step by kind: %s", self.phase_means())

    def add_phases(self, kind: str, phases: dict[str, float], between_ms: float | None, prepare_ms: float = 0.0
                   ) -> None:
        """One settled step's parts (ms): the round's ``phases``, and before it the time since the previous round
        ended (``between_ms``; None: unknown, the first step after a prefill), of which ``prepare_ms`` was this
        worker's own preparation of the step (the rest, ``between``, is SGLang's)."""
        sums = self.kinds.setdefault(kind, dict.fromkeys(("steps", "between", "prepare", *PHASES), 0.0))
        sums["steps"] += 1
        sums["prepare"] += prepare_ms
        if between_ms is not None:
            sums["between"] += max(between_ms - prepare_ms, 0.0)
        add_ms(sums, phases)

    def sums(self) -> dict[str, dict[str, float]]:
        """Per step kind: its steps and the ms summed over them of each part (a copy; SGLang's internal state
        carries it, ``glance_step_parts``, so that a client can difference two readings)."""
        return {kind: dict(parts) for kind, parts in sorted(self.kinds.items())}

    def phase_means(self) -> dict[str, dict[str, float]]:
        """Per step kind: its steps and the mean ms per step of each part it had (in round order, ``between``
        first; :func:`glance_sgl.metrics.ms_per_step`)."""
        return ms_per_step(self.kinds)


def step_kind(r: RoundResult) -> str:
    """A step's kind: ``ar`` (the root alone), ``ngram`` (candidates without the drafter), ``drafter`` (its tree
    alone) or ``merged`` (its tree with the n-gram matches)."""
    if r.drafted:
        return "drafter" if r.tree.sources is None else "merged"
    return "ngram" if r.tree.num_rows > 1 else "ar"


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
        self._tap_order = None if captured == taps else torch.tensor([captured.index(t) for t in taps])
        self._hidden = int(text_cfg.hidden_size)
        self.block_size = cfg.block_size
        self.draft_pool: DraftKVPool | None = None  # allocated with SGLang's pools (alloc_memory_pool)
        # CUDA graphs (init_cuda_graphs): the verify pass at a few widths, the drafter pass per batch/context bucket
        self.use_graphs = self.device_is_cuda and not bool(getattr(server_args, "disable_cuda_graph", True))
        self.verify_graphs: VerifyGraphs | None = None
        self.draft_runner: DraftPassRunner | None = None
        self.tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        self.page_size = int(getattr(server_args, "page_size", 1) or 1)
        self.settings = WorkerSettings.from_env()  # every GLANCE setting, validated once (settings.py)
        if self.settings.compile_drafter and not self.device_is_cuda:
            # one request and any batch, compiled now, at start-up, on caches laid out as the pool's gather lays them
            self.drafter.compile_block(batch_sizes=(1, 2), token_major=True)
        self._profile = self.settings.profile
        # the decode step on the device (tree, walk, commits: no host copy of logits or trees): the default on
        # CUDA; on a CPU the host heap and walk are faster, and GLANCE_SGL_STEP=device runs the device code there
        self.device_step = self.settings.device_step(self.device_is_cuda)
        self._count_reads = self.settings.count_host_reads
        self._last_rows = 0
        self._last_kind = "ar"
        self._calibrated_now = False
        self._counter = None  # the host-read counter of the step being counted
        self.planner_mode, seed = self.settings.planner, self.settings.planner_seed
        key = cost_key("sglang", str(self.device), torch.cuda.get_device_name(self.device) if self.device_is_cuda
                       else "cpu", spec.speculative_draft_model_path, self.model_runner.model_config.model_path,
                       str(self.model_runner.dtype), self.server_args.attention_backend, torch.get_num_threads(),
                       self.draft_token_num, self.branch_k, self.max_depth,
                       *(["compiled"] if self.drafter.block_compiled else []),
                       *([] if self.settings.draft_sources == ("drafter",) else [self.settings.draft_sources]))
        cached = load_batch_costs(key)
        costs = cached if cached is not None else BatchCostModel.prior(key)
        self.planner = make_planner(self.planner_mode, costs, self.budget, self.max_depth, seed=seed)
        # a ragged verify pass: every request of a batch its own number of tree rows (the planner sizes each),
        # where the attention backend takes them (``glance_cpu``), without CUDA graphs (one width each) and on one
        # rank (the ranks would have to agree on every request's rows)
        self.ragged = (self.settings.ragged_verify and self.server_args.attention_backend == CPU_BACKEND
                       and not self.use_graphs and self.tp_size == 1)
        self.planner.ragged = self.ragged
        self.stats = StepStats(self._profile)
        # n-gram candidates (GLANCE_DRAFT_SOURCES=...,ngram): SGLang's NgramCorpus over each request's prompt, its
        # committed output and recent answers, one source per worker, proposed every step beside the drafter's tree
        self.draft_sources = self.settings.draft_sources
        # the sources rounds draw on: none where the planner never speculates (GLANCE_PLANNER=off), so that drafting
        # forced off costs only SGLang's own AR step plus this worker's plumbing: no tap capture, no drafter context
        # or n-gram corpus kept for rounds that never read them (the draft KV pool is still allocated, unused)
        self._sources = self.draft_sources if self.planner.speculates else ()
        # the target's tap features feed the drafter's context only: without the drafter among the sources no pass
        # captures them, and the target collects no tap layers at all (SGLang's capture costs ~0.2 ms of a CPU
        # step; a graph captured with them still runs)
        self._capture = CaptureHiddenMode.FULL if "drafter" in self._sources else CaptureHiddenMode.NULL
        if self._capture == CaptureHiddenMode.FULL:
            target.set_eagle3_layers_to_capture(captured)
        self.ngram: NgramCandidates | None = None
        self._vocab = int(self.model_runner.model_config.vocab_size)
        if "ngram" in self._sources:
            # prompt ids SGLang replaced by multimodal pad values (outside the vocabulary) are never matched
            ngram = NgramSource(NgramSettings(scope=self.settings.ngram_corpus, max_depth=self.max_depth,
                                              skip_tokens=(-1,)))
            if not ngram.available:
                raise ValueError(ngram.reason)
            self.ngram = NgramCandidates(ngram, getattr(self.planner, "acceptance", None))
        self._last_round_end: float | None = None  # when the previous decode step's round ended (perf_counter s)
        self._last_rids: list = []  # the previous decode batch's requests (its host state purged for the others)
        # under overlap scheduling: the previous step's round, its outcome not read yet (_settle), with its
        # scheduler gap and its own preparation (ms) and its requests; and the requests that finished meanwhile
        # (forgotten after it)
        self._pending: tuple[RoundResult, float | None, float, set] | None = None
        self._finishing: set = set()
        # rid -> (its Req, its sampling, request_end, its stop ids on the device where it has a min_new_tokens):
        # ``_sampling_and_ends``
        self._sampling: dict[str, tuple[object, SamplingSpec, tuple[frozenset[int], int, int | None],
                                        torch.Tensor | None]] = {}
        logger.info("GLANCE worker: block %d, tree budget %d, branch_k %d, max depth %d, taps %s, planner %s "
                    "(cost model %s)", cfg.block_size, self.budget, self.branch_k, self.max_depth, taps,
                    self.planner_mode, "cached" if cached is not None else "calibrated on the first batches")

    @functools.cached_property
    def device_is_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    # ------------------------------------------------------------------ BaseSpecWorker plumbing
    def alloc_memory_pool(self, **kwargs):
        """SGLang's pools are the target's; the draft KV pool gets exactly the target pool's token slots (its
        bytes were budgeted with the target's: ``draft_pool.install_memory_accounting``); none where the drafter
        is not among the sources."""
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()
        if "drafter" not in self.draft_sources:  # n-gram candidates alone: no drafter context to keep
            logger.info("GLANCE: no draft KV pool (the drafter is not among the sources %s)", self.draft_sources)
            return
        slots = self.token_to_kv_pool_allocator.get_kvcache().k_buffer[0].shape[0]
        self.draft_pool = DraftKVPool(self.drafter, slots, self.device, self.model_runner.dtype)
        logger.info("GLANCE draft KV pool allocated: #tokens %d, %d layers, K+V size %.2f GB", slots - 1,
                    self.drafter.config.num_hidden_layers, self.draft_pool.nbytes / (1 << 30))

    def init_cuda_graphs(self):
        """After SGLang captured the target's TARGET_VERIFY graphs at the full width (through the hooks of
        ``graphs.py``): the other widths' graphs, and the drafter pass's runner (captured per bucket on first
        use). Without CUDA graphs nothing, unless ``static_draft`` (``GLANCE_SGL_STATIC_DRAFT=1``) asks for the drafter pass at the
        runner's static shapes anyway (run eagerly: what a graph would replay, checked on a CPU)."""
        graphs = self.use_graphs and self.model_runner.decode_cuda_graph_runner is not None
        if not graphs and not self.settings.static_draft:
            return
        drafts = self.draft_pool is not None  # without the drafter among the sources: the verify graphs alone
        if graphs:
            widths = graph_widths(self.draft_token_num, self.settings.graph_widths)
            self.verify_graphs = VerifyGraphs(self.model_runner, self.draft_token_num, self.max_depth, widths)
            self.planner.row_menu = widths  # the planner weighs the trees the graphs can run
            max_bs = int(self.model_runner.decode_cuda_graph_runner.max_bs)
        else:
            max_bs = int(getattr(self.server_args, "max_running_requests", None) or 48)
        # under TP the drafter's LM head all-gathers (a collective): its pass stays eager there
        if drafts:
            self.draft_runner = DraftPassRunner(self.drafter, self.draft_pool, self.req_to_token_pool.req_to_token,
                                                max_depth=self.max_depth, branch_k=self.branch_k, budget=self.budget,
                                                max_bs=max_bs, use_graphs=graphs and self.tp_size == 1)
        (logger.info if graphs else logger.warning)(  # without graphs a diagnostic mode: say so
            "GLANCE graphs: verify widths %s, drafter pass at static shapes up to batch %d (%s)",
            self.verify_graphs.widths if self.verify_graphs else None, max_bs,
            "no drafter" if not drafts else "CUDA graphs" if self.draft_runner.use_graphs else "eager")

    @property
    def target_worker(self) -> TpModelWorker:
        return self._target_worker

    @property
    def draft_worker(self):
        return None  # the drafter runs inside this worker; it has no ModelRunner of its own

    def clear_cache_pool(self):
        self._settle()  # no request runs: the last step's outcome (its answers' last tokens) first
        if self.draft_pool is not None:
            self.draft_pool.drop_pending()  # the draft K/V live in SGLang's slots: freeing the slots frees them
        for rid in self.planner.known():  # a flush happens with no request running
            self.planner.forget(rid)
        self._sampling.clear()
        self._last_rids = []
        if self.ngram is not None:
            for rid in self.ngram.source.request_ids():
                self.ngram.finish(rid, publish=False)

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        if self._pending is not None and rid in self._pending[3]:
            # its last step's outcome is not read yet (overlap scheduling): forgotten once it is, so that its
            # answer reaches the n-gram corpus whole, without waiting here for a step still running
            self._finishing.add(rid)
            return
        self._forget(rid)

    def _settle(self) -> None:
        """Under overlap scheduling, the previous step's outcome, read back where the next step starts (or the
        engine idles) instead of at the end of its own step, so that SGLang processes the step before it while the
        device runs it: the n-gram source and the planner get it before anything plans again. Then the requests
        that finished meanwhile are forgotten. Nothing to do synchronously (each round reads its own)."""
        if self._pending is not None:
            r, gap_ms, prepare_ms, _ = self._pending
            self._pending = None
            r.settle()
            self._log_report(r, gap_ms, prepare_ms)
        for rid in self._finishing:
            self._forget(rid)
        self._finishing.clear()

    def _sampling_and_ends(self, batch: ScheduleBatch
                           ) -> tuple[list[SamplingSpec], list[frozenset[int]], list[int], LogitRules | None]:
        """Each request's sampling (:func:`sampling.sampling_spec`), the token ids that end it now and the tokens it
        may still commit (``RoundBatch.stops`` / ``room``; :func:`sampling.request_end`), and the batch's logit
        rules (:func:`sampling.logit_rules`: logit bias, the stop tokens masked before ``min_new_tokens``), read
        once per request object: its sampling parameters do not change while it runs (a new request under a
        reused id is another object, read again). Its output length comes from ``req.output_ids``, which lags a
        step behind under overlap scheduling: the room read is then a step too large, and a stop token held back a
        step longer near ``min_new_tokens``, which only drops fewer rows (the mask itself counts from the exact
        sampling counters, ``next_index``)."""
        specs, stops, room, min_new, masked, produced = [], [], [], [], [], []
        none: frozenset[int] = frozenset()
        for req in batch.reqs:
            known = self._sampling.get(req.rid)
            if known is None or known[0] is not req:
                end = request_end(req)
                ids = torch.tensor(sorted(stop_ids(req)), dtype=torch.long, device=self.device) if end[1] else None
                known = self._sampling[req.rid] = (req, sampling_spec(req), end, ids)
            ids, minimum, limit = known[2]
            out = len(req.output_ids)
            specs.append(known[1])
            stops.append(ids if out >= minimum else none)
            room.append(limit - out if limit is not None else 1 << 30)
            min_new.append(minimum)
            masked.append(known[3])
            produced.append(out)
        return specs, stops, room, logit_rules(batch, min_new, masked, produced)

    def _forget(self, rid: str) -> None:
        self._sampling.pop(rid, None)
        self.planner.forget(rid)
        if self.ngram is not None:
            self.ngram.finish(rid)  # its answer stays in the cross-request corpus

    def _purge(self, live: set[str]) -> None:
        """Per-request host state of requests absent from a decode batch, which holds every running request
        (absent: finished, aborted without a notice, or retracted; a retracted one's lead entropy is set again when
        it is prefilled again)."""
        known = self.planner.known()
        if self.ngram is not None:
            known = known | set(self.ngram.source.request_ids())
        for rid in known - live:
            self._forget(rid)

    @property
    def num_drafter_states(self) -> int:
        """Requests with per-request state in the worker (the planner's: lead entropy and record)."""
        return len(self.planner.known())

    # ------------------------------------------------------------------ the step
    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, grammar_barrier=None,
                                 pp_proxy_tensors=None) -> GenerationBatchResult:
        """SGLang's V2 worker step. ``on_publish(new_seq_lens)``: under overlap scheduling, called as soon as the
        step's committed lengths are known (after the walk); ``grammar_barrier``: unused (GLANCE does not
        advance grammars inside the step: ``supports_grammar_overlap`` is False, so SGLang syncs them first)."""
        if batch.forward_mode.is_decode():
            return self._decode(batch, on_publish, pp_proxy_tensors)
        self._settle()
        return self._extend(batch, on_publish, pp_proxy_tensors)

    def _extend(self, batch: ScheduleBatch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        bs = len(batch.reqs)
        # every request's prompt gets its drafter context, also one the planner retires at birth (``Planner.admit``,
        # where the drafter idles: its decode steps feed nothing): SGLang's radix cache lends a prompt's slots to the
        # later requests that share it (the same prompt again, a system prompt, the next turn of a chat), whose
        # drafter would otherwise read another request's stale context there, fail its probes and keep idling
        capture = self._capture
        feed = capture == CaptureHiddenMode.FULL and batch.forward_mode.is_extend() and bs > 0
        if feed:
            for req in batch.reqs:
                self.planner.admit(req.rid)
        result = self.target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors, capture_hidden_mode=capture)
        logits_output = result.logits_output
        self._last_round_end = None  # the next decode step's gap includes this prefill: not a scheduler cost
        self._last_rids = []  # the next decode step purges: a request prefilled here may end before decoding
        if feed:
            hidden = logits_output.hidden_states
            self._feed_prompt(batch, self._taps(hidden))
            # Keep SGLang's output processing off the tap features (they are not the final hidden states).
            logits_output.hidden_states = None
        predict = result.next_token_ids
        if predict is not None and bs > 0 and batch.forward_mode.is_extend():
            if logits_output.next_token_logits is not None and self.planner.speculates:
                for req, h in zip(batch.reqs, _prefill_entropies(logits_output.next_token_logits)):
                    self.planner.begin(req.rid, h)
            predict = self._first_tokens(batch, logits_output, predict)
        new_seq_lens = batch.seq_lens.clone()
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        bonus = (torch.zeros(bs, dtype=torch.long, device=self.device) if predict is None or bs == 0
                 else predict.long())
        if on_publish is not None:
            on_publish(new_seq_lens)
        return self._result(result, logits_output, predict, accept_lens, new_seq_lens, bonus)

    def _result(self, result, logits_output, next_token_ids, accept_lens, new_seq_lens, bonus
                ) -> GenerationBatchResult:
        """The step's result. The draft input it carries to the next step is each request's newest committed token
        (``bonus`` [bs]): kept on the batch synchronously, relayed through SGLang's ``FutureMap`` under overlap."""
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=next_token_ids,
            can_run_cuda_graph=result.can_run_cuda_graph,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=GlanceDraftInput(bonus_tokens=bonus),
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
        )

    def _first_tokens(self, batch: ScheduleBatch, logits_output, predict: torch.Tensor) -> torch.Tensor:
        """At T > 0 the prompt's next token is drawn like every later one (glance_sgl.verify: the inverse CDF at a
        uniform keyed by the request's seed and the output index), so that a seeded request's whole output is
        reproducible and equals the embedded engine's. Greedy requests keep SGLang's own choice."""
        # SGLang's choice stands for greedy requests and for constrained ones (its sampler drew under the grammar)
        redraw = [(b, req, spec) for b, (req, spec) in enumerate(zip(batch.reqs, map(sampling_spec, batch.reqs)))
                  if not spec.greedy and req.grammar is None]
        if not redraw:
            return predict
        rows = logits_output.next_token_logits.float().cpu()
        out = predict.clone()
        for b, req, spec in redraw:
            row = rows[b]
            if float(row.min()) >= 0.0 and abs(float(row.sum()) - 1.0) < 1e-3:
                # SGLang's sampler leaves softmax(logits / T) in place: its log is the tempered distribution.
                row, spec = row.clamp_min(1e-30).log(), unit_temperature(spec)
            choice = target_choices(row[None, None], torch.zeros(1, 1, dtype=torch.long),
                                    torch.tensor([len(req.output_ids)]), [spec])
            out[b] = int(choice[0, 0])
        return out

    def _taps(self, packed: torch.Tensor | None, bs: int | None = None, rows: int = 1) -> torch.Tensor | None:
        """SGLang's packed captures [T, U*H] (unique layers in order) -> the drafter's tap order [T, L*H]
        (``bs``: as [bs, rows, L*H]); None where the pass captured none (no drafter among the sources)."""
        if packed is None:
            return None
        t = packed.shape[0]
        taps = packed if self._tap_order is None else \
            packed.view(t, -1, self._hidden)[:, self._tap_order.to(packed.device)].reshape(t, -1)
        return taps if bs is None else taps.view(bs, rows, -1)

    def _feed_prompt(self, batch: ScheduleBatch, taps: torch.Tensor) -> None:
        """Write the extended tokens' draft K/V at their slots (``batch.out_cache_loc``, where the target's K/V of
        each token went), for every request of the batch. Tokens of a radix-cache prefix hit already have theirs
        (written when the prefix was first computed)."""
        lens = list(batch.extend_lens)
        if taps is None or taps.shape[0] != sum(lens):
            raise RuntimeError(f"GLANCE: expected tap features for {sum(lens)} extend tokens, got "
                               f"{None if taps is None else tuple(taps.shape)}")
        positions = torch.cat([torch.arange(pre, pre + n) for pre, n in zip(batch.prefix_lens, lens)])
        self.draft_pool.flush()  # earlier writes first: a slot freed since may be one of these
        self.draft_pool.write(batch.out_cache_loc, taps, positions.to(taps.device))

    # ------------------------------------------------------------------ decode: draft (or not), verify, commit
    def _agree(self, value: int) -> int:
        """Under tensor parallelism every rank must take the same step, but the planner's timings differ between
        ranks: TP rank 0's choice (whether to draft, how many rows) is broadcast to the others. The tree, the walk
        and the sampling noise are functions of replicated tensors, so they agree by themselves."""
        if self.tp_size == 1:
            return value
        from sglang.srt.distributed import get_tp_group

        return int(get_tp_group().broadcast_object(int(value), src=0))

    def _roots(self, batch: ScheduleBatch) -> torch.Tensor:
        """[bs] long: each request's newest committed token (the root of its tree), as the previous step left it
        in the batch's draft input (under overlap scheduling ``req.output_ids`` lags a step behind)."""
        info = batch.spec_info
        if not isinstance(info, GlanceDraftInput) or info.bonus_tokens is None:
            raise RuntimeError(f"GLANCE decode batch without its draft input (got {type(info).__name__})")
        return info.bonus_tokens.to(self.device, torch.long)

    def _host_seq_lens(self, batch: ScheduleBatch) -> list[int]:
        """[bs] prefix lengths on the host: SGLang's host mirror ``seq_lens_cpu`` where it keeps one (a host tensor
        on any device: not a device read, so not counted), else read from the device."""
        if batch.seq_lens_cpu is None:
            return [int(x) for x in batch.seq_lens.tolist()]
        with self._counter.paused() if self._counter is not None else contextlib.nullcontext():
            return [int(x) for x in batch.seq_lens_cpu.tolist()]

    def _host_committed(self, batch: ScheduleBatch, seq_lens_cpu: list[int]) -> list[int] | None:
        """Each request's committed output count, ``seq_len - prompt + 1`` (the root's K/V is not in the cache
        yet), from SGLang's host state where it is current: scheduled synchronously, ``seq_lens_cpu`` and
        ``req.output_ids`` (which then ends in the root) hold every committed token. None under overlap
        scheduling, where the host state lags a step behind the device."""
        if not self.server_args.disable_overlap_schedule:
            return None
        reqs = batch.reqs
        committed = [s - len(req.origin_input_ids) + 1 for s, req in zip(seq_lens_cpu, reqs)]
        return committed if all(len(req.output_ids) == c for req, c in zip(reqs, committed)) else None

    def _host_roots(self, batch: ScheduleBatch, committed: list[int] | None, roots: torch.Tensor,
                    next_index: torch.Tensor) -> tuple[list[int], list[int]]:
        """Each request's root and committed output count on the host: from SGLang's host state where it is
        current (``committed``, :meth:`_host_committed`), no device read; else both read at once."""
        if committed is not None:
            return [int(req.output_ids[-1]) for req in batch.reqs], committed
        roots_host, committed = torch.stack([roots, next_index.to(roots.dtype)]).tolist()
        return roots_host, committed

    def _next_index(self, batch: ScheduleBatch, committed: list[int] | None) -> torch.Tensor:
        """[bs] long: each request's output index of the token after its root (the sampling noise's counter):
        its committed output count, from the host state where it is current (``committed``), else from the
        device's lengths (``seq_lens - prompt + 1``; ``req.output_ids`` lags a step behind under overlap)."""
        if committed is not None:
            return torch.tensor(committed, dtype=torch.long, device=self.device)
        prompt = torch.tensor([len(req.origin_input_ids) for req in batch.reqs], dtype=torch.long)
        return batch.seq_lens.long() - prompt.to(self.device, non_blocking=True) + 1

    def draft_trees(self, batch: ScheduleBatch, seq_lens_cpu: list[int], roots: torch.Tensor,
                    members: list[int] | None = None) -> DraftTree:
        """One drafter pass for the block of every request of the batch (or of ``members``, indices into it; ``roots``
        [bs] or [len(members)]: theirs) over its context in the draft KV pool, and the best-first trees at the
        largest budget (the embedded engine's CachedDrafter.propose)."""
        pool_indices, seq_lens = batch.req_pool_indices, batch.seq_lens
        if members is not None:
            idx = torch.tensor(members, dtype=torch.long, device=seq_lens.device)
            pool_indices, seq_lens = pool_indices[idx], seq_lens[idx]
            seq_lens_cpu = [seq_lens_cpu[b] for b in members]
        longest = max(seq_lens_cpu)
        if self.draft_runner is not None and self.draft_runner.fits(len(seq_lens_cpu), longest):
            return self.draft_runner.run(pool_indices, seq_lens, roots, longest)
        # the tree on device (Triton) without a host round trip; on the host the heap is the fastest
        build = glance_kernels.budget_tree if roots.is_cuda or self.device_step else build_tree
        return draft_pass(self.drafter, self.draft_pool, self.req_to_token_pool.req_to_token, pool_indices,
                          seq_lens, roots, longest, max_depth=self.max_depth, branch_k=self.branch_k,
                          budget=self.budget, build=build)

    def _verify_pass(self, batch: ScheduleBatch, tree: DraftTree, seq_lens_cpu: list[int], pp_proxy_tensors,
                     capture: CaptureHiddenMode, rows: list[int] | None = None):
        """The target's TARGET_VERIFY pass over ``tree`` (``R`` rows per request, 1 <= R <= N): its K/V go to
        the first R of the N slots SGLang reserved after each prefix. Returns (result, logits [bs, R, V],
        taps [bs, R, L*H], None where ``capture`` is NULL). ``rows``: a ragged pass (:attr:`ragged`), request
        ``b``'s first ``rows[b]`` rows alone; its logits and taps come back in the [bs, R] layout, zero on the
        rows it left out (the result's ``next_token_logits`` too)."""
        bs, width = tree.tokens.shape
        vt = build_verify_input(tree, batch.seq_lens, seq_lens_cpu, batch.req_pool_indices,
                                self.req_to_token_pool.req_to_token, rows=rows)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = vt.input_ids
        batch.out_cache_loc = vt.out_cache_loc
        batch.spec_info = vt.spec_info
        if rows is None:
            result = self.target_worker.forward_batch_generation(
                batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True, capture_hidden_mode=capture)
        else:  # SGLang derives M-RoPE positions for uniform rows only: the pass gets them from here
            forward_batch = ForwardBatch.init_new(batch, self.model_runner, capture_hidden_mode=capture,
                                                  return_hidden_states_before_norm=False,
                                                  spec_mrope_positions=self._ragged_mrope(batch, vt, rows))
            result = self.target_worker.forward_batch_generation(
                None, forward_batch=forward_batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True)
        out = result.logits_output
        if rows is not None:
            out.next_token_logits = _unragged(out.next_token_logits, vt)
            out.hidden_states = None if out.hidden_states is None else _unragged(out.hidden_states, vt)
        logits = out.next_token_logits.view(bs, width, -1)
        taps = self._taps(out.hidden_states, bs, width)
        out.hidden_states = None
        return result, logits, taps

    def _ragged_mrope(self, batch: ScheduleBatch, vt, rows: list[int]) -> torch.Tensor | None:
        """[3, T] M-RoPE positions of a ragged pass's rows (None: the target has none): each row's position plus
        its request's M-RoPE delta, as ``ForwardBatch.compute_spec_mrope_positions`` adds it to uniform rows."""
        if not self.model_runner.model_config.model_is_mrope:
            return None
        positions = vt.spec_info.positions
        mm = batch.multimodal_inputs or [None] * len(rows)
        if any(m is not None for m in mm):
            deltas = [0 if m is None else int(m.mrope_position_delta.reshape(-1)[0]) for m in mm]
            per_row = [d for d, r in zip(deltas, rows) for _ in range(r)]
            positions = positions + torch.tensor(per_row, dtype=torch.int64, device=positions.device)
        return positions.to(torch.int64).unsqueeze(0).repeat(3, 1)

    def _ar_pass(self, batch: ScheduleBatch, roots: torch.Tensor, pp_proxy_tensors, capture: CaptureHiddenMode):
        """A plain AR step: SGLang's own DECODE forward of each root (at position ``seq_lens[b]``, its K/V into
        the first slot SGLang reserved after the prefix), sampling skipped. For the forward the batch looks like
        a non-speculative decode batch (lengths including the root, no spec input); restored afterwards.
        Returns (result, logits [bs, 1, V], taps [bs, 1, L*H])."""
        bs = roots.shape[0]
        saved = (batch.seq_lens, batch.seq_lens_cpu, batch.orig_seq_lens, batch.seq_lens_sum, batch.spec_info)
        seq_lens = batch.seq_lens
        slots = self.req_to_token_pool.req_to_token[batch.req_pool_indices.long(), seq_lens.long()]
        batch.forward_mode = ForwardMode.DECODE
        batch.input_ids = roots
        batch.out_cache_loc = slots.to(torch.int64)
        batch.seq_lens = seq_lens + 1
        batch.seq_lens_cpu = None if saved[1] is None else saved[1] + 1
        batch.orig_seq_lens = None if saved[2] is None else saved[2] + 1
        batch.seq_lens_sum = None
        batch.spec_info = None
        try:
            result = self.target_worker.forward_batch_generation(
                batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True, capture_hidden_mode=capture)
        finally:
            (batch.seq_lens, batch.seq_lens_cpu, batch.orig_seq_lens, batch.seq_lens_sum, batch.spec_info) = saved
        out = result.logits_output
        logits = out.next_token_logits.view(bs, 1, -1)
        taps = self._taps(out.hidden_states, bs, 1)
        out.hidden_states = None
        return result, logits, taps

    def _pass(self, batch: ScheduleBatch, tree: DraftTree, seq_lens_cpu: list[int], pp_proxy_tensors,
              taps: bool = True, rows: list[int] | None = None):
        """The target pass of a step: SGLang's plain decode forward for a 1-row tree (an AR step; on the CPU
        backend 8.5 vs 9.2 ms median for a 1-row TARGET_VERIFY, interleaved engines), else the tree verify.
        With CUDA graphs every pass is a verify, replayed at its width (a 1-row one for an AR step: a speculative
        target has no DECODE graphs); a width without graphs runs eagerly. ``taps`` False: no tap layer captured
        (every request retired, ``Planner.context_mask``), except in a graph, which replays its capture anyway.
        ``rows``: each request's own number of rows (a ragged pass: only without graphs, :attr:`ragged`)."""
        graphs = self.verify_graphs
        if graphs is None:
            capture = self._capture if taps else CaptureHiddenMode.NULL
            if tree.num_rows == 1:
                return self._ar_pass(batch, tree.tokens[:, 0], pp_proxy_tensors, capture)
            return self._verify_pass(batch, tree, seq_lens_cpu, pp_proxy_tensors, capture, rows)
        with graphs.use(tree.num_rows) if tree.num_rows in graphs.states else contextlib.nullcontext():
            return self._verify_pass(batch, tree, seq_lens_cpu, pp_proxy_tensors, self._capture)

    def _decode(self, batch: ScheduleBatch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        if not self._count_reads:
            return self._decode_step(batch, on_publish, pp_proxy_tensors)
        self._calibrated_now = False
        with count_host_transfers() as counter:
            self._counter = counter
            try:
                out = self._decode_step(batch, on_publish, pp_proxy_tensors)
            finally:
                self._counter = None
        if not self._calibrated_now:  # a calibration step runs many passes: not a decode step's count
            logger.warning("GLANCE host reads bs=%d rows=%d: %d %s kind=%s", len(batch.reqs), self._last_rows,
                           counter.total, dict(sorted(counter.calls.items())), self._last_kind)
        return out

    def _decode_step(self, batch: ScheduleBatch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        """One decode step: the previous step's outcome where it waits (:meth:`_settle`), then
        ``glance_sgl.round.speculative_round`` over the batch, through this worker's adapters (:class:`SGLangRows`,
        :class:`PoolDrafter`), then SGLang's result."""
        entered = time.perf_counter()
        self._settle()
        rids = [req.rid for req in batch.reqs]
        if rids != self._last_rids:  # purged where the requests changed since the last decode (or a prefill)
            self._purge(set(rids))
            self._last_rids = rids
        bs = len(batch.reqs)
        seq_lens = batch.seq_lens
        seq_lens_cpu = self._host_seq_lens(batch)
        roots = self._roots(batch)
        committed = self._host_committed(batch, seq_lens_cpu)
        next_index = self._next_index(batch, committed)
        tokens = roots_host = None
        if self.ngram is not None:  # the n-gram source's host corpus
            roots_host, committed = self._host_roots(batch, committed, roots, next_index)
            tokens = _RequestTokens(batch.reqs, self._vocab, roots_host, committed)
        specs, stops, room, rules = self._sampling_and_ends(batch)
        rounds = RoundBatch(rids, roots, next_index, specs, tokens, roots_host, stops=stops, room=room)
        target = SGLangRows(self, batch, seq_lens_cpu, pp_proxy_tensors, rules, next_index)
        source = PoolDrafter(self, batch, seq_lens_cpu)
        sources = [source] if "drafter" in self._sources else []
        if self.ngram is not None:
            self._start_ngram(batch, tokens)
            sources.append(self.ngram)
        if self._maybe_calibrate(batch, rounds, target, sources):
            self._calibrated_now = True
            self._last_round_end = None  # the calibration is not the scheduler's time
        gap_ms = None
        if self._last_round_end is not None:  # everything between two rounds: the scheduler, this plumbing
            gap_ms = 1000 * (time.perf_counter() - self._last_round_end)
            if self.planner.speculates:
                self.planner.costs.observe_gap(bs, gap_ms)

        def publish(walk: WalkResult) -> None:  # before the KV keep and the drafter's writes (SGLang's V2 order)
            on_publish(seq_lens + walk.accept_lens.to(self.device) + 1)

        overlap = not self.server_args.disable_overlap_schedule  # the outcome is read when the next step starts
        prepare_ms = 1000 * (time.perf_counter() - entered)  # this worker's share of the time between rounds
        r = speculative_round(rounds, self.planner, sources, target, max_depth=self.max_depth,
                              device_resident=self.device_step, on_walk=None if on_publish is None else publish,
                              defer_outcome=overlap)
        self._last_round_end = r.ended
        if self._profile or self._count_reads:  # what the step logs read (StepStats, the host-read line)
            self._note_step(r)
        if overlap:
            self._pending = (r, gap_ms, prepare_ms, set(rids))
        else:
            self._log_report(r, gap_ms, prepare_ms)

        walk = r.walk
        accept_tokens = torch.zeros(bs, self.draft_token_num, dtype=torch.int32, device=self.device)
        if r.tree.num_rows == 1:  # an AR step: one token each, the bonus (its few ops: the cost of "never hurts")
            bonus = walk.bonus.to(self.device, torch.long)
            accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
            accept_tokens[:, 0] = bonus
        else:
            accept_lens = (walk.accept_lens.to(self.device) + 1).to(torch.int32)
            width = min(walk.committed_tokens.shape[1], self.draft_token_num)
            accept_tokens[:, :width] = walk.committed_tokens[:, :width].clamp(min=0).to(self.device, torch.int32)
            bonus = accept_tokens.gather(1, (accept_lens.long() - 1)[:, None]).squeeze(1).long()
        result = r.out.handle
        if batch.return_logprob:
            self._spec_logprobs(batch, result.logits_output, walk.accepted_rows, accept_tokens, r.tree.num_rows)
        batch.forward_mode = ForwardMode.DECODE
        tokens = accept_tokens.flatten()
        return self._result(result, result.logits_output, tokens, accept_lens, seq_lens + accept_lens, bonus)

    def _start_ngram(self, batch: ScheduleBatch, tokens: "_RequestTokens") -> None:
        """Requests the n-gram source has not seen yet (their first decode step, or the first after a
        retraction): their prompt token ids and the output committed so far. The round's adapter feeds every
        later step's."""
        source = self.ngram.source
        for b, req in enumerate(batch.reqs):
            if req.rid not in source:
                source.add_request(req.rid, _in_vocab(req.origin_input_ids, self._vocab))
                source.commit(req.rid, tokens.output(b))

    def _note_step(self, r: RoundResult) -> None:
        """Step statistics: rows verified per request, the step's kind."""
        rows = r.tree.num_rows if r.drafted or r.tree.num_rows > 1 else 0  # n-gram rows without the drafter too
        self._last_rows = rows
        self._last_kind = step_kind(r)
        self.stats.record(r.tree.batch_size, rows)

    def _log_report(self, r: RoundResult, gap_ms: float | None, prepare_ms: float) -> None:
        """With ``GLANCE_SGL_PROFILE=1``, the parts of a step whose outcome was read (its report)."""
        if self._profile:
            self.stats.add_phases(step_kind(r), r.phases, gap_ms, prepare_ms)
            rep = r.report
            # pred: the tokens per request the chosen round expected (bonus included); rival / alone: where the
            # drafter ran against the matches' round, the tokens that round expected and the drafts it would have
            # accepted on its own (what the drafter's round gained over it: accepted - alone)
            # target[R]: rows verified per request (a ragged pass: their mean)
            logger.warning("GLANCE step bs=%d sched=%s %s=%.1fms target[%s]=%.1fms host=%.1fms accepted=%s lead=%s "
                           "pred=%s rival=%s alone=%s",
                           rep.batch, "-" if gap_ms is None else f"{gap_ms:.1f}ms",
                           f"draft{sum(r.plan.drafted_for(rep.batch))}" if r.drafted else "no_draft", rep.drafter_ms,
                           f"{rep.rows:g}" if isinstance(rep.rows, int) else f"{rep.rows:.2f}", rep.pass_ms,
                           rep.host_ms, list(rep.accepted),
                           [None if (h := self.planner.lead_entropy(x)) is None else round(h, 2) for x in rep.rids],
                           _rounded(r.plan.expected_tokens),
                           None if rep.alternative is None else _rounded(rep.alternative.expected_tokens),
                           None if rep.alone is None else list(rep.alone))

    def _mask_grammar(self, batch: ScheduleBatch, tree: DraftTree, logits: torch.Tensor) -> None:
        """Constrained decoding (SGLang's grammar backends: ``json_schema``, ``regex``, ``ebnf``): every tree row's
        logits [bs, R, V] are masked in place by its request's grammar state after that row's path, which
        SGLang's own traversal computes (``build_grammar_vocab_mask``, as NGRAM does). The walk then picks at every
        row what constrained AR would pick there, so the output is constrained AR's; SGLang's scheduler advances
        each grammar over the committed tokens (and drops any past its termination). Requests without a grammar
        keep every token."""
        from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

        bs, rows = tree.tokens.shape
        meta = glance_kernels.tree_meta(tree.parents.to(self.device), batch.seq_lens)
        mask = build_grammar_vocab_mask(
            reqs=batch.reqs, sampling_info=batch.sampling_info, device=logits.device, barrier=None,
            tree=GrammarTree.from_host(meta.first_child.cpu().long(), meta.next_sibling.cpu().long(),
                                       tree.tokens.cpu().long()))
        if mask is not None:
            mask.apply(logits.view(bs * rows, -1))

    def _spec_logprobs(self, batch: ScheduleBatch, logits_output, accepted_rows: torch.Tensor, tokens: torch.Tensor,
                       rows: int) -> None:
        """The target's log-probabilities of the committed tokens (and the top / requested token ids), filled
        into ``logits_output`` by SGLang's ``compute_spec_logprobs`` as for NGRAM: committed token j of request b
        was chosen at tree row ``accepted_rows[b, j]`` (-1 padding) of this pass's ``rows`` rows per request;
        ``tokens`` [bs, >= W]: the committed tokens, root's successor first."""
        bs, width = accepted_rows.shape
        path = accepted_rows.to(self.device).long()
        valid = path >= 0
        flat = torch.arange(bs, device=self.device)[:, None] * rows + path.clamp(min=0)
        predict = torch.zeros(bs * rows + 1, dtype=torch.long, device=self.device)  # the last entry: padding
        predict.scatter_(0, torch.where(valid, flat, bs * rows).reshape(-1), tokens[:, :width].long().reshape(-1))
        compute_spec_logprobs(batch, logits_output, predict, accept_index=torch.where(valid, flat, -1))

    def _write_committed(self, batch: ScheduleBatch, taps: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor,
                         context: torch.Tensor | None = None) -> None:
        """Draft K/V of the rows a step committed (root + accepted nodes, ``counts`` [bs] of the ``rows``
        [bs, W] columns, -1 padding), written at the slots their target K/V now occupy (positions ``seq_lens[b] +
        j`` after the keep). Fixed shapes: padding columns write to the padding slot. Deferred: a run of AR
        steps is projected in one call when the drafter next reads the pool. ``context`` [bs] bool: the requests whose
        rows are written (None: every one; the others' go to the padding slot, which a CPU flush drops)."""
        bs, width = rows.shape
        if taps.shape[1] == 1:  # an AR step: each request's one row, at position seq_lens[b]
            positions = batch.seq_lens.long()
            slots = self.req_to_token_pool.req_to_token[batch.req_pool_indices.long(), positions].long()
            if context is not None:
                slots = torch.where(context, slots, PAD_SLOT)
            self.draft_pool.defer(slots, taps[:, 0], positions)
            return
        if context is not None:
            counts = torch.where(context, counts, 0)
        idx = rows.clamp(min=0).to(taps.device)
        kept = taps.gather(1, idx[:, :, None].expand(-1, -1, taps.shape[2])).reshape(bs * width, -1)
        slots, positions = committed_slots(self.req_to_token_pool.req_to_token, batch.req_pool_indices,
                                           batch.seq_lens, counts.to(self.device), width)
        self.draft_pool.defer(slots, kept, positions)

    # ------------------------------------------------------------------ cost model calibration
    def _maybe_calibrate(self, batch: ScheduleBatch, rounds: RoundBatch, target: "SGLangRows",
                         sources: list) -> bool:
        """Measure the target pass at every row count of the grid and the drafter pass, on THIS batch, the first
        time a batch size of a new power-of-two bucket decodes (not for the ``fixed`` planner; skipped when the
        cached calibration covers it). The passes write K/V only into the slots SGLang reserved for this step, which
        the real verify pass overwrites right after; their outputs are dropped."""
        if self.planner_mode in ("fixed", "off"):  # (random, a test policy, calibrates too: the passes must be harmless)
            return False
        bs = rounds.size
        bucket = 1 << (bs.bit_length() - 1)
        costs = self.planner.costs
        if any(1 << (b.bit_length() - 1) == bucket for b in costs.calibrated_batches()):
            return False
        t0 = time.perf_counter()
        grid = self.verify_graphs.widths if self.verify_graphs is not None else default_row_grid(self.draft_token_num)
        measured = calibrate_round(target, sources, rounds, grid, self.draft_token_num, repeats=3)
        costs.add_curve(bs, [x // bs for x in measured.verify_rows], measured.verify_ms_at)
        costs.add_draft_point(bs, measured.draft_ms_at[0])
        batch.forward_mode = ForwardMode.DECODE
        saved = save_costs(costs)
        logger.info("GLANCE cost model calibrated at batch %d in %.2f s (rows %s: %s ms; drafter %.2f ms)%s", bs,
                    time.perf_counter() - t0, grid, [round(x, 2) for x in costs.curves[bs][1]],
                    measured.draft_ms_at[0], f"; cached in {saved}" if saved else "")
        return True


def _unragged(packed: torch.Tensor, vt) -> torch.Tensor:
    """A ragged pass's per-row tensor [T, ...] in the uniform layout [bs * N, ...] of its verify input ``vt``
    (``build_verify_input(rows=...)``: row ``vt.rows[i]`` holds ``packed[i]``, the rows it left out are zero;
    only those are cleared, not the whole tensor: a vocabulary of logits per row)."""
    out = packed.new_empty((vt.rows.numel() + vt.left_out.numel(),) + tuple(packed.shape[1:]))
    return out.index_copy_(0, vt.rows, packed).index_fill_(0, vt.left_out, 0)


def _rounded(values) -> list[float] | None:
    """A step log's per-request numbers, to two decimals (None: none)."""
    return None if not values else [round(float(v), 2) for v in values]


def _in_vocab(ids, vocab: int) -> list[int]:
    """Token ids with those outside ``[0, vocab)`` (SGLang's multimodal pad values) as -1, the n-gram source's
    skip token: never matched, never proposed."""
    return [t if 0 <= t < vocab else -1 for t in map(int, ids)]


class _RequestTokens:
    """``RoundBatch.tokens`` of a decode batch, read lazily: request b's prompt + committed output token ids (the
    n-gram adapter reads them only for a request it must re-add). The committed output is ``committed[b]`` tokens
    ending in the root ``roots[b]``: SGLang's ``req.output_ids`` less its newest tokens (it lags a step behind under
    overlap scheduling), then the root."""

    def __init__(self, reqs, vocab: int, roots: list[int], committed: list[int]) -> None:
        self.reqs, self.vocab, self.roots, self.committed = reqs, vocab, roots, committed

    def __len__(self) -> int:
        return len(self.reqs)

    def output(self, b: int) -> list[int]:
        return list(self.reqs[b].output_ids[:max(self.committed[b] - 1, 0)]) + [self.roots[b]]

    def __getitem__(self, b: int) -> list[int]:
        return _in_vocab(self.reqs[b].origin_input_ids, self.vocab) + self.output(b)


class _PassEvents:
    """A CUDA pass's device time from two events on the current stream (recorded at creation and at :meth:`stop`),
    instead of a ``torch.cuda.synchronize`` after the pass: the host goes on queueing the walk, the KV keep and the
    drafter's writes while the pass runs, and reads the time after the round's outcome read (which waits for the
    pass)."""

    def __init__(self, device) -> None:
        self.stream = torch.cuda.current_stream(device)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record(self.stream)

    def stop(self) -> None:
        self.end.record(self.stream)

    def ms(self) -> float:
        self.end.synchronize()  # done already once the outcome was read: no wait
        return float(self.start.elapsed_time(self.end))


class SGLangRows:
    """The worker's target pass for ``glance_sgl.round`` (``TargetRows``), bound to one decode batch: SGLang's
    verify or AR forward (:meth:`GlanceWorker._pass`), the grammar mask, and the keep (``accept_window``)."""

    def __init__(self, worker: GlanceWorker, batch: ScheduleBatch, seq_lens_cpu: list[int], pp_proxy_tensors,
                 rules: LogitRules | None = None, next_index: torch.Tensor | None = None) -> None:
        self.worker, self.batch, self.seq_lens_cpu, self.pp_proxy_tensors = worker, batch, seq_lens_cpu, pp_proxy_tensors
        self.rules, self.next_index = rules, next_index  # the batch's logit rules (None: none) and sampling counters

    def forward(self, tree: DraftTree, taps: bool = True, rows: list[int] | None = None) -> PassOutput:
        """The pass over ``tree`` [bs, R]: logits [bs, R, V] where SGLang left them, with the batch's logit rules
        applied (``glance_sgl.verify.LogitRules``) and masked by each constrained request's grammar along every
        row's path; taps [bs, R, L*H] (None where not captured: ``taps`` False, or no drafter among the sources);
        SGLang's result as the handle. ``rows``: a ragged pass (each request's first ``rows[b]`` rows; ``GlanceWorker.ragged``)."""
        w = self.worker
        timer = _PassEvents(w.device) if w.device_is_cuda else None
        # SGLang's forward (attention backend, sampler bookkeeping) is not this step's to bound
        with w._counter.paused() if w._counter is not None else contextlib.nullcontext():
            result, logits, taps = w._pass(self.batch, tree, self.seq_lens_cpu, self.pp_proxy_tensors, taps, rows)
        if timer is not None:
            timer.stop()
        if self.rules is not None:  # logit bias, stop tokens before min_new_tokens: as a plain step applies them
            self.rules.apply(logits, tree.depths, self.next_index)
        if self.batch.has_grammar:  # constrained requests: each row's logits masked by the grammar along its path
            w._mask_grammar(self.batch, tree, logits)
        return PassOutput(logits, taps, result, device_ms=None if timer is None else timer.ms)

    def keep(self, tree: DraftTree, walk: WalkResult) -> None:
        """The accepted rows' K/V at the front of each verify window (root first): with token-level slots (page size
        1) the window's slots are reordered (``accept_window``: a few index ops, no K/V moved), else the K/V are
        moved (``glance_kernels.compact_kv``, every layer). Nothing to do where every accepted row already sits at
        its depth (a host step checks: its walk is host data)."""
        w = self.worker
        if not w.device_step and all(r == j for rows in walk.accepted_rows.tolist() for j, r in enumerate(rows)
                                     if r >= 0):
            return
        table = w.req_to_token_pool.req_to_token
        if w.page_size == 1 and max(self.seq_lens_cpu) + tree.num_rows <= table.shape[1]:
            accept_window(table, self.batch.req_pool_indices, self.batch.seq_lens, walk.accepted_rows, tree.num_rows)
            return
        kv = w.token_to_kv_pool_allocator.get_kvcache()
        # the slot table's columns up to the widest verify window, not whole rows (bs x context length a step)
        limit = min(max(self.seq_lens_cpu) + tree.num_rows, table.shape[1])
        glance_kernels.compact_kv(list(kv.k_buffer) + list(kv.v_buffer),
                                  table[self.batch.req_pool_indices.long(), :limit], 1,
                                  self.batch.seq_lens.long(), walk.accepted_rows.to(w.device))

    def drop(self, tree: DraftTree) -> None:
        return None  # the pass wrote only the step's reserved slots, which the real pass overwrites

    def agree(self, value: int) -> int:
        return self.worker._agree(value)

    def width(self, rows: int) -> int:
        """Up to a captured CUDA-graph width: more best-first nodes for the same pass cost."""
        graphs = self.worker.verify_graphs
        return graphs.snap(rows) if graphs is not None else rows


class PoolDrafter:
    """The block drafter as the worker's candidate source (``glance_sgl.round.CandidateSource``), bound to one
    decode batch: its context lives in the draft KV pool; what a step commits is written there deferred."""

    source_id = SOURCE_DRAFTER

    def __init__(self, worker: GlanceWorker, batch: ScheduleBatch, seq_lens_cpu: list[int]) -> None:
        self.worker, self.batch, self.seq_lens_cpu = worker, batch, seq_lens_cpu

    def propose(self, batch: RoundBatch, rows: int) -> DraftTree:
        """The best-first trees at the full budget (``rows`` is the worker's ``N``) of ``batch``'s requests (the
        step's, or those of ``batch.members``)."""
        return self.worker.draft_trees(self.batch, self.seq_lens_cpu, batch.roots, batch.members)

    def commit(self, batch: RoundBatch, taps: torch.Tensor, walk: WalkResult) -> None:
        """The committed rows' draft K/V, deferred; none for the requests whose context the round does not keep
        (``batch.context``: retired ones)."""
        w = self.worker
        context = None if batch.context is None else torch.tensor(batch.context, device=w.device)
        w._write_committed(self.batch, taps, walk.accepted_rows, walk.accept_lens.to(w.device) + 1, context)
