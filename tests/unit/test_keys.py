"""Chained chunk keys and key validation (polarkv_lib/keys.py)."""

from __future__ import annotations

import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polarkv_lib.keys import KEY_LENGTH, check_key, chunk_keys, is_valid_key

NS = "model-a"


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# -- chunk_keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "chunk", "expected"),
    [
        (0, 4, 0),
        (3, 4, 0),
        (4, 4, 1),
        (7, 4, 1),
        (8, 4, 2),
        (17, 4, 4),
        (5, 1, 5),
        (256, 256, 1),
    ],
)
def test_only_full_chunks_are_keyed(n: int, chunk: int, expected: int) -> None:
    keys = chunk_keys(tokens(n), NS, chunk)
    assert len(keys) == expected
    assert all(is_valid_key(k) for k in keys)


def test_default_chunk_is_256_tokens() -> None:
    assert len(chunk_keys(tokens(511), NS)) == 1
    assert len(chunk_keys(tokens(512), NS)) == 2


def test_deterministic_and_prefix_stable() -> None:
    full = chunk_keys(tokens(40), NS, 8)
    assert chunk_keys(tokens(40), NS, 8) == full
    # a prompt's keys are a prefix of any longer prompt's keys
    assert chunk_keys(tokens(24), NS, 8) == full[:3]
    assert chunk_keys(tokens(27), NS, 8) == full[:3]
    assert len(set(full)) == len(full)


@settings(max_examples=60, deadline=None, database=None)
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=64),
    chunk=st.integers(1, 8),
    data=st.data(),
)
def test_changing_one_token_changes_its_chunk_and_every_later_one(
    ids: list[int], chunk: int, data: st.DataObject
) -> None:
    j = data.draw(st.integers(0, len(ids) - 1), label="j")
    changed = list(ids)
    changed[j] = (ids[j] + 1) % 2**32
    before, after = chunk_keys(ids, NS, chunk), chunk_keys(changed, NS, chunk)
    c = j // chunk
    assert before[:c] == after[:c]
    for i in range(c, len(before)):
        assert before[i] != after[i], i


def test_chunk_keys_are_chained_not_positional() -> None:
    # the same chunk of tokens after different prefixes gets different keys
    a = chunk_keys([1, 2, 3, 4, 9, 9, 9, 9], NS, 4)
    b = chunk_keys([5, 6, 7, 8, 9, 9, 9, 9], NS, 4)
    assert a[1] != b[1]
    # and a chunk is not keyed independently of its position
    assert chunk_keys([9, 9, 9, 9], NS, 4)[0] not in (a[1], b[1])


def test_namespaces_separate() -> None:
    ids = tokens(16)
    a, b = chunk_keys(ids, "a", 4), chunk_keys(ids, "b", 4)
    assert not set(a) & set(b)
    assert chunk_keys(ids, "", 4) != a
    # namespace bytes cannot run into token bytes
    assert chunk_keys(ids, "ab", 4) != chunk_keys(ids, "a", 4)


def test_wide_tokens_work_and_differ_from_narrow() -> None:
    narrow = chunk_keys([0, 1, 2, 3], NS, 4)
    wide = chunk_keys([2**32, 1, 2, 3], NS, 4)
    assert len(wide) == 1 and is_valid_key(wide[0])
    assert wide != narrow
    # a uint64 token and the low/high uint32 halves it would pack into must not collide
    assert chunk_keys([2**32 + 5, 0], NS, 2) != chunk_keys([5, 1], NS, 2)
    assert chunk_keys([2**64 - 1], NS, 1) != chunk_keys([2**32 - 1], NS, 1)
    # the largest uint32 still keys fine on the narrow path
    assert chunk_keys([2**32 - 1], NS, 1) != chunk_keys([0], NS, 1)


def test_wide_chunk_only_changes_from_its_own_position() -> None:
    base = tokens(12)
    wide = list(base)
    wide[5] = 2**40
    a, b = chunk_keys(base, NS, 4), chunk_keys(wide, NS, 4)
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]


