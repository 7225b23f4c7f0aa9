"""Per-request speculative-decoding metrics (design §1, "Metrics").

Conventions: ``tau`` = tokens committed per verification round INCLUDING the bonus token, pooled over rounds
(AR = 1); ``tau - 1`` excludes the bonus. The first token comes from the prefill pass and belongs to no round,
so ``completion_tokens == 1 + sum(committed_per_round)``. Times are milliseconds; decode time starts after
the first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


def entropy_nats(logits: torch.Tensor) -> float:
    """Entropy (nats, fp32) of softmax(``logits``) for a single distribution [V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-(logp.exp() * logp).sum())


@dataclass
class RequestMetrics:
    """What one request's decoding did. ``mode`` is "glance", "chain" or "ar"."""

    mode: str
    block_size: int = 1
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_per_round: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    root_entropies: list[float] = field(default_factory=list)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0

    def record_round(self, drafted: int, accepted: int, committed: int, root_entropy: float | None) -> None:
        """One verification round: ``drafted`` tree nodes, ``accepted`` of them, ``committed`` tokens kept
        (accepted + bonus, less any truncation at a stop condition)."""
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.accept_lengths.append(accepted)
        self.committed_per_round.append(committed)
        if root_entropy is not None:
            self.root_entropies.append(root_entropy)

    @property
    def tau(self) -> float:
        return sum(self.committed_per_round) / self.rounds if self.rounds else 1.0

    @property
    def tau_minus_1(self) -> float:
        return self.tau - 1.0

    @property
    def acceptance_histogram(self) -> list[int]:
        """``hist[a]``: rounds that accepted exactly ``a`` drafted tokens, a = 0 .. block_size - 1."""
        hist = [0] * max(self.block_size, 1)
        for a in self.accept_lengths:
            hist[min(a, len(hist) - 1)] += 1
        return hist

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after the first one (the tokens the decode time paid for)."""
        return max(self.completion_tokens - 1, 0)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / (self.decode_ms / 1000.0) if self.decode_ms > 0 else 0.0

    @property
    def decode_ms_per_token(self) -> float:
        return self.decode_ms / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def mean_root_entropy(self) -> float:
        return sum(self.root_entropies) / len(self.root_entropies) if self.root_entropies else math.nan

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def to_dict(self, per_round: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "tau": self.tau,
            "tau_minus_1": self.tau_minus_1,
            "rounds": self.rounds,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_histogram": self.acceptance_histogram,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "prefill_ms": self.prefill_ms,
            "decode_ms": self.decode_ms,
            "decode_ms_per_token": self.decode_ms_per_token,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "mean_root_entropy": None if math.isnan(self.mean_root_entropy) else self.mean_root_entropy,
        }
        if per_round:
            out["committed_per_round"] = list(self.committed_per_round)
            out["accept_lengths"] = list(self.accept_lengths)
            out["root_entropies"] = list(self.root_entropies)
        return out
