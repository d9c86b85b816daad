"""A manager restart cannot cross keys: a grant does not outlive the manager incarnation
that issued it, and a restored memory entry comes back only where the slab confirms that
its extent still holds its bytes (the payload hashes to the entry's checksum). Real processes (a manager killed with -9 inside its
write-behind window, a slab that survives it), raw frames and raw HTTP.

Both failed before: an evicted entry came back from its stale row and a fresh READ grant
for it read the bytes that had since been written there; with a configured grant key, a
WRITE grant of the dead manager still wrote after the restart."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from polarkv_lib.client import PolarKVClient
from polarkv_lib.errors import AccessDenied
from polarkv_lib.transport.tcp import TcpTransport
from tests.conftest import Cluster, PolarKV, free_port, http, prompt, stats, wait_for
from tests.integration.raw import post, region

MiB = 1 << 20
CT = 4


def _manager(cluster: Cluster, port: int, db: Path, name: str, flush: str) -> PolarKV:
    return cluster.start(
        ["manager"],
        {
            "manager.listen": f"127.0.0.1:{port}",
            "manager.metadata_url": f"sqlite:///{db}",
            "manager.metadata_flush": flush,
            "manager.heartbeat_ttl": "1s",
            "security.grant_key": "k" * 32,
        },
        name=name,
    )


def _rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM polarkv_entries").fetchone()[0])


def test_an_evicted_entry_does_not_come_back_over_its_next_owner(
    cluster: Cluster, tmp_path: Path
) -> None:
    port, db = free_port(), tmp_path / "meta.db"
    manager = _manager(cluster, port, db, "m1", flush="3s")
    url = manager.manager_url
    cluster.slab(url, slab__memory="8MiB", slab__node_id="vm-1", security__grant_key="k" * 32)
    old = [os.urandom(MiB) for _ in range(8)]
    with PolarKVClient(url, chunk_tokens=CT, timeout=5, transport="tcp") as c:
        assert c.store_kv(prompt(1, 8, CT), old) == 8
        wait_for(lambda: _rows(db) == 8, timeout=10)  # persisted: in memory, at its offsets
        # Inside the next write-behind window: another prompt evicts all of the first and
        # is written over its extents; then the manager dies before it flushes that.
        new = [os.urandom(MiB) for _ in range(8)]
        assert c.store_kv(prompt(2, 8, CT), new) == 8
        manager.kill()
        _manager(cluster, port, db, "m2", flush="100ms")
        wait_for(lambda: stats(url)["nodes"] == 1)  # the slab is back, same buffer
        wait_for(lambda: http("GET", url + "/healthz")[1]["status"] == "ok")
        reply = post(url, "/v1/lookup", {"keys": c.keys(prompt(1, 8, CT)), "wait": 2})
        for entry in reply["entries"]:  # whatever is served of the old prompt is its own
            got = bytearray(entry["size"])
            transport = TcpTransport()
            try:
                transport.read_into(region(reply, entry), memoryview(got), time.monotonic() + 5)
            finally:
                transport.close()
            assert bytes(got) in old
        assert reply["hits"] == 0  # its rows named space that holds another entry's bytes
        n, views = c.load_kv(prompt(2, 8, CT))  # the prompt that was flushed as evicting
        assert n == 0 or [bytes(v) for v in views] == new[: n // CT]


def test_a_write_grant_of_a_dead_manager_writes_nothing(cluster: Cluster, tmp_path: Path) -> None:
    port, db = free_port(), tmp_path / "meta.db"
    manager = _manager(cluster, port, db, "m1", flush="100ms")
    url = manager.manager_url
    cluster.slab(url, slab__memory="16MiB", slab__node_id="vm-1", security__grant_key="k" * 32)
    stored = os.urandom(MiB)
    with PolarKVClient(url, chunk_tokens=CT, timeout=5, transport="tcp") as c:
        assert c.store_kv(prompt(1, 1, CT), [stored]) == 1
    # a WRITE grant handed out and kept, never used while its manager lived
    reply: dict[str, Any] = post(url, "/v1/allocate", {"items": [{"key": "cd" * 16, "size": MiB}]})
    kept = region(reply, reply["results"][0])
    wait_for(lambda: _rows(db) == 1)
    manager.kill()
    _manager(cluster, port, db, "m2", flush="100ms")
    wait_for(lambda: stats(url)["nodes"] == 1 and stats(url)["keys_memory"] == 1, timeout=20)
    transport = TcpTransport()
    try:
        with pytest.raises(AccessDenied):
            transport.write_from(kept, memoryview(b"\xbb" * MiB), time.monotonic() + 5)
    finally:
        transport.close()
    with PolarKVClient(url, chunk_tokens=CT, timeout=5, transport="tcp") as c:
        n, views = c.load_kv(prompt(1, 1, CT))
        assert n == CT and bytes(views[0]) == stored
