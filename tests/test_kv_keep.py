"""KV keep: after a verification round the target's cache equals the one built by decoding the committed
tokens one at a time."""

from __future__ import annotations

import pytest
import torch

from glance_sgl.tree import build_tree
from glance_sgl.verify import SamplingSpec, verify_tree

from tests.glance_testing import ARCHS, make_prompts


def greedy_continuation(target, messages, n: int) -> list[int]:
    state, rows = target.prefill(target.prepare(messages))
    toks = [int(rows.logits[-1].argmax())]
    for _ in range(n - 1):
        out = target.forward_rows(state, torch.tensor([toks[-1]]), torch.zeros(1, dtype=torch.long),
                                  torch.ones(1, 1, dtype=torch.bool))
        toks.append(int(out.logits[-1].argmax()))
    return toks


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("accept_depth", [0, 2, 5])
def test_kv_after_round_equals_sequential_decoding(arch, accept_depth, targets):
    target = targets[arch]
    messages = make_prompts(4, seed=21)[accept_depth % 4]
    depth, k, vocab = 6, 3, target.text_config.vocab_size
    cont = greedy_continuation(target, messages, depth + 2)
    root, truth = cont[0], cont[1:]
    # per-offset top-k lists that contain the true continuation up to accept_depth, then only wrong tokens
    gen = torch.Generator().manual_seed(accept_depth)
    ids = torch.randint(0, vocab, (1, depth, k), generator=gen)
    for d in range(depth):
        row = [t for t in ids[0, d].tolist() if t != truth[d]]
        row = (row + [t for t in range(vocab) if t != truth[d] and t not in row])[:k]
        if d < accept_depth:
            row[d % k] = truth[d]
        ids[0, d] = torch.tensor(row)
    values = torch.log_softmax(torch.randn(1, depth, k, generator=gen), -1).sort(-1, descending=True).values
    tree = build_tree(values, ids, torch.tensor([root]), budget=10_000)  # the full candidate tree

    state, _ = target.prefill(target.prepare(messages))
    rows = target.forward_rows(state, tree.tokens[0], tree.depths[0], tree.ancestor_mask()[0],
                               taps=[0, len(target.layers) - 1])
    walk = verify_tree(tree.tokens, tree.parents, tree.depths, rows.logits[None], torch.tensor([1]), [SamplingSpec()])
    n = int(walk.accept_lens[0])
    committed = walk.committed()[0]
    assert n == accept_depth
    assert committed == truth[: accept_depth + 1]
    target.keep_rows(state, tree.num_rows, walk.accepted_rows[0, : n + 1])

    ref_state, _ = target.prefill(target.prepare(messages))
    for tok in [root] + truth[:accept_depth]:
        ref_rows = target.forward_rows(ref_state, torch.tensor([tok]), torch.zeros(1, dtype=torch.long),
                                       torch.ones(1, 1, dtype=torch.bool))
    assert state.length == ref_state.length
    for kept, ref in zip(state.cache.layers, ref_state.cache.layers):
        torch.testing.assert_close(kept.keys, ref.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(kept.values, ref.values, atol=1e-5, rtol=0)
    # the next step from the kept cache sees exactly what sequential decoding sees
    bonus = committed[-1]
    nxt = target.forward_rows(state, torch.tensor([bonus]), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
    ref_nxt = target.forward_rows(ref_state, torch.tensor([bonus]), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(nxt.logits, ref_nxt.logits, atol=1e-5, rtol=0)
    # tap features of the accepted rows equal the sequential ones (what the head is fed next round)
    assert rows.taps.shape == (tree.num_rows, 2 * target.text_config.hidden_size)