@pytest.mark.parametrize("bad", [[-1], [1, 2, -3, 4], [2**32, -1]])
def test_negative_tokens_raise_value_error(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        chunk_keys(bad, NS, len(bad))


@pytest.mark.parametrize("bad", [[1.0], [1, "2"], [True, 1], [None], [b"x"]])
def test_non_int_tokens_raise_type_error(bad: list[object]) -> None:
    with pytest.raises(TypeError):
        chunk_keys(bad, NS, 1)


@pytest.mark.parametrize("bad", ["abcd", b"abcd", 1234, None, {1, 2}])
def test_non_sequence_tokens_raise_type_error(bad: object) -> None:
    with pytest.raises(TypeError):
        chunk_keys(bad, NS, 1)


@pytest.mark.parametrize("last", [True, 7.0, "7", None])
def test_one_bad_token_at_the_end_of_a_long_prompt_is_found(last: object) -> None:
    # the check of a whole prompt in one pass must not miss a single odd token
    with pytest.raises(TypeError):
        chunk_keys([*range(4096), last], NS, 4097)


def test_int_subclasses_are_tokens_like_ints() -> None:
    class Token(int):
        pass

    assert chunk_keys([Token(t) for t in tokens(8)], NS, 4) == chunk_keys(tokens(8), NS, 4)


def test_short_non_int_tokens_still_rejected() -> None:
    # type checks do not depend on the prompt being long enough to key
    with pytest.raises(TypeError):
        chunk_keys([1.5], NS, 4)


@pytest.mark.parametrize("chunk", [0, -1, 1.5, "4"])
def test_bad_chunk_tokens(chunk: object) -> None:
    with pytest.raises(ValueError):
        chunk_keys(tokens(8), NS, chunk)  # type: ignore[arg-type]


def test_namespace_must_be_str() -> None:
    with pytest.raises(TypeError):
        chunk_keys(tokens(8), b"ns", 4)  # type: ignore[arg-type]


def test_tuple_and_array_inputs_match_list() -> None:
    ids = tokens(12)
    expected = chunk_keys(ids, NS, 4)
    assert chunk_keys(tuple(ids), NS, 4) == expected
    assert chunk_keys(array.array("I", ids), NS, 4) == expected


def test_numpy_arrays_accepted() -> None:
    np = pytest.importorskip("numpy")
    ids = tokens(12)
    expected = chunk_keys(ids, NS, 4)
    assert chunk_keys(np.array(ids, dtype=np.int64), NS, 4) == expected
    assert chunk_keys(np.array(ids, dtype=np.uint32), NS, 4) == expected
    assert chunk_keys(np.array([2**40] * 4, dtype=np.uint64), NS, 4) == chunk_keys(
        [2**40] * 4, NS, 4
    )
    with pytest.raises(ValueError):
        chunk_keys(np.array([1, -1], dtype=np.int64), NS, 2)
    with pytest.raises(TypeError):
        chunk_keys(np.array([1.0, 2.0]), NS, 2)


# -- is_valid_key / check_key -------------------------------------------------------------


VALID = "0123456789abcdef" * 2


@pytest.mark.parametrize("key", [VALID, "0" * 32, "f" * 32])
def test_valid_keys(key: str) -> None:
    assert len(key) == KEY_LENGTH
    assert is_valid_key(key)
    assert check_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        VALID.upper(),
        VALID[:31],
        VALID + "0",
        "g" * 32,
        "",
        None,
        123,
        VALID.encode(),
        VALID[:31] + "\n",
        VALID + "\n",
        " " + VALID[:31],
        "../etc/passwd",
        "../" + VALID[3:],
        VALID[:16] + "-" + VALID[17:],
    ],
)
def test_invalid_keys(key: object) -> None:
    assert not is_valid_key(key)
    with pytest.raises(ValueError, match="32 lowercase hex"):
        check_key(key)


def test_tokens_above_uint64_raise_value_error() -> None:
    assert not issubclass(OverflowError, ValueError)  # so the check below means something
    with pytest.raises(ValueError, match=r"2\*\*64"):
        chunk_keys([2**64], NS, 1)
    with pytest.raises(ValueError, match=r"2\*\*64"):
        chunk_keys([5, 2**70], NS, 2)
    assert len(chunk_keys([2**64 - 1], NS, 1)) == 1  # the largest uint64 is still a token
