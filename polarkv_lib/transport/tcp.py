"""The tcp transport: framed READ/WRITE requests to a slab's data server.

Pooled connections per slab address; a connection that saw any error is closed, never
returned to the pool (its stream position is unknown). Reads land with `recv_into`
directly in the caller's buffer; writes go out with `sendall` from the caller's buffer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import defaultdict

from polarkv_lib.errors import AccessDenied, NetworkError, OperationTimeout, ProtocolError
from polarkv_lib.transport.base import NodeTarget, Region, Transport
from polarkv_lib.wire import frames
from polarkv_lib.wire.frames import Status
from polarkv_lib.wire.grants import Op


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise OperationTimeout("deadline passed")
    return left


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got, n = 0, len(view)
    while got < n:
        sock.settimeout(_remaining(deadline))
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise NetworkError("slab closed the connection")
        got += r


def _send_all(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    view = memoryview(data)
    sent = 0
    while sent < len(view):
        sock.settimeout(_remaining(deadline))
        sent += sock.send(view[sent:])


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
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
            if op is Op.WRITE:
                _send_all(sock, request, deadline)
                _send_all(sock, view, deadline)
            else:
                _send_all(sock, request, deadline)
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
        except TimeoutError:
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
