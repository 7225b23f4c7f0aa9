"""The planner through the gateway: ``"glance": {"planner": ...}`` per request (real `openai` client and httpx on
loopback), the planner fields of the ``glance`` object, and their Prometheus series."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.server_helpers import API_KEY, MODEL, check_glance, image_message, png_bytes

pytestmark = pytest.mark.timeout(180)


def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def check_planner_fields(glance: dict) -> None:
    """What the planner fields promise, whatever the planner chose."""
    rows = glance["rows_histogram"]
    assert sum(rows.values()) == glance["rounds"]
    assert all(int(r) >= 1 and n >= 1 for r, n in rows.items())
    assert glance["rounds_without_drafting"] <= glance["rounds"]
    if glance["mode"] == "glance":
        assert glance["planner"] in ("auto", "fixed")
        assert glance["predicted_tokens_per_round"] >= 1.0  # the bonus token at least
    else:
        assert glance["planner"] is None and glance["predicted_tokens_per_round"] is None


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus exposition: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_planner_per_request_is_lossless_and_reported(gateway, engine):
    c = client(gateway)
    messages = image_message("describe the picture", seed=11)
    outs = {}
    for planner in ("auto", "fixed"):
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=14, temperature=0,
                                      extra_body={"glance": {"planner": planner}})
        glance = r.model_extra["glance"]
        check_glance(glance, r.usage.completion_tokens)
        check_planner_fields(glance)
        assert glance["planner"] == planner
        outs[planner] = r.choices[0].message.content
        if planner == "fixed":  # the budget tree every round (less the rows past the answer's end or its limit)
            # but one with room for a single token (its last, at max_tokens): an AR step
            assert glance["rounds_without_drafting"] == glance["rows_histogram"].get("1", 0) <= 1
            assert all(int(rows) <= engine.budget + 1 for rows in glance["rows_histogram"])
            assert str(engine.budget + 1) in glance["rows_histogram"]
    ar = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=14, temperature=0,
                                   extra_body={"glance": {"mode": "ar"}})
    glance = ar.model_extra["glance"]
    check_planner_fields(glance)
    assert glance["rows_histogram"] == {"1": glance["rounds"]} and glance["rounds_without_drafting"] == glance["rounds"]
    assert outs["auto"] == outs["fixed"] == ar.choices[0].message.content
    # without a choice the server's default planner plans (auto)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert r.model_extra["glance"]["planner"] == "auto"
    assert c.models.list().data[0].model_extra["glance"]["planner"] == "auto"


def test_streaming_last_chunk_carries_the_planner_fields(gateway):
    chunks = list(client(gateway).chat.completions.create(
        model=MODEL, messages=image_message("read the text", seed=4), max_tokens=10, temperature=0.7, seed=5,
        stream=True, stream_options={"include_usage": True}, extra_body={"glance": {"planner": "fixed"}}))
    glance = chunks[-1].model_extra["glance"]
    check_glance(glance, chunks[-1].usage.completion_tokens)
    check_planner_fields(glance)
    assert glance["planner"] == "fixed"


@pytest.mark.parametrize("options,message", [
    ({"planner": "fast"}, "'auto' or 'fixed'"),
    ({"planner": 3}, "'auto' or 'fixed'"),
    ({"planner": "fixed", "mode": "ar"}, "mode 'glance'"),
    ({"planner": "auto", "mode": "chain"}, "mode 'glance'"),
])
def test_bad_planner_is_a_400(gateway, options, message):
    with pytest.raises(openai.BadRequestError) as exc:
        client(gateway).chat.completions.create(model=MODEL, messages=image_message("hi"), max_tokens=4,
                                                extra_body={"glance": options})
    err = exc.value.body
    assert exc.value.status_code == 400 and err["param"] == "glance.planner" and message in err["message"], err


def test_multipart_planner(gateway, auth):
    files = [("image", ("a.png", png_bytes(6), "image/png"))]
    r = httpx.post(gateway.url + "/v1/generate", files=files, data={"prompt": "what is it", "max_tokens": "8",
                                                                     "planner": "fixed"}, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["glance"]["planner"] == "fixed"
    r = httpx.post(gateway.url + "/v1/generate", files=files, data={"prompt": "x", "planner": "fastest"},
                   headers=auth, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "planner" and "auto or fixed" in err["message"], r.text
    r = httpx.post(gateway.url + "/v1/generate", files=files, data={"prompt": "x", "planner": "auto", "mode": "ar"},
                   headers=auth, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "planner" and "mode 'glance'" in err["message"], r.text


def test_metrics_count_rows_rounds_and_predictions(gateway):
    before = samples(httpx.get(gateway.url + "/metrics").text)
    r = client(gateway).chat.completions.create(model=MODEL, messages=image_message("count the shapes", seed=2),
                                                max_tokens=12, temperature=0,
                                                extra_body={"glance": {"planner": "fixed"}})
    glance = r.model_extra["glance"]
    after = samples(httpx.get(gateway.url + "/metrics").text)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    rows = sum(int(r) * n for r, n in glance["rows_histogram"].items())
    assert grew("glance_rows_per_round_count", mode="glance") == glance["rounds"]
    assert grew("glance_rows_per_round_sum", mode="glance") == pytest.approx(rows)
    # every round drafted a tree but one with room for a single token (at max_tokens: an AR step)
    assert grew("glance_rows_per_round_bucket", mode="glance", le="1.0") == glance["rows_histogram"].get("1", 0) <= 1
    assert grew("glance_rounds_total", mode="glance") == glance["rounds"]
    assert grew("glance_planner_predicted_tokens_total", planner="fixed") == pytest.approx(
        glance["predicted_tokens_per_round"] * glance["rounds"])
    assert grew("glance_planner_committed_tokens_total", planner="fixed") == glance["decode_tokens"]
    # an AR request: one row per round, every round without drafting
    before = after
    r = client(gateway).chat.completions.create(model=MODEL, messages=image_message("count the shapes", seed=2),
                                                max_tokens=6, temperature=0, extra_body={"glance": {"mode": "ar"}})
    after = samples(httpx.get(gateway.url + "/metrics").text)
    n = r.model_extra["glance"]["rounds"]
    assert grew("glance_rows_per_round_bucket", mode="ar", le="1.0") == n
    assert grew("glance_rounds_without_drafting_total", mode="ar") == n
