"""`polarkv admin` against real processes: tables, --json, --watch, several shards
summed, key/delete routed and guarded by the admin token, drain, and clear failures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

from polarkv_lib.client import PolarKVClient
from tests.conftest import ROOT, Cluster, http, stats, wait_for

TOKEN, ADMIN = "reader-token", "admin-token"
CHUNK = 64 * 1024


def admin(*args: str, token: str = "", admin_token: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLARKV_")}
    if token:
        env["POLARKV_SECURITY__TOKEN"] = token
    if admin_token:
        env["POLARKV_SECURITY__ADMIN_TOKEN"] = admin_token
    return subprocess.run(
        [sys.executable, str(ROOT / "polarkv.py"), "admin", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def put_keys(url: str, n: int, token: str | None = None, seed: int = 0) -> list[str]:
    keys = [f"{seed:04x}{i:028x}" for i in range(n)]
    with PolarKVClient(url, token=token, timeout=5.0) as client:
        for i, key in enumerate(keys):
            assert client.put(key, bytes([i % 251]) * CHUNK)
    return keys


def test_tables_json_key_and_delete(cluster: Cluster) -> None:
    node = cluster.embedded(security__token=TOKEN, security__admin_token=ADMIN)
    url = node.manager_url
    keys = put_keys(url, 5, token=TOKEN)
    done = admin("stats", "--url", url, token=TOKEN)
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()[:2]
    assert header.split()[:2] == ["SHARD", "NODES"] and "1 up" in row and "5/0" in row
    done = admin("stats", "--json", "--url", url, token=TOKEN)
    doc = orjson.loads(done.stdout)
    truth = http("GET", url + "/v1/stats", token=TOKEN)[1]
    for name in ("keys_memory", "bytes_memory", "capacity_memory", "commits", "nodes"):
        assert doc[name] == truth[name], name
    assert doc["shards"] == [{"url": url, "stats": doc["shards"][0]["stats"]}]

    done = admin("nodes", "--url", url, token=TOKEN)
    assert done.returncode == 0 and node.info["node_id"] in done.stdout and "alive" in done.stdout
    done = admin("key", keys[0], "--url", url, token=TOKEN)
    assert done.returncode == 0 and "memory" in done.stdout and f"{CHUNK:,}" in done.stdout
    assert (
        orjson.loads(admin("key", keys[0], "--json", "--url", url, token=TOKEN).stdout)["size"]
        == CHUNK
    )

    # deleting needs the admin token; the reader token is refused and nothing changes
    done = admin("delete", keys[0], "--url", url, token=TOKEN)
    assert done.returncode == 3 and "403" in done.stderr
    assert http("GET", f"{url}/v1/keys/{keys[0]}", token=TOKEN)[0] == 200
    done = admin("delete", keys[0], "--url", url, token=TOKEN, admin_token=ADMIN)
    assert done.returncode == 0 and f"deleted {keys[0]}" in done.stdout
    done = admin("key", keys[0], "--url", url, token=TOKEN)
    assert done.returncode == 3 and "404" in done.stderr
    assert admin("stats", "--url", url).returncode == 3  # no token: refused, said once
    assert stats_with(url)["keys_memory"] == 4


def stats_with(url: str) -> dict[str, int]:
    return dict(http("GET", url + "/v1/stats", token=TOKEN)[1])


def test_bad_arguments_are_one_line_and_exit_2(cluster: Cluster) -> None:
    cases: list[tuple[tuple[str, ...], str]] = [
        (("key", "zz"), "a key is 32 lowercase hex characters"),
        (("delete", "../etc/passwd"), "a key is 32 lowercase hex characters"),
        (("stats", "--url", "ftp://x"), "not an http(s) URL"),
        (("stats", "--interval", "0"), "--interval"),
    ]
    for args, message in cases:
        done = admin(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr and done.stdout == ""


def test_several_shards_are_summed_with_a_row_each(cluster: Cluster) -> None:
    a = cluster.embedded()
    b = cluster.embedded()
    put_keys(a.manager_url, 3, seed=1)
    put_keys(b.manager_url, 4, seed=2)
    urls = f"{a.manager_url},{b.manager_url}"
    doc = orjson.loads(admin("stats", "--json", "--url", urls).stdout)
    sa, sb = stats(a.manager_url), stats(b.manager_url)
    assert doc["keys_memory"] == sa["keys_memory"] + sb["keys_memory"] == 7
    assert doc["capacity_memory"] == sa["capacity_memory"] + sb["capacity_memory"]
    assert doc["nodes"] == 2  # two distinct nodes
    assert [s["url"] for s in doc["shards"]] == [a.manager_url, b.manager_url]
    table = admin("stats", "--url", urls).stdout.splitlines()
    assert len(table) == 4 and table[-1].startswith("total") and "7/0" in table[-1]
    nodes = orjson.loads(admin("nodes", "--json", "--url", urls).stdout)["nodes"]
    assert sorted(n["id"] for n in nodes) == sorted([a.info["node_id"], b.info["node_id"]])

    # one shard down: its row says so, the others still count, the exit code tells
    done = admin("stats", "--url", f"{urls},http://127.0.0.1:9")
    assert done.returncode == 3 and "cannot reach the manager" in done.stderr
    assert "unreachable" in done.stdout and "7/0" in done.stdout.splitlines()[4]


def test_watch_refreshes_with_rates(cluster: Cluster) -> None:
    node = cluster.embedded()
    done = admin("stats", "--watch", "--interval", "0.3", "--count", "3", "--url", node.manager_url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("SHARD") == 3 and done.stdout.count("stores/s") == 2
    done = admin(
        "nodes", "--watch", "--json", "--interval", "0.2", "--count", "2", "--url", node.manager_url
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(orjson.loads(line)["nodes"] for line in lines)


def test_drain_empties_memory_and_keeps_the_disk_copies(cluster: Cluster, tmp_path: Path) -> None:
    manager = cluster.manager()
    url = manager.manager_url
    disk = tmp_path / "node-a-disk"
    node_a = {
        "slab.manager_url": url,
        "slab.node_id": "node-a",
        "disk.paths": str(disk),
        "slab.memory": "32MiB",
    }
    a = cluster.start(["slab", "disk"], node_a, name="a")
    cluster.start(["slab"], {"slab.manager_url": url, "slab.memory": "32MiB"}, name="b")
    wait_for(lambda: len(http("GET", url + "/v1/nodes")[1]["nodes"]) == 2)
    keys = put_keys(url, 40, seed=3)
    on_a = [k for k in keys if http("GET", f"{url}/v1/keys/{k}")[1]["node"] == "node-a"]
    assert on_a, "placement put nothing on node-a"

    done = admin("drain", "nope", "--url", url)
    assert done.returncode == 3 and "no such live node" in done.stderr
    done = admin("drain", "node-a", "--url", url, "--timeout", "30")
    assert done.returncode == 0, done.stderr
    assert "node-a drained" in done.stdout and f"{len(on_a):,} keys stay on its disk" in done.stdout
    view = next(n for n in http("GET", url + "/v1/nodes")[1]["nodes"] if n["id"] == "node-a")
    assert view["draining"] and view["keys_memory"] == 0 and view["keys_disk"] == len(on_a)
    assert "draining" in admin("nodes", "--url", url).stdout
    assert all(http("GET", f"{url}/v1/keys/{k}")[1]["tiers"] == ["disk"] for k in on_a)
    # new writes go elsewhere
    fresh = put_keys(url, 20, seed=4)
    assert all(http("GET", f"{url}/v1/keys/{k}")[1]["node"] != "node-a" for k in fresh)
    events = http("GET", url + "/v1/events")[1]["events"]
    assert any(e["kind"] == "node_draining" and e["subject"] == "node-a" for e in events)

    # stopped and started again, it reports its files: nothing on its disk was lost
    assert a.stop() == 0
    cluster.start(["slab", "disk"], node_a, name="a-again")
    with PolarKVClient(url, timeout=5.0) as client:

        def all_back() -> bool:
            return all(client.get(k) == bytes([keys.index(k) % 251]) * CHUNK for k in on_a)

        wait_for(all_back, timeout=20)


def test_keys_are_asked_of_their_own_shard(cluster: Cluster) -> None:
    grant_key = "g" * 32
    shards = [
        cluster.manager(manager__shard=f"{i}/2", security__grant_key=grant_key) for i in range(2)
    ]
    urls = [s.manager_url for s in shards]
    cluster.start(["slab"], {"slab.manager_url": ",".join(urls), "security.grant_key": grant_key})
    for url in urls:
        wait_for(lambda url=url: len(http("GET", url + "/v1/nodes")[1]["nodes"]) == 1)
    low, high = "0" * 32, "f" * 32  # one key in each shard's range
    with PolarKVClient(",".join(urls), timeout=5.0) as client:
        assert client.put(low, b"l" * 1000) and client.put(high, b"h" * 1000)
    joined = ",".join(urls)
    for key in (low, high):
        done = admin("key", key, "--json", "--url", joined)
        assert done.returncode == 0, done.stderr
        assert orjson.loads(done.stdout)["key"] == key
    doc = orjson.loads(admin("stats", "--json", "--url", joined).stdout)
    assert doc["keys_memory"] == 2 and doc["nodes"] == 1
    assert [s["stats"]["keys_memory"] for s in doc["shards"]] == [1, 1]
    nodes = orjson.loads(admin("nodes", "--json", "--url", joined).stdout)["nodes"]
    assert len(nodes) == 1 and nodes[0]["shards"] == [0, 1]
    assert admin("delete", high, "--url", joined).returncode == 0
    assert http("GET", f"{urls[1]}/v1/keys/{high}")[0] == 404
    assert http("GET", f"{urls[0]}/v1/keys/{low}")[0] == 200
