"""`polarkv bench stall` without an engine: bad arguments are refused before anything
starts, and the report's figures (gap quantiles, p99 against vLLM alone) come from the
right cells. The bench itself runs real vLLM servers (docs/BENCHMARKS.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from polarkv_lib.errors import ExitCode
from polarkv_lib.stats import percentile as pct
from polarkv_lib.tools.bench.stall import Cell, render

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--streams", "0"], "--streams 1..16"),
        (["--prefix-tokens", "1000"], "--prefix-tokens: a multiple of 256"),
        (["--stream-tokens", "4"], "--stream-tokens 16..4096"),
        (["--configs", "vllm,sglang"], "--configs: choose from"),
        (["--hybrid-memory", "lots"], "--hybrid-memory"),
        (["--python", "/nonexistent/python"], "scripts/setup-vllm-cpu builds it"),
    ],
)
def test_bad_arguments_exit_with_one_line_and_start_nothing(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "polarkv.py"), "bench", "stall", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


def test_quantiles_are_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    assert pct(values, 0.5) == 50.0 and pct(values, 0.99) == 99.0 and pct([], 0.5) == 0.0
    assert pct([3.0, 1.0, 2.0], 0.99) == 3.0


def test_report_compares_p99_gaps_with_vllm_alone() -> None:
    base = Cell("vllm", gaps=[0.01] * 99 + [0.02], ttft=[1.0])
    stalled = Cell("polarkv-sync", gaps=[0.01] * 90 + [0.5] * 10, ttft=[0.1], hit_tokens=4096)
    smooth = Cell("polarkv-async", gaps=[0.011] * 100, ttft=[0.12], wrong=1, hit_tokens=4096)
    table = render([base, stalled, smooth])
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "50.00x" in rows["polarkv-sync"] and "500.0" in rows["polarkv-sync"]
    assert "1.10x" in rows["polarkv-async"] and "1 WRONG tokens" in rows["polarkv-async"]
    assert smooth.to_json()["gap_p99_s"] == 0.011 and smooth.to_json()["hit_tokens"] == 4096


def test_report_compares_p99_gaps_with_vllm_own_cache_too() -> None:
    base = Cell("vllm", gaps=[0.01] * 100, ttft=[1.0])
    cached = Cell("vllm-cached", gaps=[0.01] * 90 + [0.04] * 10, ttft=[0.05], hit_tokens=4096)
    loaded = Cell("polarkv-async", gaps=[0.01] * 90 + [0.05] * 10, ttft=[0.12], hit_tokens=4096)
    table = render([base, cached, loaded])
    rows = {line.split("|")[1].strip(): line.split("|") for line in table.splitlines()[2:]}
    header = [h.strip() for h in table.splitlines()[0].split("|")]
    vs_vllm, vs_cached = header.index("p99 vs vLLM"), header.index("p99 vs cached")
    assert rows["polarkv-async"][vs_vllm].strip() == "5.00x"
    assert rows["polarkv-async"][vs_cached].strip() == "1.25x"
    assert rows["vllm-cached"][vs_vllm].strip() == "4.00x"
    assert rows["vllm-cached"][vs_cached].strip() == ""  # itself
