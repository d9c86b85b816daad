"""Role runners: bind every socket, start the roles on one event loop, stop them in order.

Sockets are bound before anything starts, so "port in use" is a config error naming the
key and nothing runs half-way. Every start-up step pushes its own undo onto one
AsyncExitStack, so shutdown is the exact reverse of start-up — including a start-up
that failed half-way — and each step has its own bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import signal
import socket
from collections.abc import Awaitable, Callable

import orjson
import structlog

from polarkv_lib import event_loop
from polarkv_lib.config import Config, parse_address
from polarkv_lib.errors import ConfigError
from polarkv_lib.logs import Events
from polarkv_lib.manager.app import ManagerService
from polarkv_lib.node.slab import SlabService
from polarkv_lib.node.stores import open_store

log = structlog.get_logger("polarkv")
ROLES = ("manager", "slab", "disk")
SLAB_STOP_BOUND = 5.0  # unregister (1 s), stop the disk role and the data server
MANAGER_STOP_BOUND = 8.0  # stop accepting, drain, final metadata flush


def resolve_roles(requested: tuple[str, ...]) -> set[str]:
    roles = set(requested) or {"manager", "slab", "disk"}  # no role: the embedded single node
    if "disk" in roles and "slab" not in roles:
        raise ConfigError(
            "--role disk: the disk role shares the slab's buffer in one process "
            "(memory and disk of a VM are paired); use --role slab --role disk"
        )
    return roles


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(config: Config, roles: set[str], insecure: bool) -> None:
    """Listening beyond loopback without a token would hand the cache (and, through
    node registration, the grant key) to anyone on the network; a manager with a token
    but no admin token would let every client join as a node and take the grant key."""
    if insecure:
        return
    sec = config.security
    if sec.token and not sec.admin_token and "manager" in roles:
        address = config.manager.listen
        if not _is_loopback(parse_address(address)[0]):
            raise ConfigError(
                f"manager.listen: {address} is reachable from other hosts and security.token is "
                f"set but security.admin_token is empty: any client could register a node and "
                f"take the grant key; set security.admin_token or pass --insecure"
            )
    if sec.token:
        return
    for role, key, address in (
        ("manager", "manager.listen", config.manager.listen),
        ("slab", "slab.listen", config.slab.listen),
    ):
        if role in roles and not _is_loopback(parse_address(address)[0]):
            raise ConfigError(
                f"{key}: {address} is reachable from other hosts but security.token "
                f"is empty; set a token (and security.admin_token) or pass --insecure"
            )


def bind(address: str, key: str) -> socket.socket:
    host, port = parse_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{key}: cannot listen on {address}: {exc.strerror}") from None
    return sock


async def _bounded(step: Callable[[], Awaitable[None]], name: str, bound: float) -> None:
    """One shutdown step with its own bound: a slow step cannot eat the next one's time
    (the manager's final metadata flush always gets its turn)."""
    try:
        async with asyncio.timeout(bound):
            await step()
    except TimeoutError:
        log.error(Events.SHUTDOWN_STEP_SLOW, step=name, bound=bound)


async def _any(*events: asyncio.Event) -> None:
    """Wait until one of `events` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def _write_ready(path: str, ready: dict[str, object]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(orjson.dumps(ready))
    os.replace(tmp, path)


async def run(
    config: Config,
    roles: set[str],
    ready_file: str | None = None,
    stop: asyncio.Event | None = None,
    insecure: bool = False,
) -> None:
    """Bind, start the roles, serve until `stop` (or SIGTERM/SIGINT), then unwind in
    reverse: the slab stops talking to the manager and serving (clients then miss fast),
    then the manager stops accepting, drains and flushes, then the sockets close."""
    stop = stop or asyncio.Event()
    check_exposure(config, roles, insecure)
    async with contextlib.AsyncExitStack() as stack:
        # Everything is bound (or found unusable) before anything starts.
        manager_sock = slab_sock = None
        if "manager" in roles:
            manager_sock = bind(config.manager.listen, "manager.listen")
            stack.callback(manager_sock.close)
        if "slab" in roles:
            slab_sock = bind(config.slab.listen, "slab.listen")
            stack.callback(slab_sock.close)
        d = config.disk  # an unwritable disk path is a config error too
        store = open_store(d) if "disk" in roles else None  # disk.store: node/stores.py

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
            stack.callback(loop.remove_signal_handler, sig)

        ready: dict[str, object] = {
            "pid": os.getpid(),
            "roles": sorted(roles),
            "event_loop": event_loop.running(),
        }
        if manager_sock is not None:
            manager = ManagerService(config)
            stack.push_async_callback(_bounded, manager.stop, "manager", MANAGER_STOP_BOUND)
            await manager.open_store()
            await manager.start(manager_sock)
            ready["manager_url"] = manager.url
            if slab_sock is not None:  # embedded: the slab registers with this manager
                config = dataclasses.replace(
                    config, slab=dataclasses.replace(config.slab, manager_url=manager.url)
                )
        slab = None
        if slab_sock is not None:
            slab = SlabService(config, disk=store)
            stack.push_async_callback(_bounded, slab.stop, "slab", SLAB_STOP_BOUND)
            await slab.start(slab_sock)
            ready["slab_address"] = slab.address
            ready["node_id"] = slab.node_id
            if manager_sock is not None:  # embedded: don't report ready before the node is usable
                await asyncio.wait_for(_any(slab.registered, slab.failed), 10.0)
        if ready_file:
            _write_ready(ready_file, ready)
        log.info(Events.READY, **ready)
        await _any(stop, *([slab.failed] if slab else []))
        log.info(Events.SHUTTING_DOWN)
        if slab is not None and slab.failure is not None:
            raise slab.failure  # the roles stop as it leaves; polarkv.py: one line, exit 2
