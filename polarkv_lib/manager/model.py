"""The manager's data model: entries, nodes, leases, counters and the outcomes the core
hands to the HTTP shell. Plain data; the transitions live in manager/core.py (requests),
manager/tiering.py (room, offloads, reloads) and manager/snapshot.py (persistence).

Entry life: allocate -> WRITING (invisible, under a write lease) -> commit -> READY.
Where a READY entry's bytes are is one field, `Entry.residency`; `alloc_size` is the
memory extent the entry holds, which a dropped entry keeps until its last reader leaves.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass, field
from enum import StrEnum

from polarkv_lib.errors import BadRequest
from polarkv_lib.manager.allocator import Allocator
from polarkv_lib.manager.rows import EntryRow
from polarkv_lib.wire.orders import Order

# A dropped WRITING entry's space waits this long past its write grant's expiry before
# reuse, so a writer that started just before the grant expired cannot land its bytes
# in somebody else's entry.
WRITE_GRACE = 2.0
# Orders a disk role has not answered within this long are given up.
ORDER_TIMEOUT = 60.0
# Disk LRU deletion goes this far below the disk high watermark, so it runs in batches.
DISK_HYSTERESIS = 0.05


class NodeIdInUse(BadRequest):
    """A registration for a node id whose node is alive and heartbeating: taking it over
    would drop the live node's entries."""

    def __init__(self, node_id: str) -> None:
        super().__init__(
            f"node {node_id!r} is alive under another incarnation; "
            "a restarted node can register once the old one has gone silent",
            409,
        )


class State(StrEnum):
    WRITING = "writing"
    READY = "ready"


class Residency(StrEnum):
    """Where an entry's bytes are. A WRITING entry is MEMORY (its extent being written)."""

    NONE = "none"  # nowhere: dropped and freed
    MEMORY = "memory"  # a memory copy only
    OFFLOADING = "offloading"  # a memory copy; its file is being written
    BOTH = "both"  # a memory copy and a valid file ("clean": memory can go at no cost)
    DISK = "disk"  # a file only
    RELOADING = "reloading"  # a file; its memory extent is being filled from it


IN_MEMORY = frozenset({Residency.MEMORY, Residency.OFFLOADING, Residency.BOTH})
ON_DISK = frozenset({Residency.BOTH, Residency.DISK, Residency.RELOADING})


class AllocStatus(StrEnum):
    ALLOCATED = "allocated"
    EXISTS = "exists"
    IN_PROGRESS = "in_progress"
    NO_SPACE = "no_space"
    LATER = "later"  # past this request's window: ask again after committing the rest


@dataclass(eq=False, slots=True)
class Node:
    node_id: str
    incarnation: int
    address: str
    capacity: int
    shm_path: str
    host_id: str
    transports: list[str]
    last_heartbeat: float  # monotonic
    last_heartbeat_wall: float
    disk_capacity: int = 0  # 0: no disk role in this node's process
    base: int = 0  # start of this manager's arena in the node's buffer (shards; else 0)
    allocator: Allocator = field(init=False)
    alive: bool = True
    restoring: bool = False  # persisted entries still being restored: no new placements
    draining: bool = False  # an operator is emptying its memory: no new extents (manager/drain.py)
    # The eviction order: ready memory copies that may leave memory now (no reader, no
    # transfer in flight), least recently used first. A pinned or in-flight entry is out
    # of it until it is free again, so a walk over it costs what it frees however many
    # entries are leased (tables.py `_order_in` / `_order_out`).
    lru: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    lru_extent: int = 0  # memory extents held by the entries in `lru`
    # the BOTH subset of `lru` (memory that can go at no cost), roughly in LRU order
    clean: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    clean_extent: int = 0
    # entries with a file on this node's disk, least recently used first
    disk_lru: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    entries: set[str] = field(default_factory=set)
    keys_memory: int = 0  # ready entries with a memory copy, pinned or not
    ready_bytes: int = 0  # and their sizes
    disk_used: int = 0
    offloading_bytes: int = 0  # memory extents being offloaded (queued or in flight)
    offloading_files: int = 0  # and the file bytes they will take
    last_alloc: int = 0  # size class of the latest allocation: the room the next one needs
    pressure: int = 0  # bytes refused for room since the last offload plan
    offloads: dict[int, Entry] = field(default_factory=dict)  # by entry gen
    reloads: dict[int, Entry] = field(default_factory=dict)  # by entry gen
    orders: list[Order] = field(default_factory=list)
    # freed extents that must not be reused yet: a heap of (until, offset, length)
    quarantine: list[tuple[float, int, int]] = field(default_factory=list)
    reported: dict[str, int] = field(default_factory=dict)  # the slab's own counters
    # Streams sharing this node's memory (their windows are a share of it, tiering.py):
    # read leases holding entries reloaded here, and lookups waiting here for room.
    loaders: set[str] = field(default_factory=set)
    room_waiters: int = 0

    def __post_init__(self) -> None:
        self.allocator = Allocator(self.capacity, self.base)

    @property
    def has_disk(self) -> bool:
        return self.disk_capacity > 0


