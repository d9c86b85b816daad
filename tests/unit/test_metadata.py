"""The manager's metadata core (polarkv_lib/manager/core.py), driven by a fake clock
through the entry points its shell calls (tests/unit/drive.py)."""

from __future__ import annotations

import hashlib
import random

import pytest

from polarkv_lib.manager.allocator import size_class
from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import WRITE_GRACE, AllocStatus, Entry, Node, NodeIdInUse, State
from tests.unit.drive import FakeClock, allocate, lookup, tick

KiB = 1024
CHUNK = 64 * KiB  # a size that is its own size class
READ_TTL, WRITE_TTL, HB_TTL = 5.0, 30.0, 3.0


def key(i: int | str) -> str:
    return hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest()


A, B, C, D, E, F, G, H = (key(c) for c in "ABCDEFGH")


def make(capacity: int = 4 * CHUNK) -> tuple[Metadata, FakeClock, Node]:
    clock = FakeClock()
    md = Metadata(READ_TTL, WRITE_TTL, HB_TTL, clock=clock, rng=random.Random(1))
    node, new = md.register("n1", 1, "127.0.0.1:9001", capacity, "/dev/shm/n1", "host", ["tcp"])
    assert new
    return md, clock, node


def store(md: Metadata, k: str, size: int = CHUNK, checksum: str = "0" * 16) -> Entry:
    results, lease = allocate(md, [(k, size)])
    assert results[0].status is AllocStatus.ALLOCATED, results
    assert lease is not None
    assert md.commit(lease, [(k, checksum)]) == {k: "committed"}
    entry = md.get(k)
    assert entry is not None and entry.state is State.READY
    return entry


def ready_keys(md: Metadata) -> set[str]:
    return {k for k, e in md.entries.items() if e.state is State.READY}


# -- nodes --------------------------------------------------------------------------------


def test_register_and_refresh() -> None:
    md, clock, node = make()
    assert md.views.stats()["nodes"] == 1
    assert md.views.stats()["capacity_memory"] == 4 * CHUNK
    clock.now += 1
    again, new = md.register("n1", 1, "127.0.0.1:9002", 4 * CHUNK, "", "", ["tcp", "shm"])
    assert again is node and not new
    assert node.address == "127.0.0.1:9002" and node.transports == ["tcp", "shm"]
    assert node.last_heartbeat == clock.now
    assert md.heartbeat("n1", 1)
    assert not md.heartbeat("n1", 2)
    assert not md.heartbeat("nope", 1)


# -- allocate / commit --------------------------------------------------------------------


def test_allocate_in_progress_then_exists() -> None:
    md, _, node = make()
    results, lease = allocate(md, [(A, 1000)])
    assert lease is not None
    (r,) = results
    assert r.status is AllocStatus.ALLOCATED and r.entry is not None
    assert r.entry.state is State.WRITING and r.entry.node is node
    assert r.entry.alloc_size == size_class(1000)
    assert node.allocator.used == size_class(1000)
    assert md.views.stats()["keys_writing"] == 1

    second, lease2 = allocate(md, [(A, 1000)])
    assert second[0].status is AllocStatus.IN_PROGRESS and lease2 is None
    assert node.allocator.used == size_class(1000)  # no second extent

    assert md.commit(lease, [(A, "ab" * 8)]) == {A: "committed"}
    assert lease not in md.write_leases
    third, lease3 = allocate(md, [(A, 1000)])
    assert third[0].status is AllocStatus.EXISTS and lease3 is None
    assert third[0].entry is md.get(A)
    described = md.views.describe(A)
    assert described is not None
    assert described["state"] == "ready" and described["checksum"] == "ab" * 8
    assert described["size"] == 1000
    c = md.counters
    assert (c.allocations, c.in_progress, c.exists, c.commits) == (1, 1, 1, 1)
    stats = md.views.stats()
    assert stats["keys_memory"] == 1 and stats["bytes_memory"] == 1000
    assert stats["keys_writing"] == 0 and stats["write_leases"] == 0


def test_batch_allocate_mixed_statuses() -> None:
    md, _, _ = make()
    store(md, A)
    allocate(md, [(B, CHUNK)])
    results, lease = allocate(md, [(A, CHUNK), (B, CHUNK), (C, CHUNK), (C, CHUNK)])
    assert [r.status for r in results] == [
        AllocStatus.EXISTS,
        AllocStatus.IN_PROGRESS,
        AllocStatus.ALLOCATED,
        AllocStatus.IN_PROGRESS,
    ]
    assert lease is not None and set(md.write_leases[lease].entries) == {C}


