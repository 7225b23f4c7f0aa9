"""Verification: the batched walk against a brute-force reference; lossless sampling is unbiased."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from glance_sgl.verify import SamplingSpec, greedy_walk, process_logprobs, target_choices, verify_tree


def random_tree(rng: random.Random, rows: int, vocab: int):
    parents = [-1] + [rng.randrange(0, i) for i in range(1, rows)]
    tokens = [rng.randrange(vocab) for _ in range(rows)]
    return parents, tokens


def reference_walk(parents, tokens, choices):
    cur, path = 0, [0]
    while True:
        want = choices[cur]
        kids = [j for j in range(len(parents)) if parents[j] == cur and tokens[j] == want]
        if not kids:
            return path, want
        cur = kids[0]
        path.append(cur)


@pytest.mark.parametrize("seed", range(5))
def test_walk_matches_brute_force(seed):
    rng = random.Random(seed)
    bs, rows, vocab = 6, 1 + rng.randrange(1, 40), 4  # small vocab: duplicate siblings and long matches
    trees = [random_tree(rng, rows, vocab) for _ in range(bs)]
    parents = torch.tensor([t[0] for t in trees])
    tokens = torch.tensor([t[1] for t in trees])
    choices = torch.randint(0, vocab, (bs, rows), generator=torch.Generator().manual_seed(seed))
    walk = greedy_walk(tokens, parents, choices)
    for b in range(bs):
        path, bonus = reference_walk(trees[b][0], trees[b][1], choices[b].tolist())
        n = int(walk.accept_lens[b])
        assert walk.accepted_rows[b, : n + 1].tolist() == path
        assert torch.all(walk.accepted_rows[b, n + 1 :] == -1)
        assert int(walk.bonus[b]) == bonus
        assert walk.committed(tokens)[b] == [trees[b][1][j] for j in path[1:]] + [bonus]


def test_root_only_tree():
    walk = greedy_walk(torch.tensor([[5]]), torch.tensor([[-1]]), torch.tensor([[9]]))
    assert walk.accept_lens.tolist() == [0] and walk.bonus.tolist() == [9]
    assert walk.committed(torch.tensor([[5]])) == [[9]]


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    lp = process_logprobs(logits, temperature=1.0, top_p=0.8)
    assert torch.isfinite(lp[:2]).all() and torch.isinf(lp[2:]).all()
    assert lp.exp().sum().item() == pytest.approx(1.0)
    assert torch.isfinite(process_logprobs(logits, 1.0, top_p=0.01)[0])


def sample_first_two(logits_root, logits_child, tree_tokens, parents, depths, seeds, spec_of):
    firsts, seconds = [], []
    for s in seeds:
        logits = torch.stack([logits_root] + [logits_child] * (tree_tokens.shape[0] - 1))[None]
        walk = verify_tree(tree_tokens[None], parents[None], depths[None], logits, torch.tensor([0]), [spec_of(s)])
        committed = walk.committed(tree_tokens[None])[0]
        firsts.append(committed[0])
        seconds.append(committed[1] if len(committed) > 1 else None)
    return firsts, seconds


def test_sampling_acceptance_follows_the_target_distribution():
    """First committed token ~ target's root distribution; the second (after an accepted draft) ~ the
    child's distribution. A chi-square test at a fixed seed; the biased control must fail it."""
    vocab = 6
    p_root = torch.tensor([0.05, 0.40, 0.25, 0.15, 0.10, 0.05])
    p_child = torch.tensor([0.30, 0.05, 0.05, 0.20, 0.20, 0.20])
    tokens = torch.tensor([0, 1, 2])  # root, then two drafted siblings: tokens 1 and 2
    parents = torch.tensor([-1, 0, 0])
    depths = torch.tensor([0, 1, 1])
    n = 3000
    firsts, seconds = sample_first_two(p_root.log(), p_child.log(), tokens, parents, depths, range(n),
                                       lambda s: SamplingSpec(temperature=1.0, seed=s))
    counts = torch.bincount(torch.tensor(firsts), minlength=vocab).float()
    assert chisquare(counts.numpy(), (p_root * n).numpy()).pvalue > 1e-3
    after = torch.tensor([s for f, s in zip(firsts, seconds) if f in (1, 2)])
    counts2 = torch.bincount(after, minlength=vocab).float()
    assert chisquare(counts2.numpy(), (p_child * len(after)).numpy()).pvalue > 1e-3

    # control: accepting the first drafted child whenever it is "plausible" (a biased rule) is caught
    biased = [1 if f in (1, 2, 3) else f for f in firsts]
    counts_b = torch.bincount(torch.tensor(biased), minlength=vocab).float()
    assert chisquare(counts_b.numpy(), (p_root * n).numpy()).pvalue < 1e-6


def test_choices_are_keyed_by_output_index():
    """The same (seed, output index) gives the same sample whichever row computes it."""
    logits = torch.randn(1, 4, 30)
    logits[0, 2] = logits[0, 1]
    spec = SamplingSpec(temperature=1.0, seed=42)
    same_depth = target_choices(logits, torch.tensor([[0, 1, 1, 2]]), torch.tensor([5]), [spec])
    assert same_depth[0, 1] == same_depth[0, 2]
    greedy = target_choices(logits, torch.tensor([[0, 1, 1, 2]]), torch.tensor([5]), [SamplingSpec()])
    assert torch.equal(greedy[0], logits[0].argmax(-1))
