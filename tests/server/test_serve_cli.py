"""``glance serve``: argument errors, the bundled-demo check, and a real server process end to end."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from glance_sgl import cli as glance_cli
from tests.server.server_helpers import image_message

pytestmark = pytest.mark.timeout(180)
GLANCE = [sys.executable, "-m", "glance_sgl.cli"]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        glance_cli.main(argv)
    return exc.value.code, capsys.readouterr().err


def test_missing_bundled_demo_is_a_clear_error(monkeypatch, tmp_path, capsys):
    from glance_sgl.demo import paths

    monkeypatch.setattr(paths, "bundled_target", lambda: tmp_path / "no-target")
    monkeypatch.setattr(paths, "bundled_drafter", lambda: tmp_path / "no-drafter")
    code, err = run_cli(["serve"], capsys)
    assert code == 2 and "bundled demo model is missing" in err and "glance demo build" in err


@pytest.mark.parametrize("argv,message", [
    (["serve", "--model", "/nonexistent/model"], "config.json missing"),
    (["serve", "--upstream", "http://127.0.0.1:9"], "--upstream is for --backend sglang"),
    (["serve", "--api-key-env", "GLANCE_TEST_UNSET_VARIABLE"], "unset or empty"),
    (["serve", "--allow-remote-images"], "--remote-image-host"),
    (["serve", "--planner", "greedy"], "invalid choice: 'greedy'"),
    (["serve", "--backend", "sglang", "--upstream", "http://127.0.0.1:9", "--planner", "fixed"], "GLANCE_PLANNER"),
    (["serve", "--draft-sources", "drafter,beam"], "--draft-sources 'drafter,beam': draft sources must be"),
    (["serve", "--draft-sources", ","], "--draft-sources ',': draft sources must be a non-empty subset"),
    (["serve", "--draft-sources", "drafter", "--ngram-corpus", "per-key"],
     "--ngram-corpus scopes the n-gram source's corpus"),
    (["serve", "--mode", "chain", "--ngram-corpus", "off"], "--ngram-corpus scopes the n-gram source's corpus"),
    (["serve", "--ngram-corpus", "tenant"], "invalid choice: 'tenant'"),
    (["serve", "--threads", "0"], "argument --threads: must be at least 1, got 0"),
    # every number and address a flag takes is checked before anything loads (none was, and a server ran on them)
    (["serve", "--port", "99999"], "argument --port: must be between 0 and 65535, got 99999"),
    (["serve", "--sglang-port", "0"], "argument --sglang-port: must be between 1 and 65535"),
    (["serve", "--budget", "0"], "argument --budget: must be at least 1, got 0"),
    (["serve", "--branch-k", "-2"], "argument --branch-k: must be at least 1"),
    (["serve", "--max-queue", "0"], "argument --max-queue: must be at least 1"),
    (["serve", "--max-image-pixels", "0"], "argument --max-image-pixels: must be at least 1"),
    (["serve", "--max-images", "two"], "argument --max-images: not an integer: 'two'"),
    (["serve", "--request-timeout", "-5"], "argument --request-timeout: must be a number above 0"),
    (["serve", "--max-body-mb", "nan"], "argument --max-body-mb: must be a number above 0"),
    (["serve", "--sglang-timeout", "inf"], "argument --sglang-timeout: must be a number above 0"),
    (["serve", "--default-max-tokens", "99999"], "--default-max-tokens 99999 is above --max-tokens-limit 2048"),
    (["serve", "--remote-image-host", "bad host"], "argument --remote-image-host: not a host name"),
    (["serve", "--trusted-image-network", "notacidr"], "argument --trusted-image-network: 'notacidr' does not"),
    (["serve", "--backend", "sglang", "--upstream", "ftp://x"], "argument --upstream: not an http(s) URL"),
    (["serve", "--draft-sources", "ngram", "--mode", "chain"], "--mode glance"),
    (["serve", "--backend", "sglang", "--upstream", "http://127.0.0.1:9", "--draft-sources", "drafter,ngram"],
     "GLANCE_DRAFT_SOURCES"),
    (["serve", "--backend", "sglang", "--draft-sources", "drafter,ngram", "--ngram-corpus", "per-key"],
     "--ngram-corpus per-key"),
])
def test_serve_argument_errors(argv, message, capsys, checkpoints):
    code, err = run_cli(argv, capsys)
    assert code == 2 and message in err


@pytest.mark.parametrize("settings,message", [
    ({"max_images": -1}, "max_images must be an integer >= 0"), ({"max_queue": 0}, "max_queue must be an integer"),
    ({"request_timeout_s": 0}, "request_timeout_s must be a number above 0"),
    ({"max_image_pixels": True}, "max_image_pixels must be a number above 0"),
    ({"ar_ms_per_token": -1.0}, "ar_ms_per_token must be a number above 0"),
    ({"threads": 0}, "threads must be an integer >= 1"),
    ({"trusted_image_networks": ["10.0.0.0/33"]}, "trusted_image_networks:"),
])
def test_server_config_refuses_bad_settings(settings, message):
    from glance_server.config import ServerConfig

    with pytest.raises(ValueError, match=message):
        ServerConfig(**settings)


def test_host_and_network_flags_take_their_forms():
    from glance_server.cli import host_pattern, network, upstream_url

    assert [host_pattern(h) for h in ("Images.Example.com.", "*.example.com", "10.0.0.5", "::1", "localhost")] == \
        ["images.example.com", "*.example.com", "10.0.0.5", "::1", "localhost"]
    assert network("10.0.0.0/8") == "10.0.0.0/8" and upstream_url("https://h:30000/") == "https://h:30000/"
    for bad, parse in (("*.", host_pattern), ("a_b.com", host_pattern), ("-a.com", host_pattern),
                       ("10.0.0.0/40", network), ("http://", upstream_url), ("127.0.0.1:30000", upstream_url)):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


@pytest.mark.parametrize("value", ["", "a,,b", " , "])
def test_serve_api_key_list_errors(value, monkeypatch, capsys, checkpoints):
    monkeypatch.setenv("GLANCE_TEST_KEYS", value)
    code, err = run_cli(["serve", "--api-key-env", "GLANCE_TEST_KEYS"], capsys)
    assert code == 2 and "--api-key-env GLANCE_TEST_KEYS" in err and "empty" in err


def test_worker_env_for_a_launched_sglang_server():
    from glance_server.cli import worker_env

    assert worker_env(None, None, None) == {}
    assert worker_env("auto", ("drafter", "ngram"), "off") == {
        "GLANCE_PLANNER": "auto", "GLANCE_DRAFT_SOURCES": "drafter,ngram", "GLANCE_NGRAM_CORPUS": "off"}


def test_glance_serve_process(checkpoints):
    target, drafter = checkpoints
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GLANCE_TEST_KEY": "s3cret, other-tenant"}  # two tenants' keys
    proc = subprocess.Popen(
        [*GLANCE, "serve", "--model", str(target), "--drafter", str(drafter), "--port", "0", "--budget", "7",
         "--planner", "fixed", "--served-model-name", "tiny", "--api-key-env", "GLANCE_TEST_KEY", "--no-calibrate",
         "--threads", "1", "--draft-sources", "ngram,drafter", "--ngram-corpus", "per-key"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        deadline = time.time() + 120
        log = []
        while url is None and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            log.append(line)
            if m := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line):
                url = m.group(1)
        assert url, "".join(log)
        while httpx.get(url + "/ready").status_code != 200:
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=image_message("hello", seed=2), max_tokens=5,
                                           temperature=0)
        assert r.usage.completion_tokens >= 1 and r.model_extra["glance"]["backend"] == "embedded"
        assert r.model_extra["glance"]["planner"] == "fixed"  # --planner: the server's default planner
        r = client.chat.completions.create(model="tiny", messages=image_message("hello", seed=2), max_tokens=5,
                                           temperature=0, extra_body={"glance": {"planner": "auto"}})
        assert r.model_extra["glance"]["planner"] == "auto"
        assert r.model_extra["glance"]["draft_sources"] == ["drafter", "ngram"]  # --draft-sources
        other = openai.OpenAI(base_url=url + "/v1", api_key="other-tenant", max_retries=0, timeout=60)
        r = other.chat.completions.create(model="tiny", messages=image_message("hello", seed=2), max_tokens=5,
                                          temperature=0, extra_body={"glance": {"draft_sources": "ngram"}})
        assert r.model_extra["glance"]["draft_sources"] == ["ngram"]
        assert set(r.model_extra["glance"]["sources"]) == {"drafter", "ngram", "both"}
        card = other.models.retrieve("tiny").model_extra["glance"]
        assert card["draft_sources"] == ["drafter", "ngram"] and card["ngram_corpus"] == "per-key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0


def test_glance_serve_merges_the_drafter_and_ngram_matches_by_default(checkpoints):
    """Like the SGLang worker, ``glance serve`` drafts from the drafter and n-gram matches merged unless
    ``--draft-sources`` says otherwise; ``--mode ar`` builds no source."""
    from glance_server.cli import build_app
    from glance_sgl.round import DEFAULT_DRAFT_SOURCES

    target, drafter = (str(p) for p in checkpoints)
    base = ["serve", "--model", target, "--drafter", drafter, "--budget", "7"]
    for extra, sources, ngram in (([], DEFAULT_DRAFT_SOURCES, True), (["--draft-sources", "drafter"], ("drafter",),
                                                                        False)):
        app, _ = build_app(glance_cli.build_parser().parse_args(base + extra))
        engine = app.app.state.gateway.backend.engine
        assert engine.draft_sources == sources and (engine.ngram is not None) == ngram
    assert DEFAULT_DRAFT_SOURCES == ("drafter", "ngram")
    app, _ = build_app(glance_cli.build_parser().parse_args(base + ["--mode", "ar"]))
    assert app.app.state.gateway.backend.engine.ngram is None


def test_glance_serve_drafts_from_the_drafter_alone_where_the_ngram_source_cannot_run(checkpoints, monkeypatch,
                                                                                      capsys):
    """Without SGLang's NgramCorpus (the CPU image ships without SGLang) the default falls back to the drafter
    alone and says so; asking for the n-gram source explicitly is a CLI error naming the flag."""
    from glance_server.cli import build_app
    from glance_sgl import ngram_source

    monkeypatch.setattr(ngram_source, "_IMPORT", (None, "n-gram source unavailable: SGLang is not installed"))
    target, drafter = (str(p) for p in checkpoints)
    base = ["serve", "--model", target, "--drafter", drafter, "--budget", "7"]
    app, _ = build_app(glance_cli.build_parser().parse_args(base))
    assert app.app.state.gateway.backend.engine.draft_sources == ("drafter",)
    assert "drafting from the drafter alone (n-gram source unavailable" in capsys.readouterr().err
    code, err = run_cli(base + ["--draft-sources", "drafter,ngram"], capsys)
    assert code == 2 and "--draft-sources drafter,ngram" in err and "SGLang is not installed" in err