def test_commit_unknown_key_and_unknown_lease() -> None:
    md, _, _ = make()
    _, lease = allocate(md, [(A, CHUNK)])
    assert lease is not None
    assert md.commit(lease, [(B, "0" * 16)]) == {B: "not_in_lease"}
    assert md.get(B) is None
    assert md.commit("0" * 16, [(A, "0" * 16)]) == {A: "lease_expired"}
    assert md.get(A) is not None and md.get(A).state is State.WRITING  # type: ignore[union-attr]


def test_partial_commit_keeps_the_rest_of_the_lease() -> None:
    md, _, _ = make()
    _, lease = allocate(md, [(A, CHUNK), (B, CHUNK)])
    assert lease is not None
    assert md.commit(lease, [(A, "0" * 16)]) == {A: "committed"}
    assert lease in md.write_leases
    assert md.commit(lease, [(A, "0" * 16)]) == {A: "not_in_lease"}  # already committed
    assert md.commit(lease, [(B, "0" * 16)]) == {B: "committed"}
    assert lease not in md.write_leases


def test_commit_repeated_key_reports_committed() -> None:
    md, _, node = make()
    _, lease = allocate(md, [(A, CHUNK), (B, CHUNK)])
    assert lease is not None
    out = md.commit(lease, [(A, "0" * 16), (A, "0" * 16)])
    assert md.get(A).state is State.READY  # type: ignore[union-attr]
    assert out == {A: "committed"}
    assert md.counters.commits == 1  # committed once, not twice
    assert list(node.lru) == [A] and node.ready_bytes == CHUNK
    assert lease in md.write_leases  # B is still being written


# -- lookup -------------------------------------------------------------------------------


def test_lookup_longest_ready_prefix_and_counters() -> None:
    md, _, _ = make(capacity=8 * CHUNK)
    store(md, A)
    store(md, C)
    allocate(md, [(B, CHUNK)])  # B stays WRITING
    hits, lease = lookup(md, [A, B, C], take_lease=False)
    assert [e.key for e in hits] == [A] and lease is None
    assert (md.counters.hits, md.counters.misses, md.counters.lookups) == (1, 2, 1)

    hits, _ = lookup(md, [A, D, C], take_lease=False)  # stops at the first missing key
    assert [e.key for e in hits] == [A]
    hits, _ = lookup(md, [D, A], take_lease=False)
    assert hits == []
    hits, _ = lookup(md, [A, C], take_lease=False)
    assert [e.key for e in hits] == [A, C]
    stats = md.views.stats()
    assert (stats["hits"], stats["misses"], stats["lookups"]) == (4, 6, 4)


def test_lookup_lease_counts_readers() -> None:
    md, _, _ = make()
    a = store(md, A)
    _, none = lookup(md, [A], take_lease=False)
    assert none is None and a.readers == 0
    _, l1 = lookup(md, [A], take_lease=True)
    _, l2 = lookup(md, [A, B], take_lease=True)
    assert l1 and l2 and l1 != l2
    assert a.readers == 2
    assert md.views.stats()["read_leases"] == 2
    _, l3 = lookup(md, [B], take_lease=True)
    assert l3 is None  # nothing to protect, no lease
    assert md.release([l1, "0" * 16]).released == 1
    assert a.readers == 1
    assert md.release([l1]).released == 0  # already released: no double unref
    assert a.readers == 1
    md.release([l2])
    assert a.readers == 0 and md.views.stats()["read_leases"] == 0


def test_read_lease_expiry_and_renew() -> None:
    md, clock, _ = make()
    a = store(md, A)
    _, lease = lookup(md, [A], take_lease=True)
    assert lease is not None
    tick(md, clock, READ_TTL - 1)
    assert md.renew([lease, "f" * 16]) == [lease]
    tick(md, clock, READ_TTL - 1)
    assert a.readers == 1  # renewed: still held
    tick(md, clock, 2)
    assert a.readers == 0
    assert md.counters.expired_reads == 1
    assert md.renew([lease]) == []


# -- write leases -------------------------------------------------------------------------


