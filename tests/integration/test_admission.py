"""One admission for every request on the data port (node/admission.py): the tcp data
server and the rdma window loop refuse the same bad frames with the same answer, and
give a header the same deadline.

There is no RDMA device here, so the rdma side runs its real window loop
(`rdma_server.serve_windows`) behind the real gate, on a real socket, with a stand-in
for the device's one part in it, binding a window (as tests/unit/test_rdma_registrations.py
stands in for the HCA). The last test sends the header cases to a real slab process.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from polarkv_lib.config import SlabConfig
from polarkv_lib.node.admission import Admitted, Gate
from polarkv_lib.node.dataserver import DataServer
from polarkv_lib.node.rdma_server import serve_windows
from polarkv_lib.transport import rdma_wire
from polarkv_lib.transport.rdma_wire import QpParams
from polarkv_lib.wire import frames, grants
from polarkv_lib.wire.frames import Status
from polarkv_lib.wire.grants import Op
from tests.conftest import Cluster
from tests.integration.raw import key, only, post, recv_exact, write

KEY = b"k" * 32
INCARNATION = 7
SIZE = 1 << 20
FRAME_TIMEOUT = 0.5
OFFSET, LENGTH = 8192, 4096
Address = tuple[str, int]


def grant(
    op: Op = Op.READ,
    *,
    gen: int = 1,
    expires_in: float = 3600.0,  # the cases are built at import: good for the session
    incarnation: int = INCARNATION,
    offset: int = OFFSET,
    signed_with: bytes = KEY,
) -> bytes:
    expires = int((time.time() + expires_in) * 1000)
    return grants.sign(grants.Grant(op, incarnation, offset, LENGTH, expires, gen), signed_with)


def request(op: Op, blob: bytes) -> bytes:
    return frames.encode_request(op, blob)


GOOD = request(Op.READ, grant())
# name: (what the client sends, then whether it closes its side, the answer both give)
BAD: dict[str, tuple[bytes, bool, tuple[Status, bytes]]] = {
    "stale": (  # its pages were claimed by a newer entry (generation 2, below)
        GOOD,
        False,
        (Status.DENIED, b"grant names space that a newer entry holds now"),
    ),
    "borrowed": (
        request(Op.WRITE, grant(Op.READ, gen=3)),
        False,
        (Status.DENIED, b"grant is for another operation"),
    ),
    "forged": (
        request(Op.READ, grant(gen=3, signed_with=b"x" * 32)),
        False,
        (Status.DENIED, b"grant signature does not verify"),
    ),
    "expired": (
        request(Op.READ, grant(gen=3, expires_in=-1)),
        False,
        (Status.DENIED, b"grant expired"),
    ),
    "foreign incarnation": (
        request(Op.READ, grant(gen=3, incarnation=INCARNATION + 1)),
        False,
        (Status.DENIED, b"grant is for another node or incarnation"),
    ),
    "outside the buffer": (
        request(Op.READ, grant(gen=3, offset=SIZE)),
        False,
        (Status.DENIED, b"grant is outside the buffer"),
    ),
    "not a request": (
        b"GET / HTTP/1.1\r\n".ljust(frames.REQUEST_SIZE, b"\0"),
        False,
        (Status.BAD_REQUEST, b"not a PolarKV data-plane request"),
    ),
    "truncated header": (
        request(Op.READ, grant(gen=3))[:30],
        True,
        (Status.BAD_REQUEST, b"request header cut short"),
    ),
    "header past the frame timeout": (
        request(Op.READ, grant(gen=3))[:30],
        False,
        (Status.BAD_REQUEST, f"request header not whole within {FRAME_TIMEOUT:g}s".encode()),
    ),
}


@dataclass
class RecordingWindows:
    """The device's part of the window loop: what it was asked to bind, and retire."""

    bound: list[Admitted] = field(default_factory=list)
    retired: int = 0

    def retire(self) -> None:
        self.retired += 1

    def bind(self, admitted: Admitted) -> int:
        self.bound.append(admitted)
        return 0x5000 + len(self.bound)


