"""Persistence of the manager core: the rows of what changed (write-behind, see
manager/store.py) and the restore of a previous manager's rows after a restart.

A restore never stalls the manager. `restore` (at start, before serving) only groups
the rows by node and sorts them by memory offset. When a node registers, its rows come
back a slice at a time (`restore_step`, which the shell runs between requests): sorted
rows reserve their memory extents in O(1) each, so n entries cost O(n log n) in all.
Meanwhile the node takes no new placements or reloads and its not-yet-restored keys
miss; a flush keeps their rows.
"""

from __future__ import annotations

from polarkv_lib.keys import KEY_LENGTH, ident
from polarkv_lib.manager.model import (
    IN_MEMORY,
    ON_DISK,
    Entry,
    Node,
    Residency,
    RestoreJob,
    State,
)
from polarkv_lib.manager.rows import Batch, EntryRow, NodeRow
from polarkv_lib.manager.tables import Tables
from polarkv_lib.wire.control import CONFIRM_BATCH

# How long a registered slab has to confirm its memory extents.
CONFIRM_TIMEOUT = 10.0


class Snapshots:
    """Persistence over the core's tables (composed into `Metadata` as `snapshots`): the
    restore's own state lives here, the rows it brings back go into the tables."""

    def __init__(self, tables: Tables) -> None:
        self.tables = tables
        # persisted rows of nodes that have not registered (or finished restoring) since
        # the manager started, and the keys they name (kept, not deleted, on a flush)
        self.restored: dict[str, tuple[NodeRow, list[EntryRow]]] = {}
        self.waiting_keys: set[str] = set()
        self.restore_jobs: dict[str, RestoreJob] = {}
        self.restore_slice = 2000  # rows per slice: a few milliseconds between two requests
        self.finished: list[RestoreJob] = []  # done since `take_finished` (the shell logs them)

    def restore(self, nodes: list[NodeRow], entries: list[EntryRow]) -> None:
        """Keep what a previous manager persisted until each node registers again."""
        by_node: dict[str, list[EntryRow]] = {}
        for row in entries:
            by_node.setdefault(row.node_id, []).append(row)
        for node_row in nodes:
            rows = by_node.pop(node_row.node_id, [])
            rows.sort(key=lambda r: r.mem_offset)
            self.restored[node_row.node_id] = (node_row, rows)
            self.waiting_keys.update(ident(row.tenant, row.key) for row in rows)
        for orphans in by_node.values():  # entries of a node we have no row for
            self.tables.dirty_keys.update(ident(row.tenant, row.key) for row in orphans)

    def begin(self, node: Node) -> None:
        """A node registers: its persisted disk entries serve again if it has its disk;
        its memory entries too if it kept its incarnation (its buffer survived us)."""
        saved = self.restored.pop(node.node_id, None)
        if saved is None:
            return
        node_row, rows = saved
        same_buffer = (
            node_row.incarnation == node.incarnation and node_row.capacity == node.capacity
        )
        node.restoring = True
        job = RestoreJob(node, same_buffer, rows, started=self.tables.clock())
        if same_buffer:  # its memory copies come back once the slab confirms them
            job.checks = [
                (r.mem_offset, r.size, r.checksum)
                for r in rows
                if r.in_memory and r.incarnation == node.incarnation
            ]
            job.confirming = bool(job.checks)
            job.confirm_until = self.tables.clock() + CONFIRM_TIMEOUT
        self.restore_jobs[node.node_id] = job
        self.restore_step()

    def confirm(
        self, node_id: str, incarnation: int, held: list[tuple[int, str, bool]]
    ) -> list[tuple[int, int, str]] | None:
        """A registered slab's answers to the last checks (offset, checksum, whether the
        payload there still hashes to it) and the next checks to answer; [] once none is
        left (the restore then goes on). None: not a node being restored."""
        job = self.restore_jobs.get(node_id)
        if job is None or job.node.incarnation != incarnation or not job.node.alive:
            node = self.tables.nodes.get(node_id)
            known = node is not None and node.alive and node.incarnation == incarnation
            return [] if known else None
        job.held.update((offset, checksum) for offset, checksum, ok in held if ok)
        if job.asked < len(job.checks):
            batch = job.checks[job.asked : job.asked + CONFIRM_BATCH]
            job.asked += len(batch)
            return batch
        job.confirming = False
        return []

    @property
    def restoring(self) -> bool:
        return bool(self.restore_jobs)

    @property
    def restore_left(self) -> int:
        """Rows still to restore, over all nodes (for progress)."""
        return sum(len(job.rows) - job.done for job in self.restore_jobs.values())

    def restore_step(self, budget: int = 0) -> bool:
        """Restore up to `budget` rows (default: one slice) of the nodes whose slabs have
        confirmed their memory (or not in time). True while more remain."""
        budget = budget or self.restore_slice
        for node_id, job in list(self.restore_jobs.items()):
            if budget <= 0:
                break
            if job.confirming and job.node.alive:
                if self.tables.clock() < job.confirm_until:
                    continue  # the slab has not answered yet
                job.confirming = False  # it never did: none of its memory is trusted
            end = min(job.done + budget, len(job.rows))
            if job.node.alive:
                for row in job.rows[job.done : end]:
                    self._restore_row(job, row)
            else:  # died meanwhile: what is left goes, as its restored entries did
                end = len(job.rows)
                for row in job.rows[job.done :]:
                    key = ident(row.tenant, row.key)
                    self.waiting_keys.discard(key)
                    self.tables.dirty_keys.add(key)
            budget -= end - job.done
            job.done = end
            if job.done == len(job.rows):
                job.node.restoring = False
                del self.restore_jobs[node_id]
                self.finished.append(job)
        return bool(self.restore_jobs)

    def take_finished(self) -> list[RestoreJob]:
        """The node restores that ended since the last call (a small one ends inside the
        registration that began it)."""
        done, self.finished = self.finished, []
        return done

    def _restore_row(self, job: RestoreJob, row: EntryRow) -> None:
        node = job.node
        key = ident(row.tenant, row.key)
        self.waiting_keys.discard(key)
        was_dirty = key in self.tables.dirty_keys  # changed meanwhile (e.g. written elsewhere)
        if self.tables.get(key) is not None:
            self.tables.dirty_keys.add(key)  # the store gets the newer entry
            return
        in_memory = (
            job.same_buffer
            and row.in_memory
            and row.incarnation == node.incarnation
            and (row.mem_offset, row.checksum) in job.held  # its bytes are still there
            and node.allocator.reserve(row.mem_offset, row.mem_extent)
        )
        on_disk = row.on_disk and node.has_disk
        if not in_memory and not on_disk:
            self.tables.dirty_keys.add(key)  # not restored: its row is deleted
            return
        residency = (
            Residency.BOTH
            if in_memory and on_disk
            else Residency.MEMORY
            if in_memory
            else Residency.DISK
        )
        entry = Entry(
            key,
            row.size,
            node,
            row.mem_offset if in_memory else 0,
            row.mem_extent if in_memory else 0,
            State.READY,
            row.created,
            row.created,
            gen=self.tables._next_gen(),
            checksum=row.checksum,
            residency=residency,
            tenant=row.tenant,
        )
        self.tables.entries[key] = entry
        node.entries.add(key)
        if in_memory:
            self.tables._memory_ready(entry)
        if on_disk:
            self.tables._file_added(entry, row.file_bytes)
        exact = (
            in_memory == row.in_memory
            and on_disk == row.on_disk
            and row.incarnation == node.incarnation
        )
        if exact and not was_dirty:
            # Back exactly as persisted: its row stays as it is. Rewriting every restored
            # row made the write-behind redo the whole table during a restore (1M rows:
            # most of the restore's time, on the loop and in the store's thread).
            self.tables.dirty_keys.discard(key)

    def take_changes(self) -> Batch:
        """The current state of everything changed since the last call."""
        nodes = [
            NodeRow(
                n.node_id,
                n.incarnation,
                n.address,
                n.capacity,
                n.disk_capacity,
                n.shm_path,
                n.host_id,
                ",".join(n.transports),
            )
            for n in (self.tables.nodes.get(i) for i in self.tables.dirty_nodes)
            if n is not None
        ]
        entries: list[EntryRow] = []
        deleted: list[str] = []
        # On the loop for every changed key (two per evicting allocation): locals, and
        # the residency sets read directly instead of through the Entry properties.
        get, waiting, ready = self.tables.entries.get, self.waiting_keys, State.READY
        add, gone = entries.append, deleted.append
        for key in self.tables.dirty_keys:
            entry = get(key)
            if entry is None or entry.state is not ready or not entry.node.alive:
                if key not in waiting:  # a node not back yet keeps its rows
                    gone(key)
                continue
            node, residency, extent = entry.node, entry.residency, entry.alloc_size
            in_memory = extent > 0 and residency in IN_MEMORY
            add(
                EntryRow(
                    key[:KEY_LENGTH],
                    node.node_id,
                    node.incarnation,
                    entry.size,
                    entry.checksum,
                    entry.offset if in_memory else 0,
                    extent if in_memory else 0,
                    in_memory,
                    residency in ON_DISK,
                    entry.file_bytes,
                    entry.created,
                    entry.tenant,
                )
            )
        self.tables.dirty_keys.clear()
        self.tables.dirty_nodes.clear()
        return Batch(nodes, entries, deleted)

    def requeue(self, batch: Batch) -> None:
        """A batch that could not be written: mark its keys and nodes again."""
        self.tables.dirty_nodes.update(n.node_id for n in batch.nodes)
        self.tables.dirty_keys.update(ident(e.tenant, e.key) for e in batch.entries)
        self.tables.dirty_keys.update(batch.deleted_keys)
