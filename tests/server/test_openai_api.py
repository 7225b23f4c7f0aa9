"""The OpenAI-compatible chat endpoint through the real `openai` client, and the `glance` metrics."""

from __future__ import annotations

import httpx
import openai
import pytest

from glance_sgl.engine import SamplingParams

from server_helpers import API_KEY, MODEL, check_glance, image_message, png_bytes

pytestmark = pytest.mark.timeout(180)


def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def engine_reference(engine, messages_pil, **params):
    return engine.generate(messages_pil, SamplingParams(**params))


def test_chat_with_image_matches_engine_and_reports_metrics(gateway, engine):
    resp = client(gateway).chat.completions.create(
        model=MODEL, messages=image_message("what colour is the square", seed=3), max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    glance = resp.model_extra["glance"]
    assert glance["backend"] == "embedded" and glance["mode"] == "glance"
    check_glance(glance, resp.usage.completion_tokens)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert glance["estimated_ar_ms_per_token"] > 0 and glance["estimated_speedup"] > 0  # calibrated at start
    # the same request straight through the engine, autoregressively: identical text (lossless, greedy)
    from PIL import Image
    import io

    pil = Image.open(io.BytesIO(png_bytes(3))).convert("RGB")
    ref = engine.generate([{"role": "user", "content": [{"type": "image", "image": pil},
                                                        {"type": "text", "text": "what colour is the square"}]}],
                          SamplingParams(max_tokens=12, temperature=0), mode="ar")
    assert choice.message.content == ref.text
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.prompt_tokens == ref.metrics.prompt_tokens


def test_streaming_matches_non_streaming_and_carries_glance_last(gateway):
    c = client(gateway)
    kwargs = dict(model=MODEL, messages=image_message("describe the picture", seed=5), max_tokens=14,
                  temperature=0.8, seed=1234)
    full = c.chat.completions.create(**kwargs)
    chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content  # seeded sampling is reproducible
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == full.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    check_glance(last.model_extra["glance"], last.usage.completion_tokens)
    # without include_usage the glance object rides on the finish_reason chunk
    chunks = list(c.chat.completions.create(**kwargs, stream=True))
    assert chunks[-1].choices[0].finish_reason and chunks[-1].model_extra["glance"]["completion_tokens"] > 0
    assert all(ch.usage is None for ch in chunks)


def test_measure_speedup_is_lossless(gateway):
    resp = client(gateway).chat.completions.create(
        model=MODEL, messages=image_message("read the text", seed=8), max_tokens=16, temperature=0,
        extra_body={"glance": {"measure_speedup": True}})
    glance = resp.model_extra["glance"]
    check_glance(glance, resp.usage.completion_tokens)
    measured = glance["measured"]
    assert measured["lossless_match"] is True
    assert measured["ar_completion_tokens"] == resp.usage.completion_tokens
    assert measured["decode_speedup"] > 0 and measured["e2e_speedup"] > 0
    assert measured["ar_decode_ms_per_token"] > 0
    # at T > 0 without a seed the server picks one for both runs: still token-identical
    resp = client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tell me a story"}], max_tokens=10, temperature=1.0,
        extra_body={"glance": {"measure_speedup": True}})
    assert resp.model_extra["glance"]["measured"]["lossless_match"] is True


def test_modes_stop_and_max_completion_tokens(gateway):
    c = client(gateway)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count the shapes"}]
    outs = {}
    for mode in ("glance", "chain", "ar"):
        r = c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                      extra_body={"glance": {"mode": mode}})
        glance = r.model_extra["glance"]
        assert glance["mode"] == mode
        check_glance(glance, r.usage.completion_tokens)
        outs[mode] = r.choices[0].message.content
        if mode == "ar":
            assert glance["rounds"] == glance["decode_tokens"] and glance["drafted_tokens"] == 0
    assert outs["glance"] == outs["chain"] == outs["ar"]
    text = outs["glance"]
    if len(text) > 3:  # a stop string cuts the text before it
        stop = text[2:4]
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content


def test_models_health_ready_metrics(gateway, auth):
    models = client(gateway).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(gateway.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(gateway.url + "/ready").json()
    assert ready["status"] == "ready" and ready["queued"] == 0
    text = httpx.get(gateway.url + "/metrics").text  # open without the API key (scrapers)
    for name in ("glance_requests_total", "glance_request_latency_seconds_bucket", "glance_ttft_seconds_bucket",
                 "glance_completion_tokens_total", "glance_prompt_tokens_total", "glance_tau_bucket",
                 "glance_speedup_bucket", "glance_queue_depth", "glance_in_flight"):
        assert name in text, name
    assert 'glance_requests_total{route="/v1/chat/completions",status="200"}' in text
