"""Tiering in the manager's metadata core (polarkv_lib/manager/metadata.py): per-node
memory and disk tiers, offload / reload / delete orders and their answers, driven by a
fake clock. No I/O: the tests play the disk role by answering the orders themselves.

Paired sharding (PAPER "Architecture", DESIGN §6): every order goes to the node that
holds the entry, offload and reload stay inside that node, a disk hit reloads into the
same node's memory.
"""

from __future__ import annotations

import hashlib
import itertools
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import (
    ORDER_TIMEOUT,
    AllocStatus,
    Entry,
    Node,
    State,
)
from polarkv_lib.wire.orders import Order, TierOp

KiB = 1024
CHUNK = 64 * KiB  # its own size class
FILE = CHUNK + 4096  # what a disk role reports for a chunk's file (header + payload)
READ_TTL, WRITE_TTL, HB_TTL = 5.0, 30.0, 3.0
SUM = "0123456789abcdef"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(i: int | str) -> str:
    return hashlib.blake2b(f"tier-{i}".encode(), digest_size=16).hexdigest()


K = [key(i) for i in range(64)]
X, Y, Z = key("X"), key("Y"), key("Z")


def new_md(**kw: float) -> tuple[Metadata, FakeClock]:
    clock = FakeClock()
    return Metadata(READ_TTL, WRITE_TTL, HB_TTL, clock=clock, rng=random.Random(0), **kw), clock  # type: ignore[arg-type]


def add(md: Metadata, node_id: str, chunks: int, disk_files: int = 0, incarnation: int = 1) -> Node:
    node, new = md.register(
        node_id, incarnation, f"{node_id}:1", chunks * CHUNK, "", "host", ["tcp"], disk_files * FILE
    )
    assert new and node.has_disk == (disk_files > 0)
    return node


def make(chunks: int = 10, disk_files: int = 20, **kw: float) -> tuple[Metadata, FakeClock, Node]:
    """One node with a disk role: 10 chunks of memory (the high watermark, 0.9, leaves
    room for 9; the low one, 0.8, for 8) and room for 20 files."""
    md, clock = new_md(**kw)
    return md, clock, add(md, "d1", chunks, disk_files)


def store(md: Metadata, keys: list[str], size: int = CHUNK) -> list[Entry]:
    """Allocate and commit one prompt's chunks as one batch."""
    results, lease = md.allocate([(k, size) for k in keys])
    assert [r.status for r in results] == [AllocStatus.ALLOCATED] * len(keys), results
    assert lease is not None
    assert md.commit(lease, [(k, SUM) for k in keys]) == dict.fromkeys(keys, "committed")
    return [md.get(k) for k in keys]  # type: ignore[misc]


def fill(md: Metadata, keys: list[str]) -> None:
    for k in keys:  # one prompt each: the first one stored is the least recently used
        store(md, [k])


def ops(orders: list[Order]) -> list[tuple[str, str]]:
    return [(o.op, o.key) for o in orders]


def answer(md: Metadata, orders: list[Order], ok: bool = True, reason: str = "") -> None:
    """Play the disk role: report every offload / reload order done (or failed)."""
    for o in orders:
        if o.op == "offload":
            md.offload_done(o.node, o.key, o.gen, ok, reason, FILE if ok else 0)
        elif o.op == "reload":
            md.reload_done(o.node, o.key, o.gen, ok, reason)


def tiers(md: Metadata, k: str) -> list[str]:
    view = md.describe(k)
    assert view is not None
    return view["tiers"]  # type: ignore[no-any-return]


def adopt(md: Metadata, node: Node, keys: list[str]) -> list[Entry]:
    """Disk-only entries, as a restarted slab reports its files."""
    assert md.adopt(node.node_id, node.incarnation, [(k, CHUNK, SUM, FILE) for k in keys]) == []
    return [md.get(k) for k in keys]  # type: ignore[misc]


def order_for(entry: Entry, op: str) -> Order:
    return Order(
        TierOp(op),
        entry.key,
        entry.gen,
        entry.node.node_id,
        entry.offset,
        entry.size,
        entry.alloc_size,
        entry.checksum,
    )


# -- planning -----------------------------------------------------------------------------


def test_plan_tiering_orders_only_nodes_with_a_disk() -> None:
    md, _ = new_md()
    d = add(md, "d1", 10, disk_files=20)
    p = add(md, "p1", 4)
    fill(md, K[:13])
    assert d.allocator.used == 9 * CHUNK and p.allocator.used == 4 * CHUNK
    assert md.plan_tiering() == ["d1"]
    assert p.orders == [] and md.take_orders("p1") == []
    orders = md.take_orders("d1")
    assert orders and all(o.op == "offload" and o.node == "d1" for o in orders)
    assert all(md.get(o.key).node is d for o in orders)  # type: ignore[union-attr]
    assert md.take_orders("d1") == []  # drained
    assert md.take_orders("nope") == []


def test_no_orders_below_the_high_watermark() -> None:
    md, _, d = make()
    fill(md, K[:8])
    assert md.plan_tiering() == [] and d.orders == []  # 8 used + the next chunk fits under 9
    store(md, [K[8]])  # now the next chunk would not fit
    assert md.plan_tiering() == ["d1"]
    assert ops(md.take_orders("d1")) == [("offload", K[0])]  # down to the low watermark: 8


def test_watermarks_are_configurable() -> None:
    md, _, d = make(memory_high=0.5, memory_low=0.3)
    fill(md, K[:5])
    results, _ = md.allocate([(K[5], CHUNK)])
    assert results[0].status is AllocStatus.NO_SPACE
    assert d.allocator.used == 5 * CHUNK
    md.plan_tiering()
    assert ops(md.take_orders("d1")) == [("offload", k) for k in K[:2]]  # 5 -> 3 chunks


def test_offload_takes_lru_entries_tail_of_a_prefix_first() -> None:
    md, _, d = make(memory_low=0.5)  # plan down to 5 chunks
    p, q = K[0:5], K[5:9]
    store(md, p)
    store(md, q)
    # a batch enters the LRU back to front: a prompt's first chunk is its most recent one
    assert list(d.lru) == p[::-1] + q[::-1]
    md.lookup([p[0], p[1]], take_lease=False)  # a reader used p's head again
    assert list(d.lru) == [p[4], p[3], p[2], *q[::-1], p[1], p[0]]
    assert md.plan_tiering() == ["d1"]
    orders = md.take_orders("d1")
    assert ops(orders) == [("offload", k) for k in (p[4], p[3], p[2], q[3])]
    for o in orders:
        e = md.get(o.key)
        assert e is not None and o == order_for(e, "offload")
        assert e.offloading and e.in_memory and not e.on_disk
        assert md.describe(e.key)["offloading"] is True  # type: ignore[index]
    assert d.offloading_bytes == 4 * CHUNK and md.stats()["bytes_offloading"] == 4 * CHUNK
    # orders in flight count as done: planning again asks for nothing more
    assert md.plan_tiering() == [] and d.orders == []


def test_allocate_touches_a_restored_prefix_back_to_front() -> None:
    md, _, d = make(memory_low=0.7)
    fill(md, K[:9])
    md.allocate([(K[2], CHUNK), (K[3], CHUNK)])  # a writer re-storing K2, K3: they exist
    assert list(d.lru)[-2:] == [K[3], K[2]]
    md.plan_tiering()
    assert ops(md.take_orders("d1")) == [("offload", K[0]), ("offload", K[1])]


