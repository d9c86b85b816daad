"""The node half of the manager's HTTP API: slabs register, heartbeat and leave; their
disk roles long-poll for tier orders, report results and report the files they found.

Composed into `ManagerService` (manager/app.py) as `OperatorRoutes` is (manager/ui.py):
the service hands it the core, the room it keeps for its waiters and the callbacks that
wake them (`NodeHooks`), and it adds its routes to the service's router. Every call
needs the admin token when one is set (auth.py's `Auth.authorize`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from polarkv_lib.keys import split_ident
from polarkv_lib.logs import Events
from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.events import EventRing, Kind
from polarkv_lib.manager.metrics import ManagerMetrics
from polarkv_lib.manager.responses import error_response, json_response
from polarkv_lib.manager.shard import ShardGuard
from polarkv_lib.wire import control

log = structlog.get_logger("polarkv.manager")


@dataclass(frozen=True)
class NodeHooks:
    """What the service does when a node's report changes what its waiters wait for."""

    kick: Callable[[], None]  # tiering: plan and hand out orders now
    freed: Callable[[], None]  # memory was freed: writes waiting for room look again
    reload_settled: Callable[[int], None]  # a reload of this entry generation ended
    start_restore: Callable[[], None]  # a node's persisted rows can come back


@dataclass(frozen=True)
class GrantIdentity:
    """What a registering slab learns to check this manager's grants."""

    key: bytes
    incarnation: int  # this manager process's: grants are signed for it
    shared: bool  # the key was made at start: slabs get it when they register


