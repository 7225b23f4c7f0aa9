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
import math
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
# Sign colours keep the letters' contrast (luminance near the canvas) while differing in hue.
SIGN_COLOURS = {"red": (176, 96, 88), "green": (96, 150, 100), "blue": (96, 124, 176), "yellow": (184, 164, 80)}
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
@dataclass(frozen=True)
class Shape:
    colour: str
    shape: str
    cell: int  # 0..8, row-major on a 3 x 3 grid

    @property
    def where(self) -> str:
        r, c = divmod(self.cell, 3)
        return "in the center" if self.cell == 4 else f"at the {ROWS[r]} {COLS[c]}"


def draw_scene(rng: random.Random) -> tuple[Image.Image, list[Shape]]:
    """One to three coloured shapes on distinct cells of a 3 x 3 grid (168 x 168 pixels)."""
    size, cell = 168, 56
    cells = sorted(rng.sample(range(9), rng.randint(1, 3)))
    img = Image.new("RGB", (size, size), CANVAS)
    draw = ImageDraw.Draw(img)
    shapes = []
    for c in cells:
        s = Shape(rng.choice(list(COLOURS)), rng.choice(SHAPES), c)
        r, col = divmod(c, 3)
        cx, cy, h = col * cell + cell // 2, r * cell + cell // 2, 18
        fill = COLOURS[s.colour]
        if s.shape == "circle":
            draw.ellipse((cx - h, cy - h, cx + h, cy + h), fill=fill)
        elif s.shape == "square":
            draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
        else:
            draw.polygon([(cx, cy - h), (cx - h, cy + h), (cx + h, cy + h)], fill=fill)
        shapes.append(s)
    return img, shapes


def make_caption(rng: random.Random) -> Example:
    img, shapes = draw_scene(rng)
    n = len(shapes)
    parts = [f"a {s.colour} {s.shape} {s.where}" for s in shapes]
    noun = "shape" if n == 1 else "shapes"
    verb = "is" if n == 1 else "are"
    body = ", ".join(parts[:-1]) + (" and " if n > 1 else "") + parts[-1]
    answer = f"There {verb} {NUMBER_WORDS[n]} {noun}: {body}."
    prompt = rng.choice(["Describe the image.", "What do you see in the picture?", "Describe the shapes."])
    return Example("caption", img, prompt, answer, key=f"caption|{answer}")


# ---------------------------------------------------------------------------------------------- text
def make_text(rng: random.Random) -> Example:
    """A coloured sign with a word and a number (gate, platform, room...): 36 x 98 contents, so the evaluation
    signs leave plenty of training signs (single words alone would be used up by the evaluation set)."""
    word, number = rng.choice(SIGN_WORDS), rng.randint(2, 99)
    colour = rng.choice(list(SIGN_COLOURS))
    img = Image.new("RGB", (168, 112), (60, 60, 60))
    draw = ImageDraw.Draw(img)
    draw.rectangle((6, 10, 161, 101), fill=SIGN_COLOURS[colour])
    _centered_text(draw, (84, 36), word, 26, (20, 20, 20))
    _centered_text(draw, (84, 76), str(number), 26, (20, 20, 20))
    said = f"{word} {number}"
    prompt = rng.choice(["What does the sign say?", "Read the text in the image.", "What is written on the sign?"])
    answer = f'The sign says "{said}". It is a {colour} sign with black letters.'
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
# Open-ended answers are dense with free choices, most of them in runs of three back to back ("the tiny shy fox"),
# like the wide next-token distributions of real open-ended text. Nothing pins a choice down: each is sampled from
# a wide distribution (top option ~0.3) whose logits add a random preference for the prompt and, for every cue
# of the picture (a shape's colour, kind or cell), a random preference that depends on the previous choice. So
# the sampled answers follow wide, input-dependent distributions whose favourite changes with the picture AND with
# what was chosen before (an interaction meant to be learnable from thousands of samples but not from the few
# hundred answers a draft head is distilled on). The bundled VLM learns the prompt's pull better than the
# picture's, so its greedy stories are more alike than the sampled ones; the drafter is distilled on its sampled
# answers so that it learns its distribution, not its greedy picks (README).
SIZES = ("little", "tiny", "old", "young", "big", "small", "tall", "wise")
CREATURE_ADJS = ("shy", "brave", "clever", "tired", "gentle", "lonely", "curious", "silver", "grey", "proud")
CREATURES = ("fox", "crow", "bear", "mouse", "owl", "cat", "dragon", "robot", "sailor", "witch", "baker", "giant")
THING_ADJS = ("glowing", "golden", "broken", "strange", "blue", "paper", "secret", "singing", "heavy", "wooden")
THINGS = ("lantern", "key", "map", "door", "shell", "clock", "boat", "feather", "jar", "letter", "bell", "ring")
PLACES = ("near the river", "under the hill", "by the sea", "in the forest", "on the mountain", "behind the mill",
          "in the market", "by the lake", "in the snow", "on the beach")
MOODS = ("happy", "calm", "hopeful", "sleepy", "curious", "thankful", "cheerful", "quiet", "busy", "excited")
ACTIONS = ("carried it home", "showed it to a friend", "kept it a secret", "followed where it led",
           "asked the old king", "waited until morning", "wrote a song about it", "gave it away")
ENDINGS = ("and everyone smiled.", "and the night felt kind.", "and nothing was the same again.",
           "and they became friends.", "and the rain stopped.", "and it was enough.", "and the town had a party.",
           "and the stars came out.")
LIKE_ADJS = ("warm", "old", "quiet", "long", "sweet", "fresh", "loud", "small", "cold", "bright")
LIKES = ("bread", "books", "music", "walks", "tea", "songs", "gardens", "games", "movies", "fruit", "mornings",
         "rain")
