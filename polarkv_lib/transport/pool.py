"""The idle connections a transport keeps per slab between transfers, for the tcp and
rdma transports alike: a transfer takes one (or opens its own), gives it back when it
is clean, and a pool that was closed closes what is given back instead of keeping it."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
C = TypeVar("C")


class IdlePool(Generic[K, C]):
    """At most `max_idle` connections kept per key; `close_conn` ends one that is not
    kept. Thread-safe: transfers run in a thread pool."""

    def __init__(self, max_idle: int, close_conn: Callable[[C], None]) -> None:
        self._idle: defaultdict[K, list[C]] = defaultdict(list)
        self._lock = threading.Lock()
        self._max_idle = max_idle
        self._close_conn = close_conn
        self._closed = False

    def take(self, key: K) -> C | None:
        """The most recently returned connection for `key`, if any."""
        with self._lock:
            idle = self._idle.get(key)
            return idle.pop() if idle else None

    def give(self, key: K, conn: C) -> None:
        with self._lock:
            idle = self._idle[key]
            if not self._closed and len(idle) < self._max_idle:
                idle.append(conn)
                return
        self._close_conn(conn)

    def close(self) -> None:
        """Close every kept connection; later ones given back are closed at once."""
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            self._close_conn(conn)