def test_offload_skips_leased_offloading_and_writing_entries() -> None:
    md, _, d = make()
    fill(md, [K[0], K[1]])
    _, lease = md.lookup([K[0]], take_lease=True)
    md.lookup([K[1]], take_lease=False)  # the leased K0 is the least recently used again
    assert lease is not None and list(d.lru) == [K[0], K[1]]
    _, writing = md.allocate([(k, CHUNK) for k in K[2:9]])  # 7 chunks still being written
    assert writing is not None and d.allocator.used == 9 * CHUNK
    md.plan_tiering()
    assert ops(md.take_orders("d1")) == [("offload", K[1])]  # not K0 (leased), not the writes
    assert not md.get(K[0]).offloading  # type: ignore[union-attr]
    # K1 is in flight and K0 still leased: nothing else is a candidate
    md.allocate([(K[9], CHUNK)])
    md.plan_tiering()
    assert md.take_orders("d1") == []


# -- the memory cap ------------------------------------------------------------------------


def test_disk_node_memory_stays_under_the_high_watermark() -> None:
    md, _, d = make()
    limit = int(d.capacity * md.memory_high)
    fill(md, K[:9])
    assert d.allocator.used == limit == 9 * CHUNK
    results, _ = md.allocate([(K[9], CHUNK)])
    assert results[0].status is AllocStatus.NO_SPACE  # rather than the 10th chunk
    assert d.pressure >= CHUNK
    results, _ = md.allocate([(K[10], 2 * CHUNK)])  # larger than the gap between watermarks
    assert results[0].status is AllocStatus.NO_SPACE
    assert d.pressure >= 2 * CHUNK
    assert d.allocator.used == limit
    assert md.counters.evictions == 0 and md.counters.no_space == 2
    assert all(md.get(k) is not None for k in K[:9])  # nothing was evicted for it
    # the next plan makes room for what was refused, and forgets the pressure
    md.plan_tiering()
    answer(md, md.take_orders("d1"))
    assert d.pressure == 0
    results, _ = md.allocate([(K[10], 2 * CHUNK)])
    assert results[0].status is AllocStatus.ALLOCATED
    assert d.allocator.used <= limit


def test_nodes_without_a_disk_still_evict() -> None:
    md, _ = new_md()
    d = add(md, "d1", 10, disk_files=20)
    p = add(md, "p1", 4)
    fill(md, K[:20])  # 13 fit; the rest evict on p1, never on d1
    assert d.allocator.used == 9 * CHUNK <= int(d.capacity * md.memory_high)
    assert p.allocator.used == p.capacity
    assert md.counters.evictions == 7
    assert len(d.lru) == 9 and all(e.node is d for e in d.lru.values())
    assert md.stats()["keys_memory"] == 13


def test_writes_placed_elsewhere_leave_no_offload_pressure_behind() -> None:
    md, _ = new_md()
    add(md, "d1", 10, disk_files=20)
    add(md, "p1", 4)
    fill(md, K[:20])  # 7 of these were placed on p1 (evicting there), none refused
    assert md.counters.no_space == 0
    md.plan_tiering()
    # d1 is at its high watermark: one offload takes it to the low one (8 chunks)
    assert len(md.take_orders("d1")) == 1


def test_quarantined_writes_count_against_the_cap() -> None:
    md, clock, d = make()
    fill(md, K[:5])
    _, lease = md.allocate([(k, CHUNK) for k in K[5:9]])
    assert lease is not None
    md.abort(lease, None)  # 4 chunks wait out the writer's grant
    assert d.allocator.used == 9 * CHUNK
    assert md.allocate([(K[9], CHUNK)])[0][0].status is AllocStatus.NO_SPACE
    clock.now += WRITE_TTL + 2.5
    md.expire()
    assert d.quarantine == [] and d.allocator.used == 5 * CHUNK
    assert md.allocate([(K[9], CHUNK)])[0][0].status is AllocStatus.ALLOCATED


# -- offload answers ----------------------------------------------------------------------


def test_offload_done_ok_leaves_the_entry_on_disk_only() -> None:
    md, _, d = make()
    fill(md, K[:9])
    md.plan_tiering()
    (order,) = md.take_orders("d1")
    e = md.get(K[0])
    assert e is not None and order == order_for(e, "offload")
    md.offload_done("d1", K[0], order.gen, True, file_bytes=FILE)
    assert e.on_disk and not e.in_memory and not e.offloading and e.alloc_size == 0
    assert e.file_bytes == FILE and e.state is State.READY
    assert K[0] not in d.lru and list(d.disk_lru) == [K[0]]
    assert d.allocator.used == 8 * CHUNK and d.disk_used == FILE and d.offloading_bytes == 0
    assert tiers(md, K[0]) == ["disk"]
    stats = md.stats()
    assert (stats["keys_memory"], stats["bytes_memory"]) == (8, 8 * CHUNK)
    assert (stats["keys_disk"], stats["bytes_disk"], stats["capacity_disk"]) == (1, FILE, 20 * FILE)
    assert (stats["offloads"], stats["offload_bytes"], stats["bytes_offloading"]) == (1, CHUNK, 0)
    # the same answer again changes nothing
    md.offload_done("d1", K[0], order.gen, True, file_bytes=FILE)
    assert d.disk_used == FILE and md.counters.offloads == 1 and d.orders == []
    # a probe finds it on disk and moves nothing
    hits, lease = md.lookup([K[0]], take_lease=False)
    assert hits == [e] and lease is None
    assert not e.reloading and d.orders == [] and d.allocator.used == 8 * CHUNK
    assert md.stats()["hits_disk"] == 1 and md.stats()["hits_memory"] == 0


def test_leased_entry_keeps_its_memory_copy_until_the_next_plan() -> None:
    md, _, d = make()
    fill(md, K[:9])
    md.plan_tiering()
    (order,) = md.take_orders("d1")
    _, lease = md.lookup([K[0]], take_lease=True)  # a reader arrives during the offload
    assert lease is not None
    md.lookup(K[1:9], take_lease=False)  # K0 is the least recently used again
    md.offload_done("d1", K[0], order.gen, True, file_bytes=FILE)
    assert tiers(md, K[0]) == ["memory", "disk"]  # the reader's bytes stay where they are
    assert d.allocator.used == 9 * CHUNK and d.disk_used == FILE
    assert K[0] in d.lru and K[0] in d.disk_lru
    md.release([lease])
    assert tiers(md, K[0]) == ["memory", "disk"]
    md.plan_tiering()
    assert md.take_orders("d1") == []  # no second offload: the copy just goes
    assert tiers(md, K[0]) == ["disk"] and d.allocator.used == 8 * CHUNK
    assert md.counters.offloads == 1


def with_a_clean_copy() -> tuple[Metadata, Node]:
    """A full node (9 chunks) whose least recent entry, K0, is in memory and on disk,
    unleased: the one memory copy that can go without a write."""
    md, _, d = make()
    fill(md, K[:9])
    md.plan_tiering()
    (order,) = md.take_orders("d1")
    _, lease = md.lookup([K[0]], take_lease=True)  # keeps its memory copy past the offload
    assert lease is not None
    md.lookup(K[1:9], take_lease=False)
    md.offload_done("d1", K[0], order.gen, True, file_bytes=FILE)
    md.release([lease])
    return md, d


def test_allocation_drops_a_clean_memory_copy_instead_of_waiting() -> None:
    md, d = with_a_clean_copy()
    results, _ = md.allocate([(K[9], CHUNK)])
    assert results[0].status is AllocStatus.ALLOCATED
    assert tiers(md, K[0]) == ["disk"]
    assert md.counters.evictions == 0 and d.pressure == 0 and d.orders == []
    assert d.allocator.used == 9 * CHUNK


