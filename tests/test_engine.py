"""Engine behaviour: stop conditions, streaming, metrics consistency, bad requests."""

from __future__ import annotations

import pytest

from glance_sgl.engine import SEED_MAX, SEED_MIN, GlanceEngine, RequestError, SamplingParams, StreamDelta, offset_seed
from glance_sgl.round import PHASES
from glance_sgl.target import TargetError
from glance_sgl.verify import seed_tensor

from tests.glance_testing import make_prompts


@pytest.fixture(scope="module")
def engine(engines):
    return engines["qwen2_5_vl"]


@pytest.fixture(scope="module")
def messages():
    return make_prompts(3, seed=31)[0]


def test_max_tokens_and_metrics(engine, messages):
    # the fixed tree: rounds every step, whatever the shared engine's planner learned in earlier tests (where its
    # drafter idles, a new request is retired and decodes on the AR path, test_a_retired_request_...)
    result = engine.generate(messages, SamplingParams(max_tokens=7), planner="fixed")
    m = result.metrics
    assert len(result.token_ids) <= 7
    if len(result.token_ids) == 7:
        assert result.finish_reason == "length"
    assert m.completion_tokens == len(result.token_ids) == 1 + sum(m.committed_per_round)
    assert sum(m.acceptance_histogram) == m.rounds
    assert m.tau == pytest.approx(sum(m.committed_per_round) / m.rounds)
    assert m.tau_minus_1 == pytest.approx(m.tau - 1)
    # every drafting round records its root entropy; a round without drafting only where the planner reads it
    assert m.drafter_passes <= len(m.root_entropies) <= m.rounds
    assert not m.root_entropies or m.mean_root_entropy >= 0
    assert m.prefill_ms > 0 and m.decode_ms > 0 and m.decode_tokens_per_s > 0
    # where the rounds' time went: every part of the round summed, the target's pass inside the decode time
    assert set(m.round_part_ms) <= set(PHASES) and {"pass", "walk", "report"} <= set(m.round_part_ms)
    assert min(m.round_part_ms.values()) >= 0 and 0 < m.round_part_ms["pass"] < sum(m.round_part_ms.values())
    assert sum(m.round_part_ms.values()) <= m.decode_ms
    d = m.to_dict()
    for key in ("tau", "tau_minus_1", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_histogram",
                "prefill_ms", "decode_ms", "decode_tokens_per_s", "mean_root_entropy"):
        assert key in d


def test_stop_string_cuts_text(engine, messages):
    full = engine.generate(messages, SamplingParams(max_tokens=24))
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = engine.generate(messages, SamplingParams(max_tokens=24, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert stop not in cut.text
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 40])
def test_stop_strings_found_whatever_the_round_sizes(engine, messages, chunk):
    """Stop strings are searched per round in the new tail: a stop string straddling a round boundary is still
    found, and the kept tokens end exactly at the token completing it, for any split of the tokens into rounds."""
    from glance_sgl.engine import _Output

    full = engine.generate(messages, SamplingParams(max_tokens=40))
    tok = engine.target.tokenizer
    for lo, hi in ((3, 9), (len(full.text) // 2, len(full.text) // 2 + 4), (len(full.text) - 3, len(full.text))):
        stop = full.text[lo:hi]
        if not stop.strip():
            continue
        out = _Output(tok, set(), SamplingParams(max_tokens=40, stop=["<never>", stop]))
        for i in range(0, len(full.token_ids), chunk):
            out.add(full.token_ids[i : i + chunk])
        first = full.text.find(stop)
        assert out.finish_reason == "stop" and out.text == full.text[:first]
        need = next(n for n in range(1, len(full.token_ids) + 1)
                    if stop in tok.decode(full.token_ids[:n], skip_special_tokens=True))
        assert out.token_ids == full.token_ids[:need]


def test_eos_stops(engine, messages):
    full = engine.generate(messages, SamplingParams(max_tokens=24))
    eos = full.token_ids[3]
    engine.eos_ids.add(eos)
    try:
        got = engine.generate(messages, SamplingParams(max_tokens=24))
    finally:
        engine.eos_ids.discard(eos)
    first = full.token_ids.index(eos)
    assert got.token_ids == full.token_ids[: first + 1] and got.finish_reason == "stop"


def test_streaming_deltas_add_up(engine, messages):
    deltas: list[StreamDelta] = []
    result = engine.generate(messages, SamplingParams(max_tokens=20), on_delta=deltas.append)
    assert sum(len(d.token_ids) for d in deltas) == len(result.token_ids)
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert "".join(d.text for d in deltas) == result.text
    items = list(engine.stream(messages, SamplingParams(max_tokens=20)))
    assert items[-1].token_ids == result.token_ids
    assert "".join(i.text for i in items[:-1]) == result.text


def test_stream_with_stop_string_never_leaks_it(engine, messages):
    full = engine.generate(messages, SamplingParams(max_tokens=24))
    stop = full.text[3:6]
    items = list(engine.stream(messages, SamplingParams(max_tokens=24, stop=[stop])))
    streamed = "".join(i.text for i in items[:-1])
    assert streamed == items[-1].text and stop not in streamed


def test_cancellation(engine, messages):
    calls = []
    result = engine.generate(messages, SamplingParams(max_tokens=24), should_stop=lambda: calls.append(1) or True)
    assert result.finish_reason == "cancelled" and len(result.token_ids) == 1
    stream = engine.stream(messages, SamplingParams(max_tokens=24))
    next(stream)
    stream.close()  # closing early ends the request
    assert engine.generate(messages, SamplingParams(max_tokens=3)).token_ids  # engine still usable


@pytest.mark.parametrize("items", [1, 3])
def test_a_stream_runs_in_the_callers_thread_and_a_close_forgets_its_request(engine, messages, monkeypatch, items):
    """No thread of its own (OpenMP work from another thread than the main one runs far slower on a few cores),
    and closing the stream after any item leaves nothing behind: the planner and the n-gram source forget it."""
    import threading

    merged = GlanceEngine(engine.target, engine.drafter, draft_sources=("drafter", "ngram"))
    threads = []
    prefill = engine.target.prefill
    monkeypatch.setattr(engine.target, "prefill", lambda *a, **k: threads.append(threading.current_thread()) or
                        prefill(*a, **k))
    stream = merged.stream(messages, SamplingParams(max_tokens=24))
    for _ in range(items):
        next(stream)
    assert threads == [threading.current_thread()]
    assert merged.planner().known() and merged.ngram.source.request_ids()
    stream.close()
    assert not merged.planner().known()
    assert not merged.ngram.source.request_ids()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=0), SamplingParams(temperature=-1), SamplingParams(top_p=0),
    SamplingParams(stop=[""]), SamplingParams(max_tokens=10**7), SamplingParams(temperature=1.0, seed=2**63),
    SamplingParams(temperature=1.0, seed=-(2**63) - 1),
])
def test_bad_sampling_params(engine, messages, params):
    with pytest.raises(RequestError):
        engine.generate(messages, params)


