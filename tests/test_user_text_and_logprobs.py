"""The embedded engine and the training data path: special-token strings in user text are refused (never image
slots or control tokens), and logprobs are the target's own, the same from GLANCE's verify passes as from the
AR path."""

from __future__ import annotations

import pytest

from glance_sgl.engine import RequestError, SamplingParams, StreamDelta
from glance_sgl.special_tokens import SpecialTokenGuard

from tests.glance_testing import make_prompts

pytestmark = pytest.mark.timeout(300)


def test_logprobs_from_the_verify_pass_equal_the_ar_paths(engines):
    engine = engines["qwen2_5_vl"]
    messages = make_prompts(7, seed=11)[6]  # a prompt on which the random drafter's trees get accepted
    params = SamplingParams(max_tokens=24, logprobs=3)
    ar = engine.generate(messages, params, mode="ar")
    deltas: list[StreamDelta] = []
    spec = engine.generate(messages, params, planner="fixed", on_delta=deltas.append)
    assert spec.metrics.accepted_tokens > 0  # committed tokens came from accepted tree rows
    assert spec.token_ids == ar.token_ids
    assert [lp.token_id for lp in spec.logprobs] == spec.token_ids
    for a, b in zip(spec.logprobs, ar.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 3
        assert a.top[0][0] == a.token_id  # greedy: the argmax, whose logprob is the top one
        assert a.logprob == pytest.approx(a.top[0][1], abs=1e-6)
    assert [lp for d in deltas for lp in d.logprobs] == spec.logprobs  # streamed: the same, in order
    assert engine.generate(messages, SamplingParams(max_tokens=4)).logprobs is None  # off unless asked


@pytest.mark.parametrize("messages,where", [
    ([{"role": "user", "content": "x <|vision_start|><|image_pad|><|vision_end|> y"}], "messages[0].content"),
    ([{"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "<|im_end|>"}]}],
     "messages[1].content[1].text"),
    ("raw <|endoftext|> prompt", "prompt"),
])
def test_engine_refuses_special_token_strings(engines, messages, where):
    engine = engines["qwen2_5_vl"]
    with pytest.raises(RequestError) as exc:
        engine.generate(messages, SamplingParams(max_tokens=2))
    assert exc.value.code == "special_token_in_text" and exc.value.param == where
    assert "special token" in str(exc.value)


def test_text_that_only_looks_like_a_token_is_text(engines):
    engine = engines["qwen2_5_vl"]
    guard = SpecialTokenGuard(engine.target.tokenizer)
    assert "<|image_pad|>" in guard.tokens and "<|im_start|>" in guard.tokens
    assert guard.find("<|not_a_token|> and <| image_pad |>") is None
    out = engine.generate([{"role": "user", "content": "<|not_a_token|>"}], SamplingParams(max_tokens=1))
    assert len(out.token_ids) == 1


def test_distillation_skips_rows_with_special_token_strings(engines, tmp_path):
    """The training data path: such a row is skipped (named in the skip log), the others are answered."""
    import json

    from glance_sgl.train.data import build_distill_data
    from glance_sgl.train.formats import SkipLog

    engine = engines["qwen2_5_vl"]
    skips = SkipLog(quiet=True)
    requests = [("t", [{"role": "user", "content": "describe <|image_pad|> this"}]),
                ("t", [{"role": "user", "content": "describe this"}])]
    out = build_distill_data(engine, requests, tmp_path / "d", taps=engine.drafter.config.tap_layers,
                             max_new_tokens=2, progress=False, temperature=0.0, skips=skips)
    meta = json.loads((out / "distill.json").read_text())
    assert meta["sequences"] == 1
    assert len(skips.skips) == 1 and skips.skips[0].row == 1 and "<|image_pad|>" in skips.skips[0].reason
