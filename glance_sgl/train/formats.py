"""Training request files in the formats VLM datasets ship in, with bad rows skipped (or refused) by name.

Accepted rows (a file is one row per line (JSONL), or one JSON document: a list of rows, or an object holding the
list under ``data`` / ``rows`` / ``examples``; image paths are relative to the file, or to ``image_root``):

- GLANCE JSONL: ``{"image": PATH or [PATHS], "prompt": TEXT, "task": NAME?}``;
- LLaVA / ShareGPT: ``{"image": PATH or [PATHS], "conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": "..."}, ...]}`` (``from``: human / user / gpt / assistant / system);
- messages: ``{"images": [PATHS]?, "messages": [{"role": "user", "content": "<image>..." or [parts]}, ...]}``
  with OpenAI-style parts ``{"type": "text", "text": ...}`` / ``{"type": "image", "image": PATH}``.

Images go where the text says ``<image>``; a row without any ``<image>`` mark gets its images at the start of its
first user turn. The target answers the **last** user turn: earlier turns (the dataset's own assistant answers
included) stay as the conversation, a trailing assistant turn is dropped (self-distillation replaces it).

A bad row (no / unreadable image, more or fewer ``<image>`` marks than images, an unknown role, no user turn,
not JSON) is skipped with a message naming the file, the row and the field; :class:`SkipLog` keeps the list and
prints a summary at the end. ``strict=True`` raises :class:`DataError` at the first bad row instead. Rows too long
for the target's context are skipped where the prompt is tokenized (:mod:`glance_sgl.train.data`).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

IMAGE_MARK = "<image>"
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                "model": "assistant", "system": "system"}


class DataError(ValueError):
    """A bad row under ``--strict`` (the message names the file, the row and the field)."""


@dataclass
class Skip:
    """One skipped row: ``row`` is 1-based (the line of a JSONL file, the index + 1 in a JSON list)."""

    file: str
    row: int
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.row}: field {self.field!r}: {self.reason}"


@dataclass
class SkipLog:
    """Skipped rows of a run; ``strict`` turns the first skip into a :class:`DataError`."""

    strict: bool = False
    quiet: bool = False
    skips: list[Skip] = field(default_factory=list)

    def skip(self, file: str, row: int, fld: str, reason: str) -> None:
        s = Skip(str(file), int(row), fld, reason)
        if self.strict:
            raise DataError(f"{s} (--strict)")
        self.skips.append(s)
        if not self.quiet:
            print(f"skipping {s}", file=sys.stderr, flush=True)

    def summary(self) -> str:
        """``"skipped N rows (field: count, ...)"`` or ``"skipped 0 rows"``."""
        if not self.skips:
            return "skipped 0 rows"
        by = Counter(s.field for s in self.skips)
        return f"skipped {len(self.skips)} rows (" + ", ".join(f"{k}: {v}" for k, v in sorted(by.items())) + ")"

    def to_dict(self) -> dict[str, Any]:
        return {"skipped": len(self.skips), "rows": [str(s) for s in self.skips]}


@dataclass
class RequestSpec:
    """One training request, JSON-serialisable: images are absolute paths, opened by :meth:`messages`.

    ``turns``: ``[{"role": ..., "content": [{"type": "text", "text": ...} | {"type": "image", "path": ...}]}]``,
    ending with a user turn (the one the target answers).
    """

    source: str
    row: int
    task: str
    turns: list[dict[str, Any]]
    text_field: str = "conversations"  # the row's field holding the turns (named by skip messages)

    @property
    def image_paths(self) -> list[str]:
        return [p["path"] for t in self.turns for p in t["content"] if p["type"] == "image"]

    def messages(self) -> list[dict[str, Any]]:
        """Chat messages for :meth:`TargetAdapter.prepare` (images opened as RGB PIL images)."""
        from PIL import Image

        out = []
        for t in self.turns:
            parts = []
            for p in t["content"]:
                if p["type"] == "image":
                    with Image.open(p["path"]) as img:
                        parts.append({"type": "image", "image": img.convert("RGB")})
                else:
                    parts.append({"type": "text", "text": p["text"]})
            out.append({"role": t["role"], "content": parts})
        return out

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "row": self.row, "task": self.task, "turns": self.turns,
                "text_field": self.text_field}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RequestSpec":
        return cls(source=d["source"], row=int(d["row"]), task=d.get("task", "default"), turns=d["turns"],
                   text_field=d.get("text_field", "conversations"))


class _BadRow(Exception):
    def __init__(self, fld: str, reason: str) -> None:
        super().__init__(reason)
        self.field, self.reason = fld, reason


def _image_list(value: Any, fld: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise _BadRow(fld, f"expected a path or a list of paths, got {type(value).__name__}")


def _check_image(path: Path, fld: str) -> str:
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise _BadRow(fld, f"image not found: {path}")
    try:
        with Image.open(path) as img:
            img.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise _BadRow(fld, f"not a readable image: {path} ({exc})") from exc
    return str(path.resolve())


def _split_marks(text: str) -> list[dict[str, Any]]:
    """Text with ``<image>`` marks -> parts (``{"type": "mark"}`` where an image goes)."""
    parts: list[dict[str, Any]] = []
    for i, chunk in enumerate(text.split(IMAGE_MARK)):
        if i:
            parts.append({"type": "mark"})
        chunk = chunk.strip("\n") if i or chunk.strip() == "" else chunk
        if chunk:
            parts.append({"type": "text", "text": chunk})
    return parts


def _turns_from_conversation(conv: Any, key: str, role_key: str, text_key: str, paths: list[str],
                             img_key: str) -> list[dict[str, Any]]:
    if not isinstance(conv, list) or not conv:
        raise _BadRow(key, "expected a non-empty list of turns")
    turns = []
    for j, turn in enumerate(conv):
        if not isinstance(turn, dict):
            raise _BadRow(f"{key}[{j}]", "expected an object")
        raw_role = turn.get(role_key)
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise _BadRow(f"{key}[{j}].{role_key}", f"unknown role {raw_role!r} (expected one of "
                          f"{sorted(ROLE_ALIASES)})")
        content = turn.get(text_key)
        if isinstance(content, str):
            parts = _split_marks(content)
        elif isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts += _split_marks(str(part.get("text", "")))
                elif kind in ("image", "image_url"):
                    src = part.get("image") or part.get("path")
                    url = part.get("image_url")
                    if src is None and url is not None:
                        src = url.get("url") if isinstance(url, dict) else url
                    if src is None:
                        parts.append({"type": "mark"})
                    else:
                        parts.append({"type": "image", "path": str(src), "fld": f"{key}[{j}].{text_key}[{k}]"})
                else:
                    raise _BadRow(f"{key}[{j}].{text_key}[{k}].type", f"unsupported part type {kind!r}")
        else:
            raise _BadRow(f"{key}[{j}].{text_key}", "expected a string or a list of parts")
        turns.append({"role": role, "content": parts})
    marks = sum(1 for t in turns for p in t["content"] if p["type"] == "mark")
    if marks and marks != len(paths):
        raise _BadRow(key, f"{marks} {IMAGE_MARK} marks but {len(paths)} images")
    if paths and not marks:
        first_user = next((t for t in turns if t["role"] == "user"), None)
        if first_user is None:
            raise _BadRow(key, "no user turn")
        first_user["content"] = [{"type": "mark"} for _ in paths] + first_user["content"]
    it = iter(paths)
    for t in turns:
        t["content"] = [{"type": "image", "path": next(it), "fld": img_key} if p["type"] == "mark" else p
                        for p in t["content"]]
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    if not turns or turns[-1]["role"] != "user":
        raise _BadRow(key, "no user turn to answer")
    return turns


def parse_row(row: Any, base: Path, image_root: Path | None = None) -> tuple[str, list[dict[str, Any]], str]:
    """One dataset row -> (task, turns with image paths resolved and checked, the turns' field). Raises
    ``_BadRow``."""
    if not isinstance(row, dict):
        raise _BadRow("row", f"expected a JSON object, got {type(row).__name__}")
    root = image_root or base
    task = str(row.get("task", row.get("source", "default")))
    key = next((k for k in ("prompt", "conversations", "messages") if k in row), "row")
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise _BadRow("prompt", "expected a string")
        img_key = "image" if "image" in row else "images"
        paths = _image_list(row.get(img_key), img_key)
        conv = [{"from": "human", "value": row["prompt"]}]
        turns = _turns_from_conversation(conv, "prompt", "from", "value", paths, img_key)
    elif "conversations" in row:
        img_key = "image" if "image" in row else "images"
        paths = _image_list(row.get(img_key), img_key)
        turns = _turns_from_conversation(row["conversations"], "conversations", "from", "value", paths, img_key)
    elif "messages" in row:
        img_key = "images" if "images" in row else "image"
        paths = _image_list(row.get(img_key), img_key)
        turns = _turns_from_conversation(row["messages"], "messages", "role", "content", paths, img_key)
    else:
        raise _BadRow("row", "expected 'prompt', 'conversations' or 'messages'")
    for j, t in enumerate(turns):
        for p in t["content"]:
            if p["type"] == "image":
                p["path"] = _check_image(root / p["path"], p.pop("fld"))
    return task, turns, key


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based row number, parsed row or a _BadRow for an unparseable line)."""
    text = path.read_text()
    data: Any = None
    if path.suffix != ".jsonl" and text.lstrip()[:1] in ("[", "{"):
        try:
            data = json.loads(text)  # a JSON document (a JSONL file of one row parses too: one row)
        except json.JSONDecodeError:
            data = None  # one row per line after all (a .json file holding JSONL)
    if data is None or (isinstance(data, dict) and not any(isinstance(data.get(k), list)
                                                            for k in ("data", "rows", "examples"))):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as exc:
                yield n, _BadRow("row", f"not JSON: {exc}")
        return
    if isinstance(data, dict):
        data = next(data[k] for k in ("data", "rows", "examples") if isinstance(data.get(k), list))
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of rows")
    yield from enumerate(data, 1)


def read_dataset(path: str | Path, skips: SkipLog | None = None, image_root: str | Path | None = None,
                 limit: int | None = None) -> Iterator[RequestSpec]:
    """The good rows of ``path`` as :class:`RequestSpec` (bad ones go to ``skips``; see the module doc)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such file")
    skips = skips if skips is not None else SkipLog()
    root = Path(image_root) if image_root is not None else None
    count = 0
    for n, row in _rows(p):
        if limit is not None and count >= limit:
            return
        try:
            if isinstance(row, _BadRow):
                raise row
            task, turns, key = parse_row(row, p.parent, root)
        except _BadRow as bad:
            skips.skip(str(p), n, bad.field, bad.reason)
            continue
        count += 1
        yield RequestSpec(source=str(p), row=n, task=task, turns=turns, text_field=key)


def count_rows(path: str | Path) -> int:
    """Rows in ``path`` (for progress bars), bad ones included."""
    return sum(1 for _ in _rows(Path(path)))


__all__ = ["DataError", "RequestSpec", "Skip", "SkipLog", "count_rows", "parse_row", "read_dataset"]
