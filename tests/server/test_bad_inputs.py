"""A table of bad requests: each gets the right 4xx with an OpenAI-style error body, and the gateway still
answers a correct request afterwards. SSRF cases only check that the gateway REFUSES: nothing is ever sent
anywhere but loopback (the one remote fetch that happens goes to 127.0.0.2, a trusted test network)."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading

import httpx
import pytest
from PIL import Image

from server_helpers import MODEL, data_url, image_message, png_bytes

pytestmark = pytest.mark.timeout(180)


class _Handler(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []
    redirect_to = ""

    def do_GET(self):  # noqa: N802
        type(self).hits.append(self.path)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", type(self).redirect_to)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = png_bytes(42)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve(host: str):
    handler = type(f"Handler_{host.replace('.', '_')}", (_Handler,), {"hits": []})
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


@pytest.fixture(scope="module")
def image_hosts():
    """An image host on 127.0.0.2 (trusted) that redirects to a sentinel on 127.0.0.1 (must never be hit)."""
    sentinel, sentinel_handler = _serve("127.0.0.1")
    trusted, trusted_handler = _serve("127.0.0.2")
    trusted_handler.redirect_to = f"http://127.0.0.1:{sentinel.server_address[1]}/img.png"
    yield f"http://127.0.0.2:{trusted.server_address[1]}", sentinel_handler, trusted_handler
    sentinel.shutdown()
    trusted.shutdown()


def chat(url_or_text=None, **extra) -> dict:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": image_message("what is this") if url_or_text is None else url_or_text}
    body.update(extra)
    return body


def with_url(url: str) -> dict:
    return chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                              {"type": "text", "text": "what is this"}]}])


def truncated_png() -> str:
    data = png_bytes(1)
    return data_url(data[: len(data) // 2])


def huge_png() -> str:
    buf = io.BytesIO()
    Image.new("1", (7072, 7072)).save(buf, format="PNG")  # 50 megapixels, a few KB compressed
    return data_url(buf.getvalue())


BAD = [
    # (name, body or raw, expected status, expected error code)
    ("invalid base64", with_url("data:image/png;base64,@@not-base64@@"), 400, "invalid_base64"),
    ("not an image", with_url(data_url(b"hello, I am plain text, not a picture")), 400, "invalid_image"),
    ("truncated png", with_url(truncated_png()), 400, "invalid_image"),
    ("50-megapixel image", with_url(huge_png()), 400, "image_too_many_pixels"),
    ("too many images", chat(image_message("three", n_images=3)), 400, "too_many_images"),
    ("unsupported content part", chat([{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]), 400,
     "unsupported_content_part"),
    ("non-image data URL", with_url("data:text/plain;base64,aGVsbG8="), 400, "invalid_image_url"),
    ("file URL", with_url("file:///etc/passwd"), 400, "invalid_image_url"),
    ("SSRF 127.0.0.1", with_url("http://127.0.0.1:9/a.png"), 400, "image_url_forbidden_address"),
    ("SSRF metadata 169.254.169.254", with_url("http://169.254.169.254/latest/meta-data/"), 400,
     "image_url_forbidden_address"),
    ("SSRF [::1]", with_url("http://[::1]:9/a.png"), 400, "image_url_forbidden_address"),
    ("SSRF localhost name", with_url("http://localhost:9/a.png"), 400, "image_url_forbidden_address"),
    ("SSRF IPv4-mapped IPv6", with_url("http://[::ffff:127.0.0.1]:9/a.png"), 400, "image_url_forbidden_address"),
    ("SSRF 0.0.0.0", with_url("http://0.0.0.0:9/a.png"), 400, "image_url_forbidden_address"),
    ("host not on the allowlist", with_url("http://images.example.com/a.png"), 400, "image_host_not_allowed"),
    ("empty messages", chat([]), 400, "invalid_value"),
    ("n=2", chat(n=2), 400, "unsupported_parameter"),
    ("negative max_tokens", chat(max_tokens=-5), 400, "invalid_value"),
    ("max_tokens over the limit", chat(max_tokens=100_000), 400, "invalid_value"),
    ("temperature out of range", chat(temperature=7), 400, "invalid_value"),
    ("tool role", chat([{"role": "tool", "content": "x"}]), 400, "invalid_value"),
    ("image in an assistant message", chat([{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(0))}}]}]), 400, "invalid_value"),
    ("string max_tokens", chat(max_tokens="12"), 400, "invalid_request"),
    ("missing messages", {"model": MODEL}, 400, "invalid_request"),
    ("unknown model", chat(model="gpt-4o"), 404, "model_not_found"),
    ("invalid JSON", b"{not json", 400, "invalid_request"),
    ("logprobs", chat(logprobs=True), 400, "unsupported_parameter"),
]


@pytest.mark.parametrize("name,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_refused(gateway, auth, name, body, status, code):
    kwargs = {"content": body, "headers": {**auth, "content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": auth}
    r = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert err["message"] and err["type"]


def test_remote_url_refused_when_remote_images_are_off(plain_gateway):
    r = httpx.post(plain_gateway.url + "/v1/chat/completions", json=with_url("https://example.com/cat.png"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "remote_images_disabled"


def test_redirect_to_loopback_is_refused_and_never_followed(gateway, auth, image_hosts):
    base, sentinel, trusted = image_hosts
    r = httpx.post(gateway.url + "/v1/chat/completions", json=with_url(base + "/redirect"), headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_url_forbidden_address", r.text
    assert trusted.hits == ["/redirect"] and sentinel.hits == []
    # the trusted host itself serves images fine (the fetch path works end to end)
    r = httpx.post(gateway.url + "/v1/chat/completions", json=with_url(base + "/img.png"), headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    assert sentinel.hits == []


def test_oversize_body(gateway, auth):
    big = chat(with_url(data_url(b"\0" * (3 * 1024 * 1024)))["messages"])
    r = httpx.post(gateway.url + "/v1/chat/completions", json=big, headers=auth, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # chunked upload without a Content-Length is cut off too
    payload = json.dumps(big).encode()

    def chunks():
        for i in range(0, len(payload), 65536):
            yield payload[i: i + 65536]

    r = httpx.post(gateway.url + "/v1/chat/completions", content=chunks(),
                   headers={**auth, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 413


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "Basic dGVzdA==", "Bearer test-key-1234"])
def test_wrong_api_key(gateway, header):
    headers = {"Authorization": header} if header else {}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=chat(), headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(gateway.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(gateway.url + "/health").status_code == 200  # probes stay open


def test_correct_request_after_the_bad_ones(gateway, auth):
    r = httpx.post(gateway.url + "/v1/chat/completions", json=chat(max_tokens=6), headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["message"]["content"] is not None
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'glance_requests_total{route="/v1/chat/completions",status="400"}' in metrics


def test_raw_base64_payload_validation_is_strict():
    from glance_server.config import ServerConfig
    from glance_server.errors import APIError
    from glance_server.images import decode_data_url

    good = data_url(png_bytes(0))
    assert decode_data_url(good, ServerConfig(), "x").size == (112, 112)
    with pytest.raises(APIError) as exc:
        decode_data_url(good[:-3] + "!!!", ServerConfig(), "x")
    assert exc.value.code == "invalid_base64"
    assert base64.b64decode(good.split(",", 1)[1])  # sanity
