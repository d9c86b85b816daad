"""Reloads in the manager's metadata core (polarkv_lib/manager/tiering.py, reads.py): a
disk hit reloads into the same node's memory, concurrent lookups share one reload, a
failed or late reload ends the prefix there, and a stream waits for room holding
nothing. Driven by a fake clock; the tests answer the orders as the disk role would."""

from __future__ import annotations

from polarkv_lib.manager.model import (
    Wait,
)
from tests.unit.drive import (
    answer,
    disk_role,
    finish_lookup,
    lookup,
    run_lookup,
    start_lookup,
)
from tests.unit.tiering_setup import (
    CHUNK,
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

# -- reloads ------------------------------------------------------------------------------


def test_disk_hit_reloads_into_the_same_node() -> None:
    md, _ = new_md()
    d1 = add(md, "d1", 10, disk_files=20)
    d2 = add(md, "d2", 10, disk_files=20)
    p = add(md, "p1", 40)  # the most free memory anywhere, but not where the file is
    (x,) = adopt(md, d1, [X])
    op, step = start_lookup(md, [X], wait=1.0)
    assert step.wait is Wait.RELOADS and step.gens == (x.gen,) and step.until == op.deadline
    assert op.lease is not None and op.served == [] and op.pending == [x]
    assert x.reloading and not x.in_memory and x.alloc_size == CHUNK and x.readers == 1
    assert d1.allocator.used == CHUNK and d2.allocator.used == 0 and p.allocator.used == 0
    assert x.offset >= 0 and x.offset + x.alloc_size <= int(d1.capacity * md.memory_high)
    (order,) = md.take_orders("d1")
    assert order == order_for(x, "reload") and order.node == "d1"
    assert md.take_orders("d2") == [] and md.take_orders("p1") == []
    assert d1.reloads == {x.gen: x}
    view = md.views.describe(X)
    assert view is not None and view["tiers"] == ["disk"] and view["reloading"] is True
    assert md.views.stats()["lookups"] == 0  # nothing is counted before the answer is final
    answer(md, [order])
    finish_lookup(md, op)
    assert op.served == [x] and not op.more and x.readers == 1
    stats = md.views.stats()
    assert (stats["lookups"], stats["hits"], stats["hits_disk"], stats["hits_memory"]) == (
        1,
        1,
        1,
        0,
    )


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
    op, step = start_lookup(md, [on_d1.key])
    assert step.wait is Wait.RELOADS and on_d1.reloading
    assert md.take_orders("d2") == []
    (order,) = md.take_orders("d1")
    assert order.op == "reload" and order.node == "d1"
    answer(md, [order])
    assert finish_lookup(md, op).served == [on_d1]
    assert on_d1.node is d1 and tiers(md, on_d1.key) == ["memory", "disk"]


def test_concurrent_lookups_share_one_reload() -> None:
    md, _, d = make()
    (x,) = adopt(md, d, [X])
    op1, step1 = start_lookup(md, [X])
    op2, step2 = start_lookup(md, [X])
    assert step1 == step2 and step1.gens == (x.gen,)  # both wait for the one reload
    assert op1.lease and op2.lease and op1.lease != op2.lease
    assert x.readers == 2 and d.allocator.used == CHUNK  # one extent
    (order,) = md.take_orders("d1")  # one reload
    assert order.op == "reload"
    md.reload_done("d1", X, order.gen, True)
    assert finish_lookup(md, op1).served == [x]
    assert finish_lookup(md, op2).served == [x]
    l1, l2 = op1.lease, op2.lease
    assert x.readers == 2 and md.read_leases[l1].served == [x]
    assert tiers(md, X) == ["memory", "disk"] and not x.reloading and d.reloads == {}
    assert list(d.lru) == [] and d.keys_memory == 1 and d.ready_bytes == CHUNK  # read: held
    stats = md.views.stats()
    assert (stats["reloads"], stats["reload_bytes"], stats["hits_disk"]) == (1, CHUNK, 2)
    assert (stats["keys_memory"], stats["keys_disk"]) == (1, 1)
    md.release([l1, l2])
    assert x.readers == 0 and list(d.lru) == [X]
    # now it is a memory hit
    lookup(md, [X], take_lease=False)
    assert md.counters.hits_memory == 1 and md.take_orders("d1") == []


def test_reload_checksum_failure_drops_the_entry_and_ends_the_stream() -> None:
    md, _, d = make()
    (m0,) = store(md, [K[0]])
    (x,) = adopt(md, d, [X])
    (m2,) = store(md, [K[2]])
    # The prefix reaches the disk after K0: the answer is the window in memory, and X is
    # read ahead for the next one.
    first = run_lookup(md, [K[0], X, K[2]], True)
    assert first.served == [m0] and first.more and first.lease is not None
    assert x.reloading and x.readers == 1 and m2.readers == 0
    (order,) = md.take_orders("d1")
    md.reload_done("d1", X, order.gen, False, "checksum")
    assert md.get(X) is None and x.dropped
    assert md.counters.checksum_failures == 1
    assert md.counters.tier_failures == {"reload_checksum": 1}
    assert d.allocator.used == 3 * CHUNK  # X's extent waits for its reader to let go
    rest = run_lookup(md, [X, K[2]], True, resume=first.lease)
    assert rest.served == [] and not rest.more  # wrong bytes are never served
    assert (m0.readers, m2.readers) == (0, 0)  # the stream let go of what it read
    assert tiers(md, K[2]) == ["memory"]  # only the lookup lost it, not the cache
    # the stream ended with that answer: what was read ahead for it was let go, and so
    # was its lease (the reader's release finds nothing)
    assert md.release([first.lease]).released == 0
    assert x.readers == 0 and d.allocator.used == 2 * CHUNK  # X's extent is free
    stats = md.views.stats()
    assert (stats["hits"], stats["misses"], stats["keys_disk"], stats["bytes_disk"]) == (1, 2, 0, 0)


def test_a_failed_reload_is_counted_once_as_misses() -> None:
    md, _, d = make()
    adopt(md, d, [X])
    store(md, [K[1]])
    op, step = start_lookup(md, [X, K[1]])  # X reloads, K1 is held with it
    assert step.wait is Wait.RELOADS and len(op.pending) == 2
    (order,) = md.take_orders("d1")
    md.reload_done("d1", X, order.gen, False, "checksum")
    assert finish_lookup(md, op).served == [] and op.lease is None
    stats = md.views.stats()  # never counted as hits first, then taken back
    assert (stats["lookups"], stats["hits"], stats["misses"]) == (1, 0, 2)
    assert (stats["hits_disk"], stats["hits_memory"]) == (0, 0)
    assert md.get(K[1]).readers == 0  # type: ignore[union-attr]


def test_a_reload_still_running_at_the_deadline_ends_the_prefix_there() -> None:
    md, clock, d = make()
    (m0,) = store(md, [K[0]])
    (x,) = adopt(md, d, [X])
    op, step = start_lookup(md, [X, K[0]], wait=1.0)
    assert step.wait is Wait.RELOADS and m0.readers == 1
    (order,) = md.take_orders("d1")
    clock.now = step.until  # the caller's wait is over
    assert finish_lookup(md, op).served == [] and op.lease is None
    assert x.readers == 0 and m0.readers == 0 and x.reloading
    assert md.read_leases == {}
    md.reload_done("d1", X, order.gen, True)  # it lands later, for the next reader
    assert tiers(md, X) == ["memory", "disk"]
    hits, _ = lookup(md, [X, K[0]], take_lease=False)
    assert hits == [x, m0] and md.take_orders("d1") == []


def test_a_window_read_ahead_still_reloading_at_the_deadline_ends_the_stream() -> None:
    md, _, d = make()
    (m0,) = store(md, [K[0]])
    (x,) = adopt(md, d, [X])
    first = run_lookup(md, [K[0], X], True)
    assert first.served == [m0] and first.more and x.reloading and x.readers == 1
    rest = run_lookup(md, [X], True, resume=first.lease)  # nobody answers the reload
    assert rest.served == [] and not rest.more and rest.lease is None
    assert md.read_leases == {} and x.readers == 0 and m0.readers == 0


def test_a_lookup_of_memory_entries_answers_at_once_and_keeps_them_leased() -> None:
    md, _, _ = make()
    entries = store(md, K[:3])
    op, step = start_lookup(md, K[:3])
    assert step.wait is Wait.DONE and op.served == entries and not op.more
    md.close_lookup(op)
    assert md.read_leases[op.lease].served == entries  # type: ignore[index]
    assert all(e.readers == 1 for e in entries)


def test_a_lookup_short_of_room_waits_holding_nothing_then_room_is_made_for_its_window() -> None:
    md, clock, d = make()
    (x, y, z) = adopt(md, d, [X, Y, Z])
    fill(md, K[:9])
    _, leased = lookup(md, K[:9], take_lease=True)  # nothing in memory can move
    assert leased is not None
    # out of time at once: nothing served, no lease, but room is coming (the reader's
    # extents come back): `more`, ask again
    quick = run_lookup(md, [X, Y, Z], True)
    assert quick.served == [] and quick.lease is None and quick.more
    assert md.counters.misses == 3  # an answer with nothing in it is a miss, `more` or not
    op, step = start_lookup(md, [X, Y, Z], wait=5.0)
    assert step.wait is Wait.ROOM and step.until == op.deadline
    assert op.lease is None and op.pending == [] and d.room_waiters == 1  # it holds nothing
    assert (x.readers, x.reloading) == (0, False) and d.orders == []
    assert d.allocator.used == 9 * CHUNK
    md.release([leased])
    step = md.advance_lookup(op)  # room for the whole window at once, not a chunk a round
    assert step.wait is Wait.ROOM and d.room_waiters == 1
    offloads = md.take_orders("d1")
    assert ops(offloads) == [("offload", k) for k in K[8:5:-1]]
    answer(md, offloads)
    step = md.advance_lookup(op)
    assert step.wait is Wait.RELOADS and d.room_waiters == 0
    assert step.gens == (x.gen, y.gen) and z.reloading  # a window of two; Z read ahead
    answer(md, md.take_orders("d1"))
    finish_lookup(md, op)
    assert op.served == [x, y] and op.more
    rest = run_lookup(md, [Z], True, resume=op.lease)
    assert rest.served == [z] and not rest.more and (x.readers, y.readers) == (0, 0)
    assert md.release([op.lease]).released == 1  # type: ignore[list-item]
    assert (md.counters.hits_disk, md.counters.misses) == (3, 3)  # the quick answer's
    del clock


def test_a_lookup_short_of_room_waits_for_readers_to_let_go_then_reloads() -> None:
    """Memory full of copies that another request is reading: the reload cannot start
    and no offload can help, but that reader's release will; the lookup waits for it
    and its next step reloads into the room the release made (K0's clean copy)."""
    md, d = with_a_clean_copy()
    (x,) = adopt(md, d, [X])
    _, other = lookup(md, K[:9], take_lease=True)  # another request reads all of memory
    assert other is not None
    op, step = start_lookup(md, [X], wait=5.0)
    assert step.wait is Wait.ROOM and op.lease is None and x.readers == 0
    assert md.advance_lookup(op).wait is Wait.ROOM  # nothing changed: it waits again
    md.release([other])
    step = md.advance_lookup(op)
    assert step.wait is Wait.RELOADS and step.gens == (x.gen,)
    assert tiers(md, K[0]) == ["disk"]  # K0's clean copy made the room
    answer(md, md.take_orders("d1"))
    finish_lookup(md, op)
    assert op.served == [x] and op.lease is not None and not op.more
    md.release([op.lease])


def test_a_stream_reloads_into_the_room_of_what_it_read_not_of_what_it_serves() -> None:
    md, d = with_a_clean_copy()
    (x,) = adopt(md, d, [X])
    _, others = lookup(md, K[1:9], take_lease=True)
    first = run_lookup(md, [K[0], X], True)
    # X would fit only by dropping K0's memory copy, which this answer is serving
    assert first.served == [md.get(K[0])] and first.more
    assert tiers(md, K[0]) == ["memory", "disk"] and not x.reloading
    # the next window: the stream has read K0 and lets go of it, so it may go now
    rest = run_lookup(md, [X], True, resume=first.lease, meanwhile=disk_role(md), wait=1.0)
    assert rest.served == [x] and tiers(md, K[0]) == ["disk"]
    md.release([first.lease, others])  # type: ignore[list-item]