def test_offload_disk_full_degrades_to_eviction() -> None:
    md, _, d = make(memory_low=0.7)
    fill(md, K[:9])
    md.plan_tiering()
    orders = md.take_orders("d1")
    assert ops(orders) == [("offload", K[0]), ("offload", K[1])]
    _, lease = md.lookup([K[1]], take_lease=True)
    assert lease is not None
    answer(md, orders, ok=False, reason="disk_full")
    assert md.get(K[0]) is None  # evicted: memory freed at once
    assert d.allocator.used == 8 * CHUNK
    k1 = md.get(K[1])
    assert k1 is not None and tiers(md, K[1]) == ["memory"]  # leased: kept
    assert not k1.offloading and k1.readers == 1
    assert md.counters.evictions == 1 and d.offloading_bytes == 0
    assert md.counters.tier_failures == {"offload_disk_full": 2}
    assert md.stats()["tier_failures"] == 2
    assert d.orders == [] and d.disk_used == 0  # no file was written, none to delete
    assert md.release([lease]).released == 1


def test_offload_io_error_keeps_the_entry_for_another_try() -> None:
    md, _, _ = make()
    fill(md, K[:9])
    md.plan_tiering()
    orders = md.take_orders("d1")
    answer(md, orders, ok=False, reason="io_error")
    e = md.get(K[0])
    assert e is not None and tiers(md, K[0]) == ["memory"] and not e.offloading
    assert md.counters.tier_failures == {"offload_io_error": 1}
    md.plan_tiering()
    assert ops(md.take_orders("d1")) == [("offload", K[0])]


# -- reloads ------------------------------------------------------------------------------


def test_disk_hit_reloads_into_the_same_node() -> None:
    md, _ = new_md()
    d1 = add(md, "d1", 10, disk_files=20)
    d2 = add(md, "d2", 10, disk_files=20)
    p = add(md, "p1", 40)  # the most free memory anywhere, but not where the file is
    (x,) = adopt(md, d1, [X])
    hits, lease = md.lookup([X], take_lease=True)
    assert hits == [x] and lease is not None
    assert x.reloading and not x.in_memory and x.alloc_size == CHUNK and x.readers == 1
    assert d1.allocator.used == CHUNK and d2.allocator.used == 0 and p.allocator.used == 0
    assert x.offset >= 0 and x.offset + x.alloc_size <= int(d1.capacity * md.memory_high)
    (order,) = md.take_orders("d1")
    assert order == order_for(x, "reload") and order.node == "d1"
    assert md.take_orders("d2") == [] and md.take_orders("p1") == []
    assert d1.reloads == {x.gen: x}
    view = md.describe(X)
    assert view is not None and view["tiers"] == ["disk"] and view["reloading"] is True
    stats = md.stats()
    assert (stats["hits"], stats["hits_disk"], stats["hits_memory"]) == (1, 1, 0)


def test_store_offload_reload_round_trip_stays_on_its_node() -> None:
    md, _ = new_md()
    d1 = add(md, "d1", 10, disk_files=20)
    d2 = add(md, "d2", 10, disk_files=20)
    fill(md, K[:18])  # 9 on each
    md.plan_tiering()
    for node in (d1, d2):
        orders = md.take_orders(node.node_id)
        assert orders and all(md.get(o.key).node is node for o in orders)  # type: ignore[union-attr]
        answer(md, orders)
    on_d1 = next(e for e in d1.disk_lru.values())
    hits, lease = md.lookup([on_d1.key], take_lease=True)
    assert hits == [on_d1] and on_d1.reloading
    assert md.take_orders("d2") == []
    (order,) = md.take_orders("d1")
    assert order.op == "reload" and order.node == "d1"
    answer(md, [order])
    assert md.settle_lookup(lease, hits) == [on_d1]
    assert on_d1.node is d1 and tiers(md, on_d1.key) == ["memory", "disk"]


def test_concurrent_lookups_share_one_reload() -> None:
    md, _, d = make()
    (x,) = adopt(md, d, [X])
    hits1, l1 = md.lookup([X], take_lease=True)
    hits2, l2 = md.lookup([X], take_lease=True)
    assert hits1 == hits2 == [x] and l1 and l2 and l1 != l2
    assert x.readers == 2 and d.allocator.used == CHUNK  # one extent
    (order,) = md.take_orders("d1")  # one reload
    assert order.op == "reload"
    assert md.counters.hits_disk == 2
    md.reload_done("d1", X, order.gen, True)
    assert md.settle_lookup(l1, hits1) == [x]
    assert md.settle_lookup(l2, hits2) == [x]
    assert x.readers == 2 and md.read_leases[l1].entries == [x]
    assert tiers(md, X) == ["memory", "disk"] and not x.reloading and d.reloads == {}
    assert list(d.lru) == [X] and d.ready_bytes == CHUNK
    stats = md.stats()
    assert (stats["reloads"], stats["reload_bytes"], stats["hits_disk"]) == (1, CHUNK, 2)
    assert (stats["keys_memory"], stats["keys_disk"]) == (1, 1)
    md.release([l1, l2])
    assert x.readers == 0
    # now it is a memory hit
    md.lookup([X], take_lease=False)
    assert md.counters.hits_memory == 1 and md.take_orders("d1") == []


def test_reload_checksum_failure_drops_the_entry_and_ends_the_prefix() -> None:
    md, _, d = make()
    (m0,) = store(md, [K[0]])
    (x,) = adopt(md, d, [X])
    (m2,) = store(md, [K[2]])
    hits, lease = md.lookup([K[0], X, K[2]], take_lease=True)
    assert hits == [m0, x, m2] and lease is not None
    (order,) = md.take_orders("d1")
    md.reload_done("d1", X, order.gen, False, "checksum")
    assert md.get(X) is None and x.dropped
    assert md.counters.checksum_failures == 1
    assert md.counters.tier_failures == {"reload_checksum": 1}
    assert d.allocator.used == 3 * CHUNK  # X's extent waits for its reader to let go
    assert md.settle_lookup(lease, hits) == [m0]
    assert md.read_leases[lease].entries == [m0]
    assert (m0.readers, x.readers, m2.readers) == (1, 0, 0)
    assert d.allocator.used == 2 * CHUNK  # X's extent is free: wrong bytes never served
    assert tiers(md, K[2]) == ["memory"]  # only the lookup lost it, not the cache
    stats = md.stats()
    assert (stats["hits"], stats["misses"], stats["keys_disk"], stats["bytes_disk"]) == (1, 2, 0, 0)
    assert md.release([lease]).released == 1 and m0.readers == 0


def test_settle_lookup_keeps_the_memory_and_disk_hit_counters_apart() -> None:
    md, _, d = make()
    adopt(md, d, [X])
    store(md, [K[1]])
    hits, lease = md.lookup([X, K[1]], take_lease=True)
    assert len(hits) == 2 and md.counters.hits_disk == 1 and md.counters.hits_memory == 1
    (order,) = md.take_orders("d1")
    md.reload_done("d1", X, order.gen, False, "checksum")
    assert md.settle_lookup(lease, hits) == []
    stats = md.stats()
    assert stats["hits"] == 0 and stats["misses"] == 2
    assert (stats["hits_disk"], stats["hits_memory"]) == (0, 0)


