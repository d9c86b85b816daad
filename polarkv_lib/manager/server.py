"""The manager's HTTP server: aiohttp's, with bounds on how slowly a client may send.

aiohttp bounds only the wait for a request on an idle connection (`keepalive_timeout`),
and that from the connection's start or the end of the last reply, not from when a
request began: a client that never completes its request line and headers, or trickles
its body, holds a connection and a handler as long as it likes, and a body refused
half-way (413) is still read, and thrown away, for `lingering_time` afterwards. Here:

- `manager.header_timeout`: a request's line and headers must be in within this of the
  connection's start, or of the first byte of a later request (slowloris, and
  connections that never send a byte, are closed);
- `manager.body_timeout`: the body must be in within this of the headers; a handler
  still reading it then fails with 408 (BodyTimeout) and the connection closes;
- `manager.idle_timeout`: aiohttp's keep-alive, no request for this long;
- a reply to a request whose body was not read to its end (refused as too large, of the
  wrong type, or answered before reading) carries `Connection: close` and ends the
  connection: nothing more of that body is read.

The timers live in a RequestHandler subclass (aiohttp's per-connection protocol), which
`TimedRunner` makes its server create. They read two pieces of that class's state, as
a subclass may: its queue of parsed requests and the future it waits on for the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from polarkv_lib.errors import BadRequest


@dataclass(frozen=True, slots=True)
class Timeouts:
    header: float
    body: float
    idle: float


class BodyTimeout(BadRequest):
    """The body did not arrive within body_timeout: 408, and the connection closes."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"request body not received within {seconds:g} s", 408)


class _Timer:
    """At most one pending call: started again, it replaces the one before."""

    __slots__ = ("_handle", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def start(self, delay: float, callback: Callable[[], None]) -> None:
        self.stop()
        self._handle = self._loop.call_later(delay, self._fire, callback)

    def _fire(self, callback: Callable[[], None]) -> None:
        self._handle = None
        callback()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _TimedHandler(RequestHandler):
    __slots__ = ("_body_timer", "_head_timer", "_timeouts")

    def __init__(self, manager: web.Server, timeouts: Timeouts, **kwargs: Any) -> None:
        # lingering_time=0: a body not read to its end is not read after the reply either
        super().__init__(manager, keepalive_timeout=timeouts.idle, lingering_time=0, **kwargs)
        self._timeouts = timeouts
        self._head_timer = _Timer(self._loop)
        self._body_timer = _Timer(self._loop)

    def _waiting_for_head(self) -> bool:
        """No request is parsed or being handled: start() waits for the next one."""
        return self._waiter is not None and not self._waiter.done()

    def _head_overdue(self) -> None:
        if self._waiting_for_head():
            self.force_close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # the first request's head, from the connection's start
        self._head_timer.start(self._timeouts.header, self._head_overdue)

    def data_received(self, data: bytes) -> None:
        if not self._head_timer.armed and self._waiting_for_head():
            # the first byte of a later request
            self._head_timer.start(self._timeouts.header, self._head_overdue)
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:  # a request's head is in
            self._head_timer.stop()
            _, payload = self._messages[-1]
            if payload.is_eof():
                self._body_timer.stop()
            else:
                self._body_timer.start(self._timeouts.body, partial(self._body_overdue, payload))

    def _body_overdue(self, payload: StreamReader) -> None:
        if not payload.is_eof():
            payload.set_exception(BodyTimeout(self._timeouts.body))

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        self._body_timer.stop()
        if not request.content.is_eof() and resp is not None:
            resp.force_close()  # the rest of this body is never read: say the connection ends
        return await super().finish_response(request, resp, start_time)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._head_timer.stop()
        self._body_timer.stop()
        super().connection_lost(exc)


class _TimedServer(web.Server):
    """aiohttp's server, making timed connections (it has no class to make them of)."""

    def __init__(self, *args: Any, timeouts: Timeouts, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timeouts = timeouts

    def __call__(self) -> RequestHandler:
        return _TimedHandler(self, self._timeouts, loop=self._loop, **self._kwargs)


class TimedRunner(web.AppRunner):
    """An AppRunner whose connections carry the timeouts above."""

    __slots__ = ("_timeouts",)

    def __init__(self, app: web.Application, timeouts: Timeouts, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._timeouts = timeouts

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts and freezes the app
        return _TimedServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            timeouts=self._timeouts,
            **self._kwargs,
        )
