"""`polarkv bench ttft` without an engine: bad arguments are refused before anything
starts, and the derived columns (recompute and load time) come from the right cells.
The bench itself runs real vLLM servers (docs/BENCHMARKS.md); it is not a timed test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from polarkv_lib.errors import ExitCode
from polarkv_lib.tools.bench.ttft import Cell, derived, render

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lengths", "1K"], "--lengths: not a list of integers"),
        (["--lengths", "64"], "--lengths: between 256"),
        (["--concurrency", "0"], "--concurrency: between 1"),
        (["--configs", "vllm,sglang"], "--configs: choose from"),
        (["--hybrid-memory", "lots"], "--hybrid-memory"),
        (["--python", "/nonexistent/python"], "scripts/setup-vllm-cpu builds it"),
    ],
)
def test_bad_arguments_exit_with_one_line_and_start_nothing(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "polarkv.py"), "bench", "ttft", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


def cell(config: str, length: int, conc: int, *ttft: float) -> Cell:
    return Cell(config, length, conc, list(ttft))


def test_recompute_and_load_time_come_from_the_p50s_at_the_lowest_concurrency() -> None:
    cells = [
        cell("vllm", 1024, 1, 0.9, 1.0, 1.1),
        cell("vllm-local", 1024, 1, 0.1, 0.1, 0.2),
        cell("polarkv-memory", 1024, 1, 0.15, 0.14, 0.16),
        cell("vllm", 1024, 4, 5.0),
        cell("vllm-local", 1024, 4, 3.0),
        cell("polarkv-memory", 1024, 4, 4.0),
    ]
    [row] = derived(cells)
    assert row["concurrency"] == 1
    assert row["recompute_s"] == pytest.approx(0.9) and row["load_s"] == pytest.approx(0.05)
    table = render(cells)
    assert "| 1K     | 1    | polarkv-memory | 150" in table and "-85%" in table
    wrong = Cell("polarkv-memory", 2048, 1, [0.2], wrong=1)
    assert "1 WRONG tokens" in render([wrong])


def test_percentiles_are_nearest_rank() -> None:
    c = cell("vllm", 1024, 1, *[i / 10 for i in range(1, 11)])
    assert c.pct(0.5) == pytest.approx(0.5) and c.pct(0.9) == pytest.approx(0.9)
