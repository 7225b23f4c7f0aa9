"""End to end through SGLang's real scheduler on CPU (``sglang.Engine`` in a child process, float32, images).

GLANCE through SGLang must give exactly the tokens of the same engine without speculation and of the embedded
engine's AR decoding, at batch 1 and with 4 concurrent requests; its accept length (fixed planner: the full tree
every step) must agree with the embedded engine's tau (fixed planner too); SGLang's strict memory check stays on and
no KV slot leaks; requests that decode up to the context length give plain SGLang's tokens (what SGLang reserves
past a request's tokens each step fits GLANCE's slot-table rows). A third engine runs the test-only random planner
(``GLANCE_PLANNER=random:SEED``: random tree sizes and plain AR steps without the drafter pass, the cost
calibration's extra passes included) with several requests in flight, greedy and seeded sampling, with the n-gram
source's candidates merged with the drafter's (``GLANCE_DRAFT_SOURCES=drafter,ngram``: merged trees, n-gram-only
steps, drafter-only steps and AR steps) and ragged passes (``GLANCE_SGL_RAGGED_VERIFY=1``: in half its batches each
request verifies its own random number of rows) on a paged KV cache (``--page-size 16``: the accepted rows' K/V move
to the front of the verify window, ``glance_kernels.compact_kv``, where the other engines reorder token slots), and
must give the same tokens too. A fourth runs the same random rounds under SGLang's overlap scheduler (the V2 worker
with ``FutureMap`` relay: the scheduler processes a step's results after launching the next) and must give the same
tokens at 1 and 4 in flight, greedy and seeded. A fifth drafts from n-gram matches alone
(``GLANCE_DRAFT_SOURCES=ngram``: its passes capture no tap features and feed no drafter context) under the random
planner, and must give the same tokens at 4 in flight, greedy and seeded. A sixth has drafting forced off
(``GLANCE_PLANNER=off``: no source, no tap capture, every step a plain AR step) and must give the same tokens at 4
in flight, greedy and seeded, every step verifying the root alone.
"""

from __future__ import annotations

import inspect
import re
import time

import pytest
import torch

from glance_sgl.sglang import bench
from glance_sgl.sglang.bench import parts_between, step_parts
from glance_sgl.sglang.step_timing import STEP_TIMING_KEY
from glance_sgl.sglang.runner import EngineProcess, cpu_engine_kwargs, demo_requests

pytestmark = pytest.mark.slow

N_PROMPTS = 20
MAX_TOKENS = 24
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
PAGED = 16  # the random planner's engine: a paged KV cache, whose accepted rows' K/V move (glance_kernels.compact_kv)
CONTEXT = 1024  # cpu_engine_kwargs' context length
TOP_K, MIN_P = 20, 0.05  # the seeded requests' filters (the tempered distribution's top 20, at least 5 % of its best)
EOS = 2  # the demo target's end token; ".": 21


def _with_logit_rules(requests: list[dict]) -> list[dict]:
    """Greedy requests whose plain SGLang answers change with the rules SGLang applies to every step's logits:
    ``min_new_tokens`` (the stop tokens masked until then) and ``logit_bias``."""
    return [{**requests[0], "min_new_tokens": MAX_TOKENS - 2}, {**requests[1], "min_new_tokens": 12},
            {**requests[2], "logit_bias": {str(EOS): -100.0, "21": -100.0}},
            {**requests[3], "logit_bias": {"21": 4.0}, "min_new_tokens": 6}]


def _to_the_context_end(target) -> list[dict]:
    """Text requests that decode up to the context length (prompt + max_tokens = CONTEXT - 1), their last steps
    within ``--speculative-num-draft-tokens`` of it: what SGLang reserves past a request's tokens there must fit
    its slot-table row."""
    from transformers import AutoTokenizer

    from glance_sgl.sglang.runner import chat_prompt

    tok = AutoTokenizer.from_pretrained(str(target))
    out = []
    for words in (800, 960):
        text = chat_prompt(tok, [{"role": "user", "content": "story " * words + "Tell me more."}])
        out.append({"text": text, "image": None, "max_tokens": CONTEXT - 1 - len(tok(text)["input_ids"]),
                    "temperature": 0.0})
    return out


