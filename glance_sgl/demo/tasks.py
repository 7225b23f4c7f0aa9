"""The demo's synthetic task family, rendered with Pillow, mirroring the paper's task mix.

Grounded tasks (the image determines the answer): ``caption`` (shapes, colours, counts, positions), ``text``
(reading a sign, TextVQA-like), ``chart`` (bar and line charts, ChartQA-like), ``document`` (a small table,
DocVQA-like). Open-ended: ``open`` (stories and chat the image does not determine, with real variety).

Everything is deterministic from a string seed. Evaluation examples come from their own seed space and every
training example whose content key (what the image shows + the question) equals an evaluation key is redrawn,
so the splits are disjoint.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any, Callable

from PIL import Image, ImageDraw, ImageFont

TASKS = ("caption", "text", "chart", "document", "open")
GROUNDED = {"caption": True, "text": True, "chart": True, "document": True, "open": False}
EVAL_SIZE = 40

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
}
SHAPES = ("circle", "square", "triangle")
ROWS, COLS = ("top", "middle", "bottom"), ("left", "center", "right")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SIGN_WORDS = (
    "APPLE", "RIVER", "STONE", "CLOUD", "TIGER", "LEMON", "OCEAN", "PIANO", "ROBOT", "MAPLE", "EAGLE", "CANDY",
    "TRAIN", "HONEY", "LIGHT", "MUSIC", "PLANT", "QUEEN", "SMILE", "WATER", "BREAD", "CHAIR", "DREAM", "FROST",
    "GRAPE", "HOUSE", "JUICE", "KNIFE", "MANGO", "NORTH", "OLIVE", "PEARL", "RADIO", "SUGAR", "TOWER", "VOICE",
)
ITEMS = ("PEAR", "MILK", "RICE", "SALT", "CORN", "FISH", "TEA", "EGGS", "BEANS", "FLOUR", "OATS", "SOUP")
BAR_LABELS = "ABCDE"
# Canvases are mid-grey, near the processor's normalisation mean: a white page would make every patch embedding
# mostly the same large background vector, drowning the thin strokes a tiny vision tower trained from scratch
# must learn to read.
CANVAS = (124, 118, 108)


@dataclass
class Example:
    """One image + prompt with its reference answer. ``key`` identifies the content (for split disjointness)."""

    task: str
    image: Image.Image
    prompt: str
    answer: str
    key: str

    @property
    def grounded(self) -> bool:
        return GROUNDED[self.task]

    def messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "image", "image": self.image},
                                             {"type": "text", "text": self.prompt}]}]


@functools.lru_cache(maxsize=8)
def font(size: int) -> ImageFont.FreeTypeFont:
    """Pillow's bundled font (no system fonts: renders the same on every machine)."""
    return ImageFont.load_default(size=size)


def _centered_text(draw: ImageDraw.ImageDraw, xy: tuple[int, int], text: str, size: int, fill) -> None:
    f = font(size)
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=f)
    draw.text((xy[0] - (x1 - x0) / 2 - x0, xy[1] - (y1 - y0) / 2 - y0), text, font=f, fill=fill)


# ---------------------------------------------------------------------------------------------- caption
def make_caption(rng: random.Random) -> Example:
    size, cell = 168, 56
    n = rng.randint(1, 3)
    cells = sorted(rng.sample(range(9), n))
    img = Image.new("RGB", (size, size), CANVAS)
    draw = ImageDraw.Draw(img)
    parts = []
    for c in cells:
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        r, col = divmod(c, 3)
        cx, cy, h = col * cell + cell // 2, r * cell + cell // 2, 18
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse((cx - h, cy - h, cx + h, cy + h), fill=fill)
        elif shape == "square":
            draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
        else:
            draw.polygon([(cx, cy - h), (cx - h, cy + h), (cx + h, cy + h)], fill=fill)
        where = "in the center" if c == 4 else f"at the {ROWS[r]} {COLS[col]}"
        parts.append(f"a {colour} {shape} {where}")
    noun = "shape" if n == 1 else "shapes"
    verb = "is" if n == 1 else "are"
    body = ", ".join(parts[:-1]) + (" and " if n > 1 else "") + parts[-1]
    answer = f"There {verb} {NUMBER_WORDS[n]} {noun}: {body}."
    prompt = rng.choice(["Describe the image.", "What do you see in the picture?", "Describe the shapes."])
    return Example("caption", img, prompt, answer, key=f"caption|{answer}")


