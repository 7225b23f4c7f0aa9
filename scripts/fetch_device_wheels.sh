#!/usr/bin/env bash
# Fetch the wheels the device check carries to the accelerator machine (docs/gpu.md) into .device-wheels/
# (git-ignored; pass it to the device tool's `carry`). Pure-Python wheels for that image's Python 3.12; no
# dependencies are fetched: the image brings its own (tokenizers, huggingface-hub, safetensors, ...).
#   scripts/fetch_device_wheels.sh [PACKAGE==VERSION ...]    # default: transformers==5.19.0 (SGLang 0.5.23's pin)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
[ "$#" -gt 0 ] || set -- transformers==5.19.0
mkdir -p .device-wheels
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .device-wheels "$@"
ls -l .device-wheels/*.whl
