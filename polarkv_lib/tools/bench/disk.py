"""`polarkv bench disk`: the disk tier's throughput beside the raw disk, in one run.

Every row is a ratio of two measurements taken side by side in the same run, on the same
filesystem, with the same object size and the same thread count: the machine this runs
on is usually shared and noisy, and absolute GB/s move between runs far more than ratios.
The four parts (store: DiskStore against raw pwrite/preadv; service: a real node that
offloads and reloads a working set four times its memory; fit: a node with and without
the disk role when nothing needs tiering; large: single prompts larger than memory,
loaded whole through it, against the raw read and a memory-only node), their defaults and the latest results are in
docs/BENCHMARKS.md ("Disk tier"). The DiskStore's key directories (two levels of 256)
are made before timing, as on a node that has run a while.

Page cache: by default both sides use O_DIRECT, as disk.o_direct=true does. With it off,
the cache is dropped (root only) before every read measurement, and read rows depend on
readahead: on a cold cache one whole-file pread can be slower than DiskStore's 4 KiB
header read followed by the payload, so the raw read is no ceiling there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import click
import xxhash

from polarkv_lib.errors import DiskFailure
from polarkv_lib.node.buffer import SlabBuffer
from polarkv_lib.node.disk import DiskStore
from polarkv_lib.progress import progress
from polarkv_lib.tools.bench import core
from polarkv_lib.tools.bench import disk_files as files
from polarkv_lib.tools.bench.core import BenchError, MiB, gbps, size_text
from polarkv_lib.tools.bench.disk_large import large_part
from polarkv_lib.tools.bench.disk_node import fit_part, service_part
from polarkv_lib.tools.bench.disk_plan import GOALS, PARTS, Plan, Row, parse_plan
from polarkv_lib.tools.bench.measure import CpuWatch
from polarkv_lib.wire.orders import FILE_HEADER_SIZE as HEADER_SIZE

STORE_ROUNDS = 5
STORE_BUDGET_S = 40.0  # store-part rounds are cut to stay near this


# -- part 1a: DiskStore against raw files -----------------------------------------------


def _store_part(plan: Plan, workdir: str, rows: list[Row]) -> None:
    budget = STORE_BUDGET_S / len(plan.sizes)
    for size in plan.sizes:
        n = plan.total // size
        offload = Row("store", size, "offload", "raw write")
        reload = Row("store", size, "reload", "raw read")
        rows += (offload, reload)
        store_dir = os.path.join(workdir, "store")
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(files.remove_files, store_dir)
            # Buffers like the slab's: a MAP_SHARED mmap of a /dev/shm file. Named by our
            # pid, so two benches never share one; SlabBuffer.close() removes the file.
            src = SlabBuffer("/dev/shm", f"bench-disk-src-{os.getpid()}", 1, n * size)
            cleanup.callback(src.close)
            dst = SlabBuffer("/dev/shm", f"bench-disk-dst-{os.getpid()}", 1, n * size)
            cleanup.callback(dst.close)
            files.fill(src.view, size, n)
            dst.view[:] = src.view  # touch every page now, not while timing
            store = DiskStore((store_dir,), 2 * n * (size + HEADER_SIZE) + 64 * MiB, plan.o_direct)
            keys = [secrets.token_hex(16) for _ in range(n)]
            setup = StoreSetup(src.view, dst.view, size, n, store, keys)
            files.make_key_dirs(store, setup.keys)
            started = time.monotonic()
            for r in range(STORE_ROUNDS):
                if r and (time.monotonic() - started) * (r + 1) / r > budget:
                    offload.notes.append(f"{r} rounds (time budget)")
                    break
                _store_round(plan, workdir, setup, offload, reload, first_ours=r % 2 == 1)


@dataclass(frozen=True)
class StoreSetup:
    src: memoryview
    dst: memoryview
    size: int
    n: int
    store: DiskStore
    keys: list[str]

    def src_obj(self, i: int) -> memoryview:
        return self.src[i * self.size : (i + 1) * self.size]

    def dst_obj(self, i: int) -> memoryview:
        return self.dst[i * self.size : (i + 1) * self.size]


def _store_round(
    plan: Plan, workdir: str, setup: StoreSetup, offload: Row, reload: Row, first_ours: bool
) -> None:
    """One round: raw write and offload of the same objects, then raw read and reload,
    each pair in the order `first_ours` says (alternated, so neither side always finds
    the disk just rested or just busy). Files of both sides are removed afterwards."""
    size, n, store, keys = setup.size, setup.n, setup.store, setup.keys
    direct = os.O_DIRECT if plan.o_direct else 0
    raw_dir = os.path.join(workdir, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    sums = [
        xxhash.xxh3_64_hexdigest(setup.src_obj(i)) for i in range(n)
    ]  # the client's, in service
    want = xxhash.xxh3_128_digest(setup.src)

    def raw_write(i: int) -> None:
        files.raw_write(os.path.join(raw_dir, str(i)), setup.src_obj(i), direct)

    def ours_write(i: int) -> None:
        store.offload(keys[i], setup.src_obj(i), size, sums[i])

    def raw_read(i: int) -> None:
        files.raw_read(os.path.join(raw_dir, str(i)), setup.dst_obj(i), direct)

    def ours_read(i: int) -> None:
        store.reload(keys[i], setup.dst_obj(i), size, sums[i])

    try:
        for row, ours, raw, reading in (
            (offload, ours_write, raw_write, False),
            (reload, ours_read, raw_read, True),
        ):
            pair: dict[str, float] = {}
            for side in ("ours", "raw") if first_ours else ("raw", "ours"):
                if reading:
                    setup.dst[: 16 * 4096] = bytes(16 * 4096)  # a read that did nothing would show
                    files.drop_caches(plan.o_direct, row.notes)
                try:
                    seconds = files.drain_threads(n, plan.threads, ours if side == "ours" else raw)
                except BenchError as exc:
                    where = f"store part, {size_text(size)} {row.op} ({side})"
                    raise BenchError(f"{where}: {exc}") from None
                pair[side] = gbps(n * size, seconds)
                if reading and xxhash.xxh3_128_digest(setup.dst) != want:
                    raise BenchError(f"store part: {side} read back other bytes than were written")
            row.ours.append(pair["ours"])
            row.base.append(pair["raw"])
    finally:
        for key in keys:  # files only: the key directories stay, as on a running node
            store.delete(key)
        files.remove_files(raw_dir)


# -- output -----------------------------------------------------------------------------


def render(rows: list[Row]) -> str:
    header = ("part", "size", "op", "ours GB/s", "baseline", "baseline GB/s", "ratio", "goal")
    lines = [header]
    for r in rows:
        ours, base = r.best()
        lines.append(
            (
                r.part,
                size_text(r.size),
                r.op,
                f"{ours:.2f}",
                r.baseline,
                f"{base:.2f}",
                f"{r.ratio():.2f}",
                core.goal_text(r.ratio(), GOALS[r.part]),
            )
        )
    return core.markdown_table(lines)


def _notes(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        pairs = " ".join(f"{o / b:.2f}" for o, b in zip(r.ours, r.base, strict=True) if b > 0)
        out.append(f"{r.part} {size_text(r.size)} {r.op}: ratio per round {pairs}")
        out += [f"{r.part} {size_text(r.size)} {r.op}: {note}" for note in dict.fromkeys(r.notes)]
    return out


def measure(plan: Plan) -> tuple[list[Row], list[str]]:
    """Run the planned parts in a temporary directory under plan.root, removed after.
    Returns the rows and one line per part saying who used the CPUs meanwhile."""
    rows: list[Row] = []
    cpu_notes: list[str] = []
    workdir = tempfile.mkdtemp(prefix="polarkv-bench-disk-", dir=plan.root)
    try:
        if plan.o_direct:
            files.probe_o_direct(workdir)
        parts: dict[str, Callable[[Plan, str, list[Row]], None]] = {
            "store": _store_part,
            "service": service_part,
            "fit": fit_part,
            "large": large_part,
        }
        chosen = [name for name in PARTS if name in plan.parts]
        with progress(len(chosen), "bench disk", "part") as bar:
            for name in chosen:
                bar.set_postfix(name)
                with CpuWatch() as cpu:
                    parts[name](plan, workdir, rows)
                cpu_notes.append(f"{name} part: {cpu.text()}")
                bar.update(1)
    except (OSError, DiskFailure) as exc:
        raise BenchError(f"{type(exc).__name__}: {exc}") from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows, cpu_notes


def run(plan: Plan, json_path: str = "") -> bool:
    """Run the bench and print its table; False if a loaded chunk was not the stored one."""
    fs = files.filesystem(plan.root)
    print(
        f"polarkv bench disk: {core.machine_text()}; path {plan.root}: {fs}; "
        f"{'O_DIRECT on both sides' if plan.o_direct else 'page cache on both sides (dropped before reads)'}; "
        f"{plan.threads} threads / disk.io_threads; "
        f"store part {plan.total // MiB} MiB per measurement; service part: "
        f"{plan.working_set // MiB} MiB through {plan.memory // MiB} MiB of slab memory; "
        f"GB/s = 1e9 bytes/s, best round; ratio: median over rounds of ours / baseline",
        flush=True,
    )
    load_before = core.loadavg()
    if fs.startswith(("tmpfs", "ramfs")):
        print(f"bench disk: warning: {plan.root} is in memory ({fs}), not on a disk", flush=True)
    started = time.monotonic()
    rows, cpu_notes = measure(plan)
    print(render(rows))
    for note in _notes(rows) + cpu_notes:
        print(note)
    print(
        f"({time.monotonic() - started:.0f}s; load average {load_before} before, {core.loadavg()} after)"
    )
    if json_path:
        core.write_json(
            json_path,
            "disk",
            {
                "path": plan.root,
                "sizes": plan.sizes,
                "total": plan.total,
                "memory": plan.memory,
                "working_set": plan.working_set,
                "threads": plan.threads,
                "o_direct": plan.o_direct,
                "parts": list(plan.parts),
                "filesystem": fs,
            },
            rows,
            {"cpu": cpu_notes},
        )
    return not any("WRONG" in note for r in rows for note in r.notes)


@click.command("disk")
@click.option(
    "--path", default="", help="Directory on the disk to measure (default: the system temp dir)."
)
@click.option(
    "--sizes", default="1MiB,4MiB", show_default=True, help="Object sizes, comma separated."
)
@click.option(
    "--total", default="256MiB", show_default=True, help="Bytes per file-store measurement."
)
@click.option(
    "--memory", default="256MiB", show_default=True, help="Slab memory of the nodes it starts."
)
@click.option(
    "--working-set",
    default="1GiB",
    show_default=True,
    help="Bytes stored and loaded back per service round (>= 4x --memory).",
)
@click.option("--threads", default="4", show_default=True, help="I/O threads on both sides.")
@click.option(
    "--o-direct/--no-o-direct",
    default=True,
    show_default=True,
    help="O_DIRECT on both sides, or the page cache (dropped before reads; needs root).",
)
@click.option("--parts", default="store,service,fit,large", show_default=True, help="Parts to run.")
@click.option(
    "--json", "json_path", default="", help="Also write the results as JSON to this file."
)
def command(
    path: str,
    sizes: str,
    total: str,
    memory: str,
    working_set: str,
    threads: str,
    o_direct: bool,
    parts: str,
    json_path: str,
) -> None:
    """Offload/reload throughput beside raw sequential file I/O; hybrid vs memory-only."""
    core.guarded(
        "disk",
        lambda: run(
            parse_plan(path, sizes, total, memory, working_set, threads, o_direct, parts), json_path
        ),
    )
