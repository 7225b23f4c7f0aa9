"""Supervision of the SGLang server a gateway launched (``glance serve --backend sglang`` without ``--upstream``).

:class:`ManagedSGLang` watches the server process from the gateway's event loop. When it dies (a crash, the OOM
killer, a signal) the gateway:

- logs the exit status and the tail of the server's log, and kills what is left of its process group;
- answers ``/ready`` with 503 and new requests with 503 ``upstream_unavailable`` (``Retry-After``) while it
  restarts; requests in flight end as any upstream failure does (an error event, or a 503 before a stream opens);
- starts it again with the same command after the back-off of its :class:`~glance_server.config.RestartPolicy`
  and waits for its ``/health`` (a restart that dies or is not ready within the start-up timeout is one more
  failure); ``glance_sglang_restarts_total`` counts the restarts, ``glance_sglang_up`` says whether it serves;
- gives up when it has failed more than ``max_restarts`` times within ``window_s`` seconds: ``on_give_up`` is
  called (``glance serve`` then shuts down and exits with :data:`EXIT_UPSTREAM_FAILED`), so that the gateway's own
  supervisor takes over instead of a gateway that looks alive in front of a dead server.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable

import httpx

from glance_sgl.sglang.launch import SGLangServer

from .config import RestartPolicy

log = logging.getLogger("glance_server.supervisor")

EXIT_UPSTREAM_FAILED = 3  # glance serve's exit status when it gave up on its SGLang server

RUNNING, RESTARTING, FAILED, STOPPED = "running", "restarting", "failed", "stopped"


class ManagedSGLang:
    """A launched SGLang server and its supervision (start with :meth:`start` inside the gateway's loop)."""

    def __init__(self, server: SGLangServer, relaunch: Callable[[], SGLangServer], policy: RestartPolicy,
                 ready_timeout_s: float = 900.0, on_give_up: Callable[[], None] | None = None,
                 poll_s: float = 0.5) -> None:
        """``server``: the running server; ``relaunch``: starts the same server again without waiting for it
        (``launch_sglang(..., wait=False)``); ``ready_timeout_s``: how long a restart may take to answer
        ``/health``; ``on_give_up``: called once when the policy's failures are used up."""
        self.server = server
        self.relaunch = relaunch
        self.policy = policy
        self.ready_timeout_s = ready_timeout_s
        self.on_give_up = on_give_up
        self.poll_s = poll_s
        self.state = RUNNING
        self.restarts = 0  # restarts started
        self.last_exit: str | None = None  # why the server last stopped serving
        self._failures: collections.deque[float] = collections.deque()
        self._task: asyncio.Task | None = None
        self._listeners: list[Callable[[str], None]] = []

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def gave_up(self) -> bool:
        return self.state == FAILED

    def serving(self) -> bool:
        """Whether the server runs and was ready (the supervisor's view; the gateway still checks ``/health``)."""
        return self.state == RUNNING and self.server.alive()

    def on_state(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(state)`` at every change of state."""
        self._listeners.append(listener)

    def reason(self) -> str:
        """Why the server does not serve, for ``/ready`` and the 503 of new requests."""
        if self.state == FAILED:
            return (f"the managed SGLang server failed more than {self.policy.max_restarts} times within "
                    f"{self.policy.window_s:g} s ({self.last_exit}); the gateway gave up")
        if self.state == STOPPED:
            return "the managed SGLang server is stopped"
        if self.state == RESTARTING:
            return f"the managed SGLang server is restarting (restart {self.restarts or 1}; {self.last_exit})"
        return "ok" if self.server.alive() else f"the managed SGLang server exited ({self.server.proc.returncode})"

    def metrics(self) -> dict[str, int]:
        """``restarts`` (started so far) and ``up`` (1 while it serves), for ``/metrics``."""
        return {"restarts": self.restarts, "up": int(self.serving())}

    def start(self) -> None:
        """Start watching (in the running event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="glance-sglang-supervisor")

    async def stop(self) -> None:
        """Stop watching and stop the server (the gateway's shutdown)."""
        if self.state != FAILED:
            self._set(STOPPED)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        await asyncio.to_thread(self.server.stop)

    # ------------------------------------------------------------------------------------------------ internals
    def _set(self, state: str) -> None:
        if state != self.state:
            self.state = state
            for listener in self._listeners:
                listener(state)

    async def _watch(self) -> None:
        try:
            while True:
                while self.server.alive():
                    await asyncio.sleep(self.poll_s)
                if self.state in (STOPPED, FAILED):
                    return
                code = self.server.proc.returncode
                self.last_exit = f"pid {self.server.proc.pid} exited with status {code}"
                tail = self.server.tail()
                log.error("the managed SGLang server at %s died (%s)%s", self.server.url, self.last_exit,
                          f"; the end of its log ({self.server.log_path}):\n{tail}" if tail else "")
                await asyncio.to_thread(self.server.stop)  # what is left of its process group
                if not await self._restart():
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not leave a dead upstream behind a gateway that looks alive
            log.exception("the SGLang supervisor failed")
            self._give_up()

    def _count_failure(self) -> int:
        now = time.monotonic()
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.policy.window_s:
            self._failures.popleft()
        return len(self._failures)

    def _give_up(self) -> None:
        self._set(FAILED)
        log.critical("giving up on the managed SGLang server: %s; the gateway shuts down", self.reason())
        if self.on_give_up is not None:
            self.on_give_up()

    async def _restart(self) -> bool:
        """Restart until the server is ready (True) or the policy gives up (False)."""
        while True:
            failures = self._count_failure()
            if failures > self.policy.max_restarts:
                self._give_up()
                return False
            delay = self.policy.delay(failures)
            self._set(RESTARTING)
            log.warning("restarting the managed SGLang server in %.1f s (failure %d within the last %g s; "
                        "--sglang-max-restarts %d)", delay, failures, self.policy.window_s, self.policy.max_restarts)
            await asyncio.sleep(delay)
            self.restarts += 1
            t0 = time.monotonic()
            try:
                server = self.relaunch()
            except OSError as exc:
                self.last_exit = f"restart {self.restarts} could not start: {exc}"
                log.error("%s", self.last_exit)
                continue
            self.server = server
            ok, why = await self._wait_ready(server)
            if ok:
                self._set(RUNNING)
                log.warning("the managed SGLang server serves again at %s (restart %d, pid %d, ready after %.1f s)",
                            server.url, self.restarts, server.proc.pid, time.monotonic() - t0)
                return True
            self.last_exit = f"restart {self.restarts} {why}"
            tail = server.tail()
            log.error("the restarted SGLang server is not serving: %s%s", why, f"\n{tail}" if tail else "")
            await asyncio.to_thread(server.stop)

    async def _wait_ready(self, server: SGLangServer) -> tuple[bool, str]:
        """Poll the new server's ``/health`` until 200, its death, or ``ready_timeout_s``."""
        deadline = time.monotonic() + self.ready_timeout_s
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if not server.alive():
                    return False, f"exited with status {server.proc.returncode} before it was ready"
                try:
                    if (await client.get("/health")).status_code == 200:
                        return True, "ok"
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1.0)
        return False, f"not ready after {self.ready_timeout_s:g} s"


__all__ = ["EXIT_UPSTREAM_FAILED", "ManagedSGLang"]
