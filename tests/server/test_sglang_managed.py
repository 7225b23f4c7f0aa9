"""``glance serve --backend sglang`` launching and supervising a real SGLang server (CPU mode), on the demo model.

- One context length: the launched SGLang server serves the model's own context (``max_position_embeddings``,
  2,048 tokens for the demo), as the embedded backend does. A ~1,600-token request (over the CPU mode's former
  1,024-token limit) is answered by both backends with the same tokens, and a request over 2,048 tokens is a 400
  ``context_length_exceeded`` from both, the sglang backend's naming its limit.
- Supervision: the SGLang server killed mid-stream; the stream ends with an error event, ``/ready`` is 503 and new
  requests get 503 while it restarts, then it serves again and ``/metrics`` counts the restart. Killed once more
  (``--sglang-max-restarts 1``), the gateway gives up and exits with status 3.

One gateway process (and so one SGLang start, 20-40 s on these CPUs, plus one restart) serves the whole module.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from glance_sgl.sglang.launch import cpu_server_args, free_port, model_context_length, server_command
from tests.server.server_helpers import ServerThread, base_config

pytestmark = [pytest.mark.timeout(900)]

DEMO_TARGET = Path(__file__).resolve().parents[2] / "glance_sgl" / "demo" / "assets" / "target"
DEMO_DRAFTER = DEMO_TARGET.parent / "drafter"
GLANCE = [sys.executable, "-m", "glance_sgl.cli"]
MODEL = "tiny"
LONG_ANSWER = "write a long story"  # the demo's greedy answer runs for ~230 tokens: still streaming when killed


def demo_ready() -> bool:
    return (DEMO_TARGET / "config.json").is_file() and (DEMO_DRAFTER / "model.safetensors").is_file()


needs_demo = pytest.mark.skipif(not demo_ready(), reason="the bundled demo checkpoints are not built")


# ------------------------------------------------------------------------------------------ fast: no server
@pytest.mark.parametrize("flag,value,message", [
    ("--sglang-max-restarts", "-1", "max_restarts (--sglang-max-restarts) must be an integer >= 0"),
    ("--sglang-restart-window", "0", "window_s (--sglang-restart-window) must be > 0"),
    ("--sglang-restart-backoff", "-2", "backoff_s (--sglang-restart-backoff) must be >= 0"),
    ("--sglang-restart-max-backoff", "0.5", "max_backoff_s (--sglang-restart-max-backoff) must be >= the back-off"),
])
def test_restart_settings_are_validated_at_start_up(flag, value, message, capsys):
    from glance_sgl import cli as glance_cli

    with pytest.raises(SystemExit) as exc:
        glance_cli.main(["serve", "--backend", "sglang", flag, value])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_restart_back_off_doubles_up_to_its_cap():
    from glance_server.config import RestartPolicy

    policy = RestartPolicy(max_restarts=3, window_s=60, backoff_s=0.5, max_backoff_s=3)
    assert [policy.delay(k) for k in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@needs_demo
def test_cpu_mode_serves_the_models_context():
    """The CPU mode's flags: the model's context (the embedded engine's) and a KV pool that holds it twice."""
    ctx = model_context_length(DEMO_TARGET)
    assert ctx == 2048
    args = cpu_server_args(ctx)
    assert args[args.index("--context-length") + 1] == "2048"
    assert int(args[args.index("--max-total-tokens") + 1]) >= 2 * ctx
    cmd = server_command(DEMO_TARGET, DEMO_DRAFTER, cpu=True, extra_args=["--context-length", "1024"])
    assert cmd[len(cmd) - 1 - cmd[::-1].index("--context-length") + 1] == "1024"  # the caller's flag comes last


# ------------------------------------------------------------------------------------------ slow: real servers
class Gateway:
    """A ``glance serve --backend sglang`` process; its output is drained into ``lines`` by a thread."""

    def __init__(self, tmp: Path) -> None:
        self.sglang_port = free_port()
        self.log = tmp / "sglang.log"
        argv = [*GLANCE, "serve", "--backend", "sglang", "--model", str(DEMO_TARGET), "--drafter",
                str(DEMO_DRAFTER), "--port", "0", "--served-model-name", MODEL, "--threads", "1",
                "--sglang-device", "cpu", "--sglang-port", str(self.sglang_port), "--sglang-log", str(self.log),
                "--sglang-args", "--log-level warning --random-seed 0", "--sglang-timeout", "400",
                "--sglang-max-restarts", "1", "--sglang-restart-backoff", "0.5"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self.sglang_groups: set[int] = set()  # process groups of the SGLang servers seen: all killed at the end
        self._found = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.url is None and (m := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)):
                self.url = m.group(1)
                self._found.set()
        self._found.set()

    def output(self) -> str:
        return "".join(self.lines)

    def wait_url(self, timeout: float) -> str:
        self._found.wait(timeout)
        assert self.url, f"the gateway did not start:\n{self.output()[-4000:]}"
        return self.url

    def sglang_pid(self) -> int:
        """The pid of the SGLang server the gateway runs now (its child ``sglang.launch_server``)."""
        import psutil

        for child in psutil.Process(self.proc.pid).children():
            if "sglang.launch_server" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                self.sglang_groups.add(child.pid)  # it leads its own process group
                return child.pid
        raise AssertionError(f"no SGLang server under the gateway:\n{self.output()[-3000:]}")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the gateway exited:\n{self.output()[-4000:]}"
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"not ready after {timeout} s:\n{self.output()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for group in self.sglang_groups:  # whatever the gateway left behind (nothing, when it works)
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(scope="module")
def managed(tmp_path_factory):
    """The gateway process with its launched SGLang server (started first: it takes longest)."""
    pytest.importorskip("sglang")
    if not demo_ready():
        pytest.skip("the bundled demo checkpoints are not built")
    tmp = tmp_path_factory.mktemp("managed")
    gw = Gateway(tmp)
    try:
        gw.wait_url(600)
        gw.wait_ready(120)
        gw.sglang_pid()
        yield gw
    finally:
        gw.stop()
        (tmp / "gateway.log").write_text(gw.output())  # beside sglang.log, for a failure's post-mortem


@pytest.fixture(scope="module")
def embedded():
    """An embedded gateway on the same demo model (in this process)."""
    if not demo_ready():
        pytest.skip("the bundled demo checkpoints are not built")
    from glance_sgl.engine import GlanceEngine
    from glance_server.app import create_app
    from glance_server.embedded import EmbeddedBackend

    engine = GlanceEngine.load(DEMO_TARGET, DEMO_DRAFTER)
    config = base_config(api_key=None, served_model_name=MODEL, max_tokens_limit=2048)
    server = ServerThread(create_app(config, EmbeddedBackend(engine, config), engine.target.processor))
    server.wait_ready()
    yield server, engine
    server.stop()


def prompt_of(tokenizer, tokens: int) -> str:
    """User text of about ``tokens`` tokens for ``tokenizer``."""
    sentence = "the receipt lists a red apple, two blue cups and a green lamp. "
    per = len(tokenizer(sentence)["input_ids"])
    return sentence * max(1, round(tokens / per))


@pytest.mark.slow
def test_one_context_length_on_both_backends(managed, embedded):
    server, engine = embedded
    backends = {"embedded": server.url, "sglang": managed.url}
    for name, url in backends.items():
        card = httpx.get(url + f"/v1/models/{MODEL}", timeout=30).json()
        assert card["glance"]["context_length"] == 2048, (name, card)
    text = prompt_of(engine.target.processor.tokenizer, 1600)
    answers = {}
    for name, url in backends.items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8,
                                           temperature=0)
        answers[name] = r
        assert 1400 < r.usage.prompt_tokens < 1800 and r.usage.completion_tokens >= 1, (name, r.usage)
    assert answers["sglang"].usage.prompt_tokens == answers["embedded"].usage.prompt_tokens
    assert answers["sglang"].choices[0].message.content == answers["embedded"].choices[0].message.content
    # over the context: a 400 from both, before any stream opens; the sglang backend names its limit
    too_long = prompt_of(engine.target.processor.tokenizer, 2200)
    for name, url in backends.items():
        r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": [{"role": "user", "content": too_long}], "max_tokens": 8, "stream": True})
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "2048" in err["message"], (name, err)
    assert "the sglang backend's context length is 2048 tokens" in err["message"]
    assert "context length: 2048 tokens" in managed.output()  # the gateway's start-up line


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


