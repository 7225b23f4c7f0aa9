"""User text is text: the tokenizer's added-token strings (``<|im_start|>``, ``<|image_pad|>``, ...) are refused.

A Qwen-VL processor turns every ``<|image_pad|>`` string in the prompt into an image slot and the tokenizer turns
``<|im_start|>`` / ``<|im_end|>`` into control tokens, whether they came from the chat template or from a user.
Text cannot be tokenised as plain text through the processor (it expands placeholders in the rendered prompt as a
whole), so the engine, the gateway (both backends) and the training data path refuse such text up front, naming
the token and where it was found.
"""

from __future__ import annotations

import re
from typing import Any, Iterator


class SpecialTokenGuard:
    """Finds the tokenizer's added-token strings (special or not: each becomes one control id) in text."""

    def __init__(self, tokenizer: Any) -> None:
        tokens = {tok.content for tok in getattr(tokenizer, "added_tokens_decoder", {}).values()}
        tokens |= set(getattr(tokenizer, "all_special_tokens", []) or [])
        tokens = sorted((t for t in tokens if isinstance(t, str) and len(t) > 1), key=len, reverse=True)
        self.tokens: list[str] = tokens
        self._pattern = re.compile("|".join(map(re.escape, tokens))) if tokens else None

    def find(self, text: str) -> str | None:
        """The first added-token string in ``text``, or None."""
        if self._pattern is None:
            return None
        match = self._pattern.search(text)
        return match.group(0) if match else None

    def check_messages(self, messages: list[dict[str, Any]] | str) -> tuple[str, str] | None:
        """(where, token) of the first added-token string in engine-format messages (or a raw prompt string),
        ``where`` like ``messages[0].content[1].text``; None when the text is clean."""
        for where, text in iter_texts(messages):
            if (token := self.find(text)) is not None:
                return where, token
        return None


def iter_texts(messages: list[dict[str, Any]] | str) -> Iterator[tuple[str, str]]:
    """(where, text) of every text in engine-format messages, or ``("prompt", text)`` for a raw prompt."""
    if isinstance(messages, str):
        yield "prompt", messages
        return
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            yield f"messages[{i}].content", content
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    yield f"messages[{i}].content[{j}].text", part["text"]


def special_token_message(where: str, token: str) -> str:
    return (f"{where} contains the special token {token!r}; special-token strings are not allowed in message "
            "text (images go in image parts, the chat format is the server's)")
