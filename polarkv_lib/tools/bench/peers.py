"""`polarkv bench peers`: PolarKV beside other KV stores and the raw socket limit, in one
run, on loopback, with the same objects, batching and concurrency.

Systems (rows), each given the same `total` bytes of distinct random objects per size:

  raw               plain loopback sockets: per object a 64-byte request, then the
                    object (the data-plane bench's limit); the ratio's denominator
  polarkv tcp/shm   a PolarKV service (manager + slab) that the bench starts, driven by
                    AsyncPolarKVClient store_kv / load_kv into the caller's buffers
  redis             a redis-server the bench starts on a free port; redis-py GET/SET,
                    one round trip per object
  redis pipelined   the same server, one pipeline per batch
  mooncake          Mooncake Store (master + memory node + client, protocol tcp) in a
                    private network namespace, batch_put_from / batch_get_into on
                    registered buffers (polarkv_lib/tools/bench/peers_mooncake.py)

conc callers, each with its share of the objects, in batches of up to 64 objects or
64 MiB (`limits.batches`). Every round measures every system's store and load right
after the raw limit of the same direction, under fresh keys; the ratio is the median of
the per-round system / raw. Every loaded byte is compared with the source (xxh3-128 of
each call's objects, untimed); a miss counts as not loaded. A peer that is not installed
or cannot start is skipped and the table says why.
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import click

from polarkv_lib import service
from polarkv_lib.progress import progress
from polarkv_lib.tools.bench import core
from polarkv_lib.tools.bench.core import MiB, Pairs, gbps, size_text
from polarkv_lib.tools.bench.limits import Buffers, RawServer, socket_limit
from polarkv_lib.tools.bench.peers_base import Peer, PeerUnavailable, PolarKVPeer
from polarkv_lib.tools.bench.plot import bar_chart

SYSTEMS = ("polarkv-tcp", "polarkv-shm", "redis", "redis-pipelined", "mooncake")
ROUNDS = 3


@dataclass(frozen=True)
class Plan:
    sizes: list[int]
    systems: list[str]
    concurrency: int
    total: int
    rounds: int

    @property
    def memory(self) -> int:
        """Memory each system gets: two rounds of objects and the allocators' rounding."""
        return self.total * 5 // 2


@dataclass
class Row(Pairs):
    """`base` is the raw socket limit of the same direction, measured right before."""

    system: str
    size: int
    op: str


def parse_plan(sizes: str, systems: str, concurrency: str, total: str, rounds: str) -> Plan:
    size_list = core.parse_sizes(sizes, "--sizes")
    names = core.parse_choices(systems, "--systems", SYSTEMS)
    conc = core.parse_ints(concurrency, "--concurrency", 1, 64)[0]
    n_rounds = core.parse_ints(rounds, "--rounds", 1, 20)[0]
    total_b = core.parse_bytes(total, "--total")
    if any(s < 4096 or s > 64 * MiB for s in size_list):
        raise core.BadArguments("--sizes: from 4KiB to 64MiB")
    if total_b < max(size_list) * conc:
        raise core.BadArguments("--total: must hold at least one object per caller")
    if total_b > 4096 * MiB:
        raise core.BadArguments("--total: at most 4GiB (each system keeps 2.5x of it in memory)")
    return Plan(size_list, names, conc, total_b, n_rounds)


