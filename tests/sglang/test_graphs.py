"""CUDA-graph paths checked on a CPU: SGLang's capture hooks answer for GLANCE (registered through HookRegistry and
called by SGLang's own functions), the dummy a graph is captured with has the fields the eager verify input has,
captured widths and row snapping, and the drafter pass at static (bucketed) shapes equals the eager pass. A GPU
replays these (tests/gpu/run.sh)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from glance_sgl.tree import build_tree  # noqa: E402
from tests.glance_testing import tiny_bound_drafter  # noqa: E402


@pytest.fixture(scope="module")
def hooks():
    from glance_sgl.sglang.cpu import install_sgl_kernel_stub, register_cpu_hooks
    from glance_sgl.sglang.plugin import register_algorithm

    install_sgl_kernel_stub()
    register_cpu_hooks()
    register_algorithm()
    from glance_sgl.sglang.graphs import register_graph_hooks

    register_graph_hooks()
    return True


def _algo(name):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.from_string(name)


def test_capture_hooks_answer_for_glance_only(hooks):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.runner import base_runner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative import spec_info
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    from glance_sgl.sglang.glance_info import GlanceVerifyInput

    # the capture path calls the name base_runner imported: HookRegistry rebinds it there too
    assert base_runner.create_dummy_verify_input is spec_info.create_dummy_verify_input
    buf = torch.ones(4096, dtype=torch.bool)
    dummy = base_runner.create_dummy_verify_input(_algo("GLANCE"), buf, 8, False)
    assert type(dummy) is GlanceVerifyInput and dummy.custom_mask is buf
    assert (dummy.draft_token_num, dummy.num_tokens_per_req, dummy.num_tokens_for_logprob_per_req) == (8, 8, 8)
    assert dummy.capture_hidden_mode == CaptureHiddenMode.FULL and dummy.is_verify_input()
    # other algorithms go to SGLang's own function (which needs an engine's published config: none here)
    with pytest.raises(ValueError, match="'spec' not published"):
        base_runner.create_dummy_verify_input(_algo("NGRAM"), buf, 8, False)

    runner = SimpleNamespace(model_runner=SimpleNamespace(spec_algorithm=_algo("GLANCE"), is_draft_worker=False),
                             buffers=SimpleNamespace(custom_mask=buf), captured_req_width=16)
    info = DecodeCudaGraphRunner.get_spec_info(runner, 16 * 4)
    assert type(info) is GlanceVerifyInput and info.custom_mask is buf and info.num_tokens_per_req == 16
    runner.model_runner.spec_algorithm = _algo("NGRAM")
    assert type(DecodeCudaGraphRunner.get_spec_info(runner, 64)) is NgramVerifyInput


def test_dummy_matches_the_eager_verify_input(hooks):
    """What a step builds eagerly for a tree of ``w`` rows is what the width-``w`` graph was captured with: same
    class and input type, same width (so a runner of another width refuses it), hidden states captured, a bool
    mask that fits SGLang's capture buffer (``(max_bs * fill + max_tokens) * width``)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from glance_sgl.sglang.glance_info import build_verify_input
    from glance_sgl.sglang.graphs import dummy_verify_input
    from glance_sgl.tree import DraftTree

    bs, w = 3, 5
    g = torch.Generator().manual_seed(0)
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 0]])
    depths = torch.tensor([[0, 1, 1, 2, 2], [0, 1, 2, 3, 4], [0, 1, 1, 1, 1]])
    tree = DraftTree(torch.randint(0, 50, (bs, w), generator=g), parents, depths, torch.zeros(bs, w))
    seq_lens = torch.tensor([7, 12, 3])
    req_to_token = torch.arange(4 * 64, dtype=torch.int32).view(4, 64)
    eager = build_verify_input(tree, seq_lens, seq_lens.tolist(), torch.tensor([2, 0, 3]), req_to_token).spec_info
    dummy = dummy_verify_input(torch.ones((bs * 1 + bs * w) * w + 4096, dtype=torch.bool), w)
    assert type(eager) is type(dummy) and eager.spec_input_type == dummy.spec_input_type
    assert eager.num_tokens_per_req == dummy.num_tokens_per_req == w
    assert eager.custom_mask.dtype == dummy.custom_mask.dtype == torch.bool
    assert eager.custom_mask.numel() == int((w * (seq_lens + w)).sum())
    assert dummy.capture_hidden_mode == CaptureHiddenMode.FULL
    assert eager.positions.shape == (bs * w,) and eager.draft_token.shape == (bs * w,)


