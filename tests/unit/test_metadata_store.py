"""The SQLite metadata store (polarkv_lib/manager/store.py): batches of any size, written
many rows per statement, read back exactly, across tenants."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from polarkv_lib.keys import ident
from polarkv_lib.manager import store as store_module
from polarkv_lib.manager.rows import Batch, EntryRow, NodeRow
from polarkv_lib.manager.store import SqliteStore

NODE = NodeRow("n1", 7, "127.0.0.1:9", 1 << 30, 0, "", "h", "tcp")


def row(i: int, tenant: str = "", in_memory: bool = True) -> EntryRow:
    return EntryRow(
        f"{i:032x}", "n1", 7, 4096 + i, f"{i:016x}", i * 8192, 8192, in_memory, not in_memory,
        0 if in_memory else 12288, 1.7e9 + i / 8, tenant,
    )  # fmt: skip


@pytest.mark.parametrize("chunk", [1, 3, store_module.ROWS_PER_STATEMENT])
def test_batches_of_any_size_read_back_exactly(tmp_path: Path, chunk: int) -> None:
    async def go() -> None:
        store = SqliteStore(str(tmp_path / "meta.db"))
        await store.open()
        store._chunk = chunk  # a small limit: whole statements and the rest after them
        store._upsert_chunk = store_module._upsert_rows_sqlite(chunk)
        store._delete_chunk = store_module._delete_rows_sqlite(chunk)
        # 700 rows: two tenants, memory and disk rows, then changes, then deletions
        rows = {ident(r.tenant, r.key): r for i in range(700) for r in [row(i, "t" * (i % 2))]}
        await store.write(Batch([NODE], list(rows.values()), []))
        changed = [row(i, "t" * (i % 2), in_memory=False) for i in range(0, 700, 3)]
        rows.update({ident(r.tenant, r.key): r for r in changed})
        gone = [k for k in rows if int(k[:32], 16) % 5 == 0]
        for k in gone:
            del rows[k]
        await store.write(Batch([], changed, [*gone, ident("t", "f" * 32)]))  # and one unknown
        nodes, entries = await store.load()
        await store.close()
        assert nodes == [NODE]
        assert sorted(entries) == sorted(rows.values())
        assert all(type(e.in_memory) is bool and type(e.on_disk) is bool for e in entries)

    asyncio.run(go())
