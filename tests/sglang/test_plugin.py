"""Plugin units (no engine): registration through SGLang's load_plugins(), server-args filling and rejection,
the verify input against SGLang's own tree helpers, the CPU ops, the drafter model class, the launcher."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from glance_sgl.drafter import GlanceDrafter, draft_logprobs
from glance_sgl.tree import build_tree, topk_per_offset
from glance_sgl.verify import greedy_walk

sglang = pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def cpu_ops():
    """This test process is a CPU process: SGLang's NGRAM module needs the CPU mode's stand-in ops to import."""
    from glance_sgl.sglang.cpu import install_sgl_kernel_stub, register_cpu_hooks

    install_sgl_kernel_stub()
    register_cpu_hooks()


@pytest.fixture(scope="module")
def plugins_loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return True


def test_registration_through_load_plugins(plugins_loaded):
    from importlib.metadata import entry_points

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    import glance_sgl.sglang as plugin

    assert any(ep.value == "glance_sgl.sglang:register" for ep in entry_points(group="sglang.srt.plugins"))
    algo = SpeculativeAlgorithm.from_string("GLANCE")
    assert algo is get_spec("glance") and algo.is_speculative() and not algo.is_ngram()
    assert algo.supports_overlap is True  # the V2 worker under SGLang's overlap scheduler: no deprecation notice
    # what SGLang's default CustomSpecAlgo lacks
    assert algo.carries_draft_hidden_states() is False and algo.need_topk() is False
    assert callable(algo.create_future_map)
    from glance_sgl.sglang.glance_worker import GlanceWorker

    assert algo.factory(None) is GlanceWorker
    assert "glance_cpu" in ATTENTION_BACKENDS and "glance_cpu" in ATTENTION_BACKEND_CHOICES
    assert "GlanceDrafterForSGLang" in ModelRegistry.models
    plugin.register()  # idempotent
    plugin._registered = False
    plugin.register()  # even when the module flag is reset: nothing registers twice
    assert get_spec("GLANCE") is algo


def _drafter_dir(tmp_path, block=16, branch_k=8):
    from glance_sgl.config import GlanceConfig

    cfg = GlanceConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_hidden_layers=1, vocab_size=50, num_target_layers=4, tap_layers=[1],
                       block_size=block, branch_k=branch_k, mask_token_id=3)
    GlanceDrafter(cfg).save_pretrained(tmp_path / "drafter")
    return tmp_path / "drafter"


def _args(path, **kw):
    base = dict(speculative_draft_model_path=str(path), speculative_num_draft_tokens=None,
                speculative_num_steps=None, speculative_eagle_topk=None, device="cpu", disable_radix_cache=False,
                enable_mixed_chunk=True, max_running_requests=None, disable_overlap_schedule=True)
    base.update(kw)
    return SimpleNamespace(**base)


def test_server_args_filled(tmp_path, plugins_loaded, monkeypatch):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    path = _drafter_dir(tmp_path, block=16, branch_k=8)
    args = _args(path)
    SpeculativeAlgorithm.from_string("GLANCE").handle_server_args(args)
    assert (args.speculative_num_draft_tokens, args.speculative_num_steps, args.speculative_eagle_topk) == (32, 15, 8)
    assert args.disable_radix_cache is False and args.enable_mixed_chunk is False  # the radix cache stays on
    assert args.max_running_requests == 48
    args = _args(path, disable_cuda_graph=False, disable_overlap_schedule=False)  # a CPU device: no graphs
    SpeculativeAlgorithm.from_string("GLANCE").handle_server_args(args)
    assert args.disable_cuda_graph is True and args.disable_overlap_schedule is True
    args = _args(path, device="cuda", disable_cuda_graph=False, disable_overlap_schedule=False)
    SpeculativeAlgorithm.from_string("GLANCE").handle_server_args(args)  # CUDA graphs stay on (graphs.py)
    assert args.disable_cuda_graph is False and args.disable_overlap_schedule is False  # and the overlap scheduler
    monkeypatch.setenv("GLANCE_SGL_CPU_OVERLAP", "1")  # the overlap path's CPU tests
    args = _args(path, disable_overlap_schedule=False)
    SpeculativeAlgorithm.from_string("GLANCE").handle_server_args(args)
    assert args.disable_overlap_schedule is False
    args = _args(path, speculative_num_draft_tokens=8, speculative_eagle_topk=2, speculative_num_steps=5)
    SpeculativeAlgorithm.from_string("GLANCE").handle_server_args(args)
    assert (args.speculative_num_draft_tokens, args.speculative_num_steps, args.speculative_eagle_topk) == (8, 5, 2)


@pytest.mark.parametrize("kw, message", [
    (dict(speculative_draft_model_path=None), "needs --speculative-draft-model-path"),
    (dict(speculative_num_steps=16), "must be in \\[1, 15\\]"),
    (dict(speculative_num_steps=0), "must be in \\[1, 15\\]"),
    (dict(speculative_eagle_topk=0), "branch_k"),
    (dict(speculative_num_draft_tokens=1), "tree budget"),
    (dict(speculative_num_draft_tokens=10, speculative_eagle_topk=1, speculative_num_steps=4), "at most 4 nodes"),
    (dict(device="npu"), "'cuda' or 'cpu'"),
])
def test_bad_server_args_rejected(tmp_path, kw, message):
    from glance_sgl.sglang.plugin import GlanceArgsError, validate_server_args

    path = _drafter_dir(tmp_path)
    with pytest.raises(GlanceArgsError, match=message):
        validate_server_args(_args(path, **kw))


def test_bad_planner_env_rejected(tmp_path, monkeypatch):
    from glance_sgl.sglang.plugin import GlanceArgsError, validate_server_args

    path = _drafter_dir(tmp_path)
    monkeypatch.setenv("GLANCE_PLANNER", "fixed")
    validate_server_args(_args(path))
    monkeypatch.setenv("GLANCE_PLANNER", "sometimes")
    with pytest.raises(GlanceArgsError, match="GLANCE_PLANNER='sometimes': choose auto, fixed"):
        validate_server_args(_args(path))
    monkeypatch.setenv("GLANCE_PLANNER", "auto")
    monkeypatch.setenv("GLANCE_CUDA_GRAPH_WIDTHS", "4,x")  # every GLANCE setting is checked at start-up
    with pytest.raises(GlanceArgsError, match="GLANCE_CUDA_GRAPH_WIDTHS"):
        validate_server_args(_args(path))


def test_bad_drafter_directory_rejected(tmp_path):
    from glance_sgl.sglang.plugin import GlanceArgsError, validate_server_args

    with pytest.raises(GlanceArgsError, match="not found"):
        validate_server_args(_args(tmp_path / "missing"))
    path = _drafter_dir(tmp_path)
    data = json.loads((path / "config.json").read_text())
    data["model_type"] = "qwen2"
    del data["architectures"], data["dflash_config"]
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(GlanceArgsError, match="neither a DFlash drafter config"):
        validate_server_args(_args(path))
    other = tmp_path / "noweights"
    other.mkdir()
    (tmp_path / "x").mkdir()
    shutil.copy(_drafter_dir(tmp_path / "x") / "config.json", other / "config.json")
    with pytest.raises(GlanceArgsError, match="weights not found"):
        validate_server_args(_args(other))


def _random_trees(bs=3, depth=6, k=3, budget=11, vocab=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=g)
    values, ids = topk_per_offset(draft_logprobs(logits), k)
    roots = torch.randint(0, vocab, (bs,), generator=g)
    return build_tree(values, ids, roots, budget)


def test_verify_input_equals_sglang_helpers(cpu_ops):
    """Positions, links and the FULL mask of a batch of trees, against SGLang's NGRAM helpers on the same mask."""
    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    from glance_sgl.sglang.glance_info import build_verify_input

    tree = _random_trees()
    bs, n = tree.tokens.shape
    seq_lens = torch.tensor([5, 9, 7])
    req_to_token = torch.arange(4 * 64).view(4, 64)
    pool_idx = torch.tensor([2, 0, 3])
    vt = build_verify_input(tree, seq_lens, seq_lens.tolist(), pool_idx, req_to_token)
    spec = vt.spec_info
    mask = tree.ancestor_mask().numpy()  # [bs, n, n], row i sees j
    # SGLang: retrive_next_token / retrive_next_sibling from the tree mask
    nt, ns = _derive_tree_links(mask.reshape(-1), bs, n)
    assert torch.equal(spec.retrieve_next_token.cpu(), nt) and torch.equal(spec.retrieve_next_sibling.cpu(), ns)
    # SGLang's positions: seq_len + number of strict ancestors
    anc = mask & (np.arange(n)[None, None, :] < np.arange(n)[None, :, None])
    assert spec.positions.view(bs, n).tolist() == (anc.sum(-1) + seq_lens.numpy()[:, None]).tolist()
    # SGLang's FULL mask (ngram_worker): per request cat(ones[n, seq_len], tree_mask[n, n]) flattened
    full = torch.cat([torch.cat([torch.ones(n, int(L), dtype=torch.bool), torch.from_numpy(mask[b])], 1).flatten()
                      for b, L in enumerate(seq_lens.tolist())])
    assert torch.equal(spec.custom_mask.bool(), full)
    # out_cache_loc: the slots right after each prefix (assign_extend_cache_locs)
    want = torch.cat([req_to_token[r, L:L + n] for r, L in zip(pool_idx.tolist(), seq_lens.tolist())])
    assert torch.equal(vt.out_cache_loc, want)
    assert torch.equal(vt.input_ids, tree.tokens.reshape(-1))
    assert spec.draft_token_num == n and spec.retrieve_index.view(-1).tolist() == list(range(bs * n))


