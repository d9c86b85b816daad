"""The one percentile every report uses: nearest rank (docs/BENCHMARKS.md "Method")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polarkv_lib.stats import percentile, percentiles


def test_nearest_rank_is_one_of_the_values() -> None:
    one_to_ten = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose
    assert percentile(one_to_ten, 0.5) == 5.0  # not 5.5: no interpolation
    assert percentile(one_to_ten, 0.9) == 9.0 and percentile(one_to_ten, 0.91) == 10.0
    assert percentile(one_to_ten, 0.0) == 1.0 and percentile(one_to_ten, 1.0) == 10.0
    hundred = [float(v) for v in range(1, 101)]
    assert percentiles(hundred, 0.29, 0.5, 0.99) == (29.0, 50.0, 99.0)


def test_no_values_and_bad_q() -> None:
    assert percentile([], 0.99) == 0.0
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        percentile([1.0], 50)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1), st.floats(0, 1))
def test_at_least_q_of_the_values_are_at_or_below_it(values: list[float], q: float) -> None:
    p = percentile(values, q)
    assert p in values
    assert sum(v <= p for v in values) >= q * len(values) - 1e-9
    assert sum(v < p for v in values) < max(1, q * len(values) + 1e-9)
