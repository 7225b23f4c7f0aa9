"""CPU mode for SGLang: what SGLang 0.5.23 needs to run GLANCE (and its own NGRAM) on a CPU.

A development and CI mode, loaded only when the device is the CPU:

- ``glance_cpu``: an attention backend (registered through SGLang's attention-backend registry) that subclasses
  ``TorchNativeAttnBackend`` and adds the TARGET_VERIFY pass: SDPA of each request's ``n`` verify rows over
  ``req_to_token[r, :L + n]`` with the speculative input's FULL custom mask (``[n, L + n]`` per request), or in a
  ragged pass each request's own ``n_b`` rows, masked by the trees' ancestor mask (``ragged_rows``,
  ``ragged_tree_mask`` of ``glance_sgl.sglang.glance_info.GlanceVerifyInput``); all requests in one call over
  K/V padded to the longest (``PAD_LIMIT``), else one call per request.
  Select it with ``--attention-backend glance_cpu`` (``--device cpu``).
- torch versions of the speculative bookkeeping ops that SGLang runs as Triton / ``sgl_kernel`` code
  (``assign_req_to_token_pool``, the cache-location fills, ``verify_tree_greedy``, and ``get_last_loc``, which
  the allocator of a paged KV cache calls), and the CPU KV pool's warm-up without Triton: SGLang HookRegistry
  AROUND hooks (:func:`register_cpu_hooks`) that take the torch port for CPU tensors and SGLang's own function for
  any other device (so SGLang's own NGRAM also runs here, for the benchmark). GLANCE's worker itself needs none of
  them: it uses ``glance_sgl.verify`` and ``glance_kernels``;
- module stand-ins where SGLang imports a CUDA-only module at import time, which no hook can precede: a
  ``vllm._custom_ops`` (SGLang's rotary embedding imports ``rotary_embedding`` from it off CUDA and never calls it
  on the CPU path) and an ``sgl_kernel.speculative`` holding only ``reconstruct_indices_from_tree_mask``.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import sys
import types

import torch

logger = logging.getLogger(__name__)

BACKEND_NAME = "glance_cpu"
# The verify pass attends all its requests in one SDPA call over K/V padded to the longest request where that pads
# at most this factor over the requests' own lengths (one call per request otherwise): on 2 cores, 6 layers, 10-13
# rows a request over 250-450-token prefixes, 1 / 4 / 8 / 16 requests took 3.0 / 7.3 / 10.6 / 20.0 ms in one call
# against 3.1 / 9.5 / 17.1 / 32.0 ms in a call each (a microbenchmark of the two layouts)
PAD_LIMIT = 2.0
# ... and where the padded K (and V) of one layer stay within this many bytes: the per-request calls hold one
# request's at a time (16 requests of 32k tokens of a 7B model's 8 x 128 K heads would gather 2 GiB a layer)
BATCHED_KV_BYTES = 64 << 20


def install_vllm_stub() -> None:
    """A stand-in ``vllm._custom_ops`` when vllm is absent (the import is made, the function never called)."""
    if "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        return

    def rotary_embedding(*args, **kwargs):  # pragma: no cover - never called on the CPU path
        raise RuntimeError("vllm is not installed: the CUDA rotary kernel is unavailable on this machine")

    vllm = types.ModuleType("vllm")
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding
    vllm._custom_ops = ops
    vllm.__glance_stub__ = True
    sys.modules["vllm"], sys.modules["vllm._custom_ops"] = vllm, ops


# ---------------------------------------------------------------------------------------------- torch ops
def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrive_index, retrive_next_token,
                                       retrive_next_sibling, batch_size, draft_token_num):
    """Torch port of ``sgl_kernel``'s op (same contract as SGLang's Triton fallback), in place."""
    n = draft_token_num
    mask = tree_mask.view(batch_size, n, n).bool()
    idx = torch.arange(n, device=mask.device)
    anc = mask & (idx[None, None, :] < idx[None, :, None])  # strict ancestors [b, i, j]
    positions.view(batch_size, n).copy_(anc.sum(-1) + verified_seq_len.view(-1, 1).to(positions.dtype))
    retrive_index.view(batch_size, n).copy_(torch.arange(batch_size, device=mask.device)[:, None] * n + idx[None])
    parent = torch.where(anc, idx[None, None, :], -1).max(-1).values  # [b, i]
    big = torch.full_like(parent, n)
    # first child of tid: min k > tid with anc[k, tid]
    child = torch.where(anc.transpose(1, 2), idx[None, None, :], n).min(-1).values
    retrive_next_token.view(batch_size, n).copy_(torch.where(child >= n, -1, child))
    same = (parent[:, None, :] == parent[:, :, None]) & (idx[None, None, :] > idx[None, :, None])
    sib = torch.where(same, idx[None, None, :], big[:, :, None]).min(-1).values
    sib = torch.where((sib >= n) | (parent < 0), -1, sib)
    retrive_next_sibling.view(batch_size, n).copy_(sib)


def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                       retrive_next_sibling, target_predict, *args, **kwargs):
    """Torch port of ``verify_tree_greedy`` (in place): walk every tree along the target's argmax."""
    bs, n = candidates.shape
    width = accept_index.shape[1]
    cand = candidates.tolist()
    nt, ns, ri = retrive_next_token.tolist(), retrive_next_sibling.tolist(), retrive_index.tolist()
    tp = target_predict.view(bs, n).tolist() if target_predict.dim() == 2 or target_predict.numel() == bs * n \
        else target_predict.tolist()
    acc_idx = [[-1] * width for _ in range(bs)]
    acc_num = [0] * bs
    pred_updates = {}
    for b in range(bs):
        last = 0
        acc_idx[b][0] = ri[b][0]
        cur = nt[b][0]
        for j in range(1, width):
            while cur != -1:
                if cand[b][cur] == tp[b][last]:
                    break
                cur = ns[b][cur]
            if cur == -1:
                break
            pred_updates[ri[b][last]] = cand[b][cur]
            acc_idx[b][j] = ri[b][cur]
            acc_num[b] += 1
            last = cur
            cur = nt[b][cur]
        pred_updates[ri[b][last]] = tp[b][last]
    flat = predicts.view(-1)
    for k, v in pred_updates.items():
        flat[k] = v
    accept_index.copy_(torch.tensor(acc_idx, dtype=accept_index.dtype))
    accept_token_num.copy_(torch.tensor(acc_num, dtype=accept_token_num.dtype))


def assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                             batch_size=None):
    """Torch port of SGLang's ``assign_req_to_token_pool``: write each request's new slots
    ``out_cache_loc[sum(prev lens) : ...]`` into ``req_to_token[r, start:end]``."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    rows = req_pool_indices.tolist()
    off = 0
    for r, a, b in zip(rows, starts, ends):
        req_to_token[r, a:b] = out_cache_loc[off: off + (b - a)].to(req_to_token.dtype)
        off += b - a


def assign_extend_cache_locs(req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
                             draft_token_num, device=None):
    """Torch port of ``assign_extend_cache_locs_func``: the slots ``req_to_token[r, start:end]``, flattened."""
    cols = start_offset.long()[:, None] + torch.arange(draft_token_num, device=req_to_token.device)[None, :]
    return req_to_token[req_pool_indices.long()[:, None], cols].reshape(-1).to(torch.int64)


def fill_front_out_cache_loc(num_front, out_cache_loc, front_out_cache_loc):
    """Torch port: the first ``num_front[i]`` slots of each request's verify window, packed."""
    window = out_cache_loc.view(num_front.numel(), -1)
    vals = torch.cat([window[i, : int(k)] for i, k in enumerate(num_front.tolist())])
    front_out_cache_loc[: vals.numel()] = vals.to(front_out_cache_loc.dtype)


def fill_accept_out_cache_loc(accept_index, out_cache_loc, accept_out_cache_loc, size=None):
    """Torch port: ``out_cache_loc`` at the accepted (non -1) indices, packed in order."""
    idx = accept_index.reshape(-1)
    idx = idx[idx >= 0].long()
    accept_out_cache_loc[: idx.numel()] = out_cache_loc[idx].to(accept_out_cache_loc.dtype)


def install_sgl_kernel_stub() -> bool:
    """On a machine with neither CUDA nor ``sgl_kernel``: a stand-in ``sgl_kernel.speculative`` holding only the
    torch port of ``reconstruct_indices_from_tree_mask``, which SGLang's NGRAM modules import at import time.
    Nothing else is provided, so nothing can mistake it for the CUDA kernels (``from sgl_kernel import x``
    still raises ImportError). Returns whether it is installed."""
    if "sgl_kernel" in sys.modules:
        return bool(getattr(sys.modules["sgl_kernel"], "__glance_stub__", False))
    if importlib.util.find_spec("sgl_kernel") is not None or torch.cuda.is_available():
        return False
    pkg = types.ModuleType("sgl_kernel")
    sub = types.ModuleType("sgl_kernel.speculative")
    sub.reconstruct_indices_from_tree_mask = reconstruct_indices_from_tree_mask
    pkg.speculative = sub
    pkg.__path__ = []  # a package, so that the submodule import resolves through sys.modules
    pkg.__glance_stub__ = True
    sys.modules["sgl_kernel"], sys.modules["sgl_kernel.speculative"] = pkg, sub
    return True


