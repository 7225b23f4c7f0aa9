"""Launch an SGLang server with the GLANCE plugin as a managed subprocess.

    handle = launch_sglang("glance_sgl/demo/assets/target", "glance_sgl/demo/assets/drafter", port=30000,
                           cpu=True)
    handle.url        # "http://127.0.0.1:30000"
    handle.stop()

The plugin needs no flag to load (SGLang loads every ``sglang.srt.plugins`` entry point); the command is
``python -m sglang.launch_server --model-path M --speculative-algorithm GLANCE --speculative-draft-model-path D``
plus, with ``cpu=True``, the CPU mode (:func:`cpu_server_args`). ``drafter=None`` serves without speculation.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

CPU_ARGS = ("--device", "cpu", "--attention-backend", "glance_cpu", "--disable-cuda-graph",
            "--disable-overlap-schedule", "--dtype", "float32", "--mem-fraction-static", "0.3",
            "--max-total-tokens", "4096", "--context-length", "1024")


def free_port() -> int:
    """A TCP port free on loopback now (for a server launched next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_server_args() -> list[str]:
    """SGLang server flags of the CPU mode (float32, the ``glance_cpu`` attention backend, no CUDA graphs)."""
    return list(CPU_ARGS)


def server_command(model: str | Path, drafter: str | Path | None = None, port: int = 30000,
                   host: str = "127.0.0.1", cpu: bool = False, extra_args: Sequence[str] = (),
                   python: str | None = None) -> list[str]:
    """The ``sglang.launch_server`` command line for ``model`` (+ GLANCE with ``drafter``)."""
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
           "--host", host, "--port", str(port)]
    if drafter is not None:
        cmd += ["--speculative-algorithm", "GLANCE", "--speculative-draft-model-path", str(drafter)]
    if cpu:
        cmd += cpu_server_args()
    cmd += list(extra_args)
    return cmd


@dataclass
class SGLangServer:
    """A running ``sglang.launch_server`` child (its own process group, so that stop() ends its workers)."""

    proc: subprocess.Popen
    url: str
    command: list[str]
    log_path: Path | None = None
    _log: object = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = 300.0, interval: float = 1.0) -> "SGLangServer":
        """Poll ``GET /health`` until 200; raise if the process dies or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"SGLang server exited with {self.proc.returncode} before it was ready"
                                   f"{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(interval)
        self.stop()
        raise TimeoutError(f"SGLang server at {self.url} not ready after {timeout:.0f}s{self._tail()}")

    def _tail(self) -> str:
        if self.log_path and Path(self.log_path).exists():
            return "\n" + Path(self.log_path).read_text(errors="replace")[-3000:]
        return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=timeout)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "SGLangServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_sglang(model: str | Path, drafter: str | Path | None = None, port: int = 30000, *,
                  host: str = "127.0.0.1", cpu: bool = False, extra_args: Sequence[str] = (),
                  env: dict[str, str] | None = None, log_path: str | Path | None = None, wait: bool = True,
                  timeout: float = 300.0) -> SGLangServer:
    """Start SGLang (with GLANCE when ``drafter`` is given) on ``host:port``; by default wait until it answers
    ``/health``. CPU mode also defaults ``OMP_NUM_THREADS=1`` (one intra-op thread per process: on small CPUs the
    scheduler's torch threads otherwise fight each other and everything else)."""
    cmd = server_command(model, drafter, port, host, cpu, extra_args)
    child_env = dict(os.environ)
    child_env.setdefault("HF_HUB_OFFLINE", "1")
    child_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cpu:
        child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(env or {})
    log = open(log_path, "w") if log_path else None
    proc = subprocess.Popen(cmd, env=child_env, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    server = SGLangServer(proc, f"http://{host}:{port}", cmd, Path(log_path) if log_path else None, log)
    return server.wait_ready(timeout) if wait else server


__all__ = ["SGLangServer", "cpu_server_args", "launch_sglang", "server_command"]
