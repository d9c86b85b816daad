"""The manager's metadata core: entries, nodes, leases, placement and LRU. Synchronous.

No method here awaits or does I/O; the aiohttp shell (manager/app.py) calls them and
does whatever I/O follows. That keeps every state transition testable on its own.

Tables: entries live in `partitions` hash tables split by key range (the first 32 bits
of the key pick the partition), so a later manager can shard by handing out ranges.
Each node keeps the LRU of its ready memory entries: eviction and (later) offload are
per node, because tiering never leaves a node. A batch of chunk keys is one prompt's
prefix, in order; the batch is touched back to front, so a prompt's first chunk is its
most recently used one. Eviction then takes prefixes from their tail, which is right for
a prefix cache: chunk i is worthless without chunks 0..i-1.

Entry life: allocate -> WRITING (invisible, under a write lease) -> commit -> READY.
A write lease that expires drops its WRITING entries and frees their space. Lookups
return the longest READY prefix and may take a read lease on it; nothing under a read
lease is evicted or reused. An entry dropped while leased (delete, corruption report)
leaves the table at once but keeps its extent until the last reader lets go.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from polarkv_lib.manager.allocator import Allocator


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
    allocator: Allocator = field(init=False)
    alive: bool = True
    # ready memory entries, least recently used first
    lru: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    entries: set[str] = field(default_factory=set)
    ready_bytes: int = 0

    def __post_init__(self) -> None:
        self.allocator = Allocator(self.capacity)


@dataclass(eq=False, slots=True)
class Entry:
    key: str
    size: int
    node: Node
    offset: int
    alloc_size: int
    state: State
    created: float
    last_access: float
    checksum: str = ""
    readers: int = 0
    write_lease: str | None = None
    dropped: bool = False  # out of the table; extent waits for the last reader


@dataclass(slots=True)
class ReadLease:
    entries: list[Entry]
    expires: float


@dataclass(slots=True)
class WriteLease:
    entries: dict[str, Entry]
    expires: float


@dataclass(slots=True)
class Counters:
    hits: int = 0
    misses: int = 0
    lookups: int = 0
    allocations: int = 0
    exists: int = 0
    in_progress: int = 0
    no_space: int = 0
    commits: int = 0
    aborts: int = 0
    evictions: int = 0
    expired_writes: int = 0
    expired_reads: int = 0
    checksum_failures: int = 0
    deletes: int = 0
    nodes_died: int = 0
    entries_lost: int = 0


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
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.partitions: list[dict[str, Entry]] = [{} for _ in range(partitions)]
        self.read_lease_ttl = read_lease
        self.write_lease_ttl = write_lease
        self.heartbeat_ttl = heartbeat_ttl
        self.clock = clock
        self.nodes: dict[str, Node] = {}
        self.read_leases: dict[str, ReadLease] = {}
        self.write_leases: dict[str, WriteLease] = {}
        self.counters = Counters()
        self._last_expire = clock()

    # -- tables -------------------------------------------------------------------------

    def table(self, key: str) -> dict[str, Entry]:
        return self.partitions[int(key[:8], 16) * len(self.partitions) >> 32]

    def get(self, key: str) -> Entry | None:
        return self.table(key).get(key)

    def _drop(self, entry: Entry) -> None:
        """Take an entry out of every index; free its extent once nobody reads it."""
        if entry.dropped:
            return
        entry.dropped = True
        self.table(entry.key).pop(entry.key, None)
        node = entry.node
        node.entries.discard(entry.key)
        if node.lru.pop(entry.key, None) is not None:
            node.ready_bytes -= entry.size
        if entry.readers == 0:
            self._free(entry)

    def _free(self, entry: Entry) -> None:
        if entry.node.alive:
            entry.node.allocator.release(entry.offset, entry.alloc_size)

    def _unref(self, entry: Entry) -> None:
        entry.readers -= 1
        if entry.readers == 0 and entry.dropped:
            self._free(entry)

    # -- reads --------------------------------------------------------------------------

    def lookup(self, keys: list[str], take_lease: bool) -> tuple[list[Entry], str | None]:
        """The longest ready prefix of `keys`, touched in its node's LRU."""
        now = self.clock()
        hits: list[Entry] = []
        for key in keys:
            entry = self.get(key)
            if entry is None or entry.state is not State.READY:
                break
            hits.append(entry)
        wall = time.time()
        for entry in reversed(hits):
            entry.last_access = wall
            entry.node.lru.move_to_end(entry.key)
        self.counters.lookups += 1
        self.counters.hits += len(hits)
        self.counters.misses += len(keys) - len(hits)
        if not take_lease or not hits:
            return hits, None
        lease_id = new_id()
        for entry in hits:
            entry.readers += 1
        self.read_leases[lease_id] = ReadLease(hits, now + self.read_lease_ttl)
        return hits, lease_id

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

    def allocate(self, items: list[tuple[str, int]]) -> tuple[list[AllocResult], str | None]:
        """First writer wins: a key that exists or is being written is not allocated again."""
        # A writer re-storing a prefix is using it: its existing chunks become recent (head
        # last) and are not eviction victims for the rest of this batch; a prefix larger
        # than memory keeps its head and gets no_space for its tail.
        batch = set()
        for key, _ in reversed(items):
            entry = self.get(key)
            if entry is not None and entry.state is State.READY:
                entry.node.lru.move_to_end(key)
                batch.add(key)
        results = []
        lease_id = new_id()
        lease_entries: dict[str, Entry] = {}
        wall = time.time()
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
            placed = self._place(size, batch)
            if placed is None:
                self.counters.no_space += 1
                results.append(AllocResult(key, AllocStatus.NO_SPACE))
                continue
            node, offset, alloc_size = placed
            entry = Entry(key, size, node, offset, alloc_size, State.WRITING, wall, wall,
                          write_lease=lease_id)
            self.table(key)[key] = entry
            node.entries.add(key)
            lease_entries[key] = entry
            self.counters.allocations += 1
            results.append(AllocResult(key, AllocStatus.ALLOCATED, entry))
        if not lease_entries:
            return results, None
        self.write_leases[lease_id] = WriteLease(lease_entries, self.clock() + self.write_lease_ttl)
        return results, lease_id

    def _place(self, size: int, protected: set[str]) -> tuple[Node, int, int] | None:
        """Put new bytes on the alive node with the most free memory, so a freshly
        (re)started empty node is filled evenly rather than flooded; evict there if full."""
        nodes = sorted((n for n in self.nodes.values() if n.alive),
                       key=lambda n: n.allocator.free, reverse=True)
        for node in nodes:
            got = node.allocator.alloc(size)
            if got is not None:
                return node, *got
        for node in nodes:
            got = self._evict_until_fits(node, size, protected)
            if got is not None:
                return node, *got
        return None

    def _evict_until_fits(self, node: Node, size: int, protected: set[str]) -> tuple[int, int] | None:
        victims = [e for e in node.lru.values() if e.readers == 0 and e.key not in protected]
        for victim in victims:
            self._drop(victim)
            self.counters.evictions += 1
            got = node.allocator.alloc(size)
            if got is not None:
                return got
        return None

    def commit(self, lease_id: str, items: list[tuple[str, str]]) -> dict[str, str]:
        """Make written entries visible. Returns key -> 'committed' or why not."""
        lease = self.write_leases.get(lease_id)
        out: dict[str, str] = {}
        for key, checksum in reversed(items):  # head of the prefix enters the LRU last
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
            entry = lease.entries.pop(key)
            if not entry.dropped:
                self._drop(entry)
                self.counters.aborts += 1
        if not lease.entries:
            del self.write_leases[lease_id]
        return len(victims)

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
                 shm_path: str, host_id: str, transports: list[str]) -> tuple[Node, bool]:
        """Returns (node, is_new). Re-registering the same live incarnation only refreshes it."""
        now = self.clock()
        old = self.nodes.get(node_id)
        if old is not None and old.alive and old.incarnation == incarnation and old.capacity == capacity:
            old.address, old.shm_path, old.host_id, old.transports = address, shm_path, host_id, transports
            old.last_heartbeat, old.last_heartbeat_wall = now, time.time()
            return old, False
        if old is not None:
            self._kill(old)
        node = Node(node_id, incarnation, address, capacity, shm_path, host_id, transports,
                    now, time.time())
        self.nodes[node_id] = node
        return node, True

    def heartbeat(self, node_id: str, incarnation: int) -> bool:
        """False tells the slab to register again (unknown, dead, or another incarnation)."""
        node = self.nodes.get(node_id)
        if node is None or not node.alive or node.incarnation != incarnation:
            return False
        node.last_heartbeat, node.last_heartbeat_wall = self.clock(), time.time()
        return True

    def unregister(self, node_id: str, incarnation: int) -> bool:
        node = self.nodes.get(node_id)
        if node is None or node.incarnation != incarnation:
            return False
        self._kill(node)
        return True

    def _kill(self, node: Node) -> None:
        """A dead node takes only its own entries with it."""
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
        node.ready_bytes = 0

    # -- time ---------------------------------------------------------------------------

    def expire(self) -> Events:
        """Expire leases and silent nodes. Called periodically by the shell."""
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
        self.counters.expired_reads += events.expired_reads
        self.counters.expired_writes += events.expired_writes
        return events

    # -- views --------------------------------------------------------------------------

    def describe(self, key: str) -> dict[str, Any] | None:
        entry = self.get(key)
        if entry is None:
            return None
        return {
            "key": key,
            "state": entry.state.value,
            "tiers": ["memory"],
            "node": entry.node.node_id,
            "size": entry.size,
            "checksum": entry.checksum or None,
            "readers": entry.readers,
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
            "disk_used": 0,
            "disk_capacity": 0,
            "last_heartbeat": n.last_heartbeat_wall,
        } for n in self.nodes.values()]

    def stats(self) -> dict[str, int]:
        alive = [n for n in self.nodes.values() if n.alive]
        c = self.counters
        return {
            "keys_memory": sum(len(n.lru) for n in alive),
            "keys_disk": 0,
            "keys_writing": sum(len(w.entries) for w in self.write_leases.values()),
            "bytes_memory": sum(n.ready_bytes for n in alive),
            "bytes_memory_allocated": sum(n.allocator.used for n in alive),
            "bytes_disk": 0,
            "capacity_memory": sum(n.allocator.capacity for n in alive),
            "capacity_disk": 0,
            "hits": c.hits,
            "misses": c.misses,
            "hits_memory": c.hits,
            "hits_disk": 0,
            "lookups": c.lookups,
            "allocations": c.allocations,
            "alloc_exists": c.exists,
            "alloc_in_progress": c.in_progress,
            "alloc_no_space": c.no_space,
            "commits": c.commits,
            "aborts": c.aborts,
            "offloads": 0,
            "reloads": 0,
            "evictions": c.evictions,
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
