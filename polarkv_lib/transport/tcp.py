"""The tcp transport: framed READ/WRITE requests to a slab's data server.

Pooled connections per slab address; a connection that saw any error is closed, never
returned to the pool (its stream position is unknown). Reads land with `recv_into`
directly in the caller's buffer; writes go out with `sendmsg` from the caller's buffer.

While the cores are not all busy moving bytes (a lone read, or at most one in flight
per two cores: a receiver and, on loopback, its sender each have one), a read is received in
pieces and each is hashed as soon as it is in, still in the CPU's cache: the checksum
read_into returns and read_many hands over. With more reads in flight the cores are
the limit, and one receive per object (fewer wake-ups) then hashed by the client
measured as fast or faster (docs/BENCHMARKS.md).

A pooled connection may have been closed by the slab meanwhile (its idle timeout, or
to make room for a new connection): a request whose pooled connection fails before any
byte of the answer arrived is tried once more on a fresh connection. READ and WRITE of
a granted region are idempotent, so the retry is safe.

Partial sends and receives are bounded by the deadline in `sockio` (kernel timeouts on
blocking sockets, one syscall per object, or per piece of one hashed as it lands).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator, Sequence

from polarkv_lib.errors import (
    AccessDenied,
    NetworkError,
    OperationTimeout,
    PolarKVError,
    ProtocolError,
)
from polarkv_lib.transport.base import Arrived, NodeTarget, Region, Transport, checksum_stream
from polarkv_lib.transport.pool import IdlePool
from polarkv_lib.transport.sockio import recv_exact, remaining, send_all
from polarkv_lib.wire import frames
from polarkv_lib.wire.frames import Status
from polarkv_lib.wire.grants import Op

# READ requests a connection carries ahead of the answer being read (read_many): one is
# enough for the slab to find the next request waiting when it has sent an answer.
PIPELINE = 2
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, max_idle_per_node: int = 8) -> None:
        self._pool: IdlePool[str, socket.socket] = IdlePool(max_idle_per_node, socket.socket.close)
        self._reads = 0  # read_into and read_many calls in flight
        self._reads_lock = threading.Lock()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[bool]:
        """A read in flight; whether it hashes its bytes as they arrive (module doc)."""
        with self._reads_lock:
            self._reads += 1
            hashed = self._reads * 2 <= max(_CORES, 2)  # a lone read does, on any machine
        try:
            yield hashed
        finally:
            with self._reads_lock:
                self._reads -= 1

    def usable(self, node: NodeTarget) -> bool:
        return "tcp" in node.transports

    def _connect(
        self, address: str, deadline: float, fresh: bool = False
    ) -> tuple[socket.socket, bool]:
        """A connection to `address` and whether it came from the pool."""
        if not fresh and (sock := self._pool.take(address)) is not None:
            return sock, True
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection(
                (host.strip("[]"), int(port)), timeout=remaining(deadline)
            )
        except OSError as exc:
            raise NetworkError(f"cannot connect to slab {address}: {exc}") from None
        try:
            sock.settimeout(None)  # blocking from here on; _arm bounds each call
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            sock.close()
            raise NetworkError(f"cannot set up the connection to slab {address}: {exc}") from None
        return sock, False

    def _checkin(self, address: str, sock: socket.socket) -> None:
        self._pool.give(address, sock)

    def _exchange(
        self, region: Region, op: Op, view: memoryview, deadline: float, hashed: bool = False
    ) -> str | None:
        if len(view) != region.size:
            raise ValueError(f"buffer of {len(view)} bytes for a region of {region.size}")
        sock, pooled = self._connect(region.node.address, deadline)
        if pooled:
            try:
                return self._attempt(sock, region, op, view, deadline, hashed)
            except _Stale:
                pass  # closed by the slab while pooled: once more on a fresh connection
            sock, _ = self._connect(region.node.address, deadline, fresh=True)
        try:
            return self._attempt(sock, region, op, view, deadline, hashed)
        except _Stale as exc:
            raise NetworkError(str(exc)) from None

    def _attempt(
        self,
        sock: socket.socket,
        region: Region,
        op: Op,
        view: memoryview,
        deadline: float,
        hashed: bool,
    ) -> str | None:
        """One request on `sock`; the socket goes back to the pool only after a clean
        exchange (its stream position is unknown after any error)."""
        ok = False
        try:
            with _mapped(region, answered=False):
                request = frames.encode_request(op, region.grant)
                send_all(sock, (request, view) if op is Op.WRITE else (request,), deadline)
            digest = _answer(sock, region, op, view, deadline, hashed)
            ok = True
            return digest
        finally:
            if ok:
                self._checkin(region.node.address, sock)
            else:
                sock.close()

    def read_many(
        self,
        moves: Sequence[tuple[Region, memoryview]],
        deadline: float,
        arrived: Arrived | None = None,
    ) -> list[PolarKVError | None]:
        """READs of one slab over one connection, PIPELINE requests ahead: the slab
        finds the next request waiting when it has sent an answer, instead of idling a
        round trip per region. After the first fault the connection is dropped and the
        regions not yet answered are read one by one (read_into: a fresh connection,
        each its own answer), so a failure costs no other region its read."""
        if len(moves) < 2 or len({r.node.address for r, _ in moves}) != 1:
            return super().read_many(moves, deadline, arrived)
        for region, view in moves:
            if len(view) != region.size:
                raise ValueError(f"buffer of {len(view)} bytes for a region of {region.size}")
        with self._reading() as hashed:
            errors = self._pipelined(moves, deadline, arrived, hashed)
        if len(errors) < len(moves):  # the connection failed: the rest one by one
            later = None if arrived is None else _shifted(arrived, len(errors))
            return errors + super().read_many(moves[len(errors) :], deadline, later)
        return errors

    def _pipelined(
        self,
        moves: Sequence[tuple[Region, memoryview]],
        deadline: float,
        arrived: Arrived | None,
        hashed: bool,
    ) -> list[PolarKVError | None]:
        """read_many's one connection: each region's outcome up to the first fault that
        ends the connection (the refusal of a region is its outcome; a lost connection
        is nobody's), so fewer outcomes than regions if it ended early."""
        errors: list[PolarKVError | None] = []
        address = moves[0][0].node.address
        try:
            sock, _ = self._connect(address, deadline)
        except PolarKVError as exc:  # no connection for any of them
            return [exc] * len(moves)
        sent = 0
        try:
            while len(errors) < len(moves):
                while sent < len(moves) and sent - len(errors) < PIPELINE:
                    region = moves[sent][0]
                    with _mapped(region, answered=bool(errors)):
                        send_all(sock, (frames.encode_request(Op.READ, region.grant),), deadline)
                    sent += 1
                region, view = moves[len(errors)]
                digest = _answer(sock, region, Op.READ, view, deadline, hashed)
                errors.append(None)
                if arrived is not None:
                    arrived(len(errors) - 1, digest)
        except PolarKVError as exc:
            sock.close()
            if isinstance(exc, AccessDenied | ProtocolError):  # the slab's answer to this one
                errors.append(exc)
            return errors
        except BaseException:
            sock.close()
            raise
        self._checkin(address, sock)
        return errors

    def read_into(self, region: Region, view: memoryview, deadline: float) -> str | None:
        with self._reading() as hashed:
            return self._exchange(region, Op.READ, view, deadline, hashed)

    def write_from(self, region: Region, view: memoryview, deadline: float) -> None:
        self._exchange(region, Op.WRITE, view, deadline)  # the client hashes the source

    def close(self) -> None:
        self._pool.close()


def _shifted(arrived: Arrived, by: int) -> Arrived:
    """`arrived` for the regions from index `by` on, read by a later call."""
    return lambda i, digest: arrived(by + i, digest)


class _Stale(NetworkError):
    """The connection was closed before any byte of the answer arrived."""


@contextlib.contextmanager
def _mapped(region: Region, answered: bool) -> Iterator[None]:
    """Socket errors as the transport's: a reset before any byte of an answer is a
    stale pooled connection (_Stale: worth one retry), after it a NetworkError."""
    address = region.node.address
    try:
        yield
    except (ConnectionResetError, BrokenPipeError) as exc:
        if answered:
            raise NetworkError(f"transfer with slab {address} failed: {exc}") from None
        raise _Stale(f"slab {address} reset the connection: {exc}") from None
    except OperationTimeout:
        raise OperationTimeout(f"transfer with slab {address} timed out") from None
    except TimeoutError:
        raise OperationTimeout(f"transfer with slab {address} timed out") from None
    except OSError as exc:
        raise NetworkError(f"transfer with slab {address} failed: {exc}") from None


def _answer(
    sock: socket.socket,
    region: Region,
    op: Op,
    view: memoryview,
    deadline: float,
    hashed: bool,
) -> str | None:
    """Receive the slab's answer to one request: for a READ, its bytes into `view`, and
    (`hashed`) their checksum, taken as they arrive."""
    address = region.node.address
    header = bytearray(frames.RESPONSE_SIZE)
    with _mapped(region, answered=False):
        try:
            recv_exact(sock, memoryview(header), deadline)
        except NetworkError as exc:
            raise _Stale(f"slab {address} closed the connection: {exc}") from None
    with _mapped(region, answered=True):
        status, length = frames.decode_response(header)
        if status is not Status.OK:
            reason = bytearray(min(length, frames.MAX_REASON))
            try:
                recv_exact(sock, memoryview(reason), deadline)
            except (OSError, NetworkError, OperationTimeout):
                pass
            text = reason.decode(errors="replace")
            if status is Status.DENIED:
                raise AccessDenied(f"slab {address} refused: {text}")
            raise ProtocolError(f"slab {address} answered {status.name}: {text}")
        if op is not Op.READ:
            return None
        if length != region.size:
            raise ProtocolError(f"slab sent {length} bytes for a {region.size}-byte region")
        if not hashed:
            recv_exact(sock, view, deadline)
            return None
        hasher = checksum_stream()
        recv_exact(sock, view, deadline, hasher)
        return hasher.hexdigest()
