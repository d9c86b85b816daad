"""Speak the control API and the tcp data plane directly, below the client library,
so tests can stop half-way (allocate without commit, hold a lease) and look."""

from __future__ import annotations

import socket
import time
from typing import Any

from polarkv_lib.client.transfers import checksum
from polarkv_lib.transport.base import NodeTarget, Region
from polarkv_lib.transport.tcp import TcpTransport
from polarkv_lib.wire import frames
from polarkv_lib.wire.grants import Op
from tests.conftest import http


def key(i: int) -> str:
    return f"{i:032x}"


def region(reply: dict[str, Any], entry: dict[str, Any]) -> Region:
    n = reply["nodes"][entry["node"]]
    node = NodeTarget(
        entry["node"],
        n["address"],
        n["incarnation"],
        n["shm_path"],
        n["host_id"],
        tuple(n["transports"]),
    )
    return Region(node, entry["offset"], entry["size"], bytes.fromhex(entry["grant"]))


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, reply = http("POST", url + path, body)
    assert status == 200, reply
    return dict(reply)


def write(url: str, k: str, data: bytes, commit: bool = True) -> dict[str, Any]:
    """Allocate, write over tcp, and (optionally) commit one key. Returns the allocate reply."""
    reply = post(url, "/v1/allocate", {"items": [{"key": k, "size": len(data)}]})
    entry = reply["results"][0]
    assert entry["status"] == "allocated", entry
    transport = TcpTransport()
    try:
        transport.write_from(region(reply, entry), memoryview(data), time.monotonic() + 5)
    finally:
        transport.close()
    if commit:
        done = post(
            url,
            "/v1/commit",
            {"lease": reply["lease"], "items": [{"key": k, "checksum": checksum(data)}]},
        )
        assert done["results"][k] == "committed"
    return reply


def read(url: str, reply: dict[str, Any], entry: dict[str, Any]) -> bytes:
    buf = bytearray(entry["size"])
    transport = TcpTransport()
    try:
        transport.read_into(region(reply, entry), memoryview(buf), time.monotonic() + 5)
    finally:
        transport.close()
    return bytes(buf)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def raw(address: str, op: Op, grant_hex: str, payload: bytes = b"") -> tuple[frames.Status, bytes]:
    """One hand-made request frame; the status and whatever body came back."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(frames.encode_request(op, bytes.fromhex(grant_hex)) + payload)
        status, length = frames.decode_response(recv_exact(sock, frames.RESPONSE_SIZE))
        return status, recv_exact(sock, length)


def only(reply: dict[str, Any], name: str = "entries") -> tuple[dict[str, Any], str]:
    (entry,) = reply[name]
    return entry, reply["nodes"][entry["node"]]["address"]
