"""Verification of a packed draft tree against the target's own choices (torch reference).

Each tree row carries the target's *choice* for the token after it: the argmax at T = 0, or a sample from the
target's processed distribution at T > 0. The walk starts at the root and descends into the child whose token
equals the current row's choice; when no child does, that choice is the bonus token. Every committed token is
therefore the target's own choice given the committed prefix, so the output is exactly autoregressive greedy
decoding at T = 0 and follows the target's distribution at T > 0 (lossless).

Sampling uses Gumbel-max with noise keyed by (seed, output index): the token at output index i is
``argmax(logprobs + g_i)`` whichever tree row computes it, so a seeded request gives the same tokens with
speculation and without, and the noise for index i is independent of everything that fixed the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SEED_MIX = 1_000_003


def process_logprobs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities after temperature and nucleus (top-p) filtering, fp32. [..., V] -> [..., V].

    Tokens outside the nucleus get -inf. The nucleus is the smallest set of most likely tokens whose mass
    reaches ``top_p`` (the most likely token is always kept).
    """
    if temperature <= 0:
        raise ValueError("process_logprobs is for sampling; use argmax at temperature 0")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def gumbel_noise(seed: int, index: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise [V] for output index ``index`` of a request seeded with ``seed``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((int(seed) * _SEED_MIX + int(index)) % (1 << 63))
    u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(1e-20, 1.0 - 1e-16)
    return (-torch.log(-torch.log(u))).to(device=device, dtype=torch.float32)


@dataclass
class SamplingSpec:
    """How a request picks tokens. ``temperature == 0`` is greedy (seed and top_p unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def target_choices(
    logits: torch.Tensor, depths: torch.Tensor, next_index: torch.Tensor, specs: list[SamplingSpec]
) -> torch.Tensor:
    """The target's choice at every row.

    ``logits`` [B, R, V]; ``depths`` [B, R]; ``next_index`` [B]: output index of the token after the root
    (the number of tokens the request has produced so far); ``specs``: one per request. Returns [B, R] long.
    """
    choices = logits.argmax(dim=-1)
    for b, spec in enumerate(specs):
        if spec.greedy:
            continue
        logp = process_logprobs(logits[b], spec.temperature, spec.top_p)  # [R, V]
        idx = depths[b] + next_index[b]
        noise = torch.stack([gumbel_noise(spec.seed, int(i), logp.shape[-1], logp.device) for i in idx.tolist()])
        choices[b] = (logp + noise).argmax(dim=-1)
    return choices


@dataclass
class WalkResult:
    """Outcome of verifying a batch of trees.

    accepted_rows: [B, D+1] long, the accepted path as tree rows, starting with the root (row 0); -1 padding
    accept_lens:   [B] long, accepted drafted nodes (root and bonus excluded)
    bonus:         [B] long, the target's choice after the last accepted row
    """

    accepted_rows: torch.Tensor
    accept_lens: torch.Tensor
    bonus: torch.Tensor

    def committed(self, tokens: torch.Tensor) -> list[list[int]]:
        """Tokens committed per request: the accepted drafted tokens, then the bonus token."""
        out = []
        for b in range(tokens.shape[0]):
            n = int(self.accept_lens[b])
            path = self.accepted_rows[b, 1 : n + 1]
            out.append(tokens[b, path].tolist() + [int(self.bonus[b])])
        return out


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, choices: torch.Tensor) -> WalkResult:
    """Walk every tree from its root following the target's choices.

    ``tokens`` / ``parents`` / ``choices``: [B, R]. At each step the child (smallest row first, like SGLang's
    sibling order) whose token equals the current row's choice is taken. The walk runs on host lists (one
    copy each): a tree is a few dozen rows, and per-level tensor ops cost more than the whole walk.
    """
    bs, r = tokens.shape
    tok, par, choice = tokens.tolist(), parents.tolist(), choices.tolist()
    paths, bonus = [], []
    for b in range(bs):
        children: list[list[int]] = [[] for _ in range(r)]
        for row, p in enumerate(par[b]):
            if p >= 0:
                children[p].append(row)  # ascending rows: the smallest matching child wins
        cur, path = 0, [0]
        while (nxt := next((c for c in children[cur] if tok[b][c] == choice[b][cur]), None)) is not None:
            cur = nxt
            path.append(cur)
        paths.append(path)
        bonus.append(choice[b][cur])
    accepted = torch.full((bs, max(map(len, paths))), -1, dtype=torch.long)
    for b, path in enumerate(paths):
        accepted[b, : len(path)] = torch.tensor(path)
    dev = tokens.device
    return WalkResult(accepted_rows=accepted.to(dev), accept_lens=torch.tensor([len(p) - 1 for p in paths], device=dev),
                      bonus=torch.tensor(bonus, dtype=torch.long, device=dev))


def verify_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    logits: torch.Tensor,
    next_index: torch.Tensor,
    specs: list[SamplingSpec],
) -> WalkResult:
    """Target choices for every row, then the walk: greedy at T = 0, lossless sampling at T > 0."""
    return greedy_walk(tokens, parents, target_choices(logits, depths, next_index, specs))
