"""The ``sglang`` backend against a second gateway answering SGLang's native ``POST /generate`` on loopback."""

from __future__ import annotations

import httpx
import openai
import pytest

from glance_server.app import create_app
from glance_server.sglang import SGLangBackend, parse_prompt, render_prompt
from tests.server.server_helpers import API_KEY, MODEL, ServerThread, base_config, data_url, image_message, png_bytes

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


def test_sampling_filters_and_logit_rules_reach_the_upstream(gateway, sglang_gateway, engine):
    """The sampling filters and logit rules travel to SGLang's ``/generate`` (``top_k``, ``min_p``,
    ``min_new_tokens``, ``logit_bias``): a request through the SGLang backend decodes what the embedded backend
    decodes under the same parameters, and not what it decodes without them."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "tell me a story about a robot"}],
                  max_tokens=12, temperature=1.5, seed=5)
    direct = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0).chat.completions
    proxied = openai.OpenAI(base_url=sglang_gateway.url + "/v1", api_key="unused", max_retries=0).chat.completions
    filtered = proxied.create(**kwargs, extra_body={"top_k": 2, "min_p": 0.2}).choices[0].message.content
    assert filtered == direct.create(**kwargs, extra_body={"top_k": 2, "min_p": 0.2}).choices[0].message.content
    assert filtered != direct.create(**kwargs).choices[0].message.content
    rules = {"min_tokens": 5, "logit_bias": {str(min(engine.eos_ids)): 100}}  # SGLang's min_new_tokens, logit_bias
    kwargs = dict(model=MODEL, messages=image_message("what colour is the square", seed=3), max_tokens=24,
                  temperature=0)
    ruled = proxied.create(**kwargs, extra_body=rules)
    direct_ruled = direct.create(**kwargs, extra_body=rules)
    assert ruled.choices[0].message.content == direct_ruled.choices[0].message.content
    assert ruled.usage.completion_tokens == direct_ruled.usage.completion_tokens == 6  # 5 tokens, then the EOS


def test_n_choices_through_sglang_backend(gateway, sglang_gateway):
    """``n`` seeded choices through the SGLang backend: one upstream request per choice, choice i seeded ``seed +
    i``: the embedded backend's choices, streamed too."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "tell me a story about a robot"}],
                  max_tokens=10, temperature=1.0, seed=11, n=2)
    direct = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0).chat.completions
    proxied = openai.OpenAI(base_url=sglang_gateway.url + "/v1", api_key="unused", max_retries=0).chat.completions
    want = [ch.message.content for ch in direct.create(**kwargs).choices]
    got = proxied.create(**kwargs)
    assert [ch.message.content for ch in got.choices] == want and want[0] != want[1]
    texts = ["", ""]
    for chunk in proxied.create(**kwargs, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == want
    # the largest seed: choice 1's seed wraps to -2**63, which SGLang takes (seed + 1 it would refuse)
    edge = dict(kwargs, seed=2**63 - 1)
    assert [ch.message.content for ch in proxied.create(**edge).choices] == \
        [ch.message.content for ch in direct.create(**edge).choices]


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


def test_logprobs_and_completions_through_sglang_backend(gateway, sglang_gateway):
    """SGLang's ``output_token_logprobs`` / ``output_top_logprobs`` mapped to OpenAI's formats (chat and
    legacy completions, streamed and not); the upstream here is the first gateway's SGLang-native route."""
    direct = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0)
    proxied = openai.OpenAI(base_url=sglang_gateway.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "tell me a story"}], max_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=2)
    want = direct.chat.completions.create(**kwargs).choices[0].logprobs.content
    got = proxied.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert [(e.token, e.bytes) for e in got] == [(e.token, e.bytes) for e in want]
    for a, b in zip(got, want):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs] and len(a.top_logprobs) == 2
    chunks = list(proxied.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in got]
    # legacy completions, a raw prompt: the same text and logprobs as the embedded gateway's
    ckw = dict(model=MODEL, prompt="once upon a time", max_tokens=5, temperature=0, logprobs=1)
    want_c, got_c = direct.completions.create(**ckw).choices[0], proxied.completions.create(**ckw).choices[0]
    assert got_c.text == want_c.text and got_c.logprobs.tokens == want_c.logprobs.tokens
    assert got_c.logprobs.token_logprobs == pytest.approx(want_c.logprobs.token_logprobs, abs=1e-5)
    streamed = list(proxied.completions.create(**ckw, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want_c.text
    assert proxied.models.retrieve(MODEL).model_extra["glance"]["backend"] == "sglang"


def test_sglang_stream_error_chunk_before_output_is_a_400(engine):
    """SGLang streams its validation errors (HTTP 200, then ``data: {"error": {"code": 400, ...}}``, as
    ``sglang.srt.entrypoints.http_server`` writes them): refused before any output, the gateway answers a 400
    before its own stream opens, SGLang's context-length message mapped to ``context_length_exceeded``."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Upstream(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            err = {"error": {"message": "The input (9000 tokens) is longer than the model's context length (4096 "
                             "tokens).", "type": "invalid_request_error", "code": 400, "retryable": False}}
            body = b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{upstream.server_address[1]}"
    config = base_config(api_key=None, upstream_url=url)
    server = ServerThread(create_app(config, SGLangBackend(url, engine.target.processor, config),
                                     engine.target.processor))
    try:
        for stream in (True, False):
            r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                 "stream": stream})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        server.stop()
        upstream.shutdown()