def test_a_ragged_verify_input_holds_each_requests_own_rows(cpu_ops):
    """``build_verify_input(rows=...)``: request b's first ``rows[b]`` rows alone, in request order (their tokens,
    positions and cache slots as in the uniform input), no flat FULL mask, the trees' ancestor mask and the rows
    for the ``glance_cpu`` backend, and each kept row's index in the uniform layout (for the logits' way back)."""
    from glance_sgl.sglang.glance_info import build_verify_input

    tree = _random_trees()
    bs, n = tree.tokens.shape
    rows = [1, n, 3]
    cut = tree.truncated(rows)
    seq_lens = torch.tensor([5, 9, 7])
    req_to_token = torch.arange(4 * 64).view(4, 64)
    pool_idx = torch.tensor([2, 0, 3])
    full = build_verify_input(tree, seq_lens, seq_lens.tolist(), pool_idx, req_to_token)
    vt = build_verify_input(cut, seq_lens, seq_lens.tolist(), pool_idx, req_to_token, rows=rows)
    kept = [b * n + j for b, r in enumerate(rows) for j in range(r)]
    assert vt.rows.tolist() == kept and vt.left_out.tolist() == sorted(set(range(bs * n)) - set(kept))
    assert vt.input_ids.tolist() == [full.input_ids.tolist()[i] for i in kept]
    assert vt.out_cache_loc.tolist() == [full.out_cache_loc.tolist()[i] for i in kept]
    assert vt.spec_info.positions.tolist() == [full.spec_info.positions.tolist()[i] for i in kept]
    assert vt.spec_info.ragged_rows == rows and vt.spec_info.custom_mask.numel() == 0
    for b, r in enumerate(rows):  # each request's kept rows see the same ancestors as in the whole tree
        assert torch.equal(vt.spec_info.ragged_tree_mask[b, :r, :r], full.tree_mask[b, :r, :r])


