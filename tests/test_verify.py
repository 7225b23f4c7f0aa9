"""Verification: the host and tensor walks against a brute-force reference and each other; lossless sampling is
unbiased; the counter-based uniforms and the inverse CDF; the device path makes no host transfer."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from glance_sgl.host_transfers import count_host_transfers
from glance_sgl.tree import build_tree, topk_per_offset
from glance_sgl.verify import (
    SamplingSpec,
    WalkResult,
    counter_uniforms,
    device_walk,
    greedy_walk,
    inverse_cdf,
    process_logprobs,
    seed_tensor,
    target_choices,
    verify_tree,
)


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
    assert_same_walk(walk, device_walk(tokens, parents, choices, rows - 1))
    for b in range(bs):
        path, bonus = reference_walk(trees[b][0], trees[b][1], choices[b].tolist())
        n = int(walk.accept_lens[b])
        assert walk.accepted_rows[b, : n + 1].tolist() == path
        assert torch.all(walk.accepted_rows[b, n + 1 :] == -1)
        assert int(walk.bonus[b]) == bonus
        assert walk.committed()[b] == [trees[b][1][j] for j in path[1:]] + [bonus]


def test_root_only_tree():
    for walk in (greedy_walk(torch.tensor([[5]]), torch.tensor([[-1]]), torch.tensor([[9]])),
                 device_walk(torch.tensor([[5]]), torch.tensor([[-1]]), torch.tensor([[9]]), 0)):
        assert walk.accept_lens.tolist() == [0] and walk.bonus.tolist() == [9]
        assert walk.committed() == [[9]] and walk.committed_tokens.tolist() == [[9]]
    # verify_tree's shortcut for 1-row trees (AR steps) is both walks' result, at any depth cap
    rng = random.Random(0)
    for cap in (None, 0, 3):
        specs = random_specs(rng, 5)
        tokens, parents, depths, logits, next_index = random_batch(rng, 5, 1, 1, 50, specs)
        short = verify_tree(tokens, parents, depths, logits, next_index, specs, max_depth=cap)
        choices = target_choices(logits, depths, next_index, specs)
        for walk in (greedy_walk(tokens, parents, choices, cap),
                     device_walk(tokens, parents, choices, 0 if cap is None else cap)):
            assert_same_walk(short, walk)


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
        committed = walk.committed()[0]
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


# ------------------------------------------------------------------ host walk == tensor walk


def assert_same_walk(a: WalkResult, b: WalkResult) -> None:
    for field in ("accepted_rows", "accept_lens", "bonus", "committed_tokens"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype == torch.long and torch.equal(x, y), field


def capped_reference(parents, tokens, choices, cap):
    path, bonus = reference_walk(parents, tokens, choices)
    return path[: cap + 1], choices[path[min(cap, len(path) - 1)]]


def random_specs(rng: random.Random, bs: int, kind: str = "mixed") -> list[SamplingSpec]:
    def one() -> SamplingSpec:
        if kind == "greedy" or (kind == "mixed" and rng.random() < 0.4):
            return SamplingSpec()
        return SamplingSpec(rng.choice([0.3, 0.7, 1.0, 1.6]), rng.choice([1.0, 1.0, 0.9, 0.5]), rng.randrange(1 << 62),
                            top_k=rng.choice([0, 0, 1, 3, 20]), min_p=rng.choice([0.0, 0.0, 0.05, 0.3]))
    return [one() for _ in range(bs)]


def random_batch(rng: random.Random, bs: int, rows: int, max_depth: int, vocab: int, specs: list[SamplingSpec]):
    """Trees of depth <= ``max_depth`` (chains to bushes: each tree's parents are drawn among its last ``width``
    open rows) with random logits; most tokens are then set to their parent row's target choice (siblings may
    repeat a token), so walks are long. Returns tokens, parents, depths [B, R], logits [B, R, V], next_index [B]."""
    parents, depths = [], []
    for _ in range(bs):
        width = rng.choice([1, 2, 4, rows])
        par, dep = [-1], [0]
        for i in range(1, rows):
            p = rng.choice([j for j in range(i) if dep[j] < max_depth][-width:])
            par.append(p)
            dep.append(dep[p] + 1)
        parents.append(par)
        depths.append(dep)
    parents, depths = torch.tensor(parents), torch.tensor(depths)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = torch.randn(bs, rows, vocab, generator=gen) * rng.choice([0.5, 2.0, 6.0])
    next_index = torch.randint(0, 2000, (bs,), generator=gen)
    choices = target_choices(logits, depths, next_index, specs).tolist()
    tokens = torch.randint(0, vocab, (bs, rows), generator=gen).tolist()
    for b in range(bs):
        for i in range(1, rows):
            if rng.random() < 0.8:
                tokens[b][i] = choices[b][parents[b, i]]
    return torch.tensor(tokens), parents, depths, logits, next_index


@pytest.mark.parametrize("seed", range(12))
def test_tensor_walk_equals_host_walk(seed):
    """Random batches (B 1..8, R up to 64, depth up to 15, greedy and sampled requests, top-p < 1 too): the two
    paths of ``verify_tree`` agree field for field, and with the brute-force walk, at the trees' depth bound and
    at a smaller cap."""
    rng = random.Random(seed)
    accepted = []
    for _ in range(6):
        bs, rows, max_depth = rng.randint(1, 8), rng.randint(1, 64), rng.randint(1, 15)
        vocab = rng.choice([3, 50, 300])
        specs = random_specs(rng, bs)
        tokens, parents, depths, logits, next_index = random_batch(rng, bs, rows, max_depth, vocab, specs)
        choices = target_choices(logits, depths, next_index, specs)
        for cap in (max_depth, rng.randint(0, max_depth)):
            host = verify_tree(tokens, parents, depths, logits, next_index, specs, max_depth=cap)
            dev = verify_tree(tokens, parents, depths, logits, next_index, specs, max_depth=cap, device_resident=True)
            assert_same_walk(host, dev)
            assert dev.accepted_rows.shape == (bs, cap + 1)
            for b in range(bs):
                path, bonus = capped_reference(parents[b].tolist(), tokens[b].tolist(), choices[b].tolist(), cap)
                n = int(dev.accept_lens[b])
                assert dev.accepted_rows[b].tolist() == path + [-1] * (cap + 1 - len(path)) and n == len(path) - 1
                assert int(dev.bonus[b]) == bonus
                want = tokens[b, path[1:]].tolist() + [bonus]
                assert dev.committed()[b] == want
                assert dev.committed_tokens[b].tolist() == want + [-1] * (cap + 1 - len(want))
            accepted += dev.accept_lens.tolist()
    assert sum(accepted) / len(accepted) > 1 and max(accepted) >= 5, accepted  # forced tokens: long walks


def test_budget_trees_and_large_batches_take_the_tensor_walk():
    """Best-first budget trees; a CPU batch above HOST_WALK_MAX_BATCH walks in tensor ops, same result."""
    gen = torch.Generator().manual_seed(3)
    bs, depth, vocab = 40, 6, 30
    vals, ids = topk_per_offset(torch.log_softmax(torch.randn(bs, depth, vocab, generator=gen) * 3, -1), 3)
    tree = build_tree(vals, ids, torch.randint(0, vocab, (bs,), generator=gen), 31)
    choices = torch.roll(tree.tokens, -1, 1)  # the target mostly agrees with the spine
    host = greedy_walk(tree.tokens, tree.parents, choices, depth)
    assert_same_walk(host, device_walk(tree.tokens, tree.parents, choices, depth))
    logits = torch.randn(bs, tree.num_rows, vocab, generator=gen)
    specs = [SamplingSpec()] * bs
    with count_host_transfers() as counter:
        walk = verify_tree(tree.tokens, tree.parents, tree.depths, logits, torch.zeros(bs, dtype=torch.long), specs,
                           max_depth=depth)
    assert counter.total == 0
    assert_same_walk(walk, greedy_walk(tree.tokens, tree.parents, logits.argmax(-1), depth))


# ------------------------------------------------------------------ no host transfers on the device path


@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("vocab", [50, 5000])
@pytest.mark.parametrize("kind", ["greedy", "sampled", "mixed"])
def test_device_path_makes_no_host_transfer(bs, vocab, kind):
    rng = random.Random(bs * vocab)
    specs = random_specs(rng, bs, kind)
    tokens, parents, depths, logits, next_index = random_batch(rng, bs, 32, 8, vocab, specs)
    with count_host_transfers() as counter:
        choices = target_choices(logits, depths, next_index, specs)
        walk = device_walk(tokens, parents, choices, 8)
        same = verify_tree(tokens, parents, depths, logits, next_index, specs, max_depth=8, device_resident=True)
    assert counter.total == 0, counter.calls
    assert_same_walk(walk, same)
    with count_host_transfers() as counter:  # the counter does see the host walk's copies
        greedy_walk(tokens, parents, choices, 8)
    assert counter.calls == {"tolist": 3}


def test_device_path_runs_without_data():
    """On the meta device (shapes, no data) any read of a value would raise: the device path reads none, not even
    through syncs the counter cannot see (nonzero, boolean masks)."""
    bs, rows, vocab = 3, 8, 50
    meta = dict(device="meta", dtype=torch.long)
    specs = [SamplingSpec(), SamplingSpec(0.7, 0.9, 3), SamplingSpec(1.0, 1.0, 5)]
    walk = verify_tree(torch.zeros(bs, rows, **meta), torch.zeros(bs, rows, **meta), torch.zeros(bs, rows, **meta),
                       torch.zeros(bs, rows, vocab, device="meta"), torch.tensor([1, 2, 3]), specs, max_depth=4,
                       device_resident=True)
    assert walk.accepted_rows.shape == walk.committed_tokens.shape == (bs, 5)
    assert walk.bonus.shape == walk.accept_lens.shape == (bs,) and walk.bonus.device.type == "meta"


READS = {
    "item": lambda t: t.item(), "tolist": lambda t: t.tolist(), "cpu": lambda t: t.cpu(), "numpy": lambda t: t.numpy(),
    "__bool__": bool, "__int__": int, "__float__": float, "__complex__": complex, "__index__": lambda t: [0, 1][t],
    "__array__": np.asarray, "__contains__": lambda t: 1 in t, "__format__": lambda t: f"{t}", "__repr__": repr,
}


@pytest.mark.parametrize("name", READS)
def test_counter_sees_each_host_read(name):
    with count_host_transfers() as counter:
        READS[name](torch.tensor([1]))
    assert counter.calls == {name: 1}


def test_counter_counts_to_cpu_off_a_device_only():
    host, meta = torch.zeros(2), torch.zeros(2, device="meta")
    with count_host_transfers() as counter:
        host.to("cpu"), host.to(torch.float64), host.to(meta), host.to(host), meta.to(torch.float64), len(host)
        assert counter.total == 0
        for move in (lambda: meta.to("cpu"), lambda: meta.to(device=torch.device("cpu")), lambda: meta.to(host)):
            with pytest.raises(NotImplementedError):  # a meta tensor has no data to copy, but the call was seen
                move()
    assert counter.calls == {"to": 3}


# ------------------------------------------------------------------ batched sampling


def test_batched_choices_match_one_request_at_a_time():
    """A request's choices do not depend on the batch around it (other temperatures, top-p, greedy rows)."""
    rng = random.Random(5)
    specs = random_specs(rng, 8)
    specs[0] = SamplingSpec(0.8, 1.0, 11)  # next to requests with top-p < 1
    tokens, parents, depths, logits, next_index = random_batch(rng, 8, 20, 6, 400, specs)
    batched = target_choices(logits, depths, next_index, specs)
    for b, spec in enumerate(specs):
        alone = target_choices(logits[b : b + 1], depths[b : b + 1], next_index[b : b + 1], [spec])
        assert torch.equal(batched[b], alone[0]), b
        if spec.greedy:
            assert torch.equal(batched[b], logits[b].argmax(-1))