def get_last_loc(req_to_token, req_pool_indices, prefix_lens):
    """The KV slot of each request's last cached token (-1 where it has none): what a paged allocator (page size
    > 1) continues from, SGLang's torch version (its dispatcher picks Triton for any backend but torch_native)."""
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    return get_last_loc_torch(req_to_token, req_pool_indices, prefix_lens)


def verify_tree_greedy_port(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                            retrieve_next_token, retrieve_next_sibling, target_predict, topk=-1):
    """``eagle_utils.verify_tree_greedy_func``'s contract (outputs in place, returned) on the torch port."""
    verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                       retrieve_next_sibling, target_predict)
    return predicts, accept_index, accept_token_num


# SGLang's speculative bookkeeping functions and their torch ports: (module, function, port, index of the
# argument whose device decides). Every module that imported a function by name is listed: each holds its own
# reference.
CPU_PORTS = (
    ("sglang.srt.mem_cache.allocation", "assign_req_to_token_pool_func", assign_req_to_token_pool, 1),
    ("sglang.srt.speculative.spec_utils", "assign_req_to_token_pool_func", assign_req_to_token_pool, 1),
    ("sglang.kernels.ops.speculative.cache_locs", "fill_front_out_cache_loc_func", fill_front_out_cache_loc, 0),
    ("sglang.srt.speculative.spec_utils", "fill_front_out_cache_loc_func", fill_front_out_cache_loc, 0),
    ("sglang.kernels.ops.speculative.eagle", "fill_accept_out_cache_loc_func", fill_accept_out_cache_loc, 0),
    ("sglang.srt.speculative.spec_utils", "fill_accept_out_cache_loc_func", fill_accept_out_cache_loc, 0),
    ("sglang.kernels.ops.speculative.cache_locs", "assign_extend_cache_locs_func", assign_extend_cache_locs, 0),
    ("sglang.srt.speculative.ngram_worker", "assign_extend_cache_locs_func", assign_extend_cache_locs, 0),
    ("sglang.srt.speculative.eagle_utils", "verify_tree_greedy_func", verify_tree_greedy_port, 0),
    ("sglang.srt.mem_cache.allocation", "get_last_loc", get_last_loc, 0),
)


