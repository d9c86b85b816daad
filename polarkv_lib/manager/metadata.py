"""The manager's metadata core: entries, nodes, leases, placement, LRUs and tiering orders.

Synchronous: no method awaits or does I/O. The aiohttp shell (manager/app.py) calls
them and does the I/O that follows: it answers clients, and hands each node's disk role
the orders queued on `Node.orders`. That keeps every state transition testable alone.

Tables: entries live in `partitions` hash tables split by key range (the first 32 bits
of the key pick the partition), so a later manager can shard by handing out ranges.

Entry life: allocate -> WRITING (invisible, under a write lease) -> commit -> READY.
A READY entry lives in memory, on its node's disk, or both; tiering never moves it to
another node. Lookups return the longest READY prefix and may take a read lease on it;
nothing under a read lease is evicted, offloaded away or reused.

Per-node LRUs, one per tier. A batch of chunk keys is one prompt's prefix, in order; the
batch is touched back to front, so a prompt's first chunk is its most recently used one.
Eviction and offload then take prefixes from their tail, which is right for a prefix
cache: chunk i is worthless without chunks 0..i-1.

Tiering (nodes with a disk role): memory use is capped at the high watermark. When the
next allocation would not fit under it, the LRU unleased entries of that node are
offloaded to its own disk until use drops to the low watermark; an entry that still has
a valid file just drops its memory copy. A lookup that reaches a disk-only entry
allocates memory on the same node and queues a reload; the shell waits for it. Above
the disk high watermark the oldest files go. Nodes without a disk role evict instead.
"""

from __future__ import annotations

import itertools
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from polarkv_lib.manager.allocator import Allocator, size_class
from polarkv_lib.manager.store import Batch, EntryRow, NodeRow

# A dropped WRITING entry's space waits this long past its write grant's expiry before
# reuse, so a writer that started just before the grant expired cannot land its bytes
# in somebody else's entry.
WRITE_GRACE = 2.0
# Orders a disk role has not answered within this long are given up.
ORDER_TIMEOUT = 60.0
# Disk LRU deletion goes this far below the disk high watermark, so it runs in batches.
DISK_HYSTERESIS = 0.05


class State(StrEnum):
    WRITING = "writing"
    READY = "ready"


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
    allocator: Allocator = field(init=False)
    alive: bool = True
    # ready entries with a memory copy, least recently used first
    lru: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    # entries with a file on this node's disk, least recently used first
    disk_lru: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    entries: set[str] = field(default_factory=set)
    ready_bytes: int = 0
    disk_used: int = 0
    offloading_bytes: int = 0  # memory extents being offloaded (queued or in flight)
    offloading_files: int = 0  # and the file bytes they will take
    last_alloc: int = 0  # size class of the latest allocation: the room the next one needs
    pressure: int = 0  # bytes refused for room since the last offload plan
    reloads: dict[int, Entry] = field(default_factory=dict)  # by entry gen
    orders: list[dict[str, Any]] = field(default_factory=list)
    quarantine: list[tuple[float, int, int]] = field(default_factory=list)
    reported: dict[str, int] = field(default_factory=dict)  # the slab's own counters

    def __post_init__(self) -> None:
        self.allocator = Allocator(self.capacity)

    @property
    def has_disk(self) -> bool:
        return self.disk_capacity > 0


@dataclass(eq=False, slots=True)
class Entry:
    key: str
    size: int
    node: Node
    offset: int
    alloc_size: int  # 0: no memory extent
    state: State
    created: float
    last_access: float
    gen: int = 0  # tells this entry's orders from those of an older entry of the same key
    checksum: str = ""
    readers: int = 0
    write_lease: str | None = None
    dropped: bool = False  # out of the table; extent waits for readers / in-flight I/O
    in_memory: bool = True
    on_disk: bool = False
    file_bytes: int = 0
    offloading: bool = False
    reloading: bool = False
    order_deadline: float = 0.0


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
    deletes: int = 0
    nodes_died: int = 0
    entries_lost: int = 0
    tier_failures: dict[str, int] = field(default_factory=dict)  # "offload_disk_full": n


@dataclass(slots=True)
class AllocResult:
    key: str
    status: AllocStatus
    entry: Entry | None = None


@dataclass(slots=True)
class Events:
    """What `expire` changed, for the shell to log."""

    dead_nodes: list[str] = field(default_factory=list)
    expired_writes: int = 0
    expired_reads: int = 0


def new_id() -> str:
    return secrets.token_hex(8)


