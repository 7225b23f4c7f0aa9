"""Launch an SGLang server with the GLANCE plugin as a managed subprocess.

    handle = launch_sglang("glance_sgl/demo/assets/target", "glance_sgl/demo/assets/drafter", port=30000,
                           cpu=True)
    handle.url        # "http://127.0.0.1:30000"
    handle.stop()

The plugin needs no flag to load (SGLang loads every ``sglang.srt.plugins`` entry point); the command is
``python -m sglang.launch_server --model-path M --speculative-algorithm GLANCE --speculative-draft-model-path D``
plus, with ``cpu=True``, the CPU mode (:func:`cpu_server_args`). ``drafter=None`` serves without speculation.

Context length: the CPU mode serves the model's own context (:func:`model_context_length`, the text config's
``max_position_embeddings``: what the embedded engine serves) and sizes SGLang's KV pool to hold two requests of
that length (:func:`cpu_kv_tokens`), so the same model has one context length on both backends. A
``--context-length`` in ``extra_args`` comes later on the command line and wins.
"""

from __future__ import annotations

import os
import random
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
            "--disable-overlap-schedule", "--dtype", "float32", "--mem-fraction-static", "0.3")
CPU_MIN_KV_TOKENS = 4096  # the CPU mode's smallest KV pool (tokens), whatever the context


def model_context_length(model: str | Path) -> int | None:
    """The context length the embedded engine serves for ``model``: its text config's
    ``max_position_embeddings`` (``TargetAdapter.context_length``); None when the config does not set it (SGLang
    then derives its own)."""
    from transformers import AutoConfig

    value = getattr(AutoConfig.from_pretrained(str(model)).get_text_config(), "max_position_embeddings", None)
    return int(value) if value else None


def cpu_kv_tokens(context_length: int | None) -> int:
    """Tokens of the CPU mode's KV pool: room for two requests of the full context (one of them with a verify
    tree on top), at least :data:`CPU_MIN_KV_TOKENS`. SGLang refuses a request longer than its pool even when the
    context allows it, so a pool smaller than the context would shorten the context silently."""
    return max(CPU_MIN_KV_TOKENS, 2 * int(context_length or 0))


def free_port() -> int:
    """A TCP port for a server launched next: free now, below the kernel's ephemeral range and not handed out
    before by this process (:func:`_reserve_port`). A port the kernel picked (bind to port 0) lies in the ephemeral
    range, where the local end of any outgoing connection may take it while the server loads: a test's SGLang
    server once failed to bind its HTTP port so (``EADDRINUSE``) and waited out its start-up timeout."""
    return _reserve_port(30100, 32699, "an SGLang server")


def cpu_server_args(context_length: int | None = None) -> list[str]:
    """SGLang server flags of the CPU mode (float32, the ``glance_cpu`` attention backend, no CUDA graphs), with
    ``--context-length context_length`` (when given) and a KV pool of :func:`cpu_kv_tokens` tokens."""
    args = [*CPU_ARGS, "--max-total-tokens", str(cpu_kv_tokens(context_length))]
    if context_length:
        args += ["--context-length", str(int(context_length))]
    return args


def server_command(model: str | Path, drafter: str | Path | None = None, port: int = 30000,
                   host: str = "127.0.0.1", cpu: bool = False, extra_args: Sequence[str] = (),
                   python: str | None = None) -> list[str]:
    """The ``sglang.launch_server`` command line for ``model`` (+ GLANCE with ``drafter``); the CPU mode serves
    the model's own context length (:func:`model_context_length`)."""
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
           "--host", host, "--port", str(port)]
    if drafter is not None:
        cmd += ["--speculative-algorithm", "GLANCE", "--speculative-draft-model-path", str(drafter)]
    if cpu:
        cmd += cpu_server_args(model_context_length(model))
    cmd += list(extra_args)
    return cmd


_BIND_ERROR = "error while attempting to bind on address"  # uvicorn's message where the server's port is taken