def test_settle_before_the_reload_answers_ends_the_prefix_there() -> None:
    md, _, d = make()
    (m0,) = store(md, [K[0]])
    (x,) = adopt(md, d, [X])
    hits, lease = md.lookup([K[0], X], take_lease=True)
    assert lease is not None
    (order,) = md.take_orders("d1")
    assert md.settle_lookup(lease, hits) == [m0]  # the caller stopped waiting
    assert x.readers == 0 and x.reloading and md.read_leases[lease].entries == [m0]
    md.reload_done("d1", X, order.gen, True)  # it lands later, for the next reader
    assert tiers(md, X) == ["memory", "disk"]
    hits2, _ = md.lookup([K[0], X], take_lease=False)
    assert hits2 == [m0, x] and md.take_orders("d1") == []


def test_settle_of_a_lookup_without_reloads_keeps_everything() -> None:
    md, _, _ = make()
    entries = store(md, K[:3])
    hits, lease = md.lookup(K[:3], take_lease=True)
    assert md.settle_lookup(lease, hits) == entries
    assert md.read_leases[lease].entries == entries  # type: ignore[index]


def test_reload_without_room_ends_the_prefix_and_asks_for_room() -> None:
    md, _, d = make()
    (x1, x2, x3) = adopt(md, d, [X, Y, Z])
    fill(md, K[:9])
    _, leased = md.lookup(K[:9], take_lease=True)  # nothing in memory can move
    assert leased is not None
    hits, lease = md.lookup([X, Y, Z], take_lease=True)
    assert hits == [] and lease is None
    assert not x1.reloading and d.orders == [] and d.allocator.used == 9 * CHUNK
    assert md.counters.misses == 3
    assert d.pressure == 3 * CHUNK  # room for the whole prompt, not one chunk a round
    md.release([leased])
    md.plan_tiering()
    assert len(md.take_orders("d1")) == 3  # 9 -> 6 chunks: the 3 reloads will fit
    assert (x2.on_disk, x3.on_disk) == (True, True)


def test_a_lookup_short_of_room_waits_for_other_readers_then_reloads() -> None:
    """Memory full of copies that another request is reading: the reload cannot start
    and no offload can help, but that reader's release will; the lookup may wait for it
    (others_reading) and its next pass reloads into the room the release made."""
    md, d = with_a_clean_copy()
    (x,) = adopt(md, d, [X])
    _, other = md.lookup(K[:9], take_lease=True)  # another request reads all of memory
    assert other is not None
    op = md.begin_lookup([X], take_lease=True)
    assert op.wait_room and not op.done and op.reloads == [] and op.served == []
    assert not md.room_coming()  # every copy is leased: nothing to offload
    assert md.others_reading(op)
    md.release([other])
    assert not md.others_reading(op)
    md.continue_lookup(op)
    assert op.reloads == [x.gen]  # K0's clean copy made the room
    assert tiers(md, K[0]) == ["disk"]
    answer(md, md.take_orders("d1"))
    md.settle(op)
    assert [e.key for e in op.served] == [X] and op.done and op.lease is not None
    md.release([op.lease])


def test_reload_does_not_push_out_an_earlier_hit_of_the_same_lookup() -> None:
    md, d = with_a_clean_copy()
    (x,) = adopt(md, d, [X])
    _, others = md.lookup(K[1:9], take_lease=True)
    hits, lease = md.lookup([K[0], X], take_lease=True)
    # X would fit only by dropping K0's memory copy, which this lookup is serving
    assert [e.key for e in md.settle_lookup(lease, hits)] == [K[0]]
    assert tiers(md, K[0]) == ["memory", "disk"] and not x.reloading
    md.release([lease, others])  # type: ignore[list-item]


# -- the disk tier ------------------------------------------------------------------------


def test_disk_lru_deletes_the_oldest_files_above_disk_high() -> None:
    md, _ = new_md()
    # above 95% (9.5 files) delete down to 90% (9 files); the odd 1000 bytes keep the
    # test off the exact boundary, where 0.95 - 0.05 in floating point is just under 0.9
    d, _ = md.register("d1", 1, "d1:1", 10 * CHUNK, "", "host", ["tcp"], 10 * FILE + 1000)
    (m,) = store(md, [K[0]])
    files = K[10:21]
    assert (
        md.adopt("d1", 1, [(K[0], CHUNK, SUM, FILE)] + [(k, CHUNK, SUM, FILE) for k in files]) == []
    )
    assert d.disk_used == 12 * FILE and tiers(md, K[0]) == ["memory", "disk"]
    gens = {k: md.get(k).gen for k in files}  # type: ignore[union-attr]
    md.lookup([files[0]], take_lease=False)  # used: no longer among the oldest
    assert md.plan_tiering() == ["d1"]
    orders = md.take_orders("d1")
    assert ops(orders) == [("delete", K[0]), ("delete", files[1]), ("delete", files[2])]
    assert [o.gen for o in orders] == [m.gen, gens[files[1]], gens[files[2]]]
    assert all(o.node == "d1" for o in orders)
    assert d.disk_used == 9 * FILE and md.counters.disk_evictions == 3
    assert tiers(md, K[0]) == ["memory"]  # lost its file, kept its memory copy
    assert md.get(files[1]) is None and md.get(files[2]) is None  # disk-only: gone
    assert tiers(md, files[0]) == ["disk"]
    stats = md.stats()
    assert (stats["keys_disk"], stats["bytes_disk"], stats["disk_evictions"]) == (9, 9 * FILE, 3)
    assert md.plan_tiering() == []  # below the watermark now


def test_offload_makes_disk_room_by_deleting_the_oldest_files() -> None:
    md, _, d = make(disk_files=4)  # 3.8 files of budget
    adopt(md, d, K[20:23])
    fill(md, K[:9])
    md.plan_tiering()
    orders = md.take_orders("d1")
    assert ops(orders) == [("delete", K[20]), ("offload", K[0])]  # deletes go first
    assert md.get(K[20]) is None and md.counters.disk_evictions == 1
    answer(md, orders)
    assert d.disk_used == 3 * FILE <= d.disk_capacity * md.disk_high


def test_files_under_a_reload_are_not_deleted_for_room() -> None:
    md, _, d = make(disk_files=4)
    (x, _, _) = adopt(md, d, [X, Y, Z])
    _, lease = md.lookup([X], take_lease=True)  # X is reloading
    md.lookup([Y, Z], take_lease=False)  # touched back to front: disk LRU is X, Z, Y
    assert list(d.disk_lru) == [X, Z, Y]
    fill(md, K[:8])
    md.plan_tiering()
    orders = md.take_orders("d1")
    assert ops(orders) == [("delete", Z), ("reload", X), ("offload", K[0])]
    assert x.on_disk and x.reloading and md.get(Z) is None
    assert md.release([lease]).released == 1  # type: ignore[list-item]


def test_offloads_in_flight_keep_their_disk_room() -> None:
    md, _, d = make(disk_files=4, memory_low=0.5)  # room for 3 files under disk_high
    fill(md, K[:9])
    md.plan_tiering()
    first = md.take_orders("d1")
    assert len(first) == 3  # the disk budget stops the plan at 3 of the 4 it wanted
    assert md.allocate([(K[9], CHUNK)])[0][0].status is AllocStatus.NO_SPACE
    md.plan_tiering()
    booked = d.disk_used + sum(e.size + 4096 for e in d.lru.values() if e.offloading)
    assert booked <= d.disk_capacity * md.disk_high


