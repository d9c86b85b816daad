"""Tenants against every token (DESIGN §14): no key the default token (or another tenant)
can compute or send reaches a tenant's entries; a tenant's entries survive shard
restarts; quotas count what a tenant writes; one tenant cannot evict another below its
fair share; tenant series and events are their own. Real processes, raw HTTP where an
attacker would use it. Each test failed before entries carried their tenant."""

from __future__ import annotations

import hashlib
import mmap
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from polarkv_lib.client import PolarKVClient
from polarkv_lib.client.transfers import checksum
from polarkv_lib.transport.tcp import TcpTransport
from tests.conftest import PG, Cluster, free_port, http, pg, prompt, wait_for
from tests.integration.raw import region

ADMIN, DEFAULT = "admin-t0ken", "default-t0ken"
TEAM_A, TEAM_B = "team-a-t0ken", "team-b-t0ken"
TENANTS = f"team-a:{TEAM_A},team-b:{TEAM_B}"
MiB = 1 << 20
CT = 4


def post(url: str, path: str, body: dict[str, Any], token: str) -> dict[str, Any]:
    status, reply = http("POST", url + path, body, token=token)
    assert status == 200, (path, status, reply)
    return dict(reply)


def raw_store(url: str, key: str, data: bytes, token: str) -> str:
    """Allocate, write over tcp and commit one key as `token`; the result of the commit."""
    reply = post(url, "/v1/allocate", {"items": [{"key": key, "size": len(data)}]}, token)
    entry = reply["results"][0]
    if entry["status"] != "allocated":
        return str(entry["status"])
    transport = TcpTransport()
    try:
        transport.write_from(region(reply, entry), memoryview(data), time.monotonic() + 5)
    finally:
        transport.close()
    body = {"lease": reply["lease"], "items": [{"key": key, "checksum": checksum(data)}]}
    return str(post(url, "/v1/commit", body, token)["results"][key])


def old_filed_key(tenant: str, key: str) -> str:
    """Where the manager used to file a tenant's entry: a public hash of its name."""
    return hashlib.blake2b(f"{tenant}\0{key}".encode(), digest_size=16).hexdigest()


def test_the_default_token_reaches_no_tenants_entries(cluster: Cluster) -> None:
    url = cluster.embedded(
        security__token=DEFAULT, security__admin_token=ADMIN, security__tenants=TENANTS
    ).manager_url
    mine = [os.urandom(4096), os.urandom(4096)]
    with PolarKVClient(url, chunk_tokens=CT, token=TEAM_A) as a:
        assert a.store_kv(prompt(1, 2, CT), mine) == 2
        keys = a.keys(prompt(1, 2, CT))
        future = a.keys(prompt(2, 2, CT))
    # What the default token can compute from public names finds nothing ...
    for guess in ([old_filed_key("team-a", k) for k in keys], keys):
        hit = post(url, "/v1/lookup", {"keys": guess}, DEFAULT)
        assert hit["hits"] == 0, guess
    # ... and the identity a tenant's entry is filed under is no key on the API.
    status, reply = http("POST", url + "/v1/lookup", {"keys": [f"{keys[0]}.team-a"]}, token=DEFAULT)
    assert status == 400, reply
    # Pre-storing a tenant's future prompt under any key the attacker can name changes
    # nothing for the tenant: its store writes its own bytes, and it loads them.
    evil = b"\xee" * 4096
    for k in [*future, *(old_filed_key("team-a", f) for f in future)]:
        assert raw_store(url, k, evil, DEFAULT) == "committed"
    ours = [os.urandom(4096), os.urandom(4096)]
    with PolarKVClient(url, chunk_tokens=CT, token=TEAM_A) as a:
        assert a.store_kv(prompt(2, 2, CT), ours) == 2
        n, views = a.load_kv(prompt(2, 2, CT))
        assert n == 2 * CT and [bytes(v) for v in views] == ours
    # Another tenant's token sees none of it either.
    assert post(url, "/v1/lookup", {"keys": keys}, TEAM_B)["hits"] == 0
    # nor can it act on the tenant's leases: a lease id it learnt releases nothing
    lease = post(url, "/v1/lookup", {"keys": keys}, TEAM_A)["lease"]
    assert post(url, "/v1/release", {"leases": [lease]}, TEAM_B)["released"] == 0
    assert post(url, "/v1/release", {"leases": [lease]}, TEAM_A)["released"] == 1


def _shard(cluster: Cluster, i: int, port: int, db: Path, name: str) -> str:
    return cluster.start(
        ["manager"],
        {
            "manager.listen": f"127.0.0.1:{port}",
            "manager.shard": f"{i}/2",
            "manager.metadata_url": f"sqlite:///{db}",
            "manager.metadata_flush": "100ms",
            "manager.heartbeat_ttl": "1s",
            "security.token": DEFAULT,
            "security.admin_token": ADMIN,
            "security.tenants": TENANTS,
            "security.grant_key": "g" * 32,
        },
        name=name,
    ).manager_url


