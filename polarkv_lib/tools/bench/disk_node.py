"""The node parts of the disk benchmark: `service` (a real node offloading and reloading
a working set four times its memory, against raw files of the same bytes) and `fit` (a
working set that fits, loaded through a node with the disk role and one without it).
The method is described in polarkv_lib/tools/bench/disk.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import re
import statistics
import struct
import threading
import time
from dataclasses import dataclass, field

from polarkv_lib.client.admin import AdminClient
from polarkv_lib.client.async_client import AsyncPolarKVClient
from polarkv_lib.errors import PolarKVError
from polarkv_lib.keys import chunk_keys
from polarkv_lib.node.disk import DiskStore
from polarkv_lib.service import Service, running
from polarkv_lib.tools.bench import disk_files as files
from polarkv_lib.tools.bench.core import BenchError, MiB, gbps
from polarkv_lib.tools.bench.disk_plan import CALLERS, Plan, Row
from polarkv_lib.tools.bench.measure import CpuWatch
from polarkv_lib.wire.orders import FILE_HEADER_SIZE as HEADER_SIZE

SERVICE_ROUNDS = 3
FIT_ROUNDS = 9
FIT_BYTES = 1024 * MiB  # bytes one fit measurement loads (the working set, repeatedly)
NAMESPACE = "bench-disk"
POOL_BYTES = 128 * MiB  # distinct objects the service part cycles through (bounds our RSS)
SAMPLE_S = 0.02  # stats polling period: a window error of at most 2 periods
CLIENT_TIMEOUT = 30.0  # bounds each client call; a stalled reload shows up as a miss
SETTLE_TIMEOUT = 30.0  # wait for offloads still in flight when the stores returned
BUDGET_S = {"service": 100.0, "fit": 30.0}  # rounds are cut to stay near these


def _stats(url: str) -> dict[str, int]:
    return AdminClient(url).stats()


def _histogram_sums(url: str) -> dict[str, float]:
    """The offload/reload histograms' _sum and _count from /metrics."""
    text = AdminClient(url).metrics()
    found = re.findall(r"^(polarkv_(?:offload|reload)_seconds_(?:sum|count)) (\S+)$", text, re.M)
    return {name: float(value) for name, value in found}


