"""Per-request records and the run summary (the metrics of ``sglang.bench_serving`` / ``vllm bench serve``
plus the speculative ones), goodput under SLOs, and a small Prometheus text parser.

Conventions (as in vLLM / SGLang's benchmark scripts):

- TTFT: request sent -> first non-empty content chunk (streaming requests only).
- ITL: gaps between consecutive content chunks, pooled over all streaming requests. The gateway sends one
  chunk per decoding round, so with speculation a chunk carries ``tau`` tokens on average.
- TPOT: ``(e2e - ttft) / (completion_tokens - 1)`` per streaming request with at least 2 tokens.
- E2E: request sent -> last byte (every successful request).
- Percentiles: ``numpy.percentile`` (linear interpolation) over the per-request values.
- Throughputs divide by the benchmark duration: first request sent -> last request finished.
- Goodput: successful requests per second that meet every SLO given (``ttft``, ``tpot``, ``e2el``, ``itl`` in
  ms; ``itl`` is checked against a request's worst gap). A non-streaming request's first token arrives with
  the whole answer, so its TTFT for the SLO is its E2E; TPOT and ITL are not observable there and not checked.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el", "itl")


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds since the start of the run; latencies in ms."""

    index: int
    task: str
    endpoint: str  # "chat" | "generate"
    stream: bool
    n_images: int
    start_s: float
    end_s: float = math.nan
    ok: bool = False
    status: int | None = None  # HTTP status (None: no response)
    error: str | None = None  # error type, e.g. "http_429:queue_full", "timeout", "connect_error"
    error_message: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    chunks: int = 0  # content chunks received (streaming)
    tau: float | None = None
    tau_minus_1: float | None = None
    rounds: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    acceptance_rate: float | None = None
    mode: str | None = None
    planner: str | None = None  # the gateway's glance.planner ("auto" | "fixed" | None)
    mean_rows_per_round: float | None = None  # from glance.rows_histogram (1 = a round without drafting)
    rounds_without_drafting: int | None = None
    predicted_tokens_per_round: float | None = None
    queue_ms: float | None = None
    estimated_speedup: float | None = None
    measured_speedup: float | None = None
    lossless_match: bool | None = None

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or self.ttft_ms is None or self.e2e_ms is None or not self.completion_tokens \
                or self.completion_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.completion_tokens - 1)

    def as_row(self) -> dict[str, Any]:
        """A flat dict (CSV row): ``itl_ms`` joined with spaces, ``tpot_ms`` added."""
        row = asdict(self)
        row["itl_ms"] = " ".join(f"{x:.3f}" for x in self.itl_ms)
        row["tpot_ms"] = self.tpot_ms
        return row

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)] + ["tpot_ms"]


# ------------------------------------------------------------------------------------------------ summaries
def distribution(values: Iterable[float | None]) -> dict[str, Any]:
    """count, mean, std, min, p50 (= median), p90, p99, max of the non-missing values."""
    arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if arr.size == 0:
        return {"count": 0, "mean": None, "std": None, "min": None, "median": None,
                **{f"p{p}": None for p in PERCENTILES}, "max": None}
    out = {"count": int(arr.size), "mean": float(arr.mean()), "std": float(arr.std()), "min": float(arr.min()),
           "median": float(np.median(arr))}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    out["max"] = float(arr.max())
    return out


def histogram(values: Iterable[float | None], edges: list[float]) -> dict[str, Any]:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    counts, _ = np.histogram(arr, bins=edges) if arr.size else (np.zeros(len(edges) - 1, dtype=int), None)
    return {"edges": list(edges), "counts": [int(c) for c in counts]}