def test_write_lease_expiry_frees_space() -> None:
    md, clock, node = make()
    _, lease = allocate(md, [(A, CHUNK), (B, 3 * KiB)])
    assert lease is not None and node.allocator.used > 0
    used = node.allocator.used
    tick(md, clock, WRITE_TTL - 1)
    assert md.get(A) is not None
    tick(md, clock, 1.5)
    assert md.get(A) is None and md.get(B) is None
    # the writer may still be landing bytes under its grant: the space waits out the grace
    expired_at = 1000.0 + WRITE_TTL
    assert node.allocator.used == used
    assert sorted(node.quarantine) == [
        (expired_at + WRITE_GRACE, 0, CHUNK),
        (expired_at + WRITE_GRACE, CHUNK, size_class(3 * KiB)),
    ]
    assert allocate(md, [(C, 4 * CHUNK)])[0][0].status is AllocStatus.NO_SPACE
    tick(md, clock, expired_at + WRITE_GRACE - clock.now - 0.5)
    assert node.allocator.used == used  # not a moment early
    tick(md, clock, 0.5)
    assert node.allocator.used == 0 and node.quarantine == []
    assert node.allocator.extents() == [(0, node.allocator.capacity)]
    assert md.counters.expired_writes == 1
    assert md.views.stats()["keys_writing"] == 0
    assert md.commit(lease, [(A, "0" * 16)]) == {A: "lease_expired"}
    assert md.get(A) is None
    # the key is free for a new writer
    assert allocate(md, [(A, CHUNK)])[0][0].status is AllocStatus.ALLOCATED


def test_abort_after_renew_quarantines_until_the_renewed_expiry() -> None:
    md, clock, node = make()
    _, lease = allocate(md, [(A, CHUNK)])
    assert lease is not None
    clock.now += 20
    assert md.renew([lease]) == [lease]
    md.abort(lease, None)
    assert node.quarantine == [(clock.now + WRITE_TTL + WRITE_GRACE, 0, CHUNK)]


def test_entries_added_to_an_open_write_lease_get_a_full_lease() -> None:
    md, clock, node = make()
    _, lease = allocate(md, [(A, CHUNK)])
    assert lease is not None
    clock.now += 20
    results, again = allocate(md, [(B, CHUNK)], resume=lease)  # a retry of the same store
    assert again == lease and results[0].status is AllocStatus.ALLOCATED
    granted_until = clock.now + WRITE_TTL  # what app.allocate signs for B's WRITE grant
    md.abort(lease, [B])
    ((release_at, _, _),) = node.quarantine
    assert release_at >= granted_until + WRITE_GRACE


def test_write_lease_renew_postpones_expiry() -> None:
    md, clock, _ = make()
    _, lease = allocate(md, [(A, CHUNK)])
    assert lease is not None
    tick(md, clock, WRITE_TTL - 5)
    assert md.renew([lease]) == [lease]
    tick(md, clock, WRITE_TTL - 5)
    assert md.commit(lease, [(A, "0" * 16)]) == {A: "committed"}


def test_committed_entries_survive_their_write_lease() -> None:
    md, clock, node = make()
    _, lease = allocate(md, [(A, CHUNK), (B, CHUNK)])
    assert lease is not None
    md.commit(lease, [(A, "0" * 16)])
    tick(md, clock, WRITE_TTL + 1)
    assert md.get(A) is not None and md.get(B) is None
    assert node.allocator.used == 2 * CHUNK  # B's extent is quarantined
    assert [q[1:] for q in node.quarantine] == [(CHUNK, CHUNK)]
    tick(md, clock, WRITE_GRACE)
    assert node.allocator.used == CHUNK and node.quarantine == []
    assert md.get(A) is not None


def test_abort() -> None:
    md, clock, node = make()
    _, lease = allocate(md, [(A, CHUNK), (B, CHUNK), (C, CHUNK)])
    assert lease is not None
    lease_expiry = md.write_leases[lease].expires
    assert md.abort(lease, [B, D]) == 1
    assert md.get(B) is None and md.get(A) is not None
    # the writer's grant for B lasts as long as its lease: B's space waits until then + grace
    assert node.allocator.used == 3 * CHUNK
    assert node.quarantine == [(lease_expiry + WRITE_GRACE, CHUNK, CHUNK)]
    clock.now += 10
    assert md.abort(lease, None) == 2
    assert node.allocator.used == 3 * CHUNK and lease not in md.write_leases
    assert sorted(node.quarantine) == [
        (lease_expiry + WRITE_GRACE, o, CHUNK) for o in (0, CHUNK, 2 * CHUNK)
    ]
    assert md.abort(lease, None) == 0
    assert md.counters.aborts == 3
    assert md.commit(lease, [(A, "0" * 16)]) == {A: "lease_expired"}
    assert md.views.stats()["keys_writing"] == 0 and md.views.stats()["keys_memory"] == 0
    tick(md, clock, lease_expiry + WRITE_GRACE - clock.now - 0.5)
    assert node.allocator.used == 3 * CHUNK
    tick(md, clock, 0.5)
    assert node.allocator.used == 0 and node.quarantine == []
    assert node.allocator.extents() == [(0, node.allocator.capacity)]


