"""Readers that never read: genuine READ grants for a large entry, sent with raw frames
from other hosts (loopback aliases: the slab tells hosts apart by address) that then
take nothing of the payloads, against a real slab process, while an honest client on
127.0.0.1 keeps reading.

Unbounded, each such READ held one of the slab's connections and a socket buffer of its
memory for as long as a payload of its size may take on the slowest honest link, so
256 of them locked every other client out. Now a host has at most
`slab.max_bytes_in_flight_per_peer` of READs in flight (being sent, or left in the
kernel), past which its READs are refused BUSY, and a payload its reader takes nothing
of for `slab.send_timeout` is cut off."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import time
from collections.abc import Iterator

from polarkv_lib.client import PolarKVClient
from polarkv_lib.config import SlabConfig
from polarkv_lib.wire import frames
from polarkv_lib.wire.grants import Op
from tests.conftest import Cluster, wait_for
from tests.integration.raw import key, only, post, write

MiB = 1 << 20
LIMITS = SlabConfig()  # the test runs the slab's defaults: nothing here is tuned for it
ATTACKERS = ("127.0.0.2", "127.0.0.3")
PROBES = 30
TIMEOUT = 2.0  # the honest client's
_ESTABLISHED = 1  # tcp_info.tcpi_state


@contextlib.contextmanager
def readers(
    address: str, frame: bytes, n: int, sources: tuple[str, ...]
) -> Iterator[list[socket.socket]]:
    """`n` connections from `sources` in turn, each sending `frame` and reading nothing."""
    host, _, port = address.rpartition(":")
    socks: list[socket.socket] = []
    try:
        for i in range(n):
            sock = socket.socket()
            socks.append(sock)
            sock.bind((sources[i % len(sources)], 0))
            sock.connect((host, int(port)))
            sock.sendall(frame)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def answered(socks: list[socket.socket]) -> bool:
    """Every socket has something waiting: its payload arriving, or a refusal."""
    ready, _, _ = select.select(socks, [], [], 0)
    return len(ready) == len(socks)


def receiving_payloads(socks: list[socket.socket]) -> list[socket.socket]:
    """The sockets whose READ the slab took up (an OK header, its payload behind it)."""
    out = []
    for sock in socks:
        head = sock.recv(frames.RESPONSE_SIZE, socket.MSG_PEEK)
        if (
            len(head) == frames.RESPONSE_SIZE
            and frames.decode_response(head)[0] is frames.Status.OK
        ):
            out.append(sock)
    return out


def cut_off(sock: socket.socket) -> bool:
    """The slab closed or reset this connection (whatever of its payload is still unread)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
    return bool(struct.unpack_from("B", info)[0] != _ESTABLISHED)


def probe(url: str, k: str, expected: bytes) -> tuple[int, float]:
    """Honest reads, one after another: how many were served within the client's
    timeout, and how long the slowest took."""
    served, slowest = 0, 0.0
    give_up = time.monotonic() + 20  # bounded even where every probe waits its timeout
    with PolarKVClient(url, transport="tcp", timeout=TIMEOUT) as client:
        for _ in range(PROBES):
            if time.monotonic() > give_up:
                break
            started = time.monotonic()
            ok = client.get(k) == expected
            took = time.monotonic() - started
            slowest = max(slowest, took)
            served += ok and took <= TIMEOUT
    return served, slowest


def _setup(cluster: Cluster, entry: int) -> tuple[str, str, bytes, bytes]:
    """A slab with one `entry`-byte entry and a small one: the manager URL, the slab's
    data address, a raw READ frame under a genuine grant for the big entry, and the small
    one's bytes."""
    url = cluster.embedded(slab__transports="tcp").manager_url
    write(url, key(1), os.urandom(entry))
    small = os.urandom(64 * 1024)
    write(url, key(2), small)
    # A genuine grant, from an ordinary lookup; it serves any number of READs until it expires.
    grant, address = only(post(url, "/v1/lookup", {"keys": [key(1)]}))
    return url, address, frames.encode_request(Op.READ, bytes.fromhex(grant["grant"])), small


def test_readers_that_never_read_do_not_lock_honest_clients_out(cluster: Cluster) -> None:
    entry = 32 * MiB
    url, address, frame, small = _setup(cluster, entry)
    # As many READs as the slab has connections, half from each attacking host.
    with readers(address, frame, LIMITS.max_connections, ATTACKERS) as held:
        wait_for(lambda: answered(held))  # the slab has taken up every READ
        engaged = time.monotonic()
        served, slowest = probe(url, key(2), small)
        assert served == PROBES, f"{served} of {PROBES} served; slowest {slowest:.2f}s"
        taken = receiving_payloads(held)
        # The probes ran while the attack held: nothing was cut off yet (where the probes
        # took less than the send timeout, as they do unless the machine is swamped).
        if time.monotonic() - engaged < LIMITS.send_timeout:
            assert not any(cut_off(s) for s in taken)
        # Each host got no more than its bytes in flight; the rest of its READs were refused.
        per_host = LIMITS.max_bytes_in_flight_per_peer // entry
        assert 0 < len(taken) <= len(ATTACKERS) * per_host
        # And what it was sent and never read is cut off after the send timeout.
        wait_for(lambda: all(cut_off(s) for s in taken), timeout=2 * LIMITS.send_timeout)


def test_payloads_left_in_the_kernel_count_against_their_host(cluster: Cluster) -> None:
    # Small enough that the kernel takes each payload whole: the READs end at once, and
    # what their reader leaves unread sits in the slab's socket buffers.
    entry = 3 * MiB
    url, address, frame, small = _setup(cluster, entry)
    with readers(address, frame, LIMITS.max_connections_per_peer, ATTACKERS[:1]) as held:
        wait_for(lambda: answered(held))
        taken = receiving_payloads(held)
        # (less what the reader's own socket took in before it stopped acknowledging)
        assert 0 < len(taken) <= LIMITS.max_bytes_in_flight_per_peer // (entry - MiB // 2)
        # The host's other READs were refused, its connections released: others read on.
        assert probe(url, key(2), small)[0] == PROBES
