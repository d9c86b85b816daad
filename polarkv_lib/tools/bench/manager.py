"""`polarkv bench manager`: the manager's request rate at 10k, 200k and 1M entries, beside
the HTTP stack's own limit measured in the same run, and its restart at that size.

For each table size N, a fresh manager process (`polarkv --role manager`, SQLite
metadata in a temporary directory) gets one node that the bench registers and
heartbeats itself: only the control plane is measured, so no bytes move and the node's
memory exists only in the manager's accounting. Its capacity is N x --size exactly, and
the bench fills it with N committed entries (64-key allocate + commit), so the node is
full: every later allocation must evict.

  lookup    a 64-key lookup (lease) of random resident keys, then the release of its lease
  allocate  a 64-key allocate of fresh keys on the full node (evicting 64 entries), then
            the commit of what it allocated
  bare      the same two requests, with request and reply bodies of the same sizes,
            against a bare aiohttp handler in its own process (bare_http.py): the
            ceiling the HTTP stack and this client put on any manager

--concurrency clients in this process each send pair after pair for --seconds; rounds
alternate which side goes first. Rates are pairs per second (best round); the ratio is
the median of per-round manager / bare. Latency percentiles are of the pair's first
request. Memory per entry is the growth of the manager's RSS from the empty node to the
full one, divided by N. Restart: the manager is stopped (SIGTERM: it flushes its
metadata), started again on the same store, and the node registers again; the bench
times, from the new process's start, its ready file, the first lookup that hits, and
the moment every entry is back (`/healthz` keys_memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import click
import orjson

from polarkv_lib.client.admin import AdminClient
from polarkv_lib.errors import PolarKVError
from polarkv_lib.tools.bench import core
from polarkv_lib.tools.bench.core import MiB, Pairs
from polarkv_lib.tools.bench.measure import proc_rss
from polarkv_lib.tools.progress import progress
from polarkv_lib.tools.service import Service, running

BATCH = 64
NODE_ID = "bench-node"
CHECKSUM = "0" * 16  # never verified here: no bytes move
REQUEST_TIMEOUT = 60.0
SERVICE_TIMEOUT = 600.0  # start and stop of a manager with a million entries
RESTORE_TIMEOUT = 600.0
POLL_S = 0.02
FLUSH_WAIT_S = 1.0  # > manager.metadata_flush (200 ms by default)
STABLE_S = 5.0  # a restore that has not grown for this long is over, complete or not


@dataclass(frozen=True)
class Plan:
    entries: list[int]
    size: int
    seconds: float
    rounds: int
    concurrency: int
    restart: bool


@dataclass
class Row(Pairs):
    """Pairs per second; `base` is the bare aiohttp handler's."""

    entries: int
    op: str
    latency_ms: list[float] = field(
        default_factory=list
    )  # the manager's first requests, all rounds

    def percentile(self, q: float) -> float:
        lat = sorted(self.latency_ms)
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        del out["latency_ms"]  # thousands of values: the percentiles stand for them
        out["p50_ms"], out["p99_ms"] = self.percentile(0.5), self.percentile(0.99)
        return out


@dataclass
class Table:
    """What one table size showed besides the rates."""

    entries: int
    fill_s: float = 0.0
    bytes_per_entry: float = 0.0
    ready_s: float = 0.0
    first_hit_s: float = 0.0
    restored_s: float = 0.0
    restored: int = 0
    notes: list[str] = field(default_factory=list)


def parse_plan(
    entries: str, size: str, seconds: str, rounds: str, concurrency: str, restart: bool
) -> Plan:
    counts = core.parse_ints(
        entries.replace("k", "000").replace("M", "000000"), "--entries", BATCH, 10**8
    )
    try:
        secs = float(seconds)
    except ValueError:
        raise core.BadArguments(f"--seconds: not a number: {seconds!r}") from None
    if not 0.1 <= secs <= 60:
        raise core.BadArguments("--seconds: between 0.1 and 60")
    size_b = core.parse_bytes(size, "--size")
    if not 4096 <= size_b <= 256 * MiB:
        raise core.BadArguments("--size: from 4KiB to 256MiB")
    return Plan(
        counts,
        size_b,
        secs,
        core.parse_ints(rounds, "--rounds", 1, 20)[0],
        core.parse_ints(concurrency, "--concurrency", 1, 64)[0],
        restart,
    )


