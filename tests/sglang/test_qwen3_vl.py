"""Qwen3-VL (dense) through SGLang on CPU (``sglang.Engine`` in a child process, float32, images).

One GLANCE engine (fixed planner: the full tree every step) on a tiny random Qwen3-VL with a DFlash-format drafter
tapping layers 0, 1 (deepstack added after them) and 2 (none):
- its outputs equal the embedded engine's AR decoding (which equals Hugging Face ``generate``,
  tests/test_qwen3_vl.py) at 1 and 4 requests in flight, with one image, two images, or none;
- the tap features SGLang's capture hands the worker (``GLANCE_SGL_DUMP_TAPS``) equal the embedded engine's taps
  within 1e-4 (fp32): the same convention (what enters layer t + 1, deepstack included) on both engines;
- SGLang's ``Qwen3VLForConditionalGeneration.set_dflash_layers_to_capture`` (AttributeError in SGLang 0.5.23) is
  replaced through HookRegistry and captures the DFlash points ``id + 1``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from glance_sgl.sglang.runner import EngineProcess, chat_prompt, cpu_engine_kwargs, image_b64

pytestmark = pytest.mark.slow

TAPS = [0, 1, 2]
N_PROMPTS = 10
MAX_TOKENS = 16
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.glance_testing import make_prompts

    from glance_sgl.checkpoints import build_random_pair
    from glance_sgl.engine import GlanceEngine, SamplingParams

    root = tmp_path_factory.mktemp("qwen3_vl_sglang")
    target, drafter = build_random_pair(root / "pair", arch="qwen3_vl", seed=1, num_hidden_layers=2,
                                        tap_layers=TAPS)
    dumps = root / "taps"
    glance = EngineProcess(cpu_engine_kwargs(target, drafter),
                           env={**STRICT, "GLANCE_PLANNER": "fixed", "GLANCE_SGL_DUMP_TAPS": str(dumps)},
                           log_path=root / "glance.log", wait=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        engine = GlanceEngine.load(target, drafter)
        tok = engine.target.tokenizer
        messages = make_prompts(N_PROMPTS, seed=41)
        requests, ar, taps = [], [], []
        for m in messages:
            images = [image_b64(p["image"]) for p in m[0]["content"] if p["type"] == "image"]
            requests.append({"text": chat_prompt(tok, m), "image": images[0] if len(images) == 1 else images or None,
                             "max_tokens": MAX_TOKENS, "temperature": 0.0})
            ar.append(engine.generate(m, SamplingParams(max_tokens=MAX_TOKENS), mode="ar").token_ids)
            prompt = engine.target.prepare(m)
            _, rows = engine.target.prefill(prompt, taps=TAPS)
            with torch.no_grad():
                hs = engine.target.model(**prompt.inputs, output_hidden_states=True).hidden_states
            image = prompt.input_ids[0] == engine.target.model.config.image_token_id
            taps.append((rows.taps, torch.cat([hs[t + 1][0] for t in TAPS], dim=-1), image))
        glance.wait_ready()
        batch1 = glance.generate(requests)["results"]
        prefills = sorted(dumps.glob("prefill-*.pt"))
        concurrent = glance.generate(requests, concurrency=4)["results"]  # 4 in flight (async requests)
        print(f"qwen3-vl sglang: all {time.perf_counter() - t0:.1f}s")
        yield {"ar": ar, "batch1": batch1, "concurrent": concurrent, "taps": taps,
               "dumps": [torch.load(p) for p in prefills], "hidden": engine.target.text_config.hidden_size}
    finally:
        torch.set_num_threads(threads)
        glance.close()


def test_qwen3_vl_glance_through_sglang_equals_ar_at_1_and_4_in_flight(run):
    assert len(run["batch1"]) == len(run["concurrent"]) == N_PROMPTS
    for i, (b, c, a) in enumerate(zip(run["batch1"], run["concurrent"], run["ar"])):
        assert b["output_ids"] == a, f"prompt {i}: GLANCE through SGLang (1 in flight) vs the embedded AR"
        assert c["output_ids"] == a, f"prompt {i}: GLANCE through SGLang (4 in flight) vs the embedded AR"
    assert sum(r["meta_info"].get("spec_verify_ct", 0) for r in run["batch1"]) > 0


def test_sglang_captures_equal_embedded_taps_with_deepstack(run):
    """SGLang's captures at points t + 1 == the embedded engine's taps (HF + deepstack), within 1e-4; at image
    positions of the deepstack taps they differ from HF's raw ``hidden_states[t + 1]``."""
    dumps, h = run["dumps"], run["hidden"]
    assert len(dumps) == N_PROMPTS, "one prefill per request at 1 in flight"
    deepstack_gap, worst = 0.0, 0.0
    for i, (d, (ours, raw, image)) in enumerate(zip(dumps, run["taps"])):
        assert len(d["extend_lens"]) == 1
        p, e = d["prefix_lens"][0], d["extend_lens"][0]
        assert p + e == ours.shape[0], f"prompt {i}: the prefill covers the prompt"
        diff = (d["taps"] - ours[p:p + e]).abs().max().item()
        assert diff <= 1e-4, f"prompt {i}: SGLang capture vs embedded taps differ by {diff}"
        worst = max(worst, diff)
        img = image[p:p + e]
        if img.any():
            for j, t in enumerate(TAPS[:2]):  # deepstack after layers 0 and 1
                cols = slice(j * h, (j + 1) * h)
                deepstack_gap = max(deepstack_gap, (d["taps"][img][:, cols] - raw[p:p + e][img][:, cols]).abs().max().item())
            cols = slice(2 * h, 3 * h)  # layer 2: no deepstack, equal to HF's hidden_states[3]
            assert (d["taps"][:, cols] - raw[p:p + e][:, cols]).abs().max().item() <= 1e-4
    print(f"max |SGLang capture - embedded tap| = {worst:.2e}; deepstack taps vs HF hidden_states: {deepstack_gap:.2e}")
    assert deepstack_gap > 1e-3, "the deepstack taps must carry the vision features"