def test_per_request_process_logprobs_matches_the_scalar_one():
    logits = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(0)) * 3
    temperature, top_p = [0.5, 1.0, 1.7], [1.0, 0.6, 0.95]
    batched = process_logprobs(logits, torch.tensor(temperature)[:, None, None], torch.tensor(top_p)[:, None, None])
    for b in range(3):
        torch.testing.assert_close(batched[b], process_logprobs(logits[b], temperature[b], top_p[b]), rtol=0, atol=1e-6)
        assert torch.equal(torch.isinf(batched[b]), torch.isinf(process_logprobs(logits[b], temperature[b], top_p[b])))


def test_top_k_and_min_p_filter_like_sglangs_sampler():
    """Top-k keeps the k most likely tokens, min-p those at least min_p times as likely as the most likely one, and
    with top-p the filters intersect (SGLang's sampler zeroes each one's tokens on the same tempered distribution);
    the rest is renormalised. Per-request tensors give each row its own filters, and rows without any keep the
    tempered log-softmax exactly."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log()
    kept = lambda lp: torch.isfinite(lp).nonzero().flatten().tolist()  # noqa: E731
    assert kept(process_logprobs(logits, 1.0, top_k=2)) == [0, 1]
    assert kept(process_logprobs(logits, 1.0, min_p=0.3)) == [0, 1, 2]  # >= 0.12
    assert kept(process_logprobs(logits, 1.0, top_p=0.85, top_k=4, min_p=0.2)) == [0, 1, 2, 3]  # each: 0-3
    assert kept(process_logprobs(logits, 1.0, top_p=0.85, top_k=4, min_p=0.3)) == [0, 1, 2]  # min-p: 0-2
    assert kept(process_logprobs(logits, 1.0, top_p=0.6, top_k=4, min_p=0.2)) == [0, 1]  # top-p: 0-1
    assert kept(process_logprobs(logits, 1.0, top_k=1, min_p=0.99)) == [0]
    lp = process_logprobs(logits, 1.0, top_k=3)
    torch.testing.assert_close(lp[:3].exp(), probs[:3] / probs[:3].sum())
    gen = torch.Generator().manual_seed(1)
    batch = torch.randn(4, 3, 50, generator=gen) * 3
    temperature, top_p, top_k, min_p = [0.6, 1.0, 1.3, 0.9], [1.0, 0.8, 1.0, 1.0], [0, 5, 0, 12], [0.0, 0.1, 0.0, 0.0]
    batched = process_logprobs(batch, torch.tensor(temperature)[:, None, None], torch.tensor(top_p)[:, None, None],
                               torch.tensor(top_k)[:, None, None], torch.tensor(min_p)[:, None, None])
    for b in range(4):
        alone = process_logprobs(batch[b], temperature[b], top_p[b], top_k[b], min_p[b])
        torch.testing.assert_close(batched[b], alone, rtol=0, atol=1e-6)
        assert torch.equal(torch.isinf(batched[b]), torch.isinf(alone))
    assert torch.equal(batched[0], torch.log_softmax(batch[0] / 0.6, dim=-1))  # no filter: untouched
    assert torch.equal(batched[2], torch.log_softmax(batch[2] / 1.3, dim=-1))


@pytest.mark.parametrize("spec", [SamplingSpec(0.9, 1.0, 5, top_k=3), SamplingSpec(1.2, 0.95, 9, min_p=0.1),
                                  SamplingSpec(0.8, 0.9, 2, top_k=5, min_p=0.05)])
def test_filtered_choices_follow_the_filtered_distribution(spec):
    """20k rows at distinct output indices with top-k / min-p (and top-p): the choices' histogram is the filtered
    distribution, and no filtered-out token is ever chosen."""
    n, vocab = 20_000, 8
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    choices = target_choices(row.expand(1, n, vocab), torch.arange(n)[None], torch.tensor([7]), [spec])[0]
    p = process_logprobs(row, spec.temperature, spec.top_p, spec.top_k, spec.min_p).exp()
    counts = torch.bincount(choices, minlength=vocab)
    kept = p > 0
    assert counts[~kept].sum() == 0 and 1 < kept.sum() < vocab
    expected = p[kept].double() / p[kept].double().sum() * n
    assert chisquare(counts[kept].double().numpy(), expected.numpy()).pvalue > 1e-3


def test_choices_follow_the_processed_distribution():
    """20k rows at distinct output indices: the choices' histogram is the tempered nucleus distribution."""
    n, vocab = 20_000, 8
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    logits = row.expand(1, n, vocab)
    spec = SamplingSpec(temperature=0.7, top_p=0.9, seed=123)
    choices = target_choices(logits, torch.arange(n)[None], torch.tensor([40]), [spec])[0]
    p = process_logprobs(row, 0.7, 0.9).exp()
    counts = torch.bincount(choices, minlength=vocab)
    kept = p > 0
    assert counts[~kept].sum() == 0 and 0 < kept.sum() < vocab
    assert chisquare(counts[kept].numpy(), (p[kept] * n).numpy()).pvalue > 1e-3
    assert (counts / n - p).abs().max() < 0.015


