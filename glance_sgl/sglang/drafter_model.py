"""The GLANCE drafter as an SGLang model class (registered in SGLang's ``ModelRegistry``).

It reads the one drafter checkpoint format of the project (``config.json`` with ``model_type``
``glance_drafter`` + ``model.safetensors``, written by ``GlanceDrafter.save_pretrained``): the algorithm is
``glance_sgl.drafter.GlanceDrafter``, this class only adapts it to SGLang's model-class contract
(``__init__(config, quant_config, prefix)``, ``load_weights(iterable of (name, tensor))``) and binds the target's
input embedding and LM head, which the drafter shares by reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from glance_sgl.config import GlanceConfig
from glance_sgl.drafter import GlanceDrafter


def hf_config_class():
    """A ``transformers`` config class for ``model_type`` "glance_drafter", so that SGLang's ``get_config`` (it
    reads every ``--speculative-draft-model-path``) understands the drafter checkpoint's config.json."""
    from transformers import PretrainedConfig

    class GlanceDrafterConfig(PretrainedConfig):
        model_type = "glance_drafter"

        def __init__(self, **kwargs):
            kwargs.setdefault("architectures", ["GlanceDrafterForSGLang"])
            super().__init__(**kwargs)

    return GlanceDrafterConfig


def register_hf_config() -> None:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "glance_drafter" not in CONFIG_MAPPING:
        AutoConfig.register("glance_drafter", hf_config_class())


class GlanceDrafterForSGLang(nn.Module):
    """SGLang model class around :class:`GlanceDrafter`."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        if not isinstance(config, GlanceConfig):
            data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
            data["model_type"] = "glance_drafter"
            known = {k: v for k, v in data.items() if k in GlanceConfig.__dataclass_fields__}
            config = GlanceConfig.from_dict(known)
        self.config = config
        self.drafter = GlanceDrafter(config)

    @classmethod
    def from_checkpoint(cls, directory: str | Path, device="cpu", dtype: torch.dtype = torch.float32
                        ) -> "GlanceDrafterForSGLang":
        """Load a drafter checkpoint directory (the embedded engine's format) through this class."""
        from safetensors.torch import load_file

        directory = Path(directory)
        model = cls(GlanceConfig.load(directory))
        model.load_weights(load_file(str(directory / "model.safetensors")).items())
        return model.to(device=device, dtype=dtype).eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = {name.removeprefix("drafter."): tensor for name, tensor in weights}
        missing, unexpected = self.drafter.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"GLANCE drafter checkpoint mismatch: missing {missing}, unexpected {unexpected}")

    def bind_target(self, target_model: nn.Module) -> GlanceDrafter:
        """Share the SGLang target model's input embedding and LM head; returns the bound drafter."""
        embed = target_model.get_input_embeddings() if hasattr(target_model, "get_input_embeddings") \
            else target_model.model.embed_tokens
        vocab = self.config.vocab_size
        self.drafter.bind_target(_Embed(embed, vocab), _LMHead(target_model.lm_head, vocab))
        return self.drafter

    def forward(self, *args, **kwargs):  # pragma: no cover - driven by GlanceWorker, not by a ModelRunner
        raise RuntimeError("GlanceDrafterForSGLang is run by the GLANCE worker (draft_block), not forwarded")


class _Embed(nn.Module):
    """The target's input embedding without SGLang's vocabulary padding (rows past ``vocab``)."""

    def __init__(self, embed: nn.Module, vocab: int) -> None:
        super().__init__()
        self.embed, self.vocab = embed, vocab

    @property
    def weight(self) -> torch.Tensor:
        return self.embed.weight[: self.vocab]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


class _LMHead(nn.Module):
    """SGLang's LM head is a ``ParallelLMHead`` (weights only, no forward, vocabulary padded to a multiple of
    64): logits = hidden @ W[:vocab]^T, so that padding rows can never be drafted."""

    def __init__(self, head: nn.Module, vocab: int) -> None:
        super().__init__()
        self.head, self.vocab = head, vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.head.weight[: self.vocab]
        return torch.nn.functional.linear(hidden.to(w.dtype), w)


EntryClass = [GlanceDrafterForSGLang]
