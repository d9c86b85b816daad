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

from collections.abc import Iterable
from functools import cached_property

from polarkv_lib.manager.allocator import size_class
from polarkv_lib.manager.drain import Draining
from polarkv_lib.manager.model import (
    DONE,
    Allocation,
    AllocResult,
    AllocStatus,
    Claim,
    Entry,
    Events,
    Lookup,
    Node,
    NodeIdInUse,
    ReadLease,
    Released,
    Residency,
    State,
    Step,
    Stop,
    Wait,
    WriteLease,
    new_id,
)
from polarkv_lib.manager.snapshot import Snapshots
from polarkv_lib.manager.views import Views


class Metadata(Draining):
    """The core: the requests over the tables (tables.py), with tiering (tiering.py) and
    draining (drain.py) as the layers that extend the same transitions. Its read-only
    views and its persistence are objects that hold the tables (docs/ARCHITECTURE.md)."""

    @cached_property
    def views(self) -> Views:
        return Views(self)

    @cached_property
    def snapshots(self) -> Snapshots:
        return Snapshots(self)

    # -- reads --------------------------------------------------------------------------
    #
    # A lookup answers at once with the prefix that is in memory. Where the prefix
    # reaches entries on disk it becomes a stream: an answer that has nothing in memory
    # reloads one window (and waits for it); every answer starts reloading the window
    # after it before it goes out (`ahead`, pinned under the same lease), and says
    # `more`. The reader reads, then asks for the rest naming its lease (`continue`):
    # that lets go of what it has read and serves the window reloaded meanwhile. So the
    # disk and the network work at once, each stream holds at most two windows of a
    # node's memory (a fair share of it, tiering.py `_read_window`), and no lookup ever
    # waits for room while it holds anything: only an answer with nothing to serve waits.
    #
    # While a request runs, what it has taken is pinned by the request itself; only its
    # answer hands those pins to the lease. So a release or a second `continue` of the
    # lease meanwhile cannot let go of them under it: the request finds its lease gone
    # and answers nothing (and lets go of its own), and an abandoned request lets go too.

    def open_lookup(
        self,
        keys: list[str],
        take_lease: bool,
        tenant: str = "",
        wait: float = 0.0,
        resume: str | None = None,
    ) -> Lookup:
        """One lookup request; `advance_lookup` takes it step by step. `resume` names the
        read lease of the same stream: what it served was read and is let go now. A lease
        another request of the stream is still working on is not continued."""
        op = Lookup(keys, take_lease, tenant, self.clock() + wait)
        lease = self.read_leases.get(resume or "") if take_lease else None
        if lease is not None and lease.tenant == tenant and not lease.busy:
            op.lease, op.lease_ref = resume, lease
            lease.busy = True
            served, lease.served = lease.served, []
            for entry in reversed(served):  # head last: the most recently used
                self._unref(entry)
        return op

    def advance_lookup(self, op: Lookup) -> Step:
        """The next step of a lookup: what to wait for, or DONE (then `op.served` is the
        answer and `op.more` says whether the stream goes on)."""
        if op.done:
            return DONE
        self._stop_waiting(op)
        if self._lease_lost(op):
            self._let_go_all(op)  # released or expired under it: nobody reads the answer
            return self._finish_lookup(op, more=False)
        if op.pending:
            reloading = self._reloading(op)
            if reloading and self.clock() < op.deadline:
                return Step(Wait.RELOADS, reloading, op.deadline)
            stop = op.stop
            if not self._settle(op):
                stop = Stop.MISS  # a reload failed, or ran past the request's wait
            return self._after_pass(op, stop)
        stop = self._lookup_pass(op)
        if stop is Stop.WINDOW:
            self._read_ahead(op)  # the disk reloads the next window meanwhile
        reloading = self._reloading(op) if op.take_lease else ()
        if reloading:
            op.stop = stop
            return Step(Wait.RELOADS, reloading, op.deadline)
        return self._after_pass(op, stop)

    def close_lookup(self, op: Lookup) -> None:
        """The shell is done with the request: answered, or abandoned midway (the client
        went away), when it lets go of all it holds and counts as a miss."""
        self._stop_waiting(op)
        if not op.done:
            self._let_go_all(op)
            self._finish_lookup(op, more=False)

    @staticmethod
    def _reloading(op: Lookup) -> tuple[int, ...]:
        """The reloads this pass waits for (of entries still in the table)."""
        return tuple(e.gen for e in op.pending if e.reloading and not e.dropped)

    def _lease_lost(self, op: Lookup) -> bool:
        return op.lease_ref is not None and self.read_leases.get(op.lease or "") is not op.lease_ref

    def _let_go_all(self, op: Lookup) -> None:
        """Let go of what the request holds (nothing of it is answered)."""
        if op.take_lease:
            for entry in reversed(op.served + op.pending):
                self._unref(entry)
        op.served, op.pending = [], []

    def _lookup_pass(self, op: Lookup) -> Stop:
        """Walk the keys after the served prefix: take what is in memory (or arrives
        from the stream's window ahead); where the prefix reaches the disk, reload one
        window if nothing was taken yet, else stop there. Taken entries are pinned by
        the request and left in `op.pending`."""
        lease = op.lease_ref
        keys = op.keys[len(op.served) :]
        taken: list[Entry] = []
        window: dict[str, int] = {}  # node id -> bytes reloaded in this window
        reloads = 0
        cap = 1  # most reloads in this window (set at its first)
        stop = Stop.END
        for i, key in enumerate(keys):
            entry = self.get(key)
            if entry is None or entry.state is not State.READY:
                stop = Stop.MISS
                break
            if not op.take_lease:  # a probe: there, in memory or on disk; nothing moves
                taken.append(entry)
                continue
            if lease is not None and (ahead := lease.ahead.pop(key, None)) is not None:
                # read ahead for this stream: its pin passes to the request, unless its
                # reload failed (or the key has a newer entry): then it is let go
                if ahead is entry and (entry.in_memory or entry.reloading):
                    taken.append(entry)
                    if entry.gen in lease.from_disk:
                        op.from_disk.add(entry.gen)
                    continue
                self._unref(ahead)
            if entry.in_memory or entry.reloading:
                if entry.reloading:
                    op.from_disk.add(entry.gen)  # another request's reload, shared
                taken.append(entry)
                self._pin(entry)
                continue
            # On disk only: where the stream's windows begin.
            if taken and not reloads:
                stop = Stop.WINDOW  # answer with what is in memory; read the rest ahead
                break
            node = entry.node
            if not reloads:  # half the keys from here at most: the rest is read ahead
                cap = max(1, (len(keys) - i + 1) // 2)
            used = window.get(node.node_id, 0)
            need = size_class(entry.size)
            full = used and used + need > self._read_window(node, op.lease, entry.size)
            if reloads >= cap or full:
                stop = Stop.WINDOW
                break
            if node.room_waiters and not op.waited:  # others wait for room here: in line
                stop, op.stop_node = Stop.ROOM, node
                break
            if not self._start_reload(entry, Claim(op.tenant)):
                self._note_reload_pressure(node, keys[i + 1 :])
                stop = Stop.ROOM if self._reloadable(entry) else Stop.MISS
                op.stop_node = node
                break
            window[node.node_id] = used + need
            reloads += 1
            op.from_disk.add(entry.gen)
            taken.append(entry)
            self._pin(entry)
        if op.take_lease and taken:
            lease = self._read_lease(op)
            for entry in taken:
                if entry.gen in op.from_disk:
                    self._loading(lease, op.lease, entry.node)
        op.pending = taken
        return stop

    def _after_pass(self, op: Lookup, stop: Stop) -> Step:
        """This pass's hits are served; decide whether the request answers or waits."""
        op.served += op.pending
        op.pending = []
        if not op.take_lease or stop in (Stop.END, Stop.MISS):
            return self._finish_lookup(op, more=False)
        if stop is Stop.WINDOW or op.served:
            return self._finish_lookup(op, more=True)
        # Nothing to serve: the next entry is on disk and its node has no memory for it
        # now. Wait for room where it is coming; a waiting request holds nothing.
        node = op.stop_node
        assert node is not None
        coming = self._room_coming(node)
        if coming and self.clock() < op.deadline:
            op.waiting_on, op.waited = node, True
            node.room_waiters += 1
            return Step(Wait.ROOM, until=op.deadline)
        return self._finish_lookup(op, more=coming)  # out of time: the reader may ask again

    def _read_ahead(self, op: Lookup) -> None:
        """Start reloading the window after this answer, pinned under its lease, so that
        the reader's next lookup finds it in memory. Nodes where lookups wait for room
        are left alone: they go first."""
        lease = op.lease_ref
        if lease is None:
            return
        window: dict[str, int] = {}
        for key in op.keys[len(op.served) + len(op.pending) :]:
            entry = self.get(key)
            if entry is None or entry.state is not State.READY:
                break
            if key in lease.ahead or entry.in_memory:
                continue
            if not entry.reloading:
                node = entry.node
                used = window.get(node.node_id, 0)
                need = size_class(entry.size)
                if node.room_waiters or (
                    used and used + need > self._read_window(node, op.lease, entry.size)
                ):
                    break
                if not self._start_reload(entry, Claim(op.tenant)):
                    break
                window[node.node_id] = used + need
            self._pin(entry)
            lease.ahead[key] = entry
            lease.from_disk.add(entry.gen)
            self._loading(lease, op.lease, entry.node)

    def _settle(self, op: Lookup) -> bool:
        """The pending hits that are in memory now stay; from the first that is not (its
        reload failed, or is still running at the deadline) on, the request lets go of
        them. True if all stayed."""
        pending = op.pending
        n = next((i for i, e in enumerate(pending) if not e.in_memory or e.dropped), len(pending))
        if n == len(pending) or not op.take_lease:
            return True
        for entry in reversed(pending[n:]):
            self._unref(entry)
        op.pending = pending[:n]
        return False

    def _finish_lookup(self, op: Lookup, more: bool) -> Step:
        """The answer is final: count it (once), hand what it serves to the lease (the
        request's pins become the lease's), keep or end the lease."""
        op.done = True
        op.more = more
        wall = self.wall()
        for entry in reversed(op.served):  # back to front: a prompt's head is its most recent
            entry.last_access = wall
            self._touch(entry)
        hits = len(op.served)
        if op.take_lease:
            from_disk = sum(1 for e in op.served if e.gen in op.from_disk)
        else:
            from_disk = sum(1 for e in op.served if not e.in_memory)
        # The keys a window's end left are asked for again at once; an answer with
        # nothing in it is a miss whatever comes after (the reader may not ask again).
        missed = 0 if more and hits else len(op.keys) - hits
        c = self.counters
        c.lookups += 1
        c.hits += hits
        c.hits_disk += from_disk
        c.hits_memory += hits - from_disk
        c.misses += missed
        mine = self.tenant(op.tenant)
        mine.lookups += 1
        mine.hits += hits
        mine.misses += missed
        if not op.take_lease:
            return DONE
        lease = op.lease_ref if not self._lease_lost(op) else None
        if lease is None and op.served:
            lease = self._read_lease(op)
        if lease is None:
            op.lease = None
            return DONE
        lease.busy = False
        lease.served.extend(op.served)
        if not more:  # the stream ends here: what was read ahead is nobody's now
            for entry in lease.ahead.values():
                self._unref(entry)
            lease.ahead.clear()
        if not lease.served and not lease.ahead:
            self._end_read_lease(op.lease or "")
            op.lease = None
        else:
            lease.expires = max(lease.expires, self.clock() + self.read_lease_ttl)
        return DONE

    def _stop_waiting(self, op: Lookup) -> None:
        if op.waiting_on is not None:
            op.waiting_on.room_waiters -= 1
            op.waiting_on = None

    def _read_lease(self, op: Lookup) -> ReadLease:
        """The request's read lease (made on its first hit), kept for at least as long
        as the request may still wait."""
        lease = op.lease_ref
        if lease is None:
            op.lease = new_id()
            lease = op.lease_ref = self.read_leases[op.lease] = ReadLease(op.tenant, 0.0)
            lease.busy = not op.done
        lease.expires = max(lease.expires, op.deadline + self.read_lease_ttl)
        return lease

    def _loading(self, lease: ReadLease, lease_id: str | None, node: Node) -> None:
        """The lease holds memory reloaded on `node`: it is one of the node's streams."""
        if lease_id and node.node_id not in lease.loading_on:
            lease.loading_on.add(node.node_id)
            node.loaders.add(lease_id)

    def _reloadable(self, entry: Entry) -> bool:
        """Whether room could ever let this disk entry back into its node's memory."""
        node = entry.node
        return (
            node.alive
            and node.has_disk
            and not node.draining
            and size_class(entry.size) <= self._memory_limit(node)
        )

    def _end_read_lease(self, lease_id: str) -> ReadLease | None:
        lease = self.read_leases.pop(lease_id, None)
        if lease is None:
            return None
        for entry in reversed(lease.served):
            self._unref(entry)
        for entry in lease.ahead.values():
            self._unref(entry)
        for node_id in lease.loading_on:
            node = self.nodes.get(node_id)
            if node is not None:
                node.loaders.discard(lease_id)
        return lease

    def release(
        self, lease_ids: Iterable[str], corrupt: Iterable[str] = (), tenant: str | None = None
    ) -> Released:
        """End leases: read leases let go of what they hold; a write lease of a store
        of several windows ends, and anything of it still being written is aborted.
        `corrupt` keys (failed checksums) that the releasing client held under one of
        these read leases become suspects: a report alone drops nothing (any client
        could cry "corrupt"); `corrupt_verified` does, once the bytes on the slab are
        found not to match. `tenant`: the requester's; another tenant's lease is left
        alone (None: the admin's request, any lease)."""
        out = Released(0)
        held: dict[str, Entry] = {}
        for lease_id in lease_ids:
            if not self._owns(lease_id, tenant):
                continue
            lease = self._end_read_lease(lease_id)
            if lease is not None:
                out.released += 1
                held.update((e.key, e) for e in lease.served)
            elif lease_id in self.write_leases:
                out.released += 1
                self.counters.aborts += self._end_write_lease(lease_id)
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

    def _owns(self, lease_id: str, tenant: str | None) -> bool:
        """Whether a request of `tenant` may act on the lease (None: the admin's may)."""
        lease: ReadLease | WriteLease | None = self.read_leases.get(lease_id)
        if lease is None:
            lease = self.write_leases.get(lease_id)
        return lease is not None and (tenant is None or lease.tenant == tenant)

    def renew(self, lease_ids: Iterable[str], tenant: str | None = None) -> list[str]:
        now = self.clock()
        renewed = []
        for lease_id in lease_ids:
            if not self._owns(lease_id, tenant):
                continue
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
                self.wall(),
                self.wall(),
                gen=self._next_gen(),
                tenant=op.tenant,
            )
            lease = self._write_lease(op)
            entry.write_lease = op.lease
            self.entries[key] = entry
            node.entries.add(key)
            lease.entries[key] = entry
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

    def _end_write_lease(self, lease_id: str) -> int:
        """End a write lease: what it still writes is dropped. How many that was."""
        lease = self.write_leases.pop(lease_id, None)
        if lease is None:
            return 0
        for entry in lease.entries.values():
            self._drop(entry)
        return len(lease.entries)

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
            self.tenant(entry.tenant).bytes_writing -= entry.size
            self._memory_ready(entry)
            self.counters.commits += 1
            self.tenant(entry.tenant).commits += 1
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