class Metadata:
    def __init__(self, partitions: int, read_lease: float, write_lease: float, heartbeat_ttl: float,
                 clock: Callable[[], float] = time.monotonic, memory_high: float = 0.90,
                 memory_low: float = 0.80, disk_high: float = 0.95,
                 rng: random.Random | None = None) -> None:
        self.partitions: list[dict[str, Entry]] = [{} for _ in range(partitions)]
        self.read_lease_ttl = read_lease
        self.write_lease_ttl = write_lease
        self.heartbeat_ttl = heartbeat_ttl
        self.memory_high = memory_high
        self.memory_low = memory_low
        self.disk_high = disk_high
        self.clock = clock
        self.rng = rng or random.Random()  # placement; tests pass a seeded one
        self.nodes: dict[str, Node] = {}
        self.read_leases: dict[str, ReadLease] = {}
        self.write_leases: dict[str, WriteLease] = {}
        self.counters = Counters()
        self._gens = itertools.count(1)
        self._last_expire = clock()
        # write-behind: what changed since the last flush (see manager/store.py)
        self.dirty_keys: set[str] = set()
        self.dirty_nodes: set[str] = set()
        # persisted entries of nodes that have not registered since the manager started
        self.restored: dict[str, tuple[NodeRow, list[EntryRow]]] = {}

    # -- tables -------------------------------------------------------------------------

    def table(self, key: str) -> dict[str, Entry]:
        return self.partitions[int(key[:8], 16) * len(self.partitions) >> 32]

    def get(self, key: str) -> Entry | None:
        return self.table(key).get(key)

    def _drop(self, entry: Entry) -> None:
        """Take an entry out of every index and delete its file; its memory extent is
        freed once nobody reads it and no reload is writing into it."""
        if entry.dropped:
            return
        entry.dropped = True
        self.dirty_keys.add(entry.key)
        self.table(entry.key).pop(entry.key, None)
        node = entry.node
        node.entries.discard(entry.key)
        self._forget_memory(entry)
        if entry.on_disk:
            self._forget_file(entry, delete=True)
        if entry.offloading:  # its file will be deleted when the offload reports back
            entry.offloading = False
            node.offloading_bytes -= entry.alloc_size
            node.offloading_files -= entry.size + 4096
        self._maybe_free(entry)

    def _forget_memory(self, entry: Entry) -> None:
        if entry.node.lru.pop(entry.key, None) is not None:
            entry.node.ready_bytes -= entry.size

    def _forget_file(self, entry: Entry, delete: bool) -> None:
        self.dirty_keys.add(entry.key)
        node = entry.node
        if node.disk_lru.pop(entry.key, None) is not None:
            node.disk_used -= entry.file_bytes
        entry.on_disk = False
        if delete and node.alive and node.has_disk:
            node.orders.append(self._order("delete", entry))

    def _maybe_free(self, entry: Entry) -> None:
        if entry.readers or entry.reloading or not entry.alloc_size:
            return
        if not entry.node.alive:
            entry.alloc_size = 0
            return
        if entry.state is State.WRITING:
            lease = self.write_leases.get(entry.write_lease or "")
            until = max(lease.expires if lease else 0.0, self.clock()) + WRITE_GRACE
            entry.node.quarantine.append((until, entry.offset, entry.alloc_size))
        else:
            entry.node.allocator.release(entry.offset, entry.alloc_size)
        entry.alloc_size = 0
        entry.in_memory = False

    def _release_memory_copy(self, entry: Entry) -> None:
        """An entry with a valid file gives its memory back (no rewrite needed)."""
        self.dirty_keys.add(entry.key)
        self._forget_memory(entry)
        entry.node.allocator.release(entry.offset, entry.alloc_size)
        entry.alloc_size = 0
        entry.in_memory = False

    def _unref(self, entry: Entry) -> None:
        entry.readers -= 1
        if entry.readers == 0 and entry.dropped:
            self._maybe_free(entry)

    def _order(self, op: str, entry: Entry) -> dict[str, Any]:
        return {"op": op, "key": entry.key, "gen": entry.gen, "node": entry.node.node_id,
                "offset": entry.offset, "size": entry.size, "extent": entry.alloc_size,
                "checksum": entry.checksum}

    # -- reads --------------------------------------------------------------------------

    def lookup(self, keys: list[str], take_lease: bool, lease_id: str | None = None
               ) -> tuple[list[Entry], str | None]:
        """The longest ready prefix of `keys`, touched in its nodes' LRUs. With a lease,
        disk-only entries in it get a reload queued (entry.reloading): the caller waits
        for those and then calls `settle_lookup`. Without a lease nothing moves.
        `lease_id` extends an open read lease (the same request, continued)."""
        now = self.clock()
        hits: list[Entry] = []
        seen: set[str] = set()
        for key in keys:
            entry = self.get(key)
            if entry is None or entry.state is not State.READY:
                break
            if not entry.in_memory and not entry.reloading:
                if not take_lease:
                    hits.append(entry)  # a probe: it is there, on disk
                    continue
                if not self._start_reload(entry, protected=seen):
                    self._note_reload_pressure(entry.node, keys[len(hits) + 1:])
                    break  # no memory for it now: the prefix ends here
            hits.append(entry)
            seen.add(key)
        wall = time.time()
        for entry in reversed(hits):
            entry.last_access = wall
            if entry.in_memory:
                entry.node.lru.move_to_end(entry.key)
            if entry.on_disk:
                entry.node.disk_lru.move_to_end(entry.key)
        on_disk = sum(1 for e in hits if e.reloading or not e.in_memory)
        self.counters.lookups += 1
        self.counters.hits += len(hits)
        self.counters.hits_disk += on_disk
        self.counters.hits_memory += len(hits) - on_disk
        self.counters.misses += len(keys) - len(hits)
        if not take_lease or not hits:
            return hits, lease_id if lease_id in self.read_leases else None
        for entry in hits:
            entry.readers += 1
        disk_hits = {e.gen for e in hits if e.reloading}
        lease = self.read_leases.get(lease_id or "")
        if lease is not None and lease_id:
            lease.entries.extend(hits)
            lease.disk_hits |= disk_hits
            return hits, lease_id
        lease_id = new_id()
        self.read_leases[lease_id] = ReadLease(list(hits), now + self.read_lease_ttl, disk_hits)
        return hits, lease_id

    def settle_lookup(self, lease_id: str | None, hits: list[Entry]) -> list[Entry]:
        """After waiting for reloads: the prefix that is in memory now. The rest leaves
        the lease and its hits become misses."""
        served = next((i for i, e in enumerate(hits) if not e.in_memory or e.dropped), len(hits))
        if served == len(hits):
            return hits
        gone = hits[served:]
        lease = self.read_leases.get(lease_id or "")
        from_disk = sum(1 for e in gone if lease is not None and e.gen in lease.disk_hits)
        self.counters.hits -= len(gone)
        self.counters.hits_disk -= from_disk
        self.counters.hits_memory -= len(gone) - from_disk
        self.counters.misses += len(gone)
        if lease is not None:
            for entry in gone:
                self._unref(entry)
            del lease.entries[len(lease.entries) - len(gone):]  # `hits` is the lease's tail
            if not lease.entries:
                del self.read_leases[lease_id or ""]
        return hits[:served]

    def _note_reload_pressure(self, node: Node, following: list[str]) -> None:
        """The rest of a prompt on this node's disk will want memory too: ask the next
        offload plan for all of it at once rather than one chunk per round."""
        for key in following:
            entry = self.get(key)
            if entry is None or entry.node is not node or entry.in_memory or entry.reloading:
                break
            node.pressure += size_class(entry.size)

    def _start_reload(self, entry: Entry, protected: set[str]) -> bool:
        node = entry.node
        if not node.alive or not node.has_disk:
            return False
        got = self._alloc_on(node, entry.size, protected)
        if got is None:
            node.pressure += size_class(entry.size)
            return False
        entry.offset, entry.alloc_size = got
        entry.reloading = True
        node.reloads[entry.gen] = entry
        entry.order_deadline = self.clock() + ORDER_TIMEOUT
        node.orders.append(self._order("reload", entry))
        return True

    def release(self, lease_ids: Iterable[str], corrupt: Iterable[str] = ()) -> int:
        """End read leases. `corrupt` keys (failed checksums) are dropped, but only if
        the releasing client held them under one of these leases."""
        released = 0
        held: dict[str, Entry] = {}
        for lease_id in lease_ids:
            lease = self.read_leases.pop(lease_id, None)
            if lease is None:
                continue
            released += 1
            for entry in lease.entries:
                held[entry.key] = entry
                self._unref(entry)
        for key in corrupt:
            suspect = held.get(key)
            if suspect is not None and not suspect.dropped:
                self.counters.checksum_failures += 1
                self._drop(suspect)
        return released

    def renew(self, lease_ids: Iterable[str]) -> list[str]:
        now = self.clock()
        renewed = []
        for lease_id in lease_ids:
            read = self.read_leases.get(lease_id)
            if read is not None:
                read.expires = now + self.read_lease_ttl
                renewed.append(lease_id)
                continue
            write = self.write_leases.get(lease_id)
            if write is not None:
                write.expires = now + self.write_lease_ttl
                renewed.append(lease_id)
        return renewed

    # -- writes -------------------------------------------------------------------------

    def allocate(self, items: list[tuple[str, int]], lease_id: str | None = None
                 ) -> tuple[list[AllocResult], str | None]:
        """First writer wins: a key that exists or is being written is not allocated
        again. `lease_id` adds the new entries to an open write lease (a retry)."""
        # A writer re-storing a prefix is using it: its existing chunks become recent (head
        # last) and are not eviction victims for the rest of this batch; a prefix larger
        # than memory keeps its head and gets no_space for its tail.
        batch = set()
        for key, _ in reversed(items):
            entry = self.get(key)
            if entry is not None and entry.state is State.READY:
                if entry.in_memory:
                    entry.node.lru.move_to_end(key)
                batch.add(key)
        results = []
        lease = self.write_leases.get(lease_id or "")
        lease_key = lease_id if lease is not None and lease_id else new_id()
        lease_entries: dict[str, Entry] = lease.entries if lease is not None else {}
        wall = time.time()
        refused = 0  # smallest size class this call found no room for
        for key, size in items:
            entry = self.get(key)
            if entry is not None:
                if entry.state is State.READY:
                    self.counters.exists += 1
                    results.append(AllocResult(key, AllocStatus.EXISTS, entry))
                else:
                    self.counters.in_progress += 1
                    results.append(AllocResult(key, AllocStatus.IN_PROGRESS))
                continue
            need = size_class(size)
            # A failed placement changed nothing, so anything as large fails too: skip
            # the search (it scans LRUs), but still ask the offload planner for the room.
            placed = None if refused and need >= refused else self._place(size, batch)
            if placed is None:
                if refused and need >= refused:
                    self._add_pressure(need)
                else:
                    refused = need
                self.counters.no_space += 1
                results.append(AllocResult(key, AllocStatus.NO_SPACE))
                continue
            node, offset, alloc_size = placed
            entry = Entry(key, size, node, offset, alloc_size, State.WRITING, wall, wall,
                          gen=next(self._gens), write_lease=lease_key)
            self.table(key)[key] = entry
            node.entries.add(key)
            lease_entries[key] = entry
            self.counters.allocations += 1
            results.append(AllocResult(key, AllocStatus.ALLOCATED, entry))
        if not lease_entries:
            return results, None
        expires = self.clock() + self.write_lease_ttl
        if lease is None:
            self.write_leases[lease_key] = WriteLease(lease_entries, expires)
        else:  # new grants run a full lease from now; the lease (and any quarantine) must too
            lease.expires = max(lease.expires, expires)
        return results, lease_key

    def _place(self, size: int, protected: set[str]) -> tuple[Node, int, int] | None:
        """Pick a node for new bytes at random, weighted by free memory: load spreads in
        proportion to room, so a freshly (re)started empty node takes more of the new
        writes but not all of them (it would become every reader's hot spot). If none
        has a free extent, make room on the emptiest one that can (drop clean memory
        copies; evict on nodes without a disk)."""
        nodes = sorted((n for n in self.nodes.values() if n.alive),
                       key=lambda n: n.allocator.free, reverse=True)
        need = size_class(size)
        fits = [n for n in nodes if n.allocator.used + need <= self._memory_limit(n)]
        while fits:
            node = self.rng.choices(fits, weights=[n.allocator.free for n in fits])[0]
            got = self._alloc_on(node, size, protected, make_room=False)
            if got is not None:
                node.last_alloc = got[1]
                return node, *got
            fits.remove(node)  # fragmented: no extent large enough after all
        for node in nodes:
            got = self._alloc_on(node, size, protected, make_room=True)
            if got is not None:
                node.last_alloc = got[1]
                return node, *got
        self._add_pressure(need)  # nowhere: the next offload plans make room for it
        return None

    def _add_pressure(self, need: int) -> None:
        for node in self.nodes.values():
            if node.alive and node.has_disk:
                node.pressure += need

    def _memory_limit(self, node: Node) -> int:
        # Nodes with a disk keep their memory under the high watermark; offload keeps
        # room below it. Nodes without one use all of it and evict.
        cap = node.allocator.capacity
        return int(cap * self.memory_high) if node.has_disk else cap

    def _alloc_on(self, node: Node, size: int, protected: set[str], make_room: bool = True
                  ) -> tuple[int, int] | None:
        need = size_class(size)
        limit = self._memory_limit(node)
        if node.allocator.used + need <= limit:
            got = node.allocator.alloc(size)
            if got is not None:
                return got
        if not make_room:
            return None
        return self._make_room(node, size, need, limit, protected)

    def _make_room(self, node: Node, size: int, need: int, limit: int, protected: set[str]
                   ) -> tuple[int, int] | None:
        """Free memory on `node` until `size` fits: first memory copies that also have a
        file (free to drop), then, on nodes without a disk, the LRU entries themselves.
        Gives up without touching anything if even that could not make it fit."""
        movable = [e for e in node.lru.values()
                   if e.readers == 0 and not e.offloading and e.key not in protected
                   and (e.on_disk or not node.has_disk)]
        if node.allocator.used - sum(e.alloc_size for e in movable) + need > limit:
            return None
        for victim in movable:
            if victim.on_disk:
                self._release_memory_copy(victim)
            else:
                self._drop(victim)
                self.counters.evictions += 1
            if node.allocator.used + need <= limit:
                got = node.allocator.alloc(size)
                if got is not None:
                    return got
        return None

    def commit(self, lease_id: str, items: list[tuple[str, str]]) -> dict[str, str]:
        """Make written entries visible. Returns key -> 'committed' or why not."""
        lease = self.write_leases.get(lease_id)
        out: dict[str, str] = {}
        for key, checksum in reversed(items):  # head of the prefix enters the LRU last
            if key in out:
                continue
            found = lease.entries.pop(key, None) if lease is not None else None
            if found is None:
                out[key] = "lease_expired" if lease is None else "not_in_lease"
                continue
            entry = found
            if entry.dropped:  # deleted, or its node died, while being written
                out[key] = "dropped"
                continue
            entry.state = State.READY
            entry.checksum = checksum
            entry.write_lease = None
            entry.node.lru[key] = entry
            entry.node.ready_bytes += entry.size
            self.counters.commits += 1
            self.dirty_keys.add(key)
            out[key] = "committed"
        if lease is not None and not lease.entries:
            del self.write_leases[lease_id]
        return out

    def abort(self, lease_id: str, keys: list[str] | None) -> int:
        lease = self.write_leases.get(lease_id)
        if lease is None:
            return 0
        victims = list(lease.entries) if keys is None else [k for k in keys if k in lease.entries]
        for key in victims:
            entry = lease.entries[key]
            if not entry.dropped:
                self._drop(entry)
                self.counters.aborts += 1
            del lease.entries[key]
        if not lease.entries:
            del self.write_leases[lease_id]
        return len(victims)

    # -- tiering ------------------------------------------------------------------------

    def plan_tiering(self) -> list[str]:
        """Queue offloads and disk deletions where watermarks say so. Returns the ids
        of nodes that got new orders."""
        touched = []
        for node in self.nodes.values():
            if node.alive and node.has_disk:
                before = len(node.orders)
                self._plan_disk(node)
                self._plan_offload(node)
                if len(node.orders) > before:
                    touched.append(node.node_id)
        return touched

    def _plan_offload(self, node: Node) -> None:
        limit = self._memory_limit(node)
        if node.allocator.used + max(node.pressure, node.last_alloc) <= limit:
            return
        target = max(0, min(int(node.allocator.capacity * self.memory_low), limit - node.pressure))
        node.pressure = 0
        projected = node.allocator.used - node.offloading_bytes
        now = self.clock()
        for entry in list(node.lru.values()):
            if projected <= target:
                break
            if entry.readers or entry.offloading:
                continue
            if entry.on_disk:
                projected -= entry.alloc_size
                self._release_memory_copy(entry)
                continue
            if not self._disk_room(node, entry.size):
                break
            entry.offloading = True
            entry.order_deadline = now + ORDER_TIMEOUT
            node.offloading_bytes += entry.alloc_size
            node.offloading_files += entry.size + 4096
            projected -= entry.alloc_size
            node.orders.append(self._order("offload", entry))

    def _disk_room(self, node: Node, size: int) -> bool:
        """Make room on the disk for one more file by deleting the oldest ones."""
        budget = node.disk_capacity * self.disk_high
        need = size + 4096
        pending = node.offloading_files
        if node.disk_used + pending + need <= budget:
            return True  # the common case: no need to look at the LRU at all
        victims = [e for e in node.disk_lru.values() if not e.reloading and e.readers == 0]
        for victim in victims:
            if node.disk_used + pending + need <= budget:
                break
            self._evict_file(victim)
        return node.disk_used + pending + need <= budget

    def _plan_disk(self, node: Node) -> None:
        if node.disk_used <= node.disk_capacity * self.disk_high:
            return
        target = node.disk_capacity * max(self.disk_high - DISK_HYSTERESIS, 0.0)
        for victim in [e for e in node.disk_lru.values() if not e.reloading and e.readers == 0]:
            if node.disk_used <= target:
                break
            self._evict_file(victim)

    def _evict_file(self, entry: Entry) -> None:
        self.counters.disk_evictions += 1
        if entry.in_memory:
            self._forget_file(entry, delete=True)
        else:
            self._drop(entry)

    def _tier_failure(self, op: str, reason: str) -> None:
        name = f"{op}_{reason}"
        self.counters.tier_failures[name] = self.counters.tier_failures.get(name, 0) + 1

    def _ordered_entry(self, node: Node, key: str, gen: int) -> Entry | None:
        entry = self.get(key)
        if entry is None or entry.gen != gen or entry.node is not node:
            return None
        return entry

    def offload_done(self, node_id: str, key: str, gen: int, ok: bool, reason: str = "",
                     file_bytes: int = 0) -> None:
        node = self.nodes.get(node_id)
        if node is None or not node.alive:
            return
        entry = self._ordered_entry(node, key, gen)
        if entry is None or not entry.offloading:
            current = self.get(key)
            keeps_file = current is not None and current.node is node and (current.on_disk or current.offloading)
            if ok and not keeps_file:  # deleted meanwhile: the file goes too
                node.orders.append({"op": "delete", "key": key, "gen": gen, "node": node.node_id,
                                    "offset": 0, "size": 0, "extent": 0, "checksum": ""})
            return
        entry.offloading = False
        node.offloading_bytes -= entry.alloc_size
        node.offloading_files -= entry.size + 4096
        if not ok:
            self._tier_failure("offload", reason)
            if reason == "disk_full" and entry.readers == 0:
                self._drop(entry)  # the disk cannot take it: degrade to eviction
                self.counters.evictions += 1
            return
        entry.on_disk = True
        entry.file_bytes = file_bytes
        self.dirty_keys.add(key)
        node.disk_used += file_bytes
        node.disk_lru[key] = entry
        self.counters.offloads += 1
        self.counters.offload_bytes += entry.size
        if entry.readers == 0:
            self._release_memory_copy(entry)

    def reload_done(self, node_id: str, key: str, gen: int, ok: bool, reason: str = "") -> None:
        node = self.nodes.get(node_id)
        if node is None or not node.alive:
            return
        entry = node.reloads.pop(gen, None)
        if entry is None or entry.key != key:
            return
        entry.reloading = False
        if entry.dropped:
            self._maybe_free(entry)
            return
        if not ok:
            self._tier_failure("reload", reason)
            if reason == "timeout":
                # The disk role never answered: its read may still land in this extent,
                # so the extent waits out another order timeout; the file is kept.
                node.quarantine.append((self.clock() + ORDER_TIMEOUT, entry.offset, entry.alloc_size))
                entry.alloc_size = 0
                entry.in_memory = False
                return
            if reason == "checksum":
                self.counters.checksum_failures += 1
            self._drop(entry)  # the disk role already deleted a broken file
            return
        entry.in_memory = True
        self.dirty_keys.add(key)
        node.lru[key] = entry
        node.ready_bytes += entry.size
        self.counters.reloads += 1
        self.counters.reload_bytes += entry.size

    def adopt(self, node_id: str, incarnation: int, files: list[tuple[str, int, str, int]]) -> list[str] | None:
        """A slab with a disk reports the files it holds (key, size, checksum, file bytes).
        Unknown keys become disk-only entries again; files the manager has better
        copies of are to be deleted (returned). None: unknown node."""
        node = self.nodes.get(node_id)
        if node is None or not node.alive or node.incarnation != incarnation or not node.has_disk:
            return None
        delete = []
        wall = time.time()
        for key, size, checksum, file_bytes in files:
            self.dirty_keys.add(key)
            entry = self.get(key)
            if entry is not None:
                if (entry.node is node and entry.state is State.READY and not entry.on_disk
                        and entry.checksum == checksum and not entry.offloading):
                    entry.on_disk, entry.file_bytes = True, file_bytes
                    node.disk_used += file_bytes
                    node.disk_lru[key] = entry
                elif not (entry.node is node and entry.on_disk):
                    delete.append(key)
                continue
            entry = Entry(key, size, node, 0, 0, State.READY, wall, wall, gen=next(self._gens),
                          checksum=checksum, in_memory=False, on_disk=True, file_bytes=file_bytes)
            self.table(key)[key] = entry
            node.entries.add(key)
            node.disk_used += file_bytes
            node.disk_lru[key] = entry
        return delete

    def take_orders(self, node_id: str) -> list[dict[str, Any]]:
        node = self.nodes.get(node_id)
        if node is None:
            return []
        orders, node.orders = node.orders, []
        # deletions first: they make room for the offloads behind them
        return sorted(orders, key=lambda o: o["op"] != "delete")

    # -- admin --------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        entry = self.get(key)
        if entry is None:
            return False
        self._drop(entry)
        self.counters.deletes += 1
        return True

    # -- nodes --------------------------------------------------------------------------

    def register(self, node_id: str, incarnation: int, address: str, capacity: int,
                 shm_path: str, host_id: str, transports: list[str], disk_capacity: int = 0
                 ) -> tuple[Node, bool]:
        """Returns (node, is_new). Re-registering the same live incarnation only refreshes it."""
        now = self.clock()
        old = self.nodes.get(node_id)
        if (old is not None and old.alive and old.incarnation == incarnation and old.capacity == capacity
                and old.disk_capacity == disk_capacity):
            old.address, old.shm_path, old.host_id, old.transports = address, shm_path, host_id, transports
            old.last_heartbeat, old.last_heartbeat_wall = now, time.time()
            return old, False
        if old is not None:
            self._kill(old)
        node = Node(node_id, incarnation, address, capacity, shm_path, host_id, transports,
                    now, time.time(), disk_capacity)
        self.nodes[node_id] = node
        self.dirty_nodes.add(node_id)
        self._restore_node(node)
        return node, True

    def heartbeat(self, node_id: str, incarnation: int, reported: dict[str, int] | None = None) -> bool:
        """False tells the slab to register again (unknown, dead, or another incarnation)."""
        node = self.nodes.get(node_id)
        if node is None or not node.alive or node.incarnation != incarnation:
            return False
        node.last_heartbeat, node.last_heartbeat_wall = self.clock(), time.time()
        if reported is not None:
            node.reported = reported
        return True

    def node(self, node_id: str, incarnation: int) -> Node | None:
        node = self.nodes.get(node_id)
        if node is None or not node.alive or node.incarnation != incarnation:
            return None
        return node

    def unregister(self, node_id: str, incarnation: int) -> bool:
        node = self.nodes.get(node_id)
        if node is None or node.incarnation != incarnation:
            return False
        self._kill(node)
        return True

    def _kill(self, node: Node) -> None:
        """A dead node takes only its own entries with it (its files stay on its disk,
        for the node to report again when it returns)."""
        if node.alive:
            self.counters.nodes_died += 1
        node.alive = False
        for key in list(node.entries):
            entry = self.get(key)
            if entry is not None:
                if entry.state is State.READY:
                    self.counters.entries_lost += 1
                self._drop(entry)
        node.lru.clear()
        node.disk_lru.clear()
        node.orders.clear()
        node.reloads.clear()
        node.ready_bytes = node.disk_used = node.offloading_bytes = node.offloading_files = 0

    # -- persistence --------------------------------------------------------------------

    def restore(self, nodes: list[NodeRow], entries: list[EntryRow]) -> None:
        """Keep what a previous manager persisted until each node registers again."""
        by_node: dict[str, list[EntryRow]] = {}
        for row in entries:
            by_node.setdefault(row.node_id, []).append(row)
        for node_row in nodes:
            self.restored[node_row.node_id] = (node_row, by_node.pop(node_row.node_id, []))
        for orphans in by_node.values():  # entries of a node we have no row for
            self.dirty_keys.update(row.key for row in orphans)

    def _restore_node(self, node: Node) -> None:
        """A node registers: its persisted disk entries serve again if it has its disk;
        its memory entries too if it kept its incarnation (its buffer survived us)."""
        saved = self.restored.pop(node.node_id, None)
        if saved is None:
            return
        node_row, rows = saved
        same_buffer = node_row.incarnation == node.incarnation and node_row.capacity == node.capacity
        for row in rows:
            self.dirty_keys.add(row.key)  # whatever is not restored is deleted from the store
            if self.get(row.key) is not None:
                continue
            in_memory = (same_buffer and row.in_memory and row.incarnation == node.incarnation
                         and node.allocator.reserve(row.mem_offset, row.mem_extent))
            on_disk = row.on_disk and node.has_disk
            if not in_memory and not on_disk:
                continue
            entry = Entry(row.key, row.size, node, row.mem_offset if in_memory else 0,
                          row.mem_extent if in_memory else 0, State.READY, row.created, row.created,
                          gen=next(self._gens), checksum=row.checksum, in_memory=in_memory,
                          on_disk=on_disk, file_bytes=row.file_bytes if on_disk else 0)
            self.table(row.key)[row.key] = entry
            node.entries.add(row.key)
            if in_memory:
                node.lru[row.key] = entry
                node.ready_bytes += entry.size
            if on_disk:
                node.disk_lru[row.key] = entry
                node.disk_used += entry.file_bytes

    def take_changes(self) -> Batch:
        """The current state of everything changed since the last call."""
        nodes = [NodeRow(n.node_id, n.incarnation, n.address, n.capacity, n.disk_capacity, n.shm_path,
                         n.host_id, ",".join(n.transports))
                 for n in (self.nodes.get(i) for i in self.dirty_nodes) if n is not None]
        entries, deleted = [], []
        waiting = {row.key for _, rows in self.restored.values() for row in rows} if self.restored else set()
        for key in self.dirty_keys:
            entry = self.get(key)
            if entry is None or entry.state is not State.READY or not entry.node.alive:
                if key not in waiting:  # a node not back yet keeps its rows
                    deleted.append(key)
                continue
            in_memory = entry.in_memory and entry.alloc_size > 0 and not entry.reloading
            entries.append(EntryRow(key, entry.node.node_id, entry.node.incarnation, entry.size,
                                    entry.checksum, entry.offset if in_memory else 0,
                                    entry.alloc_size if in_memory else 0, in_memory, entry.on_disk,
                                    entry.file_bytes, entry.created))
        self.dirty_keys.clear()
        self.dirty_nodes.clear()
        return Batch(nodes, entries, deleted)

    def requeue(self, batch: Batch) -> None:
        """A batch that could not be written: mark its keys and nodes again."""
        self.dirty_nodes.update(n.node_id for n in batch.nodes)
        self.dirty_keys.update(e.key for e in batch.entries)
        self.dirty_keys.update(batch.deleted_keys)

    # -- time ---------------------------------------------------------------------------

    def expire(self) -> Events:
        """Expire leases, silent nodes, quarantined space and unanswered orders."""
        now = self.clock()
        events = Events()
        stalled = now - self._last_expire
        self._last_expire = now
        if stalled > self.heartbeat_ttl / 2:
            # The manager itself was not running (paused VM, SIGSTOP, long GC): the
            # silence was ours, not the nodes'. Give them the stalled time back.
            for node in self.nodes.values():
                node.last_heartbeat += stalled
        for lease_id in [i for i, r in self.read_leases.items() if r.expires <= now]:
            for entry in self.read_leases.pop(lease_id).entries:
                self._unref(entry)
            events.expired_reads += 1
        for lease_id in [i for i, w in self.write_leases.items() if w.expires <= now]:
            lease = self.write_leases.pop(lease_id)
            for entry in lease.entries.values():
                self._drop(entry)
            events.expired_writes += 1
        for node in self.nodes.values():
            if node.alive and now - node.last_heartbeat > self.heartbeat_ttl:
                self._kill(node)
                events.dead_nodes.append(node.node_id)
            if node.quarantine:
                due = [q for q in node.quarantine if q[0] <= now]
                node.quarantine = [q for q in node.quarantine if q[0] > now]
                if node.alive:
                    for _, offset, length in due:
                        node.allocator.release(offset, length)
            if node.alive:
                self._expire_orders(node, now)
        self.counters.expired_reads += events.expired_reads
        self.counters.expired_writes += events.expired_writes
        return events

    def _expire_orders(self, node: Node, now: float) -> None:
        if node.offloading_bytes:
            for entry in [e for e in node.lru.values() if e.offloading and e.order_deadline <= now]:
                self.offload_done(node.node_id, entry.key, entry.gen, False, "timeout")
        for entry in [e for e in node.reloads.values() if e.order_deadline <= now]:
            self.reload_done(node.node_id, entry.key, entry.gen, False, "timeout")

    # -- views --------------------------------------------------------------------------

    def describe(self, key: str) -> dict[str, Any] | None:
        entry = self.get(key)
        if entry is None:
            return None
        tiers = (["memory"] if entry.in_memory and entry.alloc_size else []) + (["disk"] if entry.on_disk else [])
        return {
            "key": key,
            "state": entry.state.value,
            "tiers": tiers,
            "node": entry.node.node_id,
            "size": entry.size,
            "checksum": entry.checksum or None,
            "readers": entry.readers,
            "offloading": entry.offloading,
            "reloading": entry.reloading,
            "created": entry.created,
            "last_access": entry.last_access,
        }

    def node_views(self) -> list[dict[str, Any]]:
        return [{
            "id": n.node_id,
            "address": n.address,
            "state": "alive" if n.alive else "dead",
            "incarnation": n.incarnation,
            "transports": n.transports,
            "memory_used": n.allocator.used if n.alive else 0,
            "memory_capacity": n.capacity,
            "keys_memory": len(n.lru),
            "bytes_memory": n.ready_bytes,
            "disk_used": n.disk_used,
            "disk_capacity": n.disk_capacity,
            "keys_disk": len(n.disk_lru),
            "last_heartbeat": n.last_heartbeat_wall,
            "reported": n.reported,
        } for n in self.nodes.values()]

    def stats(self) -> dict[str, int]:
        alive = [n for n in self.nodes.values() if n.alive]
        c = self.counters
        return {
            "keys_memory": sum(len(n.lru) for n in alive),
            "keys_disk": sum(len(n.disk_lru) for n in alive),
            "keys_writing": sum(len(w.entries) for w in self.write_leases.values()),
            "bytes_memory": sum(n.ready_bytes for n in alive),
            "bytes_memory_allocated": sum(n.allocator.used for n in alive),
            "bytes_disk": sum(n.disk_used for n in alive),
            "capacity_memory": sum(n.allocator.capacity for n in alive),
            "capacity_disk": sum(n.disk_capacity for n in alive),
            "hits": c.hits,
            "misses": c.misses,
            "hits_memory": c.hits_memory,
            "hits_disk": c.hits_disk,
            "lookups": c.lookups,
            "allocations": c.allocations,
            "alloc_exists": c.exists,
            "alloc_in_progress": c.in_progress,
            "alloc_no_space": c.no_space,
            "commits": c.commits,
            "aborts": c.aborts,
            "offloads": c.offloads,
            "offload_bytes": c.offload_bytes,
            "bytes_offloading": sum(n.offloading_bytes for n in alive),
            "reloads": c.reloads,
            "reload_bytes": c.reload_bytes,
            "evictions": c.evictions,
            "disk_evictions": c.disk_evictions,
            "tier_failures": sum(c.tier_failures.values()),
            "expired_write_leases": c.expired_writes,
            "expired_read_leases": c.expired_reads,
            "checksum_failures": c.checksum_failures,
            "deletes": c.deletes,
            "entries_lost": c.entries_lost,
            "read_leases": len(self.read_leases),
            "write_leases": len(self.write_leases),
            "nodes": len(alive),
            "nodes_dead": len(self.nodes) - len(alive),
        }
