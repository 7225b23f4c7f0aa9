"""The embedded engine: one request at a time, prefill then rounds of draft / tree / verify / commit.

The decoding loop reads like gpt-fast's ``generate.py``: ``prefill`` gives the first token, then
``speculative_round`` (GLANCE) or ``ar_step`` (the autoregressive baseline) runs until EOS, a stop string, the
token limit or cancellation. Committed tokens stream out through a callback or :meth:`GlanceEngine.stream`.
The algorithm itself lives in ``drafter``, ``tree`` and ``verify``; this module only drives it.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import glance_kernels
import torch

from .drafter import DrafterCache, GlanceDrafter, draft_logprobs
from .metrics import RequestMetrics, entropy_nats
from .target import PreparedPrompt, TargetAdapter, TargetError, TargetState
from .tree import DraftTree, build_tree, chain_tree, topk_per_offset
from .verify import SamplingSpec, target_choices, verify_tree

Mode = Literal["glance", "chain", "ar"]
MAX_STOP_STRINGS = 8


class RequestError(ValueError):
    """A request the engine refuses, with a message that names the problem and an OpenAI-style ``code``."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass
class SamplingParams:
    """Sampling parameters of one request. ``temperature == 0`` is greedy; ``seed`` None draws one."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise RequestError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length", "cancelled"
    metrics: RequestMetrics

    def to_dict(self, per_round: bool = False) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict(per_round=per_round),
        }


@dataclass
class StreamDelta:
    """Newly committed tokens and the text they complete (text may lag tokens at a stop-string prefix)."""

    token_ids: list[int]
    text: str


class _Output:
    """Committed tokens of one request with EOS / stop-string / limit handling and incremental text."""

    def __init__(self, tokenizer, eos_ids: set[int], params: SamplingParams) -> None:
        self.tokenizer, self.eos_ids, self.params = tokenizer, eos_ids, params
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted_chars = 0
        self.finish_reason: str | None = None
        self._stop_cut: int | None = None

    def add(self, tokens: list[int]) -> int:
        """Append tokens until a stop condition; returns how many were kept.

        Stop strings are searched once per call in the newly decoded tail (not once per token over the whole
        text), and only on a hit is the token that completes the stop string looked up.
        """
        before_tokens, before_chars = len(self.token_ids), len(self.text)
        for tok in tokens:
            if self.finish_reason is not None:
                break
            self.token_ids.append(tok)
            if tok in self.eos_ids:
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self.params.stop and self._stop_cut is None:
            # earlier text was already searched; back off so a stop string straddling the old end (or a
            # completed partial UTF-8 character there) is still found
            start = max(0, before_chars - max(map(len, self.params.stop)) - 8)
            if self._first_stop(text, start) is not None:
                text = self._truncate_at_stop(before_tokens)
        self.text = text[: self._stop_cut] if self._stop_cut is not None else text
        return len(self.token_ids) - before_tokens

    def _first_stop(self, text: str, start: int = 0) -> int | None:
        """Where the earliest stop string starts in ``text`` at or after ``start``, or None."""
        hits = [i for i in (text.find(s, start) for s in self.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _truncate_at_stop(self, first_new: int) -> str:
        """Drop the tokens after the one that completes a stop string (searched from token ``first_new``);
        sets the finish reason and the text cut. Returns the decoded text of the kept tokens."""
        for n in range(first_new + 1, len(self.token_ids) + 1):
            text = self.tokenizer.decode(self.token_ids[:n], skip_special_tokens=True)
            cut = self._first_stop(text)
            if cut is not None:
                del self.token_ids[n:]
                self._stop_cut, self.finish_reason = cut, "stop"
                return text
        raise AssertionError("stop string found in the text but in no token prefix")

    def delta(self, new_tokens: list[int]) -> StreamDelta:
        """Text not yet emitted, holding back a possible stop-string prefix or a partial UTF-8 character."""
        end = len(self.text)
        if self.finish_reason is None:
            while end > self.emitted_chars and self.text[end - 1] == "\ufffd":
                end -= 1
            for s in self.params.stop:
                for n in range(min(len(s) - 1, end - self.emitted_chars), 0, -1):
                    if self.text[end - n : end] == s[:n]:
                        end -= n
                        break
        piece = self.text[self.emitted_chars : end]
        self.emitted_chars = max(self.emitted_chars, end)
        return StreamDelta(token_ids=new_tokens, text=piece)


class GlanceEngine:
    """Serve requests on a Hugging Face Qwen-VL target, with a GLANCE drafter or autoregressively.

    ``mode`` picks the default decoding: "glance" (budget tree), "chain" (width-1 ablation) or "ar".
    Not re-entrant: one request runs at a time (a lock serialises callers).
    """

    def __init__(
        self,
        target: TargetAdapter,
        drafter: GlanceDrafter | None = None,
        budget: int | None = None,
        branch_k: int | None = None,
        mode: Mode = "glance",
    ) -> None:
        self.target = target
        self.drafter = drafter
        if drafter is not None:
            cfg = drafter.config
            if cfg.num_target_layers != len(target.layers):
                raise ValueError(
                    f"drafter was built for a target with {cfg.num_target_layers} layers, this one has "
                    f"{len(target.layers)}"
                )
            target.check_tap_layers(cfg.tap_layers)
            drafter.bind_target(target.input_embeddings(), target.lm_head())
            drafter.to(device=target.device, dtype=target.model.dtype).eval()
            self.budget = budget or cfg.budget
            self.branch_k = branch_k or cfg.branch_k
        elif mode != "ar":
            raise ValueError("a drafter is needed for speculative modes; use mode='ar' without one")
        else:
            self.budget, self.branch_k = 0, 0
        self.mode: Mode = mode
        self.eos_ids = target.eos_token_ids
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        drafter_dir: str | Path | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> "GlanceEngine":
        target = TargetAdapter.load(model_dir, device=device, dtype=dtype)
        drafter = GlanceDrafter.from_pretrained(drafter_dir, device=device, dtype=dtype) if drafter_dir else None
        if drafter is None:
            kwargs.setdefault("mode", "ar")
        return cls(target, drafter, **kwargs)

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size if self.drafter is not None else 1

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        mode: Mode | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Run one request to completion. ``on_delta`` receives committed tokens as they land;
        ``should_stop`` is polled between rounds (True cancels: finish_reason "cancelled")."""
        params = params or SamplingParams()
        params.validate()
        mode = mode or self.mode
        if mode != "ar" and self.drafter is None:
            raise RequestError(f"mode {mode!r} needs a drafter; this engine has none")
        if mode not in ("glance", "chain", "ar"):
            raise RequestError(f"unknown decoding mode {mode!r}")
        with self._lock:  # one request at a time (fast tokenizers are not safe to share across threads either)
            t0 = time.perf_counter()
            prompt = self.target.prepare(messages)
            prepare_ms = (time.perf_counter() - t0) * 1000.0
            return self._run(prompt, prepare_ms, params, mode, on_delta, should_stop)

    def stream(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
               mode: Mode | None = None) -> Iterator[StreamDelta | GenerationResult]:
        """Yield :class:`StreamDelta` items as tokens commit, then the final :class:`GenerationResult`.
        Closing the iterator early cancels the request."""
        items: queue.Queue = queue.Queue()
        cancelled = threading.Event()
        done = object()

        def work() -> None:
            try:
                items.put(self.generate(messages, params, mode, on_delta=items.put, should_stop=cancelled.is_set))
            except BaseException as exc:  # handed to the consumer
                items.put(exc)
            finally:
                items.put(done)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        try:
            while (item := items.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()
            thread.join()

    # ------------------------------------------------------------------ the loop
    def _run(self, prompt: PreparedPrompt, prepare_ms: float, params: SamplingParams, mode: Mode, on_delta,
             should_stop) -> GenerationResult:
        """The decoding loop. ``prefill_ms`` counts the prompt's preparation (``prepare_ms``) and the prefill."""
        spec = SamplingSpec(params.temperature, params.top_p,
                            params.seed if params.seed is not None else random.getrandbits(62))
        metrics = RequestMetrics(mode=mode, block_size=self.block_size if mode != "ar" else 1)
        out = _Output(self.target.tokenizer, self.eos_ids, params)

        t0 = time.perf_counter()
        metrics.prompt_tokens = prompt.num_tokens
        if prompt.num_tokens + params.max_tokens + self.budget + 1 > self.target.context_length:
            raise RequestError(
                f"prompt ({prompt.num_tokens} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"length ({self.target.context_length})", code="context_length_exceeded", param="messages",
            )
        state, rows = self.target.prefill(prompt, taps=self._taps(mode))
        first = int(self._choices(rows.logits[-1:], torch.zeros(1, dtype=torch.long), 0, spec)[0])
        dcache = self._start_drafter(rows.taps) if mode != "ar" else None
        out.add([first])
        metrics.prefill_ms = prepare_ms + (time.perf_counter() - t0) * 1000.0
        self._emit(on_delta, out, [first])

        t1 = time.perf_counter()
        while out.finish_reason is None:
            if should_stop is not None and should_stop():
                out.finish_reason = "cancelled"
                break
            if mode == "ar":
                new_tokens = self.ar_step(state, out.token_ids, spec)
                kept = out.add(new_tokens)
                metrics.record_round(drafted=0, accepted=0, committed=kept, root_entropy=None)
            else:
                new_tokens, drafted, accepted, entropy = self.speculative_round(state, dcache, out.token_ids, spec, mode)
                kept = out.add(new_tokens)
                metrics.record_round(drafted=drafted, accepted=accepted, committed=kept, root_entropy=entropy)
            self._emit(on_delta, out, new_tokens[:kept])
        metrics.decode_ms = (time.perf_counter() - t1) * 1000.0
        metrics.completion_tokens = len(out.token_ids)
        return GenerationResult(text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
                                metrics=metrics)

    def _taps(self, mode: Mode) -> list[int] | None:
        return self.drafter.config.tap_layers if mode != "ar" and self.drafter is not None else None

    def _emit(self, on_delta, out: _Output, tokens: list[int]) -> None:
        if on_delta is not None:
            on_delta(out.delta(tokens))

    def _choices(self, logits: torch.Tensor, depths: torch.Tensor, next_index: int, spec: SamplingSpec) -> torch.Tensor:
        """Target choices for rows ``logits`` [R, V] at ``depths`` [R]; output index of depth 0 is next_index."""
        return target_choices(logits[None], depths[None], torch.tensor([next_index]), [spec])[0]

    def _start_drafter(self, prompt_taps: torch.Tensor) -> DrafterCache:
        """The head's cache holding the prompt's context features."""
        assert self.drafter is not None
        n = prompt_taps.shape[0]
        dcache = self.drafter.new_cache(1, capacity=max(256, 2 * n))
        self.drafter.extend_context(dcache, prompt_taps[None], torch.tensor([n]))
        return dcache

    def draft_tree(self, dcache: DrafterCache, root: int, mode: Mode) -> DraftTree:
        """One drafter pass for the block ``[root, MASK...]`` and the candidate tree built from it."""
        assert self.drafter is not None
        logits = self.drafter.draft_block(dcache, torch.tensor([root], device=self.target.device))
        values, ids = topk_per_offset(draft_logprobs(logits), 1 if mode == "chain" else self.branch_k)
        roots = torch.tensor([root])
        return chain_tree(values, ids, roots) if mode == "chain" else build_tree(values, ids, roots, self.budget)

    def speculative_round(
        self, state: TargetState, dcache: DrafterCache, committed: list[int], spec: SamplingSpec, mode: Mode
    ) -> tuple[list[int], int, int, float]:
        """Draft, verify the whole tree in one target pass, keep the accepted KV and feed the head.

        Returns (tokens to commit, drafted nodes, accepted nodes, root entropy in nats).
        """
        assert self.drafter is not None
        tree = self.draft_tree(dcache, committed[-1], mode)
        # Triton on CUDA, glance_sgl.tree's torch code elsewhere; only the mask is needed here
        meta = glance_kernels.tree_meta(tree.parents, pointers=False)
        rows = self.target.forward_rows(state, tree.tokens[0], tree.depths[0], meta.tree_mask[0],
                                        taps=self.drafter.config.tap_layers)
        walk = verify_tree(tree.tokens, tree.parents, tree.depths, rows.logits[None].cpu(),
                           torch.tensor([len(committed)]), [spec])
        accepted = int(walk.accept_lens[0])
        path = walk.accepted_rows[0, : accepted + 1]  # root + accepted nodes
        self.target.keep_rows(state, tree.num_rows, path)
        self.drafter.extend_context(dcache, rows.taps[path.to(rows.taps.device)][None], torch.tensor([accepted + 1]))
        return walk.committed(tree.tokens)[0], tree.num_nodes, accepted, entropy_nats(rows.logits[0])

    def ar_step(self, state: TargetState, committed: list[int], spec: SamplingSpec) -> list[int]:
        """One autoregressive step: the last committed token through the target, one new token out."""
        zero = torch.zeros(1, dtype=torch.long)
        rows = self.target.forward_rows(state, torch.tensor([committed[-1]]), zero,
                                        torch.ones(1, 1, dtype=torch.bool))
        return [int(self._choices(rows.logits.cpu(), zero, len(committed), spec)[0])]


__all__ = ["GlanceEngine", "SamplingParams", "GenerationResult", "StreamDelta", "RequestError", "TargetError"]
