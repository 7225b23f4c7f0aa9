"""Random batched cases shared by the kernel tests."""

from __future__ import annotations

import importlib.util
import sys
import types
from types import ModuleType

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (name, prefix lengths): prefix 0, mixed prefix lengths, one long prefix
PREFIXES = {"prefix0": [0, 0, 0], "mixed": [0, 5, 37], "long": [130, 1, 64]}


def random_parents(kind: str, n: int, bs: int, gen: torch.Generator) -> torch.Tensor:
    """Parent rows [bs, n] of packed trees (parents precede children): ``chain``, ``star`` or ``random``."""
    rows = torch.arange(n)
    if kind == "chain":
        par = rows - 1
    elif kind == "star":
        par = torch.where(rows == 0, -1, 0)
    else:
        par = None
    if par is not None:
        return par.expand(bs, n).clone()
    out = torch.empty(bs, n, dtype=torch.long)
    for b in range(bs):
        out[b, 0] = -1
        for i in range(1, n):
            out[b, i] = int(torch.randint(0, i, (1,), generator=gen))
    return out


def greedy_predictions(tokens: torch.Tensor, parents: torch.Tensor, gen: torch.Generator, hit: float = 0.75):
    """Target argmax per row: usually the token of one of the row's children (long walks), else random."""
    bs, n = tokens.shape
    pred = torch.randint(0, 1000, (bs, n), generator=gen)
    for b in range(bs):
        for i in range(n):
            kids = (parents[b] == i).nonzero().flatten()
            if len(kids) and float(torch.rand((), generator=gen)) < hit:
                pred[b, i] = tokens[b, kids[int(torch.randint(0, len(kids), (1,), generator=gen))]]
    return pred


def load_sglang_module(name: str) -> ModuleType:
    """Import ``sglang.kernels.ops.speculative.<name>`` (the real 0.5.23 package). Off CUDA, one module imports
    ``sgl_kernel.speculative`` (a CUDA build) at import time only to bind a name the tests never call: a
    placeholder is put in ``sys.modules`` for that import alone, under a private module name."""
    full = f"sglang.kernels.ops.speculative.{name}"
    try:
        importlib.import_module("sgl_kernel.speculative")
    except ImportError:
        pass
    else:
        return importlib.import_module(full)
    stubs = {"sgl_kernel": types.ModuleType("sgl_kernel"), "sgl_kernel.speculative": types.ModuleType("s")}
    stubs["sgl_kernel.speculative"].reconstruct_indices_from_tree_mask = None
    stubs["sgl_kernel"].speculative = stubs["sgl_kernel.speculative"]
    spec = importlib.util.find_spec(full)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(f"_glance_test_{name}", spec.origin))
    added = [k for k in stubs if k not in sys.modules]
    sys.modules.update({k: stubs[k] for k in added})
    try:
        module.__spec__.loader.exec_module(module)
    finally:
        for k in added:
            sys.modules.pop(k, None)
    return module


def both(fn, *args, **kwargs):
    """``fn`` through the dispatcher twice: (torch reference, Triton kernel)."""
    import glance_kernels

    with glance_kernels.backend("torch"):
        ref = fn(*args, **kwargs)
    with glance_kernels.backend("triton"):
        tri = fn(*args, **kwargs)
    return ref, tri


def assert_same(ref, tri) -> None:
    """Exact equality of tensors / tuples of tensors / lists (dtype and values)."""
    if isinstance(ref, torch.Tensor):
        assert ref.dtype == tri.dtype and ref.shape == tri.shape, (ref.dtype, tri.dtype, ref.shape, tri.shape)
        assert torch.equal(ref.cpu(), tri.cpu())
    elif isinstance(ref, (tuple, list)):
        assert len(ref) == len(tri)
        for a, b in zip(ref, tri):
            assert_same(a, b)
    else:
        assert ref == tri


def sglang_function(module: str, name: str, namespace: dict) -> types.FunctionType:
    """One top-level function of an SGLang module, compiled from the installed package's source without
    importing the module (whose imports pull in the whole scheduler). ``namespace``: the globals it uses."""
    import ast

    path = importlib.util.find_spec(module).origin
    tree = ast.parse(open(path).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    glb = dict(namespace)
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), glb)
    return glb[name]
