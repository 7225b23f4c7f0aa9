"""End to end through SGLang's real scheduler on CPU (``sglang.Engine`` in a child process, float32, images).

GLANCE through SGLang must give exactly the tokens of the same engine without speculation and of the embedded
engine's AR decoding, at batch 1 and with 4 concurrent requests; its accept length must agree with the embedded
engine's tau; SGLang's strict memory check stays on and no KV slot leaks.
"""

from __future__ import annotations

import time

import pytest
import torch

from glance_sgl.sglang.runner import EngineProcess, cpu_engine_kwargs, demo_requests

pytestmark = pytest.mark.slow

N_PROMPTS = 20
MAX_TOKENS = 24
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


@pytest.fixture(scope="module")
def run(checkpoints, tmp_path_factory):
    """Both SGLang engines start in the background while the embedded engine decodes the same prompts."""
    target, drafter, kind = checkpoints
    logs = tmp_path_factory.mktemp("sglang_logs")
    glance = EngineProcess(cpu_engine_kwargs(target, drafter), env=STRICT, log_path=logs / "glance.log", wait=False)
    plain = EngineProcess(cpu_engine_kwargs(target, None, algorithm=None), env=STRICT,
                          log_path=logs / "plain.log", wait=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three processes share the cores; oversubscribed torch threads crawl
    t0 = time.perf_counter()
    try:
        from glance_sgl.engine import GlanceEngine, SamplingParams

        requests, messages = demo_requests(target, N_PROMPTS, MAX_TOKENS)
        engine = GlanceEngine.load(target, drafter)
        params = SamplingParams(max_tokens=MAX_TOKENS)
        ar, rounds, committed = [], 0, 0
        for m in messages:
            ar.append(engine.generate(m, params, mode="ar").token_ids)
            gl = engine.generate(m, params, mode="glance")
            rounds += gl.metrics.rounds
            committed += sum(gl.metrics.committed_per_round)
        sampled = engine.generate(messages[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1234),
                                  mode="glance").token_ids
        t_embedded = time.perf_counter() - t0
        glance.wait_ready()
        plain.wait_ready()
        t_ready = time.perf_counter() - t0
        batch1 = glance.generate(requests)["results"]
        plain_out = plain.generate(requests)["results"]
        plain.close()
        concurrent = []
        for i in range(0, N_PROMPTS, 4):
            concurrent += glance.generate(requests[i:i + 4], concurrent=True)["results"]
        print(f"embedded {t_embedded:.1f}s, engines ready {t_ready:.1f}s, all {time.perf_counter() - t0:.1f}s")
        yield {"kind": kind, "requests": requests, "ar": ar, "tau": committed / max(rounds, 1), "batch1": batch1,
               "plain": plain_out, "concurrent": concurrent, "glance": glance, "logs": logs, "sampled": sampled}
    finally:
        torch.set_num_threads(threads)
        glance.close()
        plain.close()


def test_batch1_token_identical_to_ar_and_plain_sglang(run):
    assert len(run["batch1"]) == N_PROMPTS
    for i, (g, p, a) in enumerate(zip(run["batch1"], run["plain"], run["ar"])):
        assert g["output_ids"] == p["output_ids"], f"prompt {i}: GLANCE vs SGLang without speculation"
        assert g["output_ids"] == a, f"prompt {i}: GLANCE through SGLang vs the embedded engine's AR"


def test_concurrent_token_identical(run):
    for i, (g, a) in enumerate(zip(run["concurrent"], run["ar"])):
        assert g["output_ids"] == a, f"prompt {i} (4 concurrent requests)"


def test_spec_metrics_in_meta_info(run):
    verify = 0
    for g in run["batch1"]:
        mi = g["meta_info"]
        n = mi["completion_tokens"]
        if n <= 1:
            continue
        ct = mi["spec_verify_ct"]
        verify += ct
        assert ct >= 1 and sum(mi["spec_correct_drafts_histogram"]) == ct
        assert mi["spec_accept_length"] == pytest.approx(n / ct)
        assert 1 + ct <= n <= 1 + ct + mi["spec_num_correct_drafts"]  # the last step may be cut by max_tokens
        assert mi["spec_num_proposed_drafts"] == ct * 31
    assert verify > 0


def test_accept_length_matches_embedded_tau(run):
    """SGLang's accept length (the gateway's convention: (completion - 1) / verify_ct, pooled) vs tau."""
    steps = sum(g["meta_info"].get("spec_verify_ct", 0) for g in run["batch1"])
    tokens = sum(g["meta_info"]["completion_tokens"] - 1 for g in run["batch1"] if g["meta_info"].get("spec_verify_ct"))
    sglang_tau = tokens / steps
    print(f"checkpoints={run['kind']} sglang tau={sglang_tau:.3f} embedded tau={run['tau']:.3f}")
    assert sglang_tau == pytest.approx(run["tau"], rel=0.10)


def test_no_kv_leak_and_engine_alive(run):
    glance = run["glance"]
    assert glance.alive()
    again = glance.generate(run["requests"][:2], concurrent=True)["results"]  # the scheduler is still healthy
    assert [r["output_ids"] for r in again] == run["ar"][:2]
    log = (run["logs"] / "glance.log").read_text()
    assert "Mem Leak" not in log and "memory leak" not in log.lower()
    assert "Traceback" not in log


def test_sampling_is_seeded_and_equals_embedded(run):
    """T > 0: the worker's lossless sampling (glance_sgl.verify, Gumbel keyed by seed and output index) gives
    the embedded engine's sampled output for the same seed, token for token."""
    req = {**run["requests"][0], "temperature": 0.8, "seed": 1234}
    a, b = run["glance"].generate([req, req])["results"]
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) >= 1
    assert a["output_ids"] == run["sampled"]