def _start_peers(
    plan: Plan, workdir: str, stack: contextlib.ExitStack, skipped: dict[str, str]
) -> list[Peer]:
    """Start every chosen system; one that cannot run is recorded in `skipped`."""
    peers: list[Peer] = []
    names = set(plan.systems)
    if names & {"polarkv-tcp", "polarkv-shm"}:
        info = stack.enter_context(
            service.running_service(
                f"{workdir}/polarkv", ("manager", "slab"), {"slab.memory": str(plan.memory)}
            )
        )
        for transport in ("tcp", "shm"):
            if f"polarkv-{transport}" in names:
                peer: Peer = PolarKVPeer(
                    str(info["manager_url"]), transport, plan.concurrency, plan.memory
                )
                stack.callback(peer.close)
                peers.append(peer)
    if names & {"redis", "redis-pipelined"}:
        from polarkv_lib.tools.bench.peers_redis import RedisPeer, RedisServer

        try:
            # Redis counts its clients' output buffers (a pipelined GET of a 64 MiB batch)
            # against maxmemory, and evicts for them: give it room for those too.
            server = RedisServer(workdir, 2 * plan.memory + 64 * MiB)
        except PeerUnavailable as exc:
            for name in ("redis", "redis-pipelined"):
                if name in names:
                    skipped[name] = str(exc)
        else:
            stack.callback(server.close)
            for name, pipelined in (("redis", False), ("redis-pipelined", True)):
                if name in names:
                    peer = RedisPeer(server, plan.concurrency, pipelined)
                    stack.callback(peer.close)
                    peers.append(peer)
    if "mooncake" in names:
        from polarkv_lib.tools.bench.peers_mooncake import MooncakePeer

        try:
            peer = MooncakePeer(workdir, plan.concurrency, plan.memory)
        except PeerUnavailable as exc:
            skipped["mooncake"] = str(exc)
        else:
            stack.callback(peer.close)
            peers.append(peer)
    return peers


def _round(
    peers: list[Peer],
    server: RawServer,
    bufs: Buffers,
    n: int,
    conc: int,
    rows: dict[tuple[str, str, int], Row],
    tags: Iterator[int],
    broken: dict[str, str],
) -> None:
    """One round: per system, raw store then its store, raw load then its load."""
    for peer in peers:
        if peer.name in broken:
            continue
        tag = next(tags)
        store, load = rows[peer.name, "store", bufs.size], rows[peer.name, "load", bufs.size]
        try:
            raw = socket_limit(server, bufs, n, conc, True)
            seconds, stored = peer.store(bufs, n, tag)
            store.add(gbps(stored * bufs.size, seconds), raw)
            if stored < n:
                store.notes.append(f"stored {stored}/{n}")
            raw = socket_limit(server, bufs, n, conc, False)
            seconds, hits, exact = peer.load(bufs, n, tag)
            load.add(gbps(hits * bufs.size, seconds), raw)
            if hits < n:
                load.notes.append(f"hit {hits}/{n}")
            if not exact:
                load.notes.append("BYTES DIFFER")
            peer.forget(n, tag)
        except (PeerUnavailable, core.BenchError, service.ServiceError) as exc:
            broken[peer.name] = str(exc)  # a peer that fails mid-run: reported, others go on


def measure(plan: Plan, workdir: str, skipped: dict[str, str], notes: list[str]) -> list[Row]:
    rows: dict[tuple[str, str, int], Row] = {}
    tags = itertools.count(1)
    with contextlib.ExitStack() as stack:
        peers = _start_peers(plan, workdir, stack, skipped)
        server = RawServer()
        stack.callback(server.close)
        for peer in peers:
            for size in plan.sizes:
                for op in ("store", "load"):
                    rows[peer.name, op, size] = Row(peer.name, size, op)
        with progress(len(plan.sizes) * plan.rounds, "bench peers", "round") as bar:
            for k, size in enumerate(plan.sizes):
                n = plan.total // size // plan.concurrency * plan.concurrency
                bufs = Buffers(size, n)
                if k == 0:
                    for peer in peers:
                        with contextlib.suppress(
                            PeerUnavailable, core.BenchError, service.ServiceError
                        ):
                            peer.warm_up(bufs, n, tags, notes)
                for _ in range(plan.rounds):
                    _round(peers, server, bufs, n, plan.concurrency, rows, tags, skipped)
                    bar.update(1)
                del bufs
    return list(rows.values())


