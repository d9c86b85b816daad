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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from polarkv_lib.client.control import ControlClient, NodeRef
from polarkv_lib.errors import AccessDenied, BadRequest, DiskFailure, Failure, PolarKVError
from polarkv_lib.logs import Events
from polarkv_lib.node.disk import DiskStore
from polarkv_lib.node.fence import Fence
from polarkv_lib.wire.orders import Order, OrderResult, TierOp

log = structlog.get_logger("polarkv.disk")
POLL_WAIT = 5.0
POLL_SLACK = 5.0  # beyond the long poll's wait, for the reply to arrive
REPORT_TIMEOUT = 5.0
RETRY_DELAY = 0.5
REPORT_RETRY_DELAY = 0.2


class DiskRole:
    def __init__(
        self,
        store: DiskStore,
        buffer: memoryview,
        node_id: str,
        io_threads: int,
        fence: Fence,
    ) -> None:
        """`fence` is the data server's: a reload claims its extent there."""
        self.store = store
        self._buffer = buffer
        self._fence = fence
        self._node_id = node_id
        # Bytes of orders that named another node's buffer. Tiering never crosses nodes:
        # such an order is refused, and this counter shows whether the manager ever tried.
        self.bytes_for_other_nodes = 0
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="polarkv-disk")
        self._results: list[OrderResult] = []
        self._have_results = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failures: dict[str, int] = {}

    def inventory(self) -> list[dict[str, Any]]:
        return [
            {"key": f.key, "size": f.size, "checksum": f.checksum, "file_bytes": f.file_bytes}
            for f in self.store.files.values()
        ]

    def start(
        self, control: ControlClient, ref: Callable[[], NodeRef], ready: asyncio.Event
    ) -> None:
        for coro, name in (
            (self._poll(control, ref, ready), "disk-orders"),
            (self._report(control, ref, ready), "disk-results"),
        ):
            self._tasks.add(asyncio.create_task(coro, name=name))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self._pool.shutdown, True)

    async def _poll(
        self, control: ControlClient, ref: Callable[[], NodeRef], ready: asyncio.Event
    ) -> None:
        while True:
            await ready.wait()
            try:
                orders = await control.orders(
                    ref(), POLL_WAIT, time.monotonic() + POLL_WAIT + POLL_SLACK
                )
            except PolarKVError as exc:  # manager down or forgot us: the heartbeat loop acts
                log.debug(Events.ORDER_POLL_FAILED, error=str(exc))
                await asyncio.sleep(RETRY_DELAY)
                continue
            for order in orders:
                task = asyncio.create_task(self._run(order))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _run(self, order: Order) -> None:
        started = time.perf_counter()
        file_bytes, reason = 0, ""
        try:
            file_bytes = await self._execute(order)
        except DiskFailure as failure:
            reason = failure.reason.value
            self.failures[reason] = self.failures.get(reason, 0) + 1
            log.warning(
                Events.ORDER_FAILED,
                op=order.op.value,
                key=order.key,
                reason=reason,
                detail=str(failure),
            )
        except Exception as exc:  # never let one order take the role down
            reason = Failure.IO_ERROR.value
            log.exception(Events.ORDER_CRASHED, op=order.op.value, key=order.key, error=repr(exc))
        self._results.append(
            OrderResult(
                order.op,
                order.key,
                order.gen,
                not reason,
                reason,
                file_bytes,
                time.perf_counter() - started,
            )
        )
        self._have_results.set()

    async def _execute(self, order: Order) -> int:
        """Run one order on the store's threads; the file's size after an offload."""
        if order.node != self._node_id:
            self.bytes_for_other_nodes += order.size
            raise DiskFailure(Failure.WRONG_NODE, f"order for node {order.node!r}, not this one")
        loop = asyncio.get_running_loop()
        if order.op is TierOp.DELETE:
            await loop.run_in_executor(self._pool, self.store.delete, order.key)
            return 0
        region = self._buffer[order.offset : order.offset + order.extent]
        if order.op is TierOp.OFFLOAD:
            return await loop.run_in_executor(
                self._pool, self.store.offload, order.key, region, order.size, order.checksum
            )
        await loop.run_in_executor(self._pool, self._reload, order, region)
        return 0

    def _reload(self, order: Order, region: memoryview) -> None:
        """A reload claims its extent for the entry's (fresh) generation first: grants of
        the extent's previous occupants stop working before the file's bytes land."""
        try:
            token = self._fence.enter(order.offset, order.extent, order.gen, claim=True)
        except AccessDenied as exc:
            raise DiskFailure(
                Failure.IO_ERROR, f"reload into space a newer entry holds: {exc}"
            ) from None
        try:
            self.store.reload(order.key, region, order.size, order.checksum)
        finally:
            self._fence.leave(token)

    async def _report(
        self, control: ControlClient, ref: Callable[[], NodeRef], ready: asyncio.Event
    ) -> None:
        while True:
            await self._have_results.wait()
            await ready.wait()
            self._have_results.clear()
            batch, self._results = self._results, []
            try:
                await control.done(ref(), batch, time.monotonic() + REPORT_TIMEOUT)
            except BadRequest as exc:
                # 4xx: the manager will never take these (it forgot this incarnation, or
                # refuses the batch); its order generations make them stale anyway.
                log.debug(Events.REPORT_FAILED, error=str(exc))
                if exc.status >= 500:
                    await self._requeue(batch)
            except PolarKVError as exc:  # unreachable or slow: keep them for the next try
                log.debug(Events.REPORT_FAILED, error=str(exc))
                await self._requeue(batch)

    async def _requeue(self, batch: list[OrderResult]) -> None:
        self._results = batch + self._results
        self._have_results.set()
        await asyncio.sleep(REPORT_RETRY_DELAY)
