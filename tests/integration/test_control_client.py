"""The control client's one error mapping, in process: a real aiohttp server answers
each way a manager can fail, and every failure arrives as one class of the error tree,
within the caller's deadline."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from polarkv_lib.client.admin import AdminClient
from polarkv_lib.client.control import ControlClient
from polarkv_lib.errors import (
    AccessDenied,
    BadRequest,
    NetworkError,
    OperationTimeout,
    PolarKVError,
    ProtocolError,
)
from polarkv_lib.wire.control import NodeRef
from tests.conftest import free_port


def _json(status: int, body: object) -> web.Response:
    return web.json_response(body, status=status)


async def _slow(request: web.Request) -> web.Response:
    await asyncio.sleep(30)
    return _json(200, {})


def _fixed(
    status: int, body: object, text: bool = False
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        if text:
            return web.Response(text=str(body), status=status)
        return _json(status, body)

    return handler


ROUTES = {
    "/ok": _fixed(200, {"entries": [], "hits": 0}),
    "/401": _fixed(401, {"error": "missing bearer token"}),
    "/403": _fixed(403, {"error": "this operation needs the admin token"}),
    "/404": _fixed(404, {"error": "unknown node or incarnation; register again"}),
    "/500": _fixed(500, {"error": "internal error"}),
    "/text": _fixed(502, "<html>proxy error</html>", text=True),
    "/list": _fixed(200, [1, 2, 3]),
}


@pytest.fixture
async def manager_like() -> AsyncIterator[str]:
    app = web.Application()
    for path, handler in ROUTES.items():
        app.router.add_post(path, handler)
        app.router.add_get(path, handler)
    app.router.add_post("/slow", _slow)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("path", "error", "status"),
    [
        ("/401", AccessDenied, 401),
        ("/403", AccessDenied, 403),
        ("/404", BadRequest, 404),
        ("/500", BadRequest, 500),
        ("/text", BadRequest, 502),
        ("/list", ProtocolError, None),
    ],
)
async def test_each_refusal_is_one_error_class(
    manager_like: str, path: str, error: type[PolarKVError], status: int | None
) -> None:
    control = ControlClient(manager_like, token=None)
    try:
        with pytest.raises(error) as caught:
            await control.post(path, {}, time.monotonic() + 2)
        if status is not None:
            assert getattr(caught.value, "status", None) == status
        assert await control.post("/ok", {}, time.monotonic() + 2) == {"entries": [], "hits": 0}
    finally:
        await control.close()


async def test_a_silent_manager_costs_the_deadline_then_the_breaker_answers_at_once(
    manager_like: str,
) -> None:
    control = ControlClient(manager_like, token=None, breaker_interval=5.0)
    try:
        started = time.monotonic()
        with pytest.raises(OperationTimeout):
            await control.post("/slow", {}, started + 0.3)
        assert 0.25 < time.monotonic() - started < 1.5
        started = time.monotonic()
        with pytest.raises(NetworkError, match="did not answer recently"):
            await control.post("/ok", {}, started + 2)
        assert time.monotonic() - started < 0.1  # the breaker: no second wait
    finally:
        await control.close()


async def test_node_calls_are_bounded_by_their_timeout(manager_like: str) -> None:
    control = ControlClient(manager_like + "/slow-manager", token=None, breaker_interval=0)
    # /slow-manager/v1/nodes/heartbeat does not exist: a 404 arrives, a BadRequest
    with pytest.raises(BadRequest) as caught:
        await control.heartbeat(NodeRef("n1", 1), {}, time.monotonic() + 2)
    assert caught.value.status == 404
    await control.close()


async def test_an_unreachable_manager_is_a_network_error() -> None:
    port = free_port()  # nothing listens there
    control = ControlClient(f"http://127.0.0.1:{port}", token=None, breaker_interval=0)
    try:
        with pytest.raises(NetworkError):
            await control.orders(NodeRef("n1", 1), 0, time.monotonic() + 2)
        with pytest.raises(NetworkError):  # no breaker for nodes: every call tries again
            await control.orders(NodeRef("n1", 1), 0, time.monotonic() + 2)
    finally:
        await control.close()


async def test_a_hung_connection_is_a_timeout_not_a_hang() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    port = listener.getsockname()[1]
    control = ControlClient(f"http://127.0.0.1:{port}", token=None, breaker_interval=0)
    try:
        started = time.monotonic()
        with pytest.raises(OperationTimeout):
            await control.heartbeat(NodeRef("n1", 1), {}, started + 0.5)
        assert time.monotonic() - started < 2.0
    finally:
        await control.close()
        listener.close()


async def test_the_admin_client_maps_the_same_way(manager_like: str) -> None:
    admin = AdminClient(manager_like, timeout=2)

    def calls() -> list[str]:
        seen = []
        for path in ("/401", "/403", "/404", "/500"):
            try:
                admin.call("GET", path)
            except PolarKVError as exc:
                seen.append(f"{type(exc).__name__}:{getattr(exc, 'status', '')}")
        return seen

    seen = await asyncio.to_thread(calls)  # blocking client: off the loop that serves
    assert seen == ["AccessDenied:401", "AccessDenied:403", "BadRequest:404", "BadRequest:500"]
    status, body = await asyncio.to_thread(admin.request, "GET", "/404")
    assert status == 404 and "register again" in body["error"]


def test_the_admin_client_says_unreachable_or_silent() -> None:
    with pytest.raises(NetworkError, match="cannot reach the manager"):
        AdminClient(f"http://127.0.0.1:{free_port()}").stats()
    with socket.create_server(("127.0.0.1", 0)) as silent:
        started = time.monotonic()
        with pytest.raises(OperationTimeout):
            AdminClient(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=0.5).stats()
        assert time.monotonic() - started < 2.0
