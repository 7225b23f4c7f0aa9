"""glance_loadtest: a locust-style load harness for the GLANCE gateway, on httpx and asyncio.

Users with weighted tasks (chat with one image, two images, text only; streaming or not) are spawned at a
rate and loop (closed loop), or requests arrive as a Poisson process (open loop, ``request_rate``) under a
concurrency cap. Every run is bounded (a run time and a request cap) and talks only to the base URL it is
given. Reports the metrics of ``sglang.bench_serving`` / ``vllm bench serve`` (throughput, TTFT, ITL, TPOT,
E2E latency, goodput) plus the speculative ones carried by the gateway's ``glance`` object (tau, speedup).

Use it from the command line (``python -m glance_loadtest`` or ``glance loadtest``) or from Python::

    from glance_loadtest import LoadConfig, run_load
    result = run_load(LoadConfig(url="http://127.0.0.1:8000", users=4, run_time=10))
    print(result.summary["e2e_ms"]["p99"])
"""

from .runner import LoadConfig, RunResult, run_load, run_load_async
from .stats import RequestRecord, summarize
from .users import ChatUser, User, between, constant, task

__all__ = ["ChatUser", "LoadConfig", "RequestRecord", "RunResult", "User", "between", "constant", "run_load",
           "run_load_async", "summarize", "task"]
