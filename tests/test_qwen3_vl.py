"""Qwen3-VL (dense) as a target of the embedded engine: lossless against Hugging Face ``generate`` and the AR path,
and the tap convention on a deepstack model (taps are what enters the next layer, deepstack additions included).

A tiny randomly initialised ``Qwen3VLForConditionalGeneration`` (interleaved M-RoPE, deepstack after LLM layers 0
and 1), fp32 on CPU, random drafters; 50 prompts with images of three sizes, two images, or none.
"""

from __future__ import annotations

import pytest
import torch

from glance_sgl.engine import GlanceEngine, SamplingParams
from glance_sgl.tree import max_tree_size

from tests.glance_testing import make_prompts, random_drafter

N_PROMPTS = 50
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from glance_sgl.checkpoints import build_random_target
    from glance_sgl.target import TargetAdapter

    return TargetAdapter.load(build_random_target(tmp_path_factory.mktemp("qwen3_vl"), arch="qwen3_vl", seed=1))


def hf_greedy(target, messages, max_tokens: int) -> list[int]:
    prompt = target.prepare(messages)
    with torch.no_grad():
        out = target.model.generate(**prompt.inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, prompt.num_tokens:].tolist()


def test_tiny_qwen3_vl_is_the_real_architecture(qwen3):
    from transformers import Qwen3VLForConditionalGeneration

    cfg = qwen3.model.config
    assert isinstance(qwen3.model, Qwen3VLForConditionalGeneration) and cfg.model_type == "qwen3_vl"
    rope = cfg.text_config.rope_parameters
    assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) == cfg.text_config.head_dim // 2
    assert list(cfg.vision_config.deepstack_visual_indexes) == [0, 1]


def test_lossless_qwen3_vl_tree_chain_widest_budget(qwen3):
    """GLANCE (cost-aware planner, fixed budget tree, width-1 chain, the widest budget) == generate == AR."""
    tree = GlanceEngine(qwen3, random_drafter(qwen3, num_hidden_layers=2), budget=31, branch_k=8)
    small = random_drafter(qwen3, seed=3, block_size=5)
    chain = GlanceEngine(qwen3, small, mode="chain")
    widest = max_tree_size(4, 3)
    wide = GlanceEngine(qwen3, small, budget=widest, branch_k=3, planner="fixed")
    params = SamplingParams(max_tokens=MAX_TOKENS)
    kinds, accepted = set(), 0
    for i, messages in enumerate(make_prompts(N_PROMPTS, seed=31)):
        kinds.add(i % 5)
        reference = hf_greedy(qwen3, messages, MAX_TOKENS)
        assert tree.generate(messages, params, mode="ar").token_ids == reference, f"prompt {i}: AR differs"
        got = tree.generate(messages, params)
        assert got.token_ids == reference, f"prompt {i}: GLANCE differs from generate"
        assert got.metrics.completion_tokens == 1 + sum(got.metrics.committed_per_round)
        accepted += got.metrics.accepted_tokens
        if i % 4 == 3:
            fixed = tree.generate(messages, params, planner="fixed")
            assert fixed.token_ids == reference, f"prompt {i}: fixed tree differs"
            # the budget every round, less the rows past the end (the token limit, EOS)
            assert max(fixed.metrics.rows_per_round) == tree.budget + 1
            assert fixed.metrics.drafted_tokens <= fixed.metrics.rounds * tree.budget
            accepted += fixed.metrics.accepted_tokens
        if i % 4 == 1:
            got_chain = chain.generate(messages, params)
            assert got_chain.token_ids == reference, f"prompt {i}: chain differs"
            assert max(got_chain.metrics.rows_per_round) == 5
            assert got_chain.metrics.drafted_tokens <= got_chain.metrics.rounds * 4
            accepted += got_chain.metrics.accepted_tokens
        if i % 25 == 2:  # the widest tree (all 120 nodes of k=3, depth 4) on an image prompt
            got_wide = wide.generate(messages, params)
            assert got_wide.token_ids == reference, f"prompt {i}: widest budget differs"
            assert max(got_wide.metrics.rows_per_round) == widest + 1
            assert got_wide.metrics.drafted_tokens <= got_wide.metrics.rounds * widest
            accepted += got_wide.metrics.accepted_tokens
    # the random drafters are right now and then (the target repeats itself): acceptance paths are exercised
    assert kinds == {0, 1, 2, 3, 4} and accepted > 0


