"""Adapter over Hugging Face Qwen-VL targets (Qwen2.5-VL, Qwen2-VL, Qwen3-VL dense) for the embedded engine.

One request at a time (batch 1 in the Hugging Face cache). What it does:
- ``prepare``: chat messages with images -> model inputs through the real processor (chat template, image
  processor, placeholder expansion, ``mm_token_type_ids`` so that M-RoPE positions are computed);
- ``prefill``: the prompt pass, keeping the KV cache, the M-RoPE delta and the tap-layer hidden states;
- ``forward_rows``: a tree-masked pass over packed rows (root + nodes) on top of the cache, with a FLOAT
  additive 4D mask and explicit ``(3, 1, R)`` positions ``P + depth + rope_delta`` (design §3);
- ``keep_rows``: keep the KV entries of the prefix and of the accepted rows (index-select per layer);
- :class:`CachePass`: the two above as one request's ``glance_sgl.round.TargetRows`` (the speculative round's
  target adapter).

Taps (``glance_sgl.config``: the tap convention): tap ``t`` is the hidden state entering decoder layer ``t + 1``
(the final norm for the last layer), caught by a forward pre-hook there. On Qwen2.5-VL / Qwen2-VL that is decoder
layer ``t``'s output (Hugging Face ``hidden_states[t + 1]``); on Qwen3-VL it includes the deepstack vision
features that the model adds to image positions after layers 0-2, as SGLang's capture does, so both engines feed
the drafter the same features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import glance_kernels
import torch
from torch import nn

from .round import PassOutput
from .verify import LogitRules

SUPPORTED_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")


class TargetError(ValueError):
    """A request the target cannot serve (bad messages, too long, unsupported content)."""


@dataclass
class PreparedPrompt:
    """Model inputs for one request: ``inputs`` holds input_ids [1, P], attention_mask, mm_token_type_ids and,
    with images, pixel_values and image_grid_thw."""

    inputs: dict[str, torch.Tensor]
    num_images: int

    @property
    def input_ids(self) -> torch.Tensor:
        return self.inputs["input_ids"]

    @property
    def num_tokens(self) -> int:
        return int(self.inputs["input_ids"].shape[1])


@dataclass
class TargetState:
    """A request's target-side state. ``length``: tokens in the KV cache; ``rope_delta``: M-RoPE offset of
    text positions after the prompt (position of cache index i is ``i + rope_delta`` for generated tokens)."""

    cache: Any
    length: int
    rope_delta: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RowsOutput:
    """Output of a pass: ``logits`` [R, V] fp32-castable; ``taps`` [R, L*H] or None (capture off)."""

    logits: torch.Tensor
    taps: torch.Tensor | None


def split_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Normalise OpenAI-style messages for the chat template and pull out the images in order.

    Content is a string or a list of parts ``{"type": "text", "text": ...}`` / ``{"type": "image",
    "image": PIL.Image}``. Returns (template messages, images).
    """
    if not isinstance(messages, list) or not messages:
        raise TargetError("messages must be a non-empty list")
    out, images = [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise TargetError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = msg["role"], msg["content"]
        if role not in ("system", "user", "assistant"):
            raise TargetError(f"messages[{i}].role must be system, user or assistant, got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise TargetError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image":
                if part.get("image") is None:
                    raise TargetError(f"messages[{i}].content[{j}] is an image part without an image")
                images.append(part["image"])
                parts.append({"type": "image"})
            else:
                raise TargetError(f"messages[{i}].content[{j}] has unsupported type {kind!r}")
        out.append({"role": role, "content": parts})
    return out, images


class TargetAdapter:
    """A loaded Qwen-VL target with its processor and tap hooks."""

    def __init__(self, model: nn.Module, processor: Any) -> None:
        model_type = getattr(model.config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise TargetError(f"unsupported target model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        self.model = model.eval()
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.text_config = model.config.get_text_config()
        self.layers = model.model.language_model.layers
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing: frozenset[int] = frozenset()
        # tap t = what enters layer t + 1 (the final norm after the last layer): deepstack additions included
        receivers = list(self.layers[1:]) + [model.model.language_model.norm]
        for idx, module in enumerate(receivers):
            module.register_forward_pre_hook(self._make_hook(idx), with_kwargs=True)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "TargetAdapter":
        from transformers import AutoModelForImageTextToText, AutoProcessor

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no Hugging Face model at {path} (config.json missing)")
        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, processor)

    def check_tap_layers(self, taps: list[int]) -> None:
        n = len(self.layers)
        bad = [t for t in taps if not 0 <= t < n]
        if bad:
            raise TargetError(f"tap layers {bad} outside the target's layers 0..{n - 1}")

    def _make_hook(self, idx: int):
        def hook(_module, args, kwargs):
            if idx in self._capturing:
                self._captured[idx] = args[0] if args else kwargs["hidden_states"]

        return hook

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.text_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return ids

    @property
    def vocab_size(self) -> int:
        """Logits per row (the LM head's outputs)."""
        return int(self.lm_head().weight.shape[0])

    @property
    def context_length(self) -> int:
        return int(getattr(self.text_config, "max_position_embeddings", 4096))

    def input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    # ------------------------------------------------------------------ prompt
    def prepare(self, messages: list[dict[str, Any]], processor: Any = None) -> PreparedPrompt:
        """Chat template + image processor + placeholder expansion -> model inputs on the device. ``processor``:
        a copy of the target's, to prepare in another thread (processors are not safe to share); None: its own."""
        processor = processor or self.processor
        template_messages, images = split_messages(messages)
        text = processor.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
        if images:
            kwargs["images"] = images
        try:
            inputs = processor(**kwargs)
        except (ValueError, TypeError) as exc:
            raise TargetError(f"could not process the request's images: {exc}") from exc
        inputs = {k: v.to(self.device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        return PreparedPrompt(inputs=inputs, num_images=len(images))

    # ------------------------------------------------------------------ passes
    def _run_capturing(self, taps: list[int] | None, **model_inputs: Any) -> tuple[Any, torch.Tensor | None]:
        """Run the model, capturing the outputs of decoder layers ``taps`` (concatenated in that order)."""
        self._capturing, self._captured = frozenset(taps or ()), {}
        try:
            out = self.model(**model_inputs)
            captured = torch.cat([self._captured[t][0] for t in taps], dim=-1) if taps else None
        finally:
            self._capturing, self._captured = frozenset(), {}
        return out, captured

    @torch.no_grad()
    def prefill(self, prompt: PreparedPrompt, taps: list[int] | None = None) -> tuple[TargetState, RowsOutput]:
        """Prompt pass. Returns the state (cache of P tokens) and the prompt rows' logits [P, V] and, when
        ``taps`` names decoder layers, their outputs concatenated [P, len(taps)*H]."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        self.model.model.rope_deltas = None  # a text-only prompt computes none: never reuse the last request's
        out, captured = self._run_capturing(taps, **prompt.inputs, past_key_values=cache, use_cache=True)
        deltas = self.model.model.rope_deltas
        rope_delta = int(deltas.reshape(-1)[0]) if deltas is not None else 0
        state = TargetState(cache=out.past_key_values, length=prompt.num_tokens, rope_delta=rope_delta)
        return state, RowsOutput(logits=out.logits[0], taps=captured)

    @torch.no_grad()
    def forward_rows(
        self, state: TargetState, tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
        taps: list[int] | None = None,
    ) -> RowsOutput:
        """Tree-masked pass over R packed rows on top of the cache (the cache grows by R).

        ``tokens`` / ``depths``: [R] long; ``ancestors``: bool [R, R] (row i sees row j iff True).
        Every row sees the whole prefix. Positions are ``P + depth + rope_delta`` on all three M-RoPE axes
        (Qwen3-VL also takes a leading text row, ``(4, 1, R)``; with three rows its text positions are the same
        values, and the explicit 4D mask makes them unused).
        ``taps``: decoder layers whose outputs to return, as in :meth:`prefill`.
        """
        r, p = tokens.shape[0], state.length
        dev, dtype = self.device, self.model.dtype
        mask = torch.zeros(1, 1, r, p + r, device=dev, dtype=dtype)
        mask[0, 0, :, p:] = torch.where(ancestors.to(dev), 0.0, torch.finfo(dtype).min).to(dtype)
        pos = (p + depths.to(dev) + state.rope_delta).view(1, 1, r).expand(3, 1, r)
        out, captured = self._run_capturing(
            taps, input_ids=tokens.view(1, r).to(dev), attention_mask=mask, position_ids=pos,
            past_key_values=state.cache, use_cache=True,
        )
        state.length += r
        return RowsOutput(logits=out.logits[0], taps=captured)

    def keep_rows(self, state: TargetState, num_rows: int, keep: torch.Tensor) -> None:
        """After a pass over ``num_rows`` rows, keep only the rows ``keep`` (ascending row indices) in the
        cache: entries become prefix + kept rows, in order."""
        p = state.length - num_rows
        rows = keep.tolist()
        n = len(rows)
        # rows already in place (a leading run 0, 1, 2, ...: a confident drafter's chain comes first in a
        # best-first tree) stay; only the others move (to p + i, in order; sources never precede their
        # destination), then the cache is cut: O(moved rows) rather than a copy of the whole cache
        start = next((i for i, row in enumerate(rows) if row != i), n)
        src = p + keep[start:].to(self.device) if start < n else None
        for layer in state.cache.layers:
            for name in ("keys", "values"):
                buf = getattr(layer, name)
                if src is not None:
                    buf[..., p + start:p + n, :] = buf.index_select(-2, src)
                setattr(layer, name, buf[..., :p + n, :])
        state.length = p + n


class CachePass:
    """One request's target pass for ``glance_sgl.round`` (``TargetRows``): the tree-masked pass on top of its
    Hugging Face cache, capturing ``taps``, and the KV keep. Logits come back on the host ([1, R, V]), where the
    walk runs."""

    def __init__(self, target: TargetAdapter, state: TargetState, taps: list[int] | None,
                 rules: LogitRules | None = None) -> None:
        self.target, self.state, self.taps = target, state, taps
        # the request's logit rules (None: none), applied to every row at its output index: ``next_index`` is the
        # output index of the token after the root, set by the engine before each round
        self.rules, self.next_index = rules, torch.zeros(1, dtype=torch.long)

    def forward(self, tree, taps: bool = True) -> PassOutput:
        """``tree``: a ``DraftTree`` [1, R]. Returns (logits [1, R, V] on the host, taps [1, R, L*H]; None where
        ``taps`` is False: no layer captured)."""
        if tree.num_rows == 1:  # an AR step: no tree mask to build
            ancestors = torch.ones(1, 1, dtype=torch.bool)
        else:
            # Triton on CUDA, glance_sgl.tree's torch code elsewhere; only the mask is needed here
            ancestors = glance_kernels.tree_meta(tree.parents, pointers=False).tree_mask[0]
        rows = self.target.forward_rows(self.state, tree.tokens[0], tree.depths[0], ancestors,
                                        taps=self.taps if taps else None)
        logits = rows.logits[None].cpu()
        if self.rules is not None:
            self.rules.apply(logits, tree.depths, self.next_index)
        return PassOutput(logits, None if rows.taps is None else rows.taps[None])

    def keep(self, tree, walk) -> None:
        """Keep the root's and the accepted rows' K/V (``walk.accepted_rows``), unless every row was accepted."""
        n = int(walk.accept_lens[0]) + 1
        if tree.num_rows > n:
            self.target.keep_rows(self.state, tree.num_rows, walk.accepted_rows[0, :n])

    def drop(self, tree) -> None:
        self.target.keep_rows(self.state, tree.num_rows, torch.zeros(0, dtype=torch.long))

    def agree(self, value: int) -> int:
        return value

    def width(self, rows: int) -> int:
        return rows
