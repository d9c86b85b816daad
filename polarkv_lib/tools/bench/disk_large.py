"""The `large` part of the disk benchmark: prompts larger than a node's memory, loaded
whole through it (memory is a staging area, not the limit), beside the raw disk reading
the same bytes and beside a memory-only node with memory for all of them, in one run.

Two cases per object size: one prefix of 8x the node's memory, and four loaders at once
of 2x memory each. Each round stores the prompts on a fresh hybrid node (memory + disk)
and a fresh memory-only node, lets the offloads settle, then times, in alternating order,
the raw read of the same bytes (one file per object, the bench's threads), the hybrid
load (every chunk reloaded from its disk, streamed window by window) and the
memory-only load. Loads go into caller buffers and every chunk's bytes are checked."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass

from polarkv_lib.client.async_client import AsyncPolarKVClient
from polarkv_lib.service import Service, running
from polarkv_lib.tools.bench import disk_files as files
from polarkv_lib.tools.bench.core import BenchError, MiB, gbps
from polarkv_lib.tools.bench.disk_node import (
    Pool,
    RawFiles,
    Workload,
    _client,
    _disk_settings,
    _settle_offloads,
    _stats,
)
from polarkv_lib.tools.bench.disk_plan import CALLERS, Plan, Row
from polarkv_lib.wire.orders import FILE_HEADER_SIZE as HEADER_SIZE

ROUNDS = 3
BUDGET_S = 120.0  # rounds are cut to stay near this, over all sizes and cases


@dataclass(frozen=True)
class Case:
    name: str
    loaders: int  # prompts loaded at once, one per loader
    times_memory: int  # each prompt's size, in node memories


CASES = (Case("1 prefix of 8x memory", 1, 8), Case("4 loaders of 2x memory", 4, 2))


@dataclass
class Prompts:
    """The case's prompts: `loaders` prompts of `chunks` chunks (chunk_tokens=1), their
    bytes taken from `pool` in order, and one set of caller buffers per loader."""

    pool: Pool
    loaders: int
    chunks: int

    def tokens(self, p: int) -> list[int]:
        return [p * self.chunks + j for j in range(self.chunks)]

    def data(self, p: int) -> list[memoryview]:
        return [self.pool.obj(p * self.chunks + j) for j in range(self.chunks)]

    @property
    def nbytes(self) -> int:
        return self.loaders * self.chunks * self.pool.size


async def _store(client: AsyncPolarKVClient, prompts: Prompts) -> int:
    done = await asyncio.gather(
        *(client.store_kv(prompts.tokens(p), prompts.data(p)) for p in range(prompts.loaders))
    )
    return sum(done)


async def _load(
    client: AsyncPolarKVClient, prompts: Prompts, outs: list[list[memoryview]]
) -> tuple[float, int, int]:
    """(seconds, chunks loaded, chunks whose bytes differ): every loader at once; the
    bytes are compared after the clock stops."""
    started = time.perf_counter()
    done = await asyncio.gather(
        *(client.load_kv(prompts.tokens(p), outs[p]) for p in range(prompts.loaders))
    )
    seconds = time.perf_counter() - started
    wrong = sum(
        1
        for p, (_, views) in enumerate(done)
        for v, want in zip(views, prompts.data(p), strict=False)
        if v != want
    )
    return seconds, sum(n for n, _ in done), wrong


def large_part(plan: Plan, workdir: str, rows: list[Row]) -> None:
    budget = BUDGET_S / (len(plan.sizes) * len(CASES))
    for size in plan.sizes:
        for case in CASES:
            vs_raw = Row("large", size, f"load, {case.name}", "raw read")
            vs_memory = Row("large", size, f"load, {case.name}", "memory-only load")
            rows += (vs_raw, vs_memory)
            _case(plan, workdir, size, case, vs_raw, vs_memory, budget)


def _case(
    plan: Plan,
    workdir: str,
    size: int,
    case: Case,
    vs_raw: Row,
    vs_memory: Row,
    budget: float,
) -> None:
    chunks = case.times_memory * plan.memory // size
    pool = Pool(size, case.loaders * chunks)
    prompts = Prompts(pool, case.loaders, chunks)
    # The raw side reads the same bytes, object by object, with the bench's threads.
    raw = RawFiles(
        os.path.join(workdir, "large-raw"),
        Workload(pool, prompts.nbytes, max(1, prompts.nbytes // (CALLERS * size))),
        plan.threads,
        plan.o_direct,
    )
    outs = [[memoryview(files.anonymous(size)) for _ in range(chunks)] for _ in range(case.loaders)]
    started = time.monotonic()
    try:
        raw.write("objects")
        for r in range(ROUNDS):
            if r and (time.monotonic() - started) * (r + 1) / r > budget:
                vs_raw.notes.append(f"{r} rounds (time budget)")
                break
            _round(
                plan, workdir, f"{size}-{case.loaders}-{r}", prompts, raw, outs, vs_raw, vs_memory
            )
    finally:
        raw.close()
        pool.close()


def _round(
    plan: Plan,
    workdir: str,
    tag: str,
    prompts: Prompts,
    raw: RawFiles,
    outs: list[list[memoryview]],
    vs_raw: Row,
    vs_memory: Row,
) -> None:
    hybrid_dir = os.path.join(workdir, f"large-hybrid-{tag}")
    disk_capacity = int(prompts.nbytes * (1 + HEADER_SIZE / prompts.pool.size) / 0.9) + 64 * MiB
    hybrid = Service(
        hybrid_dir,
        (),
        {
            "slab.memory": str(plan.memory),
            **_disk_settings(os.path.join(hybrid_dir, "disk"), disk_capacity, plan),
        },
    )
    memory_dir = os.path.join(workdir, f"large-memory-{tag}")
    # memory for all of it: the size classes round 1-64 MiB objects up by at most 1/8
    memory_only = Service(
        memory_dir, ("manager", "slab"), {"slab.memory": str(prompts.nbytes * 9 // 8 + 64 * MiB)}
    )
    try:
        with running(hybrid, memory_only) as (hybrid_url, memory_url):
            results = asyncio.run(_timed(plan, hybrid_url, memory_url, prompts, raw, outs))
            stats = _stats(hybrid_url)
    finally:
        files.remove_files(hybrid_dir)
        files.remove_files(memory_dir)
    hybrid_s, memory_s, raw_reads, notes = results
    vs_raw.ours.append(gbps(prompts.nbytes, hybrid_s))
    vs_raw.base.append(statistics.fmean(raw_reads))
    vs_memory.ours.append(gbps(prompts.nbytes, hybrid_s))
    vs_memory.base.append(gbps(prompts.nbytes, memory_s))
    vs_raw.notes += notes
    vs_raw.notes.append(
        f"hybrid node: {stats['reloads']} reloads, {stats['offloads']} offloads, "
        f"{stats['tier_failures']} tier failures, {stats['evictions']} evictions; "
        f"raw read before/after {raw_reads[0]:.2f}/{raw_reads[1]:.2f} GB/s"
    )


async def _timed(
    plan: Plan,
    hybrid_url: str,
    memory_url: str,
    prompts: Prompts,
    raw: RawFiles,
    outs: list[list[memoryview]],
) -> tuple[float, float, list[float], list[str]]:
    loop = asyncio.get_running_loop()
    want = prompts.loaders * prompts.chunks
    notes: list[str] = []
    hybrid, memory = _client(hybrid_url), _client(memory_url)
    try:
        for name, client in (("hybrid", hybrid), ("memory-only", memory)):
            stored = await _store(client, prompts)
            if stored < want:
                raise BenchError(f"large part: the {name} node stored {stored}/{want} chunks")
        await _settle_offloads(hybrid_url)
        raw_reads = []
        files.drop_caches(plan.o_direct, notes)
        raw_reads.append(await loop.run_in_executor(None, raw.read, "objects"))
        files.drop_caches(plan.o_direct, notes)
        hybrid_s, hits, wrong = await _load(hybrid, prompts, outs)
        _check("hybrid", hits, wrong, want, notes)
        memory_s, hits, wrong = await _load(memory, prompts, outs)
        _check("memory-only", hits, wrong, want, notes)
        files.drop_caches(plan.o_direct, notes)
        raw_reads.append(await loop.run_in_executor(None, raw.read, "objects"))
    finally:
        await hybrid.close()
        await memory.close()
    return hybrid_s, memory_s, raw_reads, notes


def _check(name: str, hits: int, wrong: int, want: int, notes: list[str]) -> None:
    if hits < want:
        notes.append(f"{name} loaded {hits}/{want} chunks")
    if wrong:
        notes.append(f"{name}: {wrong} CHUNKS WRONG")
