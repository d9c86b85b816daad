"""The client's data plane: which transport moves a region, at most `connections`
transfers at once in a thread pool, a circuit breaker per slab, and each chunk's
checksum taken in the thread that moved it (client/async_client.py composes it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from polarkv_lib.client.breaker import CircuitBreaker
from polarkv_lib.errors import NetworkError, OperationTimeout, PolarKVError
from polarkv_lib.transport import open_transports, pick
from polarkv_lib.transport.base import NodeTarget, Region

log = logging.getLogger("polarkv.client")
BufferLike = bytes | bytearray | memoryview


def checksum(data: BufferLike) -> str:
    return xxhash.xxh3_64_hexdigest(data)


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
        self.stats = stats

    async def close(self) -> None:
        # Transfers end by their deadlines; waiting for the threads must not hold the loop.
        await asyncio.to_thread(self._pool.shutdown, True)
        for transport in self._transports:
            transport.close()

    async def move(
        self, write: bool, moves: Sequence[tuple[Region, memoryview]], deadline: float
    ) -> list[str | None]:
        """Move a window's regions; return each one's checksum, or None where it failed.

        At most `connections` pool tasks each move every n-th region in turn, rather than
        one task per region: a dispatch to the pool costs tens of microseconds, a tenth of
        a 1 MiB shm copy. Each chunk is hashed in the same task right after its copy, while
        its bytes are still in cache, and on all pool threads at once."""

        def move(part: range) -> list[str | None]:
            sums: list[str | None] = []
            for i in part:
                region, view = moves[i]
                sums.append(self._move_one(write, region, view, deadline, failures))
            return sums

        failures: list[int] = []  # one entry per failed transfer; list.append is thread-safe
        n = min(self._connections, len(moves))
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(
            *(loop.run_in_executor(self._pool, move, range(k, len(moves), n)) for k in range(n))
        )
        self.stats.transfer_failures += len(failures)
        return [done[i % n][i // n] for i in range(len(moves))]

    def _move_one(
        self, write: bool, region: Region, view: memoryview, deadline: float, failures: list[int]
    ) -> str | None:
        """One transfer and its checksum, in a pool thread."""
        transport = pick(self._transports, region.node)
        if transport is None:
            return None
        address = region.node.address
        breaker = self._slab_breakers.get(address)
        if breaker is None:
            breaker = self._slab_breakers.setdefault(
                address, CircuitBreaker(f"slab {address}", self._breaker_interval)
            )
        try:
            breaker.check()
            (transport.write_from if write else transport.read_into)(region, view, deadline)
            breaker.success()
            return checksum(view)
        except (NetworkError, OperationTimeout) as exc:
            breaker.failure()  # unreachable: the next transfers to it fail fast for a while
            failures.append(1)
            log.debug("transfer with %s failed: %s", region.node.node_id, exc)
            return None
        except PolarKVError as exc:
            failures.append(1)
            log.debug("transfer with %s failed: %s", region.node.node_id, exc)
            return None
