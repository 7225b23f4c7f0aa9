#!/usr/bin/env python3
"""Render the benchmark tables of docs/benchmarks.md and README.md from the committed bench JSON in docs/bench/.

    python scripts/render_benchmarks.py             # rewrite the generated sections from docs/bench/
    python scripts/render_benchmarks.py --check     # exit 1 (and say which) if a section is out of date
    python scripts/render_benchmarks.py record embedded -- .venv/bin/glance bench --limit 10 \\
        --json docs/bench/embedded.json
    python scripts/render_benchmarks.py record sglang -- .venv/bin/python -m glance_sgl.sglang.bench \\
        --methods none,glance --prompts 16 --concurrency 1,4 --wild 8 --wild-concurrency 1 --interleave \\
        --json docs/bench/sglang.json

Numbers are never edited by hand. ``record NAME -- COMMAND`` runs a bench whose ``--json PATH`` lies under
docs/bench/, notes the command, the machine, the date and the commit in ``docs/bench/runs.json``, then renders.
The JSON is what ``glance bench --json`` (glance_sgl/demo/bench.py: ``save_json``) and
``python -m glance_sgl.sglang.bench --json`` (glance_sgl/sglang/bench.py: ``main``) write, unchanged.

A generated section is everything between ``<!-- BEGIN GENERATED: NAME ... -->`` and ``<!-- END GENERATED: NAME
-->`` in a file; the text around it (the prose that explains the numbers) is left alone. Sections:

- docs/benchmarks.md ``embedded``: the embedded engine's table per task (all methods, all columns), the geomeans,
  ``wild`` and the entropy-law fit;
- docs/benchmarks.md ``sglang``: output tokens/s per scenario and method, against no speculation;
- README.md ``headline``: decode speedup per task of the embedded run, with its command and machine.

Standard library only: tests/test_docs.py imports it to check that the committed sections equal the rendering.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = "docs/bench"
RUNS = "runs.json"  # NAME -> {json, command, machine, date, commit, wall_s}
RUN_NAMES = ("embedded", "sglang")

TASK_LABELS = {"wild": "wild (not trained)"}
METHOD_LABELS = {"ar": "AR", "auto": "GLANCE auto", "fixed": "GLANCE fixed", "chain": "chain",
                 "hf_greedy": "HF greedy", "hf_prompt_lookup": "HF prompt lookup",
                 "none": "no speculation", "ngram": "NGRAM", "glance": "GLANCE (drafter + n-gram)",
                 "glance-fixed": "GLANCE fixed", "glance-drafter": "GLANCE drafter alone",
                 "glance-ngram": "GLANCE n-gram alone", "glance+ngram": "GLANCE (drafter + n-gram)",
                 "glance-off": "GLANCE, drafting off"}

# the embedded bench's methods: its "ngram" is GLANCE's own n-gram source alone (SGLang's NGRAM runs in the SGLang
# bench only), "merged" the drafter and that source in one tree
EMBEDDED_LABELS = {**METHOD_LABELS, "ngram": "n-gram alone", "merged": "drafter + n-gram"}

# --- formatting ---------------------------------------------------------------------------------------------

def _num(value: Any, fmt: str = "{:.2f}", none: str = "–") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return none
    return fmt.format(value)


def _x(value: Any) -> str:
    return _num(value, "{:.2f}x")


def _pct(value: Any) -> str:
    return _num(None if value is None else 100.0 * value, "{:.0f}%")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(r) + " |" for r in rows]]


def _provenance(run: dict[str, Any]) -> str:
    """'`COMMAND` on MACHINE, DATE, commit C' from a runs.json entry."""
    parts = [f"`{run['command']}`"]
    if run.get("machine"):
        parts.append(f"on {run['machine']}")
    when = ", ".join(str(run[k]) if k != "commit" else f"commit `{run[k]}`"
                     for k in ("date", "commit") if run.get(k))
    text = " ".join(parts)
    if when:
        text += f" ({when}"
        if run.get("wall_s") is not None:
            text += f"; the run took {run['wall_s'] / 60:.0f} min"
        text += ")"
    return text


# --- the sections -------------------------------------------------------------------------------------------

def _task_name(task: str) -> str:
    return TASK_LABELS.get(task, task)


def render_embedded(report: dict[str, Any], run: dict[str, Any]) -> str:
    """docs/benchmarks.md ``embedded``: ``glance bench --json``'s report."""
    methods = [m for m in report["methods"] if m != "ar"]
    engine = [m for m in methods if m in ("auto", "fixed", "chain")]
    lines = [f"Made by {_provenance(run)}. Settings: tree budget {report['budget']}, branch_k "
             f"{report['branch_k']}, block {report['block_size']}, up to {report['max_tokens']} new tokens, "
             f"{report['limit']} prompts per task, greedy.", "",
             "Decode speedup over the engine's AR path (totals over each task's prompts):", ""]
    head = ["task", *[EMBEDDED_LABELS.get(m, m) for m in methods]]
    if "auto" in methods:
        head += ["auto tau", "auto round / AR step", "auto rounds without drafting"]
    if "fixed" in methods:
        head += ["fixed round / AR step"]
    head += ["lossless"]
    rows = []
    for task, s in report["tasks"].items():
        ms = s["methods"]
        row = [_task_name(task), *[_x(ms[m]["decode_speedup"]) for m in methods]]
        if "auto" in methods:
            a = ms["auto"]
            row += [_num(a["tau"]), _num(a["round_cost_ar_steps"]), _pct(a["rounds_without_drafting_fraction"])]
        if "fixed" in methods:
            row += [_num(ms["fixed"]["round_cost_ar_steps"])]
        row += [_num(s["lossless_match_rate"])]
        rows.append(row)
    lines += _table(head, rows)
    lines.append("")
    if report.get("geomean"):
        geo = ", ".join(f"{EMBEDDED_LABELS.get(m, m)} {_x(g['decode_speedup'])}" for m, g in report["geomean"].items())
        lines.append(f"Geometric mean of the decode speedup over the {len(report['geomean_tasks'])} demo tasks: "
                     f"{geo}; end to end (prefill included) {EMBEDDED_LABELS.get(report['glance_method'])} "
                     f"{_x(report['geomean_e2e_speedup'])}.")
    if report.get("wild"):
        wild = ", ".join(f"{EMBEDDED_LABELS.get(m, m)} {_x(v)}" for m, v in report["wild"].items())
        lines.append(f"`wild` (not trained, not in the geomean): {wild}.")
    law = report.get("law") or {}
    if "b0" in law:
        lines.append(f"Entropy law on the `{report['law_method']}` run's drafting rounds: b0 {law['b0']:.2f}, "
                     f"b1 {law['b1']:.2f}, Spearman {law['spearman']:.2f} (p {law['spearman_p']:.1e}), binned R^2 "
                     f"{law['binned_r2']:.2f}: {'holds' if law['holds'] else 'does not hold'}.")
    elif law:
        lines.append(f"Entropy law: not fitted ({law.get('error')}).")
    lines += ["", "Every column, per task and method (AR is the baseline row):", ""]
    head = ["task", "method", "tau", "tau-1", "ms/tok", "decode x", "e2e x", "round/AR", "eff", "lossless",
            "rows/rd", "no-draft", "pred/rd"]
    rows = []
    for task, s in report["tasks"].items():
        for j, (m, v) in enumerate(s["methods"].items()):
            rows.append([_task_name(task) if j == 0 else "", EMBEDDED_LABELS.get(m, m), _num(v["tau"]),
                         _num(v["tau_minus_1"]), _num(v["decode_ms_per_token"]), _x(v["decode_speedup"]),
                         _x(v["e2e_speedup"]), _num(v["round_cost_ar_steps"]), _num(v["efficiency"]),
                         _num(v["lossless_match_rate"]), _num(v["mean_rows_per_round"]),
                         _pct(v["rounds_without_drafting_fraction"]), _num(v["predicted_tokens_per_round"])])
    lines += _table(head, rows)
    return "\n".join(lines)


