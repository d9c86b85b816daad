"""Loads and stores that stream through memory (manager/core.py, "reads" and "writes";
tiering.py `_read_window`, `_write_window`), driven step by step with a fake clock and
the tests playing the disk role.

A lookup whose prefix reaches the disk answers window by window: each answer is at
most the stream's share of the node's memory, the next window is reloaded while the
reader reads this one, and the reader's next lookup names its lease to let go of what
it read. A lookup that waited for room goes before newcomers; a waiting lookup holds
nothing. A write request gets at most a window (LATER past it); a store of several
windows keeps its lease, and its earlier chunks are never its later ones' victims.
"""

from __future__ import annotations

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import (
    ORDER_TIMEOUT,
    AllocStatus,
    Entry,
    Lookup,
    Node,
    Step,
    Wait,
)
from polarkv_lib.wire.orders import Order, TierOp
from tests.unit.drive import (
    allocate,
    answer,
    disk_role,
    finish_allocate,
    finish_lookup,
    load,
    lookup,
    run_lookup,
    start_allocate,
    start_lookup,
)
from tests.unit.tiering_setup import CHUNK, SUM, K, X, Y, add, adopt, fill, make, new_md, store

D = [f"{i:032x}" for i in range(100, 140)]  # keys of prompts stored on disk


def reloads(md: Metadata, node: Node) -> list[str]:
    """The keys the node's disk role is asked to reload now (orders left queued)."""
    return [o.key for o in node.orders if o.op is TierOp.RELOAD]


def answer_window(md: Metadata, node: Node, step: Step) -> list[Order]:
    """The disk role takes the node's orders and answers the reloads `step` waits for;
    the rest (the window read ahead) it has taken and not answered yet."""
    taken = md.take_orders(node.node_id)
    answer(md, [o for o in taken if o.gen in step.gens])
    return [o for o in taken if o.gen not in step.gens]


def pin(md: Metadata, keys: list[str]) -> str:
    """Another reader holds these entries (in memory) under its lease."""
    hits, lease = lookup(md, keys, take_lease=True)
    assert [e.key for e in hits] == keys and lease is not None
    return lease


# -- windows and read-ahead --------------------------------------------------------------


def test_a_prefix_on_disk_streams_window_by_window_each_its_share_reloading_the_next() -> None:
    md, _, d = make(chunks=10, disk_files=40)  # memory for 9 chunks; a stream's share: 4
    prefix = adopt(md, d, D[:24])  # 24 chunks on disk: almost three times memory
    lease: str | None = None
    windows: list[list[Entry]] = []
    taken: list[Order] = []  # orders the disk role has taken and not answered yet
    while len(windows) < 10:
        served = sum(len(w) for w in windows)
        answer(md, taken + md.take_orders("d1"))  # the read-ahead lands while one is read
        op, step = start_lookup(md, D[served:24], wait=1.0, resume=lease)
        taken = []
        if step.wait is Wait.RELOADS:  # nothing in memory yet: this window is waited for
            taken = answer_window(md, d, step)
        finish_lookup(md, op)
        lease = op.lease
        assert lease is not None and all(e.in_memory and e.readers == 1 for e in op.served)
        windows.append(op.served)
        if len(windows) > 1:  # the lookup let go of the window read before
            assert all(e.readers == 0 for e in windows[-2])
        # each answer is at most its share: two windows of a stream fit under the cap
        assert len(op.served) <= 4 and d.allocator.used <= 9 * CHUNK
        if not op.more:
            break
        ahead = md.read_leases[lease].ahead
        # the next window is already being reloaded, pinned under the stream's lease
        following = D[served + len(op.served) :][: len(ahead)]
        assert list(ahead) == following and ahead
        assert all(e.reloading and e.readers == 1 for e in ahead.values())
        assert all(d.reloads.get(e.gen) is e for e in ahead.values())
    assert [e for w in windows for e in w] == prefix  # whole, in order
    assert [len(w) for w in windows] == [4] * 6
    md.release([lease])  # type: ignore[list-item]
    assert md.read_leases == {} and d.loaders == set()
    c = md.counters
    assert (c.lookups, c.hits, c.hits_disk, c.misses, c.reloads) == (6, 24, 24, 0, 24)


