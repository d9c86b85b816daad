"""Store in one process, load in another, through real manager and slab processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, stats

CLIENT = str(Path(__file__).with_name("client_proc.py"))
CHUNKS, CHUNK_BYTES = 64, 4 << 20


def run_client(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, CLIENT, *args], capture_output=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    return dict(orjson.loads(done.stdout))


@pytest.mark.parametrize(
    "layout,transport",
    [
        ("split", "tcp"),
        ("split", "shm"),
        ("embedded", "auto"),
    ],
)
def test_store_in_one_process_load_in_another(
    cluster: Cluster, layout: str, transport: str
) -> None:
    memory = {"slab__memory": "300MiB"}
    if layout == "split":
        manager = cluster.manager()
        cluster.slab(manager.manager_url, **memory)
        url = manager.manager_url
    else:
        url = cluster.embedded(disk=True, **memory).manager_url
    stored = run_client("store", url, "e2e", transport, str(CHUNKS), str(CHUNK_BYTES))
    assert stored["stored"] == CHUNKS
    loaded = run_client("load", url, "e2e", transport, str(CHUNKS))
    assert loaded["n_tokens"] == CHUNKS * 16
    assert loaded["digests"] == stored["digests"]
    assert loaded["stats"]["faults"] == 0
    s = stats(url)
    assert s["keys_memory"] == CHUNKS and s["commits"] == CHUNKS
    assert s["bytes_memory"] == CHUNKS * CHUNK_BYTES
    assert s["hits"] == CHUNKS


def test_longest_prefix_and_namespaces(cluster: Cluster) -> None:
    url = cluster.embedded().manager_url
    ct = 8
    tokens = list(range(10 * ct + 3))  # 10 full chunks and a partial one (never keyed)
    chunks = [os.urandom(1000 + i) for i in range(10)]
    with (
        PolarKVClient(url, namespace="model-a", chunk_tokens=ct) as a,
        PolarKVClient(url, namespace="model-b", chunk_tokens=ct) as b,
    ):
        assert a.store_kv(tokens, chunks) == 10
        for k in (0, 1, 4, 9):
            prompt = tokens[: k * ct] + [7] * ct + tokens[(k + 1) * ct :]  # diverges in chunk k
            n_tokens, views = a.load_kv(prompt)
            assert n_tokens == k * ct
            assert [bytes(v) for v in views] == chunks[:k]
        n_tokens, views = a.load_kv(tokens)
        assert n_tokens == 10 * ct and [bytes(v) for v in views] == chunks
        assert a.lookup_kv(tokens) == 10 * ct
        assert b.load_kv(tokens) == (0, [])
        assert b.lookup_kv(tokens) == 0
        # storing again writes nothing new: every chunk already exists
        before = stats(url)["commits"]
        assert a.store_kv(tokens, chunks) == 10
        assert stats(url)["commits"] == before


def test_load_into_caller_buffers_and_windows(cluster: Cluster) -> None:
    url = cluster.embedded().manager_url
    tokens = list(range(40 * 4))
    chunks = [os.urandom(4096) for _ in range(40)]
    # window=7: the 40-chunk prompt is stored and loaded in six control round trips
    with PolarKVClient(url, namespace="w", chunk_tokens=4, window=7) as c:
        assert c.store_kv(tokens, chunks) == 40
        out = [bytearray(5000) for _ in range(40)]
        n_tokens, views = c.load_kv(tokens, out=out)
        assert n_tokens == 160
        for i, (v, buf) in enumerate(zip(views, out, strict=True)):
            assert bytes(v) == chunks[i] and bytes(buf[:4096]) == chunks[i]
        with pytest.raises(ValueError, match="holds"):
            c.load_kv(tokens, out=[bytearray(10)])
    assert stats(url)["read_leases"] in (0, 1)  # releases are sent in the background


def test_put_get(cluster: Cluster) -> None:
    url = cluster.embedded().manager_url
    with PolarKVClient(url) as c:
        key = "ab" * 16
        assert c.get(key) is None
        assert c.put(key, b"hello") is True
        assert c.get(key) == b"hello"
        assert c.put(key, b"other") is True  # already present: first writer won
        assert c.get(key) == b"hello"
        with pytest.raises(ValueError):
            c.put("not-a-key", b"x")
        with pytest.raises(TypeError):
            c.store_kv("text", [b"x"])


def test_keyed_batches(cluster: Cluster) -> None:
    url = cluster.embedded().manager_url
    keys = [f"{i:032x}" for i in range(1, 7)]
    values = [os.urandom(3000 + i) for i in range(6)]
    with PolarKVClient(url) as c:
        assert c.lookup_keys(keys) == 0
        assert c.put_many(keys[:4], values[:4]) == 4
        assert c.lookup_keys(keys) == 4  # the leading run
        assert [bytes(v) for v in c.get_many(keys)] == values[:4]
        out = [bytearray(4000) for _ in keys[:3]]
        views = c.get_many(keys[:3], out)
        assert [bytes(v) for v in views] == values[:3] and bytes(out[0][:3000]) == values[0]
        assert c.put_many(keys, values) == 6  # four present, two written
        with pytest.raises(ValueError):
            c.put_many(keys, values[:2])
        with pytest.raises(ValueError):
            c.lookup_keys(["not-a-key"])


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_each_event_loop_serves_split_roles(cluster: Cluster, loop: str) -> None:
    """runtime.event_loop: the manager and the slab on the standard loop and on uvloop
    (the default when installed) store and load the same bytes over tcp and shm."""
    settings = {"runtime__event_loop": loop}
    manager = cluster.manager(**settings)
    slab = cluster.slab(manager.manager_url, **settings)
    assert manager.info["event_loop"] == slab.info["event_loop"] == loop
    for transport in ("tcp", "shm"):
        ns = f"loop-{transport}"
        stored = run_client("store", manager.manager_url, ns, transport, "8", str(1 << 20))
        loaded = run_client("load", manager.manager_url, ns, transport, "8")
        assert stored["stored"] == 8 and loaded["digests"] == stored["digests"]
