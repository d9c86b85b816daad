"""`polarkv bench datapath`: data-plane throughput beside what the machine allows.

The bench starts a real PolarKV service (manager + slab, one subprocess) on loopback and,
for every transport, object size and concurrency, times side by side in the same run:

  store   AsyncPolarKVClient.store_kv of `total` bytes, fresh keys every round
  load    AsyncPolarKVClient.load_kv of those bytes into caller buffers (`out=`) that
          were allocated and touched once, before any timing
  limit   the same bytes moved without PolarKV, with the same object size and the same
          number of concurrent transfers:
            tcp  a plain Python loopback socket: per object one 64-byte request, then
                 the object, each with sockio.send_all/recv_exact (N connections, one thread each; the
                 server is threads in this process)
            shm  memcpy (ctypes.memmove, which releases the GIL) in N threads

Every measurement moves the same bytes in the same pattern (a `total`-byte source
copied object by object into the same destination buffers), so the ratio is about
PolarKV's overhead, not about caches. Each round runs limit and ours back to back; the
GB/s columns report the best round and the ratio the median of the per-round ratios,
because the machine this runs on is usually shared and noisy (docs/BENCHMARKS.md).

Concurrency N means N client connections (the client's transfer pool) and N callers,
each storing/loading its share of the objects in calls of up to one control window of
chunks, so control round trips are amortised the way a long prompt amortises them.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import click

from polarkv_lib import service
from polarkv_lib.client.async_client import AsyncPolarKVClient
from polarkv_lib.progress import progress
from polarkv_lib.tools.bench import core
from polarkv_lib.tools.bench.core import MiB, Pairs, size_text
from polarkv_lib.tools.bench.limits import (
    WINDOW,
    Buffers,
    RawServer,
    batches,
    memcpy_limit,
    socket_limit,
)
from polarkv_lib.transport import rdma_unavailable

TRANSPORTS = ("tcp", "shm", "rdma")
ROUNDS = 5
BUDGET_S = 150.0  # the whole default bench stays well under three minutes
CLIENT_TIMEOUT = 10.0  # bounds every client call; a 64 MiB call needs far less
WARM_UP_S = 20.0  # per client; the default 1 GiB slab takes about a second
# Load ratio goal, from this size up. rdma's limit is memcpy: on one host, loopback
# RDMA through the HCA can at best approach it.
GOALS = {"tcp": (0.8, 4 * MiB), "shm": (0.5, 0), "rdma": (0.5, 4 * MiB)}


@dataclass(frozen=True)
class Plan:
    sizes: list[int]
    concurrency: list[int]
    transports: list[str]
    total: int
    memory: int


@dataclass
class Row(Pairs):
    """`base` is the limit: raw socket (tcp) or memcpy (shm)."""

    transport: str
    size: int
    concurrency: int
    op: str

    def goal(self) -> float | None:
        ratio, from_size = GOALS[self.transport]
        return ratio if self.op == "load" and self.size >= from_size else None


def parse_plan(sizes: str, concurrency: str, transports: str, total: str, memory: str) -> Plan:
    size_list = core.parse_sizes(sizes, "--sizes")
    total_bytes, memory_bytes = (
        core.parse_bytes(total, "--total"),
        core.parse_bytes(memory, "--memory"),
    )
    conc = core.parse_ints(concurrency, "--concurrency", 1, 64)
    names = core.parse_choices(transports, "--transports", TRANSPORTS)
    if "rdma" in names and (reason := rdma_unavailable()):
        raise core.BadArguments(f"--transports: rdma: {reason}")
    if any(s < 4096 for s in size_list):
        raise core.BadArguments("--sizes: objects of at least 4KiB")
    if total_bytes < max(size_list) * max(conc):
        raise core.BadArguments("--total: must hold at least one object per concurrent transfer")
    # One round's objects (rounded up to the allocator's size classes, at most 1/8 more)
    # must fit beside the previous round's, so nothing a load asks for is ever evicted.
    if total_bytes * 9 // 8 * 2 > memory_bytes:
        raise core.BadArguments("--memory: must be at least 2.25x --total (two rounds of objects)")
    return Plan(size_list, conc, names, total_bytes, memory_bytes)


# -- ours -------------------------------------------------------------------------------


class Ours:
    """Stores and loads through one AsyncPolarKVClient per (transport, concurrency)."""

    def __init__(self, manager_url: str, transport: str, conc: int) -> None:
        # chunk_tokens=1: a call's token list is its list of chunks, so keys are cheap
        # and any fresh first token makes a fresh chain of keys.
        self.client = AsyncPolarKVClient(
            manager_url,
            namespace=f"bench-datapath-{transport}",
            chunk_tokens=1,
            transport=transport,
            timeout=CLIENT_TIMEOUT,
            connections=conc,
            window=WINDOW,
        )
        self.conc = conc

    @staticmethod
    def _tokens(tag: int, start: int, count: int) -> list[int]:
        """Tokens for objects [start, start+count) of round `tag`, unique per round (and
        below 2**32, the compact key encoding, for the first 255 rounds)."""
        return [(tag << 24) + start + j for j in range(count)]

    async def store(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int]:
        """Seconds taken and objects stored."""

        async def caller(calls: list[tuple[int, int]]) -> int:
            stored = 0
            for start, count in calls:
                stored += await self.client.store_kv(
                    self._tokens(tag, start, count), bufs.objects(bufs.src_view, start, count)
                )
            return stored

        calls = batches(bufs.size, n, self.conc)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(caller(c) for c in calls))
        return time.perf_counter() - t0, sum(done)

    async def load(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int, bool]:
        """Seconds taken, objects that hit, and whether every hit is byte-exact."""

        async def caller(calls: list[tuple[int, int]]) -> list[tuple[int, int]]:
            hits = []
            for start, count in calls:
                n_tokens, _ = await self.client.load_kv(
                    self._tokens(tag, start, count), bufs.objects(bufs.dst_view, start, count)
                )
                hits.append((start, n_tokens))  # chunk_tokens=1: tokens == chunks
            return hits

        calls = batches(bufs.size, n, self.conc)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(caller(c) for c in calls))
        elapsed = time.perf_counter() - t0
        hits = [h for per_caller in done for h in per_caller]
        exact = all(bufs.same(start, count) for start, count in hits if count)
        return elapsed, sum(count for _, count in hits), exact

    async def close(self) -> None:
        await self.client.close()


# -- the run ----------------------------------------------------------------------------


def _limit(
    server: RawServer | None, transport: str, bufs: Buffers, n: int, conc: int, store: bool
) -> float:
    if transport == "tcp":
        assert server is not None
        return socket_limit(server, bufs, n, conc, store)
    return memcpy_limit(bufs, n, conc, store)


async def _measure_row(
    ours: Ours,
    server: RawServer | None,
    bufs: Buffers,
    store: Row,
    load: Row,
    budget: float,
    tags: Iterator[int],
) -> None:
    """Up to ROUNDS rounds of: limit (write direction), store, limit (read), load."""
    loop = asyncio.get_running_loop()
    n, size = bufs.n // store.concurrency * store.concurrency, bufs.size
    started = time.monotonic()
    for done in range(ROUNDS):
        if done and (time.monotonic() - started) * (done + 1) / done > budget:
            store.notes.append(f"{done} rounds (time budget)")
            break
        tag = next(tags)
        store.base.append(
            await loop.run_in_executor(
                None, _limit, server, store.transport, bufs, n, store.concurrency, True
            )
        )
        seconds, stored = await ours.store(bufs, n, tag)
        store.ours.append(stored * size / seconds / 1e9)
        if stored < n:
            store.notes.append(f"stored {stored}/{n}")
        load.base.append(
            await loop.run_in_executor(
                None, _limit, server, load.transport, bufs, n, load.concurrency, False
            )
        )
        seconds, hits, exact = await ours.load(bufs, n, tag)
        load.ours.append(hits * size / seconds / 1e9)
        if hits < n:
            load.notes.append(f"hit {hits}/{n}")
        if not exact:
            load.notes.append("BYTES DIFFER")


async def warm_up(
    client: Ours,
    bufs: Buffers,
    transport: str,
    conc: int,
    memory: int,
    tags: Iterator[int],
    notes: list[str],
) -> None:
    """Untimed: connect, and for shm touch the whole slab once through this client.

    A long-lived engine maps a slab once; the page-table entries of its mapping then stay.
    A fresh mapping pays for them on first touch (several times the copy itself), which
    would land on whichever rows come first. So each shm client first stores enough to
    cycle through all of slab memory, and the first-touch speed is reported on its own."""
    n = bufs.n // conc * conc
    rounds = -(-memory * 5 // 4 // (n * bufs.size)) if transport == "shm" else 1
    deadline = time.monotonic() + WARM_UP_S
    for r in range(rounds):
        if time.monotonic() > deadline:
            notes.append(
                f"shm warm-up (conc {conc}) cut short after {WARM_UP_S:.0f}s: "
                f"rows may include first-touch cost"
            )
            break
        seconds, stored = await client.store(bufs, n, next(tags))
        if r == 0 and transport == "shm":
            notes.append(
                f"shm first touch (conc {conc}, {size_text(bufs.size)}): store "
                f"{stored * bufs.size / seconds / 1e9:.2f} GB/s into never-mapped pages"
            )


async def _measure(plan: Plan, manager_url: str, notes: list[str]) -> list[Row]:
    rows: list[Row] = []
    ours = {(t, c): Ours(manager_url, t, c) for t in plan.transports for c in plan.concurrency}
    server = RawServer() if "tcp" in plan.transports else None
    budget = BUDGET_S / (len(plan.sizes) * len(plan.concurrency) * len(plan.transports))
    tags = itertools.count(1)
    n_rows = len(plan.sizes) * len(plan.transports) * len(plan.concurrency)
    try:
        with progress(n_rows, "bench datapath", "row") as bar:
            for k, size in enumerate(plan.sizes):
                # Allocated per size, not per row, so one size's buffers are alive at a time.
                bufs = Buffers(size, plan.total // size)
                if k == 0:
                    for (transport, conc), client in ours.items():
                        await warm_up(client, bufs, transport, conc, plan.memory, tags, notes)
                for transport in plan.transports:
                    for conc in plan.concurrency:
                        store = Row(transport, size, conc, "store")
                        load = Row(transport, size, conc, "load")
                        rows += (store, load)
                        await _measure_row(
                            ours[transport, conc], server, bufs, store, load, budget, tags
                        )
                        bar.update(1)
    finally:
        if server is not None:
            server.close()
        for client in ours.values():
            await client.close()
    return rows


def render(rows: list[Row]) -> str:
    header = (
        "transport",
        "size",
        "conc",
        "op",
        "ours GB/s",
        "limit GB/s",
        "ratio",
        "goal",
        "notes",
    )
    lines = [header]
    for r in rows:
        ours, limit = r.best()
        lines.append(
            (
                r.transport,
                size_text(r.size),
                str(r.concurrency),
                r.op,
                f"{ours:.2f}",
                f"{limit:.2f}",
                f"{r.ratio():.2f}",
                core.goal_text(r.ratio(), r.goal()),
                r.note_text(),
            )
        )
    return core.markdown_table(lines)


def run(plan: Plan, json_path: str = "") -> bool:
    """Run the bench and print its table; False if a loaded byte differed."""
    print(
        f"polarkv bench datapath: {core.machine_text()}; {plan.total // MiB}MiB per measurement, "
        f"up to {ROUNDS} rounds of limit and ours back to back; GB/s columns: best round; "
        f"GB/s = 1e9 bytes/s",
        flush=True,
    )
    started = time.monotonic()
    notes: list[str] = []
    # Manager and slab only: with the disk role, rounds past the memory watermark would be
    # offloaded to disk during the measurements (disk writes in the slab process, and
    # stores waiting for room). Without it the slab evicts its least recently used entries.
    with (
        tempfile.TemporaryDirectory(prefix="polarkv-bench-") as workdir,
        service.running_service(
            workdir,
            ("manager", "slab"),
            {
                "slab.memory": str(plan.memory),
                **({"slab.transports": "tcp,shm,rdma"} if "rdma" in plan.transports else {}),
            },
        ) as info,
    ):
        rows = asyncio.run(_measure(plan, str(info["manager_url"]), notes))
    order = {t: i for i, t in enumerate(plan.transports)}
    rows.sort(key=lambda r: (order[r.transport], r.size, r.concurrency, r.op != "store"))
    print(render(rows))
    for note in notes:
        print(note)
    print(
        f"({time.monotonic() - started:.0f}s; ratio: median over rounds of ours / limit, "
        f"each pair measured side by side in this run)"
    )
    if json_path:
        core.write_json(
            json_path,
            "datapath",
            {
                "sizes": plan.sizes,
                "concurrency": plan.concurrency,
                "transports": plan.transports,
                "total": plan.total,
                "memory": plan.memory,
            },
            rows,
            {"notes": notes},
        )
    return not any("BYTES DIFFER" in r.notes for r in rows)


@click.command("datapath")
@click.option(
    "--sizes", default="1MiB,4MiB,16MiB", show_default=True, help="Object sizes, comma separated."
)
@click.option(
    "--concurrency", default="1,4", show_default=True, help="Concurrent transfers, comma separated."
)
@click.option("--transports", default="tcp,shm", show_default=True, help="Transports to measure.")
@click.option("--total", default="256MiB", show_default=True, help="Bytes moved per measurement.")
@click.option(
    "--memory",
    default="1GiB",
    show_default=True,
    help="Slab memory of the service the bench starts.",
)
@click.option(
    "--json", "json_path", default="", help="Also write the results as JSON to this file."
)
def command(
    sizes: str, concurrency: str, transports: str, total: str, memory: str, json_path: str
) -> None:
    """Store/load throughput over tcp and shm beside raw socket and memcpy limits."""
    core.guarded(
        "datapath",
        lambda: run(parse_plan(sizes, concurrency, transports, total, memory), json_path),
    )
