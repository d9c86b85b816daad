"""The manager's size-class allocator (polarkv_lib/manager/allocator.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polarkv_lib.manager.allocator import PAGE, Allocator, size_class

KiB, MiB = 1024, 1024**2


# -- size_class ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (1, PAGE),
        (PAGE, PAGE),
        (PAGE + 1, 2 * PAGE),
        (32 * KiB, 32 * KiB),
        (32 * KiB + 1, 36 * KiB),
        (64 * KiB, 64 * KiB),
        (64 * KiB + 1, 72 * KiB),
        (MiB, MiB),
        (MiB + 1, MiB + 128 * KiB),
    ],
)
def test_size_class_examples(size: int, expected: int) -> None:
    assert size_class(size) == expected


@pytest.mark.parametrize("size", [0, -1, -PAGE])
def test_size_class_rejects_non_positive(size: int) -> None:
    with pytest.raises(ValueError):
        size_class(size)


@settings(max_examples=500, deadline=None, database=None)
@given(st.one_of(st.integers(1, 64 * KiB), st.integers(1, 2**40)))
def test_size_class_properties(size: int) -> None:
    cls = size_class(size)
    assert cls >= size
    assert cls % PAGE == 0
    assert cls - size < PAGE or cls - size <= size / 8
    if size > 32 * KiB:
        assert cls - size <= size / 8
    else:
        assert cls - size < PAGE  # below 32 KiB: page rounding only
    assert size_class(cls) == cls  # a class is its own class


def test_size_classes_are_few() -> None:
    # above 32 KiB there are 8 classes per power of two
    classes = {size_class(s) for s in range(MiB + 1, 2 * MiB + 1, 1000)}
    assert len(classes) == 8


def test_size_class_is_monotonic() -> None:
    prev = 0
    for size in range(1, 4 * MiB, 977):
        cls = size_class(size)
        assert cls >= prev
        prev = cls


# -- Allocator: examples ------------------------------------------------------------------


def test_capacity_rounded_down_to_pages() -> None:
    a = Allocator(10 * PAGE + 100)
    assert a.capacity == 10 * PAGE
    assert a.extents() == [(0, 10 * PAGE)]
    assert Allocator(PAGE - 1).extents() == []
    assert Allocator(0).alloc(1) is None


def test_alloc_returns_size_class_and_tracks_used() -> None:
    a = Allocator(MiB)
    off, length = a.alloc(100)  # type: ignore[misc]
    assert (off, length) == (0, PAGE)
    assert a.used == PAGE and a.free == MiB - PAGE
    off2, length2 = a.alloc(33 * KiB)  # type: ignore[misc]
    assert length2 == 36 * KiB and off2 == PAGE
    a.release(off, length)
    a.release(off2, length2)
    assert a.used == 0
    assert a.extents() == [(0, MiB)]


def test_alloc_fails_when_full_and_succeeds_after_free() -> None:
    a = Allocator(4 * PAGE)
    got = [a.alloc(PAGE) for _ in range(4)]
    assert all(g is not None for g in got)
    assert a.alloc(1) is None
    assert a.free == 0
    a.release(*got[2])  # type: ignore[misc]
    assert a.alloc(PAGE) == got[2]


def test_fragmented_space_is_not_enough() -> None:
    a = Allocator(4 * PAGE)
    blocks = [a.alloc(PAGE) for _ in range(4)]
    a.release(*blocks[0])  # type: ignore[misc]
    a.release(*blocks[2])  # type: ignore[misc]
    assert a.free == 2 * PAGE
    assert a.alloc(2 * PAGE) is None  # two free pages, but not adjacent
    a.release(*blocks[1])  # type: ignore[misc]
    assert a.extents() == [(0, 3 * PAGE)]
    assert a.alloc(3 * PAGE) == (0, 3 * PAGE)


def test_coalesces_in_any_free_order() -> None:
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2], [0, 2, 1], [1, 2, 0], [2, 0, 1]):
        a = Allocator(3 * PAGE)
        blocks = [a.alloc(PAGE) for _ in range(3)]
        for i in order:
            a.release(*blocks[i])  # type: ignore[misc]
        assert a.extents() == [(0, 3 * PAGE)], order
        assert a.used == 0


def test_double_free_of_standalone_extent_raises() -> None:
    a = Allocator(MiB)
    x = a.alloc(PAGE)
    a.alloc(PAGE)  # keeps x from coalescing to the right
    assert x is not None
    a.release(*x)
    with pytest.raises(ValueError):
        a.release(*x)
    assert a.used == PAGE


def test_double_free_of_extent_merged_to_the_right_raises() -> None:
    a = Allocator(3 * PAGE)
    x, y = a.alloc(PAGE), a.alloc(PAGE)
    assert x is not None and y is not None
    a.release(*y)  # y merges with the free tail
    a.release(*x)  # x merges with y: one extent starting at x
    with pytest.raises(ValueError):
        a.release(*x)


def test_double_free_of_extent_merged_to_the_left_raises() -> None:
    a = Allocator(4 * PAGE)
    x, y = a.alloc(PAGE), a.alloc(PAGE)
    a.alloc(PAGE)
    assert x is not None and y is not None
    a.release(*x)
    a.release(*y)  # y merges into x's free extent: y's offset no longer starts an extent
    before = (a.used, a.extents())
    with pytest.raises(ValueError, match="not an allocation"):
        a.release(*y)
    assert (a.used, a.extents()) == before == (PAGE, [(0, 2 * PAGE), (3 * PAGE, PAGE)])


def test_release_must_match_the_allocated_length() -> None:
    a = Allocator(4 * PAGE)
    x = a.alloc(2 * PAGE)
    assert x == (0, 2 * PAGE)
    for offset, length in ((0, PAGE), (0, 3 * PAGE), (PAGE, PAGE)):  # part, more, inside
        with pytest.raises(ValueError, match="not an allocation"):
            a.release(offset, length)
    assert a.used == 2 * PAGE and a.extents() == [(2 * PAGE, 2 * PAGE)]
    a.release(*x)
    assert a.used == 0 and a.extents() == [(0, 4 * PAGE)]


@pytest.mark.parametrize(("offset", "length"), [(-PAGE, PAGE), (MiB, PAGE), (MiB - PAGE, 2 * PAGE)])
def test_release_outside_capacity_raises(offset: int, length: int) -> None:
    a = Allocator(MiB)
    a.alloc(MiB)
    with pytest.raises(ValueError):
        a.release(offset, length)
    assert a.used == MiB


def test_release_of_never_allocated_free_start_raises() -> None:
    a = Allocator(MiB)
    with pytest.raises(ValueError):
        a.release(0, PAGE)
    assert a.used == 0
    assert a.extents() == [(0, MiB)]


def test_prefers_lowest_address_among_larger_bins() -> None:
    a = Allocator(MiB)
    blocks = [a.alloc(64 * KiB) for _ in range(16)]
    assert a.alloc(1) is None
    a.release(*blocks[9])  # type: ignore[misc]
    a.release(*blocks[3])  # type: ignore[misc]
    got = a.alloc(PAGE)
    assert got == (3 * 64 * KiB, PAGE)


# -- Allocator: property ------------------------------------------------------------------

CAPACITY = 64 * MiB

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.one_of(st.integers(1, 64 * KiB), st.integers(1, 6 * MiB))),
        st.tuples(st.just("free"), st.integers(0, 10**6)),
    ),
    max_size=120,
)


def check_consistent(a: Allocator, live: dict[int, int]) -> None:
    assert a.used == sum(live.values())
    assert a.free == a.capacity - a.used
    regions = sorted(live.items()) + a.extents()
    regions.sort()
    # live allocations and free extents tile the buffer exactly, with no overlap or gap
    pos = 0
    for start, length in regions:
        assert start == pos, (start, pos, regions)
        assert length > 0 and start % PAGE == 0 and length % PAGE == 0
        pos = start + length
    assert pos == a.capacity
    # free extents are coalesced: no two are adjacent
    free = a.extents()
    for (s1, l1), (s2, _) in itertools.pairwise(free):
        assert s1 + l1 < s2


@settings(max_examples=150, deadline=None, database=None)
@given(ops)
def test_random_alloc_free_sequences(seq: list[tuple[str, int]]) -> None:
    a = Allocator(CAPACITY)
    live: dict[int, int] = {}
    for op, arg in seq:
        if op == "alloc":
            need = size_class(arg)
            got = a.alloc(arg)
            if got is None:
                # it may only fail when no free extent can hold the size class
                assert all(length < need for _, length in a.extents())
            else:
                off, length = got
                assert length == need >= arg
                assert off % PAGE == 0
                assert off >= 0 and off + length <= CAPACITY
                for o, n in live.items():
                    assert off + length <= o or o + n <= off, "overlap"
                live[off] = length
        elif live:
            off = sorted(live)[arg % len(live)]
            a.release(off, live.pop(off))
        check_consistent(a, live)
    for off, length in list(live.items()):
        a.release(off, length)
    assert a.used == 0
    assert a.extents() == [(0, CAPACITY)]


def test_reserve_takes_exactly_the_given_extent() -> None:
    a = Allocator(8 * PAGE)
    assert a.reserve(2 * PAGE, 3 * PAGE)
    assert a.used == 3 * PAGE
    assert a.extents() == [(0, 2 * PAGE), (5 * PAGE, 3 * PAGE)]
    # anything overlapping it, misaligned or empty is refused and changes nothing
    for offset, length in (
        (4 * PAGE, 2 * PAGE),
        (PAGE, 2 * PAGE),
        (PAGE + 1, PAGE),
        (0, PAGE + 1),
        (0, 0),
        (0, -PAGE),
        (7 * PAGE, 2 * PAGE),
        (8 * PAGE, PAGE),
    ):
        assert not a.reserve(offset, length), (offset, length)
    assert a.used == 3 * PAGE and a.extents() == [(0, 2 * PAGE), (5 * PAGE, 3 * PAGE)]
    assert a.reserve(0, 2 * PAGE) and a.extents() == [(5 * PAGE, 3 * PAGE)]
    # a reserved extent is an allocation like any other: freed once, exactly
    with pytest.raises(ValueError):
        a.release(2 * PAGE, PAGE)
    a.release(2 * PAGE, 3 * PAGE)
    a.release(0, 2 * PAGE)
    with pytest.raises(ValueError):
        a.release(0, 2 * PAGE)
    assert a.used == 0 and a.extents() == [(0, 8 * PAGE)]
    assert a.alloc(8 * PAGE) == (0, 8 * PAGE)