def test_delete_while_writing_makes_commit_report_dropped() -> None:
    md, clock, node = make()
    _, lease = allocate(md, [(A, CHUNK)])
    assert lease is not None
    assert md.delete(A)
    assert node.allocator.used == CHUNK  # quarantined: the writer's grant is still valid
    assert md.commit(lease, [(A, "0" * 16)]) == {A: "dropped"}
    assert md.get(A) is None
    assert md.views.stats()["keys_memory"] == 0
    # a new writer of the key gets other space meanwhile
    results, _ = allocate(md, [(A, CHUNK)])
    assert results[0].entry is not None and results[0].entry.offset != 0
    tick(md, clock, WRITE_TTL + WRITE_GRACE)
    assert node.quarantine == []
    assert node.allocator.used == 0  # the new writer's lease expired too, and its grace


# -- eviction and read leases -------------------------------------------------------------


def fill(md: Metadata, keys: list[str]) -> None:
    for k in keys:
        store(md, k)


def test_lru_eviction_order_and_lookup_touches() -> None:
    md, _, node = make()  # room for 4 chunks
    fill(md, [A, B, C, D])
    assert node.allocator.free == 0
    lookup(md, [A], take_lease=False)  # A becomes most recent: B is now the oldest
    results, _ = allocate(md, [(E, CHUNK)])
    assert results[0].status is AllocStatus.ALLOCATED
    assert md.get(B) is None
    assert {A, C, D} <= ready_keys(md)
    assert md.counters.evictions == 1
    assert results[0].entry is not None and results[0].entry.offset == CHUNK  # B's old place
    allocate(md, [(F, CHUNK)])
    assert md.get(C) is None and md.get(A) is not None and md.get(D) is not None


def test_read_lease_protects_from_eviction() -> None:
    md, _, node = make()
    fill(md, [A, B, C, D])
    _, lease = lookup(md, [A], take_lease=True)
    assert lease is not None
    # read, A is out of the eviction order: no walk steps over it
    assert list(node.lru) == [B, C, D] and node.lru_extent == 3 * CHUNK
    evicted = []
    for new in (E, F, G):
        results, _ = allocate(md, [(new, CHUNK)])
        assert results[0].status is AllocStatus.ALLOCATED, new
        evicted.append(next(k for k in (B, C, D) if md.get(k) is None and k not in evicted))
    assert evicted == [B, C, D]  # LRU order, skipping the leased A
    assert md.get(A) is not None and md.get(A).readers == 1  # type: ignore[union-attr]
    # only A is evictable in principle, but it is leased; E, F, G are still being written
    results, _ = allocate(md, [(H, CHUNK)])
    assert results[0].status is AllocStatus.NO_SPACE
    assert md.counters.no_space == 1
    md.release([lease])
    results, _ = allocate(md, [(H, CHUNK)])
    assert results[0].status is AllocStatus.ALLOCATED
    assert md.get(A) is None
    assert node.allocator.used == node.allocator.capacity


def test_no_space_when_every_entry_is_leased() -> None:
    md, _, _ = make()
    fill(md, [A, B, C, D])
    hits, lease = lookup(md, [A, B, C, D], take_lease=True)
    assert len(hits) == 4 and lease is not None
    results, wl = allocate(md, [(E, CHUNK), (F, 1)])
    assert [r.status for r in results] == [AllocStatus.NO_SPACE, AllocStatus.NO_SPACE]
    assert wl is None
    assert ready_keys(md) == {A, B, C, D}
    assert md.counters.evictions == 0
    assert md.views.stats()["alloc_no_space"] == 2


