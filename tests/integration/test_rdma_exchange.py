"""The rdma exchange against real slab processes, where no RDMA device is needed: a slab
that does not offer rdma answers a hello with a clean refusal and keeps serving tcp, and
a slab told to offer rdma on a machine without a device does not start, saying why.
(With a device, tests/integration/test_transport_conformance.py runs the whole path.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from polarkv_lib.errors import ExitCode
from polarkv_lib.transport import rdma_unavailable, rdma_wire
from polarkv_lib.transport.rdma_wire import QpParams
from polarkv_lib.wire import frames
from tests.conftest import Cluster
from tests.integration.raw import key, post, read, write

CLIENT = str(Path(__file__).with_name("client_proc.py"))
HELLO = rdma_wire.encode_hello(QpParams(qpn=0x99, psn=5, lid=0, mtu=5, gid=b"\xfe\x80" + bytes(14)))


def _exchange(address: str, payload: bytes) -> tuple[frames.Status, bytes, bytes]:
    """Send `payload`, return the response status, its body, and what followed it."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(payload)
        data = b""
        while chunk := sock.recv(65536):  # the slab closes after a refusal
            data += chunk
    status, length = frames.decode_response(data[: frames.RESPONSE_SIZE])
    body = data[frames.RESPONSE_SIZE : frames.RESPONSE_SIZE + length]
    return status, body, data[frames.RESPONSE_SIZE + length :]


def test_slab_without_rdma_refuses_a_hello_and_keeps_serving(cluster: Cluster) -> None:
    node = cluster.embedded()
    nodes = post(node.manager_url, "/v1/allocate", {"items": [{"key": key(1), "size": 10}]})[
        "nodes"
    ]
    assert all("rdma" not in n["transports"] for n in nodes.values())  # not advertised
    status, reason, rest = _exchange(node.slab_address, HELLO)
    assert status is frames.Status.BAD_REQUEST and reason and rest == b""
    data = os.urandom(4096)
    write(node.manager_url, key(2), data)
    hit = post(node.manager_url, "/v1/lookup", {"keys": [key(2)]})
    assert read(node.manager_url, hit, hit["entries"][0]) == data


def test_auto_client_process_writes_nothing_to_stderr(cluster: Cluster) -> None:
    # auto must not import pyverbs (which configures logging) or log a fallback line
    # for slabs that do not offer rdma: engines and JSON-logging CLIs own stderr.
    url = cluster.embedded().manager_url
    for args in (
        ("store", url, "quiet", "auto", "4", "65536"),
        ("load", url, "quiet", "auto", "4"),
    ):
        done = subprocess.run(
            [sys.executable, CLIENT, *args], capture_output=True, timeout=60, check=False
        )
        assert done.returncode == 0 and done.stderr == b"", done.stderr.decode()
    assert orjson.loads(done.stdout)["n_tokens"] == 4 * 16


def test_slab_asked_for_rdma_without_a_device_does_not_start(cluster: Cluster) -> None:
    reason = rdma_unavailable()
    if reason is None:
        pytest.skip("this machine has a usable RDMA device: such a slab starts")
    proc = cluster.start(["manager", "slab"], {"slab.transports": "tcp,shm,rdma"}, wait=False)
    assert proc.proc.wait(20) == ExitCode.CONFIG
    log = proc.log()
    assert "slab.transports includes rdma" in log and "no RDMA device" in log
    assert "Traceback" not in log