@pytest.fixture(scope="module")
def run(checkpoints, tmp_path_factory):
    """Both SGLang engines start in the background while the embedded engine decodes the same prompts."""
    target, drafter, kind = checkpoints
    logs = tmp_path_factory.mktemp("sglang_logs")
    glance = EngineProcess(cpu_engine_kwargs(target, drafter),  # the drafter alone: its tau is the embedded one's
                           env={**STRICT, "GLANCE_PLANNER": "fixed", "GLANCE_DRAFT_SOURCES": "drafter"},
                           log_path=logs / "glance.log", wait=False)
    rand = EngineProcess(cpu_engine_kwargs(target, drafter, page_size=PAGED),
                         env={**STRICT, "GLANCE_PLANNER": "random:11", "GLANCE_COST_CACHE": "off",
                              "GLANCE_DRAFT_SOURCES": "drafter,ngram", "GLANCE_SGL_RAGGED_VERIFY": "1"},
                         log_path=logs / "random.log", wait=False)
    merged = EngineProcess(cpu_engine_kwargs(target, drafter, disable_overlap_schedule=False),
                           env={**STRICT, "GLANCE_DRAFT_SOURCES": "drafter,ngram", "GLANCE_PLANNER": "random:5",
                                "GLANCE_COST_CACHE": "off", "GLANCE_SGL_CPU_OVERLAP": "1",
                                "GLANCE_SGL_RAGGED_VERIFY": "1",
                                "SGLANG_IS_IN_CI": "1", "GLANCE_SGL_PROFILE": "1"}, log_path=logs / "merged.log",
                           wait=False)
    ngram = EngineProcess(cpu_engine_kwargs(target, drafter),
                          env={**STRICT, "GLANCE_DRAFT_SOURCES": "ngram", "GLANCE_PLANNER": "random:7",
                               "GLANCE_COST_CACHE": "off", "GLANCE_SGL_PROFILE": "1", "GLANCE_SGL_STEP_TIMING": "1"},
                          log_path=logs / "ngram.log", wait=False)
    off = EngineProcess(cpu_engine_kwargs(target, drafter), env={**STRICT, "GLANCE_PLANNER": "off"},
                        log_path=logs / "off.log", wait=False)
    plain = EngineProcess(cpu_engine_kwargs(target, None, algorithm=None),
                          env={**STRICT, "GLANCE_SGL_STEP_TIMING": "1"}, log_path=logs / "plain.log", wait=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three processes share the cores; oversubscribed torch threads crawl
    t0 = time.perf_counter()
    try:
        from glance_sgl.engine import GlanceEngine, SamplingParams

        requests, messages = demo_requests(target, N_PROMPTS, MAX_TOKENS)
        engine = GlanceEngine.load(target, drafter)
        params = SamplingParams(max_tokens=MAX_TOKENS)
        fixed = {"planner": "fixed"} if "planner" in inspect.signature(engine.generate).parameters else {}
        ar, rounds, committed = [], 0, 0
        for m in messages:
            ar.append(engine.generate(m, params, mode="ar").token_ids)
            gl = engine.generate(m, params, mode="glance", **fixed)
            rounds += gl.metrics.rounds
            committed += sum(gl.metrics.committed_per_round)
        sampled = engine.generate(messages[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1234,
                                                              top_k=TOP_K, min_p=MIN_P),
                                  mode="glance").token_ids
        t_embedded = time.perf_counter() - t0
        glance.wait_ready()
        plain.wait_ready()
        t_ready = time.perf_counter() - t0
        batch1 = glance.generate(requests)["results"]
        plain_out = plain.generate(requests)["results"]
        edge = _to_the_context_end(target)
        edge_glance = glance.generate(edge, concurrent=True)["results"]
        edge_plain = plain.generate(edge, concurrent=True)["results"]
        ruled = _with_logit_rules(requests)
        ruled_glance = glance.generate(ruled, concurrent=True)["results"]
        ruled_plain = plain.generate(ruled, concurrent=True)["results"]
        refused = {}
        for name, value in (("repetition_penalty", 1.2), ("frequency_penalty", 0.5), ("presence_penalty", 0.5)):
            try:
                glance.generate([{**requests[0], name: value}])
            except RuntimeError as exc:
                refused[name] = str(exc)
        plain_timing = step_parts(plain, STEP_TIMING_KEY)
        plain.close()
        concurrent = []
        for i in range(0, N_PROMPTS, 4):
            concurrent += glance.generate(requests[i:i + 4], concurrent=True)["results"]
        seeded = [{**requests[i], "temperature": 0.8, "seed": 1234 + i, "top_k": TOP_K, "min_p": MIN_P}
                  for i in range(4)]
        seeded_fixed = glance.generate(seeded, concurrent=True)["results"]
        rand.wait_ready()
        random_greedy = rand.generate(requests, concurrency=6)["results"]
        random_seeded = rand.generate(seeded, concurrency=3)["results"]
        ruled_random = rand.generate(ruled, concurrency=3)["results"]
        rand.close()
        merged.wait_ready()
        merged_batch1 = merged.generate(requests)["results"]
        before = step_parts(merged)
        merged_concurrent = merged.generate(requests, concurrency=4)["results"]
        merged_parts = parts_between(before, step_parts(merged))
        merged_seeded = merged.generate(seeded, concurrent=True)["results"]
        merged_info = merged.info()
        merged.close()
        ngram.wait_ready()
        before, clock = step_parts(ngram), step_parts(ngram, STEP_TIMING_KEY)
        ngram_greedy = ngram.generate(requests, concurrency=4)["results"]
        ngram_parts = parts_between(before, step_parts(ngram))
        ngram_timing = parts_between(clock, step_parts(ngram, STEP_TIMING_KEY))
        ngram_seeded = ngram.generate(seeded, concurrent=True)["results"]
        ngram.close()
        off.wait_ready()
        off_greedy = off.generate(requests, concurrency=4)["results"]
        off_seeded = off.generate(seeded, concurrent=True)["results"]
        off.close()
        print(f"embedded {t_embedded:.1f}s, engines ready {t_ready:.1f}s, all {time.perf_counter() - t0:.1f}s")
        yield {"kind": kind, "requests": requests, "ar": ar, "tau": committed / max(rounds, 1), "batch1": batch1,
               "plain": plain_out, "concurrent": concurrent, "glance": glance, "logs": logs, "sampled": sampled,
               "seeded_fixed": seeded_fixed, "random_greedy": random_greedy, "random_seeded": random_seeded,
               "merged_batch1": merged_batch1, "merged_concurrent": merged_concurrent, "merged_seeded": merged_seeded,
               "merged_info": merged_info, "merged_parts": merged_parts, "ngram_parts": ngram_parts,
               "plain_timing": plain_timing, "ngram_timing": ngram_timing,
               "ngram_greedy": ngram_greedy, "ngram_seeded": ngram_seeded,
               "off_greedy": off_greedy, "off_seeded": off_seeded, "edge_glance": edge_glance,
               "edge_plain": edge_plain, "ruled_glance": ruled_glance, "ruled_plain": ruled_plain,
               "ruled_random": ruled_random, "refused": refused}
    finally:
        torch.set_num_threads(threads)
        glance.close()
        plain.close()
        rand.close()
        merged.close()
        ngram.close()
        off.close()


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
    """T > 0: the worker's lossless sampling (glance_sgl.verify, inverse CDF at keyed uniforms) gives
    the embedded engine's sampled output for the same seed, token for token."""
    req = {**run["requests"][0], "temperature": 0.8, "seed": 1234}
    a, b = run["glance"].generate([req, req])["results"]
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) >= 1
    assert a["output_ids"] == run["sampled"]


