"""Token log-probabilities in OpenAI's two formats, from :class:`glance_sgl.engine.TokenLogprob` lists.

Chat: ``choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}``. Legacy completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}] | None,
"text_offset"}``. Token strings come from a table built once from the tokenizer (byte-level BPE pieces mapped
back to their bytes), so formatting never calls the tokenizer from another thread than the one that built it.
"""

from __future__ import annotations

from typing import Any

from glance_sgl.engine import TokenLogprob


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTES = _byte_decoder()


class TokenTable:
    """id -> (text, UTF-8 bytes) for every token of a tokenizer (built once, read from any thread)."""

    def __init__(self, tokenizer: Any) -> None:
        self.pieces: list[str | None] = list(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token; text decodes a partial UTF-8 character as U+FFFD."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.pieces[token_id] if 0 <= token_id < len(self.pieces) else None
        if piece is None:
            raw = b""
        elif all(c in _BYTES for c in piece):
            raw = bytes(_BYTES[c] for c in piece)
        else:  # an added token: its text as is
            raw = piece.encode("utf-8")
        hit = (raw.decode("utf-8", errors="replace"), list(raw))
        self._cache[token_id] = hit
        return hit

    def chat_entries(self, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
        """The chat format's ``logprobs.content`` list."""
        out = []
        for lp in logprobs:
            text, raw = self.token(lp.token_id)
            top = []
            for tid, value in lp.top:
                t, b = self.token(tid)
                top.append({"token": t, "logprob": value, "bytes": b})
            out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return out

    def legacy(self, logprobs: list[TokenLogprob], offset: int, with_top: bool) -> dict[str, Any]:
        """The completions format, ``text_offset`` counted in characters from ``offset``."""
        tokens, offsets = [], []
        for lp in logprobs:
            text = self.token(lp.token_id)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        top = [{self.token(tid)[0]: value for tid, value in lp.top} for lp in logprobs] if with_top else None
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": top,
                "text_offset": offsets}


def from_sglang(token_logprobs: list[Any], top_logprobs: list[Any] | None) -> list[TokenLogprob]:
    """SGLang ``meta_info`` ``output_token_logprobs`` ([logprob, id, text?] per token) and
    ``output_top_logprobs`` (a list of such triples per token, or None) -> TokenLogprob list."""
    out = []
    for k, item in enumerate(token_logprobs):
        tops = top_logprobs[k] if top_logprobs is not None and k < len(top_logprobs) else None
        top = [(int(t[1]), float(t[0])) for t in (tops or [])]
        out.append(TokenLogprob(int(item[1]), float(item[0]), top))
    return out


def to_sglang(logprobs: list[TokenLogprob], top_n: int) -> dict[str, Any]:
    """The inverse of :func:`from_sglang` (the gateway's own ``/generate`` answers in SGLang's format)."""
    out: dict[str, Any] = {"output_token_logprobs": [[lp.logprob, lp.token_id, None] for lp in logprobs]}
    if top_n > 0:
        out["output_top_logprobs"] = [[[v, t, None] for t, v in lp.top] for lp in logprobs]
    return out
