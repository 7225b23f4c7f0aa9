"""The embedded engine: one request at a time, prefill then rounds of draft / tree / verify / commit.

The decoding loop reads like gpt-fast's ``generate.py``: ``prefill`` gives the first token, then
``speculative_round`` (GLANCE) or ``_ar_pass`` (the autoregressive baseline) runs until EOS, a stop string, the
token limit or cancellation. Committed tokens stream out through a callback or :meth:`GlanceEngine.stream`.
The round itself is ``glance_sgl.round`` (the SGLang worker's too), run here as a batch of one over the request's
Hugging Face cache (``target.CachePass``) and its drafter context (``drafter.CachedDrafter``); this module keeps
the requests, streaming and output handling.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import platform
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

import torch

from .drafter import CachedDrafter, GlanceDrafter
from .metrics import RequestMetrics, entropy_nats, source_counts
from .ngram_source import NgramCandidates, NgramSettings, NgramSource
from .special_tokens import SpecialTokenGuard, special_token_message
from .costs import CostModel, cost_key, default_row_grid, load_costs, save_costs
from .planner import PLANNER_MODES, AlwaysDraft, Planner, PlannerMode
from .round import DRAFT_SOURCES, RoundBatch, calibrate_round, check_draft_sources, speculative_round
from .target import CachePass, PreparedPrompt, RowsOutput, TargetAdapter, TargetError, TargetState
from .tree import max_tree_size
from .verify import LogitRules, SamplingSpec, target_choices, wrap_seed

Mode = Literal["glance", "chain", "ar"]
MAX_STOP_STRINGS = 8
MAX_TOP_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a request's seed is a signed 64-bit integer, as SGLang's


def offset_seed(seed: int, offset: int) -> int:
    """``seed + offset`` wrapped into ``SEED_MIN .. SEED_MAX`` (:func:`glance_sgl.verify.wrap_seed`): the seed of a
    request's ``offset``-th choice, a valid seed for every backend whatever the first one's."""
    return wrap_seed(seed + offset)


class RequestError(ValueError):
    """A request the engine refuses, with a message that names the problem and an OpenAI-style ``code``."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass
class SamplingParams:
    """Sampling parameters of one request. ``temperature == 0`` is greedy; ``seed`` None draws one.
    ``logprobs``: None (off) or k in 0..20: return each committed token's log-probability and its k best
    alternatives (:class:`TokenLogprob`). At T > 0 the target's distribution is filtered as SGLang's sampler
    filters it: ``top_k`` most likely tokens (0: no limit), ``top_p`` nucleus, ``min_p`` times the most likely
    token's probability (0: off); greedy decoding ignores the filters."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit at every step (OpenAI's)
    min_tokens: int = 0  # no EOS before this many tokens (its logit masked, as vLLM's and SGLang's min tokens)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise RequestError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_k must be a non-negative integer (0: no limit), got {self.top_k!r}",
                               param="top_k")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}", param="min_p")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}",
                               param="min_tokens")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise RequestError(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
            if not -100.0 <= float(bias) <= 100.0:
                raise RequestError(f"logit_bias values must be in [-100, 100], got {bias!r}", param="logit_bias")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise RequestError(f"seed must be a 64-bit integer in [-2**63, 2**63 - 1], got {self.seed!r}", param="seed")
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs!r}",
                               param="logprobs")


@dataclass
class TokenLogprob:
    """One committed token's log-probability under the target (natural log of the softmax of the target's raw
    logits: temperature 1, before top-p) at the pass that chose it, and the ``top`` k alternatives
    [(token_id, logprob)], best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens`` [n] under the rows ``logits`` [n, V] that chose them, with the top ``k``."""
    lp = torch.log_softmax(logits[: len(tokens)].detach().float().cpu(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if k > 0:
        values, ids = lp.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length", "cancelled"
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, with SamplingParams.logprobs

    def to_dict(self, per_round: bool = False) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict(per_round=per_round),
        }


@dataclass
class SpeculativeRequest:
    """A request's side of the speculative round: its planner key ``rid``, the ``policy`` that plans its rounds
    (a :class:`Planner`, or ``AlwaysDraft`` for the chain), its drafter (the candidate source over its drafter
    context) and its target pass."""

    rid: int
    policy: Planner | AlwaysDraft
    drafter: CachedDrafter
    target: CachePass
    sources: list | None = None  # the round's candidate sources (None: the drafter alone)
    history: list[int] | None = None  # prompt + committed tokens, for sources that match on them (n-gram)


@dataclass
class RoundRecord:
    """What one round did: ``nodes`` verified tree nodes (0: the pass verified the root only), ``accepted``
    of them, the root entropy (nats), the planner's predicted tokens, whether the drafter ran, and the target's
    logits [n, V] of the rows that chose the n committed tokens (root first; for logprobs)."""

    nodes: int
    accepted: int
    root_entropy: float
    predicted: float | None
    drafter_ran: bool
    choice_logits: torch.Tensor | None = None
    sources: dict[str, tuple[bool, int]] | None = None  # per source: (verified, accepted), metrics.source_counts
    parts: dict[str, float] | None = None  # wall ms of each part of the round (RoundResult.phases)


@dataclass
class StreamDelta:
    """Newly committed tokens and the text they complete (text may lag tokens at a stop-string prefix);
    ``logprobs`` one per token when the request asked for them."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None