PLANS = ("cook", "read", "swim", "paint", "sing", "dance", "rest", "write", "walk", "garden")
OPENINGS = ("Once upon a time", "Long ago", "One morning", "Last winter")
STORY_PROMPTS = ("Tell me a story.", "Write a short story.", "Make up a tale.", "Tell me a bedtime story.",
                 "Invent a little story.")
CHAT_PROMPTS = ("How are you today?", "Tell me about yourself.", "Say something nice.", "What are your plans?",
                "Chat with me for a moment.")
# Logit scales: a scene has 1-3 shapes with 3 cues each; the total logit spread (~1.1) leaves every slot's
# distribution wide (entropy ~1.5-2 nats).
_CUE_SCALE, _PROMPT_SCALE = 0.42, 0.4


@functools.lru_cache(maxsize=None)
def _preference(slot: str, cue: str, n: int) -> tuple[float, ...]:
    """A fixed random preference vector (one value per option) of ``slot`` for ``cue``."""
    rng = random.Random(f"open-preference:{slot}:{cue}")
    return tuple(rng.gauss(0.0, 1.0) for _ in range(n))


class _Chooser:
    """Samples one open-ended choice after another; each leans on the prompt and on the scene's cues, in a way
    that depends on the previous choice."""

    def __init__(self, rng: random.Random, shapes: list[Shape], prompt: str) -> None:
        self.rng, self.prompt, self.prev = rng, prompt, "start"
        self.scene_cues = [c for s in shapes for c in (f"colour={s.colour}", f"shape={s.shape}", f"cell={s.cell}")]

    def weights(self, slot: str, options: tuple[str, ...], exclude: tuple[str, ...] = ()) -> list[float]:
        """Unnormalised weights ``slot`` is sampled with, given the prompt, the scene and the previous choice."""
        n = len(options)
        logits = [_PROMPT_SCALE * x for x in _preference(slot, f"prompt={self.prompt}", n)]
        for cue in self.scene_cues:
            pref = _preference(slot, f"{cue}|prev={self.prev}", n)
            logits = [l + _CUE_SCALE * x for l, x in zip(logits, pref)]
        return [0.0 if o in exclude else math.exp(l) for o, l in zip(options, logits)]

    def probabilities(self, slot: str, options: tuple[str, ...], exclude: tuple[str, ...] = ()) -> list[float]:
        w = self.weights(slot, options, exclude)
        total = sum(w)
        return [x / total for x in w]

    def __call__(self, slot: str, options: tuple[str, ...], exclude: tuple[str, ...] = ()) -> str:
        self.prev = self.rng.choices(options, weights=self.weights(slot, options, exclude))[0]
        return self.prev


def _story(choose: _Chooser) -> str:
    opening = choose("opening", OPENINGS)
    s1, a1, c1 = choose("size1", SIZES), choose("adj1", CREATURE_ADJS), choose("who1", CREATURES)
    s2, a2 = choose("size2", SIZES), choose("adj2", CREATURE_ADJS)
    c2 = choose("who2", CREATURES, exclude=(c1,))
    ta, t, where = choose("thing_adj", THING_ADJS), choose("thing", THINGS), choose("place", PLACES)
    m1 = choose("mood1", MOODS)
    m2 = choose("mood2", MOODS, exclude=(m1,))
    action, ending = choose("action", ACTIONS), choose("ending", ENDINGS)
    return (f"{opening}, the {s1} {a1} {c1} and the {s2} {a2} {c2} found the {ta} {t} {where}. The {c1} felt {m1} "
            f"and the {c2} felt {m2}, so they {action} {ending}")


def _chat(choose: _Chooser) -> str:
    m1 = choose("mood1", MOODS)
    m2 = choose("mood2", MOODS, exclude=(m1,))
    la1 = choose("like_adj1", LIKE_ADJS)
    lb1, l1 = choose("like_adj2", LIKE_ADJS, exclude=(la1,)), choose("like1", LIKES)
    la2 = choose("like_adj3", LIKE_ADJS)
    lb2 = choose("like_adj4", LIKE_ADJS, exclude=(la2,))
    l2 = choose("like2", LIKES, exclude=(l1,))
    p1 = choose("plan1", PLANS)
    p2 = choose("plan2", PLANS, exclude=(p1,))
    return (f"Today I feel {m1} and a little {m2}. I like {la1} {lb1} {l1} and {la2} {lb2} {l2}, and later I will "
            f"{p1} and {p2}.")


def make_open(rng: random.Random) -> Example:
    img, shapes = draw_scene(rng)  # a picture that leans on the answer but does not determine it
    if rng.random() < 0.5:
        prompt = rng.choice(STORY_PROMPTS)
        answer = _story(_Chooser(rng, shapes, prompt))
    else:
        prompt = rng.choice(CHAT_PROMPTS)
        answer = _chat(_Chooser(rng, shapes, prompt))
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
    """Prompts and answers of training examples, plus every word a task can choose (for the tokenizer: a sign
    or item word that BPE splits into pieces is several hard tokens to draft instead of one)."""
    texts = []
    for task in TASKS:
        for i in range(n_per_task):
            ex = train_example(task, i)
            texts += [ex.prompt, ex.answer]
    lexicon = [f'"{w}' for w in SIGN_WORDS] + [f" {w}" for w in ITEMS + tuple(SIGN_COLOURS)]
    open_words = (SIZES, CREATURE_ADJS, CREATURES, THING_ADJS, THINGS, MOODS, LIKE_ADJS, LIKES, PLANS)
    lexicon += [f" {w}" for words in open_words for w in words]
    return texts + lexicon * 40
