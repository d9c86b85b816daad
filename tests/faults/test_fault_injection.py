"""Fault injection on real processes (kill -9, restarts) while clients keep working.

Faults must cost hit rate, never wrong bytes, never an exception in the caller, never a
stuck cluster. The other faults of the suite live with their features:
(c) writer killed mid-write: tests/integration/test_semantics.py
(d) PostgreSQL restarted under the manager: tests/integration/test_persistence.py
(e) the disk fills: tests/integration/test_disk_tier.py
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import xxhash

from polarkv_lib.client import PolarKVClient
from polarkv_lib.tools import loadgen
from tests.conftest import Cluster, free_port, stats, wait_for
from tests.conftest import prompt as shared_prompt

MiB = 1 << 20
CT = 4


def prompt(conv: int, chunks: int) -> list[int]:
    return shared_prompt(conv, chunks, CT)


TIMEOUT = 1.0  # the loader's client timeout
SLACK = 0.25  # a call's own scheduling on 2 shared cores, beyond its timeout


class Loader:
    """Loads prompts in a loop from a thread, checks every byte it gets and times every
    call against the client's timeout."""

    def __init__(self, url: str, prompts: dict[int, list[str]], chunks: int) -> None:
        self.url, self.prompts, self.chunks = url, prompts, chunks
        self.loads = self.hits = self.wrong = self.exceptions = self.late = 0
        self.slowest = 0.0
        self.hits_after: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with PolarKVClient(self.url, chunk_tokens=CT, timeout=TIMEOUT, breaker_interval=0.2) as c:
            while not self._stop.is_set():
                for conv, digests in self.prompts.items():
                    started = time.monotonic()
                    try:
                        n_tokens, views = c.load_kv(prompt(conv, self.chunks))
                    except Exception:
                        self.exceptions += 1
                        continue
                    took = time.monotonic() - started
                    self.slowest = max(self.slowest, took)
                    self.late += took > TIMEOUT + SLACK
                    self.loads += 1
                    self.hits += len(views)
                    self.hits_after.append((time.monotonic(), len(views)))
                    self.wrong += sum(
                        xxhash.xxh3_64_hexdigest(v) != d
                        for v, d in zip(views, digests, strict=False)
                    )
                    if n_tokens != len(views) * CT:
                        self.wrong += 1

    def __enter__(self) -> Loader:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def hits_since(self, t: float) -> int:
        return sum(n for when, n in self.hits_after if when >= t)


def _store(url: str, convs: range, chunks: int) -> dict[int, list[str]]:
    digests = {}
    with PolarKVClient(url, chunk_tokens=CT, timeout=5) as c:
        for conv in convs:
            blobs = [os.urandom(256 * 1024) for _ in range(chunks)]
            assert c.store_kv(prompt(conv, chunks), blobs) == chunks
            digests[conv] = [xxhash.xxh3_64_hexdigest(b) for b in blobs]
    return digests


def test_a_slab_killed_during_a_loading_loop(cluster: Cluster) -> None:
    manager = cluster.manager()
    url = manager.manager_url
    slabs = [cluster.slab(url, slab__memory="32MiB") for _ in range(2)]
    digests = _store(url, range(16), 4)  # spread over both slabs
    with Loader(url, digests, 4) as loader:
        wait_for(lambda: loader.loads > 20)
        slabs[0].kill()
        wait_for(lambda: stats(url)["nodes"] == 1)
        declared_dead = time.monotonic()
        # The prompts on the surviving slab keep hitting once the manager knows.
        wait_for(lambda: loader.hits_since(declared_dead) >= 8 * 4, timeout=10)
    print(
        f"loads {loader.loads}, exceptions {loader.exceptions}, wrong {loader.wrong}, "
        f"past timeout {loader.late}, slowest {loader.slowest:.3f}s"
    )
    assert loader.exceptions == 0 and loader.wrong == 0 and loader.late == 0
    assert loader.loads > 20
    # the cluster is not stuck: new prompts go to the surviving slab and load whole
    fresh = _store(url, range(100, 104), 4)
    with PolarKVClient(url, chunk_tokens=CT, timeout=2) as c:
        for conv, digests_ in fresh.items():
            n_tokens, views = c.load_kv(prompt(conv, 4))
            assert n_tokens == 4 * CT
            assert [xxhash.xxh3_64_hexdigest(v) for v in views] == digests_


def _stored_rows(db: Path) -> int:
    """Entries the manager's write-behind has flushed to its SQLite store."""
    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as conn:
        try:
            return int(conn.execute("SELECT count(*) FROM polarkv_entries").fetchone()[0])
        except sqlite3.OperationalError:  # not created yet, or locked for a moment
            return 0


def test_b_manager_killed_under_load_and_restarted(cluster: Cluster) -> None:
    port = free_port()
    settings = {
        "manager.listen": f"127.0.0.1:{port}",
        "manager.metadata_flush": "100ms",
        "manager.metadata_url": f"sqlite:///{cluster.workdir / 'meta.db'}",
    }
    manager = cluster.start(["manager"], settings, name="m1")
    url = manager.manager_url
    cluster.slab_disk(url, slab__memory="16MiB", slab__node_id="vm-1")
    digests = _store(url, range(20), 4)  # 20 MiB through 16 MiB: memory and disk both hold some
    wait_for(lambda: stats(url)["bytes_offloading"] == 0)
    wait_for(lambda: _stored_rows(cluster.workdir / "meta.db") >= 20 * 4)  # flushed
    with Loader(url, digests, 4) as loader:
        wait_for(lambda: loader.loads > 10)
        manager.kill()
        down = loader.loads
        wait_for(lambda: loader.loads >= down + 5)  # clients see misses, not errors
        cluster.start(["manager"], settings, name="m2")
        restarted = time.monotonic()
        wait_for(lambda: loader.hits_since(restarted) >= 20 * 4, timeout=20)
    print(
        f"loads {loader.loads}, exceptions {loader.exceptions}, wrong {loader.wrong}, "
        f"past timeout {loader.late}, slowest {loader.slowest:.3f}s"
    )
    assert loader.exceptions == 0 and loader.wrong == 0 and loader.late == 0
    s = stats(url)
    assert s["hits_memory"] > 0 and s["hits_disk"] > 0  # both tiers serve again


@pytest.mark.slow
def test_f_load_many_clients_mixed_working_set_twice_memory(cluster: Cluster) -> None:
    full = os.environ.get("POLARKV_FULL_LOAD") == "1"
    seconds = 60.0 if full else 8.0
    node = cluster.embedded(disk=True, slab__memory="32MiB")
    # 64 prompts x 4 chunks x 256 KiB = 64 MiB: twice the memory
    result = loadgen.run(
        node.manager_url,
        clients=8,
        seconds=seconds,
        prompts=64,
        chunks=4,
        size=256 * 1024,
        store_ratio=0.3,
    )
    print("load result:", result)
    assert result["exceptions"] == 0 and result["wrong_bytes"] == 0
    assert result["loads"] > 0 and result["stores"] > 0 and result["hit_ratio"] > 0.3
    s = stats(node.manager_url)
    assert s["offloads"] > 0 and s["checksum_failures"] == 0
    assert node.proc.poll() is None