def test_delete_of_disk_entries_queues_file_deletes() -> None:
    md, _, d = make()
    (x,) = adopt(md, d, [X])
    assert md.delete(X)
    assert md.take_orders("d1") == [order_for(x, "delete")]
    assert d.disk_used == 0 and md.stats()["keys_disk"] == 0
    # memory and disk: the file goes and the memory is free at once
    fill(md, K[:9])
    md.plan_tiering()
    (order,) = md.take_orders("d1")
    _, lease = md.lookup([K[0]], take_lease=True)
    assert lease is not None
    md.offload_done("d1", K[0], order.gen, True, file_bytes=FILE)
    md.release([lease])
    assert tiers(md, K[0]) == ["memory", "disk"]
    assert md.delete(K[0])
    assert ops(md.take_orders("d1")) == [("delete", K[0])]
    assert d.allocator.used == 8 * CHUNK and d.disk_used == 0
    # memory only: nothing for the disk role
    assert md.delete(K[1])
    assert md.take_orders("d1") == []
    assert md.counters.deletes == 3


def test_deleting_a_leased_disk_entry_keeps_its_reload_extent_until_released() -> None:
    md, _, d = make()
    (x,) = adopt(md, d, [X])
    hits, lease = md.lookup([X], take_lease=True)
    (reload,) = md.take_orders("d1")
    assert md.delete(X)
    assert ops(md.take_orders("d1")) == [("delete", X)]
    assert d.allocator.used == CHUNK  # the disk role may still be writing into it
    md.reload_done("d1", X, reload.gen, True)
    assert d.allocator.used == CHUNK and x.readers == 1  # and now a reader holds it
    assert md.settle_lookup(lease, hits) == []
    assert d.allocator.used == 0 and md.get(X) is None


def test_dropped_offloading_entry_has_its_file_deleted_when_the_offload_reports() -> None:
    md, _, d = make()
    fill(md, K[:9])
    md.plan_tiering()
    (order,) = md.take_orders("d1")
    assert md.delete(K[0])
    assert d.offloading_bytes == 0 and d.orders == []  # no file yet
    md.offload_done("d1", K[0], order.gen, True, file_bytes=FILE)
    assert ops(md.take_orders("d1")) == [("delete", K[0])]
    assert d.disk_used == 0 and md.counters.offloads == 0 and md.stats()["keys_disk"] == 0
    # a failed offload of a dropped entry left no file behind: nothing to delete
    store(md, [K[0]])
    md.plan_tiering()
    (order,) = md.take_orders("d1")
    assert order.key == K[1]
    md.delete(K[1])
    md.offload_done("d1", K[1], order.gen, False, "io_error")
    assert md.take_orders("d1") == []


def test_a_stale_offload_answer_does_not_delete_the_current_file() -> None:
    md, _, _ = make()
    fill(md, K[:9])
    md.plan_tiering()
    (old,) = md.take_orders("d1")
    assert old.key == K[0]
    md.delete(K[0])  # dropped during its offload
    store(md, [K[0]])  # and stored again: a new generation
    _, lease = md.lookup(K[1:9], take_lease=True)
    md.allocate([(K[9], CHUNK)])
    md.plan_tiering()
    (new,) = md.take_orders("d1")
    assert new.key == K[0] and new.gen != old.gen
    md.offload_done("d1", K[0], new.gen, True, file_bytes=FILE)
    assert tiers(md, K[0]) == ["disk"]
    md.offload_done("d1", K[0], old.gen, True, file_bytes=FILE)  # the old one, late
    assert ("delete", K[0]) not in ops(md.take_orders("d1"))
    del lease


# -- nodes ----------------------------------------------------------------------------------


def test_node_death_drops_everything_without_orders() -> None:
    md, _ = new_md(memory_low=0.5)
    d = add(md, "d1", 10, disk_files=20)
    other = add(md, "d2", 10, disk_files=20)
    adopt(md, d, [X, Y])
    fill(md, K[:18])  # 9 chunks on each
    md.plan_tiering()
    offloads = md.take_orders("d1")
    assert len(offloads) == 4
    answer(md, offloads[:2])  # two done (on disk only), two still in flight
    _, lease = md.lookup([X], take_lease=True)
    reloads = md.take_orders("d1")
    assert ops(reloads) == [("reload", X)]  # in flight
    _, lease_y = md.lookup([Y], take_lease=True)
    assert ops(d.orders) == [("reload", Y)]  # still queued
    answer(md, md.take_orders("d2"))
    lost = len(d.entries)
    offloaded = md.counters.offloads
    assert md.unregister("d1", 1)
    assert d.orders == [] and md.take_orders("d1") == []  # nothing for a dead disk role
    assert md.get(X) is None and md.get(Y) is None
    assert all(md.get(o.key) is None for o in offloads)
    assert md.counters.entries_lost == lost
    stats = md.stats()
    assert stats["keys_disk"] == len(other.disk_lru) == 4
    assert stats["bytes_disk"] == other.disk_used == 4 * FILE
    # late answers of the dead incarnation change nothing
    answer(md, offloads[2:] + reloads)
    assert d.orders == [] and md.counters.offloads == offloaded and md.counters.reloads == 0
    assert md.release([lease, lease_y]).released == 2  # type: ignore[list-item]
    assert other.alive and all(e.node is other for e in md.entries.values())
    # it comes back as a new incarnation and reports its files again
    back = add(md, "d1", 10, disk_files=20, incarnation=2)
    assert md.adopt("d1", 1, [(X, CHUNK, SUM, FILE)]) is None  # the old incarnation
    assert md.adopt("d1", 2, [(X, CHUNK, SUM, FILE)]) == []
    assert tiers(md, X) == ["disk"] and md.get(X).node is back  # type: ignore[union-attr]


def test_adopt() -> None:
    md, _ = new_md()
    d = add(md, "d1", 10, disk_files=20)
    match, mismatch, writing, elsewhere = K[0], K[1], K[2], K[3]
    results, wl = md.allocate([(match, CHUNK), (mismatch, CHUNK)])
    assert wl is not None and all(r.entry.node is d for r in results)  # type: ignore[union-attr]
    md.commit(wl, [(match, SUM), (mismatch, "f" * 16)])
    _, still_writing = md.allocate([(writing, CHUNK)])
    assert still_writing is not None
    other = add(md, "d2", 10, disk_files=20)
    (e,) = store(md, [elsewhere])
    assert e.node is other  # the node with the most free memory
    add(md, "p1", 10)
    assert md.adopt("d1", 2, []) is None  # another incarnation
    assert md.adopt("p1", 1, []) is None  # no disk role
    assert md.adopt("nope", 1, []) is None
    assert md.adopt("d1", 1, []) == []

    files = [
        (X, CHUNK, SUM, FILE),
        (Y, 2 * CHUNK, SUM, 2 * FILE),
        (match, CHUNK, SUM, FILE),
        (mismatch, CHUNK, SUM, FILE),
        (writing, CHUNK, SUM, FILE),
        (elsewhere, CHUNK, SUM, FILE),
    ]
    delete = md.adopt("d1", 1, files)
    # files the manager has other (or newer) copies of are the disk role's to delete
    assert delete == [mismatch, writing, elsewhere]
    x, y = md.get(X), md.get(Y)
    assert x is not None and y is not None
    assert x.state is State.READY and not x.in_memory and x.on_disk and x.node is d
    assert x.alloc_size == 0 and x.readers == 0 and x.gen > 0
    assert (y.size, y.file_bytes, y.checksum) == (2 * CHUNK, 2 * FILE, SUM)
    assert tiers(md, X) == ["disk"] and tiers(md, match) == ["memory", "disk"]
    assert tiers(md, mismatch) == ["memory"] and tiers(md, elsewhere) == ["memory"]
    assert md.get(writing).state is State.WRITING  # type: ignore[union-attr]
    assert list(d.disk_lru) == [X, Y, match]
    assert d.disk_used == 4 * FILE and other.disk_used == 0
    # reported again (a retry): nothing is counted twice
    assert md.adopt("d1", 1, files[:3]) == []
    assert d.disk_used == 4 * FILE and md.stats()["keys_disk"] == 3
    assert md.lookup([X, Y], take_lease=False)[0] == [x, y]


