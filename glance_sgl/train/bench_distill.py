"""Answers/s of distillation: the embedded engine (one request at a time) vs an SGLang server (many in flight).

    python -m glance_sgl.train.bench_distill [--requests 32] [--max-new-tokens 64] [--concurrency 16]
        [--target DIR] [--upstream URL] [--json out.json]

Writes the demo's training prompts as a LLaVA file, distils them (answers only, greedy) with both backends,
checks the answers are token-identical and prints answers/s and answer tokens/s of each (the server's start-up
is timed apart, not counted; a launched server is stopped before the embedded run).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def write_demo_llava(root: Path, n: int, split: str = "train") -> Path:
    """``n`` demo requests (round-robin over the tasks; training or evaluation examples) as a LLaVA JSON file
    with the pictures next to it."""
    from ..demo.tasks import TASKS, eval_set, train_example

    rows = []
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        ex = train_example(task, i // len(TASKS)) if split == "train" else eval_set(task)[i // len(TASKS)]
        name = f"demo_{i:04d}.png"
        ex.image.save(root / name)
        rows.append({"image": name, "task": task,
                     "conversations": [{"from": "human", "value": "<image>\n" + ex.prompt}]})
    path = root / "demo.json"
    path.write_text(json.dumps(rows))
    return path


def _answers(out: Path) -> list[list[int]]:
    return [json.loads(line)["answer_ids"] for line in (out / "answers.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from ..demo.paths import bundled_target
    from ..engine import GlanceEngine
    from .data import PromptOnlyTarget, build_distill_data
    from .formats import read_dataset
    from .sglang_distill import SGLangAnswerer, launch_target_server

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(bundled_target()))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--upstream", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="glance-bench-distill-"))
    data = write_demo_llava(root, args.requests)
    report: dict[str, Any] = {"requests": args.requests, "max_new_tokens": args.max_new_tokens,
                              "concurrency": args.concurrency}
    server = None
    try:
        t0 = time.perf_counter()
        if args.upstream is None:
            server = launch_target_server(args.target, log_path=root / "sglang.log")
        report["sglang_startup_s"] = time.perf_counter() - t0
        url = args.upstream or server.url
        target = PromptOnlyTarget(args.target)
        runs = {}
        for name in ("sglang", "embedded"):
            kw: dict[str, Any] = {}
            engine = None
            if name == "sglang":
                kw = dict(answerer=SGLangAnswerer(url, target.tokenizer, concurrency=args.concurrency),
                          target=target)
            else:
                engine = GlanceEngine.load(args.target, None)
            t0 = time.perf_counter()
            build_distill_data(engine, read_dataset(data), root / name, taps=[0], max_new_tokens=args.max_new_tokens,
                               temperature=0.0, progress=False, features=False, **kw)
            wall = time.perf_counter() - t0
            answers = _answers(root / name)
            runs[name] = answers
            tokens = sum(len(a) for a in answers)
            report[name] = {"wall_s": wall, "answers_per_s": len(answers) / wall, "tokens_per_s": tokens / wall,
                            "answer_tokens": tokens}
            if "answerer" in kw:
                kw["answerer"].close()
                if server is not None:  # an idle server must not share the cores with the embedded run
                    server.stop()
                    server = None
        report["token_identical"] = runs["sglang"] == runs["embedded"]
        report["speedup"] = report["sglang"]["answers_per_s"] / report["embedded"]["answers_per_s"]
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
