"""The run: closed-loop users spawned at a rate, or open-loop Poisson arrivals, both bounded.

A run ends by itself: at ``run_time`` (always set; the default is 60 s) or when ``num_requests`` requests
have been sent and answered, whichever comes first. After the end no request is sent; requests in flight get
``stop_timeout`` seconds to finish and are then cancelled (recorded as ``cancelled``). Every request also has
its own deadline (``request_timeout``). So a run takes at most ``run_time + stop_timeout`` seconds plus the
set-up (building the image pool, two scrapes of ``/metrics``).
"""

from __future__ import annotations

import asyncio
import importlib
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from .client import GatewayClient
from .dataset import DEMO_TASKS, Dataset, build_dataset
from .stats import RequestRecord, parse_prometheus, parse_slos, server_delta, summarize, timeline
from .users import ChatUser, StopUser, User

MAX_RUN_TIME = 24 * 3600.0
MAX_USERS = 4096


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    # load shape
    users: int = 4  # closed loop: concurrent users
    spawn_rate: float | None = None  # users started per second (None: all at once)
    request_rate: float | None = None  # open loop: mean arrivals per second (math.inf: all at once)
    burstiness: float = 1.0  # open loop: gamma shape of the inter-arrival times (1 = Poisson)
    max_concurrency: int | None = None  # requests in flight at most (both modes)
    wait_time: tuple[float, float] = (0.0, 0.0)  # closed loop: pause between a user's tasks, uniform (lo, hi)
    # bounds
    run_time: float = 60.0
    num_requests: int | None = None
    request_timeout: float = 120.0
    stop_timeout: float = 30.0
    # requests
    dataset: str = "random"
    demo_tasks: tuple[str, ...] = DEMO_TASKS
    image_size: tuple[int, int] = (224, 224)
    prompt_words: tuple[int, int] = (4, 12)
    max_tokens: int = 64
    temperature: float = 0.0
    stream_fraction: float = 0.75
    task_weights: dict[str, float] | None = None
    user_class: Any = None  # a User subclass or "module:Class"; default ChatUser
    mode: str | None = None  # glance | chain | ar (the gateway's default when None)
    measure_speedup: float = 0.0  # fraction of requests that ask the gateway for a measured AR speedup
    model: str | None = None  # None: the first model of GET /v1/models
    api_key: str | None = None
    seed: int = 0
    # reporting
    goodput: list[str] = field(default_factory=list)  # ["ttft:500", "tpot:50", "e2el:2000"] (ms)
    scrape_metrics: bool = True
    progress: bool = True

    def validate(self) -> None:
        if not (0 < self.run_time <= MAX_RUN_TIME):
            raise ValueError(f"run_time must be within (0, {MAX_RUN_TIME:.0f}] seconds")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.request_rate is None and not (1 <= self.users <= MAX_USERS):
            raise ValueError(f"users must be within 1..{MAX_USERS}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once)")
        if self.spawn_rate is not None and not self.spawn_rate > 0:
            raise ValueError("spawn_rate must be > 0")
        if self.max_concurrency is not None and not (1 <= self.max_concurrency <= MAX_USERS):
            raise ValueError(f"max_concurrency must be within 1..{MAX_USERS}")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be > 0")
        if not (0 <= self.stream_fraction <= 1 and 0 <= self.measure_speedup <= 1):
            raise ValueError("stream_fraction and measure_speedup are fractions in [0, 1]")
        if self.max_tokens < 1 or self.request_timeout <= 0 or self.stop_timeout < 0:
            raise ValueError("max_tokens >= 1, request_timeout > 0, stop_timeout >= 0")
        lo, hi = self.wait_time
        if lo < 0 or hi < lo:
            raise ValueError("wait_time: 0 <= lo <= hi")
        lo, hi = self.prompt_words
        if lo < 1 or hi < lo:
            raise ValueError(f"prompt_words: 1 <= lo <= hi, got {lo}-{hi}")
        if not 0.0 <= self.temperature <= 2.0:  # the gateway's (OpenAI's) range: every request would be refused
            raise ValueError(f"temperature must be within [0, 2], got {self.temperature}")
        parse_slos(self.goodput)

    @property
    def open_loop(self) -> bool:
        return self.request_rate is not None

    def public(self) -> dict[str, Any]:
        """The settings for reports (no API key)."""
        out = asdict(self)
        out["api_key"] = "***" if self.api_key else None
        out["user_class"] = user_class_name(self.user_class)
        if out["request_rate"] == math.inf:
            out["request_rate"] = "inf"
        return out


