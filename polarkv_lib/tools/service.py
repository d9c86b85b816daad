"""Start a real `polarkv` process for a benchmark or tool, and always stop it."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson

import polarkv_lib
from polarkv_lib.node.buffer import buffer_path

START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


class ServiceError(RuntimeError):
    """The service could not be started."""


@contextlib.contextmanager
def running_service(workdir: str, roles: tuple[str, ...] = (), settings: dict[str, str] | None = None
                    ) -> Iterator[dict[str, object]]:
    """Run `polarkv` with `roles` (none: all of them) on ephemeral loopback ports, in
    `workdir`, and yield its ready-file contents (manager_url, slab_address, ...)."""
    ready = os.path.join(workdir, "ready.json")
    env = dict(os.environ)
    root = Path(polarkv_lib.__file__).resolve().parent.parent
    if (root / "polarkv.py").exists():  # a source checkout: make `-m polarkv` importable
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "polarkv"]
    for role in roles:
        cmd += ["--role", role]
    base = {"manager.listen": "127.0.0.1:0", "slab.listen": "127.0.0.1:0", "log.level": "warning"}
    for key, value in {**base, **(settings or {})}.items():
        cmd += ["--set", f"{key}={value}"]
    cmd += ["--ready-file", ready]
    log_path = os.path.join(workdir, "service.log")
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=subprocess.STDOUT)
    node_id = ""
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(ready):
            if proc.poll() is not None:
                raise ServiceError(f"polarkv exited with {proc.returncode}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise ServiceError(f"polarkv not ready in {START_TIMEOUT:.0f}s:\n{_tail(log_path)}")
            time.sleep(0.05)
        with open(ready, "rb") as fh:
            info: dict[str, object] = orjson.loads(fh.read())
        node_id = str(info.get("node_id", ""))
        yield info
    finally:
        _stop(proc, node_id)


def _stop(proc: subprocess.Popen[bytes], node_id: str) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # orderly: the slab unlinks its /dev/shm buffer
        try:
            proc.wait(STOP_TIMEOUT)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if node_id and proc.returncode not in (0, -signal.SIGTERM):
        # Killed or crashed: its buffer file would hold the memory until reboot.
        pattern = buffer_path("/dev/shm", node_id, 0).replace("0" * 16, "*")
        for path in glob.glob(pattern):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""
