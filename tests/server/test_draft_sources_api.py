"""Draft sources through the gateway (issue 27, "users see and control it"): ``"glance": {"draft_sources": ...}``
per request (the real `openai` client and httpx on loopback), the per-source counts of the ``glance`` object and
their Prometheus series, 400s before any stream opens, and the n-gram corpus scoped per API key (several keys,
each tenant's corpus keyed by a hash of its key, anonymous requests sharing one)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from glance_sgl.engine import GlanceEngine
from glance_sgl.ngram_source import ngram_corpus_class
from glance_server.config import key_identity
from tests.server.server_helpers import API_KEY, MODEL, check_glance, image_message, png_bytes, start_embedded

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(ngram_corpus_class()[0] is None, reason=str(ngram_corpus_class()[1]))]
KEYS = ("tenant-a-key", "tenant-b-key")
SOURCES = ("drafter", "ngram", "both")


@pytest.fixture(scope="module")
def ngram_engine(engine):
    return GlanceEngine(engine.target, engine.drafter, budget=7, draft_sources=("drafter", "ngram"),
                        ngram_corpus="per-key")


@pytest.fixture(scope="module")
def keyed_gateway(ngram_engine):
    """Two tenants' keys, the n-gram corpus per key, merged trees by default."""
    server = start_embedded(ngram_engine, api_key=None, api_keys=KEYS)
    yield server
    server.stop()


def client(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=120)


def source_series(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics").text
    return {(s.name, s.labels["source"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("glance_source_")}


def check_sources(glance: dict) -> None:
    per = glance["sources"]
    assert set(per) == set(SOURCES)
    assert sum(v["accepted_tokens"] for v in per.values()) == glance["accepted_tokens"]
    assert all(0 <= v["rounds"] <= glance["rounds"] for v in per.values())


def test_draft_sources_per_request_lossless_and_counted(keyed_gateway):
    c = client(keyed_gateway, KEYS[0])
    messages = image_message("describe the picture and the picture again", seed=5)
    ar = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                   extra_body={"glance": {"mode": "ar"}})
    assert ar.model_extra["glance"]["draft_sources"] == []
    check_sources(ar.model_extra["glance"])
    outs, per_source = {}, {}
    for name, value in (("default", None), ("ngram", ["ngram"]), ("drafter", "drafter"),
                        ("merged", "ngram, drafter")):
        before = source_series(keyed_gateway.url)
        # the fixed planner verifies a tree every round (auto may find the random drafter not worth a pass)
        extra = {"glance": {"planner": "fixed", **({"draft_sources": value} if value is not None else {})}}
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, extra_body=extra)
        glance = r.model_extra["glance"]
        check_glance(glance, r.usage.completion_tokens)
        check_sources(glance)
        assert glance["draft_sources"] == {"default": ["drafter", "ngram"], "ngram": ["ngram"],
                                           "drafter": ["drafter"], "merged": ["drafter", "ngram"]}[name]
        outs[name] = r.choices[0].message.content
        per_source[name] = glance["sources"]
        after = source_series(keyed_gateway.url)
        for s in SOURCES:  # Prometheus counts exactly what the response reported
            for metric, field in (("glance_source_rounds_total", "rounds"),
                                  ("glance_source_accepted_tokens_total", "accepted_tokens")):
                assert after.get((metric, s), 0.0) - before.get((metric, s), 0.0) == glance["sources"][s][field]
    assert all(text == ar.choices[0].message.content for text in outs.values())  # lossless, whatever the sources
    assert per_source["ngram"]["drafter"] == per_source["ngram"]["both"] == {"rounds": 0, "accepted_tokens": 0}
    assert per_source["ngram"]["ngram"]["rounds"] > 0  # the n-gram source proposed on its own
    assert per_source["drafter"]["ngram"] == per_source["drafter"]["both"] == {"rounds": 0, "accepted_tokens": 0}
    assert per_source["drafter"]["drafter"]["rounds"] > 0


@pytest.mark.parametrize("value", ["beam", [], "", ["drafter", "beam"], [1]])
def test_bad_draft_sources_are_400_before_any_stream(keyed_gateway, value):
    for stream in (False, True):
        r = httpx.post(keyed_gateway.url + "/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEYS[1]}"},
                       json={"model": MODEL, "messages": image_message("hi"), "max_tokens": 4, "stream": stream,
                             "glance": {"draft_sources": value}})
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        if value != [1]:  # a non-string is refused by the schema
            assert error["param"] == "glance.draft_sources" and error["code"] == "invalid_value"