def user_class_name(cls: Any) -> str:
    if cls is None:
        return "ChatUser"
    return cls if isinstance(cls, str) else f"{cls.__module__}:{cls.__qualname__}"


def load_user_class(spec: Any) -> type[User]:
    if spec is None:
        return ChatUser
    if isinstance(spec, str):
        module, _, name = spec.partition(":")
        if not name:
            raise ValueError(f"--user-class {spec!r}: use module:Class")
        spec = getattr(importlib.import_module(module), name)
    if not (isinstance(spec, type) and issubclass(spec, User)):
        raise ValueError(f"{spec!r} is not a glance_loadtest.User subclass")
    return spec


@dataclass
class RunResult:
    config: dict[str, Any]
    records: list[RequestRecord]
    summary: dict[str, Any]
    server: dict[str, Any] | None  # what /metrics counted during the run (None: not scraped)
    timeline: dict[str, list[float]]
    meta: dict[str, Any]

    def to_json(self, with_records: bool = True) -> dict[str, Any]:
        out = {"meta": self.meta, "config": self.config, "summary": self.summary, "server": self.server,
               "timeline": self.timeline}
        if with_records:
            out["records"] = [asdict(r) | {"tpot_ms": r.tpot_ms} for r in self.records]
        return out


class GatedClient:
    """The client users see: a request cap, a concurrency cap and the end of the run, in front of
    :class:`GatewayClient`."""

    def __init__(self, env: "Environment") -> None:
        self.env = env
        self.inner = env.gateway

    async def _gated(self, call, *args, **kwargs) -> RequestRecord:
        env = self.env
        sem = env.semaphore
        if sem is not None:
            await sem.acquire()
        try:
            if not env.take_ticket():
                raise StopUser()
            env.in_flight += 1
            try:
                return await call(*args, **kwargs)
            finally:
                env.in_flight -= 1
                env.answered += 1
                env.wake.set()
        finally:
            if sem is not None:
                sem.release()

    async def chat(self, item, **kwargs) -> RequestRecord:
        return await self._gated(self.inner.chat, item, **kwargs)

    async def generate(self, item, **kwargs) -> RequestRecord:
        return await self._gated(self.inner.generate, item, **kwargs)


class Environment:
    """State shared by the users of one run."""

    def __init__(self, config: LoadConfig, gateway: GatewayClient, dataset: Dataset) -> None:
        self.config = config
        self.gateway = gateway
        self.dataset = dataset
        self.client = GatedClient(self)
        self.semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + config.run_time
        self.sent = 0
        self.answered = 0
        self.in_flight = 0
        self.users_running = 0
        self.stopping = False
        self.stop_reason = ""
        self.wake = asyncio.Event()

    def take_ticket(self) -> bool:
        if self.stopping:
            return False
        if time.perf_counter() >= self.deadline:
            self.stop("run_time")
            return False
        cap = self.config.num_requests
        if cap is not None and self.sent >= cap:
            self.stop("num_requests")
            return False
        self.sent += 1
        return True

    def stop(self, reason: str) -> None:
        if not self.stopping:
            self.stopping, self.stop_reason = True, reason
            self.wake.set()

    def done_sending(self) -> bool:
        cap = self.config.num_requests
        return cap is not None and self.sent >= cap

    def request_options(self, rng: random.Random) -> dict[str, Any]:
        cfg = self.config
        opts: dict[str, Any] = {"temperature": cfg.temperature, "mode": cfg.mode}
        if cfg.temperature > 0:
            opts["seed"] = rng.getrandbits(31)
        if cfg.measure_speedup and rng.random() < cfg.measure_speedup:
            opts["measure_speedup"] = True
        return opts

    async def sleep(self, seconds: float) -> None:
        """Sleeps, but returns early when the run ends."""
        end = min(time.perf_counter() + seconds, self.deadline)
        while not self.stopping and (left := end - time.perf_counter()) > 0:
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), left)
            except TimeoutError:
                pass


