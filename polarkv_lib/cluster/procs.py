"""Processes inside a VM: start one, wait for it to serve, stop it, stop them all.

A process runs as `ip netns exec NS unshare --uts -- python -m polarkv_lib.cluster.enter
HOST -- COMMAND`; every step execs the next, so the pid the harness records is the pid of
COMMAND itself. A recorded pid is signalled only while its start time still matches, so
a pid the kernel reused is never touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import orjson

import polarkv_lib
from polarkv_lib.cluster.netns import ClusterError
from polarkv_lib.cluster.spec import Vm

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0  # a polarkv process bounds its own shutdown at 10 s


def source_env(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """The environment for processes in a VM: none of the caller's POLARKV_* settings
    (the harness says exactly what each process gets), and the source tree importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLARKV_")}
    root = Path(polarkv_lib.__file__).resolve().parent.parent
    if (root / "polarkv.py").exists():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def in_vm(vm: Vm, argv: Sequence[str]) -> list[str]:
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


def polarkv_argv(roles: Sequence[str], settings: Sequence[str], ready_file: str) -> list[str]:
    argv = [sys.executable, "-m", "polarkv"]
    for role in roles:
        argv += ["--role", role]
    for setting in settings:
        argv += ["--set", setting]
    return [*argv, "--ready-file", ready_file]


def start(
    vm: Vm, argv: Sequence[str], log_path: Path, env: Mapping[str, str] = {}
) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            in_vm(vm, argv),
            env=source_env(env),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


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


def wait_ready(
    proc: subprocess.Popen[bytes], ready_file: Path, log_path: Path, timeout: float = READY_TIMEOUT
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while not ready_file.exists():
        if proc.poll() is not None:
            raise ClusterError(f"exited with {proc.returncode} ({log_path}):\n{tail(log_path)}")
        if time.monotonic() > deadline:
            raise ClusterError(f"not ready in {timeout:.0f}s ({log_path}):\n{tail(log_path)}")
        time.sleep(0.05)
    info = orjson.loads(ready_file.read_bytes())
    return info if isinstance(info, dict) else {}


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])
    except OSError:
        return ""


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