def test_a_streamed_prefix_stays_stored_and_unpinned() -> None:
    md, _, d = make(chunks=10, disk_files=40)
    adopt(md, d, D[:12])
    read, windows = load(md, D[:12], disk_role(md))
    assert windows == [4, 4, 4] and [e.key for e in read] == D[:12]
    assert all(e.readers == 0 for e in read) and md.read_leases == {}
    # nothing a window read was evicted: it is a clean copy (or on disk only again)
    assert all(e.on_disk and md.get(e.key) is e for e in read)
    assert d.lru_extent == d.allocator.used


def test_two_streams_on_one_node_share_its_memory_and_both_finish() -> None:
    md, _, d = make(chunks=10, disk_files=40)
    adopt(md, d, D[:24])
    got: dict[str, list[int]] = {"a": [], "b": []}
    done = {"a": 0, "b": 0}
    keys = {"a": D[:12], "b": D[12:24]}
    leases: dict[str, str | None] = {"a": None, "b": None}
    for _ in range(20):
        for name in ("a", "b"):
            if done[name] == 12:
                continue
            op = run_lookup(
                md,
                keys[name][done[name] :],
                True,
                wait=1.0,
                resume=leases[name],
                meanwhile=disk_role(md),
            )
            leases[name] = op.lease
            done[name] += len(op.served)
            got[name].append(len(op.served))
            assert d.allocator.used <= 9 * CHUNK
    assert done == {"a": 12, "b": 12}
    # a alone had a share of 4 for its first window and the one it read ahead; once both
    # stream, each window is at most a share of two: 9 // 4 chunks
    assert got["a"][:2] == [4, 4] and max(got["a"][2:] + got["b"]) <= 2, got
    md.release([lease for lease in leases.values() if lease])
    assert md.read_leases == {} and d.loaders == set()


def test_a_stream_holds_at_most_its_window_and_the_next_one() -> None:
    md, _, d = make(chunks=10, disk_files=40, stream_window=2 * CHUNK)
    adopt(md, d, D[:10])
    op = run_lookup(md, D[:10], True, wait=1.0, meanwhile=disk_role(md))
    lease = md.read_leases[op.lease]  # type: ignore[index]
    assert len(op.served) == 2 and op.more  # the stream_window bounds a window
    assert len(lease.served) + len(lease.ahead) <= 4
    assert d.allocator.used == 4 * CHUNK
    md.release([op.lease])  # type: ignore[list-item]


# -- fairness ------------------------------------------------------------------------------


def test_a_lookup_that_waited_for_room_goes_before_newcomers() -> None:
    md, _, d = make()
    fill(md, K[:9])
    held = pin(md, K[:9])  # memory full, all of it being read
    adopt(md, d, [X, D[0]])
    first, step = start_lookup(md, [X], wait=5.0)
    assert step.wait is Wait.ROOM and d.room_waiters == 1
    md.release([held])  # room comes (the copies may be offloaded or dropped now) ...
    newcomer, step = start_lookup(md, [D[0]], wait=5.0)
    # ... but the newcomer queues behind the lookup already waiting there
    assert step.wait is Wait.ROOM and newcomer.pending == [] and d.room_waiters == 2
    assert reloads(md, d) == []
    answer(md, md.take_orders("d1"))  # the offload planned for the first one
    step = md.advance_lookup(first)
    assert step.wait is Wait.RELOADS and first.pending == [md.get(X)]
    step = md.advance_lookup(newcomer)  # it has waited in line: it asks for its own room
    assert step.wait is Wait.ROOM and d.room_waiters == 1
    answer(md, md.take_orders("d1"))
    step = md.advance_lookup(newcomer)
    assert step.wait is Wait.RELOADS and d.room_waiters == 0
    answer(md, md.take_orders("d1"))
    assert finish_lookup(md, first).served == [md.get(X)]
    assert finish_lookup(md, newcomer).served == [md.get(D[0])]
    md.release([first.lease, newcomer.lease])  # type: ignore[list-item]


