"""Request payloads: the demo tasks' images and prompts, or random images at a given resolution.

Everything is built and PNG-encoded before the run starts (a pool), so the measured loop spends no client CPU
on images. Deterministic from ``seed``.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

DEMO_TASKS = ("caption", "text", "chart", "document", "open")
WORDS = ("what colour is the circle how many shapes read the text describe this picture chart value left right "
         "top bottom sign table row column story about a tree river city write short").split()
TEXT_PROMPTS = ("Write a short story about a river.", "What is the capital of a country with a red flag?",
                "Tell me about your favourite colour.", "Describe a city at night.",
                "Write a haiku about the sea.", "Explain how a tree grows.")


@dataclass(frozen=True)
class Picture:
    png: bytes
    width: int
    height: int

    @property
    def data_url(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode()


@dataclass(frozen=True)
class Item:
    """One prompt with its images (0, 1 or 2)."""

    prompt: str
    pictures: tuple[Picture, ...] = ()

    def messages(self) -> list[dict[str, Any]]:
        """OpenAI chat messages: image_url parts (data URLs) then the text."""
        if not self.pictures:
            return [{"role": "user", "content": self.prompt}]
        parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": p.data_url}}
                                       for p in self.pictures]
        parts.append({"type": "text", "text": self.prompt})
        return [{"role": "user", "content": parts}]


def encode_png(image: Image.Image) -> Picture:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return Picture(buf.getvalue(), image.width, image.height)


def random_picture(rng: np.random.RandomState, size: tuple[int, int]) -> Picture:
    w, h = size
    arr = rng.randint(0, 256, (h, w, 3), dtype=np.uint8)
    for _ in range(3):  # a few flat blocks so the picture is not pure noise
        bw, bh = max(w // 5, 1), max(h // 5, 1)
        x, y = rng.randint(0, w - bw + 1), rng.randint(0, h - bh + 1)
        arr[y:y + bh, x:x + bw] = rng.randint(0, 256, 3)
    return encode_png(Image.fromarray(arr))


class Dataset:
    """A pool of single-image items (with their prompts) and text prompts; draws one, two or no images."""

    name = "base"

    def __init__(self, single: list[Item], texts: list[str], seed: int = 0) -> None:
        if not single or not texts:
            raise ValueError("empty dataset")
        self.single, self.texts = single, texts
        self.rng = random.Random(seed)

    def sample(self, n_images: int) -> Item:
        if n_images == 0:
            return Item(self.rng.choice(self.texts))
        if n_images == 1:
            return self.rng.choice(self.single)
        picks = [self.rng.choice(self.single) for _ in range(n_images)]
        prompt = f"Compare the {n_images} images. " + picks[0].prompt
        return Item(prompt, tuple(p.pictures[0] for p in picks))

    def describe(self) -> dict[str, Any]:
        sizes = sorted({(p.width, p.height) for item in self.single for p in item.pictures})
        return {"name": self.name, "items": len(self.single), "text_prompts": len(self.texts),
                "image_sizes": [f"{w}x{h}" for w, h in sizes]}


class DemoDataset(Dataset):
    """The demo task family's evaluation images and prompts (``glance_sgl.demo.tasks``)."""

    name = "demo"

    def __init__(self, tasks: tuple[str, ...] = DEMO_TASKS, per_task: int = 16, seed: int = 0) -> None:
        from glance_sgl.demo.tasks import eval_set

        unknown = set(tasks) - set(DEMO_TASKS)
        if unknown:
            raise ValueError(f"unknown demo task(s) {sorted(unknown)}; choose from {', '.join(DEMO_TASKS)}")
        single = [Item(ex.prompt, (encode_png(ex.image),)) for t in tasks for ex in eval_set(t, per_task)]
        texts = [ex.prompt for ex in eval_set("open", per_task)] if "open" in tasks else list(TEXT_PROMPTS)
        super().__init__(single, texts, seed)
        self.tasks = tasks

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tasks": list(self.tasks)}


class RandomDataset(Dataset):
    """Random pictures of ``image_size`` (w, h) with random word prompts of ``prompt_words`` (lo, hi) words."""

    name = "random"

    def __init__(self, image_size: tuple[int, int] = (224, 224), prompt_words: tuple[int, int] = (4, 12),
                 pool: int = 32, seed: int = 0) -> None:
        rng = np.random.RandomState(seed)
        prng = random.Random(seed)

        def words() -> str:
            return " ".join(prng.choice(WORDS) for _ in range(prng.randint(*prompt_words)))

        single = [Item(words(), (random_picture(rng, image_size),)) for _ in range(pool)]
        super().__init__(single, [words() for _ in range(pool)], seed)


def parse_size(text: str) -> tuple[int, int]:
    """``"448x336"`` or ``"448"`` -> (width, height)."""
    w, _, h = text.lower().partition("x")
    try:
        size = (int(w), int(h or w))
    except ValueError as exc:
        raise ValueError(f"image size {text!r}: use WIDTHxHEIGHT, e.g. 448x448") from exc
    if min(size) < 14 or max(size) > 8192:
        raise ValueError(f"image size {text!r}: each side must be within 14..8192 pixels")
    return size


def build_dataset(name: str, *, demo_tasks: tuple[str, ...] = DEMO_TASKS, image_size: tuple[int, int] = (224, 224),
                  prompt_words: tuple[int, int] = (4, 12), seed: int = 0) -> Dataset:
    if name == "demo":
        return DemoDataset(demo_tasks, seed=seed)
    if name == "random":
        return RandomDataset(image_size, prompt_words, seed=seed)
    raise ValueError(f"unknown dataset {name!r} (demo or random)")
