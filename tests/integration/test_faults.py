"""Infrastructure faults are cache misses within the timeout; nothing is raised."""

from __future__ import annotations

import os
import signal
import time

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, stats, wait_for

TIMEOUT = 1.0
CT = 4


def _prompt(n: int, first: int = 0) -> tuple[list[int], list[bytes]]:
    return list(range(first, first + n * CT)), [os.urandom(256 * 1024) for _ in range(n)]


def _timed(fn, *args):  # type: ignore[no-untyped-def]
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
    with PolarKVClient(node.manager_url, chunk_tokens=CT, timeout=TIMEOUT) as c:
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
        assert c.load_kv(tokens)[0] == 4 * CT  # back: hits again
        node.kill()
        (n_tokens, _), took = _timed(c.load_kv, tokens)
        assert n_tokens == 0 and took < TIMEOUT
        assert c.put("1" * 32, b"x") is False
        assert c.lookup_kv(tokens) == 0
        assert c.stats.faults >= 5 and c.stats.timeouts >= 0


def test_client_against_nothing(cluster: Cluster) -> None:
    with PolarKVClient("http://127.0.0.1:9", chunk_tokens=CT, timeout=TIMEOUT) as c:
        tokens, chunks = _prompt(2)
        assert c.store_kv(tokens, chunks) == 0
        assert c.load_kv(tokens) == (0, [])
        assert c.get("2" * 32) is None
