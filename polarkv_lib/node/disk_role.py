"""The disk role's event-loop side: take orders from the manager, run them on the
DiskStore in a thread pool, report results.

Orders come by long poll (`/v1/nodes/orders`): the slab process is only ever a client of
the manager, so no extra port is opened and the same token protects it. Results go back
as soon as they are ready (`/v1/nodes/done`), batched while a report is in flight, so a
client waiting on a reload waits for its file, not for a timer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from polarkv_lib.node.disk import DiskFailure, DiskStore, Failure

log = structlog.get_logger("polarkv.disk")
Post = Callable[[str, dict[str, Any], float], Awaitable[tuple[int, dict[str, Any]]]]
POLL_WAIT = 5.0


class DiskRole:
    def __init__(self, store: DiskStore, buffer: memoryview, node_id: str, io_threads: int) -> None:
        self.store = store
        self._buffer = buffer
        self._node_id = node_id
        # Bytes of orders that named another node's buffer. Tiering never crosses nodes:
        # such an order is refused, and this counter shows whether the manager ever tried.
        self.bytes_for_other_nodes = 0
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="polarkv-disk")
        self._results: list[dict[str, Any]] = []
        self._have_results = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failures: dict[str, int] = {}

    def inventory(self) -> list[dict[str, Any]]:
        return [{"key": f.key, "size": f.size, "checksum": f.checksum, "file_bytes": f.file_bytes}
                for f in self.store.files.values()]

    def start(self, post: Post, ref: Callable[[], dict[str, Any]], ready: asyncio.Event) -> None:
        for coro, name in ((self._poll(post, ref, ready), "disk-orders"),
                           (self._report(post, ref, ready), "disk-results")):
            self._tasks.add(asyncio.create_task(coro, name=name))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self._pool.shutdown, True)

    async def _poll(self, post: Post, ref: Callable[[], dict[str, Any]], ready: asyncio.Event) -> None:
        while True:
            await ready.wait()
            try:
                status, body = await post("/v1/nodes/orders", {**ref(), "wait": POLL_WAIT}, POLL_WAIT + 5)
            except Exception as exc:  # manager down: the heartbeat loop says so; retry
                log.debug("order poll failed", error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            if status != 200:
                await asyncio.sleep(0.5)
                continue
            for order in body.get("orders", []):
                task = asyncio.create_task(self._run(order))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _run(self, order: dict[str, Any]) -> None:
        op, key = order["op"], order["key"]
        started = time.perf_counter()
        result: dict[str, Any] = {"op": op, "key": key, "gen": order.get("gen", 0), "ok": True}
        loop = asyncio.get_running_loop()
        try:
            if order.get("node") != self._node_id:
                self.bytes_for_other_nodes += int(order.get("size", 0))
                raise DiskFailure(Failure.IO_ERROR, f"order for node {order.get('node')!r}, not this one")
            if op == "delete":
                await loop.run_in_executor(self._pool, self.store.delete, key)
            else:
                offset, size, checksum = int(order["offset"]), int(order["size"]), order["checksum"]
                region = self._buffer[offset: offset + int(order["extent"])]
                if op == "offload":
                    result["file_bytes"] = await loop.run_in_executor(
                        self._pool, self.store.offload, key, region, size, checksum)
                else:
                    await loop.run_in_executor(self._pool, self.store.reload, key, region, size, checksum)
        except DiskFailure as failure:
            result.update(ok=False, reason=failure.reason.value)
            self.failures[failure.reason.value] = self.failures.get(failure.reason.value, 0) + 1
            log.warning(f"{op} failed", key=key, reason=failure.reason.value, detail=str(failure))
        except Exception as exc:  # never let one order take the role down
            result.update(ok=False, reason=Failure.IO_ERROR.value)
            log.exception(f"{op} crashed", key=key, error=repr(exc))
        result["seconds"] = time.perf_counter() - started
        self._results.append(result)
        self._have_results.set()

    async def _report(self, post: Post, ref: Callable[[], dict[str, Any]], ready: asyncio.Event) -> None:
        while True:
            await self._have_results.wait()
            await ready.wait()
            self._have_results.clear()
            batch, self._results = self._results, []
            try:
                status, _ = await post("/v1/nodes/done", {**ref(), "results": batch}, 5.0)
            except Exception as exc:
                status = 0
                log.debug("result report failed", error=repr(exc))
            if status >= 500 or status == 0:  # keep them for the next try
                self._results = batch + self._results
                self._have_results.set()
                await asyncio.sleep(0.2)