class StatsPoller:
    """Samples the manager's counters every SAMPLE_S while a phase runs, in a thread, so
    the phase's disk window can be found afterwards."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-disk-stats", daemon=True)

    def _sample(self) -> None:
        with contextlib.suppress(PolarKVError):  # a missed sample only widens the window
            self.samples.append((time.perf_counter(), _stats(self.url)))

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def __enter__(self) -> StatsPoller:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)
        self._sample()

    def window(self, counter: str, after: str = "") -> tuple[int, float]:
        """(bytes, seconds) of the counter's growth: from the last sample before it grew
        to the first one showing its final value. Conservative: the window may be up to
        two sample periods longer than the disk work, never shorter. With `after`, the
        window starts only once that other counter has stopped growing (e.g. reloads
        while no offload wrote at the same time)."""
        if len(self.samples) < 2:
            return 0, 0.0
        values = [(t, s.get(counter, 0)) for t, s in self.samples]
        first, last = values[0][1], values[-1][1]
        if last == first:
            return 0, 0.0
        start = max(t for t, v in values if v == first)
        if after:
            done = self.samples[-1][1].get(after, 0)
            start = max(start, min(t for t, s in self.samples if s.get(after, 0) == done))
        begin = next(v for t, v in values if t == start)
        end = min(t for t, v in values if v == last)
        return last - begin, max(end - start, 0.0)


# -- the client side of the service and fit parts ---------------------------------------


class Pool:
    """The distinct objects a client stores, cycled through (a working set larger than
    the pool repeats objects under different keys, which no layer can tell apart)."""

    def __init__(self, size: int, n_objects: int) -> None:
        self.size = size
        self.n = max(1, min(n_objects, POOL_BYTES // size))
        self._mm = files.anonymous(self.n * size)
        self.view = memoryview(self._mm)
        files.fill(self.view, size, self.n)

    def obj(self, g: int) -> memoryview:
        i = g % self.n
        return self.view[i * self.size : (i + 1) * self.size]

    def header_ok(self, g: int, data: memoryview) -> bool:
        return bytes(data[:16]) == struct.pack("<QQ", g % self.n, self.size)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a slice still held somewhere: freed at exit
            self.view.release()
            self._mm.close()


class Workload:
    """A working set as prompts of `chunks` chunks each (chunk_tokens=1, so a prompt's
    tokens are its chunks and a fresh first token makes fresh keys). CALLERS callers take
    prompts in order from a shared counter, as a pool of engine workers would."""

    def __init__(self, pool: Pool, total: int, chunks: int) -> None:
        self.pool = pool
        self.chunks = chunks
        self.prompts = max(CALLERS, total // (chunks * pool.size))
        self.nbytes = self.prompts * chunks * pool.size

    def tokens(self, p: int) -> list[int]:
        return [p * self.chunks + j for j in range(self.chunks)]

    def keys(self) -> list[str]:
        """Every chunk's key, as the client will compute them."""
        return [k for p in range(self.prompts) for k in chunk_keys(self.tokens(p), NAMESPACE, 1)]

    async def store(self, client: AsyncPolarKVClient) -> int:
        """Chunks stored."""
        counter = itertools.count()

        async def caller() -> int:
            stored = 0
            while (p := next(counter)) < self.prompts:
                chunks = [self.pool.obj(p * self.chunks + j) for j in range(self.chunks)]
                stored += await client.store_kv(self.tokens(p), chunks)
            return stored

        return sum(await asyncio.gather(*(caller() for _ in range(CALLERS))))

    async def load(self, client: AsyncPolarKVClient, repeat: int = 1) -> tuple[int, int]:
        """(chunks that hit, hits whose first bytes were not the stored object's). The
        client itself checks every chunk's xxh3 (a mismatch is a miss); the header check
        here catches a chunk served under the wrong key."""
        counter = itertools.count()

        async def caller() -> tuple[int, int]:
            outs = [bytearray(self.pool.size) for _ in range(self.chunks)]
            for out in outs:  # touched once, before any timing
                out[::4096] = b"\xa5" * len(out[::4096])
            hits = wrong = 0
            while (q := next(counter)) < self.prompts * repeat:
                p = q % self.prompts
                n_tokens, views = await client.load_kv(self.tokens(p), outs)
                hits += n_tokens  # chunk_tokens=1: tokens are chunks
                first = p * self.chunks
                wrong += sum(
                    1 for j, v in enumerate(views) if not self.pool.header_ok(first + j, v)
                )
            return hits, wrong

        done = await asyncio.gather(*(caller() for _ in range(CALLERS)))
        return sum(h for h, _ in done), sum(w for _, w in done)


def _client(url: str) -> AsyncPolarKVClient:
    # transport "auto": shm, since the node is on this host, as a co-located engine's
    # would be; window 64 is the client's default control window.
    return AsyncPolarKVClient(
        url,
        namespace=NAMESPACE,
        chunk_tokens=1,
        transport="auto",
        timeout=CLIENT_TIMEOUT,
        connections=CALLERS,
    )


# -- part 1b: a node that offloads and reloads, against raw files -----------------------


@dataclass
class ServiceRound:
    raw_write: float = 0.0  # GB/s
    raw_read: float = 0.0
    offload: float = 0.0
    reload: float = 0.0
    offload_notes: list[str] = field(default_factory=list)
    reload_notes: list[str] = field(default_factory=list)


def _disk_settings(path: str, capacity: int, plan: Plan) -> dict[str, str]:
    return {
        "disk.paths": path,
        "disk.capacity": str(capacity),
        "disk.o_direct": "true" if plan.o_direct else "false",
        "disk.io_threads": str(plan.threads),
    }


