"""`glance generate` on a tiny random checkpoint and drafter saved by the test.

Most commands run in this process (``cli.main``: the same parser and commands, without a fresh interpreter's
imports, 4-6 s each on 2 cores); ``python -m glance_sgl.cli`` itself runs where the process matters (the entry point,
its exit status, a real ``distill``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.glance_testing import make_image, random_drafter


def run_glance(*args: str) -> subprocess.CompletedProcess:
    """``python -m glance_sgl.cli ARGS`` in a child process."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "glance_sgl.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """``glance ARGS`` in this process (``cli.main``), as a CompletedProcess: exit status, stdout, stderr."""
    from glance_sgl import cli

    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["glance", *args], code, out, err)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, target_dirs, targets):
    root = tmp_path_factory.mktemp("cli")
    drafter_dir = root / "drafter"
    random_drafter(targets["qwen2_5_vl"], seed=9).save_pretrained(drafter_dir)
    image = root / "picture.png"
    make_image(3, (112, 140)).save(image)
    return target_dirs["qwen2_5_vl"], str(drafter_dir), str(image)


def test_generate_json(saved, engines, capsys):
    model, drafter, image = saved
    proc = run_glance("generate", "--model", model, "--drafter", drafter, "--image", image,
                      "--prompt", "what colour is the square", "--max-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"text", "token_ids", "finish_reason", "metrics"}
    m = out["metrics"]
    for key in ("tau", "tau_minus_1", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_histogram",
                "prefill_ms", "decode_ms", "decode_tokens_per_s", "mean_root_entropy"):
        assert key in m
    assert m["completion_tokens"] == len(out["token_ids"]) <= 12
    assert m["planner"] == "auto" and sum(m["rows_histogram"].values()) == m["rounds"]
    assert len(m["rows_per_round"]) == len(m["predicted_per_round"]) == m["rounds"]
    ar = json.loads(run_main(capsys, "generate", "--model", model, "--image", image, "--prompt",
                             "what colour is the square", "--max-tokens", "12", "--ar", "--json").stdout)
    assert ar["token_ids"] == out["token_ids"] and ar["metrics"]["mode"] == "ar"
    assert ar["metrics"]["planner"] is None and ar["metrics"]["rounds_without_drafting"] == ar["metrics"]["rounds"]


def test_generate_plain_output(saved, capsys):
    model, drafter, image = saved
    proc = run_main(capsys, "generate", "--model", model, "--drafter", drafter, "--image", image, "--prompt", "hi",
                      "--max-tokens", "5", "--planner", "fixed")
    assert proc.returncode == 0, proc.stderr
    assert "tau" in proc.stderr and "prefill" in proc.stderr
    # every round drafts but the last, with room for one token at --max-tokens 5 (an AR step)
    assert "planner fixed" in proc.stderr and re.search(r"\b[01] rounds? without drafting", proc.stderr)


@pytest.mark.parametrize("args,message", [
    (["--image", "/nonexistent.png"], "image not found"),
    (["--max-tokens", "0"], "--max-tokens"),
])
def test_generate_errors_name_the_problem(saved, args, message, capsys):
    model, drafter, image = saved
    proc = run_main(capsys, "generate", "--model", model, "--drafter", drafter, "--prompt", "hi", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--planner", "fastest"], "invalid choice: 'fastest'"),
    (["--planner", "fixed", "--ar"], "--planner applies to GLANCE tree decoding"),
    (["--planner", "auto", "--mode", "chain"], "--planner applies to GLANCE tree decoding"),
    (["--draft-sources", "drafter,beam"], "--draft-sources 'drafter,beam': draft sources must be"),
    (["--draft-sources", "ngram", "--ar"], "--draft-sources applies to GLANCE tree decoding"),
])
def test_generate_planner_errors(saved, args, message, capsys):
    """Refused before any model loads (in process: the checks come first)."""
    from glance_sgl import cli

    model, drafter, _ = saved
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--model", model, "--drafter", drafter, "--prompt", "hi", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_generate_draft_sources(saved, capsys):
    from glance_sgl.ngram_source import ngram_corpus_class

    if ngram_corpus_class()[0] is None:
        pytest.skip(str(ngram_corpus_class()[1]))
    model, drafter, image = saved
    proc = run_main(capsys, "generate", "--model", model, "--drafter", drafter, "--image", image, "--prompt", "hi",
                    "--max-tokens", "8", "--planner", "fixed", "--draft-sources", "ngram,drafter")
    assert proc.returncode == 0, proc.stderr
    assert "draft sources drafter,ngram; accepted tokens per source: drafter " in proc.stderr
    out = json.loads(run_main(capsys, "generate", "--model", model, "--drafter", drafter, "--image", image,
                              "--prompt", "hi", "--max-tokens", "8", "--draft-sources", "ngram", "--json").stdout)
    m = out["metrics"]
    assert m["draft_sources"] == ["ngram"] and m["sources"]["drafter"] == {"rounds": 0, "accepted_tokens": 0}
    assert sum(v["accepted_tokens"] for v in m["sources"].values()) == m["accepted_tokens"]


def test_generate_rejects_a_non_image(saved, tmp_path, capsys):
    model, drafter, _ = saved
    fake = tmp_path / "notes.png"
    fake.write_text("not an image")
    proc = run_glance("generate", "--model", model, "--drafter", drafter, "--prompt", "hi", "--image", str(fake))
    assert proc.returncode == 2 and "not a readable image" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_main(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi", "--ar")
    assert proc.returncode == 2 and "config.json" in proc.stderr


def test_distill_cli_samples_and_rejects_bad_temperature(saved, tmp_path, capsys):
    model, _, image = saved
    data = tmp_path / "requests.jsonl"
    data.write_text(json.dumps({"image": image, "prompt": "tell me a story", "task": "open"}) + "\n")
    proc = run_main(capsys, "distill", "--target", model, "--data", str(data), "--out", str(tmp_path / "bad"),
                      "--temperature", "-0.5")
    assert proc.returncode == 2 and "--temperature" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_glance("distill", "--target", model, "--data", str(data), "--out", str(tmp_path / "d"),
                      "--max-new-tokens", "6", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "d" / "distill.json").read_text())
    assert meta["sequences"] == 1 and meta["temperature"] == 1.0 and meta["seed"] == 3
