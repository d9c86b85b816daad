"""Timers and meters shared by the benchmarks: work run across threads from a common
start, and who used the CPUs (and how much memory a process holds) meanwhile."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from polarkv_lib.tools.bench.core import BenchError


def run_threads(
    threads: int,
    work: Callable[[int], None],
    timeout: float,
    what: str,
    on_timeout: Callable[[], None] = lambda: None,
) -> float:
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

    workers = [
        threading.Thread(target=body, args=(i,), daemon=True, name=f"bench-{i}")
        for i in range(threads)
    ]
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


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss(pid: int) -> int:
    """Resident bytes of a process (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot; idle and iowait count as not busy."""
    try:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(values) - values[3] - values[4], sum(values)


class CpuWatch:
    """Who used the CPUs during a phase: a service process, this bench process, and the
    machine as a whole (the rest is other tenants). On two shared cores this, more than
    the disk or the network, often decides what a phase can do."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.wall = self.node = self.own = self.machine = 0.0

    def __enter__(self) -> CpuWatch:
        self._t0 = time.perf_counter()
        self._node0 = proc_cpu(self.pid) if self.pid else 0.0
        self._own0 = time.process_time()
        self._machine0 = _machine_jiffies()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        self.node = (proc_cpu(self.pid) - self._node0) if self.pid else 0.0
        self.own = time.process_time() - self._own0
        busy1, total1 = _machine_jiffies()
        busy0, total0 = self._machine0
        self.machine = (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0

    def text(self) -> str:
        node = f"node {self.node:.1f}s, " if self.pid else ""
        return (
            f"CPU over {self.wall:.1f}s: {node}bench {self.own:.1f}s, machine "
            f"{self.machine:.0%} busy ({os.cpu_count()} CPUs)"
        )