def _sglang_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows_by_method = {r["method"]: r for r in report["methods"]}
    base = rows_by_method.get("none")
    scenarios = list(report["methods"][0]["scenarios"]) if report["methods"] else []
    head = ["scenario", "method", "output tok/s", "vs none", "decode tok/s", "vs none", "tau"]
    rows = []
    for name in scenarios:
        b = base["scenarios"][name] if base else None
        for j, r in enumerate(report["methods"]):
            s = r["scenarios"][name]
            ratio = s["tokens_per_s"] / b["tokens_per_s"] if b and b.get("tokens_per_s") else None
            dec, bdec = s.get("decode_tokens_per_s"), (b or {}).get("decode_tokens_per_s")
            rows.append([name if j == 0 else "", METHOD_LABELS.get(r["method"], r["method"]),
                         _num(s["tokens_per_s"], "{:.1f}"), _x(ratio), _num(dec, "{:.1f}"),
                         _x(dec / bdec if dec and bdec else None), _num(s["tau"])])
    return head, rows


def render_sglang(report: dict[str, Any], run: dict[str, Any]) -> str:
    """docs/benchmarks.md ``sglang``: ``python -m glance_sgl.sglang.bench --json``'s report."""
    repeat = report.get("repeat", 1)
    runs = (f" The scenarios after the first of each kind (they replay answers seen before) ran {repeat} times, "
            f"pooled." if repeat > 1 else "")
    engine_runs = report.get("engine_runs", 1)
    if engine_runs > 1:
        runs += (f" The whole run was made {engine_runs} times, every engine started afresh each time, pooled (one "
                 f"engine process can run the same code 5-10 % faster or slower than another for its whole life).")
    lines = [f"Made by {_provenance(run)}. Device {report['device']}, {report['prompts']} demo prompts and "
             f"{report['wild']} wild ones, up to {report['max_tokens']} new tokens, the bundled demo pair, radix "
             f"cache on.{runs} Output tokens/s = completion tokens / wall time (prefill included); decode tok/s "
             f"(at 1 in flight) leaves the prefill out.", ""]
    head, rows = _sglang_rows(report)
    lines += _table(head, rows)
    lines += _spread_table(report)
    rows_per = ", ".join(f"{METHOD_LABELS.get(r['method'], r['method'])} {r['rows_per_step']:.1f}"
                         for r in report["methods"] if r.get("rows_per_step") is not None)
    if rows_per:
        lines += ["", f"Rows verified per request and decode step, over the whole run: {rows_per}."]
    lines += _step_timing_table(report)
    lines += _gap_table(report)
    lines += _host_ms_table(report)
    starts = ", ".join(f"{METHOD_LABELS.get(r['method'], r['method'])} {r['startup_s']:.0f} s"
                       for r in report["methods"] if r.get("startup_s") is not None)
    if starts:
        lines += ["", f"Engine start-up (not counted above): {starts}."]
    return "\n".join(lines)