def test_requests_decode_up_to_the_context_length(run):
    """Requests whose answers run to the context length (the full tree every step, one token a page): SGLang
    reserves twice the widest step past a request's tokens each step, which GLANCE's slot-table rows now hold
    (``plugin._decode_reserve_headroom``; SGLang's own headroom of 4 + N crashed the CPU port and, on a GPU,
    would write into the next request's row). The same tokens as SGLang without speculation, the engine alive."""
    for i, (g, p) in enumerate(zip(run["edge_glance"], run["edge_plain"])):
        assert g["output_ids"] == p["output_ids"], f"request {i} to the context end: GLANCE vs plain SGLang"
        assert g["meta_info"]["finish_reason"]["type"] == "length"
        assert len(g["output_ids"]) > 8  # it did decode up to the end
    assert run["glance"].alive()


def test_logit_bias_and_min_new_tokens_apply_as_in_plain_decoding(run):
    """``logit_bias`` and ``min_new_tokens`` change plain SGLang's greedy answers; GLANCE applies them to every
    verified row at that row's output index (the fixed tree, and random trees with n-gram candidates on a paged
    cache): the same tokens."""
    changed = 0
    for i, (g, r, p) in enumerate(zip(run["ruled_glance"], run["ruled_random"], run["ruled_plain"])):
        assert g["output_ids"] == p["output_ids"], f"request {i} with logit rules: GLANCE vs plain SGLang"
        assert r["output_ids"] == p["output_ids"], f"request {i} with logit rules: random planner vs plain SGLang"
        changed += p["output_ids"] != run["plain"][i]["output_ids"]
    assert changed >= 2  # the rules did change answers


