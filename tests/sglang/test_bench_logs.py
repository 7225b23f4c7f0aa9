"""The SGLang bench's parts that need no engine: the methods' engine arguments and env (DFLASH, GLANCE with the
planner off, the overlap flag), DFLASH's CPU refusal and its preflight on the bundled pair, and what it reads from
the engines' logs (host reads per step, a synchronous engine, the error line of a failed engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glance_sgl.demo.paths import bundled_drafter, bundled_target
from glance_sgl.sglang import bench

MODEL, DRAFTER = bundled_target(), bundled_drafter()


def test_dflash_engine_loads_the_drafter_unchanged_with_its_block_size():
    block = json.loads((DRAFTER / "config.json").read_text())["block_size"]
    assert bench.drafter_block_size(DRAFTER) == block
    for device in ("cpu", "cuda"):
        kw = bench.engine_kwargs("dflash", MODEL, DRAFTER, device, 8)
        assert kw["speculative_algorithm"] == "DFLASH"
        assert kw["speculative_draft_model_path"] == str(DRAFTER)
        assert kw["speculative_num_draft_tokens"] == block
    assert bench.engine_env("dflash") == {}


def test_overlap_flag_sets_the_speculative_engines_only():
    for device in ("cpu", "cuda"):
        for method in ("ngram", "dflash", "glance", "glance-off"):
            assert bench.engine_kwargs(method, MODEL, DRAFTER, device, 8, overlap="on")["disable_overlap_schedule"] \
                is False
            assert bench.engine_kwargs(method, MODEL, DRAFTER, device, 8, overlap="off")["disable_overlap_schedule"] \
                is True
        none = bench.engine_kwargs("none", MODEL, DRAFTER, device, 8, overlap="on")
        assert none.get("disable_overlap_schedule") is (True if device == "cpu" else None)
    assert "disable_overlap_schedule" not in bench.engine_kwargs("glance", MODEL, DRAFTER, "cuda", 8)
    assert bench.engine_kwargs("glance", MODEL, DRAFTER, "cpu", 8)["disable_overlap_schedule"] is True


def test_a_method_may_set_its_own_overlap_mode():
    assert bench.method_parts("glance+ngram@overlap") == ("glance+ngram", "on")
    assert bench.method_parts("ngram@sync") == ("ngram", "off") and bench.method_parts("none") == ("none", None)
    for bad in ("glance@fast", "turbo", "glance@"):
        with pytest.raises(ValueError, match="unknown method"):
            bench.method_parts(bad)
    kw = bench.engine_kwargs("glance@overlap", MODEL, DRAFTER, "cpu", 8, overlap="off")
    assert kw["disable_overlap_schedule"] is False  # the method's own mode wins over the run's
    assert bench.engine_env("glance@overlap")["GLANCE_SGL_CPU_OVERLAP"] == "1"
    assert "GLANCE_SGL_CPU_OVERLAP" not in bench.engine_env("glance@sync", overlap="on")
    assert bench.engine_env("ngram@overlap") == {}


def test_glance_off_forces_the_planner_off_and_host_reads_are_opt_in():
    assert bench.engine_env("glance-off") == {"GLANCE_PLANNER": "off"}
    assert bench.engine_kwargs("glance-off", MODEL, DRAFTER, "cuda", 8)["speculative_algorithm"] == "GLANCE"
    assert bench.engine_env("glance", count_host_reads=True) == {"GLANCE_PLANNER": "auto",
                                                                  "GLANCE_SGL_COUNT_HOST_READS": "1"}
    assert bench.engine_env("none", count_host_reads=True) == {}
    # --step-stats times every engine's steps, whatever its method (the side-by-side step table)
    assert bench.engine_env("none", step_stats=True, count_host_reads=True) == {"GLANCE_SGL_STEP_TIMING": "1"}
    assert bench.engine_env("ngram", step_stats=True)["GLANCE_SGL_STEP_TIMING"] == "1"
    assert bench.engine_env("glance", step_stats=True)["GLANCE_SGL_STEP_TIMING"] == "1"


def test_the_step_table_puts_every_method_s_decode_step_beside_no_speculation_s():
    """Per scenario: decode steps, mean batch, rows per request, ms per step split into the target's forward (and
    its us per row) and the rest, the scheduler's ms between two decode steps, the step over no speculation's step
    in the same scenario, the prefill's ms per request; a method or scenario without timing is left out, a scenario
    without no speculation has no ratio, a run without gaps none between steps."""
    from glance_sgl.sglang.step_timing import STEP_HEAD, step_table

    def timing(steps, reqs, ms, fwd, rows_per_req=1, pre_reqs=4, pre_ms=20.0, gaps=0, gap_ms=0.0):
        gap = {"gaps": gaps, "gap_ms": gap_ms} if gaps else {}
        return {"step_timing": {"decode": {"steps": steps, "requests": reqs, "rows": rows_per_req * reqs,
                                           "step_ms": ms, "forward_ms": fwd, **gap},
                                "prefill": {"steps": 2, "requests": pre_reqs, "rows": 800, "step_ms": pre_ms,
                                            "forward_ms": pre_ms}}}

    methods = [{"method": "none", "scenarios": {"demo c=4": timing(100, 400, 400.0, 390.0, gaps=90, gap_ms=45.0)}},
               {"method": "ngram", "scenarios": {"demo c=4": timing(40, 160, 240.0, 200.0, rows_per_req=8, gaps=36,
                                                                    gap_ms=54.0),
                                                 "wild c=1": timing(10, 10, 50.0, 40.0, rows_per_req=8)}},
               {"method": "glance", "scenarios": {"demo c=4": {"tokens_per_s": 1.0}}}]
    rows = step_table(methods, str.upper)
    assert len(STEP_HEAD) == len(rows[0]) and len(rows) == 3
    assert rows[0] == ["demo c=4", "NONE", "100", "4.0", "1.0", "4.00", "3.90", "975", "0.10", "0.50", "1.00",
                       "5.00"]
    assert rows[1] == ["", "NGRAM", "40", "4.0", "8.0", "6.00", "5.00", "156", "1.00", "1.50", "1.50", "5.00"]
    assert rows[2] == ["wild c=1", "NGRAM", "10", "1.0", "8.0", "5.00", "4.00", "500", "1.00", "–", "–", "5.00"]
    assert step_table([{"method": "none", "scenarios": {"demo c=1": {}}}]) == []



def test_the_gap_table_says_what_host_parity_with_ngram_would_give():
    """Per scenario and method: tokens per ms of decode steps over NGRAM's, the same with NGRAM's time outside the
    forward per step in place of the method's own, and both times; NGRAM itself, no speculation, a method that
    never drafted there (tau 1), a failed method and a scenario without NGRAM's timing give no row; the console
    table prints it."""
    from glance_sgl.sglang.step_timing import GAP_HEAD, gap_table

    def sc(tau, steps, reqs, ms, fwd):
        return {"tau": tau, "tokens_per_s": 1.0, "outputs": [],
                "step_timing": {"decode": {"steps": steps, "requests": reqs, "rows": 8 * reqs, "step_ms": ms,
                                           "forward_ms": fwd}}}

    rows = [{"method": "none", "scenarios": {"demo c=16": sc(1.0, 100, 1600, 1000.0, 990.0)}},
            # NGRAM: 16 requests a step, tau 5, 20 ms a step (16 forward + 4 outside): 4 tokens per ms
            {"method": "ngram", "scenarios": {"demo c=16": sc(5.0, 10, 160, 200.0, 160.0),
                                              "wild c=1": {"tau": 2.0, "tokens_per_s": 1.0, "outputs": []}}},
            # GLANCE: tau 6, 24 ms a step (18 + 6): 4 tokens per ms; with 4 ms outside, 96 / 22
            {"method": "glance", "scenarios": {"demo c=16": sc(6.0, 10, 160, 240.0, 180.0),
                                               "wild c=1": sc(2.0, 10, 10, 80.0, 60.0)}},
            {"method": "glance-off", "scenarios": {"demo c=16": sc(1.0, 10, 160, 130.0, 120.0)}},
            {"method": "dflash", "error": "boom", "scenarios": {}}]
    table = gap_table(rows, str.upper)
    assert len(GAP_HEAD) == len(table[0])
    assert table == [["demo c=16", "GLANCE", "1.00", f"{96 / 22 / 4:.2f}", "6.00", "4.00"]]
    assert gap_table([r for r in rows if r["method"] != "ngram"]) == []
    printed = bench.format_table([{**r, "scenarios": {k: {**v, "outputs": []} for k, v in r["scenarios"].items()}}
                                  for r in rows if not r.get("error")])
    assert "with NGRAM's time outside the forward" in printed and "1.09" in printed

def test_the_spread_table_gives_each_engine_run_s_ratio_over_ngram_beside_the_pooled_one():
    """With several engine runs each scenario keeps every run's rate; the spread table puts each method's rate over
    NGRAM's, pooled and run by run, with the runs' range; NGRAM itself, a failed method, a scenario without per-run
    rates and a run without NGRAM give no row; the console table prints it."""
    def sc(pooled, runs=None):
        return {"tokens_per_s": pooled, "tau": 2.0, "outputs": [], **({"runs_tokens_per_s": runs} if runs else {})}

    rows = [{"method": "ngram", "scenarios": {"demo c=1": sc(100.0, [90.0, 110.0]), "wild c=1": sc(50.0)}},
            {"method": "glance", "scenarios": {"demo c=1": sc(120.0, [117.0, 121.0]), "wild c=1": sc(40.0)}},
            {"method": "glance-ngram", "scenarios": {"demo c=1": sc(95.0, [99.0, 88.0])}},
            {"method": "glance-off", "scenarios": {"demo c=1": sc(70.0, [None, 66.0])}},  # no rate in run 1
            {"method": "none", "error": "boom", "scenarios": {}}]
    spread = bench.run_spread(rows, label=str.upper)
    assert spread == [["demo c=1", "GLANCE", "1.20", "1.30 1.10", "1.10-1.30"],
                      ["", "GLANCE-NGRAM", "0.95", "1.10 0.80", "0.80-1.10"],
                      ["", "GLANCE-OFF", "0.70", "0.60", "0.60-0.60"]]
    assert len(spread[0]) == len(bench.SPREAD_HEAD)
    assert bench.run_spread(rows[1:]) == []  # no NGRAM in the run
    table = bench.format_table(rows)
    assert "each engine run" in table and "1.10-1.30" in table


def test_outputs_are_compared_with_the_method_that_shares_their_sampling():
    """Greedy: every method against no speculation. Sampled (``--temperature``): GLANCE's methods against
    ``glance-off`` (the same seeded sampling), the others against nothing; a missing base leaves no count."""
    assert bench.identity_base("ngram", 0.0) == "none" and bench.identity_base("none", 0.0) is None
    assert bench.identity_base("glance@sync", 0.7) == "glance-off"
    assert bench.identity_base("glance-ngram#abc123", 0.7) == "glance-off#abc123"
    assert bench.identity_base("ngram", 0.7) is None and bench.identity_base("glance-off", 0.7) is None

    def row(method, outputs):
        return {"method": method, "scenarios": {"demo c=1": {"tokens_per_s": 1.0, "tau": 1.0, "outputs": outputs}}}

    rows = [row("none", [[1], [2]]), row("ngram", [[1], [3]]), row("glance", [[1], [2]]), row("glance-off", [[1], [9]])]
    bench.mark_identical(rows, 0.0)
    assert [r["scenarios"]["demo c=1"].get("identical") for r in rows] == [None, [1, 2], [2, 2], [1, 2]]
    rows = [row("none", [[1], [2]]), row("ngram", [[1], [3]]), row("glance", [[1], [2]]), row("glance-off", [[1], [9]])]
    bench.mark_identical(rows, 0.7)
    assert [r["scenarios"]["demo c=1"].get("identical") for r in rows] == [None, None, [1, 2], None]
    assert bench.sampled([{"text": "a"}, {"text": "b"}], 0.7) == [{"text": "a", "temperature": 0.7, "seed": 0},
                                                                 {"text": "b", "temperature": 0.7, "seed": 1}]


def test_dflash_on_cpu_fails_with_the_reason_not_a_crash():
    why = bench.method_unavailable("dflash", "cpu")
    assert "speculative_hook.py" in why and "_handle_dflash" in why and "--device cuda" in why
    assert bench.method_unavailable("dflash", "cuda") is None
    assert bench.method_unavailable("glance", "cpu") is None
    assert "tree_speculative_sampling_target_only" in bench.method_unavailable("ngram@sync", "cpu", 0.7)
    assert bench.method_unavailable("ngram", "cpu") is None and bench.method_unavailable("ngram", "cuda", 0.7) is None
    assert bench.method_unavailable("glance-ngram", "cpu", 0.7) is None
    row = bench.failed_row("dflash", why)
    assert row == {"method": "dflash", "error": why, "scenarios": {}}
    assert "dflash: FAILED: SGLang's DFLASH does not run on a CPU" in bench.format_table([row])


def test_dflash_preflight_on_the_bundled_pair():
    problems = bench.dflash_preflight(MODEL, DRAFTER)
    # The drafter's config is what DFLASH reads (layers, block size, mask token id, shapes); what is missing is
    # on SGLang's side: Qwen2.5-VL has no DFLASH capture method.
    assert all("set_dflash_layers_to_capture" in p for p in problems), problems


def test_host_reads_from_a_log(tmp_path):
    log = tmp_path / "glance.log"
    log.write_text("\n".join([
        "[2026-12-02 08:00:00] GLANCE host reads bs=1 rows=1: 3 {'item': 1, 'tolist': 2}",
        "[2026-12-02 08:00:00] GLANCE host reads bs=1 rows=16: 7 {'cpu': 2, 'tolist': 5}",
        "something else",
        "[2026-12-02 08:00:01] GLANCE host reads bs=1 rows=16: 5 {'tolist': 5}",
        "[2026-12-02 08:00:01] GLANCE host reads bs=8 rows=0: 2 {'tolist': 2}",
    ]) + "\n")
    h = bench.host_reads(log)
    assert (h["steps"], h["max"], h["mean"]) == (4, 7, 4.25)
    assert h["by_shape"]["bs=1 rows=16"] == {"steps": 2, "max": 7, "mean": 6.0}
    assert list(h["by_kind"]) == ["bs=1 ar", "bs=1 tree", "bs=8 ar"]
    assert h["by_kind"]["bs=8 ar"] == {"steps": 1, "max": 2, "mean": 2.0}
    assert h["calls"] == {"cpu": 2, "item": 1, "tolist": 14}
    assert bench.host_reads(tmp_path / "missing.log") is None
    (tmp_path / "quiet.log").write_text("no counts here\n")
    assert bench.host_reads(tmp_path / "quiet.log") is None


def test_overlap_note_and_error_line(tmp_path):
    log = tmp_path / "e.log"
    log.write_text("start\n[t] WARNING Speculative algorithm GLANCE is registered with supports_overlap=False, "
                   "which is deprecated\n")
    assert "supports_overlap=False" in bench.overlap_note(log)
    log.write_text("start\nall fine\n")
    assert bench.overlap_note(log) is None
    exc = RuntimeError("SGLang engine process exited (1):\nTraceback (most recent call last):\n  File \"x.py\"\n"
                       "ValueError: Speculative algorithm GLANCE does not support overlap scheduling.\n")
    assert bench.error_line(exc) == "ValueError: Speculative algorithm GLANCE does not support overlap scheduling."
    assert bench.error_line(RuntimeError("boom")) == "RuntimeError: boom"


def test_warm_up_never_runs_a_measured_request():
    """The engines warm up (calibrate) at every level on requests of the same kinds that are not measured: no
    corpus holds the start of a measured answer before its run."""
    from glance_sgl.sglang.runner import demo_requests, wild_requests

    demo, _ = demo_requests(MODEL, 6, 8)
    wild = wild_requests(MODEL, 4, 8)
    scenarios = {"demo c=1": (demo, 1), "demo c=4": (demo, 4), "wild c=2": (wild, 2)}
    warm = bench.warm_up_requests(MODEL, scenarios, 6, 8)
    assert [c for _, c in warm] == [1, 4, 2] and [len(r) for r, _ in warm] == [2, 8, 4]
    measured = {(r["text"], r["image"]) for r in demo + wild}
    assert not any((r["text"], r["image"]) in measured for reqs, _ in warm for r in reqs)
    assert {r["text"] for r in warm[1][0]} <= {r["text"] for r in demo_requests(MODEL, 14, 8)[0][6:]}


def test_repeat_runs_only_the_scenarios_that_replay_answers_and_is_bounded(capsys):
    """``--repeat``: the first scenario of each kind (requests seen for the first time) runs once, the later ones
    (replaying answers every corpus holds) N times; a bad count is a CLI error naming the flag."""
    names = ["demo c=1", "demo c=4", "demo c=16", "wild c=1", "wild c=8"]
    assert bench.replay_repeats(dict.fromkeys(names, ([], 1)), 3) == {
        "demo c=1": 1, "demo c=4": 3, "demo c=16": 3, "wild c=1": 1, "wild c=8": 3}
    assert bench.replay_repeats({"demo c=4": ([], 4), "demo c=1": ([], 1)}, 2) == {"demo c=4": 1, "demo c=1": 2}
    for bad in ("0", "101"):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--repeat", bad, "--methods", "none"])
        assert exc.value.code == 2 and "--repeat must be in [1, 100]" in capsys.readouterr().err


def test_engine_runs_is_bounded_and_needs_the_interleaved_harness(capsys):
    """``--engine-runs``: the interleaved run again with fresh engines (pooled); a bad count, or asking for it
    without ``--interleave``, is a CLI error naming the flag (as is a step of fewer than 2 rows)."""
    for argv, message in ((["--engine-runs", "0", "--interleave"], "--engine-runs must be in [1, 10]"),
                          (["--engine-runs", "11", "--interleave"], "--engine-runs must be in [1, 10]"),
                          (["--engine-runs", "2"], "give --interleave"),
                          (["--ngram-draft-tokens", "0"], "argument --ngram-draft-tokens: must be at least 2"),
                          (["--glance-draft-tokens", "1"], "argument --glance-draft-tokens: must be at least 2")):
        with pytest.raises(SystemExit) as exc:
            bench.main([*argv, "--methods", "none"])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_method_may_run_at_an_earlier_commit(tmp_path, capsys):
    """``glance#REV``: the method's engine runs the package of commit REV (before / after in one interleaved run);
    the export is that commit's tree, and a bad commit or folder is refused before any engine starts."""
    import subprocess

    from glance_sgl.sglang.runner import EngineProcess, export_package

    assert bench.method_commit("glance@overlap#e506600") == "e506600"
    assert bench.method_parts("glance@overlap#e506600") == ("glance", "on")
    assert bench.method_commit("ngram") is None
    with pytest.raises(ValueError, match="commit"):
        bench.method_commit("glance#")
    root = export_package("HEAD", tmp_path / "head")
    shown = subprocess.run(["git", "show", "HEAD:glance_sgl/sglang/bench.py"], capture_output=True, text=True,
                           check=True, cwd=Path(bench.__file__).resolve().parents[2]).stdout
    assert (root / "glance_sgl" / "sglang" / "bench.py").read_text() == shown
    with pytest.raises(ValueError, match="no-such-commit"):
        export_package("no-such-commit", tmp_path / "bad")
    with pytest.raises(ValueError, match="no glance_sgl"):
        EngineProcess({"device": "cpu"}, code_root=tmp_path / "bad")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--methods", "none,glance#no-such-commit", "--prompts", "1", "--wild", "0",
                    "--concurrency", "1"])
    assert exit_.value.code == 2 and "no-such-commit" in capsys.readouterr().err


