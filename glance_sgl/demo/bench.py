"""`glance bench`: AR vs GLANCE (and peers) back to back in one process on the same prompts.

For every task and prompt the engine's methods run back to back in an order that rotates from prompt to prompt:
the AR path, GLANCE with the cost-aware planner (``auto``), GLANCE with today's fixed tree every round
(``fixed``), the width-1 chain and, where SGLang's ``NgramCorpus`` is available, the candidate sources of issue 27:
n-gram matches alone (``ngram``: ``draft_sources=("ngram",)``, no drafter pass) and the drafter and n-gram matches
merged into one tree (``merged``), both planned by the headline planner, each on an engine of its own (its own
cross-request corpus of the bench's earlier answers, its own planner statistics); then Hugging Face ``generate``
greedy and prompt-lookup decoding. Tasks: the five demo tasks and ``wild`` (requests unlike them, :mod:`.wild`;
reported apart from the five-task geomean).

Per method and task (totals over the task's prompts): tau (committed tokens per round, bonus included), decode
ms/token, decode and end-to-end speedups over AR, round cost in AR steps ((decode ms / rounds) / AR's decode
ms per token: what one round costs), efficiency (speedup / tau: the share of tau the round cost leaves),
token-for-token match with AR, rows verified per round (1 = a round without drafting), the tokens the planner
predicted per round next to what was committed, and per candidate source (drafter, ngram, both: nodes both
proposed) the rounds that verified its candidates and the drafts accepted from them
(``glance_sgl.metrics.source_counts``). Peers through ``generate`` start from a separate prefill pass;
their decode time is the ``generate`` call (prompt lookup's rounds are not observable: no tau for it).

The entropy law is fitted on the ``fixed`` run's drafting rounds (rows > 1; every round drafts there), without
each request's last round, whose accepted length the end of the answer cuts short.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..engine import GlanceEngine, SamplingParams
from ..law import fit_entropy_law
from ..metrics import add_ms
from .tasks import GROUNDED, TASKS, eval_set
from .wild import TASK as WILD
from .wild import wild_set

BENCH_TASKS = TASKS + (WILD,)
PLANNERS = ("auto", "fixed")
PEERS = ("hf_greedy", "hf_prompt_lookup")
SOURCE_METHODS = {"ngram": ("ngram",), "merged": ("drafter", "ngram")}  # method -> draft sources
LABELS = {"ar": "AR", "auto": "GLANCE auto", "fixed": "GLANCE fixed", "chain": "chain", "ngram": "n-gram only",
          "merged": "GLANCE+ngram", "hf_greedy": "HF greedy", "hf_prompt_lookup": "HF lookup"}
SOURCES = ("drafter", "ngram", "both")


def bench_examples(task: str, limit: int) -> list[Any]:
    """The first ``limit`` evaluation requests of ``task`` (a demo task or ``wild``); each has ``messages()``."""
    if task == WILD:
        return list(wild_set()[:limit])
    if task not in TASKS:
        raise ValueError(f"unknown bench task {task!r}; tasks: {', '.join(BENCH_TASKS)}")
    return list(eval_set(task)[:limit])


def engine_methods(planners: Sequence[str] = PLANNERS, sources: bool = False) -> tuple[str, ...]:
    """The engine's methods for a choice of GLANCE planners: AR, each planner, the chain; with ``sources`` the
    n-gram-only and the merged methods (:data:`SOURCE_METHODS`)."""
    bad = [p for p in planners if p not in PLANNERS]
    if bad or not planners:
        raise ValueError(f"planners must be a non-empty subset of {PLANNERS}, got {list(planners)}")
    return ("ar", *[p for p in PLANNERS if p in planners], "chain", *(SOURCE_METHODS if sources else ()))


def ngram_available() -> bool:
    """Whether SGLang's ``NgramCorpus`` (the n-gram source) can run here."""
    from ..ngram_source import ngram_corpus_class

    return ngram_corpus_class()[0] is not None


