"""The tcp data server: one-sided READ/WRITE of the slab buffer, emulated over TCP.

Blocking sockets in threads, on purpose: a READ is one `sendmsg` of the response header
and the region straight from the mmap'd buffer, and a WRITE one `recv_into(MSG_WAITALL)`
straight into it; each releases the GIL once and lets the kernel move the whole object.
An event loop would need one wake-up per socket buffer's worth of data; a thread needs
one syscall per request. The slab's Python code only decodes a 64-byte header and checks
its grant (and, through the fence, that no newer entry holds the space it names): the
gate of node/admission.py, shared with the rdma window requests on this port.

A READ's payload must keep moving: a peer that takes nothing of it for
`slab.send_timeout` is cut off (and what the kernel still holds for it dropped), and
one client host may have at most `slab.max_bytes_in_flight_per_peer` of READs not yet
taken (node/connections.py); past that its READs are refused BUSY. So readers that
never read hold a bounded part of the slab's connections and memory, and for a bounded
time, while every other host is served.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from polarkv_lib.config import SlabConfig
from polarkv_lib.errors import OperationTimeout, PolarKVError
from polarkv_lib.logs import Events, RateLimiter
from polarkv_lib.node.admission import Gate
from polarkv_lib.node.connections import Conn, ConnTable
from polarkv_lib.transport import rdma_wire
from polarkv_lib.transport.sockio import accept_loop, close, cut, recv_exact, refuse, send_all
from polarkv_lib.wire import frames, grants
from polarkv_lib.wire.frames import Status

if TYPE_CHECKING:
    from polarkv_lib.node.rdma_server import RdmaServer

log = structlog.get_logger("polarkv.slab")
MIN_RATE = 1024**2  # bytes/s: the slowest link a payload is waited for (beyond frame_timeout)
ACCEPT_ERROR_LOG_INTERVAL = 10.0
DRAIN = 1.0  # seconds requests in flight may take to finish at shutdown


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

    def __init__(self, conn: socket.socket, stall: float) -> None:
        self._conn = conn
        self._stall = stall
        self._buffer = bytearray(frames.RESPONSE_SIZE)
        self._outstanding = 0
        self._zerocopy = sys.platform.startswith("linux")
        if self._zerocopy:
            try:
                conn.setsockopt(socket.SOL_SOCKET, _SO_ZEROCOPY, 1)
            except OSError:
                self._zerocopy = False

    def send(
        self, status: Status, length: int, payload: memoryview | None, deadline: float
    ) -> None:
        header = frames.encode_response(status, length)
        rest: list[bytes | memoryview] = [header]
        if self._zerocopy and self._reaped():
            self._buffer[:] = header
            try:
                sent = self._conn.sendmsg([self._buffer], [], _MSG_ZEROCOPY)
            except OSError:  # e.g. ENOBUFS: nothing was sent; stop trying on this socket
                self._zerocopy = False
            else:
                self._outstanding += 1
                rest = [memoryview(header)[sent:]]
        if payload is not None:
            rest.append(payload)
        # one sendmsg: header and payload together
        send_all(self._conn, rest, deadline, self._stall)

    def _reaped(self) -> bool:
        """Collect completion notices without blocking; True once none is outstanding."""
        while self._outstanding:
            try:
                _, ancillary, _, _ = self._conn.recvmsg(
                    0, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT
                )
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
    connections: int = 0
    refused: int = 0  # full of connections that were all mid-request
    evicted: int = 0  # idle connections closed to make room
    busy_reads: int = 0  # READs refused: their host had its bytes in flight
    timeouts: int = 0  # idle past slab.idle_timeout, or a payload that stalled or was late
    accept_errors: int = 0


class DataServer:
    """Accepts connections in one thread and serves each in its own (see the module
    docstring for why threads); `gate` admits each request, `limits` bounds how many
    connections and bytes, and for how long."""

    def __init__(
        self,
        sock: socket.socket,
        buffer: memoryview,
        gate: Gate,
        limits: SlabConfig,
        rdma: RdmaServer | None = None,
    ) -> None:
        self._sock = sock
        self.rdma = rdma  # set: a hello (rdma_wire) on a connection hands it to rdma.serve
        self._buffer = buffer
        self.gate = gate
        self.fence = gate.fence
        self._idle_timeout = limits.idle_timeout
        self._frame_timeout = gate.frame_timeout
        self._send_timeout = limits.send_timeout
        self._table = ConnTable(
            limits.max_connections,
            limits.max_connections_per_peer,
            limits.max_bytes_in_flight_per_peer,
        )
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._errors = RateLimiter(log, ACCEPT_ERROR_LOG_INTERVAL)
        self.stats = DataStats()
        self._acceptor = threading.Thread(target=self._accept_loop, name="slab-accept", daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    def stop(self, timeout: float = 2.0, drain: float = DRAIN) -> None:
        """Stop accepting; close idle connections at once and let requests in flight
        finish for up to `drain` seconds (then they are cut: their clients miss); then
        wait for the threads."""
        self._stopping = True
        with contextlib.suppress(OSError):  # wakes the blocked accept() on Linux
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        deadline = time.monotonic() + drain
        while conns := self._table.all():
            late = time.monotonic() > deadline
            for conn in conns:
                if late or conn.idle_since is not None:
                    cut(conn.sock)
            if late:
                break
            time.sleep(0.01)
        self._acceptor.join(timeout)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)

    def _accept_loop(self) -> None:
        accept_loop(self._sock, self._admit, lambda: self._stopping, self._accept_failed)

    def _accept_failed(self, exc: OSError) -> None:
        self.stats.accept_errors += 1
        self._errors.error(Events.ACCEPT_FAILED, error=str(exc))

    def _admit(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            return
        conn, victim = (None, None) if self._stopping else self._table.admit(sock, peer)
        if victim is not None:
            self.stats.evicted += 1
            self._errors.warning(Events.CONNECTION_EVICTED, peer=victim.peer)
            cut(victim.sock)  # its thread wakes up and closes it
        if conn is None:
            self.stats.refused += 1
            self._errors.warning(
                Events.CONNECTION_REFUSED, peer=peer, reason="too many connections"
            )
            refuse(sock, Status.BUSY, "too many connections")
            sock.close()
            return
        t = threading.Thread(target=self._serve, args=(conn,), name="slab-conn", daemon=True)
        with self._lock:
            self._threads.add(t)
        self.stats.connections += 1
        t.start()

    def _serve(self, conn: Conn) -> None:
        sock = conn.sock
        header = bytearray(frames.REQUEST_SIZE)
        hview = memoryview(header)
        responder = Responder(sock, self._send_timeout)
        try:
            while self.gate.receive(sock, hview, self._idle_timeout) and self._table.busy(conn):
                if self.rdma is not None and rdma_wire.is_hello(header):
                    self._table.idle(conn)  # a QP's lifeline: evictable, cut at once on stop
                    self.rdma.serve(sock, bytes(header))
                    return
                if not self._transfer(conn, responder, header):
                    return
                self._table.idle(conn)
                if self._stopping:  # drained: no next request on this connection
                    return
        except OperationTimeout:
            self.stats.timeouts += 1
        except (OSError, PolarKVError) as exc:
            if not self._stopping and not conn.evicted:
                log.debug(Events.CONNECTION_CLOSED, error=str(exc))
        finally:
            self._table.remove(conn)  # before the close: the table may ask its socket
            close(sock)
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _transfer(self, conn: Conn, responder: Responder, header: bytearray) -> bool:
        """One request, admitted and moved; False once it was refused (and answered)."""
        admitted = self.gate.admit(conn.sock, header)
        if admitted is None:
            return False
        try:
            if admitted.op is grants.Op.WRITE:
                self._write(conn, responder, admitted.grant)
                return True
            return self._read(conn, responder, admitted.grant)
        finally:
            self.fence.leave(admitted.token)

    def _read(self, conn: Conn, responder: Responder, grant: grants.Grant) -> bool:
        if not self._table.reserve(conn, grant.length):
            self.stats.busy_reads += 1
            limit = self._table.max_bytes_per_peer
            refuse(conn.sock, Status.BUSY, f"this host has {limit} bytes of reads in flight")
            return False
        try:
            with self._buffer[grant.offset : grant.offset + grant.length] as region:
                responder.send(Status.OK, grant.length, region, self._deadline(grant))
        finally:
            self._table.sent(conn)
        self.stats.reads += 1
        self.stats.bytes_read += grant.length
        return True

    def _write(self, conn: Conn, responder: Responder, grant: grants.Grant) -> None:
        deadline = self._deadline(grant)
        with self._buffer[grant.offset : grant.offset + grant.length] as region:
            recv_exact(conn.sock, region, deadline)
        responder.send(Status.OK, 0, None, deadline)  # through it too: keeps reads aligned
        self.stats.writes += 1
        self.stats.bytes_written += grant.length

    def _deadline(self, grant: grants.Grant) -> float:
        """A payload may take as long as a slow but honest link needs, no longer."""
        return time.monotonic() + self._frame_timeout + grant.length / MIN_RATE