def _on_cpu(args: tuple, kwargs: dict, tensor_arg: int) -> bool:
    probe = args[tensor_arg] if len(args) > tensor_arg else next(
        (v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    return isinstance(probe, torch.Tensor) and probe.device.type == "cpu"


def _port_hook(port, tensor_arg: int):
    """An AROUND hook: the torch port for CPU tensors, SGLang's own function elsewhere."""
    def around(original, *args, **kwargs):
        if _on_cpu(args, kwargs, tensor_arg):
            return port(*args, **kwargs)
        return original(*args, **kwargs)

    around.__glance_cpu__ = True
    return around


def _kv_pool_warmup_hook(original, pool, *args, **kwargs):
    """AROUND ``MHATokenToKVPool._init_kv_copy_and_warmup``: a CPU pool skips SGLang's Triton KV-copy warm-up and
    moves KV with torch indexing (``SGLANG_NATIVE_MOVE_KV_CACHE``); pools on other devices are untouched."""
    if torch.device(pool.device).type != "cpu":
        return original(pool, *args, **kwargs)
    os.environ.setdefault("SGLANG_NATIVE_MOVE_KV_CACHE", "1")
    pool.use_native_move_kv_cache = True
    pool._kv_copy_config = None
    return None


def _fork_on_cpu_hook(result, server_args, *args, **kwargs):
    """AFTER ``sglang.srt.entrypoints.engine._set_envs_and_config``, which sets multiprocessing's start method to
    "spawn" (CUDA cannot be forked): a CPU server forks its scheduler and detokenizer instead. A spawned child
    imports SGLang again, about 10 s of CPU each on 2 cores (an engine's start-up: 33 s of CPU spawned, 12 s
    forked); nothing in the parent has started threads or an OpenMP pool by then. Other devices keep "spawn"."""
    if str(getattr(server_args, "device", "")) == "cpu":
        multiprocessing.set_start_method("fork", force=True)
    return result


def register_cpu_hooks() -> None:
    """The CPU mode's changes to SGLang's functions, as SGLang HookRegistry hooks (applied by ``load_plugins``,
    idempotent): the torch ports of the speculative bookkeeping ops (chosen per call by the tensors' device, so a
    GPU process keeps SGLang's kernels), the CPU KV pool's warm-up, and forked rather than spawned processes for
    a CPU server (:func:`_fork_on_cpu_hook`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def register(target: str, hook, kind: HookType = HookType.AROUND) -> None:
        if not any(getattr(h, "__glance_cpu__", False) for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, kind)

    for module, name, port, tensor_arg in CPU_PORTS:
        register(f"{module}.{name}", _port_hook(port, tensor_arg))
    _kv_pool_warmup_hook.__glance_cpu__ = True
    register("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup", _kv_pool_warmup_hook)
    _fork_on_cpu_hook.__glance_cpu__ = True
    register("sglang.srt.entrypoints.engine._set_envs_and_config", _fork_on_cpu_hook, HookType.AFTER)
    HookRegistry.apply_hooks()  # idempotent; also when registered outside load_plugins (tests, scripts)


# ---------------------------------------------------------------------------------------------- attention
VerifyLayout = list[tuple[torch.Tensor, torch.Tensor, int, int]]  # per request: mask rows, slots, offset, rows
BatchedLayout = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def batched_layout(layout: VerifyLayout, pad_limit: float = PAD_LIMIT, max_slots: int | None = None
                   ) -> BatchedLayout | None:
    """A verify pass's requests (``layout``: per request its mask rows [n, L + n] (bool), K/V slots [L + n], the
    offset of its rows in the pass and their number n) as one padded batch, where padding to the longest request
    costs at most ``pad_limit`` times the requests' own lengths: K/V slots [bs, T] (T the longest L + n; padding
    reads slot 0, masked out), the mask [bs, 1, W, T] (W the most rows of a request) and, where requests have
    different numbers of rows (a ragged pass), each packed row's place in the [bs * W] padded rows (None: every
    request has W rows, in order). A padded query row sees one key (its output is dropped), so no softmax row is
    empty. None: one request, too much padding, or more than ``max_slots`` padded K/V slots (bs x T; None: no
    bound): one call per request (:func:`attend_per_request`)."""
    lens = [slots.shape[0] for _, slots, _, _ in layout]
    padded = len(layout) * max(lens)
    if len(layout) < 2 or padded > pad_limit * sum(lens) or (max_slots is not None and padded > max_slots):
        return None
    bs, width, longest, device = len(layout), max(n for *_, n in layout), max(lens), layout[0][1].device
    slots = torch.zeros(bs, longest, dtype=torch.long, device=device)
    mask = torch.zeros(bs, 1, width, longest, dtype=torch.bool, device=device)
    rows: list[int] = []
    for b, (seg, request_slots, _, n) in enumerate(layout):
        slots[b, : request_slots.shape[0]] = request_slots
        mask[b, 0, :n, : seg.shape[1]] = seg
        mask[b, 0, n:, 0] = True  # its padded query rows see one key
        rows.extend(range(b * width, b * width + n))
    uniform = all(n == width for *_, n in layout)
    return slots, mask, None if uniform else torch.tensor(rows, dtype=torch.long, device=device)


def attend_batched(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, batched: BatchedLayout,
                   scaling: float, dv: int) -> torch.Tensor:
    """One SDPA call for every request of a verify pass (:func:`batched_layout`). ``q`` [R, hq, d] (the pass's
    packed rows), ``k_buf`` / ``v_buf`` [slots, hk, d] (one layer's K/V pool). Returns [R, hq * dv]."""
    slots, mask, rows = batched
    bs, width, hq, d = mask.shape[0], mask.shape[2], q.shape[1], q.shape[2]
    kk = k_buf[slots].transpose(1, 2).to(q.dtype)  # [bs, hk, T, d]
    vv = v_buf[slots].transpose(1, 2).to(q.dtype)
    qq = q.view(bs, width, hq, d) if rows is None else \
        q.new_zeros(bs * width, hq, d).index_copy_(0, rows, q).view(bs, width, hq, d)
    o = torch.nn.functional.scaled_dot_product_attention(qq.transpose(1, 2), kk, vv, attn_mask=mask, scale=scaling,
                                                         enable_gqa=hq != kk.shape[1])
    o = o.transpose(1, 2).reshape(bs * width, hq * dv)
    return o if rows is None else o.index_select(0, rows)


def attend_per_request(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layout: VerifyLayout,
                       scaling: float, dv: int) -> torch.Tensor:
    """A verify pass's attention one SDPA call per request (``layout``: :func:`batched_layout`'s input); the
    shapes of :func:`attend_batched`."""
    hq = q.shape[1]
    out = q.new_empty((q.shape[0], hq * dv))
    for seg, slots, start, n in layout:
        kk = k_buf[slots].transpose(0, 1)  # [hk, T, d]
        vv = v_buf[slots].transpose(0, 1)
        qq = q[start:start + n].transpose(0, 1)  # [hq, n, d]
        o = torch.nn.functional.scaled_dot_product_attention(
            qq.unsqueeze(0), kk.unsqueeze(0).to(qq.dtype), vv.unsqueeze(0).to(qq.dtype),
            attn_mask=seg[None, None], scale=scaling, enable_gqa=hq != kk.shape[0])
        out[start:start + n] = o[0].transpose(0, 1).reshape(n, hq * dv)
    return out


def _make_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class GlanceCPUAttnBackend(TorchNativeAttnBackend):
        """``TorchNativeAttnBackend`` plus TARGET_VERIFY (tree-masked verify rows) for CPU serving."""

        def __init__(self, model_runner):
            super().__init__(model_runner)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if not forward_batch.forward_mode.is_target_verify():
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            return self._forward_verify(q, k, v, layer, forward_batch, save_kv_cache)

        def _forward_verify(self, q, k, v, layer, forward_batch, save_kv_cache):
            from sglang.srt.mem_cache.memory_pool import KVWriteLoc

            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(
                    layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
            k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            hq, d, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
            q_ = q.view(-1, hq, d)
            layout = self._verify_layout(forward_batch)
            batched = getattr(forward_batch, "_glance_cpu_batched", False)
            if batched is False:  # the same for every layer of the pass
                slot_bytes = k_buf[0].numel() * k_buf.element_size()
                batched = forward_batch._glance_cpu_batched = batched_layout(
                    layout, max_slots=BATCHED_KV_BYTES // max(slot_bytes, 1))
            if batched is not None:
                return attend_batched(q_, k_buf, v_buf, batched, layer.scaling, dv)
            return attend_per_request(q_, k_buf, v_buf, layout, layer.scaling, dv)

        def _verify_layout(self, forward_batch) -> VerifyLayout:
            """Per request: its mask rows [n, prefix + n] (bool), its K/V slots [prefix + n], the offset of its
            rows in the pass and their number ``n``: the speculative input's ``draft_token_num`` rows each, masked
            by its flat FULL mask, or a ragged pass's own rows (``ragged_rows``, masked by the trees' ancestor
            mask ``ragged_tree_mask``, the prefix all visible). The same for every layer of a pass: computed at
            the first layer, kept on the pass's ``ForwardBatch`` (a new pass has a new one)."""
            spec = forward_batch.spec_info
            layout = getattr(forward_batch, "_glance_cpu_layout", None)
            if layout is None:
                req_to_token = self.req_to_token_pool.req_to_token
                prefixes, pool_rows = forward_batch.seq_lens.tolist(), forward_batch.req_pool_indices.tolist()
                ragged = getattr(spec, "ragged_rows", None)
                layout, start = [], 0
                if ragged is None:
                    n, mask_flat, off = int(spec.draft_token_num), spec.custom_mask.bool(), 0
                    for pre, row in zip(prefixes, pool_rows):
                        total = pre + n
                        layout.append((mask_flat[off: off + n * total].view(n, total),
                                       req_to_token[row, :total].long(), start, n))
                        off, start = off + n * total, start + n
                else:
                    tree_mask = spec.ragged_tree_mask.bool()
                    for b, (pre, row, n) in enumerate(zip(prefixes, pool_rows, ragged)):
                        seg = torch.ones(n, pre + n, dtype=torch.bool, device=tree_mask.device)
                        seg[:, pre:] = tree_mask[b, :n, :n]
                        layout.append((seg, req_to_token[row, :pre + n].long(), start, n))
                        start += n
                forward_batch._glance_cpu_layout = layout
            return layout

    return GlanceCPUAttnBackend


def register_cpu_backend() -> None:
    """Add ``glance_cpu`` to SGLang's attention-backend choices and registry (idempotent)."""
    from sglang.srt.layers.attention import attention_registry as reg

    if BACKEND_NAME not in reg.ATTENTION_BACKENDS:
        def create_glance_cpu_backend(runner):
            return _make_backend_class()(runner)

        reg.register_attention_backend(BACKEND_NAME)(create_glance_cpu_backend)
    try:
        from sglang.srt import server_args as sa

        if BACKEND_NAME not in sa.ATTENTION_BACKEND_CHOICES:
            sa.add_attention_backend_choices([BACKEND_NAME])
    except Exception as exc:  # pragma: no cover
        logger.warning("glance cpu: could not add %s to the attention-backend choices: %s", BACKEND_NAME, exc)