def source_engines(engine: GlanceEngine) -> dict[str, GlanceEngine]:
    """One engine per source method, on ``engine``'s target and drafter with its tree settings: each keeps its
    own n-gram corpus (the bench's earlier answers of that method only) and its own planners."""
    return {m: GlanceEngine(engine.target, engine.drafter, budget=engine.budget, branch_k=engine.branch_k,
                            mode="glance", planner=engine.planner_mode, max_nodes=engine.max_nodes,
                            draft_sources=("drafter", "ngram")) for m in SOURCE_METHODS}


def _run_method(engine: GlanceEngine, messages, params: SamplingParams, method: str,
                others: dict[str, GlanceEngine] | None = None, planner: str = "auto"):
    if method in SOURCE_METHODS:
        assert others is not None
        return others[method].generate(messages, params, mode="glance", planner=planner,
                                       draft_sources=SOURCE_METHODS[method])
    if method in PLANNERS:
        return engine.generate(messages, params, mode="glance", planner=method)
    return engine.generate(messages, params, mode=method)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den and math.isfinite(den) and den > 0 else None


def _geomean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals and len(vals) == len(values) else None


@dataclass
class MethodStats:
    """One method's totals over a task's prompts. ``rounds`` is None where rounds are not observable."""

    decode_ms: float = 0.0
    decode_tokens: int = 0
    e2e_ms: float = 0.0
    committed: int = 0
    rounds: int | None = 0
    prompts: int = 0
    matches: int = 0
    rows: dict[int, int] = field(default_factory=dict)
    without_drafting: int = 0
    predicted: float = 0.0  # sum of the planner's predicted tokens over the rounds that had a prediction
    predicted_rounds: int = 0
    predicted_committed: int = 0  # tokens committed by those rounds
    source_rounds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    source_accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    parts: dict[str, float] = field(default_factory=dict)  # wall ms summed of each part of the rounds

    def add_result(self, result, ar_tokens: list[int]) -> None:
        """One engine run (a ``GenerationResult``) of a prompt whose AR tokens are ``ar_tokens``."""
        m = result.metrics
        self.add_timing(m.decode_ms, m.decode_tokens, m.prefill_ms + m.decode_ms, result.token_ids == ar_tokens)
        self.committed += sum(m.committed_per_round)
        self.rounds = (self.rounds or 0) + m.rounds
        for r in m.rows_per_round:
            self.rows[r] = self.rows.get(r, 0) + 1
        self.without_drafting += m.rounds_without_drafting
        for k, v in m.sources.items():
            self.source_rounds[k] += v["rounds"]
            self.source_accepted[k] += v["accepted_tokens"]
        add_ms(self.parts, m.round_part_ms)
        pred = list(m.predicted_per_round)
        if pred:
            self.predicted += sum(pred)
            self.predicted_rounds += len(pred)
            # the planner predicts every round of a request it plans (its AR rounds too: 1 token); were some
            # rounds unpredicted, they would be the first ones, before the planner took over
            self.predicted_committed += sum(m.committed_per_round[m.rounds - len(pred):])

    def add_peer(self, tokens: list[int], decode_ms: float, e2e_ms: float, ar_tokens: list[int]) -> None:
        """One Hugging Face ``generate`` run; with observable rounds (greedy) one round per decoded token."""
        decoded = max(len(tokens) - 1, 0)
        self.add_timing(decode_ms, decoded, e2e_ms, tokens == ar_tokens)
        if self.rounds is not None:
            self.rounds += decoded
            self.committed += decoded

    def add_timing(self, decode_ms: float, decode_tokens: int, e2e_ms: float, match: bool) -> None:
        self.decode_ms += decode_ms
        self.decode_tokens += decode_tokens
        self.e2e_ms += e2e_ms
        self.prompts += 1
        self.matches += int(match)

    @property
    def ms_per_token(self) -> float | None:
        return self.decode_ms / self.decode_tokens if self.decode_tokens else None

    @property
    def tau(self) -> float | None:
        if self.rounds is None:
            return None
        return self.committed / self.rounds if self.rounds else 1.0

    def summary(self, ar: "MethodStats") -> dict[str, Any]:
        """The method's columns, against the AR totals ``ar`` of the same prompts."""
        tau, ms, ar_ms = self.tau, self.ms_per_token, ar.ms_per_token
        speedup = _ratio(ar_ms, ms)
        round_ms = self.decode_ms / self.rounds if self.rounds else None
        total_rows = sum(r * n for r, n in self.rows.items())
        return {
            "tau": tau,
            "tau_minus_1": tau - 1.0 if tau is not None else None,
            "decode_ms_per_token": ms,
            "decode_speedup": speedup,
            "e2e_speedup": _ratio(ar.e2e_ms, self.e2e_ms),
            "round_cost_ar_steps": _ratio(round_ms, ar_ms),
            "efficiency": _ratio(speedup, tau),
            "lossless_match_rate": self.matches / self.prompts if self.prompts else None,
            "rounds": self.rounds,
            "mean_rows_per_round": total_rows / self.rounds if self.rounds and self.rows else None,
            "rows_histogram": {str(r): self.rows[r] for r in sorted(self.rows)},
            "rounds_without_drafting": self.without_drafting if self.rows else None,
            "rounds_without_drafting_fraction": self.without_drafting / self.rounds
            if self.rows and self.rounds else None,
            "predicted_tokens_per_round": _ratio(self.predicted, self.predicted_rounds),
            "actual_tokens_per_predicted_round": _ratio(self.predicted_committed, self.predicted_rounds),
            "sources": {k: {"rounds": self.source_rounds[k], "accepted_tokens": self.source_accepted[k]}
                        for k in SOURCES} if self.rows else None,
            # where a round's time goes: mean wall ms per round of each part (glance_sgl.round.PHASES)
            "ms_per_round_by_part": {k: v / self.rounds for k, v in self.parts.items()}
            if self.parts and self.rounds else None,
        }


