"""A Hypothesis state machine over Metadata on memory-only nodes: random allocate /
commit / abort / lookup / release / delete / renew / re-register / time steps, two
tenants (one under a memory quota), requests driven through the entry points the shell
calls (tests/unit/drive.py), and the invariants of tests/unit/invariants.py checked
after every step."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import (
    WRITE_GRACE,
    AllocResult,
    AllocStatus,
    Entry,
    State,
)
from tests.unit.drive import FakeClock, results_of, run_allocate, run_lookup, tick
from tests.unit.invariants import (
    Tally,
    check_eviction_order,
    check_holders,
    check_memory_accounting,
)

KiB = 1024
READ_TTL, WRITE_TTL, HB_TTL = 5.0, 30.0, 3.0
KEYS = [hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest() for i in range(24)]
NODES = {"n1": 128 * KiB, "n2": 192 * KiB}
QUOTAS = {"a": 160 * KiB}  # tenant "a" evicts its own entries past this
# a passing run takes ~2 s; a failing one spends minutes shrinking: let it finish
pytestmark = pytest.mark.timeout(300)

COMMIT_RESULTS = {"committed", "not_in_lease", "lease_expired", "dropped"}

keys_st = st.sampled_from(KEYS)
tenants_st = st.sampled_from(["", "a"])
sizes_st = st.one_of(st.sampled_from([1, 4097, 32 * KiB, 64 * KiB]), st.integers(1, 96 * KiB))


class MetadataMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.md = Metadata(READ_TTL, WRITE_TTL, HB_TTL, clock=self.clock, rng=random.Random(0))
        self.md.quotas = dict(QUOTAS)
        self.tally = Tally()
        self.incarnations: dict[str, int] = {}
        self.entries: list[Entry] = []  # every entry ever allocated
        self.write_lease_ids: list[str] = []
        self.read_lease_ids: list[str] = []
        self.removed: set[int] = set()  # ids of entries a rule deleted or reported corrupt
        for node_id in NODES:
            self._register(node_id)

    def _register(self, node_id: str) -> None:
        inc = self.incarnations.get(node_id, 0) + 1
        self.incarnations[node_id] = inc
        node, new = self.md.register(node_id, inc, f"{node_id}:1", NODES[node_id], "", "", ["tcp"])
        assert new and node.alive and node.allocator.used == 0

    # -- quarantine of dropped writes ---------------------------------------------------

    def _writing(self) -> list[tuple[Entry, int, int, float]]:
        """Every WRITING entry with its extent and its write lease's expiry."""
        out = []
        for e in self.md.entries.values():
            if e.state is State.WRITING:
                out.append(
                    (e, e.offset, e.alloc_size, self.md.write_leases[e.write_lease or ""].expires)
                )
        return out

    def _check_quarantined(self, before: list[tuple[Entry, int, int, float]], since: float) -> None:
        """A WRITING entry dropped by the last rule (at `since` or later) left its extent in
        quarantine until at least max(lease expiry, drop time) + WRITE_GRACE, or, if that
        moment has passed already, released it; a dead node's extents just vanish."""
        for e, offset, length, lease_expiry in before:
            if not e.dropped or not e.node.alive:
                continue
            due = max(lease_expiry, since) + WRITE_GRACE
            held = [q for q in e.node.quarantine if q[1:] == (offset, length)]
            if held:
                assert held[0][0] >= due, (held, due)
            else:
                assert self.clock.now >= due, "extent left quarantine before the grace ended"

    # -- rules --------------------------------------------------------------------------

    def _ready_keys(self) -> list[str]:
        return sorted(k for k, e in self.md.entries.items() if e.state is State.READY)

    def _table_keys(self) -> list[str]:
        return sorted(self.md.entries)

    def _live_read_leases(self) -> list[str]:
        return [lid for lid in self.read_lease_ids if lid in self.md.read_leases]

    @rule(items=st.lists(st.tuples(keys_st, sizes_st), min_size=1, max_size=8), tenant=tenants_st)
    def store(self, items: list[tuple[str, int]], tenant: str) -> None:
        # the common path: allocate, then commit everything that was allocated
        results, lease = self._allocate(items, tenant)
        if lease is not None:
            mine = [r.key for r in results if r.status is AllocStatus.ALLOCATED]
            out = self.md.commit(lease, [(k, "0123456789abcdef") for k in mine])
            self.tally.commits(out)
            assert out == dict.fromkeys(mine, "committed")
            assert lease not in self.md.write_leases

    @rule(items=st.lists(st.tuples(keys_st, sizes_st), min_size=1, max_size=4), tenant=tenants_st)
    def allocate(self, items: list[tuple[str, int]], tenant: str) -> None:
        self._allocate(items, tenant)

    def _allocate(
        self, items: list[tuple[str, int]], tenant: str
    ) -> tuple[list[AllocResult], str | None]:
        before = {k: self.md.get(k) for k, _ in items}
        op = run_allocate(self.md, items, tenant=tenant)
        self.tally.allocation(op)
        results, lease = results_of(op), op.lease
        assert [r.key for r in results] == [k for k, _ in items]
        allocated = [r for r in results if r.status is AllocStatus.ALLOCATED]
        assert (lease is None) == (not allocated)
        # a prefix: once one is refused, no later one is placed (memory-only nodes have
        # no window, so nothing is LATER)
        statuses = [r.status for r in results]
        assert AllocStatus.LATER not in statuses
        if AllocStatus.NO_SPACE in statuses:
            assert AllocStatus.ALLOCATED not in statuses[statuses.index(AllocStatus.NO_SPACE) :]
        for r in results:
            if r.status is AllocStatus.ALLOCATED:
                assert r.entry is not None and r.entry.state is State.WRITING
                assert r.entry.write_lease == lease and self.md.get(r.key) is r.entry
                self.entries.append(r.entry)
            elif r.status is AllocStatus.EXISTS:
                assert r.entry is not None and r.entry.state is State.READY
            elif r.status is AllocStatus.IN_PROGRESS:
                # it was being written before, or earlier in this very batch
                prior = before[r.key]
                assert (prior is not None and prior.state is State.WRITING) or any(
                    a.key == r.key for a in allocated
                )
        if lease is not None:
            self.write_lease_ids.append(lease)
        return results, lease

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        if not self.write_lease_ids:
            return
        open_leases = [lid for lid in self.write_lease_ids if lid in self.md.write_leases]
        lease = data.draw(st.sampled_from(open_leases or self.write_lease_ids))
        live = self.md.write_leases.get(lease)
        candidates = sorted(live.entries) if live is not None else []
        if len(candidates) > 0 and data.draw(st.booleans()):
            keys = candidates
        else:
            keys = data.draw(
                st.lists(st.sampled_from(candidates + KEYS[:2]), unique=True, max_size=4)
            )
        out = self.md.commit(lease, [(k, "0123456789abcdef") for k in keys])
        self.tally.commits(out)
        assert set(out) == set(keys)
        for k, why in out.items():
            assert why in COMMIT_RESULTS
            if why == "committed":
                entry = self.md.get(k)
                assert entry is not None and entry.state is State.READY
                assert entry.checksum == "0123456789abcdef" and entry.write_lease is None
            if live is None:
                assert why == "lease_expired"

    @rule(data=st.data(), everything=st.booleans())
    def abort(self, data: st.DataObject, everything: bool) -> None:
        if not self.write_lease_ids:
            return
        lease = data.draw(st.sampled_from(self.write_lease_ids))
        keys = None if everything else data.draw(st.lists(keys_st, unique=True, max_size=3))
        victims = []
        writing = self._writing()
        live = self.md.write_leases.get(lease)
        if live is not None:
            victims = [
                live.entries[k]
                for k in (live.entries if keys is None else keys)
                if k in live.entries
            ]
        self.md.abort(lease, keys)
        for entry in victims:
            assert entry.dropped and self.md.get(entry.key) is not entry
        self._check_quarantined(writing, self.clock.now)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        self._lookup(data, take=True)

    @rule(data=st.data())
    def peek(self, data: st.DataObject) -> None:
        self._lookup(data, take=False)

    def _lookup(self, data: st.DataObject, take: bool) -> None:
        # mostly keys that are ready, so that hits and read leases are common
        keys = data.draw(
            st.lists(st.sampled_from(self._ready_keys() or KEYS), min_size=1, max_size=4)
        ) + data.draw(st.lists(keys_st, max_size=1))
        op = run_lookup(self.md, keys, take, tenant=data.draw(tenants_st))
        self.tally.lookup(op)
        hits, lease = op.served, op.lease
        assert not op.more  # in memory, a prefix is answered whole
        assert [e.key for e in hits] == keys[: len(hits)]
        for e in hits:
            assert e.state is State.READY and not e.dropped
            assert e.readers >= (1 if take else 0)
            assert e.node.alive
        if len(hits) < len(keys):  # stopped at the first key that is not ready
            miss = self.md.get(keys[len(hits)])
            assert miss is None or miss.state is State.WRITING
        assert (lease is not None) == (take and bool(hits))
        if lease is not None:
            self.read_lease_ids.append(lease)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        pool = self._live_read_leases() or self.read_lease_ids or ["0" * 16]
        leases = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=3))
        held = {
            e.key: e
            for lid in leases
            if lid in self.md.read_leases
            for e in self.md.read_leases[lid].served
        }
        corrupt = data.draw(
            st.lists(
                st.sampled_from(sorted(held) + self._ready_keys()[:3] + KEYS[:1]),
                unique=True,
                max_size=2,
            )
        )
        before = {k: self.md.get(k) for k in corrupt}
        failures = self.md.counters.checksum_failures
        out = self.md.release(leases, corrupt)
        for entry in out.suspects:  # the slab's bytes bear every report out here
            self.md.corrupt_verified(entry, entry.gen, True)
        for lid in leases:
            assert lid not in self.md.read_leases
        for k in corrupt:
            if k in held:
                assert held[k].dropped
                self.removed.add(id(held[k]))
            elif before[k] is not None:  # not held under these leases: a report is ignored
                assert not before[k].dropped  # type: ignore[union-attr]
                assert self.md.get(k) is before[k]
        assert failures <= self.md.counters.checksum_failures <= failures + len(corrupt)

    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        pool = self.read_lease_ids + self.write_lease_ids
        if not pool:
            return
        lid = data.draw(st.sampled_from(pool))
        live = lid in self.md.read_leases or lid in self.md.write_leases
        assert self.md.renew([lid]) == ([lid] if live else [])

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(self._table_keys() + KEYS[:1]))
        entry = self.md.get(k)
        writing = self._writing()
        assert self.md.delete(k) == (entry is not None)
        assert self.md.get(k) is None
        if entry is not None:
            assert entry.dropped
            self.removed.add(id(entry))
        self._check_quarantined(writing, self.clock.now)

    @rule(
        seconds=st.sampled_from([0.5, 1.0, 2.0, 4.0, 6.0, 31.0]),
        event=st.sampled_from(["beat"] * 5 + ["silent", "stall", "restart"]),
        node_id=st.sampled_from(sorted(NODES)),
    )
    def time_passes(self, seconds: float, event: str, node_id: str) -> None:
        """Time passes with every node heartbeating, or with `node_id` silent, or with
        the manager itself stalled (one late expire), or `node_id` restarts."""
        writing, since = self._writing(), self.clock.now
        if event == "stall":
            self.clock.now += seconds
            self.md.expire()
            self._check_quarantined(writing, since)
            return
        if event == "restart":
            old = self.md.nodes[node_id]
            old.last_heartbeat = min(
                old.last_heartbeat, self.clock.now - HB_TTL / 2
            )  # it was down a while
            self._register(node_id)
            assert not old.alive
            assert all(e.dropped for e in self.entries if e.node is old)
            return
        tick(self.md, self.clock, seconds, silent=node_id if event == "silent" else "")
        self._check_quarantined(writing, since)
        for node in self.md.nodes.values():  # expire() let go of everything that was due
            assert all(q[0] > self.clock.now for q in node.quarantine)

    @rule(node_id=st.sampled_from(sorted(NODES)))
    def revive(self, node_id: str) -> None:
        # a node that died comes back as a new incarnation (a live one is left alone)
        if not self.md.nodes[node_id].alive:
            self._register(node_id)

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def readers_match_leases(self) -> None:
        check_holders(self.md, self.entries, [])

    @invariant()
    def memory_accounting_matches_the_entries(self) -> None:
        check_memory_accounting(self.md, self.entries)

    @invariant()
    def the_eviction_order_holds_what_may_leave_memory(self) -> None:
        check_eviction_order(self.md)

    @invariant()
    def counters_count_each_answer_once_and_never_go_down(self) -> None:
        self.tally.check(self.md)

    @invariant()
    def table_matches_entries(self) -> None:
        in_table = list(self.md.entries.values())
        for e in in_table:
            assert not e.dropped and e.node.alive
            assert self.md.get(e.key) is e
        known = {id(e) for e in self.entries}
        assert all(id(e) in known for e in in_table)
        for e in self.entries:
            assert e.dropped == (self.md.get(e.key) is not e)

    @invariant()
    def dropped_writes_hold_no_extent_themselves(self) -> None:
        for e in self.entries:
            if e.dropped and e.state is State.WRITING:
                assert e.alloc_size == 0 and e.readers == 0  # handed to quarantine (or node died)

    @invariant()
    def stats_match_tables(self) -> None:
        ready = [e for e in self.md.entries.values() if e.state is State.READY]
        stats = self.md.views.stats()
        assert stats["keys_memory"] == len(ready)
        assert stats["bytes_memory"] == sum(e.size for e in ready)
        assert stats["nodes"] + stats["nodes_dead"] == len(self.md.nodes)

    @invariant()
    def write_leases_hold_only_writing_entries(self) -> None:
        for lease_id, lease in self.md.write_leases.items():
            assert lease.entries
            for k, e in lease.entries.items():
                assert e.key == k and e.state is State.WRITING and e.write_lease == lease_id

    @invariant()
    def every_writing_entry_is_under_an_open_write_lease(self) -> None:
        for k, e in self.md.entries.items():
            if e.state is State.WRITING:
                lease = self.md.write_leases.get(e.write_lease or "")
                assert lease is not None and lease.entries.get(k) is e

    @invariant()
    def leased_entries_are_never_evicted(self) -> None:
        # an entry still read-leased leaves the table only by delete, a corruption report
        # or the death of its node: never to make room
        for e in self.entries:
            if e.dropped and e.readers > 0:
                assert id(e) in self.removed or not e.node.alive, e.key


TestMetadataMachine = MetadataMachine.TestCase
TestMetadataMachine.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
