"""SGLang's native ``POST /generate`` format, both ways.

- :class:`SGLangBackend` (the ``sglang`` backend) renders chat messages with the model's chat template, sends
  them to an SGLang server's ``/generate`` (images as base64 PNG data URLs, streamed SSE, pooled httpx client)
  and maps SGLang's speculative ``meta_info`` (``spec_verify_ct``, ``spec_num_correct_drafts``,
  ``spec_num_proposed_drafts``, ``spec_correct_drafts_histogram``, ...) onto the gateway's ``glance`` object.
- :func:`parse_prompt` / :func:`meta_info` let the gateway ANSWER that format from the embedded engine, so that
  the upstream client is exercised against a real server on loopback (``/generate`` route in ``app.py``).

Conventions: SGLang's ``spec_accept_length`` is ``completion_tokens / spec_verify_ct`` (the prefill token
counted); the gateway's ``tau`` is ``(completion_tokens - 1) / spec_verify_ct``. SGLang streams cumulative
``text`` / ``output_ids`` by default; both cumulative and incremental streams are understood.
Timings through this backend are observed at the gateway: ``prefill_ms`` = time to the first token (queue and
network included), ``decode_ms`` = first to last token.

Context length: at start-up (or once the upstream first answers) the backend reads the upstream's context length
(``GET /v1/models``, SGLang's ``max_model_len``), logs it beside the model's own (``max_position_embeddings``,
what the embedded backend serves; a warning says why when they differ), reports it in the model card
(``glance.context_length``) and names it in the 400 ``context_length_exceeded`` of a request over it.
A server the gateway launched is supervised (:mod:`glance_server.supervisor`): while it restarts ``/ready`` is
503 and new requests get 503 ``upstream_unavailable``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import time
from typing import Any

import httpx

from glance_sgl.engine import StreamDelta, TokenLogprob
from glance_sgl.special_tokens import SpecialTokenGuard
from glance_sgl.target import split_messages

from .config import ServerConfig
from .errors import APIError, bad_request
from .jobs import Backend, GenOutput, GenRequest, Job, queue_full
from .logprobs import TokenTable, from_sglang
from .protocol import glance_object
from .supervisor import ManagedSGLang

log = logging.getLogger("glance_server.sglang")

IM_START, IM_END, GEN_PROMPT = "<|im_start|>", "<|im_end|>\n", "<|im_start|>assistant\n"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def render_prompt(processor, messages: list[dict[str, Any]]) -> tuple[str, list[Any]]:
    """Engine-format messages -> (chat-template text with image placeholders, images in order)."""
    template_messages, images = split_messages(messages)
    text = processor.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
    return text, images


def parse_prompt(text: str, images: list[Any]) -> list[dict[str, Any]]:
    """The inverse of :func:`render_prompt` for Qwen's ChatML template (the caller re-renders to check)."""
    if not isinstance(text, str) or not text.endswith(GEN_PROMPT) or not text.startswith(IM_START):
        raise bad_request("text must be a chat-template prompt ending in the assistant generation prompt",
                          "invalid_prompt", "text")
    messages: list[dict[str, Any]] = []
    remaining = list(images)
    for segment in text[len(IM_START): -len(GEN_PROMPT)].split(IM_START) if text != GEN_PROMPT else []:
        if not segment.endswith(IM_END) or "\n" not in segment:
            raise bad_request("text is not in the model's chat format", "invalid_prompt", "text")
        role, body = segment[: -len(IM_END)].split("\n", 1)
        parts: list[dict[str, Any]] = []
        for k, piece in enumerate(body.split(IMAGE_PLACEHOLDER)):
            if k > 0:
                if not remaining:
                    raise bad_request("more image placeholders than image_data entries", "invalid_prompt", "text")
                parts.append({"type": "image", "image": remaining.pop(0)})
            if piece:
                parts.append({"type": "text", "text": piece})
        messages.append({"role": role, "content": parts})
    if remaining or not messages:
        raise bad_request("image_data does not match the prompt's image placeholders", "invalid_prompt",
                          "image_data")
    return messages


