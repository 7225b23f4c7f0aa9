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
    steps = {s["name"]: s for s in report["would_run"]}
    assert list(steps) == ["env", "gpu-tests", "bench", "overlap-off", "never-hurts", "host-reads", "scale-timing"]
    assert sum(s["limit_s"] for s in report["would_run"]) <= 480  # under 8 minutes
    bench = {name: steps[name]["cmd"] for name in ("bench", "overlap-off", "never-hurts", "host-reads")}
    assert all("glance_sgl.sglang.bench --device cuda" in cmd and "--json" in cmd and "--log-dir" in cmd
               for cmd in bench.values())
    assert "--methods none,ngram,dflash,glance " in bench["bench"] and "--concurrency 1,8,32" in bench["bench"]
    assert "--overlap on" in bench["bench"]  # every speculative engine under the overlap scheduler
    assert "--methods glance " in bench["overlap-off"] and "--overlap off" in bench["overlap-off"]
    assert "--methods none,glance-off " in bench["never-hurts"] and "--overlap" not in bench["never-hurts"]
    assert "--count-host-reads" in bench["host-reads"] and "glance-off" in bench["host-reads"]
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("GPU check skipped")
    assert all(f"  {name} (<= " in summary for name in steps)


def test_gpu_summary_reads_each_bench_line_on_its_own():
    """The summary of the bench lines from their JSON: one line's failure (or missing JSON) hides no other."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "tests/gpu/run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)

    def row(method, tps, tau=1.0, **kw):
        return {"method": method, "scenarios": {"demo c=1": {"tokens_per_s": tps, "tau": tau, "identical": [4, 4]}},
                **kw}

    results = {
        "bench": {"overlap": "on", "methods": [
            row("none", 100.0), row("ngram", 120.0, 1.5),
            {"method": "dflash", "error": "ValueError: no capture", "scenarios": {}},
            row("glance", 150.0, 3.0, error="--overlap on, but the engine ran without the overlap scheduler: x")],
            "dflash_preflight": ["SGLang's Qwen2_5_VLForConditionalGeneration defines no set_dflash_layers_to_capture"]},
        "overlap-off": {"overlap": "off", "methods": [row("glance", 140.0, 3.0)]},
        "never-hurts": None,
        "host-reads": {"overlap": None, "methods": [
            {"method": "glance", "scenarios": {}, "host_reads": {"steps": 9, "max": 7, "mean": 5.5,
                                                                  "by_kind": {"bs=1 tree": {"steps": 9, "max": 7,
                                                                                            "mean": 5.5}}}},
            {"method": "glance-off", "scenarios": {}}]},
    }
    text = "\n".join(run.bench_lines(results))
    assert "demo c=1: none 100 tok/s (tau 1.00, same 4/4); ngram 120 tok/s = 1.20x none" in text
    assert "dflash: FAILED: ValueError: no capture" in text and "dflash preflight:" in text
    assert "glance 150 tok/s = 1.50x none (tau 3.00, same 4/4) [failed, see below]" in text
    assert "glance: FAILED: --overlap on" in text
    assert "GLANCE overlap off 140 tok/s; overlap on failed (bench)" in text
    assert "--- never-hurts: no results" in text
    assert "glance: max 7, mean 5.50 per step over 9 steps; bs=1 tree max 7 mean 5.50" in text
    assert "glance-off: no host-read lines in its log" in text


def test_scale_timing_tiny_on_cpu(tmp_path):
    from glance_sgl.scale_timing import main

    path, curve = tmp_path / "scale.json", tmp_path / "curve.json"
    curve.write_text(json.dumps({"tau_by_rows": {"tau_by_rows": {"4": 2.0, "8": 2.6, "16": 3.0}}}))
    assert main(["--tiny", "--device", "cpu", "--batches", "1,2", "--rows", "4,8", "--context", "16,24",
                 "--repeats", "1", "--drafter-layers", "1", "--tau-curve", str(curve), "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["errors"] == []
    assert set(report["verify_ms"]) == {f"eager/ctx{c}/bs{b}/rows{r}" for c in (16, 24) for b in (1, 2)
                                        for r in (1, 4, 8)}
    assert set(report["drafter_ms"]) == {f"eager/ctx{c}/bs{b}" for c in (16, 24) for b in (1, 2)}
    assert all(v > 0 for v in list(report["verify_ms"].values()) + list(report["drafter_ms"].values()))
    base = "eager/ctx16/bs1"
    ar, v, d = (report["verify_ms"][f"{base}/rows1"], report["verify_ms"][f"{base}/rows4"],
                report["drafter_ms"][base])
    assert report["round_cost_ar_steps"][base]["4"] == pytest.approx((v + d) / ar, rel=1e-2)
    assert report["speedup_by_tau"][f"{base}/rows4"]["tau2.9"] == pytest.approx(2.9 * ar / (v + d), rel=1e-2)
    best = report["best_rows"][base]
    assert set(best) == {"paper_tau2.9", "paper_tau4.7", "demo"}
    costs = {int(r): c for r, c in report["round_cost_ar_steps"][base].items()}
    demo = {1: 1.0, 4: 2.0, 8: 2.6}  # the curve's 16 rows were not timed
    assert best["demo"]["rows"] == max(demo, key=lambda r: demo[r] / costs[r])


def test_scaled_tau_curve_keeps_the_bonus_and_hits_the_anchor():
    from glance_sgl.scale_timing import scaled_curve

    curve = {4: 2.0, 16: 3.0, 64: 4.0}
    out = scaled_curve(curve, 4.7, anchor=16)
    assert out[16] == pytest.approx(4.7) and out[4] == pytest.approx(1 + 1.0 * 3.7 / 2.0)
    mid = scaled_curve(curve, 5.0, anchor=32)  # 32 lies between 16 and 64: interpolated in log rows
    assert mid[16] < 5.0 < mid[64]


def test_a_configuration_without_its_drafter_pass_gets_no_round_cost():
    """A run cut short (the device check's time limit) may hold a context's verify passes but not its drafter
    pass: that configuration gets no round cost and no "best" tree size, rather than "1 row, x1.0"."""
    from glance_sgl.scale_timing import derive

    report = {"rows": [1, 4], "verify_ms": {"graph/ctx1/bs1/rows1": 10.0, "graph/ctx1/bs1/rows4": 11.0,
                                            "graph/ctx2/bs1/rows1": 20.0, "graph/ctx2/bs1/rows4": 21.0},
              "drafter_ms": {"graph/ctx1/bs1": 2.0}, "tau_curve": {"4": 2.0, "32": 3.0}}
    derive(report)
    assert set(report["round_cost_ar_steps"]) == set(report["best_rows"]) == {"graph/ctx1/bs1"}
    assert report["round_cost_ar_steps"]["graph/ctx1/bs1"]["4"] == pytest.approx(1.3)


def test_scale_timing_prints_each_configuration_and_keeps_a_partial_report(tmp_path, capsys):
    from glance_sgl.scale_timing import measure, SHAPES_TINY

    path = tmp_path / "partial.json"
    report = measure("cpu", torch.float32, SHAPES_TINY, [1], [1, 4], [16], repeats=1, drafter_layers=1,
                     progress=False, partial=path)
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("  job ")]
    assert [l.split(":")[0] for l in lines] == ["  job eager/ctx16/bs1/rows1", "  job eager/ctx16/bs1/rows4",
                                                "  job eager/ctx16/bs1"]
    assert json.loads(path.read_text())["verify_ms"] == report["verify_ms"]
