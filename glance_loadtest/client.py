"""The HTTP side: one ``httpx.AsyncClient`` pinned to the target's base URL, requests timed into records.

Safety: the client talks to its base URL only (requests to any other host or port are refused before they
leave, redirects are not followed, proxy settings from the environment are ignored) and every request has a
deadline. Images travel as data URLs, so the gateway is never asked to fetch anything.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from .dataset import Item
from .stats import RequestRecord

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


class TargetError(ValueError):
    """The base URL is not something this harness will load."""


def check_target(url: str) -> tuple[str, bool]:
    """Validates the base URL the user named; returns it normalised and whether it is loopback."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetError(f"--url must be http(s)://HOST[:PORT], got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise TargetError(f"--url must be the gateway's base URL without a path or credentials, got {url!r}")
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() in LOOPBACK_NAMES
    return f"{parts.scheme}://{parts.netloc}", loopback


def _error_code(response_text: str) -> str:
    try:
        body = json.loads(response_text)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            return str(err.get("code") or err.get("type") or "error")
        if isinstance(err, str):
            return "error"
    except ValueError:
        pass
    return "non_json"


def classify(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect_timeout"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect_error"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return "disconnected"
    if isinstance(exc, httpx.HTTPError):
        return type(exc).__name__
    return f"client_{type(exc).__name__}"


class GatewayClient:
    """Sends chat / multipart requests to one gateway and returns :class:`RequestRecord` s."""

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None,
                 request_timeout: float = 120.0, connect_timeout: float = 5.0, max_connections: int = 64,
                 clock0: float | None = None) -> None:
        self.base_url, self.loopback = check_target(url)
        self.model = model
        self.request_timeout = request_timeout
        self.clock0 = time.perf_counter() if clock0 is None else clock0
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        target = httpx.URL(self.base_url)

        async def pin(request: httpx.Request) -> None:
            if (request.url.host, request.url.port) != (target.host, target.port):
                raise TargetError(f"refusing a request to {request.url.host}: only {self.base_url} is loaded")

        self.http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, follow_redirects=False, trust_env=False,
            timeout=httpx.Timeout(request_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            event_hooks={"request": [pin]})
        self.records: list[RequestRecord] = []  # every request, in the order sent (cancelled ones too)

    async def aclose(self) -> None:
        await self.http.aclose()

    def now(self) -> float:
        return time.perf_counter() - self.clock0

    # ---------------------------------------------------------------------------------------------- helpers
    async def get(self, path: str) -> httpx.Response:
        return await self.http.get(path)

    async def discover_model(self) -> str | None:
        """The first model id the gateway serves (``GET /v1/models``), or None."""
        try:
            r = await self.http.get("/v1/models")
            if r.status_code == 200:
                data = r.json().get("data") or []
                return data[0]["id"] if data else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass
        return None

    async def scrape(self) -> str | None:
        """``GET /metrics`` text, or None when the target has none."""
        try:
            r = await self.http.get("/metrics")
            return r.text if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def _record(self, task: str, endpoint: str, stream: bool, n_images: int) -> RequestRecord:
        rec = RequestRecord(index=len(self.records), task=task, endpoint=endpoint, stream=stream,
                            n_images=n_images, start_s=self.now())
        self.records.append(rec)
        return rec

    def _finish(self, rec: RequestRecord, t0: float) -> RequestRecord:
        rec.end_s = self.now()
        rec.e2e_ms = (time.perf_counter() - t0) * 1000.0
        return rec

    @staticmethod
    def _absorb(rec: RequestRecord, usage: dict | None, glance: dict | None) -> None:
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.completion_tokens = usage.get("completion_tokens")
        if glance:
            rec.mode = glance.get("mode")
            rec.tau = glance.get("tau")
            rec.tau_minus_1 = glance.get("tau_minus_1")
            rec.rounds = glance.get("rounds")
            rec.drafted_tokens = glance.get("drafted_tokens")
            rec.accepted_tokens = glance.get("accepted_tokens")
            rec.acceptance_rate = glance.get("acceptance_rate")
            rec.queue_ms = glance.get("queue_ms")
            rec.planner = glance.get("planner")
            rows = glance.get("rows_histogram")
            if rows and sum(rows.values()):
                rec.mean_rows_per_round = sum(int(r) * n for r, n in rows.items()) / sum(rows.values())
            rec.rounds_without_drafting = glance.get("rounds_without_drafting")
            rec.predicted_tokens_per_round = glance.get("predicted_tokens_per_round")
            rec.estimated_speedup = glance.get("estimated_speedup")
            measured = glance.get("measured") or {}
            rec.measured_speedup = measured.get("decode_speedup")
            rec.lossless_match = measured.get("lossless_match")

    # ---------------------------------------------------------------------------------------------- requests
    def chat_body(self, item: Item, *, stream: bool, max_tokens: int, temperature: float = 0.0,
                  seed: int | None = None, mode: str | None = None, measure_speedup: bool = False) -> dict:
        body: dict[str, Any] = {"messages": item.messages(), "max_tokens": max_tokens, "temperature": temperature,
                                "stream": stream}
        if self.model:
            body["model"] = self.model
        if stream:
            body["stream_options"] = {"include_usage": True}
        if seed is not None:
            body["seed"] = seed
        glance = {k: v for k, v in (("mode", mode), ("measure_speedup", measure_speedup or None)) if v}
        if glance:
            body["glance"] = glance
        return body

    async def chat(self, item: Item, *, task: str, stream: bool, max_tokens: int, **options: Any) -> RequestRecord:
        """``POST /v1/chat/completions``; streaming requests are timed chunk by chunk."""
        body = self.chat_body(item, stream=stream, max_tokens=max_tokens, **options)
        rec = self._record(task, "chat", stream, len(item.pictures))
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.request_timeout):
                if stream:
                    await self._chat_stream(rec, body, t0)
                else:
                    r = await self.http.post("/v1/chat/completions", json=body)
                    rec.status = r.status_code
                    if r.status_code != 200:
                        rec.error, rec.error_message = f"http_{r.status_code}:{_error_code(r.text)}", r.text[:300]
                    else:
                        data = r.json()
                        choice = (data.get("choices") or [{}])[0]
                        rec.finish_reason = choice.get("finish_reason")
                        self._absorb(rec, data.get("usage"), data.get("glance"))
                        rec.ok = True
        except asyncio.CancelledError:
            rec.error, rec.ok = "cancelled", False
            self._finish(rec, t0)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a typed record
            rec.ok = False
            rec.error, rec.error_message = classify(exc), repr(exc)[:300]
        return self._finish(rec, t0)

    async def _chat_stream(self, rec: RequestRecord, body: dict, t0: float) -> None:
        last: float | None = None
        done = False
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                rec.error, rec.error_message = f"http_{r.status_code}:{_error_code(text)}", text[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(payload)
                except ValueError:
                    rec.error, rec.error_message = "bad_stream_chunk", payload[:300]
                    return
                if "error" in obj:
                    err = obj["error"] if isinstance(obj["error"], dict) else {}
                    rec.error = f"stream_error:{err.get('code') or err.get('type') or 'error'}"
                    rec.error_message = str(err.get("message"))[:300]
                    continue
                for choice in obj.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if last is None:
                            rec.ttft_ms = (now - t0) * 1000.0
                        else:
                            rec.itl_ms.append((now - last) * 1000.0)
                        last = now
                        rec.chunks += 1
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                if obj.get("usage") or obj.get("glance"):
                    self._absorb(rec, obj.get("usage"), obj.get("glance"))
        if rec.error is None and not done:
            rec.error = "stream_incomplete"
        rec.ok = rec.error is None

    async def generate(self, item: Item, *, task: str, max_tokens: int, temperature: float = 0.0,
                       mode: str | None = None, measure_speedup: bool = False, seed: int | None = None,
                       **_: Any) -> RequestRecord:
        """``POST /v1/generate`` (multipart: image files + prompt)."""
        rec = self._record(task, "generate", False, len(item.pictures))
        data = {"prompt": item.prompt, "max_tokens": str(max_tokens), "temperature": str(temperature)}
        if mode:
            data["mode"] = mode
        if measure_speedup:
            data["measure_speedup"] = "true"
        if seed is not None:
            data["seed"] = str(seed)
        files = [("image", (f"image{k}.png", p.png, "image/png")) for k, p in enumerate(item.pictures)]
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.request_timeout):
                r = await self.http.post("/v1/generate", data=data, files=files or None)
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error, rec.error_message = f"http_{r.status_code}:{_error_code(r.text)}", r.text[:300]
            else:
                out = r.json()
                rec.finish_reason = out.get("finish_reason")
                self._absorb(rec, out.get("usage"), out.get("glance"))
                rec.ok = True
        except asyncio.CancelledError:
            rec.error = "cancelled"
            self._finish(rec, t0)
            raise
        except Exception as exc:  # noqa: BLE001
            rec.error, rec.error_message = classify(exc), repr(exc)[:300]
        return self._finish(rec, t0)
