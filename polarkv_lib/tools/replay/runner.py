"""Replay a trace against PolarKV caches, request by request, in trace order.

Per request: look up the longest stored prefix of its blocks and load it (one
`get_many`, which stops at the first miss), then store the rest (`put_many`). Keys are
the client's chained chunk keys over the block ids with one id per chunk, so a block
is keyed by its whole prefix as an engine's chunk would be, in its own namespace.

Each block's bytes are a pure function of its key, so every loaded block is checked;
a block that differs ends the hit prefix there and is counted (it must stay 0).
Memory vs disk hits come from the manager's `hits_memory` / `hits_disk` counters read
after every request: exact only while the replay is the service's only client.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from polarkv_lib.client import PolarKVClient
from polarkv_lib.client.admin import AdminClient
from polarkv_lib.errors import PolarKVError
from polarkv_lib.keys import chunk_keys
from polarkv_lib.progress import progress
from polarkv_lib.tools.bench.core import BenchError
from polarkv_lib.tools.replay.trace import Request


@dataclass(frozen=True)
class ReplaySettings:
    kv_bytes_per_token: int
    block_tokens: int = 512
    scale: int = 1  # stored bytes per block = full bytes // scale
    namespace: str = "replay"
    time_scale: float = 0.0  # 0: as fast as possible; 1: the trace's own pace
    transport: str = "auto"
    timeout: float = 10.0
    token: str | None = None

    @property
    def block_bytes_full(self) -> int:
        return self.kv_bytes_per_token * self.block_tokens

    @property
    def block_bytes(self) -> int:
        return max(1, self.block_bytes_full // self.scale)


@dataclass
class RequestResult:
    blocks: int
    hit_blocks: int
    hit_memory: int
    hit_disk: int
    input_tokens: int
    hit_tokens: int
    load_s: float
    store_s: float
    stored_blocks: int
    cache: int


@dataclass
class ReplayResult:
    results: list[RequestResult] = field(default_factory=list)
    wrong_blocks: int = 0
    client_faults: int = 0
    seconds: float = 0.0


class Cache:
    """One cache as the replay sees it: a client over one manager URL (or several
    comma-separated shards) and the admin stats of each shard."""

    def __init__(self, url: str, settings: ReplaySettings) -> None:
        self.urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
        self._token = settings.token
        self.client = PolarKVClient(
            url,
            namespace=settings.namespace,
            chunk_tokens=1,
            token=settings.token,
            transport=settings.transport,
            timeout=settings.timeout,
        )
        self._last = (0, 0)

    def check_reachable(self) -> None:
        """A probe lookup: an unreachable manager (or shard URLs that this client cannot
        use) would otherwise turn the whole replay into silent misses."""
        before = self.client.stats.faults
        self.client.lookup_keys(chunk_keys([0], "polarkv-replay-probe", 1))
        if self.client.stats.faults > before:
            hint = " (several URLs need a client with shard support)" if len(self.urls) > 1 else ""
            raise BenchError(f"cannot use the manager at {','.join(self.urls)}{hint}")
        self._last = self.tier_hits()

    def tier_hits(self) -> tuple[int, int]:
        memory = disk = 0
        for url in self.urls:
            try:
                stats = AdminClient(url, self._token or None).stats()
            except PolarKVError as exc:
                raise BenchError(f"cannot read {url}/v1/stats: {exc}") from None
            memory += int(stats.get("hits_memory", 0))
            disk += int(stats.get("hits_disk", 0))
        return memory, disk

    def tier_delta(self) -> tuple[int, int]:
        now = self.tier_hits()
        delta = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        return delta

    def close(self) -> None:
        self.client.close()


def block_payload(key: str, size: int) -> bytes:
    """The bytes of one block: its key repeated, so a reader knows what it must get."""
    raw = bytes.fromhex(key)
    return (raw * (size // len(raw) + 1))[:size]


def replay_one(
    cache: Cache, request: Request, settings: ReplaySettings, arena: bytearray, index: int
) -> tuple[RequestResult, int]:
    """Load the longest cached prefix of one request, check it, store the rest.
    Returns the result and how many loaded blocks held wrong bytes."""
    size = settings.block_bytes
    keys = cache.client.keys(list(request.hash_ids))
    view = memoryview(arena)
    out = [view[i * size : (i + 1) * size] for i in range(len(keys))]
    start = time.perf_counter()
    loaded = cache.client.get_many(keys, out) if keys else []
    load_s = time.perf_counter() - start
    hits, wrong = len(loaded), 0
    for i, block in enumerate(loaded):
        if block != block_payload(keys[i], size):
            hits, wrong = i, len(loaded) - i
            break
    memory, disk = cache.tier_delta()
    rest = keys[hits:]
    start = time.perf_counter()
    stored = cache.client.put_many(rest, [block_payload(k, size) for k in rest]) if rest else 0
    store_s = time.perf_counter() - start
    hit_tokens = min(hits * settings.block_tokens, request.input_length)
    return RequestResult(
        len(keys),
        hits,
        min(memory, hits),
        min(disk, hits - min(memory, hits)),
        request.input_length,
        hit_tokens,
        load_s,
        store_s,
        stored,
        index,
    ), wrong


def replay(
    requests: Sequence[Request],
    caches: Sequence[Cache],
    route: Callable[[int, Request], int],
    settings: ReplaySettings,
) -> ReplayResult:
    """Replay `requests` in order; `route(i, request)` picks the cache of request i."""
    longest = max(len(r.hash_ids) for r in requests)
    arena = bytearray(max(1, longest * settings.block_bytes))
    result = ReplayResult()
    faults_before = sum(c.client.stats.faults for c in caches)
    hit_blocks = blocks = 0
    begin = time.monotonic()
    with progress(len(requests), "replay", unit="req") as bar:
        for i, request in enumerate(requests):
            if settings.time_scale > 0:  # keep the trace's pace; when late, go on at once
                due = begin + request.timestamp_ms / 1000.0 / settings.time_scale
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            which = route(i, request)
            one, wrong = replay_one(caches[which], request, settings, arena, which)
            result.results.append(one)
            result.wrong_blocks += wrong
            blocks += one.blocks
            hit_blocks += one.hit_blocks
            bar.update(1)
            if i % 50 == 0:
                bar.set_postfix(f"hit {hit_blocks / max(blocks, 1):.1%}")
    result.seconds = time.monotonic() - begin
    result.client_faults = sum(c.client.stats.faults for c in caches) - faults_before
    return result
