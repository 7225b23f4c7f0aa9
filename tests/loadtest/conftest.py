"""A real gateway on loopback for the load-harness tests: uvicorn in a thread (the server tests' helpers),
embedded backend on a tiny random Qwen2.5-VL target and a random drafter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))  # the server tests' helpers

from tests.server.server_helpers import API_KEY, start_embedded  # noqa: E402

from glance_sgl.checkpoints import build_random_pair  # noqa: E402
from glance_sgl.engine import GlanceEngine  # noqa: E402


@pytest.fixture(scope="session")
def load_engine(tmp_path_factory) -> GlanceEngine:
    target_dir, drafter_dir = build_random_pair(tmp_path_factory.mktemp("loadtest_ckpt"), seed=11,
                                                num_hidden_layers=1, block_size=8)
    return GlanceEngine.load(target_dir, drafter_dir, budget=7)


@pytest.fixture(scope="session")
def load_gateway(load_engine):
    """Calibrated (so responses carry an estimated speedup), with an API key. One torch thread while it runs:
    on 2 shared cores a 2-thread engine next to the client's event loop spends its time spin-waiting
    (about 30x slower per token)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = start_embedded(load_engine, calibrate=True, max_queue=64, max_images=2, default_max_tokens=8)
    yield server
    server.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY
