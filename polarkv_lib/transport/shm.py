"""The shm transport: a client on the slab's host maps its buffer file and copies.

No slab CPU on the path. The grant is not checked here (nothing on the slab side runs):
same-host access is guarded by the file's permissions (0600, the slab's user), so shm
is for clients the host already trusts; others use tcp. A mapping is keyed by the
buffer path, which carries the slab's incarnation, so it can never serve a newer
incarnation's memory under an old name.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

from polarkv_lib.errors import NetworkError, OperationTimeout
from polarkv_lib.host import host_id
from polarkv_lib.transport.base import NodeTarget, Region, Transport


class ShmTransport(Transport):
    name = "shm"

    def __init__(self) -> None:
        self._host_id = host_id()
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}
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
            mapped[1].release()
            try:
                mapped[0].close()
            except BufferError:
                pass

    def _view(self, node: NodeTarget) -> memoryview:
        with self._lock:
            mapped = self._maps.get(node.shm_path)
            if mapped is not None:
                return mapped[1]
            try:
                fd = os.open(node.shm_path, os.O_RDWR)
            except OSError as exc:
                raise NetworkError(f"cannot open slab buffer {node.shm_path}: {exc.strerror}") from None
            try:
                mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as exc:
                raise NetworkError(f"cannot map slab buffer {node.shm_path}: {exc}") from None
            finally:
                os.close(fd)
            view = memoryview(mm)
            self._maps[node.shm_path] = (mm, view)
            return view

    def _region(self, region: Region, size: int, deadline: float) -> memoryview:
        if time.monotonic() > deadline:
            raise OperationTimeout("deadline passed")
        if size != region.size:
            raise ValueError(f"buffer of {size} bytes for a region of {region.size}")
        view = self._view(region.node)
        if region.offset + region.size > len(view):
            raise NetworkError("region lies outside the slab buffer")
        return view[region.offset: region.offset + region.size]

    def read_into(self, region: Region, view: memoryview, deadline: float) -> None:
        view[:] = self._region(region, len(view), deadline)

    def write_from(self, region: Region, view: memoryview, deadline: float) -> None:
        self._region(region, len(view), deadline)[:] = view

    def close(self) -> None:
        for path in list(self._maps):
            self._unmap(path)
