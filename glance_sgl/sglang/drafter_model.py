"""The GLANCE drafter as an SGLang model class (registered in SGLang's ``ModelRegistry``).

It reads the drafter checkpoint format of the project, a DFlash draft checkpoint (``config.json`` with
``architectures: ["DFlashDraftModel"]`` + ``model.safetensors``, written by ``GlanceDrafter.save_pretrained``;
SGLang's own ``get_config`` reads it as a Qwen3 config), and the former ``model_type: glance_drafter`` layout
(whose config class is registered below). The algorithm is ``glance_sgl.drafter.GlanceDrafter``; this class only
adapts it to SGLang's model-class contract (``__init__(config, quant_config, prefix)``, ``load_weights(iterable of
(name, tensor))``) and binds the target's input embedding and LM head, which the drafter shares by reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from glance_sgl.config import GlanceConfig, config_format
from glance_sgl.drafter import GlanceDrafter, _head_name, _ignorable, load_head_weights


def hf_config_class():
    """A ``transformers`` config class for ``model_type`` "glance_drafter" (the former checkpoint layout), so that
    SGLang's ``get_config`` (it reads every ``--speculative-draft-model-path``) understands such a config.json."""
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
            if config_format(data) != "dflash":
                data = {k: v for k, v in data.items() if k in GlanceConfig.__dataclass_fields__}
                data["model_type"] = "glance_drafter"
            config = GlanceConfig.from_any_dict(data)
        self.config = config
        self.drafter = GlanceDrafter(config)

    @classmethod
    def from_checkpoint(cls, directory: str | Path, device="cpu", dtype: torch.dtype = torch.float32
                        ) -> "GlanceDrafterForSGLang":
        """Load a drafter checkpoint directory (the embedded engine's format) through this class."""
        directory = Path(directory)
        model = cls(GlanceConfig.load(directory))
        model.drafter.load_state_dict(load_head_weights(directory, model.drafter.state_dict().keys()), strict=True)
        return model.to(device=device, dtype=dtype).eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """SGLang's loader contract: (name, tensor) pairs, with or without a ``model.`` / ``drafter.`` prefix."""
        expected = set(self.drafter.state_dict())
        state = {_head_name(name): tensor for name, tensor in weights}
        state = {k: v for k, v in state.items() if k in expected or not _ignorable(k)}
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


def tensor_parallel_size() -> int:
    """SGLang's tensor-parallel world size in this process (1 outside an SGLang engine)."""
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except (AssertionError, ImportError, RuntimeError, ValueError):
        return 1


class _Embed(nn.Module):
    """The target's input embedding without SGLang's vocabulary padding (rows past ``vocab``). Under tensor
    parallelism each rank holds a vocabulary shard: the target's own ``VocabParallelEmbedding`` forward looks the
    ids up and all-reduces, so every rank gets the full embeddings."""

    def __init__(self, embed: nn.Module, vocab: int) -> None:
        super().__init__()
        self.embed, self.vocab = embed, vocab
        self.tp = tensor_parallel_size()

    @property
    def weight(self) -> torch.Tensor:
        return self.embed.weight[: self.vocab]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            return self.embed(ids)
        return torch.nn.functional.embedding(ids, self.weight)


class _LMHead(nn.Module):
    """SGLang's LM head is a ``ParallelLMHead`` (weights only, no forward, vocabulary padded to a multiple of
    64): logits = hidden @ W[:vocab]^T, so that padding rows can never be drafted. Under tensor parallelism the
    shards' logits are all-gathered, so every rank drafts from the full vocabulary (the drafter itself is
    replicated: every rank builds the same tree)."""

    def __init__(self, head: nn.Module, vocab: int) -> None:
        super().__init__()
        self.head, self.vocab = head, vocab
        self.tp = tensor_parallel_size()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:  # each rank's shard of the (padded) vocabulary, gathered in rank order = vocabulary order
            from sglang.srt.distributed import tensor_model_parallel_all_gather

            w = self.head.weight
            local = torch.nn.functional.linear(hidden.to(w.dtype), w)
            return tensor_model_parallel_all_gather(local, dim=-1)[..., : self.vocab]
        w = self.head.weight[: self.vocab]
        return torch.nn.functional.linear(hidden.to(w.dtype), w)


EntryClass = [GlanceDrafterForSGLang]
