"""A circuit breaker: once a peer failed to answer, calls to it fail fast for a while.

Without one, a dead or hung manager costs every request its full timeout; with one, it
costs one timeout, then one instant miss per call until `interval` has passed, when the
next call probes it again. Only faults of reachability count (refused, reset, timed
out); a peer that answers, even with an error, is up.
"""

from __future__ import annotations

import time

from polarkv_lib.errors import NetworkError


class CircuitBreaker:
    def __init__(self, name: str, interval: float) -> None:
        self.name = name
        self.interval = interval
        self._open_until = 0.0
        self.trips = 0

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self._open_until

    def check(self) -> None:
        if self.is_open:
            raise NetworkError(
                f"{self.name} did not answer recently; next try in "
                f"{self._open_until - time.monotonic():.2f}s"
            )

    def failure(self) -> None:
        if not self.is_open:
            self.trips += 1
        self._open_until = time.monotonic() + self.interval

    def success(self) -> None:
        self._open_until = 0.0