def test_penalties_are_refused_not_ignored(run):
    """Repetition, frequency and presence penalties depend on each draft row's own path: GLANCE refuses them
    when the request arrives (SGLang's ``SamplingParams.verify``: a 400 over HTTP) instead of decoding without."""
    assert set(run["refused"]) == {"repetition_penalty", "frequency_penalty", "presence_penalty"}
    for name, message in run["refused"].items():
        assert name in message and "GLANCE" in message
    assert run["glance"].alive()


def test_random_tree_sizes_and_ar_steps_stay_lossless(run):
    """Random tree sizes (0 .. 31 nodes) and plain AR steps, 6 requests in flight joining and leaving, on a paged
    KV cache (16 tokens a page: the accepted K/V are moved, not their slots reordered): the same greedy tokens as
    SGLang without speculation (one token a page), and seeded samples equal to the fixed tree's (and the embedded
    engine's for the first)."""
    for i, (g, p) in enumerate(zip(run["random_greedy"], run["plain"])):
        assert g["output_ids"] == p["output_ids"], f"prompt {i}: random planner vs SGLang without speculation"
    for i, (g, f) in enumerate(zip(run["random_seeded"], run["seeded_fixed"])):
        assert g["output_ids"] == f["output_ids"], f"seeded prompt {i}: random planner vs the fixed tree"
    assert run["random_seeded"][0]["output_ids"] == run["sampled"]
    assert len({tuple(g["output_ids"]) for g in run["random_seeded"]}) > 1  # the seeds do differ


def test_random_planner_metrics_and_no_leak(run):
    """AR steps count as verify steps of accept length 1: SGLang's per-request metrics stay consistent."""
    ar_steps = 0
    for g in run["random_greedy"] + run["random_seeded"]:
        mi = g["meta_info"]
        n, ct = mi["completion_tokens"], mi.get("spec_verify_ct", 0)
        if n <= 1:
            continue
        assert ct >= 1 and sum(mi["spec_correct_drafts_histogram"]) == ct
        assert mi["spec_accept_length"] == pytest.approx(n / ct)
        assert 1 + ct <= n <= 1 + ct + mi["spec_num_correct_drafts"]
        ar_steps += mi["spec_correct_drafts_histogram"][0]
    assert ar_steps > 0
    log = (run["logs"] / "random.log").read_text()
    assert "Mem Leak" not in log and "memory leak" not in log.lower() and "Traceback" not in log