def test_read_ahead_leaves_nodes_where_lookups_wait_for_room() -> None:
    md, _, d = make(chunks=10, disk_files=40, stream_window=2 * CHUNK)
    fill(md, K[:5])
    held = pin(md, K[:5])  # 5 of the 9 chunks are being read
    adopt(md, d, [*D[:6], X])
    stream = run_lookup(md, D[:6], True, wait=1.0, meanwhile=disk_role(md))
    assert len(stream.served) == 2 and stream.more  # D0, D1; D2, D3 read ahead
    assert d.allocator.used == 9 * CHUNK
    waiting, step = start_lookup(md, [X], wait=5.0)
    assert step.wait is Wait.ROOM and d.room_waiters == 1
    # the stream's next window was read ahead already; it reads no further while X waits
    nxt = run_lookup(md, D[2:6], True, resume=stream.lease)
    assert [e.key for e in nxt.served] == D[2:4] and nxt.more
    assert md.read_leases[nxt.lease].ahead == {} and reloads(md, d) == []  # type: ignore[index]
    # the window the stream let go of is the waiting lookup's room
    step = md.advance_lookup(waiting)
    assert step.wait is Wait.RELOADS and reloads(md, d) == [X]
    answer(md, md.take_orders("d1"))
    assert [e.key for e in finish_lookup(md, waiting).served] == [X]
    md.release([held, nxt.lease, waiting.lease])  # type: ignore[list-item]


def test_a_stream_waiting_for_room_holds_nothing() -> None:
    md, _, d = make(stream_window=2 * CHUNK)
    fill(md, K[:5])
    held = pin(md, K[:5])  # 5 of the 9 chunks are read by another request
    adopt(md, d, D[:8])
    first = run_lookup(md, D[:8], True, wait=1.0, meanwhile=disk_role(md))
    assert [e.key for e in first.served] == D[:2] and first.more  # D2, D3 read ahead
    other = pin(md, D[:4])  # another reader reads the same four chunks
    second = run_lookup(md, D[2:8], True, resume=first.lease)
    assert [e.key for e in second.served] == D[2:4] and second.more
    assert md.read_leases[first.lease].ahead == {}  # type: ignore[index]  # no room to read ahead
    # the next window: it lets go of D2, D3 and has no room for D4: it waits, holding nothing
    op, step = start_lookup(md, D[4:8], wait=5.0, resume=first.lease)
    assert step.wait is Wait.ROOM and op.pending == [] and d.room_waiters == 1
    lease = md.read_leases[first.lease]  # type: ignore[index]
    assert lease.served == [] and lease.ahead == {}
    assert [md.get(k).readers for k in D[:8]] == [1] * 4 + [0] * 4  # type: ignore[union-attr]
    md.release([other, held])  # room comes back
    step = md.advance_lookup(op)
    assert step.wait is Wait.RELOADS and d.room_waiters == 0
    answer(md, md.take_orders("d1"))
    assert [e.key for e in finish_lookup(md, op).served] == D[4:6]
    md.release([first.lease])  # type: ignore[list-item]


# -- writes ----------------------------------------------------------------------------------


def test_a_write_request_gets_its_window_and_the_rest_later() -> None:
    md, _, d = make()  # memory for 9 chunks: one writer's window is 4
    keys = K[:7]
    results, lease = allocate(md, [(k, CHUNK) for k in keys])
    statuses = [r.status for r in results]
    assert statuses == [AllocStatus.ALLOCATED] * 4 + [AllocStatus.LATER] * 3
    assert lease is not None and md.get(keys[4]) is None
    assert md.counters.allocations == 4 and md.counters.no_space == 0  # LATER is no outcome
    assert md.commit(lease, [(k, SUM) for k in keys[:4]], more=True) == dict.fromkeys(
        keys[:4], "committed"
    )
    assert md.write_leases[lease].entries == {} and md.write_leases[lease].keep
    results, again = allocate(md, [(k, CHUNK) for k in keys[4:]], resume=lease)
    assert again == lease and [r.status for r in results] == [AllocStatus.ALLOCATED] * 3
    md.commit(lease, [(k, SUM) for k in keys[4:]])
    assert lease not in md.write_leases and d.keys_memory == 7


