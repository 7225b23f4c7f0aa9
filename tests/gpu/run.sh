#!/usr/bin/env bash
# GLANCE's GPU check: tests/gpu/run.sh [OUT_DIR] (default: $OUT if set, else gpu-report/). Under 8 minutes on one
# GPU; writes OUT_DIR/report.json and OUT_DIR/summary.txt; without CUDA it says so, lists the steps and exits 0.
# Lines: env, gpu-tests, bench (none / NGRAM / DFLASH / GLANCE at 1, 8, 32 in flight, overlap on), overlap-off,
# never-hurts (GLANCE_PLANNER=off vs none), host-reads (per decode step), scale-timing; each reported on its own.
# See tests/gpu/run.py and docs/gpu.md (which also describes tests/gpu/device_check.sh for the lent accelerator machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
if [ "$#" -ge 1 ]; then set -- --out "$1" "${@:2}"; fi
exec "$PY" tests/gpu/run.py --python "$PY" "$@"
