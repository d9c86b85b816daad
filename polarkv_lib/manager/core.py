"""The manager's metadata core: the requests (lookup, allocate, commit, abort, release,
renew, delete), node membership and time.

Synchronous: no method awaits or does I/O. The core decides, the shell dispatches: a
request is opened (`open_lookup`, `open_allocate`) and advanced step by step; each step
returns one decision (`Step`: done, or wait for these reloads, or wait for room, each
until the request's deadline) that the aiohttp shell (manager/app.py) only awaits before
it asks for the next. The core counts every outcome once, when it is final, so no
counter ever goes down. That keeps every state transition testable alone, with a fake
clock and no event loop.

Lookups return the longest READY prefix and may take a read lease on it; nothing under
a read lease is evicted, offloaded away or reused. Writes: first writer wins.
"""

from __future__ import annotations

from functools import cached_property

from polarkv_lib.manager.allocator import size_class
from polarkv_lib.manager.model import (
    DONE,
    Allocation,
    AllocResult,
    AllocStatus,
    Claim,
    Entry,
    Expired,
    Lookup,
    Node,
    NodeIdInUse,
    Residency,
    State,
    Step,
    Wait,
    WriteLease,
    new_id,
)
from polarkv_lib.manager.reads import Reads
from polarkv_lib.manager.snapshot import Snapshots
from polarkv_lib.manager.views import Views


