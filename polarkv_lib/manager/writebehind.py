"""The manager's write-behind task: what changed in the core goes to the metadata store
(manager/store.py) every `manager.metadata_flush`, in one batch.

A batch taken from the core and not written (store down, or the task cancelled in the
middle of a write) is marked changed again, so it is never lost while the process
lives. A graceful stop never cancels a write: it asks the task for one last flush of
everything committed until then and waits for it, within a bound.

Rounds are numbered: `taken_seq` counts the rounds that have taken changes from the
core, `flushed_seq` is the number of the last round written whole (an empty round
counts). A change committed before `taken_seq` read n is in the store once
`flushed_seq` > n: round n + 1 took it (or its requeued batch went with a later one).
/healthz shows both, so tests and benchmarks wait for a flush instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from polarkv_lib.logs import Events
from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.events import EventRing, Kind
from polarkv_lib.manager.store import MetadataStore

log = structlog.get_logger("polarkv.manager")
FINAL_FLUSH_BOUND = 5.0  # within runner.py's MANAGER_STOP_BOUND, after the HTTP drain (2 s)
MAX_BACKOFF = 5.0


class WriteBehind:
    def __init__(
        self, meta: Metadata, store: MetadataStore, events: EventRing, interval: float
    ) -> None:
        self.meta = meta
        self.store = store
        self.events = events
        self.interval = interval
        self.failures = 0  # consecutive failed writes (0: the store is caught up)
        self.taken_seq = 0  # rounds that took changes from the core
        self.flushed_seq = 0  # the last round written whole
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="manager-write-behind")

    async def stop(self) -> None:
        """The last flush of everything changed until now, then the store closes."""
        self._stopping.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), FINAL_FLUSH_BOUND)
            except TimeoutError:
                log.error(
                    "final metadata flush failed", error="not done in time", bound=FINAL_FLUSH_BOUND
                )
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        await self.store.close()

    async def flush(self) -> bool:
        """Write what changed since the last flush. False if the store failed (kept)."""
        batch = self.meta.snapshots.take_changes()
        self.taken_seq += 1
        seq = self.taken_seq
        if not len(batch):
            self.flushed_seq = seq
            return True
        try:
            await self.store.write(batch)
        except asyncio.CancelledError:  # maybe not written: mark its keys again
            self.meta.snapshots.requeue(batch)
            raise
        except Exception as exc:  # store down: keep the changes, retry later
            self.meta.snapshots.requeue(batch)
            self.failures += 1
            if self.failures == 1:
                self.events.add(
                    Kind.STORE_RETRYING, "metadata", f"metadata store retrying: {exc!r:.200}"
                )
            if self.failures == 1 or self.failures % 50 == 0:
                log.warning(
                    Events.STORE_RETRYING,
                    error=repr(exc),
                    failures=self.failures,
                )
            return False
        if self.failures:
            log.info(Events.STORE_CAUGHT_UP, after_failures=self.failures)
            self.events.add(Kind.STORE_CAUGHT_UP, "metadata", "metadata store caught up")
            self.failures = 0
        self.flushed_seq = seq
        return True

    async def _loop(self) -> None:
        backoff = self.interval
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            ok = await self.flush()
            backoff = self.interval if ok else min(backoff * 2, MAX_BACKOFF)
        while True:  # the final flush: stop() bounds how long we try
            if await self.flush():
                return
            await asyncio.sleep(0.2)
