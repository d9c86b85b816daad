"""Repeated errors are one line with a count, not a flood: a slab past its file
descriptor limit keeps its data plane (it pauses accepting) and logs the condition once."""

from __future__ import annotations

import logging
import socket
import time

import structlog
from structlog.testing import capture_logs

from polarkv_lib.client import PolarKVClient
from polarkv_lib.logs import Events, RateLimiter
from tests.conftest import Cluster

MAX_FILES = 160  # the slab process's RLIMIT_NOFILE: a few more than it needs to run


def test_past_the_fd_limit_the_slab_logs_once_and_serves_again(cluster: Cluster) -> None:
    node = cluster.start(
        ["slab", "manager"],
        {
            "slab.transports": "tcp",
            "slab.max_connections": "1000",
            "slab.max_connections_per_peer": "1000",
        },
        max_files=MAX_FILES,
    )
    host, _, port = node.slab_address.rpartition(":")
    socks = []
    try:
        for _ in range(MAX_FILES + 40):  # past the limit: accept() fails with EMFILE
            socks.append(socket.create_connection((host, int(port)), timeout=5))
        time.sleep(2.0)  # ~40 failing accepts a second if nothing held them back
    finally:
        for sock in socks:
            sock.close()
    with PolarKVClient(node.manager_url, transport="tcp", timeout=3.0) as client:
        deadline = time.monotonic() + 10
        while not client.put("ab" * 16, b"x" * 4096) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.get("ab" * 16) == b"x" * 4096  # the data plane accepts again
    lines = [line for line in node.log().splitlines() if Events.ACCEPT_FAILED in line]
    assert 1 <= len(lines) <= 2, lines  # one per 10 s interval, not one per failure
    assert len(node.log()) < 200_000


def test_the_rate_limiter_reports_what_it_held_back() -> None:
    with capture_logs() as logs:
        limiter = RateLimiter(structlog.get_logger("test"), interval=0.2)
        for _ in range(50):
            limiter.warning("boom", detail="x")
        time.sleep(0.25)
        limiter.warning("boom", detail="x")
        limiter.clear("boom")
        limiter.warning("boom", detail="y")
    assert [(e["event"], e.get("repeated")) for e in logs] == [
        ("boom", None),
        ("boom", 49),
        ("boom", None),
    ]


def test_repeated_stdlib_errors_are_held_back(capsys: object) -> None:
    from polarkv_lib import logs

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure("json", "info")
        noisy = logging.getLogger("asyncio")
        for _ in range(100):
            noisy.error("socket.accept() out of system resource")
        logging.getLogger("aiohttp.access").info("one access line")
        logging.getLogger("aiohttp.access").info("another access line")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.captureWarnings(False)
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert err.count("out of system resource") == 1
    assert err.count("access line") == 2  # below WARNING nothing is held back
