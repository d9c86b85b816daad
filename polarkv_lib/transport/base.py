"""The transport interface: move one granted region between a slab and a local buffer.

Transports are blocking and thread-safe: the async client runs them in its transfer
thread pool, where a large copy or socket transfer releases the GIL. Every call is
bounded by an absolute `deadline` (time.monotonic()) and raises a PolarKVError
(NetworkError, AccessDenied, OperationTimeout, ProtocolError) on any fault, never a
third-party exception.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from polarkv_lib.errors import PolarKVError

BufferLike = bytes | bytearray | memoryview


def checksum(data: BufferLike) -> str:
    """A chunk's checksum as the manager records it: xxh3-64, in hex."""
    return xxhash.xxh3_64_hexdigest(data)


def checksum_stream() -> xxhash.xxh3_64:
    """The same checksum taken piece by piece (`update`, then `hexdigest`)."""
    return xxhash.xxh3_64()


@dataclass(frozen=True, slots=True)
class NodeTarget:
    node_id: str
    address: str
    incarnation: int
    shm_path: str
    host_id: str
    transports: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Region:
    """One granted region of a node's buffer: what the manager handed out."""

    node: NodeTarget
    offset: int
    size: int
    grant: bytes


# read_many's callback: region i is in, with its checksum if the transport took it.
Arrived = Callable[[int, str | None], None]


class Transport(ABC):
    name: str

    @abstractmethod
    def usable(self, node: NodeTarget) -> bool:
        """Whether this transport can reach `node` from here."""

    @abstractmethod
    def read_into(self, region: Region, view: memoryview, deadline: float) -> str | None:
        """Copy the region into `view` (len(view) == region.size). Returns the bytes'
        checksum where the transport took it as they arrived (tcp: piece by piece, while
        in the CPU's cache), else None: the caller takes it."""

    @abstractmethod
    def write_from(self, region: Region, view: memoryview, deadline: float) -> str | None:
        """Copy `view` (len(view) == region.size) into the region. Returns the checksum
        of `view`'s bytes where the transport took it as they went (shm: piece by piece,
        each right after its copy, while in the CPU's cache), else None: the caller
        takes it."""

    def read_many(
        self,
        moves: Sequence[tuple[Region, memoryview]],
        deadline: float,
        arrived: Arrived | None = None,
    ) -> list[PolarKVError | None]:
        """read_into for each (region, view) of one slab, in order; each one's error, or
        None where it arrived. `arrived(i, checksum)` is called, in the calling thread, as
        soon as region i is in whole (exactly for the regions whose error is None), with
        what read_into returned, so the caller can check its bytes while the next ones
        arrive. A transport with a cheaper way to read several (tcp: pipelined requests)
        overrides it; the answers are the same."""
        errors: list[PolarKVError | None] = []
        for i, (region, view) in enumerate(moves):
            try:
                digest = self.read_into(region, view, deadline)
            except PolarKVError as exc:
                errors.append(exc)
                continue
            errors.append(None)
            if arrived is not None:
                arrived(i, digest)
        return errors

    @abstractmethod
    def close(self) -> None:
        """Drop pooled connections and mappings."""
