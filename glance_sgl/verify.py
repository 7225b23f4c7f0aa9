"""Verification of a packed draft tree against the target's own choices (torch reference).

Each tree row carries the target's *choice* for the token after it: the argmax at T = 0, or a sample from the
target's processed distribution at T > 0. The walk starts at the root and descends into the child whose token
equals the current row's choice; when no child does, that choice is the bonus token. Every committed token is
therefore the target's own choice given the committed prefix, so the output is exactly autoregressive greedy
decoding at T = 0 and follows the target's distribution at T > 0 (lossless).

Sampling inverts the target's distribution at one uniform keyed by (seed, output index): the token at output
index i is the first token whose cumulative probability exceeds ``u_i``'s share of the row's mass, whichever tree
row computes it, so a seeded request gives the same tokens with speculation and without, and ``u_i`` is
independent of everything that fixed the prefix. ``u_i`` is a counter-based hash of (seed, output index) in integer
tensor ops, so it is computed on the device holding the logits; with the walk's tensor path (``device_walk``) a
verify step needs no device-to-host copy. One uniform per row, not one per vocabulary entry (Gumbel-max): a row costs
a softmax, a cumulative sum and a binary search, about a tenth of per-token noise over a 152k vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .host_transfers import on_host, read_stacked

_MASK32 = 0xFFFFFFFF
# lowbias32 (C. Wellons' hash prospector). The second multiplier is applied as its negative 32-bit complement:
# for 0 <= x < 2**32 both |x * m| stay below 2**63 (no int64 wrap-around) and the low 32 bits are the same.
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B - (1 << 32)
_SEED_SALT = 0x9E3779B9
_TWO_M32 = 2.0**-32
# target_choices: up to this many sampled rows on a CPU, the uniforms are hashed from Python ints, the same bits
# (seven small tensor ops cost more than a few dozen integer hashes: the demo's vocabulary, 2 cores, one request's
# choices 112 -> 72 us at 1 row, 152 -> 118 at 13, 222 -> 200 at 32; level at about 48)
HOST_UNIFORMS_MAX = 32


def _mix32(x):
    """lowbias32, a bijection of [0, 2**32): on a Python int, or in place on an int64 tensor of 32-bit values
    (the augmented assignments are in-place tensor ops); returns ``x``."""
    x ^= x >> 16
    x *= _MUL_A
    x &= _MASK32
    x ^= x >> 15
    x *= _MUL_B
    x &= _MASK32
    x ^= x >> 16
    return x


def _seed_keys(seeds):
    """A request's 32-bit key from both 32-bit words of its int64 seed: an int (any sign) or an int64 tensor [B]."""
    return _mix32(_mix32((seeds & _MASK32) ^ _SEED_SALT) ^ ((seeds >> 32) & _MASK32))


