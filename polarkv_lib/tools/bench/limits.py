"""The limits a data path is measured against, in the same run and with the same bytes:
plain loopback sockets (one 64-byte request, then the object) and memcpy.

`Buffers` holds the bytes of one object size: a source of n distinct objects (what
stores write and the limits read), the caller's load buffers, and a sink the raw server
writes into, all allocated and touched once, before any timing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import threading
import time

import xxhash

from polarkv_lib.errors import PolarKVError
from polarkv_lib.tools.bench.measure import run_threads
from polarkv_lib.transport.sockio import accept_loop, recv_exact, send_all

LIMIT_TIMEOUT = 60.0  # a stuck raw transfer is cut off after this
CALL_BYTES = 64 * 1024**2  # most bytes one batched call carries
WINDOW = 64  # objects per batched call at most: the PolarKV client's control window


def batches(size: int, n: int, conc: int) -> list[list[tuple[int, int]]]:
    """The batching every system is driven with: conc callers, each with its share of
    the n objects, in calls of up to WINDOW objects or CALL_BYTES. Per caller, its
    (first object, count) calls."""
    per = n // conc
    step = max(1, min(WINDOW, CALL_BYTES // size))
    return [
        [(i, min(step, (c + 1) * per - i)) for i in range(c * per, (c + 1) * per, step)]
        for c in range(conc)
    ]


class Buffers:
    """The bytes of one object size: a source of `n` objects (what stores write and the
    limits read), the caller's load buffers, and a sink the raw server writes into. All
    allocated and touched once, before any timing."""

    def __init__(self, size: int, n: int) -> None:
        self.size, self.n = size, n
        nbytes = size * n
        block = os.urandom(64 * 1024)
        self.src = bytearray(nbytes)
        for off in range(0, nbytes, len(block)):
            self.src[off : off + len(block)] = block[: nbytes - off]
        for i in range(n):  # every object distinct, so a misplaced one is caught
            struct.pack_into("<QQ", self.src, i * size, i, size)
        self.dst = bytearray(nbytes)
        self.sink = bytearray(nbytes)
        for buf in (self.dst, self.sink):  # fault the pages in now, not while timing
            ctypes.memset(address(buf), 0xA5, nbytes)
        self.src_view, self.dst_view = memoryview(self.src), memoryview(self.dst)
        self.sink_view = memoryview(self.sink)

    def objects(self, view: memoryview, start: int, count: int) -> list[memoryview]:
        return [view[i * self.size : (i + 1) * self.size] for i in range(start, start + count)]

    def same(self, start: int, count: int) -> bool:
        """Whether the load buffers hold the source bytes of objects [start, start+count)."""
        lo, hi = start * self.size, (start + count) * self.size
        digest = xxhash.xxh3_128_digest
        return digest(self.dst_view[lo:hi]) == digest(self.src_view[lo:hi])


def address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


# -- limits -----------------------------------------------------------------------------


def memcpy_limit(bufs: Buffers, n: int, conc: int, store: bool) -> float:
    """memcpy of n objects in conc threads: the floor under any shm transfer."""
    src, dst = (bufs.src, bufs.sink) if store else (bufs.src, bufs.dst)
    src_addr, dst_addr, size, per = address(src), address(dst), bufs.size, n // conc

    def work(c: int) -> None:
        for i in range(c * per, (c + 1) * per):
            ctypes.memmove(dst_addr + i * size, src_addr + i * size, size)

    return n * size / run_threads(conc, work, LIMIT_TIMEOUT, "limit measurement") / 1e9


# op (1 read, 2 write), offset, length, padded to 64 bytes: a WRITE's payload then starts
# cache-line aligned in the socket buffers, as a limit should (see docs/BENCHMARKS.md).
_RAW_REQ = struct.Struct("<BQQ47x")


class RawServer:
    """A plain loopback socket server: READ sends a slice of the source, WRITE receives
    into the sink. It reads whatever buffers the bench set last."""

    def __init__(self) -> None:
        self.bufs: Buffers | None = None
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = self._sock.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(
            target=accept_loop,
            args=(self._sock, self._start, lambda: self._closed),
            name="raw-accept",
            daemon=True,
        ).start()

    def _start(self, conn: socket.socket, _peer: str) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._conns.add(conn)
        threading.Thread(target=self._serve, args=(conn,), name="raw-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        req = memoryview(bytearray(_RAW_REQ.size))
        try:
            while self.bufs is not None:
                deadline = time.monotonic() + LIMIT_TIMEOUT  # an idle connection is dropped after
                recv_exact(conn, req, deadline)
                op, offset, length = _RAW_REQ.unpack(req)
                if op == 1:
                    send_all(conn, [self.bufs.src_view[offset : offset + length]], deadline)
                else:
                    recv_exact(conn, self.bufs.sink_view[offset : offset + length], deadline)
                    send_all(conn, [b"\0"], deadline)
        except (OSError, PolarKVError):  # the client closed, or a measurement was cut off
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


def socket_limit(server: RawServer, bufs: Buffers, n: int, conc: int, store: bool) -> float:
    """Plain Python sockets over loopback, n objects over conc connections."""
    server.bufs = bufs
    socks = [socket.create_connection(server.address, timeout=5.0) for _ in range(conc)]
    for s in socks:
        s.settimeout(None)  # blocking; deadlines are the kernel's (sockio), as in the client
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    size, per = bufs.size, n // conc

    def work(c: int) -> None:
        sock, ack = socks[c], memoryview(bytearray(1))
        deadline = time.monotonic() + LIMIT_TIMEOUT
        for i in range(c * per, (c + 1) * per):
            off = i * size
            if store:  # request and object in one sendmsg, as the PolarKV client sends a WRITE
                send_all(
                    sock, [_RAW_REQ.pack(2, off, size), bufs.src_view[off : off + size]], deadline
                )
                recv_exact(sock, ack, deadline)
            else:
                send_all(sock, [_RAW_REQ.pack(1, off, size)], deadline)
                recv_exact(sock, bufs.dst_view[off : off + size], deadline)

    def cut() -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    try:
        return n * size / run_threads(conc, work, LIMIT_TIMEOUT, "limit measurement", cut) / 1e9
    finally:
        for s in socks:
            s.close()
