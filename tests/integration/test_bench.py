"""The benchmarks as a user runs them: tiny configurations of `polarkv bench ...` start
real services and peers, check every loaded byte and write JSON; bad arguments are one
line and exit 2. Speed is not asserted (benchmarks are not timed tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polarkv_lib.tools.bench.core import Pairs
from polarkv_lib.tools.bench.limits import Buffers, batches
from polarkv_lib.tools.bench.peers import Row, _round
from polarkv_lib.tools.bench.peers_base import Peer
from tests.conftest import ROOT

POLARKV = [sys.executable, str(ROOT / "polarkv.py")]


def bench(*args: str, timeout: float = 110) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*POLARKV, "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["peers", "--sizes", "1KiB"], "bench peers: --sizes: from 4KiB to 64MiB"),
        (["peers", "--systems", "memcached"], "bench peers: --systems: choose from"),
        (["peers", "--total", "lots"], "bench peers: --total: not a size"),
        (["datapath", "--concurrency", "0"], "bench datapath: --concurrency: between 1 and 64"),
        (["disk", "--parts", "everything"], "bench disk: --parts: choose from"),
        (["manager", "--entries", "10"], "bench manager: --entries: between 64 and"),
        (["manager", "--seconds", "soon"], "bench manager: --seconds: not a number"),
        (["manager", "--shards", "0,2"], "bench manager: --shards: between 1 and 16"),
        (["load", "--chunk-size", "big"], "bench load: --chunk-size: not a size"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = bench(*args, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(message), result.stderr


def test_peers_tiny_run_verifies_every_system(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    png = tmp_path / "peers.png"
    result = bench(
        "peers",
        "--sizes",
        "256KiB,1MiB",
        "--total",
        "4MiB",
        "--rounds",
        "1",
        "--concurrency",
        "2",
        "--json",
        str(out),
        "--plot",
        str(png),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(out.read_bytes())
    rows = {(r["system"], r["size"], r["op"]): r for r in doc["rows"]}
    # raw (every row's base), PolarKV over both transports and Redis must run here;
    # Mooncake runs where scripts/setup-peers installed it, or is skipped with a reason.
    for system in ("polarkv-tcp", "polarkv-shm", "redis", "redis-pipelined"):
        for size in (256 * 1024, 1024**2):
            for op in ("store", "load"):
                row = rows[system, size, op]
                assert row["ours"] and row["ours"][0] > 0 and row["base"][0] > 0, row
                assert not row["notes"], row  # no miss, no short store, no differing byte
    if "mooncake" in doc["skipped"]:
        assert doc["skipped"]["mooncake"]
    else:
        assert not rows["mooncake", 1024**2, "load"]["notes"]
    assert "| polarkv-tcp" in result.stdout and "ratio to raw" in result.stdout
    if png.exists():  # matplotlib is in the test extra; keep the committed size small
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000


def test_datapath_tiny_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "datapath.json"
    result = bench(
        "datapath",
        "--sizes",
        "1MiB",
        "--concurrency",
        "1",
        "--total",
        "8MiB",
        "--memory",
        "32MiB",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(out.read_bytes())
    assert {(r["transport"], r["op"]) for r in doc["rows"]} == {
        ("tcp", "store"),
        ("tcp", "load"),
        ("shm", "store"),
        ("shm", "load"),
    }
    assert all(
        r["ours"] and not any("BYTES" in n or "hit" in n for n in r["notes"]) for r in doc["rows"]
    )


@pytest.mark.slow
def test_manager_tiny_run_restarts_with_every_entry(tmp_path: Path) -> None:
    out = tmp_path / "manager.json"
    result = bench(
        "manager", "--entries", "2048", "--seconds", "0.3", "--rounds", "1", "--json", str(out)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(out.read_bytes())
    assert {r["op"] for r in doc["rows"]} == {"lookup", "allocate, 90% leased", "allocate"}
    assert all(r["ours"][0] > 0 and r["base"][0] > 0 for r in doc["rows"])
    (table,) = doc["tables"]
    assert table["restored"] == 2048 and 0 < table["first_hit_s"] <= table["restored_s"] + 0.5
    assert not table["notes"]


def test_manager_shards_tiny_run_serves_every_shard(tmp_path: Path) -> None:
    out = tmp_path / "shards.json"
    result = bench(
        "manager", "--entries", "1024", "--shards", "1,2", "--seconds", "0.3", "--rounds", "1",
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_bytes())["shards"]
    assert [(r["shards"], r["op"]) for r in rows] == [
        (1, "lookup"), (1, "allocate"), (2, "lookup"), (2, "allocate"),
    ]  # fmt: skip
    # Every lookup hit all 64 keys and every allocation stored all 64, over both shards.
    assert all(r["pairs_per_s"] > 0 and r["manager_cores"] > 0 and not r["notes"] for r in rows)


class _Corrupting(Peer):
    """Stores nothing anywhere and 'loads' bytes that differ in one place: the bench's
    check, not a system, is under test here."""

    name = "corrupting"

    def store(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int]:
        return 0.01, n

    def load(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int, bool]:
        bufs.dst[:] = bufs.src
        bufs.dst[n * bufs.size // 2] ^= 1
        return (
            0.01,
            n,
            all(
                bufs.same(start, count)
                for calls in batches(bufs.size, n, 2)
                for start, count in calls
            ),
        )


def test_a_differing_byte_is_reported() -> None:
    from polarkv_lib.tools.bench.limits import RawServer

    bufs = Buffers(64 * 1024, 8)
    rows = {
        ("corrupting", op, bufs.size): Row("corrupting", bufs.size, op) for op in ("store", "load")
    }
    server = RawServer()
    try:
        _round([_Corrupting()], server, bufs, 8, 2, rows, iter(range(1, 10)), {})
    finally:
        server.close()
    assert "BYTES DIFFER" in rows["corrupting", "load", bufs.size].notes


def test_batches_cover_each_object_once() -> None:
    for size, n, conc in ((1024**2, 256, 4), (16 * 1024**2, 16, 4), (4096, 1000, 3)):
        calls = [c for per in batches(size, n, conc) for c in per]
        covered = sorted(i for start, count in calls for i in range(start, start + count))
        assert covered == list(range(n // conc * conc))
        assert all(count <= 64 and count * size <= max(size, 64 * 1024**2) for _, count in calls)


def test_ratio_is_the_median_of_paired_rounds() -> None:
    row = Pairs()
    for ours, base in ((1.0, 2.0), (3.0, 3.0), (0.5, 2.0)):
        row.add(ours, base)
    assert row.ratio() == 0.5 and row.best() == (3.0, 3.0)
