"""The shm transport: a client on the slab's host maps its buffer file and copies.

No slab CPU on the path. The grant is not checked here (nothing on the slab side runs):
same-host access is guarded by the file's permissions (0600, the slab's user), so shm
is for clients the host already trusts; others use tcp. A mapping is keyed by the
buffer path, which carries the slab's incarnation, so it can never serve a newer
incarnation's memory under an old name.

What makes the copy run near memcpy speed:
- It is `ctypes.memmove` between raw addresses, which releases the GIL: concurrent
  transfers copy on all cores, and the client's event loop keeps running meanwhile. A
  memoryview slice of the region stays exported for the whole copy, so the mapping
  cannot be closed (mmap.close raises BufferError) while an address into it is in use.
- A read or a write copies in COPY_BLOCK pieces and hashes each piece right after its
  copy, while it is still in the core's cache (a read what landed in the caller's
  buffer, a write the caller's bytes; xxh3 releases the GIL too), and returns the
  checksum: each byte crosses the memory bus once each way. Hashing a whole chunk
  after its copy reads it from memory again, on whichever thread: a third more memory
  traffic, which costs where one copy already fills the memory bus (docs/BENCHMARKS.md).
- A fresh mapping has no page-table entries; touching it page by page costs a fault per
  4 KiB, several times the copy itself. The first transfer into each 2 MiB block of the
  mapping populates the block's entries in one madvise(MADV_POPULATE_WRITE) call
  (Linux >= 5.14; elsewhere the pages simply fault in), about half the cost of faulting.
  Later transfers find the block populated and pay nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable

from polarkv_lib.errors import NetworkError, OperationTimeout
from polarkv_lib.host import host_id
from polarkv_lib.transport.base import NodeTarget, Region, Transport, checksum_stream

_MADV_POPULATE_WRITE = 23  # linux/mman.h; absent from Python's mmap module before 3.12
_BLOCK = 2 * 1024**2  # populate granularity: one huge page's worth of entries


def _load_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):  # the advice number is Linux's
        return None
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):  # no libc with madvise: pages fault in on first touch
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


# A transfer's copy-then-hash piece: within a core's L2 on current x86 servers (1-2
# MiB), and large enough that the calls per piece are small beside its copy (128-768
# KiB pieces measured slower, 2 MiB no better: docs/BENCHMARKS.md).
COPY_BLOCK = 1024 * 1024


def _copy_hashed(target: memoryview, source: memoryview, hashed: memoryview) -> str:
    """Copy `source` into `target` (both non-empty, of one length, `target` writable)
    piece by piece, hashing each piece of `hashed` (one of the two) right after its copy;
    the checksum of the whole."""
    hasher = checksum_stream()
    to = _address(target)
    at = None if source.readonly else _address(source)
    for start in range(0, len(target), COPY_BLOCK):
        end = min(start + COPY_BLOCK, len(target))
        if at is None:  # e.g. bytes: no address for memmove; copied with the GIL
            target[start:end] = source[start:end]
        else:
            ctypes.memmove(to + start, at + start, end - start)
        hasher.update(hashed[start:end])
    return hasher.hexdigest()


def _address(view: memoryview) -> int:
    """The address of a writable, contiguous buffer (the view stays exported while the
    caller holds it, so the address stays valid)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _Mapping:
    __slots__ = ("address", "mm", "populated", "view")

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.view = memoryview(mm)
        self.address = _address(self.view)
        self.populated = bytearray(-(-len(mm) // _BLOCK))  # one flag per block

    def populate(self, offset: int, size: int) -> None:
        """Map the blocks under [offset, offset + size) if not done yet. The caller holds
        a view of that range, so the mapping cannot go away meanwhile."""
        first, last = offset // _BLOCK, (offset + size - 1) // _BLOCK
        if _madvise is None or self.populated.find(0, first, last + 1) < 0:
            return
        start, end = first * _BLOCK, min((last + 1) * _BLOCK, len(self.view))
        if _madvise(self.address + start, end - start, _MADV_POPULATE_WRITE) == 0:
            self.populated[first : last + 1] = b"\x01" * (last + 1 - first)
        else:  # unsupported kernel, or a signal: faults will do; never ask again
            self.populated[:] = b"\x01" * len(self.populated)


class ShmTransport(Transport):
    name = "shm"

    def __init__(self) -> None:
        self._host_id = host_id()
        self._maps: dict[str, _Mapping] = {}
        self._lock = threading.Lock()

    def usable(self, node: NodeTarget) -> bool:
        if "shm" not in node.transports or not node.shm_path or node.host_id != self._host_id:
            return False
        if os.path.exists(node.shm_path):
            return True
        self._unmap(node.shm_path)  # that slab is gone: let its memory go too
        return False

    def _unmap(self, path: str) -> None:
        with self._lock:
            mapped = self._maps.pop(path, None)
        if mapped is not None:
            mapped.view.release()
            try:
                mapped.mm.close()
            except BufferError:  # a transfer still holds a region; unmapped when it ends
                pass

    def _mapping(self, node: NodeTarget) -> _Mapping:
        with self._lock:
            mapped = self._maps.get(node.shm_path)
            if mapped is not None:
                return mapped
            try:
                fd = os.open(node.shm_path, os.O_RDWR)
            except OSError as exc:
                raise NetworkError(
                    f"cannot open slab buffer {node.shm_path}: {exc.strerror}"
                ) from None
            try:
                mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as exc:
                raise NetworkError(f"cannot map slab buffer {node.shm_path}: {exc}") from None
            finally:
                os.close(fd)
            mapped = self._maps[node.shm_path] = _Mapping(mm)
            return mapped

    def _region(self, region: Region, size: int, deadline: float) -> memoryview:
        if time.monotonic() > deadline:
            raise OperationTimeout("deadline passed")
        if size != region.size:
            raise ValueError(f"buffer of {size} bytes for a region of {region.size}")
        mapped = self._mapping(region.node)
        try:
            if region.offset < 0 or region.offset + region.size > len(mapped.view):
                raise NetworkError("region lies outside the slab buffer")
            view = mapped.view[region.offset : region.offset + region.size]
        except ValueError:  # released: usable() found the slab gone meanwhile
            raise NetworkError(f"slab buffer {region.node.shm_path} was unmapped") from None
        if size:
            mapped.populate(region.offset, region.size)
        return view

    def read_into(self, region: Region, view: memoryview, deadline: float) -> str | None:
        with self._region(region, len(view), deadline) as source:
            if view.readonly or not view:  # read-only: the client refuses it before any I/O
                view[:] = source
                return None  # nothing moved to hash: the caller takes it
            # What landed in the caller's buffer: a writer changing the slab's bytes
            # meanwhile makes this differ from the stored checksum, and the read a miss.
            return _copy_hashed(view, source, view)

    def write_from(self, region: Region, view: memoryview, deadline: float) -> str | None:
        # The caller's bytes are hashed, not the region's: shm has no fence, and a stale
        # writer changing the region meanwhile must make it disagree with the checksum
        # (a miss for its readers), not get its bytes certified as this entry's.
        with self._region(region, len(view), deadline) as target:
            return _copy_hashed(target, view, view) if view else None

    def close(self) -> None:
        for path in list(self._maps):
            self._unmap(path)