def _spread_table(report: dict[str, Any]) -> list[str]:
    """Each method's output tok/s over NGRAM's, pooled and engine run by engine run (``--engine-runs``:
    :func:`glance_sgl.sglang.bench.run_spread`). Nothing without per-run rates."""
    sys.path.insert(0, str(ROOT))
    from glance_sgl.sglang.bench import SPREAD_HEAD, run_spread

    rows = run_spread([r for r in report["methods"] if not r.get("error")],
                      label=lambda m: METHOD_LABELS.get(m, m))
    if not rows:
        return []
    return ["", "Each method's output tok/s over NGRAM's in the same run: pooled (the table above), and in each "
                "engine run alone (every engine started afresh; the runs interleave the same chunks), with their "
                "range: how far one engine run's ratio strays from the pool.", ""] + _table(SPREAD_HEAD, rows)


def _step_timing_table(report: dict[str, Any]) -> list[str]:
    """Every method's decode steps side by side, per scenario (``--step-stats``: each scenario's ``step_timing``,
    :func:`glance_sgl.sglang.step_timing.step_table`). Nothing without them."""
    sys.path.insert(0, str(ROOT))
    from glance_sgl.sglang.step_timing import STEP_HEAD, step_table

    rows = step_table([r for r in report["methods"] if not r.get("error")],
                      lambda m: METHOD_LABELS.get(m, m))
    if not rows:
        return []
    return ["", "Every method's decode steps side by side, per scenario (the measured chunks only): SGLang's "
                "`Scheduler.run_batch` timed around each step (`GLANCE_SGL_STEP_TIMING`), the target's forward in it "
                "(`TpModelWorker.forward_batch_generation`; `rows / request`: its input rows per request, padding "
                "included; `us / row`: its wall time per row) and the rest (the drafter's pass, n-gram lookups, "
                "trees, the walk, the step's host work); `between steps`: the scheduler's wall ms from one decode step "
                "to the next (its processing of the step's results and its next batch; not in `ms / step`; – where "
                "the run did not time it); `step / none's`: a step's wall time over no speculation's decode step in "
                "the same scenario (at the batch each method had: a method that ends its requests sooner runs "
                "smaller batches).", ""] \
        + _table(STEP_HEAD, rows)