# ---------------------------------------------------------------------------------------------- text
def make_text(rng: random.Random) -> Example:
    """A sign with a word and a number (gate, platform, room...): 36 x 98 contents, so the evaluation signs
    leave plenty of training signs (single words alone would be used up by the evaluation set)."""
    word, number = rng.choice(SIGN_WORDS), rng.randint(2, 99)
    bg = rng.choice([(128, 128, 128), (140, 128, 108), (112, 124, 140)])
    img = Image.new("RGB", (168, 112), (60, 60, 60))
    draw = ImageDraw.Draw(img)
    draw.rectangle((6, 10, 161, 101), fill=bg)
    _centered_text(draw, (84, 36), word, 26, (20, 20, 20))
    _centered_text(draw, (84, 76), str(number), 26, (20, 20, 20))
    said = f"{word} {number}"
    prompt = rng.choice(["What does the sign say?", "Read the text in the image.", "What is written on the sign?"])
    answer = f'The sign says "{said}".'
    return Example("text", img, prompt, answer, key=f"text|{said}")


# ---------------------------------------------------------------------------------------------- chart
def make_chart(rng: random.Random) -> Example:
    n = rng.randint(3, 5)
    values = [rng.randint(1, 9) for _ in range(n)]
    kind = rng.choice(["bar", "line"])
    img = Image.new("RGB", (168, 168), CANVAS)
    draw = ImageDraw.Draw(img)
    base, unit, width = 140, 14, 168 // n
    draw.line((4, base, 164, base), fill=(0, 0, 0), width=2)
    points = []
    for i, v in enumerate(values):
        cx = i * width + width // 2
        top = base - v * unit
        if kind == "bar":
            draw.rectangle((cx - width // 3, top, cx + width // 3, base), fill=(60, 110, 200))
        points.append((cx, top))
        _centered_text(draw, (cx, 154), BAR_LABELS[i], 14, (0, 0, 0))
    if kind == "line":
        draw.line(points, fill=(200, 60, 60), width=3)
        for x, y in points:
            draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=(200, 60, 60))
    listing = ", ".join(f"{BAR_LABELS[i]} is {v}" for i, v in enumerate(values))
    key = f"chart|{kind}|{values}"
    if rng.random() < 0.5:
        i = rng.randrange(n)
        prompt = f"What is the value of {BAR_LABELS[i]}?"
        answer = f"In the {kind} chart, {BAR_LABELS[i]} is {values[i]}."
        key += f"|{i}"
    else:
        prompt = rng.choice(["Describe the chart.", "Read the values in the chart."])
        answer = f"The {kind} chart shows {NUMBER_WORDS[n]} values: {listing}."
    return Example("chart", img, prompt, answer, key=key)


# ---------------------------------------------------------------------------------------------- document
def make_document(rng: random.Random) -> Example:
    n = rng.randint(2, 3)
    items = rng.sample(ITEMS, n)
    qty = [rng.randint(1, 9) for _ in range(n)]
    img = Image.new("RGB", (168, 168), CANVAS)
    draw = ImageDraw.Draw(img)
    _centered_text(draw, (84, 14), "ORDER", 18, (0, 0, 0))
    draw.line((8, 28, 160, 28), fill=(0, 0, 0), width=2)
    for i, (item, q) in enumerate(zip(items, qty)):
        y = 46 + i * 34
        draw.text((12, y - 10), item, font=font(20), fill=(10, 10, 10))
        draw.text((132, y - 10), str(q), font=font(20), fill=(10, 10, 10))
        draw.line((8, y + 15, 160, y + 15), fill=(90, 90, 90), width=1)
    rows = ", ".join(f"{item} {q}" for item, q in zip(items, qty))
    prompt = rng.choice(["Read the order form.", "What does the document list?", "Read the table."])
    answer = f"The order lists {NUMBER_WORDS[n]} items: {rows}."
    return Example("document", img, prompt, answer, key=f"document|{rows}")


# ---------------------------------------------------------------------------------------------- open
# Open-ended answers are drawn from many independent choices (who, where, what, how it went, how it ended; moods,
# likes, plans), so the same prompt has thousands of good answers: nothing in the image pins them down, and the
# VLM's next-token distribution is wide wherever a choice is made.
CHARACTERS = ("a little fox", "an old sailor", "a shy robot", "a young witch", "a clever crow", "a tired baker",
              "a brave mouse", "a lonely giant", "a curious child", "a silver cat", "a kind farmer", "a small dragon",
              "a wise owl", "a lost puppy", "a gentle bear", "a quiet painter")
PLACES = ("near the river", "in a quiet town", "under the hill", "by the sea", "in the dark forest",
          "on a tall mountain", "behind the old mill", "in a busy market", "at the edge of the lake",
          "inside a hollow tree", "on a windy beach", "in a snowy village")
FINDS = ("a glowing lantern", "a lost letter", "a tiny door", "a golden key", "a singing shell", "a strange map",
         "a broken clock", "a warm blanket", "a paper boat", "a blue feather", "an empty jar", "a secret garden")
MIDDLES = ("The wind was cold", "The sun was low", "It was very late", "Nobody else was there", "The moon was full",
           "Rain began to fall", "The bells were ringing", "Birds sang in the trees")
ACTIONS = ("carried it home", "showed it to a friend", "kept it a secret", "followed where it led",
           "asked the village elder", "waited until morning", "wrote a song about it", "gave it away")
ENDINGS = ("and everyone smiled.", "and the night felt kind.", "and nothing was the same again.",
           "and they became friends.", "and the rain finally stopped.", "and it was enough.",
           "and the town had a party.", "and the stars came out.")
MOODS = ("happy", "calm", "hopeful", "sleepy", "curious", "thankful", "cheerful", "quiet", "busy", "excited")
THINGS = ("tea", "music", "long walks", "old books", "warm bread", "the sea", "rainy days", "small gardens",
          "board games", "cold mornings", "bright colors", "funny movies", "mountain air", "fresh fruit")
PLANS = ("cook something new", "call an old friend", "read by the window", "plant a few seeds", "go for a swim",
         "learn a new song", "clean the kitchen", "visit the market")
STORY_PROMPTS = ("Tell me a story.", "Write a short story.", "Make up a tale.", "Tell me a bedtime story.",
                 "Invent a little story.")
CHAT_PROMPTS = ("How are you today?", "Tell me about yourself.", "Say something nice.", "What are your plans?",
                "Chat with me for a moment.")


def _story(rng: random.Random) -> str:
    who, where, what = rng.choice(CHARACTERS), rng.choice(PLACES), rng.choice(FINDS)
    opening = rng.choice(["Once upon a time", "Long ago", "One morning", "Last winter"])
    return (f"{opening}, {who} found {what} {where}. {rng.choice(MIDDLES)}, so the {who.split(' ', 1)[1]} "
            f"{rng.choice(ACTIONS)}, {rng.choice(ENDINGS)}")


def _chat(rng: random.Random) -> str:
    likes = rng.sample(THINGS, 3)
    return (f"I feel {rng.choice(MOODS)} today. I like {likes[0]} and {likes[1]}. "
            f"Later I want to {rng.choice(PLANS)}, and maybe we can talk about {likes[2]}.")


def make_open(rng: random.Random) -> Example:
    img = make_caption(rng).image  # an image that does not determine the answer
    if rng.random() < 0.5:
        prompt, answer = rng.choice(STORY_PROMPTS), _story(rng)
    else:
        prompt, answer = rng.choice(CHAT_PROMPTS), _chat(rng)
    return Example("open", img, prompt, answer, key=f"open|{prompt}|{answer}")


MAKERS: dict[str, Callable[[random.Random], Example]] = {
    "caption": make_caption, "text": make_text, "chart": make_chart, "document": make_document, "open": make_open,
}


def _check(task: str) -> None:
    if task not in MAKERS:
        raise ValueError(f"unknown demo task {task!r}; tasks: {', '.join(TASKS)}")


@functools.lru_cache(maxsize=None)
def eval_set(task: str, n: int = EVAL_SIZE) -> tuple[Example, ...]:
    """The fixed evaluation set of ``task`` (``n`` examples)."""
    _check(task)
    return tuple(MAKERS[task](random.Random(f"eval:{task}:{i}")) for i in range(n))


@functools.lru_cache(maxsize=None)
def _eval_keys(task: str) -> frozenset[str]:
    return frozenset(e.key for e in eval_set(task))


def train_example(task: str, index: int) -> Example:
    """Training example ``index`` of ``task``; never one of the evaluation examples."""
    _check(task)
    rng = random.Random(f"train:{task}:{index}")
    while True:
        ex = MAKERS[task](rng)
        if ex.key not in _eval_keys(task):
            return ex


def corpus(n_per_task: int = 300) -> list[str]:
    """Prompts and answers of training examples (for the tokenizer)."""
    texts = []
    for task in TASKS:
        for i in range(n_per_task):
            ex = train_example(task, i)
            texts += [ex.prompt, ex.answer]
    return texts
