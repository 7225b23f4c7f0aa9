"""The drafter's context caches of the requests SGLang is decoding, kept as one batched cache.

Per request: its drafter context (KV-injected tap features of every committed token but the newest), the tap
features the target computed since the last drafter pass (*pending*: the accepted path of the last verify, or
the rows of AR steps taken without drafting), and its *lead entropy* (nats, of the target distribution that
produced its newest token). A drafter pass first catches every request of the batch up with ONE batched
``extend_context`` call over the pending features, then drafts on the same batched cache.

The batched cache follows the batch: it is rebuilt (rows selected, new requests' own caches concatenated) only
when SGLang's batch changes composition; a request that leaves the batch while still alive gets its row back
as its own cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from glance_sgl.drafter import DrafterCache, GlanceDrafter


def stack_caches(caches: list[DrafterCache]) -> DrafterCache:
    """One batched drafter cache from caches of any batch sizes (capacity padded to the largest)."""
    if len(caches) == 1:
        return caches[0]
    cap = max(c.capacity for c in caches)
    for c in caches:
        c.reserve(cap)
    keys = [torch.cat([c.keys[i][:, :, :cap] for c in caches]) for i in range(len(caches[0].keys))]
    values = [torch.cat([c.values[i][:, :, :cap] for c in caches]) for i in range(len(caches[0].values))]
    return DrafterCache(keys, values, torch.cat([c.lengths for c in caches]))


@dataclass
class RequestDraftState:
    """``cache``: the request's own cache [1, ...] while it is not a row of the batched cache (None when it is);
    ``pending``: tap-feature chunks [k, L*H] not yet in the context; ``lead_entropy``: nats or None."""

    req: object
    cache: DrafterCache | None
    pending: list[torch.Tensor] = field(default_factory=list)
    lead_entropy: float | None = None


class DraftContexts:
    """Drafter contexts of the live requests (see the module docstring)."""

    def __init__(self, drafter: GlanceDrafter) -> None:
        self.drafter = drafter
        self.states: dict[str, RequestDraftState] = {}
        self.batch: DrafterCache | None = None
        self.batch_rids: list[str] = []
        self._row: dict[str, int] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self.states

    def __len__(self) -> int:
        return len(self.states)

    def clear(self) -> None:
        self.states.clear()
        self.batch, self.batch_rids, self._row = None, [], {}

    # ------------------------------------------------------------------ lifecycle
    def start(self, req, capacity: int) -> DrafterCache:
        """A fresh context for ``req`` (a new request, or one re-prefilled after retraction)."""
        cache = self.drafter.new_cache(1, capacity=capacity)
        self.states[req.rid] = RequestDraftState(req, cache)
        return cache

    def own_cache(self, rid: str) -> DrafterCache:
        """The request's cache as a batch of one (taken out of the batched cache if it is a row there)."""
        st = self.states[rid]
        if st.cache is None:
            # its stale row in the batched cache is dropped at the next cache_for
            st.cache = self.batch.select(torch.tensor([self._row[rid]], device=self.batch.lengths.device))
        return st.cache

    def drop(self, rid: str) -> None:
        self.states.pop(rid, None)

    def purge(self, live: set[str]) -> None:
        """Forget finished requests that are not in the current batch."""
        for rid in [r for r, st in self.states.items() if r not in live and st.req.finished()]:
            del self.states[rid]

    # ------------------------------------------------------------------ per step
    def lead_entropies(self, rids: list[str]) -> list[float | None]:
        return [self.states[r].lead_entropy for r in rids]

    def set_lead_entropies(self, rids: list[str], entropies: list[float]) -> None:
        for r, h in zip(rids, entropies):
            self.states[r].lead_entropy = h

    def stash(self, rids: list[str], taps: torch.Tensor, rows: torch.Tensor, counts: list[int]) -> None:
        """Keep the tap features of what a verify / AR pass committed, for the next drafter pass.

        ``taps`` [bs, R, L*H] (the pass's rows); ``rows`` [bs, W] long, the committed rows (root first, -1
        padding); ``counts`` [bs]: how many of them. One gather for the batch; per request a view."""
        width = max(counts)
        if taps.shape[1] == 1 and width == 1:
            kept = taps
        else:
            idx = rows[:, :width].clamp(min=0).to(taps.device)
            kept = taps.gather(1, idx[:, :, None].expand(-1, -1, taps.shape[2]))
        for b, (rid, k) in enumerate(zip(rids, counts)):
            self.states[rid].pending.append(kept[b, :k])

    def cache_for(self, rids: list[str]) -> DrafterCache:
        """The batched cache with one row per request of ``rids``, in that order."""
        if rids == self.batch_rids and all(self.states[r].cache is None for r in rids):
            return self.batch
        wanted = set(rids)
        for rid in self.batch_rids:  # rows leaving the batch while their requests live on
            st = self.states.get(rid)
            if rid not in wanted and st is not None and st.cache is None:
                st.cache = self.batch.select(torch.tensor([self._row[rid]], device=self.batch.lengths.device))
        from_batch = [r for r in rids if self.states[r].cache is None]
        from_own = [r for r in rids if self.states[r].cache is not None]
        if any(r not in self._row for r in from_batch):
            raise RuntimeError(f"GLANCE: drafter context lost for {[r for r in from_batch if r not in self._row]}")
        parts = []
        if from_batch:
            if from_batch == self.batch_rids:
                parts.append(self.batch)
            else:
                idx = torch.tensor([self._row[r] for r in from_batch], device=self.batch.lengths.device)
                parts.append(self.batch.select(idx))
        parts += [self.states[r].cache for r in from_own]
        cache = stack_caches(parts)
        order = from_batch + from_own
        if order != rids:
            pos = {r: i for i, r in enumerate(order)}
            cache = cache.select(torch.tensor([pos[r] for r in rids], device=cache.lengths.device))
        for r in from_own:
            self.states[r].cache = None
        self.batch, self.batch_rids, self._row = cache, list(rids), {r: i for i, r in enumerate(rids)}
        return cache

    def catch_up(self, rids: list[str]) -> DrafterCache:
        """The batched cache for ``rids`` with every pending feature appended (one ``extend_context`` call)."""
        cache = self.cache_for(rids)
        chunks = [self.states[r].pending for r in rids]
        if not any(chunks):
            return cache
        per_req = [c[0] if len(c) == 1 else torch.cat(c) if c else None for c in chunks]
        dim = next(t for t in per_req if t is not None).shape[-1]
        ref = next(t for t in per_req if t is not None)
        per_req = [t if t is not None else ref.new_zeros(0, dim) for t in per_req]
        counts = torch.tensor([t.shape[0] for t in per_req], device=cache.lengths.device)
        padded = pad_sequence(per_req, batch_first=True)  # [bs, max pending, L*H]
        self.drafter.extend_context(cache, padded.to(self.drafter.fc.weight.dtype), counts)
        for r in rids:
            self.states[r].pending = []
        return cache

    def extend_own(self, rid: str, taps: torch.Tensor) -> None:
        """Append ``taps`` [n, L*H] (prompt tokens of a prefill chunk) to the request's own context now."""
        cache = self.own_cache(rid)
        n = taps.shape[0]
        self.drafter.extend_context(cache, taps[None].to(self.drafter.fc.weight.dtype),
                                    torch.tensor([n], device=cache.lengths.device))


__all__ = ["DraftContexts", "RequestDraftState", "stack_caches"]
