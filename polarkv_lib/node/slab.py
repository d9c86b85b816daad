"""The slab role: owns the buffer, serves it over the data plane, registers and heartbeats.
With the disk role in the same process, the buffer is also what offloads are written
from and reloads are read into (paired sharding).

The data server starts before registration succeeds (it refuses every request until it
has the grant key), so a slab started before its manager simply keeps trying to
register; one that the manager declared dead registers again on its next heartbeat.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from typing import Any

import aiohttp
import orjson
import structlog

from polarkv_lib.config import Config
from polarkv_lib.host import host_id
from polarkv_lib.node.buffer import SlabBuffer
from polarkv_lib.node.dataserver import DataServer
from polarkv_lib.node.disk import DiskStore
from polarkv_lib.node.disk_role import DiskRole

log = structlog.get_logger("polarkv.slab")


ADOPT_BATCH = 1000


class SlabService:
    def __init__(self, config: Config, disk: DiskStore | None = None) -> None:
        self.config = config
        self._store = disk  # with a store, this process runs the disk role too
        self.disk: DiskRole | None = None
        self.incarnation = secrets.randbits(63) or 1
        self.node_id = ""
        self.address = ""
        self.buffer: SlabBuffer | None = None
        self.server: DataServer | None = None
        self.registered = asyncio.Event()
        # Heartbeat at least three times per manager TTL, whatever was configured here.
        self._interval = config.slab.heartbeat_interval
        self._grant_key: bytes | None = (config.security.grant_key.encode()
                                         if config.security.grant_key else None)
        self._session: aiohttp.ClientSession | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        token = config.security.admin_token or config.security.token
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def start(self, sock: socket.socket) -> None:
        s = self.config.slab
        host, port = sock.getsockname()[:2]
        self.address = s.advertise or f"{host}:{port}"
        self.node_id = s.node_id or self.address
        store = self._store
        if store is not None:
            found = await asyncio.to_thread(store.scan)
            log.info("disk scanned", paths=list(store.paths), files=len(found), bytes=store.used,
                     capacity=store.capacity, o_direct=store.o_direct)
        self.buffer = SlabBuffer(s.shm_dir, self.node_id, self.incarnation, s.memory)
        if store is not None:
            self.disk = DiskRole(store, self.buffer.view, self.node_id, self.config.disk.io_threads)
            self.disk.start(self._post, self._ref, self.registered)
        self.server = DataServer(sock, self.buffer.view, self.incarnation, lambda: self._grant_key,
                                 s.max_connections)
        self.server.start()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=max(s.heartbeat_interval, 0.5)),
            json_serialize=lambda obj: orjson.dumps(obj).decode())
        self._heartbeat = asyncio.create_task(self._heartbeat_loop(), name="slab-heartbeat")
        log.info("slab serving", node=self.node_id, address=self.address, memory=s.memory,
                 buffer=self.buffer.path, incarnation=self.incarnation)

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        if self.disk is not None:
            await self.disk.stop()
        if self.registered.is_set():
            try:
                await self._post("/v1/nodes/unregister", self._ref(), 1.0)
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass  # the manager will notice the silence
        if self._session is not None:
            await self._session.close()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        if self.buffer is not None:
            self.buffer.close()
        log.info("slab stopped", node=self.node_id)

    def _ref(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "incarnation": self.incarnation}

    def stats(self) -> dict[str, int]:
        assert self.server is not None
        out = {f"data_{k}": v for k, v in vars(self.server.stats).items()}
        if self.disk is not None:
            out.update(self.disk.store.stats())
            out.update({f"disk_failures_{k}": v for k, v in self.disk.failures.items()})
            out["tiering_bytes_to_other_nodes"] = self.disk.bytes_for_other_nodes
        return out

    async def _post(self, path: str, body: dict[str, Any], timeout: float | None = None
                    ) -> tuple[int, dict[str, Any]]:
        assert self._session is not None
        url = self.config.slab.manager_url.rstrip("/") + path
        limit = aiohttp.ClientTimeout(total=timeout) if timeout is not None else None
        async with self._session.post(url, json=body, headers=self._headers, timeout=limit) as resp:
            data = await resp.read()
            try:
                parsed = orjson.loads(data)
            except orjson.JSONDecodeError:
                parsed = {}
            return resp.status, parsed if isinstance(parsed, dict) else {}

    async def _register(self) -> bool:
        assert self.buffer is not None
        status, body = await self._post("/v1/nodes/register", {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "address": self.address,
            "capacity": self.buffer.size,
            "shm_path": self.buffer.path if "shm" in self.config.slab.transports else "",
            "host_id": host_id(),
            "transports": list(self.config.slab.transports),
            "disk_capacity": self.config.disk.capacity if self.disk is not None else 0,
        })
        if status != 200:
            log.error("registration refused", status=status, error=body.get("error"))
            return False
        if self._grant_key is None:
            if "grant_key" not in body:
                log.error("manager sent no grant key; set security.grant_key on both sides")
                return False
            self._grant_key = bytes.fromhex(body["grant_key"])
        ttl = body.get("heartbeat_ttl")
        if isinstance(ttl, int | float) and ttl > 0:
            self._interval = min(self.config.slab.heartbeat_interval, ttl / 3)
        if self.disk is not None and not await self._adopt():
            return False
        self.registered.set()
        log.info("slab registered", node=self.node_id, incarnation=self.incarnation)
        return True

    async def _adopt(self) -> bool:
        """Tell the manager which files this node's disk holds, so they serve hits again."""
        assert self.disk is not None
        files = self.disk.inventory()
        for start in range(0, len(files), ADOPT_BATCH):
            status, body = await self._post("/v1/nodes/adopt",
                                             {**self._ref(), "files": files[start:start + ADOPT_BATCH]}, 10.0)
            if status != 200:
                log.error("file adoption refused", status=status, error=body.get("error"))
                return False
            for key in body.get("delete", []):  # the manager has a fresher copy elsewhere
                await asyncio.to_thread(self.disk.store.delete, key)
        if files:
            log.info("disk files adopted", files=len(files))
        return True

    async def _heartbeat_loop(self) -> None:
        last_error = 0.0
        while True:
            try:
                if not self.registered.is_set():
                    await self._register()
                else:
                    status, _ = await self._post("/v1/nodes/heartbeat", {**self._ref(), "stats": self.stats()})
                    if status == 404:
                        log.warning("manager forgot this node; registering again", node=self.node_id)
                        self.registered.clear()
                        await self._register()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                if time.monotonic() - last_error > 10:  # one line per 10 s while down
                    log.warning("manager unreachable", error=str(exc) or type(exc).__name__)
                    last_error = time.monotonic()
            await asyncio.sleep(self._interval if self.registered.is_set() else min(self._interval, 0.2))
