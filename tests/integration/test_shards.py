"""A manager sharded by key range (DESIGN §11), on loopback: two shards, slabs that
serve both from one buffer, clients that fan out to both."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from polarkv_lib.client import PolarKVClient
from polarkv_lib.client.admin import AdminClient
from polarkv_lib.keys import chunk_keys
from polarkv_lib.shards import Shard, shard_of
from tests.conftest import Cluster, PolarKV, http, stats, wait_for

GRANT_KEY = "shards-test-grant-key-0123456789"
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"  # the test database CI provides
CHUNK_TOKENS = 16
SIZE = 64 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_shard(cluster: Cluster, index: int, port: int, metadata_url: str) -> PolarKV:
    return cluster.start(
        ["manager"],
        {
            "manager.listen": f"127.0.0.1:{port}",
            "manager.shard": f"{index}/2",
            "manager.heartbeat_ttl": "1s",
            "security.grant_key": GRANT_KEY,
            "manager.metadata_url": metadata_url,
        },
        name=f"shard{index}-{time.monotonic_ns()}",
    )


Sharded = tuple[list[PolarKV], list[PolarKV], list[int], list[str]]


def make_sharded(cluster: Cluster, stores: list[str]) -> Sharded:
    """Two shards with their own metadata stores, and two slabs serving both."""
    ports = [free_port(), free_port()]
    shards = [start_shard(cluster, i, ports[i], stores[i]) for i in range(2)]
    urls = ",".join(s.manager_url for s in shards)
    slabs = [
        cluster.start(
            ["slab", "disk"],
            {"slab.manager_url": urls, "security.grant_key": GRANT_KEY, "slab.memory": "32MiB"},
            name=f"slab{i}",
        )
        for i in range(2)
    ]
    for shard in shards:
        wait_for(
            lambda url=shard.manager_url: alive_nodes(url) == {s.info["node_id"] for s in slabs},
            timeout=30.0,
        )
    return shards, slabs, ports, stores


def alive_nodes(url: str) -> set[str]:
    return {n["id"] for n in http("GET", url + "/v1/nodes")[1]["nodes"] if n["state"] == "alive"}


def chunk(i: int) -> bytes:
    return bytes([i % 251]) * SIZE


@pytest.fixture
def sharded(cluster: Cluster, tmp_path: Path) -> Sharded:
    return make_sharded(cluster, [f"sqlite:///{tmp_path}/shard{i}.db" for i in range(2)])


@pytest.fixture(params=["sqlite", "postgresql"])
def sharded_store(
    request: pytest.FixtureRequest, cluster: Cluster, tmp_path: Path
) -> Iterator[Sharded]:
    """Shards on their own SQLite files, or on their own schemas of one PostgreSQL database."""
    if request.param == "sqlite":
        yield make_sharded(cluster, [f"sqlite:///{tmp_path}/shard{i}.db" for i in range(2)])
        return
    schemas = [f"polarkv_test_shard{i}_{os.getpid()}_{time.monotonic_ns()}" for i in range(2)]
    try:
        yield make_sharded(cluster, [f"{PG_URL}?search_path={schema}" for schema in schemas])
    finally:
        cluster.close()  # the managers first: they hold connections into the schemas

        async def drop() -> None:
            conn = await asyncpg.connect(PG_URL)
            for schema in schemas:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            await conn.close()

        asyncio.run(drop())


def test_store_and_load_across_shards(sharded: Sharded) -> None:
    shards = sharded[0]
    urls = ",".join(s.manager_url for s in shards)
    # Each shard manages its own arena of every slab: half of its buffer, disjoint.
    for shard in shards:
        caps = {
            n["id"]: n["memory_capacity"]
            for n in http("GET", shard.manager_url + "/v1/nodes")[1]["nodes"]
        }
        assert sorted(caps.values()) == [16 * 1024**2, 16 * 1024**2]
    tokens = list(range(64 * CHUNK_TOKENS))
    with PolarKVClient(urls, namespace="shards", chunk_tokens=CHUNK_TOKENS, timeout=5.0) as client:
        assert client.store_kv(tokens, [chunk(i) for i in range(64)]) == 64
        # every shard's keys in memory: the merged answer says all of the hit is
        assert client.lookup_kv_tiers(tokens) == (64 * CHUNK_TOKENS, 64 * CHUNK_TOKENS)
        before = [stats(s.manager_url)["lookups"] for s in shards]
        n_tokens, views = client.load_kv(tokens)
        after = [stats(s.manager_url)["lookups"] for s in shards]
    assert after == [b + 1 for b in before]  # one window: one lookup request per shard
    assert n_tokens == 64 * CHUNK_TOKENS
    assert all(bytes(v) == chunk(i) for i, v in enumerate(views))
    keys = chunk_keys(tokens, "shards", CHUNK_TOKENS)
    owned = [sum(1 for k in keys if shard_of(k, 2) == i) for i in range(2)]
    assert min(owned) > 0
    assert [stats(s.manager_url)["keys_memory"] for s in shards] == owned


def test_a_shard_refuses_keys_outside_its_range(sharded: Sharded) -> None:
    shards = sharded[0]
    url = shards[0].manager_url
    foreign = "ffff" + "0" * 28
    assert not Shard(0, 2).owns(foreign)
    before = stats(url)
    for path, body in (
        ("/v1/lookup", {"keys": ["0000" + "0" * 28, foreign]}),
        ("/v1/allocate", {"items": [{"key": foreign, "size": 4096}]}),
    ):
        status, reply = http("POST", url + path, body)
        assert 400 <= status < 500, (path, status, reply)
        assert reply["error"].startswith("wrong_shard"), reply
    status, reply = http("GET", url + f"/v1/keys/{foreign}")
    assert 400 <= status < 500 and reply["error"].startswith("wrong_shard")
    after = stats(url)
    assert {k: after[k] for k in ("lookups", "allocations", "keys_memory", "keys_writing")} == {
        k: before[k] for k in ("lookups", "allocations", "keys_memory", "keys_writing")
    }


def test_one_shard_down_misses_only_its_range_and_recovers(
    cluster: Cluster, sharded_store: Sharded
) -> None:
    shards, _, ports, stores = sharded_store
    urls = ",".join(s.manager_url for s in shards)
    tokens = list(range(32 * CHUNK_TOKENS))
    namespace = "down5"  # its first five keys are shard 0's, the sixth shard 1's
    keys = chunk_keys(tokens, namespace, CHUNK_TOKENS)
    first_of_1 = next(i for i, k in enumerate(keys) if shard_of(k, 2) == 1)
    assert first_of_1 == 5
    with PolarKVClient(urls, namespace=namespace, chunk_tokens=CHUNK_TOKENS, timeout=2.0) as client:
        assert client.store_kv(tokens, [chunk(i) for i in range(32)]) == 32
        AdminClient(shards[1].manager_url).wait_flushed()  # shard 1's rows are stored
        # Hung (it accepts, never answers), then dead: either way the load stops at the
        # first key shard 1 owns, every key before it loads, and within the timeout.
        for fault in (signal.SIGSTOP, signal.SIGKILL):
            shards[1].proc.send_signal(fault)
            started = time.monotonic()
            n_tokens, views = client.load_kv(tokens)
            assert time.monotonic() - started < 2.5, fault  # the client's timeout, and a margin
            assert n_tokens == first_of_1 * CHUNK_TOKENS, fault
            assert all(bytes(v) == chunk(i) for i, v in enumerate(views))
        shards[1].kill()  # reaps it
        # Shard 1 restarts on its address with its own metadata file: once the slabs have
        # registered again, its range is back, and it holds only its own range.
        restarted = start_shard(cluster, 1, ports[1], stores[1])
        mine = sum(1 for k in keys if shard_of(k, 2) == 1)
        wait_for(lambda: stats(restarted.manager_url)["keys_memory"] == mine, timeout=10.0)

        def all_back() -> bool:
            return client.load_kv(tokens)[0] == 32 * CHUNK_TOKENS

        wait_for(all_back, timeout=10.0, interval=0.3)
