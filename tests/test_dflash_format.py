"""The drafter checkpoint is a DFlash checkpoint: written in DFlash's layout, read from DFlash's reference layout,
accepted by SGLang's DFlash parser; the former ``glance_drafter`` layout still loads and ``glance convert``
rewrites it; ``target_layer_ids`` are our tap layers unchanged (Hugging Face ``hidden_states[id + 1]``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from glance_sgl.config import GlanceConfig
from glance_sgl.drafter import GlanceDrafter

from tests.glance_testing import make_prompts, random_drafter

DFLASH_WEIGHTS = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
    f"layers.0.{n}.weight" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
        "post_attention_layernorm")]


def _drafts(drafter: GlanceDrafter, target, seed: int = 0) -> torch.Tensor:
    """Draft logits [2, B-1, V] of two requests (contexts of 13 and 7 random tap rows)."""
    drafter.bind_target(target.input_embeddings(), target.lm_head())
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(2, 13, drafter.fc.in_features, generator=g)
    cache = drafter.new_cache(2)
    drafter.extend_context(cache, taps, torch.tensor([13, 7]))
    return drafter.draft_block(cache, torch.tensor([5, 9]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, targets):
    """A random 2-layer, 3-tap drafter for the Qwen2.5-VL test target, saved by us."""
    drafter = random_drafter(targets["qwen2_5_vl"], seed=21, num_hidden_layers=2, num_taps=3, budget=9, branch_k=3,
                             block_size=8)
    path = drafter.save_pretrained(tmp_path_factory.mktemp("dflash") / "ours")
    return drafter, path


def test_saved_config_and_weights_are_dflash(saved):
    from safetensors.torch import load_file

    drafter, path = saved
    cfg = json.loads((path / "config.json").read_text())
    c = drafter.config
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == c.num_target_layers
    assert cfg["dflash_config"] == {"mask_token_id": c.mask_token_id, "target_layer_ids": c.tap_layers}
    for key in ("num_hidden_layers", "hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size"):
        assert cfg[key] == getattr(c, key), key
    assert cfg["glance"]["budget"] == 9 and cfg["glance"]["branch_k"] == 3
    weights = load_file(str(path / "model.safetensors"))
    assert set(DFLASH_WEIGHTS) <= set(weights) and not any("embed" in k or "lm_head" in k for k in weights)
    assert weights["fc.weight"].shape == (c.hidden_size, 3 * c.hidden_size)
    assert GlanceConfig.load(path) == c


def test_sglang_dflash_parser_accepts_our_configs(saved):
    from transformers import AutoConfig
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    from glance_sgl.demo.paths import bundled_drafter

    drafter, path = saved
    bundled = bundled_drafter()
    for directory in (path, bundled):
        ours = GlanceConfig.load(directory)
        raw = json.loads((directory / "config.json").read_text())
        hf = AutoConfig.from_pretrained(str(directory))  # what SGLang's get_config hands DFLASH: a Qwen3Config
        assert hf.model_type == "qwen3" and hf.architectures == ["DFlashDraftModel"]
        for cfg in (raw, hf):
            parsed = parse_dflash_draft_config(draft_hf_config=cfg)
            assert parsed.num_hidden_layers == ours.num_hidden_layers
            assert parsed.block_size == ours.block_size and parsed.mask_token_id == ours.mask_token_id
            assert parsed.num_target_layers == ours.num_target_layers
            assert parsed.resolve_target_layer_ids(target_num_layers=ours.num_target_layers) == ours.tap_layers
        assert GlanceConfig.from_any_dict(hf.to_dict()) == ours  # through transformers' Qwen3Config and back


def _reference_layout(path, drafter: GlanceDrafter, prefix: str = "", shards: int = 1) -> None:
    """Write ``drafter``'s weights as DFlash's reference code saves its ``DFlashDraftModel`` (a
    ``Qwen3PreTrainedModel``): ``Qwen3Config.save_pretrained`` for config.json (``rope_parameters``, the
    transformers defaults, ``dflash_config``) and safetensors of the state dict, optionally ``model.``-prefixed or
    sharded with an index."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    c = drafter.config
    config = Qwen3Config(hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                         num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                         head_dim=c.head_dim, intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                         rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, max_position_embeddings=40960,
                         tie_word_embeddings=False)
    config.architectures = ["DFlashDraftModel"]
    config.block_size = c.block_size
    config.num_target_layers = c.num_target_layers
    config.dflash_config = {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.tap_layers)}
    config.save_pretrained(path)
    state = {prefix + k: v.detach().clone().contiguous() for k, v in drafter.state_dict().items()}
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _dflash_reference_draft(state: dict[str, torch.Tensor], cfg: dict, ctx_hidden: torch.Tensor,
                            block_embeds: torch.Tensor) -> torch.Tensor:
    """DFlash's draft forward (its reference ``Qwen3DFlashAttention`` / decoder layer, written out): the context
    ``ctx_hidden`` [1, C, L*H] (``extract_context_feature``: concatenated ``hidden_states[id + 1]``) and the noise
    block's embeddings [1, B, H] at positions C..C+B-1; returns the final-normed block states [1, B, H]."""
    eps, d, theta = cfg["rms_norm_eps"], cfg["head_dim"], cfg["rope_parameters"]["rope_theta"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rms(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    target = rms(F.linear(ctx_hidden, state["fc.weight"]), state["hidden_norm.weight"])
    c, b = target.shape[1], block_embeds.shape[1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(c + b, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    x = block_embeds
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n: state[f"layers.{i}.{n}.weight"]  # noqa: E731
        h = rms(x, p("input_layernorm"))
        q = rms(F.linear(h, p("self_attn.q_proj")).view(1, b, nh, d), p("self_attn.q_norm")).transpose(1, 2)
        both = torch.cat([target, h], dim=1)
        k = rms(F.linear(both, p("self_attn.k_proj")).view(1, c + b, kvh, d), p("self_attn.k_norm")).transpose(1, 2)
        v = F.linear(both, p("self_attn.v_proj")).view(1, c + b, kvh, d).transpose(1, 2)
        q = q * cos[..., -b:, :] + rot(q) * sin[..., -b:, :]
        k = k * cos + rot(k) * sin
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(nh // kvh, 1), v.repeat_interleave(nh // kvh, 1))
        x = x + F.linear(out.transpose(1, 2).reshape(1, b, -1), p("self_attn.o_proj"))
        h = rms(x, p("post_attention_layernorm"))
        x = x + F.linear(F.silu(F.linear(h, p("mlp.gate_proj"))) * F.linear(h, p("mlp.up_proj")), p("mlp.down_proj"))
    return rms(x, state["norm.weight"])


def test_reference_layout_checkpoint_loads_and_drafts_identically(tmp_path, saved, targets):
    from safetensors.torch import load_file

    drafter, ours = saved
    target = targets["qwen2_5_vl"]
    expected = _drafts(GlanceDrafter.from_pretrained(ours), target)
    for name, prefix, shards in (("plain", "", 1), ("prefixed", "model.", 1), ("sharded", "", 2)):
        path = tmp_path / name
        _reference_layout(path, drafter, prefix=prefix, shards=shards)
        loaded = GlanceDrafter.from_pretrained(path)
        assert loaded.config.tap_layers == drafter.config.tap_layers and loaded.config.block_size == 8
        assert torch.equal(_drafts(loaded, target), expected), name
    # and what we draft is what DFlash's forward computes from those tensors: the whole context in one pass
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    state = load_file(str(tmp_path / "plain" / "model.safetensors"))
    loaded = GlanceDrafter.from_pretrained(tmp_path / "plain").bind_target(target.input_embeddings(), target.lm_head())
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(1, 11, loaded.fc.in_features, generator=g)
    cache = loaded.new_cache(1)
    loaded.extend_context(cache, ctx, torch.tensor([11]))
    root = torch.tensor([5])
    ours_logits = loaded.draft_block(cache, root)
    block = torch.full((1, cfg["block_size"]), cfg["dflash_config"]["mask_token_id"])
    block[0, 0] = root
    ref_hidden = _dflash_reference_draft(state, cfg, ctx, target.input_embeddings()(block))
    ref_logits = target.lm_head()(ref_hidden[:, 1:])
    assert torch.allclose(ours_logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_former_layout_loads_and_glance_convert_rewrites_it(tmp_path, saved, targets):
    from safetensors.torch import load_file

    from glance_sgl.cli import main

    drafter, ours = saved
    legacy = tmp_path / "legacy"
    drafter.save_pretrained(legacy, format="glance")
    data = json.loads((legacy / "config.json").read_text())
    assert data["model_type"] == "glance_drafter" and data["tap_layers"] == drafter.config.tap_layers
    expected = _drafts(GlanceDrafter.from_pretrained(ours), targets["qwen2_5_vl"])
    assert torch.equal(_drafts(GlanceDrafter.from_pretrained(legacy), targets["qwen2_5_vl"]), expected)
    out = tmp_path / "converted"
    assert main(["convert", str(legacy), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text()) == json.loads((ours / "config.json").read_text())
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ours / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    in_place = tmp_path / "in_place"
    shutil.copytree(legacy, in_place)
    assert main(["convert", str(in_place)]) == 0 and GlanceConfig.load(in_place) == drafter.config


def test_unsupported_dflash_variants_are_refused(saved):
    _, path = saved
    base = json.loads((path / "config.json").read_text())
    for change in ({"layer_types": ["sliding_attention", "full_attention"]}, {"attention_bias": True},
                   {"dflash_config": dict(base["dflash_config"], conv_kernel_size=3, conv_group_size=2)},
                   {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                   {"dflash_config": {"target_layer_ids": [1, 2, 3]}}):
        with pytest.raises(ValueError):
            GlanceConfig.from_any_dict(dict(base, **change))
    with pytest.raises(ValueError, match="neither a DFlash"):
        GlanceConfig.from_any_dict({k: v for k, v in base.items() if k not in ("architectures", "dflash_config")})


def test_target_layer_ids_are_hf_hidden_states_plus_one(saved, targets):
    """Embedded engine: the taps a DFlash config names are what DFlash's ``extract_context_feature`` reads from
    Hugging Face (``hidden_states[id + 1]``), bit for bit, with and without images (Qwen2.5-VL and Qwen2-VL: no
    deepstack; Qwen3-VL: tests/test_qwen3_vl.py)."""
    drafter, _ = saved
    ids = drafter.config.tap_layers
    for arch in ("qwen2_5_vl", "qwen2_vl"):
        target = targets[arch]
        for messages in make_prompts(5, seed=4)[3:5]:  # two images; text only
            prompt = target.prepare(messages)
            _, rows = target.prefill(prompt, taps=ids)
            with torch.no_grad():
                hs = target.model(**prompt.inputs, output_hidden_states=True).hidden_states
            assert torch.equal(rows.taps, torch.cat([hs[i + 1][0] for i in ids], dim=-1)), arch
