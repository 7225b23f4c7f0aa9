"""The embedded engine thread's torch intra-op threads: given (``--threads``), or timed at start-up in that
thread (OpenMP regions run slower from a thread other than the process's main one: see
``EmbeddedBackend._pick_threads``). No timing is asserted: only that the choice is one of the candidates, is
the count the thread then runs with, and is reported."""

from __future__ import annotations

import threading

import pytest
import torch

from glance_server.embedded import EmbeddedBackend
from tests.server.server_helpers import base_config


def _in_a_thread(fn):
    out = {}

    def run():
        fn()
        out["threads"] = torch.get_num_threads()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["threads"]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_the_engine_thread_keeps_the_faster_of_torchs_count_and_one(engine, restore_threads):
    backend = EmbeddedBackend(engine, base_config(calibrate=True))
    running = _in_a_thread(backend._pick_threads)
    assert backend.threads in {restore_threads, 1}
    assert running == backend.threads
    assert backend.describe()["threads"] == backend.threads


def test_the_engine_thread_takes_the_threads_it_is_given(engine, restore_threads):
    backend = EmbeddedBackend(engine, base_config(calibrate=True, threads=1))
    assert _in_a_thread(backend._pick_threads) == 1 and backend.threads == 1


def test_without_calibration_the_engine_thread_keeps_torchs_count(engine, restore_threads):
    backend = EmbeddedBackend(engine, base_config(calibrate=False))
    assert _in_a_thread(backend._pick_threads) == restore_threads == backend.threads
