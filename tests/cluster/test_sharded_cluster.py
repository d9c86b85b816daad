"""The must-show cluster: 2 manager shards, 3 memory VMs, 2 client VMs on capped links.
Client VM A stores, client VM B loads byte-exact; both shards hold keys; every memory VM
served client traffic. Then failures: a killed memory VM costs only its entries, a
killed shard only its range, and a restarted shard gets its range back."""

from __future__ import annotations

import signal
import sys
import time

import orjson

from polarkv_lib.cluster.harness import Cluster
from polarkv_lib.keys import chunk_keys
from polarkv_lib.shards import shard_of
from polarkv_lib.workload import CHUNK_TOKENS
from polarkv_lib.workload import prompt_tokens as tokens
from tests.cluster.conftest import MakeCluster, run_client

SIZE = 256 * 1024
FAST = ("log.level=warning", "manager.heartbeat_ttl=1s", "slab.heartbeat_interval=200ms")


def prompt_keys(namespace: str, prompt: int, chunks: int) -> list[str]:
    return chunk_keys(tokens(prompt, chunks), namespace, CHUNK_TOKENS)


def owner_node(cluster: Cluster, key: str) -> str:
    url = cluster.spec.manager_urls()[shard_of(key, cluster.spec.shards)]
    return str(cluster.admin(url, f"/v1/keys/{key}")["node"])


def wait_dead(cluster: Cluster, node: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for url in cluster.spec.manager_urls():
        while not any(
            n["id"] == node and n["state"] == "dead"
            for n in cluster.admin(url, "/v1/nodes")["nodes"]
        ):
            assert time.monotonic() < deadline, f"{url} still lists {node} alive"
            time.sleep(0.1)


def wait_flushed(cluster: Cluster, url: str, timeout: float = 10.0) -> None:
    """Until a write-behind round that began after the call is written (docs/API.md)."""
    taken = cluster.admin(url, "/healthz")["metadata_taken_seq"]
    deadline = time.monotonic() + timeout
    while cluster.admin(url, "/healthz")["metadata_flushed_seq"] <= taken:
        assert time.monotonic() < deadline, f"{url}: no metadata flush in {timeout}s"
        time.sleep(0.05)


def test_two_shards_three_memory_vms_two_clients(make_cluster: MakeCluster) -> None:
    cluster = make_cluster("pkvts", "10.77.15", shards=2, memory_vms=3, client_vms=2)
    mem = [vm.name for vm in cluster.spec.vms() if vm.role == "memory"]
    before = {vm: cluster.counters(vm) for vm in mem}
    stored = run_client(cluster, "cli0", "store", "must-show", chunks=64, size=SIZE)
    loaded = run_client(cluster, "cli1", "load", "must-show", chunks=64, size=SIZE)
    assert (stored["hostname"], loaded["hostname"]) == ("pkvts-cli0", "pkvts-cli1")
    assert stored["chunks"] == 64
    assert loaded["chunks"] == 64 and loaded["byte_exact"]
    keys = prompt_keys("must-show", 0, 64)
    per_shard = [sum(1 for k in keys if shard_of(k, 2) == i) for i in range(2)]
    held = [cluster.admin(url, "/v1/stats")["keys_memory"] for url in cluster.spec.manager_urls()]
    assert held == per_shard and min(held) > 0
    for url in cluster.spec.manager_urls():  # every slab registered with every shard
        assert (
            sorted(
                n["id"] for n in cluster.admin(url, "/v1/nodes")["nodes"] if n["state"] == "alive"
            )
            == mem
        )
    # The operator's view from a client VM: each shard's row and their sum.
    admin = cluster.run_in(
        "cli1", [sys.executable, "-m", "polarkv", "admin", "stats", "--json"], 60
    )
    report = orjson.loads(admin.stdout)
    assert report["keys_memory"] == 64
    assert [row["stats"]["keys_memory"] for row in report["shards"]] == per_shard
    holders = {owner_node(cluster, k) for k in keys}
    assert holders == set(mem)
    for vm in mem:  # each served its share of the load to cli1 over its own link
        assert (cluster.counters(vm) - before[vm]).sent >= SIZE


def test_a_killed_memory_vm_costs_only_its_entries(make_cluster: MakeCluster) -> None:
    cluster = make_cluster("pkvtk", "10.77.16", shards=2, memory_vms=3, client_vms=1, settings=FAST)
    prompts, chunks = 12, 4
    assert (
        run_client(cluster, "cli0", "store", "kill", prompts=prompts, chunks=chunks, size=SIZE)[
            "chunks"
        ]
        == prompts * chunks
    )
    holder = {
        k: owner_node(cluster, k) for p in range(prompts) for k in prompt_keys("kill", p, chunks)
    }
    cluster.kill("mem0", signal.SIGKILL)
    wait_dead(cluster, "mem0")
    expected = []
    for p in range(prompts):
        on_mem0 = [holder[k] == "mem0" for k in prompt_keys("kill", p, chunks)]
        expected.append(on_mem0.index(True) if True in on_mem0 else chunks)
    assert expected != [chunks] * prompts  # mem0 held something
    loaded = run_client(cluster, "cli0", "load", "kill", prompts=prompts, chunks=chunks, size=SIZE)
    assert loaded["per_prompt"] == expected and loaded["byte_exact"]
    # New stores go to the survivors.
    fresh = run_client(
        cluster, "cli0", "store", "kill", prompts=6, first_prompt=100, chunks=chunks, size=SIZE
    )
    assert fresh["chunks"] == 6 * chunks
    assert {
        owner_node(cluster, k) for p in range(100, 106) for k in prompt_keys("kill", p, chunks)
    } <= {"mem1", "mem2"}


def test_a_killed_shard_costs_only_its_range_and_restarts(make_cluster: MakeCluster) -> None:
    cluster = make_cluster("pkvtr", "10.77.17", shards=2, memory_vms=2, client_vms=1, settings=FAST)
    prompts, chunks = 12, 4
    run_client(cluster, "cli0", "store", "shard", prompts=prompts, chunks=chunks, size=SIZE)
    wait_flushed(cluster, cluster.spec.manager_urls()[1])  # shard 1's rows are stored
    cluster.kill("mgr1", signal.SIGKILL)
    expected = []
    for p in range(prompts):
        in_1 = [shard_of(k, 2) == 1 for k in prompt_keys("shard", p, chunks)]
        expected.append(in_1.index(True) if True in in_1 else chunks)
    assert expected != [chunks] * prompts
    started = time.monotonic()
    loaded = run_client(
        cluster, "cli0", "load", "shard", prompts=prompts, chunks=chunks, size=SIZE, timeout=2.0
    )
    assert loaded["per_prompt"] == expected and loaded["byte_exact"]
    assert time.monotonic() - started < 30  # each load bounded by the client's timeout
    cluster.start_service("mgr1")
    cluster.wait_joined()
    reloaded = run_client(
        cluster, "cli0", "load", "shard", prompts=prompts, chunks=chunks, size=SIZE
    )
    assert reloaded["per_prompt"] == [chunks] * prompts and reloaded["byte_exact"]
