"""The one asynchronous client of the manager's control API, for clients and nodes alike.

Every call is one JSON POST bounded by a deadline, and every failure leaves as one of
the error tree's classes (`reply_error` is the single status-to-error mapping, shared
with the blocking `AdminClient`):

    no answer in time          OperationTimeout
    refused, reset, dropped    NetworkError
    2xx that is not JSON       ProtocolError
    401 / 403                  AccessDenied (status kept)
    any other 4xx / 5xx        BadRequest (status kept; 404 on a node call: register again)

Caches use the typed calls of the data path (lookup/allocate/commit/abort/release/
renew); the slab and its disk role use the node calls (register/heartbeat/unregister/
orders/done/adopt). The circuit breaker is for caches, whose every miss must be cheap;
a node keeps knocking, so it passes `breaker_interval=0`.

Given the `shard` its URL stands for, a client asks the manager's /healthz at first
contact which shard it is (`check_shard`): a URL list out of shard order is a
configuration mistake, raised as ShardOrderError by every call, never a miss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from polarkv_lib.client.breaker import CircuitBreaker
from polarkv_lib.errors import (
    AccessDenied,
    BadRequest,
    NetworkError,
    OperationTimeout,
    PolarKVError,
    ProtocolError,
)
from polarkv_lib.shards import Shard, ShardOrderError, misplaced
from polarkv_lib.wire.control import NodeRef as NodeRef  # the node calls' arguments
from polarkv_lib.wire.control import RegisterRequest as RegisterRequest
from polarkv_lib.wire.orders import Order, OrderResult

log = logging.getLogger("polarkv.control")  # stdlib: the client runs inside engines


def reply_error(status: int, parsed: object, what: str) -> PolarKVError | None:
    """The error an HTTP reply stands for, or None for a usable JSON object."""
    message = str(parsed.get("error", "")) if isinstance(parsed, dict) else ""
    if status in (401, 403):
        return AccessDenied(f"manager refused {what}: HTTP {status} {message}".rstrip(), status)
    if status >= 400:
        return BadRequest(f"manager refused {what}: HTTP {status} {message}".rstrip(), status)
    if not isinstance(parsed, dict):
        return ProtocolError(f"manager sent no JSON object for {what} (HTTP {status})")
    return None


@dataclass(frozen=True, slots=True)
class Registration:
    grant_key: bytes | None  # None: the manager does not share it (both sides configured it)
    heartbeat_ttl: float | None
    manager_incarnation: int  # its grants are signed with wire.grants.epoch_key of it


class ControlClient:
    def __init__(
        self,
        manager_url: str,
        token: str | None,
        breaker_interval: float = 1.0,
        pool_limit: int = 64,
        shard: Shard | None = None,
    ) -> None:
        self.base = manager_url.rstrip("/")
        # The shard this URL's place in its list makes it; its /healthz must agree at
        # first contact (check_shard), or every call raises ShardOrderError.
        self.shard = shard
        self._shard_checked = shard is None
        self._shard_error: ShardOrderError | None = None
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._session: aiohttp.ClientSession | None = None
        self._pool_limit = pool_limit
        self.breaker = (
            CircuitBreaker(f"manager {self.base}", breaker_interval)
            if breaker_interval > 0
            else None
        )

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Idle pooled connections are dropped well before the manager closes them
            # (manager.idle_timeout, 60 s), so a request after an idle gap does not hit a
            # dead socket.
            connector = aiohttp.TCPConnector(limit=self._pool_limit, keepalive_timeout=15.0)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    def _failed(self) -> None:
        if self.breaker is not None:
            self.breaker.failure()

    async def post(self, path: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """POST `body`, return the parsed reply; raise a PolarKVError on any failure (and
        ShardOrderError when this URL is not the shard its list says)."""
        await self.check_shard(deadline)
        return await self._request("POST", path, orjson.dumps(body), deadline)

    async def get(self, path: str, deadline: float) -> dict[str, Any]:
        await self.check_shard(deadline)
        return await self._request("GET", path, None, deadline)

    async def check_shard(self, deadline: float) -> None:
        """Until a manager has answered here once: ask its /healthz which shard it is and
        raise ShardOrderError (logged once, then raised by every call) if it is not
        `self.shard`. A fault on the way is raised as any call's would be."""
        if self._shard_error is not None:
            raise self._shard_error
        if self._shard_checked:
            return
        assert self.shard is not None
        health = await self._request("GET", "/healthz", None, deadline)
        error = misplaced(self.base, self.shard, health)
        if error is not None:
            self._shard_error = error
            log.error("%s", error)
            raise error
        self._shard_checked = True

    async def check_shards(self, deadline: float) -> None:
        """check_shard if the manager answers; one that does not is checked at its first
        answer later."""
        try:
            await self.check_shard(deadline)
        except PolarKVError:
            pass

    async def _request(
        self, method: str, path: str, payload: bytes | None, deadline: float
    ) -> dict[str, Any]:
        if self.breaker is not None:
            self.breaker.check()
        for attempt in (1, 2):
            left = deadline - time.monotonic()
            if left <= 0:
                raise OperationTimeout(f"deadline passed before {path}")
            try:
                async with self._get_session().request(
                    method,
                    self.base + path,
                    data=payload,
                    timeout=aiohttp.ClientTimeout(total=left),
                ) as resp:
                    raw = await resp.read()
                    status = resp.status
                break
            except TimeoutError:  # asyncio.TimeoutError is TimeoutError since 3.11
                self._failed()
                raise OperationTimeout(f"manager did not answer {path} in time") from None
            except aiohttp.ServerDisconnectedError as exc:
                # A pooled connection the manager had closed (it restarted, or dropped an
                # idle socket): one fresh try, then it is a real fault.
                if attempt == 2:
                    self._failed()
                    raise NetworkError(f"manager closed the connection ({path}): {exc}") from None
            except (aiohttp.ClientError, OSError) as exc:
                self._failed()
                raise NetworkError(f"manager unreachable ({path}): {exc}") from None
        if self.breaker is not None:
            self.breaker.success()  # it answered: up, whatever it said
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            if status < 400:
                raise ProtocolError(f"manager sent non-JSON for {path} (HTTP {status})") from None
            parsed = {"error": raw[:200].decode(errors="replace")}  # e.g. a proxy's error page
        error = reply_error(status, parsed, path)
        if error is not None:
            raise error
        assert isinstance(parsed, dict)  # reply_error refuses anything else
        return parsed

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- the data path ------------------------------------------------------------------

    async def lookup(
        self,
        keys: Sequence[str],
        deadline: float,
        wait: float = 0.0,
        lease: bool = True,
        resume: str | None = None,
    ) -> dict[str, Any]:
        """`resume`: the read lease of the same stream, whose last window was read."""
        body: dict[str, Any] = {"keys": list(keys)}
        if lease:
            body["wait"] = wait
            if resume:
                body["continue"] = resume
        else:
            body["lease"] = False
        return await self.post("/v1/lookup", body, deadline)

    async def allocate(
        self,
        items: Sequence[tuple[str, int]],
        deadline: float,
        wait: float = 0.0,
        resume: str | None = None,
        more: bool = False,
    ) -> dict[str, Any]:
        """`resume`: the store's write lease from its earlier windows; `more`: others follow."""
        body: dict[str, Any] = {"items": [{"key": k, "size": s} for k, s in items], "wait": wait}
        if resume:
            body["continue"] = resume
        if more:
            body["more"] = True
        return await self.post("/v1/allocate", body, deadline)

    async def commit(
        self, lease: str, items: Sequence[tuple[str, str]], deadline: float, more: bool = False
    ) -> dict[str, str]:
        """Commit (key, checksum) pairs; each key's outcome ("committed" or why not).
        `more`: the store goes on in another window under this lease."""
        body: dict[str, Any] = {
            "lease": lease,
            "items": [{"key": k, "checksum": c} for k, c in items],
        }
        if more:
            body["more"] = True
        reply = await self.post("/v1/commit", body, deadline)
        return dict(reply["results"])

    async def abort(self, lease: str, keys: Sequence[str], deadline: float) -> None:
        await self.post("/v1/abort", {"lease": lease, "keys": list(keys)}, deadline)

    async def release(
        self, leases: Sequence[str], deadline: float, corrupt: Sequence[str] = ()
    ) -> None:
        await self.post("/v1/release", {"leases": list(leases), "corrupt": list(corrupt)}, deadline)

    async def renew(self, leases: Sequence[str], deadline: float) -> dict[str, Any]:
        return await self.post("/v1/renew", {"leases": list(leases)}, deadline)

    async def tiered(self, deadline: float) -> bool:
        """Whether the cluster has a disk tier (memory under pressure then makes room by
        offloading, rather than by evicting)."""
        stats = await self.get("/v1/stats", deadline)
        return int(stats.get("capacity_disk", 0)) > 0

    # -- node calls ---------------------------------------------------------------------

    async def register(self, info: RegisterRequest, deadline: float) -> Registration:
        reply = await self.post("/v1/nodes/register", info.encode(), deadline)
        key, ttl = reply.get("grant_key"), reply.get("heartbeat_ttl")
        epoch = reply.get("manager_incarnation")
        try:
            grant_key = bytes.fromhex(key) if isinstance(key, str) else None
        except ValueError:
            raise ProtocolError("manager sent a grant key that is not hex") from None
        if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 < epoch < 2**63:
            raise ProtocolError("manager sent no manager_incarnation")
        usable_ttl = float(ttl) if isinstance(ttl, int | float) and ttl > 0 else None
        return Registration(grant_key, usable_ttl, epoch)

    async def confirm(
        self, ref: NodeRef, held: Sequence[tuple[int, str, bool]], deadline: float
    ) -> list[tuple[int, int, str]]:
        """Answer the manager's last checks of this node's memory (after it restarted):
        whether the payload at each offset still hashes to its checksum; get the next
        ones, (offset, length, checksum) each; [] when done."""
        body = {
            **ref.encode(),
            "held": [{"offset": o, "checksum": c, "ok": ok} for o, c, ok in held],
        }
        reply = await self.post("/v1/nodes/confirm", body, deadline)
        try:
            return [
                (int(c["offset"]), int(c["length"]), str(c["checksum"])) for c in reply["check"]
            ]
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("'check' is not a list of {offset, length, checksum}") from None

    async def heartbeat(self, ref: NodeRef, stats: dict[str, int], deadline: float) -> None:
        await self.post("/v1/nodes/heartbeat", {**ref.encode(), "stats": stats}, deadline)

    async def unregister(self, ref: NodeRef, deadline: float) -> None:
        await self.post("/v1/nodes/unregister", ref.encode(), deadline)

    async def orders(self, ref: NodeRef, wait: float, deadline: float) -> list[Order]:
        """Long poll: the node's pending tier orders, or none after `wait` seconds (the
        deadline must leave room for the wait). A malformed order is logged and skipped:
        the manager reissues what it does not hear back about."""
        reply = await self.post("/v1/nodes/orders", {**ref.encode(), "wait": wait}, deadline)
        raw = reply.get("orders", [])
        if not isinstance(raw, list):
            raise ProtocolError("'orders' is not a list")
        orders = []
        for i, obj in enumerate(raw):
            try:
                orders.append(Order.from_json(obj, f"orders[{i}]"))
            except BadRequest as exc:
                log.warning("malformed tier order skipped: %s", exc)
        return orders

    async def done(self, ref: NodeRef, results: Sequence[OrderResult], deadline: float) -> None:
        await self.post(
            "/v1/nodes/done", {**ref.encode(), "results": [r.to_json() for r in results]}, deadline
        )

    async def adopt(
        self, ref: NodeRef, files: Sequence[dict[str, Any]], deadline: float
    ) -> list[str]:
        """Report files found on disk; the keys whose files the node should delete."""
        reply = await self.post("/v1/nodes/adopt", {**ref.encode(), "files": list(files)}, deadline)
        return [str(k) for k in reply.get("delete", [])]
