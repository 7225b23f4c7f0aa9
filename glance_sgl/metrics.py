"""Per-request speculative-decoding metrics (design §1, "Metrics").

Conventions: ``tau`` = tokens committed per verification round INCLUDING the bonus token, pooled over rounds
(AR = 1); ``tau - 1`` excludes the bonus. The first token comes from the prefill pass and belongs to no round,
so ``completion_tokens == 1 + sum(committed_per_round)``. Times are milliseconds; decode time starts after
the first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .tree import SOURCE_BOTH, SOURCE_DRAFTER, SOURCE_NGRAM

if TYPE_CHECKING:
    from .tree import DraftTree
    from .verify import WalkResult

# The per-source metrics' keys: a verified node's source tag (``DraftTree.sources``), exactly. "both" is a node
# that the drafter and the n-gram source both proposed (``SOURCE_BOTH``); "drafter" / "ngram" a node of that
# source alone. The accepted tokens of the three add up to the round's accepted drafts.
SOURCE_KEYS = {"drafter": SOURCE_DRAFTER, "ngram": SOURCE_NGRAM, "both": SOURCE_BOTH}


def source_counts(tree: "DraftTree", walk: "WalkResult") -> list[dict[str, tuple[bool, int]]]:
    """Per request of a verified round: ``{source: (verified, accepted)}`` for each key of :data:`SOURCE_KEYS`.

    ``verified``: the verified tree held at least one node with exactly that tag; ``accepted``: the walk's
    accepted rows (``walk.accepted_rows`` [bs, W] tree rows, -1 padding, column 0 the root, which no source
    proposed) with that tag. An untagged tree (``sources`` None: the drafter alone) is all drafter nodes; a
    root-only tree (an AR step) verified nothing of any source. The one place these counts are made."""
    if tree.num_rows == 1:  # an AR step: nothing to count (most rounds where drafting does not pay)
        return [dict.fromkeys(SOURCE_KEYS, (False, 0)) for _ in range(tree.batch_size)]
    # on host lists: a round's tree is a few dozen tags (one read each; tensor ops per key cost more, every round)
    tags = tree.source_tags().tolist()
    walk = walk if walk.host is None else walk.host
    out: list[dict[str, tuple[bool, int]]] = []
    for row_tags, rows in zip(tags, walk.accepted_rows.tolist()):
        present = set(row_tags[1:])
        taken = [row_tags[r] for r in rows if r > 0]
        out.append({key: (tag in present, taken.count(tag)) for key, tag in SOURCE_KEYS.items()})
    return out


def add_ms(total: dict[str, float], parts: Mapping[str, float]) -> None:
    """Add ``parts`` (name -> ms, or a count) into ``total``, in place: the sums behind every report of where a
    round's time goes (``RoundResult.phases`` per request, per bench method, per SGLang step kind)."""
    for name, ms in parts.items():
        total[name] = total.get(name, 0.0) + ms


