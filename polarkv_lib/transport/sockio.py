"""Partial I/O, written once: fill a buffer from a socket, send a list of buffers, both
bounded by an absolute deadline; the same bookkeeping for vectored file writes; and
the accept loop of a threaded server, with what it does to the connections it serves
(answer a refusal, cut one short from another thread, close one whose peer stopped
reading).

Sockets stay in blocking mode and deadlines are enforced by the kernel (SO_RCVTIMEO /
SO_SNDTIMEO, re-armed with the time left before every blocking call), not by Python's
socket timeouts: those put the socket in non-blocking mode and cost a poll() plus a
wake-up into Python for every piece of a transfer the kernel hands over, which on
loopback is a few hundred per 16 MiB object. Blocking, a whole payload is one
`recv_into(..., MSG_WAITALL)` or one `sendmsg`: the kernel copies as the bytes arrive and
the GIL is released for the whole object (a payload hashed as it lands: one receive per
128 KiB piece).

A call that runs out of time raises OperationTimeout; a peer that closes mid-buffer
raises NetworkError; other socket errors stay OSError for the caller to map.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import struct
import termios
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from polarkv_lib.errors import NetworkError, OperationTimeout
from polarkv_lib.wire import frames
from polarkv_lib.wire.frames import Status


class Hasher(Protocol):
    """A streaming hash (xxhash's xxh3_64): what recv_exact feeds each piece to."""

    def update(self, data: memoryview, /) -> None: ...


# Bytes received per recv when they are hashed as they land: well inside a core's L2
# cache. Over loopback, 16 MiB objects received in pieces and each hashed at once moved
# as fast as unhashed ones, 30% faster than received whole and hashed after; 128 KiB
# pieces beat 64, 192, 256 and 512 KiB ones on a 1 MiB-L2 machine (on one with a larger
# L2, 64 and 256 KiB had measured alike; docs/BENCHMARKS.md).
HASH_SLICE = 128 * 1024
_TIMEVAL = struct.Struct("@ll")  # struct timeval on Linux and the BSDs (time_t, suseconds_t)
_FOREVER = _TIMEVAL.pack(0, 0)  # a zero timeval: no timeout
_LINGER_RESET = struct.pack("@ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, drops the queue
_COUNT = struct.Struct("@i")
# A stalled send is noticed within this fraction of its bound: each wait on the peer
# lasts at most bound * STALL_SLICE before the loop looks at the clock again.
STALL_SLICE = 0.25
REFUSAL_WAIT = 1.0  # seconds a refusal is given to leave; it is a courtesy, never waited on

# accept() errors that mean "out of resources for now", not "the socket is gone".
RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF = 0.05


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise OperationTimeout("deadline passed")
    return left


def arm(sock: socket.socket, option: int, deadline: float) -> None:
    """Bound the next blocking call on `sock` by the time left until `deadline`. A call
    that runs out returns what it moved so far, or fails with EAGAIN if nothing."""
    arm_seconds(sock, option, remaining(deadline))


def arm_seconds(sock: socket.socket, option: int, seconds: float) -> None:
    whole = int(seconds)
    micros = max(int((seconds - whole) * 1_000_000), 0 if whole else 1)  # 0 would mean forever
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(whole, micros))


def recv_exact(
    sock: socket.socket, view: memoryview, deadline: float, hasher: Hasher | None = None
) -> None:
    """Fill `view`: one recv for the whole of it unless the deadline or a signal cuts
    the wait short, in which case the loop re-arms with what is left. With a `hasher`,
    in HASH_SLICE pieces, each fed to it as soon as it is in: still in the CPU's cache,
    where a hash of the whole object afterwards reads most of it from memory again."""
    got, n = 0, len(view)
    piece = n if hasher is None else HASH_SLICE
    try:
        while got < n:
            arm(sock, socket.SO_RCVTIMEO, deadline)
            end = min(got + piece, n)
            r = sock.recv_into(view[got:end], end - got, socket.MSG_WAITALL)
            if r == 0:
                raise NetworkError("peer closed the connection" + (" mid-frame" if got else ""))
            if hasher is not None:
                hasher.update(view[got : got + r])
            got += r
    except BlockingIOError:  # SO_RCVTIMEO ran out with nothing more received
        raise OperationTimeout(f"received {got} of {n} bytes before the deadline") from None


def recv_some(sock: socket.socket, view: memoryview, wait: float | None) -> int:
    """Up to len(view) bytes, waiting at most `wait` seconds for the first (None: for as
    long as the peer likes); 0 on a clean end of stream. Raises OperationTimeout if
    nothing arrived in time."""
    if wait is None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _FOREVER)
    else:
        arm_seconds(sock, socket.SO_RCVTIMEO, wait)
    try:
        return sock.recv_into(view, len(view))
    except BlockingIOError:
        raise OperationTimeout(f"nothing received in {wait:g}s") from None


