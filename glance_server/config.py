"""Gateway settings: limits, safety switches and backend choice (all with safe defaults)."""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, field

MiB = 1024 * 1024


@dataclass(frozen=True)
class RestartPolicy:
    """How the gateway supervises an SGLang server it launched (``glance serve --backend sglang`` without
    ``--upstream``): when the server dies it is started again after a back-off; when it has failed (died, or a
    restart did not become ready) more than ``max_restarts`` times within ``window_s`` seconds the gateway gives up
    and exits non-zero, so that its own supervisor (systemd, Kubernetes) takes over.

    The back-off before a restart is ``backoff_s * 2 ** (k - 1)`` seconds, at most ``max_backoff_s``, where ``k`` is
    the number of failures within the window (the first restart waits ``backoff_s``). Bad values raise
    ``ValueError`` naming the setting and its ``glance serve`` flag."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    FLAGS = {"max_restarts": "--sglang-max-restarts", "window_s": "--sglang-restart-window",
             "backoff_s": "--sglang-restart-backoff", "max_backoff_s": "--sglang-restart-max-backoff"}

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} ({self.FLAGS[name]}) {rule}, got {getattr(self, name)!r}")

        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise bad("max_restarts", "must be an integer >= 0 (0: exit at the first failure)")
        for name in ("window_s", "backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise bad(name, "must be a number of seconds")
        if not 0 < self.window_s < float("inf"):
            raise bad("window_s", "must be > 0 seconds")
        if not 0 <= self.backoff_s < float("inf"):
            raise bad("backoff_s", "must be >= 0 seconds")
        if not self.backoff_s <= self.max_backoff_s < float("inf"):
            raise bad("max_backoff_s", f"must be >= the back-off ({self.backoff_s} s)")

    def delay(self, failures: int) -> float:
        """Seconds to wait before the restart that follows the ``failures``-th failure within the window."""
        return min(self.backoff_s * 2.0 ** max(failures - 1, 0), self.max_backoff_s)


@dataclass
class ServerConfig:
    """Everything the gateway enforces. Defaults are the production defaults of ``glance serve``."""

    served_model_name: str = "glance-demo"
    api_key: str | None = None  # bearer token; None (and no api_keys) = no authentication
    api_keys: tuple[str, ...] = ()  # further accepted bearer tokens, one per tenant (glance serve --api-key-env)
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
    # torch intra-op threads of the engine thread (None: timed at start-up, see EmbeddedBackend._pick_threads)
    threads: int | None = None
    # sglang backend
    upstream_url: str | None = None
    upstream_api_key: str | None = None  # sent as a bearer token to the upstream server
    upstream_timeout_s: float = 600.0
    upstream_connect_timeout_s: float = 5.0
    ar_ms_per_token: float | None = None  # sglang backend: AR ms/token measured offline, for estimates
    sglang_restart: RestartPolicy = field(default_factory=RestartPolicy)  # a launched SGLang server's supervision
    # testing only: lets a request inject an engine failure ("glance": {"debug_fault": "engine_error"})
    debug_faults: bool = False

    # the settings __post_init__ checks: counts (integers, each with its smallest value) and sizes and times (numbers
    # above 0)
    COUNTS = {"max_images": 0, "max_tokens_limit": 1, "default_max_tokens": 1, "max_prompt_chars": 1, "max_queue": 1,
              "upstream_concurrency": 1, "remote_image_max_redirects": 0}
    POSITIVE = ("max_body_bytes", "max_image_bytes", "max_image_pixels", "request_timeout_s", "remote_image_timeout_s",
                "upstream_timeout_s", "upstream_connect_timeout_s")

    def __post_init__(self) -> None:
        """Bad values raise ``ValueError`` naming the setting (``glance serve`` checks its flags before)."""
        self.keys: tuple[str, ...] = tuple(dict.fromkeys(k for k in (self.api_key, *self.api_keys) if k))
        for name, low in self.COUNTS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in (*self.POSITIVE, *(("ar_ms_per_token",) if self.ar_ms_per_token is not None else ())):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a number above 0, got {value!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        try:
            self.trusted_networks = [ipaddress.ip_network(n, strict=False) for n in self.trusted_image_networks]
        except ValueError as exc:
            raise ValueError(f"trusted_image_networks: {exc}") from None
        if self.default_max_tokens > self.max_tokens_limit:
            self.default_max_tokens = self.max_tokens_limit


def key_identity(key: str) -> str:
    """A tenant's identity from its API key, never the key itself: ``key-`` and the first 16 hex digits of the
    key's SHA-256 (the n-gram corpus key of scope ``per-key``; safe to log)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def parse_api_keys(raw: str, name: str) -> tuple[str, ...]:
    """The keys in an API-key variable: one key, or several separated by commas (one per tenant), whitespace
    around each stripped; ValueError naming ``name`` when it holds none or an empty entry."""
    keys = [k.strip() for k in raw.split(",")]
    if not raw.strip() or any(not k for k in keys):
        raise ValueError(f"{name}: the variable is unset or empty, or has an empty entry (several keys are "
                         "separated by commas)")
    return tuple(dict.fromkeys(keys))