def ms_per_step(sums: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per step kind of ``sums`` (kind -> ``{"steps": n, part: ms summed}``): its steps and the mean ms per step of
    each part it had (rounded to us, in the order of ``sums``, parts that never took time left out)."""
    return {kind: {"steps": int(acc["steps"]), **{k: round(v / acc["steps"], 3) for k, v in acc.items()
                                                 if k != "steps" and v > 0}}
            for kind, acc in sorted(sums.items())}


def entropy_tensor(logits: torch.Tensor) -> torch.Tensor:
    """[N] fp32 on ``logits``' device: the entropy (nats) of softmax of each row of ``logits`` [N, V]; a masked
    token (-inf: a grammar, a stop token before the minimum length) adds nothing (``xlogy(0, 0) = 0``, where
    ``p * log p`` would be NaN)."""
    p = torch.softmax(logits.float(), dim=-1)
    return -torch.xlogy(p, p).sum(-1)


def entropies_nats(logits: torch.Tensor) -> list[float]:
    """Entropy (nats, fp32) of softmax of each row of ``logits`` [N, V]."""
    return entropy_tensor(logits).tolist()


def entropy_nats(logits: torch.Tensor) -> float:
    """Entropy (nats, fp32) of softmax(``logits``) for a single distribution [V]."""
    return entropies_nats(logits[None])[0]


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
    rows_per_round: list[int] = field(default_factory=list)
    predicted_per_round: list[float] = field(default_factory=list)
    drafter_passes: int = 0
    planner: str | None = None
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    draft_sources: tuple[str, ...] = ()  # the candidate sources the request drew on (empty: AR)
    source_rounds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCE_KEYS, 0))
    source_accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCE_KEYS, 0))
    # wall ms summed over the speculative rounds of each part of the round (``glance_sgl.round.RoundResult.phases``:
    # lookup, plan, gate, draft, tree, pass, walk, keep, feed, commit, report; a plain round's tree, pass, walk and
    # report); empty without them (AR)
    round_part_ms: dict[str, float] = field(default_factory=dict)

    def record_sources(self, counts: dict[str, tuple[bool, int]]) -> None:
        """One round's per-source counts (an entry of :func:`source_counts`)."""
        for key, (verified, accepted) in counts.items():
            self.source_rounds[key] += int(verified)
            self.source_accepted[key] += accepted

    @property
    def sources(self) -> dict[str, dict[str, int]]:
        """``{source: {"rounds", "accepted_tokens"}}`` for "drafter", "ngram" and "both" (see
        :data:`SOURCE_KEYS`): the rounds whose verified tree held nodes of that source, the drafts accepted
        from them."""
        return {k: {"rounds": self.source_rounds[k], "accepted_tokens": self.source_accepted[k]}
                for k in SOURCE_KEYS}

    def record_round(self, drafted: int, accepted: int, committed: int, root_entropy: float | None,
                     predicted: float | None = None, drafter_ran: bool | None = None,
                     parts: dict[str, float] | None = None) -> None:
        """One verification round: ``drafted`` tree nodes (the pass verified ``drafted + 1`` rows), ``accepted`` of
        them, ``committed`` tokens kept (accepted + bonus, less any truncation at a stop condition).
        ``predicted``: the tokens the planner expected the round to commit (None: no planner);
        ``drafter_ran``: whether a drafter pass preceded it (default: whether anything was drafted); ``parts``: the
        round's wall ms by part (``RoundResult.phases``), summed into ``round_part_ms``."""
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.accept_lengths.append(accepted)
        self.committed_per_round.append(committed)
        self.rows_per_round.append(drafted + 1)
        if predicted is not None:
            self.predicted_per_round.append(float(predicted))
        if drafter_ran if drafter_ran is not None else drafted > 0:
            self.drafter_passes += 1
        if root_entropy is not None:
            self.root_entropies.append(root_entropy)
        add_ms(self.round_part_ms, parts or {})

    @property
    def rounds_without_drafting(self) -> int:
        """Rounds that ran no drafter pass (plain AR steps chosen by the planner, or the AR mode)."""
        return self.rounds - self.drafter_passes

    @property
    def rows_histogram(self) -> dict[str, int]:
        """Rows verified per round (root included; 1 = an AR step) -> number of rounds."""
        hist: dict[int, int] = {}
        for r in self.rows_per_round:
            hist[r] = hist.get(r, 0) + 1
        return {str(k): hist[k] for k in sorted(hist)}

    @property
    def predicted_tokens_per_round(self) -> float | None:
        """Mean tokens per round the planner predicted (compare with ``tau``); None without a planner."""
        p = self.predicted_per_round
        return sum(p) / len(p) if p else None

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
            "planner": self.planner,
            "rows_histogram": self.rows_histogram,
            "rounds_without_drafting": self.rounds_without_drafting,
            "predicted_tokens_per_round": self.predicted_tokens_per_round,
            "draft_sources": list(self.draft_sources),
            "sources": self.sources,
        }
        if per_round:
            out["rows_per_round"] = list(self.rows_per_round)
            out["predicted_per_round"] = list(self.predicted_per_round)
            out["committed_per_round"] = list(self.committed_per_round)
            out["accept_lengths"] = list(self.accept_lengths)
            out["root_entropies"] = list(self.root_entropies)
        return out
