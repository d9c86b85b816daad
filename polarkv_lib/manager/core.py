"""The manager's metadata core: the requests (lookup, allocate, commit, abort, release,
renew, delete), node membership and time.

Synchronous: no method awaits or does I/O. The aiohttp shell (manager/app.py) calls
them and does the I/O that follows; the core returns outcome objects (`Lookup`,
`Allocation`, `Released`, `Events`) saying what was served and what to wait for, and
counts everything itself, so the shell only decodes, awaits and encodes. That keeps
every state transition testable alone, with a fake clock.

Lookups return the longest READY prefix and may take a read lease on it; nothing under
a read lease is evicted, offloaded away or reused. Writes: first writer wins.
"""

from __future__ import annotations

from collections.abc import Iterable

from polarkv_lib.manager.allocator import size_class
from polarkv_lib.manager.drain import Draining
from polarkv_lib.manager.model import (
    Allocation,
    AllocResult,
    AllocStatus,
    Entry,
    Events,
    Lookup,
    Node,
    NodeIdInUse,
    ReadLease,
    Released,
    Residency,
    State,
    WriteLease,
    new_id,
)
from polarkv_lib.manager.snapshot import Snapshots
from polarkv_lib.manager.views import Views


class Metadata(Draining, Snapshots, Views):
    # -- reads --------------------------------------------------------------------------

    def lookup(
        self, keys: list[str], take_lease: bool, lease_id: str | None = None
    ) -> tuple[list[Entry], str | None]:
        """The longest ready prefix of `keys`, touched in its nodes' LRUs. With a lease,
        disk-only entries in it get a reload queued (entry.reloading): the caller waits
        for those and then calls `settle_lookup`. Without a lease nothing moves.
        `lease_id` extends an open read lease (the same request, continued)."""
        return self._lookup_pass(keys, take_lease, lease_id)

    def _lookup_pass(
        self,
        keys: list[str],
        take_lease: bool,
        lease_id: str | None,
        first: bool = True,
        tenant: str = "",
    ) -> tuple[list[Entry], str | None]:
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
                    self._note_reload_pressure(entry.node, keys[len(hits) + 1 :])
                    break  # no memory for it now: the prefix ends here
            hits.append(entry)
            seen.add(key)
        wall = self.wall()
        for entry in reversed(hits):
            entry.last_access = wall
            self._touch(entry)
        from_disk = sum(1 for e in hits if not e.in_memory)
        # One request is one lookup, however many passes it takes: a later pass counts
        # again the keys the earlier one counted as misses.
        self.counters.lookups += first
        self.counters.hits += len(hits)
        self.counters.hits_disk += from_disk
        self.counters.hits_memory += len(hits) - from_disk
        self.counters.misses += len(keys) - len(hits)
        mine = self.tenant(tenant)
        mine.lookups += first
        mine.hits += len(hits)
        mine.misses += len(keys) - len(hits)
        if not take_lease or not hits:
            return hits, lease_id if lease_id in self.read_leases else None
        for entry in hits:
            entry.readers += 1
        reloading = {e.gen for e in hits if e.reloading}
        lease = self.read_leases.get(lease_id or "")
        if lease is not None and lease_id:
            lease.entries.extend(hits)
            lease.disk_hits |= reloading
            # a lookup may wait longer than one lease for reloads or room: what it has
            # served so far must stay protected for as long as it goes on
            lease.expires = max(lease.expires, self.clock() + self.read_lease_ttl)
            return hits, lease_id
        lease_id = new_id()
        self.read_leases[lease_id] = ReadLease(
            list(hits), self.clock() + self.read_lease_ttl, reloading
        )
        return hits, lease_id

    def settle_lookup(
        self, lease_id: str | None, hits: list[Entry], tenant: str = ""
    ) -> list[Entry]:
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
        # the lookup's tenant, as `_lookup_pass` counted it (a restored entry's own
        # tenant field may be the default one: rows do not persist it)
        mine = self.tenant(tenant)
        mine.hits -= len(gone)
        mine.misses += len(gone)
        if lease is not None:
            for entry in gone:
                self._unref(entry)
            del lease.entries[len(lease.entries) - len(gone) :]  # `hits` is the lease's tail
            if not lease.entries:
                del self.read_leases[lease_id or ""]
        return hits[:served]

    def begin_lookup(self, keys: list[str], take_lease: bool, tenant: str = "") -> Lookup:
        """One lookup request: its first pass. The shell then waits for `op.reloads`
        and calls `settle`, or waits for room and calls `continue_lookup`, until done."""
        op = Lookup(keys, take_lease, tenant)
        op.pending, op.lease = self._lookup_pass(keys, take_lease, None, tenant=tenant)
        if not op.reloads:
            self.settle(op)
        return op

    def continue_lookup(self, op: Lookup) -> None:
        """Another pass over the keys past the served prefix (memory was freed)."""
        rest = op.keys[len(op.served) :]
        self.counters.misses -= len(rest)
        self.tenant(op.tenant).misses -= len(rest)
        op.pending, op.lease = self._lookup_pass(
            rest, op.take_lease, op.lease, first=False, tenant=op.tenant
        )
        op.wait_room = False
        if not op.reloads:
            self.settle(op)

    def others_reading(self, op: Lookup) -> bool:
        """Other requests hold read leases: their memory copies become free to drop (or
        to offload) when they release, so a lookup short of room may wait for that."""
        return len(self.read_leases) > (op.lease in self.read_leases)

    def settle(self, op: Lookup) -> None:
        """After this pass's reloads landed (or the caller stopped waiting): serve what is
        in memory and decide whether the request is done or goes on."""
        hits = op.pending
        settled = self.settle_lookup(op.lease, hits, op.tenant)
        if op.lease not in self.read_leases:
            op.lease = None
        op.pending = []
        op.served += settled
        if not op.take_lease or len(op.served) == len(op.keys) or len(settled) < len(hits):
            op.done = True  # all served, a probe, or a reload failed / ran late
            return
        # The prefix stopped at a disk entry that had no memory to reload into. If this
        # pass made progress, memory may be free now: go on at once. Otherwise wait for
        # the room that offloads are making, if any are.
        stop = self.get(op.keys[len(op.served)])
        if stop is None or stop.state is not State.READY or stop.in_memory:
            op.done = True
            return
        op.wait_room = not settled

    def release(self, lease_ids: Iterable[str], corrupt: Iterable[str] = ()) -> Released:
        """End read leases. `corrupt` keys (failed checksums) that the releasing client
        held under one of these leases become suspects: a report alone drops nothing
        (any client could cry "corrupt"); `corrupt_verified` does, once the bytes on
        the slab are found not to match."""
        out = Released(0)
        held: dict[str, Entry] = {}
        for lease_id in lease_ids:
            lease = self.read_leases.pop(lease_id, None)
            if lease is None:
                continue
            out.released += 1
            for entry in lease.entries:
                held[entry.key] = entry
                self._unref(entry)
        for key in dict.fromkeys(corrupt):
            suspect = held.get(key)
            if suspect is not None and not suspect.dropped:
                self.counters.corrupt_reports += 1
                out.suspects.append(suspect)
        return out

    def corrupt_verified(self, entry: Entry, gen: int, bad: bool | None) -> bool:
        """What the slab's bytes of a suspect said: `bad` drops the entry, if it is still
        the one reported (same generation, same memory copy); False and None (could not
        be checked) leave it. True if it was dropped."""
        if bad is False:
            self.counters.corrupt_reports_rejected += 1
        if not bad or entry.dropped or entry.gen != gen or self.get(entry.key) is not entry:
            return False
        self.counters.checksum_failures += 1
        self._drop(entry)
        return True

    def grant_expiry(self, ttl: float) -> int:
        """When a data-plane grant handed out now for `ttl` expires, in wall milliseconds."""
        return int((self.wall() + ttl) * 1000)

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

    def allocate(
        self, items: list[tuple[str, int]], lease_id: str | None = None, tenant: str = ""
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
                    self._touch(entry)
                batch.add(key)
        results = []
        lease = self.write_leases.get(lease_id or "")
        lease_key = lease_id if lease is not None and lease_id else new_id()
        lease_entries: dict[str, Entry] = lease.entries if lease is not None else {}
        wall = self.wall()
        refused = 0  # smallest size class this call found no room for
        mine = self.tenant(tenant)
        pending = 0  # bytes allocated for the tenant by this call (its quota counts them)
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
            if not self._within_quota(tenant, size, pending, batch):
                self.counters.no_space += 1
                mine.alloc_no_space += 1
                results.append(AllocResult(key, AllocStatus.NO_SPACE))
                continue
            # A failed placement changed nothing, so anything as large fails too: skip
            # the search, but still ask the offload planner for the room.
            placed = None if refused and need >= refused else self._place(size, batch)
            if placed is None:
                if refused and need >= refused:
                    self._add_pressure(need)
                else:
                    refused = need
                self.counters.no_space += 1
                mine.alloc_no_space += 1
                results.append(AllocResult(key, AllocStatus.NO_SPACE))
                continue
            node, offset, alloc_size = placed
            entry = Entry(
                key,
                size,
                node,
                offset,
                alloc_size,
                State.WRITING,
                wall,
                wall,
                gen=self._next_gen(),
                write_lease=lease_key,
                tenant=tenant,
            )
            self.entries[key] = entry
            node.entries.add(key)
            lease_entries[key] = entry
            self.counters.allocations += 1
            mine.allocations += 1
            pending += size
            results.append(AllocResult(key, AllocStatus.ALLOCATED, entry))
        if not lease_entries:
            return results, None
        expires = self.clock() + self.write_lease_ttl
        if lease is None:
            self.write_leases[lease_key] = WriteLease(lease_entries, expires)
        else:  # new grants run a full lease from now; the lease (and any quarantine) must too
            lease.expires = max(lease.expires, expires)
        return results, lease_key

    def begin_allocate(self, items: list[tuple[str, int]], tenant: str = "") -> Allocation:
        results, lease = self.allocate(items, tenant=tenant)
        return Allocation(items, results, lease, tenant)

    def retry_allocate(self, op: Allocation) -> None:
        """Try the NO_SPACE items again (room was freed). A key is counted once, by its
        final result."""
        missing = op.missing
        self.counters.no_space -= len(missing)
        self.tenant(op.tenant).alloc_no_space -= len(missing)
        retry, lease = self.allocate([op.items[i] for i in missing], op.lease, op.tenant)
        op.lease = lease or op.lease  # a lease that expired while waiting was replaced
        for i, res in zip(missing, retry, strict=True):
            op.results[i] = res

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
            self._lru_add(entry)
            self.counters.commits += 1
            self.tenant(entry.tenant).commits += 1
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

    # -- admin --------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        entry = self.get(key)
        if entry is None:
            return False
        self._drop(entry)
        self.counters.deletes += 1
        return True

    # -- nodes --------------------------------------------------------------------------

    def register(
        self,
        node_id: str,
        incarnation: int,
        address: str,
        capacity: int,
        shm_path: str,
        host_id: str,
        transports: list[str],
        disk_capacity: int = 0,
        base: int = 0,
    ) -> tuple[Node, bool]:
        """Returns (node, is_new). Re-registering the same live incarnation only refreshes
        it. A new node's persisted entries start coming back (see manager/snapshot.py).
        Raises NodeIdInUse for another registration of a node that is heartbeating: a
        restarted node gets its id back once the old one has missed its heartbeats for
        half the TTL (it beats three times per TTL), a stranger never drops its entries."""
        now = self.clock()
        old = self.nodes.get(node_id)
        if (
            old is not None
            and old.alive
            and old.incarnation == incarnation
            and old.capacity == capacity
            and old.disk_capacity == disk_capacity
            and old.base == base
        ):
            old.address, old.shm_path, old.host_id, old.transports = (
                address,
                shm_path,
                host_id,
                transports,
            )
            old.last_heartbeat, old.last_heartbeat_wall = now, self.wall()
            return old, False
        if old is not None and old.alive and now - old.last_heartbeat < self.heartbeat_ttl / 2:
            raise NodeIdInUse(node_id)
        if old is not None:
            self._kill(old)
        node = Node(
            node_id,
            incarnation,
            address,
            capacity,
            shm_path,
            host_id,
            transports,
            now,
            self.wall(),
            disk_capacity,
            base,
        )
        self.nodes[node_id] = node
        self.dirty_nodes.add(node_id)
        self._begin_restore(node)
        return node, True

    def heartbeat(
        self, node_id: str, incarnation: int, reported: dict[str, int] | None = None
    ) -> bool:
        """False tells the slab to register again (unknown, dead, or another incarnation)."""
        node = self.node(node_id, incarnation)
        if node is None:
            return False
        node.last_heartbeat, node.last_heartbeat_wall = self.clock(), self.wall()
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
        node.clean.clear()
        node.disk_lru.clear()
        node.orders.clear()
        node.reloads.clear()
        node.offloads.clear()
        node.ready_bytes = node.disk_used = node.offloading_bytes = node.offloading_files = 0
        node.lru_extent = node.clean_extent = 0

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
            self._release_quarantine(node, now)
            if node.alive:
                self._expire_orders(node, now)
        self.counters.expired_reads += events.expired_reads
        self.counters.expired_writes += events.expired_writes
        return events


__all__ = [
    "AllocResult",
    "AllocStatus",
    "Allocation",
    "Entry",
    "Lookup",
    "Metadata",
    "Node",
    "Residency",
    "State",
]
