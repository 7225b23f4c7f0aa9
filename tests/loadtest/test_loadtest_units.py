"""The harness without a model: bounds, target pinning, SSE parsing and error types, statistics, users, CLI."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import numpy as np
import pytest

from glance_loadtest import ChatUser, LoadConfig, RequestRecord, run_load, summarize, task
from glance_loadtest.client import GatewayClient, TargetError, check_target
from glance_loadtest.dataset import Item, RandomDataset, parse_size
from glance_loadtest.stats import meets_slos, parse_prometheus, parse_slos, server_delta


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ bounds
def test_request_cap_and_connect_errors_on_a_dead_port():
    url = f"http://127.0.0.1:{closed_port()}"
    result = run_load(LoadConfig(url=url, users=3, num_requests=20, run_time=30, image_size=(32, 32),
                                 progress=False))
    assert len(result.records) == 20
    assert result.summary["errors"] == {"connect_error": 20}
    assert result.meta["stop_reason"] == "num_requests"
    assert result.server is None  # no /metrics to scrape


def test_run_time_bounds_the_run():
    url = f"http://127.0.0.1:{closed_port()}"
    t0 = time.perf_counter()
    result = run_load(LoadConfig(url=url, users=2, run_time=0.6, wait_time=(0.05, 0.05), image_size=(32, 32),
                                 progress=False))
    assert time.perf_counter() - t0 < 5
    assert result.meta["stop_reason"] == "run_time"
    assert 2 <= len(result.records) <= 2 * (0.6 / 0.05 + 1)
    assert max(r.start_s for r in result.records) < 0.6


@pytest.mark.parametrize("bad", [dict(run_time=0), dict(run_time=10 ** 6), dict(users=0), dict(num_requests=0),
                                 dict(request_rate=0), dict(max_concurrency=0), dict(stream_fraction=2),
                                 dict(goodput=["latency:5"]), dict(goodput=["ttft:-1"]), dict(wait_time=(2, 1)),
                                 dict(prompt_words=(5, 2)), dict(prompt_words=(0, 3)), dict(temperature=9.0),
                                 dict(temperature=float("nan"))])
def test_config_rejects_unbounded_or_bad_settings(bad):
    with pytest.raises(ValueError):
        LoadConfig(**bad).validate()


# ------------------------------------------------------------------------------------------------ target
@pytest.mark.parametrize("url", ["ftp://127.0.0.1", "http://127.0.0.1:8000/v1", "http://user:pw@127.0.0.1",
                                 "127.0.0.1:8000", "http://127.0.0.1/?x=1"])
def test_target_must_be_a_base_url(url):
    with pytest.raises(TargetError):
        check_target(url)


def test_client_talks_to_its_base_url_only():
    assert check_target("http://127.0.0.1:8000/") == ("http://127.0.0.1:8000", True)
    assert check_target("http://[::1]:9")[1] and check_target("http://localhost:9")[1]
    assert check_target("https://gw.example.com")[1] is False

    async def go():
        client = GatewayClient("http://127.0.0.1:9")
        try:
            with pytest.raises(TargetError):
                await client.http.get("http://169.254.169.254/latest/meta-data")
            with pytest.raises(TargetError):
                await client.http.get("http://127.0.0.1:10/")  # another port of the same host
            assert client.http.follow_redirects is False
        finally:
            await client.aclose()

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ parsing
def sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


def delta(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


GLANCE = {"mode": "glance", "tau": 2.5, "tau_minus_1": 1.5, "rounds": 2, "drafted_tokens": 14,
          "accepted_tokens": 3, "acceptance_rate": 3 / 14, "queue_ms": 1.0, "estimated_speedup": 1.8,
          "measured": {"decode_speedup": 1.7, "lossless_match": True}}

RESPONSES = {
    "ok": (200, sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, delta("a"), delta("bc"),
                    delta("def"), {"choices": [{"delta": {}, "finish_reason": "length"}]},
                    {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 6}, "glance": GLANCE},
                    b"[DONE]")),
    "queue_full": (429, b'{"error": {"message": "full", "type": "rate_limit", "code": "queue_full"}}'),
    "stream_error": (200, sse(delta("a"), {"error": {"message": "boom", "code": "engine_error"}}, b"[DONE]")),
    "truncated": (200, sse(delta("a"), delta("b"))),
    "not_json": (502, b"<html>bad gateway</html>"),
}


def test_sse_timing_and_error_types():
    async def go() -> dict[str, RequestRecord]:
        def handler(request: httpx.Request) -> httpx.Response:
            status, body = RESPONSES[json.loads(request.content)["messages"][0]["content"]]
            return httpx.Response(status, content=body)

        client = GatewayClient("http://127.0.0.1:9", model="m")
        await client.http.aclose()
        client.http = httpx.AsyncClient(base_url=client.base_url, transport=httpx.MockTransport(handler))
        out = {name: await client.chat(Item(name), task="t", stream=True, max_tokens=8) for name in RESPONSES}
        out["plain"] = await client.chat(Item("ok"), task="t", stream=False, max_tokens=8)  # SSE is not JSON
        await client.aclose()
        return out

    recs = asyncio.run(go())
    ok = recs["ok"]
    assert ok.ok and ok.error is None and ok.finish_reason == "length"
    assert ok.chunks == 3 and len(ok.itl_ms) == 2 and 0 < ok.ttft_ms <= ok.e2e_ms
    assert (ok.prompt_tokens, ok.completion_tokens, ok.tau, ok.rounds) == (40, 6, 2.5, 2)
    assert (ok.estimated_speedup, ok.measured_speedup, ok.lossless_match) == (1.8, 1.7, True)
    assert ok.tpot_ms == pytest.approx((ok.e2e_ms - ok.ttft_ms) / 5)
    assert recs["queue_full"].error == "http_429:queue_full" and recs["queue_full"].status == 429
    assert recs["stream_error"].error == "stream_error:engine_error"
    assert recs["truncated"].error == "stream_incomplete"
    assert recs["not_json"].error == "http_502:non_json"
    assert not recs["plain"].ok and recs["plain"].error.startswith("client_")
    s = summarize(list(recs.values()))
    assert s["completed"] == 1 and s["failed"] == 5 and sum(s["errors"].values()) == 5


# ------------------------------------------------------------------------------------------------ statistics
def rec(i: int, ttft: float | None, e2e: float, tokens: int, itl=(), ok=True) -> RequestRecord:
    return RequestRecord(index=i, task="t", endpoint="chat", stream=ttft is not None, n_images=1, start_s=i * 0.1,
                         end_s=i * 0.1 + e2e / 1000, ok=ok, status=200 if ok else 503, ttft_ms=ttft, e2e_ms=e2e,
                         itl_ms=list(itl), completion_tokens=tokens, prompt_tokens=10,
                         error=None if ok else "http_503:engine_error")


def test_summary_percentiles_goodput_and_errors():
    rng = np.random.RandomState(0)
    recs = [rec(i, float(rng.uniform(10, 100)), float(rng.uniform(200, 900)), 9, itl=rng.uniform(5, 30, 8))
            for i in range(40)]
    recs += [rec(40, None, 300.0, 9), rec(41, 5.0, 50.0, 9, ok=False)]
    slos = parse_slos(["ttft:60 e2el:800"])
    assert slos == {"ttft": 60.0, "e2el": 800.0}
    s = summarize(recs, slos)
    ok = [r for r in recs if r.ok]
    assert s["e2e_ms"]["p99"] == pytest.approx(np.percentile([r.e2e_ms for r in ok], 99))
    assert s["ttft_ms"]["count"] == 40  # streaming only
    assert s["itl_ms"]["count"] == 40 * 8
    good = [r for r in ok if (r.ttft_ms if r.stream else r.e2e_ms) <= 60 and r.e2e_ms <= 800]
    assert s["goodput"]["good_requests"] == len(good) == sum(meets_slos(r, slos) for r in recs)
    assert s["errors"] == {"http_503:engine_error": 1}
    assert s["total_output_tokens"] == 41 * 9


def test_prometheus_delta():
    before = parse_prometheus('glance_requests_total{route="/v1/chat/completions",status="200"} 5.0\n'
                              "glance_tau_count 5\nglance_tau_sum 10\n")
    after = parse_prometheus('# HELP x\nglance_requests_total{route="/v1/chat/completions",status="200"} 9.0\n'
                             'glance_requests_total{route="other",status="401"} 2.0\n'
                             "glance_tau_count 9\nglance_tau_sum 22\nglance_in_flight 0\n")
    d = server_delta(before, after)
    assert d["load_requests_by_status"] == {"200": 4, "401": 2}
    assert d["tau_mean"] == pytest.approx(3.0)
    assert d["rounds"] == 0 and d["mean_rows_per_round"] is None  # a gateway without the planner series
    after = parse_prometheus('glance_rows_per_round_count{mode="glance"} 10\n'
                             'glance_rows_per_round_sum{mode="glance"} 64\n'
                             'glance_rows_per_round_count{mode="ar"} 6\nglance_rows_per_round_sum{mode="ar"} 6\n'
                             'glance_rounds_total{mode="glance"} 10\nglance_rounds_total{mode="ar"} 6\n'
                             'glance_rounds_without_drafting_total{mode="glance"} 4\n'
                             'glance_rounds_without_drafting_total{mode="ar"} 6\n')
    d = server_delta({}, after)
    assert d["rounds"] == 16 and d["rounds_without_drafting"] == 10
    assert d["mean_rows_per_round"] == pytest.approx(70 / 16)


def test_planner_fields_pool_over_rounds():
    def rec(i, rounds, rows, skipped, predicted, tau, planner="auto"):
        return RequestRecord(index=i, task="t", endpoint="chat", stream=False, n_images=0, start_s=0.0, end_s=1.0,
                             ok=True, status=200, e2e_ms=10.0, completion_tokens=1 + round(tau * rounds), rounds=rounds,
                             tau=tau, planner=planner, mean_rows_per_round=rows, rounds_without_drafting=skipped,
                             predicted_tokens_per_round=predicted)

    s = summarize([rec(0, 10, 4.0, 2, 3.0, 2.5), rec(1, 30, 1.0, 30, 1.0, 1.0),
                   rec(2, 5, 1.0, 5, None, 1.0, planner=None)])["speculative"]
    assert s["planners"] == {"auto": 2}
    assert s["mean_rows_per_round"] == pytest.approx((40 + 30 + 5) / 45)
    assert s["rounds_without_drafting_fraction"] == pytest.approx(37 / 45)
    assert s["predicted_tokens_per_round"] == pytest.approx((30 + 30) / 40)
    assert s["committed_tokens_per_planned_round"] == pytest.approx((25 + 30) / 40)


# ------------------------------------------------------------------------------------------------ users, data, CLI
class OnlyText(ChatUser):
    @task(2)
    async def shout(self):
        await self.chat(0, task_name="shout")


def test_user_tasks_and_weights():
    table = OnlyText.task_table({"chat_one_image": 0, "chat_two_images": 0, "chat_text": 0})
    assert table == {"shout": 2.0}
    with pytest.raises(ValueError, match="unknown task"):
        ChatUser.task_table({"nope": 1})
    with pytest.raises(ValueError, match="no task"):
        ChatUser.task_table({"chat_one_image": 0, "chat_two_images": 0, "chat_text": 0})


def test_datasets_and_sizes():
    data = RandomDataset((64, 48), pool=4, seed=1)
    two = data.sample(2)
    assert len(two.pictures) == 2 and two.messages()[0]["content"][0]["image_url"]["url"].startswith("data:image/png")
    assert (data.single[0].pictures[0].width, data.single[0].pictures[0].height) == (64, 48)
    assert isinstance(data.sample(0).messages()[0]["content"], str)
    assert parse_size("448") == (448, 448) and parse_size("640x480") == (640, 480)
    with pytest.raises(ValueError):
        parse_size("100000x2")


def test_registered_as_glance_loadtest():
    from glance_loadtest.cli import cmd_loadtest
    from glance_sgl.cli import build_parser

    args = build_parser().parse_args(["loadtest", "-u", "2", "-t", "5", "--goodput", "ttft:100", "tpot:20",
                                      "--request-rate", "inf", "--task-weights", "chat_text=2,chat_one_image=0"])
    assert args.func is cmd_loadtest and args.request_rate == float("inf")
    assert args.task_weights == {"chat_text": 2.0, "chat_one_image": 0.0}


@pytest.mark.parametrize("text,seconds", [("15s", 15), ("2m", 120), ("1h30m", 5400), ("1h2m3s", 3723), ("90", 90),
                                          ("2.5", 2.5), ("1.5m", 90)])
def test_run_time_takes_locusts_format(text, seconds):
    import argparse

    from glance_loadtest.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["-t", text]).run_time == seconds
    assert parser.parse_args(["--run-time", text]).run_time == seconds


@pytest.mark.parametrize("text", ["", "5x", "1m30", "h", "m5", "inf", "1d"])
def test_run_time_refuses_other_formats(text, capsys):
    import argparse

    from glance_loadtest.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["-t", text])
    assert "duration" in capsys.readouterr().err
