"""GlanceConfig: the drafter's architecture and the decoding knobs, stored as the drafter's config.json.

On disk the config is a DFlash draft-model config (``architectures: ["DFlashDraftModel"]``, a Qwen3 config with
``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``), so that DFlash's
reference code and SGLang's DFLASH read our checkpoints and we read theirs; GLANCE's own drafting settings
(tree budget, branch_k) sit in a ``glance`` section DFlash ignores. The former layout (``model_type:
glance_drafter``, flat fields) still loads; ``glance convert`` rewrites it.

Tap convention: ``tap_layers`` == DFlash's ``target_layer_ids``, unchanged. Tap ``t`` is the hidden state that
leaves decoder layer ``t`` (0-indexed) and enters layer ``t + 1``: Hugging Face's ``hidden_states[t + 1]``,
SGLang's aux capture point ``t + 1``. On Qwen3-VL, whose deepstack adds vision features to the image positions
after layers 0-2, it is the state *after* that addition (what enters layer ``t + 1``, and what SGLang captures);
Hugging Face's ``hidden_states`` tuple holds the decoder outputs before it. The last layer (``t = n - 1``) has no
next layer: SGLang cannot capture it, and Hugging Face's ``hidden_states[n]`` is after the final norm, so DFlash
checkpoints should not name it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEGACY_MODEL_TYPE = "glance_drafter"  # the former flat checkpoint layout: read, converted, never the default

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
DFLASH_ARCHITECTURE = "DFlashDraftModel"
GLANCE_SECTION = "glance"  # GLANCE's own settings inside a DFlash config.json (DFlash and SGLang ignore it)


def default_tap_layers(num_target_layers: int, num_taps: int) -> list[int]:
    """Default tap layers (0-indexed decoder layers whose OUTPUT is tapped) for a target with
    ``num_target_layers`` layers: ``[n // 2]`` for one tap, else ``round(1 + i*(n-4)/(L-1))``.

    >>> default_tap_layers(36, 5)
    [1, 9, 17, 25, 33]
    """
    n, count = num_target_layers, num_taps
    if n < 1 or count < 1:
        raise ValueError(f"need at least one target layer and one tap (got {n} layers, {count} taps)")
    if count == 1:
        return [n // 2]
    taps = [int(round(1 + i * (n - 4) / (count - 1))) for i in range(count)]
    return [min(max(t, 0), n - 1) for t in taps]


def default_gamma(block_size: int) -> float:
    """Loss decay gamma for a block size (design §1: 7 for B=16, 5 for B=10, 4 for B=8)."""
    if block_size in DEFAULT_GAMMA:
        return DEFAULT_GAMMA[block_size]
    return max(1.0, block_size / 2.3)


@dataclass
class GlanceConfig:
    """Drafter architecture (Qwen3-style layers) plus the drafting defaults.

    ``hidden_size`` equals the target's hidden size: the head shares the target's input embedding and LM head.
    ``tap_layers`` are 0-indexed target decoder layers; the head reads the hidden state each one hands to the next
    layer (module docstring: the tap convention, equal to DFlash's ``target_layer_ids``).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    mask_token_id: int
    tap_layers: list[int]
    num_target_layers: int
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    block_size: int = 16
    budget: int = 63
    branch_k: int = 8
    target_model_type: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one anchor + at least one drafted token), got {self.block_size}")
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.branch_k < 1:
            raise ValueError(f"branch_k must be >= 1, got {self.branch_k}")
        if not self.tap_layers:
            raise ValueError("tap_layers must name at least one target layer")
        bad = [t for t in self.tap_layers if not 0 <= t < self.num_target_layers]
        if bad:
            raise ValueError(f"tap_layers {bad} outside the target's layers 0..{self.num_target_layers - 1}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary (size {self.vocab_size})")

    @property
    def gamma(self) -> float:
        return default_gamma(self.block_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GlanceConfig":
        """The config of its flat fields (:meth:`to_dict`); the former layout's ``model_type`` marker is dropped."""
        data = {k: v for k, v in data.items() if not (k == "model_type" and v == LEGACY_MODEL_TYPE)}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GLANCE config fields: {unknown}")
        return cls(**data)

    def save(self, directory: str | Path, format: str = "dflash") -> Path:
        """Write ``config.json``: the DFlash layout (default, :meth:`to_dflash_dict`) or, with ``format="glance"``,
        the project's former flat layout (``model_type: glance_drafter``; kept for conversion tests)."""
        if format not in ("dflash", "glance"):
            raise ValueError(f"unknown drafter config format {format!r}; expected 'dflash' or 'glance'")
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dflash_dict() if format == "dflash" else {"model_type": LEGACY_MODEL_TYPE, **self.to_dict()}
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "GlanceConfig":
        """Read a drafter ``config.json`` in either format (DFlash, or the former ``glance_drafter`` one)."""
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no GLANCE drafter config at {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"drafter config {path} is not valid JSON: {exc}") from exc
        return cls.from_any_dict(data, source=str(path))

    @classmethod
    def from_any_dict(cls, data: dict[str, Any], source: str = "config") -> "GlanceConfig":
        """A config from a parsed ``config.json`` of either format; ValueError naming ``source`` otherwise."""
        kind = config_format(data)
        if kind == "dflash":
            return cls.from_dflash_dict(data)
        if kind == "glance":
            return cls.from_dict(data)
        raise ValueError(f"{source} is neither a DFlash drafter config (architectures {[DFLASH_ARCHITECTURE]}, "
                         f"dflash_config) nor a GLANCE one (model_type 'glance_drafter'); got model_type "
                         f"{data.get('model_type')!r}, architectures {data.get('architectures')!r}")

    # ------------------------------------------------------------------ DFlash layout
    def to_dflash_dict(self) -> dict[str, Any]:
        """The DFlash draft-model ``config.json`` (what DFlash's reference code and SGLang's DFLASH read).

        A Qwen3 config (``model_type`` "qwen3", ``architectures`` ["DFlashDraftModel"]) with ``block_size``,
        ``num_target_layers`` and ``dflash_config`` = {``mask_token_id``, ``target_layer_ids``}; the
        ``target_layer_ids`` are our ``tap_layers`` unchanged (both: the 0-indexed decoder layer whose output
        is read, Hugging Face ``hidden_states[id + 1]``, SGLang's capture point ``id + 1``). GLANCE's own
        settings go in a ``glance`` section that DFlash ignores.
        """
        return {
            "architectures": [DFLASH_ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.tap_layers)},
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "head_dim": self.head_dim,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": int(self.extra.get("max_position_embeddings", 32768)),
            GLANCE_SECTION: {
                "format_version": 1,
                "budget": self.budget,
                "branch_k": self.branch_k,
                "target_model_type": self.target_model_type,
                "extra": dict(self.extra),
            },
        }

    @classmethod
    def from_dflash_dict(cls, data: dict[str, Any]) -> "GlanceConfig":
        """A config from a DFlash draft ``config.json`` (ours, DFlash's reference code's, or a Qwen3Config's
        ``to_dict()``): the drafting defaults come from the ``glance`` section when present (else
        ``budget`` 63 and ``branch_k`` 8). Raises ValueError for DFlash variants this head does not compute
        (sliding-window layers, grouped convolutions, a candidate selector, Domino projectors, scaled
        embeddings, biases, non-default RoPE)."""
        dflash = dict(data.get("dflash_config") or {})
        _reject_unsupported_dflash(data, dflash)
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
        layers = _required(text, "num_hidden_layers")
        ids = dflash.get("target_layer_ids", data.get("target_layer_ids"))
        n_target = dflash.get("num_target_layers", data.get("num_target_layers"))
        if n_target is None:
            if ids is None:
                raise ValueError("DFlash config has neither num_target_layers nor dflash_config.target_layer_ids")
            n_target = max(int(i) for i in ids) + 1  # what DFlash's own loaders assume
        n_target = int(n_target)
        if ids is None:
            ids = default_tap_layers(n_target, int(layers))  # DFlash's build_target_layer_ids: the same rule
        mask_id = dflash.get("mask_token_id", data.get("mask_token_id"))
        if mask_id is None:
            raise ValueError("DFlash config has no dflash_config.mask_token_id (a mask_token name alone needs the "
                             "target's tokenizer: write its id into the config)")
        block = dflash.get("block_size", data.get("block_size"))
        heads = int(_required(text, "num_attention_heads"))
        hidden = int(_required(text, "hidden_size"))
        glance = dict(data.get(GLANCE_SECTION) or {})
        extra = dict(glance.get("extra") or {})
        if "max_position_embeddings" in text and int(text["max_position_embeddings"]) != 32768:
            extra.setdefault("max_position_embeddings", int(text["max_position_embeddings"]))
        kwargs: dict[str, Any] = dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate_size=int(_required(text, "intermediate_size")),
            vocab_size=int(_required(text, "vocab_size")),
            mask_token_id=int(mask_id),
            tap_layers=[int(i) for i in ids],
            num_target_layers=n_target,
            num_hidden_layers=int(layers),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(text),
            block_size=int(block) if block is not None else 16,
            target_model_type=str(glance.get("target_model_type", "")),
            extra=extra,
        )
        for key in ("budget", "branch_k"):
            if key in glance:
                kwargs[key] = int(glance[key])
        return cls(**kwargs)

    @classmethod
    def for_target(
        cls,
        text_config: Any,
        mask_token_id: int,
        num_hidden_layers: int = 1,
        num_taps: int | None = None,
        block_size: int = 16,
        **overrides: Any,
    ) -> "GlanceConfig":
        """A drafter config sized for a Hugging Face text config (``hidden_size``, heads, vocabulary...).

        ``num_taps`` defaults to the number of head layers, at least 1 and at most the target's layers.
        """
        n = int(text_config.num_hidden_layers)
        taps = default_tap_layers(n, num_taps or min(max(num_hidden_layers, 1), n))
        heads = int(text_config.num_attention_heads)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        kwargs: dict[str, Any] = dict(
            hidden_size=int(text_config.hidden_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(text_config.intermediate_size),
            vocab_size=int(text_config.vocab_size),
            mask_token_id=int(mask_token_id),
            tap_layers=taps,
            num_target_layers=n,
            num_hidden_layers=num_hidden_layers,
            rms_norm_eps=float(getattr(text_config, "rms_norm_eps", 1e-6)),
            block_size=block_size,
            target_model_type=str(getattr(text_config, "model_type", "")),
        )
        kwargs.update(overrides)
        return cls(**kwargs)


def config_format(data: dict[str, Any]) -> str | None:
    """``"dflash"`` for a DFlash draft config (``architectures`` naming DFlashDraftModel, or a ``dflash_config``
    section), ``"glance"`` for the former ``model_type: glance_drafter`` layout, else None."""
    if data.get("model_type") == LEGACY_MODEL_TYPE:
        return "glance"
    if DFLASH_ARCHITECTURE in (data.get("architectures") or []) or isinstance(data.get("dflash_config"), dict):
        return "dflash"
    return None


def _required(data: dict[str, Any], key: str) -> Any:
    if data.get(key) is None:
        raise ValueError(f"DFlash config has no {key}")
    return data[key]


def _rope_theta(text: dict[str, Any]) -> float:
    """``rope_theta`` from a Qwen3 config: top-level (DFlash checkpoints) or ``rope_parameters`` (transformers 5)."""
    params = text.get("rope_parameters") or {}
    theta = text.get("rope_theta", params.get("rope_theta"))
    return float(theta) if theta is not None else 10000.0


# DFlash variants whose computation the GLANCE head does not implement: refused by name rather than run wrongly.
_UNSUPPORTED_DFLASH_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                            "attention_sink_bias", "attention_value_scale", "final_logit_softcapping")


def _reject_unsupported_dflash(data: dict[str, Any], dflash: dict[str, Any]) -> None:
    bad = [k for k in _UNSUPPORTED_DFLASH_KEYS if dflash.get(k)]
    if dflash.get("projector_type"):
        bad.append(f"projector_type={dflash['projector_type']!r}")
    for key, ok in (("output_multiplier", 1.0), ("input_embedding_scale", 1.0)):
        if float(dflash.get(key, data.get(key, ok)) or ok) != ok:
            bad.append(key)
    if data.get("attention_bias"):
        bad.append("attention_bias")
    if data.get("use_gemma_norm"):
        bad.append("use_gemma_norm")
    if data.get("has_embed_tokens") or data.get("has_lm_head"):
        bad.append("own embedding / LM head")
    if "sliding_attention" in (data.get("layer_types") or []):
        bad.append("sliding_attention layers")
    if data.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={data['hidden_act']!r}")
    rope = data.get("rope_scaling") or data.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        bad.append(f"rope_type={rope.get('rope_type', rope.get('type'))!r}")
    if bad:
        raise ValueError(f"DFlash draft config uses features the GLANCE head does not implement: {', '.join(bad)}")
