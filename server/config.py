"""Gateway settings: limits, safety switches and backend choice (all with safe defaults)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

MiB = 1024 * 1024


@dataclass
class ServerConfig:
    """Everything the gateway enforces. Defaults are the production defaults of ``glance serve``."""

    served_model_name: str = "glance-demo"
    api_key: str | None = None  # bearer token; None = no authentication
    # request limits
    max_body_bytes: int = 32 * MiB
    max_images: int = 4
    max_image_bytes: int = 8 * MiB  # encoded bytes of one image (data URL payload, upload or download)
    max_image_pixels: int = 16_777_216  # width * height, checked from the header before decoding
    max_tokens_limit: int = 2048  # largest max_tokens a request may ask for
    default_max_tokens: int = 256
    max_prompt_chars: int = 200_000
    # queueing
    max_queue: int = 32  # requests waiting for the engine (or for an upstream slot); beyond: 429
    upstream_concurrency: int = 16  # sglang backend: requests in flight upstream at once
    request_timeout_s: float = 600.0
    # remote images (http/https image_url): off by default
    allow_remote_images: bool = False
    remote_image_hosts: list[str] = field(default_factory=list)  # exact hosts or "*.example.com"
    remote_image_timeout_s: float = 10.0
    remote_image_max_redirects: int = 3
    # private networks a remote image may come from anyway (e.g. an internal image store); empty by default.
    # Loopback, link-local and metadata addresses outside these networks are always refused.
    trusted_image_networks: list[str] = field(default_factory=list)
    # embedded engine
    calibrate: bool = True  # measure AR ms/token at start-up for the estimated speedup
    # sglang backend
    upstream_url: str | None = None
    upstream_api_key: str | None = None  # sent as a bearer token to the upstream server
    upstream_timeout_s: float = 600.0
    upstream_connect_timeout_s: float = 5.0
    ar_ms_per_token: float | None = None  # sglang backend: AR ms/token measured offline, for estimates
    # testing only: lets a request inject an engine failure ("glance": {"debug_fault": "engine_error"})
    debug_faults: bool = False

    def __post_init__(self) -> None:
        self.trusted_networks = [ipaddress.ip_network(n, strict=False) for n in self.trusted_image_networks]
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.default_max_tokens > self.max_tokens_limit:
            self.default_max_tokens = self.max_tokens_limit
