"""The slab side of the rdma transport: the buffer as one memory region, a QP per client.

The slab's /dev/shm buffer is registered once at start-up (the mmap stays exported by
the registration's anchor, so it cannot be unmapped while the HCA may touch it; close()
deregisters before the buffer is unmapped). A client opens an rdma connection by
sending a hello on the tcp data port instead of a READ/WRITE header: the data server
hands that socket here, in its own connection thread. The thread creates an RC QP,
connects it to the client's, answers with its own QP parameters and the region's
rkey, address and length, and then only waits for the socket to close, when it
destroys the QP. Transfers never reach this process.

An rkey of the whole region lets that QP read and write every byte of the buffer: the
manager's grants are then honoured by the client, not enforced here. With
`windows=True` (devices with type 2 memory windows) the region is registered without
remote access; each transfer's grant is sent here first, admitted by the same gate as a
tcp request (node/admission.py: same header deadline, same checks, same refusals), and
answered with the rkey of a window bound over exactly the granted bytes for the granted
op, on that client's QP only. That costs one round trip and a bind per transfer, and
the last window stays valid until the next request or the disconnect.
"""

from __future__ import annotations

import ctypes
import socket
import time
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from polarkv_lib.errors import PolarKVError, ProtocolError
from polarkv_lib.node.admission import Admitted, Gate
from polarkv_lib.transport import rdma_wire
from polarkv_lib.transport.rdma_verbs import (
    Hca,
    QueuePair,
    RdmaUnavailable,
    access_flags,
    buffer_address,
    errno_of,
)
from polarkv_lib.transport.rdma_wire import RemoteBuffer
from polarkv_lib.transport.sockio import recv_some, refuse, send_all
from polarkv_lib.wire import frames, grants
from polarkv_lib.wire.frames import Status

log = structlog.get_logger("polarkv.slab")

QP_DEPTH = 4  # the slab posts only window binds (and their invalidations)
BIND_TIMEOUT = 2.0


@dataclass
class RdmaStats:
    rdma_connections: int = 0
    rdma_windows: int = 0


class RdmaServer:
    """Raises RdmaUnavailable at construction where the device cannot serve the buffer."""

    def __init__(
        self,
        buffer: memoryview,
        gate: Gate,
        device: str = "",
        port: int = 1,
        gid_index: int = -1,
        windows: bool = False,
    ) -> None:
        self.hca = Hca(device, port, gid_index)
        self.gate = gate
        v = self.hca.v
        if windows and not self.hca.windows:
            self.hca.close()
            raise RdmaUnavailable(
                f"RDMA device {self.hca.name} has no type 2 memory windows "
                "(set slab.rdma_windows = false)"
            )
        self.windows = windows
        self._anchor: Any = buffer_address(buffer)
        self.address = ctypes.addressof(self._anchor)
        self.length = len(buffer)
        remote = ("MW_BIND",) if windows else ("REMOTE_READ", "REMOTE_WRITE")
        try:
            self.mr = self.hca.register(
                self.address,
                self.length,
                access_flags(v, "LOCAL_WRITE", *remote),
                "the slab buffer",
            )
        except PolarKVError:
            self._anchor = None
            self.hca.close()
            raise
        self._qp_access = access_flags(v, "LOCAL_WRITE", "REMOTE_READ", "REMOTE_WRITE")
        self.window_access = {
            grants.Op.READ: access_flags(v, "REMOTE_READ"),
            grants.Op.WRITE: access_flags(v, "REMOTE_WRITE"),
        }
        self.stats = RdmaStats()
        log.info(
            "rdma serving",
            device=self.hca.name,
            port=self.hca.port,
            bytes=self.length,
            windows=windows,
        )

    def describe(self) -> RemoteBuffer:
        """What a client is told: with windows, no rkey to the whole region."""
        rkey = 0 if self.windows else int(self.mr.rkey)
        return RemoteBuffer(rkey, self.address, self.length, self.gate.incarnation, self.windows)

    def serve(self, conn: socket.socket, hello: bytes) -> None:
        """One client's QP, for as long as its socket stays open (the caller closes it)."""
        try:
            remote, _flags = rdma_wire.decode_hello(hello)
        except ProtocolError as exc:
            refuse(conn, Status.BAD_REQUEST, str(exc))
            return
        try:
            qp = QueuePair(self.hca, QP_DEPTH, self._qp_access)
        except PolarKVError as exc:
            refuse(conn, Status.BUSY, str(exc))
            return
        window = None
        tokens: list[int] = []  # fence admissions of the bound window (at most one)
        try:
            qp.connect(remote)
            if self.windows:
                window = self._allocate_window()
            accept = rdma_wire.encode_accept(qp.params(), self.describe())
            send_all(conn, [accept], time.monotonic() + BIND_TIMEOUT)
            self.stats.rdma_connections += 1
            if window is None:
                # Nothing more is said on this socket; EOF (or anything at all) ends the
                # QP, however long that takes: no idle timeout from the data server.
                recv_some(conn, memoryview(bytearray(1)), None)
            else:
                serve_windows(conn, self.gate, _Windows(self, qp, window, tokens))
        except PolarKVError as exc:
            refuse(conn, Status.BUSY, str(exc))
        except OSError as exc:
            log.debug("rdma connection closed", error=str(exc))
        finally:
            qp.close()  # the QP first: a window is only usable through it
            if window is not None:
                window.close()
            for token in tokens:  # only now may a newer claim on its pages proceed
                self.gate.fence.leave(token)

    def _allocate_window(self) -> Any:
        v = self.hca.v
        try:
            return v.mr.MW(self.hca.pd, v.IBV_MW_TYPE_2)
        except v.error as exc:
            raise rdma_wire.setup_error(
                "allocating a memory window", errno_of(exc), str(exc)
            ) from None

    def close(self) -> None:
        """Deregister, then let the buffer go (the caller unmaps it after this)."""
        self.mr.close()
        self._anchor = None
        self.hca.close()


