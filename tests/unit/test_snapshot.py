"""Persistence of the manager core (manager/snapshot.py): what `take_changes` writes,
`restore` brings back, in slices, while the core keeps serving."""

from __future__ import annotations

import hashlib
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import AllocStatus, Residency
from polarkv_lib.manager.rows import Batch, EntryRow, NodeRow
from tests.unit.drive import FakeClock, allocate, confirm_all, lookup, synthetic_rows

KiB = 1024
CAPACITY = 64 * 64 * KiB
SUM = "0123456789abcdef"
KEYS = [hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest() for i in range(64)]


def core(clock: FakeClock) -> Metadata:
    return Metadata(5.0, 30.0, 3.0, clock=clock, rng=random.Random(1), wall=lambda: 1.7e9)


def join(md: Metadata) -> None:
    md.register("m1", 1, "127.0.0.1:1", CAPACITY, "", "h", ["tcp"])
    md.register("d1", 1, "127.0.0.1:2", CAPACITY, "", "h", ["tcp"], disk_capacity=1 << 30)


def persisted(batch: Batch, store: dict[str, EntryRow]) -> None:
    for row in batch.entries:
        store[row.key] = row
    for key in batch.deleted_keys:
        store.pop(key, None)


def view(md: Metadata) -> dict[str, tuple[str, str, int, str, int, int]]:
    """Everything a restart must keep, per ready key."""
    out = {}
    for key, e in md.entries.items():
        out[key] = (
            e.node.node_id,
            e.residency.value,
            e.size,
            e.checksum,
            e.offset if e.in_memory else 0,
            e.file_bytes if e.on_disk else 0,
        )
    return out