def test_adopt_places_nothing_on_other_nodes() -> None:
    md, _ = new_md()
    d1 = add(md, "d1", 10, disk_files=20)
    add(md, "d2", 40, disk_files=20)
    adopt(md, d1, [X, Y])
    hits, lease = md.lookup([X, Y], take_lease=True)
    assert len(hits) == 2 and lease is not None
    orders = md.take_orders("d1")
    assert ops(orders) == [("reload", X), ("reload", Y)]
    assert md.take_orders("d2") == [] and md.nodes["d2"].allocator.used == 0
    answer(md, orders)
    assert md.settle_lookup(lease, hits) == hits
    assert all(e.node is d1 and e.in_memory for e in hits)


# -- order timeouts -------------------------------------------------------------------------


def test_unanswered_orders_time_out() -> None:
    md, clock, d = make()
    (x,) = adopt(md, d, [X])
    fill(md, K[:8])
    _, lease = md.lookup([X], take_lease=True)  # 9 chunks with X's reload extent
    (reload,) = md.take_orders("d1")
    md.plan_tiering()
    (offload,) = md.take_orders("d1")
    k0 = md.get(offload.key)
    assert k0 is not None and k0.offloading
    clock.now += ORDER_TIMEOUT - 1
    md.expire()  # one long step: the manager stalled, the nodes are not blamed
    assert d.alive and k0.offloading and x.reloading
    clock.now += 1
    md.expire()
    assert not k0.offloading and tiers(md, k0.key) == ["memory"] and d.offloading_bytes == 0
    # the reload: its file is probably fine and is kept (X is disk-only again); its extent
    # is quarantined, since a stuck read may still land in it
    assert tiers(md, X) == ["disk"] and not x.reloading and d.reloads == {}
    assert md.counters.tier_failures == {"offload_timeout": 1, "reload_timeout": 1}
    assert d.allocator.used == 9 * CHUNK and len(d.quarantine) == 1
    md.take_orders("d1")
    # answers arriving after the timeout: the late file is not wanted, the late reload ignored
    md.offload_done("d1", k0.key, offload.gen, True, file_bytes=FILE)
    assert ops(md.take_orders("d1")) == [("delete", k0.key)]
    assert tiers(md, k0.key) == ["memory"] and d.disk_used == FILE
    md.reload_done("d1", X, reload.gen, True)
    assert tiers(md, X) == ["disk"] and md.counters.reloads == 0
    assert md.release([lease]).released == 0  # it ran out meanwhile
    clock.now += ORDER_TIMEOUT
    md.expire()  # another stall-sized step: the quarantined extent comes back
    assert d.alive and d.quarantine == [] and d.allocator.used == 8 * CHUNK


def test_take_orders_puts_deletes_first_and_drains() -> None:
    md, _, d = make(disk_files=4)
    adopt(md, d, [X, Y, Z])
    fill(md, K[:9])
    md.plan_tiering()  # evicts X's file for room, then the offload
    md.delete(Y)  # queued behind the offload
    assert ops(d.orders) == [("delete", X), ("offload", K[0]), ("delete", Y)]
    assert ops(md.take_orders("d1")) == [("delete", X), ("delete", Y), ("offload", K[0])]
    assert md.take_orders("d1") == [] and d.orders == []


# -- a state machine with disk roles ------------------------------------------------------

MACHINE_KEYS = [key(f"m{i}") for i in range(32)]
# node -> (memory, disk); p1 has no disk role and evicts instead. Small, so that the
# watermarks are crossed often.
MACHINE_NODES = {"d1": (160 * KiB, 200 * KiB), "d2": (96 * KiB, 120 * KiB), "p1": (64 * KiB, 0)}
machine_keys = st.sampled_from(MACHINE_KEYS)
machine_sizes = st.one_of(st.sampled_from([4096, 16 * KiB, 32 * KiB]), st.integers(1, 40 * KiB))
HEADER = 4096  # the fake disk role's file header
OFFLOAD_FAILURES = ["disk_full", "io_error"]
RELOAD_FAILURES = ["checksum", "io_error"]


