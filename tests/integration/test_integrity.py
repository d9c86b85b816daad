"""Bytes that do not match their checksum are a miss, and the entry is dropped: no
engine ever receives them, and no later load tries them again."""

from __future__ import annotations

import os

import pytest

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, http, stats, wait_for
from tests.integration.raw import post

CT = 4


@pytest.mark.parametrize("transport", ["tcp", "shm"])  # each hashed beside the next read
def test_a_corrupted_chunk_is_a_miss_and_its_entry_is_dropped(
    cluster: Cluster, transport: str
) -> None:
    node = cluster.embedded(slab__transports="tcp,shm")
    url = node.manager_url
    tokens = list(range(3 * CT))
    chunks = [os.urandom(64 * 1024) for _ in range(3)]
    # one connection: the load's three reads are one run on one pool thread
    with PolarKVClient(
        url, chunk_tokens=CT, timeout=3.0, transport=transport, connections=1
    ) as client:
        assert client.store_kv(tokens, chunks) == 3
        n_tokens, views = client.load_kv(tokens)  # whole, each chunk checked
        assert n_tokens == 3 * CT and [bytes(v) for v in views] == chunks
        keys = client.keys(tokens)
        # Flip bytes of the middle chunk where the slab holds it (its buffer file).
        reply = post(url, "/v1/lookup", {"keys": keys[1:2]})
        entry = reply["entries"][0]
        shm_path = reply["nodes"][entry["node"]]["shm_path"]
        post(url, "/v1/release", {"leases": [reply["lease"]]})
        with open(shm_path, "r+b") as buf:
            buf.seek(entry["offset"] + 100)
            buf.write(bytes(b ^ 0xFF for b in chunks[1][100:164]))

        n_tokens, views = client.load_kv(tokens)
        assert n_tokens == CT and [bytes(v) for v in views] == chunks[:1]  # the prefix before it
        assert client.stats.checksum_failures == 1
        # The manager dropped the entry: the next load stops there without reading it.
        wait_for(lambda: http("GET", f"{url}/v1/keys/{keys[1]}")[0] == 404)
        assert client.load_kv(tokens)[0] == CT
        assert client.stats.checksum_failures == 1
    assert stats(url)["checksum_failures"] >= 1
