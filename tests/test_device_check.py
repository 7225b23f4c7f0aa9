"""The device check (tests/gpu/device_check.sh, docs/gpu.md) on this CPU machine: without CUDA it lists its steps
and exits 0; its import surface imports and decodes with SGLang, FastAPI and pydantic unimportable; what it
carries fits the device tool's 64 MiB; a failing step is reported on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import device_check  # noqa: E402
from import_surface import ABSENT_ON_DEVICE, SURFACE  # noqa: E402

STEPS = ["env", "imports", "kernels", "engine", "scale-timing", "ngram"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_device_check_without_cuda_lists_its_steps_and_exits_0(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([str(ROOT / "tests/gpu/device_check.sh")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(out)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("device check skipped: no CUDA device")
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "skipped" and "torch.cuda.is_available() is False" in report["reason"]
    assert [s["name"] for s in report["would_run"]] == STEPS
    assert sum(s["limit_s"] for s in report["would_run"]) <= device_check.BUDGET_S < 360  # under 6 minutes
    assert "--device cuda" in report["would_run"][3]["cmd"]
    assert "--rows 1,4,8,16,32,64" in report["would_run"][4]["cmd"] and "--context 1024,4096" in \
        report["would_run"][4]["cmd"]
    assert (out / "summary.txt").read_text().startswith("device check skipped")
    for name in STEPS:
        assert f"  {name} (<=" in proc.stdout


def test_import_surface_runs_with_sglang_fastapi_pydantic_unimportable(tmp_path):
    path = tmp_path / "imports.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests/gpu/import_surface.py"), "--hide",
                           ",".join(ABSENT_ON_DEVICE), "--json", str(path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["hidden"] == list(ABSENT_ON_DEVICE)
    assert report["imports"] == {name: "ok" for name in SURFACE}
    assert report["demo_decode"]["glance_equals_ar"] and report["demo_decode"]["tokens"] > 0
    assert report["loaded_absent_packages"] == [] and report["errors"] == []


def test_hidden_packages_are_unimportable_and_have_no_metadata():
    code = ("import sys; sys.path.insert(0, 'tests/gpu')\n"
            "import import_surface as s; s.hide(['fastapi', 'pydantic'])\n"
            "import importlib.util, importlib.metadata as m\n"
            "assert importlib.util.find_spec('fastapi') is None\n"
            "try:\n    import pydantic\nexcept ModuleNotFoundError:\n    pass\n"
            "else:\n    raise SystemExit('imported')\n"
            "try:\n    m.version('fastapi')\nexcept m.PackageNotFoundError:\n    pass\n"
            "else:\n    raise SystemExit('meta')\n"
            "import torch; print(m.version('torch'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == torch.__version__.split("+")[0] or proc.stdout.strip() == torch.__version__


def test_carried_tree_and_wheels_fit_64_mib(tmp_path):
    carry = device_check.carried_bytes(tmp_path)  # an empty wheels folder: the tree alone
    assert carry["wheels"] == {} and carry["tree_bytes"] > 1_000_000
    assert carry["tree_bytes"] + sum(device_check.DEFAULT_WHEELS.values()) <= device_check.CARRY_LIMIT_BYTES
    (tmp_path / "x-1.0-py3-none-any.whl").write_bytes(b"0" * 1000)
    assert device_check.carried_bytes(tmp_path)["wheels"] == {"x-1.0-py3-none-any.whl": 1000}


def test_a_failing_step_is_reported_on_its_own_and_off_is_not_a_failure(tmp_path):
    env = dict(os.environ)
    deadline = time.monotonic() + 60
    bad = device_check.run_step({"name": "bad", "limit": 20, "cmd": [sys.executable, "-c", "print('  x'); "
                                                                      "raise SystemExit(2)"]}, env, deadline)
    off = device_check.run_step({"name": "off", "limit": 20, "optional": True,
                                 "cmd": [sys.executable, "-c", "raise SystemExit(3)"]}, env, deadline)
    slow = device_check.run_step({"name": "slow", "limit": 1, "cmd": [sys.executable, "-c",
                                                                       "import time; time.sleep(30)"]}, env, deadline)
    assert (bad["status"], bad["rc"], off["status"], slow["status"], slow["rc"]) == ("failed", 2, "off", "failed", 124)
    lines = device_check.summarise({"status": "failed", "seconds": 1.0, "steps": [bad, off, slow]})
    assert "  bad: failed (rc=2)" in lines[1] and "  off: off (rc=3)" in lines[2]
    assert "--- bad" in lines and "  x" in lines
