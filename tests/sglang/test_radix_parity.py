"""GLANCE through SGLang with the radix cache on, chunked prefill and retraction: token for token the output of
SGLang without speculation under the same settings (CPU, float32, the bundled demo pair).

The drafter's context K/V live in a draft KV pool addressed by SGLang's token slots (``draft_pool.py``), so a
prefix hit reuses the draft K/V the prefix's first computation wrote. The requests are built to hit the cache:
multi-turn image chats (the second turn repeats the first turn's image, question and answer), one system prompt
shared by all, and the first turns sent again. Chunked prefill splits prompts into 48-token chunks; a small KV
pool and SGLang's own retraction test mode (``SGLANG_TEST_RETRACT``: retract running requests every few steps)
make requests leave and re-enter mid-generation, re-prefilled from the cache.

The same engine runs the device-resident decode step on the CPU (``GLANCE_SGL_DEVICE_STEP=1``: tree by
``glance_kernels.budget_tree``, walk and seeded sampling by ``glance_sgl.verify``'s tensor path, commits and draft
K/V writes as tensor ops), under the random test planner (``GLANCE_PLANNER=random``: every tree size, plain AR
steps, n-gram-only, drafter-only and merged steps: the default sources), and counts every decode step's host reads
(``GLANCE_SGL_COUNT_HOST_READS=1``, ``glance_sgl.host_transfers``; SGLang's own target forward is not counted): at
most two per step, the same for each step kind at every batch and tree size; that the
tensor walk reads nothing at any vocabulary is ``tests/test_verify.py``'s. Its drafter pass runs at the static,
bucketed shapes a CUDA graph replays (``GLANCE_SGL_STATIC_DRAFT=1``: ``draft_graph.DraftPassRunner``, eagerly).
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch

from glance_sgl.sglang.runner import EngineProcess, chat_prompt, cpu_engine_kwargs, image_b64

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
SYSTEM = "You are a careful assistant. Look at the picture before you answer."
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
RETRACT = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "7"}
HOST_READS = re.compile(r"GLANCE host reads bs=(\d+) rows=(\d+): (\d+) .* kind=(\w+)")
# device reads per decode step: the drafter's tree (a drafting step) and the round's outcome; the n-gram source's
# roots and committed tokens come from SGLang's host state and that outcome
READS_BOUND = 2
STEP_KINDS = {"ar", "ngram", "drafter", "merged"}
SETTINGS = dict(chunked_prefill_size=48, max_total_tokens=2048, context_length=512, disable_radix_cache=False)


def _first_turns(target) -> tuple[list[dict], list[list[dict]]]:
    """Image questions of the demo tasks, every one under the same system prompt, plus two text-only ones."""
    from transformers import AutoTokenizer

    from glance_sgl.demo.tasks import TASKS, eval_set

    tok = AutoTokenizer.from_pretrained(str(target))
    reqs, convs = [], []
    for i in range(10):
        ex = eval_set(TASKS[i % len(TASKS)])[i // len(TASKS)]
        m = [{"role": "system", "content": SYSTEM}, *ex.messages()]
        reqs.append({"text": chat_prompt(tok, m), "image": image_b64(ex.image), "max_tokens": MAX_TOKENS})
        convs.append(m)
    for q in ("Describe a sunny day.", "What is a chart?"):
        m = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        reqs.append({"text": chat_prompt(tok, m), "image": None, "max_tokens": MAX_TOKENS})
        convs.append(m)
    return reqs, convs


def _second_turns(target, first: list[dict], convs: list[list[dict]], answers: list[str]) -> list[dict]:
    """Each first turn, its answer and a follow-up question: the first turn's tokens are a cached prefix."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    out = []
    for req, conv, answer in zip(first, convs, answers):
        m = [*conv, {"role": "assistant", "content": answer}, {"role": "user", "content": "And what else?"}]
        out.append({**req, "text": chat_prompt(tok, m)})
    return out