def test_cpu_reconstruct_matches_sglang_links(cpu_ops):
    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    from glance_sgl.sglang.cpu import reconstruct_indices_from_tree_mask

    tree = _random_trees(bs=4, budget=15, seed=3)
    bs, n = tree.tokens.shape
    mask = tree.ancestor_mask()
    pos, idx = torch.empty(bs * n, dtype=torch.long), torch.empty(bs, n, dtype=torch.long)
    nt, ns = torch.empty(bs, n, dtype=torch.long), torch.empty(bs, n, dtype=torch.long)
    reconstruct_indices_from_tree_mask(mask.flatten(), torch.tensor([3, 4, 5, 6]), pos, idx, nt, ns, bs, n)
    want_nt, want_ns = _derive_tree_links(mask.numpy().reshape(-1), bs, n)
    assert torch.equal(nt, want_nt) and torch.equal(ns, want_ns)
    assert torch.equal(pos.view(bs, n), tree.depths + torch.tensor([3, 4, 5, 6])[:, None])


def test_cpu_verify_tree_greedy_equals_walk():
    from glance_sgl.sglang.cpu import verify_tree_greedy

    tree = _random_trees(bs=4, budget=15, seed=5)
    bs, n = tree.tokens.shape
    first, sib = tree.pointers()
    g = torch.Generator().manual_seed(1)
    # target choices that follow the tree for a while
    choices = torch.randint(0, 20, (bs, n), generator=g)
    for b in range(bs):
        for r in range(n):
            c = int(first[b, r])
            if c >= 0 and torch.rand(1, generator=g) < 0.8:
                choices[b, r] = tree.tokens[b, c]
    walk = greedy_walk(tree.tokens, tree.parents, choices)
    width = n
    predicts = torch.zeros(bs * n, dtype=torch.long)
    acc_idx = torch.full((bs, width), -1, dtype=torch.long)
    acc_num = torch.zeros(bs, dtype=torch.long)
    ri = torch.arange(bs * n).view(bs, n)
    verify_tree_greedy(predicts, acc_idx, acc_num, tree.tokens, ri, first, sib, choices)
    assert torch.equal(acc_num, walk.accept_lens)
    for b in range(bs):
        k = int(walk.accept_lens[b]) + 1
        assert (acc_idx[b, :k] - b * n).tolist() == walk.accepted_rows[b, :k].tolist()
        assert int(predicts[int(acc_idx[b, k - 1])]) == int(walk.bonus[b])


