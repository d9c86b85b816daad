"""The manager's data model: entries, nodes, leases, counters and the outcomes the core
hands to the HTTP shell. Plain data; the transitions live in manager/core.py (requests),
manager/tiering.py (room, offloads, reloads) and manager/snapshot.py (persistence).

Entry life: allocate -> WRITING (invisible, under a write lease) -> commit -> READY.
Where a READY entry's bytes are is one field, `Entry.residency`; `alloc_size` is the
memory extent the entry holds, which a dropped entry keeps until its last reader leaves.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
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


_IN_MEMORY = frozenset({Residency.MEMORY, Residency.OFFLOADING, Residency.BOTH})
_ON_DISK = frozenset({Residency.BOTH, Residency.DISK, Residency.RELOADING})


class AllocStatus(StrEnum):
    ALLOCATED = "allocated"
    EXISTS = "exists"
    IN_PROGRESS = "in_progress"
    NO_SPACE = "no_space"


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
    # ready entries with a memory copy, least recently used first
    lru: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    lru_extent: int = 0  # memory extents held by the entries in `lru`
    # the BOTH subset of `lru` (memory that can go at no cost), roughly in LRU order
    clean: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    clean_extent: int = 0
    # entries with a file on this node's disk, least recently used first
    disk_lru: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    entries: set[str] = field(default_factory=set)
    ready_bytes: int = 0
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
    tenant: str = ""  # who stored it (manager/tenants.py); "" the default namespace
    order_deadline: float = 0.0

    @property
    def in_memory(self) -> bool:
        return self.residency in _IN_MEMORY

    @property
    def on_disk(self) -> bool:
        return self.residency in _ON_DISK

    @property
    def offloading(self) -> bool:
        return self.residency is Residency.OFFLOADING

    @property
    def reloading(self) -> bool:
        return self.residency is Residency.RELOADING


@dataclass(slots=True)
class ReadLease:
    entries: list[Entry]
    expires: float
    disk_hits: set[int] = field(default_factory=set)  # gens counted as disk hits


@dataclass(slots=True)
class WriteLease:
    entries: dict[str, Entry]
    expires: float


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


@dataclass(slots=True)
class TenantStats:
    """One tenant's share of the counters, and of memory (ready entries)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    allocations: int = 0
    alloc_no_space: int = 0
    commits: int = 0
    keys_memory: int = 0
    bytes_memory: int = 0


@dataclass(slots=True)
class AllocResult:
    key: str
    status: AllocStatus
    entry: Entry | None = None


@dataclass(slots=True)
class Allocation:
    """One allocate request across its passes: the shell retries the NO_SPACE items
    while room is coming, and the core counts the final results once."""

    items: list[tuple[str, int]]
    results: list[AllocResult]
    lease: str | None
    tenant: str = ""

    @property
    def missing(self) -> list[int]:
        return [i for i, r in enumerate(self.results) if r.status is AllocStatus.NO_SPACE]


@dataclass(slots=True)
class Lookup:
    """One lookup request across its passes. After a pass, `reloads` are the entry gens
    to wait for (then `settle`), or `wait_room` says the prefix stopped at a disk entry
    that needs memory that offloads may be making; otherwise, unless `done`, the shell
    goes on with another pass at once. The core counts it as one lookup."""

    keys: list[str]
    take_lease: bool
    tenant: str = ""
    served: list[Entry] = field(default_factory=list)
    lease: str | None = None
    pending: list[Entry] = field(default_factory=list)  # this pass's hits, not settled yet
    wait_room: bool = False
    done: bool = False

    @property
    def reloads(self) -> list[int]:
        return [e.gen for e in self.pending if e.reloading]


@dataclass(slots=True)
class Released:
    released: int  # leases ended
    # entries reported corrupt by a holder of one of the leases: the shell has their
    # bytes checked on the slab, then tells `corrupt_verified` what it found
    suspects: list[Entry] = field(default_factory=list)


@dataclass(slots=True)
class Events:
    """What `expire` changed, for the shell to log."""

    dead_nodes: list[str] = field(default_factory=list)
    expired_writes: int = 0
    expired_reads: int = 0


@dataclass(slots=True)
class RestoreJob:
    """A registered node's persisted entries, restored a slice at a time in address
    order (so each memory extent is reserved in O(1))."""

    node: Node
    same_buffer: bool  # the node kept its buffer: memory copies are still valid
    rows: list[EntryRow]
    done: int = 0


def new_id() -> str:
    return secrets.token_hex(8)
