"""The GPU check's dry run here (no CUDA: it says so, lists its steps, writes a skipped report, exits 0) and its
scale-timing step on a tiny config on the CPU (the same code the GPU runs at Qwen2.5-VL-7B's shapes)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_gpu_script_skips_cleanly_without_cuda(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([str(ROOT / "tests/gpu/run.sh"), str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": str(Path(os.sys.executable))})
    assert proc.returncode == 0, proc.stderr
    assert "GPU check skipped: no CUDA device" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "skipped" and "torch.cuda.is_available() is False" in report["reason"]
    names = [s["name"] for s in report["would_run"]]
    assert names == ["env", "gpu-tests", "scale-timing", "bench"]
    assert sum(s["limit_s"] for s in report["would_run"]) <= 480  # under 8 minutes
    assert "--device cuda" in report["would_run"][3]["cmd"] and "none,ngram,glance" in report["would_run"][3]["cmd"]
    assert (out / "summary.txt").read_text().startswith("GPU check skipped")


def test_scale_timing_tiny_on_cpu(tmp_path):
    from glance_sgl.scale_timing import main

    path = tmp_path / "scale.json"
    assert main(["--tiny", "--device", "cpu", "--batches", "1,2", "--rows", "4", "--context", "16",
                 "--repeats", "1", "--drafter-layers", "1", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["errors"] == []
    assert set(report["verify_ms"]) == {f"eager/bs{b}/rows{r}" for b in (1, 2) for r in (1, 4)}
    assert set(report["drafter_ms"]) == {"eager/bs1", "eager/bs2"}
    assert all(v > 0 for v in list(report["verify_ms"].values()) + list(report["drafter_ms"].values()))
    s = report["speedup_by_tau"]["eager/bs1/rows4"]
    ar, v, d = report["verify_ms"]["eager/bs1/rows1"], report["verify_ms"]["eager/bs1/rows4"], \
        report["drafter_ms"]["eager/bs1"]
    assert s["tau3"] == pytest.approx(3 * ar / (v + d), rel=1e-2)
