"""The slab buffer: one mmap of a file under /dev/shm, shared with same-host readers.

The file is fully allocated up front (posix_fallocate), so a full tmpfs is a clear
start-up error instead of a SIGBUS on the first write into an unbacked page. Its name
carries the node id and incarnation, so a client's mapping can never outlive the
incarnation it was made for.
"""

from __future__ import annotations

import glob
import mmap
import os
import re

from polarkv_lib.errors import ConfigError


def buffer_path(shm_dir: str, node_id: str, incarnation: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node_id)
    return os.path.join(shm_dir, f"polarkv-{safe}-{incarnation:016x}.buf")


def stale_buffers(shm_dir: str, node_id: str, keep: str = "") -> list[str]:
    """Buffer files of any incarnation of `node_id` (but `keep`): what a process of this
    node killed with -9 left behind. They hold no live data: their incarnation is gone."""
    pattern = buffer_path(shm_dir, node_id, 0).replace("0" * 16, "*")
    return [path for path in glob.glob(pattern) if path != keep]


def remove_stale_buffers(shm_dir: str, node_id: str, keep: str = "") -> None:
    for path in stale_buffers(shm_dir, node_id, keep):
        try:
            os.unlink(path)
        except OSError:
            pass


class SlabBuffer:
    def __init__(self, shm_dir: str, node_id: str, incarnation: int, size: int) -> None:
        self.size = size
        self.path = buffer_path(shm_dir, node_id, incarnation)
        # Buffers left by an earlier process of this node (killed with -9) hold no live
        # data for anyone: their incarnation is gone. Reclaim their memory.
        remove_stale_buffers(shm_dir, node_id, keep=self.path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise ConfigError(f"slab.shm_dir: cannot create {self.path}: {exc.strerror}") from None
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(self.path)
                raise ConfigError(
                    f"slab.memory: cannot reserve {size} bytes in {shm_dir}: {exc.strerror}"
                ) from None
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:  # a region is still exported (a transfer in flight); unmap at exit
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
