"""Helpers shared by the core tests: tiny deterministic images and chat prompts, random drafters.

(A plain module with a unique name: with several conftest.py files in the tree, `from conftest import` is
ambiguous.)
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image

from glance_sgl.checkpoints import MASK_TOKEN
from glance_sgl.drafter import GlanceDrafter
from glance_sgl.target import TargetAdapter

ARCHS = ["qwen2_5_vl", "qwen2_vl"]
IMAGE_SIZES = [(112, 112), (168, 140), (84, 196)]  # (width, height): three sizes, so several token counts


def make_image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A deterministic picture: coloured blocks on noise."""
    rng = np.random.RandomState(seed)
    w, h = size
    arr = rng.randint(0, 256, (h, w, 3), dtype=np.uint8)
    for _ in range(3):
        x, y = rng.randint(0, w - 20), rng.randint(0, h - 20)
        arr[y : y + 20, x : x + 20] = rng.randint(0, 256, 3)
    return Image.fromarray(arr)


WORDS = "what colour is the circle how many shapes read text describe picture chart value left right top".split()


def make_prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` chat requests: one image (sizes vary), two images, or text only."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))
        kind = i % 5
        parts: list[dict] = []
        if kind in (0, 1, 2):
            parts.append({"type": "image", "image": make_image(seed * 1000 + i, IMAGE_SIZES[kind])})
        elif kind == 3:
            parts += [{"type": "image", "image": make_image(seed * 1000 + i, IMAGE_SIZES[0])},
                      {"type": "image", "image": make_image(seed * 1000 + i + 500, IMAGE_SIZES[1])}]
        parts.append({"type": "text", "text": text})
        out.append([{"role": "user", "content": parts}])
    return out


def random_drafter(target: TargetAdapter, seed: int = 0, **overrides) -> GlanceDrafter:
    mask_id = target.tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    return GlanceDrafter.for_target(target.text_config, mask_id, seed=seed, **overrides)


def tiny_bound_drafter(block_size: int = 5, branch_k: int = 2, seed: int = 0, kv_heads: int = 1) -> GlanceDrafter:
    """A 2-layer drafter (hidden 32, vocabulary 40, taps [1, 2] of a 4-layer target, ``kv_heads`` K/V heads) bound
    to a random embedding and LM head of its own: for tests of the pool, the planner and the static drafter pass
    without a target."""
    import torch

    from glance_sgl.config import GlanceConfig

    cfg = GlanceConfig(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=kv_heads,
                       head_dim=16, num_hidden_layers=2, vocab_size=40, num_target_layers=4, tap_layers=[1, 2],
                       block_size=block_size, branch_k=branch_k, mask_token_id=3)
    torch.manual_seed(seed)
    d = GlanceDrafter(cfg).eval()
    d.bind_target(torch.nn.Embedding(40, 32), torch.nn.Linear(32, 40, bias=False))
    return d

