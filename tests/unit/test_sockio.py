"""The socket loop's send bound and closing (polarkv_lib/transport/sockio.py), on real
loopback sockets: a reader that stops reading is told apart from a slow one, and what
it left unread is dropped when the connection closes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from polarkv_lib.errors import OperationTimeout
from polarkv_lib.transport.sockio import close, send_all, unsent

PAYLOAD = bytes(32 << 20)  # far more than the socket buffers of both ends hold


@contextlib.contextmanager
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        reader = socket.create_connection(listener.getsockname())
        sender, _ = listener.accept()
    try:
        yield sender, reader
    finally:
        sender.close()
        reader.close()


def test_a_reader_that_takes_nothing_is_cut_off_at_the_stall_bound() -> None:
    with pair() as (sender, _reader):
        started = time.monotonic()
        with pytest.raises(OperationTimeout, match=r"took nothing for 0\.4s"):
            send_all(sender, [PAYLOAD], started + 30, stall=0.4)
        assert 0.4 <= time.monotonic() - started < 1.5  # the bound, not the deadline
        assert unsent(sender) > 0  # the kernel still holds what it took


def test_a_slow_reader_that_keeps_reading_is_not_cut_off() -> None:
    with pair() as (sender, reader):
        got = 0

        def read_slowly() -> None:
            nonlocal got
            while chunk := reader.recv(8 << 20):
                got += len(chunk)
                # Pauses longer than one wait of the send loop, shorter than the bound.
                time.sleep(0.2)

        thread = threading.Thread(target=read_slowly)
        thread.start()
        payload = PAYLOAD[: 8 << 20]
        send_all(sender, [payload], time.monotonic() + 30, stall=0.5)
        sender.shutdown(socket.SHUT_WR)
        thread.join(30)
        assert got == len(payload)


def test_closing_over_an_unread_payload_resets_and_drops_it() -> None:
    with pair() as (sender, reader):
        with pytest.raises(OperationTimeout):
            send_all(sender, [PAYLOAD], time.monotonic() + 30, stall=0.2)
        close(sender)
        reader.settimeout(5)
        with pytest.raises(ConnectionResetError):  # not a FIN after the queued bytes
            while reader.recv(1 << 20):
                pass


def test_closing_after_a_refusal_lets_the_refusal_out() -> None:
    with pair() as (sender, reader):
        sender.sendall(b"a refusal the reader has not read yet")
        close(sender)
        reader.settimeout(5)
        assert reader.recv(100) == b"a refusal the reader has not read yet"
        assert reader.recv(100) == b""  # an orderly end
