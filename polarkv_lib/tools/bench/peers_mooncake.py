"""Mooncake Store as a peer of `polarkv bench peers`: `mooncake_master`, a memory-node
process that contributes the memory segment, and a client using the zero-copy batch
calls (`batch_put_from` / `batch_get_into` on registered buffers), protocol tcp.

The master's HTTP metadata server binds every interface whatever it is told, so all
Mooncake processes run in a private network namespace with only loopback up
(`unshare -n`; `unshare -rn` for a user without root): nothing of it can be reached
from outside, and its fixed ports collide with nothing. The bench process talks to the
client (a worker process in that namespace) over a pipe, one JSON line per command; the
worker fills and verifies its own buffers, laid out like the bench's.

    python -m polarkv_lib.tools.bench.peers_mooncake worker|node ...   (started by the bench)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import orjson

from polarkv_lib.tools.bench.limits import Buffers, address, batches
from polarkv_lib.tools.bench.measure import run_threads
from polarkv_lib.tools.bench.peers_base import Peer, PeerUnavailable

START_TIMEOUT = 90.0  # master, memory node and client; each registers with the master
REPLY_TIMEOUT = 120.0  # one command: at most one timed store or load of all objects
OP_TIMEOUT = 60.0
MASTER_PORT, METADATA_PORT, METRICS_PORT = 50051, 8080, 9003  # inside the private namespace
METADATA_URL = f"http://127.0.0.1:{METADATA_PORT}/metadata"
LOCAL_BUFFER = 16 * 1024**2
ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_FORCE_TCP": "1"}  # loopback, tcp transport only


def _master_binary() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return beside if os.access(beside, os.X_OK) else shutil.which("mooncake_master")


class MooncakePeer(Peer):
    """The bench's side: starts the worker in a private namespace and drives it."""

    def __init__(self, workdir: str, conc: int, segment: int) -> None:
        self.name = "mooncake"
        if importlib.util.find_spec("mooncake") is None or _master_binary() is None:
            raise PeerUnavailable(
                "mooncake-transfer-engine-non-cuda is not installed (scripts/setup-peers)"
            )
        unshare = shutil.which("unshare")
        if unshare is None or shutil.which("ip") is None:
            raise PeerUnavailable(
                "needs unshare and ip (util-linux, iproute2) for a private network namespace"
            )
        ns = [unshare, "-n"] if os.geteuid() == 0 else [unshare, "-rn"]
        self._log_path = os.path.join(workdir, "mooncake.log")
        env = {**os.environ, **ENV}
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [
                    *ns,
                    sys.executable,
                    "-m",
                    "polarkv_lib.tools.bench.peers_mooncake",
                    "worker",
                    "--conc",
                    str(conc),
                    "--segment",
                    str(segment),
                    "--workdir",
                    workdir,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
        self._lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, name="mooncake-reader", daemon=True).start()
        try:
            self._reply(START_TIMEOUT)
        except PeerUnavailable:
            self.close()
            raise

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(b"")

    def _log_tail(self) -> str:
        try:
            with open(self._log_path, errors="replace") as fh:
                lines = [
                    ln for ln in fh.read().splitlines() if ln[:1] in ("E", "F") or "rror" in ln
                ]
        except OSError:
            return ""
        return " | ".join(lines[-3:])

    def _reply(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise PeerUnavailable(
                f"mooncake worker silent for {timeout:.0f}s; {self._log_tail()}"
            ) from None
        if not line:
            raise PeerUnavailable(f"mooncake worker exited; {self._log_tail()}")
        reply: dict[str, Any] = orjson.loads(line)
        if "error" in reply:
            raise PeerUnavailable(f"mooncake: {reply['error']}; {self._log_tail()}")
        return reply

    def _call(self, **command: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(orjson.dumps(command) + b"\n")
            self._proc.stdin.flush()
        except OSError:
            raise PeerUnavailable(f"mooncake worker gone; {self._log_tail()}") from None
        return self._reply(REPLY_TIMEOUT)

    def store(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int]:
        self._prepare(bufs.size, bufs.n)
        r = self._call(op="store", n=n, tag=tag)
        return float(r["seconds"]), int(r["stored"])

    def load(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int, bool]:
        self._prepare(bufs.size, bufs.n)
        r = self._call(op="load", n=n, tag=tag)
        return float(r["seconds"]), int(r["hits"]), bool(r["exact"])

    def forget(self, n: int, tag: int) -> None:
        self._call(op="forget", n=n, tag=tag)

    def _prepare(self, size: int, n: int) -> None:
        if getattr(self, "_prepared", None) != (size, n):
            self._call(op="prepare", size=size, n=n)
            self._prepared = (size, n)

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self._proc.stdin is not None
                self._proc.stdin.close()  # the worker stops its master and node on EOF
            try:
                self._proc.wait(15.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()  # the namespace and everything in it go with its processes
                self._proc.wait()


# -- inside the namespace ---------------------------------------------------------------


def _wait_port(port: int, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while True:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), timeout=1.0),
        ):
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"mooncake_master did not listen on {port}")
        time.sleep(0.1)


def _setup(segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1", METADATA_URL, segment, LOCAL_BUFFER, "tcp", "", f"127.0.0.1:{MASTER_PORT}"
    )
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