class NodeRoutes:
    def __init__(
        self,
        meta: Metadata,
        guard: ShardGuard,
        events: EventRing,
        metrics: ManagerMetrics,
        limits: control.Limits,
        grants: GrantIdentity,
        hooks: NodeHooks,
        restored: asyncio.Event,
    ) -> None:
        self.meta = meta
        self.guard = guard
        self.events = events
        self.metrics = metrics
        self.limits = limits
        self.grants = grants
        self.hooks = hooks
        self.restored = restored  # set while no restore is running
        # each node's disk role long-polls for orders: set when it has some
        self.order_events: dict[str, asyncio.Event] = {}

    def wake(self, node_ids: Iterable[str]) -> None:
        """Those nodes have orders: their long polls answer now."""
        for node_id in node_ids:
            event = self.order_events.get(node_id)
            if event is not None:
                event.set()

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/nodes/register", self.register)
        router.add_post("/v1/nodes/heartbeat", self.heartbeat)
        router.add_post("/v1/nodes/unregister", self.unregister)
        router.add_post("/v1/nodes/orders", self.orders)
        router.add_post("/v1/nodes/done", self.done)
        router.add_post("/v1/nodes/adopt", self.adopt)
        router.add_post("/v1/nodes/confirm", self.confirm)

    async def register(self, request: web.Request) -> web.Response:
        req = control.parse_register(await _body(request))
        base, capacity = self.guard.arena(req.capacity)  # this shard's part of the buffer
        node, is_new = self.meta.register(
            req.node_id,
            req.incarnation,
            req.address,
            capacity,
            req.shm_path,
            req.host_id,
            req.transports,
            self.guard.disk_share(req.disk_capacity),
            base,
        )
        if is_new:
            self.hooks.start_restore()
            self.events.add(Kind.NODE_JOINED, node.node_id, f"node joined ({node.address})")
            log.info(
                Events.NODE_JOINED,
                node=node.node_id,
                address=node.address,
                incarnation=node.incarnation,
                capacity=node.capacity,
                disk_capacity=node.disk_capacity,
            )
        body: dict[str, Any] = {
            "node_id": node.node_id,
            "incarnation": node.incarnation,
            "heartbeat_ttl": self.meta.heartbeat_ttl,
            "manager_incarnation": self.grants.incarnation,  # grants are signed for it
        }
        if self.grants.shared:
            body["grant_key"] = self.grants.key.hex()
        return json_response(body)

    async def heartbeat(self, request: web.Request) -> web.Response:
        ref, reported = control.parse_heartbeat(await _body(request))
        if not self.meta.heartbeat(ref.node_id, ref.incarnation, reported):
            return error_response("unknown node or incarnation; register again", 404)
        return json_response({"ok": True})

    async def unregister(self, request: web.Request) -> web.Response:
        ref = control.parse_node_ref(await _body(request))
        if not self.meta.unregister(ref.node_id, ref.incarnation):
            return error_response("unknown node or incarnation", 404)
        log.info(Events.NODE_LEFT, node=ref.node_id)
        self.events.add(Kind.NODE_LEFT, ref.node_id, "node left")
        return json_response({"ok": True})

    async def orders(self, request: web.Request) -> web.Response:
        """Long poll of a node's disk role: its pending orders, or none after `wait`."""
        ref, wait = control.parse_orders(await _body(request))
        if self.meta.node(ref.node_id, ref.incarnation) is None:
            return error_response("unknown node or incarnation; register again", 404)
        orders = self.meta.take_orders(ref.node_id)
        if not orders and wait > 0:
            event = self.order_events.setdefault(ref.node_id, asyncio.Event())
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), wait)
            except TimeoutError:
                pass
            if self.meta.node(ref.node_id, ref.incarnation) is not None:
                orders = self.meta.take_orders(ref.node_id)
        return json_response({"orders": [o.to_json() for o in orders]})

    async def done(self, request: web.Request) -> web.Response:
        """A disk role reports finished orders."""
        ref, results = control.parse_done(await _body(request), self.limits)
        if self.meta.node(ref.node_id, ref.incarnation) is None:
            return error_response("unknown node or incarnation; register again", 404)
        for r in results:
            if r.op == "offload":
                self.meta.offload_done(ref.node_id, r.key, r.gen, r.ok, r.reason, r.file_bytes)
                self.metrics.offload_seconds.observe(r.seconds)
            elif r.op == "reload":
                self.meta.reload_done(ref.node_id, r.key, r.gen, r.ok, r.reason)
                self.metrics.reload_seconds.observe(r.seconds)
                self.hooks.reload_settled(r.gen)
            if not r.ok:
                tenant, key = split_ident(r.key)
                log.warning(
                    Events.TIER_FAILURE, op=r.op, node=ref.node_id, key=r.key, reason=r.reason
                )
                self.events.add(  # the entry's tenant's event
                    Kind.TIER_FAILURE,
                    ref.node_id,
                    f"{r.op} failed: {r.reason}",
                    tenant=tenant,
                    key=key,
                )
        self.hooks.freed()
        self.hooks.kick()
        return json_response({"ok": True})

    async def confirm(self, request: web.Request) -> web.Response:
        """A slab that registered with a restarted manager confirms its memory: the
        restore takes back only the memory copies whose bytes still match their checksum."""
        ref, held = control.parse_confirm(await _body(request), self.limits)
        checks = self.meta.snapshots.confirm(ref.node_id, ref.incarnation, held)
        if checks is None:
            return error_response("unknown node or incarnation; register again", 404)
        if not checks:
            self.hooks.start_restore()  # its rows can come back now
        return json_response(
            {"check": [{"offset": o, "length": n, "checksum": c} for o, n, c in checks]}
        )

    async def adopt(self, request: web.Request) -> web.Response:
        """A slab with a disk reports the files it found at start."""
        ref, files = control.parse_adopt(await _body(request), self.limits)
        self.guard.check(f[0] for f in files)
        await self.restored.wait()  # adopt against the restored entries, not beside them
        delete = self.meta.adopt(ref.node_id, ref.incarnation, files)
        if delete is None:
            return error_response("unknown node or incarnation, or no disk role", 404)
        self.hooks.kick()
        return json_response({"adopted": len(files) - len(delete), "delete": delete})


async def _body(request: web.Request) -> dict[str, Any]:
    return control.parse_body(await request.read())
