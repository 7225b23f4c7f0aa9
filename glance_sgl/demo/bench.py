"""`glance bench`: AR vs GLANCE (and peers) back to back in one process on the demo evaluation prompts.

For every task and prompt, in this order: the engine's AR path, GLANCE (tree), the width-1 chain, Hugging Face
``generate`` greedy and Hugging Face prompt-lookup decoding, all on the same target and prompt. Decode speedup =
AR decode ms/token / the method's decode ms/token (per task: total decode time over total decode tokens).
Peers through ``generate`` (greedy, prompt lookup) start from a separate prefill pass; their decode time is the
``generate`` call. Their token-for-token agreement with the AR path is reported as a match rate.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..engine import GlanceEngine, SamplingParams
from ..law import fit_entropy_law
from .tasks import GROUNDED, TASKS, eval_set

METHODS = ("ar", "glance", "chain", "hf_greedy", "hf_prompt_lookup")


@dataclass
class MethodTotals:
    decode_ms: float = 0.0
    decode_tokens: int = 0
    e2e_ms: float = 0.0

    def add(self, decode_ms: float, decode_tokens: int, e2e_ms: float) -> None:
        self.decode_ms += decode_ms
        self.decode_tokens += decode_tokens
        self.e2e_ms += e2e_ms

    @property
    def ms_per_token(self) -> float:
        return self.decode_ms / self.decode_tokens if self.decode_tokens else math.nan


@dataclass
class TaskResult:
    task: str
    totals: dict[str, MethodTotals] = field(default_factory=lambda: {m: MethodTotals() for m in METHODS})
    committed: int = 0
    rounds: int = 0
    chain_committed: int = 0
    chain_rounds: int = 0
    matches: int = 0
    peer_prompts: int = 0
    hf_matches: int = 0
    prompt_lookup_matches: int = 0
    prompts: int = 0
    entropies: list[float] = field(default_factory=list)  # every round's root entropy (nats)
    # The rounds the entropy law is fitted on: all but each request's last, whose accepted length is cut short by
    # the end of the answer (EOS, stop, max_tokens) rather than by what the drafter could guess.
    law_entropies: list[float] = field(default_factory=list)
    law_accepts: list[int] = field(default_factory=list)

    def speedup(self, method: str, e2e: bool = False) -> float:
        ar, other = self.totals["ar"], self.totals[method]
        if e2e:
            return ar.e2e_ms / other.e2e_ms if other.e2e_ms else math.nan
        mine = other.ms_per_token
        return ar.ms_per_token / mine if mine > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        tau = self.committed / self.rounds if self.rounds else 1.0
        return {
            "grounded": GROUNDED[self.task],
            "prompts": self.prompts,
            "tau": tau,
            "tau_minus_1": tau - 1,
            "chain_tau": self.chain_committed / self.chain_rounds if self.chain_rounds else 1.0,
            "ar_decode_ms_per_token": self.totals["ar"].ms_per_token,
            "glance_decode_ms_per_token": self.totals["glance"].ms_per_token,
            "decode_speedup": self.speedup("glance"),
            "e2e_speedup": self.speedup("glance", e2e=True),
            "chain_decode_speedup": self.speedup("chain"),
            "hf_greedy_decode_speedup": self.speedup("hf_greedy"),
            "prompt_lookup_decode_speedup": self.speedup("hf_prompt_lookup"),
            "lossless_match_rate": self.matches / self.prompts if self.prompts else math.nan,
            "hf_generate_match_rate": self.hf_matches / self.peer_prompts if self.peer_prompts else math.nan,
            "prompt_lookup_match_rate": self.prompt_lookup_matches / self.peer_prompts
            if self.peer_prompts else math.nan,
            "mean_root_entropy": sum(self.entropies) / len(self.entropies) if self.entropies else math.nan,
        }


def _hf_decode(target, messages, max_tokens: int, **kwargs) -> tuple[list[int], float, float]:
    """(tokens, decode ms, e2e ms) of Hugging Face ``generate`` after a separate prefill pass.

    The prompt (with its pixels) is prefilled by one forward pass, then ``generate`` continues from that cache
    with the first token appended and no pixels. Decode time is the ``generate`` call. (Prompt lookup started
    on the raw prompt copies ``<|image_pad|>`` tokens out of the prompt into its first candidates, which the
    Qwen-VL forward rejects next to the pixels.)
    """
    from transformers import DynamicCache

    prompt = target.prepare(messages)
    eos = sorted(target.eos_token_ids)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = target.model(**prompt.inputs, past_key_values=DynamicCache(config=target.model.config), use_cache=True)
        first = out.logits[0, -1].argmax().view(1, 1)
        prefill = (time.perf_counter() - t0) * 1000
        ids = torch.cat([prompt.input_ids, first.to(prompt.input_ids.device)], dim=1)
        tokens = [int(first)]
        decode = 0.0
        if max_tokens > 1 and int(first) not in eos:
            t0 = time.perf_counter()
            gen = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        past_key_values=out.past_key_values, max_new_tokens=max_tokens - 1,
                                        do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **kwargs)
            decode = (time.perf_counter() - t0) * 1000
            tokens += gen[0, ids.shape[1]:].tolist()
    return tokens, decode, prefill + decode


def run_bench(engine: GlanceEngine, limit: int = 10, max_tokens: int = 96, tasks: tuple[str, ...] = TASKS,
              progress: bool = True, peers: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    params = SamplingParams(max_tokens=max_tokens)
    target = engine.target
    warm = eval_set(tasks[0])[0].messages()
    for mode in ("ar", "glance", "chain"):
        engine.generate(warm, params, mode=mode)
    results: dict[str, TaskResult] = {}
    jobs = [(task, ex) for task in tasks for ex in eval_set(task)[:limit]]
    modes = ("ar", "glance", "chain")
    for i, (task, ex) in enumerate(tqdm(jobs, desc="bench", disable=not progress, dynamic_ncols=True)):
        res = results.setdefault(task, TaskResult(task))
        messages = ex.messages()
        # the three methods run back to back in an order that rotates from prompt to prompt, so no method
        # always runs first (or right after another) on a machine whose speed drifts
        runs = {mode: engine.generate(messages, params, mode=mode) for mode in modes[i % 3:] + modes[:i % 3]}
        ar, gl, ch = runs["ar"], runs["glance"], runs["chain"]
        for name, r in runs.items():
            m = r.metrics
            res.totals[name].add(m.decode_ms, m.decode_tokens, m.prefill_ms + m.decode_ms)
        res.prompts += 1
        res.matches += int(gl.token_ids == ar.token_ids and ch.token_ids == ar.token_ids)
        res.committed += sum(gl.metrics.committed_per_round)
        res.rounds += gl.metrics.rounds
        res.chain_committed += sum(ch.metrics.committed_per_round)
        res.chain_rounds += ch.metrics.rounds
        res.entropies += gl.metrics.root_entropies
        res.law_entropies += gl.metrics.root_entropies[:-1]
        res.law_accepts += gl.metrics.accept_lengths[:-1]
        if peers:
            res.peer_prompts += 1
            toks, dec, e2e = _hf_decode(target, messages, len(ar.token_ids))
            res.totals["hf_greedy"].add(dec, max(len(toks) - 1, 0), e2e)
            res.hf_matches += int(toks == ar.token_ids)
            toks, dec, e2e = _hf_decode(target, messages, len(ar.token_ids), prompt_lookup_num_tokens=10)
            res.totals["hf_prompt_lookup"].add(dec, max(len(toks) - 1, 0), e2e)
            res.prompt_lookup_matches += int(toks == ar.token_ids)
    summary = {task: r.summary() for task, r in results.items()}
    speedups = [s["decode_speedup"] for s in summary.values()]
    out: dict[str, Any] = {
        "tasks": summary,
        "geomean_decode_speedup": math.exp(sum(math.log(s) for s in speedups) / len(speedups)),
        "geomean_e2e_speedup": math.exp(sum(math.log(s["e2e_speedup"]) for s in summary.values()) / len(summary)),
        "budget": engine.budget,
        "branch_k": engine.branch_k,
        "block_size": engine.block_size,
        "max_tokens": max_tokens,
    }
    entropies = [h for r in results.values() for h in r.law_entropies]
    accepts = [a for r in results.values() for a in r.law_accepts]
    try:
        law = fit_entropy_law(entropies, accepts, engine.block_size - 1)
        out["law"] = law.to_dict()
    except ValueError as exc:
        out["law"] = {"error": str(exc), "holds": False}
    out["_rounds"] = {t: {"entropy": r.law_entropies, "accepted": r.law_accepts} for t, r in results.items()}
    return out


def parse_sweep(spec: str) -> list[tuple[int, int]]:
    """``"15x2,31x4"`` -> ``[(15, 2), (31, 4)]`` (tree budget x branch_k); ValueError naming the bad item."""
    configs = []
    for item in spec.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"bad sweep item {item.strip()!r}: expected BUDGETxBRANCH_K, e.g. 15x2")
        configs.append((int(parts[0]), int(parts[1])))
    return configs


def run_sweep(engine: GlanceEngine, configs: list[tuple[int, int]], limit: int = 10, max_tokens: int = 96,
              tasks: tuple[str, ...] = TASKS, progress: bool = True) -> dict[str, Any]:
    """The bench (without the HF peers) once per (budget, branch_k): AR, tree and chain back to back each time.

    Returns ``{"configs": [{"budget", "branch_k", "geomean_decode_speedup", "geomean_chain_decode_speedup",
    "tree_beats_chain": [tasks], "tasks": {task: {"tau", "decode_speedup", "chain_decode_speedup"}}}]}``.
    """
    saved = engine.budget, engine.branch_k
    rows = []
    try:
        for budget, branch_k in configs:
            engine.budget, engine.branch_k = budget, branch_k
            rep = run_bench(engine, limit=limit, max_tokens=max_tokens, tasks=tasks, progress=progress, peers=False)
            per_task = {t: {k: s[k] for k in ("tau", "decode_speedup", "chain_decode_speedup")}
                        for t, s in rep["tasks"].items()}
            chain = [s["chain_decode_speedup"] for s in per_task.values()]
            rows.append({
                "budget": budget, "branch_k": branch_k,
                "geomean_decode_speedup": rep["geomean_decode_speedup"],
                "geomean_chain_decode_speedup": math.exp(sum(math.log(c) for c in chain) / len(chain)),
                "tree_beats_chain": [t for t, s in per_task.items() if s["decode_speedup"] > s["chain_decode_speedup"]],
                "tasks": per_task,
            })
    finally:
        engine.budget, engine.branch_k = saved
    return {"configs": rows, "limit": limit, "max_tokens": max_tokens, "block_size": engine.block_size}


def format_sweep(sweep: dict[str, Any]) -> str:
    """One line per config: geomean decode speedups of the tree and the chain, and per-task tree / chain."""
    lines = []
    for row in sweep["configs"]:
        per = ", ".join(f"{t} {s['decode_speedup']:.2f}/{s['chain_decode_speedup']:.2f}"
                        for t, s in row["tasks"].items())
        lines.append(f"budget {row['budget']:>3} branch_k {row['branch_k']}: tree {row['geomean_decode_speedup']:.2f}x "
                     f"chain {row['geomean_chain_decode_speedup']:.2f}x | tree beats chain on "
                     f"{len(row['tree_beats_chain'])}/{len(row['tasks'])} | tree/chain x: {per}")
    return "\n".join(lines)


def format_table(report: dict[str, Any]) -> str:
    cols = [("task", "{}"), ("tau", "{:.2f}"), ("tau-1", "{:.2f}"), ("AR ms/tok", "{:.2f}"),
            ("GLANCE ms/tok", "{:.2f}"), ("decode x", "{:.2f}"), ("e2e x", "{:.2f}"), ("chain x", "{:.2f}"),
            ("HF greedy x", "{:.2f}"), ("HF lookup x", "{:.2f}"), ("lossless", "{:.2f}"), ("entropy", "{:.3f}")]
    keys = ["tau", "tau_minus_1", "ar_decode_ms_per_token", "glance_decode_ms_per_token", "decode_speedup",
            "e2e_speedup", "chain_decode_speedup", "hf_greedy_decode_speedup", "prompt_lookup_decode_speedup",
            "lossless_match_rate", "mean_root_entropy"]
    rows = [[c[0] for c in cols]]
    for task, s in report["tasks"].items():
        name = task + ("" if s["grounded"] else " (open)")
        rows.append([name] + [fmt.format(s[k]) for (_, fmt), k in zip(cols[1:], keys)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    law = report.get("law", {})
    lines.append(f"geomean decode speedup {report['geomean_decode_speedup']:.2f}x, "
                 f"geomean e2e speedup {report['geomean_e2e_speedup']:.2f}x "
                 f"(budget {report['budget']}, branch_k {report['branch_k']}, block {report['block_size']})")
    if "b0" in law:
        lines.append(f"entropy law: b0 {law['b0']:.2f}, b1 {law['b1']:.2f}, Spearman {law['spearman']:.3f} "
                     f"(p {law['spearman_p']:.1e}), binned R^2 {law['binned_r2']:.2f}, holds: {law['holds']}")
    return "\n".join(lines)


def write_plots(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ..law import expected_accept

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks = list(report["tasks"])
    fig, ax = plt.subplots(figsize=(7, 4))
    taus = [report["tasks"][t]["tau"] for t in tasks]
    chain = [report["tasks"][t]["chain_tau"] for t in tasks]
    x = np.arange(len(tasks))
    ax.bar(x - 0.2, taus, 0.4, label="GLANCE tree", color="#3b6fc4")
    ax.bar(x + 0.2, chain, 0.4, label="chain (width 1)", color="#b0b0b0")
    ax.set_xticks(x, tasks)
    ax.set_ylabel("tau (tokens per round, bonus included)")
    ax.set_title("Acceptance per task")
    ax.legend()
    fig.tight_layout()
    p1 = out / "tau_per_task.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    rng = np.random.default_rng(0)
    for task in tasks:
        r = report["_rounds"][task]
        h, a = np.asarray(r["entropy"]), np.asarray(r["accepted"], dtype=float)
        ax.scatter(h, a + rng.uniform(-0.15, 0.15, len(a)), s=8, alpha=0.5, label=task)
    law = report.get("law", {})
    if "b0" in law:
        all_h = np.concatenate([np.asarray(report["_rounds"][t]["entropy"]) for t in tasks])
        grid = np.linspace(0, max(all_h.max(), 0.1), 200)
        ax.plot(grid, expected_accept(grid, law["b0"], law["b1"], report["block_size"] - 1), "k-",
                label=f"law: b0={law['b0']:.2f}, b1={law['b1']:.2f}")
    ax.set_xlabel("root entropy H (nats)")
    ax.set_ylabel("accepted drafts per round")
    ax.set_title("Entropy vs accepted length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p2 = out / "entropy_law.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]


def save_json(report: dict[str, Any], path: str | Path) -> None:
    public = {k: v for k, v in report.items() if not k.startswith("_")}
    Path(path).write_text(json.dumps(public, indent=2))
