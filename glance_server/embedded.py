"""The embedded backend: the in-process GLANCE engine in its own worker thread, fed by a bounded queue.

The event loop never runs model code: routes ``submit`` a job (429 when ``max_queue`` requests already wait),
the worker thread runs jobs one at a time and posts committed text back to the loop. A cancelled job frees
its queue slot at once and, if running, stops at the next round (the engine polls ``should_stop``). An engine
exception fails that one request (503) and the worker carries on with the next.

At start-up the worker picks its torch intra-op threads (:meth:`EmbeddedBackend._pick_threads`: on a CPU the
model runs in this thread, not the process's main thread, and OpenMP behaves differently there), then calibrates
the AR decode cost (ms/token) on a small synthetic image prompt; AR runs made later for ``measure_speedup`` refine
it (exponential average), and the estimate feeds every response's ``estimated_speedup``.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import logging
import random
import threading
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from glance_sgl.engine import GenerationResult, GlanceEngine, RequestError, SamplingParams
from glance_sgl.target import PreparedPrompt, TargetError

from .config import ServerConfig
from .errors import APIError, bad_request
from .jobs import Backend, GenOutput, GenRequest, Job, queue_full
from .logprobs import TokenTable
from .protocol import check_planner, glance_object

log = logging.getLogger("glance_server")


class InjectedFault(RuntimeError):
    """Raised inside the engine's generation loop by ``debug_fault`` (tests of failure recovery)."""


def engine_error(exc: Exception) -> APIError:
    return bad_request(str(exc), getattr(exc, "code", "invalid_request"), getattr(exc, "param", None))


def calibration_messages() -> list[dict[str, Any]]:
    rng = np.random.RandomState(0)
    image = Image.fromarray(rng.randint(0, 256, (112, 112, 3), dtype=np.uint8))
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "describe the picture"}]}]


def result_metrics(result: GenerationResult) -> dict[str, Any]:
    """The engine's numbers, in the arguments of :func:`protocol.glance_object`."""
    m = result.metrics
    return {
        "mode": m.mode, "completion_tokens": len(result.token_ids), "rounds": m.rounds,
        "committed_per_round": list(m.committed_per_round), "drafted_tokens": m.drafted_tokens,
        "accepted_tokens": m.accepted_tokens, "acceptance_histogram": m.acceptance_histogram,
        "prefill_ms": m.prefill_ms, "decode_ms": m.decode_ms,
        "mean_root_entropy": None if not m.root_entropies else m.mean_root_entropy,
        "planner": m.planner, "rows_histogram": m.rows_histogram,
        "rounds_without_drafting": m.rounds_without_drafting,
        "predicted_tokens_per_round": m.predicted_tokens_per_round,
        "draft_sources": list(m.draft_sources), "sources": m.sources,
    }


