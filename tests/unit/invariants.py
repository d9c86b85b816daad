"""What must hold of the manager core after every step, whatever the steps were: the
state machines over it (test_metadata_state.py, test_tiering_state.py) check these.

- Memory accounting: each node's figures (`keys_memory`, `ready_bytes`, `lru_extent`,
  `clean_extent`) and each tenant's are those of its entries; the allocator's use is
  the extents entries hold plus the quarantine, without overlaps.
- The eviction order holds exactly the entries that may leave memory now: every entry
  in a node's LRU is ready, unread, resident and not in flight, and every such entry
  is in it (one left out would never be evicted).
- Readers are the leases' pins; room waiters are the requests waiting; a node's
  loaders are live read leases.
- Every counter is counted once, when its outcome is final: it never decreases, and
  (`Tally`) lookups, hits, misses and allocation results add up to the answers given.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Iterable

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import (
    Allocation,
    AllocStatus,
    Entry,
    Lookup,
    Residency,
    State,
)

ORDERABLE = (Residency.MEMORY, Residency.BOTH)


def check_memory_accounting(md: Metadata, seen: Iterable[Entry]) -> None:
    """`seen`: every entry that was ever in the table (a dropped one may still hold its
    extent, for a reader or a reload landing in it)."""
    table = list(md.entries.values())
    for e in table:
        assert e.counted == (e.state is State.READY and e.in_memory), e
    tenants: Counter[str] = Counter()
    tenant_bytes: Counter[str] = Counter()
    for e in table:
        if e.counted:
            tenants[e.tenant] += 1
            tenant_bytes[e.tenant] += e.size
    for name, stats in md.tenant_stats.items():
        assert (stats.keys_memory, stats.bytes_memory) == (tenants[name], tenant_bytes[name])
    held = [e for e in seen if e.alloc_size]
    for node in md.nodes.values():
        if not node.alive:
            assert not node.lru and not node.clean and not node.loaders
            assert node.keys_memory == node.ready_bytes == node.lru_extent == node.clean_extent == 0
            continue
        counted = [e for e in table if e.node is node and e.counted]
        assert node.keys_memory == len(counted)
        assert node.ready_bytes == sum(e.size for e in counted)
        assert node.lru_extent == sum(e.alloc_size for e in node.lru.values())
        assert node.clean_extent == sum(e.alloc_size for e in node.clean.values())
        mine = [e for e in held if e.node is node]
        assert node.allocator.used == sum(e.alloc_size for e in mine) + sum(
            q[2] for q in node.quarantine
        )
        spans = sorted(
            [(e.offset, e.offset + e.alloc_size) for e in mine]
            + [(q[1], q[1] + q[2]) for q in node.quarantine]
        )
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "extents overlap"
        assert all(s >= 0 and e <= node.allocator.capacity for s, e in spans)
        for e in mine:
            if e.dropped:  # held only by a reader or a reload writing into it
                assert e.readers > 0 or e.reloading, e.key


def check_eviction_order(md: Metadata) -> None:
    for node in md.nodes.values():
        if not node.alive:
            continue
        for k, e in node.lru.items():
            assert md.get(k) is e and e.node is node and not e.dropped
            assert e.state is State.READY and e.counted and e.alloc_size > 0
            assert e.readers == 0 and e.residency in ORDERABLE, e  # not read, not in flight
        free = {e.key for e in md.entries.values() if e.node is node and e.counted}
        free = {k for k in free if md.entries[k].readers == 0}
        free = {k for k in free if md.entries[k].residency in ORDERABLE}
        assert set(node.lru) == free  # none that may go is left out
        assert set(node.clean) == {k for k, e in node.lru.items() if e.residency is Residency.BOTH}
        for tenant, order in md.tenant_lru.items():
            if tenant in md.quotas:
                mine = {
                    k for n in md.nodes.values() for k, e in n.lru.items() if e.tenant == tenant
                }
                assert set(order) == mine


def check_holders(md: Metadata, seen: Iterable[Entry], open_lookups: Iterable[Lookup]) -> None:
    """Readers are the pins of the read leases (what they were served and what is read
    ahead for them) and of the lookups still running (what they took and have not
    answered yet); room waiters are the lookups waiting; every loader of a node is a
    live read lease."""
    pins: Counter[int] = Counter()
    for lease in md.read_leases.values():
        for e in [*lease.served, *lease.ahead.values()]:
            pins[id(e)] += 1
        for key, e in lease.ahead.items():
            assert e.key == key
    open_lookups = list(open_lookups)
    for op in open_lookups:
        if not op.done and op.take_lease:
            for e in [*op.served, *op.pending]:
                pins[id(e)] += 1
    for e in seen:
        assert e.readers == pins[id(e)], (e.key, e.readers, pins[id(e)])
    waiting: Counter[int] = Counter()
    for op in open_lookups:
        if op.waiting_on is not None:
            waiting[id(op.waiting_on)] += 1
            assert op.pending == [], "a lookup waiting for room holds nothing"
    for node in md.nodes.values():
        assert node.room_waiters == waiting[id(node)], node.node_id
        assert node.loaders <= set(md.read_leases), node.node_id


def _counters(md: Metadata) -> dict[str, int]:
    c = md.counters
    out = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "tier_failures"}
    out.update({f"tier_failures.{k}": v for k, v in c.tier_failures.items()})
    for name, stats in md.tenant_stats.items():
        for f in ("lookups", "hits", "misses", "allocations", "alloc_no_space", "commits"):
            out[f"tenant[{name}].{f}"] = getattr(stats, f)
    return out


class Tally:
    """What the core's counters must say, from the answers the requests got; and what
    they said after the previous step (they never go down)."""

    def __init__(self) -> None:
        self.expected: Counter[str] = Counter()
        self.last: dict[str, int] = {}

    def lookup(self, op: Lookup) -> None:
        assert op.done
        self.expected["lookups"] += 1
        self.expected["hits"] += len(op.served)
        # a window's end is asked for again at once: not a miss; an empty answer is
        if not op.more or not op.served:
            self.expected["misses"] += len(op.keys) - len(op.served)

    def allocation(self, op: Allocation) -> None:
        assert op.done
        names = {
            AllocStatus.ALLOCATED: "allocations",
            AllocStatus.EXISTS: "exists",
            AllocStatus.IN_PROGRESS: "in_progress",
            AllocStatus.NO_SPACE: "no_space",
        }
        for res in op.results:
            assert res is not None
            if res.status in names:
                self.expected[names[res.status]] += 1

    def commits(self, out: dict[str, str]) -> None:
        self.expected["commits"] += sum(1 for why in out.values() if why == "committed")

    def check(self, md: Metadata) -> None:
        now = _counters(md)
        for name, value in self.expected.items():
            assert now[name] == value, (name, now[name], value)
        for name, value in self.last.items():
            assert now.get(name, 0) >= value, f"{name} went down: {value} -> {now.get(name)}"
        self.last = now
