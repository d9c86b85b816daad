"""The disk role: one file per key on this node's own disks, written from and read into
the slab buffer of the same process (paired sharding: no tiering byte leaves the VM).

File layout: a 4096-byte header, then the payload (padded to 4096 bytes when O_DIRECT
is on). The header holds magic, version, key, payload length, xxh3-64 and the tenant
whose entry it is, so a file can be checked without trusting its name, and a restarted
process can adopt what it finds. A file is named by its entry's identity (keys.ident:
the key, `.tenant` after it for a tenant's entry), so two tenants' entries of one key
are two files. Version 1 headers (no tenant) are the default tenant's.
Files are written under a temporary name and renamed when complete: a crash leaves a
`.tmp` that the start-up scan removes, never a short file under a real key.

Several `disk.paths` are striped by key (software RAID-0: each key lives on exactly one
path, chosen from the key's bits, so volumes add their bandwidth). Every call here is
blocking; the slab runs them in a thread pool so the event loop never waits on a disk.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from polarkv_lib.config import DiskConfig
from polarkv_lib.errors import ConfigError
from polarkv_lib.errors import DiskFailure as DiskFailure  # re-exported: callers meet it here
from polarkv_lib.errors import Failure as Failure
from polarkv_lib.keys import TENANT_NAME, ident, is_valid_ident, split_ident
from polarkv_lib.progress import progress
from polarkv_lib.transport.sockio import pread_into, pwrite_all
from polarkv_lib.wire.orders import FILE_ALIGN as ALIGN
from polarkv_lib.wire.orders import FILE_HEADER_SIZE as HEADER_SIZE  # the manager books with these

MAGIC = b"PKVDISK1"
VERSION = 2  # 1: no tenant (the default tenant's files)
# magic, version, header size, key, length, checksum, then (version 2) the tenant
_HEADER = struct.Struct("<8sHH16sQQ")
_TENANT = struct.Struct("<B64s")


@dataclass(frozen=True, slots=True)
class FileInfo:
    key: str  # the entry's identity (keys.ident)
    size: int
    checksum: str
    file_bytes: int


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def encode_header(key: str, size: int, checksum: str) -> bytes:
    """The header of the file of the entry `key` (its identity)."""
    tenant, plain = split_ident(key)
    name = tenant.encode()
    body = _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, bytes.fromhex(plain), size, int(checksum, 16))
    body += _TENANT.pack(len(name), name)
    return body + b"\0" * (HEADER_SIZE - len(body))


def decode_header(raw: bytes | memoryview) -> FileInfo:
    if len(raw) < _HEADER.size + _TENANT.size:
        raise DiskFailure(Failure.TRUNCATED, "file shorter than its header")
    magic, version, header_size, key, size, checksum = _HEADER.unpack_from(raw)
    if magic != MAGIC or version not in (1, VERSION) or header_size != HEADER_SIZE:
        raise DiskFailure(Failure.BAD_HEADER, "not a PolarKV file")
    tenant = ""
    if version >= 2:
        length, name = _TENANT.unpack_from(raw, _HEADER.size)
        tenant = bytes(name[:length]).decode(errors="replace")
        if tenant and not TENANT_NAME.fullmatch(tenant):
            raise DiskFailure(Failure.BAD_HEADER, "header names no tenant")
    return FileInfo(ident(tenant, key.hex()), size, f"{checksum:016x}", 0)


@dataclass
class DiskCounters:
    offloads: int = 0
    offload_bytes: int = 0
    reloads: int = 0
    reload_bytes: int = 0
    deletes: int = 0


class DiskStore:
    def __init__(self, paths: tuple[str, ...], capacity: int, o_direct: bool) -> None:
        self.paths = [os.path.abspath(p) for p in paths]
        self.capacity = capacity
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.used = 0
        self.files: dict[str, FileInfo] = {}
        self.counters = DiskCounters()
        self._lock = threading.Lock()
        for path in self.paths:
            try:
                os.makedirs(path, exist_ok=True)
                probe = os.path.join(path, ".polarkv-write-probe")
                with open(probe, "wb") as fh:
                    fh.write(b"ok")
                os.unlink(probe)
            except OSError as exc:
                raise ConfigError(f"disk.paths: {path} is not writable: {exc.strerror}") from None

    # -- layout -------------------------------------------------------------------------

    def path_for(self, key: str) -> str:
        """Where the file of the entry `key` (its identity) lives."""
        if not is_valid_ident(key):  # identities become file names: nothing else does
            raise ValueError(f"not a key: {key!r:.60}")
        root = self.paths[int(key[:8], 16) % len(self.paths)]
        return os.path.join(root, key[:2], key[2:4], key)

    def file_bytes(self, size: int) -> int:
        return HEADER_SIZE + (_round_up(size) if self.o_direct else size)

    # -- start-up scan ------------------------------------------------------------------

    def _walk(self) -> Iterator[str]:
        for root in self.paths:
            for dirpath, _, names in os.walk(root):
                for name in names:
                    yield os.path.join(dirpath, name)

    def scan(self) -> list[FileInfo]:
        """Find the files a previous process left; keep those whose header verifies and
        whose length matches, delete the rest (temporaries, foreign or broken files)."""
        found: list[FileInfo] = []
        # A node with millions of files takes a while here: show it (total unknown).
        with progress(None, "disk scan", "files", log_lines=True) as bar:
            for path in self._walk():
                bar.update(1)
                self._check_file(path, found)
        with self._lock:
            self.files = {f.key: f for f in found}
            self.used = sum(f.file_bytes for f in found)
        return found

    def _check_file(self, path: str, found: list[FileInfo]) -> None:
        """Keep one file found by the scan if it verifies; delete it otherwise."""
        name = os.path.basename(path)
        if name.startswith(".polarkv"):
            return
        try:
            if not is_valid_ident(name) or self.path_for(name) != path:
                raise DiskFailure(Failure.BAD_HEADER, "not a key file in its place")
            with open(path, "rb") as fh:
                info = decode_header(fh.read(HEADER_SIZE))
                actual = os.fstat(fh.fileno()).st_size
            if info.key != name:
                raise DiskFailure(Failure.BAD_HEADER, "header names another key")
            if actual < HEADER_SIZE + info.size:
                raise DiskFailure(Failure.TRUNCATED, "file shorter than its header says")
        except (OSError, DiskFailure):
            try:
                os.unlink(path)
            except OSError:
                pass
            return
        found.append(FileInfo(info.key, info.size, info.checksum, actual))

    # -- operations (blocking; run in a thread pool) -------------------------------------

    def _open_flags(self, base: int) -> int:
        return base | (os.O_DIRECT if self.o_direct else 0)

    def offload(self, key: str, region: memoryview, size: int, checksum: str) -> int:
        """Write `region[:size]` to the key's file; return the file's size on disk.
        With O_DIRECT, `region` must extend to the next 4096 boundary past `size`."""
        need = self.file_bytes(size)
        with self._lock:
            old = self.files.get(key)
            if self.used - (old.file_bytes if old else 0) + need > self.capacity:
                raise DiskFailure(Failure.DISK_FULL, f"disk.capacity {self.capacity} reached")
            self.used += need  # reserve now; concurrent offloads must not overbook
        try:
            self._write(key, region, size, checksum)
        except BaseException:
            with self._lock:
                self.used -= need
            raise
        with self._lock:
            if old is not None:
                self.used -= old.file_bytes
            self.files[key] = FileInfo(key, size, checksum, need)
            self.counters.offloads += 1
            self.counters.offload_bytes += size
        return need

    def _write(self, key: str, region: memoryview, size: int, checksum: str) -> None:
        """Put the payload where `reload` finds it: a verified file, replaced atomically.
        (The cluster's experiment-only remote disk puts it on another VM instead.)"""
        path = self.path_for(key)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            payload = region[: _round_up(size)] if self.o_direct else region[:size]
            header = self._aligned(encode_header(key, size, checksum))
            fd = os.open(tmp, self._open_flags(os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 0o600)
            try:
                pwrite_all(fd, [header, payload], 0)
                if self.o_direct and _round_up(size) != size:
                    os.ftruncate(fd, HEADER_SIZE + _round_up(size))
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            reason = (
                Failure.DISK_FULL if exc.errno in (errno.ENOSPC, errno.EDQUOT) else Failure.IO_ERROR
            )
            raise DiskFailure(reason, f"{path}: {exc.strerror}") from None

    def reload(self, key: str, region: memoryview, size: int, checksum: str) -> None:
        """Read the key's payload into `region[:size]` and verify it; raise DiskFailure
        (and delete the file when it is broken) otherwise."""
        path = self.path_for(key)
        try:
            fd = os.open(path, self._open_flags(os.O_RDONLY))
        except FileNotFoundError:
            self._forget(key)
            raise DiskFailure(Failure.MISSING, path) from None
        except OSError as exc:
            raise DiskFailure(Failure.IO_ERROR, f"{path}: {exc.strerror}") from None
        try:
            # Header and payload in one read: one I/O per reload, not two. Bytes landing in
            # the region before the header is checked are harmless: nothing reads this
            # extent until the reload reports success.
            header = self._aligned(bytes(HEADER_SIZE))
            want = _round_up(size) if self.o_direct else size
            got = os.preadv(fd, [header, region[:want]], 0)
            if got < _HEADER.size:
                raise DiskFailure(Failure.TRUNCATED, path)
            info = decode_header(header)
            if info.key != key or info.size != size or info.checksum != checksum:
                raise DiskFailure(Failure.BAD_HEADER, f"{path}: header does not match the entry")
            got = max(got - HEADER_SIZE, 0)
            if 0 < got < want:  # a short read: finish it
                got += pread_into(fd, region[got:want], HEADER_SIZE + got)
            if got < size:
                raise DiskFailure(Failure.TRUNCATED, f"{path}: {got} of {size} bytes")
        except OSError as exc:
            raise DiskFailure(Failure.IO_ERROR, f"{path}: {exc.strerror}") from None
        except DiskFailure as failure:
            if failure.reason is not Failure.IO_ERROR:
                self.delete(key)
            raise
        finally:
            os.close(fd)
        if xxhash.xxh3_64_hexdigest(region[:size]) != checksum:
            self.delete(key)
            raise DiskFailure(Failure.CHECKSUM, f"{path}: payload does not match its checksum")
        with self._lock:
            self.counters.reloads += 1
            self.counters.reload_bytes += size

    def delete(self, key: str) -> bool:
        try:
            os.unlink(self.path_for(key))
            deleted = True
        except FileNotFoundError:
            deleted = False
        except OSError:
            deleted = False
        self._forget(key)
        if deleted:
            with self._lock:
                self.counters.deletes += 1
        return deleted

    def _forget(self, key: str) -> None:
        with self._lock:
            info = self.files.pop(key, None)
            if info is not None:
                self.used -= info.file_bytes

    # -- helpers ------------------------------------------------------------------------

    def _aligned(self, data: bytes) -> memoryview:
        """O_DIRECT needs page-aligned memory: an anonymous mmap is."""
        if not self.o_direct:
            return memoryview(bytearray(data))
        buf = mmap.mmap(-1, len(data))
        buf[:] = data
        return memoryview(buf)

    def stats(self) -> dict[str, int]:
        with self._lock:
            c = self.counters
            return {
                "disk_files": len(self.files),
                "disk_used": self.used,
                "disk_capacity": self.capacity,
                "offloads": c.offloads,
                "offload_bytes": c.offload_bytes,
                "reloads": c.reloads,
                "reload_bytes": c.reload_bytes,
                "disk_deletes": c.deletes,
            }


def local_store(config: DiskConfig) -> DiskStore:
    """`disk.store = "local"`: files on this node's own disks."""
    return DiskStore(config.paths, config.capacity, config.o_direct)