def test_request_larger_than_the_node_evicts_nothing() -> None:
    md, _, node = make()  # 4 chunks of capacity
    fill(md, [A, B, C, D])
    results, _ = allocate(md, [(E, 5 * CHUNK)])
    assert results[0].status is AllocStatus.NO_SPACE
    assert ready_keys(md) == {A, B, C, D}
    assert md.counters.evictions == 0 and node.allocator.used == 4 * CHUNK
    assert list(node.lru) == [A, B, C, D]  # not even touched


def test_hopeless_request_evicts_nothing() -> None:
    md, _, node = make()
    fill(md, [A, B, C, D])
    _, lease = lookup(md, [A, B], take_lease=True)  # at most 2 chunks can be freed
    assert lease is not None
    results, _ = allocate(md, [(E, 3 * CHUNK)])
    assert results[0].status is AllocStatus.NO_SPACE
    assert ready_keys(md) == {A, B, C, D}
    assert md.counters.evictions == 0 and node.allocator.used == 4 * CHUNK
    # the same request fits once the lease is gone: then it does evict
    md.release([lease])
    results, _ = allocate(md, [(E, 3 * CHUNK)])
    assert results[0].status is AllocStatus.ALLOCATED
    assert md.counters.evictions == 3


def test_quarantined_space_is_not_evictable_room() -> None:
    md, clock, _ = make()
    fill(md, [A, B])
    _, lease = allocate(md, [(C, CHUNK), (D, CHUNK)])
    assert lease is not None
    md.abort(lease, None)  # 2 chunks quarantined, 2 ready and evictable
    results, _ = allocate(md, [(E, 3 * CHUNK)])
    assert results[0].status is AllocStatus.NO_SPACE  # evicting A and B would not be enough
    assert ready_keys(md) == {A, B} and md.counters.evictions == 0
    tick(md, clock, WRITE_TTL + WRITE_GRACE)
    results, _ = allocate(md, [(E, 3 * CHUNK)])
    assert results[0].status is AllocStatus.ALLOCATED
    # A alone would give enough bytes but not one contiguous extent: B goes as well
    assert md.counters.evictions == 2 and ready_keys(md) == set()


# -- corruption reports and deletes -------------------------------------------------------


def reported(md: Metadata, leases: list[str], corrupt: list[str], bad: bool | None = True) -> int:
    """Release with a corruption report, then what the slab's bytes said (the shell
    reads them, manager/verify.py). Returns the leases released."""
    out = md.release(leases, corrupt)
    for entry in out.suspects:
        md.corrupt_verified(entry, entry.gen, bad)
    return out.released


def test_release_with_corrupt_key_drops_it() -> None:
    md, _, node = make()
    fill(md, [A, B])
    _, lease = lookup(md, [A], take_lease=True)
    assert lease is not None
    assert reported(md, [lease], [A]) == 1
    assert md.get(A) is None
    assert md.counters.checksum_failures == 1
    assert node.allocator.used == CHUNK  # A's extent is free again
    assert md.views.stats()["keys_memory"] == 1


def test_corrupt_report_needs_a_released_lease_holding_the_key() -> None:
    md, _, node = make()
    fill(md, [A, B])
    _, lease_a = lookup(md, [A], take_lease=True)
    _, lease_b = lookup(md, [B], take_lease=True)
    assert lease_a and lease_b
    # B is not under lease_a; an unknown lease holds nothing; no lease at all holds nothing
    reported(md, [lease_a], [B])
    reported(md, ["0" * 16], [B])
    reported(md, [], [A, B])
    assert md.get(A) is not None and md.get(B) is not None
    assert md.counters.checksum_failures == 0
    assert node.allocator.used == 2 * CHUNK
    # a lease already released cannot be used to report later
    reported(md, [lease_a], [A])
    assert md.get(A) is not None
    reported(md, [lease_b], [B])
    assert md.get(B) is None and md.counters.checksum_failures == 1


def test_a_corruption_report_drops_nothing_until_the_bytes_bear_it_out() -> None:
    md, _, node = make()
    fill(md, [A, B])
    _, lease = lookup(md, [A, B], take_lease=True)
    assert lease is not None
    out = md.release([lease], [A, B, A])
    assert [e.key for e in out.suspects] == [A, B] and md.get(A) and md.get(B)
    a, b = out.suspects
    assert not md.corrupt_verified(a, a.gen, False)  # the bytes match: a false report
    assert not md.corrupt_verified(b, b.gen, None)  # could not be read: not obeyed either
    assert md.get(A) is a and md.get(B) is b and node.allocator.used == 2 * CHUNK
    c = md.counters
    assert (c.corrupt_reports, c.corrupt_reports_rejected, c.checksum_failures) == (2, 1, 0)
    assert not md.corrupt_verified(a, a.gen + 1, True)  # another generation: not this entry
    assert md.corrupt_verified(a, a.gen, True) and md.get(A) is None and c.checksum_failures == 1


