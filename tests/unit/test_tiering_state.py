"""A Hypothesis state machine over the manager core with disk roles: random writes
(single requests and stores of several windows under one write lease), reads (probes,
whole streams read window by window, and requests left open between steps: advanced
one step at a time or abandoned), deletes, tiering plans, disk-role answers (the test
plays the disk role, with a dict for a disk), time and restarts. Requests go through
the entry points the shell calls (tests/unit/drive.py); the tiering invariants, and
those of tests/unit/invariants.py, are checked after every step."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import (
    ORDER_TIMEOUT,
    Allocation,
    AllocStatus,
    Entry,
    Lookup,
    State,
    Step,
    Wait,
)
from polarkv_lib.wire.orders import Order
from tests.unit.drive import (
    HEADER,
    FakeClock,
    finish_allocate,
    finish_lookup,
    results_of,
    run_allocate,
    run_lookup,
    start_allocate,
    start_lookup,
    tick,
)
from tests.unit.invariants import (
    Tally,
    check_eviction_order,
    check_holders,
    check_memory_accounting,
)
from tests.unit.tiering_setup import HB_TTL, READ_TTL, SUM, WRITE_TTL, KiB, key

pytestmark = pytest.mark.timeout(300)  # a failing run spends minutes shrinking

MACHINE_KEYS = [key(f"m{i}") for i in range(32)]
# node -> (memory, disk); p1 has no disk role and evicts instead. Small, so that the
# watermarks are crossed often.
MACHINE_NODES = {"d1": (160 * KiB, 200 * KiB), "d2": (96 * KiB, 120 * KiB), "p1": (64 * KiB, 0)}
machine_keys = st.sampled_from(MACHINE_KEYS)
machine_sizes = st.one_of(st.sampled_from([4096, 16 * KiB, 32 * KiB]), st.integers(1, 40 * KiB))
waits = st.sampled_from([0.0, 0.0, 0.5, 2.0])
OFFLOAD_FAILURES = ["disk_full", "io_error"]
RELOAD_FAILURES = ["checksum", "io_error"]
REFUSED = (AllocStatus.NO_SPACE, AllocStatus.IN_PROGRESS)


class TieringMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.md = Metadata(READ_TTL, WRITE_TTL, HB_TTL, clock=self.clock, rng=random.Random(0))
        self.tally = Tally()
        self.incarnations: dict[str, int] = {}
        self.seen: dict[int, Entry] = {}  # every entry ever in a table, by id
        self.write_lease_ids: list[str] = []
        self.read_lease_ids: list[str] = []
        self.lookups: list[Lookup] = []  # requests open between steps, as the shell holds them
        self.allocations: list[Allocation] = []
        self.in_flight: dict[str, list[Order]] = {n: [] for n in MACHINE_NODES}
        self.disks: dict[str, dict[str, tuple[int, str, int]]] = {n: {} for n in MACHINE_NODES}
        for node_id in MACHINE_NODES:
            self._register(node_id)

    # -- helpers --------------------------------------------------------------------------

    def _register(self, node_id: str) -> None:
        inc = self.incarnations.get(node_id, 0) + 1
        self.incarnations[node_id] = inc
        memory, disk = MACHINE_NODES[node_id]
        node, new = self.md.register(node_id, inc, f"{node_id}:1", memory, "", "", ["tcp"], disk)
        assert new and node.allocator.used == 0
        self.in_flight[node_id] = []  # the old incarnation's answers are refused
        if disk:
            # the slab comes back with its files and reports them
            files = [
                (k, size, checksum, fb) for k, (size, checksum, fb) in self.disks[node_id].items()
            ]
            delete = self.md.adopt(node_id, inc, files)
            assert delete is not None
            for k in delete:
                del self.disks[node_id][k]
            for k, (size, checksum, _) in self.disks[node_id].items():
                e = self.md.get(k)
                assert e is not None and e.node is node and e.on_disk
                assert (e.size, e.checksum) == (size, checksum)
        self._learn()

    def _learn(self) -> None:
        for e in self.md.entries.values():
            self.seen.setdefault(id(e), e)

    def _entry_of(self, order: Order) -> Entry | None:
        return next(
            (e for e in self.seen.values() if e.gen == order.gen and e.key == order.key), None
        )

    def _table(self) -> list[Entry]:
        return list(self.md.entries.values())

    def _pending(self) -> set[int]:
        """Entries that open lookups wait for (served to nobody yet)."""
        return {id(e) for op in self.lookups for e in op.pending}

    @initialize(
        sizes=st.lists(st.sampled_from([16 * KiB, 32 * KiB]), min_size=6, max_size=12),
        files=st.lists(st.sampled_from([16 * KiB, 32 * KiB]), max_size=6),
    )
    def warm_up(self, sizes: list[int], files: list[int]) -> None:
        """Start near the watermarks, so that runs spend their steps on tiering: d1 was
        restarted with files on its disk, and some prompts were stored."""
        for k, size in zip(MACHINE_KEYS, files, strict=False):
            self.disks["d1"][k] = (size, SUM, size + HEADER)
        if files:
            self.md.unregister("d1", self.incarnations["d1"])
            self._register("d1")
        for k, size in zip(MACHINE_KEYS[-len(sizes) :], sizes, strict=True):
            self.store([(k, size)])

    # -- writes -----------------------------------------------------------------------------

    def _allocate(self, op: Allocation, resumed: bool = False) -> list[tuple[str, str]]:
        """Check a finished allocation; count it; what to commit (every key allocated)."""
        self.tally.allocation(op)
        self._learn()
        results = results_of(op)
        statuses = [r.status for r in results]
        # a prefix: past the first refused or deferred item, nothing is placed
        ends = [i for i, s in enumerate(statuses) if s in (AllocStatus.NO_SPACE, AllocStatus.LATER)]
        if ends:
            assert AllocStatus.ALLOCATED not in statuses[ends[0] :], statuses
        mine = [(r.key, SUM) for r in results if r.status is AllocStatus.ALLOCATED]
        assert op.lease is not None or not mine
        if not resumed and not op.more:  # a lease is made by what it holds
            assert (op.lease is not None) == bool(mine)
        for r in results:
            if r.status is AllocStatus.ALLOCATED:
                assert r.entry is not None and r.entry.state is State.WRITING
                assert r.entry.write_lease == op.lease and self.md.get(r.key) is r.entry
        return mine

    def _commit(self, lease: str, items: list[tuple[str, str]], more: bool = False) -> None:
        out = self.md.commit(lease, items, more)
        self.tally.commits(out)

    @rule(items=st.lists(st.tuples(machine_keys, machine_sizes), min_size=1, max_size=6))
    def store(self, items: list[tuple[str, int]]) -> None:
        op = run_allocate(self.md, items)
        mine = self._allocate(op)
        if op.lease is not None:
            self._commit(op.lease, mine)
            assert all(self.md.get(k).state is State.READY for k, _ in mine)  # type: ignore[union-attr]
        self.plan()  # the shell plans after every write

    @rule(
        items=st.lists(st.tuples(machine_keys, machine_sizes), min_size=2, max_size=8),
        window=st.integers(1, 3),
    )
    def stream_store(self, items: list[tuple[str, int]], window: int) -> None:
        """A store of several windows as the client makes it (client/async_client.py
        `_store`): each window continues the write lease, deferred items are asked for
        again; its earlier chunks are never evicted to make room for its later ones."""
        lease: str | None = None
        stored: dict[str, Entry] = {}
        todo = list(items)
        for _ in range(2 * len(items)):  # each round stores one item at least, or ends
            if not todo:
                break
            part, rest = todo[:window], todo[window:]
            op = run_allocate(self.md, part, resume=lease, more=bool(rest))
            mine = self._allocate(op, resumed=lease is not None)
            lease = op.lease or lease
            later = [
                item
                for item, r in zip(part, results_of(op), strict=True)
                if r.status is AllocStatus.LATER
            ]
            if lease is not None:
                self._commit(lease, mine, more=bool(rest or later))
            for k, _ in mine:
                stored[k] = self.md.get(k)  # type: ignore[assignment]
            self.plan()
            if all(r.status in REFUSED for r in results_of(op)):
                break  # nothing moved: what is left would not move either
            todo = later + rest
        for k, entry in stored.items():
            if not entry.node.has_disk:  # a disk node's files may still go when its disk is full
                assert self.md.get(k) is entry, "a store evicted its own earlier chunk"
        if lease is not None:
            self.md.release([lease])
        assert lease not in self.md.write_leases

    @rule(items=st.lists(st.tuples(machine_keys, machine_sizes), min_size=1, max_size=3))
    def allocate(self, items: list[tuple[str, int]]) -> None:
        op = run_allocate(self.md, items)
        self._allocate(op)
        if op.lease is not None:
            self.write_lease_ids.append(op.lease)

    @rule(
        items=st.lists(st.tuples(machine_keys, machine_sizes), min_size=1, max_size=3), wait=waits
    )
    def open_allocate(self, items: list[tuple[str, int]], wait: float) -> None:
        """An allocate request the shell keeps open while it waits for room."""
        op, step = start_allocate(self.md, items, wait=wait)
        if step.wait is Wait.DONE:
            self._close_allocate(op)
        else:
            assert step.wait is Wait.ROOM and step.until == op.deadline
            self.allocations.append(op)

    def _close_allocate(self, op: Allocation) -> None:
        self.md.close_allocate(op)
        self._allocate(op)
        if op.lease is not None:
            self.write_lease_ids.append(op.lease)

    @rule(data=st.data(), abandon=st.booleans())
    def step_allocate(self, data: st.DataObject, abandon: bool) -> None:
        if not self.allocations:
            return
        op = self.allocations.pop(data.draw(st.integers(0, len(self.allocations) - 1)))
        if abandon or self.md.advance_allocate(op).wait is Wait.DONE:
            self._close_allocate(op)
        else:
            self.allocations.append(op)

    @rule(data=st.data(), commit=st.booleans())
    def finish_write(self, data: st.DataObject, commit: bool) -> None:
        if not self.write_lease_ids:
            return
        lease = data.draw(st.sampled_from(self.write_lease_ids))
        live = self.md.write_leases.get(lease)
        if commit:
            self._commit(lease, [(k, SUM) for k in (live.entries if live else [])])
        else:
            self.md.abort(lease, None)

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(e.key for e in self._table()) + MACHINE_KEYS[:1]))
        entry = self.md.get(k)
        had_file = entry is not None and entry.on_disk and entry.node.alive
        assert self.md.delete(k) == (entry is not None)
        if had_file:
            assert entry is not None
            assert any(
                o.op == "delete" and o.key == k and o.gen == entry.gen for o in entry.node.orders
            )

    # -- reads ----------------------------------------------------------------------------

    def _draw_keys(self, data: st.DataObject) -> list[str]:
        # mostly keys that are ready, often ones on disk only, so that reloads are common
        ready = [e for e in self._table() if e.state is State.READY]
        pool = sorted(e.key for e in ready) or MACHINE_KEYS
        on_disk = sorted(e.key for e in ready if not e.in_memory) or pool
        return data.draw(
            st.lists(
                st.one_of(st.sampled_from(pool), st.sampled_from(on_disk)), min_size=1, max_size=6
            )
        )

    def _answered(self, op: Lookup) -> None:
        """A lookup's final answer: a prefix of its keys, each entry a reader may be sent
        to (in memory, pinned, under the lease) or, for a probe, stored somewhere."""
        assert op.done
        self.tally.lookup(op)
        assert [e.key for e in op.served] == op.keys[: len(op.served)]
        for e in op.served:
            assert e.state is State.READY
            if op.take_lease:
                assert e.in_memory and e.alloc_size > 0 and e.readers >= 1, e
            else:
                assert e.in_memory or e.on_disk
        if op.lease is not None:
            assert op.take_lease and op.lease in self.md.read_leases
            self.read_lease_ids.append(op.lease)
        elif op.take_lease:
            assert op.served == []  # a lookup that serves something holds it under a lease

    def _busy(self) -> set[str | None]:
        """Leases of lookups still waiting: none is let go of meanwhile (test_streams.py:
        a lease released, or continued, while its lookup waits)."""
        return {op.lease for op in self.lookups}

    def _resume(self, data: st.DataObject) -> str | None:
        busy = self._busy()
        live = [
            lid for lid in self.read_lease_ids if lid in self.md.read_leases and lid not in busy
        ]
        return data.draw(st.sampled_from([None, *live])) if live else None

    @rule(data=st.data(), take=st.booleans(), wait=waits)
    def open_lookup(self, data: st.DataObject, take: bool, wait: float) -> None:
        """A lookup the shell keeps open between steps (it awaits what the step names)."""
        keys = self._draw_keys(data)
        op, step = start_lookup(self.md, keys, take, wait=wait, resume=self._resume(data))
        self._learn()
        self._stepped(op, step)

    def _stepped(self, op: Lookup, step: Step) -> None:
        if step.wait is Wait.DONE:
            self.md.close_lookup(op)
            self._answered(op)
            return
        assert op.take_lease and step.until == op.deadline
        if step.wait is Wait.RELOADS:
            reloading = {e.gen: e for e in op.pending if e.reloading}
            assert set(step.gens) == set(reloading) and reloading
            for e in reloading.values():  # each is a reload some disk role was told to do
                node = e.node
                if not node.alive:  # test_streams.py: a dead node's reload, awaited anyway
                    continue
                assert node.has_disk and node.reloads.get(e.gen) is e
                assert any(o.gen == e.gen for o in node.orders + self.in_flight[node.node_id])
        else:
            assert step.wait is Wait.ROOM and op.pending == [] and op.waiting_on is not None
        self.lookups.append(op)

    @rule(data=st.data(), abandon=st.booleans())
    def step_lookup(self, data: st.DataObject, abandon: bool) -> None:
        """The shell's await ended (what it waited for came, or the deadline passed), or
        its client went away: the next step, or close."""
        if not self.lookups:
            return
        op = self.lookups.pop(data.draw(st.integers(0, len(self.lookups) - 1)))
        if abandon:
            self.md.close_lookup(op)
            self._answered(op)
        else:
            self._stepped(op, self.md.advance_lookup(op))

    @rule(data=st.data(), release=st.booleans())
    def load(self, data: st.DataObject, release: bool) -> None:
        """What the client does for a load: one stream, window by window, each lookup
        continuing the lease; the disk roles answer while it waits, or time passes."""
        keys = self._draw_keys(data)
        lease: str | None = None
        loaded: list[Entry] = []
        while len(loaded) < len(keys):
            op = run_lookup(
                self.md,
                keys[len(loaded) :],
                True,
                wait=1.0,
                resume=lease,
                meanwhile=lambda step: self._disk_roles_answer(data, step),
            )
            self._learn()
            self._answered(op)
            lease = op.lease
            loaded += op.served
            if not op.more or not op.served:
                break  # a miss; or room did not come while it waited
        if release and lease is not None:
            self.md.release([lease])

    def _disk_roles_answer(self, data: st.DataObject, step: Step) -> None:
        """While a request waits: every disk role takes and answers its orders; if there
        were none, the request's deadline passes."""
        answered = [self._round(data, node_id) for node_id in sorted(MACHINE_NODES)]
        if not any(answered):
            self.clock.now = max(self.clock.now, step.until)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        busy = self._busy()
        pool = [
            lid for lid in self.read_lease_ids if lid in self.md.read_leases and lid not in busy
        ] or ["0" * 16]
        leases = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=2))
        held = sorted(
            {
                e.key
                for lid in leases
                if lid in self.md.read_leases
                for e in self.md.read_leases[lid].served
            }
        )
        corrupt = data.draw(
            st.lists(st.sampled_from(held or MACHINE_KEYS[:1]), unique=True, max_size=1)
        )
        out = self.md.release(leases, corrupt)
        for entry in out.suspects:  # the slab's bytes bear every report out here
            self.md.corrupt_verified(
                entry, entry.gen, data.draw(st.sampled_from([True, False, None]))
            )

    @rule()
    def renew(self) -> None:
        """Clients renew the leases they hold (a read may outlast its lease's TTL)."""
        live = [*self.md.read_leases, *self.md.write_leases]
        assert sorted(self.md.renew(live)) == sorted(live)

    # -- tiering --------------------------------------------------------------------------

    @rule()
    def plan(self) -> None:
        touched = self.md.plan_tiering()
        for node_id in touched:
            node = self.md.nodes[node_id]
            assert node.alive and node.has_disk and node.orders

    @rule(node_id=st.sampled_from(sorted(MACHINE_NODES)))
    def take_orders(self, node_id: str) -> None:
        node = self.md.nodes[node_id]
        orders = self.md.take_orders(node_id)
        assert node.orders == []
        if not node.has_disk or not node.alive:
            assert orders == []
            return
        kinds = [o.op for o in orders]
        assert kinds == sorted(kinds, key=lambda op: op != "delete")  # deletes first
        for o in orders:
            assert o.node == node_id  # tiering stays inside the node
            if o.op == "delete":
                self.disks[node_id].pop(o.key, None)
                continue
            entry = self._entry_of(o)
            assert entry is not None and entry.node is node, o
            assert o.offset >= 0 and o.offset + o.extent <= node.allocator.capacity
            assert o.size == entry.size <= o.extent
            self.in_flight[node_id].append(o)

    @rule(data=st.data(), ok=st.booleans())
    def answer(self, data: st.DataObject, ok: bool) -> None:
        pending = [(n, i) for n, orders in self.in_flight.items() for i in range(len(orders))]
        if not pending:
            return
        node_id, i = data.draw(st.sampled_from(pending))
        o = self.in_flight[node_id].pop(i)
        failures = OFFLOAD_FAILURES if o.op == "offload" else RELOAD_FAILURES
        self._answer(node_id, o, ok, data.draw(st.sampled_from(failures)))

    @rule(data=st.data(), node_id=st.sampled_from(["d1", "d2"]))
    def disk_role_round(self, data: st.DataObject, node_id: str) -> None:
        """The common case in one step: plan, the node's disk role takes its orders and
        answers all of them, mostly with success."""
        self.plan()
        self._round(data, node_id)

    def _round(self, data: st.DataObject, node_id: str) -> int:
        """The node's disk role takes its orders and answers every order it holds, mostly
        with success; how many."""
        self.take_orders(node_id)
        orders, self.in_flight[node_id] = self.in_flight[node_id], []
        for o in orders:
            ok = data.draw(st.sampled_from([True] * 4 + [False]))
            failures = OFFLOAD_FAILURES if o.op == "offload" else RELOAD_FAILURES
            self._answer(node_id, o, ok, data.draw(st.sampled_from(failures)))
        return len(orders)

    def _answer(self, node_id: str, o: Order, ok: bool, reason: str) -> None:
        disk = self.disks[node_id]
        if o.op == "offload":
            if ok:
                disk[o.key] = (o.size, o.checksum, o.size + HEADER)
            self.md.offload_done(
                node_id, o.key, o.gen, ok, "" if ok else reason, o.size + HEADER if ok else 0
            )
            return
        if o.key not in disk:  # a delete or a stale answer took the file
            ok, reason = False, "missing"
        elif not ok and reason == "checksum":
            del disk[o.key]  # the disk role deletes a broken file itself
        entry = self._entry_of(o)
        awaited = entry is not None and entry.reloading  # not timed out meanwhile
        self.md.reload_done(node_id, o.key, o.gen, ok, "" if ok else reason)
        if ok and awaited and entry is not None and not entry.dropped and entry.node.alive:
            assert entry.in_memory and not entry.reloading
            assert (entry.key in entry.node.lru) == (entry.readers == 0)

    # -- time and nodes -------------------------------------------------------------------

    @rule(
        seconds=st.sampled_from([0.5, 2.0, 6.0, 31.0, ORDER_TIMEOUT + 1]),
        event=st.sampled_from(["beat"] * 4 + ["stall", "silent", "restart"]),
        node_id=st.sampled_from(sorted(MACHINE_NODES)),
    )
    def time_passes(self, seconds: float, event: str, node_id: str) -> None:
        self._deadlines_pass(self.clock.now + seconds)
        if event == "restart":
            old = self.md.nodes[node_id]
            old.last_heartbeat = min(
                old.last_heartbeat, self.clock.now - HB_TTL / 2
            )  # it was down a while
            self._register(node_id)
            assert not old.alive and old.orders == []
            return
        if event == "stall" or seconds > 10:  # the manager stalled: one late expire
            self.clock.now += seconds
            self.md.expire()
        else:
            tick(self.md, self.clock, seconds, silent=node_id if event == "silent" else "")
        for nid, node in self.md.nodes.items():
            if not node.alive:
                self.in_flight[nid] = []
            for e in node.reloads.values():
                assert e.order_deadline > self.clock.now  # overdue reloads were given up
            assert all(e.order_deadline > self.clock.now for e in node.offloads.values())

    def _deadlines_pass(self, until: float) -> None:
        """The shell's waits end at their requests' deadlines: each open request whose
        deadline comes before `until` takes its next steps then, before time goes on."""
        for op in sorted(self.lookups, key=lambda o: o.deadline):
            if op.deadline <= until:
                self.lookups.remove(op)
                self.clock.now = max(self.clock.now, op.deadline)
                finish_lookup(self.md, op)
                self._answered(op)
        for alloc in sorted(self.allocations, key=lambda o: o.deadline):
            if alloc.deadline <= until:
                self.allocations.remove(alloc)
                self.clock.now = max(self.clock.now, alloc.deadline)
                finish_allocate(self.md, alloc)
                self._allocate(alloc)
                if alloc.lease is not None:
                    self.write_lease_ids.append(alloc.lease)

    @rule(node_id=st.sampled_from(sorted(MACHINE_NODES)))
    def revive(self, node_id: str) -> None:
        if not self.md.nodes[node_id].alive:
            self._register(node_id)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def memory_stays_under_the_high_watermark_on_disk_nodes(self) -> None:
        for node in self.md.nodes.values():
            if node.alive and node.has_disk:
                assert node.allocator.used <= int(node.allocator.capacity * self.md.memory_high)

    @invariant()
    def memory_accounting_matches_the_entries(self) -> None:
        check_memory_accounting(self.md, self.seen.values())

    @invariant()
    def the_eviction_order_holds_what_may_leave_memory(self) -> None:
        check_eviction_order(self.md)

    @invariant()
    def readers_and_waiters_are_the_requests_holding_them(self) -> None:
        check_holders(self.md, self.seen.values(), self.lookups)

    @invariant()
    def counters_count_each_answer_once_and_never_go_down(self) -> None:
        self.tally.check(self.md)

    @invariant()
    def every_ready_entry_is_in_memory_or_on_disk(self) -> None:
        for e in self._table():
            node = e.node
            assert node.alive and e.key in node.entries and not e.dropped
            assert (e.key in node.disk_lru) == e.on_disk
            if e.on_disk:
                assert node.has_disk and e.file_bytes > 0 and e.state is State.READY
            if e.state is State.WRITING:
                assert e.alloc_size > 0 and not (e.on_disk or e.offloading or e.reloading)
                continue
            assert e.in_memory or e.on_disk or e.reloading, e.key
            if e.in_memory:
                assert e.alloc_size > 0 and not e.reloading
            elif e.reloading:
                assert e.alloc_size > 0 and e.on_disk and node.reloads.get(e.gen) is e
            else:
                assert e.alloc_size == 0 and e.on_disk
            if e.offloading:
                assert e.in_memory and not e.on_disk

    @invariant()
    def node_indexes_match_the_table(self) -> None:
        table = {id(e) for e in self._table()}
        for node in self.md.nodes.values():
            if not node.alive:
                assert not node.lru and not node.disk_lru and not node.orders
                continue
            for e in [*node.lru.values(), *node.disk_lru.values(), *node.reloads.values()]:
                assert e.node is node
                assert id(e) in table or (e.dropped and e.reloading)
            assert node.disk_used == sum(e.file_bytes for e in node.disk_lru.values())
            assert node.disk_used == sum(
                e.file_bytes for e in self._table() if e.node is node and e.on_disk
            )
            assert node.offloading_bytes == sum(e.alloc_size for e in node.offloads.values())
            assert all(e.offloading for e in node.offloads.values())
            assert node.has_disk or (not node.disk_lru and not node.reloads and not node.orders)

    @invariant()
    def orders_name_the_node_that_holds_the_entry(self) -> None:
        for node in self.md.nodes.values():
            for o in node.orders:
                assert o.node == node.node_id
                if o.op != "delete":
                    entry = self._entry_of(o)
                    assert entry is not None and entry.node is node

    @invariant()
    def leased_entries_keep_their_memory_copy(self) -> None:
        # nothing served under a live read lease is offloaded away or evicted for room;
        # what open lookups still wait for may be reloading (or back on disk, given up)
        waited = self._pending()
        for lease in self.md.read_leases.values():
            for e in lease.served:
                assert id(e) in waited or (e.in_memory and e.alloc_size > 0), e

    @invariant()
    def stats_match_the_nodes(self) -> None:
        alive = [n for n in self.md.nodes.values() if n.alive]
        stats = self.md.views.stats()
        assert stats["keys_memory"] == sum(n.keys_memory for n in alive)
        assert stats["bytes_memory"] == sum(n.ready_bytes for n in alive)
        assert stats["keys_disk"] == sum(len(n.disk_lru) for n in alive)
        assert stats["bytes_disk"] == sum(n.disk_used for n in alive)
        assert stats["bytes_offloading"] == sum(n.offloading_bytes for n in alive)
        assert stats["hits"] == stats["hits_memory"] + stats["hits_disk"]
        assert stats["lookups"] == self.tally.expected["lookups"]


TestTieringMachine = TieringMachine.TestCase
TestTieringMachine.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
