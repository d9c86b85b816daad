"""`--log-format json`: every line a process prints is one JSON object, from start-up
through traffic, bad requests and shutdown."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import orjson

from polarkv_lib.client import PolarKVClient
from polarkv_lib.errors import ExitCode
from tests.conftest import ROOT, Cluster, http

CT = 16


def test_every_line_is_json_from_start_to_shutdown(cluster: Cluster) -> None:
    node = cluster.start([], {"log.level": "debug"}, extra_args=["--log-format", "json"])
    url = node.manager_url
    tokens = list(range(8 * CT))
    with PolarKVClient(url, chunk_tokens=CT, timeout=5.0) as client:
        assert client.store_kv(tokens, [bytes([i]) * 65536 for i in range(8)]) == 8
        assert client.load_kv(tokens)[0] == 8 * CT
    assert http("POST", url + "/v1/lookup", raw=b"{not json")[0] == 400
    assert http("POST", url + "/v1/allocate", {"items": [{"key": "nope", "size": 1}]})[0] == 400
    assert http("GET", url + "/v1/no-such-thing")[0] == 404
    assert http("DELETE", url + "/v1/lookup")[0] == 405
    assert (
        http("POST", url + "/v1/nodes/heartbeat", {"node_id": "ghost", "incarnation": 1})[0] == 404
    )
    host, _, port = url.removeprefix("http://").rpartition(":")
    for garbage in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n"):
        # Below the HTTP layer: aiohttp's own logger reports these, with a traceback.
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(garbage)
            assert sock.recv(64).startswith(b"HTTP/1.0 400")
    assert node.stop() == 0
    lines = [line for line in node.log().splitlines() if line.strip()]
    events = []
    for line in lines:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(record, dict) and "event" in record and "level" in record, line
        events.append(record["event"])
    assert any(e.startswith("Error handling request") for e in events)  # stdlib records, as JSON
    for expected in (
        "polarkv ready",
        "slab registered",
        "shutting down",
        "slab stopped",
        "manager stopped",
    ):
        assert expected in events


def test_a_start_up_failure_is_one_json_line_and_a_named_exit_code(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "polarkv.py"),
            "--log-format",
            "json",
            "--set",
            "slab.memory=1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == ExitCode.CONFIG
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and done.stdout == ""
    record = orjson.loads(lines[0])
    assert record["level"] == "error" and "slab.memory" in record["error"]