class _Output:
    """Committed tokens of one request with EOS / stop-string / limit handling and incremental text."""

    def __init__(self, tokenizer, eos_ids: set[int], params: SamplingParams) -> None:
        self.tokenizer, self.eos_ids, self.params = tokenizer, eos_ids, params
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.emitted_chars = 0
        self.finish_reason: str | None = None
        self._stop_cut: int | None = None

    def add(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> int:
        """Append tokens (and their ``logprobs``, when tracked) until a stop condition; returns how many were kept.

        Stop strings are searched once per call in the newly decoded tail (not once per token over the whole
        text), and only on a hit is the token that completes the stop string looked up.
        """
        before_tokens, before_chars = len(self.token_ids), len(self.text)
        for n, tok in enumerate(tokens):
            if self.finish_reason is not None:
                break
            self.token_ids.append(tok)
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(logprobs[n])
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
                if self.logprobs is not None:
                    del self.logprobs[n:]
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
        lps = self.logprobs[len(self.logprobs) - len(new_tokens):] if self.logprobs is not None else None
        return StreamDelta(token_ids=new_tokens, text=piece, logprobs=lps)


class GlanceEngine:
    """Serve requests on a Hugging Face Qwen-VL target, with a GLANCE drafter or autoregressively.

    ``mode`` picks the default decoding: "glance" (budget tree), "chain" (width-1 ablation) or "ar".
    ``compile_drafter``: on a CPU, the drafter's block pass runs through ``torch.compile``
    (:meth:`GlanceDrafter.compile_block`; the drafter object is shared, so every engine on it drafts compiled).
    Not re-entrant: one request runs at a time (a lock serialises callers).
    """

    def __init__(
        self,
        target: TargetAdapter,
        drafter: GlanceDrafter | None = None,
        budget: int | None = None,
        branch_k: int | None = None,
        mode: Mode = "glance",
        planner: PlannerMode = "auto",
        max_nodes: int | None = None,
        draft_sources: Sequence[str] = ("drafter",),
        ngram: NgramSettings | None = None,
        ngram_corpus: str | None = None,
        compile_drafter: bool = False,
    ) -> None:
        if planner not in PLANNER_MODES:
            raise ValueError(f"planner must be one of {PLANNER_MODES}, got {planner!r}")
        for name, value in (("budget", budget), ("branch_k", branch_k), ("max_nodes", max_nodes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (None: the drafter's), got {value!r}")
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
            if compile_drafter:  # on a CPU: the block pass through torch.compile (GlanceDrafter.compile_block)
                drafter.compile_block()
            self.budget = budget or cfg.budget
            self.branch_k = branch_k or cfg.branch_k
        elif mode != "ar":
            raise ValueError("a drafter is needed for speculative modes; use mode='ar' without one")
        else:
            self.budget, self.branch_k = 0, 0
        self.mode: Mode = mode
        self.planner_mode: PlannerMode = planner
        self.max_nodes = max_nodes or default_max_nodes(self.budget, self.block_size, self.branch_k)
        self.eos_ids = target.eos_token_ids
        self._stops = frozenset(self.eos_ids)  # the tokens that end every request (RoundBatch.stops)
        self._lock = threading.Lock()
        self._costs: CostModel | None = None
        self._planners: dict[str, Planner] = {}
        self._rids = itertools.count()
        self.special_tokens = SpecialTokenGuard(target.tokenizer)
        # candidate sources of mode "glance": the drafter (its pass gated by the planner) and n-gram matches over
        # the request's own tokens and recent answers (SGLang's NgramCorpus; no model pass, proposed every round)
        self.draft_sources = check_draft_sources(draft_sources)
        self.ngram: NgramCandidates | None = None
        if "ngram" in self.draft_sources:
            if drafter is None:
                raise ValueError("draft source 'ngram' runs in mode 'glance', which needs a drafter")
            settings = ngram or NgramSettings(max_depth=self.block_size - 1)
            if ngram_corpus is not None:  # the cross-request corpus's scope: shared | per-key | off
                settings = dataclasses.replace(settings, scope=ngram_corpus)
            source = NgramSource(settings)
            if not source.available:
                raise ValueError(source.reason)
            self.ngram = NgramCandidates(source)

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

    # ------------------------------------------------------------------ planning
    def cost_model(self) -> CostModel:
        """The target / drafter pass costs on this device: cached per device + model, else measured now
        (about a second on a CPU), then refined by every round."""
        if self._costs is None:
            key = self._cost_key()
            self._costs = load_costs(key) or self._calibrate(key)
        return self._costs

    def planner(self, name: PlannerMode | None = None) -> Planner:
        """The engine's planner for ``name`` ("auto": cost-aware; "fixed": always the ``budget`` tree). Its
        acceptance statistics are shared by all requests; per-request state is dropped when a request ends."""
        name = name or self.planner_mode
        if name not in self._planners:
            if name not in PLANNER_MODES:
                raise RequestError(f"planner must be one of {PLANNER_MODES}, got {name!r}", "invalid_request",
                                   "planner")
            max_nodes = self.max_nodes if name == "auto" else self.budget
            self._planners[name] = Planner(self.cost_model(), max_nodes=max_nodes, max_depth=self.block_size - 1,
                                           mode=name, fixed_nodes=self.budget)
        return self._planners[name]

    def install_planner(self, name: str, planner: Planner) -> None:
        """Serve requests that ask for planner ``name`` with ``planner`` (an ablation or a test policy)."""
        self._planners[name] = planner

    def _cost_key(self) -> str:
        cfg = self.target.model.config.to_json_string(use_diff=False)
        params = sum(p.numel() for p in self.target.model.parameters())
        drafter = json.dumps(self.drafter.config.to_dict(), sort_keys=True) if self.drafter is not None else ""
        compiled = self.drafter is not None and self.drafter.block_compiled  # the drafter pass's price differs
        # the thread matters too: OpenMP regions run slower from a thread other than the main one once that has
        # run any (glance_server.embedded.EmbeddedBackend._pick_threads), so costs timed in one do not carry over
        main = threading.current_thread() is threading.main_thread()
        return cost_key("embedded", self.target.device, platform.machine(), platform.processor(),
                        torch.__version__, torch.get_num_threads(), main, self.target.model.dtype, cfg, params,
                        drafter, self.max_nodes, self.branch_k, *(["compiled"] if compiled else []))

    @torch.no_grad()
    def _calibrate(self, key: str) -> CostModel:
        """Time target passes over 1 .. max_nodes+1 rows and the drafter pass (+ top-k + tree) on a short
        text prompt, through the round's own adapters (``glance_sgl.round.calibrate_round``)."""
        assert self.drafter is not None
        prompt = self.target.prepare([{"role": "user", "content": "calibration " * 24}])
        taps = self.drafter.config.tap_layers
        state, rows = self.target.prefill(prompt, taps=taps)
        source = CachedDrafter.start(self.drafter, rows.taps, self.branch_k)
        batch = RoundBatch(["calibration"], prompt.input_ids[0, -1:].cpu(), torch.zeros(1, dtype=torch.long),
                           [SamplingSpec()])
        costs = calibrate_round(CachePass(self.target, state, taps), [source], batch,
                                default_row_grid(self.max_nodes + 1), self.max_nodes + 1, repeats=15, key=key,
                                smooth=True)
        save_costs(costs)
        return costs

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        messages: list[dict[str, Any]] | str | PreparedPrompt,
        params: SamplingParams | None = None,
        mode: Mode | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        planner: PlannerMode | None = None,
        draft_sources: Sequence[str] | None = None,
        ngram_key: str | None = None,
    ) -> GenerationResult:
        """Run one request to completion. ``messages``: chat messages (the chat template applies) or a string
        (a raw text prompt, tokenised as is) or a prompt from :meth:`prepare`. ``on_delta`` receives committed
        tokens as they land;
        ``should_stop`` is polled between rounds (True cancels: finish_reason "cancelled"). ``planner``
        ("auto" / "fixed") overrides the engine's default for mode "glance", and ``draft_sources`` (a subset of
        ``DRAFT_SOURCES``: "drafter", "ngram") its candidate sources; ``ngram_key``: the tenant whose
        cross-request n-gram corpus the request matches and feeds (scope ``per-key``; the gateway passes a hash of
        the API key; None: the anonymous tenant). Text holding a special-token string
        (``<|image_pad|>``, ``<|im_start|>``, ...) is refused (:class:`RequestError`, code
        ``special_token_in_text``)."""
        params, mode, sources = self._checked(params, mode, planner, draft_sources)
        with self._lock:  # one request at a time (fast tokenizers are not safe to share across threads either)
            rounds = self._start(messages, params, mode, planner, should_stop, sources, ngram_key)
            while True:
                try:
                    out, tokens = next(rounds)
                except StopIteration as done:
                    return done.value
                if on_delta is not None:
                    on_delta(out.delta(tokens))

    def _checked(self, params: SamplingParams | None, mode: Mode | None, planner: PlannerMode | None,
                 draft_sources: Sequence[str] | None) -> tuple[SamplingParams, Mode, tuple[str, ...]]:
        """A request's settings, validated (:class:`RequestError`): its params, mode and candidate sources."""
        params = params or SamplingParams()
        params.validate()
        mode = mode or self.mode
        if mode != "ar" and self.drafter is None:
            raise RequestError(f"mode {mode!r} needs a drafter; this engine has none")
        if mode not in ("glance", "chain", "ar"):
            raise RequestError(f"unknown decoding mode {mode!r}")
        sources = self.check_sources(draft_sources, mode)
        vocab = self.target.vocab_size
        for token in params.logit_bias or {}:
            if token >= vocab:
                raise RequestError(f"logit_bias key {token} is not a token id of this model (vocabulary {vocab})",
                                   param="logit_bias")
        if planner is not None and mode != "glance":
            raise RequestError(f"a planner applies to mode 'glance' only, not {mode!r}", param="planner")
        return params, mode, sources

    def _start(self, messages: list[dict[str, Any]] | str | PreparedPrompt, params: SamplingParams, mode: Mode,
               planner: PlannerMode | None, should_stop, sources: Sequence[str], ngram_key: str | None
               ) -> Iterator[tuple["_Output", list[int]]]:
        """The request's planner and prompt, then its decoding loop (:meth:`_run`); under the engine's lock."""
        plan = self.planner(planner) if mode == "glance" else None
        t0 = time.perf_counter()
        prompt = messages if isinstance(messages, PreparedPrompt) else self.prepare(messages)
        prepare_ms = (time.perf_counter() - t0) * 1000.0
        return self._run(prompt, prepare_ms, params, mode, plan, should_stop, sources, ngram_key)

    @staticmethod
    def freeze_gc() -> int:
        """Once the engine is loaded, for a process that serves or measures it: the objects alive now (torch,
        transformers, the weights' modules: about 450,000 on the demo pair) leave the garbage collector's view, as
        SGLang's ``Engine.freeze_gc`` and its HTTP server after its warm-up do. A full collection otherwise walks
        them all whenever it runs: 0.2-0.3 s of one request's time on 2 cores. Garbage is collected first, so none
        is frozen. Returns how many objects are frozen now."""
        gc.collect()
        gc.freeze()
        return gc.get_freeze_count()

    def check_fits(self, prompt: PreparedPrompt, params: SamplingParams) -> None:
        """Refuses (``context_length_exceeded``) a prompt whose tokens plus ``max_tokens`` and a tree do not fit
        the target's context."""
        if prompt.num_tokens + params.max_tokens + self.budget + 1 > self.target.context_length:
            raise RequestError(
                f"prompt ({prompt.num_tokens} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"length ({self.target.context_length})", code="context_length_exceeded", param="messages",
            )

    def prepare(self, messages: list[dict[str, Any]] | str, processor: Any = None) -> PreparedPrompt:
        """Model inputs of a request (chat messages or a raw prompt string), special-token strings refused.
        ``processor``: a copy of the target's processor, to prepare in another thread than the engine's
        (processors and fast tokenizers are not safe to share across threads); None uses the target's own and
        must run under the engine's lock, as :meth:`generate` does."""
        if (hit := self.special_tokens.check_messages(messages)) is not None:
            raise RequestError(special_token_message(*hit), "special_token_in_text", hit[0])
        if isinstance(messages, str):
            return self._prepare_text(messages, processor)
        return self.target.prepare(messages, processor)

    def _prepare_text(self, text: str, processor: Any = None) -> PreparedPrompt:
        """A raw text prompt (no chat template, no images) -> model inputs: input_ids [1, P] and the rest."""
        if not text:
            raise RequestError("the prompt is empty", "invalid_value", "prompt")
        inputs = (processor or self.target.processor)(text=[text], return_tensors="pt")
        return PreparedPrompt(inputs={k: v.to(self.target.device) for k, v in inputs.items()
                                      if isinstance(v, torch.Tensor)}, num_images=0)

    def stream(self, messages: list[dict[str, Any]] | str, params: SamplingParams | None = None,
               mode: Mode | None = None, planner: PlannerMode | None = None,
               draft_sources: Sequence[str] | None = None,
               ngram_key: str | None = None) -> Iterator[StreamDelta | GenerationResult]:
        """Yield :class:`StreamDelta` items as tokens commit, then the final :class:`GenerationResult`.
        Closing the iterator early ends the request. The model runs in the caller's thread, between the items: a
        thread of its own would run it far slower on a few cores once the main thread has run OpenMP work (see
        ``glance_server.embedded.EmbeddedBackend._pick_threads``). The engine's lock is held until the last item
        or the close."""
        params, mode, sources = self._checked(params, mode, planner, draft_sources)
        with self._lock:
            rounds = self._start(messages, params, mode, planner, None, sources, ngram_key)
            try:
                while True:
                    try:
                        out, tokens = next(rounds)
                    except StopIteration as done:
                        yield done.value
                        return
                    yield out.delta(tokens)
            finally:
                rounds.close()  # an early close ends the loop: its request is forgotten, its answer published

    # ------------------------------------------------------------------ the loop
    def check_sources(self, names: Sequence[str] | None, mode: Mode) -> tuple[str, ...]:
        """The candidate sources of a request: ``names`` (None: the engine's), for mode "glance" only
        (:class:`RequestError`, param ``draft_sources``, otherwise or for a source this engine lacks)."""
        if names is None:
            return self.draft_sources if mode == "glance" else ("drafter",)
        try:
            names = check_draft_sources(names)
        except ValueError as exc:
            raise RequestError(str(exc), param="draft_sources") from None
        if mode != "glance" and names != ("drafter",):
            raise RequestError(f"draft sources apply to mode 'glance' only, not {mode!r}", param="draft_sources")
        if "ngram" in names and self.ngram is None:
            raise RequestError("this engine has no n-gram source (start it with draft source 'ngram')",
                               param="draft_sources")
        return names

    def _run(self, prompt: PreparedPrompt, prepare_ms: float, params: SamplingParams, mode: Mode,
             planner: Planner | None, should_stop, sources: Sequence[str] = ("drafter",),
             ngram_key: str | None = None) -> Iterator[tuple["_Output", list[int]]]:
        """The decoding loop, as a generator: it yields ``(output, tokens)`` as tokens commit (the caller makes a
        delta of them where it wants one: ``output.delta(tokens)``) and returns the :class:`GenerationResult`.
        ``prefill_ms`` counts the prompt's preparation (``prepare_ms``) and the prefill."""
        spec = SamplingSpec(params.temperature, params.top_p,
                            params.seed if params.seed is not None else random.getrandbits(62),
                            top_k=params.top_k, min_p=params.min_p)
        metrics = RequestMetrics(mode=mode, block_size=self.block_size if mode != "ar" else 1)
        metrics.planner = planner.mode if planner is not None else None
        metrics.draft_sources = tuple(sources) if mode != "ar" else ()
        out = _Output(self.target.tokenizer, self.eos_ids, params)
        rules = self._logit_rules(params)

        t0 = time.perf_counter()
        metrics.prompt_tokens = prompt.num_tokens
        self.check_fits(prompt, params)
        rid = next(self._rids)
        ngram = "ngram" in sources and mode != "ar"
        if ngram:  # the prompt goes in now where the first round will look (SGLang's insert thread stores it while
            # the prefill runs), else before the request's first lookup, if any
            assert self.ngram is not None
            self.ngram.set_key(rid, ngram_key)  # scope per-key: the tenant's corpus
            self.ngram.start(rid, prompt.input_ids[0].tolist(), planner is None or planner.looks_first())
        policy = None if mode == "ar" else planner if planner is not None else AlwaysDraft(self.block_size - 1)
        # the drafter's context is kept from the prompt on, unless the planner retires the request at birth (where
        # the drafter idles: its prompt's tap features are neither captured nor projected)
        keeps = policy is not None and policy.admit(rid)
        try:
            state, rows = self.target.prefill(prompt, taps=self._taps(mode) if keeps else None)
        except BaseException:
            if ngram:
                self.ngram.finish(rid, publish=False)
            if policy is not None:
                policy.forget(rid)
            raise
        first = int(self._choices(rows.logits[-1:], torch.zeros(1, dtype=torch.long), 0, spec, rules)[0])
        request = None
        if policy is not None:
            weight = self.drafter.fc.weight
            context = rows.taps if keeps else weight.new_zeros(0, weight.shape[1])
            request = SpeculativeRequest(rid, policy,
                                         CachedDrafter.start(self.drafter, context, self.branch_k, mode == "chain"),
                                         CachePass(self.target, state, self._taps(mode), rules))
            policy.begin(request.rid, entropy_nats(rows.logits[-1]))
            if ngram:
                self.ngram.acceptance = policy.acceptance  # the planner learns per source and depth
                self.ngram.source.commit(rid, [first])
                request.history = prompt.input_ids[0].tolist() + [first]
                request.sources = ([request.drafter] if "drafter" in sources else []) + [self.ngram]
        k = params.logprobs
        out.add([first], token_logprobs(rows.logits[-1:], [first], k) if k is not None else None)
        metrics.prefill_ms = prepare_ms + (time.perf_counter() - t0) * 1000.0
        try:  # from here on the request is the planner's and the n-gram source's: whatever ends it, they forget it
            yield out, [first]
            t1 = time.perf_counter()
            while out.finish_reason is None:
                if should_stop is not None and should_stop():
                    out.finish_reason = "cancelled"
                    break
                if request is None:
                    token, ar_rows = self._ar_pass(state, out.token_ids, spec, rules)
                    new_tokens = [token]
                    kept = out.add(new_tokens, token_logprobs(ar_rows.logits, new_tokens, k) if k is not None
                                   else None)
                    metrics.record_round(drafted=0, accepted=0, committed=kept, root_entropy=None)
                else:
                    new_tokens, rec = self.speculative_round(request, out.token_ids, spec, logprobs=k is not None,
                                                             room=params.max_tokens - len(out.token_ids))
                    kept = out.add(new_tokens, token_logprobs(rec.choice_logits, new_tokens, k) if k is not None
                                   else None)
                    if request.history is not None:
                        request.history += new_tokens[:kept]
                    metrics.record_round(drafted=rec.nodes, accepted=rec.accepted, committed=kept,
                                         root_entropy=rec.root_entropy, predicted=rec.predicted,
                                         drafter_ran=rec.drafter_ran, parts=rec.parts)
                    if rec.sources is not None:
                        metrics.record_sources(rec.sources)
                yield out, new_tokens[:kept]
        finally:
            if request is not None:
                request.policy.forget(request.rid)
                if request.history is not None and self.ngram is not None:
                    self.ngram.finish(request.rid)  # its answer stays in the cross-request corpus
        metrics.decode_ms = (time.perf_counter() - t1) * 1000.0
        metrics.completion_tokens = len(out.token_ids)
        return GenerationResult(text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
                                metrics=metrics, logprobs=out.logprobs)

    def _taps(self, mode: Mode) -> list[int] | None:
        return self.drafter.config.tap_layers if mode != "ar" and self.drafter is not None else None

    def _choices(self, logits: torch.Tensor, depths: torch.Tensor, next_index: int, spec: SamplingSpec,
                 rules: LogitRules | None = None) -> torch.Tensor:
        """Target choices for rows ``logits`` [R, V] at ``depths`` [R]; output index of depth 0 is next_index. The
        request's ``rules`` are applied to ``logits`` first, in place."""
        if rules is not None:
            rules.apply(logits[None], depths[None], torch.tensor([next_index]))
        return target_choices(logits[None], depths[None], torch.tensor([next_index]), [spec])[0]

    def _logit_rules(self, params: SamplingParams) -> LogitRules | None:
        """``params``' logit bias and minimum length as the rules of a batch of one (None: neither)."""
        bias = None
        if params.logit_bias:
            bias = torch.zeros(1, self.target.vocab_size)
            for token, value in params.logit_bias.items():
                bias[0, token] = float(value)
        early = {0: (params.min_tokens, torch.tensor(sorted(self.eos_ids), dtype=torch.long))} \
            if params.min_tokens > 0 and self.eos_ids else {}
        return LogitRules(bias, early) if bias is not None or early else None

    def speculative_round(self, request: SpeculativeRequest, committed: list[int], spec: SamplingSpec,
                          logprobs: bool = False, room: int | None = None) -> tuple[list[int], RoundRecord]:
        """One round of ``glance_sgl.round`` for this request (a batch of one): the planner decides whether to
        draft and how big a tree to verify, one target pass verifies it, the accepted KV stays and the drafter
        is fed (deferred: a round without drafting is an AR step whose tap features wait for the next drafter
        pass). ``room``: the tokens the request may still commit (None: no limit); no candidate goes past it or
        past an EOS token. Returns (tokens to commit, what the round did; its ``choice_logits`` only with
        ``logprobs``)."""
        next_index = torch.tensor([len(committed)])
        request.target.next_index = next_index  # where the request's logit rules count from
        batch = RoundBatch([request.rid], torch.tensor([committed[-1]]), next_index, [spec],
                           None if request.history is None else [request.history],
                           stops=[self._stops], room=None if room is None else [room])
        r = speculative_round(batch, request.policy, request.sources or [request.drafter], request.target,
                              max_depth=self.block_size - 1)
        accepted = r.report.accepted[0]
        logits = r.out.logits[0]
        # a drafting round's root entropy (metrics, the entropy law); an AR round's root is the next lead, which
        # the planner computed where a gate reads it
        root_entropy = entropy_nats(logits[0]) if r.tree.num_rows > 1 else request.policy.lead_entropy(request.rid)
        predicted = r.plan.expected_tokens[0] if r.plan.expected_tokens else None
        record = RoundRecord(r.tree.num_nodes, accepted, root_entropy, predicted, r.drafted,
                             choice_logits=logits[r.walk.accepted_rows[0, : accepted + 1].to(logits.device)]
                             if logprobs else None,
                             sources=source_counts(r.tree, r.walk)[0], parts=r.phases)
        return r.walk.committed()[0], record

    def _ar_pass(self, state: TargetState, committed: list[int], spec: SamplingSpec,
                 rules: LogitRules | None = None) -> tuple[int, RowsOutput]:
        """The last committed token through the target: the next token and the row (the AR baseline; the
        request's ``rules`` applied to the row's logits)."""
        zero = torch.zeros(1, dtype=torch.long)
        rows = self.target.forward_rows(state, torch.tensor([committed[-1]]), zero,
                                        torch.ones(1, 1, dtype=torch.bool))
        rows.logits = rows.logits.cpu()  # the rules apply in place: the row's logprobs read what was chosen from
        return int(self._choices(rows.logits, zero, len(committed), spec, rules)[0]), rows


def default_max_nodes(budget: int, block_size: int, branch_k: int) -> int:
    """The largest tree the "auto" planner may verify: twice the fixed budget (at least 31 nodes, at most 63),
    within the candidate tree of the block."""
    if budget <= 0:
        return 0
    cap = max_tree_size(block_size - 1, branch_k)
    return max(budget, min(max(2 * budget + 1, 31), 63, cap))


__all__ = ["GlanceEngine", "SamplingParams", "GenerationResult", "StreamDelta", "RequestError", "TargetError",
           "TokenLogprob", "token_logprobs"]
