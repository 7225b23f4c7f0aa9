"""The OpenAI-compatible request schema, its translation to engine requests, and the response bodies.

The ``glance`` object (one schema for every backend)::

    backend, mode             "embedded" | "sglang"; "glance" | "chain" | "ar"
    completion_tokens         = usage.completion_tokens
    prefill_tokens            1: the first token comes from the prefill pass and belongs to no round
    decode_tokens             completion_tokens - prefill_tokens = sum(committed_per_round)
    rounds                    verification rounds (AR: one per token)
    committed_per_round       tokens committed by each round (accepted drafts + bonus), or null if unknown
    tau                       decode_tokens / rounds: tokens per round INCLUDING the bonus (null if no round)
    predicted_tokens_per_round  mean tokens per round the planner expected to commit (compare with tau; null
                              without a planner: chain, ar, or an upstream that does not report it)
    tau_minus_1               tau - 1 (accepted drafts per round, the bonus excluded)
    planner                   "auto" (cost-aware tree size per round, may skip drafting) | "fixed" (the budget
                              tree every round) | null (chain, ar, or unknown upstream)
    rows_histogram            rows verified per round (root included; "1" = a round without a tree) -> rounds,
                              e.g. {"1": 3, "16": 9}; null if unknown
    rounds_without_drafting   rounds that ran no drafter pass (AR: every round); null if unknown
    drafted_tokens, accepted_tokens, acceptance_rate, acceptance_histogram (hist[a] = rounds accepting a drafts)
    prefill_ms, decode_ms, decode_ms_per_token, decode_tokens_per_s, mean_root_entropy, queue_ms
    estimated_ar_ms_per_token AR decode ms/token calibrated on this engine (null if unknown)
    estimated_speedup         estimated_ar_ms_per_token / decode_ms_per_token
    measured                  with "glance": {"measure_speedup": true}: the same request decoded
                              autoregressively right after: ar_* timings, decode_speedup (AR ms/token over
                              speculative ms/token, both after prefill), e2e_speedup, lossless_match
    draft_sources             the candidate sources the request drew on, e.g. ["drafter", "ngram"] ([] for mode
                              ar); null on the sglang backend (the server's GLANCE_DRAFT_SOURCES, not reported)
    sources                   per source, {"drafter" | "ngram" | "both": {"rounds", "accepted_tokens"}}: the
                              rounds whose verified tree held nodes of that source, and the drafts accepted from
                              them, by each node's source tag ("both": a node the drafter and the n-gram source
                              both proposed; "drafter" / "ngram": that source alone). Null on the sglang backend:
                              SGLang's meta_info has no per-source counts (only spec_verify_ct,
                              spec_accept_length and the accepted-drafts histogram, which the fields above carry)

So ``completion_tokens == prefill_tokens + sum(committed_per_round)``, ``tau == decode_tokens / rounds``,
``sum(rows_histogram.values()) == rounds`` and, where ``sources`` is reported, the three sources'
``accepted_tokens`` add up to ``accepted_tokens``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from glance_sgl.engine import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams, offset_seed
from glance_sgl.round import check_draft_sources

from .config import ServerConfig
from .errors import APIError, bad_request
from .images import load_image_url
from .jobs import GenOutput, GenRequest

Mode = Literal["glance", "chain", "ar"]
Planner = Literal["auto", "fixed"]
PLANNERS = ("auto", "fixed")


# ------------------------------------------------------------------------------------------------ schema
class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class GlanceOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    measure_speedup: StrictBool = False
    mode: Mode | None = None
    planner: Planner | None = None
    stream_rounds: StrictBool = False  # stream: a glance_round object on every content chunk (app.RoundChunks)
    draft_sources: list[StrictStr] | StrictStr | None = None  # "drafter,ngram" or ["drafter", "ngram"]; glance only
    debug_fault: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[Any] | None = None


class _GenerationBody(BaseModel):
    """The fields chat and legacy completions requests share (numbers strict, as OpenAI's: a string or a boolean
    where a number goes is refused, not read as one)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, Any] | None = None
    # the sampling extras of vLLM's and SGLang's OpenAI servers: top_k / min_p / min_tokens act as theirs do,
    # repetition_penalty is refused (never ignored)
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt | None = None
    glance: GlanceOptions | None = None


