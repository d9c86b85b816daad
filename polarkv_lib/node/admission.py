"""Admission to the slab buffer: the one gate every request on the tcp data port passes,
whether it is a tcp READ/WRITE (node/dataserver.py) or a memory-window request on an
rdma connection (node/rdma_server.py).

A request is a 64-byte header (wire/frames.py) carrying a grant. The gate receives the
header (its first byte may be waited for as long as the caller allows; the rest must
follow within `slab.frame_timeout`), decodes it, verifies the grant (signed with the
grant key, this slab's incarnation, inside the buffer, not expired, the op it names)
and enters the fence for the bytes it covers (no newer entry holds them). Whatever fails
is answered with a reason (wire/frames.py: BAD_REQUEST or DENIED, the reason cut to
MAX_REASON bytes) and the caller closes the connection: both paths refuse the same
frames the same way, because they share this code.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from polarkv_lib.errors import AccessDenied, NetworkError, OperationTimeout, ProtocolError
from polarkv_lib.node.fence import Fence
from polarkv_lib.transport.sockio import cut, recv_exact, recv_some, refuse
from polarkv_lib.wire import frames, grants
from polarkv_lib.wire.frames import Status


@dataclass
class GateStats:
    denied: int = 0  # grants refused: forged, foreign, expired, outside, wrong op, fenced
    bad_requests: int = 0  # not a data-plane request, or a header cut short
    slow_headers: int = 0  # a header not whole within slab.frame_timeout


@dataclass(frozen=True, slots=True)
class Admitted:
    op: grants.Op
    grant: grants.Grant
    token: int  # the fence admission: `gate.fence.leave(token)` once the use is over


class Gate:
    def __init__(
        self,
        size: int,
        incarnation: int,
        grant_keys: Callable[[], Sequence[bytes]],
        frame_timeout: float,
        fence: Fence | None = None,
    ) -> None:
        self.size = size
        self.fence = fence or Fence(size)
        self.frame_timeout = frame_timeout
        self.incarnation = incarnation
        self._grant_keys = grant_keys  # those of the manager incarnations registered with
        self.stats = GateStats()

    def receive(self, sock: socket.socket, view: memoryview, idle: float | None) -> bool:
        """The next request header into `view`. Its first byte is waited for `idle`
        seconds (None: however long the client stays quiet; past it, OperationTimeout),
        the rest for frame_timeout. False when the connection is done: closed by the
        client between requests, or a header cut short or too slow, answered here."""
        got = recv_some(sock, view, idle)
        if got == 0:
            return False
        if got == len(view):
            return True
        try:
            recv_exact(sock, view[got:], time.monotonic() + self.frame_timeout)
        except OperationTimeout:
            self.stats.slow_headers += 1
            refuse(
                sock,
                Status.BAD_REQUEST,
                f"request header not whole within {self.frame_timeout:g}s",
            )
            return False
        except NetworkError:
            self.stats.bad_requests += 1
            refuse(sock, Status.BAD_REQUEST, "request header cut short")
            return False
        return True

    def admit(self, sock: socket.socket, header: bytes | bytearray) -> Admitted | None:
        """The request in `header`, admitted to its bytes; None once it was refused (and
        answered). A newer entry's claim on those bytes cuts `sock` short."""
        try:
            op, blob = frames.decode_request(header)
            keys = self._grant_keys()
            if not keys:
                raise AccessDenied("slab is not registered with a manager yet")
            grant = grants.verify(blob, keys, self.incarnation, self.size)
            if grant.op != op:
                raise AccessDenied("grant is for another operation")
            token = self.fence.enter(
                grant.offset,
                grant.length,
                grant.gen,
                claim=op is grants.Op.WRITE,
                abort=partial(cut, sock),
            )
        except ProtocolError as exc:
            self.stats.bad_requests += 1
            refuse(sock, Status.BAD_REQUEST, str(exc))
            return None
        except AccessDenied as exc:
            self.stats.denied += 1
            refuse(sock, Status.DENIED, str(exc))
            return None
        return Admitted(op, grant, token)
