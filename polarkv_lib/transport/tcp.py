"""The tcp transport: framed READ/WRITE requests to a slab's data server.

Pooled connections per slab address; a connection that saw any error is closed, never
returned to the pool (its stream position is unknown). Reads land with `recv_into`
directly in the caller's buffer; writes go out with `sendmsg` from the caller's buffer.

Sockets stay in blocking mode and the deadline is enforced by the kernel
(SO_RCVTIMEO / SO_SNDTIMEO, re-armed with the time left before every blocking call),
not by Python's socket timeouts: those put the socket in non-blocking mode and cost a
poll() plus a wake-up into Python for every piece of a transfer the kernel hands over,
which on loopback is a few hundred per 16 MiB object. Blocking, a whole payload is one
`recv_into(..., MSG_WAITALL)` or one `sendmsg`: the kernel copies as the bytes arrive and
the GIL is released for the whole object.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

from polarkv_lib.errors import AccessDenied, NetworkError, OperationTimeout, ProtocolError
from polarkv_lib.transport.base import NodeTarget, Region, Transport
from polarkv_lib.wire import frames
from polarkv_lib.wire.frames import Status
from polarkv_lib.wire.grants import Op

_TIMEVAL = struct.Struct("@ll")  # struct timeval on Linux and the BSDs (time_t, suseconds_t)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise OperationTimeout("deadline passed")
    return left


def _arm(sock: socket.socket, option: int, deadline: float) -> None:
    """Bound the next blocking call on `sock` by the time left until `deadline`. A call
    that runs out returns what it moved so far, or fails with EAGAIN if nothing."""
    left = _remaining(deadline)
    seconds = int(left)
    micros = max(int((left - seconds) * 1_000_000), 0 if seconds else 1)  # 0 would mean forever
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(seconds, micros))


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill `view`: one recv for the whole of it unless the deadline or a signal cuts
    the wait short, in which case the loop re-arms with what is left."""
    got, n = 0, len(view)
    while got < n:
        _arm(sock, socket.SO_RCVTIMEO, deadline)
        r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if r == 0:
            raise NetworkError("slab closed the connection")
        got += r


def _send_all(sock: socket.socket, parts: Sequence[bytes | memoryview], deadline: float) -> None:
    """Send `parts` back to back: one sendmsg, so a WRITE's header and payload leave in
    one call (and the header never travels as a segment of its own)."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        _arm(sock, socket.SO_SNDTIMEO, deadline)
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, max_idle_per_node: int = 8) -> None:
        self._idle: dict[str, list[socket.socket]] = defaultdict(list)
        self._lock = threading.Lock()
        self._max_idle = max_idle_per_node
        self._closed = False

    def usable(self, node: NodeTarget) -> bool:
        return "tcp" in node.transports

    def _connect(self, address: str, deadline: float) -> socket.socket:
        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop()
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=_remaining(deadline))
        except OSError as exc:
            raise NetworkError(f"cannot connect to slab {address}: {exc}") from None
        try:
            sock.settimeout(None)  # blocking from here on; _arm bounds each call
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            sock.close()
            raise NetworkError(f"cannot set up the connection to slab {address}: {exc}") from None
        return sock

    def _checkin(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle[address]
            if not self._closed and len(idle) < self._max_idle:
                idle.append(sock)
                return
        sock.close()

    def _exchange(self, region: Region, op: Op, view: memoryview, deadline: float) -> None:
        if len(view) != region.size:
            raise ValueError(f"buffer of {len(view)} bytes for a region of {region.size}")
        address = region.node.address
        sock = self._connect(address, deadline)
        ok = False
        try:
            request = frames.encode_request(op, region.grant)
            _send_all(sock, (request, view) if op is Op.WRITE else (request,), deadline)
            header = bytearray(frames.RESPONSE_SIZE)
            _recv_exact(sock, memoryview(header), deadline)
            status, length = frames.decode_response(header)
            if status is not Status.OK:
                reason = bytearray(min(length, 4096))
                try:
                    _recv_exact(sock, memoryview(reason), deadline)
                except (OSError, NetworkError, OperationTimeout):
                    pass
                text = reason.decode(errors="replace")
                if status is Status.DENIED:
                    raise AccessDenied(f"slab {address} refused: {text}")
                raise ProtocolError(f"slab {address} answered {status.name}: {text}")
            if op is Op.READ:
                if length != region.size:
                    raise ProtocolError(f"slab sent {length} bytes for a {region.size}-byte region")
                _recv_exact(sock, view, deadline)
            ok = True
        except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_*TIMEO ran out
            raise OperationTimeout(f"transfer with slab {address} timed out") from None
        except OSError as exc:
            raise NetworkError(f"transfer with slab {address} failed: {exc}") from None
        finally:
            if ok:
                self._checkin(address, sock)
            else:
                sock.close()

    def read_into(self, region: Region, view: memoryview, deadline: float) -> None:
        self._exchange(region, Op.READ, view, deadline)

    def write_from(self, region: Region, view: memoryview, deadline: float) -> None:
        self._exchange(region, Op.WRITE, view, deadline)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for s in socks:
            s.close()
