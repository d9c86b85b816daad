"""Events about a tenant's entries are that tenant's (manager/events.py): each tenant's go
to a ring of its own, shown to it and the admin only, so one tenant's flood pushes out
only its own events, never the nodes' or another tenant's."""

from __future__ import annotations

from polarkv_lib.manager.events import CAPACITY, EventRing, Kind


def test_a_tenants_flood_pushes_out_only_its_own_events() -> None:
    ring = EventRing()
    ring.add(Kind.NODE_JOINED, "vm-1", "node joined")
    ring.add(Kind.CHECKSUM_FAILURE, "bb" * 16, "confirmed", tenant="team-b")
    for i in range(300):
        ring.add(Kind.CHECKSUM_FAILURE, f"{i:032x}", "confirmed", tenant="team-a")
    seen_by_b = ring.since(0, CAPACITY, "team-b", admin=False)
    assert [e["kind"] for e in seen_by_b] == ["node_joined", "checksum_failure"]
    assert seen_by_b[1]["tenant"] == "team-b"
    seen_by_a = ring.since(0, CAPACITY, "team-a", admin=False)
    assert len(seen_by_a) == CAPACITY  # its own ring is full; the nodes' event is older
    assert all(e.get("tenant") in (None, "team-a") for e in seen_by_a)
    everything = ring.since(0, 1000)
    assert {e.get("tenant") for e in everything} == {None, "team-a", "team-b"}
    assert len(everything) == 1 + 1 + CAPACITY
    assert [e["seq"] for e in everything] == sorted(e["seq"] for e in everything)


def test_the_default_tenants_events_are_its_own_too() -> None:
    ring = EventRing()
    ring.add(Kind.TIER_FAILURE, "vm-1", "reload failed", tenant="", key="aa" * 16)
    assert ring.since(0, 10, "", admin=False)[0]["tenant"] == "default"
    assert ring.since(0, 10, "team-a", admin=False) == []