@dataclass
class TaskResult:
    task: str
    methods: tuple[str, ...]
    stats: dict[str, MethodStats] = field(default_factory=dict)
    prompts: int = 0
    entropies: list[float] = field(default_factory=list)  # root entropy of every drafting round (nats)
    # rounds the entropy law is fitted on (see the module docstring)
    law_entropies: list[float] = field(default_factory=list)
    law_accepts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for m in self.methods:
            self.stats.setdefault(m, MethodStats(rounds=None if m == "hf_prompt_lookup" else 0))

    def add_law_rounds(self, metrics) -> None:
        """A drafting run's rounds: every drafting round (rows > 1) for the mean entropy, all of them but the
        request's last drafting round for the law (the answer's end, or its token limit, cuts that one short; a
        last round with room for one token is an AR step). Root entropies are per round, or per drafting round
        when a planner's rounds without drafting record none."""
        rows, accepts, h = metrics.rows_per_round, metrics.accept_lengths, metrics.root_entropies
        drafting = [i for i, r in enumerate(rows) if r > 1]
        if len(h) == len(rows):
            h = [h[i] for i in drafting]
        elif len(h) != len(drafting):
            return  # entropies that cannot be matched with rounds: leave them out rather than guess
        last = drafting[-1] if drafting else -1
        self.entropies += h
        self.law_entropies += [x for x, i in zip(h, drafting) if i != last]
        self.law_accepts += [accepts[i] for i in drafting if i != last]

    def summary(self, headline: str) -> dict[str, Any]:
        ar = self.stats["ar"]
        methods = {m: s.summary(ar) for m, s in self.stats.items()}
        head = methods[headline]
        matched = [methods[m]["lossless_match_rate"] for m in self.methods if m not in ("ar", *PEERS)]
        return {
            "grounded": GROUNDED.get(self.task, False),
            "demo_task": self.task in TASKS,
            "prompts": self.prompts,
            "glance_method": headline,
            "tau": head["tau"],
            "tau_minus_1": head["tau_minus_1"],
            "decode_speedup": head["decode_speedup"],
            "e2e_speedup": head["e2e_speedup"],
            "lossless_match_rate": min(matched) if matched else None,  # every engine method vs AR
            "mean_root_entropy": sum(self.entropies) / len(self.entropies) if self.entropies else None,
            "methods": methods,
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


def run_bench(engine: GlanceEngine, limit: int = 10, max_tokens: int = 96, tasks: tuple[str, ...] = BENCH_TASKS,
              progress: bool = True, peers: bool = True, planners: Sequence[str] = PLANNERS,
              sources: bool | None = None, temperature: float = 0.0) -> dict[str, Any]:
    """Every method on the first ``limit`` prompts of every task, back to back (module docstring).

    ``temperature`` > 0: every method samples, the ``i``-th prompt of the run seeded ``i`` (lossless sampling: each
    must commit AR's tokens); the Hugging Face peers are greedy and do not run then.

    ``planners``: the GLANCE methods to run (``("auto", "fixed")`` or one of them). The report's headline
    method (``glance_method``, the flat per-task keys and ``geomean_decode_speedup``) is ``auto`` when it runs.
    ``sources``: run the n-gram-only and merged methods (planned by the headline planner); None: where the
    n-gram source is available (:func:`ngram_available`).
    """
    from tqdm import tqdm

    if sources is None:
        sources = ngram_available()
    methods = engine_methods(planners, sources=sources)
    headline = "auto" if "auto" in methods else methods[1]
    others = source_engines(engine) if sources else None

    def run(method: str, messages):
        return _run_method(engine, messages, params, method, others, headline)

    peers = peers and temperature == 0.0
    all_methods = methods + (PEERS if peers else ())
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0 if temperature else None)
    target = engine.target
    warm = bench_examples(tasks[0], 1)[0].messages()
    for method in methods:
        run(method, warm)
    results: dict[str, TaskResult] = {}
    jobs = [(task, ex) for task in tasks for ex in bench_examples(task, limit)]
    bar = tqdm(jobs, desc="bench", disable=not progress, dynamic_ncols=True)
    for i, (task, ex) in enumerate(bar):
        bar.set_postfix_str(task, refresh=False)
        res = results.setdefault(task, TaskResult(task, all_methods))
        messages = ex.messages()
        if temperature:
            params = dataclasses.replace(params, seed=i)
        # the engine's methods run back to back in an order that rotates from prompt to prompt, so no method
        # always runs first (or right after another) on a machine whose speed drifts
        k = i % len(methods)
        runs = {m: run(m, messages) for m in methods[k:] + methods[:k]}
        ar_tokens = runs["ar"].token_ids
        for m in methods:
            res.stats[m].add_result(runs[m], ar_tokens)
        res.prompts += 1
        res.add_law_rounds(runs["fixed" if "fixed" in runs else headline].metrics)
        if peers:
            toks, dec, e2e = _hf_decode(target, messages, len(ar_tokens))
            res.stats["hf_greedy"].add_peer(toks, dec, e2e, ar_tokens)
            toks, dec, e2e = _hf_decode(target, messages, len(ar_tokens), prompt_lookup_num_tokens=10)
            res.stats["hf_prompt_lookup"].add_peer(toks, dec, e2e, ar_tokens)
    summary = {task: r.summary(headline) for task, r in results.items()}
    demo = [t for t in summary if t in TASKS]
    geomean = {m: {"decode_speedup": _geomean([summary[t]["methods"][m]["decode_speedup"] for t in demo]),
                   "e2e_speedup": _geomean([summary[t]["methods"][m]["e2e_speedup"] for t in demo])}
               for m in all_methods if m != "ar"} if demo else {}
    out: dict[str, Any] = {
        "tasks": summary,
        "methods": list(all_methods),
        "glance_method": headline,
        "geomean_tasks": demo,
        "geomean": geomean,
        "geomean_decode_speedup": geomean[headline]["decode_speedup"] if demo else None,
        "geomean_e2e_speedup": geomean[headline]["e2e_speedup"] if demo else None,
        "budget": engine.budget,
        "branch_k": engine.branch_k,
        "max_nodes": getattr(engine, "max_nodes", None),
        "block_size": engine.block_size,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "limit": limit,
        "law_method": "fixed" if "fixed" in methods else headline,
        "source_methods": {m: list(SOURCE_METHODS[m]) for m in methods if m in SOURCE_METHODS},
        "source_planner": headline if sources else None,
    }
    if WILD in summary:
        out["wild"] = {m: s["decode_speedup"] for m, s in summary[WILD]["methods"].items() if m != "ar"}
    entropies = [h for r in results.values() for h in r.law_entropies]
    accepts = [a for r in results.values() for a in r.law_accepts]
    try:
        out["law"] = fit_entropy_law(entropies, accepts, engine.block_size - 1).to_dict()
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
              tasks: tuple[str, ...] = TASKS, progress: bool = True,
              planners: Sequence[str] = PLANNERS, temperature: float = 0.0) -> dict[str, Any]:
    """The bench (without the HF peers) once per (budget, branch_k): AR, the GLANCE ``planners`` (both by
    default; one with ``glance bench --planner``) and the chain back to back each time, sampled at ``temperature``
    as :func:`run_bench` samples.

    Returns ``{"configs": [{"budget", "branch_k", "glance_method", "geomean_decode_speedup",
    "geomean_chain_decode_speedup", "geomean": {method: x} (demo tasks), "wild": {method: x} | None,
    "tree_beats_chain": [tasks],
    "tasks": {task: {"tau", "decode_speedup", "chain_decode_speedup", "methods": {method: {"tau",
    "decode_speedup"}}}}}]}``; the flat keys are the headline GLANCE method's.
    """
    rows = []
    for budget, branch_k in configs:
        # a fresh engine on the same target and drafter per config: its planners are built for its tree sizes
        config_engine = GlanceEngine(engine.target, engine.drafter, budget=budget, branch_k=branch_k,
                                     mode=engine.mode, planner=engine.planner_mode)
        rep = run_bench(config_engine, limit=limit, max_tokens=max_tokens, tasks=tasks, progress=progress,
                        peers=False, planners=planners, sources=False, temperature=temperature)
        per_task = {}
        for t, s in rep["tasks"].items():
            ms = s["methods"]
            per_task[t] = {"tau": s["tau"], "decode_speedup": s["decode_speedup"],
                           "chain_decode_speedup": ms["chain"]["decode_speedup"],
                           "methods": {m: {"tau": v["tau"], "decode_speedup": v["decode_speedup"]}
                                       for m, v in ms.items() if m != "ar"}}
        # over the demo tasks, as the bench's geomean (wild, when asked for, on its own)
        geo = {m: g["decode_speedup"] for m, g in rep["geomean"].items()} if rep["geomean"] else \
            {m: _geomean([p["methods"][m]["decode_speedup"] for p in per_task.values()])
             for m in rep["methods"] if m != "ar"}
        rows.append({
            "budget": budget, "branch_k": branch_k, "glance_method": rep["glance_method"],
            "geomean_decode_speedup": geo[rep["glance_method"]],
            "geomean_chain_decode_speedup": geo["chain"],
            "geomean": geo,
            "wild": rep.get("wild"),
            "tree_beats_chain": [t for t, s in per_task.items()
                                 if (s["decode_speedup"] or 0) > (s["chain_decode_speedup"] or 0)],
            "tasks": per_task,
        })
    return {"configs": rows, "limit": limit, "max_tokens": max_tokens, "temperature": temperature,
            "block_size": engine.block_size}


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else fmt.format(value)


