"""The harness against a real gateway on loopback: counts against /metrics, percentiles against the records,
the request cap of the open loop, the CLI and its outputs."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest

from glance_loadtest import LoadConfig, run_load
from glance_loadtest.stats import parse_prometheus, server_delta

pytestmark = pytest.mark.timeout(180)


def scrape(url: str) -> dict:
    return parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)


def test_counts_match_metrics_and_percentiles_match_records(load_gateway, api_key, tmp_path):
    before = scrape(load_gateway.url)
    config = LoadConfig(url=load_gateway.url, api_key=api_key, users=3, spawn_rate=10, run_time=4.0,
                        max_tokens=8, dataset="random", image_size=(112, 112), stream_fraction=0.6,
                        task_weights={"generate_multipart": 1}, goodput=["ttft:60000", "e2el:60000"], seed=3,
                        progress=False)
    result = run_load(config)
    after = scrape(load_gateway.url)
    records, s = result.records, result.summary

    # the run: several requests of every kind, all answered, stopped by the clock
    assert result.meta["stop_reason"] == "run_time"
    assert s["requests"] == len(records) >= 6
    assert s["failed"] == 0, s["errors"]
    assert {r.task for r in records} >= {"one_image", "two_images", "text"}
    assert any(r.stream for r in records) and any(not r.stream for r in records)
    assert [r.index for r in records] == list(range(len(records)))
    assert all(r.e2e_ms is not None and r.status == 200 for r in records)

    # no lost or double-counted requests: the gateway counted exactly what the client sent and got back
    delta = server_delta(before, after)
    chat = sum(r.endpoint == "chat" for r in records)
    multipart = sum(r.endpoint == "generate" for r in records)
    assert delta["chat_requests_by_status"] == {"200": chat}
    assert delta["generate_requests_by_status"] == ({"200": multipart} if multipart else {})
    assert delta["generations"] == len(records)
    assert delta["completion_tokens"] == sum(r.completion_tokens for r in records) == s["total_output_tokens"]
    assert delta["prompt_tokens"] == sum(r.prompt_tokens for r in records) == s["total_input_tokens"]
    assert delta["tau_observations"] == sum(r.tau is not None for r in records)
    assert result.summary["consistency"]["counts_match"]
    assert result.server["completion_tokens"] == delta["completion_tokens"]
    # the planner's per-round counts: the server's series add up to the responses' glance objects
    assert delta["rounds"] == sum(r.rounds for r in records)
    assert delta["rounds_without_drafting"] == sum(r.rounds_without_drafting for r in records)
    assert delta["mean_rows_per_round"] == pytest.approx(s["speculative"]["mean_rows_per_round"])
    assert delta["planner_committed_tokens"] == sum(r.completion_tokens - 1 for r in records if r.planner)
    assert delta["planner_predicted_tokens"] == pytest.approx(s["speculative"]["predicted_tokens_per_round"]
                                                             * sum(r.rounds for r in records if r.planner))
    assert s["speculative"]["planners"] == {"auto": len(records)}
    assert 0 <= s["speculative"]["rounds_without_drafting_fraction"] <= 1

    # reported percentiles are those of the per-request records
    def check(dist, values):
        assert dist["count"] == len(values)
        for key, q in (("median", 50), ("p90", 90), ("p99", 99)):
            assert dist[key] == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
        assert dist["mean"] == pytest.approx(float(np.mean(values)), rel=1e-12)

    streams = [r for r in records if r.stream]
    check(s["e2e_ms"], [r.e2e_ms for r in records])
    check(s["ttft_ms"], [r.ttft_ms for r in streams])
    check(s["itl_ms"], [x for r in streams for x in r.itl_ms])
    check(s["tpot_ms"], [(r.e2e_ms - r.ttft_ms) / (r.completion_tokens - 1) for r in streams
                         if r.completion_tokens >= 2])
    check(s["speculative"]["tau"], [r.tau for r in records if r.tau is not None])
    check(s["speculative"]["estimated_speedup"], [r.estimated_speedup for r in records
                                                   if r.estimated_speedup is not None])
    # the client's timings are consistent with each other and with the gateway's glance objects
    for r in streams:
        assert 0 < r.ttft_ms <= r.e2e_ms
        assert r.chunks == len(r.itl_ms) + 1
    for r in records:
        if r.tau is not None:
            assert r.tau == pytest.approx((r.completion_tokens - 1) / r.rounds)
    assert s["request_throughput"] == pytest.approx(len(records) / s["duration_s"])
    assert s["goodput"]["good_requests"] == len(records)  # generous SLOs

    # the JSON / CSV outputs carry the same records
    from glance_loadtest import report

    data = json.loads(report.write_json(result, tmp_path / "run.json").read_text())
    assert data["summary"]["e2e_ms"]["p99"] == pytest.approx(
        float(np.percentile([r["e2e_ms"] for r in data["records"]], 99)))
    with report.write_csv(records, tmp_path / "req.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records) and float(rows[0]["e2e_ms"]) == pytest.approx(records[0].e2e_ms)
    assert "GLANCE load test result" in report.table(result)


def test_open_loop_request_cap_is_exact(load_gateway, api_key):
    before = scrape(load_gateway.url)
    result = run_load(LoadConfig(url=load_gateway.url, api_key=api_key, request_rate=50.0, max_concurrency=2,
                                 num_requests=7, run_time=60, max_tokens=4, stream_fraction=1.0,
                                 image_size=(112, 112), progress=False))
    delta = server_delta(before, scrape(load_gateway.url))
    assert result.meta["stop_reason"] == "num_requests"
    assert len(result.records) == 7 and result.summary["completed"] == 7
    assert delta["chat_requests_by_status"] == {"200": 7}
    # never more than max_concurrency requests in flight
    events = sorted([(r.start_s, 1) for r in result.records] + [(r.end_s, -1) for r in result.records],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak <= 2


def test_wrong_api_key_is_an_error_type_and_counted(load_gateway):
    before = scrape(load_gateway.url)
    result = run_load(LoadConfig(url=load_gateway.url, api_key="wrong", model="glance-test", users=1,
                                 num_requests=3, run_time=30,
                                 max_tokens=4, image_size=(112, 112), progress=False))
    assert result.summary["errors"] == {"http_401:invalid_api_key": 3}
    delta = server_delta(before, scrape(load_gateway.url))
    assert delta["requests_by_route"]["other"] == {"401": 3}  # refused before routing
    assert "/v1/chat/completions" not in delta["requests_by_route"]
    assert result.summary["consistency"]["counts_match"]


def test_cli_writes_reports(load_gateway, api_key, tmp_path):
    env = {**os.environ, "LOADTEST_KEY": api_key}
    cmd = [sys.executable, "-m", "glance_loadtest", "--url", load_gateway.url, "--api-key-env", "LOADTEST_KEY",
           "-u", "2", "-t", "2", "--max-tokens", "6", "--image-size", "112x112", "--goodput", "ttft:30000",
           "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"), "--plot", str(tmp_path / "plots")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Request throughput (req/s):" in proc.stdout and "Counts match:" in proc.stdout
    assert "yes" in proc.stdout.split("Counts match:")[1].splitlines()[0]
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["completed"] == len(data["records"]) > 0
    for name in ("latency_cdf.png", "throughput.png", "tau_hist.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
