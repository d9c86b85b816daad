"""A store larger than a node's memory: with a disk tier it continues as offloads make
room, so the whole prefix is stored; without one, the head is stored and the rest is
refused at once."""

from __future__ import annotations

import time

import numpy as np

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, stats

CT = 16
CHUNKS = 32
CHUNK = 4 * 1024**2  # 32 x 4 MiB = 128 MiB into 32 MiB of memory


def _chunks(seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes() for _ in range(CHUNKS)]


def test_a_store_bigger_than_memory_continues_onto_disk(cluster: Cluster) -> None:
    node = cluster.embedded(disk=True, slab__memory="32MiB", disk__capacity="1GiB")
    tokens = list(range(CHUNKS * CT))
    chunks = _chunks(1)
    with PolarKVClient(node.manager_url, chunk_tokens=CT, timeout=30.0) as client:
        started = time.monotonic()
        assert client.store_kv(tokens, chunks) == CHUNKS
        assert time.monotonic() - started < 30.0
        s = stats(node.manager_url)
        assert s["keys_memory"] + s["keys_disk"] == CHUNKS and s["keys_disk"] > 0
        # The head came back from disk, byte for byte.
        n, views = client.load_kv(tokens[: 4 * CT])
        assert n == 4 * CT and [bytes(v) for v in views] == chunks[:4]


def test_without_a_disk_tier_the_head_is_stored_and_the_rest_refused_at_once(
    cluster: Cluster,
) -> None:
    node = cluster.embedded(slab__memory="32MiB")
    tokens = list(range(CHUNKS * CT))
    with PolarKVClient(node.manager_url, chunk_tokens=CT, timeout=10.0) as client:
        started = time.monotonic()
        stored = client.store_kv(tokens, _chunks(2))
        assert 0 < stored < CHUNKS
        assert time.monotonic() - started < 5.0  # no waiting for room that cannot come
        assert client.lookup_kv(tokens) == stored * CT
