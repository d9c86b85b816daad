"""Role runners: bind every socket, start the roles on one event loop, stop them in order.

Sockets are bound before anything starts, so "port in use" is a config error naming the
key and nothing runs half-way. Shutdown is the reverse of start-up and bounded: the
slab unregisters and stops serving first (clients then miss fast), then the manager.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import signal
import socket

import orjson
import structlog

from polarkv_lib.config import Config, parse_address
from polarkv_lib.errors import ConfigError
from polarkv_lib.manager.app import ManagerService
from polarkv_lib.node.disk import DiskStore
from polarkv_lib.node.slab import SlabService

log = structlog.get_logger("polarkv")
ROLES = ("manager", "slab", "disk")
SHUTDOWN_BOUND = 10.0


def resolve_roles(requested: tuple[str, ...]) -> set[str]:
    roles = set(requested) or {"manager", "slab", "disk"}  # no role: the embedded single node
    if "disk" in roles and "slab" not in roles:
        raise ConfigError("--role disk: the disk role shares the slab's buffer in one process "
                          "(memory and disk of a VM are paired); use --role slab --role disk")
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
    node registration, the grant key) to anyone on the network."""
    if insecure or config.security.token:
        return
    for role, key, address in (("manager", "manager.listen", config.manager.listen),
                               ("slab", "slab.listen", config.slab.listen)):
        if role in roles and not _is_loopback(parse_address(address)[0]):
            raise ConfigError(f"{key}: {address} is reachable from other hosts but security.token "
                              f"is empty; set a token (and security.admin_token) or pass --insecure")


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


async def run(config: Config, roles: set[str], ready_file: str | None = None,
              stop: asyncio.Event | None = None, insecure: bool = False) -> None:
    stop = stop or asyncio.Event()
    check_exposure(config, roles, insecure)
    manager_sock = bind(config.manager.listen, "manager.listen") if "manager" in roles else None
    try:
        slab_sock = bind(config.slab.listen, "slab.listen") if "slab" in roles else None
    except ConfigError:
        if manager_sock is not None:
            manager_sock.close()
        raise
    try:  # an unwritable disk path is a config error too, found before anything starts
        d = config.disk
        store = DiskStore(d.paths, d.capacity, d.o_direct) if "disk" in roles else None
    except ConfigError:
        for sock in (manager_sock, slab_sock):
            if sock is not None:
                sock.close()
        raise
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    manager = slab = None
    try:
        ready: dict[str, object] = {"pid": os.getpid(), "roles": sorted(roles)}
        if manager_sock is not None:
            manager = ManagerService(config)
            await manager.open_store()
            await manager.start(manager_sock)
            ready["manager_url"] = manager.url
            if slab_sock is not None:  # embedded: the slab registers with this manager
                config = dataclasses.replace(
                    config, slab=dataclasses.replace(config.slab, manager_url=manager.url))
        if slab_sock is not None:
            slab = SlabService(config, disk=store)
            await slab.start(slab_sock)
            ready["slab_address"] = slab.address
            ready["node_id"] = slab.node_id
            if manager is not None:  # embedded: don't report ready before the node is usable
                await asyncio.wait_for(slab.registered.wait(), 10.0)
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "wb") as fh:
                fh.write(orjson.dumps(ready))
            os.replace(tmp, ready_file)
        log.info("polarkv ready", **ready)
        await stop.wait()
        log.info("shutting down")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        try:
            async with asyncio.timeout(SHUTDOWN_BOUND):
                if slab is not None:
                    await slab.stop()
                if manager is not None:
                    await manager.stop()
        except TimeoutError:
            log.error("shutdown ran past its bound; exiting anyway", bound=SHUTDOWN_BOUND)
        for sock in (manager_sock, slab_sock):
            if sock is not None:
                sock.close()