class ChatRequest(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None


class CompletionRequest(_GenerationBody):
    """OpenAI's legacy ``POST /v1/completions``: one raw text prompt (no chat template), text only."""

    prompt: str | list[Any]
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: str | None = None


# ------------------------------------------------------------------------------------------------ parsing
def check_text(text: str, where: str) -> None:
    """Text must be valid Unicode (a lone surrogate such as ``\\ud800`` from a JSON escape is not): 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{where} is not valid Unicode text: lone surrogate {text[exc.start]!r} at character "
                          f"{exc.start}", "invalid_unicode", where) from exc

def check_model(model: str | None, config: ServerConfig) -> None:
    if model is not None and model != config.served_model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {config.served_model_name!r}",
                       "model_not_found", "model")


def sampling_params(config: ServerConfig, max_tokens: int | None, temperature: float | None, top_p: float | None,
                    stop: str | list[str] | None, seed: int | None, param: str = "max_tokens",
                    logprobs: int | None = None, top_k: int | None = None, min_p: float | None = None,
                    logit_bias: dict[str, Any] | None = None, min_tokens: int | None = None) -> SamplingParams:
    """Validated sampling parameters (OpenAI ranges; the server's token limit). ``logprobs``: None or the
    number of top alternatives (0..20) per token; ``logit_bias``: OpenAI's (token id strings -> -100..100);
    ``top_k`` (-1 or 0: no limit), ``min_p`` and ``min_tokens`` as vLLM's and SGLang's servers take them."""
    if max_tokens is None:
        max_tokens = config.default_max_tokens
    if max_tokens < 1:
        raise bad_request(f"{param} must be at least 1, got {max_tokens}", "invalid_value", param)
    if max_tokens > config.max_tokens_limit:
        raise bad_request(f"{param} is {max_tokens}; this server allows at most {config.max_tokens_limit}",
                          "invalid_value", param)
    temperature = 1.0 if temperature is None else float(temperature)
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"temperature must be between 0 and 2, got {temperature}", "invalid_value", "temperature")
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "invalid_value", "top_p")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise bad_request(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", "invalid_value", "stop")
    for k, s in enumerate(stops):
        check_text(s, f"stop[{k}]")
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise bad_request(f"seed must be a 64-bit integer in [-2**63, 2**63 - 1], got {seed}", "invalid_value", "seed")
    if top_k is not None and top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (no limit) or at least 1, got {top_k}", "invalid_value", "top_k")
    min_p = 0.0 if min_p is None else float(min_p)
    if not 0.0 <= min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {min_p}", "invalid_value", "min_p")
    if min_tokens is not None and not 0 <= min_tokens <= max_tokens:
        raise bad_request(f"min_tokens must be in [0, {param}], got {min_tokens}", "invalid_value", "min_tokens")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stops, seed=seed,
                          logprobs=logprobs, top_k=max(top_k or 0, 0), min_p=min_p,
                          logit_bias=parse_logit_bias(logit_bias), min_tokens=min_tokens or 0)


def parse_logit_bias(raw: dict[str, Any] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token id strings -> numbers in [-100, 100]) as token ids -> floats; 400 where a key
    is not a token id or a value is out of range (a key beyond the vocabulary: the engine's 400)."""
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "invalid_value", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= float(value) <= 100.0:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key}",
                              "invalid_value", "logit_bias")
        out[int(key)] = float(value)
    return out


def chat_logprobs(body: ChatRequest) -> int | None:
    """The chat request's ``logprobs`` / ``top_logprobs`` -> None (off) or the top count; 400 like OpenAI for
    ``top_logprobs`` without ``logprobs`` or out of 0..20."""
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "invalid_value", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {body.top_logprobs}",
                              "invalid_value", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


