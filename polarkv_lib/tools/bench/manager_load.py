"""The load side of `polarkv bench manager` (the method is in bench/manager.py): a node
that only exists in the manager's accounting, the clients that send request pairs, the
fill, the measured phases beside the bare handler, the leased phase, and the restart."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from polarkv_lib.client.admin import AdminClient
from polarkv_lib.errors import PolarKVError
from polarkv_lib.progress import progress
from polarkv_lib.service import Service, running
from polarkv_lib.tools.bench import core
from polarkv_lib.tools.bench.manager_plan import (
    BATCH,
    CHECKSUM,
    FLUSH_WAIT_S,
    LEASED,
    NODE_ID,
    POLL_S,
    REQUEST_TIMEOUT,
    RESTORE_TIMEOUT,
    SERVICE_TIMEOUT,
    STABLE_S,
    Plan,
    Row,
    Table,
)
from polarkv_lib.tools.bench.measure import proc_rss

RENEW_BATCH = 4096  # lease ids per renew or release request (the manager's max_batch)
RENEW_EVERY_S = 1.0  # well within a read lease (5 s by default)


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
        self._confirm(url)
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="bench-heartbeat", daemon=True)
            self._thread.start()

    def _confirm(self, url: str) -> None:
        """A restarted manager asks which memory extents still hold their entries: this
        node moves no bytes, so it vouches for every one (as its buffer would)."""
        admin = AdminClient(url, timeout=REQUEST_TIMEOUT)
        held: list[dict[str, Any]] = []
        while True:
            reply = admin.call(
                "POST",
                "/v1/nodes/confirm",
                {"node_id": NODE_ID, "incarnation": self.incarnation, "held": held},
                admin=True,
            )
            if not reply["check"]:
                return
            held = [
                {"offset": c["offset"], "checksum": c["checksum"], "ok": True}
                for c in reply["check"]
            ]

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

        async def lookup(lat: list[float] | None) -> None:
            keys = [_key(rng.randrange(n)) for _ in range(BATCH)]
            if await _lookup_release(driver, url, keys, lat) < BATCH:
                hits_short[0] += 1

        async def allocate(lat: list[float] | None) -> None:
            first = next(fresh)
            keys = [_key(i) for i in range(first, first + BATCH)]
            done = await _allocate_commit(driver, url, keys, plan.size, lat)
            evicting["allocated"] += done
            evicting["short"] += BATCH - done

        async def rounds(op: str, pair: Callable[[list[float] | None], Awaitable[None]]) -> Row:
            await pair(None)  # records the body sizes the bare side mirrors
            row = Row(n, op)
            rows.append(row)
            sizes = driver.sizes[op.split(",")[0]]
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
            return row

        # Lookups first: they draw from all N keys, which the allocations then evict.
        looked = await rounds("lookup", lookup)
        if hits_short[0]:
            looked.notes.append(f"{hits_short[0]} lookups hit less than {BATCH}")
        # The same allocations with most of the node under read leases, kept renewed: the
        # cold end of its LRU (the first entries filled) is leased, so an eviction walk that
        # stepped over leased entries would cost all of them every time.
        held = [_key(i) for i in range(int(n * LEASED))]
        async with _leased(driver, url, held) as leases:
            leased = await rounds(f"allocate, {LEASED:.0%} leased", allocate)
        leased.notes.append(f"{len(leases)} read leases on {len(held):,} entries")
        short, evicting["short"] = evicting["short"], 0
        if short:
            leased.notes.append(f"{short} keys not allocated")
        unleased = await rounds("allocate", allocate)
        if evicting["short"]:
            unleased.notes.append(f"{evicting['short']} keys not allocated")
        if unleased.percentile(0.5) > 0:
            leased.notes.append(
                f"p50 {leased.percentile(0.5) / unleased.percentile(0.5):.2f}x the unleased one's"
            )
        # The restart's probe: committed last, so resident; then a write-behind round that
        # began after it is written, so the store has it before the manager is stopped.
        first = next(fresh)
        probe = [_key(i) for i in range(first, first + BATCH)]
        if await _allocate_commit(driver, url, probe, plan.size) != BATCH:
            raise core.BenchError("the restart probe could not be stored")
        admin = AdminClient(url, timeout=REQUEST_TIMEOUT)
        await asyncio.to_thread(admin.wait_flushed, FLUSH_WAIT_S)
        return probe[0]


@contextlib.asynccontextmanager
async def _leased(driver: Driver, url: str, keys: list[str]) -> Any:
    """Hold read leases on `keys` (one per 64) while the body runs, renewed meanwhile;
    released after. Yields the lease ids."""
    leases: list[str] = []
    batches = iter(range(0, len(keys), BATCH))

    async def take() -> None:
        for first in batches:
            body = _dumps({"keys": keys[first : first + BATCH], "lease": True})
            reply, _ = await _call(driver, url, "/v1/lookup", body)
            if reply["lease"]:
                leases.append(reply["lease"])

    async def each(path: str) -> None:
        for first in range(0, len(leases), RENEW_BATCH):
            await _call(driver, url, path, _dumps({"leases": leases[first : first + RENEW_BATCH]}))

    async def renew(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await each("/v1/renew")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RENEW_EVERY_S)

    with progress(len(keys), f"lease {len(keys)} entries", "entry", log_lines=False) as bar:
        await asyncio.gather(*(take() for _ in range(driver.conc)))
        bar.update(len(keys))
    stop = asyncio.Event()
    renewer = asyncio.create_task(renew(stop))
    try:
        yield leases
    finally:
        stop.set()
        await renewer
        await each("/v1/release")


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


def one_table(plan: Plan, n: int, workdir: str, bare_url: str, rows: list[Row]) -> Table:
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