@dataclass(eq=False, slots=True)
class Entry:
    key: str
    size: int
    node: Node
    offset: int
    alloc_size: int  # the memory extent held; 0: none
    state: State
    created: float
    last_access: float
    # Generation: tells this entry's orders from an older entry's of the same key, and is
    # carried by its grants; the slab lets no grant touch space a newer one has claimed.
    gen: int = 0
    checksum: str = ""
    readers: int = 0
    write_lease: str | None = None
    dropped: bool = False  # out of the table; extent waits for readers / in-flight I/O
    residency: Residency = Residency.MEMORY
    file_bytes: int = 0
    tenant: str = ""  # whose entry it is (tenancy.py); "" the default tenant
    order_deadline: float = 0.0
    counted: bool = False  # its memory copy is in its node's and tenant's memory figures

    @property
    def in_memory(self) -> bool:
        return self.residency in IN_MEMORY

    @property
    def on_disk(self) -> bool:
        return self.residency in ON_DISK

    @property
    def offloading(self) -> bool:
        return self.residency is Residency.OFFLOADING

    @property
    def reloading(self) -> bool:
        return self.residency is Residency.RELOADING


@dataclass(slots=True)
class ReadLease:
    """What one reader holds: the entries it was served (pinned until it lets go) and,
    for a stream, the next window being reloaded for it (`ahead`, pinned, not yet
    served). A lookup that names the lease (`continue`) lets go of `served` first."""

    tenant: str
    expires: float
    served: list[Entry] = field(default_factory=list)
    ahead: dict[str, Entry] = field(default_factory=dict)  # by key, in key order
    from_disk: set[int] = field(default_factory=set)  # gens of `ahead` reloaded from disk
    loading_on: set[str] = field(default_factory=set)  # node ids: in their `loaders`
    busy: bool = False  # a lookup of the stream is running on it: no second `continue`


@dataclass(slots=True)
class WriteLease:
    """What one writer holds: its entries being written, and for a store of several
    windows (`more` on commit) the keys it has stored so far, which its later windows
    never evict to make room for themselves."""

    tenant: str
    expires: float
    entries: dict[str, Entry] = field(default_factory=dict)
    kept: dict[str, None] = field(default_factory=dict)  # in prompt order
    keep: bool = False  # more windows follow: it lives on with no entry open


@dataclass(slots=True)
class Counters:
    hits: int = 0
    hits_memory: int = 0
    hits_disk: int = 0
    misses: int = 0
    lookups: int = 0
    allocations: int = 0
    exists: int = 0
    in_progress: int = 0
    no_space: int = 0
    commits: int = 0
    aborts: int = 0
    evictions: int = 0
    offloads: int = 0
    offload_bytes: int = 0
    reloads: int = 0
    reload_bytes: int = 0
    disk_evictions: int = 0
    expired_writes: int = 0
    expired_reads: int = 0
    checksum_failures: int = 0
    corrupt_reports: int = 0  # clients' checksum-mismatch reports, before verification
    corrupt_reports_rejected: int = 0  # reports the slab's bytes did not bear out
    deletes: int = 0
    nodes_died: int = 0
    entries_lost: int = 0
    tier_failures: dict[str, int] = field(default_factory=dict)  # "offload_disk_full": n


@dataclass(frozen=True, slots=True)
class Claim:
    """Who asks for memory (placement, reloads, room), and which of the ready entries
    that could make room must stay: a store's own chunks (WriteLease.kept)."""

    tenant: str
    keep: Container[str] = frozenset()


@dataclass(slots=True)
class TenantStats:
    """One tenant's share of the counters, and of memory (ready entries, and the extents
    it is writing: both count against its quota and its fair share)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    allocations: int = 0
    alloc_no_space: int = 0
    commits: int = 0
    keys_memory: int = 0
    bytes_memory: int = 0
    bytes_writing: int = 0


@dataclass(slots=True)
class AllocResult:
    key: str
    status: AllocStatus
    entry: Entry | None = None


class Wait(StrEnum):
    """What the shell awaits before it asks the core for the next step of a request."""

    DONE = "done"  # nothing: answer now
    RELOADS = "reloads"  # these reloads (or the deadline)
    ROOM = "room"  # memory being freed somewhere (or the deadline)


@dataclass(frozen=True, slots=True)
class Step:
    """The core's decision for one request: what to wait for, and until when (the
    monotonic deadline the request's `wait` set)."""

    wait: Wait
    gens: tuple[int, ...] = ()
    until: float = 0.0


