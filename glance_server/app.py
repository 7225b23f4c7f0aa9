"""The FastAPI app: routes, the ASGI guards (metrics, API key, body size) and the job consumers.

Endpoints: ``POST /v1/chat/completions`` (OpenAI; SSE with ``stream: true``), ``POST /v1/completions`` (OpenAI's
legacy text completions: a raw prompt, no chat template), ``POST /v1/generate``
(multipart: image file(s) + prompt -> JSON), ``POST /generate`` (SGLang's native format, answered by this
gateway's backend), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (liveness), ``GET /ready`` (readiness),
``GET /metrics`` (Prometheus). Every error is an OpenAI-style body with a 4xx/5xx status; a
streamed request that cannot start (validation, context length, a refused prompt) gets its status before the
stream opens (:meth:`Gateway.open_stream`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import UploadFile

from glance_sgl.engine import MAX_TOP_LOGPROBS

from .config import ServerConfig, key_identity
from .errors import APIError, bad_request, body_parse_error
from .images import decode_data_url, decode_image
from .jobs import Backend, GenOutput, GenRequest, Job
from .logprobs import TokenTable, to_sglang
from .protocol import (PLANNERS, ChatRequest, CompletionRequest, check_model, check_planner, check_text,
                       chat_request, choice_requests, chunk_body, completion_body, completion_requests,
                       parse_draft_sources, sampling_params, text_chunk_body, text_completion_body, usage)
from .sglang import IM_START, meta_info, parse_prompt, render_prompt
from .playground import PLAYGROUND_PATHS, router as playground_router
from .telemetry import Telemetry

log = logging.getLogger("glance_server")
OPEN_PATHS = {"/health", "/ready", "/metrics"} | PLAYGROUND_PATHS  # the playground page holds no secret
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ------------------------------------------------------------------------------------------------ ASGI guards
class Guards:
    """Outermost middleware: counts and times every request (by route template and status), refuses a wrong
    or missing API key (401) and bodies over the limit (413, from Content-Length or while reading)."""

    def __init__(self, app, config: ServerConfig, telemetry: Telemetry) -> None:
        self.app, self.config, self.telemetry = app, config, telemetry

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self._auth(scope)
            if refusal is None:
                receive, refusal = await self._limit_body(scope, receive)
            if refusal is not None:
                await refusal.response()(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "other"
            self.telemetry.requests.labels(label, str(status["code"])).inc()
            self.telemetry.latency.labels(label).observe(time.perf_counter() - t0)

    def _auth(self, scope) -> APIError | None:
        """401 unless the bearer token is one of the keys (each compared in constant time, all of them every
        time); the matching key's identity (a hash, :func:`key_identity`) goes to ``request.state.tenant``."""
        if not self.config.keys or scope["path"] in OPEN_PATHS:
            return None
        headers = dict(scope["headers"])
        value = headers.get(b"authorization", b"").decode("latin-1")
        token = (value[7:].strip() if value[:7].lower() == "bearer " else "").encode()
        match = None
        for key in self.config.keys:
            if hmac.compare_digest(token, key.encode()) and match is None:
                match = key
        if match is None:
            return APIError(401, "invalid or missing API key (Authorization: Bearer ...)", "invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        scope.setdefault("state", {})["tenant"] = key_identity(match)
        return None

    async def _limit_body(self, scope, receive):
        """Reads the body up front (at most the limit) and replays it; 413 beyond the limit."""
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return receive, None
        encoding = dict(scope["headers"]).get(b"content-encoding", b"").decode("latin-1").strip().lower()
        if encoding not in ("", "identity"):
            return receive, APIError(415, f"Content-Encoding {encoding!r} is not supported; send the body "
                                     "uncompressed", "unsupported_content_encoding")
        limit = self.config.max_body_bytes
        too_big = APIError(413, f"request body is larger than {limit} bytes", "request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return receive, too_big
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                chunks = None
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return receive, too_big
            if not message.get("more_body", False):
                break
        body = b"".join(chunks) if chunks is not None else b""
        scope.setdefault("state", {})["raw_body"] = body
        replay = [{"type": "http.request", "body": body, "more_body": False}] if chunks is not None \
            else [{"type": "http.disconnect"}]

        async def replay_receive():
            return replay.pop(0) if replay else await receive()

        return replay_receive, None


# ------------------------------------------------------------------------------------------------ consumers
async def wait_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Gateway:
    """Shared state of the routes."""

    def __init__(self, config: ServerConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.telemetry = Telemetry(backend.stats, backend.supervision)
        self.http: httpx.AsyncClient | None = None  # remote image fetches
        self.started = int(time.time())

    async def start(self, req: GenRequest, request: Request | None = None) -> Job:
        """Checks, the backend's preparation (may refuse: 400), then :meth:`submit`. ``request``: the HTTP
        request, whose API key's identity becomes the request's tenant (None: anonymous)."""
        if request is not None:
            req.tenant = getattr(request.state, "tenant", None)
        try:
            self.backend.check_text(req)
            await self.backend.prepare(req)
        except APIError as exc:
            self.observe("error", exc)
            raise
        return self.submit(req)

    async def start_choices(self, req: GenRequest, n: int, request: Request | None = None) -> list[Job]:
        """The jobs of a request's ``n`` choices, choice ``i`` answered by ``jobs[i]`` (a greedy request: one job
        for all, :func:`protocol.choice_requests`). The first is checked and prepared by :meth:`start`, the others
        share its preparation; a refusal (a full queue) cancels the ones queued before it."""
        reqs = choice_requests(req, n)
        jobs = [await self.start(req, request)]
        try:
            for copy in reqs[1:]:
                copy.prepared, copy.tenant = req.prepared, req.tenant
                jobs.append(self.submit(copy))
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        return jobs if len(jobs) == n else jobs * n

    def submit(self, req: GenRequest) -> Job:
        try:
            job = self.backend.submit(req)
        except APIError as exc:
            self.observe("error", exc)
            raise
        job.on_finish = self.observe
        return job

    def observe(self, kind: str, payload: Any) -> None:
        """Telemetry of a finished job (also when its client has gone)."""
        if kind == "done":
            self.telemetry.observe_generation(payload.glance, payload.prompt_tokens, payload.completion_tokens,
                                              payload.finish_reason)
        elif payload.status == 499:
            self.telemetry.finished.labels("cancelled").inc()
        elif payload.status >= 500:
            self.telemetry.engine_errors.inc()

    async def events(self, job: Job, t0: float) -> AsyncIterator[tuple[str, Any]]:
        """A job's events until done / error, with telemetry; past the request timeout: cancel and 504."""
        deadline = time.monotonic() + self.config.request_timeout_s
        first = True
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.next_event(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                job.cancel()
                raise APIError(504, f"generation took longer than {self.config.request_timeout_s} s", "timeout")
            if kind == "delta" and first:
                first = False
                self.telemetry.ttft.observe(time.perf_counter() - t0)
            yield kind, payload
            if kind in ("done", "error"):
                return

    async def collect(self, job: Job, request: Request, t0: float) -> GenOutput:
        """Wait for a job's result; a client that goes away cancels it."""
        watcher = asyncio.create_task(wait_disconnect(request))
        watcher.add_done_callback(lambda task: job.cancel() if not task.cancelled() else None)
        try:
            async for kind, payload in self.events(job, t0):
                if kind == "done":
                    return payload
                if kind == "error":
                    raise payload
        finally:
            watcher.cancel()
            job.cancel()
        raise APIError(500, "the job ended without a result", "internal_error")

    async def collect_all(self, jobs: list[Job], request: Request, t0: float) -> list[GenOutput]:
        """:meth:`collect` of every choice's job (``jobs[i]``: choice i's, a job may answer several); one that
        fails cancels the others."""
        unique = list(dict.fromkeys(jobs))
        try:
            outs = await asyncio.gather(*(self.collect(job, request, t0) for job in unique))
        except BaseException:
            for job in unique:
                job.cancel()
            raise
        found = dict(zip(unique, outs))
        return [found[job] for job in jobs]

    async def merged_events(self, jobs: list[Job], t0: float) -> AsyncIterator[tuple[int, str, Any]]:
        """``(k, kind, payload)``: the events of ``jobs[k]`` (:meth:`events`), interleaved as they come, until
        every job is done or failed (a job's timeout is its ``"error"`` event)."""
        if len(jobs) == 1:
            async for kind, payload in self.events(jobs[0], t0):
                yield 0, kind, payload
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, job: Job) -> None:
            try:
                async for kind, payload in self.events(job, t0):
                    queue.put_nowait((k, kind, payload))
            except APIError as exc:
                queue.put_nowait((k, "error", exc))
            except Exception as exc:  # never leave the merge waiting for a job that can no longer end
                log.exception("choice %d's events failed", k)
                queue.put_nowait((k, "error", APIError(500, f"internal error: {type(exc).__name__}",
                                                       "internal_error")))

        tasks = [asyncio.create_task(pump(k, job)) for k, job in enumerate(jobs)]
        try:
            left = len(jobs)
            while left:
                event = await queue.get()
                yield event
                left -= event[1] in ("done", "error")
        finally:
            for task in tasks:
                task.cancel()

    async def open_stream(self, jobs: list[Job], request: Request, t0: float, chunks: list[Any],
                          trailer: Any = None) -> StreamingResponse:
        """The SSE response of a request's choices (``chunks[i]`` frames choice i, answered by ``jobs[i]``; a job
        may answer several), opened once nothing can refuse it any more: at once when the backend has accepted
        every job (embedded: prepared before queueing), else after each job's first event, so that an error found
        while preparing it (an upstream 4xx, SGLang's streamed validation error) is raised here and the client
        gets its 4xx instead of a 200 and an error event. A client that goes away meanwhile cancels them.
        ``trailer(outs)``: chunks after every choice finished (the usage chunk of several choices)."""
        unique = list(dict.fromkeys(jobs))
        events = self.merged_events(unique, t0)
        early: list[tuple[int, str, Any]] = []
        waiting = {k for k, job in enumerate(unique) if not job.accepted}
        if waiting:
            watcher = asyncio.create_task(wait_disconnect(request))
            watcher.add_done_callback(lambda task: [job.cancel() for job in unique] if not task.cancelled()
                                      else None)
            try:
                while waiting:
                    event = await anext(events)
                    early.append(event)
                    waiting.discard(event[0])
                    if event[1] == "error":
                        raise event[2]
            except BaseException:
                for job in unique:
                    job.cancel()
                await events.aclose()
                raise
            finally:
                watcher.cancel()
        owners = [unique.index(job) for job in jobs]
        return StreamingResponse(self.stream(unique, chunks, owners, early, events, trailer),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def stream(self, jobs: list[Job], chunks: list[Any], owners: list[int], early: list[tuple[int, str, Any]],
                     events: AsyncIterator[tuple[int, str, Any]], trailer: Any = None) -> AsyncIterator[bytes]:
        """SSE framing of the choices' events (``early`` if already read, then the rest of ``events``):
        ``chunks[i]`` turns the events of ``jobs[owners[i]]`` into choice i's JSON objects. An error ends the
        stream. When the client goes, Starlette cancels this generator and the jobs are cancelled with it."""
        outs: dict[int, GenOutput] = {}

        async def all_events():
            for event in early:
                yield event
            async for event in events:
                yield event

        try:
            for frame in chunks:
                for obj in frame.start():
                    yield sse(obj)
            async for k, kind, payload in all_events():
                if kind == "error":
                    yield sse(payload.body())
                    break
                if kind == "done":
                    outs[k] = payload
                for frame, owner in zip(chunks, owners):
                    if owner == k:
                        for obj in frame.delta(payload) if kind == "delta" else frame.done(payload):
                            yield sse(obj)
            else:
                if trailer is not None and len(outs) == len(jobs):
                    for obj in trailer([outs[owner] for owner in owners]):
                        yield sse(obj)
        except APIError as exc:
            yield sse(exc.body())
        finally:
            for job in jobs:
                job.cancel()
            await events.aclose()
        yield b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class ChatChunks:
    """OpenAI chat.completion.chunk objects of choice ``index``. The ``glance`` object rides on the last chunk
    before [DONE] (the usage chunk with ``stream_options.include_usage``, else the chunk with ``finish_reason``);
    with several choices each choice's finish chunk carries its own and one usage chunk (:meth:`usage_chunks`)
    ends the stream."""

    def __init__(self, rid: str, model: str, include_usage: bool, tokens: TokenTable | None = None,
                 index: int = 0) -> None:
        self.rid, self.model, self.include_usage = rid, model, include_usage
        self.tokens = tokens  # with logprobs: the token table that names them
        self.index = index  # the choice these chunks frame
        self.created = int(time.time())

    def start(self):
        yield chunk_body(self.rid, self.model, self.created, {"role": "assistant", "content": ""}, index=self.index)

    def logprobs(self, delta) -> dict[str, Any] | None:
        """The chunk's ``logprobs`` (``{"content": [...]}`` for the delta's tokens) or None."""
        if self.tokens is None or not getattr(delta, "logprobs", None):
            return None
        return {"content": self.tokens.chat_entries(delta.logprobs)}

    def delta(self, delta):
        logprobs = self.logprobs(delta)
        if delta.text or logprobs:
            yield chunk_body(self.rid, self.model, self.created, {"content": delta.text}, logprobs=logprobs,
                             index=self.index)

    def done(self, out: GenOutput, **extra):
        if self.include_usage:
            yield chunk_body(self.rid, self.model, self.created, {}, out.finish_reason, index=self.index, **extra)
            yield chunk_body(self.rid, self.model, self.created, None, usage=usage(out), glance=out.glance)
        else:
            yield chunk_body(self.rid, self.model, self.created, {}, out.finish_reason, index=self.index,
                             glance=out.glance, **extra)

    def usage_chunks(self, outs: list[GenOutput]):
        """The usage chunk of several choices (each choice's finish chunk carries its ``glance``)."""
        yield chunk_body(self.rid, self.model, self.created, None, usage=usage(outs))


class RoundChunks(ChatChunks):
    """``"glance": {"stream_rounds": true}``: every content chunk (also one whose text is held back, content "")
    carries ``glance_round``: ``round`` (index of the verification round that committed the chunk's tokens; 0 is
    the prefill token, which belongs to no round), ``rounds`` (rounds the chunk spans), ``tokens``, ``accepted``
    (accepted draft tokens among them), ``bonus`` (the target's own tokens: one per round, last in it),
    ``bonus_text`` (the bonus token decoded alone), ``prefill``, ``provisional``; null where unknown. The finish
    chunk carries ``glance_round: {"final": true, "rounds_confirmed": bool, "last": ...}``: whether the chunks
    were one round each as reported (their rounds add up to the request's ``rounds``), and, when the last round
    was cut by a stop condition (its bonus token dropped), that round restated from the request's accepted-draft
    count (else null).

    A round commits its accepted drafts + one bonus token, so a chunk of one round has ``accepted = tokens - 1``,
    except a last round cut short. Embedded: one chunk per round, exact. SGLang: one chunk per upstream stream
    chunk. SGLang 0.5.23 puts its speculative counts (``spec_verify_ct``, ``spec_num_correct_drafts``) on the
    last chunk only, so each chunk is reported as one round (``provisional: true``, true when SGLang streams every
    decode step) and the finish chunk says whether the counts confirm it; where an upstream sends its cumulative
    counts on every chunk, the split is exact per chunk (a chunk spanning several rounds has ``round`` null)."""

    def __init__(self, rid: str, model: str, include_usage: bool, tokenizer=None,
                 tokens: TokenTable | None = None, index: int = 0) -> None:
        super().__init__(rid, model, include_usage, tokens, index)
        self.tokenizer = tokenizer
        self.count = 0  # chunks so far
        self.rounds = 0  # rounds reported so far (None once a chunk's rounds are unknown)
        self.accepted = 0  # accepted drafts reported so far (those kept in the answer)
        self.upstream_accepted = 0  # the upstream's cumulative accepted-draft count so far
        self.counted = True  # every chunk after the prefill came with the upstream's cumulative counts
        self.last: dict[str, Any] | None = None

    def _bonus_text(self, token_ids, bonus) -> str | None:
        if self.tokenizer is None or bonus != 1 or not token_ids:
            return None
        return self.tokenizer.decode(token_ids[-1:], skip_special_tokens=True)

    def delta(self, delta):
        n = len(delta.token_ids)
        k, self.count = self.count, self.count + 1
        info: dict[str, Any] = {"round": None, "rounds": None, "tokens": n, "accepted": None, "bonus": None,
                                "bonus_text": None, "prefill": False, "provisional": False}
        verify = getattr(delta, "spec_verify_ct", None)  # an upstream's cumulative counts, when it sends them
        if k == 0:
            info.update(round=0, rounds=0, prefill=True, accepted=0, bonus=0)
        elif verify is not None and self.counted and self.rounds is not None:
            rounds = int(verify) - self.rounds
            upstream = int(getattr(delta, "spec_num_correct_drafts", 0) or 0)
            accepted = min(upstream - self.upstream_accepted, n)  # a cut last round keeps fewer than it accepted
            self.upstream_accepted = upstream
            if rounds >= 1 and accepted >= 0 and n - accepted <= rounds:
                info.update(round=self.rounds + 1 if rounds == 1 else None, rounds=rounds, accepted=accepted,
                            bonus=n - accepted)
            # else: counts that do not fit the chunk: its rounds stay unknown and the finish chunk says so
        else:  # one delta per round (embedded), or an upstream without per-chunk counts: one chunk, one round
            self.counted = self.counted and not hasattr(delta, "spec_verify_ct")
            info.update(round=k, rounds=1, accepted=max(n - 1, 0), bonus=1 if n else 0,
                        provisional=hasattr(delta, "spec_verify_ct"))
        if k and info["rounds"] is None:
            self.rounds = None
        elif self.rounds is not None:
            self.rounds += info["rounds"]
        self.accepted += info["accepted"] or 0
        info["bonus_text"] = self._bonus_text(delta.token_ids, info["bonus"])
        self.last = {"info": info, "token_ids": list(delta.token_ids)}
        yield chunk_body(self.rid, self.model, self.created, {"content": delta.text}, logprobs=self.logprobs(delta),
                         index=self.index, glance_round=info)

    def done(self, out: GenOutput):
        g = out.glance
        confirmed = self.rounds is not None and self.rounds == g.get("rounds")
        final: dict[str, Any] = {"final": True, "rounds_confirmed": confirmed, "last": None}
        last = self.last["info"] if self.last else None
        if confirmed and last is not None and last["rounds"] == 1 and not last["prefill"]:
            # the last round's true split: the request's accepted drafts less those of the earlier rounds
            true_accepted = g.get("accepted_tokens", 0) - (self.accepted - last["accepted"])
            kept = min(max(true_accepted, 0), last["tokens"])
            if kept != last["accepted"]:
                bonus = last["tokens"] - kept
                final["last"] = {**last, "accepted": kept, "bonus": bonus,
                                 "bonus_text": self._bonus_text(self.last["token_ids"], bonus)}
        yield from super().done(out, glance_round=final)


class CompletionChunks:
    """OpenAI text_completion stream objects of choice ``index`` (legacy completions); ``glance`` rides as in
    :class:`ChatChunks`. ``tokens``: with logprobs, the token table (legacy format, ``top`` alternatives when
    ``with_top``)."""

    def __init__(self, rid: str, model: str, include_usage: bool, tokens: TokenTable | None = None,
                 with_top: bool = False, index: int = 0) -> None:
        self.rid, self.model, self.include_usage = rid, model, include_usage
        self.tokens, self.with_top, self.index = tokens, with_top, index
        self.created = int(time.time())
        self.offset = 0  # characters of the completion so far (text_offset)

    def start(self):
        return ()

    def delta(self, delta):
        logprobs = None
        if self.tokens is not None and getattr(delta, "logprobs", None):
            logprobs = self.tokens.legacy(delta.logprobs, self.offset, self.with_top)
            self.offset += sum(len(t) for t in logprobs["tokens"])
        if delta.text or logprobs:
            yield text_chunk_body(self.rid, self.model, self.created, delta.text, logprobs=logprobs,
                                  index=self.index)

    def done(self, out: GenOutput):
        if self.include_usage:
            yield text_chunk_body(self.rid, self.model, self.created, "", out.finish_reason, index=self.index)
            yield text_chunk_body(self.rid, self.model, self.created, None, usage=usage(out), glance=out.glance)
        else:
            yield text_chunk_body(self.rid, self.model, self.created, "", out.finish_reason, index=self.index,
                                  glance=out.glance)

    def usage_chunks(self, outs: list[GenOutput], per_prompt: int | None = None):
        """The usage chunk of several choices (as :meth:`ChatChunks.usage_chunks`; ``per_prompt``: as in
        :func:`protocol.usage`)."""
        yield text_chunk_body(self.rid, self.model, self.created, None, usage=usage(outs, per_prompt))


class NativeChunks:
    """SGLang ``/generate`` stream objects: cumulative text, output_ids (and logprobs), meta_info on every chunk."""

    def __init__(self, rid: str, top_logprobs: int | None = None) -> None:
        self.rid, self.text, self.ids = rid, "", []
        self.top, self.logprobs = top_logprobs, []
        self.t0 = time.perf_counter()

    def start(self):
        return ()

    def delta(self, delta):
        self.text += delta.text
        self.ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        info = meta_info(self.rid, None, len(self.ids), None, self._elapsed())
        if self.top is not None:
            info.update(to_sglang(self.logprobs, self.top))
        yield {"text": self.text, "output_ids": list(self.ids), "meta_info": info}

    def done(self, out: GenOutput):
        yield native_body(self.rid, out, self._elapsed(), self.top)

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t0


def native_body(rid: str, out: GenOutput, e2e_latency: float, top_logprobs: int | None = None) -> dict[str, Any]:
    info = meta_info(rid, out, out.completion_tokens, out.prompt_tokens, e2e_latency)
    if top_logprobs is not None:
        info.update(to_sglang(out.logprobs or [], top_logprobs))
    return {"text": out.text, "output_ids": list(out.token_ids), "meta_info": info}


# ------------------------------------------------------------------------------------------------ the app
def create_app(config: ServerConfig, backend: Backend, processor=None) -> FastAPI:
    """The gateway. ``processor`` (the model's processor) enables the SGLang-native ``/generate`` route."""
    gw = Gateway(config, backend)

    @asynccontextmanager
    async def lifespan(_app):
        gw.http = httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                    timeout=httpx.Timeout(config.remote_image_timeout_s))
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()
            await gw.http.aclose()

    app = FastAPI(title="GLANCE gateway", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gw
    app.include_router(playground_router)

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        if err.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        return bad_request(message, "invalid_request", param).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.error("unhandled error on %s: %r", request.url.path, exc)
        return APIError(500, "internal server error", "internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """Starlette's / FastAPI's own errors (no route, wrong method, an unparsable body) in the OpenAI body."""
        if exc.status_code == 404:
            return APIError(404, f"no route {request.method} {request.url.path}", "not_found").response()
        if exc.status_code == 405:
            return APIError(405, f"method {request.method} not allowed on {request.url.path}",
                            "method_not_allowed").response()
        if exc.status_code == 400:  # FastAPI: "There was an error parsing the body"
            return body_parse_error(request.scope.get("state", {}).get("raw_body")).response()
        return APIError(exc.status_code, str(exc.detail), "http_error").response()

    # -------------------------------------------------------------- probes and metadata
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        ok, why = await backend.check_ready()
        body = {"status": "ready" if ok else "not ready", "reason": why, **backend.stats()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(gw.telemetry.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": config.served_model_name, "object": "model", "created": gw.started, "owned_by": "glance",
                "glance": backend.describe()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id, config)
        return model_card()

    # -------------------------------------------------------------- generation
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        t0 = time.perf_counter()
        req = await chat_request(body, config, gw.http)
        n = body.n or 1
        jobs = await gw.start_choices(req, n, request)
        model = config.served_model_name
        tokens = backend.tokens if req.params.logprobs is not None else None
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            own = include and n == 1  # one choice: the usage chunk is its own (with its glance object)
            rounds = bool(body.glance and body.glance.stream_rounds)
            chunks = [RoundChunks(req.request_id, model, own, getattr(processor, "tokenizer", None), tokens, i)
                      if rounds else ChatChunks(req.request_id, model, own, tokens, i) for i in range(n)]
            return await gw.open_stream(jobs, request, t0, chunks,
                                        chunks[0].usage_chunks if include and n > 1 else None)
        outs = await gw.collect_all(jobs, request, t0)
        logprobs = [{"content": tokens.chat_entries(out.logprobs or [])} if tokens is not None else None
                    for out in outs]
        return completion_body(req.request_id, model, outs, logprobs)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI's legacy text completions: ``prompt`` is raw text (no chat template), no images; a list of
        prompts is a batch (choice ``k * n + i``: prompt k's i-th)."""
        t0 = time.perf_counter()
        reqs = completion_requests(body, config)
        n = body.n or 1
        jobs: list[Job] = []
        try:
            for req in reqs:
                jobs += await gw.start_choices(req, n, request)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        rid, model = reqs[0].request_id, config.served_model_name
        tokens = backend.tokens if reqs[0].params.logprobs is not None else None
        with_top = bool(reqs[0].params.logprobs)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            one = len(jobs) == 1  # one choice: the usage chunk is its own (with its glance object)
            chunks = [CompletionChunks(rid, model, include and one, tokens, with_top, i) for i in range(len(jobs))]
            trailer = (lambda outs: chunks[0].usage_chunks(outs, n)) if include and not one else None
            return await gw.open_stream(jobs, request, t0, chunks, trailer)
        outs = await gw.collect_all(jobs, request, t0)
        logprobs = [tokens.legacy(out.logprobs or [], 0, with_top) if tokens is not None else None for out in outs]
        return text_completion_body(rid, model, outs, logprobs, n)

    @app.post("/v1/generate")
    async def generate_multipart(request: Request):
        """Multipart form: ``prompt`` + ``image`` file(s) (repeatable), optional ``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``min_tokens``, ``seed``, ``stop`` (repeatable), ``mode``,
        ``planner``, ``draft_sources`` (comma-separated), ``measure_speedup`` (any other field: 400)."""
        t0 = time.perf_counter()
        req = await multipart_request(request, config)
        out = await gw.collect(await gw.start(req, request), request, t0)
        return {"id": f"gen-{req.request_id}", "object": "glance.generation", "model": config.served_model_name,
                "text": out.text, "finish_reason": out.finish_reason, "usage": usage(out), "glance": out.glance}

    if processor is not None:
        @app.post("/generate")
        async def generate_native(request: Request):
            """SGLang's native format, answered by this gateway's backend (``text`` must be a chat-template
            prompt; ``image_data``: base64 data URLs only — never paths or URLs)."""
            t0 = time.perf_counter()
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise body_parse_error(raw) from exc
            req = await native_request(body, config, processor)
            job = await gw.start(req, request)
            rid = str(body.get("rid") or req.request_id)
            top = req.params.logprobs
            if body.get("stream"):
                return await gw.open_stream([job], request, t0, [NativeChunks(rid, top)])
            out = await gw.collect(job, request, t0)
            return native_body(rid, out, time.perf_counter() - t0, top)

    guarded = Guards(app, config, gw.telemetry)
    guarded.gateway = gw  # the routes' shared state (its backend), for whoever runs the app
    return guarded


# ------------------------------------------------------------------------------------------------ parsers
# the multipart route's fields
FORM_FIELDS = frozenset({"prompt", "image", "images", "model", "mode", "planner", "max_tokens", "temperature", "top_p",
                         "top_k", "min_p", "min_tokens", "stop", "seed", "measure_speedup", "draft_sources"})


def form_number(form, name: str, kind, default=None):
    value = form.get(name)
    if value is None or value == "":
        return default
    try:
        return kind(value)
    except ValueError as exc:
        raise bad_request(f"{name} must be a number, got {value!r}", "invalid_value", name) from exc


async def multipart_request(request: Request, config: ServerConfig) -> GenRequest:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("send multipart/form-data with a 'prompt' field and 'image' file(s)", "invalid_request")
    try:
        form = await request.form(max_files=config.max_images + 1, max_fields=32,
                                  max_part_size=config.max_image_bytes)
    except Exception as exc:  # malformed multipart / over the part limits
        raise bad_request(f"could not read the form ({exc})", "invalid_request") from exc
    unknown = sorted(set(form.keys()) - FORM_FIELDS)
    if unknown:  # a field this route does not read is refused, never ignored
        raise bad_request(f"form field {unknown[0]!r} is not supported (fields: {', '.join(sorted(FORM_FIELDS))})",
                          "unsupported_parameter", unknown[0])
    prompt = form.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad_request("the form needs a non-empty 'prompt' field", "invalid_value", "prompt")
    check_text(prompt, "prompt")
    files = [f for key in ("image", "images") for f in form.getlist(key) if isinstance(f, UploadFile)]
    if len(files) > config.max_images:
        raise bad_request(f"{len(files)} images; this server allows at most {config.max_images}", "too_many_images",
                          "image")
    images = []
    for k, upload in enumerate(files):
        data = await upload.read(config.max_image_bytes + 1)
        images.append(await asyncio.to_thread(decode_image, data, config, f"image[{k}]"))
    check_model(form.get("model") or None, config)
    mode = form.get("mode") or None
    if mode not in (None, "glance", "chain", "ar"):
        raise bad_request(f"mode must be glance, chain or ar, got {mode!r}", "invalid_value", "mode")
    planner = form.get("planner") or None
    if planner is not None and mode is not None:
        check_planner(planner, mode, "planner")
    elif planner is not None and planner not in PLANNERS:
        raise bad_request(f"planner must be auto or fixed, got {planner!r}", "invalid_value", "planner")
    params = sampling_params(config, form_number(form, "max_tokens", int), form_number(form, "temperature", float, 0.0),
                             form_number(form, "top_p", float), [s for s in form.getlist("stop") if s] or None,
                             form_number(form, "seed", int), top_k=form_number(form, "top_k", int),
                             min_p=form_number(form, "min_p", float), min_tokens=form_number(form, "min_tokens", int))
    content: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
    content.append({"type": "text", "text": prompt})
    measure = str(form.get("measure_speedup", "")).lower() in ("1", "true", "yes", "on")
    return GenRequest(messages=[{"role": "user", "content": content}], params=params, mode=mode, planner=planner,
                      measure_speedup=measure,
                      draft_sources=parse_draft_sources(str(form.get("draft_sources") or "") or None, "draft_sources"))


async def native_request(body: Any, config: ServerConfig, processor) -> GenRequest:
    """SGLang ``/generate`` JSON -> request. A chat-template prompt is parsed back into messages and re-rendered
    to check; text that does not start with the template (and comes without images) is a raw prompt.
    ``return_logprob`` / ``top_logprobs_num`` ask for the output tokens' logprobs."""
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise bad_request("'text' (a chat-template prompt string) is required", "invalid_value", "text")
    check_text(body["text"], "text")
    raw = body.get("image_data") or []
    raw = [raw] if isinstance(raw, str) else raw
    if not isinstance(raw, list) or len(raw) > config.max_images:
        raise bad_request(f"image_data must be a list of at most {config.max_images} data URLs", "too_many_images",
                          "image_data")
    images = []
    for k, item in enumerate(raw):
        if not isinstance(item, str):
            raise bad_request("image_data entries must be strings", "invalid_value", "image_data")
        url = item if item.startswith("data:") else "data:image/png;base64," + item
        images.append(await asyncio.to_thread(decode_data_url, url, config, f"image_data[{k}]"))
    raw_prompt = None
    if not images and body["text"] and not body["text"].startswith(IM_START):
        messages, raw_prompt = [], body["text"]
    else:
        messages = parse_prompt(body["text"], images)
        rendered, _ = render_prompt(processor, messages)
        if rendered != body["text"]:
            raise bad_request("text is not in this model's chat format", "invalid_prompt", "text")
    logprobs = None
    if body.get("return_logprob"):
        top = body.get("top_logprobs_num") or 0
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs_num must be an integer in 0..{MAX_TOP_LOGPROBS}", "invalid_value",
                              "top_logprobs_num")
        logprobs = top
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise bad_request("sampling_params must be an object", "invalid_value", "sampling_params")
    for key, value in sp.items():  # SGLang's other sampling parameters: refused unless at their neutral value
        if key not in NATIVE_SAMPLING and (key not in NATIVE_NEUTRAL or value not in (None, NATIVE_NEUTRAL[key])):
            raise bad_request(f"sampling_params.{key} is not supported on this server", "unsupported_parameter",
                              f"sampling_params.{key}")
    seed = sp.get("sampling_seed", sp.get("seed"))
    for name, value in (("max_new_tokens", sp.get("max_new_tokens")), ("sampling_seed", seed),
                        ("top_k", sp.get("top_k")), ("min_new_tokens", sp.get("min_new_tokens"))):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise bad_request(f"sampling_params.{name} must be an integer", "invalid_value", f"sampling_params.{name}")
    for name in ("temperature", "top_p", "min_p"):
        value = sp.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise bad_request(f"sampling_params.{name} must be a number", "invalid_value", f"sampling_params.{name}")
    stop = sp.get("stop")
    if stop is not None and not isinstance(stop, str) and \
            not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("sampling_params.stop must be a string or a list of strings", "invalid_value",
                          "sampling_params.stop")
    if sp.get("logit_bias") is not None and not isinstance(sp["logit_bias"], dict):
        raise bad_request("sampling_params.logit_bias must be an object", "invalid_value", "sampling_params.logit_bias")
    params = sampling_params(config, sp.get("max_new_tokens", 128), sp.get("temperature", 1.0), sp.get("top_p"),
                             sp.get("stop"), seed, "sampling_params.max_new_tokens", logprobs, sp.get("top_k"),
                             sp.get("min_p"), sp.get("logit_bias"), sp.get("min_new_tokens"))
    return GenRequest(messages=messages, params=params, prompt=raw_prompt)


# SGLang's native sampling parameters this endpoint honours, and the others it accepts at their neutral value only
NATIVE_SAMPLING = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "sampling_seed",
                             "seed", "logit_bias", "min_new_tokens"})
NATIVE_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1,
                  "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
                  "no_stop_trim": False}