@dataclass
class SGLangServer:
    """A running ``sglang.launch_server`` child (its own process group, so that stop() ends its workers)."""

    proc: subprocess.Popen
    url: str
    command: list[str]
    log_path: Path | None = None
    _log: object = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = 300.0, interval: float = 1.0) -> "SGLangServer":
        """Poll ``GET /health`` until 200; raise if the process dies, fails to bind its port (SGLang's HTTP server
        then logs the error and stays up without serving) or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"SGLang server exited with {self.proc.returncode} before it was ready"
                                   f"{self._tail()}")
            if _BIND_ERROR in self._last_bytes():
                self.stop()
                raise RuntimeError(f"SGLang server could not bind {self.url} (address already in use){self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(interval)
        self.stop()
        raise TimeoutError(f"SGLang server at {self.url} not ready after {timeout:.0f}s{self._tail()}")

    def _last_bytes(self, n: int = 4096) -> str:
        """The last ``n`` bytes of the server's log ("" without one)."""
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        with open(self.log_path, "rb") as fh:
            fh.seek(max(fh.seek(0, os.SEEK_END) - n, 0))
            return fh.read().decode(errors="replace")

    def _tail(self) -> str:
        """The end of the server's log for an error message ("" without a log file)."""
        text = self._last_bytes(3000)
        return "\n" + text if text else ""

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's log ("" without a log file)."""
        if self.log_path and Path(self.log_path).exists():
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout``. When the server process has died
        already, what is left of its group (a scheduler or detokenizer child) gets SIGKILL."""
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
        elif not self._stopped:
            try:  # the group id outlives its leader while any member lives; nothing else can hold it then
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._stopped = True
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "SGLangServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_HANDED_OUT: set[int] = set()  # ports handed to servers and engines started from this process


def _reserve_port(low: int, high: int, what: str) -> int:
    """A TCP port in ``[low, high]``, free on every interface now and not handed out before by this process."""
    for port in random.SystemRandom().sample(range(low, high + 1), min(512, high - low + 1)):
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high} for {what}")


def rendezvous_port(low: int = 22000, high: int = 29999) -> int:
    """A port for an engine's ``torch.distributed`` rendezvous (SGLang's ``nccl_port``): below the kernel's
    ephemeral range (the engine's scheduler binds it later), free now, and not handed to another engine started
    from this process (``EngineProcess``, :func:`launch_sglang`). Left to SGLang, engines started together each
    pick one at random, and two of four picked the same one once (``EADDRINUSE``: the parity tests' engines failed
    to start in CI)."""
    return _reserve_port(low, high, "an SGLang engine's rendezvous")


def launch_sglang(model: str | Path, drafter: str | Path | None = None, port: int = 30000, *,
                  host: str = "127.0.0.1", cpu: bool = False, extra_args: Sequence[str] = (),
                  env: dict[str, str] | None = None, log_path: str | Path | None = None, wait: bool = True,
                  timeout: float = 300.0, append_log: bool = False) -> SGLangServer:
    """Start SGLang (with GLANCE when ``drafter`` is given) on ``host:port``; by default wait until it answers
    ``/health``. CPU mode also defaults ``OMP_NUM_THREADS=1`` (one intra-op thread per process: on small CPUs the
    scheduler's torch threads otherwise fight each other and everything else). The server's output goes to
    ``log_path`` (appended with ``append_log``, e.g. by a supervisor's restarts), else nowhere."""
    cmd = server_command(model, drafter, port, host, cpu, extra_args)
    if "--nccl-port" not in cmd:  # servers launched together must not race for one rendezvous port
        cmd += ["--nccl-port", str(rendezvous_port())]
    child_env = dict(os.environ)
    child_env.setdefault("HF_HUB_OFFLINE", "1")
    child_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cpu:
        child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(env or {})
    log = open(log_path, "a" if append_log else "w") if log_path else None
    proc = subprocess.Popen(cmd, env=child_env, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    server = SGLangServer(proc, f"http://{host}:{port}", cmd, Path(log_path) if log_path else None, log)
    return server.wait_ready(timeout) if wait else server


__all__ = ["SGLangServer", "cpu_kv_tokens", "cpu_server_args", "free_port", "launch_sglang", "model_context_length",
           "rendezvous_port", "server_command"]
