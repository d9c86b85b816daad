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

import os
import statistics
import subprocess
import sys
import tempfile
import time

import click

from polarkv_lib.tools.bench import core, manager_shards
from polarkv_lib.tools.bench.manager_load import one_table
from polarkv_lib.tools.bench.manager_plan import Plan, Row, Table, parse_plan


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
                tables.append(one_table(plan, n, os.path.join(workdir, str(n)), bare.url, rows))
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


def run_shards(plan: Plan, counts: list[int], json_path: str) -> bool:
    """The shard part (bench/manager_shards.py): the first --entries over N shards."""
    n = plan.entries[0]
    print(
        f"polarkv bench manager --shards: {core.machine_text()}; {n:,} entries of {plan.size} B "
        f"over {counts} shard(s), {plan.concurrency} client tasks, {plan.rounds} rounds of "
        f"{plan.seconds:g}s; rates: best round",
        flush=True,
    )
    started = time.monotonic()
    rows: list[manager_shards.ShardRow] = []
    with tempfile.TemporaryDirectory(prefix="polarkv-bench-shards-") as workdir:
        for count in counts:
            rows += manager_shards.one_count(plan, count, n, workdir)
            print(
                f"{count} shard(s): "
                + ", ".join(
                    f"{r.op} {r.pairs_per_s[r.best()]:,.0f}/s on {r.manager_cores[r.best()]:.2f} cores"
                    for r in rows
                    if r.shards == count
                ),
                flush=True,
            )
    print(manager_shards.render(rows))
    print(f"({time.monotonic() - started:.0f}s)")
    if json_path:
        core.write_json(
            json_path,
            "manager-shards",
            {"entries": n, "size": plan.size, "shards": counts, "seconds": plan.seconds},
            [],
            {"shards": [r.to_json() for r in rows]},
        )
    return not any(r.notes for r in rows)


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
    "--shards",
    default="",
    help="Instead: shard counts (e.g. 1,2,4); the first --entries spread over each count.",
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
    shards: str,
    json_path: str,
) -> None:
    """Manager lookups/s and allocations/s at growing table sizes beside a bare aiohttp
    handler; restart and memory per entry. With --shards: the aggregate rates of N shards
    behind one client pool, per core used."""

    def go() -> bool:
        plan = parse_plan(entries, size, seconds, rounds, concurrency, restart)
        if shards:
            return run_shards(plan, core.parse_ints(shards, "--shards", 1, 16), json_path)
        return run(plan, json_path)

    core.guarded("manager", go)
