"""The device check's ``env`` step: versions, the GPU, and its bf16 matmul and copy-bandwidth ceilings.

Standard library + torch only (it runs first, before anything of the project is imported).

    python tests/gpu/device_env.py --json env.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "triton", "transformers", "tokenizers", "huggingface-hub", "safetensors", "numpy", "pillow",
            "pytest", "tqdm", "sglang", "flashinfer-python", "sgl-kernel", "fastapi", "pydantic")


def versions() -> dict[str, str | None]:
    """Installed version of each package of interest (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _best_ms(fn, repeats: int) -> float:
    """Fastest of ``repeats`` CUDA-event-timed calls of ``fn`` (after two warm-up calls), in milliseconds."""
    import torch

    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def ceilings(n: int = 8192, copy_mib: int = 1024, repeats: int = 10) -> dict[str, float]:
    """bf16 matmul TFLOP/s (``n x n @ n x n``) and device-to-device copy bandwidth (GB/s, read + write) of the
    current CUDA device: the roofline the passes are judged against. A few seconds on one GPU."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    mm_ms = _best_ms(lambda: torch.matmul(a, b, out=c), repeats)
    src = torch.empty(copy_mib * 2**20, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    cp_ms = _best_ms(lambda: dst.copy_(src), repeats)
    return {"bf16_matmul_tflops": round(2 * n**3 / (mm_ms / 1000) / 1e12, 1), "matmul_n": n,
            "copy_gb_per_s": round(2 * src.numel() / (cp_ms / 1000) / 1e9, 1), "copy_mib": copy_mib}


def probe() -> dict[str, Any]:
    """Everything the step reports; the ceilings only where CUDA runs."""
    import torch

    report: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                              "packages": versions(), "torch_cuda": torch.version.cuda,
                              "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                      capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                      bf16_supported=torch.cuda.is_bf16_supported())
        report.update(ceilings())
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    report = probe()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    for key, value in report.items():
        if key != "packages":
            print(f"  {key}: {value}")
    print("  packages: " + ", ".join(f"{k} {v}" for k, v in report["packages"].items() if v))
    print("  absent: " + ", ".join(k for k, v in report["packages"].items() if not v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
