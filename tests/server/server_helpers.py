"""Helpers of the server tests: a uvicorn server in a thread on loopback, images, request bodies."""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import pytest
import numpy as np
import uvicorn
from PIL import Image

from glance_server.app import create_app
from glance_server.config import MiB, ServerConfig
from glance_server.embedded import EmbeddedBackend

API_KEY = "test-key-123"
MODEL = "glance-test"


class ServerThread:
    """A uvicorn server on 127.0.0.1 (or another loopback address), ephemeral port, in a daemon thread."""

    def __init__(self, app, host: str = "127.0.0.1") -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                return
            time.sleep(0.1)
        raise RuntimeError("gateway never became ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def png_bytes(seed: int = 0, size: tuple[int, int] = (112, 112), fmt: str = "PNG") -> bytes:
    rng = np.random.RandomState(seed)
    w, h = size
    arr = rng.randint(0, 256, (h, w, 3), dtype=np.uint8)
    arr[10:40, 10:40] = rng.randint(0, 256, 3)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_message(text: str, seed: int = 0, n_images: int = 1) -> list[dict]:
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(seed + k))}}
                         for k in range(n_images)]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def base_config(**overrides) -> ServerConfig:
    settings = dict(served_model_name=MODEL, api_key=API_KEY, max_body_bytes=2 * MiB, max_images=2,
                    max_image_bytes=1 * MiB, max_image_pixels=4_000_000, max_tokens_limit=512, default_max_tokens=16,
                    calibrate=False, request_timeout_s=120)
    settings.update(overrides)
    return ServerConfig(**settings)


def start_embedded(engine: GlanceEngine, **overrides) -> ServerThread:
    config = base_config(**overrides)
    server = ServerThread(create_app(config, EmbeddedBackend(engine, config), engine.target.processor))
    server.wait_ready()
    return server


def check_glance(glance: dict, completion_tokens: int) -> None:
    """The identities the gateway promises."""
    assert glance["completion_tokens"] == completion_tokens
    assert glance["prefill_tokens"] == 1
    assert glance["decode_tokens"] == completion_tokens - 1
    if glance["committed_per_round"] is not None:
        assert len(glance["committed_per_round"]) == glance["rounds"]
        assert glance["prefill_tokens"] + sum(glance["committed_per_round"]) == completion_tokens
    if glance["rounds"]:
        assert glance["tau"] == pytest.approx(glance["decode_tokens"] / glance["rounds"])
        assert glance["tau_minus_1"] == pytest.approx(glance["tau"] - 1)
        assert sum(glance["acceptance_histogram"]) == glance["rounds"]
        assert sum(a * n for a, n in enumerate(glance["acceptance_histogram"])) == glance["accepted_tokens"]
    assert glance["accepted_tokens"] <= glance["drafted_tokens"]
    for key in ("prefill_ms", "decode_ms", "queue_ms"):
        assert glance[key] >= 0
    if glance["rows_histogram"] is not None:
        assert sum(glance["rows_histogram"].values()) == glance["rounds"]
        assert glance["rounds_without_drafting"] <= glance["rounds"]
