"""A graceful stop loses no committed entry: entries committed right before SIGTERM are
in the metadata store when the manager exits, and a manager started again on the same
store serves every one of them once their node registers again (same incarnation, so
its buffer is the one that holds the bytes)."""

from __future__ import annotations

import secrets
import threading

from polarkv_lib.errors import PolarKVError
from tests.conftest import Cluster, PolarKV, free_port, http, stats, wait_for

N = 2048
BATCH = 64
SIZE = 4096
NODE = "vm-stop"


def _manager(cluster: Cluster, port: int, url: str, name: str) -> PolarKV:
    # a long write-behind interval: whatever was committed in the last 10 s reaches the
    # store only through the final flush of the graceful stop
    return cluster.start(
        ["manager"],
        {
            "manager.listen": f"127.0.0.1:{port}",
            "manager.metadata_url": url,
            "manager.metadata_flush": "10s",
            "manager.heartbeat_ttl": "30s",
        },
        name=name,
    )


def _register(url: str, incarnation: int) -> None:
    status, body = http(
        "POST",
        url + "/v1/nodes/register",
        {
            "node_id": NODE,
            "incarnation": incarnation,
            "address": "127.0.0.1:9",
            # room for both writers' 2N entries under the watermark: a node without a
            # disk evicts past it, and an evicted entry is gone by design, not lost
            "capacity": 4 * N * SIZE,
            "transports": ["tcp"],
        },
    )
    assert status == 200, body
    # A node that registers with a restarted manager confirms the memory it still holds;
    # this one moves no bytes, so it vouches for everything it is asked about.
    held: list[dict[str, object]] = []
    while True:
        status, reply = http(
            "POST",
            url + "/v1/nodes/confirm",
            {"node_id": NODE, "incarnation": incarnation, "held": held},
        )
        assert status == 200, reply
        if not reply["check"]:
            return
        held = [
            {"offset": c["offset"], "checksum": c["checksum"], "ok": True} for c in reply["check"]
        ]


def _commit(url: str, keys: list[str]) -> None:
    status, reply = http(
        "POST", url + "/v1/allocate", {"items": [{"key": k, "size": SIZE} for k in keys]}
    )
    assert status == 200 and all(r["status"] == "allocated" for r in reply["results"]), reply
    status, done = http(
        "POST",
        url + "/v1/commit",
        {"lease": reply["lease"], "items": [{"key": k, "checksum": "0" * 16} for k in keys]},
    )
    assert status == 200 and set(done["results"].values()) == {"committed"}, done


def test_sigterm_right_after_commits_keeps_them_all(cluster: Cluster, metadata_url: str) -> None:
    port = free_port()
    first = _manager(cluster, port, metadata_url, "m1")
    url = first.manager_url
    incarnation = secrets.randbits(62)
    _register(url, incarnation)
    keys = [f"{i:032x}" for i in range(N)]
    for i in range(0, N, BATCH):
        _commit(url, keys[i : i + BATCH])
    assert stats(url)["keys_memory"] == N
    assert first.stop() == 0  # at once: no write-behind interval has passed
    assert "final metadata flush failed" not in first.log()
    again = _manager(cluster, port, metadata_url, "m2")
    assert f"entries={N}" in again.log()
    _register(url, incarnation)
    wait_for(lambda: stats(url)["keys_memory"] == N)
    status, reply = http("POST", url + "/v1/lookup", {"keys": keys[-BATCH:], "lease": False})
    assert status == 200 and reply["hits"] == BATCH  # the very last commits too
    assert again.stop() == 0
    assert "final metadata flush failed" not in again.log()


def test_sigterm_in_the_middle_of_a_write_behind_batch(cluster: Cluster, metadata_url: str) -> None:
    """Commits keep coming and the write-behind writes every 20 ms, so SIGTERM finds a
    batch in flight: every commit the manager acknowledged is still there after it."""
    port = free_port()
    first = cluster.start(
        ["manager"],
        {
            "manager.listen": f"127.0.0.1:{port}",
            "manager.metadata_url": metadata_url,
            "manager.metadata_flush": "20ms",
            "manager.heartbeat_ttl": "30s",
        },
        name="m1",
    )
    url = first.manager_url
    incarnation = secrets.randbits(62)
    _register(url, incarnation)
    acked: list[str] = []
    stop = threading.Event()

    def writer(base: int) -> None:
        for i in range(base, base + N, BATCH):
            if stop.is_set():
                return
            keys = [f"{k:032x}" for k in range(i, i + BATCH)]
            try:
                _commit(url, keys)
            except (AssertionError, PolarKVError):
                return  # the manager is stopping: not acknowledged
            acked.extend(keys)

    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, N)]
    for t in threads:
        t.start()
    wait_for(lambda: len(acked) >= N // 2)
    assert first.stop() == 0  # commits still coming in
    stop.set()
    for t in threads:
        t.join(10)
    again = _manager(cluster, port, metadata_url, "m2")
    _register(url, incarnation)
    wait_for(lambda: stats(url)["keys_memory"] >= len(acked))
    for i in range(0, len(acked), BATCH):
        status, reply = http(
            "POST", url + "/v1/lookup", {"keys": acked[i : i + BATCH], "lease": False}
        )
        assert status == 200 and reply["hits"] == len(acked[i : i + BATCH]), i
    assert again.stop() == 0  # before the store's tables go with the test
    assert "final metadata flush failed" not in first.log() + again.log()
