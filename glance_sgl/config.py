"""GlanceConfig: the drafter's architecture and the decoding knobs, stored as the drafter's config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


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
    ``tap_layers`` are 0-indexed target decoder layers; the head reads their outputs.
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
    model_type: str = "glance_drafter"
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
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GLANCE config fields: {unknown}")
        return cls(**data)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "GlanceConfig":
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no GLANCE drafter config at {path}")
        data = json.loads(path.read_text())
        if data.get("model_type") != "glance_drafter":
            raise ValueError(f"{path} is not a GLANCE drafter config (model_type={data.get('model_type')!r})")
        return cls.from_dict(data)

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
