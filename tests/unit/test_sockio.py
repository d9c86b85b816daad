"""The socket loop's send bound and closing (polarkv_lib/transport/sockio.py), on real
loopback sockets: a reader that stops reading is told apart from a slow one, and what
it left unread is dropped when the connection closes; a hashed receive hashes exactly
the bytes it received, however they come."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from polarkv_lib.errors import NetworkError, OperationTimeout
from polarkv_lib.transport.base import checksum, checksum_stream
from polarkv_lib.transport.sockio import HASH_SLICE, close, recv_exact, send_all, unsent

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


@pytest.mark.parametrize(
    "size", [1, HASH_SLICE - 1, HASH_SLICE, HASH_SLICE + 1, 3 * HASH_SLICE + 4099]
)
def test_a_hashed_receive_hashes_what_it_received_in_dribs_and_drabs(size: int) -> None:
    """Sent in pieces that straddle the hashed ones, with pauses: every byte is in the
    buffer and the checksum is the whole object's, as one hash of it after would be."""
    data = bytes(range(251)) * (size // 251 + 1)
    data = data[:size]
    with pair() as (sender, reader):

        def dribble() -> None:
            for at in range(0, size, 65_521):  # a prime: never a multiple of a slice
                sender.sendall(data[at : at + 65_521])
                time.sleep(0.001)

        thread = threading.Thread(target=dribble)
        thread.start()
        out = bytearray(size)
        hasher = checksum_stream()
        recv_exact(reader, memoryview(out), time.monotonic() + 10, hasher)
        thread.join(10)
    assert out == data
    assert hasher.hexdigest() == checksum(data)


def test_a_hashed_receive_cut_short_says_so() -> None:
    """The peer closes mid-object, or sends too little before the deadline: an error,
    never a checksum of part of it passing for the whole."""
    with pair() as (sender, reader):
        sender.sendall(bytes(HASH_SLICE + 10))
        sender.close()
        with pytest.raises(NetworkError, match="mid-frame"):
            recv_exact(
                reader,
                memoryview(bytearray(2 * HASH_SLICE)),
                time.monotonic() + 5,
                checksum_stream(),
            )
    with pair() as (sender, reader):
        sender.sendall(bytes(HASH_SLICE + 10))
        with pytest.raises(OperationTimeout):
            recv_exact(
                reader,
                memoryview(bytearray(2 * HASH_SLICE)),
                time.monotonic() + 0.3,
                checksum_stream(),
            )
