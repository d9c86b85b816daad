"""AsyncPolarKVClient: store_kv / load_kv / put / get over the control API and a transport.

Contract (DESIGN §7-8): caller mistakes raise ValueError/TypeError before any I/O;
every infrastructure fault (manager or slab down, timeout, refused grant, checksum
mismatch, lost lease) becomes a miss: fewer chunks stored or loaded, nothing raised.
Every operation is bounded by `timeout` seconds: control requests carry the remaining
time, and each data transfer sets its socket timeout to the same absolute deadline.

One control round trip per window of chunks (`window`, default 64): a long prompt is
looked up and read window by window, so no single lease or batch has to cover it all
and a load never waits on more than it can use.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from polarkv_lib.client.breaker import CircuitBreaker
from polarkv_lib.client.control import ControlClient
from polarkv_lib.errors import NetworkError, OperationTimeout, PolarKVError
from polarkv_lib.keys import check_key, chunk_keys
from polarkv_lib.transport.base import NodeTarget, Region, Transport
from polarkv_lib.transport.shm import ShmTransport
from polarkv_lib.transport.tcp import TcpTransport
from polarkv_lib.wire.control import MAX_WAIT

# stdlib logging, not structlog: the client lives inside engines, which own log config.
log = logging.getLogger("polarkv.client")

T = TypeVar("T")
TRANSPORTS = ("auto", "tcp", "shm")
BufferLike = bytes | bytearray | memoryview


class CallerError(ValueError):
    """A caller mistake found only after the manager answered (e.g. an `out` buffer
    smaller than the stored chunk): raised, not turned into a miss."""


def checksum(data: BufferLike) -> str:
    return xxhash.xxh3_64_hexdigest(data)


@dataclass
class ClientStats:
    """What the client turned into misses, by kind: the engine never sees these raised."""

    faults: int = 0
    timeouts: int = 0
    checksum_failures: int = 0
    transfer_failures: int = 0


def _as_view(data: object, what: str) -> memoryview:
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be bytes-like, got {type(data).__name__}") from None
    if not view.contiguous:
        raise ValueError(f"{what} must be a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _nodes(reply: dict[str, Any]) -> dict[str, NodeTarget]:
    return {node_id: NodeTarget(node_id, n["address"], int(n["incarnation"]), n.get("shm_path", ""),
                                n.get("host_id", ""), tuple(n.get("transports", ("tcp",))))
            for node_id, n in reply.get("nodes", {}).items()}


def _region(entry: dict[str, Any], nodes: dict[str, NodeTarget]) -> Region:
    return Region(nodes[entry["node"]], int(entry["offset"]), int(entry["size"]),
                  bytes.fromhex(entry["grant"]))


class AsyncPolarKVClient:
    def __init__(self, manager_url: str = "http://127.0.0.1:8170", namespace: str = "",
                 chunk_tokens: int = 256, token: str | None = None, transport: str = "auto",
                 timeout: float = 2.0, connections: int = 4, window: int = 64,
                 breaker_interval: float = 1.0) -> None:
        if not isinstance(manager_url, str) or not manager_url.startswith(("http://", "https://")):
            raise ValueError(f"manager_url must be an http(s) URL, got {manager_url!r}")
        if not isinstance(namespace, str):
            raise TypeError("namespace must be a str")
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError("chunk_tokens must be a positive int")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}"
                             + (" (rdma is not built into this version)" if transport == "rdma" else ""))
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError("timeout must be a positive number of seconds")
        if connections < 1 or window < 1:
            raise ValueError("connections and window must be >= 1")
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.timeout = float(timeout)
        self.window = window
        self._connections = connections
        self.stats = ClientStats()
        self._control = ControlClient(manager_url, token, breaker_interval)
        self._breaker_interval = breaker_interval
        self._slab_breakers: dict[str, CircuitBreaker] = {}
        self._tcp = TcpTransport(max_idle_per_node=connections)
        self._shm = ShmTransport() if transport in ("auto", "shm") else None
        self._preference = transport
        self._pool = ThreadPoolExecutor(max_workers=connections, thread_name_prefix="polarkv-xfer")
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> AsyncPolarKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._background:
            await asyncio.wait(self._background, timeout=self.timeout)
        for task in self._background:
            task.cancel()
        await self._control.close()
        self._pool.shutdown(wait=True)
        self._tcp.close()
        if self._shm is not None:
            self._shm.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn("AsyncPolarKVClient was not closed", ResourceWarning, stacklevel=1)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("client is closed")

    # -- public API ---------------------------------------------------------------------

    def keys(self, tokens: Any) -> list[str]:
        return chunk_keys(tokens, self.namespace, self.chunk_tokens)

    async def store_kv(self, tokens: Any, chunks: Sequence[BufferLike]) -> int:
        """Store chunk i as the KV of tokens[i*chunk_tokens:(i+1)*chunk_tokens].
        Returns how many of `chunks` are now stored (newly written or already there)."""
        self._check_open()
        keys = self.keys(tokens)
        if not isinstance(chunks, Sequence):
            raise TypeError("chunks must be a sequence of bytes-like objects")
        if len(chunks) > len(keys):
            raise ValueError(f"{len(chunks)} chunks for {len(keys)} full chunks of tokens")
        views = [_as_view(c, f"chunks[{i}]") for i, c in enumerate(chunks)]
        if any(len(v) == 0 for v in views):
            raise ValueError("chunks must not be empty")
        return await self._guarded(self._store(keys[: len(views)], views), 0)

    async def load_kv(self, tokens: Any, out: Sequence[BufferLike] | None = None
                      ) -> tuple[int, list[memoryview]]:
        """The longest cached prefix: (n_tokens, one buffer per hit chunk). With `out`,
        chunk i lands in out[i] (zero-copy into caller memory) and the views are slices
        of those buffers."""
        self._check_open()
        keys = self.keys(tokens)
        targets = None
        if out is not None:
            targets = [_as_view(b, f"out[{i}]") for i, b in enumerate(out)]
            if any(t.readonly for t in targets):
                raise ValueError("out buffers must be writable")
            keys = keys[: len(targets)]
        views = await self._guarded(self._load(keys, targets), [])
        return len(views) * self.chunk_tokens, views

    async def lookup_kv(self, tokens: Any) -> int:
        """How many leading tokens are cached now (no lease, no transfer): for schedulers."""
        self._check_open()
        keys = self.keys(tokens)
        return await self._guarded(self._count(keys), 0) * self.chunk_tokens

    async def put(self, key: str, data: BufferLike) -> bool:
        self._check_open()
        view = _as_view(data, "data")
        if len(view) == 0:
            raise ValueError("data must not be empty")
        return await self._guarded(self._store([check_key(key)], [view]), 0) == 1

    async def get(self, key: str) -> bytes | None:
        self._check_open()
        views = await self._guarded(self._load([check_key(key)], None), [])
        return bytes(views[0]) if views else None

    # Keyed batches: for callers that bring their own 32-hex keys (SGLang's pages). Each
    # works on the leading run of keys, like a prompt's chunks: what follows a miss is a miss.

    async def lookup_keys(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored now (no lease, no transfer)."""
        self._check_open()
        checked = [check_key(k) for k in keys]
        return await self._guarded(self._count(checked), 0) if checked else 0

    async def put_many(self, keys: Sequence[str], values: Sequence[BufferLike]) -> int:
        """Store values[i] under keys[i]; how many are now stored (written or present)."""
        self._check_open()
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        checked = [check_key(k) for k in keys]
        views = [_as_view(v, f"values[{i}]") for i, v in enumerate(values)]
        if any(len(v) == 0 for v in views):
            raise ValueError("values must not be empty")
        return await self._guarded(self._store(checked, views), 0) if checked else 0

    async def get_many(self, keys: Sequence[str], out: Sequence[BufferLike] | None = None
                       ) -> list[memoryview]:
        """The values of the leading stored keys; with `out`, read into out[i]."""
        self._check_open()
        checked = [check_key(k) for k in keys]
        targets = None
        if out is not None:
            if len(out) != len(checked):
                raise ValueError(f"{len(checked)} keys for {len(out)} out buffers")
            targets = [_as_view(b, f"out[{i}]") for i, b in enumerate(out)]
        return await self._guarded(self._load(checked, targets), []) if checked else []

    # -- internals ----------------------------------------------------------------------

    async def _guarded(self, op: Awaitable[T], miss: T) -> T:
        """Run one operation; any infrastructure fault is a miss."""
        try:
            return await asyncio.wait_for(op, self.timeout + 1.0)  # backstop over the deadlines
        except CallerError:
            raise
        except (PolarKVError, TimeoutError) as exc:
            self.stats.faults += 1
            if isinstance(exc, TimeoutError):
                self.stats.timeouts += 1
            log.debug("operation became a miss: %s", str(exc) or type(exc).__name__)
            return miss
        except Exception as exc:  # the contract: an engine never sees infrastructure errors
            self.stats.faults += 1
            log.warning("unexpected client fault became a miss: %r", exc)
            return miss

    def _transport_for(self, node: NodeTarget) -> Transport | None:
        if self._shm is not None and self._shm.usable(node):
            return self._shm
        if self._preference != "shm" and self._tcp.usable(node):
            return self._tcp
        return None

    async def _transfer(self, write: bool, moves: Sequence[tuple[Region, memoryview]],
                        deadline: float) -> list[str | None]:
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
        done = await asyncio.gather(*(loop.run_in_executor(self._pool, move, range(k, len(moves), n))
                                      for k in range(n)))
        self.stats.transfer_failures += len(failures)
        return [done[i % n][i // n] for i in range(len(moves))]

    def _move_one(self, write: bool, region: Region, view: memoryview, deadline: float,
                  failures: list[int]) -> str | None:
        """One transfer and its checksum, in a pool thread."""
        transport = self._transport_for(region.node)
        if transport is None:
            return None
        address = region.node.address
        breaker = self._slab_breakers.get(address)
        if breaker is None:
            breaker = self._slab_breakers.setdefault(
                address, CircuitBreaker(f"slab {address}", self._breaker_interval))
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

    def _background_post(self, path: str, body: dict[str, Any]) -> None:
        """Fire a release/abort without making the caller wait; tracked, awaited on close."""
        async def send() -> None:
            try:
                await self._control.post(path, body, time.monotonic() + self.timeout)
            except PolarKVError as exc:
                log.debug("background %s failed: %s", path, exc)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    def _server_wait(deadline: float) -> float:
        """How long the manager may wait on our behalf (for a reload, or for room that
        offloads are making): what is left of our deadline, less time for the reply and
        the transfer that follows."""
        return round(min(MAX_WAIT, max(0.0, (deadline - time.monotonic()) * 0.5)), 3)

    async def _store(self, keys: list[str], views: list[memoryview]) -> int:
        deadline = time.monotonic() + self.timeout
        stored = 0
        for start in range(0, len(keys), self.window):
            part = range(start, min(start + self.window, len(keys)))
            reply = await self._control.post("/v1/allocate", {
                "items": [{"key": keys[i], "size": len(views[i])} for i in part],
                "wait": self._server_wait(deadline)}, deadline)
            nodes = _nodes(reply)
            writes: list[tuple[int, Region]] = []
            for i, res in zip(part, reply["results"], strict=True):
                if res["status"] == "exists":
                    stored += 1
                elif res["status"] == "allocated":
                    writes.append((i, _region(res, nodes)))
            if not writes:
                continue
            sums = await self._transfer(True, [(r, views[i]) for i, r in writes], deadline)
            ok = [(i, s) for (i, _), s in zip(writes, sums, strict=True) if s is not None]
            failed = [keys[i] for (i, _), s in zip(writes, sums, strict=True) if s is None]
            lease = reply["lease"]
            if failed:
                self._background_post("/v1/abort", {"lease": lease, "keys": failed})
            if ok:
                committed = await self._control.post("/v1/commit", {
                    "lease": lease, "items": [{"key": keys[i], "checksum": s} for i, s in ok]}, deadline)
                stored += sum(1 for s in committed["results"].values() if s == "committed")
        return stored

    async def _load(self, keys: list[str], targets: list[memoryview] | None) -> list[memoryview]:
        deadline = time.monotonic() + self.timeout
        loaded: list[memoryview] = []
        for start in range(0, len(keys), self.window):
            part = keys[start: start + self.window]
            reply = await self._control.post("/v1/lookup", {"keys": part, "wait": self._server_wait(deadline)},
                                             deadline)
            entries = reply["entries"]
            if not entries:
                break
            corrupt: list[str] = []
            try:
                good, corrupt = await self._read_window(start, entries, _nodes(reply), targets, deadline)
            finally:
                self._background_post("/v1/release", {"leases": [reply["lease"]], "corrupt": corrupt})
            loaded.extend(good)
            if len(good) < len(part):
                break
        return loaded

    async def _read_window(self, start: int, entries: list[dict[str, Any]],
                           nodes: dict[str, NodeTarget], targets: list[memoryview] | None,
                           deadline: float) -> tuple[list[memoryview], list[str]]:
        """Read a window's hits; return the verified prefix and any key whose bytes failed
        their checksum (the manager drops it)."""
        buffers: list[memoryview] = []
        for j, entry in enumerate(entries):
            size = int(entry["size"])
            if targets is None:
                buffers.append(memoryview(bytearray(size)))
            else:
                target = targets[start + j]
                if len(target) < size:
                    raise CallerError(f"out[{start + j}] holds {len(target)} bytes, the chunk has {size}")
                buffers.append(target[:size])
        sums = await self._transfer(False, [(_region(e, nodes), b) for e, b in
                                            zip(entries, buffers, strict=True)], deadline)
        n = next((j for j, s in enumerate(sums) if s is None), len(sums))
        for j in range(n):
            if sums[j] != entries[j]["checksum"]:
                self.stats.checksum_failures += 1
                log.warning("checksum mismatch on %s; treating it as a miss", entries[j]["key"])
                return buffers[:j], [entries[j]["key"]]
        return buffers[:n], []

    async def _count(self, keys: list[str]) -> int:
        deadline = time.monotonic() + self.timeout
        hits = 0
        for start in range(0, len(keys), self.window):
            part = keys[start: start + self.window]
            reply = await self._control.post("/v1/lookup", {"keys": part, "lease": False}, deadline)
            hits += int(reply["hits"])
            if reply["hits"] < len(part):
                break
        return hits
