"""Where the vLLM connector's threads run (polarkv_lib/integrations/cpu_affinity.py):
off the cores vLLM's OpenMP threads are bound to, on the CPUs this process may use."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from polarkv_lib.integrations import cpu_affinity
from polarkv_lib.integrations.cpu_affinity import io_cpus, parse_cpus, pin

ALL = frozenset(os.sched_getaffinity(0))


def test_cpu_lists_parse_as_vllm_writes_them() -> None:
    assert parse_cpus("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpus("0-1|2-3") == {0, 1, 2, 3}  # one range per rank
    for bad in ("", "a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_auto_takes_the_cpus_no_openmp_thread_is_bound_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_affinity, "_available", lambda: frozenset({0, 1, 2, 3}))
    monkeypatch.setenv(cpu_affinity.BIND_ENV, "0-1|2")
    assert io_cpus("auto") == frozenset({3})
    monkeypatch.setenv(cpu_affinity.BIND_ENV, "0-3")
    assert io_cpus("auto") is None  # every core bound: leave the threads be
    # No list in the environment (vLLM's own "auto"): the calling thread's mask is bound.
    monkeypatch.setenv(cpu_affinity.BIND_ENV, "auto")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert io_cpus("auto") == frozenset({1, 2, 3})
    # Nothing bound (a GPU worker): the mask is everything, nothing moves.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert io_cpus("auto") is None
    assert io_cpus("none") is None
    assert io_cpus("2-3") == frozenset({2, 3})


def test_pin_moves_one_thread_and_a_refusal_is_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started, done = threading.Event(), threading.Event()

    def idle() -> None:
        started.set()
        done.wait(10)

    worker = threading.Thread(target=idle)
    worker.start()
    try:
        started.wait(5)
        assert worker.native_id is not None
        tid = worker.native_id
        target = frozenset({min(ALL)})
        pin(tid, target)
        assert os.sched_getaffinity(tid) == target
        assert os.sched_getaffinity(0) == ALL  # only that thread moved
        with caplog.at_level(logging.WARNING, logger="polarkv.integrations.vllm"):
            pin(tid, frozenset({max(ALL) + 4096}))  # no such CPU
        assert "could not move a thread" in caplog.text
        assert os.sched_getaffinity(tid) == target
        pin(tid, None)  # nothing to do
        assert os.sched_getaffinity(tid) == target
    finally:
        done.set()
        worker.join(5)