def test_corrupt_entry_still_read_by_another_lease_keeps_its_extent() -> None:
    md, _, node = make()
    fill(md, [A])
    _, l1 = lookup(md, [A], take_lease=True)
    _, l2 = lookup(md, [A], take_lease=True)
    assert l1 and l2
    reported(md, [l1], [A])
    assert md.get(A) is None
    assert node.allocator.used == CHUNK  # l2's reader may still be copying the bytes
    reported(md, [l2], [A])  # reported twice: counted once
    assert md.counters.checksum_failures == 1
    assert node.allocator.used == 0


def test_delete_leased_entry_keeps_extent_until_release() -> None:
    md, _, node = make()
    a = store(md, A)
    _, lease = lookup(md, [A], take_lease=True)
    assert lease is not None
    assert md.delete(A)
    assert not md.delete(A)
    assert md.get(A) is None
    assert lookup(md, [A], take_lease=False)[0] == []
    assert node.allocator.used == CHUNK
    assert md.views.stats()["keys_memory"] == 0 and md.views.stats()["bytes_memory"] == 0
    # a new writer of the same key gets a different extent while the old one is read
    results, _ = allocate(md, [(A, CHUNK)])
    assert results[0].entry is not None and results[0].entry.offset != a.offset
    md.release([lease])
    assert node.allocator.used == CHUNK  # only the new entry remains
    assert md.counters.deletes == 1


def test_delete_unleased_frees_at_once() -> None:
    md, _, node = make()
    store(md, A)
    assert md.delete(A)
    assert node.allocator.used == 0
    assert not md.delete(B)


def test_deleted_entry_read_lease_expiry_frees_extent() -> None:
    md, clock, node = make()
    store(md, A)
    _, lease = lookup(md, [A], take_lease=True)
    md.delete(A)
    assert node.allocator.used == CHUNK
    tick(md, clock, READ_TTL + 1)
    assert node.allocator.used == 0
    assert md.release([lease]).released == 0  # type: ignore[list-item]


# -- node liveness ------------------------------------------------------------------------


def test_heartbeat_timeout_kills_node_and_drops_entries() -> None:
    md, clock, node = make()
    fill(md, [A, B])
    allocate(md, [(C, CHUNK)])
    tick(md, clock, HB_TTL - 1, beat=False)
    assert node.alive
    assert md.heartbeat("n1", 1)
    tick(md, clock, HB_TTL + 1.5, beat=False)
    assert not node.alive
    assert md.get(A) is None and md.get(B) is None and md.get(C) is None
    stats = md.views.stats()
    assert stats["nodes"] == 0 and stats["nodes_dead"] == 1
    assert stats["keys_memory"] == 0 and stats["capacity_memory"] == 0
    assert md.counters.entries_lost == 2
    assert not md.heartbeat("n1", 1)
    assert allocate(md, [(D, CHUNK)])[0][0].status is AllocStatus.NO_SPACE
    assert md.views.node_views()[0]["state"] == "dead"


def test_heartbeats_keep_node_alive() -> None:
    md, clock, node = make()
    store(md, A)
    tick(md, clock, 10 * HB_TTL, beat=True)
    assert node.alive and md.get(A) is not None


def test_reregister_new_incarnation_drops_old_entries() -> None:
    md, clock, old = make()
    fill(md, [A, B])
    _, lease = lookup(md, [A], take_lease=True)
    assert lease is not None
    clock.now += HB_TTL / 2  # the node restarted: silent that long
    node, new = md.register("n1", 2, "127.0.0.1:9001", 4 * CHUNK, "", "", ["tcp"])
    assert new and node is not old and not old.alive
    assert md.get(A) is None and md.get(B) is None
    assert node.allocator.used == 0
    store(md, C)
    # releasing a lease on the dead incarnation must not touch the new node's allocator
    reported(md, [lease], [A])
    assert node.allocator.used == CHUNK
    assert md.views.stats()["nodes"] == 1 and md.views.stats()["keys_memory"] == 1


