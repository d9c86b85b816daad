"""`polarkv bench disk`: the disk tier's throughput beside the raw disk, in one run.

Every row is a ratio of two measurements taken side by side in the same run, on the same
filesystem, with the same object size and the same thread count: the machine this runs
on is usually shared and noisy, and absolute GB/s move between runs far more than ratios.

  store    DiskStore.offload / DiskStore.reload, the calls the disk role makes, from
           `threads` threads (the role's io_threads pool), between slab-like buffers (an
           mmap of a /dev/shm file, as the slab's) and a directory under --path;
           against raw os.pwrite / os.preadv of the same objects from and into the same
           buffers, one file per object in a sibling directory, same threads. Up to 5
           rounds; which side goes first alternates.
  service  a real node (`polarkv`, all roles, slab.memory=--memory, disk.io_threads=
           --threads, disk.o_direct as chosen) is given a working set (--working-set) at
           least four times its memory by CALLERS concurrent store_kv callers: storing it
           makes the manager offload; loading it back, in the order it was stored, makes
           it reload. Our throughput is the growth of the manager's offload_bytes /
           reload_bytes counters over the time they grew (sampled every 20 ms; for
           reloads, only the part after the last offload, so reads compare with reads);
           against raw writes / reads of as many bytes, in objects of the same size, on
           the same path, same threads, measured right before and right after our phase
           and averaged. A fresh node per round, so every round starts from empty memory.
  fit      a working set that fits in memory (half of --memory), loaded through a node
           with the disk role and through one without it (manager + slab), same memory,
           same client: with nothing to tier, the disk role should cost nothing.

Each GB/s column shows its best round; the ratio is the median over rounds of the
round's ours / baseline. The DiskStore's key directories (two levels of 256) are made
before timing, as on a node that has run a while; on a fresh node the first offloads
also pay for creating them.

Page cache: by default both sides use O_DIRECT, as disk.o_direct=true does, so neither
side reads or writes memory instead of the disk. With o_direct off, both sides use the
page cache, the cache is dropped (`echo 1 > /proc/sys/vm/drop_caches`, root only) before
every read measurement, and write rows time how fast the kernel absorbs the writes (no
fsync on either side; DiskStore does none). Read rows then depend on readahead: on a
cold cache, one whole-file pread can be slower than DiskStore's 4 KiB header read
followed by the payload, so the raw read is no ceiling there; the goals are for O_DIRECT.

Disk use is bounded: the store part holds 2 x total at a time, the service part its
node's files and the two raw sets of one round (3 x working set, and headers); all of it
lives in one temporary directory under --path, removed at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import mmap
import os
import platform
import re
import secrets
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
import xxhash

from polarkv_lib import logs
from polarkv_lib.client.async_client import AsyncPolarKVClient
from polarkv_lib.config import parse_size
from polarkv_lib.keys import chunk_keys
from polarkv_lib.node.buffer import SlabBuffer
from polarkv_lib.node.disk import HEADER_SIZE, DiskFailure, DiskStore
from polarkv_lib.tools.service import Service, running
from polarkv_lib.tools.timing import BenchError, markdown_table, run_threads

MiB = 1024**2
PARTS = ("store", "service", "fit")
GOALS = {"store": 0.8, "service": 0.8, "fit": 0.9}  # ratio goals (fit: the paper's "about equal")
STORE_ROUNDS = 5
SERVICE_ROUNDS = 3
FIT_ROUNDS = 9
FIT_BYTES = 1024 * MiB  # bytes one fit measurement loads (the working set, repeatedly)
NAMESPACE = "bench-disk"
CALLERS = 4  # concurrent store_kv/load_kv callers in one client, like a few engine workers
POOL_BYTES = 128 * MiB  # distinct objects the service part cycles through (bounds our RSS)
SAMPLE_S = 0.02  # stats polling period: a window error of at most 2 periods
CLIENT_TIMEOUT = 30.0  # bounds each client call; a stalled reload shows up as a miss
IO_TIMEOUT = 120.0  # a raw or DiskStore measurement stuck this long is abandoned
SETTLE_TIMEOUT = 30.0  # wait for offloads still in flight when the stores returned
BUDGET_S = {"store": 40.0, "service": 100.0, "fit": 30.0}  # rounds are cut to stay near these
DISK_SLACK = 1024 * MiB  # free space left to others beyond what the bench itself needs


@dataclass(frozen=True)
class Plan:
    root: str  # the bench's temporary directory goes under this path
    sizes: list[int]
    total: int  # bytes per store-part measurement
    memory: int  # slab memory of every service
    working_set: int  # bytes the service part stores and loads per round
    threads: int
    o_direct: bool
    parts: tuple[str, ...]

    def chunks_per_prompt(self, size: int) -> int:
        """Chunks per store_kv/load_kv call. A loading prompt pins its chunks in memory
        until it has read them, so CALLERS prompts in flight must leave most of memory
        free for the reloads behind them: a quarter of memory for all of them together."""
        return max(1, min(64, self.memory // (4 * CALLERS * size)))


@dataclass
class Row:
    part: str
    size: int
    op: str
    baseline: str  # what the ratio divides by
    ours: list[float] = field(default_factory=list)  # GB/s per round
    base: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def ratio(self) -> float:
        """The median over rounds of ours / baseline, each pair measured back to back: a
        pair mostly sees the same neighbours' load, the two best values may not."""
        pairs = [o / b for o, b in zip(self.ours, self.base, strict=True) if b > 0]
        return statistics.median(pairs) if pairs else 0.0


