"""Data-plane grants and frames (polarkv_lib/wire/grants.py, wire/frames.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polarkv_lib.errors import AccessDenied, ProtocolError
from polarkv_lib.wire import frames, grants
from polarkv_lib.wire.frames import Status
from polarkv_lib.wire.grants import GRANT_SIZE, Grant, Op

KEY = b"k" * 32
INC = 7
BUF = 1 << 20
NOW = 1_700_000_000_000


def make(
    op: Op = Op.READ,
    offset: int = 4096,
    length: int = 8192,
    expires_ms: int = NOW + 5000,
    incarnation: int = INC,
) -> Grant:
    return Grant(op, incarnation, offset, length, expires_ms)


# -- grants -------------------------------------------------------------------------------


def test_sign_has_fixed_size_and_round_trips() -> None:
    for op in Op:
        grant = make(op)
        blob = grants.sign(grant, KEY)
        assert len(blob) == GRANT_SIZE
        assert grants.decode(blob) == grant
        assert grants.verify(blob, KEY, INC, BUF, now_ms=NOW) == grant
        # the verify path accepts the buffer-like types a socket read produces
        assert grants.verify(bytearray(blob), KEY, INC, BUF, now_ms=NOW) == grant
        assert grants.verify(memoryview(blob), KEY, INC, BUF, now_ms=NOW) == grant


@settings(max_examples=100, deadline=None, database=None)
@given(
    op=st.sampled_from(list(Op)),
    incarnation=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**40),
    length=st.integers(1, 2**40),
    expires=st.integers(0, 2**64 - 1),
)
def test_decode_round_trips_any_grant(
    op: Op, incarnation: int, offset: int, length: int, expires: int
) -> None:
    grant = Grant(op, incarnation, offset, length, expires)
    assert grants.decode(grants.sign(grant, KEY)) == grant


@settings(max_examples=100, deadline=None, database=None)
@given(
    op=st.sampled_from(list(Op)),
    incarnation=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**40),
    length=st.integers(1, 2**40),
    expires=st.integers(0, 2**64 - 1),
    gen=st.integers(0, 2**64 - 1),
)
def test_a_signer_signs_the_bytes_of_sign(
    op: Op, incarnation: int, offset: int, length: int, expires: int, gen: int
) -> None:
    grant = Grant(op, incarnation, offset, length, expires, gen)
    assert grants.Signer(KEY)(op, incarnation, offset, length, expires, gen) == grants.sign(
        grant, KEY
    )


def test_verify_uses_wall_clock_when_now_is_omitted() -> None:
    far_future = grants.sign(make(expires_ms=2**63), KEY)
    assert grants.verify(far_future, KEY, INC, BUF).expires_ms == 2**63
    long_ago = grants.sign(make(expires_ms=1), KEY)
    with pytest.raises(AccessDenied, match="expired"):
        grants.verify(long_ago, KEY, INC, BUF)


# every byte outside the op field: padding, incarnation, offset, length, expiry and MAC
NON_OP_POSITIONS = list(range(1, GRANT_SIZE))


@pytest.mark.parametrize("pos", NON_OP_POSITIONS)
@pytest.mark.parametrize("flip", [0x01, 0x80, 0xFF])
def test_tampered_byte_is_denied(pos: int, flip: int) -> None:
    blob = bytearray(grants.sign(make(), KEY))
    blob[pos] ^= flip
    with pytest.raises(AccessDenied):
        grants.verify(bytes(blob), KEY, INC, BUF, now_ms=NOW)


def test_tampered_op_to_other_valid_op_is_denied() -> None:
    blob = bytearray(grants.sign(make(Op.READ), KEY))
    blob[0] = Op.WRITE
    assert grants.decode(bytes(blob)).op is Op.WRITE  # parses, but
    with pytest.raises(AccessDenied):
        grants.verify(bytes(blob), KEY, INC, BUF, now_ms=NOW)


@pytest.mark.parametrize("flip", [0x80, 0xFF])
def test_tampered_op_byte_to_unknown_op_is_denied(flip: int) -> None:
    blob = bytearray(grants.sign(make(), KEY))
    blob[0] ^= flip
    with pytest.raises(ProtocolError):
        grants.decode(bytes(blob))  # the op byte is no op at all: parsing it would fail
    with pytest.raises(AccessDenied, match="signature"):  # but the MAC is checked first
        grants.verify(bytes(blob), KEY, INC, BUF, now_ms=NOW)


def test_wrong_key_is_denied() -> None:
    blob = grants.sign(make(), KEY)
    with pytest.raises(AccessDenied, match="signature"):
        grants.verify(blob, b"other key", INC, BUF, now_ms=NOW)
    with pytest.raises(AccessDenied):
        grants.verify(blob, b"", INC, BUF, now_ms=NOW)


def test_wrong_incarnation_is_denied() -> None:
    blob = grants.sign(make(incarnation=INC), KEY)
    for other in (0, INC - 1, INC + 1, 2**63):
        with pytest.raises(AccessDenied, match="incarnation"):
            grants.verify(blob, KEY, other, BUF, now_ms=NOW)


def test_expiry_boundary() -> None:
    blob = grants.sign(make(expires_ms=NOW), KEY)
    assert grants.verify(blob, KEY, INC, BUF, now_ms=NOW).expires_ms == NOW  # last valid ms
    with pytest.raises(AccessDenied, match="expired"):
        grants.verify(blob, KEY, INC, BUF, now_ms=NOW + 1)


@pytest.mark.parametrize(
    ("offset", "length", "ok"),
    [
        (0, BUF, True),
        (BUF - 1, 1, True),
        (0, BUF + 1, False),
        (BUF - 4096, 4097, False),
        (BUF, 1, False),
        (2**63, 2**63, False),  # would wrap in a 64-bit sum
        (0, 0, False),
        (4096, 0, False),
    ],
)
def test_grant_must_lie_inside_the_buffer(offset: int, length: int, ok: bool) -> None:
    blob = grants.sign(make(offset=offset, length=length), KEY)
    if ok:
        assert grants.verify(blob, KEY, INC, BUF, now_ms=NOW).offset == offset
    else:
        with pytest.raises(AccessDenied, match="outside"):
            grants.verify(blob, KEY, INC, BUF, now_ms=NOW)


@pytest.mark.parametrize("size", [0, 1, GRANT_SIZE - 1, GRANT_SIZE + 1, 2 * GRANT_SIZE])
def test_decode_wrong_size_is_protocol_error(size: int) -> None:
    blob = (grants.sign(make(), KEY) * 3)[:size]
    with pytest.raises(ProtocolError):
        grants.decode(blob)
    with pytest.raises(ProtocolError):
        grants.verify(blob, KEY, INC, BUF, now_ms=NOW)


@pytest.mark.parametrize("op", [0, 3, 255])
def test_decode_unknown_op_is_protocol_error(op: int) -> None:
    blob = bytearray(grants.sign(make(), KEY))
    blob[0] = op
    with pytest.raises(ProtocolError):
        grants.decode(bytes(blob))


# -- frames -------------------------------------------------------------------------------


def test_request_round_trip() -> None:
    for op in Op:
        blob = grants.sign(make(op), KEY)
        frame = frames.encode_request(op, blob)
        assert len(frame) == frames.REQUEST_SIZE == 4 + GRANT_SIZE
        assert frame[:2] == frames.MAGIC
        got_op, got_blob = frames.decode_request(frame)
        assert got_op is op
        assert got_blob == blob
        assert frames.decode_request(bytearray(frame)) == (op, blob)
        assert frames.decode_request(memoryview(frame)) == (op, blob)


@pytest.mark.parametrize("status", list(Status))
@pytest.mark.parametrize("length", [0, 1, 2**32, 2**64 - 1])
def test_response_round_trip(status: Status, length: int) -> None:
    frame = frames.encode_response(status, length)
    assert len(frame) == frames.RESPONSE_SIZE == 12
    got_status, got_length = frames.decode_response(frame)
    assert got_status is status
    assert got_length == length


def test_response_length_defaults_to_zero() -> None:
    assert frames.decode_response(frames.encode_response(Status.OK)) == (Status.OK, 0)


@pytest.mark.parametrize(
    ("reason", "sent"),
    [
        ("grant expired", b"grant expired"),
        ("x" * (frames.MAX_REASON + 100), b"x" * frames.MAX_REASON),
        # never half a character: a client decodes what it reads as UTF-8
        ("x" * (frames.MAX_REASON - 1) + "\u00e9", b"x" * (frames.MAX_REASON - 1)),
    ],
)
def test_a_refusal_carries_its_reason_cut_to_max_reason(reason: str, sent: bytes) -> None:
    frame = frames.encode_refusal(Status.DENIED, reason)
    assert len(frame) <= frames.MAX_REFUSAL
    assert frames.decode_response(frame[: frames.RESPONSE_SIZE]) == (Status.DENIED, len(sent))
    assert frame[frames.RESPONSE_SIZE :] == sent


@pytest.mark.parametrize("magic", [b"PL", b"pk", b"\x00\x00", b"KP"])
def test_request_bad_magic(magic: bytes) -> None:
    frame = bytearray(frames.encode_request(Op.READ, grants.sign(make(), KEY)))
    frame[:2] = magic
    with pytest.raises(ProtocolError):
        frames.decode_request(bytes(frame))


@pytest.mark.parametrize("version", [0, 2, 255])
def test_request_bad_version(version: int) -> None:
    frame = bytearray(frames.encode_request(Op.READ, grants.sign(make(), KEY)))
    frame[2] = version
    with pytest.raises(ProtocolError):
        frames.decode_request(bytes(frame))


@pytest.mark.parametrize("op", [0, 3, 255])
def test_request_bad_op(op: int) -> None:
    frame = bytearray(frames.encode_request(Op.READ, grants.sign(make(), KEY)))
    frame[3] = op
    with pytest.raises(ProtocolError, match="op"):
        frames.decode_request(bytes(frame))


@pytest.mark.parametrize("magic", [b"PL", b"\x00\x00"])
def test_response_bad_magic(magic: bytes) -> None:
    frame = bytearray(frames.encode_response(Status.OK, 5))
    frame[:2] = magic
    with pytest.raises(ProtocolError):
        frames.decode_response(bytes(frame))


@pytest.mark.parametrize("status", [4, 200, 255])
def test_response_unknown_status(status: int) -> None:
    frame = bytearray(frames.encode_response(Status.OK, 5))
    frame[2] = status
    with pytest.raises(ProtocolError, match="status"):
        frames.decode_response(bytes(frame))


@pytest.mark.parametrize("which", ["request", "response"])
@pytest.mark.parametrize("delta", [-1, 1])
def test_short_frame_is_protocol_error(which: str, delta: int) -> None:
    if which == "request":
        good = frames.encode_request(Op.READ, grants.sign(make(), KEY))
        frame = good[:-1] if delta < 0 else good + b"\0"
        with pytest.raises(ProtocolError, match="request header"):
            frames.decode_request(frame)
    else:
        good = frames.encode_response(Status.OK)
        frame = good[:-1] if delta < 0 else good + b"\0"
        with pytest.raises(ProtocolError, match="response header"):
            frames.decode_response(frame)


@pytest.mark.parametrize("size", [0, 5, GRANT_SIZE - 1, GRANT_SIZE + 1])
def test_encode_request_refuses_wrong_size_grant(size: int) -> None:
    with pytest.raises(ValueError, match="grant"):
        frames.encode_request(Op.READ, b"g" * size)


@pytest.mark.parametrize("key_size", [1, 32, 64, 65, 200])
def test_a_grant_mac_is_hmac_sha256_of_its_body_truncated(key_size: int) -> None:
    """The precomputed-pad MAC is the standard HMAC: a slab built on any HMAC library,
    or one of another version, verifies what the manager signed."""
    import hashlib
    import hmac as std_hmac

    key = bytes(range(256))[:key_size]
    blob = grants.sign(grants.Grant(grants.Op.READ, 7, 4096, 65536, 2**40, 3), key)
    body = blob[: grants.SIGNED_SIZE]
    assert blob[grants.SIGNED_SIZE :] == std_hmac.new(key, body, hashlib.sha256).digest()[:16]
    assert grants.verify(blob, key, 7, 2**20, now_ms=0).offset == 4096
    with pytest.raises(AccessDenied):
        grants.verify(blob, key + b"x", 7, 2**20, now_ms=0)
