"""The disk role's file store on a real filesystem: layout, O_DIRECT, scan, faults."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import xxhash

from polarkv_lib.errors import ConfigError, DiskFailure, Failure
from polarkv_lib.node.disk import DiskStore
from polarkv_lib.wire.orders import FILE_HEADER_SIZE as HEADER_SIZE

KEY = "0123456789abcdef0123456789abcdef"


def region(size: int) -> memoryview:
    # what the slab hands the disk role: a page-aligned slice of an mmap'd buffer,
    # extending to the allocation's page boundary
    return memoryview(mmap.mmap(-1, -(-size // 4096) * 4096 + 4096))


@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("size", [1, 4096, 1_000_003, 4 << 20])
def test_offload_reload_round_trip(tmp_path: Path, o_direct: bool, size: int) -> None:
    store = DiskStore((str(tmp_path),), 1 << 30, o_direct)
    data = os.urandom(size)
    src = region(size)
    src[:size] = data
    checksum = xxhash.xxh3_64_hexdigest(data)
    file_bytes = store.offload(KEY, src, size, checksum)
    path = tmp_path / KEY[:2] / KEY[2:4] / KEY
    assert path.stat().st_size == file_bytes == store.used
    dst = region(size)
    store.reload(KEY, dst, size, checksum)
    assert bytes(dst[:size]) == data
    assert store.stats()["reloads"] == 1 and store.stats()["reload_bytes"] == size
    # a fresh process finds it again
    again = DiskStore((str(tmp_path),), 1 << 30, o_direct)
    (info,) = again.scan()
    assert (info.key, info.size, info.checksum, info.file_bytes) == (
        KEY,
        size,
        checksum,
        file_bytes,
    )


def test_scan_keeps_verified_files_and_removes_the_rest(tmp_path: Path) -> None:
    store = DiskStore((str(tmp_path),), 1 << 30, False)
    data = os.urandom(10_000)
    src = region(len(data))
    src[: len(data)] = data
    store.offload(KEY, src, len(data), xxhash.xxh3_64_hexdigest(data))
    good = tmp_path / KEY[:2] / KEY[2:4] / KEY
    junk = [
        tmp_path / "aa" / "bb" / ("aabb" + "0" * 28 + ".123.tmp"),  # a crash mid-write
        tmp_path / "zz" / "not-a-key",
        tmp_path / "ff" / "ee" / ("ffee" + "1" * 28),
    ]  # a key name with no valid header
    for path in junk:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 5000)
    short = tmp_path / "12" / "34" / ("1234" + "2" * 28)  # header says more than the file has
    short.parent.mkdir(parents=True, exist_ok=True)
    short.write_bytes(
        good.read_bytes()[:HEADER_SIZE].replace(bytes.fromhex(KEY), bytes.fromhex(short.name))
        + b"y" * 10
    )
    found = DiskStore((str(tmp_path),), 1 << 30, False).scan()
    assert [f.key for f in found] == [KEY]
    assert good.exists() and not any(p.exists() for p in [*junk, short])


def test_capacity_and_faults(tmp_path: Path) -> None:
    store = DiskStore((str(tmp_path),), 3 * 4096 + 2 * HEADER_SIZE, False)
    data = os.urandom(3 * 4096)
    src = region(len(data))
    src[: len(data)] = data
    checksum = xxhash.xxh3_64_hexdigest(data)
    store.offload(KEY, src, len(data), checksum)
    other = "f" * 32
    with pytest.raises(DiskFailure) as full:
        store.offload(other, src, len(data), checksum)
    assert full.value.reason is Failure.DISK_FULL
    assert not list(tmp_path.rglob("*.tmp"))
    with pytest.raises(DiskFailure) as wrong:  # the entry the manager knows differs from the file
        store.reload(KEY, region(len(data)), len(data), "0" * 16)
    assert wrong.value.reason is Failure.BAD_HEADER
    with pytest.raises(DiskFailure) as missing:
        store.reload(other, region(10), 10, checksum)
    assert missing.value.reason is Failure.MISSING
    with pytest.raises(ValueError):
        store.path_for("../../etc/passwd")


def test_unwritable_path_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"disk\.paths"):
        DiskStore((str(blocker / "sub"),), 1 << 30, False)
