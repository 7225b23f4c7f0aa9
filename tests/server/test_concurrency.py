"""Concurrent streaming clients, client disconnects, a full queue (429) and engine failures (503)."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from tests.server.server_helpers import API_KEY, MODEL, image_message, start_embedded

pytestmark = pytest.mark.timeout(240)


def request(i: int) -> dict:
    """16 different requests: text or image, greedy or seeded sampling."""
    messages = image_message(f"describe picture {i}", seed=100 + i) if i % 3 == 0 else \
        [{"role": "user", "content": f"question number {i}: what is left of the chart"}]
    extra = {"temperature": 0.9, "seed": 1000 + i} if i % 2 else {"temperature": 0}
    return {"model": MODEL, "messages": messages, "max_tokens": 6, **extra}


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_16_concurrent_streams_match_sequential(gateway):
    async def run() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=180)

        async def one(i: int) -> str:
            stream = await client.chat.completions.create(**request(i), stream=True)
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return "".join(parts)

        sequential = []
        for i in range(16):
            r = await client.chat.completions.create(**request(i))
            sequential.append(r.choices[0].message.content)
        concurrent = await asyncio.gather(*(one(i) for i in range(16)))
        await client.close()
        return sequential, list(concurrent)

    sequential, concurrent = asyncio.run(run())
    assert concurrent == sequential
    assert len(set(sequential)) > 1  # the requests really differ


def long_stream(url: str, headers: dict, prompt: str):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 500,
            "temperature": 0, "stream": True}
    return httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_disconnect_frees_the_slot(gateway, auth, long_prompt):
    before = httpx.get(gateway.url + "/metrics").text
    with long_stream(gateway.url, auth, long_prompt) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got
    # the client is gone: the next request is served promptly (the long one would take many seconds)
    t0 = time.perf_counter()
    r = httpx.post(gateway.url + "/v1/chat/completions", headers=auth, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200
    assert r.json()["glance"]["queue_ms"] < 3000 and elapsed < 10
    after = httpx.get(gateway.url + "/metrics").text
    name = 'glance_generations_total{finish_reason="cancelled"}'
    assert metric(after, name) == metric(before, name) + 1
    assert metric(after, "glance_in_flight") == 0 and metric(after, "glance_queue_depth") == 0


def test_non_streaming_client_timeout_cancels(gateway, auth, long_prompt):
    before = metric(httpx.get(gateway.url + "/metrics").text, 'glance_generations_total{finish_reason="cancelled"}')
    body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 500,
            "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=auth, timeout=0.5)
    deadline = time.time() + 20
    while time.time() < deadline:
        text = httpx.get(gateway.url + "/metrics").text
        if metric(text, 'glance_generations_total{finish_reason="cancelled"}') == before + 1:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the abandoned request was not cancelled")
    assert metric(text, "glance_in_flight") == 0


def wait_for(url: str, **expected) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        ready = httpx.get(url + "/ready").json()
        if all(ready[k] == v for k, v in expected.items()):
            return
        time.sleep(0.02)
    pytest.fail(f"/ready never showed {expected}: {ready}")


def test_full_queue_answers_429_with_retry_after(engine, long_prompt):
    server = start_embedded(engine, api_key=None, max_queue=1)
    try:
        with long_stream(server.url, {}, long_prompt) as running:
            assert running.status_code == 200
            running_lines = running.iter_lines()  # keep the iterator: dropping it closes the connection
            next(running_lines)
            wait_for(server.url, in_flight=1, queued=0)
            with long_stream(server.url, {}, long_prompt) as queued:
                assert queued.status_code == 200
                wait_for(server.url, in_flight=1, queued=1)
                r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 429
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["code"] == "queue_full"
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200
    finally:
        server.stop()


def test_engine_failure_answers_503_and_recovers(gateway, auth):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "temperature": 0}
    for _ in range(2):
        r = httpx.post(gateway.url + "/v1/chat/completions", headers=auth, timeout=60,
                       json={**body, "glance": {"debug_fault": "engine_error"}})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
    # streaming: the failure arrives as an error event, then [DONE]
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", headers=auth, timeout=60,
                      json={**body, "stream": True, "glance": {"debug_fault": "engine_error"}}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert '"engine_error"' in events[-2] and events[-1] == "data: [DONE]"
    r = httpx.post(gateway.url + "/v1/chat/completions", headers=auth, json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(gateway.url + "/ready").status_code == 200
    assert metric(httpx.get(gateway.url + "/metrics").text, "glance_engine_errors_total") >= 3