def _gap_table(report: dict[str, Any]) -> list[str]:
    """Where each method's decode steps stand against NGRAM's, and what host parity would give
    (:func:`glance_sgl.sglang.step_timing.gap_table`). Nothing without step timings and NGRAM."""
    sys.path.insert(0, str(ROOT))
    from glance_sgl.sglang.step_timing import GAP_HEAD, gap_table

    rows = gap_table([r for r in report["methods"] if not r.get("error")], lambda m: METHOD_LABELS.get(m, m))
    if not rows:
        return []
    return ["", "Decode steps against NGRAM's, from the table above: `decode rate over NGRAM's` is tokens per ms of "
                "decode steps (tau x requests per step / ms per step) over NGRAM's; `at NGRAM's host time` the same "
                "with the method's own target forward but NGRAM's time outside the forward per step (`other` above: "
                "for NGRAM its lookup, verify input, walk, KV move and corpus update; for GLANCE also the drafter's "
                "passes): where it reaches 1, the host work per step is the whole gap; where it stays below, the "
                "rows verified are too (the forward).", ""] + _table(GAP_HEAD, rows)


def _host_ms_table(report: dict[str, Any]) -> list[str]:
    """Where a GLANCE step's time goes: per scenario and step kind, the mean ms per decode step of each part, for
    the headline GLANCE method (``--step-stats``: each scenario's ``host_ms_per_step``, read from the engine around
    every measured chunk; a report without them: the method's whole-life line, per kind). Nothing without either."""
    method = next((r for r in report["methods"] if r["method"] == "glance"), None) or \
        next((r for r in report["methods"] if r.get("host_ms_per_step")), None)
    if method is None:
        return []
    per = [(name, s["host_ms_per_step"]) for name, s in method["scenarios"].items() if s.get("host_ms_per_step")]
    scope = "per scenario (the measured chunks only)"
    if not per:
        per, scope = [("whole run", method.get("host_ms_per_step") or {})], "over an engine's life (warm-up included)"
    kinds = [(name, kind, parts) for name, by_kind in per for kind, parts in by_kind.items()]
    if not kinds:
        return []
    names = list(dict.fromkeys(k for _, _, parts in kinds for k in parts if k != "steps"))
    rows = [[name if i == 0 or kinds[i - 1][0] != name else "", kind, str(parts["steps"])]
            + [_num(parts.get(k)) for k in names] for i, (name, kind, parts) in enumerate(kinds)]
    label = METHOD_LABELS.get(method["method"], method["method"])
    return ["", f"Where a {label} step's time goes: mean wall ms per decode step, {scope}, by step kind (`ar`: the "
                "root alone, `ngram`: n-gram candidates without the drafter, `drafter` / `merged`: the drafter's tree "
                "alone / with the matches). `between`: SGLang's scheduler and result processing between two steps, "
                "`prepare`: the worker's own, then the round's parts in order (`pass` is the target's forward; "
                "`glance_sgl.round.PHASES`).", ""] + _table(["scenario", "step kind", "steps"] + names, rows)


