"""The data server's ordered shutdown: it stops accepting, closes idle connections at
once, and lets a request in flight finish (within its drain bound) before the buffer
goes away."""

from __future__ import annotations

import socket
import threading
import time

from polarkv_lib.config import SlabConfig
from polarkv_lib.node.admission import Gate
from polarkv_lib.node.dataserver import DataServer
from polarkv_lib.transport.sockio import recv_exact
from polarkv_lib.wire import frames, grants
from tests.conftest import wait_for

KEY = b"k" * 32
INCARNATION = 7
SIZE = 1 << 20


def _write_grant(offset: int, length: int) -> bytes:
    expires = int(time.time() * 1000) + 30_000
    grant = grants.Grant(grants.Op.WRITE, INCARNATION, offset, length, expires)
    return grants.sign(grant, KEY)


def test_a_request_in_flight_finishes_and_idle_connections_close() -> None:
    buffer = bytearray(SIZE)
    listener = socket.create_server(("127.0.0.1", 0))
    limits = SlabConfig()
    gate = Gate(SIZE, INCARNATION, lambda: (KEY,), limits.frame_timeout)
    server = DataServer(listener, memoryview(buffer), gate, limits)
    server.start()
    address = listener.getsockname()
    idle = socket.create_connection(address, timeout=5)
    writer = socket.create_connection(address, timeout=5)
    try:
        payload = bytes(range(256)) * 256  # 64 KiB
        writer.sendall(frames.encode_request(grants.Op.WRITE, _write_grant(4096, len(payload))))
        writer.sendall(payload[:1000])  # the request is in flight: its payload half sent
        # the server has the header: that connection is serving a request now
        wait_for(lambda: any(c.idle_since is None for c in server._table.all()), timeout=5)
        stopper = threading.Thread(target=server.stop, kwargs={"drain": 2.0})
        stopper.start()
        assert idle.recv(1) == b""  # closed at once (blocks until then: timeout 5 s)
        writer.sendall(payload[1000:])
        header = bytearray(frames.RESPONSE_SIZE)
        recv_exact(writer, memoryview(header), time.monotonic() + 5)
        assert frames.decode_response(header) == (frames.Status.OK, 0)
        assert writer.recv(1) == b""  # and then it is closed: no next request
        stopper.join(5)
        assert not stopper.is_alive()
        assert bytes(buffer[4096 : 4096 + len(payload)]) == payload
    finally:
        idle.close()
        writer.close()
        listener.close()