def format_sweep(sweep: dict[str, Any]) -> str:
    """One line per config: geomean decode speedups of the GLANCE method(s) and the chain, and per task."""
    lines = []
    for row in sweep["configs"]:
        head = row["glance_method"]
        geo = " ".join(f"{m} {_f(g)}x" for m, g in row["geomean"].items())
        if row.get("wild"):
            geo += " (wild: " + " ".join(f"{m} {_f(g)}x" for m, g in row["wild"].items()) + ")"
        per = ", ".join(f"{t} {_f(s['decode_speedup'])}/{_f(s['chain_decode_speedup'])}"
                        for t, s in row["tasks"].items())
        lines.append(f"budget {row['budget']:>3} branch_k {row['branch_k']}: {geo} | {head} beats chain on "
                     f"{len(row['tree_beats_chain'])}/{len(row['tasks'])} | {head}/chain x: {per}")
    return "\n".join(lines)


TABLE_COLUMNS = (  # (header, key in the method summary, format)
    ("tau", "tau", "{:.2f}"), ("tau-1", "tau_minus_1", "{:.2f}"), ("ms/tok", "decode_ms_per_token", "{:.2f}"),
    ("decode x", "decode_speedup", "{:.2f}"), ("e2e x", "e2e_speedup", "{:.2f}"),
    ("round/AR", "round_cost_ar_steps", "{:.2f}"), ("eff", "efficiency", "{:.2f}"),
    ("lossless", "lossless_match_rate", "{:.2f}"), ("rows/rd", "mean_rows_per_round", "{:.1f}"),
    ("no-draft", "rounds_without_drafting_fraction", "{:.0%}"), ("pred/rd", "predicted_tokens_per_round", "{:.2f}"),
)


