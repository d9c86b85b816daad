"""Checking a client's corruption report where the bytes are, before anything is dropped.

A client that finds a checksum mismatch reports the key when it releases its lease. A
report alone proves nothing (any client could cry "corrupt" to delete a key it may
only read), so the manager reads the entry's region from its slab itself, over the tcp
data plane under a READ grant it signs for the entry's generation, and compares the
bytes with the checksum their writer committed. Only a mismatch drops the entry; a
match, or a region that can no longer be read (the slab's fence refuses it once newer
bytes hold that space, the slab is unreachable), leaves it, and the report is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import xxhash

from polarkv_lib.errors import ProtocolError
from polarkv_lib.wire import frames
from polarkv_lib.wire.grants import Grant, Op, sign

TIMEOUT = 5.0
_HASH_ON_LOOP = 1 << 20  # larger payloads are hashed on a thread


@dataclass(frozen=True, slots=True)
class Region:
    address: str  # the slab's data address, host:port
    incarnation: int
    offset: int
    size: int
    gen: int
    checksum: str  # what the writer committed: xxh3-64, hex


async def read_region(address: str, grant: bytes, size: int) -> bytes | None:
    """One READ frame to a slab; the payload, or None if it was refused or did not come
    within TIMEOUT."""
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(TIMEOUT):
            reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            try:
                writer.write(frames.encode_request(Op.READ, grant))
                status, length = frames.decode_response(
                    await reader.readexactly(frames.RESPONSE_SIZE)
                )
                if status is not frames.Status.OK or length != size:
                    return None
                return await reader.readexactly(length)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, ProtocolError):
        return None


async def bytes_are_bad(region: Region, key: bytes, expires_ms: int) -> bool | None:
    """True: the slab's bytes do not match the committed checksum; False: they do; None:
    they could not be read."""
    grant = sign(
        Grant(Op.READ, region.incarnation, region.offset, region.size, expires_ms, region.gen), key
    )
    data = await read_region(region.address, grant, region.size)
    if data is None:
        return None
    if len(data) > _HASH_ON_LOOP:
        digest = await asyncio.to_thread(xxhash.xxh3_64_hexdigest, data)
    else:
        digest = xxhash.xxh3_64_hexdigest(data)
    return digest != region.checksum
