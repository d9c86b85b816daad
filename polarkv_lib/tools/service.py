"""Start real `polarkv` processes for a benchmark, tool or demo, and always stop them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

import polarkv_lib
from polarkv_lib.node.buffer import remove_stale_buffers
from polarkv_lib.tools.bench.core import BenchError

START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0  # the service's own shutdown bound is 10 s


class ServiceError(BenchError):
    """The service could not be started."""


class Service:
    """One `polarkv` subprocess on ephemeral loopback ports, in its own directory (its
    metadata store and, with the disk role, its disk path live there)."""

    def __init__(self, workdir: str, roles: tuple[str, ...], settings: dict[str, str],
                 stop_timeout: float = STOP_TIMEOUT, start_timeout: float = START_TIMEOUT) -> None:
        os.makedirs(workdir, exist_ok=True)
        self.stop_timeout = stop_timeout  # a manager with a big table flushes longer
        self.start_timeout = start_timeout
        self.started = 0.0  # time.monotonic() when the process was started
        self.workdir = workdir
        self._ready = os.path.join(workdir, "ready.json")
        self._log = os.path.join(workdir, "service.log")
        self._cmd = [sys.executable, "-m", "polarkv"]
        for role in roles:
            self._cmd += ["--role", role]
        base = {"manager.listen": "127.0.0.1:0", "slab.listen": "127.0.0.1:0", "log.level": "warning"}
        for key, value in {**base, **settings}.items():
            self._cmd += ["--set", f"{key}={value}"]
        self._cmd += ["--ready-file", self._ready]
        self._proc: subprocess.Popen[bytes] | None = None
        self._node_id = ""
        self.url = ""

    def start(self) -> None:
        env = dict(os.environ)
        root = Path(polarkv_lib.__file__).resolve().parent.parent
        if (root / "polarkv.py").exists():  # a source checkout: make `-m polarkv` importable
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        with contextlib.suppress(FileNotFoundError):  # a previous run's, in the same workdir
            os.unlink(self._ready)
        with open(self._log, "wb") as log_file:
            self.started = time.monotonic()
            self._proc = subprocess.Popen(self._cmd, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL,
                                          stdout=log_file, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def wait_ready(self) -> str:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        while not os.path.exists(self._ready):
            if self._proc.poll() is not None:
                raise ServiceError(f"polarkv exited with {self._proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServiceError(f"polarkv not ready in {self.start_timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.05)
        with open(self._ready, "rb") as fh:
            info = orjson.loads(fh.read())
        self.info: dict[str, Any] = info
        self._node_id = str(info.get("node_id", ""))
        self.url = str(info["manager_url"])
        return self.url

    def terminate(self) -> None:
        """Ask it to stop (orderly: the slab unlinks its /dev/shm buffer); stop() waits."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self.terminate()
            try:
                proc.wait(self.stop_timeout)
                return
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._node_id and proc.returncode not in (0, -signal.SIGTERM):
            # Killed or crashed: its buffer file would hold the memory until reboot.
            remove_stale_buffers("/dev/shm", self._node_id)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self._log, errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return ""


@contextlib.contextmanager
def running(*services: Service) -> Iterator[list[str]]:
    """Start the services together (their start-ups overlap), yield their manager URLs,
    and stop every one of them, whatever happened (their shutdowns overlap too)."""
    try:
        for service in services:
            service.start()
        yield [service.wait_ready() for service in services]
    finally:
        for service in services:
            service.terminate()
        for service in services:
            service.stop()


@contextlib.contextmanager
def running_service(workdir: str, roles: tuple[str, ...] = (), settings: dict[str, str] | None = None
                    ) -> Iterator[dict[str, Any]]:
    """Run `polarkv` with `roles` (none: all of them) on ephemeral loopback ports, in
    `workdir`, and yield its ready-file contents (manager_url, slab_address, pid, ...)."""
    service = Service(workdir, roles, settings or {})
    with running(service):
        yield service.info
