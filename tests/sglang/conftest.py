"""Fixtures of the SGLang plugin tests: the checkpoint pair under test and SGLang engines in child processes.

The pair is the bundled demo (``glance_sgl/demo/assets/{target,drafter}``) when it is installed, else
``GLANCE_SGL_TEST_CKPT`` (a directory holding ``target/`` and ``drafter/``), else a tiny random pair built here
(``glance tiny``; parity holds, accept lengths are near zero).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sglang = pytest.importorskip("sglang")


def _pair_ready(target: Path, drafter: Path) -> bool:
    return (target / "config.json").is_file() and (drafter / "model.safetensors").is_file()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> tuple[Path, Path, str]:
    """(target dir, drafter dir, kind) with kind "demo", "env" or "tiny"."""
    from glance_sgl.demo.paths import bundled_drafter, bundled_target

    if _pair_ready(bundled_target(), bundled_drafter()):
        return bundled_target(), bundled_drafter(), "demo"
    env = os.environ.get("GLANCE_SGL_TEST_CKPT")
    if env and _pair_ready(Path(env) / "target", Path(env) / "drafter"):
        return Path(env) / "target", Path(env) / "drafter", "env"
    from glance_sgl.checkpoints import build_random_pair

    target_dir, drafter_dir = build_random_pair(tmp_path_factory.mktemp("tiny_pair"), seed=0)
    return target_dir, drafter_dir, "tiny"