@contextlib.contextmanager
def tcp_port(gate: Gate) -> Iterator[Address]:
    listener = socket.create_server(("127.0.0.1", 0))
    server = DataServer(listener, memoryview(bytearray(SIZE)), gate, SlabConfig())
    server.start()
    try:
        yield listener.getsockname()
    finally:
        server.stop()


@contextlib.contextmanager
def window_port(gate: Gate, windows: RecordingWindows) -> Iterator[Address]:
    """Connections served by the rdma window loop from the first byte (the QP exchange
    before it needs the device)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            serve_windows(conn, gate, windows)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()


def answer(address: Address, data: bytes, shut: bool) -> tuple[Status, bytes, bytes]:
    """Send `data` (then close the sending side if `shut`); the status, the reason, and
    whatever came after it before the server closed."""
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(data)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    status, length = frames.decode_response(got[: frames.RESPONSE_SIZE])
    end = frames.RESPONSE_SIZE + length
    return status, got[frames.RESPONSE_SIZE : end], got[end:]


@pytest.fixture
def gate() -> Gate:
    """One gate for both ports, as the slab has."""
    return Gate(SIZE, INCARNATION, lambda: (KEY,), FRAME_TIMEOUT)


def test_a_good_grant_passes_both_paths(gate: Gate) -> None:
    windows = RecordingWindows()
    with tcp_port(gate) as tcp, window_port(gate, windows) as rdma:
        status, body, _ = answer(tcp, GOOD, shut=True)
        assert (status, body) == (Status.OK, bytes(LENGTH))
        with socket.create_connection(rdma, timeout=5) as sock:
            for n in (1, 2):  # the connection stays open for the next window
                sock.sendall(GOOD)
                status, length = frames.decode_response(recv_exact(sock, frames.RESPONSE_SIZE))
                assert status is Status.OK
                assert rdma_wire.decode_window(recv_exact(sock, length)) == 0x5000 + n
        (first, _) = windows.bound
        assert (first.op, first.grant.offset, first.grant.length) == (Op.READ, OFFSET, LENGTH)
        assert windows.retired == 2  # the previous window goes before each admission


def test_both_paths_refuse_the_same_bad_frames_the_same_way(gate: Gate) -> None:
    # A newer entry wrote the pages GOOD names: its grant is stale from now on.
    gate.fence.leave(gate.fence.enter(OFFSET, LENGTH, gen=2, claim=True))
    windows = RecordingWindows()
    with tcp_port(gate) as tcp, window_port(gate, windows) as rdma:
        for name, (data, shut, expected) in BAD.items():
            started = time.monotonic()
            by_tcp = answer(tcp, data, shut)
            by_rdma = answer(rdma, data, shut)
            assert by_tcp == by_rdma == (*expected, b""), name  # and then closed
            if name == "header past the frame timeout":
                assert time.monotonic() - started < 4 * FRAME_TIMEOUT + 1
    assert windows.bound == []  # nothing refused got near the device
    denied = sum(want[0] is Status.DENIED for _, _, want in BAD.values())
    assert (gate.stats.denied, gate.stats.bad_requests, gate.stats.slow_headers) == (
        2 * denied,
        2 * (len(BAD) - denied - 1),
        2,
    )


def test_a_slab_refuses_a_slow_or_cut_short_header_with_a_reason(cluster: Cluster) -> None:
    """The same on a real slab process, for a READ header and for an rdma hello alike:
    the hello's header is admitted by the same gate before rdma sees it."""
    node = cluster.embedded(slab__transports="tcp", slab__frame_timeout="1s")
    write(node.manager_url, key(1), b"x" * 4096)
    entry, address = only(post(node.manager_url, "/v1/lookup", {"keys": [key(1)]}))
    host, _, port = address.rpartition(":")
    hello = rdma_wire.encode_hello(QpParams(qpn=1, psn=2, lid=0, mtu=5, gid=bytes(16)))
    for header in (request(Op.READ, bytes.fromhex(entry["grant"])), hello):
        cut = answer((host, int(port)), header[:20], shut=True)
        assert cut == (Status.BAD_REQUEST, b"request header cut short", b"")
        started = time.monotonic()
        slow = answer((host, int(port)), header[:20], shut=False)
        assert slow == (Status.BAD_REQUEST, b"request header not whole within 1s", b"")
        assert time.monotonic() - started < 4
