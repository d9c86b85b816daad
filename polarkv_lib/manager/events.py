"""A bounded ring of recent events that an operator wants to see at a glance: nodes
joining, leaving, dying or draining, checksum failures reported by clients, failed
offloads and reloads, the metadata store falling behind and catching up.

The logs hold the same events for good, under the same names: each `Kind` is one of
the log events of `polarkv_lib.logs.Events` (`LOG_EVENTS`), so an operator who saw one
on the page finds its line in the logs. This ring only serves `GET /v1/events` (the
status page and `polarkv admin`), so it keeps the last `capacity` and forgets the rest.
Every event gets a sequence number: a poller asks for those after the last one it saw.
`id` stays the event's first sequence number when repeats fold into it.
Repeats of one kind and subject within `coalesce_s` fold into one recent event with a count,
so a failing disk cannot push everything else out of the ring.

Events about a tenant's entries (a checksum failure, a failed reload of its entry) are
that tenant's: they go to a ring of its own and are shown only to that tenant and the
admin (DESIGN §14), and however many one tenant causes, they push out only its own, never
the nodes' events or another tenant's. Sequence numbers are shared by every ring, so one
`since` covers what a viewer may see.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from polarkv_lib.logs import Events

CAPACITY = 256
COALESCE_S = 5.0
FOLD_WINDOW = 8  # how many of the latest events a repeat may fold into


class Kind(StrEnum):
    NODE_JOINED = "node_joined"
    NODE_LEFT = "node_left"
    NODE_DIED = "node_died"
    NODE_DRAINING = "node_draining"
    CHECKSUM_FAILURE = "checksum_failure"
    TIER_FAILURE = "tier_failure"
    STORE_RETRYING = "metadata_store_retrying"
    STORE_CAUGHT_UP = "metadata_store_caught_up"


# The log line of each kind: one vocabulary (polarkv_lib/logs.py).
LOG_EVENTS = {
    Kind.NODE_JOINED: Events.NODE_JOINED,
    Kind.NODE_LEFT: Events.NODE_LEFT,
    Kind.NODE_DIED: Events.NODE_DIED,
    Kind.NODE_DRAINING: Events.NODE_DRAINING,
    Kind.CHECKSUM_FAILURE: Events.CHECKSUM_FAILURE,
    Kind.TIER_FAILURE: Events.TIER_FAILURE,
    Kind.STORE_RETRYING: Events.STORE_RETRYING,
    Kind.STORE_CAUGHT_UP: Events.STORE_CAUGHT_UP,
}

# What a person should make of each kind (the page colours by it).
LEVELS = {
    Kind.NODE_JOINED: "info",
    Kind.NODE_LEFT: "info",
    Kind.NODE_DRAINING: "info",
    Kind.NODE_DIED: "error",
    Kind.CHECKSUM_FAILURE: "error",
    Kind.TIER_FAILURE: "warning",
    Kind.STORE_RETRYING: "warning",
    Kind.STORE_CAUGHT_UP: "info",
}


class EventRing:
    def __init__(
        self,
        capacity: int = CAPACITY,
        coalesce_s: float = COALESCE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._capacity = capacity
        # the shared ring (None: nodes, the metadata store) and one per tenant
        self._rings: dict[str | None, deque[dict[str, Any]]] = {}
        self._seq = itertools.count(1)
        self._last = 0
        self._coalesce_s = coalesce_s
        self._clock = clock

    def add(
        self, kind: Kind, subject: str, message: str, tenant: str | None = None, **fields: Any
    ) -> dict[str, Any]:
        """Record one event about `subject` (a node id, a key, an operation); `tenant`:
        the tenant whose entry it is about (its own ring, its eyes and the admin's)."""
        now = self._clock()
        ring = self._rings.setdefault(tenant, deque(maxlen=self._capacity))
        for i in range(len(ring) - 1, max(len(ring) - FOLD_WINDOW, 0) - 1, -1):
            seen = ring[i]
            if (
                seen["kind"] == kind
                and seen["subject"] == subject
                and now - seen["time"] <= self._coalesce_s
            ):
                # Folded into that one, moved to the end with a new sequence number so
                # that pollers see the change.
                del ring[i]
                seen.update(
                    fields, seq=self._next(), time=now, count=seen["count"] + 1, message=message
                )
                ring.append(seen)
                return seen
        seq = self._next()
        event = {
            "seq": seq,
            "id": seq,
            "time": now,
            "kind": kind.value,
            "level": LEVELS[kind],
            "subject": subject,
            "message": message,
            "count": 1,
            **fields,
        }
        if tenant is not None:
            event["tenant"] = tenant or "default"
        ring.append(event)
        return event

    def _next(self) -> int:
        self._last = next(self._seq)
        return self._last

    def since(
        self, seq: int = 0, limit: int = CAPACITY, viewer: str | None = None, admin: bool = True
    ) -> list[dict[str, Any]]:
        """Events with a sequence number above `seq`, oldest first, at most the last
        `limit`, of those the viewer may see: the admin every ring, a tenant the shared
        one and its own."""
        rings = (
            self._rings.values()
            if admin
            else [r for owner, r in self._rings.items() if owner is None or owner == viewer]
        )
        newer = sorted(
            (e for ring in rings for e in ring if e["seq"] > seq), key=lambda e: e["seq"]
        )
        return newer[-limit:] if limit > 0 else []

    @property
    def last_seq(self) -> int:
        return self._last

    def __len__(self) -> int:
        return sum(len(ring) for ring in self._rings.values())
