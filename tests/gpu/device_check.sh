#!/usr/bin/env bash
# The device check for the lent accelerator machine as it is (docs/gpu.md): tests/gpu/device_check.sh [--dry-run]
# [--out DIR] [--wheels DIR]. Runs under that machine's python3 (or $PYTHON) with the wheels carried in
# .device-wheels/ (scripts/fetch_device_wheels.sh); under 6 minutes on one H200; writes report.json and
# summary.txt to $OUT when set, else gpu-report/. Without CUDA it lists its steps and exits 0.
# tests/gpu/run.sh is the full SGLang check for a user's GPU machine (pip-installed SGLang + FlashInfer).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$(command -v python3)}"
exec "$PY" tests/gpu/device_check.py --python "$PY" "$@"