def _key(i: int) -> str:
    return f"{i:032x}"


class FakeNode:
    """The node's control side: register, then heartbeat every second from a thread,
    registering again whenever the manager does not know it (after a restart)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.incarnation = secrets.randbits(62)
        self.url = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, url: str) -> None:
        self.url = url
        AdminClient(url, timeout=REQUEST_TIMEOUT).call(
            "POST",
            "/v1/nodes/register",
            {
                "node_id": NODE_ID,
                "incarnation": self.incarnation,
                "address": "127.0.0.1:9",
                "capacity": self.capacity,
                "transports": ["tcp"],
            },
            admin=True,
        )
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="bench-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            status, _ = (0, None)
            with contextlib.suppress(PolarKVError):
                status, _ = AdminClient(self.url, timeout=2.0).request(
                    "POST",
                    "/v1/nodes/heartbeat",
                    {"node_id": NODE_ID, "incarnation": self.incarnation},
                )
            if status == 404:
                with contextlib.suppress(PolarKVError):
                    self.register(self.url)

    def stop(self) -> None:
        self._stop.set()


class Driver:
    """conc aiohttp clients sending request pairs; records body sizes for the bare side."""

    def __init__(self, session: aiohttp.ClientSession, conc: int) -> None:
        self.session = session
        self.conc = conc
        self.sizes: dict[str, list[int]] = {}  # op -> [request 1, reply 1, request 2, reply 2]

    async def post(self, url: str, body: bytes) -> tuple[int, bytes]:
        async with self.session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            return resp.status, await resp.read()


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _loads(raw: bytes) -> Any:
    return orjson.loads(raw)


async def _fill(driver: Driver, url: str, n: int, size: int, table: Table) -> None:
    counter = iter(range(0, n, BATCH))
    started = time.perf_counter()
    with progress(n, f"fill {n} entries", "entry") as bar:

        async def worker() -> None:
            for first in counter:
                keys = [_key(i) for i in range(first, min(n, first + BATCH))]
                done = await _allocate_commit(driver, url, keys, size)
                if done < len(keys):
                    table.notes.append(f"fill: {len(keys) - done} of a batch not stored")
                bar.update(len(keys))

        await asyncio.gather(*(worker() for _ in range(driver.conc)))
    table.fill_s = time.perf_counter() - started


async def _call(
    driver: Driver, url: str, path: str, body: bytes, latencies: list[float] | None = None
) -> tuple[Any, int]:
    """POST one control request; its parsed reply and the reply's size."""
    t0 = time.perf_counter()
    status, raw = await driver.post(url + path, body)
    if latencies is not None:
        latencies.append((time.perf_counter() - t0) * 1000)
    if status != 200:
        raise core.BenchError(f"{path}: HTTP {status} {raw[:200]!r}")
    return _loads(raw), len(raw)


async def _allocate_commit(
    driver: Driver, url: str, keys: list[str], size: int, latencies: list[float] | None = None
) -> int:
    body = _dumps({"items": [{"key": k, "size": size} for k in keys]})
    reply, reply_size = await _call(driver, url, "/v1/allocate", body, latencies)
    done = [r["key"] for r in reply["results"] if r["status"] == "allocated"]
    if not done:
        return 0
    commit = _dumps(
        {"lease": reply["lease"], "items": [{"key": k, "checksum": CHECKSUM} for k in done]}
    )
    committed, commit_size = await _call(driver, url, "/v1/commit", commit)
    driver.sizes.setdefault("allocate", [len(body), reply_size, len(commit), commit_size])
    return sum(1 for v in committed["results"].values() if v == "committed")