def format_table(report: dict[str, Any]) -> str:
    """One row per task and method, then the geomeans (five demo tasks; wild apart) and the entropy law."""
    header = ["task", "method", *[c[0] for c in TABLE_COLUMNS], "entropy"]
    rows = [header]
    for task, s in report["tasks"].items():
        name = task + ("" if s["grounded"] else " (open)" if s["demo_task"] else " (not trained)")
        for j, (method, ms) in enumerate(s["methods"].items()):
            cells = [_f(ms[key], fmt) for _, key, fmt in TABLE_COLUMNS]
            entropy = _f(s["mean_root_entropy"], "{:.3g}") if j == 0 else ""
            rows.append([name if j == 0 else "", LABELS.get(method, method), *cells, entropy])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    lines.append("round/AR: (decode ms / rounds) / AR decode ms per token; eff: decode x / tau; rows/rd: rows "
                 "verified per round (1 = no draft); pred/rd: tokens per round the planner predicted (vs tau)")
    for task, s in report["tasks"].items():
        auto = s["methods"].get("auto")
        if auto and auto["rows_histogram"]:
            hist = " ".join(f"{r}:{n}" for r, n in auto["rows_histogram"].items())
            lines.append(f"{task}: auto rows per round {{{hist}}}, {auto['rounds_without_drafting']} of "
                         f"{auto['rounds']} rounds without drafting; predicted {_f(auto['predicted_tokens_per_round'])}"
                         f" vs committed {_f(auto['actual_tokens_per_predicted_round'])} tokens per round")
    for task, s in report["tasks"].items():  # accepted drafts per candidate source, where sources were merged
        merged = s["methods"].get("merged")
        if merged and merged["sources"]:
            per = ", ".join(f"{k} {v['accepted_tokens']} ({v['rounds']} rounds)" for k, v in merged["sources"].items())
            lines.append(f"{task}: {LABELS['merged']} accepted tokens per source: {per}")
    if report["geomean"]:
        geo = ", ".join(f"{LABELS.get(m, m)} {_f(g['decode_speedup'])}x" for m, g in report["geomean"].items())
        lines.append(f"geomean decode speedup over {len(report['geomean_tasks'])} demo tasks: {geo}; "
                     f"{report['glance_method']} e2e {_f(report['geomean_e2e_speedup'])}x "
                     f"(budget {report['budget']}, branch_k {report['branch_k']}, block {report['block_size']})")
    if "wild" in report:
        wild = ", ".join(f"{LABELS.get(m, m)} {_f(x)}x" for m, x in report["wild"].items())
        lines.append(f"wild (not trained, not in the geomean) decode speedup: {wild}")
    law = report.get("law", {})
    if "b0" in law:
        lines.append(f"entropy law ({report['law_method']} drafting rounds): b0 {law['b0']:.2f}, b1 {law['b1']:.2f}, "
                     f"Spearman {law['spearman']:.3f} (p {law['spearman_p']:.1e}), binned R^2 {law['binned_r2']:.2f}, "
                     f"holds: {law['holds']}")
    elif law:
        lines.append(f"entropy law: not fitted ({law.get('error')})")
    return "\n".join(lines)


