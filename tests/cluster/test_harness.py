"""The harness itself: VMs that are separate hosts on capped links, and a teardown that
leaves nothing behind, also after a crash."""

from __future__ import annotations

import signal

from polarkv_lib.cluster import netns, procs
from polarkv_lib.cluster.harness import Cluster
from tests.cluster.conftest import MakeCluster, run_client


def test_vms_are_hosts_on_capped_links(make_cluster: MakeCluster) -> None:
    cluster = make_cluster("pkvta", "10.77.11", memory_vms=2, client_vms=2)
    for vm in cluster.spec.vms():
        assert "htb" in netns.qdisc_kinds(vm.netns)
        assert netns.run("tc", "-n", vm.netns, "qdisc", "show", "dev", "eth0").stdout.startswith(
            "qdisc htb"
        )
    before = {vm.name: cluster.counters(vm.name) for vm in cluster.spec.vms()}
    stored = run_client(cluster, "cli0", "store", "harness", chunks=16, size=256 * 1024)
    loaded = run_client(cluster, "cli1", "load", "harness", chunks=16, size=256 * 1024)
    assert stored["hostname"] == "pkvta-cli0" and loaded["hostname"] == "pkvta-cli1"
    assert stored["chunks"] == 16
    assert loaded["chunks"] == 16 and loaded["byte_exact"]
    # The bytes crossed the links (tcp between hosts, not shm): each client moved the
    # whole working set through its own interface, one way each.
    sent = cluster.counters("cli0") - before["cli0"]
    received = cluster.counters("cli1") - before["cli1"]
    assert sent.sent >= 16 * 256 * 1024
    assert received.received >= 16 * 256 * 1024
    served = sum((cluster.counters(f"mem{i}") - before[f"mem{i}"]).sent for i in range(2))
    assert served >= 16 * 256 * 1024
    # The link counters tell memory-VM peers apart: the client VMs received the data
    # from memory VMs, the memory VMs nothing from each other.
    assert cluster.peer_bytes("cli1") >= 16 * 256 * 1024
    assert cluster.peer_bytes("mem0") + cluster.peer_bytes("mem1") < 64 * 1024
    status = cluster.status()
    assert status["phase"] == "up"
    assert {row["vm"]: row.get("running") for row in status["vms"] if row["role"] != "client"} == {
        "mgr0": True,
        "mem0": True,
        "mem1": True,
    }


def test_up_after_a_crash_and_down_leave_nothing(make_cluster: MakeCluster) -> None:
    first = make_cluster("pkvtb", "10.77.12", memory_vms=1, client_vms=1)
    old_pids = [(rec["pid"], rec["started"]) for rec in first._procs.values()]
    first.kill("mem0", signal.SIGKILL)  # a crashed memory VM leaves its buffer file behind
    # The controlling process "crashed" too: a new one, knowing only the state directory,
    # brings the same cluster up again.
    second = Cluster.load("pkvtb", first.dir.parent)
    second.up()
    assert not any(procs.alive(pid, started) for pid, started in old_pids)
    assert run_client(second, "cli0", "store", "again", chunks=4, size=64 * 1024)["chunks"] == 4
    removed = second.down()
    assert len(removed["namespaces"]) == 3
    assert second.leftovers() == {
        "namespaces": [],
        "pids": [],
        "links": [],
        "qdiscs": [],
        "buffers": [],
    }
    assert not second.state_file.exists()