def render_headline(report: dict[str, Any], run: dict[str, Any]) -> str:
    """README.md ``headline``: the embedded run's decode speedups per task (the full table: docs/benchmarks.md),
    ``glance serve``'s default first (the drafter and n-gram matches merged, where the run has it)."""
    methods = [m for m in ("merged", "auto", "fixed", "chain") if m in report["methods"]]
    served = methods[0] if methods and methods[0] in ("merged", "auto") else None
    labels = {**EMBEDDED_LABELS, "merged": "drafter + n-gram (`glance serve`'s default)",
              "auto": "GLANCE auto, drafter alone" if "merged" in methods else "GLANCE auto"}
    head = ["task", *[f"{labels[m]} decode speedup" for m in methods]]
    if served:
        head.append(f"{EMBEDDED_LABELS[served]} tau")
    head.append("lossless")
    rows = []
    for task, s in report["tasks"].items():
        ms = s["methods"]
        row = [_task_name(task), *[_x(ms[m]["decode_speedup"]) for m in methods]]
        if served:
            row.append(_num(ms[served]["tau"]))
        rows.append(row + [_num(s["lossless_match_rate"])])
    if report.get("geomean"):
        rows.append([f"geomean, {len(report['geomean_tasks'])} demo tasks",
                     *[_x(report["geomean"][m]["decode_speedup"]) for m in methods],
                     *([""] if served else []), ""])
    lines = [f"Made by {_provenance(run)}; the bundled demo pair, budget {report['budget']}, branch_k "
             f"{report['branch_k']}, greedy, {report['limit']} prompts per task:", ""]
    return "\n".join(lines + _table(head, rows))


# NAME -> (file, the run it reads, renderer)
SECTIONS: dict[str, tuple[str, str, Callable[[dict[str, Any], dict[str, Any]], str]]] = {
    "embedded": ("docs/benchmarks.md", "embedded", render_embedded),
    "sglang": ("docs/benchmarks.md", "sglang", render_sglang),
    "headline": ("README.md", "embedded", render_headline),
}


# --- reading and rewriting ----------------------------------------------------------------------------------

def load_runs(root: Path = ROOT) -> dict[str, dict[str, Any]]:
    """runs.json, each entry with its report loaded under ``report``."""
    bench = root / BENCH_DIR
    runs = json.loads((bench / RUNS).read_text())
    for name, run in runs.items():
        run["report"] = json.loads((root / run["json"]).read_text())
    return runs


def section_pattern(name: str) -> re.Pattern[str]:
    return re.compile(r"(<!-- BEGIN GENERATED: " + re.escape(name) + r"\b[^\n]*-->\n)(.*?)(<!-- END GENERATED: "
                      + re.escape(name) + r" -->)", re.S)


def render_section(name: str, runs: dict[str, dict[str, Any]]) -> str:
    _, run_name, fn = SECTIONS[name]
    run = runs[run_name]
    return fn(run["report"], run).rstrip("\n") + "\n"


def current_section(text: str, name: str) -> str | None:
    m = section_pattern(name).search(text)
    return m.group(2) if m else None


