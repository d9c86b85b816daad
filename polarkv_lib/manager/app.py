"""The manager's aiohttp shell: HTTP in, metadata core calls, JSON out.

Every handler parses its body through wire.control (bad input -> 4xx with a reason),
calls synchronous methods of the metadata core (manager/core.py), awaits what their
outcome says to wait for, signs grants for the regions it hands out, and answers. The
core counts and decides; the shell never reads or corrects its state. Background tasks
expire leases and silent nodes, write changes behind, and restore a restarted
manager's entries in slices.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import secrets
import socket
import time
from collections.abc import Iterable
from typing import Any

import structlog
from aiohttp import web

from polarkv_lib.config import Config
from polarkv_lib.keys import ident
from polarkv_lib.logs import Events
from polarkv_lib.manager.admin_routes import AdminRoutes
from polarkv_lib.manager.auth import TENANT, Auth, middleware
from polarkv_lib.manager.browser import BrowserGuard
from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.events import EventRing, Kind
from polarkv_lib.manager.metrics import ManagerMetrics
from polarkv_lib.manager.model import AllocStatus, Entry, Node, Step, Wait
from polarkv_lib.manager.node_routes import GrantIdentity, NodeHooks, NodeRoutes
from polarkv_lib.manager.responses import json_response
from polarkv_lib.manager.server import TimedRunner, Timeouts
from polarkv_lib.manager.shard import ShardGuard
from polarkv_lib.manager.store import MetadataStore, open_store
from polarkv_lib.manager.ui import OperatorRoutes
from polarkv_lib.manager.verify import TIMEOUT as VERIFY_TIMEOUT
from polarkv_lib.manager.verify import Region, bytes_are_bad
from polarkv_lib.manager.writebehind import WriteBehind
from polarkv_lib.progress import progress
from polarkv_lib.shards import Shard, split_urls
from polarkv_lib.tenancy import DEFAULT
from polarkv_lib.wire import control
from polarkv_lib.wire.grants import Op, Signer, epoch_key

log = structlog.get_logger("polarkv.manager")


class ManagerService:
    def __init__(self, config: Config) -> None:
        m = config.manager
        self.config = config
        # One table: scaling out is done across processes, by shard (manager/shard.py).
        self.meta = Metadata(
            m.read_lease,
            m.write_lease,
            m.heartbeat_ttl,
            memory_high=m.memory_high_watermark,
            memory_low=m.memory_low_watermark,
            disk_high=m.disk_high_watermark,
            stream_window=m.stream_window,
            tenants=config.security.tenancy,
        )
        self.metrics = ManagerMetrics(
            self.meta.views.stats,
            self.meta.views.tier_failures,
            self.meta.views.node_views,
            self.meta.views.tenant_views,
        )
        self.limits = control.Limits(m.max_batch, m.max_object_size)
        self.guard = ShardGuard(Shard.parse(m.shard))  # every request's keys pass it
        sec = config.security
        # Without a configured key the manager makes one and hands it to slabs when they
        # register (protected by the admin token when one is set).
        self._grant_key_shared = not sec.grant_key
        self.grant_key = sec.grant_key.encode() if sec.grant_key else secrets.token_bytes(32)
        # This process's incarnation: it signs grants with a key derived from it, which
        # slabs learn when they register, so no grant outlives the process that issued it.
        self.incarnation = secrets.randbits(63) or 1
        self.signing_key = epoch_key(self.grant_key, self.incarnation)
        self._sign = Signer(self.signing_key)
        self.tenants = sec.tenancy  # parsed once, by config.py
        auth = Auth(sec.token, sec.admin_token, self.tenants)  # manager/auth.py
        self.shard_urls = split_urls(m.shard_urls) if m.shard_urls else ()
        self.browser = BrowserGuard(self.shard_urls, auth.open)  # manager/browser.py
        self.app = web.Application(
            client_max_size=m.max_body_size,
            middlewares=[middleware(auth, self.browser, self.metrics)],
        )
        self.events = EventRing()  # recent events for the status page (manager/events.py)
        # Tiering hand-offs: each node's disk role long-polls for orders (node_routes.py);
        # lookups wait on reloads; writes wait for room that offloads are making.
        self._reloads: dict[int, asyncio.Future[None]] = {}  # entry gen -> reload settled
        self._freed = asyncio.Event()
        self._restore_wanted = asyncio.Event()
        self._restored = asyncio.Event()  # set while no restore is running
        self._restored.set()
        self.node_routes = NodeRoutes(  # register, heartbeat, orders, done, adopt, confirm
            self.meta,
            self.guard,
            self.events,
            self.metrics,
            self.limits,
            GrantIdentity(self.grant_key, self.incarnation, self._grant_key_shared),
            NodeHooks(self._kick, self._signal_freed, self._settle_reload, self._start_restore),
            self._restored,
        )
        self.store: MetadataStore = open_store(m.metadata_url)
        self.writer = WriteBehind(self.meta, self.store, self.events, m.metadata_flush)
        self._add_routes()
        self._runner: TimedRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._restorer: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[None]] = set()  # corruption reports being verified
        self._frozen_at = 0  # table size at the last gc.freeze()
        self.url = ""

    def _add_routes(self) -> None:
        r = self.app.router
        AdminRoutes(  # health, stats, nodes, keys, metrics, the OpenAPI document
            self.meta,
            self.guard,
            self.tenants,
            self.metrics,
            self.limits,
            self.writer,
            self.shard_urls,
        ).add_routes(r)
        r.add_post("/v1/lookup", self.lookup)
        r.add_post("/v1/allocate", self.allocate)
        r.add_post("/v1/commit", self.commit)
        r.add_post("/v1/abort", self.abort)
        r.add_post("/v1/release", self.release)
        r.add_post("/v1/renew", self.renew)
        self.node_routes.add_routes(r)  # manager/node_routes.py
        OperatorRoutes(  # page, events, drain
            self.events, self.meta, self._kick, self.browser, lambda request: request[TENANT]
        ).add_routes(self.app)

    # -- lifecycle ----------------------------------------------------------------------

    async def open_store(self) -> None:
        """Connect to the metadata store and restore what it holds. Before serving."""
        await self.store.open()
        # A million rows are a million acyclic objects that live until restored: the
        # cyclic collector's passes over them while they are made cost a third of the
        # load, and find nothing. Nothing else runs yet.
        gc.disable()
        try:
            nodes, entries = await self.store.load()
            if self.guard.shard.count > 1:
                entries = [e for e in entries if self.guard.shard.owns(e.key)]  # this shard's range
            self.meta.snapshots.restore(nodes, entries)
        finally:
            gc.enable()
        gc.freeze()
        log.info(
            "metadata restored",
            store=self.config.manager.metadata_url.split("@")[-1],
            nodes=len(nodes),
            entries=len(entries),
        )

    async def start(self, sock: socket.socket) -> None:
        self.writer.start()
        m = self.config.manager
        timeouts = Timeouts(m.header_timeout, m.body_timeout, m.idle_timeout)  # manager/server.py
        self._runner = TimedRunner(self.app, timeouts, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, shutdown_timeout=2.0).start()
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._sweeper = asyncio.create_task(self._sweep(), name="manager-sweeper")
        self._restorer = asyncio.create_task(self._restore_loop(), name="manager-restore")
        log.info(
            "manager listening",
            url=self.url,
            shard=str(self.guard.shard),
            keys=self.guard.shard.describe(),
        )

    async def stop(self) -> None:
        for task in (self._sweeper, self._restorer, *self._checks):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._runner is not None:  # requests in flight finish (and commit) first
            await self._runner.cleanup()
        await self.writer.stop()  # then everything committed is written (writebehind.py)
        log.info("manager stopped")

    async def _sweep(self) -> None:
        m = self.config.manager
        period = min(max(min(m.read_lease, m.write_lease, m.heartbeat_ttl) / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(period)
            expired = self.meta.expire()
            for node_id in expired.dead_nodes:
                log.warning(Events.NODE_DIED, node=node_id, reason="heartbeat timeout")
                self.events.add(Kind.NODE_DIED, node_id, "node died (heartbeat timeout)")
            if expired.expired_writes:
                log.info("write leases expired", count=expired.expired_writes)
            self._settle_stale_reloads()
            self._signal_freed()
            self._kick()
            self._freeze_grown_tables()

    def _freeze_grown_tables(self) -> None:
        """Move the tables out of the cyclic collector's reach once they have grown by a
        quarter. Its full passes scan every live object: at a million entries one took
        0.6 s, a stall of every request. Entries are freed by reference counting when
        dropped (no cycle is left once they leave the indexes), so frozen ones still go;
        what a freeze may keep are cycles of requests in flight at that moment, and
        geometric growth bounds the freezes to a few dozen over the process's life."""
        size = len(self.meta.entries)
        if size >= max(self._frozen_at * 5 // 4, 10_000):
            gc.freeze()
            self._frozen_at = size

    async def _restore_loop(self) -> None:
        """Restore registered nodes' persisted entries a slice at a time, yielding to
        requests between slices (they miss on what is not back yet)."""
        while True:
            await self._restore_wanted.wait()
            self._restore_wanted.clear()
            started = time.perf_counter()
            with progress(
                self.meta.snapshots.restore_left, "metadata restore", "entries", log_lines=True
            ) as bar:
                while self.meta.snapshots.restoring:
                    left = self.meta.snapshots.restore_left
                    self.meta.snapshots.restore_step()
                    bar.update(max(left - self.meta.snapshots.restore_left, 0))
                    # Restored entries live long: out of the cyclic collector's reach, or
                    # its full passes over a million of them stall the loop for most of a
                    # second (worst slice at 1M entries: 0.6 s without, 0.16 s with). The
                    # same geometric rule as in steady state: a few freezes, not one per slice.
                    self._freeze_grown_tables()
                    if self.meta.snapshots.restore_left == left:
                        # nothing could be restored: slabs are still confirming their memory
                        # (node_routes.confirm sets the event when one is done)
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._restore_wanted.wait(), 0.2)
                        self._restore_wanted.clear()
                    else:
                        await asyncio.sleep(0)
            self._restored.set()
            self._log_restores()
            log.debug("metadata restore pass done", seconds=round(time.perf_counter() - started, 3))
            self._kick()

    def _start_restore(self) -> None:
        if self.meta.snapshots.restoring:
            self._restored.clear()
            self._restore_wanted.set()
        self._log_restores()

    def _log_restores(self) -> None:
        """One line per node whose persisted entries are back (docs/OPERATIONS.md)."""
        now = self.meta.clock()
        for job in self.meta.snapshots.take_finished():
            log.info(
                Events.RESTORE_FINISHED,
                node=job.node.node_id,
                entries=len(job.rows),
                seconds=round(now - job.started, 3),
            )

    # -- tiering hand-offs --------------------------------------------------------------

    def _kick(self) -> None:
        """Plan tiering and wake the disk roles that have orders now."""
        self.meta.plan_tiering()
        self.node_routes.wake(self.meta.nodes_with_orders())

    async def _await(self, step: Step) -> None:
        """Wait for what the core's step names, at most until its deadline. The disk
        roles are woken first: the step may have queued the very orders it waits for."""
        self._kick()
        left = step.until - time.monotonic()
        if left <= 0:
            return
        if step.wait is Wait.RELOADS:
            await asyncio.wait([self._reload_future(gen) for gen in step.gens], timeout=left)
        elif step.wait is Wait.ROOM:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), left)

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
        live = self.meta.pending_reloads()
        for gen in [g for g in self._reloads if g not in live]:
            self._settle_reload(gen)

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        return control.parse_body(await request.read())

    # -- control ------------------------------------------------------------------------

    @staticmethod
    def _node_view(node: Node) -> dict[str, Any]:
        return {
            "address": node.address,
            "shm_path": node.shm_path,
            "host_id": node.host_id,
            "transports": node.transports,
            "incarnation": node.incarnation,
        }

    def _entry_views(
        self, served: Iterable[tuple[Entry, str]], op: Op, ttl: float, nodes: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """The reply's view of each (entry, client key), with its grant: one per region,
        all of one reply expiring together (one clock read, not one per grant)."""
        sign, node_view = self._sign, self._node_view
        expires = self.meta.grant_expiry(ttl)
        out = []
        for entry, key in served:
            node = entry.node
            node_id = node.node_id
            if node_id not in nodes:  # one view per node a reply names, built once
                nodes[node_id] = node_view(node)
            offset, size = entry.offset, entry.size
            grant = sign(op, node.incarnation, offset, size, expires, entry.gen)
            out.append(
                {
                    "key": key,
                    "node": node_id,
                    "offset": offset,
                    "size": size,
                    "checksum": entry.checksum,
                    "grant": grant.hex(),
                }
            )
        return out

    @staticmethod
    def _scope(request: web.Request, keys: Iterable[str]) -> tuple[str, list[str]]:
        """The requester's tenant and its keys as the core files them (keys.ident);
        replies name the client's keys again."""
        tenant = request[TENANT] or DEFAULT
        if tenant == DEFAULT:  # the default tenant's identities are its keys
            return tenant, list(keys)
        return tenant, [ident(tenant, k) for k in keys]

    async def lookup(self, request: web.Request) -> web.Response:
        req = control.parse_lookup(await self._body(request), self.limits)
        self.guard.check(req.keys)
        tenant, scoped = self._scope(request, req.keys)
        op = self.meta.open_lookup(scoped, req.lease, tenant, req.wait, req.resume)
        if op.lease:  # a stream let go of the window it read: lookups waiting for room go
            self._signal_freed()
        try:
            step = self.meta.advance_lookup(op)
            while step.wait is not Wait.DONE:
                await self._await(step)
                step = self.meta.advance_lookup(op)
        finally:
            self.meta.close_lookup(op)
        self._kick()  # a stream's next window may have been queued
        hits, lease = op.served, op.lease
        nodes: dict[str, Any] = {}
        ttl = self.meta.read_lease_ttl
        # a hit prefix: the i-th hit is the i-th key asked for
        entries = (
            self._entry_views(zip(hits, req.keys, strict=False), Op.READ, ttl, nodes)
            if req.lease
            else [
                {"key": k, "size": e.size, "checksum": e.checksum}
                for e, k in zip(hits, req.keys, strict=False)
            ]
        )
        # How many of the hits, from the first, are in memory now: a scheduler's way to
        # tell a load that is one memory read from one that waits for the disk.
        memory = next((i for i, e in enumerate(hits) if not e.in_memory), len(hits))
        return json_response(
            {
                "hits": len(hits),
                "memory": memory,
                "lease": lease,
                "more": op.more,
                "nodes": nodes,
                "entries": entries,
            }
        )

    async def allocate(self, request: web.Request) -> web.Response:
        req = control.parse_allocate(await self._body(request), self.limits)
        self.guard.check(i.key for i in req.items)
        tenant, scoped = self._scope(request, (i.key for i in req.items))
        items = [(k, i.size) for k, i in zip(scoped, req.items, strict=True)]
        op = self.meta.open_allocate(items, tenant, req.wait, req.resume, req.more)
        try:
            step = self.meta.advance_allocate(op)
            while step.wait is not Wait.DONE:  # under pressure: wait for the room being made
                await self._await(step)
                step = self.meta.advance_allocate(op)
        finally:
            self.meta.close_allocate(op)
        self._kick()
        nodes: dict[str, Any] = {}
        ttl = self.meta.write_lease_ttl
        allocated: list[tuple[Entry, str]] = []
        out: list[dict[str, Any] | None] = []
        for res, item in zip(op.results, req.items, strict=True):  # in request order
            assert res is not None  # every item has its result once the request is done
            if res.status is AllocStatus.ALLOCATED and res.entry is not None:
                allocated.append((res.entry, item.key))
                out.append(None)  # its view, signed with the others below
            else:
                out.append({"key": item.key, "status": res.status.value})
        views = iter(self._entry_views(allocated, Op.WRITE, ttl, nodes))
        status = AllocStatus.ALLOCATED.value
        for i, view in enumerate(out):
            if view is None:
                view = out[i] = next(views)
                view["status"] = status
        return json_response({"lease": op.lease, "nodes": nodes, "results": out})

    async def commit(self, request: web.Request) -> web.Response:
        req = control.parse_commit(await self._body(request), self.limits)
        self.guard.check(key for key, _ in req.items)
        _, scoped = self._scope(request, (key for key, _ in req.items))
        theirs = {s: key for s, (key, _) in zip(scoped, req.items, strict=True)}
        results = self.meta.commit(
            req.lease,
            [(s, checksum) for s, (_, checksum) in zip(scoped, req.items, strict=True)],
            req.more,
            request[TENANT],
        )
        self._kick()
        return json_response({"results": {theirs[s]: result for s, result in results.items()}})

    async def abort(self, request: web.Request) -> web.Response:
        req = control.parse_abort(await self._body(request), self.limits)
        self.guard.check(req.keys or ())
        keys = None if req.keys is None else self._scope(request, req.keys)[1]
        aborted = self.meta.abort(req.lease, keys, request[TENANT])
        self._signal_freed()
        return json_response({"aborted": aborted})

    async def release(self, request: web.Request) -> web.Response:
        req = control.parse_release(await self._body(request), self.limits)
        self.guard.check(req.corrupt)
        _, scoped = self._scope(request, req.corrupt)
        theirs = dict(zip(scoped, req.corrupt, strict=True))
        outcome = self.meta.release(req.leases, scoped, request[TENANT])
        for entry in outcome.suspects:  # checked where the bytes are, then maybe dropped
            task = asyncio.create_task(
                self._check_report(entry, theirs[entry.key]), name="manager-verify"
            )
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
        self._signal_freed()
        return json_response({"released": outcome.released})

    async def _check_report(self, entry: Entry, key: str) -> None:
        """A client's corruption report: read the entry's bytes on its slab (manager/
        verify.py); only a mismatch drops it."""
        gen, node = entry.gen, entry.node
        bad: bool | None = None
        if entry.in_memory and entry.alloc_size and node.alive:
            region = Region(
                node.address, node.incarnation, entry.offset, entry.size, gen, entry.checksum
            )
            bad = await bytes_are_bad(
                region, self.signing_key, self.meta.grant_expiry(VERIFY_TIMEOUT)
            )
        if self.meta.corrupt_verified(entry, gen, bad):
            log.warning(Events.CHECKSUM_FAILURE, key=key, node=node.node_id)
            self.events.add(
                Kind.CHECKSUM_FAILURE,
                key,
                "checksum mismatch reported and confirmed on its node",
                tenant=entry.tenant,
            )
            self._signal_freed()
        else:
            log.info(
                "checksum mismatch report not borne out",
                key=key,
                node=node.node_id,
                verdict="bytes match" if bad is False else "not checkable",
            )

    async def renew(self, request: web.Request) -> web.Response:
        leases = control.parse_renew(await self._body(request), self.limits)
        return json_response({"renewed": self.meta.renew(leases, request[TENANT])})
