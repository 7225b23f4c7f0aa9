"""Kernel tests: Triton kernels run on CUDA when present, else under the Triton interpreter on CPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first kernel import (glance_kernels imports it lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")
