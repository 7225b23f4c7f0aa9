"""The OpenAI-compatible chat endpoint through the real `openai` client, and the `glance` metrics."""

from __future__ import annotations

import httpx
import openai
import pytest

from glance_sgl.engine import SamplingParams

from tests.server.server_helpers import API_KEY, MODEL, check_glance, image_message, png_bytes

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


def test_top_k_and_min_p_are_honoured(gateway, engine):
    """vLLM's and SGLang's sampling extras ``top_k`` and ``min_p`` filter the target's distribution (never ignored):
    a seeded request through the gateway equals the engine's AR decoding under the same filters, GLANCE and AR
    alike, and the filters change what a seed draws."""
    c = client(gateway)
    messages = [{"role": "user", "content": "tell me a story about a robot"}]
    outs = {}
    for mode in ("glance", "ar"):
        for filters in ({"top_k": 2, "min_p": 0.2}, {}):
            r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=1.5, seed=77,
                                          extra_body={**filters, "glance": {"mode": mode}})
            outs[mode, bool(filters)] = r.choices[0].message.content
    ref = engine.generate(messages, SamplingParams(max_tokens=16, temperature=1.5, seed=77, top_k=2, min_p=0.2),
                          mode="ar")
    assert outs["glance", True] == outs["ar", True] == ref.text
    assert outs["glance", False] == outs["ar", False] != outs["ar", True]


def test_logit_bias_and_min_tokens_are_honoured(gateway, engine):
    """OpenAI's ``logit_bias`` and vLLM's / SGLang's ``min_tokens`` change what the target picks at every step
    (GLANCE applies them to every verified row at its output index): the answers equal the engine's AR decoding
    under the same rules; a bias against the plain answer's first token changes it, and an EOS pushed up by a bias
    comes only once ``min_tokens`` tokens are out."""
    c = client(gateway)
    messages = [{"role": "user", "content": "count the shapes"}]
    plain = engine.generate(messages, SamplingParams(max_tokens=16, temperature=0), mode="ar").token_ids
    eos = min(engine.eos_ids)
    for rules in ({"logit_bias": {str(plain[0]): -100}}, {"logit_bias": {str(eos): 100}, "min_tokens": 5}):
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_body=rules)
        params = SamplingParams(max_tokens=16, temperature=0, min_tokens=rules.get("min_tokens", 0),
                                logit_bias={int(k): float(v) for k, v in rules["logit_bias"].items()})
        ref = engine.generate(messages, params, mode="ar")
        assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids), rules
        assert ref.token_ids != plain
    assert ref.finish_reason == "stop" and len(ref.token_ids) == 6 and ref.token_ids[-1] == eos  # 5, then EOS


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