def test_overlap_scheduler_stays_lossless(run):
    """Under SGLang's overlap scheduler (results processed a step late; roots relayed through its FutureMap):
    n-gram candidates merged with the drafter's tree, random tree sizes and AR steps give SGLang's tokens without
    speculation at 1 and 4 in flight, and the fixed tree's seeded samples."""
    for i, (g, c, p) in enumerate(zip(run["merged_batch1"], run["merged_concurrent"], run["plain"])):
        assert g["output_ids"] == p["output_ids"], f"prompt {i}: drafter + n-gram vs SGLang without speculation"
        assert c["output_ids"] == p["output_ids"], f"prompt {i} (4 in flight): drafter + n-gram vs plain SGLang"
    for i, (g, f) in enumerate(zip(run["merged_seeded"], run["seeded_fixed"])):
        assert g["output_ids"] == f["output_ids"], f"seeded prompt {i}: drafter + n-gram vs the fixed tree"
    steps = sum(g["meta_info"].get("spec_verify_ct", 0) for g in run["merged_batch1"])
    tokens = sum(g["meta_info"]["completion_tokens"] - 1 for g in run["merged_batch1"])
    print(f"overlap, drafter + n-gram (random planner) accept length {tokens / max(steps, 1):.2f}")
    log = (run["logs"] / "merged.log").read_text()
    assert "Mem Leak" not in log and "memory leak" not in log.lower() and "Traceback" not in log
    assert run["merged_info"]["disable_overlap_schedule"] is False  # the overlap scheduler did run
    # ragged passes ran (GLANCE_SGL_RAGGED_VERIFY=1): steps whose requests verified unequal rows log their mean
    assert re.search(r"GLANCE step bs=\d+ .*? target\[\d+\.\d+\]", log), "no ragged pass in the overlap engine"
    for name in ("glance", "random", "merged", "ngram"):  # supports_overlap=True: no deprecation notice
        assert "supports_overlap=False" not in (run["logs"] / f"{name}.log").read_text()


def test_ngram_only_steps_stay_lossless(run):
    """N-gram candidates alone (no drafter pass, no tap features captured), random tree sizes and AR steps at 4
    in flight: SGLang's tokens without speculation, and the fixed tree's seeded samples."""
    for i, (g, p) in enumerate(zip(run["ngram_greedy"], run["plain"])):
        assert g["output_ids"] == p["output_ids"], f"prompt {i}: n-gram alone vs SGLang without speculation"
    for i, (g, f) in enumerate(zip(run["ngram_seeded"], run["seeded_fixed"])):
        assert g["output_ids"] == f["output_ids"], f"seeded prompt {i}: n-gram alone vs the fixed tree"
    drafted = sum(g["meta_info"]["completion_tokens"] - 1 - g["meta_info"].get("spec_verify_ct", 0)
                  for g in run["ngram_greedy"])
    assert drafted > 0  # some matches were accepted: n-gram steps did run
    log = (run["logs"] / "ngram.log").read_text()
    assert "Mem Leak" not in log and "memory leak" not in log.lower() and "Traceback" not in log


