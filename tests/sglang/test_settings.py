"""The worker's settings: every GLANCE variable parsed and validated once, bad values named."""

from __future__ import annotations

from pathlib import Path

import pytest

from glance_sgl.sglang.settings import SettingsError, WorkerSettings


def test_defaults_from_an_empty_environment():
    s = WorkerSettings.from_env({})
    assert s == WorkerSettings()
    assert (s.planner, s.step, s.graph_widths, s.profile, s.count_host_reads, s.dump_taps) == \
        ("auto", "auto", None, False, False, None)
    assert s.device_step(on_cuda=True) and not s.device_step(on_cuda=False)
    assert (s.draft_sources, s.ngram_corpus) == (("drafter", "ngram"), "shared")  # merged by default
    assert s.compile_drafter  # the CPU drafter pass compiled by default


def test_every_variable_is_read():
    s = WorkerSettings.from_env({"GLANCE_PLANNER": " Random:17 ", "GLANCE_CUDA_GRAPH_WIDTHS": " 4, 12 ",
                                 "GLANCE_SGL_STEP": "device", "GLANCE_SGL_STATIC_DRAFT": "1",
                                 "GLANCE_SGL_PROFILE": "true", "GLANCE_SGL_COUNT_HOST_READS": "1",
                                 "GLANCE_SGL_DUMP_TAPS": "/tmp/taps", "GLANCE_DRAFT_SOURCES": " NGram, drafter ",
                                 "GLANCE_NGRAM_CORPUS": "Per-Key", "GLANCE_SGL_STEP_TIMING": "on"})
    assert (s.planner, s.planner_seed, s.graph_widths, s.step) == ("random", 17, (4, 12), "device")
    assert s.static_draft and s.profile and s.count_host_reads and s.dump_taps == Path("/tmp/taps")
    assert s.step_timing and not WorkerSettings.from_env({}).step_timing
    assert s.device_step(on_cuda=False)
    assert (s.draft_sources, s.ngram_corpus) == (("drafter", "ngram"), "per-key")  # canonical order
    assert WorkerSettings.from_env({"GLANCE_DRAFT_SOURCES": "ngram,ngram"}).draft_sources == ("ngram",)
    assert WorkerSettings.from_env({"GLANCE_DRAFT_SOURCES": " "}).draft_sources == ("drafter", "ngram")
    assert WorkerSettings.from_env({"GLANCE_DRAFT_SOURCES": "drafter"}).draft_sources == ("drafter",)
    assert WorkerSettings.from_env({"GLANCE_SGL_STEP": "host"}).device_step(on_cuda=True) is False
    assert WorkerSettings.from_env({"GLANCE_SGL_DEVICE_STEP": "1"}).step == "device"  # the earlier spelling
    assert not WorkerSettings.from_env({"GLANCE_SGL_COMPILE_DRAFTER": "0"}).compile_drafter
    assert WorkerSettings.from_env({"GLANCE_SGL_COMPILE_DRAFTER": " On "}).compile_drafter


@pytest.mark.parametrize(("env", "named"), [
    ({"GLANCE_PLANNER": "greedy"}, "GLANCE_PLANNER"),
    ({"GLANCE_PLANNER": "fixed:3"}, "GLANCE_PLANNER"),
    ({"GLANCE_PLANNER": "random:x"}, "GLANCE_PLANNER"),
    ({"GLANCE_CUDA_GRAPH_WIDTHS": "4,a"}, "GLANCE_CUDA_GRAPH_WIDTHS"),
    ({"GLANCE_CUDA_GRAPH_WIDTHS": "0,4"}, "GLANCE_CUDA_GRAPH_WIDTHS"),
    ({"GLANCE_SGL_STEP": "gpu"}, "GLANCE_SGL_STEP"),
    ({"GLANCE_SGL_PROFILE": "maybe"}, "GLANCE_SGL_PROFILE"),
    ({"GLANCE_SGL_COUNT_HOST_READS": "2"}, "GLANCE_SGL_COUNT_HOST_READS"),
    ({"GLANCE_SGL_STEP_TIMING": "always"}, "GLANCE_SGL_STEP_TIMING"),
    ({"GLANCE_DRAFT_SOURCES": "drafter,eagle"}, "GLANCE_DRAFT_SOURCES"),
    ({"GLANCE_DRAFT_SOURCES": "drafter;ngram"}, "GLANCE_DRAFT_SOURCES"),
    ({"GLANCE_NGRAM_CORPUS": "global"}, "GLANCE_NGRAM_CORPUS"),
    ({"GLANCE_SGL_COMPILE_DRAFTER": "inductor"}, "GLANCE_SGL_COMPILE_DRAFTER"),
])
def test_bad_values_name_the_variable(env, named):
    with pytest.raises(SettingsError, match=named):
        WorkerSettings.from_env(env)


def test_the_object_validates_itself():
    with pytest.raises(SettingsError, match="step"):
        WorkerSettings(step="gpu")
    with pytest.raises(SettingsError, match="graph_widths"):
        WorkerSettings(graph_widths=(0,))
    with pytest.raises(SettingsError, match="draft_sources"):
        WorkerSettings(draft_sources=())
    with pytest.raises(SettingsError, match="ngram_corpus"):
        WorkerSettings(ngram_corpus="global")