# ------------------------------------------------------------------ counter-based uniforms, inverse CDF


def test_uniforms_are_keyed_by_seed_and_index_alone():
    seeds = [0, 7, -1, (1 << 70) + 3]
    indices = [[0, 1, 2], [5, 5, 10**6], [3, 2, 1], [17, 0, (1 << 32) - 1]]
    u = counter_uniforms(seed_tensor(seeds), torch.tensor(indices))
    assert u.shape == (4, 3) and u.dtype == torch.float64
    for b, s in enumerate(seeds):
        for r, i in enumerate(indices[b]):
            assert torch.equal(counter_uniforms(seed_tensor([s]), torch.tensor([[i]]))[0, 0], u[b, r])
    assert u[1, 0] == u[1, 1] and u[0, 0] != u[3, 1]  # the same (seed, index): the same uniform


def test_choices_invert_the_distribution_at_the_keyed_uniforms():
    """``target_choices`` (request keys hashed on the host) samples each row at ``counter_uniforms``: the first
    token whose cumulative probability exceeds the uniform."""
    seeds = [0, -5, (1 << 70) + 3, (1 << 63) - 1]
    specs = [SamplingSpec(0.9, 1.0, s) for s in seeds]
    logits = torch.randn(4, 6, 100, generator=torch.Generator().manual_seed(1))
    depths, next_index = torch.tensor([[0, 1, 1, 2, 3, 3]] * 4), torch.tensor([0, 9, 10**6, 3])
    u = counter_uniforms(seed_tensor(seeds), depths + next_index[:, None])
    cdf = process_logprobs(logits, 0.9).double().exp().cumsum(-1)
    want = (cdf < u[..., None] * cdf[..., -1:]).sum(-1)  # tokens whose cumulative mass stays at or under u
    assert torch.equal(target_choices(logits, depths, next_index, specs), want)


