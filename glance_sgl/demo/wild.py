"""The ``wild`` bench task: requests unlike the demo tasks, built in code and deterministic from a seed.

The five demo tasks are what the bundled VLM and its drafter were trained on (168-pixel Pillow drawings, a few
fixed prompts). Requests a real deployment sees are not like that, and that is where speculation must not cost
time. ``wild`` mixes, in a fixed rotation so that any ``limit`` covers several kinds:

- ``photo``: photo-like pictures (sky and ground gradients, a sun, blurred objects, sensor noise) at other sizes
  and aspect ratios, with generic questions;
- ``text_only``: generic questions with no image (facts, code, arithmetic, translation);
- ``noise``: noise and texture images (uniform, Gaussian, salt and pepper, stripes, checkerboards) of odd sizes;
- ``chat``: multi-turn chat with a system message and an earlier assistant turn;
- ``long``: a long prompt (a few hundred words of generated prose, sometimes beside an image) to summarise;
- ``two_images``: a photo and a noise image to compare.

It is not one of the training tasks (``tasks.TASKS`` does not list it and nothing trains on it); ``glance bench``
reports it apart from the five-task geometric mean. Images are drawn with numpy and Pillow, so the set is the
same on every machine.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

TASK = "wild"
KINDS = ("photo", "text_only", "noise", "chat", "long", "two_images")
WILD_SIZE = 40
# (width, height): none is one of the demo canvases (168 x 168, 168 x 112); several aspect ratios, some sizes
# that are not multiples of the 28-pixel merge grid (the processor resizes them)
PHOTO_SIZES = ((224, 168), (168, 224), (280, 112), (112, 280), (196, 196), (252, 140), (84, 84), (336, 224))
NOISE_SIZES = ((150, 97), (64, 200), (240, 240), (97, 150), (300, 60), (128, 128))
NOISE_KINDS = ("uniform", "gaussian", "salt_pepper", "stripes", "checker")

PHOTO_PROMPTS = (
    "What is in this photo?", "Where might this picture have been taken?", "Is this indoors or outdoors?",
    "What time of day is it in this photo?", "Describe the mood of this image in one sentence.",
    "What would be a good title for this picture?", "Is there anything unusual about this image?",
    "Describe the colours and textures you see.", "Would this make a good postcard? Why?",
    "Write a caption for social media for this photo.",
)
NOISE_PROMPTS = (
    "What is this?", "Can you find any pattern in this image?", "Is this image corrupted?",
    "What does this texture remind you of?", "Describe this image in detail.", "Is there a hidden picture here?",
)
TEXT_QUESTIONS = (
    "What is the capital of France?", "Explain photosynthesis in simple terms.",
    "Write a Python function that reverses a list.", "Translate 'good morning, my friend' into Spanish.",
    "What is 17 times 23?", "Give me three tips for sleeping better.", "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.", "What are the primary colours?",
    "How do I boil an egg?", "List five animals that live in the ocean.", "What does HTTP stand for?",
)
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a concise assistant. Answer briefly.",
                  "You are a friendly travel agent.", "You are a patient maths tutor.")
CHAT_TOPICS = ("a trip to the mountains", "learning to play the guitar", "a birthday party for my sister",
               "starting a vegetable garden", "a job interview next week", "training for a 10k run")
CHAT_REPLIES = ("That sounds exciting! Tell me a bit more about what you have in mind.",
                "Great idea. What is your budget and how much time do you have?",
                "Happy to help. Have you done anything like this before?")
CHAT_FOLLOW_UPS = ("What should I prepare first?", "Can you make me a short checklist?",
                   "What mistakes do beginners usually make?", "How long will it take?",
                   "Any advice for the first day?")
LONG_TASKS = ("Summarise the text above in two sentences.", "What is the main point of this passage?",
              "List three key facts from the text.", "Rewrite the first sentence in plain words.")
# material for the long prompts' prose (generated sentences, so no corpus is needed)
SUBJECTS = ("The committee", "A small village", "The old library", "Our research team", "The river delta",
            "Every spring the farmers", "The city council", "A local bakery", "The museum", "Most engineers")
VERBS = ("reported", "discovered", "decided", "argued", "noticed", "planned", "explained", "measured")
OBJECTS = ("that the budget would grow by nine percent", "a new way to store rainwater",
           "to rebuild the northern bridge before winter", "that traffic had doubled since last year",
           "several rare birds near the marsh", "a festival for the harvest season",
           "how the printing press changed local trade", "the temperature every hour for a month",
           "that the roof needed urgent repairs", "a cheaper route for the delivery trucks")
CLAUSES = ("after a long debate", "despite the heavy rain", "according to the annual report",
           "with help from volunteers", "for the third year in a row", "to everyone's surprise",
           "while the mayor was away", "in a letter to the newspaper")


@dataclass(frozen=True)
class WildExample:
    """One ``wild`` request. ``turns``: (role, text, images) in order; ``key`` identifies the content."""

    index: int
    kind: str
    turns: tuple[tuple[str, str, tuple[Image.Image, ...]], ...]
    key: str
    task: str = TASK
    grounded: bool = False

    @property
    def prompt(self) -> str:
        """The last user message's text."""
        return next(text for role, text, _ in reversed(self.turns) if role == "user")

    @property
    def images(self) -> tuple[Image.Image, ...]:
        return tuple(img for _, _, imgs in self.turns for img in imgs)

    def messages(self) -> list[dict[str, Any]]:
        """Engine-format chat messages (PIL images in ``{"type": "image"}`` parts, before the text)."""
        out: list[dict[str, Any]] = []
        for role, text, imgs in self.turns:
            if imgs:
                content = [{"type": "image", "image": img} for img in imgs] + [{"type": "text", "text": text}]
                out.append({"role": role, "content": content})
            else:
                out.append({"role": role, "content": text})
        return out


