"""Lossless: GLANCE greedy output == Hugging Face generate(do_sample=False) == the engine's AR path.

Tiny randomly initialised Qwen2.5-VL and Qwen2-VL targets, fp32 on CPU, random drafters, 50 prompts per target
with images of three sizes, two images, or none; the budget tree, the width-1 chain and the widest budget.
"""

from __future__ import annotations

import pytest
import torch

from glance_sgl.engine import GlanceEngine, SamplingParams
from glance_sgl.tree import max_tree_size

from glance_sgl.planner import RandomPlanner

from tests.glance_testing import ARCHS, make_prompts, random_drafter

N_PROMPTS = 50
MAX_TOKENS = 24


def hf_greedy(target, messages, max_tokens: int) -> list[int]:
    prompt = target.prepare(messages)
    with torch.no_grad():
        out = target.model.generate(**prompt.inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, prompt.num_tokens :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_glance_tree_matches_generate_and_ar(arch, targets, engines):
    target, engine = targets[arch], engines[arch]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    accepted_total = 0
    for i, messages in enumerate(make_prompts(N_PROMPTS, seed=11)):
        reference = hf_greedy(target, messages, MAX_TOKENS)
        ar = engine.generate(messages, params, mode="ar")
        glance = engine.generate(messages, params, mode="glance")  # the cost-aware planner (the default)
        assert ar.token_ids == reference, f"prompt {i}: AR path differs from generate"
        assert glance.token_ids == reference, f"prompt {i}: GLANCE differs from generate"
        assert glance.text == ar.text
        m = glance.metrics
        assert m.planner == "auto"
        assert m.completion_tokens == len(reference) == 1 + sum(m.committed_per_round)
        assert m.drafted_tokens == sum(r - 1 for r in m.rows_per_round)
        assert max(m.rows_per_round) <= engine.max_nodes + 1
        accepted_total += m.accepted_tokens
        if i % 3 == 0:  # the fixed tree: every round drafts and verifies the budget, less the rows past the end
            fixed = engine.generate(messages, params, planner="fixed")
            assert fixed.token_ids == reference, f"prompt {i}: GLANCE (fixed tree) differs from generate"
            assert max(fixed.metrics.rows_per_round) == engine.budget + 1
            assert fixed.metrics.drafted_tokens <= fixed.metrics.rounds * engine.budget
            accepted_total += fixed.metrics.accepted_tokens
    # the random drafter is right now and then (the targets repeat themselves): acceptance paths are exercised
    assert accepted_total > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_chain_and_widest_budget(arch, targets):
    target = targets[arch]
    drafter = random_drafter(target, seed=3, block_size=6)
    widest = max_tree_size(5, 4)  # every node of the k=4, depth-5 candidate tree
    chain = GlanceEngine(target, drafter, mode="chain")
    wide = GlanceEngine(target, drafter, budget=widest, branch_k=4, planner="fixed")
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for i, messages in enumerate(make_prompts(N_PROMPTS, seed=12)):
        reference = hf_greedy(target, messages, MAX_TOKENS)
        got_chain = chain.generate(messages, params)
        assert got_chain.token_ids == reference, f"prompt {i}: chain differs"
        assert max(got_chain.metrics.rows_per_round) == 6  # the block's 5 drafts, less the rows past the end
        assert got_chain.metrics.drafted_tokens <= got_chain.metrics.rounds * 5
        if i % 10 == 0:  # the widest tree (1364 nodes, about 2 s a prompt on 2 cores): every tenth prompt
            got_wide = wide.generate(messages, params)
            assert got_wide.token_ids == reference, f"prompt {i}: widest budget differs"
            assert max(got_wide.metrics.rows_per_round) == widest + 1
            assert got_wide.metrics.drafted_tokens <= got_wide.metrics.rounds * widest


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_sampling_same_seed_same_tokens(arch, engines):
    """At T > 0 a seeded request gives the same tokens with and without speculation."""
    engine = engines[arch]
    for i, messages in enumerate(make_prompts(6, seed=13)):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i)
        ar = engine.generate(messages, params, mode="ar")
        glance = engine.generate(messages, params, mode="glance")
        assert glance.token_ids == ar.token_ids, f"prompt {i}"


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_random_tree_sizes_and_ar_rounds(arch, engines):
    """Whatever the planner picks per round (no draft, the root alone, any prefix of the tree), greedy and seeded
    sampled outputs equal the AR path's token for token."""
    engine = engines[arch]
    engine.install_planner("random", RandomPlanner(engine.cost_model(), engine.max_nodes, engine.block_size - 1,
                                                   seed=7))
    rows_seen: set[int] = set()
    skipped = 0
    for i, messages in enumerate(make_prompts(16, seed=14)):
        for params in (SamplingParams(max_tokens=MAX_TOKENS),
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=300 + i)):
            ar = engine.generate(messages, params, mode="ar")
            got = engine.generate(messages, params, planner="random")
            assert got.token_ids == ar.token_ids, f"prompt {i}, temperature {params.temperature}"
            m = got.metrics
            assert m.completion_tokens == 1 + sum(m.committed_per_round)
            rows_seen |= set(m.rows_per_round)
            skipped += m.rounds_without_drafting
    assert skipped > 0 and 1 in rows_seen and len(rows_seen) > 5  # AR rounds, root-only and many tree sizes ran


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_random_source_mixes(arch, engines):
    """Candidate sources mixed at random: n-gram matches alone (no drafter pass), the drafter alone, both merged
    into one tree, AR rounds, any tree size. Greedy and seeded sampled outputs equal the AR path's token for token,
    and n-gram candidates were verified and accepted."""
    base = engines[arch]
    engine = GlanceEngine(base.target, base.drafter, draft_sources=("drafter", "ngram"))
    engine.install_planner("random", RandomPlanner(engine.cost_model(), engine.max_nodes, engine.block_size - 1,
                                                   seed=9))
    ngram_rounds = ngram_accepted = merged_rounds = 0
    for i, messages in enumerate(make_prompts(10, seed=15)):
        for params in (SamplingParams(max_tokens=MAX_TOKENS),
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=400 + i)):
            ar = engine.generate(messages, params, mode="ar")
            for sources in (("drafter", "ngram"), ("ngram",)):
                got = engine.generate(messages, params, planner="random", draft_sources=sources)
                assert got.token_ids == ar.token_ids, f"prompt {i}, {sources}, temperature {params.temperature}"
                m = got.metrics
                assert m.completion_tokens == 1 + sum(m.committed_per_round)
                if sources == ("ngram",):
                    assert m.drafter_passes == 0
                    ngram_rounds += sum(r > 1 for r in m.rows_per_round)
                    ngram_accepted += m.accepted_tokens
                else:
                    merged_rounds += m.drafter_passes
    assert ngram_rounds > 0 and ngram_accepted > 0 and merged_rounds > 0


def test_lossless_with_the_compiled_drafter_pass(targets):
    """The drafter's block pass through torch.compile (``compile_drafter``, what ``glance serve`` and ``glance
    bench`` run on a CPU): its drafts may differ from the eager pass's in the last float bits, the output never does
    (greedy and seeded sampling, the auto planner's trees and the chain)."""
    target = targets["qwen2_5_vl"]
    engine = GlanceEngine(target, random_drafter(target, seed=5, block_size=6), compile_drafter=True,
                          draft_sources=("drafter", "ngram"))
    assert engine.drafter.block_compiled
    for i, messages in enumerate(make_prompts(8, seed=16)):
        for params in (SamplingParams(max_tokens=MAX_TOKENS),
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=500 + i)):
            ar = engine.generate(messages, params, mode="ar")
            for mode in ("glance", "chain"):
                got = engine.generate(messages, params, mode=mode)
                assert got.token_ids == ar.token_ids, f"prompt {i}, {mode}, temperature {params.temperature}"
    assert engine.drafter.block_compiled  # compiled throughout, not fallen back to the eager pass
