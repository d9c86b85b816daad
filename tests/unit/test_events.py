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


def test_every_kind_of_the_feed_is_a_log_event_the_manager_logs() -> None:
    """One vocabulary (polarkv_lib/logs.py): each kind on the page names its log line,
    and the manager's code logs that line by its constant."""
    from pathlib import Path

    from polarkv_lib.logs import Events
    from polarkv_lib.manager.events import LOG_EVENTS

    assert set(LOG_EVENTS) == set(Kind)
    names = {v: k for k, v in vars(Events).items() if k.isupper()}
    manager = Path(__file__).resolve().parents[2] / "polarkv_lib" / "manager"
    source = "".join(p.read_text() for p in manager.glob("*.py"))
    for kind, line in LOG_EVENTS.items():
        assert line in names, kind
        assert f"Events.{names[line]}" in source and f"Kind.{kind.name}" in source, kind
