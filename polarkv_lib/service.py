"""Start real `polarkv` processes for a benchmark, tool, demo, test or the cluster
harness, and always stop them.

The one starter: it builds the command line (`--role`, `--set`, `--ready-file`), makes
a source checkout importable, and waits for the ready file the process writes once it
serves. A `wrapper` prefix runs the command somewhere else, as the cluster harness runs
it inside a VM (`ip netns exec ... enter HOST --`, cluster/procs.py `in_vm`): every step
of the wrapper execs the next, so the pid is still the service's own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

import polarkv_lib
from polarkv_lib.errors import PolarKVError
from polarkv_lib.node.buffer import remove_stale_buffers

START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0  # the service's own shutdown bound is 10 s


class ServiceError(PolarKVError):
    """The service could not be started."""


def child_env(extra: Mapping[str, str] = {}, inherit_settings: bool = True) -> dict[str, str]:
    """The environment of a started process: this one's (without its POLARKV_* settings
    unless `inherit_settings`), a source checkout importable, and `extra` on top."""
    env = {k: v for k, v in os.environ.items() if inherit_settings or not k.startswith("POLARKV_")}
    root = Path(polarkv_lib.__file__).resolve().parent.parent
    if (root / "polarkv.py").exists():  # a source checkout: make `-m polarkv` importable
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def polarkv_argv(
    roles: Sequence[str],
    settings: Mapping[str, str | None],
    ready_file: str,
    config_file: str | os.PathLike[str] | None = None,
) -> list[str]:
    """`python -m polarkv` with these roles and `--set`s (a None value: not set)."""
    argv = [sys.executable, "-m", "polarkv"]
    for role in roles:
        argv += ["--role", role]
    if config_file is not None:
        argv += ["--config", os.fspath(config_file)]
    for key, value in settings.items():
        if value is not None:
            argv += ["--set", f"{key}={value}"]
    return [*argv, "--ready-file", ready_file]


class Service:
    """One `polarkv` subprocess on ephemeral loopback ports, in its own directory (its
    working directory: its log, its ready file and the default metadata store and disk
    path live there).

    `settings` become `--set key=value`; a None value drops the key (the config file,
    the environment or the default decides). `env` is added to this process's
    environment, `max_files` caps its open files (RLIMIT_NOFILE, through util-linux's
    `prlimit`), and `extra_args` go last on the command line.

    Where it runs: `wrapper` is a command prefix that execs the service (a VM's
    namespaces); `argv` replaces polarkv's command line with another program that writes
    the same ready file (the cluster's remote disk server); `loopback=False` leaves the
    listen addresses to `settings`; `ready_file` and `log_path` default to the workdir;
    `inherit_settings=False` drops this process's POLARKV_* variables; `append_log` keeps
    an earlier run's log (a restarted VM service); `new_session` detaches it from this
    terminal's signals; `shm_dir` is its `slab.shm_dir` (a crashed node's buffer is
    removed from there)."""

    def __init__(
        self,
        workdir: str,
        roles: Sequence[str],
        settings: Mapping[str, str | None],
        stop_timeout: float = STOP_TIMEOUT,
        start_timeout: float = START_TIMEOUT,
        *,
        env: Mapping[str, str] | None = None,
        config_file: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        max_files: int | None = None,
        wrapper: Sequence[str] = (),
        argv: Sequence[str] | None = None,
        loopback: bool = True,
        ready_file: str | os.PathLike[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        inherit_settings: bool = True,
        append_log: bool = False,
        new_session: bool = False,
        shm_dir: str = "/dev/shm",
    ) -> None:
        os.makedirs(workdir, exist_ok=True)
        self.stop_timeout = stop_timeout  # a manager with a big table flushes longer
        self.start_timeout = start_timeout
        self.started = 0.0  # time.monotonic() when the process was started
        self.workdir = workdir
        self.ready_file = os.fspath(ready_file or os.path.join(workdir, "ready.json"))
        self.log_path = os.fspath(log_path or os.path.join(workdir, "service.log"))
        base = {"manager.listen": "127.0.0.1:0", "slab.listen": "127.0.0.1:0"} if loopback else {}
        base["log.level"] = "warning"
        if argv is None:
            argv = polarkv_argv(roles, {**base, **settings}, self.ready_file, config_file)
        limit = ["prlimit", f"--nofile={max_files}:{max_files}"] if max_files is not None else []
        self._cmd = [*wrapper, *limit, *argv, *extra_args]
        self._env = dict(env or {})
        self._inherit = inherit_settings
        self._append = append_log
        self._new_session = new_session
        self._shm_dir = shm_dir  # where a killed node's buffer is left (slab.shm_dir)
        self._proc: subprocess.Popen[bytes] | None = None
        self._node_id = ""
        self.info: dict[str, Any] = {}  # the ready file's contents, once ready
        self.url = ""

    @property
    def command(self) -> list[str]:
        return list(self._cmd)

    def start(self) -> None:
        env = child_env(self._env, self._inherit)
        with contextlib.suppress(FileNotFoundError):  # a previous run's, in the same workdir
            os.unlink(self.ready_file)
        os.makedirs(os.path.dirname(self.ready_file) or ".", exist_ok=True)
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        with open(self.log_path, "ab" if self._append else "wb") as log_file:
            self.started = time.monotonic()
            self._proc = subprocess.Popen(
                self._cmd,
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=self._new_session,
            )

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The process itself (to signal it, poll it, wait for it)."""
        assert self._proc is not None, "not started"
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self) -> str:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        while not os.path.exists(self.ready_file):
            if self._proc.poll() is not None:
                raise ServiceError(
                    f"exited with {self._proc.returncode} ({self.log_path}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"not ready in {self.start_timeout:.0f}s ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.05)
        with open(self.ready_file, "rb") as fh:
            self.info = orjson.loads(fh.read())
        self._node_id = str(self.info.get("node_id", ""))
        self.url = str(self.info.get("manager_url", ""))  # none for a node without a manager
        return self.url

    def terminate(self) -> None:
        """Ask it to stop (orderly: the slab unlinks its /dev/shm buffer); stop() waits."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """kill -9: no goodbye, no final flush (what a crash looks like to the others)."""
        proc = self.proc
        if proc.poll() is None:
            proc.kill()
            proc.wait(STOP_TIMEOUT)
        self._remove_orphan_buffer()

    def stop(self) -> int | None:
        """Stop it in order and wait; kill it past `stop_timeout`. Returns its exit status
        (None if it never started); idempotent."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self.terminate()
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.returncode not in (0, -signal.SIGTERM):
            self._remove_orphan_buffer()
        return proc.returncode

    def _remove_orphan_buffer(self) -> None:
        """Killed or crashed: its /dev/shm buffer would hold the memory until reboot (its
        node id carries a random port, so no later node reclaims it)."""
        if self._node_id:
            remove_stale_buffers(self._shm_dir, self._node_id)

    def log_text(self) -> str:
        """Everything it has printed so far."""
        try:
            with open(self.log_path, errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "".join(self.log_text().splitlines(keepends=True)[-lines:])


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
def running_service(
    workdir: str, roles: tuple[str, ...] = (), settings: dict[str, str] | None = None
) -> Iterator[dict[str, Any]]:
    """Run `polarkv` with `roles` (none: all of them) on ephemeral loopback ports, in
    `workdir`, and yield its ready-file contents (manager_url, slab_address, pid, ...)."""
    service = Service(workdir, roles, settings or {})
    with running(service):
        yield service.info
