"""Processes inside a VM: the wrapper that runs a command there, and stopping them all.

A process runs as `ip netns exec NS unshare --uts -- python -m polarkv_lib.cluster.enter
HOST -- COMMAND`; every step execs the next, so the pid the harness records is the pid of
COMMAND itself. Starting a service and waiting for its ready file is `Service`'s
(polarkv_lib/service.py), with `in_vm` as its wrapper; what is here is about VMs only:
the wrapper, the environment of a VM's processes, and pids recorded across harness
processes. A recorded pid is signalled only while its start time still matches, so a pid
the kernel reused is never touched.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence

from polarkv_lib.cluster.spec import Vm
from polarkv_lib.service import child_env

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0  # a polarkv process bounds its own shutdown at 10 s


def vm_env(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """The environment for processes in a VM: none of the caller's POLARKV_* settings
    (the harness says exactly what each process gets), and the source tree importable."""
    return child_env(extra, inherit_settings=False)


def in_vm(vm: Vm, argv: Sequence[str] = ()) -> list[str]:
    """`argv` inside `vm` (with no `argv`: the prefix, a `Service`'s wrapper)."""
    return [
        "ip",
        "netns",
        "exec",
        vm.netns,
        "unshare",
        "--uts",
        "--",
        sys.executable,
        "-m",
        "polarkv_lib.cluster.enter",
        vm.hostname,
        "--",
        *argv,
    ]


def start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot): with the pid, it names
    one process, so a recorded pid that was reused is never signalled."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int, started: int | None) -> bool:
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def signal_pid(pid: int, started: int | None, sig: int) -> bool:
    if not alive(pid, started):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def reap(pid: int) -> None:
    """Collect the exit status if `pid` is our child (else the kernel's init does)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_pids(pids: Sequence[tuple[int, int | None]], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM (an orderly stop: slabs unregister and unlink their buffers), then SIGKILL
    whatever is still there after `timeout`."""
    pending = [(pid, started) for pid, started in pids if signal_pid(pid, started, signal.SIGTERM)]
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        for pid, _ in pending:
            reap(pid)
        pending = [
            (pid, started) for pid, started in pending if alive(pid, started) and not _zombie(pid)
        ]
    for pid, started in pending:
        signal_pid(pid, started, signal.SIGKILL)
        reap(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return True