# -- arguments --------------------------------------------------------------------------


def _parse_list(text: str, what: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise BenchError(f"{what}: give at least one value")
    return items


def parse_plan(path: str, sizes: str, total: str, memory: str, working_set: str, threads: str,
               o_direct: bool, parts: str) -> Plan:
    try:
        size_list = [parse_size(s) for s in _parse_list(sizes, "--sizes")]
        total_b, memory_b, ws_b = parse_size(total), parse_size(memory), parse_size(working_set)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    try:
        n_threads = int(threads)
    except ValueError:
        raise BenchError(f"--threads: not an integer: {threads!r}") from None
    part_list = tuple(_parse_list(parts, "--parts"))
    if any(p not in PARTS for p in part_list):
        raise BenchError(f"--parts: choose from {', '.join(PARTS)}, got {parts!r}")
    if any(s < 64 * 1024 or s % 4096 or s > 64 * MiB for s in size_list):
        raise BenchError("--sizes: multiples of 4KiB from 64KiB to 64MiB (O_DIRECT needs whole pages)")
    if not 1 <= n_threads <= 64:
        raise BenchError("--threads: between 1 and 64 (the range of disk.io_threads)")
    if total_b < max(size_list) * n_threads:
        raise BenchError("--total: must hold at least one object per thread")
    if memory_b < 4 * CALLERS * max(size_list):
        raise BenchError(f"--memory: at least {4 * CALLERS} objects of the largest size")
    if ws_b < 4 * memory_b:
        raise BenchError("--working-set: at least 4x --memory, so that most of it lives on disk")
    root = os.path.abspath(path) if path else tempfile.gettempdir()
    if not os.path.isdir(root):
        raise BenchError(f"--path: {root} is not a directory")
    return Plan(root, size_list, total_b, memory_b, ws_b, n_threads, o_direct, part_list)


def _check_room(plan: Plan) -> None:
    """Refuse to start rather than fill a disk or /dev/shm that others share."""
    need_disk = 0
    if "store" in plan.parts:  # raw and DiskStore files of one round live together
        need_disk = max(need_disk, 2 * plan.total * 11 // 10)
    if "service" in plan.parts:  # the node's files and two sets of raw files of one round
        need_disk = max(need_disk, 3 * plan.working_set * 11 // 10)
    free = shutil.disk_usage(plan.root).free
    if free < need_disk + DISK_SLACK:
        raise BenchError(f"--path: {plan.root} has {free // MiB} MiB free; the bench needs "
                         f"{need_disk // MiB} MiB plus {DISK_SLACK // MiB} MiB to spare")
    need_shm = max(2 * plan.total if "store" in plan.parts else 0, 2 * plan.memory)
    shm_free = shutil.disk_usage("/dev/shm").free
    if shm_free < need_shm + DISK_SLACK:
        raise BenchError(f"/dev/shm has {shm_free // MiB} MiB free; the bench needs "
                         f"{need_shm // MiB} MiB plus {DISK_SLACK // MiB} MiB to spare")


def _probe_o_direct(directory: str) -> None:
    probe = os.path.join(directory, ".o_direct-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as exc:
        raise BenchError(f"--path: {directory} does not support O_DIRECT ({exc.strerror}); choose "
                         f"a path on a disk filesystem or run without O_DIRECT (--no-o-direct)") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _filesystem(path: str) -> str:
    """'ext4 on /dev/vda (mounted at /)': the mount that holds `path`."""
    best = ("", "?", "?")
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            mount_point = fields[4]
            fs_type, device = fields[fields.index("-") + 1: fields.index("-") + 3]
            inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best[0]):
                best = (mount_point, fs_type, device)
    return f"{best[1]} on {best[2]} (mounted at {best[0] or '?'})"


# -- buffers and raw I/O ----------------------------------------------------------------


def _fill(view: memoryview, size: int, n: int) -> None:
    """Random bytes, every object distinct (its index and size in its first 16 bytes), so
    a misplaced object is caught and no layer can compress or deduplicate its way ahead."""
    block = os.urandom(256 * 1024)
    for off in range(0, n * size, len(block)):
        view[off: off + len(block)] = block[: n * size - off]
    for i in range(n):
        struct.pack_into("<QQ", view, i * size, i, size)


def _anonymous(nbytes: int) -> mmap.mmap:
    """Page-aligned memory (O_DIRECT needs it), touched now rather than while timing."""
    mm = mmap.mmap(-1, nbytes)
    for off in range(0, nbytes, 4096):
        mm[off] = 0xA5
    return mm


def _run_threads(n: int, threads: int, op: Callable[[int], None]) -> float:
    """Run op(0..n-1) on `threads` threads that each take the next index from a shared
    counter, as a thread pool takes queued orders; return the seconds from their common
    start to the last one's end."""
    counter = itertools.count()
    lock = threading.Lock()
    stop = threading.Event()  # one failed or late: the others stop at their next object

    def drain(_: int) -> None:
        while not stop.is_set():
            with lock:
                i = next(counter)
            if i >= n:
                return
            try:
                op(i)
            except BaseException:
                stop.set()
                raise

    return run_threads(threads, drain, IO_TIMEOUT, "disk measurement", stop.set)


def _raw_write(path: str, data: memoryview, direct: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
    try:
        done = 0
        while done < len(data):
            n = os.pwrite(fd, data[done:], done)
            if n <= 0:
                raise OSError(f"{path}: short write")
            done += n
    finally:
        os.close(fd)


def _raw_read(path: str, into: memoryview, direct: int) -> None:
    fd = os.open(path, os.O_RDONLY | direct)
    try:
        done = 0
        while done < len(into):
            n = os.preadv(fd, [into[done:]], done)
            if n <= 0:
                raise OSError(f"{path}: short read")
            done += n
    finally:
        os.close(fd)


def _remove_files(directory: str) -> None:
    """Untimed clean-up between rounds. The sync lets the filesystem finish the frees
    (and, on a `discard` mount, the trims) before the next round measures."""
    shutil.rmtree(directory, ignore_errors=True)
    os.sync()


def _drop_caches(o_direct: bool, notes: list[str]) -> None:
    """Without O_DIRECT, a read measurement must start from a cold page cache, on both
    sides; the pages written a moment ago would otherwise be read from memory."""
    if o_direct:
        return
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1")
    except OSError:
        notes.append("page cache NOT dropped (needs root): reads may come from memory")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


# -- part 1a: DiskStore against raw files -----------------------------------------------


def _store_part(plan: Plan, workdir: str, rows: list[Row]) -> None:
    budget = BUDGET_S["store"] / len(plan.sizes)
    for size in plan.sizes:
        n = plan.total // size
        offload = Row("store", size, "offload", "raw write")
        reload = Row("store", size, "reload", "raw read")
        rows += (offload, reload)
        store_dir = os.path.join(workdir, "store")
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(_remove_files, store_dir)
            # Buffers like the slab's: a MAP_SHARED mmap of a /dev/shm file. Named by our
            # pid, so two benches never share one; SlabBuffer.close() removes the file.
            src = SlabBuffer("/dev/shm", f"bench-disk-src-{os.getpid()}", 1, n * size)
            cleanup.callback(src.close)
            dst = SlabBuffer("/dev/shm", f"bench-disk-dst-{os.getpid()}", 1, n * size)
            cleanup.callback(dst.close)
            _fill(src.view, size, n)
            dst.view[:] = src.view  # touch every page now, not while timing
            store = DiskStore((store_dir,), 2 * n * (size + HEADER_SIZE) + 64 * MiB, plan.o_direct)
            keys = [secrets.token_hex(16) for _ in range(n)]
            setup = StoreSetup(src.view, dst.view, size, n, store, keys)
            _make_key_dirs(store, setup.keys)
            started = time.monotonic()
            for r in range(STORE_ROUNDS):
                if r and (time.monotonic() - started) * (r + 1) / r > budget:
                    offload.notes.append(f"{r} rounds (time budget)")
                    break
                _store_round(plan, workdir, setup, offload, reload, first_ours=r % 2 == 1)


def _make_key_dirs(store: DiskStore, keys: list[str]) -> None:
    """Create the directories the keys' files go to, untimed. A node that has run a while
    has all of them (two levels of 256, never removed), so a steady-state offload finds
    its directory; on a fresh node the first offloads also pay one or two mkdirs each."""
    for key in keys:
        os.makedirs(os.path.dirname(store.path_for(key)), exist_ok=True)
    os.sync()


@dataclass(frozen=True)
class StoreSetup:
    src: memoryview
    dst: memoryview
    size: int
    n: int
    store: DiskStore
    keys: list[str]

    def src_obj(self, i: int) -> memoryview:
        return self.src[i * self.size: (i + 1) * self.size]

    def dst_obj(self, i: int) -> memoryview:
        return self.dst[i * self.size: (i + 1) * self.size]


def _store_round(plan: Plan, workdir: str, setup: StoreSetup, offload: Row, reload: Row,
                 first_ours: bool) -> None:
    """One round: raw write and offload of the same objects, then raw read and reload,
    each pair in the order `first_ours` says (alternated, so neither side always finds
    the disk just rested or just busy). Files of both sides are removed afterwards."""
    size, n, store, keys = setup.size, setup.n, setup.store, setup.keys
    direct = os.O_DIRECT if plan.o_direct else 0
    raw_dir = os.path.join(workdir, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    sums = [xxhash.xxh3_64_hexdigest(setup.src_obj(i)) for i in range(n)]  # the client's, in service
    want = xxhash.xxh3_128_digest(setup.src)

    def raw_write(i: int) -> None:
        _raw_write(os.path.join(raw_dir, str(i)), setup.src_obj(i), direct)

    def ours_write(i: int) -> None:
        store.offload(keys[i], setup.src_obj(i), size, sums[i])

    def raw_read(i: int) -> None:
        _raw_read(os.path.join(raw_dir, str(i)), setup.dst_obj(i), direct)

    def ours_read(i: int) -> None:
        store.reload(keys[i], setup.dst_obj(i), size, sums[i])

    try:
        for row, ours, raw, reading in ((offload, ours_write, raw_write, False),
                                        (reload, ours_read, raw_read, True)):
            pair: dict[str, float] = {}
            for side in ("ours", "raw") if first_ours else ("raw", "ours"):
                if reading:
                    setup.dst[: 16 * 4096] = bytes(16 * 4096)  # a read that did nothing would show
                    _drop_caches(plan.o_direct, row.notes)
                try:
                    seconds = _run_threads(n, plan.threads, ours if side == "ours" else raw)
                except BenchError as exc:
                    where = f"store part, {_size_text(size)} {row.op} ({side})"
                    raise BenchError(f"{where}: {exc}") from None
                pair[side] = _gbps(n * size, seconds)
                if reading and xxhash.xxh3_128_digest(setup.dst) != want:
                    raise BenchError(f"store part: {side} read back other bytes than were written")
            row.ours.append(pair["ours"])
            row.base.append(pair["raw"])
    finally:
        for key in keys:  # files only: the key directories stay, as on a running node
            store.delete(key)
        _remove_files(raw_dir)


# -- services ---------------------------------------------------------------------------




def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5.0) as resp:
        body: bytes = resp.read()
        return body


def _stats(url: str) -> dict[str, int]:
    stats: dict[str, int] = orjson.loads(_get(url + "/v1/stats"))
    return stats


def _histogram_sums(url: str) -> dict[str, float]:
    """The offload/reload histograms' _sum and _count from /metrics."""
    text = _get(url + "/metrics").decode()
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
        with contextlib.suppress(OSError, ValueError):  # a missed sample only widens the window
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


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot; idle and iowait count as not busy."""
    try:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(values) - values[3] - values[4], sum(values)


class CpuWatch:
    """Who used the CPUs during a phase: the node, this bench process, and the machine as
    a whole (the rest is other tenants). On two shared cores this, more than the disk,
    often decides what a phase can do."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid

    def __enter__(self) -> CpuWatch:
        self._t0 = time.perf_counter()
        self._node0 = _proc_cpu(self.pid) if self.pid else 0.0
        self._own0 = time.process_time()
        self._machine0 = _machine_jiffies()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        self.node = (_proc_cpu(self.pid) - self._node0) if self.pid else 0.0
        self.own = time.process_time() - self._own0
        busy1, total1 = _machine_jiffies()
        busy0, total0 = self._machine0
        self.machine = (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0

    def text(self) -> str:
        node = f"node {self.node:.1f}s, " if self.pid else ""
        return (f"CPU over {self.wall:.1f}s: {node}bench {self.own:.1f}s, machine "
                f"{self.machine:.0%} busy ({os.cpu_count()} CPUs)")


# -- the client side of the service and fit parts ---------------------------------------


class Pool:
    """The distinct objects a client stores, cycled through (a working set larger than
    the pool repeats objects under different keys, which no layer can tell apart)."""

    def __init__(self, size: int, n_objects: int) -> None:
        self.size = size
        self.n = max(1, min(n_objects, POOL_BYTES // size))
        self._mm = _anonymous(self.n * size)
        self.view = memoryview(self._mm)
        _fill(self.view, size, self.n)

    def obj(self, g: int) -> memoryview:
        i = g % self.n
        return self.view[i * self.size: (i + 1) * self.size]

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
                wrong += sum(1 for j, v in enumerate(views) if not self.pool.header_ok(first + j, v))
            return hits, wrong

        done = await asyncio.gather(*(caller() for _ in range(CALLERS)))
        return sum(h for h, _ in done), sum(w for _, w in done)


def _client(url: str) -> AsyncPolarKVClient:
    # transport "auto": shm, since the node is on this host, as a co-located engine's
    # would be; window 64 is the client's default control window.
    return AsyncPolarKVClient(url, namespace=NAMESPACE, chunk_tokens=1, transport="auto",
                              timeout=CLIENT_TIMEOUT, connections=CALLERS)


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
    return {"disk.paths": path, "disk.capacity": str(capacity),
            "disk.o_direct": "true" if plan.o_direct else "false", "disk.io_threads": str(plan.threads)}


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
        self._scratch = [_anonymous(work.pool.size) for _ in range(threads)]

    def write(self, name: str) -> float:
        directory = os.path.join(self.root, name)

        def op(i: int) -> None:
            _raw_write(os.path.join(directory, str(i)), self.work.pool.obj(i), self._direct)

        os.makedirs(directory, exist_ok=True)
        return _gbps(self.n * self.work.pool.size, _run_threads(self.n, self.threads, op))

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
            _raw_read(os.path.join(directory, str(i)), buf, self._direct)

        return _gbps(self.n * self.work.pool.size, _run_threads(self.n, self.threads, op))

    def close(self) -> None:
        for mm in self._scratch:
            with contextlib.suppress(BufferError):  # a view still held: freed at exit
                mm.close()
        _remove_files(self.root)


async def _service_round(plan: Plan, url: str, pid: int, work: Workload, raw: RawFiles
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
        _drop_caches(plan.o_direct, out.reload_notes)
        reads.append(await loop.run_in_executor(None, raw.read, str(len(reads))))

    async def ours_store() -> None:
        before = _histogram_sums(url)
        with CpuWatch(pid) as cpu, StatsPoller(url) as poll:
            t0 = time.perf_counter()
            stored = await work.store(client)
            client_s = time.perf_counter() - t0
            await _settle_offloads(url)
        nbytes, seconds = poll.window("offload_bytes")
        out.offload = _gbps(nbytes, seconds)
        if stored < chunks:
            out.offload_notes.append(f"stored {stored}/{chunks}")
        out.offload_notes.append(
            f"{nbytes // MiB} MiB in {seconds:.2f}s, "
            f"{_in_flight(before, _histogram_sums(url), 'offload', seconds)}; "
            f"client store {_gbps(work.nbytes, client_s):.2f} GB/s over the phase; {cpu.text()}")

    async def ours_load() -> None:
        _drop_caches(plan.o_direct, out.reload_notes)
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
            out.reload = _gbps(pure_bytes, pure_seconds)
            measured = f"{pure_bytes // MiB} MiB in {pure_seconds:.2f}s after the last offload"
        else:  # too little of it without offloads to time on its own
            out.reload = _gbps(nbytes, seconds)
            measured = f"all {nbytes // MiB} MiB in {seconds:.2f}s (with offloads)"
        if hits < chunks:
            out.reload_notes.append(f"load hit {hits}/{chunks}")
        if wrong:
            out.reload_notes.append(f"{wrong} CHUNKS WRONG")
        out.reload_notes.append(
            f"{measured}; whole phase {nbytes // MiB} MiB in {seconds:.2f}s "
            f"({_gbps(nbytes, seconds):.2f} GB/s) with {offloaded // MiB} MiB offloaded meanwhile, "
            f"{_in_flight(before, _histogram_sums(url), 'reload', seconds)}; "
            f"client load {_gbps(work.nbytes, client_s):.2f} GB/s over the phase; {cpu.text()}")

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
    return f"{busy / seconds:.1f} orders in the disk role on average, {busy / done * 1000:.1f} ms each"


async def _settle_offloads(url: str) -> None:
    """The stores have returned; offloads already ordered may still be running."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while _stats(url).get("bytes_offloading", 0) and time.monotonic() < deadline:
        await asyncio.sleep(SAMPLE_S)


def _service_part(plan: Plan, workdir: str, rows: list[Row]) -> None:
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
                _make_key_dirs(DiskStore((disk_dir,), capacity, plan.o_direct), work.keys())
                node = Service(node_dir, (), {"slab.memory": str(plan.memory),
                                              **_disk_settings(disk_dir, capacity, plan)})
                try:
                    with running(node) as (url,):
                        result = asyncio.run(_service_round(plan, url, node.pid, work, raw))
                        stats = _stats(url)
                finally:
                    _remove_files(raw.root)
                    _remove_files(node_dir)
                offload.ours.append(result.offload)
                offload.base.append(result.raw_write)
                reload.ours.append(result.reload)
                reload.base.append(result.raw_read)
                offload.notes += [f"round {r}: {note}" for note in result.offload_notes]
                reload.notes += [f"round {r}: {note}" for note in result.reload_notes]
                if stats["tier_failures"] or stats["evictions"] or stats["disk_evictions"]:
                    offload.notes.append(f"round {r}: {stats['tier_failures']} tier failures, "
                                         f"{stats['evictions']} evictions, "
                                         f"{stats['disk_evictions']} disk evictions")
        finally:
            raw.close()
            pool.close()


# -- part 2: a working set that fits, with and without the disk role --------------------


def _fit_part(plan: Plan, workdir: str, rows: list[Row]) -> None:
    budget = BUDGET_S["fit"] / len(plan.sizes)
    for size in plan.sizes:
        row = Row("fit", size, "load", "memory-only load")
        rows.append(row)
        chunks = plan.chunks_per_prompt(size)
        pool = Pool(size, plan.memory // 2 // size)
        work = Workload(pool, plan.memory // 2, chunks)  # under the low watermark: nothing to tier
        repeat = max(1, math.ceil(FIT_BYTES / work.nbytes))
        hybrid_dir = os.path.join(workdir, f"fit-hybrid-{size}")
        hybrid = Service(hybrid_dir, (), {"slab.memory": str(plan.memory),
                                          **_disk_settings(os.path.join(hybrid_dir, "disk"),
                                                           4 * plan.memory, plan)})
        memory_only = Service(os.path.join(workdir, f"fit-memory-{size}"), ("manager", "slab"),
                              {"slab.memory": str(plan.memory)})
        try:
            with running(hybrid, memory_only) as (hybrid_url, memory_url):
                asyncio.run(_fit_rounds(work, repeat, hybrid_url, memory_url, row, budget))
                stats = _stats(hybrid_url)
                if stats["offloads"] or stats["reloads"] or stats["hits_disk"]:
                    row.notes.append(f"hybrid tiered: {stats['offloads']} offloads, "
                                     f"{stats['reloads']} reloads, {stats['hits_disk']} disk hits")
        finally:
            pool.close()
            _remove_files(hybrid_dir)
            _remove_files(os.path.join(workdir, f"fit-memory-{size}"))
        row.notes.append(f"{work.nbytes // MiB} MiB working set in {plan.memory // MiB} MiB, "
                         f"loaded {repeat}x per measurement")


async def _fit_rounds(work: Workload, repeat: int, hybrid_url: str, memory_url: str, row: Row,
                      budget: float) -> None:
    clients = {"hybrid": _client(hybrid_url), "memory": _client(memory_url)}
    try:
        for name, client in clients.items():
            stored = await work.store(client)
            if stored < work.prompts * work.chunks:
                raise BenchError(f"fit part: {name} node stored {stored}/{work.prompts * work.chunks}")
            await work.load(client)  # untimed: maps the slab in this client, warms both paths
        started = time.monotonic()
        for r in range(FIT_ROUNDS):
            if r and (time.monotonic() - started) * (r + 1) / r > budget:
                row.notes.append(f"{r} rounds (time budget)")
                break
            pair: dict[str, float] = {}
            for name in (("hybrid", "memory") if r % 2 else ("memory", "hybrid")):
                t0 = time.perf_counter()
                hits, wrong = await work.load(clients[name], repeat)
                seconds = time.perf_counter() - t0
                pair[name] = _gbps(hits * work.pool.size, seconds)
                if hits < work.prompts * work.chunks * repeat:
                    row.notes.append(f"{name} hit {hits}/{work.prompts * work.chunks * repeat}")
                if wrong:
                    row.notes.append(f"{name}: {wrong} CHUNKS WRONG")
            row.ours.append(pair["hybrid"])
            row.base.append(pair["memory"])
    finally:
        for client in clients.values():
            await client.close()


# -- output -----------------------------------------------------------------------------


def _size_text(size: int) -> str:
    return f"{size // MiB}MiB" if size % MiB == 0 else f"{size // 1024}KiB"


def render(rows: list[Row]) -> str:
    header = ("part", "size", "op", "ours GB/s", "baseline", "baseline GB/s", "ratio", "goal")
    lines = [header]
    for r in rows:
        ratio, goal = r.ratio(), GOALS[r.part]
        lines.append((r.part, _size_text(r.size), r.op, f"{max(r.ours, default=0.0):.2f}", r.baseline,
                      f"{max(r.base, default=0.0):.2f}", f"{ratio:.2f}",
                      f">={goal:.1f} {'met' if round(ratio, 2) >= goal else 'MISSED'}"))  # as shown
    return markdown_table(lines)


def _notes(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        pairs = " ".join(f"{o / b:.2f}" for o, b in zip(r.ours, r.base, strict=True) if b > 0)
        out.append(f"{r.part} {_size_text(r.size)} {r.op}: ratio per round {pairs}")
        out += [f"{r.part} {_size_text(r.size)} {r.op}: {note}" for note in dict.fromkeys(r.notes)]
    return out


def run(plan: Plan) -> tuple[list[Row], list[str]]:
    """Run the planned parts in a temporary directory under plan.root, removed after.
    Returns the rows and one line per part saying who used the CPUs meanwhile."""
    rows: list[Row] = []
    cpu_notes: list[str] = []
    workdir = tempfile.mkdtemp(prefix="polarkv-bench-disk-", dir=plan.root)
    try:
        if plan.o_direct:
            _probe_o_direct(workdir)
        parts: dict[str, Callable[[Plan, str, list[Row]], None]] = {
            "store": _store_part, "service": _service_part, "fit": _fit_part}
        for name in PARTS:
            if name in plan.parts:
                with CpuWatch() as cpu:
                    parts[name](plan, workdir, rows)
                cpu_notes.append(f"{name} part: {cpu.text()}")
    except (OSError, DiskFailure) as exc:
        raise BenchError(f"{type(exc).__name__}: {exc}") from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows, cpu_notes


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "?"


def main(path: str = "", sizes: str = "1MiB,4MiB", total: str = "256MiB", memory: str = "256MiB",
         working_set: str = "1GiB", threads: str = "4", o_direct: bool = True,
         parts: str = "store,service,fit") -> None:
    """Run the bench and print its table; exit 2 on bad arguments, 3 if it cannot run or
    a loaded chunk was not the stored one."""
    try:
        plan = parse_plan(path, sizes, total, memory, working_set, threads, o_direct, parts)
        _check_room(plan)
    except BenchError as exc:
        print(f"bench disk: {exc}", file=sys.stderr)
        sys.exit(2)
    logs.configure("console", "warning")  # this process logs warnings only
    print(f"polarkv bench disk: {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
          f"{platform.python_version()}; path {plan.root}: {_filesystem(plan.root)}; "
          f"{'O_DIRECT on both sides' if plan.o_direct else 'page cache on both sides (dropped before reads)'}; "
          f"{plan.threads} threads / disk.io_threads; "
          f"store part {plan.total // MiB} MiB per measurement; service part: "
          f"{plan.working_set // MiB} MiB through {plan.memory // MiB} MiB of slab memory; "
          f"GB/s = 1e9 bytes/s, best round; ratio: median over rounds of ours / baseline",
          flush=True)
    load_before = _loadavg()
    if _filesystem(plan.root).startswith(("tmpfs", "ramfs")):
        print(f"bench disk: warning: {plan.root} is in memory ({_filesystem(plan.root)}), not on a disk",
              flush=True)
    started = time.monotonic()
    try:
        rows, cpu_notes = run(plan)
    except BenchError as exc:
        print(f"bench disk: {exc}", file=sys.stderr)
        sys.exit(3)
    print(render(rows))
    for note in _notes(rows) + cpu_notes:
        print(note)
    print(f"({time.monotonic() - started:.0f}s; load average {load_before} before, {_loadavg()} after)")
    if any("WRONG" in note for r in rows for note in r.notes):
        sys.exit(3)


__all__ = ["BenchError", "Plan", "main", "parse_plan", "render", "run"]