JSON_OBJECT_SCHEMA = '{"type": "object"}'


def check_response_format(response_format: dict[str, Any] | None) -> str | None:
    """The JSON schema a ``response_format`` asks for (a JSON string), or None for free text (``text``, the
    default). ``json_object`` is the schema ``{"type": "object"}``; ``json_schema`` needs ``json_schema.schema``
    (an object). The SGLang backend decodes under it with SGLang's grammar backend (GLANCE's verify masks every
    tree row by the grammar, so the output is constrained AR's); the embedded engine refuses it (400
    ``unsupported_parameter``, at submit)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                              "invalid_value", "response_format.json_schema.schema")
        return json.dumps(schema)
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "invalid_value", "response_format.type")


# Fields of OpenAI's, vLLM's or SGLang's request bodies that would change the answer, with the values that do not:
# a body carrying another value is refused (other unknown fields, such as ``user`` or ``metadata``, are accepted)
OUTPUT_EXTRAS: dict[str, tuple[Any, ...]] = {
    "ignore_eos": (None, False), "stop_token_ids": (None, []), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "regex": (None,), "ebnf": (None,), "json_schema": (None,), "structural_tag": (None,),
    "functions": (None, []), "function_call": (None, "none"), "tool_choice": (None, "none", "auto"),
    "prediction": (None,), "min_new_tokens": (None, 0), "custom_logit_processor": (None,),
    "modalities": (None, ["text"]), "audio": (None,),  # OpenAI's audio output
}


MAX_CHOICES = 8  # ``n``: the most choices one request may ask for
MAX_BATCH = 16  # legacy completions: the most choices (prompts x n) one request may ask for


def reject_unsupported(body: ChatRequest | CompletionRequest) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise bad_request(f"n must be between 1 and {MAX_CHOICES} on this server, got {body.n}", "invalid_value",
                          "n")
    if getattr(body, "tools", None):
        raise bad_request("tools are not supported", "unsupported_parameter", "tools")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise bad_request(f"{name} is not supported (only 0)", "unsupported_parameter", name)
    if body.repetition_penalty is not None and body.repetition_penalty != 1.0:
        raise bad_request("repetition_penalty is not supported (only 1)", "unsupported_parameter", "repetition_penalty")
    extra = body.model_extra or {}
    for name, neutral in OUTPUT_EXTRAS.items():  # other servers' fields that would change the answer
        if name in extra and extra[name] not in neutral:
            raise bad_request(f"{name} is not supported by this server", "unsupported_parameter", name)


async def convert_messages(messages: list[ChatMessage], config: ServerConfig,
                           client: httpx.AsyncClient) -> list[dict[str, Any]]:
    """OpenAI messages -> engine messages; images decoded (after the count check) into PIL images."""
    if not messages:
        raise bad_request("messages must be a non-empty list", "invalid_value", "messages")
    n_images = sum(1 for m in messages if isinstance(m.content, list) for p in m.content
                   if isinstance(p, dict) and p.get("type") == "image_url")
    if n_images > config.max_images:
        raise bad_request(f"{n_images} images in the request; this server allows at most {config.max_images}",
                          "too_many_images", "messages")
    out: list[dict[str, Any]] = []
    chars = 0
    for i, msg in enumerate(messages):
        role = "system" if msg.role == "developer" else msg.role
        if role not in ("system", "user", "assistant"):
            raise bad_request(f"messages[{i}].role {msg.role!r} is not supported (system, user, assistant)",
                              "invalid_value", f"messages[{i}].role")
        if msg.content is None:
            raise bad_request(f"messages[{i}].content is missing", "invalid_value", f"messages[{i}].content")
        if isinstance(msg.content, str):
            check_text(msg.content, f"messages[{i}].content")
            chars += len(msg.content)
            out.append({"role": role, "content": msg.content})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                check_text(part["text"], f"{where}.text")
                chars += len(part["text"])
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                if role != "user":
                    raise bad_request(f"{where}: images are only allowed in user messages", "invalid_value", where)
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                parts.append({"type": "image", "image": await load_image_url(url, config, client, where)})
            elif kind == "text":
                raise bad_request(f"{where}: a text part needs a string 'text'", "invalid_value", where)
            else:
                raise bad_request(f"{where}: unsupported content part type {kind!r} (text, image_url)",
                                  "unsupported_content_part", f"{where}.type")
        out.append({"role": role, "content": parts})
    if chars > config.max_prompt_chars:
        raise bad_request(f"the prompt has {chars} characters; the limit is {config.max_prompt_chars}",
                          "context_length_exceeded", "messages")
    return out


async def chat_request(body: ChatRequest, config: ServerConfig, client: httpx.AsyncClient) -> GenRequest:
    check_model(body.model, config)
    reject_unsupported(body)
    json_schema = check_response_format(body.response_format)
    logprobs = chat_logprobs(body)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = sampling_params(config, limit, body.temperature, body.top_p, body.stop, body.seed, param, logprobs,
                             body.top_k, body.min_p, body.logit_bias, body.min_tokens)
    options = glance_options(body.glance, config)
    messages = await convert_messages(body.messages, config, client)
    return GenRequest(messages=messages, params=params, mode=options.mode, planner=options.planner,
                      measure_speedup=options.measure_speedup, debug_fault=options.debug_fault,
                      json_schema=json_schema, draft_sources=parse_draft_sources(options.draft_sources))


def glance_options(options: GlanceOptions | None, config: ServerConfig) -> GlanceOptions:
    options = options or GlanceOptions()
    if options.debug_fault and not config.debug_faults:
        raise bad_request("debug_fault needs a server started with --debug-faults", "unsupported_parameter",
                          "glance.debug_fault")
    return options


def completion_requests(body: CompletionRequest, config: ServerConfig) -> list[GenRequest]:
    """A legacy completions request -> one raw-prompt GenRequest per prompt (same limits as chat; a list of
    strings is a batch: at most :data:`MAX_BATCH` choices in all, ``n`` per prompt)."""
    check_model(body.model, config)
    reject_unsupported(body)
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request(f"best_of must equal n on this server (got best_of {body.best_of}, n {body.n or 1}): "
                          "ranking more candidates than it returns is not supported", "unsupported_parameter",
                          "best_of")
    if body.echo:
        raise bad_request("echo is not supported", "unsupported_parameter", "echo")
    if body.suffix:
        raise bad_request("suffix is not supported", "unsupported_parameter", "suffix")
    prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise bad_request("prompt must be a string or a list of strings; token-id prompts are not supported",
                          "unsupported_parameter", "prompt")
    if len(prompts) * (body.n or 1) > MAX_BATCH:
        raise bad_request(f"{len(prompts)} prompts x n {body.n or 1} choices; this server answers at most "
                          f"{MAX_BATCH} choices a request", "invalid_value", "prompt")
    for k, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
        if not prompt:
            raise bad_request(f"{where} must be a non-empty string", "invalid_value", where)
        check_text(prompt, where)
        if len(prompt) > config.max_prompt_chars:
            raise bad_request(f"{where} has {len(prompt)} characters; the limit is {config.max_prompt_chars}",
                              "context_length_exceeded", where)
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {body.logprobs}",
                          "invalid_value", "logprobs")
    params = sampling_params(config, body.max_tokens, body.temperature, body.top_p, body.stop, body.seed,
                             logprobs=body.logprobs, top_k=body.top_k, min_p=body.min_p, logit_bias=body.logit_bias,
                             min_tokens=body.min_tokens)
    options = glance_options(body.glance, config)
    sources = parse_draft_sources(options.draft_sources)
    return [GenRequest(messages=[], prompt=prompt, params=params, mode=options.mode, planner=options.planner,
                       measure_speedup=options.measure_speedup, debug_fault=options.debug_fault,
                       draft_sources=sources) for prompt in prompts]


def check_planner(planner: str | None, mode: str, param: str = "glance.planner") -> None:
    """A per-request planner must be known and go with GLANCE tree decoding (400 otherwise)."""
    if planner is None:
        return
    if planner not in PLANNERS:
        raise bad_request(f"planner must be auto or fixed, got {planner!r}", "invalid_value", param)
    if mode != "glance":
        raise bad_request(f"planner {planner!r} applies to mode 'glance' (tree decoding), not to mode {mode!r}",
                          "invalid_value", param)


def parse_draft_sources(value: str | list[str] | None, param: str = "glance.draft_sources"
                        ) -> tuple[str, ...] | None:
    """A request's candidate sources (a comma-separated string or a list of names) -> their canonical tuple
    (``glance_sgl.round.check_draft_sources``), None when not given; 400 ``invalid_value`` naming ``param`` on
    an unknown name or none. Whether they fit the request's mode and this server is the backend's check."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else list(value)
    try:
        return check_draft_sources([n for n in names if n] if isinstance(value, str) else names)
    except ValueError as exc:
        raise bad_request(str(exc), "invalid_value", param) from None