def _rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM polarkv_entries").fetchone()[0])


def test_a_tenants_entries_come_back_when_both_shards_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    ports = [free_port(), free_port()]
    dbs = [tmp_path / "s0.db", tmp_path / "s1.db"]
    urls = [_shard(cluster, i, ports[i], dbs[i], f"m{i}") for i in range(2)]
    both = ",".join(urls)
    cluster.start(
        ["slab", "disk"],
        {
            "slab.manager_url": both,
            "slab.memory": "64MiB",
            "slab.node_id": "vm-1",
            "security.admin_token": ADMIN,
            "security.grant_key": "g" * 32,
        },
        name="slab",
    )
    wait_for(lambda: all(stats_as(u)["nodes"] == 1 for u in urls))
    data = {t: [os.urandom(64 * 1024) for _ in range(32)] for t in (DEFAULT, TEAM_A)}
    for token, chunks in data.items():
        with PolarKVClient(both, chunk_tokens=CT, token=token) as c:
            assert c.store_kv(prompt(7, 32, CT), chunks) == 32
    wait_for(lambda: _rows(dbs[0]) + _rows(dbs[1]) == 64)
    for proc in cluster.procs[:2]:
        proc.stop()  # SIGTERM: both shards flush and stop
    for i in range(2):
        _shard(cluster, i, ports[i], dbs[i], f"m{i}-again")
    wait_for(lambda: sum(stats_as(u)["keys_memory"] for u in urls) == 64, timeout=30)
    for token, chunks in data.items():
        with PolarKVClient(both, chunk_tokens=CT, token=token) as c:
            n, views = c.load_kv(prompt(7, 32, CT))
            assert n == 32 * CT and [bytes(v) for v in views] == chunks, token


def stats_as(url: str, token: str = ADMIN) -> dict[str, Any]:
    status, body = http("GET", url + "/v1/stats", token=token)
    assert status == 200, body
    return dict(body)


def test_old_tables_are_migrated_and_their_rows_are_the_default_tenants(
    cluster: Cluster, tmp_path: Path, clean_pg: None
) -> None:
    old = (
        "CREATE TABLE polarkv_entries (key TEXT PRIMARY KEY, node_id TEXT NOT NULL, "
        "incarnation BIGINT NOT NULL, size BIGINT NOT NULL, checksum TEXT NOT NULL, "
        "mem_offset BIGINT NOT NULL, mem_extent BIGINT NOT NULL, in_memory BOOLEAN NOT NULL, "
        "on_disk BOOLEAN NOT NULL, file_bytes BIGINT NOT NULL, created DOUBLE PRECISION NOT NULL)"
    )
    nodes = (
        "CREATE TABLE polarkv_nodes (node_id TEXT PRIMARY KEY, incarnation BIGINT NOT NULL, "
        "address TEXT NOT NULL, capacity BIGINT NOT NULL, disk_capacity BIGINT NOT NULL, "
        "shm_path TEXT NOT NULL, host_id TEXT NOT NULL, transports TEXT NOT NULL)"
    )
    node = "('vm-9', 5, 'h:1', 65536, 0, '', 'h', 'tcp')"  # its node: the row waits for it
    key = "ab" + "0" * 30
    entry = f"('{key}', 'vm-9', 5, 4096, '0123456789abcdef', 0, 4096, true, false, 0, 1.0)"
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:
        for statement in (old, nodes, f"INSERT INTO polarkv_nodes VALUES {node}"):
            conn.execute(statement)
        conn.execute(
            f"INSERT INTO polarkv_entries VALUES {entry}".replace("true", "1").replace("false", "0")
        )
    for statement in (old, nodes, f"INSERT INTO polarkv_nodes VALUES {node}"):
        pg(statement)
    pg(f"INSERT INTO polarkv_entries VALUES {entry}")
    for name, url in (("sqlite", f"sqlite:///{db}"), ("pg", PG)):
        manager = cluster.start(["manager"], {"manager.metadata_url": url}, name=name)
        assert "entries=1" in manager.log()  # the old row is read, kept for its node
        manager.stop()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT tenant, key, node_id FROM polarkv_entries").fetchall() == [
            ("", key, "vm-9")
        ]
    assert pg("SELECT tenant, key, node_id FROM polarkv_entries") == [("", key, "vm-9")]


