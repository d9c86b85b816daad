"""The client's data plane: which transport moves a region, at most `connections`
transfers at once in a thread pool, a circuit breaker per slab, and each chunk's
checksum: the one the transport took as the bytes arrived (tcp in pieces as they land,
shm piece by piece behind its copy), or taken in the thread that moved it, or, for a run
of reads from one slab, on a hashing thread while the next ones arrive
(client/async_client.py composes it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from polarkv_lib.client.breaker import CircuitBreaker
from polarkv_lib.errors import NetworkError, OperationTimeout, PolarKVError
from polarkv_lib.transport import open_transports, pick
from polarkv_lib.transport.base import BufferLike, NodeTarget, Region, checksum

log = logging.getLogger("polarkv.client")
__all__ = ["BufferLike", "ClientStats", "Transfers", "checksum"]


def as_view(data: object, what: str) -> memoryview:
    """A caller's buffer as flat bytes; a TypeError or ValueError naming `what` if it
    cannot be one."""
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be bytes-like, got {type(data).__name__}") from None
    if not view.contiguous:
        raise ValueError(f"{what} must be a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def node_targets(reply: dict[str, Any]) -> dict[str, NodeTarget]:
    """The slabs a lookup or allocate reply names, as the transports address them."""
    return {
        node_id: NodeTarget(
            node_id,
            n["address"],
            int(n["incarnation"]),
            n.get("shm_path", ""),
            n.get("host_id", ""),
            tuple(n.get("transports", ("tcp",))),
        )
        for node_id, n in reply.get("nodes", {}).items()
    }


def region_of(entry: dict[str, Any], nodes: dict[str, NodeTarget]) -> Region:
    """Where one granted entry of a reply lies, and its grant."""
    return Region(
        nodes[entry["node"]],
        int(entry["offset"]),
        int(entry["size"]),
        bytes.fromhex(entry["grant"]),
    )


@dataclass
class ClientStats:
    """What the client turned into misses, by kind: the engine never sees these raised."""

    faults: int = 0
    timeouts: int = 0
    checksum_failures: int = 0
    transfer_failures: int = 0


class Transfers:
    def __init__(
        self, transport: str, connections: int, breaker_interval: float, stats: ClientStats
    ) -> None:
        # An explicit rdma without a usable device raises here (RdmaUnavailable, naming
        # the reason); auto falls back to tcp.
        self._transports = open_transports(transport, connections)
        self._connections = connections
        self._breaker_interval = breaker_interval
        self._slab_breakers: dict[str, CircuitBreaker] = {}
        self._pool = ThreadPoolExecutor(max_workers=connections, thread_name_prefix="polarkv-xfer")
        # A run's chunk i that its transport did not hash (a tcp read received whole
        # beside others, rdma) is hashed here while chunk i+1 arrives: hashing after the
        # transfer on the same thread would add the hash's time to every chunk's.
        # Started on first use.
        self._hasher = ThreadPoolExecutor(
            max_workers=connections, thread_name_prefix="polarkv-hash"
        )
        self._queued = 0  # move tasks submitted to the pool and not started yet
        self._queue_lock = threading.Lock()
        self.stats = stats

    async def close(self) -> None:
        # Transfers end by their deadlines; waiting for the threads must not hold the loop.
        await asyncio.to_thread(self._pool.shutdown, True)
        self._hasher.shutdown(wait=True)  # idle: every hash was awaited by its move
        for transport in self._transports:
            transport.close()

    async def move(
        self, write: bool, moves: Sequence[tuple[Region, memoryview]], deadline: float
    ) -> list[str | None]:
        """Move a window's regions; return each one's checksum, or None where it failed.

        At most `connections` pool tasks each move every n-th region in turn, rather than
        one task per region: a dispatch to the pool costs tens of microseconds, a tenth of
        a 1 MiB shm copy. A task's consecutive reads from one slab go as one read_many
        (pipelined on tcp). A chunk's checksum is the transport's where it took one;
        otherwise a chunk of such a run is hashed on the hashing pool while the next ones
        arrive, and any other chunk in its task right after its transfer."""

        def move(part: range) -> list[str | None]:
            with self._queue_lock:
                self._queued -= 1
                # Other callers' work waiting for a thread: their connections keep the
                # slab busy already, and pipelining on top measured slower (4 callers).
                pipelined = self._queued == 0
            if write or not pipelined:
                return [self._one(write, *moves[i], deadline, failures) for i in part]
            sums: list[str | None] = []
            run: list[tuple[Region, memoryview]] = []
            for i in part:
                if run and moves[i][0].node != run[0][0].node:
                    sums += self._read_run(run, deadline, failures)
                    run = []
                run.append(moves[i])
            return sums + (self._read_run(run, deadline, failures) if run else [])

        failures: list[int] = []  # one entry per failed transfer; list.append is thread-safe
        n = min(self._connections, len(moves))
        with self._queue_lock:
            self._queued += n
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(
            *(loop.run_in_executor(self._pool, move, range(k, len(moves), n)) for k in range(n))
        )
        self.stats.transfer_failures += len(failures)
        return [done[i % n][i // n] for i in range(len(moves))]

    def _breaker(self, address: str) -> CircuitBreaker:
        breaker = self._slab_breakers.get(address)
        if breaker is None:
            breaker = self._slab_breakers.setdefault(
                address, CircuitBreaker(f"slab {address}", self._breaker_interval)
            )
        return breaker

    def _settled(
        self,
        breaker: CircuitBreaker,
        region: Region,
        view: memoryview,
        error: PolarKVError | None,
        failures: list[int],
        digest: str | None = None,
    ) -> str | None:
        """A transfer's outcome: its checksum (`digest` where the transport took it), or
        None (`_moved`)."""
        if not self._moved(breaker, region, error, failures):
            return None
        return checksum(view) if digest is None else digest

    @staticmethod
    def _moved(
        breaker: CircuitBreaker, region: Region, error: PolarKVError | None, failures: list[int]
    ) -> bool:
        """Whether a transfer moved its bytes; a failure is counted and a slab that did
        not answer opens its breaker, so the next transfers to it fail fast for a while."""
        if error is None:
            breaker.success()
            return True
        if isinstance(error, NetworkError | OperationTimeout):
            breaker.failure()
        failures.append(1)
        log.debug("transfer with %s failed: %s", region.node.node_id, error)
        return False

    def _read_run(
        self, run: list[tuple[Region, memoryview]], deadline: float, failures: list[int]
    ) -> list[str | None]:
        """Reads of one slab, in a pool thread (one read_many: tcp pipelines them). A
        chunk the transport did not hash as it arrived is, in a run of several, hashed
        on the hashing pool as soon as it is in, while the next ones arrive; a lone
        chunk here, at once."""
        transport = pick(self._transports, run[0][0].node)
        if transport is None:
            return [None] * len(run)
        breaker = self._breaker(run[0][0].node.address)
        try:
            breaker.check()
        except NetworkError as exc:
            return [self._settled(breaker, r, v, exc, failures) for r, v in run]
        taken: dict[int, str] = {}
        hashes: dict[int, Future[str]] = {}

        def arrived(i: int, digest: str | None) -> None:
            if digest is not None:
                taken[i] = digest
            elif len(run) > 1:
                hashes[i] = self._hasher.submit(checksum, run[i][1])

        errors = transport.read_many(run, deadline, arrived)
        return [
            self._settled(
                breaker, r, v, e, failures, hashes[i].result() if i in hashes else taken.get(i)
            )
            for i, ((r, v), e) in enumerate(zip(run, errors, strict=True))
        ]

    def _one(
        self, write: bool, region: Region, view: memoryview, deadline: float, failures: list[int]
    ) -> str | None:
        """One transfer and its checksum, in a pool thread."""
        transport = pick(self._transports, region.node)
        if transport is None:
            return None
        breaker = self._breaker(region.node.address)
        error: PolarKVError | None = None
        digest = None
        try:
            breaker.check()
            if write:
                digest = transport.write_from(region, view, deadline)
            else:
                digest = transport.read_into(region, view, deadline)
        except PolarKVError as exc:
            error = exc
        return self._settled(breaker, region, view, error, failures, digest)
