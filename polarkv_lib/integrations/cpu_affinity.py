"""Where the connector's own threads run in a vLLM worker whose OpenMP threads are bound
to cores (vLLM's CPU build binds them: VLLM_CPU_OMP_THREADS_BIND).

A thread inherits the mask of the thread that starts it, and the worker's main thread
is an OpenMP thread: without this, the loader, the saver and the client's I/O thread
all share the forward pass's cores, slowing the step and the loads together (measured:
an asynchronous 16 MiB load took 3.6x a synchronous one; docs/BENCHMARKS.md).

"auto" moves them to the CPUs this process may use that no OpenMP thread of vLLM's is
bound to, and leaves them alone when there are none (a GPU worker, or every core bound).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

log = logging.getLogger("polarkv.integrations.vllm")

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cpus(text: str) -> frozenset[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6} ('|' between ranks counts as ','); ValueError on
    anything else."""
    cpus: set[int] = set()
    for part in text.replace("|", ",").split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None or int(match[1]) > int(match[2] or match[1]):
            raise ValueError(f"not a CPU range: {part!r}")
        cpus.update(range(int(match[1]), int(match[2] or match[1]) + 1))
    return frozenset(cpus)


def _available() -> frozenset[int]:
    """The CPUs the process may use: its parent's mask (the engine core that started
    the worker, which vLLM does not bind), else every online CPU."""
    with contextlib.suppress(OSError):
        return frozenset(os.sched_getaffinity(os.getppid()))
    return frozenset(range(os.cpu_count() or 1))


def _bound() -> frozenset[int]:
    """The cores vLLM's OpenMP threads are bound to: every rank's in the environment
    ('0-3|4-7'), else this thread's own mask (the worker's main thread is one of them)."""
    with contextlib.suppress(ValueError):
        return parse_cpus(os.environ.get(BIND_ENV, ""))
    return frozenset(os.sched_getaffinity(0))


def io_cpus(choice: str) -> frozenset[int] | None:
    """The CPUs for the connector's threads, or None to leave them where they start.
    `choice`: "auto", "none", or a CPU list ("1,3-4"); call it on the worker's main
    thread once vLLM has bound it."""
    if choice == "none":
        return None
    if choice != "auto":
        return parse_cpus(choice)
    available = _available()
    free = available - _bound()
    return free if free and free != available else None


def pin(native_id: int | None, cpus: frozenset[int] | None) -> None:
    """Move one thread (its native id; 0: the calling thread) to `cpus`; a refusal (a
    CPU outside the cgroup) is logged and leaves the thread where it is."""
    if cpus is None or native_id is None:
        return
    try:
        os.sched_setaffinity(native_id, cpus)
    except OSError as exc:
        log.warning("PolarKV: could not move a thread to CPUs %s: %r", sorted(cpus), exc)