# ------------------------------------------------------------------------------------------------ load shapes
async def _user_loop(env: Environment, user: User) -> None:
    env.users_running += 1
    try:
        await user.on_start()
        while not env.stopping:
            _, fn = user.pick()
            await fn(user)
            wait = user.wait_time() if callable(user.wait_time) else float(user.wait_time)
            if wait > 0:
                await env.sleep(wait)
    except StopUser:
        pass
    finally:
        env.users_running -= 1


async def _closed_loop(env: Environment, user_cls: type[User], tasks: set[asyncio.Task]) -> None:
    cfg = env.config
    lo, hi = cfg.wait_time
    for i in range(cfg.users):
        if env.stopping:
            break
        user = user_cls(env, i)
        if (lo, hi) != (0.0, 0.0) and "wait_time" not in vars(user_cls):
            user.wait_time = lambda lo=lo, hi=hi, u=user: u.rng.uniform(lo, hi)
        tasks.add(asyncio.create_task(_user_loop(env, user)))
        if cfg.spawn_rate and i + 1 < cfg.users:
            await env.sleep(1.0 / cfg.spawn_rate)


async def _open_loop(env: Environment, user_cls: type[User], tasks: set[asyncio.Task]) -> None:
    """Arrivals at ``request_rate`` (gamma inter-arrival times with shape ``burstiness``; 1 = Poisson)."""
    cfg = env.config
    rng = random.Random(f"{cfg.seed}:arrivals")
    template = user_cls(env, 0)
    arrivals = 0

    async def one(k: int) -> None:
        env.users_running += 1
        try:
            user = template if k == 0 else user_cls(env, k)
            _, fn = user.pick()
            await fn(user)
        except StopUser:
            pass
        finally:
            env.users_running -= 1

    while not env.stopping and (cfg.num_requests is None or arrivals < cfg.num_requests):
        tasks.add(asyncio.create_task(one(arrivals)))
        arrivals += 1
        if math.isfinite(cfg.request_rate):
            theta = 1.0 / (cfg.request_rate * cfg.burstiness)
            await env.sleep(rng.gammavariate(cfg.burstiness, theta))
        elif arrivals % 64 == 0:
            await asyncio.sleep(0)


