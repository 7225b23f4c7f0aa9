"""GPU: GLANCE vs no speculation token for token through SGLang with FlashInfer's custom-mask attention, CUDA graphs
on (the verify pass at several widths, the drafter pass) and off, the radix cache on (skips without CUDA).

float32 must match exactly (near-ties cannot flip an argmax between a tree pass and one-token decoding at that
precision); in bfloat16 they can, so that test reports the match rate and the first divergence (in the JSON
report of tests/gpu/run.sh when ``GLANCE_GPU_REPORT`` names a file) and only requires most outputs to match.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from glance_sgl.sglang.runner import EngineProcess, demo_requests

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _kwargs(target, drafter=None, dtype="float32", graphs=True):
    kw = dict(model_path=str(target), dtype=dtype, attention_backend="flashinfer", disable_radix_cache=False,
              mem_fraction_static=0.3, log_level="warning", random_seed=0, disable_cuda_graph=not graphs,
              cuda_graph_max_bs=8)
    if drafter is not None:
        kw.update(speculative_algorithm="GLANCE", speculative_draft_model_path=str(drafter))
    return kw


def _outputs(kwargs, requests, tmp_path, name, concurrent_too=False):
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"}
    with EngineProcess(kwargs, env=env, log_path=tmp_path / f"{name}.log") as engine:
        got = [r["output_ids"] for r in engine.generate(requests)["results"]]
        conc = [r["output_ids"] for r in engine.generate(requests[:8], concurrent=True)["results"]] \
            if concurrent_too else None
    return got, conc


def _record(name: str, value) -> None:
    path = os.environ.get("GLANCE_GPU_REPORT")
    if path:
        data = json.loads(open(path).read()) if os.path.exists(path) else {}
        data[name] = value
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2)


@pytest.fixture(scope="module")
def fp32_reference(checkpoints, tmp_path_factory):
    target, _, _ = checkpoints
    requests, _ = demo_requests(target, 20, 24)
    want, _ = _outputs(_kwargs(target), requests, tmp_path_factory.mktemp("plain"), "plain")
    return requests, want


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_gpu_parity_fp32(checkpoints, fp32_reference, tmp_path, graphs):
    target, drafter, _ = checkpoints
    requests, want = fp32_reference
    got, conc = _outputs(_kwargs(target, drafter, graphs=graphs), requests, tmp_path, "glance", concurrent_too=True)
    _record(f"fp32_{'graphs' if graphs else 'eager'}_match", sum(g == w for g, w in zip(got, want)) / len(want))
    assert got == want
    assert conc == want[:8]


def test_gpu_bf16_match_rate(checkpoints, tmp_path):
    target, drafter, _ = checkpoints
    requests, _ = demo_requests(target, 20, 24)
    want, _ = _outputs(_kwargs(target, dtype="bfloat16"), requests, tmp_path, "plain_bf16")
    got, _ = _outputs(_kwargs(target, drafter, dtype="bfloat16"), requests, tmp_path, "glance_bf16")
    same = [g == w for g, w in zip(got, want)]
    first = next(((i, next(j for j, (a, b) in enumerate(zip(g, w)) if a != b) if any(
        a != b for a, b in zip(g, w)) else min(len(g), len(w))) for i, (g, w) in enumerate(zip(got, want))
        if g != w), None)
    _record("bf16", {"match_rate": sum(same) / len(same), "first_divergence": None if first is None else
                     {"request": first[0], "token": first[1]}})
    assert sum(same) >= 0.7 * len(same), f"bf16 match rate {sum(same)}/{len(same)}, first divergence {first}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (SGLang's CPU path has no TP without "
                    "sgl_kernel's CPU ops)")
def test_gpu_tp2_parity(checkpoints, fp32_reference, tmp_path):
    """``--tp 2``: the drafter replicated, its logits all-gathered, rank 0's planner choice broadcast: the same
    output as one GPU without speculation."""
    target, drafter, _ = checkpoints
    requests, want = fp32_reference
    got, conc = _outputs({**_kwargs(target, drafter), "tp_size": 2}, requests, tmp_path, "glance_tp2",
                         concurrent_too=True)
    assert got == want
    assert conc == want[:8]
