"""N-gram candidates: a source of draft trees that needs no drafter pass (issue 27, docs/method.md "Sources").

Built on SGLang's own ``NgramCorpus`` (``sglang.srt.speculative.cpp_ngram.ngram_corpus``: the C++ trie and suffix
matcher behind SGLang's NGRAM, JIT-built through tvm_ffi on first use). A request's candidates come from two
corpora, both matched on the request's last ``max_trie_depth`` tokens:

- its own tokens: its prompt, in one corpus that holds every request in flight, each in a token namespace of its
  own (token ``t`` of request namespace ``k`` is stored as ``k * NAMESPACE_STRIDE + t``), so that no request ever
  matches another's tokens there, and one step costs one lookup call for the whole batch instead of one per
  request (SGLang harness, 16 in flight: 2.2 -> 1.8 ms of proposal per step). Its committed output goes there too
  only where no cross-request corpus receives it round by round (scope ``off``, ``publish="finished"``, or past
  ``max_answer_tokens``): each committed token is stored once. A prompt-only lookup runs only where the root
  occurs in the prompt followed by another token (no other lookup can match);
- a cross-request corpus of recent answers (committed outputs, published round by round, or when a request
  finishes, ``NgramSettings.publish``; each answer led by the last ``max_trie_depth - 1`` prompt tokens before it,
  so that a request asked again, or ending like another, matches the other's answer from its first token, as with
  SGLang's NGRAM; never the rest of a prompt), scoped by ``NgramSettings.scope``: ``shared`` (one corpus for
  every request), ``per-key`` (one per API key / tenant, the least recently used dropped beyond ``max_keys``) or
  ``off`` (none: a request matches its own tokens only).

Every corpus is a trie of at most a fixed number of nodes (``corpus_capacity`` / ``own_capacity``; SGLang
preallocates them and evicts the least recently used leaves when full), so memory is bounded whatever the
traffic: ``NgramSource.memory_bound_nodes``. A proposal is a ``DraftTree`` whose nodes are all tagged
``SOURCE_NGRAM``, scored by a ``SourceAcceptance`` table (per depth and sibling rank: the corpus gives no
probabilities; siblings ranked in the order SGLang's BFS found them, :func:`sibling_order_reversed`) and packed
best-first, ready for ``glance_sgl.tree.merge_trees`` with the drafter's tree.

SGLang is imported lazily and is optional: where it is not importable (or the JIT build fails) the source is
unavailable (``available`` False, ``reason`` says why) and proposes root-only trees; nothing raises.

Not thread-safe: one engine thread (or the SGLang scheduler) drives a source.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np
import torch

from .acceptance import CONTEXT_ANY, CONTEXT_CHAIN, CONTEXT_ON_TRACK, HindsightTree, SourceAcceptance
from .tree import SOURCE_NGRAM, CandidateTrie, DraftTree, _rows_per_request, is_chain, pack_trees

log = logging.getLogger(__name__)

SCOPES = ("shared", "per-key", "off")
MAX_PENDING = 8  # proposals per request awaiting hindsight labels; beyond it the oldest is labelled as far as known
# A request whose last this many committed tokens were, one after the other, its proposals' first choices is on
# track (copying a passage, replaying an answer): its proposals are scored and labelled in their own acceptance
# context (SourceAcceptance, CONTEXT_ON_TRACK)
ON_TRACK_TOKENS = 4
MATCH_TYPES = ("BFS", "PROB")
PUBLISH = ("live", "finished")
_CHAIN = "\x00chain"  # suffix of a request's match-state id for its chains' continuations
_ANON_KEY = ""  # per-key scope: requests without a key share this tenant's corpus
# The in-flight requests' corpus stores token t of namespace k as k * NAMESPACE_STRIDE + t (int32 ids). The stride
# lies above the vocabularies of today's VLMs (Qwen's 151 936 ids, Gemma 3's 262 144); an id outside
# [0, NAMESPACE_STRIDE - 1) (a skipped prompt position, -1) is never stored: prompts are split there, output windows
# start after it, and a lookup's context carries it as the namespace's separator (NAMESPACE_STRIDE - 1), which no
# trie holds. NAMESPACES per corpus before a fresh one takes new requests (the old one serves its requests until
# they finish, and goes with the last of them)
NAMESPACE_STRIDE = 1 << 19
NAMESPACES = (2**31 - 1) // NAMESPACE_STRIDE - 1
# Inserts wait in a corpus's queue until a lookup reads that corpus, or until this many tokens wait: one insert
# call per lookup instead of one per round (an insert call costs ~0.15 ms on 2 cores, a round's n-grams far less;
# a drafting request whose lookups the planner skips would otherwise pay it every round for nothing). A corpus a
# lookup read since the last commit is flushed as soon as a round's commits reach it: SGLang's insert thread stores
# them while the engine finishes the round and schedules the next, where a flush just before the lookup would make
# the lookup wait for the whole insert (``synchronize``: 0.19 ms of a 9 ms SGLang step on 2 cores, fresh traffic at
# 1 in flight)
MAX_QUEUED_TOKENS = 8192

_IMPORT: tuple[Any, str | None] | None = None  # (NgramCorpus class or None, why not)


@functools.lru_cache(maxsize=None)
def sibling_order_reversed(cls: Any) -> bool:
    """Whether ``cls`` (SGLang's ``NgramCorpus``) returns a lookup's siblings in the reverse of the order its BFS
    found them. The BFS finds the longest match's continuations first, each match's most recent first (its LRU
    list), but SGLang 0.5's result keeps them in a ``std::unordered_map``, whose libstdc++ iteration runs newest
    entry first: the siblings come out shortest match and oldest continuation first, the least likely first.
    Probed once per process on a corpus of two continuations of one context (the older one first in the result:
    reversed), so a corpus that keeps the BFS order is read as it is."""
    corpus = cls(max_trie_depth=4, min_bfs_breadth=1, max_bfs_breadth=4, draft_token_num=3, match_type="BFS",
                 capacity=64)
    for continuation in (10, 20):  # 20 is the more recent continuation of 1 2 3
        corpus.batch_put([[1, 2, 3, continuation]])
        corpus.synchronize()
    ids, _ = corpus.batch_get(["probe"], [[1, 2, 3]], [3])
    return [int(t) for t in ids.reshape(-1)[1:3]] == [10, 20]


def ngram_corpus_class() -> tuple[Any, str | None]:
    """SGLang's ``NgramCorpus`` class, imported on first call: ``(cls, None)``, or ``(None, reason)`` where
    SGLang is not importable. The result is cached for the process."""
    global _IMPORT
    if _IMPORT is None:
        try:
            from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
            _IMPORT = (NgramCorpus, None)
        except Exception as exc:  # ImportError, or anything SGLang's import raises on this machine
            _IMPORT = (None, f"n-gram source unavailable: SGLang's NgramCorpus "
                             f"(sglang.srt.speculative.cpp_ngram) could not be imported ({type(exc).__name__}: {exc})")
    return _IMPORT


@dataclass
class NgramSettings:
    """Settings of the n-gram source (``validate()`` before use; ``NgramSource`` calls it).

    scope:            ``shared`` | ``per-key`` | ``off``: which finished answers a request matches besides its own
                      tokens (see the module doc; ``per-key`` isolates tenants, ``off`` shares nothing)
    max_trie_depth:   longest n-gram stored, in tokens (match length + continuation; SGLang's default 18)
    max_nodes:        candidates per corpus lookup (SGLang's ``draft_token_num - 1``; 7 as its NGRAM's default); a
                      proposal merges the cross-request and own lookups and keeps at most the rows asked for. Kept
                      narrow: SGLang's BFS spends a lookup's candidates on the longest match first, and a wider
                      lookup mostly adds shorter matches' breadth (replayed greedy answers, 8 rows at 8 in flight,
                      measured while proposals kept the lookup's level order: tau 2.25 with 15 per lookup, 2.61
                      with 7, SGLang's NGRAM 2.56)
    max_depth:        deepest candidate kept (the walk's depth cap: keep it at the drafter's block size - 1)
    min_bfs_breadth / max_bfs_breadth / match_type: SGLang's NgramCorpus matching (BFS: most recent
                      continuations first, wider for shorter matches; PROB: most frequent first)
    corpus_capacity:  trie nodes of one cross-request corpus (SGLang preallocates them: ~180 bytes each, plus the
                      per-node child maps as they fill)
    own_capacity:     trie nodes of the corpus of the in-flight requests' own tokens (their prompts, and their
                      outputs where no cross-request corpus receives them round by round; every request in a
                      namespace of its own; the least recently inserted evicted when full: finished requests'
                      n-grams first)
    max_keys:         ``per-key``: tenant corpora kept, the least recently used dropped beyond it
    publish:          ``live``: a request's committed output joins its cross-request corpus round by round, so
                      concurrent requests match each other's answers as they are written (as SGLang's NGRAM);
                      ``finished``: only when the request finishes
    max_answer_tokens: tokens of an answer published to the cross-request corpus (its first ones)
    skip_tokens:      token ids never matched in prompts (e.g. the image placeholder): the prompt is split there
    """

    scope: str = "shared"
    max_trie_depth: int = 18
    max_nodes: int = 7
    max_depth: int = 15
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    match_type: str = "BFS"
    corpus_capacity: int = 200_000
    own_capacity: int = 262_144
    max_keys: int = 32
    publish: str = "live"
    max_answer_tokens: int = 4096
    skip_tokens: tuple[int, ...] = field(default_factory=tuple)

    def validate(self) -> "NgramSettings":
        """Raises ValueError naming the first bad field; returns self."""
        if self.scope not in SCOPES:
            raise ValueError(f"ngram scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        if self.match_type not in MATCH_TYPES:
            raise ValueError(f"ngram match_type must be one of {', '.join(MATCH_TYPES)}, got {self.match_type!r}")
        if not 2 <= self.max_trie_depth <= 64:
            raise ValueError(f"ngram max_trie_depth must be in [2, 64], got {self.max_trie_depth}")
        if not 1 <= self.max_nodes <= 255:
            raise ValueError(f"ngram max_nodes must be in [1, 255], got {self.max_nodes}")
        if not 1 <= self.max_depth <= 255:
            raise ValueError(f"ngram max_depth must be in [1, 255], got {self.max_depth}")
        if not 1 <= self.min_bfs_breadth <= self.max_bfs_breadth:
            raise ValueError(f"ngram bfs breadths need 1 <= min <= max, got {self.min_bfs_breadth}, "
                             f"{self.max_bfs_breadth}")
        floor = 4 * self.max_trie_depth
        for name in ("corpus_capacity", "own_capacity"):
            value = getattr(self, name)
            if not floor <= value <= 100_000_000:
                raise ValueError(f"ngram {name} must be in [{floor}, 1e8] trie nodes, got {value}")
        if self.max_keys < 1:
            raise ValueError(f"ngram max_keys must be >= 1, got {self.max_keys}")
        if self.publish not in PUBLISH:
            raise ValueError(f"ngram publish must be one of {', '.join(PUBLISH)}, got {self.publish!r}")
        if self.max_answer_tokens < 0:
            raise ValueError(f"ngram max_answer_tokens must be >= 0, got {self.max_answer_tokens}")
        self.skip_tokens = tuple(int(t) for t in self.skip_tokens)
        return self


@dataclass
class _OwnCorpus:
    """The corpus of in-flight requests' own tokens, one namespace per request (``NAMESPACE_STRIDE``)."""

    corpus: Any
    next_namespace: int = 1


