"""Key ranges of manager shards (DESIGN §11) and the arenas that split a slab among them."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polarkv_lib.shards import SPACE, Shard, group_by_shard, shard_of, split_urls

keys = st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 7, 16, 1000])
def test_every_prefix_has_exactly_one_owner(count: int) -> None:
    owners = [0] * SPACE
    for index in range(count):
        shard = Shard(index, count)
        for k in range(shard.low, shard.high):
            owners[k] += 1
    assert owners == [1] * SPACE
    for k in range(0, SPACE, 97):  # shard_of agrees with the ranges, rounding included
        key = f"{k:04x}" + "0" * 28
        assert Shard(shard_of(key, count), count).owns(key)


@given(keys, st.integers(1, 64))
def test_shard_of_is_the_design_formula(key: str, count: int) -> None:
    k = int(key[:4], 16)
    index = shard_of(key, count)
    assert index * 65536 // count <= k < (index + 1) * 65536 // count


def test_parse_and_describe() -> None:
    assert Shard.parse("1/4") == Shard(1, 4)
    assert Shard.parse(" 0 / 1 ") == Shard()
    assert str(Shard(2, 3)) == "2/3"
    assert Shard(0, 2).describe() == "0000-7fff" and Shard(1, 2).describe() == "8000-ffff"
    for bad in ("2/2", "-1/2", "1", "a/b", "0/0", 3):
        with pytest.raises(ValueError):
            Shard.parse(bad)


@pytest.mark.parametrize("count", [1, 2, 3, 7])
@pytest.mark.parametrize("size", [64 * 1024**2, 64 * 1024**2 + 12345, 5 * 4096])
def test_arenas_are_disjoint_page_aligned_and_cover_the_buffer(count: int, size: int) -> None:
    arenas = [Shard(i, count).arena(size) for i in range(count)]
    assert all(start % 4096 == 0 for start, _ in arenas)
    assert arenas[0][0] == 0
    assert sum(length for _, length in arenas) == size
    for (start, length), (next_start, _) in itertools.pairwise(arenas):
        assert start + length == next_start


def test_split_urls_and_grouping() -> None:
    assert split_urls("http://a:1, http://b:2/") == ("http://a:1", "http://b:2")
    assert split_urls(["http://a:1"]) == ("http://a:1",)
    for bad in ("", "ftp://a", "http://a,http://a"):
        with pytest.raises(ValueError):
            split_urls(bad)
    ks = ["0000" + "0" * 28, "ffff" + "0" * 28, "7fff" + "0" * 28, "8000" + "0" * 28]
    assert group_by_shard(ks, 2) == {0: [0, 2], 1: [1, 3]}


def test_an_allocator_over_an_arena_stays_inside_it() -> None:
    from polarkv_lib.manager.allocator import Allocator

    base, length = Shard(1, 3).arena(48 * 1024**2)
    alloc = Allocator(length, base)
    got = []
    while (extent := alloc.alloc(1024**2)) is not None:
        got.append(extent)
    assert got and all(base <= off and off + n <= base + length for off, n in got)
    assert sum(n for _, n in got) == length
    for off, n in got:
        alloc.release(off, n)
    assert alloc.extents() == [(base, length)]
    with pytest.raises(ValueError):
        Allocator(length, base + 1)


def test_engine_adapters_take_a_list_of_shard_urls() -> None:
    from polarkv_lib.integrations.common import settings_from_extra

    urls = ["http://10.0.0.2:8170", "http://10.0.0.3:8170/"]
    assert (
        settings_from_extra({"manager_url": urls}).manager_url
        == "http://10.0.0.2:8170,http://10.0.0.3:8170"
    )
    assert (
        settings_from_extra({"manager_url": ",".join(urls)}).manager_url
        == "http://10.0.0.2:8170,http://10.0.0.3:8170"
    )
    for bad in (None, [], ["10.0.0.2:8170"], [urls[0], urls[0]]):
        with pytest.raises(ValueError, match="manager_url"):
            settings_from_extra({"manager_url": bad})