def render(rows: list[Row], skipped: dict[str, str]) -> str:
    header = ("system", "size", "op", "GB/s", "raw GB/s", "ratio to raw", "notes")
    lines = [header]
    for r in rows:
        ours, raw = r.best()
        lines.append(
            (
                r.system,
                size_text(r.size),
                r.op,
                f"{ours:.2f}",
                f"{raw:.2f}",
                f"{r.ratio():.2f}",
                r.note_text(),
            )
        )
    for name, why in skipped.items():
        lines.append((name, "-", "-", "-", "-", "-", f"skipped: {why}"))
    return core.markdown_table(lines)


def plot(path: str, rows: list[Row], plan: Plan) -> str | None:
    groups = [f"{size_text(s)} {op}" for s in plan.sizes for op in ("store", "load")]
    series: dict[str, list[float]] = {}
    raw: dict[str, float] = {}
    for r in rows:
        key = f"{size_text(r.size)} {r.op}"
        series.setdefault(r.system, [0.0] * len(groups))[groups.index(key)] = r.best()[0]
        raw[key] = max(raw.get(key, 0.0), r.best()[1])
    all_series = {"raw socket": [raw.get(g, 0.0) for g in groups], **series}
    return bar_chart(
        path,
        f"polarkv bench peers: {plan.total // MiB} MiB per measurement, "
        f"{plan.concurrency} callers, loopback",
        groups,
        all_series,
        "GB/s (best round)",
        note=core.machine_text(),
    )


def run(plan: Plan, json_path: str, png_path: str) -> bool:
    print(
        f"polarkv bench peers: {core.machine_text()}; {plan.total // MiB} MiB per measurement, "
        f"{plan.concurrency} callers, batches of up to 64 objects or 64 MiB, {plan.rounds} rounds; "
        f"GB/s = 1e9 bytes/s, best round; ratio: median over rounds of system / raw",
        flush=True,
    )
    started = time.monotonic()
    skipped: dict[str, str] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="polarkv-bench-peers-") as workdir:
        rows = measure(plan, workdir, skipped, notes)
    order = {name: i for i, name in enumerate(SYSTEMS)}
    rows.sort(key=lambda r: (r.size, r.op != "store", order.get(r.system, 99)))
    print(render(rows, skipped))
    for note in notes:
        print(note)
    print(f"({time.monotonic() - started:.0f}s)")
    if json_path:
        core.write_json(
            json_path,
            "peers",
            {
                "sizes": plan.sizes,
                "systems": plan.systems,
                "concurrency": plan.concurrency,
                "total": plan.total,
                "rounds": plan.rounds,
            },
            rows,
            {"skipped": skipped, "notes": notes},
        )
    if png_path:
        why = plot(png_path, rows, plan)
        if why:
            print(why)
    return not any("BYTES DIFFER" in r.notes for r in rows)


@click.command("peers")
@click.option(
    "--sizes", default="1MiB,4MiB,16MiB", show_default=True, help="Object sizes, comma separated."
)
@click.option(
    "--systems", default=",".join(SYSTEMS), show_default=True, help="Systems beside the raw limit."
)
@click.option(
    "--concurrency", default="4", show_default=True, help="Concurrent callers for every system."
)
@click.option(
    "--total", default="256MiB", show_default=True, help="Bytes stored and loaded per measurement."
)
@click.option("--rounds", default=str(ROUNDS), show_default=True, help="Rounds per size.")
@click.option(
    "--json", "json_path", default="", help="Also write the results as JSON to this file."
)
@click.option("--plot", "png_path", default="", help="Also draw a bar chart (PNG) to this file.")
def command(
    sizes: str,
    systems: str,
    concurrency: str,
    total: str,
    rounds: str,
    json_path: str,
    png_path: str,
) -> None:
    """PolarKV (tcp, shm), Redis and Mooncake Store beside the raw socket limit, one run."""
    core.guarded(
        "peers",
        lambda: run(parse_plan(sizes, systems, concurrency, total, rounds), json_path, png_path),
    )
