"""`polarkv bench manager --shards 1,2,4`: does the control plane add up across shards?

For each shard count N, N fresh manager processes (`manager.shard=I/N`, one grant key,
SQLite each) each get the same bench node (registered and heartbeated by the bench, as
in the table part: no bytes move), and the bench fills them with --entries committed
entries whose keys are hashes, so every shard owns its share. Then one client pool
(--concurrency tasks in this process, one keep-alive pool) sends the same 64-key pairs
the table part sends, split by owner the way the sharded client splits them: each pair's
per-shard requests go out at once and the pair ends with the slowest.

  lookup    64 random resident keys: lookup with a lease per owning shard, then release
  allocate  64 fresh keys on full shards (each evicts its share), then commit

Per row: pairs/s (best round), the managers' CPU over the round in cores (user + system
of every shard process, /proc), the client's own CPU in cores, pairs/s per manager
core, and what N shards would serve with a core each: the per-core rate times N. On a
machine with fewer cores than shards plus client, the measured aggregate is bounded by
the cores; the per-core rate is the figure that carries over.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from polarkv_lib.progress import progress
from polarkv_lib.service import Service, running
from polarkv_lib.shards import shard_of
from polarkv_lib.tools.bench import core
from polarkv_lib.tools.bench.manager_load import (
    Driver,
    FakeNode,
    _allocate_commit,
    _lookup_release,
)
from polarkv_lib.tools.bench.manager_plan import BATCH, REQUEST_TIMEOUT, SERVICE_TIMEOUT, Plan
from polarkv_lib.tools.bench.measure import proc_cpu

GRANT_KEY = "bench-shards-grant-key-0123456789abcdef"  # every shard signs with one key
FRESH = 10**9  # key indexes of new entries start here, far past the resident ones


def _key(i: int) -> str:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest()


@dataclass
class ShardRow:
    shards: int
    op: str
    pairs_per_s: list[float] = field(default_factory=list)  # per round
    manager_cores: list[float] = field(default_factory=list)
    client_cores: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def best(self) -> int:
        return max(range(len(self.pairs_per_s)), key=self.pairs_per_s.__getitem__)

    def per_core(self) -> float:
        i = self.best()
        return self.pairs_per_s[i] / self.manager_cores[i] if self.manager_cores[i] else 0.0

    def to_json(self) -> dict[str, Any]:
        i = self.best()
        return {
            "shards": self.shards,
            "op": self.op,
            "pairs_per_s": self.pairs_per_s[i],
            "keys_per_s": self.pairs_per_s[i] * BATCH,
            "manager_cores": self.manager_cores[i],
            "client_cores": self.client_cores[i],
            "pairs_per_s_per_manager_core": self.per_core(),
            "expected_pairs_per_s_core_per_shard": self.per_core() * self.shards,
            "rounds": self.pairs_per_s,
            "notes": self.notes,
        }


class Shards:
    """Which shard URL owns a key (the sharded client's rule), and keys that fill every
    shard equally."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def owner(self, key: str) -> int:
        return shard_of(key, len(self.urls))

    def split(self, keys: list[str]) -> dict[str, list[str]]:
        by_url: dict[str, list[str]] = {}
        for key in keys:
            by_url.setdefault(self.urls[self.owner(key)], []).append(key)
        return by_url

    def resident(self, n: int) -> list[str]:
        """n // shards keys for each shard (hash order): what fills each one exactly."""
        quota = n // len(self.urls)
        per = [0] * len(self.urls)
        keys: list[str] = []
        i = 0
        while len(keys) < quota * len(self.urls):
            key = _key(i)
            owner = self.owner(key)
            if per[owner] < quota:
                per[owner] += 1
                keys.append(key)
            i += 1
        return keys


async def _fill(
    driver: Driver, shards: Shards, keys: list[str], size: int, notes: list[str]
) -> None:
    batches = [
        (url, part[first : first + BATCH])
        for url, part in shards.split(keys).items()
        for first in range(0, len(part), BATCH)
    ]
    todo = iter(batches)
    n = len(keys)
    with progress(n, f"fill {n} entries over {len(shards.urls)} shard(s)", "entry") as bar:

        async def worker() -> None:
            for url, batch in todo:
                done = await _allocate_commit(driver, url, batch, size)
                if done < len(batch):
                    notes.append(f"fill: {len(batch) - done} of a batch not stored")
                bar.update(len(batch))

        await asyncio.gather(*(worker() for _ in range(driver.conc)))


async def _round(
    driver: Driver, seconds: float, pids: list[int], pair: Callable[[], Awaitable[None]]
) -> tuple[float, float, float]:
    """Pairs/s, manager cores and client cores over one round."""
    deadline = time.monotonic() + seconds
    count = [0]

    async def worker() -> None:
        while time.monotonic() < deadline:
            await pair()
            count[0] += 1

    cpu0, own0, t0 = sum(proc_cpu(p) for p in pids), time.process_time(), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(driver.conc)))
    elapsed = time.monotonic() - t0
    managers = (sum(proc_cpu(p) for p in pids) - cpu0) / elapsed
    return count[0] / elapsed, managers, (time.process_time() - own0) / elapsed


