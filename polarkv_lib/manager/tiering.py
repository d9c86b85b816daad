"""Placement, room-making and tiering: where new bytes go, what leaves memory to make
room, and the offload / reload / delete orders for each node's disk role.

Tiering (nodes with a disk role): memory use is capped at the high watermark. When the
next allocation would not fit under it, the LRU unleased entries of that node are
offloaded to its own disk until use drops to the low watermark; an entry that still has
a valid file just drops its memory copy. A lookup that reaches a disk-only entry
allocates memory on the same node and queues a reload; the shell waits for it. Above
the disk high watermark the oldest files go. Nodes without a disk role evict instead.
Tiering never moves an entry to another node.

Every plan walks an LRU from its head and stops at its target: it costs what it frees
plus the leased or in-flight entries it steps over, never the size of the table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from polarkv_lib.keys import split_ident
from polarkv_lib.manager.allocator import size_class
from polarkv_lib.manager.model import (
    DISK_HYSTERESIS,
    ORDER_TIMEOUT,
    Claim,
    Entry,
    Node,
    Residency,
    State,
)
from polarkv_lib.manager.tables import Tables
from polarkv_lib.wire.orders import Order, TierOp, file_bytes_bound


class Tiering(Tables):
    # -- placement ----------------------------------------------------------------------

    def _place(self, size: int, claim: Claim) -> tuple[Node, int, int] | None:
        """Pick a node for new bytes at random, weighted by free memory: load spreads in
        proportion to room, so a freshly (re)started empty node takes more of the new
        writes but not all of them (it would become every reader's hot spot). If none
        has a free extent, make room on the emptiest one that can (drop clean memory
        copies; evict on nodes without a disk)."""
        nodes = [n for n in self.nodes.values() if n.alive and not n.restoring]
        if len(nodes) > 1:  # once per item placed: no sort for the common single node
            nodes.sort(key=lambda n: n.allocator.free, reverse=True)
        need = size_class(size)
        fits = [n for n in nodes if n.allocator.used + need <= self._memory_limit(n)]
        while fits:
            node = self.rng.choices(fits, weights=[n.allocator.free for n in fits])[0]
            got = self._alloc_on(node, size, claim, make_room=False)
            if got is not None:
                node.last_alloc = got[1]
                return node, *got
            fits.remove(node)  # fragmented: no extent large enough after all
        for node in nodes:
            got = self._alloc_on(node, size, claim, make_room=True)
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

    def _alloc_on(
        self, node: Node, size: int, claim: Claim, make_room: bool = True
    ) -> tuple[int, int] | None:
        need = size_class(size)
        limit = self._memory_limit(node)
        if node.allocator.used + need <= limit:
            got = node.allocator.alloc(size)
            if got is not None:
                return got
        if not make_room:
            return None
        return self._make_room(node, size, need, limit, claim)

    def _movable(self, node: Node, claim: Claim) -> Iterable[Entry]:
        """Memory copies that may go now for `claim`, least recently used first: clean
        copies on a node with a disk (their file stays: nothing is lost), any copy on a
        node without one — but never another tenant's while that tenant holds no more
        than its fair share. The order holds no read or in-flight entry, so only kept
        entries and such fair shares are stepped over."""
        if node.has_disk:
            yield from (e for e in node.clean.values() if e.key not in claim.keep)
            return
        for entry in node.lru.values():
            if entry.key in claim.keep:
                continue
            if entry.tenant == claim.tenant or self._over_share(entry.tenant):
                yield entry

    def _make_room(
        self, node: Node, size: int, need: int, limit: int, claim: Claim
    ) -> tuple[int, int] | None:
        """Free memory on `node` until `size` fits: memory copies that also have a file
        (free to drop), or, on nodes without a disk, the LRU entries themselves. Gives up
        without touching anything if even that could not make it fit."""
        freeable = node.clean_extent if node.has_disk else node.lru_extent
        if node.allocator.used - freeable + need > limit:
            return None  # even everything movable would not do: no walk at all
        victims: list[Entry] = []
        freed = 0
        for entry in self._movable(node, claim):
            victims.append(entry)
            freed += entry.alloc_size
            if node.allocator.used - freed + need <= limit:
                break
        else:
            return None  # leased or protected entries hold the rest
        while True:
            for victim in victims:
                self._let_go(node, victim)
            if node.allocator.used + need <= limit:
                got = node.allocator.alloc(size)
                if got is not None:
                    return got
            # fragmented: free one more at a time until an extent is large enough
            victims = list(self._take(self._movable(node, claim), 1))
            if not victims:
                return None

    @staticmethod
    def _take(entries: Iterable[Entry], n: int) -> list[Entry]:
        out = []
        for entry in entries:
            out.append(entry)
            if len(out) == n:
                break
        return out

    def _within_quota(self, claim: Claim, size: int) -> bool:
        """Room under the tenant's quota for `size` more bytes: what it holds in memory
        plus what it is writing. Its own least recently used entries leave memory (clean
        copies are dropped, the rest evicted) until it fits; False if its leased, kept or
        in-flight entries hold the rest (then nothing left)."""
        quota = self.quotas.get(claim.tenant)
        if quota is None:
            return True
        mine = self.tenant(claim.tenant)
        if size > quota:
            return False
        lru = self.tenant_lru.setdefault(claim.tenant, OrderedDict())
        # One walk from the least recently used end; nothing leaves unless enough can
        # (as in _make_room): a refusal must not have evicted entries for nothing.
        excess = mine.bytes_memory + mine.bytes_writing + size - quota
        victims: list[Entry] = []
        for entry in lru.values():
            if excess <= 0:
                break
            if entry.key not in claim.keep:
                victims.append(entry)
                excess -= entry.size  # what leaving memory takes off bytes_memory
        if excess > 0:
            return False
        for victim in victims:
            self._let_go(victim.node, victim)
        return True

    def _fair_share(self, tenant: str) -> int:
        """Memory a tenant may keep against other tenants' writes and reloads: an equal
        share of the alive nodes' memory among the configured tenants, or its quota if
        that is less. Unbounded with a single tenant (no tenants configured)."""
        names = self.tenants.names()
        if len(names) < 2:
            return 1 << 62
        total = sum(n.allocator.capacity for n in self.nodes.values() if n.alive)
        share = total // len(names)
        quota = self.quotas.get(tenant)
        return min(share, quota) if quota is not None else share

    def _over_share(self, tenant: str) -> bool:
        """Whether a tenant holds (in memory and being written) more than its fair share:
        only then may another tenant's request evict its entries."""
        held = self.tenant(tenant)
        return held.bytes_memory + held.bytes_writing > self._fair_share(tenant)

    def _let_go(self, node: Node, victim: Entry) -> None:
        if victim.on_disk:
            self._release_memory_copy(victim)
        else:
            self._drop(victim)
            self.counters.evictions += 1

    # -- reloads ------------------------------------------------------------------------

    def _start_reload(self, entry: Entry, claim: Claim) -> bool:
        node = entry.node
        if not node.alive or not node.has_disk or node.restoring:
            return False
        got = self._alloc_on(node, entry.size, claim)
        if got is None:
            node.pressure += size_class(entry.size)
            return False
        entry.offset, entry.alloc_size = got
        # A fresh generation: the reload claims the extent on the slab for this entry, so
        # grants of its previous occupants can no longer touch it.
        entry.gen = self._next_gen()
        entry.residency = Residency.RELOADING
        node.reloads[entry.gen] = entry
        entry.order_deadline = self.clock() + ORDER_TIMEOUT
        node.orders.append(self._order(TierOp.RELOAD, entry))
        return True

    def _note_reload_pressure(self, node: Node, following: list[str]) -> None:
        """The rest of a prompt on this node's disk will want memory too: ask the next
        offload plan for all of it at once rather than one chunk per round."""
        for key in following:
            entry = self.get(key)
            if entry is None or entry.node is not node or entry.in_memory or entry.reloading:
                break
            node.pressure += size_class(entry.size)

    # -- planning -----------------------------------------------------------------------

    def plan_tiering(self) -> list[str]:
        """Queue offloads and disk deletions where watermarks say so. Returns the ids
        of nodes that got new orders."""
        return [n.node_id for n in self.nodes.values() if self._plan_node(n)]

    def _plan_node(self, node: Node) -> bool:
        """Plan one node's tiering; True if it got new orders."""
        if not node.alive or not node.has_disk or node.restoring:
            return False
        before = len(node.orders)
        self._plan_disk(node)
        self._plan_offload(node)
        return len(node.orders) > before

    def nodes_with_orders(self) -> list[str]:
        return [n.node_id for n in self.nodes.values() if n.orders]

    # -- streams: windows and room ------------------------------------------------------

    def _room_coming(self, node: Node) -> bool:
        """Whether memory on `node` is being freed or will be without anyone's help:
        offloads queued or running (planned now if the watermarks say so), or extents
        that are held for now (read, being written, reloaded or offloaded, quarantined)
        and come back when their reader, writer or transfer lets go. Nodes without a
        disk make room by evicting, at once; waiting on them would only add latency."""
        if not node.alive or not node.has_disk:
            return False
        self._plan_node(node)
        return bool(node.offloading_bytes or node.orders or node.allocator.used > node.lru_extent)

    def _room_coming_anywhere(self) -> bool:
        return any(self._room_coming(n) for n in self.nodes.values())

    def _read_window(self, node: Node, lease: str | None, size: int) -> int:
        """Bytes one stream may reload on `node` per window: an equal share of what the
        node may hold among the streams using it (read leases holding its reloads, and
        lookups waiting there for room), two windows each (the one being read and the
        next one being reloaded), at most `stream_window`, at least one entry."""
        streams = len(node.loaders) + node.room_waiters + (lease not in node.loaders)
        share = self._memory_limit(node) // (2 * streams)
        return max(size_class(size), min(self.stream_window, share))

    def _write_window(self, size: int, lease: str | None) -> int:
        """Bytes one write request may allocate while memory streams to disk: an equal
        share of the disk nodes' memory among the open writes, two windows each (one
        being written, one being offloaded), at most `stream_window`, at least one item.
        Without disk nodes, unbounded: memory-only stores fit or evict, and never wait."""
        limit = sum(self._memory_limit(n) for n in self.nodes.values() if n.alive and n.has_disk)
        if not limit:
            return 1 << 62
        share = limit // (2 * (len(self.write_leases) + (lease not in self.write_leases)))
        return max(size_class(size), min(self.stream_window, share))

    def _plan_offload(self, node: Node) -> None:
        limit = self._memory_limit(node)
        if node.allocator.used + max(node.pressure, node.last_alloc) <= limit:
            return
        target = max(0, min(int(node.allocator.capacity * self.memory_low), limit - node.pressure))
        node.pressure = 0
        projected = node.allocator.used - node.offloading_bytes
        if projected <= target:
            return  # the offloads in flight will do
        clean: list[Entry] = []
        dirty: list[Entry] = []
        for entry in node.lru.values():  # in place, from the head, to the target
            if projected <= target:
                break
            (clean if entry.residency is Residency.BOTH else dirty).append(entry)
            projected -= entry.alloc_size
        for entry in clean:
            self._release_memory_copy(entry)
        for entry in dirty:
            if not self._disk_room(node, entry.size):
                break
            self._start_offload(node, entry)

    def _start_offload(self, node: Node, entry: Entry) -> None:
        self._order_out(entry)  # in flight: back in the order when it reports
        entry.residency = Residency.OFFLOADING
        entry.order_deadline = self.clock() + ORDER_TIMEOUT
        node.offloads[entry.gen] = entry
        node.offloading_bytes += entry.alloc_size
        node.offloading_files += file_bytes_bound(entry.size)
        node.orders.append(self._order(TierOp.OFFLOAD, entry))

    def _disk_room(self, node: Node, size: int) -> bool:
        """Make room on the disk for one more file by deleting the oldest ones."""
        budget = node.disk_capacity * self.disk_high
        need = node.offloading_files + file_bytes_bound(size)
        if node.disk_used + need <= budget:
            return True  # the common case: no need to look at the LRU at all
        self._evict_files(node, budget - need)
        return node.disk_used + need <= budget

    def _plan_disk(self, node: Node) -> None:
        if node.disk_used > node.disk_capacity * self.disk_high:
            self._evict_files(node, node.disk_capacity * max(self.disk_high - DISK_HYSTERESIS, 0.0))

    def _evict_files(self, node: Node, target: float) -> None:
        """Delete the oldest unleased files until the disk use is at most `target`."""
        victims = []
        projected = node.disk_used
        for entry in node.disk_lru.values():
            if projected <= target:
                break
            # A file being read into memory stays; a read entry's file may go (its reader
            # has the memory copy), so only reloads in flight are stepped over.
            if not entry.reloading:
                victims.append(entry)
                projected -= entry.file_bytes
        for victim in victims:
            self.counters.disk_evictions += 1
            if victim.in_memory:
                self._forget_file(victim, delete=True)
            else:
                self._drop(victim)

    # -- order results ------------------------------------------------------------------

    def _tier_failure(self, op: str, reason: str) -> None:
        name = f"{op}_{reason}"
        self.counters.tier_failures[name] = self.counters.tier_failures.get(name, 0) + 1

    def offload_done(
        self, node_id: str, key: str, gen: int, ok: bool, reason: str = "", file_bytes: int = 0
    ) -> None:
        node = self.nodes.get(node_id)
        if node is None or not node.alive:
            return
        entry = node.offloads.get(gen)
        if entry is None or entry.key != key:
            current = self.get(key)
            keeps_file = (
                current is not None
                and current.node is node
                and (current.on_disk or current.offloading)
            )
            if ok and not keeps_file:  # deleted meanwhile: the file goes too
                node.orders.append(Order(TierOp.DELETE, key, gen, node.node_id))
            return
        self._end_offload(entry)
        if not ok:
            self._tier_failure("offload", reason)
            if reason == "disk_full" and entry.readers == 0:
                self._drop(entry)  # the disk cannot take it: degrade to eviction
                self.counters.evictions += 1
            else:  # it was next to go: back at the cold end of the order
                self._order_in(entry, recent=False)
            return
        entry.residency = Residency.BOTH
        self._file_added(entry, file_bytes)
        self.counters.offloads += 1
        self.counters.offload_bytes += entry.size
        if entry.readers == 0:
            self._release_memory_copy(entry)
        # else its reader holds it; it joins the order, as a clean copy, when let go

    def reload_done(self, node_id: str, key: str, gen: int, ok: bool, reason: str = "") -> None:
        node = self.nodes.get(node_id)
        if node is None or not node.alive:
            return
        entry = node.reloads.pop(gen, None)
        if entry is None or entry.key != key:
            return
        if entry.dropped:
            entry.residency = Residency.NONE
            self._maybe_free(entry)
            return
        if not ok:
            self._tier_failure("reload", reason)
            entry.residency = Residency.DISK
            if reason == "timeout":
                # The disk role never answered: its read may still land in this extent,
                # so the extent waits out another order timeout; the file is kept. An
                # order it never even took is withdrawn (the next reload has a new gen).
                node.orders = [o for o in node.orders if o.gen != gen]
                self._quarantine(node, self.clock() + ORDER_TIMEOUT, entry.offset, entry.alloc_size)
                entry.alloc_size = 0
                return
            if reason == "checksum":
                self.counters.checksum_failures += 1
            self._drop(entry)  # the disk role already deleted a broken file
            return
        entry.residency = Residency.BOTH
        self.dirty_keys.add(key)
        self._memory_ready(entry)
        self.counters.reloads += 1
        self.counters.reload_bytes += entry.size

    def _expire_orders(self, node: Node, now: float) -> None:
        """Give up orders past their deadline."""
        for entry in [e for e in node.offloads.values() if e.order_deadline <= now]:
            self.offload_done(node.node_id, entry.key, entry.gen, False, "timeout")
        for entry in [e for e in node.reloads.values() if e.order_deadline <= now]:
            self.reload_done(node.node_id, entry.key, entry.gen, False, "timeout")

    def pending_reloads(self) -> set[int]:
        """Gens of the reloads still running (a waiting lookup for any other is done)."""
        return {gen for node in self.nodes.values() for gen in node.reloads}

    def adopt(
        self, node_id: str, incarnation: int, files: list[tuple[str, int, str, int]]
    ) -> list[str] | None:
        """A slab with a disk reports the files it holds (the identity of its entry, size,
        checksum, file bytes): the file of a tenant's entry is that tenant's again.
        Unknown keys become disk-only entries again; files the manager has better
        copies of are to be deleted (returned). None: unknown node."""
        node = self.nodes.get(node_id)
        if node is None or not node.alive or node.incarnation != incarnation or not node.has_disk:
            return None
        delete = []
        wall = self.wall()
        for key, size, checksum, file_bytes in files:
            self.dirty_keys.add(key)
            entry = self.get(key)
            if entry is not None:
                if (
                    entry.node is node
                    and entry.state is State.READY
                    and entry.residency is Residency.MEMORY
                    and entry.checksum == checksum
                ):
                    entry.residency = Residency.BOTH
                    self._file_added(entry, file_bytes)
                    self._clean_add(entry)
                elif not (entry.node is node and entry.on_disk):
                    delete.append(key)
                continue
            entry = Entry(
                key,
                size,
                node,
                0,
                0,
                State.READY,
                wall,
                wall,
                gen=self._next_gen(),
                checksum=checksum,
                residency=Residency.DISK,
                tenant=split_ident(key)[0],
            )
            self.entries[key] = entry
            node.entries.add(key)
            self._file_added(entry, file_bytes)
        return delete

    def take_orders(self, node_id: str) -> list[Order]:
        node = self.nodes.get(node_id)
        if node is None:
            return []
        orders, node.orders = node.orders, []
        # deletions first: they make room for the offloads behind them
        return sorted(orders, key=lambda o: o.op is not TierOp.DELETE)
