"""The ``sglang`` backend against a second gateway answering SGLang's native ``POST /generate`` on loopback."""

from __future__ import annotations

import httpx
import openai
import pytest

from glance_server.app import create_app
from glance_server.sglang import SGLangBackend, parse_prompt, render_prompt
from server_helpers import API_KEY, MODEL, ServerThread, base_config, data_url, image_message, png_bytes

pytestmark = pytest.mark.timeout(180)


def test_chat_through_sglang_backend_matches_embedded(gateway, sglang_gateway):
    kwargs = dict(model=MODEL, messages=image_message("what colour is the square", seed=21), max_tokens=12,
                  temperature=0)
    direct = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        **kwargs)
    proxied_client = openai.OpenAI(base_url=sglang_gateway.url + "/v1", api_key="unused", max_retries=0)
    proxied = proxied_client.chat.completions.create(**kwargs)
    assert proxied.choices[0].message.content == direct.choices[0].message.content
    assert proxied.choices[0].finish_reason == direct.choices[0].finish_reason
    assert proxied.usage.completion_tokens == direct.usage.completion_tokens
    assert proxied.usage.prompt_tokens == direct.usage.prompt_tokens
    g, d = proxied.model_extra["glance"], direct.model_extra["glance"]
    assert g["backend"] == "sglang" and g["mode"] == "glance"
    # SGLang's meta_info mapped back onto the same metrics. The planner learns across requests (its probe
    # back-off, entropy table and calibration), so the second run of the same request may draft differently:
    # the tokens are the same, and the mapped metrics must be consistent with each other
    assert g["decode_tokens"] == d["decode_tokens"]
    assert g["rounds"] >= 1 and 0 <= g["accepted_tokens"] <= g["drafted_tokens"]
    assert g["rounds"] + g["accepted_tokens"] >= g["decode_tokens"]  # each round commits accepted + 1 at most
    assert sum(g["acceptance_histogram"]) == g["rounds"]
    assert g["committed_per_round"] is None  # SGLang does not report it
    assert g["rows_histogram"] is None and g["planner"] is None  # nor the rows or the planner of its rounds
    assert g["prefill_ms"] >= 0 and g["decode_ms"] >= 0
    # streaming through the proxy
    chunks = list(proxied_client.chat.completions.create(**kwargs, stream=True,
                                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.choices[0].message.content
    assert chunks[-1].model_extra["glance"]["rounds"] == d["rounds"]


def test_native_generate_format(gateway, engine, auth):
    messages = [{"role": "user", "content": [{"type": "image", "image": None}, {"type": "text", "text": "hi"}]}]
    from PIL import Image
    import io

    messages[0]["content"][0]["image"] = Image.open(io.BytesIO(png_bytes(4))).convert("RGB")
    text, images = render_prompt(engine.target.processor, messages)
    assert parse_prompt(text, images)[0]["content"][1] == {"type": "text", "text": "hi"}
    body = {"text": text, "image_data": [data_url(png_bytes(4))],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    r = httpx.post(gateway.url + "/generate", json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 8
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]
    # refused: a file path or URL in image_data, a prompt not in the chat format, placeholders without images
    for bad in ({**body, "image_data": ["/etc/passwd"]}, {**body, "image_data": ["http://127.0.0.1/x.png"]},
                {**body, "text": "plain text"}, {**body, "image_data": []}):
        r = httpx.post(gateway.url + "/generate", json=bad, headers=auth, timeout=30)
        assert r.status_code == 400, (bad.get("image_data"), r.text)


def test_sglang_backend_errors(engine):
    # nothing listens on this port: 503 from the gateway, /ready says not ready
    config = base_config(api_key=None, upstream_url="http://127.0.0.1:9", upstream_connect_timeout_s=2)
    backend = SGLangBackend("http://127.0.0.1:9", engine.target.processor, config)
    server = ServerThread(create_app(config, backend, engine.target.processor))
    try:
        assert httpx.get(server.url + "/ready").status_code == 503
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "glance": {"measure_speedup": True}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "glance": {"planner": "fixed"}})  # SGLang plans per batch, by its own setting
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unsupported_parameter" and err["param"] == "glance.planner"
    finally:
        server.stop()


def test_sglang_backend_relays_upstream_rejections(gateway, engine):
    """A wrong upstream key is the upstream's 401: the client gets a clear error, not a hang."""
    config = base_config(api_key=None, upstream_url=gateway.url, upstream_api_key="wrong")
    backend = SGLangBackend(gateway.url, engine.target.processor, config)
    server = ServerThread(create_app(config, backend, engine.target.processor))
    try:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_auth"
        assert "API key" in r.json()["error"]["message"]
    finally:
        server.stop()
