"""The disk role against a manager that fails: results it could not report are kept and
reported again, once; results the manager will never take (it forgot the node) are
dropped, not retried forever. The manager side is a small aiohttp app that fails on
purpose (fault injection on the HTTP surface), the disk role and its files are real."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import xxhash
from aiohttp import web

from polarkv_lib.client.control import ControlClient, NodeRef
from polarkv_lib.node.disk import DiskStore
from polarkv_lib.node.disk_role import DiskRole
from polarkv_lib.node.fence import Fence
from polarkv_lib.wire.orders import Order, TierOp
from tests.conftest import free_port

KEY = "00112233445566778899aabbccddeeff"
SIZE = 64 * 1024


@dataclass
class FailingManager:
    """Hands out one offload order; answers /v1/nodes/done with `done_statuses` in turn."""

    order: dict[str, Any]
    done_statuses: list[int]
    reports: list[list[dict[str, Any]]] = field(default_factory=list)
    given: bool = False
    reported: asyncio.Event = field(default_factory=asyncio.Event)  # any report arrived
    taken: asyncio.Event = field(default_factory=asyncio.Event)  # a report answered 200

    async def orders(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not self.given:
            self.given = True
            return web.json_response({"orders": [self.order]})
        await asyncio.sleep(min(float(body["wait"]), 0.2))
        return web.json_response({"orders": []})

    async def done(self, request: web.Request) -> web.Response:
        body = await request.json()
        status = self.done_statuses.pop(0) if self.done_statuses else 200
        self.reports.append(body["results"])
        self.reported.set()
        if status == 200:
            self.taken.set()
        return web.json_response({"ok": status == 200, "error": "injected"}, status=status)


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(manager: FailingManager) -> str:
        app = web.Application()
        app.router.add_post("/v1/nodes/orders", manager.orders)
        app.router.add_post("/v1/nodes/done", manager.done)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    try:
        yield start
    finally:
        for runner in runners:
            await runner.cleanup()


async def _run_role(
    tmp_path: Path, manager: FailingManager, url: str, until: asyncio.Event, settle: float
) -> DiskRole:
    buffer = bytearray(SIZE)
    buffer[:] = bytes(range(256)) * (SIZE // 256)
    store = DiskStore((str(tmp_path / "disk"),), 16 * 1024**2, False)
    await asyncio.to_thread(store.scan)
    role = DiskRole(store, memoryview(buffer), "n1", io_threads=1, fence=Fence(SIZE))
    control = ControlClient(url, None, breaker_interval=0)
    ready = asyncio.Event()
    ready.set()
    role.start(control, lambda: NodeRef("n1", 1), ready)
    try:
        await asyncio.wait_for(until.wait(), 15)
        await asyncio.sleep(settle)  # room for a wrong extra report to show up
    finally:
        await role.stop()
        await control.close()
    return role


def _order() -> dict[str, Any]:
    data = (bytes(range(256)) * (SIZE // 256))[:SIZE]
    return Order(
        TierOp.OFFLOAD, KEY, 7, "n1", 0, SIZE, SIZE, xxhash.xxh3_64_hexdigest(data)
    ).to_json()


async def test_unreported_results_are_reported_again_once(serve: Any, tmp_path: Path) -> None:
    manager = FailingManager(_order(), done_statuses=[503, 502])
    role = await _run_role(tmp_path, manager, await serve(manager), manager.taken, settle=0.5)
    assert [len(batch) for batch in manager.reports] == [1, 1, 1]  # two failures, then taken
    result = manager.reports[-1][0]
    assert (result["op"], result["key"], result["gen"], result["ok"]) == ("offload", KEY, 7, True)
    assert KEY in role.store.files  # the file was written once, whatever the reports did


async def test_results_a_manager_refuses_are_dropped(serve: Any, tmp_path: Path) -> None:
    manager = FailingManager(_order(), done_statuses=[404])
    await _run_role(tmp_path, manager, await serve(manager), manager.reported, settle=0.6)
    assert len(manager.reports) == 1  # 404: the manager forgot this node; no retry loop


async def test_an_order_for_another_node_is_refused_as_wrong_node(
    serve: Any, tmp_path: Path
) -> None:
    order = _order() | {"node": "someone-else"}
    manager = FailingManager(order, done_statuses=[])
    role = await _run_role(tmp_path, manager, await serve(manager), manager.reported, settle=0.1)
    result = manager.reports[0][0]
    assert (result["ok"], result["reason"]) == (False, "wrong_node")  # not an I/O error
    assert role.bytes_for_other_nodes == SIZE and KEY not in role.store.files
