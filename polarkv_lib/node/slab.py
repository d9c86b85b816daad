"""The slab role: owns the buffer, serves it over the data plane, registers and heartbeats.

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

log = structlog.get_logger("polarkv.slab")


class SlabService:
    def __init__(self, config: Config) -> None:
        self.config = config
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
        self.buffer = SlabBuffer(s.shm_dir, self.node_id, self.incarnation, s.memory)
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
        if self.registered.is_set():
            try:
                await self._post("/v1/nodes/unregister",
                                 {"node_id": self.node_id, "incarnation": self.incarnation})
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass  # the manager will notice the silence
        if self._session is not None:
            await self._session.close()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        if self.buffer is not None:
            self.buffer.close()
        log.info("slab stopped", node=self.node_id)

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert self._session is not None
        url = self.config.slab.manager_url.rstrip("/") + path
        async with self._session.post(url, json=body, headers=self._headers) as resp:
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
        self.registered.set()
        log.info("slab registered", node=self.node_id, incarnation=self.incarnation)
        return True

    async def _heartbeat_loop(self) -> None:
        last_error = 0.0
        while True:
            try:
                if not self.registered.is_set():
                    await self._register()
                else:
                    status, _ = await self._post("/v1/nodes/heartbeat",
                                                 {"node_id": self.node_id, "incarnation": self.incarnation})
                    if status == 404:
                        log.warning("manager forgot this node; registering again", node=self.node_id)
                        self.registered.clear()
                        await self._register()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                if time.monotonic() - last_error > 10:  # one line per 10 s while down
                    log.warning("manager unreachable", error=str(exc) or type(exc).__name__)
                    last_error = time.monotonic()
            await asyncio.sleep(self._interval if self.registered.is_set() else min(self._interval, 0.2))
