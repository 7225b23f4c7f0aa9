"""Gateways on loopback for the server tests: real uvicorn servers in threads, a tiny random engine shared by
all of them (one engine, one lock: the gateways' worker threads take turns)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glance_sgl.checkpoints import build_random_pair
from glance_sgl.engine import GlanceEngine
from glance_server.app import create_app
from glance_server.sglang import SGLangBackend
from tests.server.server_helpers import API_KEY, ServerThread, base_config, start_embedded


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    return build_random_pair(tmp_path_factory.mktemp("serve_ckpt"), seed=7, num_hidden_layers=1, block_size=8)


@pytest.fixture(scope="session")
def engine(checkpoints) -> GlanceEngine:
    target_dir, drafter_dir = checkpoints
    return GlanceEngine.load(target_dir, drafter_dir, budget=7)


@pytest.fixture(scope="session")
def gateway(engine):
    """The main gateway: API key, remote images on for an allowlist of (refused) loopback/metadata hosts and
    for 127.0.0.2 (a trusted network: the test image host), fault injection on, calibrated."""
    server = start_embedded(  # threads: the session's count, kept (tests/server/test_engine_threads.py times them)
        engine, calibrate=True, threads=torch.get_num_threads(), debug_faults=True, allow_remote_images=True,
        remote_image_hosts=["127.0.0.1", "localhost", "169.254.169.254", "::1", "::ffff:127.0.0.1", "127.0.0.2",
                            "0.0.0.0"],
        trusted_image_networks=["127.0.0.2/32"], remote_image_timeout_s=5,
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def plain_gateway(engine):
    """Defaults for remote images (off), no API key."""
    server = start_embedded(engine, api_key=None)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sglang_gateway(gateway, engine):
    """A gateway whose backend is the first gateway's SGLang-native /generate endpoint."""
    config = base_config(api_key=None, upstream_url=gateway.url, upstream_api_key=API_KEY)
    backend = SGLangBackend(gateway.url, engine.target.processor, config)
    server = ServerThread(create_app(config, backend, engine.target.processor))
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture()
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def long_prompt(engine) -> str:
    """A text prompt whose greedy answer does not stop early (so that a request with a large max_tokens keeps
    the engine busy for seconds)."""
    from glance_sgl.engine import SamplingParams

    for k in range(20):
        prompt = f"write a long story number {k}"
        result = engine.generate([{"role": "user", "content": prompt}], SamplingParams(max_tokens=48), mode="ar")
        if result.finish_reason == "length":
            return prompt
    pytest.skip("no long-running prompt found for this random model")
