"""The client's cache of registered buffers: found again by address range, kept while in
use, dropped least-recently-used past its byte budget. A memory region needs a device,
so a recording stand-in for the HCA plays the device's part (register / close) here;
everything else is the real cache on real buffers."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from polarkv_lib.transport.rdma import Registrations
from polarkv_lib.transport.rdma_verbs import Hca


@dataclass
class Region:
    address: int
    length: int
    closed: bool = False
    lkey: int = 7

    def close(self) -> None:
        self.closed = True


@dataclass
class RecordingHca:
    v: Any = field(default_factory=lambda: SimpleNamespace(IBV_ACCESS_LOCAL_WRITE=1))
    made: list[Region] = field(default_factory=list)

    def register(self, address: int, length: int, access: int, what: str) -> Region:
        assert access == 1 and what == "a client buffer"
        self.made.append(Region(address, length))
        return self.made[-1]


def _cache(limit: int) -> tuple[Registrations, RecordingHca]:
    hca = RecordingHca()
    return Registrations(cast(Hca, hca), limit), hca


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_a_buffer_is_registered_once_and_found_again_by_range() -> None:
    cache, hca = _cache(1 << 20)
    buf = bytearray(8192)
    address, entry = cache.acquire(memoryview(buf))
    assert address == _address(buf) and hca.made == [Region(address, 8192)]
    cache.release(entry)
    inner_address, inner = cache.acquire(memoryview(buf)[4096:6000])  # a slice of it
    assert inner is entry and inner_address == address + 4096 and len(hca.made) == 1
    cache.release(inner)
    assert cache.registered_bytes == 8192


def test_a_registered_buffer_stays_alive_and_pinned() -> None:
    cache, _ = _cache(1 << 20)
    buf = bytearray(4096)
    _, entry = cache.acquire(memoryview(buf))
    cache.release(entry)
    with pytest.raises(BufferError):  # its address must not move while the HCA may use it
        buf.extend(b"x")
    cache.close()
    buf.extend(b"x")  # deregistered: the caller has it back


def test_least_recently_used_goes_first_but_never_one_in_use() -> None:
    cache, hca = _cache(3 * 4096)
    bufs = [bytearray(4096) for _ in range(4)]
    entries = [cache.acquire(memoryview(b))[1] for b in bufs[:3]]
    for e in entries[1:]:
        cache.release(e)  # entries[0] stays in use
    cache.acquire(memoryview(bufs[3]))  # over budget: the oldest unused one goes
    assert [r.closed for r in hca.made] == [False, True, False, False]
    assert cache.registered_bytes == 3 * 4096
    cache.release(entries[0])
    cache.close()
    assert all(r.closed for r in hca.made) and cache.registered_bytes == 0
