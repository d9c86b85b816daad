"""The manager's ring of recent events: bounded, ordered, repeats folded."""

from __future__ import annotations

from polarkv_lib.manager.events import EventRing, Kind


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bounded_and_ordered() -> None:
    clock = Clock()
    ring = EventRing(capacity=4, clock=clock)
    for i in range(10):
        clock.now += 10
        ring.add(Kind.NODE_JOINED, f"n{i}", "node joined")
    assert len(ring) == 4
    assert [e["subject"] for e in ring.since(0)] == ["n6", "n7", "n8", "n9"]
    assert [e["seq"] for e in ring.since(8)] == [9, 10]
    assert ring.since(ring.last_seq) == []
    assert [e["subject"] for e in ring.since(0, limit=2)] == ["n8", "n9"]


def test_repeats_fold_with_a_count_and_a_new_seq() -> None:
    clock = Clock()
    ring = EventRing(coalesce_s=5.0, clock=clock)
    ring.add(Kind.TIER_FAILURE, "n1", "offload failed", reason="disk_full")
    ring.add(Kind.NODE_JOINED, "n2", "node joined")
    clock.now += 1
    folded = ring.add(Kind.TIER_FAILURE, "n1", "offload failed", reason="io_error")
    assert len(ring) == 2 and folded["count"] == 2 and folded["reason"] == "io_error"
    assert ring.since(2) == [folded] and folded["seq"] == 3  # a poller at seq 2 sees it
    clock.now += 10  # outside the window: a new event
    ring.add(Kind.TIER_FAILURE, "n1", "offload failed")
    assert len(ring) == 3 and ring.since(3)[0]["count"] == 1
    assert ring.since(0)[0]["level"] == "info" and ring.since(3)[0]["level"] == "warning"
