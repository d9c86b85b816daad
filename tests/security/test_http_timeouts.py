"""The manager's HTTP server bounds how slowly a client may send: connections that never
send a request, trickle their headers (slowloris), sit idle after a reply or trickle a
body are closed within their timeouts, honest requests are answered meanwhile, and a
refused body is not read on after the refusal. Raw sockets against a real manager."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, PolarKV, http
from tests.security.rawhttp import address, closed_by_peer, read_reply, request_bytes

HEADER, BODY, IDLE = 1.0, 1.0, 2.0
SLACK = 2.5  # a loaded two-core machine
CHUNK = 1 << 20


@pytest.fixture
def node(cluster: Cluster) -> PolarKV:
    return cluster.embedded(
        slab__transports="tcp",
        manager__header_timeout=f"{HEADER}s",
        manager__body_timeout=f"{BODY}s",
        manager__idle_timeout=f"{IDLE}s",
    )


class Trickle:
    """Sends one byte to each socket every `every` seconds until it is refused."""

    def __init__(self, socks: list[socket.socket], every: float = 0.25) -> None:
        self.socks, self.every = socks, every
        self.cut: dict[int, float] = {}  # socket index -> seconds until a send failed
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="slowloris", daemon=True)

    def _run(self) -> None:
        started = time.monotonic()
        while not self.stop.wait(self.every) and len(self.cut) < len(self.socks):
            for i, sock in enumerate(self.socks):
                if i not in self.cut:
                    try:
                        sock.send(b"X")
                    except OSError:
                        self.cut[i] = time.monotonic() - started

    def __enter__(self) -> Trickle:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def connections(url: str, n: int, stack: ExitStack) -> Iterator[socket.socket]:
    for _ in range(n):
        yield stack.enter_context(socket.create_connection(address(url), timeout=5))


def test_slow_and_silent_connections_are_closed_and_honest_requests_answered(
    node: PolarKV,
) -> None:
    url = node.manager_url
    with ExitStack() as stack:
        held = time.monotonic()
        silent = list(connections(url, 40, stack))  # never send a byte
        slowloris = list(connections(url, 40, stack))
        for sock in slowloris:  # a request line, then a header byte at a time, forever
            sock.sendall(b"GET /v1/stats HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        idle = list(connections(url, 40, stack))
        for sock in idle:  # one honest request, then nothing
            sock.sendall(request_bytes("GET", url + "/healthz"))
            assert read_reply(sock).status == 200
        slow_body = list(connections(url, 20, stack))
        for sock in slow_body:  # headers whole, 1000 bytes promised, 8 sent
            head = {"Content-Type": "application/json", "Content-Length": "1000"}
            sock.sendall(request_bytes("POST", url + "/v1/lookup", head) + b'{"keys":')

        with Trickle(slowloris) as trickle:
            # the attacker holds 140 connections: honest callers are still answered at once
            with PolarKVClient(url, timeout=5.0) as client:
                for i in range(10):
                    started = time.monotonic()
                    assert http("GET", url + "/v1/stats")[0] == 200
                    assert client.put(f"{i:032x}", b"v" * 4096)
                    assert client.get(f"{i:032x}") == b"v" * 4096
                    assert time.monotonic() - started < 1.0
            for sock in slow_body:  # cut off at body_timeout with a reason
                reply = read_reply(sock)
                assert reply.status == 408 and reply.headers.get("connection") == "close"
                assert "body" in str(reply.json())
            deadline = held + IDLE + SLACK
            for kind, socks in (("silent", silent), ("idle", idle), ("slow body", slow_body)):
                for sock in socks:
                    left = max(deadline - time.monotonic(), 0.1)
                    assert closed_by_peer(sock, left), f"a {kind} connection is still open"
            trickle.thread.join(HEADER + SLACK)
            assert len(trickle.cut) == len(slowloris), "slowloris connections still open"
            assert max(trickle.cut.values()) < HEADER + SLACK, trickle.cut


def test_an_honest_client_outlives_the_idle_timeout(node: PolarKV) -> None:
    """The manager closing a pooled connection costs the client nothing: it dials again."""
    url = node.manager_url
    with PolarKVClient(url, timeout=5.0) as client:
        assert client.put("a" * 32, b"x" * 1000)
        time.sleep(IDLE + 0.5)  # the manager has closed the client's idle connections
        assert client.get("a" * 32) == b"x" * 1000
        assert client.stats.faults == 0


def test_a_refused_body_is_not_read_on(node: PolarKV) -> None:
    """64 MiB chunked at a 4 MiB limit: 413, the connection closes, the sender is cut off
    instead of the manager reading (and dropping) the rest."""
    url = node.manager_url
    with socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/lookup HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        sent, failed = [0], []
        chunk = f"{CHUNK:x}\r\n".encode() + b"a" * CHUNK + b"\r\n"

        def pump() -> None:
            try:
                for _ in range(64):
                    sock.sendall(chunk)
                    sent[0] += CHUNK
                sock.sendall(b"0\r\n\r\n")
            except OSError as exc:
                failed.append(exc)

        sender = threading.Thread(target=pump, name="big-body", daemon=True)
        sender.start()
        reply = read_reply(sock)
        assert reply.status == 413 and reply.headers.get("connection") == "close", reply
        sender.join(20)
        assert failed, f"the manager read all {sent[0] >> 20} MiB after refusing the body"
        assert sent[0] < 32 * CHUNK, f"{sent[0] >> 20} MiB were taken after the 413"
    assert http("GET", url + "/healthz")[0] == 200
