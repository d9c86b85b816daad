"""Shared pieces of the benchmarks: timing work across threads, printing tables."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


class BenchError(Exception):
    """A benchmark could not run or measure; the message says why."""


def run_threads(threads: int, work: Callable[[int], None], timeout: float, what: str,
                on_timeout: Callable[[], None] = lambda: None) -> float:
    """Run work(0..threads-1), one per thread, all released together; return the seconds
    from their common start to the last one's end. Bounded by `timeout` (then
    `on_timeout` is called to unblock them); any error in a thread is raised as a
    BenchError naming `what`."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=body, args=(i,), daemon=True, name=f"bench-{i}")
               for i in range(threads)]
    for t in workers:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    deadline = time.monotonic() + timeout
    for t in workers:
        t.join(max(0.0, deadline - time.monotonic()))
    elapsed = time.perf_counter() - start
    if any(t.is_alive() for t in workers):
        on_timeout()
        raise BenchError(f"a {what} ran past {timeout:.0f}s")
    if errors:
        raise BenchError(f"a {what} failed: {errors[0]!r}")
    return elapsed


def markdown_table(lines: Sequence[tuple[str, ...]]) -> str:
    """lines[0] is the header; columns padded so the table also reads as plain text."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for k, line in enumerate(lines):
        out.append("| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |")
        if k == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)
