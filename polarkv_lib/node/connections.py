"""The data server's connection table: who is connected, who is between requests, whom
to close when a new connection needs room, and how many bytes of READs each client host
has not taken yet.

A connection is *idle* from the moment it finished a request (or was accepted) until a
whole request header has arrived; while idle it holds no part of the buffer and may be
closed at any time (the client's transport retries a pooled connection once). When the
server is full, or a peer host is at its own limit, a new connection takes the place of
an idle one — never-used connections first (silent sockets held by an attacker), then
the longest idle — and is refused only when every candidate is in the middle of a
request. So sockets that never send a request cannot lock honest clients out.

A host's bytes in flight are the lengths of its READs being sent plus what the kernel
still holds of those sent before (unsent or unacknowledged: sockio.unsent). A READ that
would take its host past `max_bytes_per_peer` is refused, unless the host has nothing
in flight at all (so an entry larger than the limit is still served, one at a time).
Bytes a reader leaves in the kernel are counted when its READ's send returns and looked
at again only when its host is at the limit: the common path costs no system call. So
a host that asks for payloads and does not read them holds at most its limit of the
slab's memory and a limit's worth of connections in a send, whatever it sends.

Thread-safe: the accept thread admits and evicts, each connection's thread marks itself
busy or idle, and a connection chosen for eviction can no longer turn busy.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from polarkv_lib.transport.sockio import unsent


@dataclass(eq=False)
class Conn:
    sock: socket.socket
    peer: str
    idle_since: float | None = field(default_factory=time.monotonic)  # None: serving a request
    served: int = 0
    evicted: bool = False
    sending: bool = False  # a READ's payload is being sent
    held: int = 0  # READ bytes counted against the peer: see the module docstring


class ConnTable:
    def __init__(self, max_total: int, max_per_peer: int, max_bytes_per_peer: int) -> None:
        self.max_total = max_total
        self.max_per_peer = min(max_per_peer, max_total)
        self.max_bytes_per_peer = max_bytes_per_peer
        self._conns: set[Conn] = set()
        self._per_peer: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._conns)

    def admit(self, sock: socket.socket, peer: str) -> tuple[Conn | None, Conn | None]:
        """(the new connection, or None if refused; an idle connection to close for it)."""
        with self._lock:
            victim = None
            if self._per_peer.get(peer, 0) >= self.max_per_peer:
                victim = self._idlest(c for c in self._conns if c.peer == peer)
                if victim is None:
                    return None, None
            elif len(self._conns) >= self.max_total:
                victim = self._idlest(iter(self._conns))
                if victim is None:
                    return None, None
            if victim is not None:
                victim.evicted = True
                self._remove(victim)
            conn = Conn(sock, peer)
            self._conns.add(conn)
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            return conn, victim

    @staticmethod
    def _idlest(candidates: Iterable[Conn]) -> Conn | None:
        best: Conn | None = None
        for c in candidates:
            if c.idle_since is None or c.evicted:
                continue
            if best is None or (c.served > 0, c.idle_since) < (best.served > 0, best.idle_since):
                best = c
        return best

    def busy(self, conn: Conn) -> bool:
        """A whole request header arrived: serve it, unless the connection was evicted."""
        with self._lock:
            if conn.evicted:
                return False
            conn.idle_since = None
            return True

    def reserve(self, conn: Conn, length: int) -> bool:
        """Count a READ of `length` bytes against its host; False: the host is at its
        limit (refuse the READ)."""
        with self._lock:
            if not self._room(conn.peer, length):
                self._recount(conn.peer)
                if not self._room(conn.peer, length):
                    return False
            self._hold(conn, conn.held + length)
            conn.sending = True
            return True

    def sent(self, conn: Conn) -> None:
        """The READ's send returned: from now on the host is charged what the kernel
        still holds of it."""
        left = unsent(conn.sock)
        with self._lock:
            conn.sending = False
            self._hold(conn, left)

    def _room(self, peer: str, length: int) -> bool:
        held = self._in_flight.get(peer, 0)
        return held == 0 or held + length <= self.max_bytes_per_peer

    def _recount(self, peer: str) -> None:
        """Ask the kernel what the host's connections between sends still hold."""
        for c in self._conns:
            if c.peer == peer and c.held and not c.sending:
                self._hold(c, unsent(c.sock))

    def _hold(self, conn: Conn, held: int) -> None:
        total = self._in_flight.get(conn.peer, 0) + held - conn.held
        conn.held = held
        if total:
            self._in_flight[conn.peer] = total
        else:
            self._in_flight.pop(conn.peer, None)

    def idle(self, conn: Conn) -> None:
        with self._lock:
            conn.served += 1
            conn.idle_since = time.monotonic()

    def remove(self, conn: Conn) -> None:
        with self._lock:
            self._remove(conn)

    def _remove(self, conn: Conn) -> None:
        if conn in self._conns:
            self._hold(conn, 0)
            self._conns.discard(conn)
            left = self._per_peer[conn.peer] - 1
            if left:
                self._per_peer[conn.peer] = left
            else:
                del self._per_peer[conn.peer]

    def all(self) -> list[Conn]:
        with self._lock:
            return list(self._conns)
