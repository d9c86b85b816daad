"""The manager core at 200k entries: allocating on a full node, planning offloads and
evicting files cost what they free (however many of the entries are being read), and a
restore runs in short slices.

The bound is on work, not time: the LRUs are swapped for dicts that count the entries
handed out by their iterators, so a plan that walks the whole table fails however fast
the machine is. (The timed version, up to 1M entries, is `polarkv bench manager`.)
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Iterator

import pytest

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import AllocStatus, Entry, Node
from polarkv_lib.manager.rows import NodeRow
from tests.unit.drive import allocate, confirm_all, lookup, synthetic_rows

N = 200_000
SIZE = 4096
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class CountingLRU(OrderedDict[str, Entry]):
    """An LRU that counts the entries its iterators hand out."""

    visited = 0

    def values(self) -> Iterator[Entry]:  # type: ignore[override]  # only ever iterated
        for value in super().values():
            CountingLRU.visited += 1
            yield value

    def __iter__(self) -> Iterator[str]:
        for key in super().__iter__():
            CountingLRU.visited += 1
            yield key


def counted(node: Node) -> None:
    node.lru, node.clean, node.disk_lru = (
        CountingLRU(node.lru),
        CountingLRU(node.clean),
        CountingLRU(node.disk_lru),
    )
    CountingLRU.visited = 0


def full_core(count: int, *, disk: bool = False, on_disk: bool = False) -> tuple[Metadata, Node]:
    md = Metadata(5.0, 30.0, 3.0, rng=random.Random(1))
    row = NodeRow(
        "n1", 1, "127.0.0.1:1", count * SIZE, (count * SIZE * 4) if disk else 0, "", "h", "tcp"
    )
    md.snapshots.restore([row], synthetic_rows(row, count, SIZE, on_disk=on_disk))
    started = time.perf_counter()
    node, _ = md.register("n1", 1, row.address, row.capacity, "", "h", ["tcp"], row.disk_capacity)
    assert confirm_all(md, "n1", 1) == count  # its buffer survived: every row still holds
    assert md.snapshots.restoring and node.restoring  # nothing restored before the slab answered
    slices = [time.perf_counter() - started]
    restored = [len(node.entries)]
    while True:
        started = time.perf_counter()
        more = md.snapshots.restore_step()
        slices.append(time.perf_counter() - started)
        restored.append(len(node.entries) - sum(restored))
        if not more:
            break
    assert len(node.entries) == count
    # The restore is cut into slices of bounded work between requests (the old one did
    # all of it in one piece that blocked the loop for most of a minute). Work is what
    # is asserted; time only loosely, by the median slice, because a collector pause or
    # a loaded machine can stretch any single one.
    assert (
        max(restored) <= md.snapshots.restore_slice
        and len(slices) >= count // md.snapshots.restore_slice
    )
    slices.sort()
    assert slices[len(slices) // 2] < 0.25, slices[-5:]
    return md, node


def new_keys(n: int) -> list[str]:
    return [f"{i:032x}" for i in range(n)]


def lease_most(md: Metadata, node: Node) -> str:
    """Nine in ten of the node's entries, the least recently used ones, are read now."""
    cold = list(node.lru)[: N * 9 // 10]
    hits, lease = lookup(md, cold, take_lease=True)
    assert len(hits) == len(cold) and lease is not None
    assert len(node.lru) == N - len(cold), len(node.lru)  # out of the eviction order while read
    return lease


@pytest.mark.parametrize("leased", [False, True])
def test_allocating_on_a_full_node_evicts_only_what_it_needs(leased: bool) -> None:
    md, node = full_core(N)
    assert node.allocator.free == 0
    if leased:  # the walk never steps over entries being read
        lease_most(md, node)
    counted(node)
    for batch in range(10):
        keys = new_keys(64 * (batch + 1))[-64:]
        results, lease = allocate(md, [(k, SIZE) for k in keys])
        assert all(r.status is AllocStatus.ALLOCATED for r in results) and lease
        md.commit(lease, [(k, "0123456789abcdef") for k in keys])
    assert md.counters.evictions == 640
    assert CountingLRU.visited <= 4 * 640, CountingLRU.visited


def test_offload_planning_walks_only_what_it_offloads() -> None:
    md, node = full_core(N, disk=True)  # all in memory, no files: way past the watermark
    counted(node)
    results, _ = allocate(md, [(k, SIZE) for k in new_keys(64)])
    assert {r.status for r in results} == {AllocStatus.NO_SPACE}
    assert CountingLRU.visited <= 64, CountingLRU.visited  # nothing clean to drop: no walk
    CountingLRU.visited = 0
    md.plan_tiering()
    orders = md.take_orders("n1")
    # down to the low watermark (80%): a fifth of the table, and nothing more is looked at
    assert len(orders) == N // 5
    assert CountingLRU.visited <= len(orders) + 64, CountingLRU.visited
    CountingLRU.visited = 0
    for _ in range(5):
        md.expire()  # in-flight offloads are found without a walk over the LRU
        md.plan_tiering()
    assert CountingLRU.visited == 0


def test_a_full_disk_deletes_only_the_files_it_must() -> None:
    md, node = full_core(N, disk=True, on_disk=True)
    node.disk_capacity = node.disk_used  # the disk is full now
    counted(node)
    used = node.allocator.used
    md.plan_tiering()
    orders = md.take_orders("n1")
    deleted = [o for o in orders if o.op == "delete"]
    released = (used - node.allocator.used) // SIZE  # clean memory copies dropped
    assert md.counters.disk_evictions == len(deleted) > 0
    assert node.disk_used <= node.disk_capacity * (md.disk_high - 0.05)
    # the work is what the plan did: files deleted, copies dropped, offloads ordered
    assert CountingLRU.visited <= 2 * (len(orders) + released) + 64, (
        CountingLRU.visited,
        len(orders),
        released,
    )


def test_offloading_past_leased_entries_walks_only_what_it_offloads() -> None:
    md, node = full_core(N, disk=True)
    lease = lease_most(md, node)
    counted(node)
    results, _ = allocate(md, [(k, SIZE) for k in new_keys(64)])
    assert {r.status for r in results} == {AllocStatus.NO_SPACE}
    md.plan_tiering()
    orders = md.take_orders("n1")
    # the low watermark is out of reach (the leased nine tenths stay): everything else
    # goes, and the leased entries are never looked at
    assert len(orders) == N // 10
    assert CountingLRU.visited <= len(orders) + 64, CountingLRU.visited
    CountingLRU.visited = 0
    md.release([lease])  # back in the order, one at a time: no walk either
    assert CountingLRU.visited == 0 and len(node.lru) == N * 9 // 10
