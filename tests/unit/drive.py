"""Drive the manager's metadata core the way its aiohttp shell does (manager/app.py
`lookup`, `allocate`): open a request, advance it until its step is DONE, close it. The
test plays what the shell would await between two steps (`meanwhile`): the disk role
answering orders, time passing on the fake clock, other requests. Without one, a step
that waits is advanced again at once, which is what the shell does once the request's
deadline has passed; a request that would wait for longer with nobody to act fails.

Also what the core's unit tests share: the fake clock, a disk role that answers every
order, and rows that fill a core through `restore` (a previous manager's table).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from polarkv_lib.manager.allocator import size_class
from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import (
    Allocation,
    AllocResult,
    Entry,
    Lookup,
    Step,
    Wait,
)
from polarkv_lib.manager.rows import EntryRow, NodeRow
from polarkv_lib.wire.orders import Order, TierOp, file_bytes_bound

# What the test does while a request waits for the step it was given.
Meanwhile = Callable[[Step], object]
HEADER = 4096  # the disk role's file header: a file is its entry's size plus this


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _drive(
    md: Metadata,
    step: Step,
    advance: Callable[[], Step],
    close: Callable[[], None],
    meanwhile: Meanwhile | None,
) -> None:
    """Advance a request until it is done, then close it (as the shell's `finally`)."""
    try:
        for _ in range(10_000):
            if step.wait is Wait.DONE:
                return
            if meanwhile is not None:
                meanwhile(step)
            else:
                assert md.clock() >= step.until, f"{step} with nobody to answer it"
            step = advance()
        raise AssertionError(f"the request still waits ({step}): what it waits for never comes")
    finally:
        close()


def tick(
    md: Metadata, clock: FakeClock, seconds: float, beat: bool = True, silent: str = ""
) -> None:
    """Let time pass the way the shell sees it: expire() every half second, the live nodes
    heartbeating (none if not `beat`; all but `silent`)."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + 0.5)
        for node in md.nodes.values():
            if beat and node.alive and node.node_id != silent:
                assert md.heartbeat(node.node_id, node.incarnation)
        md.expire()


# -- lookups --------------------------------------------------------------------------------


def start_lookup(
    md: Metadata,
    keys: list[str],
    take_lease: bool = True,
    *,
    tenant: str = "",
    wait: float = 0.0,
    resume: str | None = None,
) -> tuple[Lookup, Step]:
    """Open a lookup and take its first step: the test acts on what it waits for, then
    calls `finish_lookup`."""
    op = md.open_lookup(keys, take_lease, tenant, wait, resume)
    return op, md.advance_lookup(op)


def finish_lookup(
    md: Metadata, op: Lookup, step: Step | None = None, meanwhile: Meanwhile | None = None
) -> Lookup:
    first = step or md.advance_lookup(op)
    _drive(md, first, lambda: md.advance_lookup(op), lambda: md.close_lookup(op), meanwhile)
    return op


def run_lookup(
    md: Metadata,
    keys: list[str],
    take_lease: bool = False,
    *,
    tenant: str = "",
    wait: float = 0.0,
    resume: str | None = None,
    meanwhile: Meanwhile | None = None,
) -> Lookup:
    """One lookup request, opened, advanced and closed."""
    op, step = start_lookup(md, keys, take_lease, tenant=tenant, wait=wait, resume=resume)
    return finish_lookup(md, op, step, meanwhile)


def lookup(
    md: Metadata,
    keys: list[str],
    take_lease: bool = False,
    *,
    tenant: str = "",
    wait: float = 0.0,
    resume: str | None = None,
    meanwhile: Meanwhile | None = None,
) -> tuple[list[Entry], str | None]:
    """A lookup's answer: the entries served and its read lease."""
    op = run_lookup(
        md, keys, take_lease, tenant=tenant, wait=wait, resume=resume, meanwhile=meanwhile
    )
    return op.served, op.lease


def load(
    md: Metadata, keys: list[str], meanwhile: Meanwhile, *, wait: float = 1.0
) -> tuple[list[Entry], list[int]]:
    """A whole prefix read as a client does (client/async_client.py `_load`): window by
    window, each lookup continuing the stream's lease, until a miss; the lease released.
    Returns the entries read and each window's length."""
    served: list[Entry] = []
    windows: list[int] = []
    lease: str | None = None
    try:
        while len(served) < len(keys):
            op = run_lookup(
                md, keys[len(served) :], True, wait=wait, resume=lease, meanwhile=meanwhile
            )
            lease = op.lease
            assert all(e.in_memory for e in op.served)  # what a reader is sent is there
            served += op.served
            windows.append(len(op.served))
            if not op.more or not op.served:
                break  # a miss; or room did not come while it waited
    finally:
        if lease is not None:
            md.release([lease])
    return served, windows


# -- allocations ----------------------------------------------------------------------------


def start_allocate(
    md: Metadata,
    items: list[tuple[str, int]],
    *,
    tenant: str = "",
    wait: float = 0.0,
    resume: str | None = None,
    more: bool = False,
) -> tuple[Allocation, Step]:
    op = md.open_allocate(items, tenant, wait, resume, more)
    return op, md.advance_allocate(op)


def finish_allocate(
    md: Metadata, op: Allocation, step: Step | None = None, meanwhile: Meanwhile | None = None
) -> Allocation:
    first = step or md.advance_allocate(op)
    _drive(md, first, lambda: md.advance_allocate(op), lambda: md.close_allocate(op), meanwhile)
    return op


def run_allocate(
    md: Metadata,
    items: list[tuple[str, int]],
    *,
    tenant: str = "",
    wait: float = 0.0,
    resume: str | None = None,
    more: bool = False,
    meanwhile: Meanwhile | None = None,
) -> Allocation:
    """One allocate request, opened, advanced and closed."""
    op, step = start_allocate(md, items, tenant=tenant, wait=wait, resume=resume, more=more)
    return finish_allocate(md, op, step, meanwhile)


def results_of(op: Allocation) -> list[AllocResult]:
    out = [r for r in op.results if r is not None]
    assert len(out) == len(op.items)  # a finished request has a result for every item
    return out


def allocate(
    md: Metadata,
    items: list[tuple[str, int]],
    *,
    tenant: str = "",
    wait: float = 0.0,
    resume: str | None = None,
    more: bool = False,
    meanwhile: Meanwhile | None = None,
) -> tuple[list[AllocResult], str | None]:
    """An allocate request's answer: a result per item, and its write lease."""
    op = run_allocate(
        md, items, tenant=tenant, wait=wait, resume=resume, more=more, meanwhile=meanwhile
    )
    return results_of(op), op.lease


# -- the disk role --------------------------------------------------------------------------


def answer(md: Metadata, orders: list[Order], ok: bool = True, reason: str = "") -> None:
    """Report offload and reload orders done (or failed, for `reason`); deletes need no
    answer."""
    for o in orders:
        if o.op is TierOp.OFFLOAD:
            md.offload_done(o.node, o.key, o.gen, ok, reason, o.size + HEADER if ok else 0)
        elif o.op is TierOp.RELOAD:
            md.reload_done(o.node, o.key, o.gen, ok, reason)


def disk_role(md: Metadata, ok: bool = True, reason: str = "") -> Meanwhile:
    """While a request waits: every node's disk role takes its orders and answers them."""

    def serve(_: Step) -> None:
        for node_id in md.nodes_with_orders():
            answer(md, md.take_orders(node_id), ok, reason)

    return serve


# -- a previous manager's table -------------------------------------------------------------


def synthetic_rows(
    node: NodeRow,
    count: int,
    size: int,
    *,
    in_memory: bool = True,
    on_disk: bool = False,
    checksum: str = "0123456789abcdef",
) -> list[EntryRow]:
    """`count` ready entries of `size` bytes packed from offset 0 of `node`'s buffer (or
    files only), as a previous manager would have persisted them: restoring these is
    the quick way to fill a core."""
    extent = size_class(size) if in_memory else 0
    if extent * count > node.capacity:
        raise ValueError(f"{count} entries of {size} bytes do not fit in {node.capacity} bytes")
    file_bytes = file_bytes_bound(size) if on_disk else 0
    return [
        EntryRow(
            hashlib.blake2b(f"{node.node_id}/{i}".encode(), digest_size=16).hexdigest(),
            node.node_id,
            node.incarnation,
            size,
            checksum,
            i * extent,
            extent,
            in_memory,
            on_disk,
            file_bytes,
            0.0,
        )
        for i in range(count)
    ]


def confirm_all(md: Metadata, node_id: str, incarnation: int) -> int:
    """Play a slab whose buffer survived the manager's restart: every memory row it is
    asked about still holds its entry's bytes. How many it confirmed."""
    held: list[tuple[int, str, bool]] = []
    confirmed = 0
    while checks := md.snapshots.confirm(node_id, incarnation, held) or []:
        held = [(offset, checksum, True) for offset, _, checksum in checks]
        confirmed += len(held)
    return confirmed