class _Worker:
    """The client inside the namespace: the same buffers, batching and callers as the
    other peers, with the objects' bytes checked after every load."""

    def __init__(self, store: Any, conc: int) -> None:
        self.store = store
        self.conc = conc
        self.bufs: Buffers | None = None

    def prepare(self, size: int, n: int) -> dict[str, Any]:
        if self.bufs is not None:
            for buf in (self.bufs.src, self.bufs.dst):
                self.store.unregister_buffer(address(buf))
        self.bufs = Buffers(size, n)
        for buf in (self.bufs.src, self.bufs.dst):
            rc = self.store.register_buffer(address(buf), len(buf))
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
        return {}

    @staticmethod
    def _keys(tag: int, start: int, count: int) -> list[str]:
        return [f"pk-{tag}-{start + j}" for j in range(count)]

    def store_(self, n: int, tag: int) -> dict[str, Any]:
        bufs = self.bufs
        assert bufs is not None
        plan, stored = batches(bufs.size, n, self.conc), [0] * self.conc
        src = address(bufs.src)

        def work(c: int) -> None:
            for start, count in plan[c]:
                rcs = self.store.batch_put_from(
                    self._keys(tag, start, count),
                    [src + (start + j) * bufs.size for j in range(count)],
                    [bufs.size] * count,
                )
                stored[c] += sum(1 for rc in rcs if rc == 0)

        seconds = run_threads(self.conc, work, OP_TIMEOUT, "mooncake store")
        return {"seconds": seconds, "stored": sum(stored)}

    def load(self, n: int, tag: int) -> dict[str, Any]:
        bufs = self.bufs
        assert bufs is not None
        plan = batches(bufs.size, n, self.conc)
        hits: list[list[tuple[int, int]]] = [[] for _ in range(self.conc)]
        ctypes.memset(address(bufs.dst), 0, len(bufs.dst))  # a load that did nothing would show
        dst = address(bufs.dst)

        def work(c: int) -> None:
            for start, count in plan[c]:
                got = self.store.batch_get_into(
                    self._keys(tag, start, count),
                    [dst + (start + j) * bufs.size for j in range(count)],
                    [bufs.size] * count,
                )
                prefix = 0  # as a KV prefix: up to the first object that did not arrive whole
                while prefix < count and got[prefix] == bufs.size:
                    prefix += 1
                hits[c].append((start, prefix))

        seconds = run_threads(self.conc, work, OP_TIMEOUT, "mooncake load")
        flat = [h for per in hits for h in per]
        exact = all(bufs.same(start, count) for start, count in flat if count)
        return {"seconds": seconds, "hits": sum(count for _, count in flat), "exact": exact}

    def forget(self, n: int, tag: int) -> dict[str, Any]:
        # force: the gets' leases (Mooncake's default, 10 s) would otherwise keep them
        rcs = self.store.batch_remove(self._keys(tag, 0, n), True)
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"batch_remove failed for {sum(1 for rc in rcs if rc != 0)} keys")
        return {}


def _serve(worker: _Worker, commands: IO[bytes], replies: IO[bytes]) -> None:
    for line in commands:
        cmd = orjson.loads(line)
        try:
            op = cmd.pop("op")
            handler: Callable[..., dict[str, Any]] = {
                "prepare": worker.prepare,
                "store": worker.store_,
                "load": worker.load,
                "forget": worker.forget,
            }[op]
            reply = handler(**cmd)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(orjson.dumps(reply) + b"\n")
        replies.flush()


def _worker_main(conc: int, segment: int, workdir: str) -> None:
    # Protocol lines go to the original stdout; anything the C++ side prints goes to stderr.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        master = _master_binary()
        assert master is not None
        deadline = time.monotonic() + START_TIMEOUT / 2
        procs.append(
            subprocess.Popen(
                [
                    master,
                    f"--rpc_port={MASTER_PORT}",
                    "--rpc_address=127.0.0.1",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={METADATA_PORT}",
                    f"--metrics_port={METRICS_PORT}",
                    "--metrics_host=127.0.0.1",
                ],
                stdin=subprocess.DEVNULL,
                stdout=2,
                stderr=2,
                cwd=workdir,
            )
        )
        _wait_port(MASTER_PORT, procs[0], deadline)
        _wait_port(METADATA_PORT, procs[0], deadline)
        node = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "polarkv_lib.tools.bench.peers_mooncake",
                "node",
                "--segment",
                str(segment),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=2,
        )
        procs.append(node)
        assert node.stdout is not None
        if (
            node.stdout.readline().strip() != b"ready"
        ):  # the node prints it once its segment is mounted
            raise RuntimeError("the memory node did not start")
        worker = _Worker(
            _setup(0), conc
        )  # the client contributes no memory: all of it is the node's
    except Exception as exc:
        replies.write(orjson.dumps({"error": f"{type(exc).__name__}: {exc}"}) + b"\n")
        replies.flush()
        raise SystemExit(1) from None
    else:
        replies.write(b'{"ready": true}\n')
        replies.flush()
        _serve(worker, sys.stdin.buffer, replies)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _node_main(segment: int) -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    store = _setup(segment)
    replies.write(b"ready\n")
    replies.flush()
    sys.stdin.buffer.read()  # serve until the worker closes our stdin or goes away
    store.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("role", choices=("worker", "node"))
    parser.add_argument("--conc", type=int, default=1)
    parser.add_argument("--segment", type=int, required=True)
    parser.add_argument("--workdir", default=".")
    args = parser.parse_args(argv)
    if args.role == "worker":
        _worker_main(args.conc, args.segment, args.workdir)
    else:
        _node_main(args.segment)


if __name__ == "__main__":
    main()