# ------------------------------------------------------------------------------------------------ progress
def progress_line(env: Environment, records: list[RequestRecord]) -> str:
    elapsed = time.perf_counter() - env.t0
    done = [r for r in records if r.e2e_ms is not None]
    ok = [r for r in done if r.ok]
    recent = [r.e2e_ms for r in ok[-50:]]
    taus = [r.tau for r in ok if r.tau is not None]
    toks = sum(r.completion_tokens or 0 for r in ok)
    p50 = sorted(recent)[len(recent) // 2] if recent else float("nan")
    tau = sum(taus) / len(taus) if taus else float("nan")
    cap = f"/{env.config.num_requests}" if env.config.num_requests else ""
    who = "arrivals" if env.config.open_loop else "users"
    return (f"[{elapsed:6.1f}s/{env.config.run_time:.0f}s] {who} {env.users_running} | sent {env.sent}{cap} "
            f"ok {len(ok)} err {len(done) - len(ok)} in-flight {env.in_flight} | "
            f"{len(ok) / max(elapsed, 1e-9):.2f} req/s {toks / max(elapsed, 1e-9):.1f} tok/s | "
            f"e2e p50 {p50:.0f} ms | tau {tau:.2f}")


async def _progress(env: Environment, records: list[RequestRecord], stream: TextIO) -> None:
    tty = stream.isatty()
    period = 1.0 if tty else 5.0
    while True:
        await asyncio.sleep(period)
        line = progress_line(env, records)
        stream.write(("\r" + line + "\x1b[K") if tty else line + "\n")
        stream.flush()


# ------------------------------------------------------------------------------------------------ the run
async def _scrape(gateway: GatewayClient) -> dict | None:
    text = await gateway.scrape()
    return parse_prometheus(text) if text else None


async def _settled_delta(gateway: GatewayClient, before: dict, records: list[RequestRecord]) -> dict | None:
    """The server's counts after the run, once they cover every answered request (the gateway counts a
    request when its response has ended, a moment after the client has read it)."""
    want = sum(r.status is not None for r in records)
    delta = None
    for _ in range(50):
        after = await _scrape(gateway)
        if after is None:
            return None
        delta = server_delta(before, after)
        if sum(delta["load_requests_by_status"].values()) == want and delta["in_flight"] == 0 and delta["queue_depth"] == 0:
            break
        await asyncio.sleep(0.1)
    return delta


async def run_load_async(config: LoadConfig, progress_stream: TextIO | None = None) -> RunResult:
    config.validate()
    user_cls = load_user_class(config.user_class)
    user_cls.task_table(config.task_weights)  # fail early on unknown tasks
    slos = parse_slos(config.goodput)
    dataset = await asyncio.to_thread(build_dataset, config.dataset, demo_tasks=tuple(config.demo_tasks),
                                      image_size=tuple(config.image_size), prompt_words=tuple(config.prompt_words),
                                      seed=config.seed)
    conns = max(config.max_concurrency or 0, config.users if not config.open_loop else 0, 16) + 4
    gateway = GatewayClient(config.url, model=config.model, api_key=config.api_key,
                            request_timeout=config.request_timeout, max_connections=conns)
    try:
        if gateway.model is None:
            gateway.model = await gateway.discover_model()
        before = await _scrape(gateway) if config.scrape_metrics else None
        env = Environment(config, gateway, dataset)
        gateway.clock0 = env.t0
        started = time.time()
        tasks: set[asyncio.Task] = set()
        shape = _open_loop if config.open_loop else _closed_loop
        driver = asyncio.create_task(shape(env, user_cls, tasks))
        ticker = asyncio.create_task(_progress(env, gateway.records, progress_stream)) \
            if config.progress and progress_stream is not None else None
        # run until the deadline, or until the request cap is used up and answered, or every user has quit
        while not env.stopping:
            left = env.deadline - time.perf_counter()
            if left <= 0:
                env.stop("run_time")
                break
            if env.done_sending() and env.in_flight == 0 and driver.done():
                env.stop("num_requests")
                break
            if driver.done() and tasks and all(t.done() for t in tasks):
                env.stop("users_finished")
                break
            env.wake.clear()
            try:
                await asyncio.wait_for(env.wake.wait(), min(left, 0.25))
            except TimeoutError:
                pass
        end_sending = time.perf_counter()
        pending = [t for t in tasks | {driver} if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=config.stop_timeout)
        cancelled = [t for t in pending if not t.done()]
        for t in cancelled:
            t.cancel()
        if cancelled:
            await asyncio.gather(*cancelled, return_exceptions=True)
        for t in tasks | {driver}:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        if ticker is not None:
            ticker.cancel()
            progress_stream.write(("\r" if progress_stream.isatty() else "") + progress_line(env, gateway.records)
                                  + "\n")
        records = gateway.records
        server = await _settled_delta(gateway, before, records) if before is not None else None
    finally:
        await gateway.aclose()
    summary = summarize(records, slos)
    if server is not None:
        summary["consistency"] = consistency(records, server)
    meta = {"started_at": started, "stop_reason": env.stop_reason, "open_loop": config.open_loop,
            "sending_s": end_sending - env.t0, "cancelled_at_stop": sum(r.error == "cancelled" for r in records),
            "dataset": dataset.describe(), "model": gateway.model, "target": gateway.base_url,
            "user_class": user_class_name(config.user_class), "tasks": user_cls.task_table(config.task_weights)}
    return RunResult(config.public(), records, summary, server, timeline(records), meta)


def consistency(records: list[RequestRecord], server: dict[str, Any]) -> dict[str, Any]:
    """Client records vs the gateway's counters (no lost or double-counted requests): every request that got
    an HTTP status, by status, against what the gateway counted on the chat and multipart routes (plus the
    requests it refused before routing, such as a wrong API key)."""
    client: dict[str, int] = {}
    for r in records:
        if r.status is not None:
            client[str(r.status)] = client.get(str(r.status), 0) + 1
    ok = [r for r in records if r.ok]
    return {
        "client_by_status": dict(sorted(client.items())),
        "server_by_status": server["load_requests_by_status"],
        "counts_match": dict(sorted(client.items())) == server["load_requests_by_status"],
        "no_response": sum(r.status is None for r in records),
        "client_completion_tokens": sum(r.completion_tokens or 0 for r in ok),
        "server_completion_tokens": server["completion_tokens"],
    }


def run_load(config: LoadConfig, progress_stream: TextIO | None = None) -> RunResult:
    """Runs :func:`run_load_async` in a fresh event loop."""
    return asyncio.run(run_load_async(config, progress_stream))


def main_progress_stream(quiet: bool) -> TextIO | None:
    return None if quiet else sys.stderr