def test_logprobs_are_the_targets_and_match_the_ar_path(gateway):
    """Chat logprobs: the target's own log-probabilities of the committed tokens, the same from GLANCE's verify
    passes as from the AR path, and the same streamed as not."""
    c = client(gateway)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "tell me a story"}], max_tokens=8,
                  temperature=0, logprobs=True, top_logprobs=3)
    spec = c.chat.completions.create(**kwargs, extra_body={"glance": {"mode": "glance", "planner": "fixed"}})
    ar = c.chat.completions.create(**kwargs, extra_body={"glance": {"mode": "ar"}})
    content, ar_content = spec.choices[0].logprobs.content, ar.choices[0].logprobs.content
    assert len(content) == spec.usage.completion_tokens == len(ar_content)
    assert spec.model_extra["glance"]["drafted_tokens"] > 0  # the verify passes produced them
    for a, b in zip(content, ar_content):
        assert a.token == b.token and a.bytes == b.bytes
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert len(a.top_logprobs) == 3
        assert [t.logprob for t in a.top_logprobs] == sorted((t.logprob for t in a.top_logprobs), reverse=True)
        assert a.logprob == pytest.approx(a.top_logprobs[0].logprob, abs=1e-6)  # greedy picks the argmax
        assert a.logprob <= 0
    if spec.choices[0].finish_reason == "length":  # no EOS token: the tokens' bytes are the text
        assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == spec.choices[0].message.content
    chunks = list(c.chat.completions.create(**kwargs, stream=True,
                                            extra_body={"glance": {"mode": "glance", "planner": "fixed"}}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # without logprobs: null, as before
    plain = c.chat.completions.create(model=MODEL, messages=kwargs["messages"], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completions_endpoint(gateway, engine):
    """Legacy completions: a raw prompt (no chat template), the same tokens as the engine's, streamed too."""
    c = client(gateway)
    kwargs = dict(model=MODEL, prompt="once upon a time", max_tokens=6, temperature=0, logprobs=2)
    resp = c.completions.create(**kwargs)
    ref = engine.generate("once upon a time", SamplingParams(max_tokens=6, temperature=0), mode="ar")
    choice = resp.choices[0]
    assert resp.object == "text_completion" and choice.text == ref.text
    assert resp.usage.completion_tokens == len(ref.token_ids) and resp.usage.prompt_tokens == ref.metrics.prompt_tokens
    check_glance(resp.model_extra["glance"], resp.usage.completion_tokens)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ref.token_ids)
    assert all(len(top) <= 2 for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text
    assert [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens] \
        == lp.tokens
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert chunks[-1].model_extra["glance"]["completion_tokens"] == resp.usage.completion_tokens


def test_n_choices_are_the_answers_of_their_seeds(gateway):
    """``n`` choices: a greedy request's are all its one answer; a seeded one's choice i is the answer of seed
    ``seed + i`` alone, streamed too (every chunk names its choice, one finish chunk per choice, one usage chunk
    for all); usage counts the prompt once and every choice's tokens; each choice carries its glance object."""
    c = client(gateway)
    messages = image_message("describe the picture", seed=6)
    one = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    three = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, n=3)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert {ch.message.content for ch in three.choices} == {one.choices[0].message.content}
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    kwargs = dict(model=MODEL, messages=messages, max_tokens=10, temperature=1.0)
    alone = [c.chat.completions.create(**kwargs, seed=40 + i).choices[0].message.content for i in range(3)]
    assert len(set(alone)) > 1  # the seeds give different answers, so the check below can fail
    both = c.chat.completions.create(**kwargs, seed=40, n=3)
    assert [ch.message.content for ch in both.choices] == alone
    for ch in both.choices:
        check_glance(ch.model_extra["glance"], ch.model_extra["glance"]["completion_tokens"])
    assert both.usage.completion_tokens == sum(ch.model_extra["glance"]["completion_tokens"] for ch in both.choices)
    chunks = list(c.chat.completions.create(**kwargs, seed=40, n=3, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finished = ["", "", ""], []
    for chunk in chunks[:-1]:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.append(ch.index)
                assert chunk.model_extra["glance"]["completion_tokens"] > 0  # the choice's own metrics
    assert texts == alone and sorted(finished) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == both.usage.completion_tokens
    # the largest seed: its second choice's seed wraps to the smallest one (a seed every backend takes)
    top = c.chat.completions.create(**kwargs, seed=2**63 - 1, n=2)
    assert top.choices[1].message.content == \
        c.chat.completions.create(**kwargs, seed=-(2**63)).choices[0].message.content
    # legacy completions alike, and a batch of prompts: choice k * n + i is prompt k's i-th
    kwargs = dict(model=MODEL, max_tokens=8, temperature=1.0)
    prompts = ["once upon a time", "the robot said"]
    alone = [c.completions.create(**kwargs, prompt=p, seed=3 + i) for p in prompts for i in range(2)]
    assert [ch.text for ch in c.completions.create(**kwargs, prompt=prompts[0], seed=3, n=2, best_of=2).choices] \
        == [r.choices[0].text for r in alone[:2]]
    batch = c.completions.create(**kwargs, prompt=prompts, seed=3, n=2)
    assert [ch.text for ch in batch.choices] == [r.choices[0].text for r in alone]
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens
    assert batch.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    texts = [""] * 4
    chunks = list(c.completions.create(**kwargs, prompt=prompts, seed=3, n=2, stream=True,
                                       stream_options={"include_usage": True}))
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in batch.choices] and chunks[-1].usage == batch.usage


def test_model_retrieve_and_refusals_through_the_client(gateway):
    c = client(gateway)
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as exc:
        c.models.retrieve("gpt-4o")
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:  # the processor never sees it
        c.chat.completions.create(model=MODEL, max_tokens=2, stream=True, messages=[
            {"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"}])
    assert exc.value.code == "special_token_in_text"
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                  response_format={"type": "json_object"})
    assert exc.value.code == "unsupported_parameter" and exc.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                  top_logprobs=2)
    assert exc.value.code == "invalid_value" and exc.value.param == "top_logprobs"
