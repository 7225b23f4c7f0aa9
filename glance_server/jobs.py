"""What the routes hand to a backend and get back: requests, jobs with streamed events, outcomes.

A :class:`Job` is one request in a backend. Its producer (the engine worker thread or an upstream task) posts
events thread-safely; the route consumes them with :meth:`Job.next_event`: ``("delta", text)`` pieces, then exactly
one ``("done", GenOutput)`` or ``("error", APIError)``. Cancelling a job (client gone, timeout) frees its slot:
a queued job never runs, a running one stops at the next round.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from glance_sgl.engine import SamplingParams, TokenLogprob
from glance_sgl.special_tokens import SpecialTokenGuard, special_token_message

from .errors import APIError


@dataclass
class GenRequest:
    """A validated request: engine-format messages (PIL images in ``{"type": "image"}`` parts), or a raw text
    ``prompt`` (legacy completions: no chat template; ``messages`` empty)."""

    messages: list[dict[str, Any]]
    params: SamplingParams
    mode: str | None = None  # "glance" | "chain" | "ar" | None (the backend's default)
    planner: str | None = None  # "auto" | "fixed" | None (the backend's default); mode "glance" only
    measure_speedup: bool = False
    debug_fault: str | None = None
    prompt: str | None = None
    json_schema: str | None = None  # response_format as a JSON schema (SGLang's grammar), or None: free text
    prepared: Any = None  # the backend's prepared model inputs (embedded: a PreparedPrompt), set by prepare()
    draft_sources: tuple[str, ...] | None = None  # candidate sources (mode "glance"), None: the server's
    tenant: str | None = None  # the API key's identity (a hash, never the key; app.key_identity), None: anonymous
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class GenOutput:
    """A finished generation with the ``glance`` metrics object (see ``protocol.glance_object``)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    glance: dict[str, Any]
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them


class Job:
    """One request inside a backend, with a thread-safe event channel to the asyncio side."""

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.cancelled = threading.Event()
        self.accepted = False  # True: the request can no longer be refused, a stream may open before any event
        self._events: asyncio.Queue = asyncio.Queue()
        self._on_cancel: list[Any] = []
        self.on_finish: Any = None  # called on the loop with ("done", GenOutput) / ("error", APIError)

    # producer side (any thread)
    def post(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver, kind, payload)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def _deliver(self, kind: str, payload: Any) -> None:
        self._events.put_nowait((kind, payload))
        if kind in ("done", "error") and self.on_finish is not None:
            self.on_finish(kind, payload)  # whether or not a client is still listening

    @property
    def queue_ms(self) -> float:
        return ((self.started or time.perf_counter()) - self.submitted) * 1000.0

    # consumer side (event loop)
    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancelled.set()
            for callback in self._on_cancel:
                callback()

    def on_cancel(self, callback) -> None:
        self._on_cancel.append(callback)

    async def next_event(self) -> tuple[str, Any]:
        return await self._events.get()


class Backend:
    """The interface both backends implement."""

    name = "base"
    default_mode = "glance"
    guard: SpecialTokenGuard | None = None  # the model's special-token strings, refused in user text
    tokens: Any = None  # logprobs.TokenTable of the model's tokenizer (token strings for logprobs)

    def check_text(self, request: GenRequest) -> None:
        """400 ``special_token_in_text`` when a message (or the raw prompt) holds a special-token string."""
        if self.guard is None:
            return
        hit = self.guard.check_messages(request.prompt if request.prompt is not None else request.messages)
        if hit is not None:
            raise APIError(400, special_token_message(*hit), "special_token_in_text", hit[0])

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def check_ready(self) -> tuple[bool, str]:
        """(ready, reason) for ``GET /ready``."""
        return True, "ok"

    async def prepare(self, request: GenRequest) -> None:
        """Work done before queueing that can refuse the request (400): tokenisation, context length."""

    def submit(self, request: GenRequest) -> Job:
        """Queue a request; raises APIError 429 when the queue is full, 503 when the backend cannot serve."""
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """``{"queued": waiting requests, "in_flight": running requests}``."""
        return {"queued": 0, "in_flight": 0}

    def supervision(self) -> dict[str, int] | None:
        """A supervised upstream's ``{"restarts": restarts so far, "up": 1 while it serves}`` for ``/metrics``;
        None when the backend supervises nothing."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}


def queue_full(retry_after_s: float, queued: int) -> APIError:
    secs = max(1, min(60, int(retry_after_s + 0.999)))
    return APIError(429, f"the server is busy ({queued} requests queued); retry after {secs} s", "queue_full",
                    headers={"Retry-After": str(secs)})