def _keyed_uniforms(keys: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``counter_uniforms`` from the requests' keys [B] (``_seed_keys``) on ``indices.device``."""
    return _mix32(keys.to(indices.device)[:, None] ^ (indices & _MASK32)).double().add_(0.5).mul_(_TWO_M32)


def _host_uniforms(keys: list[int], indices: list[list[int]]) -> torch.Tensor:
    """:func:`_keyed_uniforms` from Python ints (keys [B], indices [B][R]): the same bits, without tensor ops."""
    return torch.tensor([[(_mix32(k ^ (i & _MASK32)) + 0.5) * _TWO_M32 for i in row] for k, row in zip(keys, indices)],
                        dtype=torch.float64)


def wrap_seed(seed: int) -> int:
    """A Python int as the signed 64-bit seed it stands for (two's complement): the 64 bits the uniforms read."""
    return (int(seed) + (1 << 63)) % (1 << 64) - (1 << 63)


def seed_tensor(seeds: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Python seeds (any int) -> [B] int64, each wrapped to 64 bits (:func:`wrap_seed`)."""
    return torch.tensor([wrap_seed(s) for s in seeds], dtype=torch.long, device=device)


def counter_uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) [B, R] float64 for output indices ``indices`` [B, R] int64 (below 2**32) of requests
    seeded ``seeds`` [B] int64.

    Counter-based: element (b, r) is a function of (seeds[b], indices[b, r]) alone, in int64 tensor ops on
    ``indices.device`` (no generator, no host copy; every product below 2**63, so the same bits on every device). A
    request's 32-bit key (two lowbias32 rounds over the seed's two words) is xor-ed with the index and mixed once more
    (for one seed, distinct indices get distinct values); the 32-bit hash h gives u = (h + 1/2) / 2**32, exact in
    float64.
    """
    return _keyed_uniforms(_seed_keys(seeds.to(device=indices.device, dtype=torch.long)), indices.long())


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One sample per row of ``probs`` [..., V] (non-negative, any total > 0; zero: never drawn) at the uniforms
    ``u`` [...] in (0, 1): the first token whose cumulative mass exceeds ``u`` times the row's total. [...] long.
    The cumulative sum is float32 (accumulated in float64 on a CPU); the draw is kept below the total, so a token
    of zero mass is never the answer."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    target = torch.minimum(u.to(cdf.dtype)[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def process_logprobs(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0, min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Log-probabilities after temperature and the top-k, nucleus (top-p) and min-p filters, fp32. [..., V] ->
    [..., V], renormalised over the tokens every filter keeps (-inf elsewhere), as SGLang's sampler draws:

    - ``top_k`` (> 0): the ``top_k`` most likely tokens (0: no limit);
    - ``top_p`` (< 1): the smallest set of most likely tokens whose mass reaches ``top_p``;
    - ``min_p`` (> 0): tokens at least ``min_p`` times as likely as the most likely one.

    The filters read the tempered distribution alike; the most likely token always stays. Each value is a float
    (int) or a tensor broadcasting against ``logits[..., :1]`` (one per row or per request; temperatures must then
    be > 0, unchecked to stay on the device). Rows without a filter keep the tempered log-softmax as it is,
    whatever their neighbours'.
    """
    if not isinstance(temperature, torch.Tensor) and temperature <= 0:
        raise ValueError("process_logprobs is for sampling; use argmax at temperature 0")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    nucleus, limited, floor = _on(top_p, lambda v: v < 1.0), _on(top_k, lambda v: v > 0), _on(min_p, lambda v: v > 0)
    if not (nucleus or limited or floor):
        return logp
    drop = torch.zeros_like(logp, dtype=torch.bool)
    if nucleus or limited:  # by rank: one sort serves both
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        out_sorted = torch.zeros_like(sorted_lp, dtype=torch.bool)
        if nucleus:
            mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
            out_sorted |= mass_before >= top_p
        if limited:
            rank = torch.arange(logp.shape[-1], device=logp.device)
            out_sorted |= (rank >= top_k) & (torch.as_tensor(top_k, device=logp.device) > 0)
        drop.scatter_(-1, order, out_sorted)
    if floor:
        threshold = logp.amax(dim=-1, keepdim=True) + torch.log(torch.as_tensor(min_p, device=logp.device).float())
        drop |= logp < threshold
    filtered = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    if all(not isinstance(v, torch.Tensor) for v in (top_p, top_k, min_p)):
        return filtered
    any_filter = (torch.as_tensor(top_p, device=logp.device) < 1.0) | (torch.as_tensor(top_k, device=logp.device) > 0) \
        | (torch.as_tensor(min_p, device=logp.device) > 0)
    return torch.where(any_filter, filtered, logp)


def _on(value: float | int | torch.Tensor, active) -> bool:
    """Whether a filter is on: a number by ``active``; a tensor of per-row values always (callers pass one only
    where some row uses the filter, and reading it back would cost a device sync)."""
    return True if isinstance(value, torch.Tensor) else bool(active(value))


@dataclass
class LogitRules:
    """What a plain decoding step adds to a request's logits before it picks, for a batch: ``bias`` [B, V'] (a
    logit bias per request, zero where a request has none; None: no request has one) and, per request still short
    of its minimum output length (batch index -> (that minimum, its stop token ids as a long tensor on the logits'
    device)), its stop tokens masked. :meth:`apply` does it to every row of a tree pass at the row's own output
    index, so that every choice is the one a plain step would make there."""

    bias: torch.Tensor | None = None
    early: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def apply(self, logits: torch.Tensor, depths: torch.Tensor, next_index: torch.Tensor) -> None:
        """In place on ``logits`` [bs, R, V] of a pass over trees of ``depths`` [bs, R]; ``next_index`` [bs]: each
        request's output index of the token after its root. Device ops only (no read back)."""
        if self.bias is not None:
            width = min(logits.shape[-1], self.bias.shape[-1])
            logits[..., :width] += self.bias[:, None, :width].to(logits.device, logits.dtype)
        for b, (minimum, ids) in self.early.items():
            before = (next_index[b].to(depths.device) + depths[b]) < minimum  # [R]: rows that pick a token too early
            row = logits[b]
            row[:, ids] = row[:, ids].masked_fill(before.to(row.device)[:, None], float("-inf"))


@dataclass
class SamplingSpec:
    """How a request picks tokens. ``temperature == 0`` is greedy (seed and the filters unused); at T > 0 the
    target's tempered distribution, filtered by ``top_k`` (0: off), ``top_p`` and ``min_p`` (0: off) as
    :func:`process_logprobs` does, sampled at uniforms keyed by ``seed`` (:func:`inverse_cdf`)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def target_choices(
    logits: torch.Tensor, depths: torch.Tensor, next_index: torch.Tensor, specs: list[SamplingSpec]
) -> torch.Tensor:
    """The target's choice at every row.

    ``logits`` [B, R, V]; ``depths`` [B, R]; ``next_index`` [B]: output index of the token after the root
    (the number of tokens the request has produced so far); ``specs``: one per request. Returns [B, R] long on
    ``logits.device``. Tensor ops on that device only (``depths`` / ``next_index`` are moved there; the sampled
    requests' rows, temperatures, top-p values and seeds go there as small host-built tensors), so no value comes
    back to the host. Greedy requests' rows are the argmax and never enter the sampling arithmetic.
    """
    choices = logits.argmax(dim=-1)
    sampled = [b for b, spec in enumerate(specs) if not spec.greedy]
    if not sampled:
        return choices
    dev = logits.device
    picked = [specs[b] for b in sampled]
    subset = None if len(sampled) == len(specs) else torch.tensor(sampled, device=dev)

    def rows(t: torch.Tensor) -> torch.Tensor:
        t = t.to(dev)
        return t if subset is None else t.index_select(0, subset)

    temperature = torch.tensor([s.temperature for s in picked], dtype=torch.float32, device=dev)[:, None, None]

    def per_request(name: str, off: float | int, dtype: torch.dtype) -> float | int | torch.Tensor:
        """A filter's values [S, 1, 1] on the device where a request uses it, else its neutral value (no tensor)."""
        values = [getattr(s, name) for s in picked]
        return off if all(v == off for v in values) else torch.tensor(values, dtype=dtype, device=dev)[:, None, None]

    filters = per_request("top_p", 1.0, torch.float32), per_request("top_k", 0, torch.long), \
        per_request("min_p", 0.0, torch.float32)
    if not any(isinstance(f, torch.Tensor) for f in filters):
        # no filter: the tempered softmax, unnormalised (the draw scales by each row's mass)
        probs = rows(logits).float() / temperature
        probs = probs.sub_(probs.amax(dim=-1, keepdim=True)).exp_()  # [S, R, V]
    else:
        probs = process_logprobs(rows(logits), temperature, *filters).exp_()
    index = rows(depths).long() + rows(next_index).long()[:, None]
    keys = [_seed_keys(int(s.seed)) for s in picked]  # on the host
    if dev.type == "cpu" and index.numel() <= HOST_UNIFORMS_MAX:
        with on_host():  # a CPU-only path: its read is no device read
            u = _host_uniforms(keys, index.tolist())
    else:
        u = _keyed_uniforms(torch.tensor(keys, dtype=torch.long, device=dev), index)
    sample = inverse_cdf(probs, u)
    return sample if subset is None else choices.index_copy_(0, subset, sample)


@dataclass
class WalkResult:
    """Outcome of verifying a batch of trees (D: the walk's depth cap, ``max_depth``).

    accepted_rows:    [B, D+1] long, the accepted path as tree rows, starting with the root (row 0); -1 padding
    accept_lens:      [B] long, accepted drafted nodes (root and bonus excluded)
    bonus:            [B] long, the target's choice after the last accepted row
    committed_tokens: [B, D+1] long, the accepted drafted tokens then the bonus (``accept_lens + 1`` of them);
                      -1 padding
    """

    accepted_rows: torch.Tensor
    accept_lens: torch.Tensor
    bonus: torch.Tensor
    committed_tokens: torch.Tensor
    host: "WalkResult | None" = field(default=None, repr=False, compare=False)  # its host copy, once read

    def host_copy(self, extra: torch.Tensor | None = None) -> tuple["WalkResult", torch.Tensor | None]:
        """The walk on the host in one device-to-host read, kept as ``host`` (later ``committed()`` calls read
        that), with ``extra`` [B] (e.g. the lead entropies) in the same read. Returns (host walk, host extra). A CPU
        walk is its own host copy; it still makes the one read call (a no-op there), so a CPU device counts the
        reads a GPU makes."""
        dev = self.accept_lens.device
        if dev.type == "cpu" and (extra is None or extra.device.type == "cpu"):
            self.accept_lens.cpu()
            return self, extra
        return self._copy_to_host(extra)

    def _copy_to_host(self, extra: torch.Tensor | None) -> tuple["WalkResult", torch.Tensor | None]:
        rows, lens, bonus, committed, *rest = read_stacked(self.accepted_rows, self.accept_lens, self.bonus,
                                                           self.committed_tokens, *([] if extra is None else [extra]))
        self.host = WalkResult(rows, lens, bonus, committed)
        return self.host, rest[0] if rest else None

    def committed(self) -> list[list[int]]:
        """Tokens committed per request as host lists: the accepted drafted tokens, then the bonus (from the host
        copy where ``host_copy`` made one; else two reads)."""
        walk = self if self.host is None else self.host
        lens = walk.accept_lens.tolist()
        return [row[: n + 1] for row, n in zip(walk.committed_tokens.tolist(), lens)]


# CPU tensors: the host-list walk up to this batch size, the tensor walk above. Median us per walk, R = 32 rows
# (budget trees, branch 4), cap D = 8, 2 CPU cores (short walks / walks of ~4-5 accepted nodes):
#   bs 1: host 47 / 62, tensor 201 / 286;  bs 16: host 177 / 282, tensor 221 / 294;  bs 32: host 331 / 461,
#   tensor 263 / 322;  bs 64: host 710 / 1080, tensor 352 / 450.
HOST_WALK_MAX_BATCH = 16


def greedy_walk(
    tokens: torch.Tensor, parents: torch.Tensor, choices: torch.Tensor, max_depth: int | None = None
) -> WalkResult:
    """Walk every tree from its root following the target's choices, on host lists.

    ``tokens`` / ``parents`` / ``choices``: [B, R]. At each step the child (smallest row first, like SGLang's
    sibling order) whose token equals the current row's choice is taken, at most ``max_depth`` times (default
    R - 1: no cap). One copy of each input to host lists; the result is on ``tokens.device``. Same result as
    ``device_walk``.
    """
    bs, r = tokens.shape
    depth = r - 1 if max_depth is None else max_depth
    tok, par, choice = tokens.tolist(), parents.tolist(), choices.tolist()
    accepted, committed, lens, bonus = [], [], [], []
    for b in range(bs):
        children: list[list[int]] = [[] for _ in range(r)]
        for row, p in enumerate(par[b]):
            if p >= 0:
                children[p].append(row)  # ascending rows: the smallest matching child wins
        cur, path = 0, [0]
        while len(path) <= depth and (
            nxt := next((c for c in children[cur] if tok[b][c] == choice[b][cur]), None)
        ) is not None:
            cur = nxt
            path.append(cur)
        pad = [-1] * (depth + 1 - len(path))
        accepted.append(path + pad)
        committed.append([tok[b][c] for c in path[1:]] + [choice[b][cur]] + pad)
        lens.append(len(path) - 1)
        bonus.append(choice[b][cur])
    dev = tokens.device
    return WalkResult(accepted_rows=torch.tensor(accepted, dtype=torch.long, device=dev),
                      accept_lens=torch.tensor(lens, dtype=torch.long, device=dev),
                      bonus=torch.tensor(bonus, dtype=torch.long, device=dev),
                      committed_tokens=torch.tensor(committed, dtype=torch.long, device=dev))


def device_walk(tokens: torch.Tensor, parents: torch.Tensor, choices: torch.Tensor, max_depth: int) -> WalkResult:
    """``greedy_walk`` in tensor ops on ``tokens.device``: no host copy, no data-dependent control flow.

    ``tokens`` / ``parents`` / ``choices``: [B, R] on one device; ``max_depth``: the walk's cap D (pass the trees'
    depth bound, e.g. the drafter's number of offsets: D, not the tensors' values, fixes the op count, so the
    step has no host sync and can be captured in a CUDA graph). Each row's next row is computed once (its
    smallest child whose token is the row's choice, else the row itself), then D gathers walk every tree at once.
    """
    bs, r = tokens.shape
    dev = tokens.device
    rows = torch.arange(r, device=dev).expand(bs, r)
    taken = (parents >= 0) & (tokens == choices.gather(1, parents.clamp(min=0)))  # the parent's choice
    step = torch.full((bs, r + 1), r, dtype=torch.long, device=dev)  # column r collects the other rows
    step.scatter_reduce_(1, torch.where(taken, parents, r), rows, reduce="amin")
    step = torch.where(step[:, :r] < r, step[:, :r], rows)
    cur = torch.zeros(bs, 1, dtype=torch.long, device=dev)
    path = [cur]
    for _ in range(max_depth):
        cur = step.gather(1, cur)
        path.append(cur)
    walk = torch.cat(path, dim=1)  # [B, D+1]; a walk that stopped repeats its last row
    moved = torch.cat([torch.ones(bs, 1, dtype=torch.bool, device=dev), walk[:, 1:] != walk[:, :-1]], dim=1)
    accept_lens = moved.sum(dim=1) - 1
    bonus = choices.gather(1, cur).squeeze(1)
    drafted = torch.where(moved[:, 1:], tokens.gather(1, walk[:, 1:]), -1)  # [B, D]
    committed = torch.nn.functional.pad(drafted, (0, 1), value=-1).scatter_(1, accept_lens[:, None], bonus[:, None])
    return WalkResult(accepted_rows=torch.where(moved, walk, -1), accept_lens=accept_lens, bonus=bonus,
                      committed_tokens=committed)


@functools.lru_cache(maxsize=64)
def _root_walk_constants(bs: int, depth: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted rows [bs, 1 + depth]: the root, then -1 padding; accept lengths [bs]: 0) of a root-only walk:
    constants of the shape, made once (an AR step's host work is the cost of "never hurts"; never written)."""
    rows = torch.full((bs, 1 + depth), -1, dtype=torch.long, device=device)
    rows[:, 0] = 0
    return rows, torch.zeros(bs, dtype=torch.long, device=device)


def verify_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    logits: torch.Tensor,
    next_index: torch.Tensor,
    specs: list[SamplingSpec],
    max_depth: int | None = None,
    device_resident: bool = False,
) -> WalkResult:
    """Target choices for every row, then the walk: greedy at T = 0, lossless sampling at T > 0.

    ``tokens`` / ``parents`` / ``depths``: [B, R]; ``logits`` [B, R, V]; ``next_index`` [B]; ``max_depth``: the
    walk's cap D (default R - 1; pass the trees' depth bound to keep the tensor walk short). With
    ``device_resident``, logits off the CPU or a batch above ``HOST_WALK_MAX_BATCH``, everything runs on
    ``logits.device`` (``device_walk``: no host copy) and the result lives there; else the walk runs on host lists
    (``greedy_walk``, result on ``tokens.device``). Both give the same result.
    """
    choices = target_choices(logits, depths, next_index, specs)
    depth = tokens.shape[1] - 1 if max_depth is None else max_depth
    if tokens.shape[1] == 1:  # the root alone (an AR step): nothing to walk, the choice is the bonus
        accepted_rows, accept_lens = _root_walk_constants(choices.shape[0], depth, choices.device)
        committed = choices if depth == 0 else torch.nn.functional.pad(choices, (0, depth), value=-1)
        return WalkResult(accepted_rows=accepted_rows, accept_lens=accept_lens, bonus=choices[:, 0],
                          committed_tokens=committed)
    if device_resident or logits.device.type != "cpu" or tokens.shape[0] > HOST_WALK_MAX_BATCH:
        return device_walk(tokens.to(logits.device), parents.to(logits.device), choices, depth)
    return greedy_walk(tokens, parents, choices, depth)
