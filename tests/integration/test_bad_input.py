"""Bad input gets a 4xx with a reason, changes nothing, and the process stays healthy."""

from __future__ import annotations

import os
import socket
import time

import pytest

from polarkv_lib.errors import AccessDenied
from polarkv_lib.transport.tcp import TcpTransport
from polarkv_lib.wire import frames
from polarkv_lib.wire.grants import Op
from tests.conftest import Cluster, PolarKV, http, stats
from tests.integration.raw import key, post, region, write

K = key(7)


@pytest.fixture
def node(cluster: Cluster) -> PolarKV:
    return cluster.embedded(
        manager__max_batch="8",
        manager__max_object_size="1MiB",
        manager__max_body_size="64KiB",
        manager__read_lease="300ms",
    )


CASES = [
    # (method, path, raw body, status, error text)
    ("POST", "/v1/lookup", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/lookup", b"[1, 2]", 400, "must be a JSON object"),
    ("POST", "/v1/lookup", b"{}", 400, "'keys' is required"),
    ("POST", "/v1/lookup", b'{"keys": "abc"}', 400, "'keys' must be list"),
    ("POST", "/v1/lookup", b'{"keys": []}', 400, "must not be empty"),
    (
        "POST",
        "/v1/lookup",
        b'{"keys": ["ABCDEF0123456789ABCDEF0123456789"]}',
        400,
        "32 lowercase hex",
    ),
    ("POST", "/v1/lookup", b'{"keys": ["../../etc/passwd"]}', 400, "32 lowercase hex"),
    (
        "POST",
        "/v1/lookup",
        b'{"keys": ["' + K.encode() + b'"], "lease": 1}',
        400,
        "'lease' must be bool",
    ),
    (
        "POST",
        "/v1/lookup",
        b'{"keys": [' + b",".join([b'"' + K.encode() + b'"'] * 9) + b"]}",
        413,
        "maximum is 8",
    ),
    (
        "POST",
        "/v1/allocate",
        b'{"items": [{"key": "' + K.encode() + b'", "size": 0}]}',
        400,
        "must be > 0",
    ),
    (
        "POST",
        "/v1/allocate",
        b'{"items": [{"key": "' + K.encode() + b'", "size": -5}]}',
        400,
        "must be > 0",
    ),
    (
        "POST",
        "/v1/allocate",
        b'{"items": [{"key": "' + K.encode() + b'", "size": "10"}]}',
        400,
        "size must be an integer",
    ),
    (
        "POST",
        "/v1/allocate",
        b'{"items": [{"key": "' + K.encode() + b'", "size": true}]}',
        400,
        "size must be an integer",
    ),
    (
        "POST",
        "/v1/allocate",
        b'{"items": [{"key": "' + K.encode() + b'", "size": 1048577}]}',
        413,
        "above the maximum object size",
    ),
    ("POST", "/v1/allocate", b'{"items": [7]}', 400, "must be an object"),
    (
        "POST",
        "/v1/commit",
        b'{"lease": "xyz", "items": [{"key": "' + K.encode() + b'", "checksum": "00"}]}',
        400,
        "not a lease id",
    ),
    (
        "POST",
        "/v1/commit",
        b'{"lease": "0123456789abcdef", "items": [{"key": "' + K.encode() + b'", "checksum": 5}]}',
        400,
        "checksum must be 16 lowercase hex",
    ),
    ("POST", "/v1/release", b'{"leases": [1]}', 400, "not a lease id"),
    ("POST", "/v1/abort", b'{"keys": []}', 400, "'lease' is required"),
    ("POST", "/v1/renew", b'{"leases": "x"}', 400, "'leases' must be list"),
    (
        "POST",
        "/v1/nodes/heartbeat",
        b'{"node_id": "nobody", "incarnation": 5}',
        404,
        "unknown node",
    ),
    (
        "POST",
        "/v1/nodes/unregister",
        b'{"node_id": "nobody", "incarnation": 5}',
        404,
        "unknown node",
    ),
    (
        "POST",
        "/v1/nodes/heartbeat",
        b'{"node_id": "a/b", "incarnation": 5}',
        400,
        "'node_id' must be",
    ),
    (
        "POST",
        "/v1/nodes/register",
        b'{"node_id": "n", "incarnation": 0, "address": "h:1", "capacity": 9}',
        400,
        "incarnation",
    ),
    (
        "POST",
        "/v1/nodes/register",
        b'{"node_id": "n", "incarnation": 3, "address": "nohost", "capacity": 9}',
        400,
        "host:port",
    ),
    ("GET", "/v1/keys/NOTAKEY", None, 400, "32 lowercase hex"),
    ("GET", "/v1/keys/" + K, None, 404, "no such key"),
    ("DELETE", "/v1/keys/" + K, None, 404, "no such key"),
    ("GET", "/v1/nothing-here", None, 404, "Not Found"),
    ("PUT", "/v1/lookup", b"{}", 405, "Method Not Allowed"),
]


def test_each_bad_input_is_a_4xx_with_a_reason(node: PolarKV) -> None:
    url = node.manager_url
    write(url, key(1), b"x" * 100)  # something that must survive every bad request
    before = stats(url)
    for method, path, raw, status, text in CASES:
        got, body = http(method, url + path, raw=raw)
        assert got == status, (path, raw, body)
        assert isinstance(body, dict) and text in body["error"], (path, raw, body)
    got, body = http(
        "POST",
        url + "/v1/lookup",
        raw=b'{"keys": ["' + b"a" * 32 + b'"], "pad": "' + b"x" * 70_000 + b'"}',
    )
    assert got == 413 and "error" in body
    after = stats(url)
    for counter in ("keys_memory", "bytes_memory", "commits", "allocations", "nodes", "deletes"):
        assert after[counter] == before[counter], counter
    status, health = http("GET", url + "/healthz")
    assert (
        status == 200
        and health | {"status": "ok", "nodes": 1, "keys_memory": 1, "metadata_store": "ok"}
        == health
    )
    assert node.proc.poll() is None


def _raw_exchange(address: str, frame: bytes) -> tuple[frames.Status, bytes]:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(frame)
        header = sock.recv(frames.RESPONSE_SIZE, socket.MSG_WAITALL)
        status, length = frames.decode_response(header)
        return status, sock.recv(length, socket.MSG_WAITALL) if length else b""


def test_data_plane_refuses_forged_and_expired_grants(node: PolarKV) -> None:
    url = node.manager_url
    data = os.urandom(5000)
    write(url, key(2), data)
    hit = post(url, "/v1/lookup", {"keys": [key(2)]})
    entry = hit["entries"][0]
    grant = bytes.fromhex(entry["grant"])
    address = hit["nodes"][entry["node"]]["address"]
    # a genuine grant reads the bytes
    status, payload = _raw_exchange(address, frames.encode_request(Op.READ, grant))
    assert status is frames.Status.OK and payload == data
    # every single flipped byte (offset, length, incarnation, expiry, op, MAC) is refused
    for i in range(len(grant)):
        forged = bytearray(grant)
        forged[i] ^= 0x01
        status, reason = _raw_exchange(address, frames.encode_request(Op.READ, bytes(forged)))
        assert status in (frames.Status.DENIED, frames.Status.BAD_REQUEST), i
        assert reason
    # a READ grant cannot be used to WRITE
    status, reason = _raw_exchange(address, frames.encode_request(Op.WRITE, grant) + b"\0" * 5000)
    assert status is frames.Status.DENIED and b"another operation" in reason
    # garbage instead of a frame
    status, _ = _raw_exchange(address, b"GET / HTTP/1.1\r\n" + b"\0" * 100)
    assert status is frames.Status.BAD_REQUEST
    # the grant expires with its lease (300 ms here)
    time.sleep(0.5)
    with pytest.raises(AccessDenied, match="expired"):
        TcpTransport().read_into(
            region(hit, entry), memoryview(bytearray(5000)), time.monotonic() + 5
        )
    assert node.proc.poll() is None
    assert post(url, "/v1/lookup", {"keys": [key(2)]})["hits"] == 1  # nothing was lost
