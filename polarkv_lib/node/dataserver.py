"""The tcp data server: one-sided READ/WRITE of the slab buffer, emulated over TCP.

Blocking sockets in threads, on purpose: a READ is one `sendmsg` of the response header
and the region straight from the mmap'd buffer, and a WRITE one `recv_into(MSG_WAITALL)`
straight into it; each releases the GIL once and lets the kernel move the whole object.
An event loop would need one wake-up per socket buffer's worth of data; a thread needs
one syscall per request. The slab's Python code only decodes a 56-byte header and checks
its grant.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from polarkv_lib.errors import AccessDenied, ProtocolError
from polarkv_lib.wire import frames, grants
from polarkv_lib.wire.frames import Status

log = structlog.get_logger("polarkv.slab")


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False on a clean EOF before the first byte, raise on a short read.
    MSG_WAITALL: the kernel fills the whole view in one call (the socket is blocking), so
    a WRITE's payload costs one syscall and one GIL release, not one per segment batch."""
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if r == 0:
            if got == 0:
                return False
            raise ConnectionError("peer closed mid-frame")
        got += r
    return True


def send_all(sock: socket.socket, header: bytes, payload: memoryview) -> None:
    """Send a response header and its payload with one sendmsg (and the rest, if the
    kernel took less): the payload leaves straight from the slab buffer."""
    sent = sock.sendmsg([header, payload])
    if sent < len(header):
        sock.sendall(memoryview(header)[sent:])
        sent = len(header)
    if sent - len(header) < len(payload):
        sock.sendall(payload[sent - len(header):])


# Linux's values; Python 3.11's socket module does not export them.
_SO_ZEROCOPY = getattr(socket, "SO_ZEROCOPY", 60)
_MSG_ZEROCOPY = getattr(socket, "MSG_ZEROCOPY", 0x4000000)
_EXTENDED_ERR = struct.Struct("=IBBBBII")  # struct sock_extended_err (linux/errqueue.h)
_ORIGIN_ZEROCOPY = 5  # SO_EE_ORIGIN_ZEROCOPY


class Responder:
    """Sends one connection's response headers so that payloads stay cache-line aligned.

    The kernel copies what a thread sends into that thread's page fragment, right after
    the bytes it sent before. A 12-byte response header therefore shifts every payload
    byte that follows 12 bytes off the alignment it has in the slab buffer (and usually
    in the reader's buffer), and the kernel's copies run markedly slower between
    differently aligned addresses: with four readers of 4 MiB objects on loopback, a
    12-byte header in front of each cost about a third of the throughput (measurements
    in docs/BENCHMARKS.md). The wire format keeps its 12-byte header, so the header is
    sent zero-copy instead (MSG_ZEROCOPY: the kernel references this buffer rather than
    copying it into the fragment) and the fragment stays where the previous payload
    left it: payloads whose sizes are multiples of 64 bytes, as KV chunks are, stay
    aligned.

    The kernel may read the buffer until it reports the send complete on the socket's
    error queue, so it is rewritten only when no zero-copy send is outstanding; otherwise,
    and where zero-copy is not available, the header is sent the ordinary way.
    """

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._buffer = bytearray(frames.RESPONSE_SIZE)
        self._outstanding = 0
        self._zerocopy = sys.platform.startswith("linux")
        if self._zerocopy:
            try:
                conn.setsockopt(socket.SOL_SOCKET, _SO_ZEROCOPY, 1)
            except OSError:
                self._zerocopy = False

    def send(self, status: Status, length: int, payload: memoryview | None = None) -> None:
        header = frames.encode_response(status, length)
        if self._zerocopy and self._reaped():
            self._buffer[:] = header
            try:
                sent = self._conn.sendmsg([self._buffer], [], _MSG_ZEROCOPY)
            except OSError:  # e.g. ENOBUFS: nothing was sent; stop trying on this socket
                self._zerocopy = False
            else:
                self._outstanding += 1
                if sent < len(header):
                    self._conn.sendall(header[sent:])
                if payload is not None:
                    self._conn.sendall(payload)
                return
        if payload is not None:
            send_all(self._conn, header, payload)
        else:
            self._conn.sendall(header)

    def _reaped(self) -> bool:
        """Collect completion notices without blocking; True once none is outstanding."""
        while self._outstanding:
            try:
                _, ancillary, _, _ = self._conn.recvmsg(
                    0, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            for _level, _kind, data in ancillary:
                if len(data) >= _EXTENDED_ERR.size:
                    _, origin, _, _, _, first, last = _EXTENDED_ERR.unpack_from(data)
                    if origin == _ORIGIN_ZEROCOPY:  # sends first..last are complete
                        self._outstanding -= (last - first) % 2**32 + 1  # u32 counters
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
        responder = Responder(conn)
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
                    responder.send(Status.OK, grant.length, region)
                    self.stats.reads += 1
                    self.stats.bytes_read += grant.length
                else:
                    if not recv_exact(conn, region):
                        return
                    responder.send(Status.OK, 0)  # through it too: keeps reads aligned
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
