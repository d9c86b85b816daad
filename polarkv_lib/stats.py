"""The one definition of a percentile every report uses (docs/BENCHMARKS.md "Method").

Nearest rank: the q-th percentile of n values is the smallest value with at least q·n of
the values at or below it, so it is always one of the measured values (the p50 of 1…10
is 5, the p99 of 100 values is the 99th smallest). A leaf: benchmarks, the load
generator, trace replay and the cluster's workload import it alike."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile, `q` in [0, 1]; 0.0 for no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a percentile's q is in [0, 1], not {q}")
    ordered: Sequence[float] = sorted(values)
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(round(q * len(ordered), 9)))  # round: 0.29 * 100 is 28.999...
    return ordered[rank - 1]


def percentiles(values: Iterable[float], *qs: float) -> tuple[float, ...]:
    """Several percentiles of the same values, sorted once."""
    ordered = sorted(values)
    return tuple(percentile(ordered, q) for q in qs)
