"""The client's side of the control API: one JSON POST per batch, bounded by a deadline.

aiohttp and JSON errors are translated here into the PolarKV error tree, so the layers
above deal with four outcomes only: a parsed reply, NetworkError, OperationTimeout,
or AccessDenied / BadRequest for what the manager refused.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import orjson

from polarkv_lib.client.breaker import CircuitBreaker
from polarkv_lib.errors import (
    AccessDenied,
    BadRequest,
    NetworkError,
    OperationTimeout,
    ProtocolError,
)


class ControlClient:
    def __init__(self, manager_url: str, token: str | None, breaker_interval: float = 1.0) -> None:
        self.base = manager_url.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._session: aiohttp.ClientSession | None = None
        self.breaker = CircuitBreaker(f"manager {self.base}", breaker_interval)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Idle pooled connections are dropped well before the server's keep-alive
            # (75 s) ends them, so a request after an idle gap does not hit a dead socket.
            connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=15.0)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def post(self, path: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        self.breaker.check()
        payload = orjson.dumps(body)
        for attempt in (1, 2):
            left = deadline - time.monotonic()
            if left <= 0:
                raise OperationTimeout("deadline passed before the request")
            try:
                async with self._get_session().post(self.base + path, data=payload,
                                                    timeout=aiohttp.ClientTimeout(total=left)) as resp:
                    raw = await resp.read()
                    status = resp.status
                break
            except TimeoutError:  # asyncio.TimeoutError is TimeoutError since 3.11
                self.breaker.failure()
                raise OperationTimeout(f"manager did not answer {path} in time") from None
            except aiohttp.ServerDisconnectedError as exc:
                # A pooled connection the manager had closed (it restarted, or dropped an
                # idle socket): one fresh try, then it is a real fault.
                if attempt == 2:
                    self.breaker.failure()
                    raise NetworkError(f"manager closed the connection ({path}): {exc}") from None
            except (aiohttp.ClientError, OSError) as exc:
                self.breaker.failure()
                raise NetworkError(f"manager unreachable ({path}): {exc}") from None
        self.breaker.success()
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise ProtocolError(f"manager sent non-JSON for {path} (HTTP {status})") from None
        if status in (401, 403):
            raise AccessDenied(str(parsed.get("error", status)) if isinstance(parsed, dict) else str(status))
        if status >= 400 or not isinstance(parsed, dict):
            message = parsed.get("error", "") if isinstance(parsed, dict) else ""
            raise BadRequest(f"manager refused {path}: HTTP {status} {message}", status)
        return parsed

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
