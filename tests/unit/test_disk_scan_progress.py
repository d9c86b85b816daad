"""The start-up scan of a node's disk reports its progress: a bar on a terminal,
structured log lines (every LOG_EVERY_S, and one at the end) in a service's log."""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

import pytest
import xxhash
from structlog.testing import capture_logs

from polarkv_lib import progress
from polarkv_lib.node.disk import DiskStore


def test_disk_scan_logs_progress_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskStore((str(tmp_path),), 1 << 30, False)
    region = memoryview(mmap.mmap(-1, 8192))
    keys = [hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest() for i in range(5)]
    for key in keys:
        region[:100] = os.urandom(100)
        store.offload(key, region, 100, xxhash.xxh3_64_hexdigest(region[:100]))
    (tmp_path / "stray").write_bytes(b"not ours")  # counted, then deleted
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # a line per file
    with capture_logs() as logs:
        found = DiskStore((str(tmp_path),), 1 << 30, False).scan()
    assert sorted(f.key for f in found) == sorted(keys)
    assert not (tmp_path / "stray").exists()
    lines = [e for e in logs if e.get("task") == "disk scan"]
    assert [e["done"] for e in lines if e["event"] == "progress"] == [1, 2, 3, 4, 5, 6]
    assert lines[-1]["event"] == "progress_done" and lines[-1]["done"] == 6
    assert lines[-1]["unit"] == "files" and lines[-1]["total"] is None