async def _lookup_release(
    driver: Driver, url: str, keys: list[str], latencies: list[float] | None = None
) -> int:
    body = _dumps({"keys": keys, "lease": True})
    reply, reply_size = await _call(driver, url, "/v1/lookup", body, latencies)
    release = _dumps({"leases": [reply["lease"]] if reply["lease"] else []})
    _, release_size = await _call(driver, url, "/v1/release", release)
    driver.sizes.setdefault("lookup", [len(body), reply_size, len(release), release_size])
    return int(reply["hits"])


async def _phase(driver: Driver, seconds: float, pair: Callable[[], Awaitable[object]]) -> int:
    """conc clients run `pair()` until the time is up; the number of pairs done."""
    deadline = time.monotonic() + seconds
    counts = [0] * driver.conc

    async def worker(c: int) -> None:
        while time.monotonic() < deadline:
            await pair()
            counts[c] += 1

    await asyncio.gather(*(worker(c) for c in range(driver.conc)))
    return sum(counts)


async def _bare_pair(driver: Driver, bare_url: str, sizes: list[int]) -> None:
    """Requests of the manager's sizes (JSON padding), replies of its reply sizes."""
    for name, request, reply in (("first", sizes[0], sizes[1]), ("second", sizes[2], sizes[3])):
        body = b'{"x":"' + b"a" * max(0, request - 8) + b'"}'
        status, _ = await driver.post(f"{bare_url}/{name}?reply={reply}", body)
        if status != 200:
            raise core.BenchError(f"bare handler: HTTP {status}")


