"""A real gateway on loopback for the load-harness tests: uvicorn in a thread (the server tests' helpers),
embedded backend on a tiny random Qwen2.5-VL target and a random drafter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))  # the server tests' helpers

from server_helpers import API_KEY, start_embedded  # noqa: E402

from glance_sgl.checkpoints import MASK_TOKEN, build_random_target  # noqa: E402
from glance_sgl.drafter import GlanceDrafter  # noqa: E402
from glance_sgl.engine import GlanceEngine  # noqa: E402


@pytest.fixture(scope="session")
def load_engine(tmp_path_factory) -> GlanceEngine:
    root = tmp_path_factory.mktemp("loadtest_ckpt")
    target_dir = build_random_target(root / "target", arch="qwen2_5_vl", seed=11)
    engine = GlanceEngine.load(target_dir, None)
    mask_id = engine.target.tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    GlanceDrafter.for_target(engine.target.text_config, mask_id, seed=11, num_hidden_layers=1,
                             block_size=8).save_pretrained(root / "drafter")
    return GlanceEngine.load(target_dir, root / "drafter", budget=7)


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