def test_concurrent_writers_share_the_window() -> None:
    md, _, _ = make()
    _, first = allocate(md, [(k, CHUNK) for k in K[:2]])
    assert first is not None  # one open write: the next gets 9 // (2 * 2) chunks
    results, second = allocate(md, [(k, CHUNK) for k in K[2:6]])
    assert [r.status for r in results] == [AllocStatus.ALLOCATED] * 2 + [AllocStatus.LATER] * 2
    assert second is not None and second != first


def test_without_a_disk_node_a_request_has_no_window() -> None:
    md, _ = new_md()
    add(md, "p1", 10)
    results, _ = allocate(md, [(k, CHUNK) for k in K[:10]])
    assert [r.status for r in results] == [AllocStatus.ALLOCATED] * 10


def test_an_allocation_is_a_prefix() -> None:
    md, _ = new_md()
    add(md, "p1", 4)
    store(md, [K[0]])
    held = pin(md, [K[0]])
    results, _ = allocate(md, [(K[1], 2 * CHUNK), (K[2], 2 * CHUNK), (K[3], 1), (K[0], CHUNK)])
    # K3 would fit in the chunk left, but comes after a refused item; K0 exists
    assert [r.status for r in results] == [
        AllocStatus.ALLOCATED,
        AllocStatus.NO_SPACE,
        AllocStatus.NO_SPACE,
        AllocStatus.EXISTS,
    ]
    assert md.counters.no_space == 2
    md.release([held])


def test_a_continued_store_never_evicts_its_own_earlier_chunks() -> None:
    md, _ = new_md()
    p = add(md, "p1", 5)  # memory only: room comes from evicting
    (old,) = store(md, [K[20]])
    prompt = K[:6]
    lease: str | None = None
    got: list[AllocStatus] = []
    for start in range(0, 6, 2):  # windows of two under one write lease
        part = prompt[start : start + 2]
        more = start + 2 < 6
        results, lease = allocate(md, [(k, CHUNK) for k in part], resume=lease, more=more)
        assert lease is not None
        got += [r.status for r in results]
        mine = [(r.key, SUM) for r in results if r.status is AllocStatus.ALLOCATED]
        md.commit(lease, mine, more=more)
    # the older prompt was evicted for the third window; the store's own head never was
    assert got == [AllocStatus.ALLOCATED] * 5 + [AllocStatus.NO_SPACE]
    assert md.get(old.key) is None and md.counters.evictions == 1
    assert all(md.get(k) is not None for k in prompt[:5]) and p.keys_memory == 5
    assert lease not in md.write_leases  # the last window ended it
    # a new store (another lease) may evict them, least recently used first
    results, _ = allocate(md, [(K[30], CHUNK)])
    assert results[0].status is AllocStatus.ALLOCATED and md.counters.evictions == 2


# -- abandoned requests -----------------------------------------------------------------------


def test_closing_an_abandoned_lookup_leaves_nothing_pinned_and_counts_it_once() -> None:
    md, _, d = make()
    (m0,) = store(md, [K[0]])
    adopt(md, d, [X])
    op, step = start_lookup(md, [X, K[0]], wait=5.0)  # waits for X's reload, holding K0
    assert step.wait is Wait.RELOADS and m0.readers == 1 and md.counters.lookups == 0
    md.close_lookup(op)  # the client went away
    assert op.done and op.served == [] and op.lease is None and md.read_leases == {}
    assert m0.readers == 0 and K[0] in d.lru
    c = md.counters
    assert (c.lookups, c.hits, c.misses) == (1, 0, 2)
    md.close_lookup(op)  # closing again changes nothing
    assert (c.lookups, c.misses) == (1, 2)


def test_closing_a_lookup_waiting_for_room_counts_no_waiter() -> None:
    md, _, d = make()
    fill(md, K[:9])
    held = pin(md, K[:9])
    adopt(md, d, [X])
    op, step = start_lookup(md, [X], wait=5.0)
    assert step.wait is Wait.ROOM and d.room_waiters == 1
    md.close_lookup(op)
    assert d.room_waiters == 0 and op.done and md.counters.lookups == 2
    md.release([held])
    # nobody waits there now: a newcomer asks for room of its own, in line behind no one
    newcomer, step = start_lookup(md, [X], wait=5.0)
    assert step.wait is Wait.ROOM and d.room_waiters == 1 and d.pressure + len(d.orders) > 0
    md.close_lookup(newcomer)
    assert d.room_waiters == 0