def rendered_files(root: Path = ROOT) -> dict[str, str]:
    """Every file with generated sections -> its text with every section rendered from the committed JSON."""
    runs = load_runs(root)
    out: dict[str, str] = {}
    for name, (rel, _, _) in SECTIONS.items():
        text = out.get(rel)
        if text is None:
            text = (root / rel).read_text()
        pat = section_pattern(name)
        if not pat.search(text):
            raise SystemExit(f"{rel}: no '<!-- BEGIN GENERATED: {name} -->' ... '<!-- END GENERATED: {name} -->' "
                             f"markers")
        body = render_section(name, runs)
        out[rel] = pat.sub(lambda m: m.group(1) + body + m.group(3), text, count=1)
    return out


def render(root: Path = ROOT, check: bool = False) -> int:
    stale = []
    for rel, text in rendered_files(root).items():
        path = root / rel
        if path.read_text() != text:
            stale.append(rel)
            if not check:
                path.write_text(text)
    if check and stale:
        print(f"out of date (run python scripts/render_benchmarks.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    if not check:
        print(f"rewrote {', '.join(stale)}" if stale else "up to date")
    return 0


# --- recording a run ----------------------------------------------------------------------------------------

def describe_machine() -> str:
    """CPU model, cores usable / present, memory, GPUs (nvidia-smi): where a bench ran."""
    model = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = ""
    try:
        kb = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                      if ln.startswith("MemTotal")))
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        gpus = []
    gpu = f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU"
    return f"{usable} of {os.cpu_count()} cores ({model}){mem}, {gpu}"


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"


def _git_commit(root: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()
    rev = git("rev-parse", "--short", "HEAD")
    return rev + ("+local changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _json_target(cmd: list[str], root: Path) -> Path:
    for i, a in enumerate(cmd):
        if a == "--json" and i + 1 < len(cmd):
            path = Path(cmd[i + 1])
        elif a.startswith("--json="):
            path = Path(a.split("=", 1)[1])
        else:
            continue
        path = (root / path).resolve() if not path.is_absolute() else path.resolve()
        if (root / BENCH_DIR).resolve() not in path.parents:
            raise SystemExit(f"--json {path}: the report must go under {BENCH_DIR}/")
        return path
    raise SystemExit("the bench command needs --json docs/bench/NAME.json")


def record(name: str, cmd: list[str], root: Path = ROOT) -> int:
    if name not in RUN_NAMES:
        raise SystemExit(f"record: NAME is one of {', '.join(RUN_NAMES)}")
    if not cmd:
        raise SystemExit("record: give the bench command after --")
    target = _json_target(cmd, root)
    machine, commit, load0 = describe_machine(), _git_commit(root), _load()
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=root).returncode
    # the 1-minute load average says how busy the shared machine was, which is how far to trust the timings
    machine += f", load average {load0} at the start and {_load()} at the end"
    if rc != 0:
        print(f"record: the bench exited {rc}; nothing recorded", file=sys.stderr)
        return rc
    runs_path = root / BENCH_DIR / RUNS
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    shown = [a[len(str(root)) + 1:] if a.startswith(str(root) + "/") else a for a in cmd]
    runs[name] = {"json": target.relative_to(root.resolve()).as_posix(), "command": shlex.join(shown),
                  "machine": machine, "date": date, "commit": commit, "wall_s": round(time.monotonic() - t0, 1)}
    runs_path.write_text(json.dumps(dict(sorted(runs.items())), indent=2) + "\n")
    return render(root)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "record":
        if len(argv) < 2:
            raise SystemExit("usage: render_benchmarks.py record NAME -- BENCH COMMAND ...")
        rest = argv[2:]
        if rest and rest[0] == "--":
            rest = rest[1:]
        return record(argv[1], rest)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a section is out of date")
    args = p.parse_args(argv)
    return render(check=args.check)


if __name__ == "__main__":
    raise SystemExit(main())
