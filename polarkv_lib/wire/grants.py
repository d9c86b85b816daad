"""Data-plane grants: (op, incarnation, offset, length, expiry, generation) signed with
HMAC-SHA256.

The manager signs one grant per region it hands out; a slab serves a request only if
the grant verifies with the shared key, names this slab's incarnation (so a grant for
another node, or for this node before a restart, is useless), covers the bytes asked
for, and has not expired. Expiry is wall-clock milliseconds: manager and slabs must
keep their clocks in sync (NTP) to well within a lease.

The generation is that of the entry the region belongs to (it grows with every entry,
across manager restarts). A grant outlives its entry: the slab's fence (node/fence.py)
refuses any grant on space that a newer generation has claimed since, so a kept grant
can neither read nor overwrite the bytes of whoever holds that space next.
"""

from __future__ import annotations

import functools
import hmac
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from hashlib import sha256

from polarkv_lib.errors import AccessDenied, ProtocolError


class Op(IntEnum):
    READ = 1
    WRITE = 2


_BODY = struct.Struct("<B3xQQQQQ")  # op, incarnation, offset, length, expires_ms, gen
SIGNED_SIZE = _BODY.size  # what the MAC covers
MAC_SIZE = 16
GRANT_SIZE = SIGNED_SIZE + MAC_SIZE


@dataclass(frozen=True, slots=True)
class Grant:
    op: Op
    incarnation: int
    offset: int
    length: int
    expires_ms: int
    gen: int = 0

    def body(self) -> bytes:
        return _BODY.pack(
            self.op, self.incarnation, self.offset, self.length, self.expires_ms, self.gen
        )


def epoch_key(grant_key: bytes, manager_incarnation: int) -> bytes:
    """The key one manager incarnation signs with: derived from the grant key and its
    incarnation (given to slabs as they register), so that no grant outlives the manager
    process that issued it, even with a configured `security.grant_key`."""
    return hmac.new(
        grant_key, b"polarkv-epoch" + manager_incarnation.to_bytes(8, "little"), sha256
    ).digest()


class _Mac:
    """HMAC-SHA256 of one key with its two padded key blocks hashed once: each grant
    costs two `copy()`s of a started hash instead of building the HMAC from the key
    (2 us instead of 5 us; a 64-key lookup signs 64 grants). Same bytes as hmac.new."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        block = sha256().block_size
        if len(key) > block:
            key = sha256(key).digest()
        key = key.ljust(block, b"\0")
        self._inner = sha256(bytes(b ^ 0x36 for b in key))
        self._outer = sha256(bytes(b ^ 0x5C for b in key))

    def __call__(self, body: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(body)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:MAC_SIZE]


@functools.lru_cache(maxsize=64)  # a process holds a few keys: its own and its shards'
def _mac(key: bytes) -> _Mac:
    return _Mac(key)


def sign(grant: Grant, key: bytes) -> bytes:
    body = grant.body()
    return body + _mac(key)(body)


class Signer:
    """Signs grants with one key from their fields, without a Grant object each (a
    64-key reply signs 64; building the frozen Grant cost as much as its MAC). The
    same bytes as `sign(Grant(...), key)`: one grant per region, as before."""

    __slots__ = ("_mac",)

    def __init__(self, key: bytes) -> None:
        self._mac = _mac(key)

    def __call__(
        self, op: Op, incarnation: int, offset: int, length: int, expires_ms: int, gen: int
    ) -> bytes:
        body = _BODY.pack(op, incarnation, offset, length, expires_ms, gen)
        return body + self._mac(body)


def decode(blob: bytes | bytearray | memoryview) -> Grant:
    """Parse without verifying (clients read offset/length for shm; the slab verifies)."""
    if len(blob) != GRANT_SIZE:
        raise ProtocolError(f"a grant is {GRANT_SIZE} bytes, got {len(blob)}")
    op, incarnation, offset, length, expires_ms, gen = _BODY.unpack_from(blob)
    if op not in (Op.READ, Op.WRITE):
        raise ProtocolError(f"unknown grant op {op}")
    return Grant(Op(op), incarnation, offset, length, expires_ms, gen)


def verify(
    blob: bytes | bytearray | memoryview,
    keys: bytes | Sequence[bytes],
    incarnation: int,
    buffer_size: int,
    now_ms: int | None = None,
) -> Grant:
    """Return the grant if it is genuine (signed with one of `keys`: each manager shard's
    current epoch key) and usable on this slab, else raise AccessDenied."""
    if len(blob) != GRANT_SIZE:
        raise ProtocolError(f"a grant is {GRANT_SIZE} bytes, got {len(blob)}")
    body = bytes(blob[:SIGNED_SIZE])
    mac = bytes(blob[SIGNED_SIZE:])
    candidates = (keys,) if isinstance(keys, bytes) else keys
    if not any(hmac.compare_digest(_mac(key)(body), mac) for key in candidates):
        raise AccessDenied("grant signature does not verify")
    grant = decode(blob)  # only a genuine grant is parsed
    if grant.incarnation != incarnation:
        raise AccessDenied("grant is for another node or incarnation")
    if grant.expires_ms < (int(time.time() * 1000) if now_ms is None else now_ms):
        raise AccessDenied("grant expired")
    if grant.length <= 0 or grant.offset < 0 or grant.offset + grant.length > buffer_size:
        raise AccessDenied("grant is outside the buffer")
    return grant
