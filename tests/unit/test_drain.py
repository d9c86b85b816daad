"""Draining a node in the metadata core (manager/drain.py), with a fake clock and the
tests playing the disk role: no new extents on the node, clean copies drop, the rest is
offloaded (or dropped without a disk), leased entries wait for their readers."""

from __future__ import annotations

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import AllocStatus, Node, Residency
from polarkv_lib.wire.orders import Order, TierOp
from tests.unit.drive import allocate, answer, finish_lookup, lookup, start_lookup
from tests.unit.tiering_setup import CHUNK, FILE, K, add, new_md, store


def offloads(md: Metadata, node: Node) -> list[Order]:
    return [o for o in md.take_orders(node.node_id) if o.op is TierOp.OFFLOAD]


def test_drain_offloads_memory_only_entries_and_places_nothing_new() -> None:
    md, _ = new_md()
    a = add(md, "a", 10, disk_files=20)
    entries = store(md, K[:4])
    assert all(e.node is a for e in entries)
    view = md.drain("a")
    assert view is not None and view["draining"] and not view["drained"]
    orders = offloads(md, a)
    assert sorted(o.key for o in orders) == sorted(K[:4])
    # a draining node gets no new extents: with no other node, writes find no space
    results, _ = allocate(md, [(K[10], CHUNK)])
    assert results[0].status is AllocStatus.NO_SPACE
    b = add(md, "b", 10)
    results, _ = allocate(md, [(K[11], CHUNK)])
    assert results[0].entry is not None and results[0].entry.node is b
    for order in orders:  # the disk role reports the files written
        md.offload_done("a", order.key, order.gen, True, file_bytes=FILE)
    view = md.drain_view(a)
    assert view["drained"] and view["keys_memory"] == 0 and view["keys_disk"] == 4
    assert a.allocator.used == 0 and all(md.get(k).residency is Residency.DISK for k in K[:4])  # type: ignore[union-attr]
    # a disk hit on a draining node is not reloaded into its memory: a miss
    hits, lease = lookup(md, [K[0]], True)
    assert hits == [] and lease is None and a.allocator.used == 0


def test_clean_copies_drop_at_once_and_leased_entries_wait() -> None:
    md, _ = new_md()
    a = add(md, "a", 10, disk_files=20)
    store(md, K[:3])
    md.drain("a")  # all three go to disk
    for order in offloads(md, a):
        md.offload_done("a", order.key, order.gen, True, file_bytes=FILE)
    assert md.drain_view(a)["drained"]
    a.draining = False  # back in service (as a restarted node would be)
    op, _ = start_lookup(md, K[:2])  # reloads K0 into memory, and K1 read ahead
    answer(md, md.take_orders("a"))
    lease = finish_lookup(md, op).lease
    assert lease is not None and op.served == [md.get(K[0])] and op.more
    assert md.get(K[0]).residency is md.get(K[1]).residency is Residency.BOTH  # type: ignore[union-attr]
    md.drain("a")
    assert offloads(md, a) == []  # clean copies need no offload ...
    assert md.drain_view(a)["keys_memory"] == 2  # ... but these two are read right now
    md.release([lease])
    md.plan_tiering()
    assert md.drain_view(a)["drained"] and md.get(K[0]).residency is Residency.DISK  # type: ignore[union-attr]


def test_a_node_without_disk_drops_its_entries() -> None:
    md, _ = new_md()
    a = add(md, "a", 10)
    store(md, K[:2])
    view = md.drain("a")
    assert view is not None and view["drained"] and md.get(K[0]) is None
    assert md.counters.evictions == 2 and a.allocator.used == 0
    assert md.drain("nope") is None