def test_drafter_model_class_loads_the_engine_checkpoint(tmp_path):
    from glance_sgl.sglang.drafter_model import GlanceDrafterForSGLang

    path = _drafter_dir(tmp_path)
    ours = GlanceDrafterForSGLang.from_checkpoint(path)
    ref = GlanceDrafter.from_pretrained(path)
    for (ka, a), (kb, b) in zip(sorted(ours.drafter.state_dict().items()), sorted(ref.state_dict().items())):
        assert ka == kb and torch.equal(a, b)

    class Head(torch.nn.Module):  # SGLang's ParallelLMHead: weight only, vocabulary padded to a multiple of 64
        def __init__(self, w):
            super().__init__()
            self.weight = torch.nn.Parameter(w)

    vocab, h = ref.config.vocab_size, ref.config.hidden_size
    emb = torch.randn(64, h)
    emb[vocab:] = 0
    target = SimpleNamespace(get_input_embeddings=lambda: torch.nn.Embedding.from_pretrained(emb),
                             lm_head=Head(emb.clone()))
    bound = ours.bind_target(target)
    ref.bind_target(torch.nn.Embedding.from_pretrained(emb[:vocab]), torch.nn.Linear(h, vocab, bias=False))
    ref._shared["lm_head"].weight.data.copy_(emb[:vocab])
    cache_a, cache_b = bound.new_cache(1), ref.new_cache(1)
    taps = torch.randn(1, 5, h)
    bound.extend_context(cache_a, taps, torch.tensor([5]))
    ref.extend_context(cache_b, taps, torch.tensor([5]))
    la, lb = bound.draft_block(cache_a, torch.tensor([4])), ref.draft_block(cache_b, torch.tensor([4]))
    assert la.shape[-1] == vocab and torch.allclose(la, lb, atol=1e-6)


def test_hf_config_registered_for_sglang_get_config(tmp_path, plugins_loaded):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(_drafter_dir(tmp_path)))  # the DFlash layout: a Qwen3 config
    assert cfg.model_type == "qwen3" and cfg.architectures == ["DFlashDraftModel"]
    legacy = tmp_path / "legacy"
    GlanceDrafter.from_pretrained(_drafter_dir(tmp_path / "x")).save_pretrained(legacy, format="glance")
    cfg = AutoConfig.from_pretrained(str(legacy))  # the former layout, through the registered config class
    assert cfg.model_type == "glance_drafter" and cfg.architectures == ["GlanceDrafterForSGLang"]


def test_launch_command():
    from glance_sgl.cli import default_checkpoints
    from glance_sgl.sglang.launch import server_command

    model = default_checkpoints()[0]  # the CPU mode reads the model's context length from its config
    cmd = server_command(model, "/d", port=31234, cpu=True, extra_args=["--log-level", "warning"])
    joined = " ".join(cmd)
    assert f"-m sglang.launch_server --model-path {model}" in joined
    assert "--context-length 2048" in joined  # the demo's max_position_embeddings, as the embedded engine serves
    assert "--speculative-algorithm GLANCE --speculative-draft-model-path /d" in joined
    assert "--device cpu --attention-backend glance_cpu" in joined and "--port 31234" in joined
    assert cmd[-2:] == ["--log-level", "warning"]
    assert "--speculative-algorithm" not in server_command("/m", None)


