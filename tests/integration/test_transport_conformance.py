"""One suite, every transport this machine supports (tcp, shm; rdma needs a device and
is skipped with the reason where there is none).

Each case runs against a real slab process with regions and grants from its manager.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from polarkv_lib.client import checksum
from polarkv_lib.errors import AccessDenied, NetworkError, OperationTimeout, PolarKVError
from polarkv_lib.transport import create, rdma_unavailable, shm
from polarkv_lib.transport.base import Transport
from polarkv_lib.transport.sockio import HASH_SLICE
from polarkv_lib.transport.tcp import TcpTransport
from tests.conftest import Cluster, PolarKV
from tests.integration.raw import key, post, region

NAMES = ("rdma", "shm", "tcp")
# Whether a grant's op is enforced on this path (by the slab for tcp, by the client for
# rdma; shm is guarded by file permissions instead), and whether its signature is: only
# the slab holds the key, and an rdma slab without memory windows is not asked.
VERIFIES_GRANTS = {"tcp": True, "shm": False, "rdma": True}
# Whether a read returns its bytes' checksum, taken as they arrived (else the client takes it).
HASHES_READS = {"tcp": True, "shm": True, "rdma": False}
# Whether a write returns the checksum of the bytes it put in the region.
HASHES_WRITES = {"tcp": False, "shm": True, "rdma": False}
CHECKS_SIGNATURE = {"tcp": True, "shm": False, "rdma": False}


@pytest.fixture(params=NAMES)
def transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    if request.param == "rdma" and (reason := rdma_unavailable()):
        pytest.skip(f"rdma: {reason}")
    t = create(request.param)
    yield t
    t.close()


@pytest.fixture
def node(cluster: Cluster, transport: Transport) -> PolarKV:
    if transport.name == "rdma":
        return cluster.embedded(slab__transports="tcp,shm,rdma")
    return cluster.embedded()


def _allocate(url: str, k: str, size: int) -> tuple[dict[str, Any], Any]:
    reply = post(url, "/v1/allocate", {"items": [{"key": k, "size": size}]})
    return reply, region(reply, reply["results"][0])


def test_usable_for_its_own_node(node: PolarKV, transport: Transport) -> None:
    _, r = _allocate(node.manager_url, key(1), 10)
    assert transport.usable(r.node)


@pytest.mark.parametrize("source", [bytes, bytearray])  # read-only, and with an address
@pytest.mark.parametrize("size", [1, 4095, 4096, 1 << 20, (1 << 20) + 1, (3 << 20) + 17])
def test_write_then_read_back(
    node: PolarKV, transport: Transport, size: int, source: type[bytes | bytearray]
) -> None:
    data = os.urandom(size)
    name = key(size if source is bytes else size + (1 << 30))
    reply, w = _allocate(node.manager_url, name, size)
    wrote = transport.write_from(w, memoryview(source(data)), time.monotonic() + 5)
    assert wrote == (checksum(data) if HASHES_WRITES[transport.name] else None)
    post(
        node.manager_url,
        "/v1/commit",
        {"lease": reply["lease"], "items": [{"key": name, "checksum": checksum(data)}]},
    )
    hit = post(node.manager_url, "/v1/lookup", {"keys": [name]})
    out = bytearray(size)
    got = transport.read_into(region(hit, hit["entries"][0]), memoryview(out), time.monotonic() + 5)
    assert out == data
    assert got == (checksum(data) if HASHES_READS[transport.name] else None)


def test_shm_checksums_are_of_the_callers_bytes_whatever_a_stale_writer_does(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """shm has no fence: a writer with a stale grant can change a region at any moment.
    The checksum a write returns is of the caller's bytes, and a read's of what landed
    in the caller's buffer, so such a change shows as a mismatch (a miss) and is never
    certified. Here the stale writer changes the slab's side of each piece right after
    its copy, before its hash."""
    node = cluster.embedded()
    data = os.urandom(3 * shm.COPY_BLOCK + 5)
    reply, w = _allocate(node.manager_url, key(78), len(data))
    transport = create("shm")
    copy = ctypes.memmove
    try:
        # A write copies to the region: the stale writer changes the piece just written.
        monkeypatch.setattr(
            ctypes, "memmove", lambda to, at, n: (copy(to, at, n), ctypes.memset(to, 0xA5, 1))
        )
        assert transport.write_from(w, memoryview(bytearray(data)), time.monotonic() + 5) == (
            checksum(data)
        )
        post(
            node.manager_url,
            "/v1/commit",
            {"lease": reply["lease"], "items": [{"key": key(78), "checksum": checksum(data)}]},
        )
        stored = bytearray(data)
        for start in range(0, len(data), shm.COPY_BLOCK):
            stored[start] = 0xA5
        hit = post(node.manager_url, "/v1/lookup", {"keys": [key(78)]})
        r = region(hit, hit["entries"][0])
        # A read copies from the region: the stale writer changes it again behind each copy.
        monkeypatch.setattr(
            ctypes, "memmove", lambda to, at, n: (copy(to, at, n), ctypes.memset(at, 0x5A, 1))
        )
        out = bytearray(len(data))
        got = transport.read_into(r, memoryview(out), time.monotonic() + 5)
        assert out == stored  # the first stale change is in the region and so in the copy
        assert got == checksum(stored) != checksum(data)  # what the caller got: a miss
    finally:
        monkeypatch.undo()
        transport.close()


def test_a_tcp_read_beside_others_leaves_the_checksum_to_the_client(cluster: Cluster) -> None:
    """With more reads in flight than the cores keep up with, a tcp read is received
    whole and says no checksum (the client takes it); its bytes are the same."""
    node = cluster.embedded()
    data = os.urandom((1 << 20) + 17)
    reply, w = _allocate(node.manager_url, key(77), len(data))
    transport = TcpTransport()
    try:
        transport.write_from(w, memoryview(data), time.monotonic() + 5)
        post(
            node.manager_url,
            "/v1/commit",
            {"lease": reply["lease"], "items": [{"key": key(77), "checksum": checksum(data)}]},
        )
        hit = post(node.manager_url, "/v1/lookup", {"keys": [key(77)]})
        r = region(hit, hit["entries"][0])
        transport._reads = max(os.cpu_count() or 1, 2)  # others in flight, as far as it knows
        out = bytearray(len(data))
        assert transport.read_into(r, memoryview(out), time.monotonic() + 5) is None
        assert out == data
        transport._reads = 0  # alone again: hashed as it arrives
        assert transport.read_into(r, memoryview(out), time.monotonic() + 5) == checksum(data)
    finally:
        transport.close()


def test_many_transfers_reuse_the_transport(node: PolarKV, transport: Transport) -> None:
    blobs = [os.urandom(64 * 1024) for _ in range(32)]
    regions = []
    for i, blob in enumerate(blobs):
        _, r = _allocate(node.manager_url, key(1000 + i), len(blob))
        transport.write_from(r, memoryview(blob), time.monotonic() + 5)
        regions.append(r)
    for blob, r in zip(blobs, regions, strict=True):
        out = bytearray(len(blob))
        # Where grants are checked, a WRITE grant cannot read; where they are not (shm),
        # read back through it to check the writes did not trample each other.
        if VERIFIES_GRANTS[transport.name]:
            with pytest.raises(AccessDenied):
                transport.read_into(r, memoryview(out), time.monotonic() + 5)
        else:
            transport.read_into(r, memoryview(out), time.monotonic() + 5)
            assert out == blob


def test_wrong_buffer_size_is_a_caller_error(node: PolarKV, transport: Transport) -> None:
    _, r = _allocate(node.manager_url, key(2), 100)
    with pytest.raises(ValueError):
        transport.write_from(r, memoryview(bytearray(99)), time.monotonic() + 5)
    with pytest.raises(ValueError):
        transport.read_into(r, memoryview(bytearray(101)), time.monotonic() + 5)


def test_deadline_in_the_past(node: PolarKV, transport: Transport) -> None:
    _, r = _allocate(node.manager_url, key(3), 100)
    with pytest.raises(OperationTimeout):
        transport.write_from(r, memoryview(bytearray(100)), time.monotonic() - 1)


def test_forged_grant(node: PolarKV, transport: Transport) -> None:
    _, r = _allocate(node.manager_url, key(4), 100)
    forged = bytearray(r.grant)
    forged[-1] ^= 0xFF
    bad = type(r)(r.node, r.offset, r.size, bytes(forged))
    if CHECKS_SIGNATURE[transport.name]:
        with pytest.raises(AccessDenied):
            transport.write_from(bad, memoryview(bytearray(100)), time.monotonic() + 5)
    else:
        transport.write_from(bad, memoryview(bytearray(100)), time.monotonic() + 5)


def test_dead_slab_is_a_polarkv_error(node: PolarKV, transport: Transport) -> None:
    _, r = _allocate(node.manager_url, key(5), 100)
    node.close()  # the slab process ends and removes its buffer
    if transport.name == "shm":
        assert not transport.usable(r.node)
        return
    with pytest.raises(NetworkError):
        transport.write_from(r, memoryview(bytearray(100)), time.monotonic() + 2)
    assert issubclass(NetworkError, PolarKVError)


def _stored(url: str, transport: Transport, keys: list[str], blobs: list[bytes]) -> list[Any]:
    """Write and commit each blob under its key; the write regions, in order."""
    writes = []
    for k, blob in zip(keys, blobs, strict=True):
        reply, w = _allocate(url, k, len(blob))
        transport.write_from(w, memoryview(blob), time.monotonic() + 5)
        post(
            url,
            "/v1/commit",
            {"lease": reply["lease"], "items": [{"key": k, "checksum": checksum(blob)}]},
        )
        writes.append(w)
    return writes


def test_read_many_reads_each_region_and_isolates_a_refused_one(
    node: PolarKV, transport: Transport
) -> None:
    """read_many (tcp: requests pipelined on one connection) gives every region its own
    answer: the bytes where granted, and where a grant is refused (a WRITE grant used to
    read) that region's error alone; the regions after it are still read. A checksum
    the transport hands over with a region is that of the bytes it put there (tcp
    hashes each region in pieces as they arrive: these regions span three)."""
    url = node.manager_url
    blobs = [os.urandom(2 * HASH_SLICE + 1 + i) for i in range(6)]
    keys = [key(3000 + i) for i in range(len(blobs))]
    writes = _stored(url, transport, keys, blobs)
    hit = post(url, "/v1/lookup", {"keys": keys})
    reads = [region(hit, e) for e in hit["entries"]]
    outs = [bytearray(len(b)) for b in blobs]
    whole: list[bytes] = []  # each region's bytes as `arrived` names it: already in
    sums: list[str | None] = []

    def arrived(i: int, digest: str | None) -> None:
        whole.append(bytes(outs[i]))
        sums.append(digest)

    errors = transport.read_many(
        [(r, memoryview(o)) for r, o in zip(reads, outs, strict=True)],
        time.monotonic() + 5,
        arrived,
    )
    assert errors == [None] * len(blobs) and outs == blobs and whole == blobs
    if HASHES_READS[transport.name]:
        assert sums == [checksum(b) for b in blobs]
    else:
        assert sums == [None] * len(blobs)
    if not VERIFIES_GRANTS[transport.name]:
        return
    moves = [(r, memoryview(bytearray(len(b)))) for r, b in zip(reads, blobs, strict=True)]
    moves[2] = (writes[2], moves[2][1])  # a grant for another op, mid-batch
    named: list[int] = []
    errors = transport.read_many(moves, time.monotonic() + 5, lambda i, _: named.append(i))
    assert isinstance(errors[2], AccessDenied)
    assert [e for i, e in enumerate(errors) if i != 2] == [None] * (len(blobs) - 1)
    assert named == [0, 1, 3, 4, 5]  # the refused one is not, the later ones by index
    assert [bytes(v) for i, (_, v) in enumerate(moves) if i != 2] == [
        b for i, b in enumerate(blobs) if i != 2
    ]


def test_read_many_of_a_slab_gone_fails_each_region_and_raises_nothing(
    node: PolarKV, transport: Transport
) -> None:
    url = node.manager_url
    blobs = [os.urandom(4096 + i) for i in range(3)]
    keys = [key(3100 + i) for i in range(len(blobs))]
    _stored(url, transport, keys, blobs)
    hit = post(url, "/v1/lookup", {"keys": keys})
    moves = [(region(hit, e), memoryview(bytearray(e["size"]))) for e in hit["entries"]]
    node.kill()
    if transport.name == "shm":
        return  # the mapping outlives the process: nothing to refuse
    errors = transport.read_many(moves, time.monotonic() + 5)
    assert len(errors) == len(moves) and all(isinstance(e, PolarKVError) for e in errors)
