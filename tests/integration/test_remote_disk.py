"""The global-pool experiment's remote disk store over real loopback sockets: a
`RemoteDiskStore` against the serving side with a real `DiskStore` in a temporary
directory; bytes come back intact, refusals arrive as the same DiskFailure, and a
server that goes away is an I/O error, not a hang."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from polarkv_lib.cluster.remote_disk import RemoteDiskStore, _Server
from polarkv_lib.errors import DiskFailure, Failure
from polarkv_lib.node.disk import DiskStore

KEY = "ab" * 16
OTHER = "cd" * 16


def checksum(data: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[_Server, DiskStore]]:
    store = DiskStore((str(tmp_path / "files"),), 1 << 20, o_direct=False)
    server = _Server(("127.0.0.1", 0), store)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, store
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def remotes() -> Iterator[list[RemoteDiskStore]]:
    opened: list[RemoteDiskStore] = []
    yield opened
    for remote in opened:
        remote.close()


def remote_of(
    server: _Server, opened: list[RemoteDiskStore], capacity: int = 1 << 20
) -> RemoteDiskStore:
    opened.append(RemoteDiskStore(f"127.0.0.1:{server.server_address[1]}", capacity))
    return opened[-1]


def test_offload_reload_delete_and_scan_round_trip(
    served: tuple[_Server, DiskStore], remotes: list[RemoteDiskStore]
) -> None:
    server, store = served
    remote = remote_of(server, remotes)
    data = os.urandom(100_000)
    need = remote.offload(KEY, memoryview(bytearray(data)), len(data), checksum(data))
    assert need == remote.file_bytes(len(data)) and remote.used == need
    assert KEY in store.files  # the file lives on the serving side
    back = bytearray(len(data))
    remote.reload(KEY, memoryview(back), len(data), checksum(data))
    assert bytes(back) == data
    assert remote.counters.offloads == 1 and remote.counters.reloads == 1
    fresh = remote_of(server, remotes)  # another node's view: it learns the files by scanning
    assert [(f.key, f.size) for f in fresh.scan()] == [(KEY, len(data))]
    assert remote.delete(KEY) and KEY not in store.files and remote.used == 0
    assert not remote.delete(KEY)


def test_refusals_arrive_as_the_same_failure(
    served: tuple[_Server, DiskStore], remotes: list[RemoteDiskStore]
) -> None:
    server, _ = served
    remote = remote_of(server, remotes)
    with pytest.raises(DiskFailure) as missing:
        remote.reload(OTHER, memoryview(bytearray(10)), 10, "0" * 16)
    assert missing.value.reason is not Failure.IO_ERROR
    small = remote_of(
        server, remotes, capacity=4096
    )  # its own budget, checked before any byte moves
    with pytest.raises(DiskFailure) as full:
        small.offload(KEY, memoryview(bytearray(8192)), 8192, checksum(bytes(8192)))
    assert full.value.reason is Failure.DISK_FULL and small.used == 0


def test_a_server_gone_is_an_io_error(
    served: tuple[_Server, DiskStore], remotes: list[RemoteDiskStore]
) -> None:
    server, _ = served
    remote = remote_of(server, remotes)
    data = b"x" * 5000
    remote.offload(KEY, memoryview(bytearray(data)), len(data), checksum(data))
    server.shutdown()
    server.server_close()
    remote.close()  # the connection dies with its server
    with pytest.raises(DiskFailure) as gone:
        remote.reload(KEY, memoryview(bytearray(len(data))), len(data), checksum(data))
    assert gone.value.reason is Failure.IO_ERROR
