"""What the tiering unit tests share (test_tiering.py, test_reloads.py): a metadata core
on a fake clock, nodes with a disk role, and prompts stored and answered by hand."""

from __future__ import annotations

import hashlib
import random

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import (
    AllocStatus,
    Entry,
    Node,
)
from polarkv_lib.wire.orders import Order, TierOp
from tests.unit.drive import HEADER, FakeClock, allocate, lookup

KiB = 1024
CHUNK = 64 * KiB  # its own size class
FILE = CHUNK + HEADER  # what a disk role reports for a chunk's file (header + payload)
READ_TTL, WRITE_TTL, HB_TTL = 5.0, 30.0, 3.0
SUM = "0123456789abcdef"


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
    results, lease = allocate(md, [(k, size) for k in keys])
    assert [r.status for r in results] == [AllocStatus.ALLOCATED] * len(keys), results
    assert lease is not None
    assert md.commit(lease, [(k, SUM) for k in keys]) == dict.fromkeys(keys, "committed")
    return [md.get(k) for k in keys]  # type: ignore[misc]


def fill(md: Metadata, keys: list[str]) -> None:
    for k in keys:  # one prompt each: the first one stored is the least recently used
        store(md, [k])


def ops(orders: list[Order]) -> list[tuple[str, str]]:
    return [(o.op, o.key) for o in orders]


def tiers(md: Metadata, k: str) -> list[str]:
    view = md.views.describe(k)
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


def with_a_clean_copy() -> tuple[Metadata, Node]:
    """A full node (9 chunks) whose least recent entry, K0, is in memory and on disk,
    unleased: the one memory copy that can go without a write."""
    md, _, d = make()
    fill(md, K[:9])
    md.plan_tiering()
    (order,) = md.take_orders("d1")
    _, lease = lookup(md, [K[0]], take_lease=True)  # keeps its memory copy past the offload
    assert lease is not None
    md.offload_done("d1", K[0], order.gen, True, file_bytes=FILE)
    md.release([lease])
    lookup(md, K[1:9], take_lease=False)
    assert list(d.clean) == [K[0]] and next(iter(d.lru)) == K[0]
    return md, d
