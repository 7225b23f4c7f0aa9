"""The draft head: config, persistence, batching, incremental context."""

from __future__ import annotations

import json

import pytest
import torch

from glance_sgl.config import GlanceConfig, default_tap_layers
from glance_sgl.drafter import GlanceDrafter

from tests.glance_testing import random_drafter, tiny_bound_drafter


def test_default_taps():
    assert default_tap_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_tap_layers(4, 1) == [2]
    assert default_tap_layers(4, 2) == [1, 1]  # n - 4 = 0: both taps at layer 1
    assert default_tap_layers(28, 3) == [1, 13, 25]


def test_config_rejects_bad_values(targets):
    base = GlanceConfig.for_target(targets["qwen2_5_vl"].text_config, mask_token_id=3).to_dict()
    for field, value in [("block_size", 1), ("budget", 0), ("branch_k", 0), ("tap_layers", [99]),
                         ("tap_layers", []), ("mask_token_id", 10**6)]:
        bad = dict(base, **{field: value})
        with pytest.raises(ValueError):
            GlanceConfig.from_dict(bad)
    with pytest.raises(ValueError, match="unknown"):
        GlanceConfig.from_dict(dict(base, bogus=1))


def test_save_load_round_trip(tmp_path, targets):
    target = targets["qwen2_5_vl"]
    drafter = random_drafter(target, seed=5, num_hidden_layers=2, num_taps=3).bind_target(
        target.input_embeddings(), target.lm_head())
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"]  # the DFlash layout (tests/test_dflash_format.py)
    assert saved["dflash_config"]["target_layer_ids"] == drafter.config.tap_layers
    from safetensors.torch import load_file
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert not any("embed" in k or "lm_head" in k for k in keys), "shared target modules must not be saved"
    loaded = GlanceDrafter.from_pretrained(tmp_path).bind_target(target.input_embeddings(), target.lm_head())
    taps = torch.randn(1, 10, 3 * drafter.config.hidden_size)
    outs = []
    for model in (drafter, loaded):
        cache = model.new_cache(1)
        model.extend_context(cache, taps, torch.tensor([10]))
        outs.append(model.draft_block(cache, torch.tensor([4])))
    assert torch.equal(outs[0], outs[1])
    assert outs[0].shape == (1, drafter.config.block_size - 1, drafter.config.vocab_size)


def test_unbound_drafter_errors(targets):
    drafter = random_drafter(targets["qwen2_vl"])
    cache = drafter.new_cache(1)
    with pytest.raises(RuntimeError, match="bind_target"):
        drafter.draft_block(cache, torch.tensor([1]))


def test_batched_equals_single_and_incremental_equals_at_once(targets):
    target = targets["qwen2_vl"]
    drafter = random_drafter(target, seed=6, num_hidden_layers=2).bind_target(
        target.input_embeddings(), target.lm_head())
    h = drafter.config.hidden_size * len(drafter.config.tap_layers)
    lengths = [7, 13, 1]
    feats = [torch.randn(n, h) for n in lengths]
    roots = torch.tensor([3, 9, 11])
    singles = []
    for f, root in zip(feats, roots):
        cache = drafter.new_cache(1, capacity=4)  # forces growth
        drafter.extend_context(cache, f[None, :4], torch.tensor([min(4, len(f))]))
        if len(f) > 4:
            drafter.extend_context(cache, f[None, 4:], torch.tensor([len(f) - 4]))
        singles.append(drafter.draft_block(cache, root[None]))
    padded = torch.zeros(3, max(lengths), h)
    for i, f in enumerate(feats):
        padded[i, : len(f)] = f
    cache = drafter.new_cache(3)
    drafter.extend_context(cache, padded, torch.tensor(lengths))
    batched = drafter.draft_block(cache, roots)
    for i in range(3):
        torch.testing.assert_close(batched[i], singles[i][0], atol=1e-5, rtol=1e-5)
    sub = cache.select(torch.tensor([2, 0]))
    torch.testing.assert_close(drafter.draft_block(sub, roots[[2, 0]]), torch.cat([singles[2], singles[0]]),
                               atol=1e-5, rtol=1e-5)


def test_a_pass_compiled_token_major_reads_the_draft_pool_without_compiling_again():
    """The SGLang worker's drafter reads contexts gathered from its draft KV pool, laid out token-major; compiled at
    start-up on that layout (``compile_block(token_major=True)``), drafting from the pool compiles nothing more (on
    the other layout the compiler's stride guards compiled twice more on the first drafting steps, seconds each),
    and the logits equal the eager pass's."""
    from torch._dynamo.utils import counters

    from glance_sgl.sglang.draft_pool import DraftKVPool

    drafter, eager = tiny_bound_drafter(block_size=6, kv_heads=2), tiny_bound_drafter(block_size=6, kv_heads=2)
    assert drafter.compile_block(batch_sizes=(1, 2), token_major=True)
    graphs = counters["stats"]["unique_graphs"]
    pool = DraftKVPool(drafter, size=64, device="cpu", dtype=torch.float32)
    h = drafter.config.hidden_size * len(drafter.config.tap_layers)
    torch.manual_seed(2)
    pool.write(torch.arange(1, 64), torch.randn(63, h), torch.arange(63) % 16)
    req_to_token = torch.arange(64).view(4, 16)
    for lengths in ([9], [12, 3, 7], [5, 16]):
        cache = pool.gather(req_to_token, torch.arange(len(lengths)), torch.tensor(lengths), max(lengths))
        assert cache.keys[0].stride(2) != cache.keys[0].shape[-1]  # token-major: not the contiguous layout
        roots = torch.randint(4, 40, (len(lengths),))
        torch.testing.assert_close(drafter.draft_block(cache, roots, context_len=max(lengths)),
                                   eager.draft_block(cache, roots, context_len=max(lengths)), atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_compiled_block_pass_matches_the_eager_one_and_falls_back_when_it_fails(caplog):
    """``compile_block`` (on a CPU) runs the block pass through torch.compile with dynamic shapes: the logits equal
    the eager pass's up to float rounding for one request and for a batch of unequal contexts (the masked branch),
    at context lengths it was not compiled for. A compile that fails leaves the pass eager, with a warning."""
    drafter = tiny_bound_drafter(block_size=6)
    eager = tiny_bound_drafter(block_size=6)
    assert not drafter.block_compiled and drafter.compile_block() and drafter.block_compiled
    h = drafter.config.hidden_size * len(drafter.config.tap_layers)
    torch.manual_seed(1)
    for lengths in ([9], [5], [12, 3, 7], [20, 20, 2, 11]):
        feats = torch.randn(len(lengths), max(lengths), h)
        roots = torch.randint(4, 40, (len(lengths),))
        caches = []
        for d in (drafter, eager):
            cache = d.new_cache(len(lengths), capacity=32)
            d.extend_context(cache, feats, torch.tensor(lengths))
            caches.append(cache)
        torch.testing.assert_close(drafter.draft_block(caches[0], roots), eager.draft_block(caches[1], roots),
                                   atol=1e-4, rtol=1e-4)

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    drafter._compiled_block = broken
    cache = drafter.new_cache(1, capacity=32)
    drafter.extend_context(cache, torch.randn(1, 4, h), torch.tensor([4]))
    with caplog.at_level("WARNING", logger="glance_sgl.drafter"):
        out = drafter.draft_block(cache, torch.tensor([5]))
    assert out.shape == (1, 5, 40) and not drafter.block_compiled
    assert "running it eagerly" in caplog.text