def test_uniforms_from_python_ints_are_the_tensor_ones():
    """``target_choices`` hashes a few sampled rows on a CPU from Python ints (``HOST_UNIFORMS_MAX``): the same bits
    as the tensor hash, for any seed and index."""
    from glance_sgl.verify import _host_uniforms, _keyed_uniforms, _seed_keys

    rng = random.Random(3)
    seeds = [0, -1, (1 << 63) - 1, -(1 << 63), (1 << 70) + 3] + [rng.randrange(-(1 << 80), 1 << 80) for _ in range(27)]
    indices = [[rng.randrange(1 << 32) for _ in range(9)] + [0, (1 << 32) - 1] for _ in seeds]
    keys = [_seed_keys(s) for s in seeds]
    assert torch.equal(_host_uniforms(keys, indices), _keyed_uniforms(torch.tensor(keys), torch.tensor(indices)))
    assert torch.equal(_host_uniforms(keys, indices), counter_uniforms(seed_tensor(seeds), torch.tensor(indices)))


def test_uniform_hash_is_pinned():
    """The hash fixes every seeded output: a change to it must be deliberate (these are its first words)."""
    u = counter_uniforms(seed_tensor([0, (1 << 70) + 3]), torch.tensor([[0, 1, 2, 3], [17, 18, 19, 20]]))
    assert (u * 2**32 - 0.5).long().tolist() == PINNED_HASHES