@dataclass
class _Request:
    own: _OwnCorpus  # where the request's prompt (and output, see ``starts``) live, namespace ``offset // stride``
    offset: int
    key: str
    tail: list[int]  # the last max_trie_depth tokens (prompt then output); tail[-1] is the root of a proposal
    total: int  # tokens so far (prompt + output)
    answer: list[int] = field(default_factory=list)  # committed output, up to max_answer_tokens
    lead: list[int] = field(default_factory=list)  # the prompt's last tokens (since its last skip token): the
    # context the answer's first n-grams are published with
    pending: list[HindsightTree] = field(default_factory=list)  # proposals awaiting their labels, oldest first
    pending_at: int = -1  # ``total`` when the newest pending proposal was made (one per position)
    streak: int = 0  # its latest committed tokens that its proposals had as first choices (ON_TRACK_TOKENS)
    # a chain it was proposed (``CONTEXT_CHAIN``) broke: what it committed left the chain before the chain's end (an
    # opening like an earlier answer's, over another picture). Its later chains are scored in its own context until
    # it is on track again: the chain table is learned where chains hold (replayed answers)
    chain_broken: bool = False
    # the tokens its prompt follows by another (an own lookup whose root is none of them finds nothing), while its
    # output goes to a cross-request corpus only; None: the own corpus takes its output too, every lookup runs
    starts: frozenset[int] | None = None
    # its prompt's windows (in its namespace), not inserted yet: they go in before its first own lookup or its
    # first output window (``NgramSource._own_ready``), so a request whose rounds never look never inserts them
    prompt_windows: list[list[int]] | None = None


