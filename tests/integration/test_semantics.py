"""Write-finish visibility, first writer wins, leases, eviction, stats == metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

from polarkv_lib.client import PolarKVClient, checksum
from tests.conftest import Cluster, http, stats, wait_for
from tests.integration.raw import key, post, read, write


def test_entry_invisible_until_write_finish(cluster: Cluster) -> None:
    url = cluster.embedded().manager_url
    k = key(1)
    data = os.urandom(100_000)
    reply = write(url, k, data, commit=False)
    # written but not committed: no reader can see it, a second writer is told in_progress
    assert post(url, "/v1/lookup", {"keys": [k]})["hits"] == 0
    assert http("GET", f"{url}/v1/keys/{k}")[1]["state"] == "writing"
    again = post(url, "/v1/allocate", {"items": [{"key": k, "size": 10}]})
    assert again["results"][0]["status"] == "in_progress"
    done = post(
        url,
        "/v1/commit",
        {"lease": reply["lease"], "items": [{"key": k, "checksum": checksum(data)}]},
    )
    assert done["results"] == {k: "committed"}
    hit = post(url, "/v1/lookup", {"keys": [k]})
    assert hit["hits"] == 1
    assert read(url, hit, hit["entries"][0]) == data
    again = post(url, "/v1/allocate", {"items": [{"key": k, "size": 10}]})
    assert again["results"][0]["status"] == "exists"


def test_sixteen_concurrent_writers_one_wins(cluster: Cluster) -> None:
    url = cluster.embedded().manager_url
    k = key(2)
    payloads = [bytes([i]) * 2_000_000 for i in range(16)]
    seen_early: list[bytes] = []
    stop = threading.Event()
    results: list[bool] = []
    barrier = threading.Barrier(17)

    def writer(i: int) -> None:
        with PolarKVClient(url, timeout=10) as c:
            barrier.wait()
            results.append(c.put(k, payloads[i]))

    def reader() -> None:
        with PolarKVClient(url, timeout=10) as c:
            barrier.wait()
            while not stop.is_set():
                got = c.get(k)
                if got is not None:
                    seen_early.append(got)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(16)]
    watcher = threading.Thread(target=reader)
    for t in [*threads, watcher]:
        t.start()
    for t in threads:
        t.join(30)
    stop.set()
    watcher.join(30)
    s = stats(url)
    assert s["allocations"] == 1 and s["commits"] == 1
    assert s["alloc_in_progress"] + s["alloc_exists"] == 15
    with PolarKVClient(url) as c:
        final = c.get(k)
    assert final in payloads
    # whatever the reader saw was the complete winning value, never a partial write
    assert all(v == final for v in seen_early)
    # the winner and every writer that found it committed stored it; one that found it
    # still being written did not (the client does not ask again for an in-progress key)
    assert len(results) == 16 and results.count(True) == 1 + s["alloc_exists"]


WRITER = """
import sys, time, os
from tests.integration.raw import post, region
from polarkv_lib.transport.tcp import TcpTransport
url, k = sys.argv[1], sys.argv[2]
reply = post(url, "/v1/allocate", {"items": [{"key": k, "size": 3_000_000}]})
entry = reply["results"][0]
TcpTransport().write_from(region(reply, entry), memoryview(os.urandom(3_000_000)), time.monotonic() + 5)
print("written", flush=True)
time.sleep(60)  # killed before write-finish
"""


def test_killed_writer_space_returns_after_write_lease(cluster: Cluster) -> None:
    url = cluster.embedded(manager__write_lease="1s").manager_url
    k = key(3)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, url, k],
        stdout=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"written"
        assert stats(url)["keys_writing"] == 1 and stats(url)["bytes_memory_allocated"] > 0
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    wait_for(lambda: stats(url)["keys_writing"] == 0, timeout=5)
    # the space comes back once the writer's grant can no longer land bytes in it
    wait_for(lambda: stats(url)["bytes_memory_allocated"] == 0, timeout=5)
    assert stats(url)["expired_write_leases"] == 1
    assert http("GET", f"{url}/v1/keys/{k}")[0] == 404
    with PolarKVClient(url) as c:  # the key can be written again
        assert c.put(k, b"second writer")
        assert c.get(k) == b"second writer"


def test_read_lease_protects_from_eviction(cluster: Cluster) -> None:
    url = cluster.embedded(slab__memory="8MiB", manager__read_lease="30s").manager_url
    mib = 1 << 20
    first = os.urandom(mib)
    write(url, key(100), first)
    for i in range(1, 7):
        write(url, key(100 + i), os.urandom(mib))
    held = post(url, "/v1/lookup", {"keys": [key(100)]})  # oldest entry, now under a read lease
    assert held["hits"] == 1
    for i in range(7, 20):  # memory pressure: 13 more MiB into an 8 MiB node
        write(url, key(100 + i), os.urandom(mib))
    assert stats(url)["evictions"] > 0
    assert http("GET", f"{url}/v1/keys/{key(100)}")[0] == 200
    assert read(url, held, held["entries"][0]) == first  # bytes untouched under the lease
    assert http("GET", f"{url}/v1/keys/{key(101)}")[0] == 404  # unleased LRU went first
    post(url, "/v1/release", {"leases": [held["lease"]]})
    assert stats(url)["read_leases"] == 0


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" ([0-9.e+]+)"
    m = re.search("^" + pattern + "$", text, re.M)
    assert m, f"{name}{labels} not in metrics"
    return float(m.group(1))


def test_filling_memory_evicts_lru_and_stats_match_metrics(cluster: Cluster) -> None:
    url = cluster.embedded(slab__memory="16MiB").manager_url
    mib = 1 << 20
    prompts = [[p * 1000 + t for t in range(8)] for p in range(20)]  # 20 prompts of 2 chunks
    chunks = [[os.urandom(mib), os.urandom(mib)] for _ in prompts]
    with PolarKVClient(url, namespace="fill", chunk_tokens=4) as c:
        for tokens, kv in zip(prompts, chunks, strict=True):
            assert c.store_kv(tokens, kv) == 2
        s = stats(url)
        assert s["evictions"] > 0
        assert s["bytes_memory_allocated"] <= 16 * mib
        loaded = [c.load_kv(tokens)[0] // 4 for tokens in prompts]
        # the newest prompts survive whole; the oldest are gone
        assert loaded[-7:] == [2] * 7 and loaded[0] == 0
        first = next(i for i, n in enumerate(loaded) if n)
        assert all(n == 2 for n in loaded[first + 1 :])
        # a partly evicted prompt lost its tail, never its head: prefixes stay usable
        assert loaded[first] in (1, 2)
        _, views = c.load_kv(prompts[-1])
        assert [bytes(v) for v in views] == chunks[-1]
        assert s["keys_memory"] + s["evictions"] == 40
    s = stats(url)
    status, text = http("GET", url + "/metrics")
    assert status == 200
    assert _metric(text, "polarkv_evictions_total") == s["evictions"]
    assert _metric(text, "polarkv_keys", 'tier="memory"') == s["keys_memory"]
    assert _metric(text, "polarkv_bytes", 'tier="memory"') == s["bytes_memory"]
    assert _metric(text, "polarkv_hits_total", 'tier="memory"') == s["hits_memory"]
    assert _metric(text, "polarkv_misses_total") == s["misses"]
    assert _metric(text, "polarkv_commits_total") == s["commits"] == 40
    assert _metric(text, "polarkv_allocations_total", 'result="exists"') == s["alloc_exists"]
    assert _metric(text, "polarkv_nodes", 'state="alive"') == 1
    assert 'polarkv_request_seconds_count{endpoint="/v1/allocate"}' in text