def parse_slos(specs: Iterable[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (ms) -> ``{"ttft": 500.0, "tpot": 50.0}``; also accepts one
    space/comma-separated string."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        for item in re.split(r"[\s,]+", spec.strip()):
            if not item:
                continue
            key, sep, value = item.partition(":")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"goodput SLO {item!r}: use KEY:MS with KEY in {', '.join(SLO_KEYS)}")
            try:
                ms = float(value)
            except ValueError as exc:
                raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of ms") from exc
            if ms <= 0:
                raise ValueError(f"goodput SLO {item!r}: must be positive")
            slos[key] = ms
    return slos


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    if not r.ok:
        return False
    observed = {"ttft": r.ttft_ms if r.stream else r.e2e_ms, "e2el": r.e2e_ms,
                "tpot": r.tpot_ms if r.stream else None, "itl": max(r.itl_ms) if r.itl_ms else None}
    return all(observed[k] is None or observed[k] <= limit for k, limit in slos.items())


def summarize(records: list[RequestRecord], slos: dict[str, float] | None = None,
              duration_s: float | None = None) -> dict[str, Any]:
    """The run summary: counts, throughputs, latency distributions, goodput, errors, speculative metrics."""
    slos = slos or {}
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    if duration_s is None:
        starts = [r.start_s for r in records]
        ends = [r.end_s for r in records if not math.isnan(r.end_s)]
        duration_s = (max(ends) - min(starts)) if starts and ends else 0.0
    dur = max(duration_s, 1e-9)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    completion = sum(r.completion_tokens or 0 for r in ok)
    streaming = [r for r in ok if r.stream]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    good = [r for r in ok if meets_slos(r, slos)] if slos else ok
    tau_edges = [1, 1.25, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 10, 12, 16]
    spec = {
        "tau": distribution(r.tau for r in ok),
        "tau_minus_1": distribution(r.tau_minus_1 for r in ok),
        # pooled over rounds (the design's convention): decode tokens / rounds over all requests
        "tau_pooled": _pooled_tau(ok),
        "acceptance_rate": distribution(r.acceptance_rate for r in ok),
        "estimated_speedup": distribution(r.estimated_speedup for r in ok),
        "measured_speedup": distribution(r.measured_speedup for r in ok),
        "lossless_match": {"checked": sum(r.lossless_match is not None for r in ok),
                           "matched": sum(r.lossless_match is True for r in ok)},
        "tau_histogram": histogram((r.tau for r in ok), tau_edges),
        "modes": _count(r.mode for r in ok),
        "planners": _count(r.planner for r in ok if r.planner),
        **_planner_pooled(ok),
    }
    by_task = {}
    for name in sorted({r.task for r in records}):
        rs = [r for r in records if r.task == name]
        rs_ok = [r for r in rs if r.ok]
        by_task[name] = {"requests": len(rs), "ok": len(rs_ok), "failed": len(rs) - len(rs_ok),
                         "e2e_ms_mean": _mean(r.e2e_ms for r in rs_ok), "e2e_ms_p99": distribution(
                             r.e2e_ms for r in rs_ok)["p99"], "tau_mean": _mean(r.tau for r in rs_ok),
                         "output_tokens": sum(r.completion_tokens or 0 for r in rs_ok)}
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "streaming": sum(r.stream for r in records),
        "duration_s": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": completion,
        "request_throughput": len(ok) / dur,
        "input_token_throughput": prompt / dur,
        "output_token_throughput": completion / dur,
        "total_token_throughput": (prompt + completion) / dur,
        # mean requests in flight (Little's law over the completed ones)
        "concurrency": sum(r.e2e_ms or 0.0 for r in ok) / 1000.0 / dur,
        "ttft_ms": distribution(r.ttft_ms for r in streaming),
        "tpot_ms": distribution(r.tpot_ms for r in streaming),
        "itl_ms": distribution(x for r in streaming for x in r.itl_ms),
        "e2e_ms": distribution(r.e2e_ms for r in ok),
        "queue_ms": distribution(r.queue_ms for r in ok),  # the gateway's glance.queue_ms
        "tokens_per_chunk": (sum(r.completion_tokens or 0 for r in streaming) / sum(r.chunks for r in streaming)
                             if sum(r.chunks for r in streaming) else None),
        "goodput": {"slos_ms": slos, "good_requests": len(good), "request_goodput": len(good) / dur,
                    "fraction": len(good) / len(records) if records else None},
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])),
        "speculative": spec,
        "by_task": by_task,
    }


def _pooled_tau(records: list[RequestRecord]) -> float | None:
    rounds = sum(r.rounds or 0 for r in records if r.tau is not None)
    decode = sum((r.tau or 0.0) * (r.rounds or 0) for r in records if r.tau is not None)
    return decode / rounds if rounds else None