def write_plots(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """``speedup_per_task.png`` (decode speedup of every method), ``tau_per_task.png``, ``entropy_law.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ..law import expected_accept

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks = list(report["tasks"])
    x = np.arange(len(tasks))
    paths = []

    def grouped(methods: list[str], key: str, ylabel: str, title: str, name: str, baseline: float | None) -> None:
        fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(tasks) + 2), 4))
        width = 0.8 / max(len(methods), 1)
        for j, m in enumerate(methods):
            vals = [report["tasks"][t]["methods"][m][key] for t in tasks]
            ax.bar(x - 0.4 + width * (j + 0.5), [v if v is not None else 0.0 for v in vals], width,
                   label=LABELS.get(m, m))
        if baseline is not None:
            ax.axhline(baseline, color="k", linestyle="--", linewidth=1, label="AR")
        ax.set_xticks(x, tasks)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    others = [m for m in report["methods"] if m != "ar"]
    grouped(others, "decode_speedup", "decode speedup over AR (x)", "Decode speedup per task",
            "speedup_per_task.png", 1.0)
    grouped([m for m in others if m in ("auto", "fixed", "chain", *SOURCE_METHODS)], "tau", "tau (tokens per round, bonus included)",
            "Acceptance per task", "tau_per_task.png", None)

    fig, ax = plt.subplots(figsize=(7, 4))
    rng = np.random.default_rng(0)
    for task in tasks:
        r = report["_rounds"][task]
        h, a = np.asarray(r["entropy"]), np.asarray(r["accepted"], dtype=float)
        ax.scatter(h, a + rng.uniform(-0.15, 0.15, len(a)), s=8, alpha=0.5, label=task)
    law = report.get("law", {})
    all_h = np.concatenate([np.asarray(report["_rounds"][t]["entropy"], dtype=float) for t in tasks])
    if "b0" in law and all_h.size:
        grid = np.linspace(0, max(all_h.max(), 0.1), 200)
        ax.plot(grid, expected_accept(grid, law["b0"], law["b1"], report["block_size"] - 1), "k-",
                label=f"law: b0={law['b0']:.2f}, b1={law['b1']:.2f}")
    ax.set_xlabel("root entropy H (nats)")
    ax.set_ylabel("accepted drafts per round")
    ax.set_title(f"Entropy vs accepted length ({report.get('law_method', 'fixed')} drafting rounds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "entropy_law.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
    return paths


def save_json(report: dict[str, Any], path: str | Path) -> None:
    """The report without its private per-round lists (``_rounds``); NaN/inf written as null."""
    public = {k: v for k, v in report.items() if not k.startswith("_")}
    Path(path).write_text(json.dumps(_finite(public), indent=2))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
