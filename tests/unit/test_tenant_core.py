"""The core's side of tenants and restarts (manager/tiering.py, snapshot.py): a quota
counts what a tenant writes, other tenants' requests evict a tenant only above its fair
share, and restored memory rows come back only where the slab confirms them."""

from __future__ import annotations

import random

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import AllocStatus, Wait
from polarkv_lib.manager.rows import EntryRow, NodeRow
from polarkv_lib.tenancy import Tenants

KiB = 1024
CHUNK = 64 * KiB
SUM = "0123456789abcdef"


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def core(tenants: Tenants, chunks: int) -> Metadata:
    md = Metadata(5.0, 30.0, 3.0, clock=Clock(), rng=random.Random(0), tenants=tenants)
    md.register("n", 1, "n:1", chunks * CHUNK, "", "h", ["tcp"])
    return md


def allocate(md: Metadata, tenant: str, keys: list[str], commit: bool = True) -> list[AllocStatus]:
    op = md.open_allocate([(k, CHUNK) for k in keys], tenant)
    assert md.advance_allocate(op).wait is Wait.DONE
    md.close_allocate(op)
    statuses = [r.status for r in op.results if r is not None]
    done = [(r.key, SUM) for r in op.results if r is not None and r.status is AllocStatus.ALLOCATED]
    if commit and done and op.lease:
        md.commit(op.lease, done)
    return statuses


def key(i: int, tenant: str = "") -> str:
    return f"{i:032x}" + (f".{tenant}" if tenant else "")


def test_a_quota_counts_what_the_tenant_is_still_writing() -> None:
    md = core(Tenants({"t-a": "team-a"}, {"team-a": 4 * CHUNK}), chunks=64)
    results = [allocate(md, "team-a", [key(i, "team-a")], commit=False)[0] for i in range(12)]
    assert results.count(AllocStatus.ALLOCATED) == 4  # uncommitted ones count too
    assert md.tenant("team-a").bytes_writing == 4 * CHUNK


def test_another_tenant_evicts_a_tenant_only_above_its_fair_share() -> None:
    md = core(Tenants({"t-a": "team-a", "t-b": "team-b"}), chunks=30)  # fair share 10 each
    assert (
        allocate(md, "team-b", [key(i, "team-b") for i in range(8)]) == [AllocStatus.ALLOCATED] * 8
    )
    got = [allocate(md, "team-a", [key(100 + i, "team-a")], commit=False)[0] for i in range(31)]
    assert got.count(AllocStatus.ALLOCATED) == 22  # the free memory, and none of team-b's
    assert all(md.get(key(i, "team-b")) is not None for i in range(8))
    # team-b may still make room among its own entries for a new prompt
    assert (
        allocate(md, "team-b", [key(50 + i, "team-b") for i in range(8)])
        == [AllocStatus.ALLOCATED] * 8
    )


def test_restored_memory_rows_keep_only_what_the_slab_confirms() -> None:
    md = Metadata(5.0, 30.0, 3.0, clock=Clock(), rng=random.Random(0))
    node_row = NodeRow("n", 7, "n:1", 8 * CHUNK, 0, "", "h", "tcp")
    sums = [f"{i:016x}" for i in range(4)]
    size = CHUNK - 100
    rows = [
        EntryRow(f"{i:032x}", "n", 7, size, sums[i], i * CHUNK, CHUNK, True, False, 0, 1.0)
        for i in range(4)
    ]
    md.snapshots.restore([node_row], rows)
    md.register("n", 7, "n:1", 8 * CHUNK, "", "h", ["tcp"])
    assert (
        md.snapshots.restore_step() and md.snapshots.restoring
    )  # waiting for the slab: nothing restored yet
    assert md.get(rows[0].key) is None
    checks = md.snapshots.confirm("n", 7, [])
    assert checks == [(i * CHUNK, size, sums[i]) for i in range(4)]  # the payloads to hash
    # the slab hashed them: extents 1 and 3 were rewritten by other entries since
    held = [(o, c, o // CHUNK in (0, 2)) for o, _, c in checks]
    assert md.snapshots.confirm("n", 7, held) == []
    while md.snapshots.restoring:
        md.snapshots.restore_step()
    kept = [md.get(r.key) is not None for r in rows]
    assert kept == [True, False, True, False]
    assert md.views.stats()["keys_memory"] == 2


def test_a_slab_that_never_confirms_keeps_no_memory_copy() -> None:
    clock = Clock()
    md = Metadata(5.0, 30.0, 3.0, clock=clock, rng=random.Random(0))
    node_row = NodeRow("n", 7, "n:1", 8 * CHUNK, 0, "", "h", "tcp")
    row = EntryRow("ab" * 16, "n", 7, CHUNK, SUM, 0, CHUNK, True, False, 0, 1.0)
    md.snapshots.restore([node_row], [row])
    md.register("n", 7, "n:1", 8 * CHUNK, "", "h", ["tcp"])
    clock.now += 11.0  # past the confirmation timeout
    while md.snapshots.restoring:
        md.snapshots.restore_step()
    assert md.get(row.key) is None
