"""Infrastructure faults are cache misses within the timeout; nothing is raised."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, free_port, stats, wait_for

TIMEOUT = 1.0
T = TypeVar("T")
CT = 4


def _prompt(n: int, first: int = 0) -> tuple[list[int], list[bytes]]:
    return list(range(first, first + n * CT)), [os.urandom(256 * 1024) for _ in range(n)]


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


def test_killed_slab_means_misses(cluster: Cluster) -> None:
    manager = cluster.manager()
    slab = cluster.slab(manager.manager_url)
    tokens, chunks = _prompt(8)
    with PolarKVClient(manager.manager_url, chunk_tokens=CT, timeout=TIMEOUT, transport="tcp") as c:
        assert c.store_kv(tokens, chunks) == 8
        assert c.load_kv(tokens)[0] == 8 * CT  # warm pooled connections to the slab
        slab.kill()
        # before the manager notices: the manager still hands out grants, the slab is gone
        (n_tokens, views), took = _timed(c.load_kv, tokens)
        assert (n_tokens, views) == (0, []) and took < TIMEOUT + 0.5
        stored, took = _timed(c.store_kv, *_prompt(3, first=1000))
        assert stored == 0 and took < TIMEOUT + 0.5
        # after the heartbeat TTL the node is dead and its entries are gone
        wait_for(lambda: stats(manager.manager_url)["nodes"] == 0, timeout=5)
        assert stats(manager.manager_url)["keys_memory"] == 0
        assert c.load_kv(tokens) == (0, [])
        assert c.store_kv(tokens, chunks) == 0  # no node: no_space, a miss
        assert c.stats.faults == 0 and c.stats.transfer_failures > 0


def test_killed_or_hung_manager_means_misses(cluster: Cluster) -> None:
    node = cluster.embedded()
    tokens, chunks = _prompt(4)
    with PolarKVClient(
        node.manager_url, chunk_tokens=CT, timeout=TIMEOUT, breaker_interval=0.5
    ) as c:
        assert c.store_kv(tokens, chunks) == 4
        os.kill(node.proc.pid, signal.SIGSTOP)  # hung: accepts nothing, answers nothing
        try:
            (n_tokens, _), took = _timed(c.load_kv, tokens)
            assert n_tokens == 0 and took < TIMEOUT + 0.5
            stored, took = _timed(c.store_kv, tokens, chunks)
            assert stored == 0 and took < TIMEOUT + 0.5
            assert c.get("0" * 32) is None
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        # past the breaker's interval, the next call probes the manager: hits again
        wait_for(lambda: c.load_kv(tokens)[0] == 4 * CT, timeout=5)
        node.kill()
        (n_tokens, _), took = _timed(c.load_kv, tokens)
        assert n_tokens == 0 and took < TIMEOUT
        assert c.put("1" * 32, b"x") is False
        assert c.lookup_kv(tokens) == 0
        # the hung manager cost one timeout; the breaker turned the rest into fast misses
        assert c.stats.faults >= 5 and c.stats.timeouts >= 1


def test_client_against_nothing(cluster: Cluster) -> None:
    with PolarKVClient("http://127.0.0.1:9", chunk_tokens=CT, timeout=TIMEOUT) as c:
        tokens, chunks = _prompt(2)
        assert c.store_kv(tokens, chunks) == 0
        assert c.load_kv(tokens) == (0, [])
        assert c.get("2" * 32) is None


def test_breaker_makes_a_dead_manager_cost_one_timeout(cluster: Cluster) -> None:
    node = cluster.embedded()
    tokens, chunks = _prompt(2)
    with PolarKVClient(
        node.manager_url, chunk_tokens=CT, timeout=TIMEOUT, breaker_interval=3.0
    ) as c:
        assert c.store_kv(tokens, chunks) == 2
        os.kill(node.proc.pid, signal.SIGSTOP)
        try:
            _, first = _timed(c.load_kv, tokens)
            tripped = time.monotonic()
            assert first >= TIMEOUT * 0.4  # the first call pays a (server-wait bounded) timeout
            for _ in range(20):  # the rest fail fast while the breaker is open
                result, took = _timed(c.load_kv, tokens)
                assert (
                    result == (0, []) and took < 0.25
                )  # no network wait: far under the 1 s timeout
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        # once the interval has passed, the breaker lets a probe through: hits again
        wait_for(lambda: c.load_kv(tokens)[0] == 2 * CT, timeout=10)
        assert time.monotonic() - tripped >= 3.0 - 0.1


def test_pooled_connection_to_a_restarted_manager(cluster: Cluster, tmp_path: Path) -> None:
    port = free_port()
    settings = {
        "manager.listen": f"127.0.0.1:{port}",
        "slab.listen": "127.0.0.1:0",
        "manager.metadata_url": f"sqlite:///{tmp_path / 'meta.db'}",
    }
    node = cluster.start(["manager", "slab"], settings, name="first")
    tokens, chunks = _prompt(2)
    with PolarKVClient(node.manager_url, chunk_tokens=CT, timeout=TIMEOUT) as c:
        assert c.store_kv(tokens, chunks) == 2  # leaves a pooled keep-alive connection
        node.stop()
        cluster.start(["manager", "slab"], settings, name="second")
        # the first request after the restart works: no stale-connection miss
        assert c.store_kv(*_prompt(2, first=500)) == 2
        assert c.stats.faults == 0