def test_graph_widths_and_snapping():
    from glance_sgl.sglang.graphs import DEFAULT_WIDTHS, graph_widths, snap_rows
    from glance_sgl.sglang.settings import WorkerSettings

    def widths(text: str) -> tuple[int, ...] | None:  # GLANCE_CUDA_GRAPH_WIDTHS as the worker gets it
        return WorkerSettings.from_env({"GLANCE_CUDA_GRAPH_WIDTHS": text}).graph_widths

    assert graph_widths(32, widths("")) == graph_widths(32) == sorted(set(DEFAULT_WIDTHS) | {32})
    assert graph_widths(8, widths("1,2,16")) == [1, 2, 8]
    assert graph_widths(32, widths(" 4 , 12 ")) == [4, 12, 32]
    for bad in ("x", "0,4", "-1"):
        with pytest.raises(ValueError, match="GLANCE_CUDA_GRAPH_WIDTHS"):
            widths(bad)
    widths = [1, 4, 8, 16, 32]
    assert [snap_rows(widths, r) for r in (1, 2, 4, 5, 9, 17, 32)] == [1, 4, 4, 8, 16, 32, 32]


def test_buckets():
    from glance_sgl.sglang.draft_graph import batch_buckets, bucket_of, context_buckets

    assert batch_buckets(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert batch_buckets(3) == [1, 2, 3]
    assert context_buckets(1000) == [64, 128, 256, 512, 1000]
    assert bucket_of([1, 2, 4, 8], 3) == 4
    with pytest.raises(ValueError, match="exceeds"):
        bucket_of([1, 2, 4], 5)


@pytest.mark.parametrize("lengths", [[5], [1], [9, 3, 17], [40, 2, 2, 11, 63]])
def test_static_drafter_pass_equals_eager(lengths):
    """The drafter pass of a decode step at bucketed shapes (batch padded to its bucket, context padded to a power
    of two, masked by length, even for one request) gives the eager pass's logits-derived trees: same tokens and
    parents, scores within float rounding."""
    from glance_sgl.sglang.draft_graph import DraftPassRunner, draft_pass
    from glance_sgl.sglang.draft_pool import DraftKVPool

    d = tiny_bound_drafter(block_size=6, branch_k=3)
    rng = random.Random(len(lengths))
    g = torch.Generator().manual_seed(len(lengths))
    pool = DraftKVPool(d, size=512, device="cpu", dtype=torch.float32)
    req_to_token = torch.zeros(8, 128, dtype=torch.int32)
    free = list(range(1, 512))
    rng.shuffle(free)
    rows = rng.sample(range(8), len(lengths))
    for r, n in zip(rows, lengths):
        slots = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
        req_to_token[r, :n] = slots
        pool.write(slots, torch.randn(n, 2 * 32, generator=g), torch.arange(n))
    rpi, lens = torch.tensor(rows), torch.tensor(lengths)
    roots = torch.randint(0, 40, (len(lengths),), generator=g)
    limits = dict(max_depth=5, branch_k=3, budget=12)
    runner = DraftPassRunner(d, pool, req_to_token, max_bs=8, use_graphs=True, **limits)  # no CUDA: eager
    assert runner.use_graphs is False and runner.fits(len(lengths), max(lengths))
    static = runner.run(rpi, lens, roots, max(lengths))
    eager = draft_pass(d, pool, req_to_token, rpi, lens, roots, max(lengths), build=build_tree, **limits)
    assert static.tokens.shape == eager.tokens.shape == (len(lengths), 13)
    assert torch.equal(static.tokens, eager.tokens) and torch.equal(static.parents, eager.parents)
    assert torch.equal(static.depths, eager.depths)
    assert torch.allclose(static.scores, eager.scores, atol=1e-5)
    assert not runner.fits(9, 10) and not runner.fits(1, 129)
