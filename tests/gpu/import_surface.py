"""The device check's import surface: what it imports of the project, imported and used once.

The accelerator machine has no SGLang, sgl-kernel, FlashInfer, FastAPI, uvicorn or pydantic, so the embedded
engine, the kernels and the scale timing must import and run without them. This step imports each module of the
surface, then loads the bundled demo pair and decodes a few tokens with GLANCE and AR (they must agree), and
runs a kernel through the dispatcher. ``--hide`` makes the named top-level packages unimportable first (the CPU
test's way of being that machine: ``tests/test_device_check.py``).

    python tests/gpu/import_surface.py [--device cuda] [--hide sglang,fastapi,pydantic] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SURFACE = (
    "glance_sgl", "glance_sgl.config", "glance_sgl.tree", "glance_sgl.verify", "glance_sgl.drafter",
    "glance_sgl.target", "glance_sgl.planner", "glance_sgl.engine", "glance_sgl.metrics", "glance_sgl.cli",
    "glance_sgl.demo.bench", "glance_sgl.demo.wild", "glance_sgl.scale_timing", "glance_sgl.sglang.draft_graph",
    "glance_sgl.sglang.draft_pool", "glance_kernels", "glance_kernels.triton_ops",
)
ABSENT_ON_DEVICE = ("sglang", "sgl_kernel", "flashinfer", "fastapi", "starlette", "uvicorn", "pydantic",
                    "pydantic_core")


class _Hidden(importlib.abc.MetaPathFinder):
    """Wraps one meta-path finder so that it finds nothing under the hidden top-level names: to the importer
    those packages are simply not installed (``find_spec`` returns None, ``import`` raises ModuleNotFoundError)."""

    def __init__(self, inner: Any, names: frozenset[str]) -> None:
        self.inner, self.names = inner, names

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname.partition(".")[0] in self.names:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(fullname, path, target) if find is not None else None

    def find_distributions(self, *args: Any, **kwargs: Any):
        """``importlib.metadata`` asks the finders too: the hidden packages' metadata is gone as well."""
        find = getattr(self.inner, "find_distributions", None)
        if find is None:
            return iter(())
        prefixes = tuple(n.replace("_", "-") for n in self.names)
        return (d for d in find(*args, **kwargs)
                if not (d.metadata["Name"] or "").lower().replace("_", "-").startswith(prefixes))

    def invalidate_caches(self) -> None:
        getattr(self.inner, "invalidate_caches", lambda: None)()


def hide(names: tuple[str, ...] | list[str]) -> None:
    """Make the top-level packages ``names`` unimportable in this process (already-imported ones are dropped)."""
    hidden = frozenset(names)
    for mod in [m for m in sys.modules if m.partition(".")[0] in hidden]:
        del sys.modules[mod]
    sys.meta_path[:] = [_Hidden(f, hidden) for f in sys.meta_path]


def check(device: str, max_tokens: int = 8) -> dict[str, Any]:
    """Import every module of :data:`SURFACE`, then use them once; every failure is reported, none raises."""
    report: dict[str, Any] = {"imports": {}, "errors": []}
    for name in SURFACE:
        try:
            importlib.import_module(name)
            report["imports"][name] = "ok"
        except Exception as exc:
            report["imports"][name] = f"{type(exc).__name__}: {exc}"[:300]
            report["errors"].append(f"import {name}: {type(exc).__name__}: {exc}"[:300])
    t0 = time.monotonic()
    try:
        import torch

        from glance_sgl.cli import default_checkpoints
        from glance_sgl.demo.bench import bench_examples
        from glance_sgl.engine import GlanceEngine, SamplingParams

        model, drafter = default_checkpoints()
        engine = GlanceEngine.load(model, drafter, device=device)
        msgs = bench_examples("caption", 1)[0].messages()
        params = SamplingParams(max_tokens=max_tokens)
        ar = engine.generate(msgs, params, mode="ar").token_ids
        spec = engine.generate(msgs, params, mode="glance", planner="fixed").token_ids
        report["demo_decode"] = {"tokens": len(ar), "glance_equals_ar": spec == ar}
        if spec != ar:
            report["errors"].append(f"GLANCE != AR on the demo caption prompt: {spec} vs {ar}")
        import glance_kernels

        parents = torch.tensor([[-1, 0, 0, 1]], device=device)
        report["kernel_backend"] = "triton" if glance_kernels.use_triton(parents) else "torch"
        glance_kernels.tree_meta(parents)
    except Exception as exc:
        report["errors"].append(f"use: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")
    report["use_seconds"] = round(time.monotonic() - t0, 1)
    report["loaded_absent_packages"] = sorted({m.partition(".")[0] for m in sys.modules} & set(ABSENT_ON_DEVICE))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--hide", default="", help="comma-separated top-level packages to make unimportable first")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    names = [n for n in args.hide.split(",") if n]
    if names:
        hide(names)
    report = check(args.device)
    report["hidden"] = names
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    bad = {k: v for k, v in report["imports"].items() if v != "ok"}
    print(f"  imports: {len(report['imports']) - len(bad)}/{len(report['imports'])} ok" +
          "".join(f"\n    {k}: {v}" for k, v in bad.items()))
    print(f"  demo decode: {report.get('demo_decode')}; kernel backend: {report.get('kernel_backend')}")
    print(f"  absent-on-device packages loaded: {report['loaded_absent_packages'] or 'none'}")
    for err in report["errors"]:
        print(f"  error: {err}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