class EmbeddedBackend(Backend):
    name = "embedded"

    def __init__(self, engine: GlanceEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.guard = engine.special_tokens
        self.tokens = TokenTable(engine.target.tokenizer)
        # prompts are prepared before queueing, in a worker thread, with a processor of their own
        self._processor = copy.deepcopy(engine.target.processor)
        self._prepare_lock = threading.Lock()
        self.default_mode = engine.mode
        self.default_planner = engine.planner_mode if engine.drafter is not None else None
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._calibrated = not config.calibrate
        self.threads: int | None = None  # the engine thread's torch intra-op threads, once the worker started
        self.ar_ms_per_token: float | None = None
        self.mean_job_s = 1.0  # exponential average of a job's run time (for Retry-After)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._thread = threading.Thread(target=self._worker, name="glance-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._cond:
            self._stopping = True
            for job in self._pending:
                job.cancel()
            if self._running is not None:
                self._running.cancel()
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    async def check_ready(self) -> tuple[bool, str]:
        if self._thread is None or not self._thread.is_alive():
            return False, "engine worker not running"
        if not self._calibrated:
            return False, "calibrating"
        return True, "ok"

    def describe(self) -> dict[str, Any]:
        ngram = self.engine.ngram
        return {"backend": self.name, "mode": self.default_mode, "planner": self.default_planner,
                "draft_sources": list(self.engine.draft_sources),
                "ngram_corpus": ngram.source.settings.scope if ngram is not None else None,
                "block_size": self.engine.block_size, "budget": self.engine.budget,
                "max_nodes": getattr(self.engine, "max_nodes", None), "branch_k": self.engine.branch_k,
                "context_length": self.engine.target.context_length, "threads": self.threads,
                "drafter_compiled": self.engine.drafter is not None and self.engine.drafter.block_compiled,
                "estimated_ar_ms_per_token": self.ar_ms_per_token}

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"queued": self._queued(), "in_flight": int(self._running is not None)}

    def _queued(self) -> int:
        return sum(1 for job in self._pending if not job.cancelled.is_set())

    # ------------------------------------------------------------------ submission
    async def prepare(self, request: GenRequest) -> None:
        """Chat template, image processing and the context-length check before the request queues, so that a
        refusal is a 400 at once (also before a stream opens); the engine then runs the prepared prompt."""
        request.prepared = await asyncio.to_thread(self._prepare, request)

    def _prepare(self, request: GenRequest):
        try:
            with self._prepare_lock:
                prompt = self.engine.prepare(request.prompt if request.prompt is not None else request.messages,
                                             self._processor)
            self.engine.check_fits(prompt, request.params)
        except (RequestError, TargetError) as exc:
            raise engine_error(exc) from exc
        return prompt

    def submit(self, request: GenRequest) -> Job:
        if request.json_schema is not None:
            raise bad_request("response_format json_object / json_schema needs grammar-constrained decoding, which "
                              "the embedded engine does not have; serve with --backend sglang for it",
                              "unsupported_parameter", "response_format")
        if request.mode not in (None, "ar") and self.engine.drafter is None:
            raise bad_request(f"mode {request.mode!r} needs a drafter; this server runs without one",
                              "unsupported_parameter", "glance.mode")
        if request.planner is not None and self.engine.drafter is None:
            raise bad_request("planner needs a drafter; this server runs without one (AR only)",
                              "unsupported_parameter", "glance.planner")
        check_planner(request.planner, request.mode or self.default_mode)
        try:  # sources this engine has, for mode glance: refused now, before any stream opens
            self.engine.check_sources(request.draft_sources, request.mode or self.default_mode)
        except RequestError as exc:
            raise bad_request(str(exc), "invalid_value", "glance.draft_sources") from exc
        job = Job(request, asyncio.get_running_loop())
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down", "shutting_down")
            queued = self._queued()
            if queued >= self.config.max_queue:
                raise queue_full((queued + 1) * self.mean_job_s, queued)
            self._pending.append(job)
            self._cond.notify()
        job.accepted = request.prepared is not None  # nothing left to refuse: a stream may open now
        job.on_cancel(self._wake)
        return job

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ the worker thread
    def _next_job(self) -> Job | None:
        with self._cond:
            while True:
                while self._pending and self._pending[0].cancelled.is_set():
                    self._pending.popleft().post("error", APIError(499, "cancelled", "cancelled"))
                if self._pending:
                    self._running = self._pending.popleft()
                    return self._running
                if self._stopping:
                    return None
                self._cond.wait()

    def _worker(self) -> None:
        self._pick_threads()
        if not self._calibrated:
            try:
                self._calibrate()
            except Exception:  # a failed calibration leaves estimates empty, the engine may still serve
                log.exception("calibration failed")
            self._calibrated = True
        while (job := self._next_job()) is not None:
            t0 = time.perf_counter()
            try:
                job.started = t0
                job.post("done", self._run(job))
            except APIError as exc:
                job.post("error", exc)
            except (RequestError, TargetError) as exc:
                job.post("error", engine_error(exc))
            except Exception as exc:  # the engine failed: this request gets a 503, the worker goes on
                log.exception("engine failure on request %s", job.request.request_id)
                job.post("error", APIError(503, f"the engine failed on this request ({type(exc).__name__}); "
                                           "it has recovered, retry", "engine_error"))
            finally:
                with self._cond:
                    self._running = None
                self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * (time.perf_counter() - t0)

    def _pick_threads(self) -> None:
        """The engine thread's torch intra-op threads: ``config.threads`` where given, else, on a CPU, whichever of
        torch's count and 1 decodes faster in this thread (timed on the calibration prompt: AR and drafter-chain
        rounds), else torch's count. Once the process's main thread has run an OpenMP region (loading the model
        does), regions started from another thread are far slower with several threads on a few cores: on 2 cores
        the demo target's 8-row GEMMs took 2.4x as long in a worker thread as in the main thread, a verify round
        of the fixed tree 1.7x (12.1 vs 7.6 ms) and an AR step 1.2x; with one thread the worker ran within 10 %
        of the main thread. Set here, in the thread that runs the model: OpenMP keeps the count per thread."""
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
            self.threads = self.config.threads
            return
        default = self.threads = torch.get_num_threads()
        if not self.config.calibrate or default <= 1 or self.engine.target.device.type != "cpu":
            return
        try:
            with self._prepare_lock:  # the backend's own processor, as requests are prepared
                prompt = self.engine.prepare(calibration_messages(), self._processor)
            timed = {n: self._decode_cost(prompt, n) for n in (default, 1)}
        except Exception:  # keep torch's count; the calibration that follows reports what fails
            log.exception("timing the engine thread's torch threads failed")
            torch.set_num_threads(default)
            return
        self.threads = min(timed, key=timed.get)
        torch.set_num_threads(self.threads)
        log.info("engine thread: %d torch threads (ms per AR + chain round: %s)", self.threads,
                 ", ".join(f"{n} threads {ms:.2f}" for n, ms in timed.items()))

    def _decode_cost(self, prompt: PreparedPrompt, threads: int, repeats: int = 2) -> float:
        """Milliseconds of an AR round plus, with a drafter, a drafter-chain round (drafter pass and a verify of
        the block's rows) of ``prompt``, in this thread at ``threads`` torch threads: the fastest of ``repeats``
        runs. Neither mode reaches the planner or the n-gram corpus, so nothing is learned from runs at the wrong
        count."""
        torch.set_num_threads(threads)
        params = SamplingParams(max_tokens=16, temperature=0.0)

        def per_round(mode: str) -> float:
            m = self.engine.generate(prompt, params, mode=mode).metrics
            return m.decode_ms / max(m.rounds, 1)

        modes = ["ar"] + (["chain"] if self.engine.drafter is not None else [])
        return sum(min(per_round(mode) for _ in range(repeats)) for mode in modes)

    def _calibrate(self) -> None:
        messages = calibration_messages()
        if self.engine.drafter is not None:  # warm the speculative path too
            self.engine.generate(messages, SamplingParams(max_tokens=8, temperature=0.0))
        result = self.engine.generate(messages, SamplingParams(max_tokens=32, temperature=0.0), mode="ar")
        self._observe_ar(result)
        log.info("calibrated AR decode: %.2f ms/token", self.ar_ms_per_token or float("nan"))

    def _observe_ar(self, result: GenerationResult) -> None:
        if result.metrics.decode_tokens >= 4 and result.finish_reason != "cancelled":
            ms = result.metrics.decode_ms_per_token
            self.ar_ms_per_token = ms if self.ar_ms_per_token is None else 0.7 * self.ar_ms_per_token + 0.3 * ms

    def _run(self, job: Job) -> GenOutput:
        req = job.request
        params = req.params
        if req.measure_speedup and params.seed is None:  # both runs must draw the same samples
            params = dataclasses.replace(params, stop=list(params.stop), seed=random.getrandbits(62))
        deltas = 0

        def on_delta(delta) -> None:
            nonlocal deltas
            deltas += 1
            if req.debug_fault == "engine_error" and deltas == 2:
                raise InjectedFault("injected engine failure")
            job.post("delta", delta)

        mode = req.mode or self.default_mode
        prompt = req.prepared if req.prepared is not None else req.prompt if req.prompt is not None \
            else req.messages
        result = self.engine.generate(prompt, params, mode=mode, planner=req.planner, on_delta=on_delta,
                                      should_stop=job.cancelled.is_set, draft_sources=req.draft_sources,
                                      ngram_key=req.tenant)
        estimate = self.ar_ms_per_token
        measured = None
        if mode == "ar":
            self._observe_ar(result)
        elif req.measure_speedup and result.finish_reason != "cancelled":
            ar = self.engine.generate(prompt, params, mode="ar", should_stop=job.cancelled.is_set)
            self._observe_ar(ar)
            measured = measured_speedup(result, ar)
        metrics = result_metrics(result)
        glance = glance_object(backend=self.name, estimated_ar_ms_per_token=estimate, queue_ms=job.queue_ms,
                               measured=measured, **metrics)
        return GenOutput(text=result.text, token_ids=result.token_ids, finish_reason=result.finish_reason,
                         prompt_tokens=result.metrics.prompt_tokens, completion_tokens=len(result.token_ids),
                         glance=glance, logprobs=result.logprobs)


def measured_speedup(spec: GenerationResult, ar: GenerationResult) -> dict[str, Any]:
    """Speculative vs autoregressive decoding of the same request, back to back (design §1, Metrics)."""
    s, a = spec.metrics, ar.metrics
    decode = a.decode_ms_per_token / s.decode_ms_per_token if s.decode_ms_per_token and a.decode_ms_per_token else None
    e2e_spec = (s.prefill_ms + s.decode_ms) / max(len(spec.token_ids), 1)
    e2e_ar = (a.prefill_ms + a.decode_ms) / max(len(ar.token_ids), 1)
    return {
        "ar_prefill_ms": a.prefill_ms,
        "ar_decode_ms": a.decode_ms,
        "ar_decode_ms_per_token": a.decode_ms_per_token,
        "ar_completion_tokens": len(ar.token_ids),
        "decode_speedup": decode,
        "e2e_speedup": e2e_ar / e2e_spec if e2e_spec > 0 else None,
        "lossless_match": ar.token_ids == spec.token_ids,
    }
