"""The read requests of the manager core: lookups (a prefix, maybe a stream of windows
from disk), their read leases, release, renew and a verified corruption report.

A layer of the core (manager/core.py `Metadata` derives from it), below the writes:
synchronous like all of the core, deciding and never awaiting (see core.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from polarkv_lib.manager.allocator import size_class
from polarkv_lib.manager.drain import Draining
from polarkv_lib.manager.model import (
    DONE,
    Claim,
    Entry,
    Lookup,
    Node,
    ReadLease,
    Released,
    State,
    Step,
    Stop,
    Wait,
    WriteLease,
    new_id,
)


class Reads(Draining):
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
        # In line behind lookups waiting there, room is coming whatever the node holds:
        # the waiters are being handed it (memory all clean copies, free to drop, made
        # this a miss when only offloads and held extents counted).
        coming = self._room_coming(node) or (node.alive and bool(node.room_waiters))
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
            from_disk = sum(1 for e in op.served if e.gen in op.from_disk) if op.from_disk else 0
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
        reported = dict.fromkeys(corrupt)
        held: dict[str, Entry] = {}
        for lease_id in lease_ids:
            if not self._owns(lease_id, tenant):
                continue
            lease = self._end_read_lease(lease_id)
            if lease is not None:
                out.released += 1
                if reported:  # what it held matters only to a report
                    held.update((e.key, e) for e in lease.served)
            elif lease_id in self.write_leases:
                out.released += 1
                self.counters.aborts += self._end_write_lease(lease_id)
        for key in reported:
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