class NgramSource:
    """Candidate trees from n-gram matches (module doc). Lifecycle per request: ``add_request`` (prompt),
    ``commit`` after every round (and for the prefill's first token), ``propose`` before a round, ``finish``.

    Example::

        src = NgramSource(NgramSettings(scope="per-key"))
        if src.available:
            src.add_request("r1", prompt_ids, key="tenant-a")
            src.commit("r1", [first_token])
            tree = src.propose(["r1"], rows=16, acceptance=table)   # DraftTree [1, <=16], tags SOURCE_NGRAM
            merged = merge_trees([drafter_tree, tree], rows=16)
            ...
            src.commit("r1", committed_tokens)
            src.finish("r1")                                        # its answer joins tenant-a's corpus
    """

    tag = SOURCE_NGRAM
    name = "ngram"

    def __init__(self, settings: NgramSettings | None = None) -> None:
        self.settings = (settings or NgramSettings()).validate()
        self._cls, self.reason = ngram_corpus_class()
        self._requests: dict[Hashable, _Request] = {}
        self._own: _OwnCorpus | None = None  # where new requests go (an older one may still serve its requests)
        self._corpora: OrderedDict[str, Any] = OrderedDict()  # cross-request corpora by key (shared: one, "")
        self._default_acceptance = SourceAcceptance(max_depth=self.settings.max_depth)
        self._hindsight: SourceAcceptance | None = None  # the table proposals are labelled into (propose's)
        self._queued: dict[int, tuple[Any, list[list[int]], int]] = {}  # id(corpus) -> (corpus, windows, tokens)
        self._queued_last: dict[int, Hashable] = {}  # id(corpus) -> the request whose window is queued last there
        self._read: set[int] = set()  # id() of the corpora read since the last commit (its puts flush at once)
        self._unsynced: set[int] = set()  # id() of the corpora with inserts a lookup has not waited for yet
        self.published_tokens = 0
        self._reversed = False  # whether lookups return siblings in reverse BFS order (sibling_order_reversed)
        if self._cls is not None:
            try:  # the first NgramCorpus JIT-builds SGLang's C++ (tens of seconds once, cached on disk)
                self._own = _OwnCorpus(self._new_corpus(self.settings.own_capacity))
                self._reversed = sibling_order_reversed(self._cls)
                if self.settings.scope == "shared":  # allocated now (tens of ms), not in the first request
                    self._cross(_ANON_KEY, create=True)
            except Exception as exc:
                self._cls = None
                self.reason = (f"n-gram source unavailable: SGLang's NgramCorpus failed to build "
                               f"({type(exc).__name__}: {exc})")
        if self._cls is None:
            log.warning("%s", self.reason)

    # ------------------------------------------------------------------------------------------ state
    @property
    def available(self) -> bool:
        """Whether SGLang's NgramCorpus loaded; if not, ``reason`` says why and proposals are root-only."""
        return self._cls is not None

    def __contains__(self, rid: Hashable) -> bool:
        """Whether ``rid`` is a request in flight here (added, not yet finished)."""
        return rid in self._requests

    def request_ids(self) -> list[Hashable]:
        """The requests in flight here."""
        return list(self._requests)

    def memory_bound_nodes(self, active_requests: int) -> int:
        """Trie nodes this source can hold with ``active_requests`` requests in flight: the cross-request
        corpora (one, ``max_keys`` or none) plus the in-flight requests' corpus, and a second one while the
        requests of a filled one (``NAMESPACES`` requests) finish. Memory is about 180 bytes per node plus the
        child maps of filled nodes."""
        s = self.settings
        cross = {"shared": 1, "per-key": s.max_keys, "off": 0}[s.scope] * s.corpus_capacity
        return cross + min(2, max(active_requests, 1)) * s.own_capacity

    def stats(self) -> dict[str, int | bool | str]:
        """Counters for reports: requests in flight, cross-request corpora, published tokens."""
        return {"available": self.available, "scope": self.settings.scope, "requests": len(self._requests),
                "corpora": len(self._corpora), "published_tokens": self.published_tokens}

    def _new_corpus(self, capacity: int) -> Any:
        s = self.settings
        return self._cls(max_trie_depth=s.max_trie_depth, min_bfs_breadth=s.min_bfs_breadth,
                         max_bfs_breadth=s.max_bfs_breadth, draft_token_num=s.max_nodes + 1, match_type=s.match_type,
                         capacity=capacity)

    def _cross(self, key: str, create: bool) -> Any | None:
        """The cross-request corpus of ``key`` (most recently used first out of eviction), or None."""
        if self.settings.scope == "off":
            return None
        corpus = self._corpora.get(key)
        if corpus is not None:
            self._corpora.move_to_end(key)
            return corpus
        if not create:
            return None
        if len(self._corpora) >= (1 if self.settings.scope == "shared" else self.settings.max_keys):
            # the least recently used tenant's answers go; its trie is emptied (pending inserts first, so that
            # none of them lands after the reset) and serves the new key: no allocation churn
            _, corpus = self._corpora.popitem(last=False)
            self._queued.pop(id(corpus), None)  # the old tenant's queued n-grams go with it
            self._queued_last.pop(id(corpus), None)
            corpus.synchronize()
            self._unsynced.discard(id(corpus))
            corpus.reset()
        else:
            corpus = self._new_corpus(self.settings.corpus_capacity)
        self._corpora[key] = corpus
        return corpus

    def _put(self, corpus: Any, windows: list[list[int]],
             continued: Sequence[tuple[Hashable, list[int]] | None] | None = None) -> None:
        """Queue ``windows`` for ``corpus`` (inserted by :meth:`_flush` before a lookup reads it, once
        ``MAX_QUEUED_TOKENS`` tokens wait, or at once where a lookup read it since the last commit).

        ``continued``: per window, ``(rid, new)`` where the window is request ``rid``'s context followed by its
        ``new`` tokens (None: a window of its own). Where the window queued last for ``corpus`` is ``rid``'s, its
        ``new`` tokens extend that one instead: the trie then stores the same n-grams (every one up to
        ``max_trie_depth`` tokens that ends in a new token starts within the context) without walking the
        context's paths again (SGLang's insert stores every path from every position: about 7 us a token on 2
        cores, and a round's window is mostly context)."""
        if not windows:
            return
        key = id(corpus)
        _, queued, tokens = self._queued.get(key, (corpus, [], 0))
        last = self._queued_last.get(key)
        for i, window in enumerate(windows):
            link = continued[i] if continued is not None else None
            if link is not None and queued and last is not None and last == link[0]:
                queued[-1].extend(link[1])
                tokens += len(link[1])
            else:
                queued.append(window)
                tokens += len(window)
            last = None if link is None else link[0]
        self._queued[key] = (corpus, queued, tokens)
        self._queued_last[key] = last
        if tokens >= MAX_QUEUED_TOKENS or key in self._read:
            self._flush(corpus)

    def _flush(self, corpus: Any) -> None:
        """Insert what waits for ``corpus`` (one insert call)."""
        entry = self._queued.pop(id(corpus), None)
        self._queued_last.pop(id(corpus), None)
        if entry is not None:
            corpus.batch_put(entry[1])
            self._unsynced.add(id(corpus))

    def _sync_inserts(self, corpus: Any) -> None:
        """Wait for ``corpus``'s inserts (SGLang's insert thread) before a lookup reads it; nothing to wait for
        where none was issued since the last wait (a chain's continuation lookups: about 0.1 ms each)."""
        self._flush(corpus)
        if id(corpus) in self._unsynced:
            corpus.synchronize()
            self._unsynced.discard(id(corpus))

    # ------------------------------------------------------------------------------------------ lifecycle
    def add_request(self, rid: Hashable, prompt: Sequence[int], key: str | None = None) -> None:
        """Start ``rid`` with its prompt token ids (image placeholders included; ``skip_tokens`` are not matched).
        ``key``: the API key / tenant (``per-key`` scope; None shares the anonymous tenant's corpus)."""
        if rid in self._requests:
            raise ValueError(f"ngram source: request {rid!r} already added")
        if not self.available:
            return
        s = self.settings
        own = self._own
        if own.next_namespace > NAMESPACES:  # a fresh corpus for new requests; this one serves its own to the end
            self._flush(own.corpus)
            own = self._own = _OwnCorpus(self._new_corpus(s.own_capacity))
        offset = own.next_namespace * NAMESPACE_STRIDE
        own.next_namespace += 1
        prompt = [int(t) for t in prompt]
        skip = set(s.skip_tokens)
        segments, cur = [], []
        for t in prompt:
            if t in skip or not _storable(t):
                if len(cur) > 1:
                    segments.append(cur)
                cur = []
            else:
                cur.append(t)
        if len(cur) > 1:
            segments.append(cur)
        scope_key = _ANON_KEY if s.scope == "shared" or key is None else str(key)
        lead = cur[-(s.max_trie_depth - 1):]  # cur: the prompt's tokens after its last skip token
        live = s.scope != "off" and s.publish == "live"  # its output reaches a cross-request corpus round by round
        starts = frozenset(t for seg in segments for t in seg[:-1]) if live else None
        self._requests[rid] = _Request(own, offset, scope_key, prompt[-s.max_trie_depth:], len(prompt), lead=lead,
                                       starts=starts,
                                       prompt_windows=[_in_namespace(seg, offset) for seg in segments] or None)

    def insert_prompt(self, rid: Hashable) -> None:
        """Insert ``rid``'s prompt now, where its first round will look it up: SGLang's insert thread stores it
        while the caller goes on (the embedded engine: before the request's prefill). Else it goes in before the
        request's first own lookup (:meth:`_own_ready`)."""
        req = self._requests.get(rid)
        if req is not None:
            self._own_ready(req)
            self._flush(req.own.corpus)

    def _own_ready(self, req: _Request) -> None:
        """Queue ``req``'s prompt for its own corpus, once, before anything else of it goes in or is looked up
        there. Inserting a prompt costs SGLang's trie about 6 us a token (n-grams up to ``max_trie_depth``), and on
        a busy CPU the woken insert thread takes the engine's core meanwhile: a request whose rounds skip the
        lookups (the planner's ``cheap_rows``) never pays it."""
        if req.prompt_windows is not None:
            windows, req.prompt_windows = req.prompt_windows, None
            self._put(req.own.corpus, windows)

    def commit(self, rid: Hashable, tokens: Sequence[int]) -> None:
        """Tokens committed for ``rid`` (in output order: the prefill's first token, then each round's)."""
        self.commit_many([(rid, tokens)])

    def commit_many(self, items: Sequence[tuple[Hashable, Sequence[int]]]) -> None:
        """:meth:`commit` for several requests at once: one insert call into each cross-request corpus for all of
        its requests' new answer n-grams (a round's commits), and one into the in-flight requests' corpus for the
        windows of the requests whose output no cross-request corpus receives (``_Request.starts`` None)."""
        s = self.settings
        own: dict[int, tuple[_OwnCorpus, list[list[int]], list[tuple[Hashable, list[int]] | None]]] = {}
        live: dict[str, tuple[list[list[int]], list[tuple[Hashable, list[int]]]]] = {}
        published: dict[str, int] = {}
        for rid, tokens in items:
            req = self._requests.get(rid)
            if req is None or not tokens:
                continue
            tokens = [int(t) for t in tokens]
            # every n-gram that ends in a new token starts at most max_trie_depth - 1 tokens before it
            window = req.tail[-(s.max_trie_depth - 1):] + tokens
            if req.starts is not None and len(req.answer) + len(tokens) > s.max_answer_tokens:
                req.starts = None  # the answer outgrows what is published: its own corpus takes over
            if req.starts is None:
                self._own_ready(req)  # its prompt before its output, as the tokens came
                stored = _after_separators(window)  # a skipped prompt position never enters a trie
                if len(stored) > 1:
                    _, windows, links = own.setdefault(id(req.own), (req.own, [], []))
                    windows.append(_in_namespace(stored, req.offset))
                    # continued only where nothing in it is a separator (a skipped position ends the n-grams)
                    links.append((rid, _in_namespace(tokens, req.offset)) if len(stored) == len(window) else None)
            req.tail = window[-s.max_trie_depth:]
            req.total += len(tokens)
            room = s.max_answer_tokens - len(req.answer)
            if room > 0:
                if s.publish == "live":  # the answer's new n-grams (the first ones led by the prompt's last tokens)
                    context = (req.lead + req.answer)[-(s.max_trie_depth - 1):]
                    windows, links = live.setdefault(req.key, ([], []))
                    windows.append(context + tokens[:room])
                    links.append((rid, tokens[:room]))
                    published[req.key] = published.get(req.key, 0) + min(room, len(tokens))
                req.answer.extend(tokens[:room])
        for corpus, windows, links in own.values():
            self._put(corpus.corpus, windows, links)
        for key, (windows, links) in live.items():
            corpus = self._cross(key, create=True)
            if corpus is not None:
                self._put(corpus, windows, links)
                self.published_tokens += published[key]
        self._read.clear()  # a round without lookups leaves the next round's commits queued
        self._label(items)

    def _label(self, items: Sequence[tuple[Hashable, Sequence[int]]]) -> None:
        """Extends the pending proposals of the requests in ``items`` with their committed tokens and labels the
        matured ones (and any beyond ``MAX_PENDING``) into the hindsight table, as one batch."""
        if self._hindsight is None:
            return
        ready: list[HindsightTree] = []
        for rid, tokens in items:
            req = self._requests.get(rid)
            if req is None or not tokens:
                continue
            # the streak goes on where this round's proposal (made where these tokens start) foresaw them all
            latest = req.pending[-1] if req.pending and req.pending_at == req.total - len(tokens) else None
            hit, unbroken = latest.foreseen(tokens) if latest is not None else (0, False)
            req.streak = req.streak + hit if unbroken else 0
            if req.streak >= ON_TRACK_TOKENS:
                req.chain_broken = False
            elif latest is not None and latest.context == CONTEXT_CHAIN and not unbroken:
                req.chain_broken = True
            if not req.pending:
                continue
            keep = []
            for tree in req.pending:
                tree.future.extend(int(t) for t in tokens[:tree.depth - len(tree.future)])
                (ready if tree.mature else keep).append(tree)
            while len(keep) > MAX_PENDING:
                ready.append(keep.pop(0))
            req.pending = keep
        if ready:
            self._hindsight.observe_hindsight(SOURCE_NGRAM, ready)

    def finish(self, rid: Hashable, publish: bool = True) -> None:
        """``rid`` is done: its answer joins its cross-request corpus (``publish``, with ``publish="finished"``
        settings; live publishing has put it there already; never with scope ``off``). Its own n-grams stay in the
        in-flight requests' corpus, in a namespace no later request gets, until evicted."""
        req = self._requests.pop(rid, None)
        if req is None:
            return
        for key, last in self._queued_last.items():  # a request added again under this id starts a window anew
            if last == rid:
                self._queued_last[key] = None
        if self._hindsight is not None and req.pending:  # labelled as far as the answer went
            self._hindsight.observe_hindsight(SOURCE_NGRAM, req.pending)
        if publish and self.settings.publish == "finished" and len(req.answer) > 1:
            corpus = self._cross(req.key, create=True)
            if corpus is not None:
                self._put(corpus, [req.lead + req.answer])
                self.published_tokens += len(req.answer)
        corpus = self._cross(req.key, create=False)
        if corpus is not None:
            corpus.erase_match_state([str(rid), chain_state(str(rid))])  # its lookups' and its chains' continuations'
        req.own.corpus.erase_match_state([str(rid), chain_state(str(rid))])

    def close(self) -> None:
        """Drop every corpus (their SGLang insert threads end)."""
        self._requests.clear()
        self._queued.clear()
        self._read.clear()
        self._unsynced.clear()
        self._own = None
        self._corpora.clear()

    # ------------------------------------------------------------------------------------------ proposing
    def root(self, rid: Hashable) -> int:
        """The token a proposal for ``rid`` starts from: its last token (the last committed one); -1 while it has
        none (an empty prompt and nothing committed)."""
        tail = self._requests[rid].tail
        return tail[-1] if tail else -1

    def propose(self, rids: Sequence[Hashable], rows: int | Sequence[int],
                acceptance: SourceAcceptance | None = None, roots: Sequence[int] | None = None,
                device: torch.device | str = "cpu", strict: bool = True) -> DraftTree:
        """N-gram candidate trees for the requests ``rids`` (in batch order).

        ``rows``: rows per request, root included (one int or one per request). ``acceptance``: the calibration
        that scores the nodes (``SourceAcceptance``; its ``SOURCE_NGRAM`` cells), else the source's own prior
        table. ``roots``: the requests' last committed tokens, checked against what the source was told (None:
        taken from it; a mismatch raises, or with ``strict=False`` gives that request the root alone). Returns a
        DraftTree [B, W] (W <= max(rows)) tagged ``SOURCE_NGRAM`` with scores = estimated log-probability that the
        walk reaches the node, best-first; requests with no match (or an unavailable source, or a request not
        added) get the root alone, padded (``pack_trees``).
        """
        budgets = _rows_per_request(rows, len(rids))
        known = [rid in self._requests and bool(self._requests[rid].tail) for rid in rids]
        if roots is None:
            if not all(known):
                missing = [rid for rid, k in zip(rids, known) if not k]
                raise ValueError(f"ngram source: requests not added (or without any token) and no roots given: "
                                 f"{missing}")
            roots = [self.root(rid) for rid in rids]
        roots = [int(r) for r in roots]
        for b, (rid, root) in enumerate(zip(rids, roots)):
            if known[b] and self.root(rid) != root:
                if strict:
                    raise ValueError(f"ngram source: request {rid!r} ends in token {self.root(rid)}, the round's "
                                     f"root is {root}: commit() every committed token")
                known[b] = False
        tries = [CandidateTrie(root) for root in roots]
        live = [b for b, k in enumerate(known) if k and budgets[b] > 1 and self.available]
        chained = self._lookup(rids, live, tries) if live else set()
        table = acceptance or self._default_acceptance
        logs: dict[int, list[list[float]]] = {}
        label = acceptance is not None and SOURCE_NGRAM in acceptance.hindsight
        if label:
            self._hindsight = acceptance
        packed = []
        for b, trie in enumerate(tries):
            if len(trie) > 1:
                # a lookup that found one long chain is scored by the tables of such lookups (a replayed answer),
                # unless a chain of this request broke since it was last on track
                context = CONTEXT_CHAIN if b in chained and not self._requests[rids[b]].chain_broken \
                    else self.context(rids[b])
                if context not in logs:
                    logs[context] = table.log_table(SOURCE_NGRAM, context)
                ranks = trie.rescore(logs[context], SOURCE_NGRAM)
                if label:
                    self._pend(self._requests[rids[b]], trie, ranks, context)
            packed.append(trie.best_first(budgets[b] - 1))
        return pack_trees(packed, device)

    def context(self, rid: Hashable) -> int:
        """The acceptance context ``rid``'s next proposal is scored in: ``CONTEXT_ON_TRACK`` where its last
        ``ON_TRACK_TOKENS`` committed tokens or more were its proposals' first choices, else ``CONTEXT_ANY`` (and
        always where proposals are not labelled in hindsight: none is kept to check the commits against)."""
        req = self._requests.get(rid)
        return CONTEXT_ON_TRACK if req is not None and req.streak >= ON_TRACK_TOKENS else CONTEXT_ANY

    @staticmethod
    def _pend(req: _Request, trie: CandidateTrie, ranks: list[int], context: int) -> None:
        """Keeps ``req``'s whole proposal (every node, verified or not) for its hindsight labels, in the context
        it was scored in; a second proposal from the same position replaces the first."""
        tree = HindsightTree(list(trie.tokens), list(trie.parents), list(trie.depths), ranks, context=context)
        if req.pending_at == req.total and req.pending:
            req.pending[-1] = tree
        else:
            req.pending.append(tree)
        req.pending_at = req.total

    def _lookup(self, rids: Sequence[Hashable], live: list[int], tries: list[CandidateTrie]) -> set[int]:
        """Cross-request and own-corpus matches of the requests ``live`` (batch indices) into their tries, in that
        order (the order ``best_first`` keeps: the cross-request corpus holds the request's own answer too, as
        SGLang's NGRAM corpus does; its own corpus adds the prompt, looked up where the cross-request lookup did not
        return one long chain and the root occurs in it).

        A lookup returns at most ``max_nodes`` candidates. Where they form one chain (a long match with a single
        continuation: a replayed answer, a quoted passage) the corpus is asked again from the chain's end, and the
        continuation joins the tree under it, until ``max_depth``: verbatim copies are drafted as deep as the
        drafter's block, not ``max_nodes`` deep. Returns the batch indices whose lookups found such a chain."""
        s = self.settings
        reqs = [self._requests[rids[b]] for b in live]
        queries: list[_Query] = []
        by_key: dict[str, list[int]] = {}
        for i, req in enumerate(reqs):
            by_key.setdefault(req.key, []).append(i)
        for key, members in by_key.items():
            corpus = self._cross(key, create=False)
            if corpus is not None:
                queries += [_Query(live[i], corpus, str(rids[live[i]]), reqs[i].tail, reqs[i].total) for i in members]
        own = []
        for b, req in zip(live, reqs):
            if req.starts is None or req.tail[-1] in req.starts:
                self._own_ready(req)  # its prompt goes in before its first own lookup
                own.append(_Query(b, req.own.corpus, str(rids[b]), _in_namespace(req.tail, req.offset), req.total,
                                  offset=req.offset))
        for i, q in enumerate(queries + own):
            q.order = (i,)
        if not queries:  # scope off: the own corpora alone
            queries, own = own, []
        # (order, batch index, tokens, parent rows): a lookup's tree, whose row 0 is the proposal's root or, for a
        # chain's continuation, the end of the chain it continues
        found: list[tuple[tuple, int, list[int], list[int]]] = []
        chained_any: set[int] = set()
        while queries:
            chains: list[_Query] = []
            for q, (tok, par, dep) in zip(queries, self._match(queries)):
                found.append((q.order, q.b, [t - q.offset for t in tok] if q.offset else tok, par))
                if len(tok) == s.max_nodes + 1 and dep[-1] == s.max_nodes and q.depth + s.max_nodes < s.max_depth:
                    chains.append(q.extend(tok, s.max_trie_depth))
            # the own corpora (the prompt's matches) where the cross-request lookup found no single long chain:
            # where it did, its continuation goes deeper than a row budget keeps the own lookup's breadth
            chained = {q.b for q in chains}
            chained_any |= chained
            queries, own = chains + [q for q in own if q.b not in chained], []
        found.sort(key=lambda f: f[0])
        ends: dict[tuple, int] = {}  # a lookup's order -> the trie node of its last row (a chain's end)
        for order, b, tok, par in found:  # a first lookup's order[:-1] is (), no lookup's: it hangs under the root
            nodes = tries[b].add_tree(tok, par, [0.0] * len(tok), [SOURCE_NGRAM] * len(tok), s.max_depth,
                                      under=ends.get(order[:-1], 0))
            ends[order] = nodes[-1]
        return chained_any

    def _match(self, queries: Sequence["_Query"]) -> list[tuple[list[int], list[int], list[int]]]:
        """Every query's lookup, one ``batch_get`` per corpus, decoded in one array pass over all of them (per-lookup
        numpy calls cost more than the lookups at 8 rows): per query its tree's tokens, parent rows and depths
        (row 0 the root, SGLang's padding dropped; the root alone where nothing matched)."""
        d = self.settings.max_nodes + 1
        groups: dict[int, list[int]] = {}
        for i, q in enumerate(queries):
            groups.setdefault(id(q.corpus), []).append(i)
        self._read.update(groups)
        got = []
        for members in groups.values():
            corpus = queries[members[0]].corpus
            self._sync_inserts(corpus)
            got.append(corpus.batch_get([queries[i].state for i in members], [queries[i].context for i in members],
                                        [queries[i].total for i in members]))
        if len(got) == 1:  # one corpus (the usual case): its answers are in query order already
            ids, mask = got[0]
        else:
            order = np.argsort(np.concatenate([np.asarray(m) for m in groups.values()]), kind="stable")
            ids = np.concatenate([g[0].reshape(-1, d) for g in got])[order]
            mask = np.concatenate([g[1].reshape(-1, d * d) for g in got])[order]
        n = len(queries)
        tokens = ids.reshape(n, d).tolist()
        m = mask.reshape(n, d, d)  # 0/1: row i's ancestors and itself
        depths = (m.sum(-1) - 1).tolist()
        # the parent: the highest-numbered ancestor before the row (level order), -1 where there is none
        parents = ((m * _ancestor_rank(d)).max(-1) - 1).tolist()
        out = []
        for tok, par, dep in zip(tokens, parents, depths):
            n = d
            while n > 1 and dep[n - 1] == 1 and tok[n - 1] == 0:  # SGLang's padding (a real token 0 at the
                n -= 1  # tail, childless at depth 1, is dropped with it: one candidate less, nothing wrong)
            tree = (tok[:n], par[:n], dep[:n])
            out.append(_siblings_reversed(*tree) if self._reversed else tree)
        return out


