"""The slab's fence: which entry generation owns each page of the buffer, so that a grant
kept past its entry's life touches nobody else's bytes.

A grant names a region and the generation of the entry it was handed out for; the
manager's generations only grow. A WRITE (or a reload from disk) claims its pages for
its generation; any grant of an older generation on those pages is refused from then
on, and the older uses still in flight on them are aborted before the new bytes land.
A READ is served only if no newer generation has claimed any of its pages. So a reader
that kept a grant after release, drop or eviction reads at most the bytes of the entry
it was given (or nothing), and a writer that kept one cannot overwrite the next owner.

One array slot per 4 KiB page (8 bytes: 0.2% of the buffer); the manager places
extents on page boundaries.
"""

from __future__ import annotations

import itertools
import threading
import time
from array import array
from collections.abc import Callable

from polarkv_lib.errors import AccessDenied

PAGE = 4096
# How long a claim waits for the older uses it aborted to let go of their pages.
ABORT_WAIT = 2.0


class Fence:
    def __init__(self, size: int) -> None:
        self._owner = array("Q", [0]) * -(-size // PAGE)
        self._cond = threading.Condition()
        self._active: dict[
            int, tuple[int, int, int, Callable[[], None]]
        ] = {}  # first, end, gen, abort
        self._tokens = itertools.count()
        self.refused = 0  # grants refused because a newer generation owns their space
        self.aborted = 0  # uses cut off because a newer generation claimed their space

    def enter(
        self,
        offset: int,
        length: int,
        gen: int,
        claim: bool,
        abort: Callable[[], None] = lambda: None,
    ) -> int:
        """Admit one use of [offset, offset+length) under generation `gen`; `claim` for
        writes. Returns a token for `leave`. Raises AccessDenied if a newer generation
        owns any of the pages. `abort` cuts this use short (e.g. shuts its socket down)
        if a newer claim needs the pages while it is still running."""
        first, end = offset // PAGE, -(-(offset + length) // PAGE)
        with self._cond:
            if end > first and max(self._owner[first:end]) > gen:
                self.refused += 1
                raise AccessDenied("grant names space that a newer entry holds now")
            if claim:
                self._owner[first:end] = array("Q", [gen]) * (end - first)
                self._drain_older(first, end, gen)
            token = next(self._tokens)
            self._active[token] = (first, end, gen, abort)
            return token

    def _drain_older(self, first: int, end: int, gen: int) -> None:
        deadline = time.monotonic() + ABORT_WAIT
        aborted: set[int] = set()
        while True:
            older = [
                t for t, (f, e, g, _) in self._active.items() if f < end and first < e and g < gen
            ]
            if not older:
                return
            for token in older:
                if token not in aborted:
                    aborted.add(token)
                    self.aborted += 1
                    self._active[token][3]()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AccessDenied("an older use of this space did not stop")
            self._cond.wait(left)

    def leave(self, token: int) -> None:
        with self._cond:
            if self._active.pop(token, None) is not None:
                self._cond.notify_all()