@pytest.mark.slow
def test_killed_sglang_server_is_restarted_then_given_up_on(managed):
    url = managed.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": LONG_ANSWER}]
    before = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert metric(url, "glance_sglang_restarts_total") == 0 and metric(url, "glance_sglang_up") == 1

    # killed mid-stream: the stream ends with the gateway's error event
    pid = managed.sglang_pid()
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1000, temperature=0,
                                            stream=True)
    received = []
    with pytest.raises(openai.APIError) as exc:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
                if len(received) == 1:
                    os.kill(pid, signal.SIGKILL)
    assert received and exc.value.body["code"] == "upstream_unavailable", exc.value.body

    # restarting: /ready 503 with the reason, new requests 503 upstream_unavailable (not a hang)
    deadline = time.monotonic() + 60
    while True:
        r = httpx.get(url + "/ready", timeout=10)
        if r.status_code == 503 and "restarting" in r.json()["reason"]:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": messages, "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
    assert "restarting" in r.json()["error"]["message"] and r.headers["Retry-After"]
    assert metric(url, "glance_sglang_up") == 0

    # serves again: the same greedy answer as before the kill, one restart counted, a new server process
    managed.wait_ready(400)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert again.choices[0].message.content == before.choices[0].message.content
    assert metric(url, "glance_sglang_restarts_total") == 1 and metric(url, "glance_sglang_up") == 1
    new_pid = managed.sglang_pid()
    assert new_pid != pid
    out = managed.output()
    assert f"pid {pid} exited with status -9" in out and "serves again" in out

    # a second failure within the window is one more than --sglang-max-restarts 1: the gateway exits with 3
    os.kill(new_pid, signal.SIGKILL)
    assert managed.proc.wait(120) == 3, managed.output()[-4000:]
    assert "giving up on the managed SGLang server" in managed.output()
    deadline = time.monotonic() + 30  # the gateway killed what was left of each server's process group
    while (left := [g for g in managed.sglang_groups if group_alive(g)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"SGLang process groups left behind: {left}"


def group_alive(group: int) -> bool:
    """Whether any process of process group ``group`` still exists."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
