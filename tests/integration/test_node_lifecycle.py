"""A slab and a manager in this process, on real sockets: restarts and hangs of the
manager that the node must get over by itself, over the tcp data plane."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from polarkv_lib.client import AsyncPolarKVClient
from polarkv_lib.config import Config, load_config
from polarkv_lib.logs import Events
from polarkv_lib.manager.app import ManagerService
from polarkv_lib.node.slab import SlabService
from polarkv_lib.runner import bind

KEY = "0123456789abcdef0123456789abcdef"
# The manager's shell still passes shutdown_timeout to its site (aiohttp wants it on the runner).
pytestmark = pytest.mark.filterwarnings("ignore:shutdown_timeout should be set on BaseRunner")


def _config(tmp: Path, manager_url: str = "http://127.0.0.1:1", **extra: str) -> Config:
    settings = {
        "manager.listen": "127.0.0.1:0",
        "manager.metadata_url": f"sqlite:///{tmp}/meta.db",
        "manager.heartbeat_ttl": "1s",
        "slab.listen": "127.0.0.1:0",
        "slab.memory": "8MiB",
        "slab.shm_dir": str(tmp),
        "slab.transports": "tcp",
        "slab.heartbeat_interval": "100ms",
        "slab.manager_url": manager_url,
        **extra,
    }
    return load_config(overrides=[f"{k}={v}" for k, v in settings.items()], environ={})


async def _until(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Poll a condition of in-process state (nothing to await: the services change it
    as they run), failing after `within` seconds."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(0.05)


class Manager:
    """A ManagerService that can be stopped and started again on the same port."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.port = 0
        self.service: ManagerService | None = None
        self._sock: socket.socket | None = None

    async def start(self) -> None:
        self._sock = bind(f"127.0.0.1:{self.port}", "manager.listen")
        self.port = self._sock.getsockname()[1]
        self.service = ManagerService(self.config)
        await self.service.open_store()
        await self.service.start(self._sock)

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop()
            self.service = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self, node_id: str) -> bool:
        assert self.service is not None
        node = self.service.meta.nodes.get(node_id)
        return node is not None and node.alive


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[Manager]:
    m = Manager(_config(tmp_path))
    await m.start()
    try:
        yield m
    finally:
        await m.stop()


@contextlib.asynccontextmanager
async def running_slab(config: Config) -> AsyncIterator[SlabService]:
    slab = SlabService(config)
    sock = bind(config.slab.listen, "slab.listen")
    try:
        await slab.start(sock)
        await asyncio.wait_for(slab.registered.wait(), 10)
        yield slab
    finally:
        await slab.stop()
        sock.close()


async def test_a_restarted_manager_with_default_config_serves_tcp_again(
    manager: Manager, tmp_path: Path
) -> None:
    """No security.grant_key: the restarted manager signs grants with a new random key,
    and the slab must check them with it (it takes the key on every registration)."""
    data = os.urandom(256 * 1024)
    async with (
        running_slab(_config(tmp_path, manager.url)) as slab,
        AsyncPolarKVClient(
            manager.url, transport="tcp", timeout=3.0, breaker_interval=0.05
        ) as client,
    ):
        assert await client.put(KEY, data)
        assert await client.get(KEY) == data
        await manager.stop()
        await manager.start()  # same port, same metadata store, a new grant key
        await _until(lambda: slab.registrations >= 2 and manager.alive(slab.node_id))
        assert await client.get(KEY) == data  # restored entry, read with a new-key grant
        other = "f" * 32
        assert await client.put(other, data[::-1])
        assert await client.get(other) == data[::-1]
        assert client.stats.faults == 0
        assert slab.server is not None and slab.server.gate.stats.denied == 0


class HangingProxy:
    """A TCP proxy in front of the manager. While `hung`, it accepts and reads but
    forwards nothing in either direction; a connection that saw the hang stays silent
    for good (as one through a dead middlebox would), new ones work again after it."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.hung = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state = {"poisoned": self.hung}
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, state)),
            asyncio.create_task(self._pump(up_reader, writer, state)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self._tasks.difference_update(pumps)
            for w in (writer, up_writer):
                w.close()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, state: dict[str, bool]
    ) -> None:
        while data := await src.read(65536):
            if self.hung:
                state["poisoned"] = True
            if not state["poisoned"]:
                dst.write(data)
                await dst.drain()


async def test_a_node_declared_dead_behind_a_hung_connection_registers_again(
    manager: Manager, tmp_path: Path
) -> None:
    proxy = HangingProxy(manager.port)
    await proxy.start()
    try:
        config = _config(tmp_path, f"http://127.0.0.1:{proxy.port}")
        with capture_logs() as logs:
            async with running_slab(config) as slab:
                proxy.hung = True  # the manager hears nothing; the node's calls hang
                await _until(lambda: not manager.alive(slab.node_id), within=5)
                proxy.hung = False
                # alive on the manager's side, and the slab has taken the answer
                await _until(
                    lambda: manager.alive(slab.node_id) and slab.registrations == 2, within=10
                )
        events = [e["event"] for e in logs]
        assert Events.MANAGER_UNREACHABLE in events  # the timed-out calls, logged
        assert Events.SLAB_FORGOTTEN in events  # and the re-registration
    finally:
        await proxy.stop()
