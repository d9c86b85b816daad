"""The rdma transport: one-sided RDMA READ/WRITE straight into a slab's registered buffer.

The paper's data path: once a client's queue pair is connected, a transfer is one work
request that the two HCAs carry out; neither the slab's CPU nor the client's copies a
byte. Per slab, pooled connections as in tcp: each is a tcp socket to the slab's data
port (the exchange in rdma_wire, then kept open as the QP's lifeline) and one RC queue
pair with its own CQ. A connection is used by one transfer thread at a time.

Client buffers are registered once and kept: engines hand the same pinned buffers
again and again, and registering costs far more than a transfer. A registration keeps
a reference to the caller's buffer (so its address cannot be reused by other memory
while the HCA may write there) and is dropped least-recently-used beyond
`max_registered` bytes. Read-only sources (bytes) cannot be registered for the HCA
from Python; they go through a per-connection staging buffer (one copy).

A transfer that fails or runs out of time destroys its queue pair before the error is
raised: after that no late RDMA READ can land in a buffer the caller has taken back.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from polarkv_lib.errors import (
    AccessDenied,
    NetworkError,
    OperationTimeout,
    PolarKVError,
    ProtocolError,
)
from polarkv_lib.transport import rdma_wire
from polarkv_lib.transport.base import NodeTarget, Region, Transport
from polarkv_lib.transport.pool import IdlePool
from polarkv_lib.transport.rdma_verbs import Hca, QueuePair, access_flags, buffer_address
from polarkv_lib.transport.rdma_wire import RemoteBuffer
from polarkv_lib.transport.sockio import recv_exact, remaining, send_all
from polarkv_lib.wire import frames
from polarkv_lib.wire.frames import Status
from polarkv_lib.wire.grants import Op

SEND_DEPTH = 64  # WRs in flight per QP: one transfer, split at the port's message size
STAGING_MIN = 1 << 20
DEFAULT_MAX_REGISTERED = 8 * 1024**3


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def _read_answer(sock: socket.socket, expected: int, address: str, deadline: float) -> bytes:
    """A frames response; OK must carry exactly `expected` bytes, errors carry a reason."""
    status, length = frames.decode_response(_recv(sock, frames.RESPONSE_SIZE, deadline))
    if status is not Status.OK:
        reason = _recv(sock, min(length, 4096), deadline).decode(errors="replace")
        if status is Status.DENIED:
            raise AccessDenied(f"slab {address} refused: {reason}")
        raise ProtocolError(f"slab {address} answered {status.name}: {reason}")
    if length != expected:
        raise ProtocolError(f"slab {address} sent a {length}-byte answer, expected {expected}")
    return _recv(sock, length, deadline)


@dataclass
class _Registration:
    start: int
    end: int
    mr: Any
    anchor: Any  # ctypes view over the caller's buffer: keeps it exported and alive
    users: int = 0


class Registrations:
    """Client buffers registered with the HCA, found again by address range."""

    def __init__(self, hca: Hca, max_bytes: int) -> None:
        self._hca = hca
        self._max = max_bytes
        self._entries: OrderedDict[tuple[int, int], _Registration] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._access = access_flags(hca.v, "LOCAL_WRITE")

    def acquire(self, view: memoryview) -> tuple[int, _Registration]:
        """(address, registration) covering the writable buffer `view`; release after use."""
        anchor = buffer_address(view)
        address = ctypes.addressof(anchor)
        end = address + len(view)
        entry: _Registration | None
        with self._lock:
            for key, entry in self._entries.items():
                if entry.start <= address and end <= entry.end:
                    self._entries.move_to_end(key)
                    entry.users += 1
                    return address, entry
        mr = self._hca.register(address, len(view), self._access, "a client buffer")
        with self._lock:
            entry = self._entries.get((address, end))
            if entry is not None:  # another thread registered the same range meanwhile
                entry.users += 1
            else:
                entry = self._entries[address, end] = _Registration(address, end, mr, anchor, 1)
                self._bytes += len(view)
                mr = None
                self._evict()
        if mr is not None:
            mr.close()
        assert entry is not None
        return address, entry

    def release(self, entry: _Registration) -> None:
        with self._lock:
            entry.users -= 1
            self._evict()

    def _evict(self) -> None:
        for key in list(self._entries):
            if self._bytes <= self._max:
                return
            entry = self._entries[key]
            if entry.users == 0:
                del self._entries[key]
                self._bytes -= entry.end - entry.start
                entry.mr.close()
                entry.anchor = None  # the buffer is the caller's again

    @property
    def registered_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        with self._lock:
            for entry in self._entries.values():
                entry.mr.close()
                entry.anchor = None
            self._entries.clear()
            self._bytes = 0


class _Connection:
    def __init__(self, sock: socket.socket, qp: QueuePair, remote: RemoteBuffer) -> None:
        self.sock, self.qp, self.remote = sock, qp, remote
        self.staging: bytearray | None = None

    def alive(self) -> bool:
        """Whether the slab still holds the QP: it closes the socket when it drops it
        (restart, eviction), and a transfer on a dead QP would wait out its deadline."""
        try:
            self.sock.settimeout(None)  # with a timeout, Python would poll before recv
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.qp.close()  # first: no work request of it may touch memory after this
        self.sock.close()


def _close_quietly(conn: _Connection) -> None:
    with contextlib.suppress(PolarKVError):  # tearing down a QP the HCA already dropped
        conn.close()


class RdmaTransport(Transport):
    """Raises RdmaUnavailable at construction where no RDMA device is usable."""

    name = "rdma"

    def __init__(
        self,
        device: str = "",
        port: int = 1,
        gid_index: int = -1,
        max_idle_per_node: int = 8,
        max_registered: int = DEFAULT_MAX_REGISTERED,
    ) -> None:
        self._hca = Hca(device, port, gid_index)
        self._registrations = Registrations(self._hca, max_registered)
        self._pool: IdlePool[tuple[str, int], _Connection] = IdlePool(
            max_idle_per_node, _close_quietly
        )
        v = self._hca.v
        self._opcodes = {Op.READ: v.IBV_WR_RDMA_READ, Op.WRITE: v.IBV_WR_RDMA_WRITE}

    def usable(self, node: NodeTarget) -> bool:
        return "rdma" in node.transports

    @property
    def device(self) -> str:
        return self._hca.name

    def _connect(self, node: NodeTarget, deadline: float) -> _Connection:
        while (conn := self._pool.take((node.address, node.incarnation))) is not None:
            if conn.alive():
                return conn
            conn.close()
        host, _, port = node.address.rpartition(":")
        try:
            sock = socket.create_connection(
                (host.strip("[]"), int(port)), timeout=remaining(deadline)
            )
        except OSError as exc:
            raise NetworkError(f"cannot connect to slab {node.address}: {exc}") from None
        qp = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            qp = QueuePair(self._hca, SEND_DEPTH, access_flags(self._hca.v, "LOCAL_WRITE"))
            sock.settimeout(None)  # blocking: sockio bounds each call by the deadline
            send_all(sock, (rdma_wire.encode_hello(qp.params()),), deadline)
            body = _read_answer(sock, rdma_wire.ACCEPT_SIZE, node.address, deadline)
            remote_qp, remote = rdma_wire.decode_accept(body)
            if remote.incarnation != node.incarnation:
                raise NetworkError(f"slab {node.address} restarted (incarnation changed)")
            qp.connect(remote_qp)
            return _Connection(sock, qp, remote)
        except BaseException as exc:
            if qp is not None:
                qp.close()
            sock.close()
            if isinstance(exc, (TimeoutError, OperationTimeout)):
                raise OperationTimeout(
                    f"rdma exchange with slab {node.address} timed out"
                ) from None
            if isinstance(exc, OSError):
                raise NetworkError(
                    f"rdma exchange with slab {node.address} failed: {exc}"
                ) from None
            raise

    def _checkin(self, node: NodeTarget, conn: _Connection) -> None:
        self._pool.give((node.address, node.incarnation), conn)

    def _window(
        self, conn: _Connection, op: Op, grant: bytes, address: str, deadline: float
    ) -> int:
        """Ask the slab to bind a window over exactly this grant; its rkey."""
        try:
            send_all(conn.sock, (frames.encode_request(op, grant),), deadline)
            return rdma_wire.decode_window(
                _read_answer(conn.sock, rdma_wire.WINDOW_SIZE, address, deadline)
            )
        except (TimeoutError, OperationTimeout):
            raise OperationTimeout(f"window request to slab {address} timed out") from None
        except OSError as exc:
            raise NetworkError(f"window request to slab {address} failed: {exc}") from None

    def _transfer(self, region: Region, op: Op, view: memoryview, deadline: float) -> None:
        if len(view) != region.size:
            raise ValueError(f"buffer of {len(view)} bytes for a region of {region.size}")
        if op is Op.READ and view.readonly:
            raise ValueError("cannot read into a read-only buffer")
        remaining(deadline)
        node = region.node
        conn = self._connect(node, deadline)
        keep = True  # until something is in flight: a refused grant leaves it clean
        entry = None
        try:
            t = rdma_wire.target(conn.remote, region.grant, op, region.offset, region.size)
            rkey = conn.remote.rkey
            if conn.remote.windows:  # a refusal closes the socket on the slab's side
                keep = False
                rkey = self._window(conn, op, region.grant, node.address, deadline)
                keep = True
            local = view
            if view.readonly:  # a write from bytes: through the staging buffer
                if conn.staging is None or len(conn.staging) < len(view):
                    conn.staging = bytearray(max(len(view), STAGING_MIN))
                local = memoryview(conn.staging)[: len(view)]
                local[:] = view
            address, entry = self._registrations.acquire(local)
            keep = False
            conn.qp.post_rdma(
                self._opcodes[op], address, int(entry.mr.lkey), t.address, rkey, t.length
            )
            conn.qp.wait(deadline, f"rdma {op.name.lower()} with slab {node.address}")
            keep = True
        finally:
            if keep:
                self._checkin(node, conn)
            else:
                conn.close()  # before the buffer goes back to the caller
            if entry is not None:
                self._registrations.release(entry)

    def read_into(self, region: Region, view: memoryview, deadline: float) -> None:
        self._transfer(region, Op.READ, view, deadline)

    def write_from(self, region: Region, view: memoryview, deadline: float) -> None:
        self._transfer(region, Op.WRITE, view, deadline)  # the client hashes the source

    def close(self) -> None:
        self._pool.close()
        self._registrations.close()
        self._hca.close()