async def _measure_table(
    plan: Plan, n: int, url: str, bare_url: str, pid: int, rows: list[Row], table: Table
) -> str:
    """Fill, then lookup and allocate rounds beside the bare handler. Returns a key that
    is surely resident at the end (the last one committed)."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=plan.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        driver = Driver(session, plan.concurrency)
        rss_empty = proc_rss(pid)
        await _fill(driver, url, n, plan.size, table)
        table.bytes_per_entry = (proc_rss(pid) - rss_empty) / n
        rng = random.Random(n)
        hits_short = [0]
        fresh = iter(range(n, 10**12, BATCH))
        evicting = {"allocated": 0, "short": 0}

        async def lookup(lat: list[float] | None = None) -> None:
            keys = [_key(rng.randrange(n)) for _ in range(BATCH)]
            if await _lookup_release(driver, url, keys, lat) < BATCH:
                hits_short[0] += 1

        async def allocate(lat: list[float] | None = None) -> None:
            first = next(fresh)
            keys = [_key(i) for i in range(first, first + BATCH)]
            done = await _allocate_commit(driver, url, keys, plan.size, lat)
            evicting["allocated"] += done
            evicting["short"] += BATCH - done

        # Lookups first: they draw from all N keys, which the allocations then evict.
        for op, pair in (("lookup", lookup), ("allocate", allocate)):
            await pair()  # records the body sizes the bare side mirrors
            row = Row(n, op)
            rows.append(row)
            sizes = driver.sizes[op]
            for r in range(plan.rounds):
                rates: dict[str, float] = {}
                for side in ("bare", "manager") if r % 2 == 0 else ("manager", "bare"):
                    if side == "bare":
                        done = await _phase(
                            driver,
                            plan.seconds,
                            functools.partial(_bare_pair, driver, bare_url, sizes),
                        )
                    else:
                        done = await _phase(
                            driver, plan.seconds, functools.partial(pair, row.latency_ms)
                        )
                    rates[side] = done / plan.seconds
                row.add(rates["manager"], rates["bare"])
            row.notes.append(f"bodies {sizes[0]}/{sizes[1]} B then {sizes[2]}/{sizes[3]} B")
        if hits_short[0]:
            rows[-2].notes.append(f"{hits_short[0]} lookups hit less than {BATCH}")
        if evicting["short"]:
            rows[-1].notes.append(f"{evicting['short']} keys not allocated")
        # The restart's probe: committed last, so resident; then one write-behind interval
        # and more, so the store has it before the manager is stopped.
        first = next(fresh)
        probe = [_key(i) for i in range(first, first + BATCH)]
        if await _allocate_commit(driver, url, probe, plan.size) != BATCH:
            raise core.BenchError("the restart probe could not be stored")
        await asyncio.sleep(FLUSH_WAIT_S)
        return probe[0]


async def _restart(
    plan: Plan, service: Service, node: FakeNode, probe: str, expected: int, table: Table
) -> None:
    """Time the restarted manager: ready, first hit on `probe`, all `expected` entries back."""
    t0 = service.started
    url = await asyncio.to_thread(service.wait_ready)
    table.ready_s = time.monotonic() - t0
    await asyncio.to_thread(node.register, url)
    admin = AdminClient(url, timeout=REQUEST_TIMEOUT)
    deadline = time.monotonic() + RESTORE_TIMEOUT
    body = {"keys": [probe], "lease": False}
    last_change, last_count = time.monotonic(), -1
    while not (table.first_hit_s and table.restored_s):
        now = time.monotonic()
        if now > deadline or (table.restored and now - last_change > STABLE_S):
            what = (
                "stopped growing" if now <= deadline else f"not done after {RESTORE_TIMEOUT:.0f}s"
            )
            table.notes.append(
                f"restart: restore {what} at {table.restored} of {expected} entries"
                + ("" if table.first_hit_s else "; the probe never hit")
            )
            return
        if (
            not table.first_hit_s
            and (await asyncio.to_thread(admin.call, "POST", "/v1/lookup", body))["hits"]
        ):
            table.first_hit_s = time.monotonic() - t0
        if not table.restored_s:
            table.restored = int((await asyncio.to_thread(admin.healthz)).get("keys_memory", 0))
            if table.restored != last_count:
                last_change, last_count = time.monotonic(), table.restored
            if table.restored >= expected:
                table.restored_s = time.monotonic() - t0
        await asyncio.sleep(POLL_S)


def _one_table(plan: Plan, n: int, workdir: str, bare_url: str, rows: list[Row]) -> Table:
    table = Table(n)
    settings = {"manager.metadata_url": f"sqlite:///{workdir}/meta.db"}
    node = FakeNode(n * plan.size)
    try:
        first = Service(
            workdir,
            ("manager",),
            settings,
            stop_timeout=SERVICE_TIMEOUT,
            start_timeout=SERVICE_TIMEOUT,
        )
        with running(first) as (url,):
            node.register(url)
            probe = asyncio.run(_measure_table(plan, n, url, bare_url, first.pid, rows, table))
            expected = int(AdminClient(url).stats()["keys_memory"])
        if plan.restart:
            again = Service(
                workdir,
                ("manager",),
                settings,
                stop_timeout=SERVICE_TIMEOUT,
                start_timeout=SERVICE_TIMEOUT,
            )
            try:
                again.start()
                asyncio.run(_restart(plan, again, node, probe, expected, table))
            finally:
                again.stop()
    finally:
        node.stop()
    return table


def render(rows: list[Row], tables: list[Table]) -> str:
    lines = [
        (
            "entries",
            "op (64 keys)",
            "manager pairs/s",
            "bare pairs/s",
            "ratio",
            "p50 ms",
            "p99 ms",
            "notes",
        )
    ]
    for r in rows:
        ours, bare = r.best()
        lines.append(
            (
                f"{r.entries:,}",
                r.op,
                f"{ours:,.0f}",
                f"{bare:,.0f}",
                f"{r.ratio():.2f}",
                f"{r.percentile(0.5):.1f}",
                f"{r.percentile(0.99):.1f}",
                r.note_text(),
            )
        )
    second = [
        (
            "entries",
            "fill s",
            "RSS bytes/entry",
            "restart: ready s",
            "first hit s",
            "all back s",
            "notes",
        )
    ]
    for t in tables:
        second.append(
            (
                f"{t.entries:,}",
                f"{t.fill_s:.1f}",
                f"{t.bytes_per_entry:,.0f}",
                f"{t.ready_s:.2f}",
                f"{t.first_hit_s:.2f}",
                f"{t.restored_s:.2f}",
                "; ".join(dict.fromkeys(t.notes)),
            )
        )
    return core.markdown_table(lines) + "\n\n" + core.markdown_table(second)


def run(plan: Plan, json_path: str) -> bool:
    print(
        f"polarkv bench manager: {core.machine_text()}; entries {plan.entries}, {plan.size} B each, "
        f"{plan.concurrency} clients, {plan.rounds} rounds of {plan.seconds:g}s per side; "
        f"rates: best round; ratio: median over rounds of manager / bare",
        flush=True,
    )
    started = time.monotonic()
    rows: list[Row] = []
    tables: list[Table] = []
    with tempfile.TemporaryDirectory(prefix="polarkv-bench-manager-") as workdir:
        bare = _BareServer(workdir)
        try:
            for n in plan.entries:
                tables.append(_one_table(plan, n, os.path.join(workdir, str(n)), bare.url, rows))
                t = tables[-1]
                print(
                    f"{n:,} entries: "
                    + ", ".join(
                        f"{r.op} {r.best()[0]:,.0f}/s (ratio {r.ratio():.2f})"
                        for r in rows
                        if r.entries == n
                    )
                    + f"; fill {t.fill_s:.1f}s; restart: first hit {t.first_hit_s:.2f}s, "
                    f"all back {t.restored_s:.2f}s",
                    flush=True,
                )
        finally:
            bare.stop()
    print(render(rows, tables))
    print(f"({time.monotonic() - started:.0f}s)")
    if json_path:
        core.write_json(
            json_path,
            "manager",
            {
                "entries": plan.entries,
                "size": plan.size,
                "seconds": plan.seconds,
                "rounds": plan.rounds,
                "concurrency": plan.concurrency,
                "restart": plan.restart,
            },
            rows,
            {
                "tables": [t.__dict__ for t in tables],
                "latency_ms": {
                    f"{r.entries} {r.op}": {
                        "p50": r.percentile(0.5),
                        "p99": r.percentile(0.99),
                        "mean": statistics.fmean(r.latency_ms or [0.0]),
                    }
                    for r in rows
                },
            },
        )
    return not any(t.notes for t in tables)


class _BareServer:
    def __init__(self, workdir: str) -> None:
        ready = os.path.join(workdir, "bare.url")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "polarkv_lib.tools.bench.bare_http", ready],
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise core.BenchError("the bare aiohttp server did not start")
            time.sleep(0.05)
        with open(ready) as fh:
            self.url = fh.read().strip()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)


@click.command("manager")
@click.option(
    "--entries", default="10k,200k,1M", show_default=True, help="Table sizes, comma separated."
)
@click.option("--size", default="64KiB", show_default=True, help="Bytes each entry accounts for.")
@click.option("--seconds", default="2", show_default=True, help="Seconds per side per round.")
@click.option("--rounds", default="3", show_default=True, help="Rounds per operation.")
@click.option("--concurrency", default="4", show_default=True, help="Concurrent clients.")
@click.option(
    "--restart/--no-restart", default=True, show_default=True, help="Also time a restart."
)
@click.option(
    "--json", "json_path", default="", help="Also write the results as JSON to this file."
)
def command(
    entries: str,
    size: str,
    seconds: str,
    rounds: str,
    concurrency: str,
    restart: bool,
    json_path: str,
) -> None:
    """Manager lookups/s and allocations/s at growing table sizes beside a bare aiohttp
    handler; restart and memory per entry."""
    core.guarded(
        "manager",
        lambda: run(parse_plan(entries, size, seconds, rounds, concurrency, restart), json_path),
    )