def test_reregister_same_incarnation_new_capacity_is_a_new_node() -> None:
    md, clock, old = make()
    store(md, A)
    clock.now += HB_TTL / 2
    node, new = md.register("n1", 1, "127.0.0.1:9001", 8 * CHUNK, "", "", ["tcp"])
    assert new and node is not old
    assert md.get(A) is None
    assert md.views.stats()["capacity_memory"] == 8 * CHUNK


def test_registering_over_a_live_node_is_refused_and_drops_nothing() -> None:
    md, clock, node = make()
    store(md, A)
    clock.now += HB_TTL / 4  # it heartbeats three times per TTL: this one is alive
    for incarnation, capacity in ((2, 4 * CHUNK), (1, 1 << 40)):  # a stranger, however it claims
        with pytest.raises(NodeIdInUse) as refused:
            md.register("n1", incarnation, "10.0.0.66:9001", capacity, "", "", ["tcp"])
        assert refused.value.status == 409
    assert node.alive and md.nodes["n1"] is node and md.get(A) is not None
    assert md.heartbeat("n1", 1)
    assert md.register("n1", 1, "127.0.0.1:9001", 4 * CHUNK, "", "", ["tcp"]) == (node, False)


def test_commit_after_node_death_reports_dropped() -> None:
    md, _, _ = make()
    _, lease = allocate(md, [(A, CHUNK)])
    assert lease is not None
    assert md.unregister("n1", 1)
    assert md.commit(lease, [(A, "0" * 16)]) == {A: "dropped"}
    assert md.get(A) is None


def test_unregister_needs_the_right_incarnation() -> None:
    md, _, node = make()
    assert not md.unregister("n1", 2)
    assert not md.unregister("n2", 1)
    assert node.alive
    assert md.unregister("n1", 1)
    assert not node.alive and md.views.stats()["nodes"] == 0


def test_placement_weighs_nodes_by_free_memory() -> None:
    clock = FakeClock()
    md = Metadata(READ_TTL, WRITE_TTL, HB_TTL, clock=clock, rng=random.Random(7))
    old, _ = md.register("old", 1, "127.0.0.1:9001", 400 * CHUNK, "", "", ["tcp"])
    for i in range(300):  # a busy node: three quarters full
        allocate(md, [(key(f"old{i}"), CHUNK)])
    assert old.allocator.used == 300 * CHUNK
    md.register("fresh", 1, "127.0.0.1:9002", 400 * CHUNK, "", "", ["tcp"])
    placed = [
        allocate(md, [(key(i), CHUNK)])[0][0].entry.node.node_id  # type: ignore[union-attr]
        for i in range(100)
    ]
    # the restarted, empty node takes most new writes (about 4:1 by free memory) ...
    assert 65 <= placed.count("fresh") <= 92
    # ... but not all of them: it does not become the only place new KV lives
    assert placed.count("old") >= 8
    assert md.views.stats()["bytes_memory_allocated"] == 400 * CHUNK


def test_placement_fills_every_node_before_evicting() -> None:
    md, _, n1 = make(capacity=4 * CHUNK)
    n2, _ = md.register("n2", 1, "127.0.0.1:9002", 6 * CHUNK, "", "", ["tcp"])
    fill(md, [key(i) for i in range(10)])
    assert n1.allocator.free == n2.allocator.free == 0
    assert md.views.stats()["evictions"] == 0
    results, _ = allocate(md, [(key(10), CHUNK)])  # full: now one LRU entry goes
    assert results[0].status is AllocStatus.ALLOCATED and md.views.stats()["evictions"] == 1


def test_placement_skips_dead_nodes() -> None:
    md, _, _ = make(capacity=4 * CHUNK)
    md.register("n2", 1, "127.0.0.1:9002", 8 * CHUNK, "", "", ["tcp"])
    md.unregister("n2", 1)
    results, _ = allocate(md, [(A, CHUNK)])
    assert results[0].entry is not None and results[0].entry.node.node_id == "n1"


def test_eviction_happens_on_a_node_that_can_fit() -> None:
    md, _, n1 = make(capacity=4 * CHUNK)
    fill(md, [A, B, C, D])
    n2, _ = md.register("n2", 1, "127.0.0.1:9002", CHUNK, "", "", ["tcp"])
    results, _ = allocate(md, [(E, 2 * CHUNK)])  # n2 is empty but too small: evict on n1
    assert results[0].status is AllocStatus.ALLOCATED
    assert results[0].entry is not None and results[0].entry.node is n1
    assert n2.allocator.used == 0
