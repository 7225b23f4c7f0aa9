"""``sglang.launch_server --speculative-algorithm GLANCE`` on loopback (launched by ``launch_sglang``): one
OpenAI chat request with an image straight to SGLang, and the gateway's ``sglang`` backend returning our
``glance`` metrics from it."""

from __future__ import annotations

import json
import base64
import io
import threading
import time

import httpx
import pytest

from glance_sgl.sglang.launch import free_port, launch_sglang

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _image_url() -> str:
    from glance_sgl.demo.tasks import eval_set

    buf = io.BytesIO()
    eval_set("caption")[0].image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages():
    from glance_sgl.demo.tasks import eval_set

    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _image_url()}},
                                         {"type": "text", "text": eval_set("caption")[0].prompt}]}]


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    target, drafter, _ = checkpoints
    log = tmp_path_factory.mktemp("http") / "sglang.log"
    srv = launch_sglang(target, drafter, port=free_port(), cpu=True, log_path=log,
                        env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"},
                        extra_args=["--log-level", "warning", "--random-seed", "0"], timeout=400)
    yield srv
    srv.stop()
    assert not srv.alive()


def test_openai_chat_with_image_through_sglang(server):
    body = {"model": "default", "messages": _messages(), "max_tokens": 16, "temperature": 0,
            "return_meta_info": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    usage = out["usage"]
    assert usage["completion_tokens"] >= 1 and usage["prompt_tokens"] > 20  # the image's placeholder tokens
    info = out["choices"][0].get("meta_info") or out.get("meta_info") or {}
    print("sglang openai:", usage, {k: v for k, v in info.items() if k.startswith("spec")})
    if usage["completion_tokens"] > 1:
        assert info.get("spec_verify_ct", 0) >= 1, out


class _Gateway:
    def __init__(self, app) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "gateway did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def test_gateway_sglang_backend_returns_glance_metrics(server, checkpoints):
    server_mod = pytest.importorskip("glance_server.sglang")
    from transformers import AutoProcessor

    from glance_server.app import create_app
    from glance_server.config import ServerConfig

    target, _, _ = checkpoints
    processor = AutoProcessor.from_pretrained(str(target))
    config = ServerConfig(served_model_name="glance-sglang", api_key=None, calibrate=False, upstream_url=server.url,
                          request_timeout_s=300)
    gw = _Gateway(create_app(config, server_mod.SGLangBackend(server.url, processor, config), processor))
    try:
        body = {"model": "glance-sglang", "messages": _messages(), "max_tokens": 16, "temperature": 0}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        g = out["glance"]
        print("gateway glance:", g)
        assert g["backend"] == "sglang"
        n = out["usage"]["completion_tokens"]
        if n > 1:
            assert g["rounds"] >= 1 and g["tau"] == pytest.approx((n - 1) / g["rounds"])
            assert sum(g["acceptance_histogram"]) == g["rounds"]
    finally:
        gw.stop()


def test_gateway_on_sglang_logprobs_completions_and_refusals(server, checkpoints):
    """Issue 20 through a real GLANCE SGLang server: chat logprobs (SGLang's, from its verify pass) mapped to
    OpenAI's format and streamed; a raw-prompt completion; special-token text refused at the gateway; a prompt
    over SGLang's context length refused with a 400 before any stream opens (SGLang streams that error)."""
    from transformers import AutoProcessor

    from glance_server.app import create_app
    from glance_server.config import ServerConfig
    from glance_server.sglang import SGLangBackend

    target, _, _ = checkpoints
    processor = AutoProcessor.from_pretrained(str(target))
    config = ServerConfig(served_model_name="glance-sglang", api_key=None, calibrate=False, upstream_url=server.url,
                          request_timeout_s=300, max_prompt_chars=10 ** 6)
    gw = _Gateway(create_app(config, SGLangBackend(server.url, processor, config), processor))
    try:
        body = {"model": "glance-sglang", "messages": _messages(), "max_tokens": 8, "temperature": 0,
                "logprobs": True, "top_logprobs": 2}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        content = out["choices"][0]["logprobs"]["content"]
        assert len(content) == out["usage"]["completion_tokens"]
        for e in content:
            assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2
            assert e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"], abs=1e-4)  # greedy: the argmax
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as s:
            assert s.status_code == 200
            import json as _json

            chunks = [_json.loads(line[5:]) for line in s.iter_lines()
                      if line.startswith("data:") and line != "data: [DONE]"]
        streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for e in c["choices"][0]["logprobs"]["content"]]
        assert [e["token"] for e in streamed] == [e["token"] for e in content]
        r = httpx.post(gw.url + "/v1/completions", timeout=300,
                       json={"model": "glance-sglang", "prompt": "The order lists", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        schema = {"type": "object", "properties": {"caption": {"type": "string", "maxLength": 20}},
                  "required": ["caption"], "additionalProperties": False}
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=300, json={
            "model": "glance-sglang", "messages": _messages(), "max_tokens": 64, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "caption", "schema": schema}}})
        assert r.status_code == 200, r.text  # SGLang's grammar decodes it; GLANCE masks its tree rows by it
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and set(json.loads(choice["message"]["content"])) == {"caption"}
        bad = {**body, "messages": [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"}]}
        r = httpx.post(gw.url + "/v1/chat/completions", json={**bad, "stream": True}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "special_token_in_text", r.text
        long = {**body, "messages": [{"role": "user", "content": "word " * 40_000}], "stream": True}
        r = httpx.post(gw.url + "/v1/chat/completions", json=long, timeout=300)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "context_length_exceeded", err
    finally:
        gw.stop()
