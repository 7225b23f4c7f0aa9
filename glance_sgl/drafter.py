"""GlanceDrafter: the block-diffusion draft head (design §1).

A few Qwen3-style decoder layers that own neither an embedding nor an LM head. Context features are the
target's tap-layer hidden states, concatenated and projected: ``ctx = RMSNorm(fc(concat(h_taps)))``. In every
layer, queries come from the block tokens only; keys/values are ``k_proj``/``v_proj`` of
``[context ; block]`` (k-norm, then RoPE with plain 1-D positions). Context K/V live in a :class:`DrafterCache`
across rounds; the block's K/V are never stored. Attention is non-causal.

Everything is batched torch with no Hugging Face or SGLang types in the signatures.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .config import GlanceConfig
from .tree import SOURCE_DRAFTER, DraftTree, build_tree, chain_tree, topk_per_offset

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .round import RoundBatch
    from .verify import WalkResult

WEIGHTS_NAME = "model.safetensors"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _inv_freq_of(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


_inv_freq_cached = functools.lru_cache(maxsize=16)(_inv_freq_of)


def _inv_freq(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The rotary frequencies, cached per (dim, theta, device); computed in the graph of a compiled pass
    (``GlanceDrafter.compile_block``: the compiler folds them, and does not trace through a cache)."""
    return _inv_freq_of(dim, theta, device) if torch.compiler.is_compiling() else _inv_freq_cached(dim, theta, device)


