"""The tcp data-plane frames: the one-sided READ/WRITE emulation.

Request (little-endian):  magic "PK" | version u8 | op u8 | grant (GRANT_SIZE bytes)
  WRITE: followed by exactly grant.length payload bytes.
Response:                 magic "PK" | status u8 | 0 u8 | length u64
  OK + READ: followed by `length` payload bytes; OK + WRITE: length 0.
  error: followed by `length` bytes of UTF-8 reason (at most MAX_REASON); the server
  then closes.

A request always covers its whole grant, so the frame needs no offset of its own and a
client can only ever touch what the manager gave it.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from polarkv_lib.errors import ProtocolError
from polarkv_lib.wire.grants import GRANT_SIZE, Op

MAGIC = b"PK"
VERSION = 1
_REQ = struct.Struct(f"<2sBB{GRANT_SIZE}s")
_RESP = struct.Struct("<2sBxQ")
REQUEST_SIZE = _REQ.size
RESPONSE_SIZE = _RESP.size
MAX_REASON = 4096  # bytes of an error's reason: servers cut longer ones, clients read no more
MAX_REFUSAL = RESPONSE_SIZE + MAX_REASON


class Status(IntEnum):
    OK = 0
    DENIED = 1
    BAD_REQUEST = 2
    BUSY = 3


def encode_request(op: Op, grant: bytes) -> bytes:
    if len(grant) != GRANT_SIZE:
        raise ValueError(f"a grant is {GRANT_SIZE} bytes, got {len(grant)}")
    return _REQ.pack(MAGIC, VERSION, op, grant)


def decode_request(frame: bytes | bytearray | memoryview) -> tuple[Op, bytes]:
    if len(frame) != REQUEST_SIZE:
        raise ProtocolError(f"a request header is {REQUEST_SIZE} bytes, got {len(frame)}")
    magic, version, op, grant = _REQ.unpack(frame)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError("not a PolarKV data-plane request")
    if op not in (Op.READ, Op.WRITE):
        raise ProtocolError(f"unknown op {op}")
    return Op(op), grant


def encode_response(status: Status, length: int = 0) -> bytes:
    return _RESP.pack(MAGIC, status, length)


def encode_refusal(status: Status, reason: str) -> bytes:
    """An error response and its reason, cut to MAX_REASON bytes (and to whole characters)."""
    msg = reason.encode()[:MAX_REASON].decode(errors="ignore").encode()
    return _RESP.pack(MAGIC, status, len(msg)) + msg


def decode_response(frame: bytes | bytearray | memoryview) -> tuple[Status, int]:
    if len(frame) != RESPONSE_SIZE:
        raise ProtocolError(f"a response header is {RESPONSE_SIZE} bytes, got {len(frame)}")
    magic, status, length = _RESP.unpack(frame)
    if magic != MAGIC:
        raise ProtocolError("not a PolarKV data-plane response")
    try:
        return Status(status), length
    except ValueError:
        raise ProtocolError(f"unknown status {status}") from None