@functools.lru_cache(maxsize=8)
def _ancestor_rank(d: int) -> np.ndarray:
    """[d, d] int64: ``j + 1`` where column ``j`` lies before row ``i`` (a possible ancestor), else 0."""
    j = np.arange(d)
    return np.where(j[None, :] < j[:, None], j[None, :] + 1, 0)


def _siblings_reversed(tokens: list[int], parents: list[int], depths: list[int]
                       ) -> tuple[list[int], list[int], list[int]]:
    """One lookup's tree (level order, row 0 the root) with every node's children in reverse order, again in level
    order (:func:`sibling_order_reversed`); as it is where it is one chain (its deepest row as deep as it has rows
    below the root: no siblings to put in order)."""
    if is_chain(depths):
        return tokens, parents, depths
    n = len(tokens)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    order = [0]
    for node in order:  # level order, appended while walked
        order.extend(reversed(children[node]))
    row = [0] * n
    for r, i in enumerate(order):
        row[i] = r
    return ([tokens[i] for i in order], [-1] + [row[parents[i]] for i in order[1:]], [depths[i] for i in order])


def _storable(token: int) -> bool:
    """Whether ``token`` has an id of its own in a namespace: in ``[0, NAMESPACE_STRIDE - 1)`` (else it is a
    skipped prompt position, -1, or beyond the stride, and becomes the namespace's separator)."""
    return 0 <= token < NAMESPACE_STRIDE - 1


