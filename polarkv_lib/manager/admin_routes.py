"""The admin half of the manager's cache API: health, stats, nodes, one key, the
Prometheus scrape and the OpenAPI document. Read-only but for `DELETE /v1/keys/{key}`.

Composed into `ManagerService` (manager/app.py) as the node and operator routes are:
it holds what it reads, and adds its routes to the service's router.
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from polarkv_lib.errors import BadRequest
from polarkv_lib.keys import ident, is_valid_key
from polarkv_lib.manager.auth import TENANT
from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.metrics import ManagerMetrics
from polarkv_lib.manager.openapi import openapi_spec
from polarkv_lib.manager.responses import error_response, json_response
from polarkv_lib.manager.shard import ShardGuard
from polarkv_lib.manager.writebehind import WriteBehind
from polarkv_lib.tenancy import Tenants, label
from polarkv_lib.wire import control

log = structlog.get_logger("polarkv.manager")


class AdminRoutes:
    def __init__(
        self,
        meta: Metadata,
        guard: ShardGuard,
        tenants: Tenants,
        metrics: ManagerMetrics,
        limits: control.Limits,
        writer: WriteBehind,
        shard_urls: tuple[str, ...],
    ) -> None:
        self.meta = meta
        self.guard = guard
        self.tenants = tenants
        self.metrics = metrics
        self.limits = limits
        self.writer = writer  # its failures and round numbers: /healthz
        self.shard_urls = shard_urls  # what /healthz tells the status page (ui.py)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/healthz", self.healthz)
        router.add_get("/v1/stats", self.stats)
        router.add_get("/v1/nodes", self.nodes)
        router.add_get("/v1/keys/{key}", self.get_key)
        router.add_delete("/v1/keys/{key}", self.delete_key)
        router.add_get("/metrics", self.prometheus)
        router.add_get("/openapi.json", self.openapi)

    async def healthz(self, request: web.Request) -> web.Response:
        stats = self.meta.views.stats()
        return json_response(
            {
                "status": "ok",
                "nodes": stats["nodes"],
                "keys_memory": stats["keys_memory"],
                "metadata_store": "retrying" if self.writer.failures else "ok",
                # write-behind rounds (writebehind.py): wait for a flush, never sleep
                "metadata_taken_seq": self.writer.taken_seq,
                "metadata_flushed_seq": self.writer.flushed_seq,
                "shard": str(self.guard.shard),
                "key_range": self.guard.shard.describe(),
                "shard_urls": list(self.shard_urls),
            }
        )

    async def stats(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = dict(self.meta.views.stats())
        if self.tenants.enabled:  # the admin sees every tenant, a tenant itself
            tenant = request[TENANT]
            views = self.meta.views.tenant_views()
            body["tenants"] = (
                views if tenant is None else {label(tenant): views.get(label(tenant), {})}
            )
        return json_response(body)

    async def nodes(self, request: web.Request) -> web.Response:
        return json_response({"nodes": self.meta.views.node_views()})

    def _path_key(self, request: web.Request) -> str:
        """The entry's key: a tenant's own namespace; the admin's is ?tenant=NAME (or the
        default namespace)."""
        key = request.match_info["key"]
        if not is_valid_key(key):
            raise BadRequest(f"a key is 32 lowercase hex characters, got {key!r:.60}")
        self.guard.check([key])
        tenant = request[TENANT]
        if tenant is None:
            tenant = request.query.get("tenant", "default")
            if tenant != "default" and tenant not in self.tenants.names():
                raise BadRequest(f"no tenant {tenant!r:.70}")
            tenant = "" if tenant == "default" else tenant
        return ident(tenant, key)

    async def get_key(self, request: web.Request) -> web.Response:
        view = self.meta.views.describe(self._path_key(request))
        if view is None:
            return error_response("no such key", 404)
        view["key"] = request.match_info["key"]
        return json_response(view)

    async def delete_key(self, request: web.Request) -> web.Response:
        if not self.meta.delete(self._path_key(request)):
            return error_response("no such key", 404)
        key = request.match_info["key"]
        log.info("key deleted", key=key, tenant=label(request.query.get("tenant", "")))
        return json_response({"deleted": key})

    async def prometheus(self, request: web.Request) -> web.Response:
        tenant = request[TENANT]  # the admin (None) sees every tenant's series
        return web.Response(
            body=self.metrics.scrape(None if tenant is None else label(tenant)),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(openapi_spec(self.limits.max_batch, self.limits.max_object_size))