class RawFiles:
    """The raw side of the service part: the working set's bytes as one file per object
    in a directory under `root`, written from and read into page-aligned memory,
    `threads` at a time."""

    def __init__(self, root: str, work: Workload, threads: int, o_direct: bool) -> None:
        self.root = root
        self.work = work
        self.threads = threads
        self.n = work.nbytes // work.pool.size
        self._direct = os.O_DIRECT if o_direct else 0
        # One read buffer per thread, made and touched now, not while timing.
        self._scratch = [files.anonymous(work.pool.size) for _ in range(threads)]

    def write(self, name: str) -> float:
        directory = os.path.join(self.root, name)

        def op(i: int) -> None:
            files.raw_write(os.path.join(directory, str(i)), self.work.pool.obj(i), self._direct)

        os.makedirs(directory, exist_ok=True)
        return gbps(self.n * self.work.pool.size, files.drain_threads(self.n, self.threads, op))

    def read(self, name: str) -> float:
        directory = os.path.join(self.root, name)
        free = [memoryview(mm) for mm in self._scratch]
        lock = threading.Lock()
        mine = threading.local()  # each reading thread takes one buffer on its first object

        def op(i: int) -> None:
            buf: memoryview | None = getattr(mine, "buf", None)
            if buf is None:
                with lock:
                    buf = mine.buf = free.pop()
            files.raw_read(os.path.join(directory, str(i)), buf, self._direct)

        return gbps(self.n * self.work.pool.size, files.drain_threads(self.n, self.threads, op))

    def close(self) -> None:
        for mm in self._scratch:
            with contextlib.suppress(BufferError):  # a view still held: freed at exit
                mm.close()
        files.remove_files(self.root)


async def _service_round(
    plan: Plan, url: str, pid: int, work: Workload, raw: RawFiles
) -> ServiceRound:
    out = ServiceRound()
    loop = asyncio.get_running_loop()
    chunks = work.prompts * work.chunks
    client = _client(url)

    writes: list[float] = []
    reads: list[float] = []

    async def raw_write() -> None:
        # Each bracket writes new files, into a directory of its own, as ours does.
        writes.append(await loop.run_in_executor(None, raw.write, str(len(writes))))

    async def raw_read() -> None:
        files.drop_caches(plan.o_direct, out.reload_notes)
        reads.append(await loop.run_in_executor(None, raw.read, str(len(reads))))

    async def ours_store() -> None:
        before = _histogram_sums(url)
        with CpuWatch(pid) as cpu, StatsPoller(url) as poll:
            t0 = time.perf_counter()
            stored = await work.store(client)
            client_s = time.perf_counter() - t0
            await _settle_offloads(url)
        nbytes, seconds = poll.window("offload_bytes")
        out.offload = gbps(nbytes, seconds)
        if stored < chunks:
            out.offload_notes.append(f"stored {stored}/{chunks}")
        out.offload_notes.append(
            f"{nbytes // MiB} MiB in {seconds:.2f}s, "
            f"{_in_flight(before, _histogram_sums(url), 'offload', seconds)}; "
            f"client store {gbps(work.nbytes, client_s):.2f} GB/s over the phase; {cpu.text()}"
        )

    async def ours_load() -> None:
        files.drop_caches(plan.o_direct, out.reload_notes)
        before = _histogram_sums(url)
        with CpuWatch(pid) as cpu, StatsPoller(url) as poll:
            t0 = time.perf_counter()
            hits, wrong = await work.load(client)
            client_s = time.perf_counter() - t0
        # Loading in store order, the first reloads need the memory that the last stores
        # still hold, so those are offloaded first: the disk then writes while it reads.
        # The row compares reads with reads: the window after the last offload.
        nbytes, seconds = poll.window("reload_bytes")
        pure_bytes, pure_seconds = poll.window("reload_bytes", after="offload_bytes")
        offloaded, _ = poll.window("offload_bytes")
        if pure_bytes >= nbytes // 4:
            out.reload = gbps(pure_bytes, pure_seconds)
            measured = f"{pure_bytes // MiB} MiB in {pure_seconds:.2f}s after the last offload"
        else:  # too little of it without offloads to time on its own
            out.reload = gbps(nbytes, seconds)
            measured = f"all {nbytes // MiB} MiB in {seconds:.2f}s (with offloads)"
        if hits < chunks:
            out.reload_notes.append(f"load hit {hits}/{chunks}")
        if wrong:
            out.reload_notes.append(f"{wrong} CHUNKS WRONG")
        out.reload_notes.append(
            f"{measured}; whole phase {nbytes // MiB} MiB in {seconds:.2f}s "
            f"({gbps(nbytes, seconds):.2f} GB/s) with {offloaded // MiB} MiB offloaded meanwhile, "
            f"{_in_flight(before, _histogram_sums(url), 'reload', seconds)}; "
            f"client load {gbps(work.nbytes, client_s):.2f} GB/s over the phase; {cpu.text()}"
        )

    try:
        # Each of our phases lasts seconds, and on a shared machine the disk's speed drifts
        # over seconds: the raw baseline is measured right before and right after ours
        # and averaged, so a drift in either direction moves both sides alike.
        for step in (raw_write, ours_store, raw_write, raw_read, ours_load, raw_read):
            await step()
    finally:
        await client.close()
    out.raw_write, out.raw_read = statistics.fmean(writes), statistics.fmean(reads)
    out.offload_notes.append(f"raw write before/after {writes[0]:.2f}/{writes[1]:.2f} GB/s")
    out.reload_notes.append(f"raw read before/after {reads[0]:.2f}/{reads[1]:.2f} GB/s")
    return out