def test_offset_seed_stays_a_64_bit_seed():
    """A choice's seed (``seed + i``) wraps past the signed 64-bit range instead of leaving it: SGLang refuses a seed
    outside it, and the sampling noise reads the seed's 64 bits (the wrapped seed draws what the unwrapped one
    would)."""
    assert offset_seed(5, 2) == 7 and offset_seed(-3, 1) == -2
    assert offset_seed(SEED_MAX, 1) == SEED_MIN and offset_seed(SEED_MAX, 3) == SEED_MIN + 2
    assert seed_tensor([SEED_MAX + 1]).tolist() == [offset_seed(SEED_MAX, 1)]


@pytest.mark.parametrize("bad", [
    [], [{"role": "user"}], [{"role": "robot", "content": "hi"}],
    [{"role": "user", "content": [{"type": "video"}]}], [{"role": "user", "content": [{"type": "image"}]}],
    [{"role": "user", "content": 42}],
])
def test_bad_messages(engine, bad):
    with pytest.raises(TargetError):
        engine.generate(bad, SamplingParams(max_tokens=3))


def test_ar_engine_without_drafter(targets, messages):
    engine = GlanceEngine(targets["qwen2_vl"], None, mode="ar")
    assert engine.generate(messages, SamplingParams(max_tokens=5)).metrics.tau == 1.0
    with pytest.raises(RequestError):
        engine.generate(messages, SamplingParams(max_tokens=5), mode="glance")


def test_freeze_gc_takes_the_start_up_objects_out_of_full_collections(engine, messages):
    """``GlanceEngine.freeze_gc`` (``glance serve`` and ``glance bench`` call it once loaded, as SGLang's server does
    after its warm-up): what is alive stays alive and out of the collector's view; requests run on."""
    import gc

    try:
        assert engine.freeze_gc() > 10_000  # (a frozen object that dies leaves the count: it only shrinks)
        assert gc.get_freeze_count() > 10_000
        assert engine.generate(messages, SamplingParams(max_tokens=4)).metrics.completion_tokens == 4
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("when", ["at birth", "after its first round"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_retired_request_takes_plain_steps(engine, messages, monkeypatch, when, temperature):
    """A request the planner retires (it never drafts again) whose only source is the drafter decodes the rest
    of its answer in plain steps (``round.plain_round``: one token a step, no gate, plan or drafter): the AR answer
    (greedy and seeded), each step counted as a round without drafting."""
    from glance_sgl.planner import Planner

    params = SamplingParams(max_tokens=12, temperature=temperature, seed=7)
    ar = engine.generate(messages, params, mode="ar").token_ids
    planner = engine.planner("auto")
    if when == "at birth":
        monkeypatch.setattr(Planner, "retired", lambda self, rid: True)
    else:
        rounds: list[object] = []
        monkeypatch.setattr(Planner, "report", lambda self, report, _orig=Planner.report: (
            rounds.append(report), _orig(self, report)))
        monkeypatch.setattr(Planner, "retired", lambda self, rid: bool(rounds))
    result = engine.generate(messages, params, mode="glance", planner="auto", draft_sources=["drafter"])
    m = result.metrics
    assert result.token_ids == ar
    assert m.rounds == len(ar) - 1 - sum(a for a in m.accept_lengths) and m.drafter_passes <= 1
    reported = 0 if when == "at birth" else 1
    assert m.rounds - reported == sum(1 for c in m.committed_per_round[reported:] if c == 1)  # one token a step
    # a plain step has no gate or drafter part: only the full round before the retirement has them
    assert ({"gate", "draft"} & set(m.round_part_ms)) == (set() if when == "at birth" else {"gate", "draft"})
    assert m.to_dict()["predicted_tokens_per_round"] >= 1.0  # each plain step the planner's: one token expected
    assert planner.known() == set()  # forgotten at its end, whichever path it ended on
