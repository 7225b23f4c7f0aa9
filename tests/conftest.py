"""Shared fixtures: tiny randomly initialised Qwen2.5-VL / Qwen2-VL targets built offline, random drafters."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# planner calibrations of the tests' throwaway models go to a temporary folder, not ~/.cache
os.environ.setdefault("GLANCE_COST_CACHE", os.path.join(tempfile.gettempdir(), f"glance-test-costs-{os.getpid()}"))
# SGLang engines started by the tests draft eagerly (a compile costs each engine process seconds); the compiled
# pass has its own tests (tests/test_drafter.py, tests/test_lossless.py)
os.environ.setdefault("GLANCE_SGL_COMPILE_DRAFTER", "0")

import pytest
import torch

from glance_sgl.checkpoints import build_random_target
from glance_sgl.engine import GlanceEngine
from glance_sgl.target import TargetAdapter
from tests.glance_testing import ARCHS, random_drafter

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def target_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("targets")
    return {arch: str(build_random_target(root / arch, arch=arch, seed=1)) for arch in ARCHS}


@pytest.fixture(scope="session")
def targets(target_dirs) -> dict[str, TargetAdapter]:
    return {arch: TargetAdapter.load(path) for arch, path in target_dirs.items()}


@pytest.fixture(scope="session")
def engines(targets) -> dict[str, GlanceEngine]:
    return {arch: GlanceEngine(t, random_drafter(t, num_hidden_layers=2)) for arch, t in targets.items()}
