"""Prometheus metrics of one gateway (its own registry, so several gateways can live in one process)."""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TAU_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 10, 12, 16)
SPEEDUP_BUCKETS = (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6)
ROWS_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)  # rows verified per round (root included)


class _BackendCollector:
    """Queue depth and in-flight requests, read from the backend at scrape time; with a supervised upstream (a
    launched SGLang server) also its restarts and whether it serves."""

    def __init__(self, stats: Callable[[], dict[str, int]],
                 supervision: Callable[[], dict[str, int] | None] | None = None) -> None:
        self.stats = stats
        self.supervision = supervision

    def collect(self):
        stats = self.stats()
        yield GaugeMetricFamily("glance_queue_depth", "Requests waiting for the engine", value=stats["queued"])
        yield GaugeMetricFamily("glance_in_flight", "Requests being generated", value=stats["in_flight"])
        sup = self.supervision() if self.supervision is not None else None
        if sup is not None:
            yield CounterMetricFamily("glance_sglang_restarts", "Restarts of the SGLang server this gateway "
                                      "launched", value=sup["restarts"])
            yield GaugeMetricFamily("glance_sglang_up", "1 while the SGLang server this gateway launched serves",
                                    value=sup["up"])


class Telemetry:
    def __init__(self, stats: Callable[[], dict[str, int]],
                 supervision: Callable[[], dict[str, int] | None] | None = None) -> None:
        """``stats``: the backend's queue counts; ``supervision``: its supervised upstream's counts, if any."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter("glance_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.latency = Histogram("glance_request_latency_seconds", "Request latency (to the last byte)", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("glance_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("glance_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("glance_completion_tokens", "Completion tokens generated", registry=r)
        self.tau = Histogram("glance_tau", "Tokens per verification round (incl. bonus) per request", ["mode"],
                             buckets=TAU_BUCKETS, registry=r)
        self.speedup = Histogram("glance_speedup", "Per-request decode speedup over AR", ["kind"],
                                 buckets=SPEEDUP_BUCKETS, registry=r)
        self.rows = Histogram("glance_rows_per_round", "Rows verified per round (root included; 1 = no draft)",
                              ["mode"], buckets=ROWS_BUCKETS, registry=r)
        self.rounds = Counter("glance_rounds", "Verification rounds (AR: one per token)", ["mode"], registry=r)
        self.rounds_without_drafting = Counter("glance_rounds_without_drafting",
                                               "Rounds that ran no drafter pass", ["mode"], registry=r)
        self.predicted_tokens = Counter("glance_planner_predicted_tokens",
                                        "Tokens the planner expected its rounds to commit", ["planner"], registry=r)
        self.planned_tokens = Counter("glance_planner_committed_tokens",
                                      "Tokens committed by the rounds the planner predicted", ["planner"], registry=r)
        self.source_rounds = Counter("glance_source_rounds", "Rounds whose verified tree held candidates of the "
                                     "source (both: nodes both sources proposed)", ["source"], registry=r)
        self.source_accepted = Counter("glance_source_accepted_tokens", "Drafted tokens accepted, by the source "
                                       "that proposed them (both: nodes both sources proposed)", ["source"],
                                       registry=r)
        self.finished = Counter("glance_generations", "Generations by finish reason", ["finish_reason"], registry=r)
        self.engine_errors = Counter("glance_engine_errors", "Requests failed by the engine or upstream", registry=r)
        r.register(_BackendCollector(stats, supervision))

    def observe_generation(self, glance: dict[str, Any], prompt_tokens: int, completion_tokens: int,
                           finish_reason: str) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.finished.labels(finish_reason).inc()
        if glance.get("tau") is not None:
            self.tau.labels(glance.get("mode") or "unknown").observe(glance["tau"])
        if glance.get("estimated_speedup") is not None:
            self.speedup.labels("estimated").observe(glance["estimated_speedup"])
        self.observe_rounds(glance)
        measured = glance.get("measured") or {}
        if measured.get("decode_speedup") is not None:
            self.speedup.labels("measured").observe(measured["decode_speedup"])

    def observe_rounds(self, glance: dict[str, Any]) -> None:
        """Per-round counts of one request: rows verified, rounds without drafting, predicted vs committed."""
        mode = glance.get("mode") or "unknown"
        rounds = glance.get("rounds") or 0
        if rounds:
            self.rounds.labels(mode).inc(rounds)
        for rows, n in (glance.get("rows_histogram") or {}).items():
            for _ in range(int(n)):
                self.rows.labels(mode).observe(float(rows))
        if glance.get("rounds_without_drafting"):
            self.rounds_without_drafting.labels(mode).inc(glance["rounds_without_drafting"])
        for source, counts in (glance.get("sources") or {}).items():  # null on the sglang backend
            self.source_rounds.labels(source).inc(counts["rounds"])
            self.source_accepted.labels(source).inc(counts["accepted_tokens"])
        predicted = glance.get("predicted_tokens_per_round")
        if predicted is not None and rounds:  # the planner predicts every round of the requests it plans
            planner = glance.get("planner") or "unknown"
            self.predicted_tokens.labels(planner).inc(predicted * rounds)
            self.planned_tokens.labels(planner).inc(glance.get("decode_tokens") or 0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
