"""Memory is a staging area, never the limit: loads and stores of prefixes larger than a
node's memory stream through it, alone and several at once, across a restart, and each
count a call returns is what a later call can get back.

Every case ran against real processes (an embedded `polarkv` with its disk tier, or a
memory-only one) and failed before loads and stores streamed: a load stopped at what fit
in memory at once (28 of 256 chunks), concurrent stores stored nothing, and a store
without a disk tier counted chunks its own tail had evicted."""

from __future__ import annotations

import hashlib
import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from polarkv_lib.client import PolarKVClient
from polarkv_lib.keys import chunk_keys
from tests.conftest import Cluster, free_port, http, prompt, stats, wait_for

MiB = 1 << 20
CT = 4


def _chunks(seed: int, n: int, size: int) -> list[bytes]:
    """Distinct, reproducible chunk bytes (another process makes the same ones)."""
    out = []
    for i in range(n):
        block = hashlib.blake2b(f"{seed}/{i}".encode()).digest()
        out.append((block * (size // len(block) + 1))[:size])
    return out


def _digests(views: list[memoryview] | list[bytes]) -> list[str]:
    return [hashlib.sha256(v).hexdigest() for v in views]


def _settled(url: str) -> bool:
    s = stats(url)
    return s["bytes_offloading"] == 0 and s["read_leases"] == 0 and s["write_leases"] == 0


def test_a_prefix_of_eight_times_memory_stores_and_loads_whole(cluster: Cluster) -> None:
    node = cluster.embedded(disk=True, slab__memory="32MiB", disk__capacity="1GiB")
    url = node.manager_url
    chunks = _chunks(1, 64, 4 * MiB)  # 256 MiB through 32 MiB
    tokens = prompt(1, 64, CT)
    with PolarKVClient(url, chunk_tokens=CT, timeout=60) as client:
        started = time.monotonic()
        assert client.store_kv(tokens, chunks) == 64
        n, views = client.load_kv(tokens)
        assert time.monotonic() - started < 60
        assert n == 64 * CT
        assert _digests(views) == _digests(chunks)
    wait_for(lambda: _settled(url), timeout=30)
    s = stats(url)
    assert s["reloads"] >= 56 and s["tier_failures"] == 0 and s["checksum_failures"] == 0
    assert s["bytes_memory_allocated"] <= 32 * MiB


def test_a_prefix_as_large_as_memory_loads_whole_after_kill_and_restart(
    cluster: Cluster,
) -> None:
    settings = {
        "slab.memory": "32MiB",
        "disk.capacity": "1GiB",
        "manager.listen": f"127.0.0.1:{free_port()}",
        "slab.node_id": "vm-1",
        "manager.metadata_flush": "100ms",
    }
    node = cluster.start([], settings, name="node")
    url = node.manager_url
    chunks = _chunks(2, 32, 4 * MiB)
    tokens = prompt(2, 32, CT)
    with PolarKVClient(url, chunk_tokens=CT, timeout=30) as client:
        assert client.store_kv(tokens, chunks) == 32
        # another prompt pushes all of this one out to disk
        assert client.store_kv(prompt(3, 16, CT), _chunks(3, 16, 4 * MiB)) == 16
    keys = chunk_keys(tokens, "", CT)
    wait_for(lambda: all("disk" in http("GET", f"{url}/v1/keys/{k}")[1]["tiers"] for k in keys))
    wait_for(lambda: _settled(url), timeout=30)
    time.sleep(0.5)  # the write-behind (every 100 ms) has flushed the last rows
    node.kill()  # kill -9: no goodbye, no final flush; its buffer is gone
    again = cluster.start([], settings, name="node")  # its metadata and files are back
    wait_for(lambda: stats(url)["keys_disk"] >= 32, timeout=30)
    assert stats(url)["keys_memory"] == 0  # a new buffer: everything is on disk now
    with PolarKVClient(again.manager_url, chunk_tokens=CT, timeout=30) as client:
        # A scheduler's probe sees the whole prefix, on disk as it is (a probe used to stop
        # at the first chunk on disk: an engine then never asked for a reload).
        assert client.lookup_kv(tokens) == 32 * CT
        n, views = client.load_kv(tokens[: 8 * CT])  # 32 MiB: all of memory
        assert n == 8 * CT and _digests(views) == _digests(chunks[:8])
        n, views = client.load_kv(tokens)
        assert n == 32 * CT and _digests(views) == _digests(chunks)


def _store_then_load(
    url: str, seed: int, n: int, size: int, timeout: float
) -> tuple[int, int, bool]:
    chunks = _chunks(seed, n, size)
    tokens = prompt(seed, n, CT)
    with PolarKVClient(url, chunk_tokens=CT, timeout=timeout) as client:
        stored = client.store_kv(tokens, chunks)
        got, views = client.load_kv(tokens)
        return stored, got // CT, _digests(views) == _digests(chunks[: got // CT])


def _load(url: str, seed: int, n: int, size: int, timeout: float) -> tuple[int, bool]:
    chunks = _chunks(seed, n, size)
    with PolarKVClient(url, chunk_tokens=CT, timeout=timeout) as client:
        got, views = client.load_kv(prompt(seed, n, CT))
        return got // CT, _digests(views) == _digests(chunks[: got // CT])


@pytest.fixture
def pool() -> Iterator[multiprocessing.pool.Pool]:
    ctx = multiprocessing.get_context("spawn")  # real processes, each its own client
    with ctx.Pool(4) as p:
        yield p


def test_four_processes_store_twice_memory_each_at_once_and_load_it_back(
    cluster: Cluster, pool: multiprocessing.pool.Pool
) -> None:
    node = cluster.embedded(disk=True, slab__memory="16MiB", disk__capacity="1GiB")
    url = node.manager_url
    jobs = [pool.apply_async(_store_then_load, (url, 10 + s, 24, MiB, 60.0)) for s in range(4)]
    results = [job.get(timeout=120) for job in jobs]
    assert results == [(24, 24, True)] * 4, results
    wait_for(lambda: _settled(url), timeout=30)
    assert stats(url)["tier_failures"] == 0


def test_four_loaders_of_twice_memory_each_all_complete_at_once(
    cluster: Cluster, pool: multiprocessing.pool.Pool
) -> None:
    node = cluster.embedded(disk=True, slab__memory="32MiB", disk__capacity="1GiB")
    url = node.manager_url
    for s in range(4):  # 4 x 64 MiB through 32 MiB
        with PolarKVClient(url, chunk_tokens=CT, timeout=60) as client:
            assert client.store_kv(prompt(20 + s, 16, CT), _chunks(20 + s, 16, 4 * MiB)) == 16
    wait_for(lambda: _settled(url), timeout=30)
    before = stats(url)
    jobs = [pool.apply_async(_load, (url, 20 + s, 16, 4 * MiB, 60.0)) for s in range(4)]
    results = [job.get(timeout=120) for job in jobs]
    assert results == [(16, True)] * 4, results
    wait_for(lambda: _settled(url), timeout=30)
    after = stats(url)
    assert after["reloads"] - before["reloads"] >= 4 * 16 - 8  # what was in memory stays
    assert after["bytes_memory_allocated"] <= 32 * MiB


def test_loaders_and_storers_at_once_through_a_fraction_of_memory_each_get_it_whole(
    cluster: Cluster,
) -> None:
    """Eight processes at once through 8 MiB (7 MiB under the watermark): four load 24 MiB
    prompts from disk while four store and load their own; every stream's share of memory
    is one 2 MiB chunk at a time, so lookups and writes queue for room the whole time."""
    node = cluster.embedded(disk=True, slab__memory="8MiB", disk__capacity="1GiB")
    url = node.manager_url
    for s in range(4):
        with PolarKVClient(url, chunk_tokens=CT, timeout=60) as client:
            assert client.store_kv(prompt(60 + s, 12, CT), _chunks(60 + s, 12, 2 * MiB)) == 12
    wait_for(lambda: _settled(url), timeout=30)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(8) as p:
        loads = [p.apply_async(_load, (url, 60 + s, 12, 2 * MiB, 60.0)) for s in range(4)]
        stores = [
            p.apply_async(_store_then_load, (url, 70 + s, 12, 2 * MiB, 60.0)) for s in range(4)
        ]
        assert [j.get(timeout=120) for j in loads] == [(12, True)] * 4
        assert [j.get(timeout=120) for j in stores] == [(12, 12, True)] * 4
    wait_for(lambda: _settled(url), timeout=30)
    after = stats(url)
    assert after["tier_failures"] == 0 and after["bytes_memory_allocated"] <= 8 * MiB


def test_one_prompt_of_three_times_memory_loads_what_it_stored(cluster: Cluster) -> None:
    node = cluster.embedded(disk=True, slab__memory="16MiB", disk__capacity="1GiB")
    assert _store_then_load(node.manager_url, 30, 48, MiB, 30.0) == (48, 48, True)


def test_without_a_disk_tier_a_store_counts_only_what_a_load_gets_back(
    cluster: Cluster,
) -> None:
    node = cluster.embedded(slab__memory="16MiB")
    with PolarKVClient(node.manager_url, chunk_tokens=CT, timeout=10, window=8) as client:
        tokens = prompt(40, 48, CT)
        chunks = _chunks(40, 48, MiB)
        stored = client.store_kv(tokens, chunks)  # windows of 8: later ones must not
        assert 0 < stored < 48  # evict the earlier ones to make room for themselves
        got, views = client.load_kv(tokens)
        assert got == stored * CT and _digests(views) == _digests(chunks[:stored])


def test_the_counters_never_go_down_under_streams(cluster: Cluster, tmp_path: Path) -> None:
    """A `/metrics` scrape in the middle of room waits and streams: no `_total` series
    ever goes down (Prometheus would read each drop as a counter reset)."""
    node = cluster.embedded(disk=True, slab__memory="16MiB", disk__capacity="1GiB")
    url = node.manager_url
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as p:
        jobs = [p.apply_async(_store_then_load, (url, 50 + s, 24, MiB, 60.0)) for s in range(3)]
        last: dict[str, float] = {}
        drops: list[str] = []
        scrapes = 0
        while not all(j.ready() for j in jobs) or scrapes < 5:
            status, text = _metrics(url)
            assert status == 200
            scrapes += 1
            for name, value in _totals(text).items():
                if value < last.get(name, 0.0):
                    drops.append(f"{name}: {last[name]} -> {value}")
                last[name] = value
        results = [j.get(timeout=120) for j in jobs]
    assert not drops, drops
    assert all(r == (24, 24, True) for r in results), results
    assert scrapes > 5 and any(v > 0 for k, v in last.items() if "no_space" in k or "reload" in k)


def _metrics(url: str) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return resp.status, resp.read().decode()


def _totals(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "_total" not in line.split(" ")[0]:
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out
