"""`polarkv bench datapath`: data-plane throughput beside what the machine allows.

The bench starts a real PolarKV service (manager + slab, one subprocess) on loopback and,
for every transport, object size and concurrency, times side by side in the same run:

  store   AsyncPolarKVClient.store_kv of `total` bytes, fresh keys every round
  load    AsyncPolarKVClient.load_kv of those bytes into caller buffers (`out=`) that
          were allocated and touched once, before any timing
  limit   the same bytes moved without PolarKV, with the same object size and the same
          number of concurrent transfers:
            tcp  a plain Python loopback socket: per object one 64-byte request, then
                 sendall/recv_into of the object (N connections, one thread each; the
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
import contextlib
import ctypes
import itertools
import os
import platform
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import xxhash

from polarkv_lib import logs
from polarkv_lib.client.async_client import AsyncPolarKVClient
from polarkv_lib.config import parse_size
from polarkv_lib.tools import service
from polarkv_lib.tools.timing import BenchError, markdown_table, run_threads

MiB = 1024**2
TRANSPORTS = ("tcp", "shm")
ROUNDS = 5
BUDGET_S = 150.0  # the whole default bench stays well under three minutes
CALL_BYTES = 64 * MiB  # most bytes one store_kv/load_kv call carries
WINDOW = 64  # chunks per call at most: the client's control window
CLIENT_TIMEOUT = 10.0  # bounds every client call; a 64 MiB call needs far less
WARM_UP_S = 20.0  # per client; the default 1 GiB slab takes about a second
LIMIT_TIMEOUT = 60.0  # a stuck raw transfer is cut off after this
GOALS = {"tcp": (0.8, 4 * MiB), "shm": (0.5, 0)}  # load ratio goal, from this size up


@dataclass(frozen=True)
class Plan:
    sizes: list[int]
    concurrency: list[int]
    transports: list[str]
    total: int
    memory: int


@dataclass
class Row:
    transport: str
    size: int
    concurrency: int
    op: str
    ours: list[float] = field(default_factory=list)  # GB/s per round
    limit: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def ratio(self) -> float:
        """The median over rounds of ours / limit, each pair measured back to back: on a
        shared machine a neighbour's load comes and goes, and a pair mostly sees the same
        load where the two best values may come from different moments."""
        pairs = [o / lim for o, lim in zip(self.ours, self.limit, strict=True) if lim > 0]
        return statistics.median(pairs) if pairs else 0.0

    def goal(self) -> float | None:
        ratio, from_size = GOALS[self.transport]
        return ratio if self.op == "load" and self.size >= from_size else None


def _parse_list(text: str, what: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise BenchError(f"{what}: give at least one value")
    return items


def parse_plan(sizes: str, concurrency: str, transports: str, total: str, memory: str) -> Plan:
    try:
        size_list = [parse_size(s) for s in _parse_list(sizes, "--sizes")]
        total_bytes, memory_bytes = parse_size(total), parse_size(memory)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    try:
        conc = [int(c) for c in _parse_list(concurrency, "--concurrency")]
    except ValueError:
        raise BenchError(f"--concurrency: not a list of integers: {concurrency!r}") from None
    names = _parse_list(transports, "--transports")
    if any(n not in TRANSPORTS for n in names):
        raise BenchError(f"--transports: choose from {', '.join(TRANSPORTS)}, got {transports!r}")
    if any(s < 4096 for s in size_list):
        raise BenchError("--sizes: objects of at least 4KiB")
    if any(c < 1 or c > 64 for c in conc):
        raise BenchError("--concurrency: between 1 and 64")
    if total_bytes < max(size_list) * max(conc):
        raise BenchError("--total: must hold at least one object per concurrent transfer")
    # One round's objects (rounded up to the allocator's size classes, at most 1/8 more)
    # must fit beside the previous round's, so nothing a load asks for is ever evicted.
    if total_bytes * 9 // 8 * 2 > memory_bytes:
        raise BenchError("--memory: must be at least 2.25x --total (two rounds of objects)")
    return Plan(size_list, conc, names, total_bytes, memory_bytes)


# -- the service ------------------------------------------------------------------------


@contextlib.contextmanager
def running_service(memory: int, workdir: str) -> Iterator[str]:
    """Start `polarkv` (manager + slab) and yield its manager URL; always stop it.

    Manager and slab only: with the disk role, rounds past the memory watermark would be
    offloaded to disk during the measurements (disk writes in the slab process, and
    stores waiting for room). Without it the slab evicts its least recently used entries."""
    with service.running_service(workdir, ("manager", "slab"), {"slab.memory": str(memory)}) as info:
        yield str(info["manager_url"])


# -- buffers ----------------------------------------------------------------------------


class Buffers:
    """The bytes of one object size: a source of `n` objects (what stores write and the
    limits read), the caller's load buffers, and a sink the raw server writes into. All
    allocated and touched once, before any timing."""

    def __init__(self, size: int, n: int) -> None:
        self.size, self.n = size, n
        nbytes = size * n
        block = os.urandom(64 * 1024)
        self.src = bytearray(nbytes)
        for off in range(0, nbytes, len(block)):
            self.src[off: off + len(block)] = block[: nbytes - off]
        for i in range(n):  # every object distinct, so a misplaced one is caught
            struct.pack_into("<QQ", self.src, i * size, i, size)
        self.dst = bytearray(nbytes)
        self.sink = bytearray(nbytes)
        for buf in (self.dst, self.sink):  # fault the pages in now, not while timing
            ctypes.memset(_address(buf), 0xA5, nbytes)
        self.src_view, self.dst_view = memoryview(self.src), memoryview(self.dst)
        self.sink_view = memoryview(self.sink)

    def objects(self, view: memoryview, start: int, count: int) -> list[memoryview]:
        return [view[i * self.size: (i + 1) * self.size] for i in range(start, start + count)]

    def same(self, start: int, count: int) -> bool:
        """Whether the load buffers hold the source bytes of objects [start, start+count)."""
        lo, hi = start * self.size, (start + count) * self.size
        digest = xxhash.xxh3_128_digest
        return digest(self.dst_view[lo:hi]) == digest(self.src_view[lo:hi])


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


# -- limits -----------------------------------------------------------------------------


def memcpy_limit(bufs: Buffers, n: int, conc: int, store: bool) -> float:
    """memcpy of n objects in conc threads: the floor under any shm transfer."""
    src, dst = (bufs.src, bufs.sink) if store else (bufs.src, bufs.dst)
    src_addr, dst_addr, size, per = _address(src), _address(dst), bufs.size, n // conc

    def work(c: int) -> None:
        for i in range(c * per, (c + 1) * per):
            ctypes.memmove(dst_addr + i * size, src_addr + i * size, size)

    return n * size / run_threads(conc, work, LIMIT_TIMEOUT, "limit measurement") / 1e9


# op (1 read, 2 write), offset, length, padded to 64 bytes: a WRITE's payload then starts
# cache-line aligned in the socket buffers, as a limit should (see docs/BENCHMARKS.md).
_RAW_REQ = struct.Struct("<BQQ47x")


def _recv_all(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        r = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if r == 0:
            raise ConnectionError("peer closed")
        got += r


class RawServer:
    """A plain loopback socket server: READ sends a slice of the source, WRITE receives
    into the sink. It reads whatever buffers the bench set last."""

    def __init__(self) -> None:
        self.bufs: Buffers | None = None
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = self._sock.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="raw-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="raw-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        req = bytearray(_RAW_REQ.size)
        try:
            while True:
                got = conn.recv_into(req, len(req), socket.MSG_WAITALL)
                if got < len(req) or self.bufs is None:
                    return
                op, offset, length = _RAW_REQ.unpack(req)
                if op == 1:
                    conn.sendall(self.bufs.src_view[offset: offset + length])
                else:
                    _recv_all(conn, self.bufs.sink_view[offset: offset + length])
                    conn.sendall(b"\0")
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


def socket_limit(server: RawServer, bufs: Buffers, n: int, conc: int, store: bool) -> float:
    """Plain Python sockets over loopback, n objects over conc connections."""
    server.bufs = bufs
    socks = [socket.create_connection(server.address, timeout=5.0) for _ in range(conc)]
    for s in socks:
        s.settimeout(None)  # plain blocking sockets; the join timeout bounds them
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    size, per = bufs.size, n // conc

    def work(c: int) -> None:
        sock, ack = socks[c], bytearray(1)
        for i in range(c * per, (c + 1) * per):
            off = i * size
            if store:
                sock.sendall(_RAW_REQ.pack(2, off, size))
                sock.sendall(bufs.src_view[off: off + size])
                _recv_all(sock, memoryview(ack))
            else:
                sock.sendall(_RAW_REQ.pack(1, off, size))
                _recv_all(sock, bufs.dst_view[off: off + size])

    def cut() -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    try:
        return n * size / run_threads(conc, work, LIMIT_TIMEOUT, "limit measurement", cut) / 1e9
    finally:
        for s in socks:
            s.close()


# -- ours -------------------------------------------------------------------------------


class Ours:
    """Stores and loads through one AsyncPolarKVClient per (transport, concurrency)."""

    def __init__(self, manager_url: str, transport: str, conc: int) -> None:
        # chunk_tokens=1: a call's token list is its list of chunks, so keys are cheap
        # and any fresh first token makes a fresh chain of keys.
        self.client = AsyncPolarKVClient(manager_url, namespace=f"bench-datapath-{transport}",
                                         chunk_tokens=1, transport=transport,
                                         timeout=CLIENT_TIMEOUT, connections=conc, window=WINDOW)
        self.conc = conc

    @staticmethod
    def _calls(bufs: Buffers, n: int, conc: int) -> list[list[tuple[int, int]]]:
        """Per caller, its (first object, count) calls."""
        per = n // conc
        step = max(1, min(WINDOW, CALL_BYTES // bufs.size))
        return [[(i, min(step, (c + 1) * per - i)) for i in range(c * per, (c + 1) * per, step)]
                for c in range(conc)]

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
                stored += await self.client.store_kv(self._tokens(tag, start, count),
                                                     bufs.objects(bufs.src_view, start, count))
            return stored

        calls = self._calls(bufs, n, self.conc)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(caller(c) for c in calls))
        return time.perf_counter() - t0, sum(done)

    async def load(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int, bool]:
        """Seconds taken, objects that hit, and whether every hit is byte-exact."""
        async def caller(calls: list[tuple[int, int]]) -> list[tuple[int, int]]:
            hits = []
            for start, count in calls:
                n_tokens, _ = await self.client.load_kv(self._tokens(tag, start, count),
                                                        bufs.objects(bufs.dst_view, start, count))
                hits.append((start, n_tokens))  # chunk_tokens=1: tokens == chunks
            return hits

        calls = self._calls(bufs, n, self.conc)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(caller(c) for c in calls))
        elapsed = time.perf_counter() - t0
        hits = [h for per_caller in done for h in per_caller]
        exact = all(bufs.same(start, count) for start, count in hits if count)
        return elapsed, sum(count for _, count in hits), exact

    async def close(self) -> None:
        await self.client.close()


# -- the run ----------------------------------------------------------------------------


def _limit(server: RawServer | None, transport: str, bufs: Buffers, n: int, conc: int,
           store: bool) -> float:
    if transport == "tcp":
        assert server is not None
        return socket_limit(server, bufs, n, conc, store)
    return memcpy_limit(bufs, n, conc, store)


async def _measure_row(ours: Ours, server: RawServer | None, bufs: Buffers, store: Row, load: Row,
                       budget: float, tags: Iterator[int]) -> None:
    """Up to ROUNDS rounds of: limit (write direction), store, limit (read), load."""
    loop = asyncio.get_running_loop()
    n, size = bufs.n // store.concurrency * store.concurrency, bufs.size
    started = time.monotonic()
    for done in range(ROUNDS):
        if done and (time.monotonic() - started) * (done + 1) / done > budget:
            store.notes.append(f"{done} rounds (time budget)")
            break
        tag = next(tags)
        store.limit.append(await loop.run_in_executor(
            None, _limit, server, store.transport, bufs, n, store.concurrency, True))
        seconds, stored = await ours.store(bufs, n, tag)
        store.ours.append(stored * size / seconds / 1e9)
        if stored < n:
            store.notes.append(f"stored {stored}/{n}")
        load.limit.append(await loop.run_in_executor(
            None, _limit, server, load.transport, bufs, n, load.concurrency, False))
        seconds, hits, exact = await ours.load(bufs, n, tag)
        load.ours.append(hits * size / seconds / 1e9)
        if hits < n:
            load.notes.append(f"hit {hits}/{n}")
        if not exact:
            load.notes.append("BYTES DIFFER")


async def _warm_up(client: Ours, bufs: Buffers, transport: str, conc: int, plan: Plan,
                   tags: Iterator[int], notes: list[str]) -> None:
    """Untimed: connect, and for shm touch the whole slab once through this client.

    A long-lived engine maps a slab once; the page-table entries of its mapping then stay.
    A fresh mapping pays for them on first touch (several times the copy itself), which
    would land on whichever rows come first. So each shm client first stores enough to
    cycle through all of slab memory, and the first-touch speed is reported on its own."""
    n = bufs.n // conc * conc
    rounds = -(-plan.memory * 5 // 4 // (n * bufs.size)) if transport == "shm" else 1
    deadline = time.monotonic() + WARM_UP_S
    for r in range(rounds):
        if time.monotonic() > deadline:
            notes.append(f"shm warm-up (conc {conc}) cut short after {WARM_UP_S:.0f}s: "
                         f"rows may include first-touch cost")
            break
        seconds, stored = await client.store(bufs, n, next(tags))
        if r == 0 and transport == "shm":
            notes.append(f"shm first touch (conc {conc}, {_size_text(bufs.size)}): store "
                         f"{stored * bufs.size / seconds / 1e9:.2f} GB/s into never-mapped pages")


async def _measure(plan: Plan, manager_url: str, notes: list[str]) -> list[Row]:
    rows: list[Row] = []
    ours = {(t, c): Ours(manager_url, t, c) for t in plan.transports for c in plan.concurrency}
    server = RawServer() if "tcp" in plan.transports else None
    budget = BUDGET_S / (len(plan.sizes) * len(plan.concurrency) * len(plan.transports))
    tags = itertools.count(1)
    try:
        for k, size in enumerate(plan.sizes):
            # Allocated per size, not per row, so one size's buffers are alive at a time.
            bufs = Buffers(size, plan.total // size)
            if k == 0:
                for (transport, conc), client in ours.items():
                    await _warm_up(client, bufs, transport, conc, plan, tags, notes)
            for transport in plan.transports:
                for conc in plan.concurrency:
                    store = Row(transport, size, conc, "store")
                    load = Row(transport, size, conc, "load")
                    rows += (store, load)
                    await _measure_row(ours[transport, conc], server, bufs, store, load, budget, tags)
    finally:
        if server is not None:
            server.close()
        for client in ours.values():
            await client.close()
    return rows


def _size_text(size: int) -> str:
    return f"{size // MiB}MiB" if size % MiB == 0 else f"{size // 1024}KiB"


def render(rows: list[Row]) -> str:
    header = ("transport", "size", "conc", "op", "ours GB/s", "limit GB/s", "ratio", "goal", "notes")
    lines = [header]
    for r in rows:
        ours, limit, ratio = max(r.ours, default=0.0), max(r.limit, default=0.0), r.ratio()
        goal = r.goal()
        goal_text = "" if goal is None else f">={goal:.1f} {'met' if ratio >= goal else 'MISSED'}"
        lines.append((r.transport, _size_text(r.size), str(r.concurrency), r.op, f"{ours:.2f}",
                      f"{limit:.2f}", f"{ratio:.2f}", goal_text, "; ".join(dict.fromkeys(r.notes))))
    return markdown_table(lines)


def main(sizes: str, concurrency: str, transports: str, total: str, memory: str) -> None:
    """Run the bench and print its table; exit 2 on bad arguments, 3 if it cannot run."""
    try:
        plan = parse_plan(sizes, concurrency, transports, total, memory)
    except BenchError as exc:
        print(f"bench datapath: {exc}", file=sys.stderr)
        sys.exit(2)
    logs.configure("console", "warning")  # this process logs warnings only
    print(f"polarkv bench datapath: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{plan.total // MiB}MiB per measurement, up to {ROUNDS} rounds of limit and ours "
          f"back to back; GB/s columns: best round; "
          f"GB/s = 1e9 bytes/s", flush=True)
    started = time.monotonic()
    notes: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="polarkv-bench-") as workdir, \
                running_service(plan.memory, workdir) as manager_url:
            rows = asyncio.run(_measure(plan, manager_url, notes))
    except BenchError as exc:
        print(f"bench datapath: {exc}", file=sys.stderr)
        sys.exit(3)
    order = {t: i for i, t in enumerate(plan.transports)}
    rows.sort(key=lambda r: (order[r.transport], r.size, r.concurrency, r.op != "store"))
    print(render(rows))
    for note in notes:
        print(note)
    print(f"({time.monotonic() - started:.0f}s; ratio: median over rounds of ours / limit, "
          f"each pair measured side by side in this run)")
    if any("BYTES DIFFER" in r.notes for r in rows):
        sys.exit(3)