def test_lossless_qwen3_vl_sampling_same_seed_same_tokens(qwen3):
    engine = GlanceEngine(qwen3, random_drafter(qwen3, num_hidden_layers=2))
    for i, messages in enumerate(make_prompts(5, seed=32)):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i)
        assert engine.generate(messages, params).token_ids == engine.generate(messages, params, mode="ar").token_ids


def test_qwen3_vl_taps_include_deepstack_and_match_hf_elsewhere(qwen3):
    """Tap t = the state entering layer t + 1. For t >= 2 (no deepstack after it) that is Hugging Face's
    ``hidden_states[t + 1]`` (DFlash's ``target_layer_ids``) bit for bit; for t in 0, 1 it is that plus the
    deepstack features at the image positions, and equal to it everywhere else."""
    model = qwen3.model
    n = len(qwen3.layers)
    taps = list(range(n - 1))
    h = qwen3.text_config.hidden_size
    for messages in make_prompts(5, seed=33)[2:5]:  # one image, two images, text only
        prompt = qwen3.prepare(messages)
        _, rows = qwen3.prefill(prompt, taps=taps)
        got = rows.taps.view(prompt.num_tokens, len(taps), h)
        with torch.no_grad():
            hs = model(**prompt.inputs, output_hidden_states=True).hidden_states
        image = prompt.input_ids[0] == model.config.image_token_id
        deep = None
        if prompt.num_images:
            with torch.no_grad():
                feats = model.model.get_image_features(prompt.inputs["pixel_values"], prompt.inputs["image_grid_thw"])
            deep = [torch.cat(f, dim=0) for f in feats.deepstack_features]
        for j, t in enumerate(taps):
            expected = hs[t + 1][0].clone()
            if deep is not None and t < len(deep):
                assert not torch.allclose(got[:, j][image], expected[image]), "deepstack missing from the tap"
                expected[image] = expected[image] + deep[t]
            assert torch.equal(got[:, j][~image], hs[t + 1][0][~image]), t
            assert torch.allclose(got[:, j], expected, atol=1e-6, rtol=0), t


def test_demo_build_pipeline_on_a_tiny_qwen3_vl(tmp_path):
    """`glance demo build --target-arch qwen3_vl`: target training, distillation, drafter training, tau and the
    benchmark all run on a Qwen3-VL target (a tiny recipe), and the drafter is saved in the DFlash format."""
    import json

    from glance_sgl.cli import build_parser
    from glance_sgl.demo.build import DemoRecipe, build_demo
    from glance_sgl.demo.target_training import TargetRecipe

    args = build_parser().parse_args(["demo", "build", "--quick", "--target-arch", "qwen3_vl", "--no-install"])
    assert args.target_arch == "qwen3_vl"
    target = TargetRecipe(arch="qwen3_vl", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1,
                          intermediate_size=64, vision_hidden=32, vision_depth=2, steps=2, batch_size=2,
                          max_pixels=112 * 112)
    recipe = DemoRecipe(target=target, distill_per_task=1, drafter_steps=2, drafter_layers=1, block_size=4,
                        budget=3, branch_k=2, bench_limit=1, tau_limit=1, accuracy_limit=1, eval_max_tokens=8)
    report = build_demo(tmp_path, recipe, install=False, progress=False)
    assert json.loads((tmp_path / "target" / "config.json").read_text())["model_type"] == "qwen3_vl"
    drafter_cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert drafter_cfg["architectures"] == ["DFlashDraftModel"] and drafter_cfg["num_target_layers"] == 4
    assert set(report["tau"]) and report["bench"]["glance_method"] == "auto"
    assert set(report["timings"]) == {"target_s", "distill_s", "drafter_s"}