def _in_namespace(tokens: Sequence[int], offset: int) -> list[int]:
    """``tokens`` as ids of the namespace at ``offset`` (``NAMESPACE_STRIDE``); a token that is not
    :func:`_storable` becomes the namespace's separator, which no trie holds."""
    sep = offset + NAMESPACE_STRIDE - 1
    return [offset + t if _storable(t) else sep for t in tokens]


def _after_separators(tokens: list[int]) -> list[int]:
    """The tokens after the last one that is not :func:`_storable` (all where there is none)."""
    for i in range(len(tokens) - 1, -1, -1):
        if not _storable(tokens[i]):
            return tokens[i + 1:]
    return tokens


def chain_state(state: str) -> str:
    """The match-state id of the continuation lookups of the request whose lookups use ``state``."""
    return state if state.endswith(_CHAIN) else state + _CHAIN


@dataclass
class _Query:
    """One corpus lookup of a proposal: batch index ``b``, the ``corpus`` and its match-state id ``state``, the
    ``context`` (the last ``max_trie_depth`` tokens, in the corpus's ids: ``offset`` plus the token) and the tokens
    so far ``total``; ``depth``: its root's depth in the proposal (a chain's continuation: the chain's end); ``order``:
    its place among the proposal's lookups (a continuation joins the tree right after the lookup it continues)."""

    b: int
    corpus: Any
    state: str
    context: list[int]
    total: int
    offset: int = 0
    depth: int = 0
    order: tuple = ()

    def extend(self, chain: list[int], context_len: int) -> "_Query":
        """The lookup of the continuation of ``chain`` (this lookup's result: its root, then one token per depth)
        from its last ``context_len`` tokens, under a match state of its own (:func:`chain_state`)."""
        k = len(chain) - 1
        return _Query(self.b, self.corpus, chain_state(self.state), (self.context + chain[1:])[-context_len:],
                      self.total + k, self.offset, self.depth + k, self.order + (1,))