def rope_tables(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin of the rotary embedding at ``positions`` [B, T] (int): each [B, 1, T, dim], in ``dtype``.
    Computed once per forward and shared by every layer's queries and keys."""
    freqs = positions.to(torch.float32)[..., None] * _inv_freq(dim, float(theta), positions.device)  # [B, T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Apply the rotary embedding ``rope`` = (cos, sin) from :func:`rope_tables` to ``x`` [B, heads, T, d]."""
    cos, sin = rope
    return x * cos + rotate_half(x) * sin


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding. ``x``: [B, heads, T, d]; ``positions``: [B, T] (int)."""
    return rotate(x, rope_tables(positions, x.shape[-1], theta, x.dtype))


class DrafterAttention(nn.Module):
    """KV-injected attention: block queries over ``[context K/V ; block K/V]``."""

    def __init__(self, cfg: GlanceConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [B, n, T, d]

    def key_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V of ``x`` [B, T, H] with ``rope`` = :func:`rope_tables` of its positions:
        each [B, kv_heads, T, d]."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads))
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return rotate(k, rope), v

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x``: normed block states [B, M, H]; ``rope``: :func:`rope_tables` of the block positions [B, M];
        ``ctx_k``/``ctx_v`` [B, kv, C, d]; ``mask``: bool [B, 1, M, C+M], True where a query may attend, or None
        (every query sees every key). Returns [B, M, H]."""
        q = rotate(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), rope)
        k_blk, v_blk = self.key_values(x, rope)
        k = torch.cat([ctx_k, k_blk], dim=2)
        v = torch.cat([ctx_v, v_blk], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        b, _, m, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, m, -1))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: GlanceConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: GlanceConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, x, rope, ctx_k, ctx_v, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DrafterCache:
    """Context K/V of the head, per layer ``[B, kv_heads, capacity, head_dim]``, plus ``lengths`` [B].

    ``lengths[b]`` is the number of context tokens of request b; context token j sits at 1-D position j.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: torch.Tensor) -> None:
        self.keys, self.values, self.lengths = keys, values, lengths

    @classmethod
    def empty(cls, cfg: GlanceConfig, batch: int, device, dtype, capacity: int = 256,
              token_major: bool = False) -> "DrafterCache":
        """Zeros, ``capacity`` tokens per request. ``token_major``: laid out as a cache gathered from a pool of
        token slots is (``[B, capacity, kv_heads, head_dim]`` seen as ``[B, kv_heads, capacity, head_dim]``, the
        SGLang worker's draft KV pool), so that a pass compiled on it serves such caches without a recompile."""
        kv, d = cfg.num_key_value_heads, cfg.head_dim

        def buffer() -> torch.Tensor:
            if token_major:
                return torch.zeros(batch, capacity, kv, d, device=device, dtype=dtype).permute(0, 2, 1, 3)
            return torch.zeros(batch, kv, capacity, d, device=device, dtype=dtype)

        n = cfg.num_hidden_layers
        return cls([buffer() for _ in range(n)], [buffer() for _ in range(n)],
                   torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, needed: int) -> None:
        """Grow the buffers (doubling) so that ``needed`` context tokens fit."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                grown = buf.new_zeros(buf.shape[0], buf.shape[1], new_cap, buf.shape[3])
                grown[:, :, : buf.shape[2]] = buf
                store[i] = grown

    def select(self, index: torch.Tensor) -> "DrafterCache":
        """The cache of the requests at ``index`` (filtering or reordering a batch)."""
        return DrafterCache(
            [k.index_select(0, index) for k in self.keys],
            [v.index_select(0, index) for v in self.values],
            self.lengths.index_select(0, index),
        )


class GlanceDrafter(nn.Module):
    """The GLANCE draft head. Bind the target's input embedding and LM head with :meth:`bind_target`."""

    def __init__(self, config: GlanceConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.tap_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([DrafterLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # Shared with the target by reference; kept out of parameters() and the saved state dict.
        self._shared: dict[str, nn.Module] = {}
        self._compiled_block = None  # draft_block's pass through torch.compile (compile_block), or None: eager
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # ------------------------------------------------------------------ target sharing
    def bind_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> "GlanceDrafter":
        """Share the target's (frozen) input embedding and LM head."""
        if embed_tokens.weight.shape[0] != self.config.vocab_size:
            raise ValueError(
                f"target vocabulary {embed_tokens.weight.shape[0]} != drafter vocabulary {self.config.vocab_size}"
            )
        if embed_tokens.weight.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"target hidden size {embed_tokens.weight.shape[1]} != drafter hidden size {self.config.hidden_size}"
            )
        self._shared = {"embed_tokens": embed_tokens, "lm_head": lm_head}
        return self

    def _target_module(self, name: str) -> nn.Module:
        if name not in self._shared:
            raise RuntimeError("drafter is not bound to a target: call bind_target(embed_tokens, lm_head) first")
        return self._shared[name]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._target_module("embed_tokens")(token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target_module("lm_head")(self.norm(hidden))

    # ------------------------------------------------------------------ context
    def project_context(self, tap_hidden: torch.Tensor) -> torch.Tensor:
        """``tap_hidden`` [B, T, L*H] (taps concatenated in config order) -> context features [B, T, H]."""
        return self.hidden_norm(self.fc(tap_hidden))

    def new_cache(self, batch: int, device=None, dtype=None, capacity: int = 256,
                  token_major: bool = False) -> DrafterCache:
        p = self.fc.weight
        return DrafterCache.empty(self.config, batch, device or p.device, dtype or p.dtype, capacity, token_major)

    @torch.no_grad()
    def extend_context(self, cache: DrafterCache, tap_hidden: torch.Tensor, counts: torch.Tensor) -> None:
        """Append context tokens to ``cache``.

        ``tap_hidden``: [B, T, L*H], request b's new tokens in rows ``0..counts[b]-1`` (rest is padding);
        ``counts``: [B] int. Token j of request b gets position ``cache.lengths[b] + j``.
        """
        b, t, _ = tap_hidden.shape
        counts = counts.to(cache.lengths.device)
        cache.reserve(int((cache.lengths + counts).max().item()))
        offsets = torch.arange(t, device=tap_hidden.device)
        positions = cache.lengths[:, None] + offsets[None, :]  # [B, T]
        if b == 1 and not tap_hidden.is_cuda:  # the embedded engine's case: one contiguous slice per layer
            start, n = int(cache.lengths[0]), int(counts[0])
            keys, values = self.context_key_values(tap_hidden[:, :n], positions[:, :n])
            for k, v, k_buf, v_buf in zip(keys, values, cache.keys, cache.values):
                k_buf[:, :, start:start + n] = k.to(k_buf.dtype)
                v_buf[:, :, start:start + n] = v.to(v_buf.dtype)
        else:
            rows, cols = torch.nonzero(offsets[None, :] < counts[:, None], as_tuple=True)
            dest = positions[rows, cols]
            keys, values = self.context_key_values(tap_hidden, positions)
            for k, v, k_buf, v_buf in zip(keys, values, cache.keys, cache.values):
                k_buf[rows, :, dest] = k[rows, :, cols].to(k_buf.dtype)
                v_buf[rows, :, dest] = v[rows, :, cols].to(v_buf.dtype)
        cache.lengths += counts

    def _fused_kv_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's k_proj and v_proj stacked into one matrix [L*2*kv*d, H], and the k-norm weights [L, d];
        rebuilt when a weight changes (training steps, ``.to()``)."""
        params = [p for layer in self.layers for p in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight,
                                                       layer.self_attn.k_norm.weight)]
        key = tuple((p.data_ptr(), p._version) for p in params)
        if getattr(self, "_fused_key", None) != key:
            attn = [layer.self_attn for layer in self.layers]
            self._fused = (torch.cat([w for a in attn for w in (a.k_proj.weight, a.v_proj.weight)]),
                           torch.stack([a.k_norm.weight for a in attn]))
            self._fused_key = key
        return self._fused

    def context_key_values(self, tap_hidden: torch.Tensor, positions: torch.Tensor
                           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Context K (normed, rotated) and V of every layer for tap features [B, T, L*H] at ``positions``
        [B, T], in one projection: lists of [B, kv_heads, T, d] per layer (what ``key_values`` gives one layer
        at a time)."""
        cfg = self.config
        ctx = self.project_context(tap_hidden)
        b, t, _ = ctx.shape
        n_layers, kvh, d = len(self.layers), cfg.num_key_value_heads, cfg.head_dim
        weight, k_norm = self._fused_kv_weight()
        kv = F.linear(ctx, weight).view(b, t, n_layers, 2, kvh, d).permute(2, 3, 0, 4, 1, 5)  # [L,2,B,kv,T,d]
        k, v = kv[:, 0], kv[:, 1]
        kf = k.float()
        k = k_norm[:, None, None, None, :] * (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
                                              ).to(k.dtype)
        k = rotate(k, rope_tables(positions, d, cfg.rope_theta, k.dtype))
        return list(k.unbind(0)), list(v.unbind(0))

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def draft_block(self, cache: DrafterCache, root_tokens: torch.Tensor, context_len: int | None = None,
                    padded: bool = False) -> torch.Tensor:
        """One forward pass for the block ``[root, MASK x (B-1)]`` of every request.

        ``root_tokens``: [B] (the last committed token, whose context features are not in the cache yet);
        the block sits at positions ``cache.lengths[b] .. + block_size - 1``. ``context_len``: the longest context
        (``cache.lengths.max()``) when the caller knows it on the host, so the pass needs no device sync;
        ``padded``: ``context_len`` may exceed every length (static shapes, e.g. a CUDA graph), so the context is
        masked by ``lengths`` even for one request.
        Returns draft logits [B, block_size - 1, V] for offsets 1..block_size-1.
        """
        c = int(cache.lengths.max().item()) if context_len is None else context_len
        if self._compiled_block is not None:
            try:
                return self._compiled_block(cache, root_tokens, c, padded)
            except Exception as exc:  # the compile failed (no C++ compiler, an op inductor lacks): eager from now on
                log.warning("drafter: the compiled block pass failed (%s: %s); running it eagerly",
                            type(exc).__name__, (str(exc).strip().splitlines() or [""])[0])
                self._compiled_block = None
        return self._block_pass(cache, root_tokens, c, padded)

    def compile_block(self, batch_sizes: Iterable[int] = (1,), token_major: bool = False) -> bool:
        """Run :meth:`draft_block` through ``torch.compile`` (inductor, dynamic shapes: one compile serves one
        request, another every larger batch, each at any context length) from now on, where the drafter lives on a
        CPU. There the pass is a few dozen small ops whose dispatch costs about as much as their arithmetic: one
        request of 100-400 context tokens took 0.9-1.0 ms compiled against 1.4 ms eager, nine of 400 tokens 7.2
        against 9.1 ms (2 cores). The passes for ``batch_sizes`` (1: one request; any larger: every batch) are
        compiled now, on a small dummy context (4-12 s each on 2 cores; inductor's on-disk cache makes a later
        process's faster), so that no request waits for a compile. On other devices it does nothing (CUDA graphs
        replay the pass there) and returns False. A compile that fails leaves the pass eager, with a warning, and
        returns False. ``token_major``: the caches the pass will read are laid out token-major
        (:meth:`DrafterCache.empty`: the SGLang worker's gathered context); the compiler guards on the layout, so a
        pass compiled on the other one would be compiled again, seconds each, on the first drafting steps. The
        drafts may differ from the eager pass's in the last float bits; the target's verification decides every
        committed token, so outputs do not change."""
        if self.fc.weight.device.type != "cpu":
            return False
        if self._compiled_block is None:
            self._compiled_block = torch.compile(self._block_pass, dynamic=True)
            # inductor's C++ toolchain lookup warns "No CUDA runtime is found" on every CPU machine: not news here
            cpp = logging.getLogger("torch.utils.cpp_extension")
            level = cpp.level
            cpp.setLevel(logging.ERROR)
            try:
                for bs in sorted(set(batch_sizes)):
                    # odd sizes: nothing for the compiler to specialise on
                    cache = self.new_cache(bs, capacity=37, token_major=token_major)
                    cache.lengths[:] = torch.tensor([29, 17, 23][:bs] + [11] * max(bs - 3, 0))
                    self.draft_block(cache, torch.zeros(bs, dtype=torch.long, device=self.fc.weight.device))
            finally:
                cpp.setLevel(level)
        return self.block_compiled

    @property
    def block_compiled(self) -> bool:
        """Whether :meth:`draft_block` runs compiled (:meth:`compile_block`, and its compile has not failed)."""
        return self._compiled_block is not None

    def _block_pass(self, cache: DrafterCache, root_tokens: torch.Tensor, c: int, padded: bool) -> torch.Tensor:
        """:meth:`draft_block`'s pass over contexts of at most ``c`` tokens (a host int)."""
        bs, blk = root_tokens.shape[0], self.config.block_size
        block = torch.full((bs, blk), self.config.mask_token_id, dtype=torch.long, device=root_tokens.device)
        block[:, 0] = root_tokens
        positions = cache.lengths[:, None] + torch.arange(blk, device=root_tokens.device)[None, :]
        mask = None  # one request (or equal lengths): every block token sees the whole context and block
        if bs > 1 or padded:
            ctx_valid = torch.arange(c, device=root_tokens.device)[None, :] < cache.lengths[:, None]  # [B, C]
            mask = torch.cat([ctx_valid, ctx_valid.new_ones(bs, blk)], dim=1)[:, None, None, :]  # [B,1,1,C+blk]
        x = self.embed(block).to(self.fc.weight.dtype)
        rope = rope_tables(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer, k_buf, v_buf in zip(self.layers, cache.keys, cache.values):
            x = layer(x, rope, k_buf[:, :, :c], v_buf[:, :, :c], mask)
        return self.logits(x[:, 1:])

    def forward_blocks(
        self,
        ctx: torch.Tensor,
        ctx_positions: torch.Tensor,
        block_tokens: torch.Tensor,
        block_positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """General (training) forward: many blocks over one context, with an explicit mask.

        ``ctx``: context features [B, C, H]; ``ctx_positions`` [B, C]; ``block_tokens`` / ``block_positions``
        [B, M]; ``mask``: bool [B, 1, M, C+M]. Returns the final hidden states [B, M, H] (apply :meth:`logits`).
        """
        x = self.embed(block_tokens).to(self.fc.weight.dtype)
        d, theta = self.config.head_dim, self.config.rope_theta
        ctx_rope = rope_tables(ctx_positions, d, theta, ctx.dtype)
        block_rope = rope_tables(block_positions, d, theta, x.dtype)
        for layer in self.layers:
            k, v = layer.self_attn.key_values(ctx, ctx_rope)
            x = layer(x, block_rope, k, v, mask)
        return x

    # ------------------------------------------------------------------ persistence
    def save_pretrained(self, directory: str | Path, format: str = "dflash") -> Path:
        """Write ``config.json`` + ``model.safetensors`` (the head only; never the shared target modules).

        The weights carry DFlash's names (``layers.N.self_attn.q_proj.weight``, ``fc.weight`` [H, L*H],
        ``hidden_norm.weight``, ``norm.weight``, ...); ``format`` is the config's layout (``"dflash"``, the
        default, or the former ``"glance"`` one, see :meth:`GlanceConfig.save`)."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.config.save(out, format=format)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        return out

    @classmethod
    def from_pretrained(cls, directory: str | Path, device="cpu", dtype: torch.dtype = torch.float32) -> "GlanceDrafter":
        """Load a drafter directory: a DFlash checkpoint (ours, or one saved by DFlash's reference code: weights
        with or without a ``model.`` prefix, one file or shards with ``model.safetensors.index.json``) or one in
        the former ``glance_drafter`` layout."""
        config = GlanceConfig.load(directory)
        model = cls(config)
        model.load_state_dict(load_head_weights(directory, model.state_dict().keys()), strict=True)
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    def for_target(cls, text_config, mask_token_id: int, seed: int | None = None, **overrides) -> "GlanceDrafter":
        """A freshly initialised drafter sized for a target's text config (see GlanceConfig.for_target)."""
        config = GlanceConfig.for_target(text_config, mask_token_id, **overrides)
        if seed is not None:
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                return cls(config)
        return cls(config)


def load_head_weights(directory: str | Path, expected: Iterable[str]) -> dict[str, torch.Tensor]:
    """The head's tensors from a checkpoint directory, named as in :class:`GlanceDrafter`'s state dict.

    Reads ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``; strips a ``model.`` (or
    ``drafter.``) prefix; drops tensors DFlash exports may carry that the head does not own (rotary caches, an
    embedding or LM head tied to the target). Raises ValueError naming missing / unexpected tensors."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / (WEIGHTS_NAME + ".index.json")
    if (directory / WEIGHTS_NAME).is_file():
        files = [directory / WEIGHTS_NAME]
    elif index.is_file():
        files = [directory / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"no drafter weights at {directory / WEIGHTS_NAME}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            state[_head_name(name)] = tensor
    expected = set(expected)
    ignored = {k for k in state if k not in expected and _ignorable(k)}
    for k in ignored:
        del state[k]
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"drafter checkpoint {directory} does not match its config: missing={missing}, "
                         f"unexpected={unexpected}")
    return state


def _head_name(name: str) -> str:
    for prefix in ("model.", "drafter."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _ignorable(name: str) -> bool:
    return "rotary_emb" in name or name.startswith(("embed_tokens.", "lm_head."))


def draft_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Per-offset draft log-probabilities in fp32 (design: log_softmax in fp32). [B, D, V] -> [B, D, V]."""
    return torch.log_softmax(logits.float(), dim=-1)


class CachedDrafter:
    """The block drafter as one request's candidate source (``glance_sgl.round.CandidateSource``), over its own
    :class:`DrafterCache` (the embedded engine: a batch of one).

    ``cache`` holds the context features of every committed token but the root (the last one); ``stash`` the tap
    features [n, L*H] of tokens committed since the drafter last ran, appended to ``cache`` in one call before
    its next pass (a run of rounds without drafting costs one projection when drafting resumes). ``chain``: the
    width-1 ablation (top-1 per offset) instead of the best-first tree over the top ``branch_k``.
    """

    source_id = SOURCE_DRAFTER

    def __init__(self, drafter: GlanceDrafter, cache: DrafterCache, branch_k: int, chain: bool = False) -> None:
        self.drafter, self.cache, self.branch_k, self.chain = drafter, cache, branch_k, chain
        self.stash: list[torch.Tensor] = []

    @classmethod
    def start(cls, drafter: GlanceDrafter, prompt_taps: torch.Tensor, branch_k: int, chain: bool = False
              ) -> "CachedDrafter":
        """A request's drafter with the prompt's tap features [P, L*H] in its context."""
        n = prompt_taps.shape[0]
        cache = drafter.new_cache(1, capacity=max(256, 2 * n))
        drafter.extend_context(cache, prompt_taps[None], torch.tensor([n]))
        return cls(drafter, cache, branch_k, chain)

    def flush(self) -> None:
        """The stashed tokens' context K/V into the cache, in one projection."""
        if self.stash:
            taps = self.stash[0] if len(self.stash) == 1 else torch.cat(self.stash)
            self.stash.clear()
            self.drafter.extend_context(self.cache, taps[None], torch.tensor([taps.shape[0]]))

    def propose(self, batch: "RoundBatch", rows: int) -> DraftTree:
        """One drafter pass for the block ``[root, MASK...]`` and the best-first tree of ``rows - 1`` nodes (or
        the chain) built from it: fields [1, <= rows]."""
        self.flush()
        roots = batch.roots
        logits = self.drafter.draft_block(self.cache, roots.to(self.drafter.fc.weight.device))
        values, ids = topk_per_offset(draft_logprobs(logits), 1 if self.chain else self.branch_k)
        return chain_tree(values, ids, roots) if self.chain else build_tree(values, ids, roots, rows - 1)

    def commit(self, batch: "RoundBatch", taps: torch.Tensor, walk: "WalkResult") -> None:
        """Stash the tap features of the committed rows (root + accepted; ``taps`` [1, R, L*H])."""
        if taps.shape[1] == 1:  # an AR step: the root's row
            self.stash.append(taps[0])
            return
        n = int(walk.accept_lens[0]) + 1
        self.stash.append(taps[0, walk.accepted_rows[0, :n].to(taps.device)])


__all__ = ["GlanceDrafter", "DrafterCache", "CachedDrafter", "draft_logprobs", "apply_rope", "RMSNorm"]
