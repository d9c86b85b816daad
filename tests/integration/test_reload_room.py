"""A prefix longer than the memory tier loads in full once it has been offloaded: the
client reads it window by window, and each window's reloads make room the way a write
does (clean copies of earlier windows go; dirty entries of other prompts are offloaded
first), never taking the entries that the same lookup is about to return."""

from __future__ import annotations

import hashlib
import os
import threading

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, prompt, stats, wait_for

MiB = 1 << 20
CT = 4
CHUNKS = 32  # 32 MiB per prompt through 16 MiB of memory


def _digests(views: list[memoryview]) -> list[str]:
    return [hashlib.sha256(v).hexdigest() for v in views]


def test_prefix_twice_memory_loads_fully_after_offload(cluster: Cluster) -> None:
    node = cluster.embedded(disk=True, slab__memory="16MiB", disk__capacity="1GiB")
    url = node.manager_url
    sessions = 4
    data = {s: [os.urandom(MiB) for _ in range(CHUNKS)] for s in range(sessions)}
    with PolarKVClient(url, chunk_tokens=CT, timeout=20, window=4) as c:
        for s, chunks in data.items():
            assert c.store_kv(prompt(s, CHUNKS, CT), chunks) == CHUNKS
        wait_for(lambda: stats(url)["bytes_offloading"] == 0, timeout=30)
        before = stats(url)
        assert before["keys_disk"] >= sessions * CHUNKS - 16  # most of it only on disk now
        n_tokens, views = c.load_kv(prompt(0, CHUNKS, CT))
        assert n_tokens == CHUNKS * CT
        assert _digests(views) == _digests([memoryview(b) for b in data[0]])

    # four sessions at once, as an engine at concurrency 4 asks for them
    results: dict[int, tuple[int, list[str]]] = {}

    def load(s: int) -> None:
        with PolarKVClient(url, chunk_tokens=CT, timeout=30, window=4) as client:
            got, got_views = client.load_kv(prompt(s, CHUNKS, CT))
            results[s] = (got, _digests(got_views))

    threads = [threading.Thread(target=load, args=(s,)) for s in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in range(sessions):
        got, digests = results[s]
        assert digests == _digests(
            [memoryview(b) for b in data[s]][: got // CT]
        )  # never wrong bytes
    assert sum(got for got, _ in results.values()) == sessions * CHUNKS * CT, {
        s: got // CT for s, (got, _) in results.items()
    }
    after = stats(url)
    assert after["reloads"] > before["reloads"] + CHUNKS and after["tier_failures"] == 0
