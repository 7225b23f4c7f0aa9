"""Micro-benchmark: each kernel against its torch reference (``python -m glance_kernels.bench``).

On CUDA the Triton kernels run compiled; without CUDA they run under the Triton interpreter (set here), so the
CPU numbers measure the interpreter, not a GPU. ``build_tree`` (``glance_sgl.tree``, the host heap) is timed
next to the device budget tree. Not a test.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import glance_kernels as gk  # noqa: E402
from glance_sgl.tree import build_tree, topk_per_offset  # noqa: E402


def _time(fn: Callable[[], object], device: str, repeat: int) -> float:
    """Median wall time in microseconds (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]


def _backend(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with gk.backend(name):
            return fn()

    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=8, help="requests per batch")
    ap.add_argument("--budget", type=int, default=63, help="tree nodes (rows = budget + 1)")
    ap.add_argument("--block", type=int, default=16, help="block size B (depth B - 1)")
    ap.add_argument("--branch-k", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=512, help="committed tokens per request (mixed +- 50%%)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=0, help="timed calls per kernel (default: 50 CUDA, 3 CPU)")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    repeat = args.repeat or (50 if device == "cuda" else 3)
    gen = torch.Generator().manual_seed(0)
    bs, depth, k = args.bs, args.block - 1, args.branch_k
    logp = torch.log_softmax(torch.randn(bs, depth, 1000, generator=gen) * 3, -1)
    vals, ids = (t.to(device) for t in topk_per_offset(logp, k))
    roots = torch.randint(0, 1000, (bs,), generator=gen).to(device)
    tree = gk.budget_tree(vals, ids, roots, args.budget)
    n = tree.tokens.shape[1]
    prefix_cpu = [max(0, int(args.prefix * (0.5 + i / max(bs - 1, 1)))) for i in range(bs)]
    prefix = torch.tensor(prefix_cpu, device=device)
    meta = gk.tree_meta(tree.parents, prefix)
    # an accepted path per request: the root, then first children while there are some (up to 4 nodes)
    rows = [torch.zeros(bs, dtype=torch.long, device=device)]
    for _ in range(4):
        nxt = meta.first_child.gather(1, rows[-1][:, None].clamp(min=0))[:, 0]
        rows.append(torch.where(rows[-1] >= 0, nxt, torch.full_like(nxt, -1)))
    accepted_rows = torch.stack(rows, 1)
    pages = (max(prefix_cpu) + n + args.page_size - 1) // args.page_size
    table = torch.randperm(bs * pages, generator=gen).view(bs, pages).to(device)
    caches = [torch.randn(bs * pages * args.page_size, 8, 128, device=device, dtype=torch.bfloat16)
              for _ in range(2)]

    cases: list[tuple[str, Callable[[], object]]] = [
        ("tree_meta", lambda: gk.tree_meta(tree.parents, prefix)),
        ("full_mask", lambda: gk.full_mask(meta.tree_mask, prefix, prefix_cpu)),
        ("compact_kv (K+V, 1 layer)", lambda: gk.compact_kv(caches, table, args.page_size, prefix, accepted_rows)),
        ("budget_tree", lambda: gk.budget_tree(vals, ids, roots, args.budget)),
    ]
    print(f"device={device} ({'compiled Triton' if device == 'cuda' else 'Triton interpreter'}) bs={bs} "
          f"rows={n} depth={depth} k={k} prefix~{args.prefix} page_size={args.page_size} repeat={repeat}")
    print(f"{'kernel':28s} {'triton us':>12s} {'torch us':>12s} {'torch/triton':>13s}")
    for name, fn in cases:
        t_tri = _time(_backend("triton", fn), device, repeat)
        t_ref = _time(_backend("torch", fn), device, repeat)
        print(f"{name:28s} {t_tri:12.1f} {t_ref:12.1f} {t_ref / t_tri:12.2f}x")
    t_host = _time(lambda: build_tree(vals, ids, roots, args.budget), device, repeat)
    print(f"{'build_tree (host heap)':28s} {'':>12s} {t_host:12.1f}")


if __name__ == "__main__":
    main()