def test_profiling_engines_report_where_each_step_s_time_goes(run):
    """With ``GLANCE_SGL_PROFILE=1`` SGLang's internal state carries the worker's step parts (per step kind, steps
    and ms summed): the steps of a run, read before and after it, under the synchronous and the overlap scheduler
    (a deferred round's outcome read and report included once settled)."""
    from glance_sgl.round import PHASES

    for name, kinds, allowed in (("ngram", run["ngram_parts"], {"ar", "ngram"}),
                                 ("merged", run["merged_parts"], {"ar", "ngram", "drafter", "merged"})):
        assert kinds and set(kinds) <= allowed, f"{name}: {sorted(kinds)}"
        steps = sum(p["steps"] for p in kinds.values())
        verifies = sum(r["meta_info"]["spec_verify_ct"] for r in run[f"{name}_greedy" if name == "ngram"
                                                                        else "merged_concurrent"])
        assert 0 < steps <= verifies  # 4 in flight: a step verifies up to 4 requests
        for kind, parts in kinds.items():
            assert set(parts) == {"steps", "between", "prepare", *PHASES} and min(parts.values()) >= 0
            assert parts["pass"] > 0 and (kind == "ar" or parts["lookup"] > 0), f"{name} {kind}: {parts}"
    means = bench.mean_parts([run["ngram_parts"]])
    assert means["ngram"]["steps"] == int(run["ngram_parts"]["ngram"]["steps"])


def test_step_timing_times_every_engine_s_steps_whatever_its_algorithm(run):
    """``GLANCE_SGL_STEP_TIMING=1`` (the bench's side-by-side step table): SGLang's internal state carries, for an
    engine without speculation and for GLANCE alike, its decode steps and prefill batches with the wall ms of each
    step and of the target's forwards in it, and the scheduler's time between two decode steps. GLANCE's decode steps
    are the worker's steps, counted by its own profile between the same readings; a plain engine decodes one token
    a step."""
    plain, ngram = run["plain_timing"], run["ngram_timing"]
    for name, t in (("plain", plain), ("ngram", ngram)):
        assert set(t) == {"decode", "prefill"}, f"{name}: {t}"
        for kind, s in t.items():
            assert s["steps"] > 0 and s["requests"] >= s["steps"], f"{name} {kind}: {s}"
            assert 0 < s["forward_ms"] <= s["step_ms"] and s["rows"] >= s["requests"], f"{name} {kind}: {s}"
    for name, t in (("plain", plain), ("ngram", ngram)):  # decode steps back to back: the time between them
        d = t["decode"]
        assert 0 < d["gaps"] < d["steps"] and 0 < d["gap_ms"], f"{name}: {d}"
        assert "gaps" not in t["prefill"], f"{name}: {t['prefill']}"
    assert plain["decode"]["rows"] == plain["decode"]["requests"]  # one row a request: the plain decode step
    assert plain["prefill"]["requests"] >= N_PROMPTS  # warm-up prefills too: read since the engine started
    assert plain["decode"]["steps"] >= sum(r["meta_info"]["completion_tokens"] - 1 for r in run["plain"])
    assert ngram["decode"]["steps"] == sum(p["steps"] for p in run["ngram_parts"].values())
    assert ngram["prefill"]["requests"] >= N_PROMPTS


def test_drafting_off_is_plain_decoding(run):
    """Drafting forced off: every step verifies the root alone (one token per step), SGLang's tokens without
    speculation and the fixed tree's seeded samples."""
    for i, (g, p) in enumerate(zip(run["off_greedy"], run["plain"])):
        assert g["output_ids"] == p["output_ids"], f"prompt {i}: drafting off vs SGLang without speculation"
        assert g["meta_info"]["spec_verify_ct"] == g["meta_info"]["completion_tokens"] - 1
    for i, (g, f) in enumerate(zip(run["off_seeded"], run["seeded_fixed"])):
        assert g["output_ids"] == f["output_ids"], f"seeded prompt {i}: drafting off vs the fixed tree"
    log = (run["logs"] / "off.log").read_text()
    assert "Mem Leak" not in log and "memory leak" not in log.lower() and "Traceback" not in log


def test_the_engine_process_freezes_its_start_up_objects_out_of_the_collector(run):
    """As SGLang's HTTP server does after its warm-up (``/freeze_gc``): the runner calls ``Engine.freeze_gc``, so a
    full collection never walks the start-up objects mid-run (it stalled an engine for 0.4-0.5 s on 2 cores)."""
    assert run["merged_info"]["gc_frozen_objects"] > 100_000
