"""The rdma exchange codec, grant bookkeeping and error mapping: bytes in, bytes out."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polarkv_lib.errors import AccessDenied, NetworkError, OperationTimeout, ProtocolError
from polarkv_lib.transport import rdma_wire
from polarkv_lib.transport.rdma_wire import QpParams, RemoteBuffer
from polarkv_lib.wire import frames, grants
from polarkv_lib.wire.grants import Grant, Op

GID = bytes.fromhex("fe800000000000000202c9fffe001122")
KEY = b"k" * 32
LOCAL = QpParams(qpn=0x1234, psn=0xABCDE, lid=7, mtu=5, gid=GID)
BUFFER = RemoteBuffer(
    rkey=0xDEADBEEF, base=0x7F00_0000_0000, length=1 << 30, incarnation=42, windows=False
)

params = st.builds(
    QpParams,
    qpn=st.integers(1, (1 << 24) - 1),
    psn=st.integers(0, (1 << 24) - 1),
    lid=st.integers(0, 0xFFFF),
    mtu=st.integers(1, 5),
    gid=st.binary(min_size=16, max_size=16),
)


def _grant(
    op: Op = Op.READ,
    offset: int = 4096,
    length: int = 100,
    incarnation: int = 42,
    expires_ms: int | None = None,
) -> bytes:
    expires = int(time.time() * 1000) + 60_000 if expires_ms is None else expires_ms
    return grants.sign(Grant(op, incarnation, offset, length, expires), KEY)


def test_hello_is_exactly_one_data_plane_header() -> None:
    # The data server reads REQUEST_SIZE bytes before it knows what it got.
    hello = rdma_wire.encode_hello(LOCAL)
    assert len(hello) == frames.REQUEST_SIZE == rdma_wire.HELLO_SIZE
    assert rdma_wire.is_hello(hello)
    assert not rdma_wire.is_hello(frames.encode_request(Op.READ, _grant()))
    with pytest.raises(ProtocolError):  # and a tcp slab without rdma refuses it cleanly
        frames.decode_request(hello)


@given(params, st.integers(0, 255))
def test_hello_round_trip(p: QpParams, flags: int) -> None:
    assert rdma_wire.decode_hello(rdma_wire.encode_hello(p, flags)) == (p, flags)


@given(
    params,
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(1, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.booleans(),
)
def test_accept_round_trip(
    p: QpParams, rkey: int, base: int, length: int, inc: int, windows: bool
) -> None:
    buffer = RemoteBuffer(rkey, base, length, inc, windows)
    frame = rdma_wire.encode_accept(p, buffer)
    status, size = frames.decode_response(frame[: frames.RESPONSE_SIZE])
    assert (status, size) == (frames.Status.OK, rdma_wire.ACCEPT_SIZE)
    assert rdma_wire.decode_accept(frame[frames.RESPONSE_SIZE :]) == (p, buffer)


def test_window_answer_round_trip() -> None:
    frame = rdma_wire.encode_window(0x1122_3344)
    assert frames.decode_response(frame[: frames.RESPONSE_SIZE]) == (
        frames.Status.OK,
        rdma_wire.WINDOW_SIZE,
    )
    assert rdma_wire.decode_window(frame[frames.RESPONSE_SIZE :]) == 0x1122_3344
    with pytest.raises(ProtocolError):
        rdma_wire.decode_window(b"abc")


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        rdma_wire.encode_hello(LOCAL)[:-1],
        b"PK" + rdma_wire.encode_hello(LOCAL)[2:],  # a tcp request's magic
        rdma_wire.encode_hello(LOCAL)[:2]
        + bytes([9])
        + rdma_wire.encode_hello(LOCAL)[3:],  # version 9
    ],
)
def test_bad_hellos_are_protocol_errors(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        rdma_wire.decode_hello(frame)


@pytest.mark.parametrize(
    "bad",
    [
        QpParams(0, 1, 0, 5, GID),  # qpn 0 is never a real RC QP
        QpParams(1 << 24, 1, 0, 5, GID),
        QpParams(1, 1 << 24, 0, 5, GID),
        QpParams(1, 1, 0, 6, GID),  # no such mtu code
        QpParams(1, 1, 0, 0, GID),
        QpParams(1, 1, 0, 5, b"\x00" * 15),
    ],
)
def test_out_of_range_parameters_are_refused(bad: QpParams) -> None:
    with pytest.raises(ProtocolError):
        rdma_wire.encode_hello(bad)


def test_accept_with_an_empty_buffer_is_refused() -> None:
    frame = rdma_wire.encode_accept(LOCAL, RemoteBuffer(1, 0, 0, 1, False))
    with pytest.raises(ProtocolError):
        rdma_wire.decode_accept(frame[frames.RESPONSE_SIZE :])


def test_global_route_only_with_a_gid() -> None:
    assert LOCAL.is_global
    assert not QpParams(1, 1, 3, 5, bytes(16)).is_global  # InfiniBand, same subnet: LID only


def test_path_mtu_is_the_smaller_one() -> None:
    assert rdma_wire.path_mtu(5, 3) == 3 and rdma_wire.path_mtu(2, 4) == 2
    with pytest.raises(ProtocolError):
        rdma_wire.path_mtu(5, 7)


def test_grant_becomes_remote_address_and_length() -> None:
    t = rdma_wire.target(BUFFER, _grant(Op.WRITE, 8192, 300), Op.WRITE, 8192, 300)
    assert (t.address, t.length, t.op) == (BUFFER.base + 8192, 300, Op.WRITE)


# Grants are minted inside the test (from these keyword arguments), not at collection:
# a grant signed when the module is collected may have expired by the time a long suite
# reaches the test.
@pytest.mark.parametrize(
    ("grant", "op", "offset", "size", "error"),
    [
        ({"op": Op.WRITE}, Op.READ, 4096, 100, AccessDenied),  # a write grant cannot read
        ({"incarnation": 41}, Op.READ, 4096, 100, AccessDenied),  # the slab restarted
        ({"expires_ms": 1}, Op.READ, 4096, 100, AccessDenied),
        ({"offset": (1 << 30) - 50}, Op.READ, (1 << 30) - 50, 100, AccessDenied),  # past the end
        ({}, Op.READ, 0, 100, ProtocolError),  # region and grant disagree
        ({}, Op.READ, 4096, 99, ProtocolError),
        (None, Op.READ, 4096, 100, ProtocolError),  # not a grant at all
    ],
)
def test_grant_bookkeeping_refuses(
    grant: dict[str, Any] | None, op: Op, offset: int, size: int, error: type[Exception]
) -> None:
    blob = b"short" if grant is None else _grant(**grant)
    with pytest.raises(error):
        rdma_wire.target(BUFFER, blob, op, offset, size)


def test_failed_completions_map_to_polarkv_errors() -> None:
    assert isinstance(rdma_wire.completion_error(10, "x"), AccessDenied)  # REM_ACCESS_ERR
    assert isinstance(rdma_wire.completion_error(12, "x"), NetworkError)  # RETRY_EXC_ERR
    assert isinstance(rdma_wire.completion_error(5, "x"), NetworkError)  # WR_FLUSH_ERR
    err = rdma_wire.completion_error(4, "rdma read")  # LOC_PROT_ERR: our lkey was wrong
    assert isinstance(err, ProtocolError) and "LOC_PROT_ERR" in str(err)
    assert "status 99" in str(rdma_wire.completion_error(99, "x"))


def test_setup_errors_name_the_memlock_limit() -> None:
    import errno

    err = rdma_wire.setup_error("registering the slab buffer", errno.ENOMEM)
    assert isinstance(err, NetworkError) and "memlock" in str(err)
    assert "memlock" not in str(rdma_wire.setup_error("creating a queue pair", errno.ENOMEM))
    assert isinstance(rdma_wire.setup_error("connecting", errno.ETIMEDOUT), OperationTimeout)
