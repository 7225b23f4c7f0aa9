"""`glance distill --backend sglang` on the demo pair (CPU): a real SGLang server answers the distillation
requests, many in flight, token-identical to the embedded engine at temperature 0; sampled answers carry their
per-request seed. One SGLang launch (the target alone, no speculation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from glance_sgl.demo.paths import bundled_target  # noqa: E402

pytestmark = pytest.mark.slow

N = 5  # the fifth is the demo's open task, where sampled answers differ from greedy ones
MAX_NEW = 16


def _answers(out: Path) -> list[list[int]]:
    return [json.loads(line)["answer_ids"] for line in (out / "answers.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not (bundled_target() / "config.json").is_file(), reason="the demo target is not installed")
def test_distill_through_sglang_matches_the_embedded_engine(tmp_path):
    import torch

    from glance_sgl.cli import main
    from glance_sgl.train.bench_distill import write_demo_llava
    from glance_sgl.train.sglang_distill import launch_target_server

    target = str(bundled_target())
    data = write_demo_llava(tmp_path, N)
    rows = json.loads(data.read_text())
    rows.insert(1, {"image": "missing.png", "conversations": [{"from": "human", "value": "<image>\nhi"}]})
    data.write_text(json.dumps(rows))
    # what distill launches without --upstream; it starts while the embedded path answers
    server = launch_target_server(target, device="cpu", log_path=tmp_path / "sglang.log", wait=False)
    threads = torch.get_num_threads()
    try:
        common = ["--target", target, "--data", str(data), "--max-new-tokens", str(MAX_NEW), "--no-features"]
        assert main(["distill", *common, "--out", str(tmp_path / "embedded"), "--temperature", "0"]) == 0
        server.wait_ready(timeout=600)
        torch.set_num_threads(1)  # the server's scheduler has the cores now
        sg = ["distill", *common, "--backend", "sglang", "--upstream", server.url, "--concurrency", "4"]
        assert main([*sg, "--out", str(tmp_path / "sglang"), "--temperature", "0"]) == 0
        assert main([*sg, "--out", str(tmp_path / "s1"), "--temperature", "1", "--seed", "7"]) == 0
    finally:
        torch.set_num_threads(threads)
        server.stop()
    embedded, sglang = _answers(tmp_path / "embedded"), _answers(tmp_path / "sglang")
    assert len(embedded) == N and all(len(a) > 0 for a in embedded)
    assert sglang == embedded  # token-identical at temperature 0
    meta = json.loads((tmp_path / "sglang" / "distill.json").read_text())
    assert meta["backend"] == "sglang" and meta["skipped"] == 1 and "demo.json:2: field 'image'" in meta["rows"][0]
    def prompt_tokens(name: str) -> list[int]:
        return [json.loads(x)["prompt_tokens"] for x in (tmp_path / name / "answers.jsonl").read_text().splitlines()]

    assert prompt_tokens("sglang") == prompt_tokens("embedded")
    # sampled answers (SGLang's CPU mode cannot seed its sampler: --enable-deterministic-inference needs a GPU
    # attention backend, so per-seed repeats are not checked here)
    sampled = _answers(tmp_path / "s1")
    assert len(sampled) == N and sampled != embedded
    assert [json.loads(x)["seed"] for x in (tmp_path / "s1" / "answers.jsonl").read_text().splitlines()] == \
        [7 + i for i in (0, 2, 3, 4, 5)]  # request i (the file's row order, the bad row 2 included) gets seed 7 + i
