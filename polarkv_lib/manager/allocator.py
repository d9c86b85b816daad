"""A size-class allocator over one slab buffer (the manager's view of a node's memory).

Requests are rounded up to a size class: page-aligned (4 KiB), and above 32 KiB to an
eighth of their power of two, which bounds internal waste at 12.5% while keeping the
number of distinct extent sizes small. Free extents are binned by power of two and
coalesced with both neighbours on free (boundary tags kept in two dicts), so a buffer
that has been filled and emptied returns to one extent whatever the order of frees.
All offsets are page aligned, which O_DIRECT file I/O relies on.
"""

from __future__ import annotations

import functools

PAGE = 4096


@functools.lru_cache(maxsize=4096)  # several calls per allocation; few distinct sizes
def size_class(size: int) -> int:
    if size <= 0:
        raise ValueError("size must be positive")
    size = -(-size // PAGE) * PAGE
    if size <= 8 * PAGE:
        return size
    step = 1 << (size.bit_length() - 4)  # an eighth of the highest power of two
    return -(-size // step) * step


class Allocator:
    def __init__(self, capacity: int, base: int = 0) -> None:
        """Manage [base, base+capacity) of a buffer: a sharded manager owns one arena of
        each slab (manager/shard.py), and offsets stay the buffer's own."""
        if base % PAGE:
            raise ValueError(f"an arena starts on a page, not at {base}")
        self.capacity = capacity // PAGE * PAGE
        self.used = 0
        self._start: dict[int, int] = {}  # free extent start -> length
        self._end: dict[int, int] = {}  # free extent end -> start
        self._bins: dict[int, set[int]] = {}  # length.bit_length() -> starts
        self._live: dict[int, int] = {}  # allocated start -> length: frees must match one
        self._hint = base  # where the next in-order reserve will look first
        if self.capacity:
            self._add(base, self.capacity)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def _add(self, start: int, length: int) -> None:
        self._start[start] = length
        self._end[start + length] = start
        self._bins.setdefault(length.bit_length(), set()).add(start)

    def _remove(self, start: int) -> int:
        length = self._start.pop(start)
        del self._end[start + length]
        bin_ = self._bins[length.bit_length()]
        bin_.discard(start)
        if not bin_:
            del self._bins[length.bit_length()]
        return length

    def alloc(self, size: int) -> tuple[int, int] | None:
        """Return (offset, allocated length) or None if no free extent is large enough."""
        need = size_class(size)
        if need > self.free:
            return None
        first = need.bit_length()
        found = None
        for start in self._bins.get(first, ()):  # same power of two: may be too small
            if self._start[start] >= need:
                found = start
                break
        if found is None:
            for b in sorted(b for b in self._bins if b > first):
                found = min(self._bins[b])  # lowest address keeps the buffer compact
                break
        if found is None:
            return None
        length = self._remove(found)
        if length > need:
            self._add(found + need, length - need)
        self.used += need
        self._live[found] = need
        return found, need

    def reserve(self, offset: int, length: int) -> bool:
        """Take exactly [offset, offset+length) (restoring a known layout after a restart).
        False if any of it is not free."""
        if length <= 0 or offset % PAGE or length % PAGE:
            return False
        start = self._containing(offset, length)
        if start is None:
            return False
        total = self._remove(start)
        if offset > start:
            self._add(start, offset - start)
        if start + total > offset + length:
            self._add(offset + length, start + total - offset - length)
            self._hint = offset + length
        self.used += length
        self._live[offset] = length
        return True

    def _containing(self, offset: int, length: int) -> int | None:
        """The free extent that holds [offset, offset+length). Reserving in address order
        (a restore) always finds it at the hint, the rest left by the previous reserve;
        anything else is a scan of the free extents."""
        n = self._start.get(self._hint)
        if n is not None and self._hint <= offset and offset + length <= self._hint + n:
            return self._hint
        return next(
            (s for s, n in self._start.items() if s <= offset and offset + length <= s + n), None
        )

    def release(self, offset: int, length: int) -> None:
        if self._live.get(offset) != length:
            raise ValueError(f"bad free of [{offset}, {offset + length}): not an allocation")
        del self._live[offset]
        self.used -= length
        start, end = offset, offset + length
        left = self._end.get(start)
        if left is not None:
            self._remove(left)
            start = left
        if end in self._start:
            end += self._remove(end)
        self._add(start, end - start)

    def extents(self) -> list[tuple[int, int]]:
        """Free extents, sorted: for tests and diagnostics."""
        return sorted(self._start.items())
