"""The device-resident decode step: a constant number of host reads per step, whatever the batch and tree size.

The worker runs its device code on the CPU (``GLANCE_SGL_DEVICE_STEP=1``: tree by ``glance_kernels.budget_tree``,
the walk and the seeded sampling by ``glance_sgl.verify``'s tensor path, commits and draft K/V writes as tensor
ops) and wraps every decode step in ``glance_sgl.host_transfers``' counter (``GLANCE_SGL_COUNT_HOST_READS=1``;
SGLang's own target forward is not counted). The random test planner varies the rows per step (AR steps
included) and requests come one at a time and 2, 4 and 8 in flight. What is read: the planner's few numbers per
step (its choice of tree size, the accepted lengths, the next lead entropies) and SGLang's host-side lengths,
never logits or trees; that the tensor walk reads nothing at any vocabulary is ``tests/test_verify.py``'s.
The outputs stay those of plain autoregressive decoding.
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch

from glance_sgl.sglang.runner import EngineProcess, cpu_engine_kwargs, demo_requests

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
BOUND = 8  # host reads per decode step (today: 3 for an AR step, 5 to 7 for a drafting one)
LINE = re.compile(r"GLANCE host reads bs=(\d+) rows=(\d+): (\d+) ")


@pytest.fixture(scope="module")
def run(checkpoints, tmp_path_factory):
    target, drafter, _ = checkpoints
    log = tmp_path_factory.mktemp("host_reads") / "glance.log"
    env = {"GLANCE_SGL_DEVICE_STEP": "1", "GLANCE_SGL_COUNT_HOST_READS": "1", "GLANCE_PLANNER": "random:3",
           "GLANCE_COST_CACHE": str(log.parent / "costs")}
    engine = EngineProcess(cpu_engine_kwargs(target, drafter), env=env, log_path=log, wait=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from glance_sgl.engine import GlanceEngine, SamplingParams

        requests, messages = demo_requests(target, 8, MAX_TOKENS)
        embedded = GlanceEngine.load(target, drafter)
        ar = [embedded.generate(m, SamplingParams(max_tokens=MAX_TOKENS), mode="ar").token_ids for m in messages]
        sampled = embedded.generate(messages[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7),
                                    mode="ar").token_ids
        engine.wait_ready()
        out = {"c1": engine.generate(requests[:2])["results"]}
        for c in (2, 4, 8):
            out[f"c{c}"] = engine.generate(requests, concurrency=c)["results"]
        out["seeded"] = engine.generate([{**requests[0], "temperature": 0.8, "seed": 7}])["results"]
        yield {"ar": ar, "sampled": sampled, "out": out, "log": log}
    finally:
        torch.set_num_threads(threads)
        engine.close()


def test_device_step_outputs_equal_autoregressive_decoding(run):
    for name, results in run["out"].items():
        if name == "seeded":
            assert results[0]["output_ids"] == run["sampled"], "seeded sampling vs the embedded engine's AR"
            continue
        for i, r in enumerate(results):
            assert r["output_ids"] == run["ar"][i], f"{name}, request {i}"


def test_host_reads_per_decode_step_are_few_and_independent_of_batch_and_tree_size(run):
    counts = defaultdict(set)  # (drafted?) -> read counts seen
    seen_bs, seen_rows = set(), set()
    for bs, rows, total in (map(int, m.groups()) for m in LINE.finditer(run["log"].read_text())):
        counts[rows > 0].add(total)
        seen_bs.add(bs)
        seen_rows.add(rows)
    assert {1, 2, 4} <= seen_bs and len(seen_rows) >= 5, (seen_bs, seen_rows)  # the step shapes did vary
    assert counts[False] and counts[True]  # AR steps and drafting steps both ran
    assert max(max(v) for v in counts.values()) <= BOUND, dict(counts)
    assert all(len(v) <= 2 for v in counts.values()), dict(counts)  # the same few reads whatever the shape