def test_closing_an_abandoned_stream_lets_go_of_its_window() -> None:
    md, _, d = make(chunks=10, disk_files=40)
    adopt(md, d, D[:12])
    first, step = start_lookup(md, D[:12], wait=1.0)
    in_flight = answer_window(md, d, step)  # the next window is read ahead, not landed
    finish_lookup(md, first)
    assert first.more and first.lease is not None and in_flight
    op, step = start_lookup(md, D[len(first.served) : 12], wait=1.0, resume=first.lease)
    assert step.wait is Wait.RELOADS  # for the window read ahead
    md.close_lookup(op)  # the reader left mid-stream; its release follows
    assert d.room_waiters == 0
    # the abandoned request let go of the window it took, and with nothing left in it,
    # the stream's lease ended: the reader's release finds nothing to do
    assert md.release([first.lease]).released == 0
    answer(md, in_flight + md.take_orders("d1"))  # the disk role answers late
    assert all(md.get(k).readers == 0 for k in D[:12])  # type: ignore[union-attr]
    assert md.read_leases == {} and d.loaders == set()
    assert d.lru_extent == d.allocator.used  # every copy may leave memory again


def test_closing_an_abandoned_allocation_allocates_nothing_and_counts_it_once() -> None:
    md, _, d = make()
    fill(md, K[:9])
    held = pin(md, K[:9])
    op, step = start_allocate(md, [(K[9], CHUNK), (K[10], CHUNK)], wait=5.0)
    assert step.wait is Wait.ROOM and md.counters.no_space == 0  # not final yet
    md.close_allocate(op)
    assert op.done and op.lease is None and md.write_leases == {}
    assert [r.status for r in op.results if r] == [AllocStatus.NO_SPACE] * 2
    assert md.counters.no_space == 2 and md.get(K[9]) is None
    finish_allocate(md, op)  # closing again changes nothing
    assert md.counters.no_space == 2
    md.release([held])
    assert d.allocator.used == 9 * CHUNK


# -- what a waiting request holds when its client, lease or reload goes away ---------------


def test_closing_an_abandoned_lookup_whose_reloads_landed_leaves_nothing_pinned() -> None:
    """The client went away after the reload landed, before the shell took its next
    step: nobody will ever learn the lease, so nothing may stay pinned under it."""
    md, _, d = make()
    (m1,) = store(md, [K[1]])
    (x,) = adopt(md, d, [X])
    op, step = start_lookup(md, [X, K[1]], wait=5.0)
    assert step.wait is Wait.RELOADS
    answer(md, md.take_orders("d1"))
    md.close_lookup(op)
    assert (x.readers, m1.readers) == (0, 0) and md.read_leases == {}


def test_a_read_ahead_whose_reload_timed_out_is_not_served() -> None:
    """A window read ahead whose reload the disk role never answered is on disk only
    again (its extent quarantined): the next lookup of the stream must not serve it."""
    md, clock, d = make()
    (m0,) = store(md, [K[0]])
    (x,) = adopt(md, d, [X])
    first = run_lookup(md, [K[0], X], True)
    assert first.served == [m0] and first.more and x.reloading
    md.take_orders("d1")  # taken, never answered
    for _ in range(int(ORDER_TIMEOUT) + 1):  # the reader renews its lease meanwhile
        clock.now += 1
        md.heartbeat("d1", 1)
        md.renew([first.lease])  # type: ignore[list-item]
        md.expire()
    assert not x.reloading and not x.in_memory and x.alloc_size == 0
    rest = run_lookup(md, [X], True, resume=first.lease, wait=1.0, meanwhile=disk_role(md))
    assert all(e.in_memory and e.alloc_size for e in rest.served), rest.served


def released_while_waiting(md: Metadata, d: Node) -> tuple[Lookup, Entry]:
    """A lookup waits for X's reload; its read lease is released meanwhile (the client
    lets go of the stream, or anyone naming the lease does)."""
    (x,) = adopt(md, d, [X])
    op, step = start_lookup(md, [X], wait=1.0)
    assert step.wait is Wait.RELOADS and x.readers == 1
    assert md.release([op.lease]).released == 1  # type: ignore[list-item]
    assert x.readers == 1  # the request holds what it took until it answers, not the lease
    return op, x


