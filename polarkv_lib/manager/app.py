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
from polarkv_lib.manager.metadata import AllocStatus, Entry, Metadata, Node, State
from polarkv_lib.manager.metrics import ManagerMetrics
from polarkv_lib.manager.openapi import openapi_spec
from polarkv_lib.manager.store import MetadataStore, open_store
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
        self.meta = Metadata(m.partitions, m.read_lease, m.write_lease, m.heartbeat_ttl,
                             memory_high=m.memory_high_watermark, memory_low=m.memory_low_watermark,
                             disk_high=m.disk_high_watermark)
        self.metrics = ManagerMetrics(self.meta.stats, self._tier_failures, self.meta.node_views)
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
        # Tiering hand-offs: each node's disk role long-polls for orders; lookups wait on
        # reloads; writes wait for room that offloads are making.
        self._order_events: dict[str, asyncio.Event] = {}
        self._reloads: dict[int, asyncio.Future[None]] = {}  # entry gen -> reload settled
        self._freed = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.store: MetadataStore = open_store(m.metadata_url)
        self._flusher: asyncio.Task[None] | None = None
        self.flush_failures = 0
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
        r.add_post("/v1/nodes/orders", self.orders)
        r.add_post("/v1/nodes/done", self.done)
        r.add_post("/v1/nodes/adopt", self.adopt)

    # -- lifecycle ----------------------------------------------------------------------

    async def open_store(self) -> None:
        """Connect to the metadata store and restore what it holds. Before serving."""
        await self.store.open()
        nodes, entries = await self.store.load()
        self.meta.restore(nodes, entries)
        log.info("metadata restored", store=self.config.manager.metadata_url.split("@")[-1],
                 nodes=len(nodes), entries=len(entries))

    async def start(self, sock: socket.socket) -> None:
        self._flusher = asyncio.create_task(self._flush_loop(), name="manager-write-behind")
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, shutdown_timeout=2.0).start()
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._sweeper = asyncio.create_task(self._sweep(), name="manager-sweeper")
        log.info("manager listening", url=self.url, partitions=len(self.meta.partitions))

    async def stop(self) -> None:
        for task in (self._sweeper, self._flusher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        try:  # the last changes, within a bound
            await asyncio.wait_for(self._flush(), 5.0)
        except Exception as exc:
            log.error("final metadata flush failed", error=repr(exc))
        await self.store.close()
        log.info("manager stopped")

    async def _flush(self) -> bool:
        batch = self.meta.take_changes()
        if not len(batch):
            return True
        try:
            await self.store.write(batch)
        except Exception as exc:  # store down: keep the changes, retry later
            self.meta.requeue(batch)
            self.flush_failures += 1
            if self.flush_failures == 1 or self.flush_failures % 50 == 0:
                log.warning("metadata write-behind failed; will retry", error=repr(exc),
                            failures=self.flush_failures)
            return False
        if self.flush_failures:
            log.info("metadata write-behind caught up", after_failures=self.flush_failures)
            self.flush_failures = 0
        return True

    async def _flush_loop(self) -> None:
        interval = self.config.manager.metadata_flush
        backoff = interval
        while True:
            await asyncio.sleep(backoff)
            ok = await self._flush()
            backoff = interval if ok else min(backoff * 2, 5.0)

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
            self._settle_stale_reloads()
            self._signal_freed()
            self._kick()

    # -- tiering hand-offs --------------------------------------------------------------

    def _tier_failures(self) -> dict[str, int]:
        return dict(self.meta.counters.tier_failures)

    def _kick(self) -> None:
        """Plan tiering and wake the disk roles that have orders now."""
        self.meta.plan_tiering()
        for node in self.meta.nodes.values():
            if node.orders:
                event = self._order_events.get(node.node_id)
                if event is not None:
                    event.set()

    def _signal_freed(self) -> None:
        """Wake every writer waiting for room; each re-checks and waits again if needed."""
        self._freed.set()
        self._freed = asyncio.Event()

    def _reload_future(self, gen: int) -> asyncio.Future[None]:
        future = self._reloads.get(gen)
        if future is None:
            future = self._reloads[gen] = asyncio.get_running_loop().create_future()
        return future

    def _settle_reload(self, gen: int) -> None:
        future = self._reloads.pop(gen, None)
        if future is not None and not future.done():
            future.set_result(None)

    def _settle_stale_reloads(self) -> None:
        live = {gen for node in self.meta.nodes.values() for gen in node.reloads}
        for gen in [g for g in self._reloads if g not in live]:
            self._settle_reload(gen)

    def _room_coming(self) -> bool:
        return any(n.alive and n.has_disk and (n.offloading_bytes or n.orders)
                   for n in self.meta.nodes.values())

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
            response = error_response(reason, exc.status)
            if "Allow" in exc.headers:  # 405 must say what is allowed (RFC 9110)
                response.headers["Allow"] = exc.headers["Allow"]
            return response
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
        return json_response({"status": "ok", "nodes": stats["nodes"], "keys_memory": stats["keys_memory"],
                              "metadata_store": "retrying" if self.flush_failures else "ok"})

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
        return json_response(openapi_spec(self.limits.max_batch, self.limits.max_object_size))

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
        hits, lease = await self._lookup(req)
        nodes: dict[str, Any] = {}
        ttl = self.meta.read_lease_ttl
        entries = [self._entry_view(e, Op.READ, ttl, nodes) for e in hits] if lease else [
            {"key": e.key, "size": e.size, "checksum": e.checksum} for e in hits]
        return json_response({"hits": len(hits), "lease": lease, "nodes": nodes, "entries": entries})

    async def _lookup(self, req: control.LookupRequest) -> tuple[list[Entry], str | None]:
        """The longest prefix in memory, after waiting (up to req.wait) for disk hits to be
        reloaded by their own node, and for room when reloads lack memory right now."""
        deadline = time.monotonic() + req.wait
        served: list[Entry] = []
        lease: str | None = None
        while True:
            rest = req.keys[len(served):]
            hits, lease = self.meta.lookup(rest, req.lease, lease)
            pending = [self._reload_future(e.gen) for e in hits if e.reloading]
            settled = hits
            if pending:
                self._kick()
                await asyncio.wait(pending, timeout=max(deadline - time.monotonic(), 0.0))
                settled = self.meta.settle_lookup(lease, hits)
                if lease not in self.meta.read_leases:
                    lease = None
            served += settled
            if not req.lease or len(served) == len(req.keys) or len(settled) < len(hits):
                return served, lease  # all served, a probe, or a reload failed / ran late
            # The prefix stopped at a disk entry that had no memory to reload into. If this
            # pass made progress, memory may be free now: go on at once. Otherwise wait
            # for the room that offloads are making, if any are.
            stop = self.meta.get(req.keys[len(served)])
            left = deadline - time.monotonic()
            if stop is None or stop.state is not State.READY or stop.in_memory or left <= 0:
                return served, lease
            if not settled:
                self._kick()
                if not self._room_coming():
                    return served, lease
                try:
                    await asyncio.wait_for(self._freed.wait(), left)
                except TimeoutError:
                    return served, lease
            self.meta.counters.lookups -= 1  # one request, however many passes
            self.meta.counters.misses -= len(req.keys) - len(served)

    async def allocate(self, request: web.Request) -> web.Response:
        req = control.parse_allocate(await self._body(request), self.limits)
        items = [(i.key, i.size) for i in req.items]
        results, lease = self.meta.allocate(items)
        deadline = time.monotonic() + req.wait
        while True:  # under pressure, writes wait for the room offloads are making
            missing = [i for i, r in enumerate(results) if r.status is AllocStatus.NO_SPACE]
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                break
            self._kick()
            if not self._room_coming():
                break
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except TimeoutError:
                break
            self.meta.counters.no_space -= len(missing)  # counted once, on the final answer
            retry, again = self.meta.allocate([items[i] for i in missing], lease)
            lease = lease or again
            for i, res in zip(missing, retry, strict=True):
                results[i] = res
        self._kick()
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
        results = self.meta.commit(req.lease, req.items)
        self._kick()
        return json_response({"results": results})

    async def abort(self, request: web.Request) -> web.Response:
        req = control.parse_abort(await self._body(request), self.limits)
        aborted = self.meta.abort(req.lease, req.keys)
        self._signal_freed()
        return json_response({"aborted": aborted})

    async def release(self, request: web.Request) -> web.Response:
        req = control.parse_release(await self._body(request), self.limits)
        before = self.meta.counters.checksum_failures
        released = self.meta.release(req.leases, req.corrupt)
        if self.meta.counters.checksum_failures > before:
            log.warning("checksum mismatch reported", keys=req.corrupt)
        self._signal_freed()
        return json_response({"released": released})

    async def renew(self, request: web.Request) -> web.Response:
        leases = control.parse_renew(await self._body(request), self.limits)
        return json_response({"renewed": self.meta.renew(leases)})

    # -- nodes --------------------------------------------------------------------------

    async def register(self, request: web.Request) -> web.Response:
        req = control.parse_register(await self._body(request))
        node, is_new = self.meta.register(req.node_id, req.incarnation, req.address, req.capacity,
                                          req.shm_path, req.host_id, req.transports, req.disk_capacity)
        if is_new:
            log.info("node joined", node=node.node_id, address=node.address,
                     incarnation=node.incarnation, capacity=node.capacity,
                     disk_capacity=node.disk_capacity)
        body: dict[str, Any] = {"node_id": node.node_id, "incarnation": node.incarnation,
                                "heartbeat_ttl": self.meta.heartbeat_ttl}
        if self._grant_key_shared:
            body["grant_key"] = self.grant_key.hex()
        return json_response(body)

    async def heartbeat(self, request: web.Request) -> web.Response:
        ref, reported = control.parse_heartbeat(await self._body(request))
        if not self.meta.heartbeat(ref.node_id, ref.incarnation, reported):
            return error_response("unknown node or incarnation; register again", 404)
        return json_response({"ok": True})

    async def unregister(self, request: web.Request) -> web.Response:
        ref = control.parse_node_ref(await self._body(request))
        if not self.meta.unregister(ref.node_id, ref.incarnation):
            return error_response("unknown node or incarnation", 404)
        log.info("node left", node=ref.node_id)
        return json_response({"ok": True})

    async def orders(self, request: web.Request) -> web.Response:
        """Long poll of a node's disk role: its pending orders, or none after `wait`."""
        ref, wait = control.parse_orders(await self._body(request))
        if self.meta.node(ref.node_id, ref.incarnation) is None:
            return error_response("unknown node or incarnation; register again", 404)
        orders = self.meta.take_orders(ref.node_id)
        if not orders and wait > 0:
            event = self._order_events.setdefault(ref.node_id, asyncio.Event())
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), wait)
            except TimeoutError:
                pass
            if self.meta.node(ref.node_id, ref.incarnation) is not None:
                orders = self.meta.take_orders(ref.node_id)
        return json_response({"orders": orders})

    async def done(self, request: web.Request) -> web.Response:
        """A disk role reports finished orders."""
        ref, results = control.parse_done(await self._body(request), self.limits)
        if self.meta.node(ref.node_id, ref.incarnation) is None:
            return error_response("unknown node or incarnation; register again", 404)
        for r in results:
            if r.op == "offload":
                self.meta.offload_done(ref.node_id, r.key, r.gen, r.ok, r.reason, r.file_bytes)
                self.metrics.offload_seconds.observe(r.seconds)
            elif r.op == "reload":
                self.meta.reload_done(ref.node_id, r.key, r.gen, r.ok, r.reason)
                self.metrics.reload_seconds.observe(r.seconds)
                self._settle_reload(r.gen)
            if not r.ok:
                log.warning(f"{r.op} failed", node=ref.node_id, key=r.key, reason=r.reason)
        self._signal_freed()
        self._kick()
        return json_response({"ok": True})

    async def adopt(self, request: web.Request) -> web.Response:
        """A slab with a disk reports the files it found at start."""
        ref, files = control.parse_adopt(await self._body(request), self.limits)
        delete = self.meta.adopt(ref.node_id, ref.incarnation, files)
        if delete is None:
            return error_response("unknown node or incarnation, or no disk role", 404)
        self._kick()
        return json_response({"adopted": len(files) - len(delete), "delete": delete})