def test_engines_started_together_get_distinct_free_rendezvous_ports():
    """Each SGLang engine an ``EngineProcess`` starts gets its own rendezvous port (``nccl_port``), below the
    ephemeral range and free when handed out; left to SGLang, engines started together could pick the same one."""
    import socket

    from glance_sgl.sglang.launch import rendezvous_port

    ports = [rendezvous_port() for _ in range(64)]
    assert len(set(ports)) == len(ports) and all(22000 <= p <= 29999 for p in ports)
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", ports[-1]))  # nothing holds it


def test_servers_get_free_ports_no_outgoing_connection_can_take(tmp_path):
    """``free_port`` hands out distinct ports below the kernel's ephemeral range (where the local end of an
    outgoing connection could take one while the server loads), and a server whose port is taken anyway fails at
    once, naming it, instead of waiting out its start-up timeout."""
    import subprocess
    import sys
    import time

    from glance_sgl.sglang.launch import SGLangServer, free_port, rendezvous_port

    ports = [free_port() for _ in range(32)] + [rendezvous_port() for _ in range(8)]
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert len(set(ports)) == len(ports) and all(p < low for p in ports[:32])
    log = tmp_path / "server.log"
    log.write_text("INFO: started\nERROR:    [Errno 98] error while attempting to bind on address "
                   "('127.0.0.1', 1): address already in use\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    server = SGLangServer(proc, "http://127.0.0.1:1", [], log)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="could not bind"):
        server.wait_ready(timeout=30)
    assert time.monotonic() - started < 10 and proc.poll() is not None


def test_step_stats_log_the_mean_ms_of_each_part_of_a_round_and_the_bench_reads_them(tmp_path):
    """The worker's ``StepStats`` (``GLANCE_SGL_PROFILE=1``) log per step kind the mean ms of the round's parts
    every 200 steps, through the worker's logger; the bench's ``--step-stats`` reads the last such line."""
    import logging

    from glance_sgl.round import PHASES
    from glance_sgl.sglang import glance_worker

    log = tmp_path / "glance.log"
    handler = logging.FileHandler(log)
    glance_worker.logger.addHandler(handler)
    try:
        stats = glance_worker.StepStats(log=True)
        for i in range(400):
            kind = "ngram" if i % 4 else "merged"
            parts = {p: (2.0 if p == "pass" else 0.5) for p in PHASES}
            stats.add_phases(kind, parts, None if i == 0 else 1.25 + (i % 2), 0.25)
            stats.record(8, 8)
    finally:
        glance_worker.logger.removeHandler(handler)
        handler.close()
    got = bench.host_ms_per_step(log)
    assert got == stats.phase_means() and set(got) == {"merged", "ngram"}
    assert got["ngram"]["steps"] == 300 and got["merged"]["steps"] == 100
    assert list(got["ngram"]) == ["steps", "between", "prepare", *PHASES] and got["ngram"]["pass"] == 2.0
    assert got["ngram"]["prepare"] == 0.25  # the worker's share, not SGLang's
    assert got["ngram"]["between"] == round((200 * 2.0 + 100 * 1.0) / 300, 3)  # odd steps 2 ms, the others 1 ms
    assert got["merged"]["between"] == round(99 / 100, 3)  # the first step had none before it
    assert bench.host_ms_per_step(tmp_path / "none.log") is None