def _in_flight(before: dict[str, float], after: dict[str, float], op: str, seconds: float) -> str:
    """Orders the disk role held on average over the window, by Little's law: the sum of
    the times from order receipt to result, over the window. Below io_threads, the role
    waited for orders: the control path, not the disk, set the pace."""
    total, count = f"polarkv_{op}_seconds_sum", f"polarkv_{op}_seconds_count"
    busy = after.get(total, 0.0) - before.get(total, 0.0)
    done = after.get(count, 0.0) - before.get(count, 0.0)
    if seconds <= 0 or done <= 0:
        return "no orders"
    return (
        f"{busy / seconds:.1f} orders in the disk role on average, {busy / done * 1000:.1f} ms each"
    )


async def _settle_offloads(url: str) -> None:
    """The stores have returned; offloads already ordered may still be running."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while _stats(url).get("bytes_offloading", 0) and time.monotonic() < deadline:
        await asyncio.sleep(SAMPLE_S)


def service_part(plan: Plan, workdir: str, rows: list[Row]) -> None:
    budget = BUDGET_S["service"] / len(plan.sizes)
    for size in plan.sizes:
        offload = Row("service", size, "offload", "raw write")
        reload = Row("service", size, "reload", "raw read")
        rows += (offload, reload)
        pool = Pool(size, plan.working_set // size)
        work = Workload(pool, plan.working_set, plan.chunks_per_prompt(size))
        raw = RawFiles(os.path.join(workdir, "raw"), work, plan.threads, plan.o_direct)
        # Room for one round's files and more: the disk LRU must never delete meanwhile.
        capacity = int(work.nbytes * (1 + HEADER_SIZE / size) / 0.9) + 64 * MiB
        started = time.monotonic()
        try:
            for r in range(SERVICE_ROUNDS):
                if r and (time.monotonic() - started) * (r + 1) / r > budget:
                    offload.notes.append(f"{r} rounds (time budget)")
                    break
                # A fresh node per round: every round starts from empty memory and disk.
                node_dir = os.path.join(workdir, f"node-{size}-{r}")
                disk_dir = os.path.join(node_dir, "disk")
                files.make_key_dirs(DiskStore((disk_dir,), capacity, plan.o_direct), work.keys())
                node = Service(
                    node_dir,
                    (),
                    {"slab.memory": str(plan.memory), **_disk_settings(disk_dir, capacity, plan)},
                )
                try:
                    with running(node) as (url,):
                        result = asyncio.run(_service_round(plan, url, node.pid, work, raw))
                        stats = _stats(url)
                finally:
                    files.remove_files(raw.root)
                    files.remove_files(node_dir)
                offload.ours.append(result.offload)
                offload.base.append(result.raw_write)
                reload.ours.append(result.reload)
                reload.base.append(result.raw_read)
                offload.notes += [f"round {r}: {note}" for note in result.offload_notes]
                reload.notes += [f"round {r}: {note}" for note in result.reload_notes]
                if stats["tier_failures"] or stats["evictions"] or stats["disk_evictions"]:
                    offload.notes.append(
                        f"round {r}: {stats['tier_failures']} tier failures, "
                        f"{stats['evictions']} evictions, "
                        f"{stats['disk_evictions']} disk evictions"
                    )
        finally:
            raw.close()
            pool.close()


# -- part 2: a working set that fits, with and without the disk role --------------------


def fit_part(plan: Plan, workdir: str, rows: list[Row]) -> None:
    budget = BUDGET_S["fit"] / len(plan.sizes)
    for size in plan.sizes:
        row = Row("fit", size, "load", "memory-only load")
        rows.append(row)
        chunks = plan.chunks_per_prompt(size)
        pool = Pool(size, plan.memory // 2 // size)
        work = Workload(pool, plan.memory // 2, chunks)  # under the low watermark: nothing to tier
        repeat = max(1, math.ceil(FIT_BYTES / work.nbytes))
        hybrid_dir = os.path.join(workdir, f"fit-hybrid-{size}")
        hybrid = Service(
            hybrid_dir,
            (),
            {
                "slab.memory": str(plan.memory),
                **_disk_settings(os.path.join(hybrid_dir, "disk"), 4 * plan.memory, plan),
            },
        )
        memory_only = Service(
            os.path.join(workdir, f"fit-memory-{size}"),
            ("manager", "slab"),
            {"slab.memory": str(plan.memory)},
        )
        try:
            with running(hybrid, memory_only) as (hybrid_url, memory_url):
                asyncio.run(_fit_rounds(work, repeat, hybrid_url, memory_url, row, budget))
                stats = _stats(hybrid_url)
                if stats["offloads"] or stats["reloads"] or stats["hits_disk"]:
                    row.notes.append(
                        f"hybrid tiered: {stats['offloads']} offloads, "
                        f"{stats['reloads']} reloads, {stats['hits_disk']} disk hits"
                    )
        finally:
            pool.close()
            files.remove_files(hybrid_dir)
            files.remove_files(os.path.join(workdir, f"fit-memory-{size}"))
        row.notes.append(
            f"{work.nbytes // MiB} MiB working set in {plan.memory // MiB} MiB, "
            f"loaded {repeat}x per measurement"
        )


async def _fit_rounds(
    work: Workload, repeat: int, hybrid_url: str, memory_url: str, row: Row, budget: float
) -> None:
    clients = {"hybrid": _client(hybrid_url), "memory": _client(memory_url)}
    try:
        for name, client in clients.items():
            stored = await work.store(client)
            if stored < work.prompts * work.chunks:
                raise BenchError(
                    f"fit part: {name} node stored {stored}/{work.prompts * work.chunks}"
                )
            await work.load(client)  # untimed: maps the slab in this client, warms both paths
        started = time.monotonic()
        for r in range(FIT_ROUNDS):
            if r and (time.monotonic() - started) * (r + 1) / r > budget:
                row.notes.append(f"{r} rounds (time budget)")
                break
            pair: dict[str, float] = {}
            for name in ("hybrid", "memory") if r % 2 else ("memory", "hybrid"):
                t0 = time.perf_counter()
                hits, wrong = await work.load(clients[name], repeat)
                seconds = time.perf_counter() - t0
                pair[name] = gbps(hits * work.pool.size, seconds)
                if hits < work.prompts * work.chunks * repeat:
                    row.notes.append(f"{name} hit {hits}/{work.prompts * work.chunks * repeat}")
                if wrong:
                    row.notes.append(f"{name}: {wrong} CHUNKS WRONG")
            row.ours.append(pair["hybrid"])
            row.base.append(pair["memory"])
    finally:
        for client in clients.values():
            await client.close()