def trim(hist: list[int]) -> list[int]:
    end = len(hist)
    while end > 1 and hist[end - 1] == 0:
        end -= 1
    return list(hist[:end])


def meta_info(rid: str, out: GenOutput | None, completion_tokens: int, prompt_tokens: int | None,
              e2e_latency: float) -> dict[str, Any]:
    """SGLang ``meta_info`` for a (possibly unfinished) generation; spec fields once finished."""
    info: dict[str, Any] = {"id": rid, "finish_reason": None, "prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens, "cached_tokens": 0, "e2e_latency": e2e_latency}
    if out is None:
        return info
    info["finish_reason"] = ({"type": "length", "length": out.completion_tokens} if out.finish_reason == "length"
                             else {"type": "abort"} if out.finish_reason == "cancelled"
                             else {"type": "stop", "matched": None})
    g = out.glance
    if g["mode"] != "ar" and g["rounds"] > 0:
        info.update({
            "spec_verify_ct": g["rounds"],
            "spec_accept_length": out.completion_tokens / g["rounds"],
            "spec_accept_rate": g["acceptance_rate"] or 0.0,
            "spec_num_correct_drafts": g["accepted_tokens"],
            "spec_num_proposed_drafts": g["drafted_tokens"],
            "spec_correct_drafts_histogram": trim(g["acceptance_histogram"]),
        })
    return info


def glance_from_meta(meta: dict[str, Any], prefill_ms: float, decode_ms: float, queue_ms: float,
                     ar_ms_per_token: float | None) -> dict[str, Any]:
    """Our ``glance`` object from SGLang's ``meta_info``."""
    completion = int(meta.get("completion_tokens") or 0)
    verify = int(meta.get("spec_verify_ct") or 0)
    if verify:
        accepted = int(meta.get("spec_num_correct_drafts") or 0)
        drafted = meta.get("spec_num_proposed_drafts")
        if drafted is None:
            rate = meta.get("spec_accept_rate") or 0.0
            drafted = round(accepted / rate) if rate else 0
        mode, rounds, hist = "glance", verify, list(meta.get("spec_correct_drafts_histogram") or [])
        rows, without = None, None  # SGLang's meta_info does not say how many rows each round verified
    else:  # no speculation upstream: one token per step
        mode, rounds, accepted, drafted, hist = "ar", max(completion - 1, 0), 0, 0, [max(completion - 1, 0)]
        rows, without = ({"1": rounds} if rounds else {}), rounds
    return glance_object(backend="sglang", mode=mode, completion_tokens=completion, rounds=rounds,
                         committed_per_round=None, drafted_tokens=int(drafted), accepted_tokens=accepted,
                         acceptance_histogram=hist, prefill_ms=prefill_ms, decode_ms=decode_ms,
                         mean_root_entropy=None, estimated_ar_ms_per_token=ar_ms_per_token, queue_ms=queue_ms,
                         rows_histogram=rows, rounds_without_drafting=without)


def rejection_code(error: Any, message: str) -> str:
    """The error code of an upstream refusal: the upstream's own string code (another GLANCE gateway), else
    ``context_length_exceeded`` for SGLang's input-length message, else ``upstream_rejected``."""
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and code:
        return code
    if "context length" in message.lower() or "context_length" in message.lower():
        return "context_length_exceeded"
    return "upstream_rejected"


def upstream_rejection(status: int, raw: bytes) -> APIError:
    """An upstream error answer: the client's fault (400) or the deployment's (502 / 503)."""
    error: Any = None
    try:
        error = json.loads(raw)["error"]
        message = error["message"]
    except Exception:
        message = raw[:500].decode("utf-8", "replace")
    if status in (401, 403):
        return APIError(502, f"the upstream server refused the gateway's credentials: {message}", "upstream_auth")
    if 400 <= status < 500 and status != 429:
        return APIError(400, f"upstream: {message}", rejection_code(error, str(message)),
                        error.get("param") if isinstance(error, dict) else None)
    return APIError(503, f"upstream answered {status}: {message}", "upstream_unavailable",
                    headers={"Retry-After": "1"} if status == 429 else None)


def png_data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class SGLangBackend(Backend):
    """Requests forwarded to an SGLang server (or another GLANCE gateway) through ``POST /generate``."""

    name = "sglang"

    def __init__(self, upstream_url: str, processor, config: ServerConfig, *, managed: ManagedSGLang | None = None,
                 model_context_length: int | None = None, context_note: str = "") -> None:
        """``managed``: the supervised SGLang server this gateway launched (stopped with the gateway);
        ``model_context_length``: the model's own context (what the embedded backend serves), compared at start-up
        with the upstream's; ``context_note``: why they may differ (said in the start-up warning)."""
        self.upstream_url = upstream_url.rstrip("/")
        self.processor = processor
        self.config = config
        self.guard = SpecialTokenGuard(processor.tokenizer)
        self.tokens = TokenTable(processor.tokenizer)
        self.client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None
        self._queued = 0
        self._in_flight = 0
        self._ready_cache: tuple[float, bool, str] = (0.0, False, "not checked")
        self.managed = managed
        self.model_context_length = model_context_length
        self.upstream_context_length: int | None = None  # the upstream's max_model_len, once read
        self.context_note = context_note
        self._context_checked = False

    async def start(self) -> None:
        n = self.config.upstream_concurrency
        headers = {"Authorization": f"Bearer {self.config.upstream_api_key}"} if self.config.upstream_api_key else {}
        self.client = httpx.AsyncClient(
            base_url=self.upstream_url, trust_env=False, headers=headers,
            timeout=httpx.Timeout(self.config.upstream_timeout_s, connect=self.config.upstream_connect_timeout_s),
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
        )
        self._slots = asyncio.Semaphore(n)
        if self.managed is not None:
            self.managed.on_state(lambda _state: setattr(self, "_ready_cache", (0.0, False, "not checked")))
            self.managed.start()
            await self.check_context()

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.managed is not None:  # here, not atexit: uvicorn re-raises SIGTERM after shutdown
            await self.managed.stop()

    async def check_ready(self) -> tuple[bool, str]:
        """Upstream ``GET /health`` (cached for a second); a managed server that is restarting is not ready."""
        if self.managed is not None and not self.managed.serving():
            return False, self.managed.reason()
        at, ok, why = self._ready_cache
        if time.monotonic() - at < 1.0:
            return ok, why
        try:
            resp = await self.client.get("/health", timeout=2.0)
            ok, why = resp.status_code == 200, f"upstream /health answered {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"upstream unreachable ({type(exc).__name__})"
        self._ready_cache = (time.monotonic(), ok, "ok" if ok else why)
        if ok and not self._context_checked:
            await self.check_context()
        return ok, self._ready_cache[2]

    async def check_context(self) -> None:
        """Read the upstream's context length once (``GET /v1/models``: SGLang's ``max_model_len``, or an upstream
        GLANCE gateway's ``glance.context_length``) and log it beside the model's own; a warning says why when
        they differ."""
        try:
            resp = await self.client.get("/v1/models", timeout=5.0)
            cards = (resp.json().get("data") or []) if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return  # not reachable yet: check_ready tries again once it is
        self._context_checked = True
        # SGLang's max_model_len, or another GLANCE gateway's glance.context_length
        lengths = [c.get("max_model_len") or (c.get("glance") or {}).get("context_length")
                   for c in cards if isinstance(c, dict)]
        up = next((int(n) for n in lengths if isinstance(n, int) and n > 0), None)
        self.upstream_context_length = up
        model = self.model_context_length
        if up is None:
            log.info("the upstream does not report its context length; requests over it get its 400")
        elif model is None or up == model:
            log.info("context length: %d tokens (the model's max_position_embeddings: %s, as the embedded backend "
                     "serves it)", up, model if model is not None else "not set")
        else:
            log.warning("the SGLang server serves a context of %d tokens, but the model's max_position_embeddings "
                        "(what the embedded backend serves) is %d%s; requests longer than %d tokens get 400 "
                        "context_length_exceeded", up, model, f": {self.context_note}" if self.context_note else "",
                        up)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"backend": self.name, "upstream": self.upstream_url,
                                "context_length": self.upstream_context_length or self.model_context_length,
                                "estimated_ar_ms_per_token": self.config.ar_ms_per_token}
        if self.managed is not None:
            info["managed"] = {"state": self.managed.state, "restarts": self.managed.restarts}
        return info

    def stats(self) -> dict[str, int]:
        return {"queued": self._queued, "in_flight": self._in_flight}

    def supervision(self) -> dict[str, int] | None:
        """The managed server's ``restarts`` and ``up`` (None for an upstream the gateway did not launch)."""
        return self.managed.metrics() if self.managed is not None else None

    def name_limit(self, exc: APIError) -> APIError:
        """A ``context_length_exceeded`` from the upstream, with this backend's context length named."""
        n = self.upstream_context_length
        if exc.code != "context_length_exceeded" or n is None:
            return exc
        return APIError(exc.status, f"the sglang backend's context length is {n} tokens; {exc.message}", exc.code,
                        exc.param, headers=exc.headers)

    def submit(self, request: GenRequest) -> Job:
        if self.managed is not None and not self.managed.serving():
            raise APIError(503, self.managed.reason(), "upstream_unavailable", headers={"Retry-After": "5"})
        if request.measure_speedup:
            raise bad_request("measure_speedup needs the embedded backend (SGLang cannot switch speculation off "
                              "per request)", "unsupported_parameter", "glance.measure_speedup")
        if request.mode not in (None, "glance"):
            raise bad_request("the sglang backend decodes with the server's speculative setting; mode cannot be "
                              "chosen per request", "unsupported_parameter", "glance.mode")
        if request.planner is not None:
            raise bad_request("the sglang backend plans its trees per batch inside SGLang; planner cannot be chosen "
                              "per request", "unsupported_parameter", "glance.planner")
        if request.draft_sources is not None:
            raise bad_request("the sglang backend drafts from the SGLang server's sources (GLANCE_DRAFT_SOURCES, set "
                              "by glance serve --draft-sources for a server it launches); draft_sources cannot be "
                              "chosen per request", "unsupported_parameter", "glance.draft_sources")
        if self._queued >= self.config.max_queue and self._slots is not None and self._slots.locked():
            raise queue_full(1.0, self._queued)
        job = Job(request, asyncio.get_running_loop())
        task = asyncio.create_task(self._run(job))
        job.on_cancel(task.cancel)
        return job

    def payload(self, request: GenRequest, text: str, images: list[Any]) -> dict[str, Any]:
        p = request.params
        sampling = {"max_new_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
                    "top_k": p.top_k if p.top_k > 0 else -1, "min_p": p.min_p}
        if p.stop:
            sampling["stop"] = list(p.stop)
        if p.seed is not None:
            sampling["sampling_seed"] = p.seed
        if p.logit_bias:
            sampling["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
        if p.min_tokens:
            sampling["min_new_tokens"] = p.min_tokens
        if request.json_schema is not None:
            sampling["json_schema"] = request.json_schema
        body: dict[str, Any] = {"text": text, "sampling_params": sampling, "stream": True, "rid": request.request_id}
        if p.logprobs is not None:
            body.update(return_logprob=True, top_logprobs_num=p.logprobs)
        if images:
            body["image_data"] = [png_data_url(img) for img in images]
        return body

    async def _run(self, job: Job) -> None:
        assert self.client is not None and self._slots is not None
        self._queued += 1
        try:
            try:
                await self._slots.acquire()
            finally:
                self._queued -= 1
            self._in_flight += 1
            try:
                job.started = time.perf_counter()
                job.post("done", await self._generate(job))
            finally:
                self._in_flight -= 1
                self._slots.release()
        except asyncio.CancelledError:
            job.post("error", APIError(499, "cancelled", "cancelled"))
        except APIError as exc:
            job.post("error", self.name_limit(exc))
        except httpx.TimeoutException:
            job.post("error", APIError(504, "the upstream SGLang server timed out", "upstream_timeout"))
        except httpx.HTTPError as exc:
            job.post("error", APIError(503, f"the upstream SGLang server is unavailable ({type(exc).__name__})",
                                       "upstream_unavailable"))
        except Exception as exc:  # a malformed upstream answer
            job.post("error", APIError(502, f"bad answer from the upstream server ({type(exc).__name__}: {exc})",
                                       "upstream_error"))

    async def _generate(self, job: Job) -> GenOutput:
        if job.request.prompt is not None:
            text, images = job.request.prompt, []
        else:
            text, images = render_prompt(self.processor, job.request.messages)
        body = await asyncio.to_thread(self.payload, job.request, text, images)
        t0 = time.perf_counter()
        first = last = None
        seen_text, token_ids, meta = "", [], {}
        logprobs: list[TokenLogprob] | None = [] if job.request.params.logprobs is not None else None
        final: dict[str, Any] = {}
        async with self.client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                raise upstream_rejection(resp.status_code, await resp.aread())
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                    message = str(error.get("message"))
                    status = error.get("code")
                    if not token_ids and (isinstance(status, str) or (isinstance(status, int)
                                                                      and 400 <= status < 500)):
                        # refused before any output (SGLang streams its validation errors): the client's 400
                        raise APIError(400, f"upstream: {message}", rejection_code(error, message),
                                       error.get("param"))
                    raise APIError(502, f"upstream: {message}", "upstream_error")
                meta = chunk.get("meta_info") or {}
                ids, text = list(chunk.get("output_ids") or []), chunk.get("text") or ""
                if len(ids) == meta.get("completion_tokens", -1):  # cumulative (SGLang's default)
                    ids, text = ids[len(token_ids):], text[len(seen_text):]
                token_ids += ids
                seen_text += text
                new_logprobs = None
                if logprobs is not None:
                    entries = meta.get("output_token_logprobs") or []
                    tops = meta.get("output_top_logprobs")
                    cumulative = len(entries) == len(token_ids)
                    start = len(logprobs) if cumulative else 0
                    new_logprobs = from_sglang(entries[start:], tops[start:] if tops else None)
                    logprobs += new_logprobs
                if ids:
                    last = time.perf_counter()
                    first = first if first is not None else last
                if text or ids:
                    delta = StreamDelta(token_ids=ids, text=text, logprobs=new_logprobs)
                    # SGLang's cumulative counts so far (absent before the first verify step): stream_rounds
                    delta.spec_verify_ct = meta.get("spec_verify_ct")
                    delta.spec_num_correct_drafts = meta.get("spec_num_correct_drafts")
                    job.post("delta", delta)
                final = chunk
        if not final:
            raise APIError(502, "the upstream stream ended without a result", "upstream_error")
        reason = (meta.get("finish_reason") or {}).get("type")
        finish = {"length": "length", "abort": "cancelled"}.get(reason, "stop")
        prefill_ms = ((first or t0) - t0) * 1000.0
        decode_ms = ((last or t0) - (first or t0)) * 1000.0
        glance = glance_from_meta(meta, prefill_ms, decode_ms, job.queue_ms, self.config.ar_ms_per_token)
        return GenOutput(text=seen_text, token_ids=token_ids, finish_reason=finish,
                         prompt_tokens=int(meta.get("prompt_tokens") or 0),
                         completion_tokens=int(meta.get("completion_tokens") or 0), glance=glance,
                         logprobs=logprobs)