class TieringMachine(RuleBasedStateMachine):
    """Random writes, reads, deletes, tiering plans and disk-role answers (the test plays
    the disk role, with a dict for a disk), time and restarts; the tiering invariants are
    checked after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.md = Metadata(READ_TTL, WRITE_TTL, HB_TTL, clock=self.clock, rng=random.Random(0))
        self.incarnations: dict[str, int] = {}
        self.seen: dict[int, Entry] = {}  # every entry ever in a table, by id
        self.write_lease_ids: list[str] = []
        self.read_lease_ids: list[str] = []
        self.unsettled: list[tuple[str | None, list[Entry]]] = []  # lookups that took a lease
        self.in_flight: dict[str, list[Order]] = {n: [] for n in MACHINE_NODES}
        self.disks: dict[str, dict[str, tuple[int, str, int]]] = {n: {} for n in MACHINE_NODES}
        for node_id in MACHINE_NODES:
            self._register(node_id)

    # -- helpers --------------------------------------------------------------------------

    def _register(self, node_id: str) -> None:
        inc = self.incarnations.get(node_id, 0) + 1
        self.incarnations[node_id] = inc
        memory, disk = MACHINE_NODES[node_id]
        node, new = self.md.register(node_id, inc, f"{node_id}:1", memory, "", "", ["tcp"], disk)
        assert new and node.allocator.used == 0
        self.in_flight[node_id] = []  # the old incarnation's answers are refused
        if disk:
            # the slab comes back with its files and reports them
            files = [
                (k, size, checksum, fb) for k, (size, checksum, fb) in self.disks[node_id].items()
            ]
            delete = self.md.adopt(node_id, inc, files)
            assert delete is not None
            for k in delete:
                del self.disks[node_id][k]
            for k, (size, checksum, _) in self.disks[node_id].items():
                e = self.md.get(k)
                assert e is not None and e.node is node and e.on_disk
                assert (e.size, e.checksum) == (size, checksum)
        self._learn()

    def _learn(self) -> None:
        for e in self.md.entries.values():
            self.seen.setdefault(id(e), e)

    def _entry_of(self, order: Order) -> Entry | None:
        return next(
            (e for e in self.seen.values() if e.gen == order.gen and e.key == order.key), None
        )

    def _table(self) -> list[Entry]:
        return list(self.md.entries.values())

    def _ready_keys(self) -> list[str]:
        return sorted(e.key for e in self._table() if e.state is State.READY)

    @initialize(
        sizes=st.lists(st.sampled_from([16 * KiB, 32 * KiB]), min_size=6, max_size=12),
        files=st.lists(st.sampled_from([16 * KiB, 32 * KiB]), max_size=6),
    )
    def warm_up(self, sizes: list[int], files: list[int]) -> None:
        """Start near the watermarks, so that runs spend their steps on tiering: d1 was
        restarted with files on its disk, and some prompts were stored."""
        for k, size in zip(MACHINE_KEYS, files, strict=False):
            self.disks["d1"][k] = (size, SUM, size + HEADER)
        if files:
            self.md.unregister("d1", self.incarnations["d1"])
            self._register("d1")
        for k, size in zip(MACHINE_KEYS[-len(sizes) :], sizes, strict=True):
            self.store([(k, size)])

    # -- writes -----------------------------------------------------------------------------

    @rule(items=st.lists(st.tuples(machine_keys, machine_sizes), min_size=1, max_size=6))
    def store(self, items: list[tuple[str, int]]) -> None:
        results, lease = self.md.allocate(items)
        self._learn()
        if lease is not None:
            mine = [r.key for r in results if r.status is AllocStatus.ALLOCATED]
            assert self.md.commit(lease, [(k, SUM) for k in mine]) == dict.fromkeys(
                mine, "committed"
            )
        self.plan()  # the shell plans after every write

    @rule(items=st.lists(st.tuples(machine_keys, machine_sizes), min_size=1, max_size=3))
    def allocate(self, items: list[tuple[str, int]]) -> None:
        _, lease = self.md.allocate(items)
        self._learn()
        if lease is not None:
            self.write_lease_ids.append(lease)

    @rule(data=st.data(), commit=st.booleans())
    def finish_write(self, data: st.DataObject, commit: bool) -> None:
        if not self.write_lease_ids:
            return
        lease = data.draw(st.sampled_from(self.write_lease_ids))
        live = self.md.write_leases.get(lease)
        if commit:
            self.md.commit(lease, [(k, SUM) for k in (live.entries if live else [])])
        else:
            self.md.abort(lease, None)

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(e.key for e in self._table()) + MACHINE_KEYS[:1]))
        entry = self.md.get(k)
        had_file = entry is not None and entry.on_disk and entry.node.alive
        assert self.md.delete(k) == (entry is not None)
        if had_file:
            assert entry is not None
            assert any(
                o.op == "delete" and o.key == k and o.gen == entry.gen for o in entry.node.orders
            )

    # -- reads ----------------------------------------------------------------------------

    @rule(data=st.data(), take=st.booleans())
    def lookup(self, data: st.DataObject, take: bool) -> None:
        keys = self._draw_keys(data)
        hits, lease = self._lookup(keys, take)
        if lease is not None:
            self.unsettled.append((lease, hits))

    def _draw_keys(self, data: st.DataObject) -> list[str]:
        # mostly keys that are ready, often ones on disk only, so that reloads are common
        ready = [e for e in self._table() if e.state is State.READY]
        pool = sorted(e.key for e in ready) or MACHINE_KEYS
        on_disk = sorted(e.key for e in ready if not e.in_memory) or pool
        return data.draw(
            st.lists(
                st.one_of(st.sampled_from(pool), st.sampled_from(on_disk)), min_size=1, max_size=4
            )
        )

    def _lookup(self, keys: list[str], take: bool) -> tuple[list[Entry], str | None]:
        hits, lease = self.md.lookup(keys, take)
        assert [e.key for e in hits] == keys[: len(hits)]
        for e in hits:
            assert e.state is State.READY and not e.dropped and e.node.alive
            if take:  # what a leased reader gets is in memory, or being reloaded there
                assert e.in_memory or e.reloading, e.key
                assert e.readers >= 1
                if e.reloading:
                    node = e.node
                    assert node.has_disk and node.reloads.get(e.gen) is e
                    assert any(
                        o.op == "reload" and o.gen == e.gen
                        for o in node.orders + self.in_flight[node.node_id]
                    )
        if lease is not None:
            self.read_lease_ids.append(lease)
        return hits, lease

    @rule(data=st.data(), release=st.booleans())
    def serve_lookup(self, data: st.DataObject, release: bool) -> None:
        """What the shell does for a client: look up with a lease, let the disk roles
        reload what is on disk, settle, and (maybe) release."""
        hits, lease = self._lookup(self._draw_keys(data), True)
        for node_id in sorted({e.node.node_id for e in hits if e.reloading}):
            self.take_orders(node_id)
            orders = [o for o in self.in_flight[node_id] if o.op == "reload"]
            self.in_flight[node_id] = [o for o in self.in_flight[node_id] if o.op != "reload"]
            for o in orders:
                ok = data.draw(st.sampled_from([True] * 4 + [False]))
                self._answer(node_id, o, ok, data.draw(st.sampled_from(RELOAD_FAILURES)))
        served = self.md.settle_lookup(lease, hits)
        assert served == hits[: len(served)] and all(e.in_memory for e in served)
        if release and lease is not None:
            self.md.release([lease])

    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        if not self.unsettled:
            return
        i = data.draw(st.integers(0, len(self.unsettled) - 1))
        lease_id, hits = self.unsettled.pop(i)
        live = self.md.read_leases.get(lease_id or "")
        held = list(live.entries) if live is not None else None
        served = self.md.settle_lookup(lease_id, hits)
        assert served == hits[: len(served)]
        assert all(e.in_memory and not e.dropped for e in served)
        if len(served) < len(hits):
            gone = hits[len(served)]
            assert not gone.in_memory or gone.dropped
        if held is not None:
            now = self.md.read_leases.get(lease_id or "")
            assert (now.entries if now else []) == held[: len(held) - len(hits) + len(served)]

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        pool = [lid for lid in self.read_lease_ids if lid in self.md.read_leases] or ["0" * 16]
        leases = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=2))
        held = sorted(
            {
                e.key
                for lid in leases
                if lid in self.md.read_leases
                for e in self.md.read_leases[lid].entries
            }
        )
        corrupt = data.draw(
            st.lists(st.sampled_from(held or MACHINE_KEYS[:1]), unique=True, max_size=1)
        )
        out = self.md.release(leases, corrupt)
        for entry in out.suspects:  # the slab's bytes bear every report out here
            self.md.corrupt_verified(
                entry, entry.gen, data.draw(st.sampled_from([True, False, None]))
            )

    # -- tiering --------------------------------------------------------------------------

    @rule()
    def plan(self) -> None:
        touched = self.md.plan_tiering()
        for node_id in touched:
            node = self.md.nodes[node_id]
            assert node.alive and node.has_disk and node.orders

    @rule(node_id=st.sampled_from(sorted(MACHINE_NODES)))
    def take_orders(self, node_id: str) -> None:
        node = self.md.nodes[node_id]
        orders = self.md.take_orders(node_id)
        assert node.orders == []
        if not node.has_disk or not node.alive:
            assert orders == []
            return
        kinds = [o.op for o in orders]
        assert kinds == sorted(kinds, key=lambda op: op != "delete")  # deletes first
        for o in orders:
            assert o.node == node_id  # tiering stays inside the node
            if o.op == "delete":
                self.disks[node_id].pop(o.key, None)
                continue
            entry = self._entry_of(o)
            assert entry is not None and entry.node is node, o
            assert o.offset >= 0 and o.offset + o.extent <= node.allocator.capacity
            assert o.size == entry.size <= o.extent
            self.in_flight[node_id].append(o)

    @rule(data=st.data(), ok=st.booleans())
    def answer(self, data: st.DataObject, ok: bool) -> None:
        pending = [(n, i) for n, orders in self.in_flight.items() for i in range(len(orders))]
        if not pending:
            return
        node_id, i = data.draw(st.sampled_from(pending))
        o = self.in_flight[node_id].pop(i)
        failures = OFFLOAD_FAILURES if o.op == "offload" else RELOAD_FAILURES
        self._answer(node_id, o, ok, data.draw(st.sampled_from(failures)))

    @rule(data=st.data(), node_id=st.sampled_from(["d1", "d2"]))
    def disk_role_round(self, data: st.DataObject, node_id: str) -> None:
        """The common case in one step: plan, the node's disk role takes its orders and
        answers all of them, mostly with success."""
        self.plan()
        self.take_orders(node_id)
        orders, self.in_flight[node_id] = self.in_flight[node_id], []
        for o in orders:
            ok = data.draw(st.sampled_from([True] * 4 + [False]))
            failures = OFFLOAD_FAILURES if o.op == "offload" else RELOAD_FAILURES
            self._answer(node_id, o, ok, data.draw(st.sampled_from(failures)))

    def _answer(self, node_id: str, o: Order, ok: bool, reason: str) -> None:
        disk = self.disks[node_id]
        if o.op == "offload":
            if ok:
                disk[o.key] = (o.size, o.checksum, o.size + HEADER)
            self.md.offload_done(
                node_id, o.key, o.gen, ok, "" if ok else reason, o.size + HEADER if ok else 0
            )
            return
        if o.key not in disk:  # a delete or a stale answer took the file
            ok, reason = False, "missing"
        elif not ok and reason == "checksum":
            del disk[o.key]  # the disk role deletes a broken file itself
        entry = self._entry_of(o)
        awaited = entry is not None and entry.reloading  # not timed out meanwhile
        self.md.reload_done(node_id, o.key, o.gen, ok, "" if ok else reason)
        if ok and awaited and entry is not None and not entry.dropped and entry.node.alive:
            assert entry.in_memory and not entry.reloading and entry.key in entry.node.lru

    # -- time and nodes -------------------------------------------------------------------

    @rule(
        seconds=st.sampled_from([0.5, 2.0, 6.0, 31.0, ORDER_TIMEOUT + 1]),
        event=st.sampled_from(["beat"] * 4 + ["stall", "silent", "restart"]),
        node_id=st.sampled_from(sorted(MACHINE_NODES)),
    )
    def time_passes(self, seconds: float, event: str, node_id: str) -> None:
        if event == "restart":
            old = self.md.nodes[node_id]
            old.last_heartbeat = min(
                old.last_heartbeat, self.clock.now - HB_TTL / 2
            )  # it was down a while
            self._register(node_id)
            assert not old.alive and old.orders == []
            return
        if event == "stall" or seconds > 10:  # the manager stalled: one late expire
            self.clock.now += seconds
            self.md.expire()
        else:
            end = self.clock.now + seconds
            while self.clock.now < end:
                self.clock.now = min(end, self.clock.now + 0.5)
                for nid, node in self.md.nodes.items():
                    if node.alive and not (event == "silent" and nid == node_id):
                        assert self.md.heartbeat(nid, node.incarnation)
                self.md.expire()
        for nid, node in self.md.nodes.items():
            if not node.alive:
                self.in_flight[nid] = []
            for e in node.reloads.values():
                assert e.order_deadline > self.clock.now  # overdue reloads were given up
            assert all(
                not e.offloading or e.order_deadline > self.clock.now for e in node.lru.values()
            )

    @rule(node_id=st.sampled_from(sorted(MACHINE_NODES)))
    def revive(self, node_id: str) -> None:
        if not self.md.nodes[node_id].alive:
            self._register(node_id)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def memory_stays_under_the_high_watermark_on_disk_nodes(self) -> None:
        for node in self.md.nodes.values():
            if node.alive and node.has_disk:
                assert node.allocator.used <= int(node.allocator.capacity * self.md.memory_high)

    @invariant()
    def allocator_accounts_for_entries_and_quarantine(self) -> None:
        for node in self.md.nodes.values():
            if not node.alive:
                continue
            mine = [e for e in self.seen.values() if e.node is node and e.alloc_size]
            assert node.allocator.used == (
                sum(e.alloc_size for e in mine) + sum(q[2] for q in node.quarantine)
            )
            spans = sorted(
                [(e.offset, e.offset + e.alloc_size) for e in mine]
                + [(q[1], q[1] + q[2]) for q in node.quarantine]
            )
            for (_, end), (start, _) in itertools.pairwise(spans):
                assert end <= start, "extents overlap"
            assert all(s >= 0 and e <= node.allocator.capacity for s, e in spans)
            for e in mine:
                if e.dropped:  # held only by a reader or a reload writing into it
                    assert e.readers > 0 or e.reloading, e.key

    @invariant()
    def every_ready_entry_is_in_memory_or_on_disk(self) -> None:
        for e in self._table():
            node = e.node
            assert node.alive and e.key in node.entries and not e.dropped
            assert (e.key in node.lru) == (e.state is State.READY and e.in_memory)
            assert (e.key in node.disk_lru) == e.on_disk
            if e.on_disk:
                assert node.has_disk and e.file_bytes > 0 and e.state is State.READY
            if e.state is State.WRITING:
                assert e.alloc_size > 0 and not (e.on_disk or e.offloading or e.reloading)
                continue
            assert e.in_memory or e.on_disk or e.reloading, e.key
            if e.in_memory:
                assert e.alloc_size > 0 and not e.reloading
            elif e.reloading:
                assert e.alloc_size > 0 and e.on_disk and node.reloads.get(e.gen) is e
            else:
                assert e.alloc_size == 0 and e.on_disk
            if e.offloading:
                assert e.in_memory and not e.on_disk

    @invariant()
    def node_indexes_match_the_table(self) -> None:
        table = {id(e) for e in self._table()}
        for node in self.md.nodes.values():
            if not node.alive:
                assert not node.lru and not node.disk_lru and not node.orders
                continue
            for e in [*node.lru.values(), *node.disk_lru.values(), *node.reloads.values()]:
                assert e.node is node
                assert id(e) in table or (e.dropped and e.reloading)
            assert node.ready_bytes == sum(e.size for e in node.lru.values())
            assert node.disk_used == sum(e.file_bytes for e in node.disk_lru.values())
            assert node.disk_used == sum(
                e.file_bytes for e in self._table() if e.node is node and e.on_disk
            )
            assert node.offloading_bytes == sum(
                e.alloc_size for e in node.lru.values() if e.offloading
            )
            assert node.has_disk or (not node.disk_lru and not node.reloads and not node.orders)

    @invariant()
    def orders_name_the_node_that_holds_the_entry(self) -> None:
        for node in self.md.nodes.values():
            for o in node.orders:
                assert o.node == node.node_id
                if o.op != "delete":
                    entry = self._entry_of(o)
                    assert entry is not None and entry.node is node

    @invariant()
    def leased_entries_keep_their_memory_copy(self) -> None:
        # nothing under a live read lease is offloaded away or evicted for room
        for lease in self.md.read_leases.values():
            for e in lease.entries:
                assert e.dropped or e.in_memory or e.reloading, e.key

    @invariant()
    def readers_match_leases(self) -> None:
        held: dict[int, int] = {}
        for lease in self.md.read_leases.values():
            for e in lease.entries:
                held[id(e)] = held.get(id(e), 0) + 1
        for e in self.seen.values():
            assert e.readers == held.get(id(e), 0), e.key

    @invariant()
    def stats_match_the_nodes(self) -> None:
        alive = [n for n in self.md.nodes.values() if n.alive]
        stats = self.md.stats()
        assert stats["keys_memory"] == sum(len(n.lru) for n in alive)
        assert stats["keys_disk"] == sum(len(n.disk_lru) for n in alive)
        assert stats["bytes_disk"] == sum(n.disk_used for n in alive)
        assert stats["bytes_offloading"] == sum(n.offloading_bytes for n in alive)
        assert stats["hits"] + stats["misses"] >= 0


TestTieringMachine = TieringMachine.TestCase
TestTieringMachine.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
