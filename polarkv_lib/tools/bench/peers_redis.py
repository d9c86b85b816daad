"""Redis as a peer of `polarkv bench peers`: a `redis-server` that the bench starts on a
free loopback port (no persistence, nothing else on it), driven by redis-py with plain
GET/SET (one round trip per object) or pipelined (one pipeline per batch)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from typing import Any

from polarkv_lib.tools.bench.limits import Buffers, batches
from polarkv_lib.tools.bench.measure import run_threads
from polarkv_lib.tools.bench.peers_base import Peer, PeerUnavailable

START_TIMEOUT = 10.0
OP_TIMEOUT = 60.0  # one timed store or load of all objects


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """`redis-server` on 127.0.0.1 in `workdir`, with `maxmemory` and LRU eviction, no
    snapshots and no AOF; always stopped by close()."""

    def __init__(self, workdir: str, maxmemory: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise PeerUnavailable("redis-server is not installed (scripts/setup-peers)")
        try:
            import redis  # noqa: F401  (the client library; checked before starting anything)
        except ImportError:
            raise PeerUnavailable(
                "redis-py is not installed (pip install 'polarkv[bench]')"
            ) from None
        self.port = _free_port()
        self._log = os.path.join(workdir, "redis.log")
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                [
                    binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--protected-mode",
                    "yes",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    workdir,
                    "--maxmemory",
                    str(maxmemory),
                    "--maxmemory-policy",
                    "allkeys-lru",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                with open(self._log, errors="replace") as fh:
                    raise PeerUnavailable(f"redis-server did not start: {fh.read()[-300:]}")
            time.sleep(0.05)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class RedisPeer(Peer):
    """conc connections, one thread each; `pipelined` sends a batch's commands in one
    pipeline (no MULTI), otherwise one command and its reply per object."""

    def __init__(self, server: RedisServer, conc: int, pipelined: bool) -> None:
        import redis

        self.name = "redis-pipelined" if pipelined else "redis"
        self.conc = conc
        self.pipelined = pipelined
        self._clients: list[Any] = [
            redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=OP_TIMEOUT)
            for _ in range(conc)
        ]

    @staticmethod
    def _key(tag: int, i: int) -> str:
        return f"pk:{tag}:{i}"

    def store(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int]:
        plan = batches(bufs.size, n, self.conc)
        stored = [0] * self.conc

        def work(c: int) -> None:
            client = self._clients[c]
            for start, count in plan[c]:
                objects = bufs.objects(bufs.src_view, start, count)
                if self.pipelined:
                    pipe = client.pipeline(transaction=False)
                    for j, obj in enumerate(objects):
                        pipe.set(self._key(tag, start + j), obj)
                    stored[c] += sum(1 for ok in pipe.execute() if ok)
                else:
                    for j, obj in enumerate(objects):
                        stored[c] += bool(client.set(self._key(tag, start + j), obj))

        seconds = run_threads(self.conc, work, OP_TIMEOUT, "redis store", self._cut)
        return seconds, sum(stored)

    def load(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int, bool]:
        plan = batches(bufs.size, n, self.conc)
        hits: list[list[tuple[int, int]]] = [[] for _ in range(self.conc)]
        wrong_size = [0]

        def work(c: int) -> None:
            client = self._clients[c]
            for start, count in plan[c]:
                keys = [self._key(tag, start + j) for j in range(count)]
                if self.pipelined:
                    pipe = client.pipeline(transaction=False)
                    for key in keys:
                        pipe.get(key)
                    values = pipe.execute()
                else:
                    values = [client.get(key) for key in keys]
                # The caller's buffers are where an engine needs the bytes: copy them there.
                # A prefix stops at the first miss, as a KV prefix does.
                got = 0
                for j, value in enumerate(values):
                    if value is None:
                        break
                    if len(value) != bufs.size:
                        wrong_size[0] += 1
                        break
                    off = (start + j) * bufs.size
                    bufs.dst_view[off : off + bufs.size] = value
                    got += 1
                hits[c].append((start, got))

        seconds = run_threads(self.conc, work, OP_TIMEOUT, "redis load", self._cut)
        flat = [h for per in hits for h in per]
        exact = not wrong_size[0] and all(bufs.same(start, count) for start, count in flat if count)
        return seconds, sum(count for _, count in flat), exact

    def forget(self, n: int, tag: int) -> None:
        """Untimed: drop a round's keys so rounds never evict each other's."""
        keys = [self._key(tag, i) for i in range(n)]
        for k in range(0, len(keys), 512):
            self._clients[0].delete(*keys[k : k + 512])

    def _cut(self) -> None:
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.connection_pool.disconnect()

    def close(self) -> None:
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
