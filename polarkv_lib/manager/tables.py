"""The manager core's state and the primitive transitions every part of it shares:
finding entries, dropping them, moving them in and out of the per-node LRUs, freeing
their memory extents and queuing file deletions.

Tables: one hash table of entries per manager process (`entries`); scaling out is done
across processes, each owning a range of keys (manager/shard.py).

Per-node LRUs, one per tier. A batch of chunk keys is one prompt's prefix, in order; the
batch is touched back to front, so a prompt's first chunk is its most recently used one.
Eviction and offload then take prefixes from their tail, which is right for a prefix
cache: chunk i is worthless without chunks 0..i-1. Every walk over an LRU starts at its
head and stops once it has what it came for, so its cost follows what it frees, not the
size of the table.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import OrderedDict
from collections.abc import Callable

from polarkv_lib.manager.model import (
    WRITE_GRACE,
    Counters,
    Entry,
    Node,
    ReadLease,
    Residency,
    State,
    TenantStats,
    WriteLease,
)
from polarkv_lib.tenancy import Tenants
from polarkv_lib.wire.orders import Order, TierOp, file_bytes_bound


class Tables:
    def __init__(
        self,
        read_lease: float,
        write_lease: float,
        heartbeat_ttl: float,
        clock: Callable[[], float] = time.monotonic,
        memory_high: float = 0.90,
        memory_low: float = 0.80,
        disk_high: float = 0.95,
        rng: random.Random | None = None,
        wall: Callable[[], float] = time.time,
        stream_window: int = 64 << 20,
        tenants: Tenants | None = None,
    ) -> None:
        self.entries: dict[str, Entry] = {}
        self.read_lease_ttl = read_lease
        self.write_lease_ttl = write_lease
        self.heartbeat_ttl = heartbeat_ttl
        self.memory_high = memory_high
        self.memory_low = memory_low
        self.disk_high = disk_high
        self.stream_window = stream_window  # most bytes one stream moves per window (tiering.py)
        self.clock = clock  # monotonic: leases, heartbeats, deadlines
        self.wall = wall  # wall time: what views and persisted rows show
        self.rng = rng or random.Random()  # placement; tests pass a seeded one
        self.nodes: dict[str, Node] = {}
        self.read_leases: dict[str, ReadLease] = {}
        self.write_leases: dict[str, WriteLease] = {}
        self.counters = Counters()
        self.tenant_stats: dict[str, TenantStats] = {}
        # the tenants (tenancy.py), those with a memory quota, and the memory copies of
        # the latter that may leave memory now, least recently used first
        self.tenants = tenants or Tenants({})
        self.quotas: dict[str, int] = dict(self.tenants.quotas)
        self.tenant_lru: dict[str, OrderedDict[str, Entry]] = {}
        # Generations grow across manager restarts too (wall microseconds at start, then
        # one by one): a slab ranks the grants of every manager it has served by them.
        self._gens = itertools.count(int(wall() * 1_000_000))
        self._last_expire = clock()
        # write-behind: what changed since the last flush (see manager/store.py)
        self.dirty_keys: set[str] = set()
        self.dirty_nodes: set[str] = set()

    # -- tables -------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def tenant(self, name: str) -> TenantStats:
        stats = self.tenant_stats.get(name)
        if stats is None:
            stats = self.tenant_stats[name] = TenantStats()
        return stats

    def _next_gen(self) -> int:
        return next(self._gens)

    # -- memory figures and the eviction order -------------------------------------------

    def _memory_ready(self, entry: Entry) -> None:
        """A ready entry has a memory copy now (commit, reload, restore): it counts in its
        node's and tenant's memory, and joins the eviction order unless it is held."""
        if entry.counted:
            return
        entry.counted = True
        node = entry.node
        node.keys_memory += 1
        node.ready_bytes += entry.size
        tenant = self.tenant(entry.tenant)
        tenant.keys_memory += 1
        tenant.bytes_memory += entry.size
        self._order_in(entry)

    def _forget_memory(self, entry: Entry) -> None:
        """The entry's memory copy no longer counts (it is going, or gone)."""
        self._order_out(entry)
        if not entry.counted:
            return
        entry.counted = False
        node = entry.node
        node.keys_memory -= 1
        node.ready_bytes -= entry.size
        tenant = self.tenant(entry.tenant)
        tenant.keys_memory -= 1
        tenant.bytes_memory -= entry.size

    @staticmethod
    def _orderable(entry: Entry) -> bool:
        """Whether its memory copy may leave memory now: ready, not dropped, read by
        nobody, no transfer of it in flight."""
        return (
            entry.counted
            and entry.readers == 0
            and entry.residency in (Residency.MEMORY, Residency.BOTH)
        )

    def _order_in(self, entry: Entry, recent: bool = True) -> None:
        """Put an entry that may leave memory into its node's eviction order (and its
        tenant's, under a quota): as the most recently used, or (`recent=False`) as the
        least, for an entry that was next to go when it was taken out."""
        node, key = entry.node, entry.key
        if not self._orderable(entry) or key in node.lru:
            return
        # Every lease's release and every commit comes here, once per key: each order
        # is written directly (no list of them per entry).
        node.lru[key] = entry
        node.lru_extent += entry.alloc_size
        if not recent:
            node.lru.move_to_end(key, last=False)
        if entry.residency is Residency.BOTH:
            node.clean[key] = entry
            node.clean_extent += entry.alloc_size
            if not recent:
                node.clean.move_to_end(key, last=False)
        if entry.tenant in self.quotas:
            order = self.tenant_lru.setdefault(entry.tenant, OrderedDict())
            order[key] = entry
            if not recent:
                order.move_to_end(key, last=False)

    def _order_out(self, entry: Entry) -> None:
        """Take an entry out of the eviction order: it is read, in flight or leaving."""
        node = entry.node
        if node.lru.pop(entry.key, None) is None:
            return
        node.lru_extent -= entry.alloc_size
        if node.clean.pop(entry.key, None) is not None:
            node.clean_extent -= entry.alloc_size
        if entry.tenant in self.quotas:
            self.tenant_lru[entry.tenant].pop(entry.key, None)

    def _clean_add(self, entry: Entry) -> None:
        """An entry in the eviction order got a valid file: its memory can go at no cost."""
        node = entry.node
        if entry.key in node.lru and entry.key not in node.clean:
            node.clean[entry.key] = entry
            node.clean_extent += entry.alloc_size

    def _pin(self, entry: Entry) -> None:
        """A reader holds the entry: nothing evicts, offloads away or reuses it."""
        entry.readers += 1
        if entry.readers == 1:
            self._order_out(entry)

    def _unref(self, entry: Entry) -> None:
        entry.readers -= 1
        if entry.readers:
            return
        if entry.dropped:
            self._maybe_free(entry)
        else:
            self._order_in(entry)

    def _touch(self, entry: Entry) -> None:
        node = entry.node
        if entry.key in node.lru:
            node.lru.move_to_end(entry.key)
            if entry.key in node.clean:
                node.clean.move_to_end(entry.key)
            if entry.tenant in self.quotas:
                self.tenant_lru[entry.tenant].move_to_end(entry.key)
        if entry.key in node.disk_lru:
            node.disk_lru.move_to_end(entry.key)

    def _file_added(self, entry: Entry, file_bytes: int) -> None:
        """A valid file of this entry now exists on its node's disk."""
        node = entry.node
        entry.file_bytes = file_bytes
        node.disk_used += file_bytes
        node.disk_lru[entry.key] = entry
        self.dirty_keys.add(entry.key)

    # -- dropping -----------------------------------------------------------------------

    def _drop(self, entry: Entry) -> None:
        """Take an entry out of every index and delete its file; its memory extent is
        freed once nobody reads it and no reload is writing into it."""
        if entry.dropped:
            return
        entry.dropped = True
        if entry.state is State.WRITING:  # its writer will not commit it now
            self.tenant(entry.tenant).bytes_writing -= entry.size
        self.dirty_keys.add(entry.key)
        self.entries.pop(entry.key, None)
        node = entry.node
        node.entries.discard(entry.key)
        self._forget_memory(entry)
        if entry.residency is Residency.OFFLOADING:  # its file goes when the offload reports
            self._end_offload(entry)
        if entry.on_disk:
            self._forget_file(entry, delete=True)
        self._maybe_free(entry)

    def _end_write_lease(self, lease_id: str) -> int:
        """End a write lease (release, abort, expiry): what it still writes is dropped.
        How many that was."""
        lease = self.write_leases.pop(lease_id, None)
        if lease is None:
            return 0
        for entry in lease.entries.values():
            self._drop(entry)
        return len(lease.entries)

    def _end_offload(self, entry: Entry) -> None:
        node = entry.node
        entry.residency = Residency.MEMORY
        node.offloads.pop(entry.gen, None)
        node.offloading_bytes -= entry.alloc_size
        node.offloading_files -= file_bytes_bound(entry.size)

    def _forget_file(self, entry: Entry, delete: bool) -> None:
        self.dirty_keys.add(entry.key)
        node = entry.node
        if node.disk_lru.pop(entry.key, None) is not None:
            node.disk_used -= entry.file_bytes
        if entry.residency is Residency.BOTH:
            if node.clean.pop(entry.key, None) is not None:
                node.clean_extent -= entry.alloc_size
            entry.residency = Residency.MEMORY
        elif entry.residency is Residency.DISK:
            entry.residency = Residency.NONE
        # RELOADING keeps its state: the read in flight still lands in its extent
        if delete and node.alive and node.has_disk:
            node.orders.append(self._order(TierOp.DELETE, entry))

    def _maybe_free(self, entry: Entry) -> None:
        if entry.readers or entry.reloading or not entry.alloc_size:
            return
        if entry.node.alive:
            if entry.state is State.WRITING:
                lease = self.write_leases.get(entry.write_lease or "")
                until = max(lease.expires if lease else 0.0, self.clock()) + WRITE_GRACE
                self._quarantine(entry.node, until, entry.offset, entry.alloc_size)
            else:
                entry.node.allocator.release(entry.offset, entry.alloc_size)
        entry.alloc_size = 0
        entry.residency = Residency.DISK if entry.residency is Residency.BOTH else Residency.NONE

    def _release_memory_copy(self, entry: Entry) -> None:
        """An entry with a valid file gives its memory back (no rewrite needed)."""
        self.dirty_keys.add(entry.key)
        self._forget_memory(entry)
        entry.node.allocator.release(entry.offset, entry.alloc_size)
        entry.alloc_size = 0
        entry.residency = Residency.DISK

    @staticmethod
    def _quarantine(node: Node, until: float, offset: int, length: int) -> None:
        heapq.heappush(node.quarantine, (until, offset, length))

    def _release_quarantine(self, node: Node, now: float) -> None:
        while node.quarantine and node.quarantine[0][0] <= now:
            _, offset, length = heapq.heappop(node.quarantine)
            if node.alive:
                node.allocator.release(offset, length)

    @staticmethod
    def _order(op: TierOp, entry: Entry) -> Order:
        return Order(
            op,
            entry.key,
            entry.gen,
            entry.node.node_id,
            entry.offset,
            entry.size,
            entry.alloc_size,
            entry.checksum,
        )
