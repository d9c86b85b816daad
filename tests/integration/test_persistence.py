"""Metadata write-behind and recovery: a restarted manager serves again what the
surviving slab holds in memory and what its disk holds, from SQLite or PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
from pathlib import Path

from polarkv_lib.client import PolarKVClient
from tests.conftest import PG, Cluster, PolarKV, free_port, http, pg, stats, wait_for
from tests.conftest import prompt as shared_prompt

MiB = 1 << 20
CT = 4


def prompt(conv: int, chunks: int) -> list[int]:
    return shared_prompt(conv, chunks, CT)


def _flushed(metadata_url: str, sql: str) -> tuple[int, ...]:
    """One row of `sql` over what the write-behind has flushed to the metadata store
    (zeros while the table is not there yet)."""
    if metadata_url.startswith("postgresql"):
        return tuple(int(str(v or 0)) for v in pg(sql)[0])  # count and sum: int, Decimal
    path = metadata_url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)) as conn:
        try:
            return tuple(int(v or 0) for v in conn.execute(sql).fetchone())
        except sqlite3.OperationalError:  # not created yet, or busy for a moment
            return (0,)


def _rows(metadata_url: str) -> int:
    """Entries the write-behind has flushed to the metadata store."""
    return _flushed(metadata_url, "SELECT count(*) FROM polarkv_entries")[0]


def _tiers(metadata_url: str) -> tuple[int, ...]:
    """Flushed entries with a copy in memory, and with one on disk. A row's tiers change
    without its count changing (an offloaded entry's memory copy dropped later), so
    counting rows does not say the last changes are flushed."""
    return _flushed(
        metadata_url,
        "SELECT sum(CASE WHEN in_memory THEN 1 ELSE 0 END),"
        " sum(CASE WHEN on_disk THEN 1 ELSE 0 END) FROM polarkv_entries",
    )


def _manager(cluster: Cluster, port: int, url: str, name: str) -> PolarKV:
    return cluster.start(
        ["manager"],
        {
            "manager.listen": f"127.0.0.1:{port}",
            "manager.metadata_url": url,
            "manager.metadata_flush": "100ms",
            "manager.heartbeat_ttl": "1s",
        },
        name=name,
    )


def test_manager_restart_restores_memory_and_disk_entries(
    cluster: Cluster, metadata_url: str
) -> None:
    port = free_port()
    manager = _manager(cluster, port, metadata_url, "m1")
    url = manager.manager_url
    cluster.slab_disk(url, slab__memory="16MiB", slab__node_id="vm-1")
    # tcp, where every read is checked against a grant: the restarted manager has a new
    # grant key (none is configured), which the slab must take when it registers again.
    with PolarKVClient(url, chunk_tokens=CT, timeout=5, breaker_interval=0.1, transport="tcp") as c:
        data = {conv: [os.urandom(MiB) for _ in range(6)] for conv in range(5)}
        for conv, chunks in data.items():  # 30 MiB through 16 MiB: the oldest go to disk
            assert c.store_kv(prompt(conv, 6), chunks) == 6
        wait_for(lambda: stats(url)["bytes_offloading"] == 0)  # tiering has settled
        before = stats(url)
        assert before["keys_disk"] > 0 and before["keys_memory"] > 0
        flushed = (before["keys_memory"], before["keys_disk"])
        wait_for(lambda: _tiers(metadata_url) == flushed)  # the last tier changes included
        manager.kill()  # kill -9: no goodbye, no final flush
        assert c.load_kv(prompt(4, 6)) == (0, [])  # down: a miss, nothing raised
        again = _manager(cluster, port, metadata_url, "m2")
        assert "entries=" in again.log()
        wait_for(lambda: stats(url)["nodes"] == 1)  # the slab registers again, same incarnation
        # Its rows come back once it has confirmed its memory (hashed by the slab) and
        # adopted its files: a few moments after the registration, not with it.
        tiers = ("keys_memory", "keys_disk")
        wait_for(lambda: all(stats(url)[t] >= before[t] for t in tiers), timeout=30)
        after = stats(url)
        assert after["keys_memory"] == before["keys_memory"]
        assert after["keys_disk"] == before["keys_disk"]
        # memory entries are served straight from the surviving buffer, no reload
        n_tokens, views = c.load_kv(prompt(4, 6))
        assert n_tokens == 6 * CT and [bytes(v) for v in views] == data[4]
        assert stats(url)["reloads"] == 0
        # disk entries come back from the slab's disk
        n_tokens, views = c.load_kv(prompt(0, 6))
        assert n_tokens == 6 * CT and [bytes(v) for v in views] == data[0]
        assert stats(url)["reloads"] > 0


def test_postgres_restart_under_the_manager(cluster: Cluster, clean_pg: None) -> None:
    manager = _manager(cluster, free_port(), PG, "m")
    url = manager.manager_url
    cluster.slab(url, slab__memory="32MiB")
    with PolarKVClient(url, chunk_tokens=CT, timeout=5) as c:
        assert c.store_kv(prompt(1, 4), [os.urandom(1000) for _ in range(4)]) == 4
        wait_for(lambda: pg("SELECT count(*) FROM polarkv_entries")[0][0] == 4)
        cluster_name = subprocess.run(
            ["bash", "-c", "ls /etc/postgresql"], capture_output=True, text=True, check=True
        ).stdout.split()[0]
        pg_ctl = ["pg_ctlcluster", "--skip-systemctl-redirect", cluster_name, "main"]
        subprocess.run([*pg_ctl, "stop", "-m", "fast"], check=True, timeout=60)
        try:
            # the manager serves on while its store is down
            assert c.store_kv(prompt(2, 4), [os.urandom(1000) for _ in range(4)]) == 4
            assert c.load_kv(prompt(1, 4))[0] == 4 * CT
            wait_for(lambda: http("GET", url + "/healthz")[1]["metadata_store"] == "retrying")
        finally:
            subprocess.run([*pg_ctl, "start"], check=True, timeout=60)
        wait_for(lambda: http("GET", url + "/healthz")[1]["metadata_store"] == "ok", timeout=30)
        wait_for(lambda: pg("SELECT count(*) FROM polarkv_entries")[0][0] == 8, timeout=15)
    assert "write-behind caught up" in manager.log()


def test_a_restart_confirms_more_entries_than_one_request_may_carry(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A restarted manager asks the slab to confirm its extents in batches larger than
    manager.max_batch: the slab's answers are accepted, and every entry comes back."""
    metadata_url = f"sqlite:///{tmp_path}/meta.db"
    port = free_port()
    manager = _manager(cluster, port, metadata_url, "m1")
    url = manager.manager_url
    cluster.slab(url, slab__memory="64MiB", slab__node_id="vm-1")
    keys = [f"{i:032x}" for i in range(6000)]  # more than max_batch (4096) in memory
    values = [i.to_bytes(4, "little") * 1024 for i in range(len(keys))]
    with PolarKVClient(url, timeout=30, breaker_interval=0.1) as c:
        assert c.put_many(keys, values) == len(keys)
        wait_for(lambda: _rows(metadata_url) >= len(keys), timeout=30)
        manager.kill()
        _manager(cluster, port, metadata_url, "m2")
        wait_for(lambda: stats(url)["keys_memory"] == len(keys), timeout=60)
        got = c.get_many(keys)
        assert len(got) == len(keys) and all(
            bytes(g) == v for g, v in zip(got, values, strict=True)
        )