DONE = Step(Wait.DONE)


class Stop(StrEnum):
    """Why a lookup's pass over its keys stopped where it did."""

    END = "end"  # every key taken
    MISS = "miss"  # the next key is not stored (or cannot come back)
    WINDOW = "window"  # the window is full: the stream goes on in the next lookup
    ROOM = "room"  # the next entry is on disk and its node has no memory for it now


@dataclass(slots=True)
class Allocation:
    """One allocate request, across its steps (core.py `advance_allocate`). Items are
    placed in order; past the request's window (its share of memory) they are LATER,
    for the writer to ask again once it has committed what it got."""

    items: list[tuple[str, int]]
    tenant: str
    deadline: float
    results: list[AllocResult | None]
    lease: str | None = None  # the write lease, continued (`continue`) or new
    more: bool = False  # more windows of the same store follow
    kept: dict[str, None] = field(default_factory=dict)  # the store's chunks: not its victims
    done: bool = False

    @property
    def open(self) -> list[int]:
        """Items not decided yet: never tried, or refused for room while it may come."""
        return [
            i
            for i, r in enumerate(self.results)
            if r is None or r.status in (AllocStatus.NO_SPACE, AllocStatus.LATER)
        ]


@dataclass(slots=True)
class Lookup:
    """One lookup request, across its steps (core.py `advance_lookup`). `served` is the
    prefix answered so far; `pending`, this step's hits whose reloads are awaited.
    `more`: the answer stopped at the end of a window, not at a miss: the next key is
    stored and a lookup that continues the lease gets it (its reload has started)."""

    keys: list[str]
    take_lease: bool
    tenant: str
    deadline: float
    lease: str | None = None
    lease_ref: ReadLease | None = None  # the lease object (gone from the table: it ended)
    served: list[Entry] = field(default_factory=list)
    pending: list[Entry] = field(default_factory=list)
    from_disk: set[int] = field(default_factory=set)  # gens of hits reloaded for it
    waiting_on: Node | None = None  # the node whose room it waits for (node.room_waiters)
    waited: bool = False  # it has waited for room in line: it goes before newcomers
    stop: Stop = Stop.END  # why the pass whose reloads are pending stopped
    stop_node: Node | None = None  # where it stopped for room
    more: bool = False
    done: bool = False


@dataclass(slots=True)
class Released:
    released: int  # leases ended
    # entries reported corrupt by a holder of one of the leases: the shell has their
    # bytes checked on the slab, then tells `corrupt_verified` what it found
    suspects: list[Entry] = field(default_factory=list)


@dataclass(slots=True)
class Expired:
    """What `expire` changed, for the shell to log (not an event: see manager/events.py)."""

    dead_nodes: list[str] = field(default_factory=list)
    expired_writes: int = 0
    expired_reads: int = 0


@dataclass(slots=True)
class RestoreJob:
    """A registered node's persisted entries, restored a slice at a time in address
    order (so each memory extent is reserved in O(1)). Memory copies come back only where
    the slab confirms that the bytes at the entry's extent still match its checksum
    (`checks`, answered in `held`): a row the write-behind had not yet updated (the entry
    was evicted, its space rewritten) must not name another entry's bytes."""

    node: Node
    same_buffer: bool  # the node kept its buffer: memory copies may still be valid
    rows: list[EntryRow]
    done: int = 0
    checks: list[tuple[int, int, str]] = field(default_factory=list)  # offset, size, xxh3
    asked: int = 0  # checks handed to the slab so far
    held: set[tuple[int, str]] = field(default_factory=set)  # (offset, checksum) confirmed
    confirming: bool = False  # waiting for the slab's answers: the rows wait too
    confirm_until: float = 0.0  # past this, what was not confirmed is not trusted
    started: float = 0.0  # monotonic: when the node registered (for the log line)


_ID_HEX = 16  # a lease id: 8 random bytes, in hex
_IDS_PER_DRAW = 512
_ids: list[str] = []
_drawing = threading.Lock()


def _forked() -> None:
    """A forked child draws its own ids: those left in the pool are the parent's to hand
    out. The lock is new too (another thread may have held it at the fork)."""
    global _drawing
    _ids.clear()
    _drawing = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def new_id() -> str:
    """A fresh lease id from the OS's CSPRNG. Drawn 512 at a time: one `getrandom` per
    request (`secrets.token_hex`) also let go of the GIL each time, and the loop then
    waited for the write-behind thread's turn to end; now one in 512 requests draws."""
    while True:
        try:
            return _ids.pop()  # atomic: no lock on the common path
        except IndexError:
            with _drawing:
                if not _ids:
                    block = os.urandom(_ID_HEX // 2 * _IDS_PER_DRAW).hex()
                    _ids.extend(block[i : i + _ID_HEX] for i in range(0, len(block), _ID_HEX))
