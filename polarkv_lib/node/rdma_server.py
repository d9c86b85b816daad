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
remote access; each transfer's grant is sent here first, verified like a tcp request,
and answered with the rkey of a window bound over exactly the granted bytes for the
granted op, on that client's QP only. That costs one round trip and a bind per
transfer, and the last window stays valid until the next request or the disconnect.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import structlog

from polarkv_lib.errors import AccessDenied, PolarKVError, ProtocolError
from polarkv_lib.node.fence import Fence
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
from polarkv_lib.wire import frames, grants
from polarkv_lib.wire.frames import Status

log = structlog.get_logger("polarkv.slab")

QP_DEPTH = 4  # the slab posts only window binds (and their invalidations)
BIND_TIMEOUT = 2.0
_FOREVER = struct.pack("@ll", 0, 0)  # SO_RCVTIMEO of zero: no timeout


@dataclass
class RdmaStats:
    rdma_connections: int = 0
    rdma_windows: int = 0
    rdma_denied: int = 0


class RdmaServer:
    """Raises RdmaUnavailable at construction where the device cannot serve the buffer."""

    def __init__(
        self,
        buffer: memoryview,
        incarnation: int,
        grant_key: Callable[[], bytes | None],
        device: str = "",
        port: int = 1,
        gid_index: int = -1,
        windows: bool = False,
        fence: Fence | None = None,
    ) -> None:
        self.hca = Hca(device, port, gid_index)
        self._fence = fence or Fence(len(buffer))
        v = self.hca.v
        if windows and not self.hca.windows:
            self.hca.close()
            raise RdmaUnavailable(
                f"RDMA device {self.hca.name} has no type 2 memory windows "
                "(set slab.rdma_windows = false)"
            )
        self.windows = windows
        self._incarnation = incarnation
        self._grant_key = grant_key
        self._anchor: Any = buffer_address(buffer)
        self.address = ctypes.addressof(self._anchor)
        self.length = len(buffer)
        remote = ("MW_BIND",) if windows else ("REMOTE_READ", "REMOTE_WRITE")
        try:
            self._mr = self.hca.register(
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
        self._window_access = {
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
        rkey = 0 if self.windows else int(self._mr.rkey)
        return RemoteBuffer(rkey, self.address, self.length, self._incarnation, self.windows)

    def serve(self, conn: socket.socket, hello: bytes) -> None:
        """One client's QP, for as long as its socket stays open (the caller closes it)."""
        try:
            remote, _flags = rdma_wire.decode_hello(hello)
        except ProtocolError as exc:
            _refuse(conn, Status.BAD_REQUEST, str(exc))
            return
        try:
            qp = QueuePair(self.hca, QP_DEPTH, self._qp_access)
        except PolarKVError as exc:
            _refuse(conn, Status.BUSY, str(exc))
            return
        window = None
        tokens: list[int] = []  # fence admissions of the bound window (at most one)
        try:
            qp.connect(remote)
            if self.windows:
                window = self._allocate_window()
            # The socket lives as long as the QP: no idle timeout from the data server.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _FOREVER)
            conn.settimeout(BIND_TIMEOUT)
            conn.sendall(rdma_wire.encode_accept(qp.params(), self.describe()))
            conn.settimeout(None)
            self.stats.rdma_connections += 1
            if window is None:
                # Nothing more is said on this socket; EOF (or anything at all) ends the QP.
                conn.recv(1)
            else:
                self._bind_loop(conn, qp, window, tokens)
        except PolarKVError as exc:
            _refuse(conn, Status.BUSY, str(exc))
        except OSError as exc:
            log.debug("rdma connection closed", error=str(exc))
        finally:
            qp.close()  # the QP first: a window is only usable through it
            if window is not None:
                window.close()
            for token in tokens:  # only now may a newer claim on its pages proceed
                self._fence.leave(token)

    def _allocate_window(self) -> Any:
        v = self.hca.v
        try:
            return v.mr.MW(self.hca.pd, v.IBV_MW_TYPE_2)
        except v.error as exc:
            raise rdma_wire.setup_error(
                "allocating a memory window", errno_of(exc), str(exc)
            ) from None

    def _bind_loop(
        self, conn: socket.socket, qp: QueuePair, window: Any, tokens: list[int]
    ) -> None:
        """Bind the connection's window for each verified grant. The bound window holds
        a fence admission for its pages until it is invalidated (next request) or the QP
        is gone (disconnect); a newer generation's claim on them cuts this connection."""
        header = bytearray(frames.REQUEST_SIZE)
        bound: int | None = None
        while _recv_header(conn, memoryview(header)):
            try:
                op, blob = frames.decode_request(header)
                key = self._grant_key()
                if key is None:
                    raise AccessDenied("slab is not registered with a manager yet")
                grant = grants.verify(blob, key, self._incarnation, self.length)
                if grant.op != op:
                    raise AccessDenied("grant is for another operation")
                if bound is not None:  # retire the previous window before claiming anew:
                    qp.invalidate_window(bound)  # its own admission must not block this one
                    bound = None
                    qp.wait(time.monotonic() + BIND_TIMEOUT, "invalidating a memory window")
                    while tokens:
                        self._fence.leave(tokens.pop())
                tokens.append(
                    self._fence.enter(
                        grant.offset,
                        grant.length,
                        grant.gen,
                        claim=op is grants.Op.WRITE,
                        abort=partial(_cut, conn),
                    )
                )
            except ProtocolError as exc:
                _refuse(conn, Status.BAD_REQUEST, str(exc))
                return
            except AccessDenied as exc:
                self.stats.rdma_denied += 1
                _refuse(conn, Status.DENIED, str(exc))
                return
            rkey = qp.bind_window(
                window, self._mr, self.address + grant.offset, grant.length, self._window_access[op]
            )
            qp.wait(time.monotonic() + BIND_TIMEOUT, "binding a memory window")
            bound = rkey
            self.stats.rdma_windows += 1
            conn.sendall(rdma_wire.encode_window(rkey))

    def close(self) -> None:
        """Deregister, then let the buffer go (the caller unmaps it after this)."""
        self._mr.close()
        self._anchor = None
        self.hca.close()


def _cut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _recv_header(conn: socket.socket, view: memoryview) -> bool:
    """The next window request's header, however long the client stays quiet; False
    on a clean close between requests."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            if got:
                raise ProtocolError("client closed mid-request")
            return False
        got += n
    return True


def _refuse(conn: socket.socket, status: Status, reason: str) -> None:
    msg = reason.encode()[:4096]
    try:
        conn.sendall(frames.encode_response(status, len(msg)) + msg)
    except OSError:
        pass


def start(
    buffer: memoryview,
    incarnation: int,
    grant_key: Callable[[], bytes | None],
    device: str,
    port: int,
    gid_index: int,
    windows: bool,
    fence: Fence | None = None,
) -> RdmaServer:
    """The slab's rdma side; where it cannot run, a start-up error naming the reason
    (rdma is offered only when slab.transports lists it)."""
    try:
        return RdmaServer(buffer, incarnation, grant_key, device, port, gid_index, windows, fence)
    except PolarKVError as exc:
        raise RdmaUnavailable(f"slab.transports includes rdma, but {exc}") from None