def _planner_pooled(records: list[RequestRecord]) -> dict[str, float | None]:
    """Rows per round, the share of rounds without drafting, and the planner's predicted tokens per round next
    to the tokens those rounds committed, pooled over rounds (requests that report them)."""
    rows = [r for r in records if r.mean_rows_per_round is not None and r.rounds]
    n_rows = sum(r.rounds for r in rows)
    skipped = [r for r in records if r.rounds_without_drafting is not None and r.rounds]
    n_skipped = sum(r.rounds for r in skipped)
    planned = [r for r in records if r.predicted_tokens_per_round is not None and r.rounds and r.tau is not None]
    n_planned = sum(r.rounds for r in planned)
    return {
        "mean_rows_per_round": sum(r.mean_rows_per_round * r.rounds for r in rows) / n_rows if n_rows else None,
        "rounds_without_drafting_fraction": sum(r.rounds_without_drafting for r in skipped) / n_skipped
        if n_skipped else None,
        "predicted_tokens_per_round": sum(r.predicted_tokens_per_round * r.rounds for r in planned) / n_planned
        if n_planned else None,
        "committed_tokens_per_planned_round": sum(r.tau * r.rounds for r in planned) / n_planned
        if n_planned else None,
    }


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _count(values: Iterable[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        if v is not None:
            out[str(v)] = out.get(str(v), 0) + 1
    return out


def timeline(records: list[RequestRecord], bin_s: float = 1.0) -> dict[str, list[float]]:
    """Completed requests/s, output tokens/s and errors/s per time bin (by finish time)."""
    ends = [r.end_s for r in records if not math.isnan(r.end_s)]
    if not ends:
        return {"t": [], "requests_per_s": [], "output_tokens_per_s": [], "errors_per_s": []}
    n = int(max(ends) // bin_s) + 1
    req, tok, err = [0.0] * n, [0.0] * n, [0.0] * n
    for r in records:
        if math.isnan(r.end_s):
            continue
        k = int(r.end_s // bin_s)
        if r.ok:
            req[k] += 1 / bin_s
            tok[k] += (r.completion_tokens or 0) / bin_s
        else:
            err[k] += 1 / bin_s
    return {"t": [(k + 0.5) * bin_s for k in range(n)], "requests_per_s": req, "output_tokens_per_s": tok,
            "errors_per_s": err}


# ------------------------------------------------------------------------------------------------ Prometheus
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text exposition -> ``{(name, sorted label pairs): value}``."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def metric_sum(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def server_delta(before: dict, after: dict) -> dict[str, Any]:
    """What the gateway counted between two scrapes of ``/metrics``."""
    def d(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    by_route: dict[str, dict[str, int]] = {}
    for (name, ls), _ in after.items():
        if name == "glance_requests_total":
            lab = dict(ls)
            n = int(d("glance_requests_total", route=lab.get("route", ""), status=lab.get("status", "")))
            if n:
                by_route.setdefault(lab.get("route", ""), {})[lab.get("status", "")] = n
    load_routes = ("/v1/chat/completions", "/v1/generate", "other")  # "other": refused before routing (401, 413)
    load: dict[str, int] = {}
    for route in load_routes:
        for code, n in by_route.get(route, {}).items():
            load[code] = load.get(code, 0) + n
    tau_n, tau_sum = d("glance_tau_count"), d("glance_tau_sum")
    rows_n, rows_sum = d("glance_rows_per_round_count"), d("glance_rows_per_round_sum")
    rounds, predicted = d("glance_rounds_total"), d("glance_planner_predicted_tokens_total")
    return {
        "requests_by_route": {r: dict(sorted(v.items())) for r, v in sorted(by_route.items())},
        "chat_requests_by_status": dict(sorted(by_route.get("/v1/chat/completions", {}).items())),
        "generate_requests_by_status": dict(sorted(by_route.get("/v1/generate", {}).items())),
        # what the load itself caused: the chat and multipart routes and requests refused before routing
        "load_requests_by_status": dict(sorted(load.items())),
        "generations": int(d("glance_generations_total")),
        "prompt_tokens": int(d("glance_prompt_tokens_total")),
        "completion_tokens": int(d("glance_completion_tokens_total")),
        "tau_observations": int(tau_n),
        "tau_mean": tau_sum / tau_n if tau_n else None,
        "rounds": int(rounds),
        "mean_rows_per_round": rows_sum / rows_n if rows_n else None,
        "rounds_without_drafting": int(d("glance_rounds_without_drafting_total")),
        "planner_predicted_tokens": predicted,
        "planner_committed_tokens": d("glance_planner_committed_tokens_total"),
        "engine_errors": int(d("glance_engine_errors_total")),
        "queue_depth": metric_sum(after, "glance_queue_depth"),
        "in_flight": metric_sum(after, "glance_in_flight"),
    }
