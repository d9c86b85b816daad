"""`polarkv bench cluster` in a tiny configuration: it runs, checks every byte, and its
counters tell the layouts apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest


@pytest.mark.slow
def test_bench_cluster_tiny(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "polarkv",
            "bench",
            "cluster",
            "--layouts",
            "tiered,global",
            "--memory-vms",
            "2",
            "--client-vms",
            "1",
            "--slab-memory",
            "16MiB",
            "--working-set",
            "1.5",
            "--chunk-size",
            "256KiB",
            "--seconds",
            "3",
            "--state-dir",
            str(tmp_path / "state"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| tiered" in done.stdout and "| global" in done.stdout
    results = {r["layout"]: r for r in orjson.loads(out.read_bytes())["results"]}
    for r in results.values():
        assert r["load"]["wrong_bytes"] == 0 and r["load"]["chunks_hit"] > 0
    assert results["tiered"]["between_memory_vms"] < 256 * 1024
    assert results["global"]["between_memory_vms"] > 4 * 1024**2