class _Windows:
    """One connection's memory window, bound per admitted request. The bound window
    holds that request's fence admission until it is retired (next request) or the QP
    is gone (disconnect); a newer generation's claim on its pages cuts the connection."""

    def __init__(self, server: RdmaServer, qp: QueuePair, window: Any, tokens: list[int]) -> None:
        self._server = server
        self._qp = qp
        self._window = window
        self._tokens = tokens  # the bound window's fence admission, left on retire
        self._bound: int | None = None

    def retire(self) -> None:
        """Invalidate the bound window before a new request is admitted: its own fence
        admission must not block (or cut) the next one's claim on the same pages."""
        if self._bound is not None:
            self._qp.invalidate_window(self._bound)
            self._bound = None
            self._qp.wait(time.monotonic() + BIND_TIMEOUT, "invalidating a memory window")
        while self._tokens:
            self._server.gate.fence.leave(self._tokens.pop())

    def bind(self, admitted: Admitted) -> int:
        self._tokens.append(admitted.token)
        server, grant = self._server, admitted.grant
        rkey = self._qp.bind_window(
            self._window,
            server.mr,
            server.address + grant.offset,
            grant.length,
            server.window_access[admitted.op],
        )
        self._qp.wait(time.monotonic() + BIND_TIMEOUT, "binding a memory window")
        self._bound = rkey
        server.stats.rdma_windows += 1
        return int(rkey)


class WindowBinder(Protocol):
    """The device's part of the window loop: `_Windows` on an HCA."""

    def retire(self) -> None: ...
    def bind(self, admitted: Admitted) -> int: ...


def serve_windows(conn: socket.socket, gate: Gate, windows: WindowBinder) -> None:
    """Window requests on an rdma connection, for as long as it stays open: each one
    admitted by the gate like a tcp request (the next header waited for however long
    the client stays quiet, then whole within the frame timeout) and answered with the
    rkey of a window over exactly its grant. A refused request ends the connection."""
    header = bytearray(frames.REQUEST_SIZE)
    while gate.receive(conn, memoryview(header), None):
        windows.retire()
        admitted = gate.admit(conn, header)
        if admitted is None:
            return
        rkey = windows.bind(admitted)
        send_all(conn, [rdma_wire.encode_window(rkey)], time.monotonic() + BIND_TIMEOUT)


def start(
    buffer: memoryview, gate: Gate, device: str, port: int, gid_index: int, windows: bool
) -> RdmaServer:
    """The slab's rdma side; where it cannot run, a start-up error naming the reason
    (rdma is offered only when slab.transports lists it)."""
    try:
        return RdmaServer(buffer, gate, device, port, gid_index, windows)
    except PolarKVError as exc:
        raise RdmaUnavailable(f"slab.transports includes rdma, but {exc}") from None
