"""Kept for importers of the old location; the benchmarks' shared pieces live in
polarkv_lib/tools/bench/ (core: errors and tables; measure: timers)."""

from polarkv_lib.tools.bench.core import BenchError, markdown_table
from polarkv_lib.tools.bench.measure import run_threads

__all__ = ["BenchError", "markdown_table", "run_threads"]