def test_qwen3_vl_set_dflash_layers_to_capture_is_fixed():
    """The real SGLang class's method, after the plugin's HookRegistry hooks: DFlash points id + 1 captured."""
    from sglang.srt.models.qwen3_vl import Qwen3VLForConditionalGeneration

    from glance_sgl.sglang.targets import register_target_hooks

    register_target_hooks()
    model = object.__new__(Qwen3VLForConditionalGeneration)  # no weights needed: the capture setup only
    torch.nn.Module.__init__(model)
    model.__dict__.update(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace())
    model.set_dflash_layers_to_capture([1, 3])
    assert model.capture_aux_hidden_states and model.model.capture_aux_hidden_states
    assert model.model.layers_to_capture == [2, 4]
    # the same points the GLANCE worker sets through set_eagle3_layers_to_capture
    other = object.__new__(Qwen3VLForConditionalGeneration)
    torch.nn.Module.__init__(other)
    other.__dict__.update(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace())
    other.set_eagle3_layers_to_capture([1, 3])
    assert other.model.layers_to_capture == [2, 4]


def test_dflash_capture_on_qwen2_5_vl_goes_through_eagle3_setter():
    """SGLang's Qwen2.5-VL has no DFLASH capture setter; after the plugin's hooks, the function SGLang's model
    runner calls captures DFlash points id + 1 through its EAGLE3 setter (so SGLang's DFLASH can load our
    drafters), and a model with neither still gets SGLang's own error."""
    import pytest
    from sglang.srt.model_executor import model_runner
    from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    from glance_sgl.sglang.targets import register_target_hooks

    register_target_hooks()
    assert not hasattr(Qwen2_5_VLForConditionalGeneration, "set_dflash_layers_to_capture")
    model = object.__new__(Qwen2_5_VLForConditionalGeneration)
    torch.nn.Module.__init__(model)
    model.__dict__.update(model=SimpleNamespace())
    kwargs = dict(eagle_use_aux_hidden_state=False, eagle_aux_hidden_state_layer_ids=None,
                  dflash_use_aux_hidden_state=True, dflash_target_layer_ids=[1, 3], is_dspark=False)
    model_runner.configure_aux_hidden_state_capture(model=model, **kwargs)
    assert model.capture_aux_hidden_states and model.model.layers_to_capture == [2, 4]
    with pytest.raises(ValueError, match="set_dflash_layers_to_capture"):
        model_runner.configure_aux_hidden_state_capture(model=torch.nn.Linear(1, 1), **kwargs)
