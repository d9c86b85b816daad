"""A fault after some windows of a load or a store: the windows already done stand.

The client's contract is that a fault means fewer chunks, never none of those already
moved: a manager that dies between two windows of a long prompt leaves the loaded prefix
(or the committed head) to the caller. The fault is injected at the client's side of the
control boundary; the service, the slab and every byte are real."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from polarkv_lib.client import AsyncPolarKVClient
from polarkv_lib.errors import NetworkError
from tests.conftest import Cluster

CT = 4
CHUNK = 64 * 1024


def fail_from_call(obj: Any, name: str, n: int) -> None:
    """From its n-th call on, `obj.name` raises as a manager gone between windows would."""
    real: Callable[..., Awaitable[Any]] = getattr(obj, name)
    calls = 0

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls >= n:
            raise NetworkError("manager gone (injected)")
        return await real(*args, **kwargs)

    setattr(obj, name, wrapped)


@pytest.fixture
def url(cluster: Cluster) -> str:
    return cluster.embedded().manager_url  # started before the test's event loop runs


async def test_a_load_keeps_the_windows_read_before_a_fault(url: str) -> None:
    tokens = list(range(6 * CT))
    chunks = [os.urandom(CHUNK) for _ in range(6)]
    async with AsyncPolarKVClient(url, chunk_tokens=CT, window=2, timeout=10.0) as client:
        assert await client.store_kv(tokens, chunks) == 6
        fail_from_call(client._control, "lookup", 2)
        n, views = await client.load_kv(tokens)
        assert n == 2 * CT and [bytes(v) for v in views] == chunks[:2]
        assert client.stats.faults == 1


async def test_a_store_keeps_the_windows_committed_before_a_fault(url: str) -> None:
    tokens = list(range(1000, 1000 + 6 * CT))
    chunks = [os.urandom(CHUNK) for _ in range(6)]
    async with AsyncPolarKVClient(url, chunk_tokens=CT, window=2, timeout=10.0) as client:
        fail_from_call(client._control, "allocate", 2)
        assert await client.store_kv(tokens, chunks) == 2
        assert client.stats.faults == 1
    async with AsyncPolarKVClient(url, chunk_tokens=CT, timeout=10.0) as reader:
        n, views = await reader.load_kv(tokens)
        assert n == 2 * CT and [bytes(v) for v in views] == chunks[:2]


async def test_a_fault_in_the_first_window_is_a_plain_miss(url: str) -> None:
    tokens = list(range(2000, 2000 + 4 * CT))
    chunks = [os.urandom(CHUNK) for _ in range(4)]
    async with AsyncPolarKVClient(url, chunk_tokens=CT, window=2, timeout=10.0) as client:
        assert await client.store_kv(tokens, chunks) == 4
        fail_from_call(client._control, "lookup", 1)
        assert (await client.load_kv(tokens))[0] == 0
        assert client.stats.faults == 1


async def test_get_many_refuses_read_only_buffers_before_any_io(url: str) -> None:
    async with AsyncPolarKVClient(url, timeout=10.0) as client:
        with pytest.raises(ValueError, match="writable"):
            await client.get_many(["ab" * 16], out=[b"\0" * 16])
