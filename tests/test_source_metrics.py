"""Per-source metrics (issue 27, "users see it"): ``metrics.source_counts`` on hand-made trees and walks, and the
embedded engine's per-request counts over random source mixes (drafter, n-gram, merged; lossless against AR),
the n-gram corpus key per request (scope ``per-key``)."""

from __future__ import annotations

import pytest
import torch

from glance_sgl.engine import GlanceEngine, RequestError, SamplingParams
from glance_sgl.metrics import SOURCE_KEYS, RequestMetrics, source_counts
from glance_sgl.ngram_source import NgramSettings, ngram_corpus_class
from glance_sgl.planner import RandomPlanner
from glance_sgl.tree import SOURCE_BOTH, SOURCE_DRAFTER, SOURCE_NGRAM, SOURCE_NONE, DraftTree
from glance_sgl.verify import WalkResult
from tests.glance_testing import make_prompts

needs_ngram = pytest.mark.skipif(ngram_corpus_class()[0] is None, reason=str(ngram_corpus_class()[1]))


def walk_of(rows: list[list[int]]) -> WalkResult:
    accepted = torch.tensor(rows)
    lens = (accepted >= 0).sum(dim=1) - 1
    return WalkResult(accepted, lens, torch.zeros(len(rows), dtype=torch.long), torch.full_like(accepted, -1))


def tree_of(parents: list[list[int]], tags: list[list[int]] | None) -> DraftTree:
    par = torch.tensor(parents)
    depths = torch.zeros_like(par)
    for b in range(par.shape[0]):
        for r in range(1, par.shape[1]):
            depths[b, r] = depths[b, par[b, r]] + 1 if par[b, r] >= 0 else 0
    return DraftTree(torch.arange(par.numel()).view(par.shape), par, depths, torch.zeros(par.shape),
                     None if tags is None else torch.tensor(tags))


def test_source_counts_by_tag():
    # request 0: root -> 1 (drafter) -> 3 (both) -> 4 (ngram); 2 (ngram) beside 1. The walk takes 1, 3, 4.
    # request 1: the same shape, padded at row 4; the walk takes row 2 (ngram) only.
    parents = [[-1, 0, 0, 1, 3], [-1, 0, 0, 1, 0]]
    tags = [[SOURCE_NONE, SOURCE_DRAFTER, SOURCE_NGRAM, SOURCE_BOTH, SOURCE_NGRAM],
            [SOURCE_NONE, SOURCE_DRAFTER, SOURCE_NGRAM, SOURCE_DRAFTER, SOURCE_NONE]]
    counts = source_counts(tree_of(parents, tags), walk_of([[0, 1, 3, 4], [0, 2, -1, -1]]))
    assert counts[0] == {"drafter": (True, 1), "ngram": (True, 1), "both": (True, 1)}
    assert counts[1] == {"drafter": (True, 0), "ngram": (True, 1), "both": (False, 0)}
    # an untagged tree is the drafter's; a root-only tree (an AR step) verified no source
    plain = source_counts(tree_of([[-1, 0, 1]], None), walk_of([[0, 1, 2]]))[0]
    assert plain == {"drafter": (True, 2), "ngram": (False, 0), "both": (False, 0)}
    root = source_counts(tree_of([[-1]], [[SOURCE_NONE]]), walk_of([[0]]))[0]
    assert root == dict.fromkeys(SOURCE_KEYS, (False, 0))
    m = RequestMetrics(mode="glance")
    for c in counts:
        m.record_sources(c)
    assert m.sources == {"drafter": {"rounds": 2, "accepted_tokens": 1}, "ngram": {"rounds": 2, "accepted_tokens": 2},
                         "both": {"rounds": 1, "accepted_tokens": 1}}
    assert m.to_dict()["sources"] == m.sources


@pytest.fixture(scope="module")
def ngram_engine(engines):
    base = engines["qwen2_5_vl"]
    engine = GlanceEngine(base.target, base.drafter, draft_sources=("drafter", "ngram"),
                          ngram=NgramSettings(scope="per-key", max_depth=base.block_size - 1))
    engine.install_planner("random", RandomPlanner(engine.cost_model(), engine.max_nodes, engine.block_size - 1,
                                                   seed=3))
    return engine


@needs_ngram
def test_engine_counts_accepted_tokens_per_source(ngram_engine):
    """Over random source mixes and tree sizes the per-source accepted tokens add up to the request's accepted
    drafts, each source reports only its own nodes, and the output is the AR path's token for token."""
    engine = ngram_engine
    seen = dict.fromkeys(SOURCE_KEYS, 0)
    ngram_accepted = 0
    for i, messages in enumerate(make_prompts(6, seed=21)):
        params = SamplingParams(max_tokens=24)
        ar = engine.generate(messages, params, mode="ar")
        assert ar.metrics.sources == {k: {"rounds": 0, "accepted_tokens": 0} for k in SOURCE_KEYS}
        assert ar.metrics.draft_sources == ()
        for sources in (("drafter",), ("ngram",), ("drafter", "ngram")):
            got = engine.generate(messages, params, planner="random", draft_sources=sources, ngram_key=f"t{i % 2}")
            assert got.token_ids == ar.token_ids, f"prompt {i}, {sources}"
            m = got.metrics
            assert m.draft_sources == sources
            per = m.sources
            assert sum(v["accepted_tokens"] for v in per.values()) == m.accepted_tokens
            assert all(per[k]["rounds"] <= m.rounds for k in per)
            if sources == ("drafter",):
                assert per["ngram"] == per["both"] == {"rounds": 0, "accepted_tokens": 0}
            if sources == ("ngram",):
                assert per["drafter"] == per["both"] == {"rounds": 0, "accepted_tokens": 0}
            for k in SOURCE_KEYS:
                seen[k] += per[k]["rounds"]
            ngram_accepted += per["ngram"]["accepted_tokens"]
    # (nodes of both sources are rare with a random drafter: test_source_counts_by_tag covers them)
    assert seen["drafter"] > 0 and seen["ngram"] > 0 and ngram_accepted > 0
    # scope per-key: the requests' keys are the tenants whose corpora exist
    assert set(engine.ngram.source._corpora) == {"t0", "t1"}


@needs_ngram
def test_engine_refuses_bad_sources(ngram_engine, engines):
    messages = make_prompts(1, seed=2)[0]
    for bad in (["beam"], [], ("ngram", "nope")):
        with pytest.raises(RequestError) as err:
            ngram_engine.generate(messages, SamplingParams(max_tokens=2), draft_sources=bad)
        assert err.value.param == "draft_sources"
    with pytest.raises(RequestError, match="n-gram"):  # an engine started without the n-gram source
        engines["qwen2_5_vl"].generate(messages, SamplingParams(max_tokens=2), draft_sources=["ngram"])
    with pytest.raises(RequestError, match="glance"):
        ngram_engine.generate(messages, SamplingParams(max_tokens=2), mode="chain", draft_sources=["ngram"])
