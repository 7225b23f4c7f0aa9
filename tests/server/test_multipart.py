"""``POST /v1/generate``: multipart image file(s) + prompt, through httpx."""

from __future__ import annotations

import httpx
import pytest

from tests.server.server_helpers import MODEL, png_bytes

pytestmark = pytest.mark.timeout(120)


def test_multipart_png_and_jpeg(gateway, auth):
    files = [("image", ("a.png", png_bytes(1), "image/png")), ("image", ("b.jpg", png_bytes(2, fmt="JPEG"), "image/jpeg"))]
    data = {"prompt": "compare the two pictures", "max_tokens": "10", "measure_speedup": "true", "model": MODEL}
    r = httpx.post(gateway.url + "/v1/generate", files=files, data=data, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "glance.generation" and body["model"] == MODEL
    assert body["finish_reason"] in ("stop", "length") and isinstance(body["text"], str)
    glance, usage = body["glance"], body["usage"]
    assert glance["completion_tokens"] == usage["completion_tokens"] <= 10
    assert 1 + sum(glance["committed_per_round"]) == usage["completion_tokens"]
    assert glance["measured"]["lossless_match"] is True
    # greedy by default, so the same form gives the same answer through the chat endpoint's engine path
    again = httpx.post(gateway.url + "/v1/generate", files=files, data={**data, "measure_speedup": "0"},
                       headers=auth, timeout=60).json()
    assert again["text"] == body["text"] and again["glance"]["measured"] is None


@pytest.mark.parametrize("files,data,code", [
    ([("image", ("a.png", png_bytes(1), "image/png"))], {}, "invalid_value"),  # no prompt
    ([("image", ("a.txt", b"not an image", "text/plain"))], {"prompt": "x"}, "invalid_image"),
    ([("image", (f"{k}.png", png_bytes(k), "image/png")) for k in range(3)], {"prompt": "x"}, "too_many_images"),
    ([("image", ("a.png", png_bytes(1), "image/png"))], {"prompt": "x", "max_tokens": "ten"}, "invalid_value"),
    ([("image", ("a.png", png_bytes(1), "image/png"))], {"prompt": "x", "mode": "fast"}, "invalid_value"),
    # a field the route does not read is refused, never ignored
    ([("image", ("a.png", png_bytes(1), "image/png"))], {"prompt": "x", "repetition_penalty": "1.1"},
     "unsupported_parameter"),
    ([("image", ("a.png", png_bytes(1), "image/png"))], {"prompt": "x", "topk": "5"}, "unsupported_parameter"),
    ([("image", ("a.png", png_bytes(1), "image/png"))], {"prompt": "x", "min_p": "2"}, "invalid_value"),
])
def test_multipart_bad_forms(gateway, auth, files, data, code):
    r = httpx.post(gateway.url + "/v1/generate", files=files, data=data, headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text


def test_multipart_needs_a_form(gateway, auth):
    r = httpx.post(gateway.url + "/v1/generate", json={"prompt": "x"}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_multipart_sampling_fields_are_honoured(gateway, auth):
    """``top_k``, ``min_p`` and ``min_tokens`` as form fields act as in the chat route: the same seeded answer."""
    import openai

    from tests.server.server_helpers import API_KEY, image_message

    files = [("image", ("a.png", png_bytes(4), "image/png"))]
    fields = {"max_tokens": "12", "temperature": "1.3", "seed": "9", "top_k": "3", "min_p": "0.1", "min_tokens": "2"}
    r = httpx.post(gateway.url + "/v1/generate", files=files, data={"prompt": "describe it", **fields}, headers=auth,
                   timeout=60)
    assert r.status_code == 200, r.text
    chat = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model=MODEL, messages=image_message("describe it", seed=4), max_tokens=12, temperature=1.3, seed=9,
        extra_body={"top_k": 3, "min_p": 0.1, "min_tokens": 2})
    assert r.json()["text"] == chat.choices[0].message.content