@pytest.fixture(scope="module")
def run(checkpoints, tmp_path_factory):
    target, drafter, _ = checkpoints
    logs = tmp_path_factory.mktemp("radix_logs")
    env = {**STRICT, **RETRACT}
    device_step = {"GLANCE_SGL_DEVICE_STEP": "1", "GLANCE_SGL_COUNT_HOST_READS": "1", "GLANCE_PLANNER": "random:3",
                   "GLANCE_SGL_STATIC_DRAFT": "1",  # the drafter pass at the CUDA-graph runner's static shapes
                   "GLANCE_COST_CACHE": str(logs / "costs")}
    glance = EngineProcess(cpu_engine_kwargs(target, drafter, **SETTINGS), env={**env, **device_step},
                           log_path=logs / "glance.log", wait=False)
    plain = EngineProcess(cpu_engine_kwargs(target, None, algorithm=None, **SETTINGS), env=env,
                          log_path=logs / "plain.log", wait=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first, convs = _first_turns(target)
        glance.wait_ready()
        plain.wait_ready()
        ref_first = plain.generate(first, concurrency=4)["results"]
        second = _second_turns(target, first, convs, [r["text"] for r in ref_first])
        out = {"first": ref_first, "second": plain.generate(second, concurrency=16)["results"]}
        plain.close()
        got = {
            "first_c4": glance.generate(first, concurrency=4)["results"],
            "second_c16": glance.generate(second, concurrency=16)["results"],
            "second_c1": glance.generate(second, concurrency=1)["results"],  # full prefix hits, one at a time
            "first_c16": glance.generate(first, concurrency=16)["results"],
        }
        yield {"ref": out, "got": got, "glance": glance, "logs": logs}
    finally:
        torch.set_num_threads(threads)
        glance.close()
        plain.close()


@pytest.mark.parametrize("name, ref", [("first_c4", "first"), ("second_c16", "second"), ("second_c1", "second"),
                                       ("first_c16", "first")])
def test_radix_cache_chunked_prefill_and_retraction_stay_token_identical(run, name, ref):
    got, want = run["got"][name], run["ref"][ref]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["output_ids"] == w["output_ids"], f"{name}, request {i}: GLANCE vs SGLang without speculation"


def test_the_cache_was_hit_requests_were_retracted_and_nothing_leaked(run):
    cached = sum(r["meta_info"].get("cached_tokens", 0) for r in run["got"]["second_c1"])
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in run["got"]["second_c1"])
    assert cached > prompt / 3, f"only {cached} of {prompt} prompt tokens came from the radix cache"
    drafted = sum(r["meta_info"].get("spec_verify_ct", 0) for r in run["got"]["second_c16"])
    assert drafted > 0
    log = (run["logs"] / "glance.log").read_text()
    assert "Retract requests" in log or "Testing retraction" in log
    assert "Mem Leak" not in log and "memory leak" not in log.lower() and "Traceback" not in log
    assert "drafter pass at static shapes up to batch 48 (eager)" in log  # GLANCE_SGL_STATIC_DRAFT=1 took effect


def test_device_step_host_reads_are_few_and_independent_of_batch_tree_size_and_sources(run):
    counts = defaultdict(set)  # step kind -> read counts seen
    seen_bs, seen_rows = set(), set()
    log = (run["logs"] / "glance.log").read_text()
    for m in HOST_READS.finditer(log):
        bs, rows, total = map(int, m.groups()[:3])
        counts[m[4]].add(total)
        seen_bs.add(bs)
        seen_rows.add(rows)
    assert len(seen_bs) >= 3 and len(seen_rows) >= 5, (seen_bs, seen_rows)  # the step shapes did vary
    assert set(counts) == STEP_KINDS, dict(counts)  # AR, n-gram-only, drafter-only and merged steps all ran
    assert max(max(v) for v in counts.values()) <= READS_BOUND, dict(counts)
    assert all(len(v) == 1 for v in counts.values()), dict(counts)  # the same reads whatever the shape