def test_draft_sources_need_mode_glance_and_the_source(keyed_gateway, gateway, sglang_gateway):
    body = {"model": MODEL, "messages": image_message("hi"), "max_tokens": 4, "stream": True}
    r = httpx.post(keyed_gateway.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS[0]}"},
                   json={**body, "glance": {"mode": "chain", "draft_sources": "ngram"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "glance.draft_sources"
    assert "mode 'glance'" in r.json()["error"]["message"]
    # the main gateway's engine drafts with the drafter alone: it has no n-gram source to choose
    r = httpx.post(gateway.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={**body, "glance": {"draft_sources": ["ngram"]}}, timeout=60)
    assert r.status_code == 400 and "n-gram" in r.json()["error"]["message"]
    r = httpx.post(sglang_gateway.url + "/v1/chat/completions",
                   json={**body, "glance": {"draft_sources": ["drafter"]}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    assert r.json()["error"]["param"] == "glance.draft_sources"
    # the multipart route takes them as a form field
    r = httpx.post(keyed_gateway.url + "/v1/generate", headers={"Authorization": f"Bearer {KEYS[0]}"},
                   data={"prompt": "hi", "draft_sources": "drafter,beam"},
                   files={"image": ("a.png", png_bytes(1), "image/png")}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "draft_sources", r.text


def test_sglang_backend_reports_no_per_source_counts(sglang_gateway):
    r = openai.OpenAI(base_url=sglang_gateway.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=MODEL, messages=image_message("hi", seed=3), max_tokens=6, temperature=0)
    glance = r.model_extra["glance"]
    assert glance["backend"] == "sglang" and glance["sources"] is None and glance["draft_sources"] is None


def test_ngram_corpus_per_api_key(keyed_gateway, ngram_engine):
    """Each key is a tenant: its answers go to a corpus keyed by a hash of its key (never the key); a wrong key
    is a 401; a gateway without keys puts every request in the anonymous tenant's corpus."""
    corpora = ngram_engine.ngram.source._corpora
    for key in KEYS:
        r = client(keyed_gateway, key).chat.completions.create(
            model=MODEL, messages=image_message("tell me about it", seed=8), max_tokens=8, temperature=0)
        assert r.model_extra["glance"]["draft_sources"] == ["drafter", "ngram"]
    assert {key_identity(k) for k in KEYS} <= set(corpora)
    assert not any(k in name for k in KEYS for name in corpora)
    assert key_identity(KEYS[0]) != key_identity(KEYS[1])
    with pytest.raises(openai.AuthenticationError):
        client(keyed_gateway, "tenant-c-key").models.list()
    models = httpx.get(keyed_gateway.url + "/v1/models/" + MODEL,
                       headers={"Authorization": f"Bearer {KEYS[1]}"}).json()
    assert models["glance"]["ngram_corpus"] == "per-key"
    assert models["glance"]["draft_sources"] == ["drafter", "ngram"]
    anonymous = start_embedded(ngram_engine, api_key=None)
    try:
        r = client(anonymous, "whatever").chat.completions.create(
            model=MODEL, messages=image_message("tell me about it", seed=9), max_tokens=8, temperature=0)
        assert r.model_extra["glance"]["sources"]["ngram"]["rounds"] >= 0
        assert "" in corpora  # the anonymous tenant
    finally:
        anonymous.stop()
