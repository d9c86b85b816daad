"""Tier locally, serve globally, on capped links: with memory pushed past the watermark,
a memory VM's offloads and reloads never cross the network; in the global-pools layout
(experiment only: each VM's disk tier on the next VM) they all do."""

from __future__ import annotations

import sys
import time
from typing import Any

import orjson

from polarkv_lib.cluster.harness import Cluster
from tests.cluster.conftest import MakeCluster

PROMPTS, CHUNKS, SIZE = 12, 8, 512 * 1024
WORKING_SET = PROMPTS * CHUNKS * SIZE  # 48 MiB over 2 x 16 MiB of memory


def workload(cluster: Cluster, phase: str) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "polarkv_lib.cluster.workload",
        phase,
        "--prompts",
        str(PROMPTS),
        "--chunks",
        str(CHUNKS),
        "--size",
        str(SIZE),
        "--timeout",
        "10",
    ]
    report = orjson.loads(cluster.run_in("cli0", argv, 120).stdout.splitlines()[-1])
    assert isinstance(report, dict)
    return report


def disk_bytes(cluster: Cluster) -> int:
    """Bytes the memory VMs' disk roles wrote and read, as their slabs report them."""
    url = cluster.spec.manager_urls()[0]
    nodes = cluster.admin(url, "/v1/nodes")["nodes"]
    return sum(
        int(n["reported"].get("offload_bytes", 0)) + int(n["reported"].get("reload_bytes", 0))
        for n in nodes
    )


def run_layout(
    make_cluster: MakeCluster, name: str, subnet: str, global_pools: bool
) -> tuple[int, int]:
    cluster = make_cluster(
        name,
        subnet,
        memory_vms=2,
        client_vms=1,
        slab_memory="16MiB",
        disk_capacity="256MiB",
        global_pools=global_pools,
        settings=("log.level=warning", "slab.heartbeat_interval=200ms"),
    )
    stored = workload(cluster, "fill")
    loaded = workload(cluster, "load")
    assert stored["chunks_stored"] == PROMPTS * CHUNKS
    assert loaded["chunks_hit"] == PROMPTS * CHUNKS and loaded["wrong_bytes"] == 0
    # The slabs' disk counters reach the manager with their heartbeats (every 200 ms).
    deadline = time.monotonic() + 15
    while (moved := disk_bytes(cluster)) < WORKING_SET and time.monotonic() < deadline:
        time.sleep(0.2)
    between = sum(cluster.peer_bytes(vm) for vm in ("mem0", "mem1"))
    return moved, between


def test_tiering_stays_inside_each_memory_vm(make_cluster: MakeCluster) -> None:
    moved, between = run_layout(make_cluster, "pkvtt", "10.77.13", global_pools=False)
    # Memory was overrun three halves over: offloads, and reloads for the load back.
    assert moved >= WORKING_SET
    assert between < 256 * 1024  # ~0: no memory VM sent another a byte of KV


def test_global_pools_move_the_tiering_bytes_over_the_network(make_cluster: MakeCluster) -> None:
    moved, between = run_layout(make_cluster, "pkvtg", "10.77.14", global_pools=True)
    assert moved >= WORKING_SET
    assert between >= moved  # every offloaded and reloaded byte crossed a link