# ---------------------------------------------------------------------------------------------- images
def photo_image(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """A photo-like picture: sky and ground gradients split at a horizon, a sun, blurred objects, sensor noise."""
    w, h = size
    horizon = int(h * rng.uniform(0.35, 0.7))
    sky_top, sky_low = rng.uniform(60, 255, 3), rng.uniform(120, 255, 3)
    ground_near, ground_far = rng.uniform(20, 160, 3), rng.uniform(40, 200, 3)
    y = np.arange(h, dtype=np.float32)[:, None, None]
    t_sky = np.clip(y / max(horizon, 1), 0, 1)
    t_ground = np.clip((y - horizon) / max(h - horizon, 1), 0, 1)
    sky = sky_top * (1 - t_sky) + sky_low * t_sky
    ground = ground_far * (1 - t_ground) + ground_near * t_ground
    arr = np.where(y < horizon, sky, ground) * np.ones((1, w, 1), dtype=np.float32)
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    r = int(min(w, h) * rng.uniform(0.05, 0.12))
    sx, sy = int(rng.uniform(r, w - r)), int(rng.uniform(r, max(horizon - r, r + 1)))
    draw.ellipse((sx - r, sy - r, sx + r, sy + r), fill=tuple(int(c) for c in rng.uniform(200, 255, 3)))
    for _ in range(int(rng.integers(2, 7))):  # trees, houses, rocks on the ground line
        ow, oh = int(w * rng.uniform(0.04, 0.2)), int(h * rng.uniform(0.08, 0.35))
        x0 = int(rng.uniform(0, w - ow))
        colour = tuple(int(c) for c in rng.uniform(10, 200, 3))
        if rng.random() < 0.5:
            draw.rectangle((x0, horizon - oh, x0 + ow, horizon + oh // 4), fill=colour)
        else:
            draw.ellipse((x0, horizon - oh, x0 + ow, horizon + oh // 3), fill=colour)
    img = img.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.6, 1.8))))
    noisy = np.asarray(img, dtype=np.float32) + rng.normal(0, rng.uniform(2, 10), (h, w, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def noise_image(rng: np.random.Generator, size: tuple[int, int], kind: str) -> Image.Image:
    """Noise or a texture of ``kind`` (one of ``NOISE_KINDS``)."""
    w, h = size
    if kind == "uniform":
        arr = rng.integers(0, 256, (h, w, 3))
    elif kind == "gaussian":
        arr = rng.normal(rng.uniform(60, 200), rng.uniform(20, 70), (h, w, 3))
    elif kind == "salt_pepper":
        arr = np.full((h, w, 3), rng.uniform(80, 180))
        mask = rng.random((h, w))
        arr[mask < 0.1], arr[mask > 0.9] = 0, 255
    elif kind == "stripes":
        period = int(rng.integers(3, 17))
        axis = np.arange(w if rng.random() < 0.5 else h)
        band = (axis // period) % 2
        a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        line = np.where(band[:, None] == 1, a, b)
        arr = np.broadcast_to(line[None], (h, w, 3)) if len(axis) == w else np.broadcast_to(line[:, None], (h, w, 3))
        arr = arr + rng.normal(0, 6, (h, w, 3))
    elif kind == "checker":
        cell = int(rng.integers(4, 25))
        yy, xx = np.mgrid[0:h, 0:w]
        on = ((yy // cell + xx // cell) % 2)[..., None]
        arr = np.where(on == 1, rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)) + rng.normal(0, 4, (h, w, 3))
    else:
        raise ValueError(f"unknown noise kind {kind!r}; kinds: {', '.join(NOISE_KINDS)}")
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


# ---------------------------------------------------------------------------------------------- prompts
def long_text(rng: random.Random, sentences: int) -> str:
    """Generated prose: ``sentences`` sentences from fixed phrase lists."""
    out = []
    for _ in range(sentences):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.6:
            s += f" {rng.choice(CLAUSES)}"
        out.append(s + ".")
    return " ".join(out)


def make_wild(index: int, seed: int = 0) -> WildExample:
    """Request ``index`` of the wild set drawn with ``seed`` (its kind rotates through ``KINDS``)."""
    rng = random.Random(f"wild:{seed}:{index}")
    nrng = np.random.default_rng(rng.getrandbits(64))
    kind = KINDS[index % len(KINDS)]
    if kind == "photo":
        size = rng.choice(PHOTO_SIZES)
        turns = (("user", rng.choice(PHOTO_PROMPTS), (photo_image(nrng, size),)),)
        key = f"photo|{size}"
    elif kind == "text_only":
        turns = (("user", rng.choice(TEXT_QUESTIONS), ()),)
        key = "text_only"
    elif kind == "noise":
        size, noise = rng.choice(NOISE_SIZES), rng.choice(NOISE_KINDS)
        turns = (("user", rng.choice(NOISE_PROMPTS), (noise_image(nrng, size, noise),)),)
        key = f"noise|{noise}|{size}"
    elif kind == "chat":
        topic = rng.choice(CHAT_TOPICS)
        turns = (("system", rng.choice(SYSTEM_PROMPTS), ()),
                 ("user", f"Hi! I would like some help with {topic}.", ()),
                 ("assistant", rng.choice(CHAT_REPLIES), ()),
                 ("user", rng.choice(CHAT_FOLLOW_UPS), ()))
        key = f"chat|{topic}"
    elif kind == "long":
        text = long_text(rng, rng.randint(12, 24))
        images = (photo_image(nrng, rng.choice(PHOTO_SIZES)),) if rng.random() < 0.5 else ()
        turns = (("user", f"{text}\n\n{rng.choice(LONG_TASKS)}", images),)
        key = f"long|{len(images)}"
    else:  # two_images
        images = (photo_image(nrng, rng.choice(PHOTO_SIZES)),
                  noise_image(nrng, rng.choice(NOISE_SIZES), rng.choice(NOISE_KINDS)))
        turns = (("user", rng.choice(("Compare these two images.", "What is different between these pictures?",
                                      "Which of the two images looks like a real photo?")), images),)
        key = "two_images"
    text = "|".join(t for _, t, _ in turns)
    return WildExample(index=index, kind=kind, turns=turns, key=f"wild|{key}|{text}")


@functools.lru_cache(maxsize=4)
def wild_set(n: int = WILD_SIZE, seed: int = 0) -> tuple[WildExample, ...]:
    """The fixed ``wild`` evaluation set: ``n`` requests drawn with ``seed``."""
    return tuple(make_wild(i, seed) for i in range(n))


__all__ = ["TASK", "KINDS", "WILD_SIZE", "WildExample", "make_wild", "wild_set", "photo_image", "noise_image"]
