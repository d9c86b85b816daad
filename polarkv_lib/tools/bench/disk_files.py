"""Raw file I/O for the disk benchmark: the baseline side (plain pwrite/preadv, one file
per object), page-aligned touched buffers, distinct random objects, and the clean-up and
cache handling between rounds."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import shutil
import struct
import threading
from collections.abc import Callable

from polarkv_lib.node.disk import DiskStore
from polarkv_lib.tools.bench.core import BenchError
from polarkv_lib.tools.bench.measure import run_threads

IO_TIMEOUT = 120.0  # a raw or DiskStore measurement stuck this long is abandoned


def probe_o_direct(directory: str) -> None:
    probe = os.path.join(directory, ".o_direct-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as exc:
        raise BenchError(
            f"--path: {directory} does not support O_DIRECT ({exc.strerror}); choose "
            f"a path on a disk filesystem or run without O_DIRECT (--no-o-direct)"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def filesystem(path: str) -> str:
    """'ext4 on /dev/vda (mounted at /)': the mount that holds `path`."""
    best = ("", "?", "?")
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            mount_point = fields[4]
            fs_type, device = fields[fields.index("-") + 1 : fields.index("-") + 3]
            inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best[0]):
                best = (mount_point, fs_type, device)
    return f"{best[1]} on {best[2]} (mounted at {best[0] or '?'})"


def fill(view: memoryview, size: int, n: int) -> None:
    """Random bytes, every object distinct (its index and size in its first 16 bytes), so
    a misplaced object is caught and no layer can compress or deduplicate its way ahead."""
    block = os.urandom(256 * 1024)
    for off in range(0, n * size, len(block)):
        view[off : off + len(block)] = block[: n * size - off]
    for i in range(n):
        struct.pack_into("<QQ", view, i * size, i, size)


def anonymous(nbytes: int) -> mmap.mmap:
    """Page-aligned memory (O_DIRECT needs it), touched now rather than while timing."""
    mm = mmap.mmap(-1, nbytes)
    for off in range(0, nbytes, 4096):
        mm[off] = 0xA5
    return mm


def drain_threads(n: int, threads: int, op: Callable[[int], None]) -> float:
    """Run op(0..n-1) on `threads` threads that each take the next index from a shared
    counter, as a thread pool takes queued orders; return the seconds from their common
    start to the last one's end."""
    counter = itertools.count()
    lock = threading.Lock()
    stop = threading.Event()  # one failed or late: the others stop at their next object

    def drain(_: int) -> None:
        while not stop.is_set():
            with lock:
                i = next(counter)
            if i >= n:
                return
            try:
                op(i)
            except BaseException:
                stop.set()
                raise

    return run_threads(threads, drain, IO_TIMEOUT, "disk measurement", stop.set)


def raw_write(path: str, data: memoryview, direct: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
    try:
        done = 0
        while done < len(data):
            n = os.pwrite(fd, data[done:], done)
            if n <= 0:
                raise OSError(f"{path}: short write")
            done += n
    finally:
        os.close(fd)


def raw_read(path: str, into: memoryview, direct: int) -> None:
    fd = os.open(path, os.O_RDONLY | direct)
    try:
        done = 0
        while done < len(into):
            n = os.preadv(fd, [into[done:]], done)
            if n <= 0:
                raise OSError(f"{path}: short read")
            done += n
    finally:
        os.close(fd)


def remove_files(directory: str) -> None:
    """Untimed clean-up between rounds. The sync lets the filesystem finish the frees
    (and, on a `discard` mount, the trims) before the next round measures."""
    shutil.rmtree(directory, ignore_errors=True)
    os.sync()


def drop_caches(o_direct: bool, notes: list[str]) -> None:
    """Without O_DIRECT, a read measurement must start from a cold page cache, on both
    sides; the pages written a moment ago would otherwise be read from memory."""
    if o_direct:
        return
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1")
    except OSError:
        notes.append("page cache NOT dropped (needs root): reads may come from memory")


def make_key_dirs(store: DiskStore, keys: list[str]) -> None:
    """Create the directories the keys' files go to, untimed. A node that has run a while
    has all of them (two levels of 256, never removed), so a steady-state offload finds
    its directory; on a fresh node the first offloads also pay one or two mkdirs each."""
    for key in keys:
        os.makedirs(os.path.dirname(store.path_for(key)), exist_ok=True)
    os.sync()