PINNED_HASHES = [[2488251732, 3002921059, 4258319090, 516850854], [304084951, 2283722730, 3931094426, 1798694801]]


def test_uniforms_are_open_unit_distinct_and_uncorrelated():
    seeds, n_index = list(range(64)), 4096
    u = counter_uniforms(seed_tensor(seeds), torch.arange(n_index).expand(len(seeds), n_index))
    assert bool(((u > 0) & (u < 1)).all()) and abs(float(u.mean()) - 0.5) < 0.005
    assert u.numel() - u.unique().numel() < 64  # birthday bound for 2**18 32-bit values: ~8
    for x, y in ((u[:, 1:], u[:, :-1]), (u[1:], u[:-1])):  # adjacent indices, adjacent seeds
        assert abs(float(torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1])) < 0.01


def test_inverse_cdf_never_draws_a_token_without_mass():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]])
    u = [torch.tensor([x], dtype=torch.float64) for x in (1e-12, 0.29, 0.31, 1.0 - 1e-12)]
    assert [int(inverse_cdf(probs, x)) for x in u] == [1, 1, 3, 3]
    assert int(inverse_cdf(torch.tensor([[0.0, 2.0, 0.0]]), torch.tensor([0.999999], dtype=torch.float64))) == 1


@pytest.mark.parametrize("over", ["indices", "seeds"])
def test_sampling_follows_the_softmax(over):
    n, vocab = 20_000, 6
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -2.0])
    if over == "indices":
        # one request's rows at depths 0 .. n-1: output indices 0 .. n-1
        choices = target_choices(logits.expand(1, n, vocab), torch.arange(n)[None], torch.zeros(1, dtype=torch.long),
                                 [SamplingSpec(1.0, 1.0, 31)])[0]
    else:
        specs = [SamplingSpec(1.0, 1.0, s) for s in range(n)]
        choices = target_choices(logits.expand(n, 1, vocab), torch.zeros(n, 1, dtype=torch.long),
                                 torch.full((n,), 7), specs)[:, 0]
    p = torch.softmax(logits, -1)
    counts = torch.bincount(choices, minlength=vocab)
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3
    assert (counts / n - p).abs().max() < 0.015


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    """Uniforms bit for bit, and the whole device path on CUDA with no
    counted transfer, equal to the CPU result."""
    seeds, indices = seed_tensor([1, 2, (1 << 62) + 5]), torch.randint(0, 1 << 20, (3, 64))
    assert torch.equal(counter_uniforms(seeds, indices), counter_uniforms(seeds, indices.cuda()).cpu())
    rng = random.Random(0)
    specs = random_specs(rng, 8)
    tokens, parents, depths, logits, next_index = random_batch(rng, 8, 32, 8, 5000, specs)
    on = [t.cuda() for t in (tokens, parents, depths, logits)]
    with count_host_transfers() as counter:
        walk = verify_tree(*on, next_index, specs, max_depth=8)
    assert counter.total == 0, counter.calls
    assert walk.committed_tokens.is_cuda
    want = verify_tree(tokens, parents, depths, logits, next_index, specs, max_depth=8)
    assert_same_walk(want, WalkResult(*(t.cpu() for t in (walk.accepted_rows, walk.accept_lens, walk.bonus,
                                                          walk.committed_tokens))))


