"""The metadata write-behind's round numbers (manager/writebehind.py): what a test or a
benchmark waits for instead of sleeping past `manager.metadata_flush`."""

from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path

from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.events import EventRing, Kind
from polarkv_lib.manager.model import AllocStatus
from polarkv_lib.manager.rows import Batch
from polarkv_lib.manager.store import SqliteStore
from polarkv_lib.manager.writebehind import WriteBehind
from tests.unit.drive import FakeClock, allocate

KEY = hashlib.blake2b(b"write-behind", digest_size=16).hexdigest()


class FlakyStore(SqliteStore):
    """The real SQLite store, whose writes fail while `down` is set (a store outage)."""

    down = False

    async def write(self, batch: Batch) -> None:
        if self.down:
            raise OSError("metadata store unreachable")
        await super().write(batch)


def committed(md: Metadata) -> None:
    md.register("m1", 1, "127.0.0.1:1", 1 << 20, "", "h", ["tcp"])
    results, lease = allocate(md, [(KEY, 4096)])
    assert results[0].status is AllocStatus.ALLOCATED and lease is not None
    assert md.commit(lease, [(KEY, "0123456789abcdef")]) == {KEY: "committed"}


def test_a_round_that_began_after_a_commit_has_it_in_the_store(tmp_path: Path) -> None:
    async def run() -> None:
        md = Metadata(5.0, 30.0, 3.0, clock=FakeClock(), rng=random.Random(1))
        store = FlakyStore(str(tmp_path / "meta.db"))
        await store.open()
        events = EventRing()
        writer = WriteBehind(md, store, events, interval=60.0)  # rounds run by hand here
        assert (writer.taken_seq, writer.flushed_seq) == (0, 0)
        assert await writer.flush()  # nothing changed: an empty round still counts
        assert (writer.taken_seq, writer.flushed_seq) == (1, 1)

        committed(md)
        seen = writer.taken_seq
        store.down = True
        assert not await writer.flush()  # taken, not written: kept for the next round
        assert writer.taken_seq == seen + 1 and writer.flushed_seq == seen
        assert [e["kind"] for e in events.since(0)] == [Kind.STORE_RETRYING.value]
        _, rows = await store.load()
        assert rows == []  # what a waiter must not be told is stored

        store.down = False
        assert await writer.flush()  # the requeued batch goes with a later round
        assert writer.flushed_seq == writer.taken_seq == seen + 2 > seen
        _, rows = await store.load()
        assert [r.key for r in rows] == [KEY]
        await writer.stop()

    asyncio.run(run())