def test_a_quota_counts_what_a_tenant_is_writing(cluster: Cluster) -> None:
    url = cluster.embedded(
        slab__memory="64MiB",
        security__admin_token=ADMIN,
        security__tenants=TENANTS,
        security__tenant_quotas="team-a:4MiB",
    ).manager_url
    replies = [  # twelve separate allocations of 1 MiB, none committed yet
        post(url, "/v1/allocate", {"items": [{"key": f"{i:032x}", "size": MiB}]}, TEAM_A)
        for i in range(12)
    ]
    allocated = [r for r in replies if r["results"][0]["status"] == "allocated"]
    assert len(allocated) == 4
    data = os.urandom(MiB)
    for reply in allocated:
        entry = reply["results"][0]
        transport = TcpTransport()
        try:
            transport.write_from(region(reply, entry), memoryview(data), time.monotonic() + 5)
        finally:
            transport.close()
        body = {
            "lease": reply["lease"],
            "items": [{"key": entry["key"], "checksum": checksum(data)}],
        }
        post(url, "/v1/commit", body, TEAM_A)
    mine = stats_as(url)["tenants"]["team-a"]
    assert mine["bytes_memory"] <= 4 * MiB and mine["bytes_writing"] == 0


def test_another_tenants_writes_leave_a_tenant_its_fair_share(cluster: Cluster) -> None:
    url = cluster.embedded(
        slab__memory="32MiB", security__admin_token=ADMIN, security__tenants=TENANTS
    ).manager_url
    theirs = [os.urandom(MiB) for _ in range(8)]
    with PolarKVClient(url, chunk_tokens=CT, token=TEAM_B) as b:
        assert b.store_kv(prompt(3, 8, CT), theirs) == 8
    for i in range(31):  # 31 write leases of team-a, never committed
        post(url, "/v1/allocate", {"items": [{"key": f"{i:032x}", "size": MiB}]}, TEAM_A)
    with PolarKVClient(url, chunk_tokens=CT, token=TEAM_B) as b:
        n, views = b.load_kv(prompt(3, 8, CT))
        assert n == 8 * CT and [bytes(v) for v in views] == theirs  # its share was kept
        more = [os.urandom(MiB) for _ in range(8)]
        assert b.store_kv(prompt(4, 8, CT), more) == 8  # and it can still store
        n, views = b.load_kv(prompt(4, 8, CT))
        assert n == 8 * CT and [bytes(v) for v in views] == more


def _metrics(url: str, token: str) -> str:
    status, text = http("GET", url + "/metrics", token=token)
    assert status == 200
    return str(text)


def _events(url: str, token: str) -> list[dict[str, Any]]:
    status, body = http("GET", url + "/v1/events?limit=256", token=token)
    assert status == 200, body
    return list(body["events"])


def _corrupt_and_load(client: PolarKVClient, url: str, conv: int, token: str) -> None:
    """Store one chunk, flip its bytes in the slab's buffer, load it (a confirmed
    checksum failure: an event of the tenant's)."""
    tokens = prompt(conv, 1, CT)
    assert client.store_kv(tokens, [os.urandom(4096)]) == 1
    reply = post(url, "/v1/lookup", {"keys": client.keys(tokens)}, token)
    entry = reply["entries"][0]
    path = reply["nodes"][entry["node"]]["shm_path"]
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as buf:
        buf[entry["offset"]] ^= 0xFF
    post(url, "/v1/release", {"leases": [reply["lease"]]}, token)
    assert client.load_kv(tokens)[0] == 0


def test_tenants_see_only_their_own_series_and_events(cluster: Cluster) -> None:
    url = cluster.embedded(
        security__token=DEFAULT, security__admin_token=ADMIN, security__tenants=TENANTS
    ).manager_url
    with PolarKVClient(url, chunk_tokens=CT, token=TEAM_A) as a:
        for conv in range(300):  # 300 confirmed checksum failures of team-a's own
            _corrupt_and_load(a, url, 100 + conv, TEAM_A)
    with PolarKVClient(url, chunk_tokens=CT, token=TEAM_B) as b:
        _corrupt_and_load(b, url, 1, TEAM_B)
    wait_for(lambda: stats_as(url)["checksum_failures"] == 301, timeout=30)
    # /metrics: a tenant's token gets its own series only; the admin's every one
    b_text = _metrics(url, TEAM_B)
    assert 'tenant="team-b"' in b_text and 'tenant="team-a"' not in b_text
    assert 'tenant="default"' not in b_text
    assert 'tenant="team-a"' in _metrics(url, ADMIN)
    # /v1/events: team-a's flood pushed out nothing of team-b's, and neither sees the other's
    b_events = _events(url, TEAM_B)
    failures = [e for e in b_events if e["kind"] == "checksum_failure"]
    assert len(failures) == 1 and failures[0]["tenant"] == "team-b"
    assert any(e["kind"] == "node_joined" for e in b_events)  # the nodes' events stay too
    a_events = _events(url, TEAM_A)
    assert {e.get("tenant") for e in a_events if e["kind"] == "checksum_failure"} == {"team-a"}
    admin = _events(url, ADMIN)
    assert {"team-a", "team-b"} <= {e.get("tenant") for e in admin}