async def _measure(plan: Plan, n: int, shards: Shards, pids: list[int]) -> list[ShardRow]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=plan.concurrency * len(shards.urls))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        driver = Driver(session, plan.concurrency)
        fill_notes: list[str] = []
        resident = shards.resident(n)
        await _fill(driver, shards, resident, plan.size, fill_notes)
        rng = random.Random(n)
        fresh = iter(range(FRESH, 10**12, BATCH))
        short = {"lookup": 0, "allocate": 0}

        async def lookup() -> None:
            keys = rng.sample(resident, BATCH)
            parts = shards.split(keys).items()
            hits = await asyncio.gather(*(_lookup_release(driver, u, k) for u, k in parts))
            short["lookup"] += BATCH - sum(hits)

        async def allocate() -> None:
            first = next(fresh)
            keys = [_key(i) for i in range(first, first + BATCH)]
            parts = shards.split(keys).items()
            done = await asyncio.gather(
                *(_allocate_commit(driver, u, k, plan.size) for u, k in parts)
            )
            short["allocate"] += BATCH - sum(done)

        rows = []
        for op, pair in (("lookup", lookup), ("allocate", allocate)):
            row = ShardRow(len(shards.urls), op, notes=list(dict.fromkeys(fill_notes)))
            await pair()  # warm the pool's connections to every shard
            short[op] = 0
            for _ in range(plan.rounds):
                rate, managers, client = await _round(driver, plan.seconds, pids, pair)
                row.pairs_per_s.append(rate)
                row.manager_cores.append(managers)
                row.client_cores.append(client)
            if short[op]:
                row.notes.append(f"{short[op]} keys not {'hit' if op == 'lookup' else 'stored'}")
            rows.append(row)
        return rows


def one_count(plan: Plan, count: int, n: int, workdir: str) -> list[ShardRow]:
    services = [
        Service(
            os.path.join(workdir, f"{count}-{i}"),
            ("manager",),
            {
                "manager.shard": f"{i}/{count}",
                "manager.metadata_url": f"sqlite:///{workdir}/{count}-{i}.db",
                "security.grant_key": GRANT_KEY,
            },
            stop_timeout=SERVICE_TIMEOUT,
            start_timeout=SERVICE_TIMEOUT,
        )
        for i in range(count)
    ]
    for s in services:
        os.makedirs(s.workdir, exist_ok=True)
    # The whole (fake) buffer; each shard takes its part, n // count entries' worth.
    nodes = [FakeNode(n // count * count * plan.size) for _ in services]
    try:
        with running(*services) as urls:
            for node, url in zip(nodes, urls, strict=True):
                node.register(url)
            return asyncio.run(_measure(plan, n, Shards(urls), [s.pid for s in services]))
    finally:
        for node in nodes:
            node.stop()


def render(rows: list[ShardRow]) -> str:
    lines = [
        (
            "shards",
            "op (64 keys)",
            "pairs/s",
            "manager cores",
            "client cores",
            "pairs/s per manager core",
            "a core per shard: pairs/s",
            "notes",
        )
    ]
    one = {r.op: r.per_core() for r in rows if r.shards == 1}
    for r in rows:
        i = r.best()
        scaling = (
            f" ({r.per_core() / one[r.op]:.2f}x one shard's per core)" if one.get(r.op) else ""
        )
        lines.append(
            (
                str(r.shards),
                r.op,
                f"{r.pairs_per_s[i]:,.0f}",
                f"{r.manager_cores[i]:.2f}",
                f"{r.client_cores[i]:.2f}",
                f"{r.per_core():,.0f}{scaling}",
                f"{r.per_core() * r.shards:,.0f}",
                "; ".join(r.notes),
            )
        )
    return core.markdown_table(lines)