class NgramCandidates:
    """``NgramSource`` as a candidate source of the one round (``glance_sgl.round.CandidateSource``):
    ``propose(batch, rows)`` / ``commit(batch, taps, walk)`` on a round batch (read by duck typing: ``rids``,
    ``roots`` [bs] long, ``tokens``: each request's tokens so far, prompt + output), ``finish(rid)`` when a request
    ends (its answer joins the cross-request corpus).

    A request the source has not seen is added from ``batch.tokens`` (all of them as its own corpus) with the key
    ``keys.get(rid)`` (``set_key``); without ``batch.tokens`` it gets root-only proposals. A request whose last
    token is not the batch's root (the engine dropped tokens at a stop) is re-added from ``batch.tokens``.
    ``acceptance`` scores the nodes (default: the source's prior); its ``SOURCE_NGRAM`` cells are learned in
    hindsight (``SourceAcceptance.observe_hindsight``: every proposed node against what the request committed
    next), not by the round's ``observe`` of the verified tree.
    """

    source_id = SOURCE_NGRAM

    def __init__(self, source: NgramSource, acceptance: SourceAcceptance | None = None) -> None:
        self.source = source
        self.acceptance = acceptance
        self.keys: dict[Hashable, str] = {}

    @property
    def acceptance(self) -> SourceAcceptance | None:
        """The table that scores this source's nodes and learns them in hindsight (None: the source's prior)."""
        return self._acceptance

    @acceptance.setter
    def acceptance(self, table: SourceAcceptance | None) -> None:
        if table is not None:
            table.hindsight.add(SOURCE_NGRAM)
        self._acceptance = table

    def set_key(self, rid: Hashable, key: str | None) -> None:
        """The API key / tenant of ``rid`` (``per-key`` scope), before its first round."""
        if key is not None:
            self.keys[rid] = key

    def start(self, rid: Hashable, prompt: Sequence[int], looks_first: bool = True) -> None:
        """``rid``'s prompt token ids, before its prefill (its key first, ``set_key``); the first committed token
        follows through ``source.commit``. A request not started here is added from its first round's
        ``batch.tokens``. ``looks_first``: its first round will look its matches up (the planner's
        ``looks_first``): the prompt goes into the corpus now, while the prefill runs; else before its first
        lookup, if any."""
        if self.source.available and rid not in self.source:
            self.source.add_request(rid, prompt, self.keys.get(rid))
            if looks_first:
                self.source.insert_prompt(rid)

    def _sync(self, batch: Any, roots: list[int]) -> None:
        src = self.source
        tokens = getattr(batch, "tokens", None)
        for b, rid in enumerate(batch.rids):
            known = rid in src
            if known and src.root(rid) == roots[b]:
                continue
            if tokens is None or not tokens[b] or int(tokens[b][-1]) != roots[b]:
                continue
            answer: list[int] = []
            lead = None
            if known:  # keep what it had answered, less the tokens the engine dropped
                old = src._requests[rid]
                keep = len(old.answer) - (old.total - len(tokens[b]))
                answer = old.answer[:keep] if keep > 0 else []
                lead = old.lead
                src.finish(rid, publish=False)
            src.add_request(rid, tokens[b], self.keys.get(rid))
            src._requests[rid].answer = answer
            if lead is not None:
                src._requests[rid].lead = lead

    def propose(self, batch: Any, rows: int | Sequence[int]) -> DraftTree:
        """Candidate trees [bs, <= rows] tagged ``SOURCE_NGRAM``, on the host (``rows``: one budget, or one per
        request; 1: the root alone, no lookup)."""
        roots = _host_roots(batch)
        if self.source.available:
            self._sync(batch, roots)
        return self.source.propose(batch.rids, rows, self.acceptance, roots=roots, device=torch.device("cpu"),
                                   strict=False)

    def commit(self, batch: Any, taps: torch.Tensor, walk: Any) -> None:
        """Feeds each request's committed tokens (``walk.committed()``) to its own corpus (``taps`` unused)."""
        if not self.source.available:
            return
        roots = _host_roots(batch)
        self._sync(batch, roots)
        self.source.commit_many([(rid, tokens) for b, (rid, tokens) in enumerate(zip(batch.rids, walk.committed()))
                                 if rid in self.source and self.source.root(rid) == roots[b]])

    def finish(self, rid: Hashable, publish: bool = True) -> None:
        """``rid`` ended: see ``NgramSource.finish``."""
        self.keys.pop(rid, None)
        self.source.finish(rid, publish)


def _host_roots(batch: Any) -> list[int]:
    """A round batch's roots as a host list (``RoundBatch.host_roots``: read once per round, or handed over by the
    engine; a batch without it: read)."""
    host_roots = getattr(batch, "host_roots", None)
    return host_roots() if host_roots is not None else [int(t) for t in batch.roots.tolist()]