def test_draft_pool_bytes_join_sglangs_kv_cell_size(tmp_path, plugins_loaded, monkeypatch):
    """The draft KV pool is budgeted with the target's: SGLang's per-token cell size (what its KV budget is
    divided by) gains the drafter's K+V bytes per token, for GLANCE only, not for a draft worker, and not where the
    drafter is not among the sources."""
    from types import SimpleNamespace

    import sglang.srt.runtime_context as rc
    from sglang.srt.plugins.hook_registry import HookRegistry

    from glance_sgl.sglang import draft_pool

    target = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__"
    assert any(hook is draft_pool._add_draft_cell for _, hook, _ in HookRegistry._hooks[target])
    path = _drafter_dir(tmp_path)  # 1 layer, 2 KV heads of 16
    monkeypatch.setattr(rc, "get_spec", lambda: SimpleNamespace(speculative_draft_model_path=str(path)))
    for name, draft_worker, extra in (("GLANCE", False, 2 * 1 * 2 * 16 * 4), ("GLANCE", True, 0), ("NGRAM", False, 0)):
        conf = SimpleNamespace(_cell_size=1000)
        kvc = SimpleNamespace(spec_algorithm=SimpleNamespace(name=name), is_draft_worker=draft_worker,
                              model_config=SimpleNamespace(dtype=torch.float32))
        draft_pool._add_draft_cell(None, conf, kvc)
        assert conf._cell_size == 1000 + extra, (name, draft_worker)
    # n-gram candidates alone: the worker allocates no draft pool, so SGLang's KV budget keeps its whole cell
    monkeypatch.setenv("GLANCE_DRAFT_SOURCES", "ngram")
    conf = SimpleNamespace(_cell_size=1000)
    draft_pool._add_draft_cell(None, conf, SimpleNamespace(spec_algorithm=SimpleNamespace(name="GLANCE"),
                                                            is_draft_worker=False,
                                                            model_config=SimpleNamespace(dtype=torch.float32)))
    assert conf._cell_size == 1000


def test_a_cpu_server_forks_its_processes_and_a_gpu_server_spawns_them(plugins_loaded):
    """SGLang spawns its scheduler and detokenizer (CUDA cannot be forked); on a CPU each spawned child imports
    SGLang again, about 10 s of CPU on 2 cores, so the CPU mode forks them: an AFTER hook on the function that
    sets the start method, for the CPU device only."""
    import multiprocessing
    from types import SimpleNamespace

    from sglang.srt.plugins.hook_registry import HookRegistry

    from glance_sgl.sglang import cpu

    target = "sglang.srt.entrypoints.engine._set_envs_and_config"
    assert any(hook is cpu._fork_on_cpu_hook for _, hook, _ in HookRegistry._hooks[target])
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        multiprocessing.set_start_method("spawn", force=True)
        assert cpu._fork_on_cpu_hook("kept", SimpleNamespace(device="cuda")) == "kept"
        assert multiprocessing.get_start_method() == "spawn"
        assert cpu._fork_on_cpu_hook(None, SimpleNamespace(device="cpu")) is None
        assert multiprocessing.get_start_method() == "fork"
    finally:
        multiprocessing.set_start_method(before, force=True)


@pytest.mark.parametrize("ragged", [False, True])
def test_cpu_verify_attention_in_one_call_equals_one_call_per_request(ragged):
    """The ``glance_cpu`` backend's verify attention over every request at once (K/V padded to the longest
    request, :func:`glance_sgl.sglang.cpu.batched_layout`) gives each row what one SDPA call per request gives it,
    for uniform and ragged passes (tree masks, prefixes of different lengths, GQA); a batch that would pad too
    much keeps one call per request."""
    from glance_sgl.sglang.cpu import attend_batched, attend_per_request, batched_layout

    g = torch.Generator().manual_seed(3 + ragged)
    hq, hk, d, slots_total = 6, 2, 8, 400
    k_buf, v_buf = torch.randn(slots_total, hk, d, generator=g), torch.randn(slots_total, hk, d, generator=g)
    prefixes = [37, 5, 60, 21]
    rows = [7, 3, 7, 1] if ragged else [7] * 4
    layout, start, taken = [], 0, torch.randperm(slots_total, generator=g)
    for pre, n in zip(prefixes, rows):
        seg = torch.ones(n, pre + n, dtype=torch.bool)
        seg[:, pre:] = torch.rand(n, n, generator=g) < 0.5  # a random tree mask: every row sees itself
        seg[:, pre:] |= torch.eye(n, dtype=torch.bool)
        seg[:, pre:] &= torch.tril(torch.ones(n, n, dtype=torch.bool))
        layout.append((seg, taken[:pre + n].clone(), start, n))
        taken, start = taken[pre + n:], start + n
    q = torch.randn(start, hq, d, generator=g)
    batched = batched_layout(layout)
    assert batched is not None and (batched[2] is None) == (not ragged)
    want = attend_per_request(q, k_buf, v_buf, layout, 0.3, d)
    got = attend_batched(q, k_buf, v_buf, batched, 0.3, d)
    assert got.shape == want.shape == (start, hq * d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # one long request among short ones: padding all to it would cost more than the calls it saves
    assert batched_layout(layout, pad_limit=1.0) is None and batched_layout(layout[:1]) is None
    # ... and a batch whose padded K/V would pass the bound (4 requests x 67 slots)
    assert batched_layout(layout, max_slots=4 * 67 - 1) is None and batched_layout(layout, max_slots=4 * 67)