class Metadata(Reads):
    """The core: the requests over the tables (tables.py), with tiering (tiering.py),
    draining (drain.py) and the reads (reads.py) as the layers below the writes, the
    nodes and time here. Its read-only
    views and its persistence are objects that hold the tables (docs/ARCHITECTURE.md)."""

    @cached_property
    def views(self) -> Views:
        return Views(self)

    @cached_property
    def snapshots(self) -> Snapshots:
        return Snapshots(self)

    # -- writes -------------------------------------------------------------------------
    #
    # First writer wins: a key that exists or is being written is not allocated again.
    # Items are placed in order, a prefix: after the first one refused for room, the
    # rest are refused too. With disk nodes, one request gets at most a window of memory
    # (a share among the open writes, tiering.py `_write_window`), the items past it are
    # LATER, and a request that got nothing may wait for room that offloads are making.
    # A store of several windows continues its write lease (`continue`; `more` keeps it
    # open between windows): what it stored in earlier windows is never evicted to make
    # room for its later ones, so a prompt larger than memory keeps its head.

    def open_allocate(
        self,
        items: list[tuple[str, int]],
        tenant: str = "",
        wait: float = 0.0,
        resume: str | None = None,
        more: bool = False,
    ) -> Allocation:
        """One allocate request; `advance_allocate` takes it step by step. `resume`
        names the store's write lease from its earlier windows; `more`: windows follow."""
        op = Allocation(items, tenant, self.clock() + wait, [None] * len(items), more=more)
        lease = self.write_leases.get(resume or "")
        if lease is not None and lease.tenant == tenant:
            op.lease = resume
        # A writer re-storing a prefix is using it: its existing chunks become recent
        # (head last) and are not eviction victims for the rest of this store.
        kept = lease.kept if op.lease and lease is not None else op.kept
        ready = [k for k, _ in items if (e := self.get(k)) is not None and e.state is State.READY]
        for key in reversed(ready):
            self._touch(self.entries[key])
        kept.update(dict.fromkeys(ready))  # in prompt order
        op.kept = kept
        return op

    def advance_allocate(self, op: Allocation) -> Step:
        """The next step of an allocate request: wait for room, or DONE (`op.results`)."""
        if op.done:
            return DONE
        placed = self._allocate_pass(op)
        refused = any(r is not None and r.status is AllocStatus.NO_SPACE for r in op.results)
        if placed or not refused:
            return self._finish_allocate(op)
        if self.clock() < op.deadline and self._room_coming_anywhere():
            return Step(Wait.ROOM, until=op.deadline)
        return self._finish_allocate(op)

    def close_allocate(self, op: Allocation) -> None:
        """The shell is done with the request (answered, or abandoned midway)."""
        if not op.done:
            self._finish_allocate(op)

    def _allocate_pass(self, op: Allocation) -> int:
        """Place the items still open, in order; how many got memory."""
        lease = self.write_leases.get(op.lease or "")
        window = self._write_window(max(size for _, size in op.items), op.lease)
        taken = sum(e.size for e in lease.entries.values()) if lease is not None else 0
        placed = 0
        refused = 0  # smallest size class this pass found no room for
        end: AllocStatus | None = None  # the rest of the prefix: refused, or later
        claim = Claim(op.tenant, op.kept)
        mine = self.tenant(op.tenant)
        now = self.wall()  # one clock read and one lease refresh per pass, not per item
        writing: WriteLease | None = None
        for i in op.open:
            key, size = op.items[i]
            entry = self.get(key)
            if entry is not None:
                status = (
                    AllocStatus.EXISTS if entry.state is State.READY else AllocStatus.IN_PROGRESS
                )
                op.results[i] = AllocResult(key, status, entry)
                if status is AllocStatus.EXISTS:
                    op.kept[key] = None
                continue
            need = size_class(size)
            if end is None and not self._within_quota(claim, size):
                end = AllocStatus.NO_SPACE
            elif end is None and taken and taken + need > window:
                end = AllocStatus.LATER
            if end is not None:
                if end is AllocStatus.NO_SPACE:
                    self._add_pressure(need)
                op.results[i] = AllocResult(key, end)
                continue
            # A failed placement changed nothing, so anything as large fails too: skip
            # the search, but still ask the offload planner for the room.
            got = None if refused and need >= refused else self._place(size, claim)
            if got is None:
                if refused and need >= refused:
                    self._add_pressure(need)
                refused = refused or need
                end = AllocStatus.NO_SPACE
                op.results[i] = AllocResult(key, end)
                continue
            node, offset, alloc_size = got
            entry = Entry(
                key,
                size,
                node,
                offset,
                alloc_size,
                State.WRITING,
                now,
                now,
                gen=self._next_gen(),
                tenant=op.tenant,
            )
            if writing is None:
                writing = self._write_lease(op)
            entry.write_lease = op.lease
            self.entries[key] = entry
            node.entries.add(key)
            writing.entries[key] = entry
            taken += need
            mine.bytes_writing += size  # its quota and fair share count what it writes
            placed += 1
            op.results[i] = AllocResult(key, AllocStatus.ALLOCATED, entry)
        return placed

    def _write_lease(self, op: Allocation) -> WriteLease:
        """The request's write lease (made on its first allocation): new grants run a
        full lease from now, so the lease (and any quarantine) must too."""
        lease = self.write_leases.get(op.lease or "")
        if lease is None:
            op.lease = new_id()
            lease = self.write_leases[op.lease] = WriteLease(op.tenant, 0.0, kept=op.kept)
        lease.expires = max(lease.expires, self.clock() + self.write_lease_ttl)
        return lease

    def _finish_allocate(self, op: Allocation) -> Step:
        """The answer is final: count each item once, by its result."""
        op.done = True
        c = self.counters
        mine = self.tenant(op.tenant)
        for i, res in enumerate(op.results):
            if res is None:  # never reached (a refused prefix ended before it)
                op.results[i] = res = AllocResult(op.items[i][0], AllocStatus.NO_SPACE)
            if res.status is AllocStatus.ALLOCATED:
                c.allocations += 1
                mine.allocations += 1
            elif res.status is AllocStatus.EXISTS:
                c.exists += 1
            elif res.status is AllocStatus.IN_PROGRESS:
                c.in_progress += 1
            elif res.status is AllocStatus.NO_SPACE:
                c.no_space += 1
                mine.alloc_no_space += 1
        if op.more and op.lease is None and op.kept:
            # more windows follow: they need the lease that keeps this one's chunks
            self._write_lease(op)
        lease = self.write_leases.get(op.lease or "")
        if lease is not None:
            lease.keep = lease.keep or op.more
            if not lease.entries and not lease.keep:
                self._end_write_lease(op.lease or "")
                op.lease = None
        return DONE

    def commit(
        self,
        lease_id: str,
        items: list[tuple[str, str]],
        more: bool = False,
        tenant: str | None = None,
    ) -> dict[str, str]:
        """Make written entries visible. Returns key -> 'committed' or why not. `more`:
        the store goes on in another window, under the same lease. Another tenant's
        lease is as good as none."""
        lease = self.write_leases.get(lease_id) if self._owns(lease_id, tenant) else None
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
            mine = self.tenant(entry.tenant)
            mine.bytes_writing -= entry.size
            self._memory_ready(entry)
            self.counters.commits += 1
            mine.commits += 1
            self.dirty_keys.add(key)
            out[key] = "committed"
        if lease is None:
            return out
        earlier = len(lease.kept)
        lease.kept.update(dict.fromkeys(k for k, _ in items if out.get(k) == "committed"))
        if earlier:
            # A store of several windows commits its head first: touched again, back to
            # front, the prompt's head stays its most recent chunk (what eviction takes
            # last), however many windows came after it.
            for key in reversed(lease.kept):
                kept = self.entries.get(key)
                if kept is not None and kept.state is State.READY:
                    self._touch(kept)
        lease.keep = more
        if not lease.entries and not more:
            del self.write_leases[lease_id]
        return out

    def abort(self, lease_id: str, keys: list[str] | None, tenant: str | None = None) -> int:
        lease = self.write_leases.get(lease_id) if self._owns(lease_id, tenant) else None
        if lease is None:
            return 0
        victims = list(lease.entries) if keys is None else [k for k in keys if k in lease.entries]
        for key in victims:
            entry = lease.entries[key]
            if not entry.dropped:
                self._drop(entry)
                self.counters.aborts += 1
            del lease.entries[key]
        if not lease.entries and (keys is None or not lease.keep):
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
        self.snapshots.begin(node)
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
        node.lru_extent = node.clean_extent = node.keys_memory = 0
        node.loaders.clear()

    # -- time ---------------------------------------------------------------------------

    def expire(self) -> Expired:
        """Expire leases, silent nodes, quarantined space and unanswered orders."""
        now = self.clock()
        events = Expired()
        stalled = now - self._last_expire
        self._last_expire = now
        if stalled > self.heartbeat_ttl / 2:
            # The manager itself was not running (paused VM, SIGSTOP, long GC): the
            # silence was ours, not the nodes'. Give them the stalled time back.
            for node in self.nodes.values():
                node.last_heartbeat += stalled
        for lease_id in [i for i, r in self.read_leases.items() if r.expires <= now]:
            self._end_read_lease(lease_id)
            events.expired_reads += 1
        for lease_id in [i for i, w in self.write_leases.items() if w.expires <= now]:
            if self.write_leases[lease_id].entries:
                events.expired_writes += 1  # a kept lease with nothing open just ends
            self._end_write_lease(lease_id)
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
