"""Tiering in the manager's metadata core (polarkv_lib/manager/tiering.py): per-node
memory and disk tiers, offload / reload / delete orders and their answers, driven by a
fake clock. No I/O: the tests play the disk role by answering the orders themselves.

Paired sharding (PAPER "Architecture", DESIGN §6): every order goes to the node that
holds the entry, offload and reload stay inside that node, a disk hit reloads into the
same node's memory.
"""

from __future__ import annotations

from polarkv_lib.manager.model import (
    ORDER_TIMEOUT,
    AllocStatus,
    State,
    Wait,
)
from tests.unit.drive import (
    allocate,
    answer,
    finish_lookup,
    lookup,
    run_lookup,
    start_lookup,
)
from tests.unit.tiering_setup import (
    CHUNK,
    FILE,
    SUM,
    WRITE_TTL,
    K,
    X,
    Y,
    Z,
    add,
    adopt,
    fill,
    make,
    new_md,
    ops,
    order_for,
    store,
    tiers,
    with_a_clean_copy,
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
    results, _ = allocate(md, [(K[5], CHUNK)])
    assert results[0].status is AllocStatus.NO_SPACE
    assert d.allocator.used == 5 * CHUNK
    md.plan_tiering()
    assert ops(md.take_orders("d1")) == [("offload", k) for k in K[:2]]  # 5 -> 3 chunks


def test_offload_takes_lru_entries_tail_of_a_prefix_first() -> None:
    md, _, d = make(memory_low=0.5)  # plan down to 5 chunks
    p, q, r = K[0:4], K[4:8], K[8]  # a request gets at most 4 chunks here (its window)
    store(md, p)
    store(md, q)
    store(md, [r])
    # a batch enters the LRU back to front: a prompt's first chunk is its most recent one
    assert list(d.lru) == p[::-1] + q[::-1] + [r]
    lookup(md, [p[0], p[1]], take_lease=False)  # a reader used p's head again
    assert list(d.lru) == [p[3], p[2], *q[::-1], r, p[1], p[0]]
    assert md.plan_tiering() == ["d1"]
    orders = md.take_orders("d1")
    assert ops(orders) == [("offload", k) for k in (p[3], p[2], q[3], q[2])]
    for o in orders:
        e = md.get(o.key)
        assert e is not None and o == order_for(e, "offload")
        assert e.offloading and e.in_memory and not e.on_disk
        assert md.views.describe(e.key)["offloading"] is True  # type: ignore[index]
    assert d.offloading_bytes == 4 * CHUNK and md.views.stats()["bytes_offloading"] == 4 * CHUNK
    # orders in flight count as done: planning again asks for nothing more
    assert md.plan_tiering() == [] and d.orders == []


def test_allocate_touches_a_restored_prefix_back_to_front() -> None:
    md, _, d = make(memory_low=0.7)
    fill(md, K[:9])
    allocate(md, [(K[2], CHUNK), (K[3], CHUNK)])  # a writer re-storing K2, K3: they exist
    assert list(d.lru)[-2:] == [K[3], K[2]]
    md.plan_tiering()
    assert ops(md.take_orders("d1")) == [("offload", K[0]), ("offload", K[1])]


def test_offload_skips_leased_offloading_and_writing_entries() -> None:
    md, _, d = make()
    fill(md, [K[0], K[1]])
    _, lease = lookup(md, [K[0]], take_lease=True)
    assert lease is not None and list(d.lru) == [K[1]]  # read: out of the eviction order
    for k in K[2:9]:  # 7 chunks still being written
        _, writing = allocate(md, [(k, CHUNK)])
        assert writing is not None
    assert d.allocator.used == 9 * CHUNK
    md.plan_tiering()
    assert ops(md.take_orders("d1")) == [("offload", K[1])]  # not K0 (leased), not the writes
    assert not md.get(K[0]).offloading  # type: ignore[union-attr]
    # K1 is in flight and K0 still leased: nothing else is a candidate
    allocate(md, [(K[9], CHUNK)])
    md.plan_tiering()
    assert md.take_orders("d1") == []


# -- the memory cap ------------------------------------------------------------------------


def test_disk_node_memory_stays_under_the_high_watermark() -> None:
    md, _, d = make()
    limit = int(d.capacity * md.memory_high)
    fill(md, K[:9])
    assert d.allocator.used == limit == 9 * CHUNK
    results, _ = allocate(md, [(K[9], CHUNK)])
    assert results[0].status is AllocStatus.NO_SPACE  # rather than the 10th chunk
    assert d.pressure >= CHUNK
    results, _ = allocate(md, [(K[10], 2 * CHUNK)])  # larger than the gap between watermarks
    assert results[0].status is AllocStatus.NO_SPACE
    assert d.pressure >= 2 * CHUNK
    assert d.allocator.used == limit
    assert md.counters.evictions == 0 and md.counters.no_space == 2
    assert all(md.get(k) is not None for k in K[:9])  # nothing was evicted for it
    # the next plan makes room for what was refused, and forgets the pressure
    md.plan_tiering()
    answer(md, md.take_orders("d1"))
    assert d.pressure == 0
    results, _ = allocate(md, [(K[10], 2 * CHUNK)])
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
    assert md.views.stats()["keys_memory"] == 13


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
    _, lease = allocate(md, [(k, CHUNK) for k in K[5:9]])
    assert lease is not None
    md.abort(lease, None)  # 4 chunks wait out the writer's grant
    assert d.allocator.used == 9 * CHUNK
    assert allocate(md, [(K[9], CHUNK)])[0][0].status is AllocStatus.NO_SPACE
    clock.now += WRITE_TTL + 2.5
    md.expire()
    assert d.quarantine == [] and d.allocator.used == 5 * CHUNK
    assert allocate(md, [(K[9], CHUNK)])[0][0].status is AllocStatus.ALLOCATED


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
    stats = md.views.stats()
    assert (stats["keys_memory"], stats["bytes_memory"]) == (8, 8 * CHUNK)
    assert (stats["keys_disk"], stats["bytes_disk"], stats["capacity_disk"]) == (1, FILE, 20 * FILE)
    assert (stats["offloads"], stats["offload_bytes"], stats["bytes_offloading"]) == (1, CHUNK, 0)
    # the same answer again changes nothing
    md.offload_done("d1", K[0], order.gen, True, file_bytes=FILE)
    assert d.disk_used == FILE and md.counters.offloads == 1 and d.orders == []
    # a probe finds it on disk and moves nothing
    hits, lease = lookup(md, [K[0]], take_lease=False)
    assert hits == [e] and lease is None
    assert not e.reloading and d.orders == [] and d.allocator.used == 8 * CHUNK
    assert md.views.stats()["hits_disk"] == 1 and md.views.stats()["hits_memory"] == 0


def test_leased_entry_keeps_its_memory_copy_until_the_next_plan() -> None:
    md, _, d = make()
    fill(md, K[:9])
    md.plan_tiering()
    (order,) = md.take_orders("d1")
    _, lease = lookup(md, [K[0]], take_lease=True)  # a reader arrives during the offload
    assert lease is not None
    md.offload_done("d1", K[0], order.gen, True, file_bytes=FILE)
    assert tiers(md, K[0]) == ["memory", "disk"]  # the reader's bytes stay where they are
    assert d.allocator.used == 9 * CHUNK and d.disk_used == FILE
    assert K[0] not in d.lru and K[0] in d.disk_lru  # out of the order while it is read
    md.release([lease])
    assert tiers(md, K[0]) == ["memory", "disk"]
    assert K[0] in d.lru and K[0] in d.clean  # back, as a copy that can go at no cost
    lookup(md, K[1:9], take_lease=False)  # K0 is the least recently used again
    md.plan_tiering()
    assert md.take_orders("d1") == []  # no second offload: the copy just goes
    assert tiers(md, K[0]) == ["disk"] and d.allocator.used == 8 * CHUNK
    assert md.counters.offloads == 1


def test_allocation_drops_a_clean_memory_copy_instead_of_waiting() -> None:
    md, d = with_a_clean_copy()
    results, _ = allocate(md, [(K[9], CHUNK)])
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
    _, lease = lookup(md, [K[1]], take_lease=True)
    assert lease is not None
    answer(md, orders, ok=False, reason="disk_full")
    assert md.get(K[0]) is None  # evicted: memory freed at once
    assert d.allocator.used == 8 * CHUNK
    k1 = md.get(K[1])
    assert k1 is not None and tiers(md, K[1]) == ["memory"]  # leased: kept
    assert not k1.offloading and k1.readers == 1
    assert md.counters.evictions == 1 and d.offloading_bytes == 0
    assert md.counters.tier_failures == {"offload_disk_full": 2}
    assert md.views.stats()["tier_failures"] == 2
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
    lookup(md, [files[0]], take_lease=False)  # used: no longer among the oldest
    assert md.plan_tiering() == ["d1"]
    orders = md.take_orders("d1")
    assert ops(orders) == [("delete", K[0]), ("delete", files[1]), ("delete", files[2])]
    assert [o.gen for o in orders] == [m.gen, gens[files[1]], gens[files[2]]]
    assert all(o.node == "d1" for o in orders)
    assert d.disk_used == 9 * FILE and md.counters.disk_evictions == 3
    assert tiers(md, K[0]) == ["memory"]  # lost its file, kept its memory copy
    assert md.get(files[1]) is None and md.get(files[2]) is None  # disk-only: gone
    assert tiers(md, files[0]) == ["disk"]
    stats = md.views.stats()
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
    op, _ = start_lookup(md, [X])  # X is reloading
    lookup(md, [Y, Z], take_lease=False)  # touched back to front: disk LRU is X, Z, Y
    assert list(d.disk_lru) == [X, Z, Y]
    fill(md, K[:8])
    md.plan_tiering()
    orders = md.take_orders("d1")
    assert ops(orders) == [("delete", Z), ("reload", X), ("offload", K[0])]
    assert x.on_disk and x.reloading and md.get(Z) is None
    answer(md, orders)
    assert finish_lookup(md, op).served == [x]
    assert md.release([op.lease]).released == 1  # type: ignore[list-item]


def test_offloads_in_flight_keep_their_disk_room() -> None:
    md, _, d = make(disk_files=4, memory_low=0.5)  # room for 3 files under disk_high
    fill(md, K[:9])
    md.plan_tiering()
    first = md.take_orders("d1")
    assert len(first) == 3  # the disk budget stops the plan at 3 of the 4 it wanted
    assert allocate(md, [(K[9], CHUNK)])[0][0].status is AllocStatus.NO_SPACE
    md.plan_tiering()
    booked = d.disk_used + sum(e.size + 4096 for e in d.lru.values() if e.offloading)
    assert booked <= d.disk_capacity * md.disk_high


def test_delete_of_disk_entries_queues_file_deletes() -> None:
    md, _, d = make()
    (x,) = adopt(md, d, [X])
    assert md.delete(X)
    assert md.take_orders("d1") == [order_for(x, "delete")]
    assert d.disk_used == 0 and md.views.stats()["keys_disk"] == 0
    # memory and disk: the file goes and the memory is free at once
    fill(md, K[:9])
    md.plan_tiering()
    (order,) = md.take_orders("d1")
    _, lease = lookup(md, [K[0]], take_lease=True)
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


def test_deleting_a_disk_entry_under_reload_keeps_its_extent_until_its_reader_lets_go() -> None:
    md, _, d = make()
    (x,) = adopt(md, d, [X])
    op, _ = start_lookup(md, [X])
    (reload,) = md.take_orders("d1")
    assert md.delete(X)
    assert ops(md.take_orders("d1")) == [("delete", X)]
    assert d.allocator.used == CHUNK  # the disk role may still be writing into it
    md.reload_done("d1", X, reload.gen, True)
    assert d.allocator.used == CHUNK and x.readers == 1  # and now a reader holds it
    assert finish_lookup(md, op).served == [] and op.lease is None
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
    assert d.disk_used == 0 and md.counters.offloads == 0 and md.views.stats()["keys_disk"] == 0
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
    _, lease = lookup(md, K[1:9], take_lease=True)
    allocate(md, [(K[9], CHUNK)])
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
    op_x, _ = start_lookup(md, [X])
    reloads = md.take_orders("d1")
    assert ops(reloads) == [("reload", X)]  # in flight
    op_y, _ = start_lookup(md, [Y])
    assert ops(d.orders) == [("reload", Y)]  # still queued
    answer(md, md.take_orders("d2"))
    lost = len(d.entries)
    offloaded = md.counters.offloads
    assert md.unregister("d1", 1)
    assert d.orders == [] and md.take_orders("d1") == []  # nothing for a dead disk role
    assert md.get(X) is None and md.get(Y) is None
    assert all(md.get(o.key) is None for o in offloads)
    assert md.counters.entries_lost == lost
    stats = md.views.stats()
    assert stats["keys_disk"] == len(other.disk_lru) == 4
    assert stats["bytes_disk"] == other.disk_used == 4 * FILE
    # late answers of the dead incarnation change nothing
    answer(md, offloads[2:] + reloads)
    assert d.orders == [] and md.counters.offloads == offloaded and md.counters.reloads == 0
    for op in (op_x, op_y):  # their lookups answer nothing, and hold nothing
        assert finish_lookup(md, op).served == [] and op.lease is None
    assert md.read_leases == {}
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
    results, wl = allocate(md, [(match, CHUNK), (mismatch, CHUNK)])
    assert wl is not None and all(r.entry.node is d for r in results)  # type: ignore[union-attr]
    md.commit(wl, [(match, SUM), (mismatch, "f" * 16)])
    _, still_writing = allocate(md, [(writing, CHUNK)])
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
    assert d.disk_used == 4 * FILE and md.views.stats()["keys_disk"] == 3
    assert lookup(md, [X, Y], take_lease=False)[0] == [x, y]


def test_adopt_places_nothing_on_other_nodes() -> None:
    md, _ = new_md()
    d1 = add(md, "d1", 10, disk_files=20)
    add(md, "d2", 40, disk_files=20)
    (x, y) = adopt(md, d1, [X, Y])
    op, step = start_lookup(md, [X, Y])
    assert step.gens == (x.gen,)  # this window; Y is read ahead for the next one
    orders = md.take_orders("d1")
    assert ops(orders) == [("reload", X), ("reload", Y)]
    assert md.take_orders("d2") == [] and md.nodes["d2"].allocator.used == 0
    answer(md, orders)
    assert finish_lookup(md, op).served == [x] and op.more
    assert run_lookup(md, [Y], True, resume=op.lease).served == [y]
    assert all(e.node is d1 and e.in_memory for e in (x, y))


# -- order timeouts -------------------------------------------------------------------------


def test_unanswered_orders_time_out() -> None:
    md, clock, d = make()
    (x,) = adopt(md, d, [X])
    fill(md, K[:8])
    op, _ = start_lookup(md, [X], wait=2 * ORDER_TIMEOUT)  # 9 chunks with X's reload extent
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
    # the lookup waiting for it answers at once: a miss, holding nothing
    assert md.advance_lookup(op).wait is Wait.DONE and op.served == [] and op.lease is None
    md.close_lookup(op)
    md.take_orders("d1")
    # answers arriving after the timeout: the late file is not wanted, the late reload ignored
    md.offload_done("d1", k0.key, offload.gen, True, file_bytes=FILE)
    assert ops(md.take_orders("d1")) == [("delete", k0.key)]
    assert tiers(md, k0.key) == ["memory"] and d.disk_used == FILE
    md.reload_done("d1", X, reload.gen, True)
    assert tiers(md, X) == ["disk"] and md.counters.reloads == 0
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
