"""The measurements behind docs/BENCHMARKS.md's write-behind figures (section "Event
loop, grant MACs, and where a 1M-entry manager spends its time"), on the loop's side and
in the store's thread:

- building 100k entry rows (what `take_changes` makes per changed key) and turning them
  into statement parameters (what the SQLite thread did per row under the GIL);
- `take_changes` over 4,000 ready and 4,000 deleted keys of a 200k-entry core;
- `SqliteStore._write` of one 200k-row batch, then steady batches of 4,000 new rows and
  4,000 deletions (what 0.2 s of 64-key evicting allocations change), thread CPU.

Runs against whichever tree is on PYTHONPATH, so the same command measures before and
after a change:

    PYTHONPATH=. python scripts/measure_write_behind.py
"""

from __future__ import annotations

import os
import random
import tempfile
import time
import timeit
from collections.abc import Callable

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.rows import ENTRY_COLUMNS, Batch, EntryRow, NodeRow
from polarkv_lib.manager.store import SqliteStore
from tests.unit.drive import confirm_all, synthetic_rows

ROWS = 100_000
TABLE = 200_000
STEADY = 4_000


def best_ms(fn: Callable[[], object], repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=1, repeat=repeat)) * 1e3


def row(i: int) -> EntryRow:
    return EntryRow(
        f"{i:032x}", "n1", 7, 65536, "0123456789abcdef", i * 65536, 65536, True, False, 0, 1.7e9
    )


def rows_and_parameters() -> None:
    fields = [
        (f"{i:032x}", "n1", 7, 65536, "0123456789abcdef", i * 65536, 65536, True, False, 0, 1.7e9)
        for i in range(ROWS)
    ]
    rows = [EntryRow(*f) for f in fields]

    def parameters() -> list[tuple[object, ...]]:
        if isinstance(rows[0], tuple):  # rows are their own parameters
            return list(rows)
        return [tuple(getattr(e, c) for c in ENTRY_COLUMNS) for e in rows]

    print(f"build {ROWS:,} EntryRow: {best_ms(lambda: [EntryRow(*f) for f in fields]):.1f} ms")
    print(f"their statement parameters: {best_ms(parameters):.1f} ms")


def take_changes() -> None:
    md = Metadata(5.0, 30.0, 3.0, rng=random.Random(1))
    node = NodeRow("n1", 1, "127.0.0.1:1", TABLE * 65536, 0, "", "h", "tcp")
    rows = synthetic_rows(node, TABLE, 65536)
    md.snapshots.restore([node], rows)
    md.register("n1", 1, node.address, node.capacity, "", "h", ["tcp"], 0)
    confirm_all(md, "n1", 1)
    while md.snapshots.restore_step(100_000):
        pass
    ready = random.Random(2).sample([r.key for r in rows], STEADY)
    gone = [f"{i:032x}" for i in range(10**9, 10**9 + STEADY)]

    def once() -> Batch:
        md.snapshots.tables.dirty_keys.update(ready)
        md.snapshots.tables.dirty_keys.update(gone)
        return md.snapshots.take_changes()

    print(
        f"take_changes, {STEADY:,} ready + {STEADY:,} deleted keys: "
        f"{best_ms(once, repeat=20):.2f} ms"
    )


def sqlite_writes() -> None:
    store = SqliteStore(os.path.join(tempfile.mkdtemp(), "meta.db"))
    store._open()
    started = time.thread_time()
    store._write(Batch([], [row(i) for i in range(TABLE)], []))
    first = time.thread_time() - started
    cpu = []
    low, high = 0, TABLE
    for _ in range(8):
        batch = Batch(
            [],
            [row(i) for i in range(high, high + STEADY)],
            [f"{i:032x}" for i in range(low, low + STEADY)],
        )
        low, high = low + STEADY, high + STEADY
        started = time.thread_time()
        store._write(batch)
        cpu.append(time.thread_time() - started)
    print(
        f"SqliteStore._write: {TABLE:,} rows in one batch {first * 1e3:.0f} ms CPU; "
        f"steady batch {STEADY:,} + {STEADY:,}: median {sorted(cpu)[4] * 1e3:.1f} ms CPU"
    )


if __name__ == "__main__":
    rows_and_parameters()
    take_changes()
    sqlite_writes()