# ------------------------------------------------------------------------------------------------ metrics
def glance_object(*, backend: str, mode: str, completion_tokens: int, rounds: int,
                  committed_per_round: list[int] | None, drafted_tokens: int, accepted_tokens: int,
                  acceptance_histogram: list[int], prefill_ms: float, decode_ms: float,
                  mean_root_entropy: float | None, estimated_ar_ms_per_token: float | None, queue_ms: float,
                  measured: dict[str, Any] | None = None, planner: str | None = None,
                  rows_histogram: dict[str, int] | None = None, rounds_without_drafting: int | None = None,
                  predicted_tokens_per_round: float | None = None, draft_sources: list[str] | None = None,
                  sources: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """The per-request ``glance`` object (schema in the module docstring)."""
    prefill_tokens = 1 if completion_tokens > 0 else 0
    decode_tokens = completion_tokens - prefill_tokens
    if committed_per_round is not None and sum(committed_per_round) != decode_tokens:
        raise ValueError(f"inconsistent metrics: {decode_tokens} decode tokens, rounds committed "
                         f"{sum(committed_per_round)}")
    if rows_histogram is not None and sum(rows_histogram.values()) != rounds:
        raise ValueError(f"inconsistent metrics: {rounds} rounds, rows histogram counts "
                         f"{sum(rows_histogram.values())}")
    if sources is not None and sum(v["accepted_tokens"] for v in sources.values()) != accepted_tokens:
        raise ValueError(f"inconsistent metrics: {accepted_tokens} accepted tokens, the sources count "
                         f"{sum(v['accepted_tokens'] for v in sources.values())}")
    tau = decode_tokens / rounds if rounds else None
    ms_per_token = decode_ms / decode_tokens if decode_tokens else None
    speedup = (estimated_ar_ms_per_token / ms_per_token
               if estimated_ar_ms_per_token and ms_per_token else None)
    return {
        "backend": backend,
        "mode": mode,
        "completion_tokens": completion_tokens,
        "prefill_tokens": prefill_tokens,
        "decode_tokens": decode_tokens,
        "rounds": rounds,
        "committed_per_round": committed_per_round,
        "tau": tau,
        "predicted_tokens_per_round": predicted_tokens_per_round,
        "tau_minus_1": tau - 1.0 if tau is not None else None,
        "planner": planner,
        "rows_histogram": rows_histogram,
        "rounds_without_drafting": rounds_without_drafting,
        "drafted_tokens": drafted_tokens,
        "accepted_tokens": accepted_tokens,
        "acceptance_rate": accepted_tokens / drafted_tokens if drafted_tokens else None,
        "acceptance_histogram": acceptance_histogram,
        "prefill_ms": prefill_ms,
        "decode_ms": decode_ms,
        "decode_ms_per_token": ms_per_token,
        "decode_tokens_per_s": decode_tokens / (decode_ms / 1000.0) if decode_ms > 0 and decode_tokens else None,
        "mean_root_entropy": mean_root_entropy,
        "queue_ms": queue_ms,
        "estimated_ar_ms_per_token": estimated_ar_ms_per_token,
        "estimated_speedup": speedup,
        "measured": measured,
        "draft_sources": draft_sources,
        "sources": sources,
    }


def choice_requests(req: GenRequest, n: int) -> list[GenRequest]:
    """The engine requests behind a request's ``n`` choices (OpenAI's ``n``). Greedy: one request, whose answer
    is every choice's (they would all be the same). Sampled: one request per choice, choice ``i`` seeded ``seed +
    i`` (wrapped to 64 bits past ``2**63 - 1``: :func:`glance_sgl.engine.offset_seed`; the same answer as a request
    with ``n`` 1 and that seed), or each drawing its own seed where the request has none. The copies share the first
    one's prepared inputs; each has its own request id (``<id>-<i>``)."""
    if n <= 1 or req.params.temperature == 0.0:
        return [req]
    out = [req]
    for i in range(1, n):
        seed = None if req.params.seed is None else offset_seed(req.params.seed, i)
        out.append(dataclasses.replace(req, params=dataclasses.replace(req.params, seed=seed),
                                       request_id=f"{req.request_id}-{i}"))
    return out


# ------------------------------------------------------------------------------------------------ bodies
def usage(outs: GenOutput | list[GenOutput], per_prompt: int | None = None) -> dict[str, int]:
    """OpenAI's usage of one answer, or of a request's choices (every choice's tokens; each prompt counted once:
    ``per_prompt`` choices each, in prompt order; None: all of one prompt)."""
    outs = outs if isinstance(outs, list) else [outs]
    step = per_prompt or len(outs)
    prompt = sum(out.prompt_tokens for out in outs[::step])
    completion = sum(out.completion_tokens for out in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(rid: str, model: str, outs: list[GenOutput], logprobs: list[dict[str, Any] | None]
                    ) -> dict[str, Any]:
    """A chat.completion of ``outs`` (choice i: ``outs[i]`` and its ``logprobs[i]``, ``{"content": [...]}`` (see
    :mod:`logprobs`) or None). ``glance``: the first choice's metrics; with several choices each also carries its
    own."""
    choices = [{"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                "finish_reason": out.finish_reason} for i, (out, lp) in enumerate(zip(outs, logprobs))]
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": _with_glance(choices, outs),
        "usage": usage(outs),
        "glance": outs[0].glance,
    }


def _with_glance(choices: list[dict[str, Any]], outs: list[GenOutput]) -> list[dict[str, Any]]:
    """Several choices: each with its own ``glance`` object (one choice: the body's ``glance`` is its)."""
    if len(choices) > 1:
        for choice, out in zip(choices, outs):
            choice["glance"] = out.glance
    return choices


def chunk_body(rid: str, model: str, created: int, delta: dict[str, Any] | None,
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None, index: int = 0,
               **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None, "choices": choices, **extra}


def text_completion_body(rid: str, model: str, outs: list[GenOutput], logprobs: list[dict[str, Any] | None],
                         per_prompt: int | None = None) -> dict[str, Any]:
    """A legacy ``text_completion`` of ``outs`` (``per_prompt`` choices of each prompt, in prompt order: choice
    ``k * per_prompt + i`` is prompt k's i-th); ``logprobs[i]`` in the legacy format or None (``glance`` as in
    :func:`completion_body`)."""
    choices = [{"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
               for i, (out, lp) in enumerate(zip(outs, logprobs))]
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": _with_glance(choices, outs),
        "usage": usage(outs, per_prompt),
        "glance": outs[0].glance,
    }


def text_chunk_body(rid: str, model: str, created: int, text: str | None, finish_reason: str | None = None,
                    logprobs: dict[str, Any] | None = None, index: int = 0, **extra: Any) -> dict[str, Any]:
    """One streamed ``text_completion`` object (``text`` None: the usage chunk, no choices)."""
    choices = [] if text is None else [{"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish_reason}]
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None, "choices": choices, **extra}