ops_st = st.lists(
    st.tuples(
        st.sampled_from(["store", "delete", "offload", "adopt"]),
        st.integers(0, len(KEYS) - 1),
        st.integers(1, 96 * KiB),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops_st, st.integers(1, 7))
def test_restore_of_take_changes_round_trips(
    ops: list[tuple[str, int, int]], slice_rows: int
) -> None:
    clock = FakeClock()
    md = core(clock)
    join(md)
    store: dict[str, EntryRow] = {}
    for op, i, size in ops:
        key = KEYS[i]
        if op == "store":
            results, lease = allocate(md, [(key, size)])
            if results[0].status is AllocStatus.ALLOCATED and lease is not None:
                md.commit(lease, [(key, SUM)])
        elif op == "delete":
            md.delete(key)
        elif op == "offload":  # a disk node's entry gets its file; memory copy goes
            entry = md.get(key)
            if entry is not None and entry.node.has_disk and entry.residency is Residency.MEMORY:
                entry.node.pressure = CAPACITY  # ask the planner for everything
                md.plan_tiering()
                for order in md.take_orders("d1"):
                    if order.op == "offload":
                        md.offload_done(
                            "d1", order.key, order.gen, True, file_bytes=order.size + 4096
                        )
        else:
            md.adopt("d1", 1, [(key, size, SUM, size + 4096)])
        if i % 5 == 0:  # flushes happen in between, too
            persisted(md.snapshots.take_changes(), store)
    nodes = md.snapshots.take_changes()
    persisted(nodes, store)
    before = view(md)
    node_rows = [
        NodeRow(
            n.node_id,
            n.incarnation,
            n.address,
            n.capacity,
            n.disk_capacity,
            n.shm_path,
            n.host_id,
            ",".join(n.transports),
        )
        for n in md.nodes.values()
    ]

    again = core(FakeClock())
    again.snapshots.restore(node_rows, list(store.values()))
    assert again.snapshots.take_changes().deleted_keys == []  # rows of nodes not back yet stay
    join(again)
    for node_id in ("m1", "d1"):  # their buffers survived: every memory row still holds
        confirm_all(again, node_id, 1)
    while again.snapshots.restore_step(slice_rows):
        pass
    assert view(again) == before
    for node_id in ("m1", "d1"):
        old, new = md.nodes[node_id], again.nodes[node_id]
        assert (
            new.allocator.used,
            new.lru_extent,
            new.disk_used,
            len(new.lru),
            new.ready_bytes,
        ) == (old.allocator.used, old.lru_extent, old.disk_used, len(old.lru), old.ready_bytes)
        assert not new.restoring
    # and what the restored core writes is what was read; rows that came back exactly as
    # persisted are not written again (a restore must not rewrite the whole table)
    changes = again.snapshots.take_changes()
    rows = {r.key: r for r in changes.entries}
    assert {k: r for k, r in rows.items()} == {k: store[k] for k in rows}
    assert changes.deleted_keys == []
    assert not rows  # same incarnations, same buffers: every row came back as it was


def test_a_restore_writes_back_only_what_changed() -> None:
    clock = FakeClock()
    md = core(clock)
    node = NodeRow("m1", 1, "127.0.0.1:1", 1 << 30, 0, "", "h", "tcp")
    rows = synthetic_rows(node, 500, 4096)
    md.snapshots.restore([node], rows)
    md.register("m1", 1, "127.0.0.1:1", 1 << 30, "", "h", ["tcp"])
    assert confirm_all(md, "m1", 1) == 500
    while md.snapshots.restore_step(64):
        pass
    assert md.views.stats()["keys_memory"] == 500
    assert len(md.snapshots.take_changes()) == 1  # only the node's own row
    # a new incarnation lost the buffer: every row is deleted from the store
    clock.now += 2.0  # the old one missed its heartbeats
    md.register("m1", 2, "127.0.0.1:1", 1 << 30, "", "h", ["tcp"])
    assert len(md.snapshots.take_changes().deleted_keys) == 500


def test_a_restoring_node_serves_misses_and_takes_no_new_writes() -> None:
    md = core(FakeClock())
    md.snapshots.restore_slice = 5
    rows = [
        EntryRow(KEYS[i], "m1", 1, 4096, SUM, i * 4096, 4096, True, False, 0, 1.0)
        for i in range(40)
    ]
    md.snapshots.restore([NodeRow("m1", 1, "127.0.0.1:1", 1 << 30, 0, "", "h", "tcp")], rows[::-1])
    md.register("m1", 1, "127.0.0.1:1", 1 << 30, "", "h", ["tcp"])  # kept its buffer
    assert (
        md.snapshots.restoring and not md.snapshots.restore_step()
    ) or md.snapshots.restoring  # waits for the slab
    assert md.get(KEYS[0]) is None  # nothing comes back before its bytes are confirmed
    assert confirm_all(md, "m1", 1) == 40
    md.snapshots.restore_step()  # one slice: the first 5 by address
    hits, _ = lookup(md, KEYS[:40], take_lease=False)
    assert [e.key for e in hits] == KEYS[:5]  # the rest misses for now
    results, _ = allocate(md, [(KEYS[50], 4096)])
    assert results[0].status is AllocStatus.NO_SPACE  # the only node is restoring
    assert all(md.get(k) is None for k in KEYS[5:40])
    batch = md.snapshots.take_changes()
    assert not set(batch.deleted_keys) & set(KEYS[:40])  # not-yet-restored rows stay stored
    while md.snapshots.restore_step(3):
        pass
    assert not md.snapshots.restoring
    hits, _ = lookup(md, KEYS[:40], take_lease=False)
    assert [e.offset for e in hits] == [i * 4096 for i in range(40)]
    results, _ = allocate(md, [(KEYS[50], 4096)])
    assert results[0].status is AllocStatus.ALLOCATED and results[0].entry is not None
    assert results[0].entry.offset == 40 * 4096


def test_a_node_that_dies_while_restoring_gives_up_the_rest() -> None:
    md = core(FakeClock())
    md.snapshots.restore_slice = 5
    rows = [
        EntryRow(KEYS[i], "m1", 1, 4096, SUM, i * 4096, 4096, True, False, 0, 1.0)
        for i in range(20)
    ]
    md.snapshots.restore([NodeRow("m1", 1, "127.0.0.1:1", 1 << 30, 0, "", "h", "tcp")], rows)
    md.register("m1", 1, "127.0.0.1:1", 1 << 30, "", "h", ["tcp"])
    assert md.unregister("m1", 1)
    assert not md.snapshots.restore_step()
    assert sorted(md.snapshots.take_changes().deleted_keys) == sorted(KEYS[:20])
