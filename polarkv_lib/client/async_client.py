"""AsyncPolarKVClient: store_kv / load_kv / put / get over the control API and a transport.

Contract (DESIGN §7-8): caller mistakes raise ValueError/TypeError before any I/O
(and a `manager_url` out of shard order raises ShardOrderError, a ValueError, from the
first call that reaches the misplaced manager: only it can say which shard it is);
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
from typing import Any, TypeVar

from polarkv_lib.client.sharded import control_for
from polarkv_lib.client.transfers import (
    BufferLike,
    ClientStats,
    Transfers,
    as_view,
    node_targets,
    region_of,
)
from polarkv_lib.config import ClientConfig, Config
from polarkv_lib.errors import OperationTimeout, PolarKVError
from polarkv_lib.keys import check_key, chunk_keys
from polarkv_lib.shards import ShardOrderError, split_urls
from polarkv_lib.transport import PREFERENCES
from polarkv_lib.transport.base import NodeTarget, Region
from polarkv_lib.wire.control import MAX_WAIT

# stdlib logging, not structlog: the client lives inside engines, which own log config.
log = logging.getLogger("polarkv.client")

T = TypeVar("T")
TRANSPORTS = PREFERENCES  # auto, tcp, shm, rdma
TIERED_TTL = 30.0  # seconds a "has a disk tier" answer is reused
MIN_STREAM_WAIT = 0.01  # seconds: a stream waiting for room less than this gives up


class CallerError(ValueError):
    """A caller mistake found only after the manager answered (e.g. an `out` buffer
    smaller than the stored chunk): raised, not turned into a miss."""


DEFAULTS = ClientConfig()  # the one place client defaults are written


class AsyncPolarKVClient:
    def __init__(
        self,
        manager_url: str = DEFAULTS.manager_url,
        namespace: str = "",
        chunk_tokens: int = DEFAULTS.chunk_tokens,
        token: str | None = None,
        transport: str = DEFAULTS.transport,
        timeout: float = DEFAULTS.timeout,
        connections: int = DEFAULTS.connections,
        window: int = DEFAULTS.window,
        breaker_interval: float = DEFAULTS.breaker_interval,
    ) -> None:
        try:  # one URL, or one per manager shard in shard order (comma separated)
            split_urls(manager_url)
        except (ValueError, TypeError, AttributeError):
            raise ValueError(
                f"manager_url must be http(s) URLs, one per shard, got {manager_url!r}"
            ) from None
        if not isinstance(namespace, str):
            raise TypeError("namespace must be a str")
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError("chunk_tokens must be a positive int")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}")
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError("timeout must be a positive number of seconds")
        if connections < 1 or window < 1:
            raise ValueError("connections and window must be >= 1")
        # First: an explicit rdma without a usable device raises here (RdmaUnavailable,
        # naming the reason) before anything else is opened; auto falls back to tcp.
        self.stats = ClientStats()
        self._transfers = Transfers(transport, connections, breaker_interval, self.stats)
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.timeout = float(timeout)
        self.window = window
        self._control = control_for(manager_url, token, breaker_interval)
        self._pending: set[asyncio.Task[Any]] = set()
        self._tiered_at = -TIERED_TTL - 1.0
        self._tiered_value = False
        self._closed = False

    @classmethod
    def from_config(
        cls, config: Config | ClientConfig, namespace: str = "", token: str | None = None
    ) -> AsyncPolarKVClient:
        """A client with the `[client]` settings of a config; with a whole Config, the
        token defaults to `security.token`."""
        return cls(namespace=namespace, **client_kwargs(config, token))

    # -- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> AsyncPolarKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pending:
            await asyncio.wait(self._pending, timeout=self.timeout)
        for task in self._pending:
            task.cancel()
        await self._control.close()
        await self._transfers.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn("AsyncPolarKVClient was not closed", ResourceWarning, stacklevel=1)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("client is closed")

    # -- public API ---------------------------------------------------------------------

    async def check_shards(self) -> None:
        """Ask every manager in `manager_url` that answers which shard it is; raise
        ShardOrderError if the list is out of shard order. Every cache call checks this
        at its first contact with a shard anyway; this is for callers that want the
        mistake at start-up (the engine adapters). Unreachable managers raise nothing."""
        self._check_open()
        await self._control.check_shards(time.monotonic() + self.timeout)

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
        views = [as_view(c, f"chunks[{i}]") for i, c in enumerate(chunks)]
        if any(len(v) == 0 for v in views):
            raise ValueError("chunks must not be empty")
        return await self._guarded(self._store(keys[: len(views)], views), 0)

    async def load_kv(
        self, tokens: Any, out: Sequence[BufferLike] | None = None
    ) -> tuple[int, list[memoryview]]:
        """The longest cached prefix: (n_tokens, one buffer per hit chunk). With `out`,
        chunk i lands in out[i] (zero-copy into caller memory) and the views are slices
        of those buffers."""
        self._check_open()
        keys = self.keys(tokens)
        targets = None
        if out is not None:
            targets = [as_view(b, f"out[{i}]") for i, b in enumerate(out)]
            if any(t.readonly for t in targets):
                raise ValueError("out buffers must be writable")
            keys = keys[: len(targets)]
        views = await self._guarded(self._load(keys, targets), [])
        return len(views) * self.chunk_tokens, views

    async def lookup_kv(self, tokens: Any) -> int:
        """How many leading tokens are cached now (no lease, no transfer): for schedulers."""
        self._check_open()
        keys = self.keys(tokens)
        return (await self._guarded(self._count(keys), (0, 0)))[0] * self.chunk_tokens

    async def lookup_kv_tiers(self, tokens: Any) -> tuple[int, int]:
        """(tokens cached now, how many of them from the start are in memory): a lookup
        that also tells a load served from memory from one that waits for the disk."""
        self._check_open()
        hits, memory = await self._guarded(self._count(self.keys(tokens)), (0, 0))
        return hits * self.chunk_tokens, memory * self.chunk_tokens

    async def put(self, key: str, data: BufferLike) -> bool:
        self._check_open()
        view = as_view(data, "data")
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
        return (await self._guarded(self._count(checked), (0, 0)))[0] if checked else 0

    async def put_many(self, keys: Sequence[str], values: Sequence[BufferLike]) -> int:
        """Store values[i] under keys[i]; how many are now stored (written or present)."""
        self._check_open()
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        checked = [check_key(k) for k in keys]
        views = [as_view(v, f"values[{i}]") for i, v in enumerate(values)]
        if any(len(v) == 0 for v in views):
            raise ValueError("values must not be empty")
        return await self._guarded(self._store(checked, views), 0) if checked else 0

    async def get_many(
        self, keys: Sequence[str], out: Sequence[BufferLike] | None = None
    ) -> list[memoryview]:
        """The values of the leading stored keys; with `out`, read into out[i]."""
        self._check_open()
        checked = [check_key(k) for k in keys]
        targets = None
        if out is not None:
            if len(out) != len(checked):
                raise ValueError(f"{len(checked)} keys for {len(out)} out buffers")
            targets = [as_view(b, f"out[{i}]") for i, b in enumerate(out)]
            if any(t.readonly for t in targets):
                raise ValueError("out buffers must be writable")
        return await self._guarded(self._load(checked, targets), []) if checked else []

    # -- internals ----------------------------------------------------------------------

    async def _guarded(self, op: Awaitable[T], miss: T) -> T:
        """Run one operation; any infrastructure fault is a miss."""
        try:
            return await asyncio.wait_for(op, self.timeout + 1.0)  # backstop over the deadlines
        except (CallerError, ShardOrderError):  # the caller's (or its config's) to fix
            raise
        except (PolarKVError, TimeoutError) as exc:
            self.stats.faults += 1
            if isinstance(exc, TimeoutError | OperationTimeout):
                self.stats.timeouts += 1
            log.debug("operation became a miss: %s", str(exc) or type(exc).__name__)
            return miss
        except Exception as exc:  # the contract: an engine never sees infrastructure errors
            self.stats.faults += 1
            log.warning("unexpected client fault became a miss: %r", exc)
            return miss

    def _cut_short(self, exc: BaseException) -> None:
        """A fault after some windows were done: what they did stands (fewer chunks, not
        none), and the fault is counted as `_guarded` counts one that leaves nothing."""
        self.stats.faults += 1
        if isinstance(exc, TimeoutError | OperationTimeout):
            self.stats.timeouts += 1
        log.debug("operation cut short: %s", str(exc) or type(exc).__name__)

    def _background(self, call: Awaitable[None], what: str) -> None:
        """Fire a release/abort without making the caller wait; tracked, awaited on close."""

        async def send() -> None:
            try:
                await call
            except PolarKVError as exc:
                log.debug("background %s failed: %s", what, exc)

        task = asyncio.get_running_loop().create_task(send())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    @staticmethod
    def _server_wait(deadline: float) -> float:
        """How long the manager may wait on our behalf (for a reload, or for room that
        offloads are making): what is left of our deadline, less time for the reply and
        the transfer that follows."""
        return round(min(MAX_WAIT, max(0.0, (deadline - time.monotonic()) * 0.5)), 3)

    async def _store(self, keys: list[str], views: list[memoryview]) -> int:
        """Store window by window under one write lease; return the stored prefix: the
        chunks a load can get back (a chunk after a gap would never be read)."""
        deadline = time.monotonic() + self.timeout
        stored = [False] * len(keys)
        todo = list(range(len(keys)))
        lease: str | None = None
        streamed = False  # a window said more follow: the lease ends with a release
        try:
            while todo:
                part, rest = todo[: self.window], todo[self.window :]
                try:
                    done, retry, lease, kept = await self._store_window(
                        keys, views, part, deadline, lease, bool(rest)
                    )
                except (PolarKVError, TimeoutError) as exc:
                    if not any(stored):
                        raise
                    self._cut_short(exc)
                    break
                streamed = streamed or kept
                for i in done:
                    stored[i] = True
                todo = retry + rest
        finally:
            if streamed and lease:
                self._background(
                    self._control.release([lease], time.monotonic() + self.timeout), "release"
                )
        return next((i for i, ok in enumerate(stored) if not ok), len(stored))

    async def _store_window(
        self,
        keys: list[str],
        views: list[memoryview],
        part: list[int],
        deadline: float,
        lease: str | None,
        more: bool,
    ) -> tuple[list[int], list[int], str | None, bool]:
        """Store one window: which of it are stored, which to ask for again, the store's
        write lease (continued from its earlier windows), and whether this window asked
        the manager to keep that lease open for more."""
        reply = await self._control.allocate(
            [(keys[i], len(views[i])) for i in part],
            deadline,
            self._server_wait(deadline),
            lease,
            more,
        )
        lease = reply["lease"] or lease
        nodes = node_targets(reply)
        stored: list[int] = []
        writes: list[tuple[int, Region]] = []
        later: list[int] = []  # past this request's share of memory: ask again at once
        no_space: list[int] = []
        for i, res in zip(part, reply["results"], strict=True):
            status = res["status"]
            if status == "exists":
                stored.append(i)
            elif status == "allocated":
                writes.append((i, region_of(res, nodes)))
            elif status == "later":
                later.append(i)
            elif status == "no_space":
                no_space.append(i)
        # Refused keys are asked for again only with a disk tier: what this round
        # committed can be offloaded to make room (the manager waits for it). Without
        # one, room would come from evicting this prompt's own head: it stays stored.
        # A round that committed nothing ends it (the manager waited what it could).
        retry_refused = bool(no_space) and bool(writes) and await self._tiered(deadline)
        go_on = more or bool(later) or retry_refused
        committed = await self._write_window(keys, views, writes, reply["lease"], deadline, go_on)
        stored += committed
        retry = later + (no_space if retry_refused and committed else [])
        if not committed and not stored:
            retry = []  # nothing moved this round: what is left would not move either
        return stored, sorted(retry), lease, more or go_on

    async def _tiered(self, deadline: float) -> bool:
        now = time.monotonic()
        if now - self._tiered_at > TIERED_TTL:
            self._tiered_value = await self._control.tiered(deadline)
            self._tiered_at = now
        return self._tiered_value

    async def _write_window(
        self,
        keys: list[str],
        views: list[memoryview],
        writes: list[tuple[int, Region]],
        lease: str | None,
        deadline: float,
        more: bool,
    ) -> list[int]:
        """Write the allocated regions, commit what arrived whole; which committed."""
        if not writes or lease is None:
            return []
        sums = await self._transfers.move(True, [(r, views[i]) for i, r in writes], deadline)
        ok = [(i, s) for (i, _), s in zip(writes, sums, strict=True) if s is not None]
        failed = [keys[i] for (i, _), s in zip(writes, sums, strict=True) if s is None]
        if failed:
            self._background(
                self._control.abort(lease, failed, time.monotonic() + self.timeout), "abort"
            )
        if not ok:
            return []
        results = await self._control.commit(lease, [(keys[i], s) for i, s in ok], deadline, more)
        return [i for i, _ in ok if results.get(keys[i]) == "committed"]

    async def _load(self, keys: list[str], targets: list[memoryview] | None) -> list[memoryview]:
        """Load the longest stored prefix as one stream: each lookup names the stream's
        lease (`continue`), which lets go of the window just read and serves the next,
        reloaded from disk meanwhile. Memory is the staging area, not the limit."""
        deadline = time.monotonic() + self.timeout
        loaded: list[memoryview] = []
        lease: str | None = None
        corrupt: list[str] = []
        try:
            while len(loaded) < len(keys):
                start = len(loaded)
                part = keys[start : start + self.window]
                wait = self._server_wait(deadline)
                try:
                    reply = await self._control.lookup(part, deadline, wait=wait, resume=lease)
                except (PolarKVError, TimeoutError) as exc:
                    if not loaded:
                        raise
                    self._cut_short(exc)  # the windows already read are a valid prefix
                    break
                lease = reply["lease"] or None
                entries = reply["entries"]
                if entries:
                    good, corrupt = await self._read_window(
                        start, entries, node_targets(reply), targets, deadline
                    )
                    loaded.extend(good)
                    if len(good) < len(entries):
                        break  # a transfer failed, or bytes were wrong: the prefix ends
                if len(entries) == len(part):
                    continue
                if not reply.get("more") or (not entries and wait < MIN_STREAM_WAIT):
                    break  # a miss; or room did not come, and no time is left to wait
        finally:
            if lease:
                self._background(
                    self._control.release([lease], time.monotonic() + self.timeout, corrupt),
                    "release",
                )
        return loaded

    async def _read_window(
        self,
        start: int,
        entries: list[dict[str, Any]],
        nodes: dict[str, NodeTarget],
        targets: list[memoryview] | None,
        deadline: float,
    ) -> tuple[list[memoryview], list[str]]:
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
                    raise CallerError(
                        f"out[{start + j}] holds {len(target)} bytes, the chunk has {size}"
                    )
                buffers.append(target[:size])
        sums = await self._transfers.move(
            False,
            [(region_of(e, nodes), b) for e, b in zip(entries, buffers, strict=True)],
            deadline,
        )
        n = next((j for j, s in enumerate(sums) if s is None), len(sums))
        for j in range(n):
            if sums[j] != entries[j]["checksum"]:
                self.stats.checksum_failures += 1
                log.warning("checksum mismatch on %s; treating it as a miss", entries[j]["key"])
                return buffers[:j], [entries[j]["key"]]
        return buffers[:n], []

    async def _count(self, keys: list[str]) -> tuple[int, int]:
        """(leading keys stored, leading keys in memory), one window at a time."""
        deadline = time.monotonic() + self.timeout
        hits = memory = 0
        for start in range(0, len(keys), self.window):
            part = keys[start : start + self.window]
            reply = await self._control.lookup(part, deadline, lease=False)
            if memory == hits:  # a manager that does not say counts nothing in memory
                memory += min(int(reply.get("memory", 0)), int(reply["hits"]))
            hits += int(reply["hits"])
            if reply["hits"] < len(part):
                break
        return hits, memory


def client_kwargs(config: Config | ClientConfig, token: str | None) -> dict[str, Any]:
    """A client's keyword arguments from the `[client]` section of a config, and the
    token: the one given, else the config's `security.token` (a whole Config only)."""
    if isinstance(config, Config):
        token = token if token is not None else (config.security.token or None)
        config = config.client
    c = config
    return {
        "manager_url": c.manager_url,
        "chunk_tokens": c.chunk_tokens,
        "token": token,
        "transport": c.transport,
        "timeout": c.timeout,
        "connections": c.connections,
        "window": c.window,
        "breaker_interval": c.breaker_interval,
    }