def test_reads_of_host_copies_are_not_counted_and_device_reads_still_are():
    from glance_sgl.host_transfers import on_host

    host, meta = torch.zeros(2), torch.zeros(2, device="meta")
    with on_host():  # no counter: a no-op
        host.tolist()
    with count_host_transfers() as counter:
        host.tolist()
        with on_host():
            host.tolist(), host.cpu(), float(host[0])
            with pytest.raises(NotImplementedError):  # a meta tensor has no data, but the read was seen
                meta.to("cpu")
        host[0].item()
    assert counter.calls == {"tolist": 1, "to": 1, "item": 1}


def test_a_walks_host_copy_is_one_exact_read():
    from glance_sgl.tree import DraftTree

    big = (1 << 19) + 12345  # token ids far above float32's exact range of a sum, exact in the copy
    walk = WalkResult(accepted_rows=torch.tensor([[0, 3, -1], [0, -1, -1]]), accept_lens=torch.tensor([1, 0]),
                      bonus=torch.tensor([big, 7]), committed_tokens=torch.tensor([[big - 1, big, -1], [7, -1, -1]]))
    lead = torch.tensor([0.25, 1.5])
    with count_host_transfers() as counter:
        same, same_lead = walk.host_copy(lead)  # a CPU walk is its own copy; the read call is still made
    assert same is walk and same_lead is lead and counter.total == 1
    with count_host_transfers() as counter:
        copy, lead_host = walk._copy_to_host(lead)  # what a device walk does
    assert counter.total == 1 and walk.host is copy
    for name in ("accepted_rows", "accept_lens", "bonus", "committed_tokens"):
        assert getattr(copy, name).dtype == torch.long and torch.equal(getattr(copy, name), getattr(walk, name))
    assert lead_host.tolist() == [0.25, 1.5] and walk.committed() == [[big - 1, big], [7]]
    tree = DraftTree(torch.tensor([[5, big]]), torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]),
                     torch.tensor([[0.0, -0.7]]), torch.tensor([[0, 3]]))
    with count_host_transfers() as counter:
        t = tree._copy_to_host()
    assert counter.total == 1 and torch.equal(t.tokens, tree.tokens) and torch.equal(t.sources, tree.sources)
    assert torch.equal(t.scores, tree.scores) and t.scores.dtype == torch.float32 and t.tokens.dtype == torch.long
    untagged = DraftTree(tree.tokens, tree.parents, tree.depths, tree.scores)
    assert untagged._copy_to_host().sources is None and untagged.host_copy() is untagged
