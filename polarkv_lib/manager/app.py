"""The manager's aiohttp shell: HTTP in, metadata core calls, JSON out.

Every handler parses its body through wire.control (bad input -> 4xx with a reason),
calls one synchronous method of the metadata core, signs grants for the regions it
hands out, and answers. A background sweeper expires leases and silent nodes.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from polarkv_lib.config import Config
from polarkv_lib.errors import BadRequest
from polarkv_lib.keys import is_valid_key
from polarkv_lib.manager.metadata import AllocStatus, Entry, Metadata, Node
from polarkv_lib.manager.metrics import ManagerMetrics
from polarkv_lib.manager.openapi import openapi_spec
from polarkv_lib.wire import control
from polarkv_lib.wire.grants import Grant, Op, sign

log = structlog.get_logger("polarkv.manager")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(message: str, status: int) -> web.Response:
    return json_response({"error": message}, status)


class ManagerService:
    def __init__(self, config: Config) -> None:
        m = config.manager
        self.config = config
        self.meta = Metadata(m.partitions, m.read_lease, m.write_lease, m.heartbeat_ttl)
        self.metrics = ManagerMetrics(self.meta.stats)
        self.limits = control.Limits(m.max_batch, m.max_object_size)
        sec = config.security
        # Without a configured key the manager makes one and hands it to slabs when they
        # register (protected by the admin token when one is set).
        self._grant_key_shared = not sec.grant_key
        self.grant_key = sec.grant_key.encode() if sec.grant_key else secrets.token_bytes(32)
        self._token = sec.token
        self._admin_token = sec.admin_token
        self.app = web.Application(client_max_size=m.max_body_size, middlewares=[self._middleware])
        self._add_routes()
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.url = ""

    def _add_routes(self) -> None:
        r = self.app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/v1/stats", self.stats)
        r.add_get("/v1/nodes", self.nodes)
        r.add_get("/v1/keys/{key}", self.get_key)
        r.add_delete("/v1/keys/{key}", self.delete_key)
        r.add_get("/metrics", self.prometheus)
        r.add_get("/openapi.json", self.openapi)
        r.add_post("/v1/lookup", self.lookup)
        r.add_post("/v1/allocate", self.allocate)
        r.add_post("/v1/commit", self.commit)
        r.add_post("/v1/abort", self.abort)
        r.add_post("/v1/release", self.release)
        r.add_post("/v1/renew", self.renew)
        r.add_post("/v1/nodes/register", self.register)
        r.add_post("/v1/nodes/heartbeat", self.heartbeat)
        r.add_post("/v1/nodes/unregister", self.unregister)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self, sock: socket.socket) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, shutdown_timeout=2.0).start()
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._sweeper = asyncio.create_task(self._sweep(), name="manager-sweeper")
        log.info("manager listening", url=self.url, partitions=len(self.meta.partitions))

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        log.info("manager stopped")

    async def _sweep(self) -> None:
        m = self.config.manager
        period = min(max(min(m.read_lease, m.write_lease, m.heartbeat_ttl) / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(period)
            events = self.meta.expire()
            for node_id in events.dead_nodes:
                log.warning("node died", node=node_id, reason="heartbeat timeout")
            if events.expired_writes:
                log.info("write leases expired", count=events.expired_writes)

    # -- middleware ---------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        try:
            self._authorize(request)
            return await handler(request)
        except BadRequest as exc:
            return error_response(str(exc), exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            reason = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
            return error_response(reason, exc.status)
        except Exception:
            log.exception("unhandled error", endpoint=endpoint)
            return error_response("internal error", 500)
        finally:
            self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)

    def _authorize(self, request: web.Request) -> None:
        if request.path == "/healthz" or not (self._token or self._admin_token):
            return
        header = request.headers.get("Authorization", "")
        presented = header[7:] if header.startswith("Bearer ") else ""
        admin_write = request.method == "DELETE" or request.path.startswith("/v1/nodes/")
        if admin_write and self._admin_token:
            if not presented:
                raise BadRequest("missing bearer token", 401)
            if not secrets.compare_digest(presented, self._admin_token):
                raise BadRequest("this operation needs the admin token", 403)
            return
        allowed = [t for t in (self._token, self._admin_token) if t]
        if not presented:
            raise BadRequest("missing bearer token", 401)
        if not any(secrets.compare_digest(presented, t) for t in allowed):
            raise BadRequest("wrong bearer token", 401)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return control.parse_body(await request.read())

    # -- admin --------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        stats = self.meta.stats()
        return json_response({"status": "ok", "nodes": stats["nodes"], "keys_memory": stats["keys_memory"]})

    async def stats(self, request: web.Request) -> web.Response:
        return json_response(self.meta.stats())

    async def nodes(self, request: web.Request) -> web.Response:
        return json_response({"nodes": self.meta.node_views()})

    def _path_key(self, request: web.Request) -> str:
        key = request.match_info["key"]
        if not is_valid_key(key):
            raise BadRequest(f"a key is 32 lowercase hex characters, got {key!r:.60}")
        return key

    async def get_key(self, request: web.Request) -> web.Response:
        view = self.meta.describe(self._path_key(request))
        if view is None:
            return error_response("no such key", 404)
        return json_response(view)

    async def delete_key(self, request: web.Request) -> web.Response:
        key = self._path_key(request)
        if not self.meta.delete(key):
            return error_response("no such key", 404)
        log.info("key deleted", key=key)
        return json_response({"deleted": key})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(openapi_spec())

    # -- control ------------------------------------------------------------------------

    def _grant(self, entry: Entry, op: Op, ttl: float) -> str:
        expires_ms = int((time.time() + ttl) * 1000)
        grant = Grant(op, entry.node.incarnation, entry.offset, entry.size, expires_ms)
        return sign(grant, self.grant_key).hex()

    @staticmethod
    def _node_view(node: Node) -> dict[str, Any]:
        return {"address": node.address, "shm_path": node.shm_path, "host_id": node.host_id,
                "transports": node.transports, "incarnation": node.incarnation}

    def _entry_view(self, entry: Entry, op: Op, ttl: float, nodes: dict[str, Any]) -> dict[str, Any]:
        nodes.setdefault(entry.node.node_id, self._node_view(entry.node))
        return {"key": entry.key, "node": entry.node.node_id, "offset": entry.offset,
                "size": entry.size, "checksum": entry.checksum, "grant": self._grant(entry, op, ttl)}

    async def lookup(self, request: web.Request) -> web.Response:
        req = control.parse_lookup(await self._body(request), self.limits)
        hits, lease = self.meta.lookup(req.keys, req.lease)
        nodes: dict[str, Any] = {}
        ttl = self.meta.read_lease_ttl
        entries = [self._entry_view(e, Op.READ, ttl, nodes) for e in hits] if lease else [
            {"key": e.key, "size": e.size, "checksum": e.checksum} for e in hits]
        return json_response({"hits": len(hits), "lease": lease, "nodes": nodes, "entries": entries})

    async def allocate(self, request: web.Request) -> web.Response:
        items = control.parse_allocate(await self._body(request), self.limits)
        results, lease = self.meta.allocate([(i.key, i.size) for i in items])
        nodes: dict[str, Any] = {}
        ttl = self.meta.write_lease_ttl
        out = []
        for res in results:
            if res.status is AllocStatus.ALLOCATED and res.entry is not None:
                view = self._entry_view(res.entry, Op.WRITE, ttl, nodes)
                view["status"] = res.status.value
                out.append(view)
            else:
                out.append({"key": res.key, "status": res.status.value})
        return json_response({"lease": lease, "nodes": nodes, "results": out})

    async def commit(self, request: web.Request) -> web.Response:
        req = control.parse_commit(await self._body(request), self.limits)
        return json_response({"results": self.meta.commit(req.lease, req.items)})

    async def abort(self, request: web.Request) -> web.Response:
        req = control.parse_abort(await self._body(request), self.limits)
        return json_response({"aborted": self.meta.abort(req.lease, req.keys)})

    async def release(self, request: web.Request) -> web.Response:
        req = control.parse_release(await self._body(request), self.limits)
        before = self.meta.counters.checksum_failures
        released = self.meta.release(req.leases, req.corrupt)
        if self.meta.counters.checksum_failures > before:
            log.warning("checksum mismatch reported", keys=req.corrupt)
        return json_response({"released": released})

    async def renew(self, request: web.Request) -> web.Response:
        leases = control.parse_renew(await self._body(request), self.limits)
        return json_response({"renewed": self.meta.renew(leases)})

    # -- nodes --------------------------------------------------------------------------

    async def register(self, request: web.Request) -> web.Response:
        req = control.parse_register(await self._body(request))
        node, is_new = self.meta.register(req.node_id, req.incarnation, req.address, req.capacity,
                                          req.shm_path, req.host_id, req.transports)
        if is_new:
            log.info("node joined", node=node.node_id, address=node.address,
                     incarnation=node.incarnation, capacity=node.capacity)
        body: dict[str, Any] = {"node_id": node.node_id, "incarnation": node.incarnation,
                                "heartbeat_ttl": self.meta.heartbeat_ttl}
        if self._grant_key_shared:
            body["grant_key"] = self.grant_key.hex()
        return json_response(body)

    async def heartbeat(self, request: web.Request) -> web.Response:
        ref = control.parse_node_ref(await self._body(request))
        if not self.meta.heartbeat(ref.node_id, ref.incarnation):
            return error_response("unknown node or incarnation; register again", 404)
        return json_response({"ok": True})

    async def unregister(self, request: web.Request) -> web.Response:
        ref = control.parse_node_ref(await self._body(request))
        if not self.meta.unregister(ref.node_id, ref.incarnation):
            return error_response("unknown node or incarnation", 404)
        log.info("node left", node=ref.node_id)
        return json_response({"ok": True})