def test_a_lookup_whose_lease_is_released_while_it_waits_serves_nothing_unpinned() -> None:
    md, _, d = make()
    op, _ = released_while_waiting(md, d)
    answer(md, md.take_orders("d1"))  # the reload lands
    finish_lookup(md, op)
    for e in op.served:  # what a reader is sent is held for it, under a live lease
        assert e.readers >= 1 and op.lease in md.read_leases, (e.readers, op.lease)


def test_a_lookup_whose_lease_is_released_while_it_waits_lets_go_once() -> None:
    md, clock, d = make()
    op, x = released_while_waiting(md, d)
    clock.now += 2  # the reload does not land in time
    finish_lookup(md, op)
    assert x.readers == 0  # not let go of twice
    answer(md, md.take_orders("d1"))  # it lands later: an entry that can be evicted
    assert X in d.lru


def test_a_lookup_continuing_a_lease_does_not_let_go_of_another_ones_wait() -> None:
    """Two lookups name the same stream's lease (a client that asks for the next window
    before the last answer came): the second lets go of what the lease served, not of
    what the first one still waits for."""
    md, _, d = make()
    (m0,) = store(md, [K[0]])
    (x,) = adopt(md, d, [X])
    first = run_lookup(md, [K[0]], True)
    op, step = start_lookup(md, [X], wait=1.0, resume=first.lease)
    assert step.wait is Wait.RELOADS and x.readers == 1 and m0.readers == 0
    again = run_lookup(md, [K[0]], True, resume=first.lease)
    assert again.served == [m0]
    answer(md, md.take_orders("d1"))
    finish_lookup(md, op)
    assert op.served == [x] and x.readers == 1, x.readers


def test_an_answer_that_ends_the_stream_keeps_nothing_read_ahead() -> None:
    """X is not back in time: the answer is a miss, with no `more`; Y, read ahead for a
    next window that will not be asked for, must not stay pinned under a lease."""
    md, _, d = make()
    (_, y) = adopt(md, d, [X, Y])
    op = run_lookup(md, [X, Y], True)
    assert op.served == [] and not op.more
    assert y.readers == 0 and op.lease is None and md.read_leases == {}, op.lease


def test_a_lookup_does_not_wait_for_a_reload_on_a_node_that_died() -> None:
    md, _, d = make()
    adopt(md, d, [X])
    op, step = start_lookup(md, [X], wait=5.0)
    assert step.wait is Wait.RELOADS
    assert md.unregister("d1", 1)
    assert md.pending_reloads() == set()  # the shell settles its wait at once ...
    step = md.advance_lookup(op)  # ... and the next step must not wait for it again
    assert step.wait is Wait.DONE, step
    md.close_lookup(op)


def test_a_newcomer_in_line_while_memory_is_all_clean_copies_waits_and_is_served() -> None:
    """Room that is free to take (clean copies, dropped without a write) is room coming
    for a lookup in line behind a waiter: it used to be answered as a miss at once."""
    md, _, d = make()
    adopt(md, d, D[:12])
    hits, _ = load(md, D[:9], disk_role(md))
    assert len(hits) == 9 and d.clean_extent == d.allocator.used == 9 * CHUNK
    held = pin(md, D[:9])  # memory full, all of it being read
    first, step = start_lookup(md, [D[10]], wait=5.0)
    assert step.wait is Wait.ROOM and d.room_waiters == 1
    md.release([held])  # all of memory is clean copies now; the waiter not woken yet
    newcomer, step = start_lookup(md, [D[11]], wait=5.0)
    assert step.wait is Wait.ROOM and not newcomer.done and d.room_waiters == 2
    assert [e.key for e in finish_lookup(md, first, meanwhile=disk_role(md)).served] == [D[10]]
    assert [e.key for e in finish_lookup(md, newcomer, meanwhile=disk_role(md)).served] == [D[11]]
    assert d.room_waiters == 0
    md.release([first.lease, newcomer.lease])  # type: ignore[list-item]
