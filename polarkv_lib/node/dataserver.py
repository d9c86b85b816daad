"""The tcp data server: one-sided READ/WRITE of the slab buffer, emulated over TCP.

Blocking sockets in threads, on purpose: a READ is one `sendall` straight from the
mmap'd buffer and a WRITE is `recv_into` straight into it, both of which release the GIL
and let the kernel move the bytes. An event loop would need one wake-up per socket
buffer's worth of data; a thread needs one syscall per request. The slab's Python code
only decodes a 56-byte header and checks its grant.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from polarkv_lib.errors import AccessDenied, ProtocolError
from polarkv_lib.wire import frames, grants
from polarkv_lib.wire.frames import Status

log = structlog.get_logger("polarkv.slab")


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False on a clean EOF before the first byte, raise on a short read."""
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            if got == 0:
                return False
            raise ConnectionError("peer closed mid-frame")
        got += r
    return True


@dataclass
class DataStats:
    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    denied: int = 0
    connections: int = 0


class DataServer:
    def __init__(self, sock: socket.socket, buffer: memoryview, incarnation: int,
                 grant_key: Callable[[], bytes | None], max_connections: int) -> None:
        self._sock = sock
        self._buffer = buffer
        self._incarnation = incarnation
        self._grant_key = grant_key
        self._max_connections = max_connections
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self.stats = DataStats()
        self._acceptor = threading.Thread(target=self._accept_loop, name="slab-accept", daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping = True
        try:  # wakes the blocked accept() on Linux
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._threads)
        self._acceptor.join(timeout)
        for t in threads:
            t.join(timeout)

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if len(self._conns) >= self._max_connections or self._stopping:
                    busy = True
                else:
                    busy = False
                    self._conns.add(conn)
                    t = threading.Thread(target=self._serve, args=(conn,), name="slab-conn", daemon=True)
                    self._threads.add(t)
                    self.stats.connections += 1
            if busy:
                self._refuse(conn, Status.BUSY, "too many connections")
                conn.close()
            else:
                t.start()

    @staticmethod
    def _refuse(conn: socket.socket, status: Status, reason: str) -> None:
        msg = reason.encode()
        try:
            conn.sendall(frames.encode_response(status, len(msg)) + msg)
        except OSError:
            pass

    def _serve(self, conn: socket.socket) -> None:
        header = bytearray(frames.REQUEST_SIZE)
        hview = memoryview(header)
        try:
            while recv_exact(conn, hview):
                try:
                    op, blob = frames.decode_request(header)
                    key = self._grant_key()
                    if key is None:
                        raise AccessDenied("slab is not registered with a manager yet")
                    grant = grants.verify(blob, key, self._incarnation, len(self._buffer))
                    if grant.op != op:
                        raise AccessDenied("grant is for another operation")
                except ProtocolError as exc:
                    self._refuse(conn, Status.BAD_REQUEST, str(exc))
                    return
                except AccessDenied as exc:
                    self.stats.denied += 1
                    self._refuse(conn, Status.DENIED, str(exc))
                    return
                region = self._buffer[grant.offset: grant.offset + grant.length]
                if op is grants.Op.READ:
                    conn.sendall(frames.encode_response(Status.OK, grant.length))
                    conn.sendall(region)
                    self.stats.reads += 1
                    self.stats.bytes_read += grant.length
                else:
                    if not recv_exact(conn, region):
                        return
                    conn.sendall(frames.encode_response(Status.OK, 0))
                    self.stats.writes += 1
                    self.stats.bytes_written += grant.length
                region.release()
        except OSError as exc:
            if not self._stopping:
                log.debug("data connection closed", error=str(exc))
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
