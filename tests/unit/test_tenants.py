"""Tenants (polarkv_lib/tenancy.py) and their counters and quotas in the core."""

from __future__ import annotations

import random

import pytest

from polarkv_lib.config import parse_size
from polarkv_lib.keys import ident
from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.model import AllocStatus
from polarkv_lib.tenancy import Tenants, parse_quotas, parse_tenants
from tests.unit.drive import allocate, lookup

CHUNK = 64 * 1024
SUM = "0123456789abcdef"


def key(i: int) -> str:
    return f"{i:032x}"


def test_tokens_map_to_tenants_and_keys_to_namespaces() -> None:
    assert parse_tenants(["a:tokentoken", "b:other-token"]) == {
        "tokentoken": "a",
        "other-token": "b",
    }
    for bad in (
        ["a"],
        [":tokentoken"],
        ["a:short"],
        ["a:tokentoken", "a:tokentoke2"],
        ["a:tokentoken", "b:tokentoken"],
        ["a b:tokentoken"],
        ["default:tokentoken"],  # security.token's tenant
    ):
        with pytest.raises(ValueError):
            parse_tenants(bad)
    tenants = Tenants({**parse_tenants(["a:tokentoken"]), "plain-token": ""})
    assert tenants.enabled and tenants.of("tokentoken") == "a" and tenants.of("plain-token") == ""
    assert tenants.of("nope") is None and tenants.names() == ["", "a"]
    assert not Tenants({"plain-token": ""}).enabled  # one token: today's behaviour
    k = key(7)
    assert ident("", k) == k  # the default tenant's entries are filed under their keys
    assert ident("a", k) == f"{k}.a" != ident("b", k)  # another tenant's: never a key
    assert parse_quotas(["a:64KiB"], ["a"], parse_size) == {"a": CHUNK}
    for bad in (["b:1MiB"], ["a"], ["a:0"]):
        with pytest.raises(ValueError):
            parse_quotas(bad, ["a"], parse_size)


def core() -> Metadata:
    md = Metadata(5.0, 30.0, 3.0, clock=lambda: 1000.0, rng=random.Random(1))
    md.register("n1", 1, "127.0.0.1:1", 64 * CHUNK, "", "h", ["tcp"])
    return md


def store(md: Metadata, tenant: str, keys: list[str]) -> list[AllocStatus]:
    results, lease = allocate(md, [(k, CHUNK) for k in keys], tenant=tenant)
    if lease is not None:
        md.commit(lease, [(r.key, SUM) for r in results if r.status is AllocStatus.ALLOCATED])
    return [r.status for r in results]


def test_each_tenant_is_counted_apart() -> None:
    md = core()
    a, b = ident("a", key(1)), ident("b", key(1))
    assert store(md, "a", [a]) == [AllocStatus.ALLOCATED]
    assert store(md, "b", [b]) == [AllocStatus.ALLOCATED]  # the same client key: its own entry
    hits, _ = lookup(md, [a, ident("a", key(2))], tenant="a")
    assert [e.key for e in hits] == [a] and md.get(a) is not md.get(b)
    views = md.views.tenant_views()
    assert views["a"] == {
        "lookups": 1,
        "hits": 1,
        "misses": 1,
        "allocations": 1,
        "alloc_no_space": 0,
        "commits": 1,
        "keys_memory": 1,
        "bytes_memory": CHUNK,
        "bytes_writing": 0,
    }
    assert views["b"]["lookups"] == 0 and views["b"]["bytes_memory"] == CHUNK
    assert md.delete(b) and md.views.tenant_views()["b"]["keys_memory"] == 0


def test_a_quota_evicts_the_tenants_own_oldest_entries_first() -> None:
    md = core()
    md.quotas = {"a": 3 * CHUNK}
    others = [ident("b", key(i)) for i in range(4)]
    assert store(md, "b", others) == [AllocStatus.ALLOCATED] * 4
    mine = [ident("a", key(i)) for i in range(5)]
    assert store(md, "a", mine[:3]) == [AllocStatus.ALLOCATED] * 3
    hits, lease = lookup(md, [mine[0]], take_lease=True)  # a reader holds the oldest
    assert store(md, "a", mine[3:5]) == [AllocStatus.ALLOCATED] * 2
    assert md.get(mine[0]) is not None  # leased: kept
    assert md.get(mine[1]) is None and md.get(mine[2]) is None  # the next oldest went
    assert all(md.get(k) is not None for k in others)  # nobody else's
    assert md.views.tenant_views()["a"]["bytes_memory"] == 3 * CHUNK
    assert md.counters.evictions == 2
    # a batch bigger than the quota keeps its head (its own entries are protected)
    assert store(md, "a", [ident("a", key(i)) for i in range(10, 14)]) == (
        [AllocStatus.ALLOCATED] * 2 + [AllocStatus.NO_SPACE] * 2
    )
    assert md.release([lease or ""]).released == 1 and hits


def test_a_quota_that_cannot_be_met_evicts_nothing() -> None:
    md = core()
    md.quotas = {"a": 3 * CHUNK}
    free, read1, read2 = (ident("a", key(i)) for i in range(3))
    assert store(md, "a", [free, read1, read2]) == [AllocStatus.ALLOCATED] * 3
    _, lease = lookup(md, [read1, read2], take_lease=True)  # two of three are being read
    # two chunks' worth more needs two to leave; only `free` may: refused, and `free`
    # must still be there (not evicted for a request that failed anyway)
    results, _ = allocate(md, [(ident("a", key(9)), 2 * CHUNK)], tenant="a")
    assert [r.status for r in results] == [AllocStatus.NO_SPACE]
    assert md.get(free) is not None and md.counters.evictions == 0
    assert md.views.tenant_views()["a"]["bytes_memory"] == 3 * CHUNK
    assert lease is not None