def advance(parts: list[memoryview], n: int) -> list[memoryview]:
    """What is left of `parts` after the first `n` bytes went out (vectored writes)."""
    while parts and n >= len(parts[0]):
        n -= len(parts[0])
        parts = parts[1:]
    if parts and n:
        parts = [parts[0][n:], *parts[1:]]
    return parts


def send_all(
    sock: socket.socket,
    parts: Sequence[bytes | bytearray | memoryview],
    deadline: float,
    stall: float | None = None,
) -> None:
    """Send `parts` back to back: one sendmsg, so a header and its payload leave in one
    call (and the header never travels as a segment of its own). With `stall`, a peer
    that takes nothing for that many seconds fails the send before the deadline: a
    reader that stopped reading is told apart from a slow one."""
    views = [memoryview(p) for p in parts if len(p)]
    moved = time.monotonic()  # when the peer last took something
    while views:
        wait = remaining(deadline)
        if stall is not None:
            wait = min(wait, stall * STALL_SLICE)
        arm_seconds(sock, socket.SO_SNDTIMEO, wait)
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:  # SO_SNDTIMEO ran out with nothing sent
            sent = 0
        if sent:
            moved = time.monotonic()
            views = advance(views, sent)
        elif stall is None:
            raise OperationTimeout("the peer did not take the data before the deadline")
        elif time.monotonic() - moved >= stall:
            raise OperationTimeout(f"the peer took nothing for {stall:g}s")


def pwrite_all(fd: int, parts: list[memoryview], offset: int) -> None:
    """Write `parts` at `offset` with as few pwritev calls as the kernel allows."""
    while parts:
        n = os.pwritev(fd, parts, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        offset += n
        parts = advance(parts, n)


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `offset`; how many bytes there were (short at end of file)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def unsent(sock: socket.socket) -> int:
    """Bytes the kernel still holds for the peer: not sent, or sent and not acknowledged
    (SIOCOUTQ); 0 where it cannot tell, or once the socket is closed."""
    try:
        return int(_COUNT.unpack(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0])
    except (OSError, ValueError):  # ValueError: closed (fileno() is -1)
        return 0


def refuse(sock: socket.socket, status: Status, reason: str) -> None:
    """Answer a request with an error and its reason; the caller then closes."""
    with contextlib.suppress(OSError, OperationTimeout):
        send_all(sock, [frames.encode_refusal(status, reason)], time.monotonic() + REFUSAL_WAIT)


def cut(sock: socket.socket) -> None:
    """Cut a connection short from another thread: its blocked send or receive fails."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def close(sock: socket.socket) -> None:
    """Close a served connection. What the peer has not read of a refusal still goes
    out; more than that (a payload it stopped reading) is dropped at once with a reset,
    where a plain close would leave the kernel holding it until it gives up on the peer."""
    if unsent(sock) > frames.MAX_REFUSAL:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.close()


def accept_loop(
    sock: socket.socket,
    handle: Callable[[socket.socket, str], None],
    stopping: Callable[[], bool],
    on_resource_error: Callable[[OSError], None] = lambda exc: None,
) -> None:
    """Accept until the listening socket is closed (or `stopping()`), handing each
    connection and its peer host to `handle`. Running out of file descriptors or buffers
    is a pause, not the end: the loop backs off briefly and reports through
    `on_resource_error` (rate-limit it: this can happen thousands of times a second)."""
    while not stopping():
        try:
            conn, peer = sock.accept()
        except OSError as exc:
            if stopping() or exc.errno in (errno.EBADF, errno.EINVAL):
                return  # closed by stop()
            if exc.errno in RESOURCE_ERRORS:
                on_resource_error(exc)
                time.sleep(ACCEPT_BACKOFF)
            # Anything else is the new connection's own error (accept(2): ECONNABORTED,
            # EPROTO, ENETDOWN, EHOSTUNREACH ...): that one is gone, the listener is not.
            continue
        host = peer[0] if isinstance(peer, tuple) else str(peer)
        handle(conn, host)
