"""The tcp data plane under sockets that never send a request: raw sockets, as an
attacker would hold them, against a real slab process, while an honest client works."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, wait_for

ATTACKERS = 300  # more than slab.max_connections (256)


def _address(node: object) -> tuple[str, int]:
    host, _, port = node.slab_address.rpartition(":")  # type: ignore[attr-defined]
    return host, int(port)


@contextlib.contextmanager
def raw_sockets(
    address: tuple[str, int], n: int, source: str = ""
) -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket()
            socks.append(sock)  # before connect: a refused connect must still be closed
            if source:
                sock.bind((source, 0))
            sock.connect(address)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the slab closed (or refused) this connection."""
    try:
        data = sock.recv(4096, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True
    if not data:
        return True
    # a BUSY refusal then close: the close follows at once
    return closed_by_peer(sock) if len(data) < 4096 else False


def _honest_round(url: str, rounds: int) -> int:
    ok = 0
    with PolarKVClient(url, transport="tcp", timeout=2.0) as client:
        for i in range(rounds):
            data = os.urandom(64 * 1024)
            key = f"{i:08x}" + "a" * 24
            if client.put(key, data) and client.get(key) == data:
                ok += 1
    return ok


def test_honest_clients_are_served_while_silent_sockets_fill_the_slab(cluster: Cluster) -> None:
    # One peer may hold the whole server here: the global cap is what is tested.
    node = cluster.embedded(slab__transports="tcp", slab__max_connections_per_peer="256")
    with raw_sockets(_address(node), ATTACKERS) as held:
        closed: set[int] = set()

        def count_closed() -> int:
            closed.update(i for i, s in enumerate(held) if i not in closed and closed_by_peer(s))
            return len(closed)

        wait_for(lambda: count_closed() >= ATTACKERS - 256)  # the slab is full of them
        full = count_closed()
        assert _honest_round(node.manager_url, 20) == 20
        # Each honest connection took the place of a silent one.
        assert count_closed() > full


def test_silent_and_slow_connections_are_closed_by_their_timeouts(cluster: Cluster) -> None:
    node = cluster.embedded(
        slab__transports="tcp", slab__idle_timeout="1s", slab__frame_timeout="1s"
    )
    with raw_sockets(_address(node), 2) as (silent, slow):
        slow.sendall(b"P")  # the first byte of a header, and no more
        started = time.monotonic()
        wait_for(lambda: closed_by_peer(silent) and closed_by_peer(slow), timeout=5)
        assert time.monotonic() - started < 4
    assert _honest_round(node.manager_url, 3) == 3


def test_one_peer_host_cannot_hold_more_than_its_share(cluster: Cluster) -> None:
    node = cluster.embedded(slab__transports="tcp", slab__max_connections_per_peer="8")
    # 127.0.0.2 is another host as far as the slab can tell (all of 127/8 is loopback).
    with raw_sockets(_address(node), 20, source="127.0.0.2") as held:
        wait_for(lambda: sum(not closed_by_peer(s) for s in held) <= 8, timeout=5)
        assert _honest_round(node.manager_url, 5) == 5
