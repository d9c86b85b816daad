"""A slab's link to one manager shard: registration, heartbeats, file adoption and (with
the disk role) that shard's tier orders.

A slab keeps one link per URL in `slab.manager_url` (one per shard, DESIGN §11), all
over the same buffer, data server and disk: each shard manages its own arena of the
buffer and its own share of the disk (manager/shard.py), so the links share nothing but
the node's identity. Each link registers, heartbeats and re-registers on its own, so a
shard that is down or restarting leaves the others' links untouched. Before its first
registration a link asks its manager's /healthz which shard it is: a URL out of shard
order stops the slab (exit 2, one line naming the URL) instead of registering its buffer
and files with the wrong shard.

Every call to a manager is bounded (`call_timeout`): a manager that accepts a connection
and never answers costs one timeout, not the node. A node the manager declared dead, or
a manager that restarted and forgot it, is told so by its next heartbeat (404) and
registers again by itself.

A link sees its node through two narrow objects: `NodeIdentity` (what it registers: ids,
address, buffer and disk sizes) and `LinkHooks` (what it tells the node: a grant key
taken, a registration, a configuration failure; what it asks: the heartbeat's stats), so
the slab's internals stay the slab's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import xxhash

from polarkv_lib.client.control import ControlClient, NodeRef, RegisterRequest
from polarkv_lib.config import Config
from polarkv_lib.errors import AccessDenied, BadRequest, ConfigError, PolarKVError
from polarkv_lib.host import host_id
from polarkv_lib.logs import Events, RateLimiter
from polarkv_lib.node.disk_role import DiskRole
from polarkv_lib.shards import Shard, ShardOrderError

log = structlog.get_logger("polarkv.slab")

ADOPT_BATCH = 1000
ADOPT_TIMEOUT = 10.0
UNREGISTER_TIMEOUT = 1.0
DOWN_LOG_INTERVAL = 10.0  # one "manager unreachable" line per this many seconds, with a count


def call_timeout(config: Config) -> float:
    """The bound on one register/heartbeat call: long enough for a loaded manager, short
    enough that a hung one is noticed well within the manager's heartbeat TTL."""
    return max(2 * config.slab.heartbeat_interval, 1.0)


@dataclass(frozen=True)
class NodeIdentity:
    """Who the node is and what it offers, as every one of its links registers it."""

    node_id: str
    incarnation: int
    address: str
    buffer_size: int
    shm_path: str  # empty when shm is not among the transports
    transports: tuple[str, ...]
    disk_capacity: int  # 0 without a disk role

    @property
    def ref(self) -> NodeRef:
        return NodeRef(self.node_id, self.incarnation)


@dataclass(frozen=True)
class LinkHooks:
    """What a link tells its node, and the one thing it asks of it."""

    take_grant_key: Callable[[int, bytes | None, int], bool]  # shard, key, manager incarnation
    registered: Callable[[], None]
    fail: Callable[[ConfigError], None]
    stats: Callable[[], dict[str, int]]


class ManagerLink:
    def __init__(
        self,
        config: Config,
        url: str,
        shard: Shard,
        node: NodeIdentity,
        view: memoryview,
        hooks: LinkHooks,
        disk: DiskRole | None = None,
    ) -> None:
        self.node = node
        self.url = url
        self.shard = shard
        token = config.security.admin_token or config.security.token
        # shard: the manager at `url` must say it is this link's shard (ShardOrderError)
        self.control = ControlClient(
            url, token or None, breaker_interval=0, pool_limit=8, shard=shard
        )
        self.registered = asyncio.Event()
        self.registrations = 0
        self.disk = disk  # this shard's tier orders, with the disk role
        self._view = view
        self._hooks = hooks
        # Heartbeat at least three times per manager TTL, whatever was configured here.
        self._interval = self._configured = config.slab.heartbeat_interval
        self._timeout = call_timeout(config)
        self._task: asyncio.Task[None] | None = None
        self._down = RateLimiter(log, DOWN_LOG_INTERVAL)

    def start(self) -> None:
        if self.disk is not None:
            ref = self.node.ref
            self.disk.start(self.control, lambda: ref, self.registered)
        self._task = asyncio.create_task(self._loop(), name=f"slab-heartbeat-{self.shard}")

    async def stop(self) -> None:
        """Stop heartbeating and taking orders, and tell the manager (bounded)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.disk is not None:
            await self.disk.stop()
        if self.registered.is_set():
            try:
                await self.control.unregister(self.node.ref, time.monotonic() + UNREGISTER_TIMEOUT)
            except PolarKVError:
                pass  # the manager will notice the silence
        await self.control.close()

    async def _register(self) -> bool:
        node = self.node
        # The whole buffer and disk: the manager takes its shard's part of each.
        info = RegisterRequest(
            node.node_id,
            node.incarnation,
            node.address,
            node.buffer_size,
            node.shm_path,
            host_id(),
            list(node.transports),
            node.disk_capacity,
        )
        try:
            reg = await self.control.register(info, time.monotonic() + self._timeout)
        except (BadRequest, AccessDenied) as exc:
            log.error(
                Events.REGISTRATION_REFUSED, status=exc.status, error=str(exc), manager=self.url
            )
            return False
        if not self._hooks.take_grant_key(self.shard.index, reg.grant_key, reg.manager_incarnation):
            return False
        if not await self._confirm():
            return False
        if reg.heartbeat_ttl is not None:
            self._interval = min(self._configured, reg.heartbeat_ttl / 3)
        if self.disk is not None and not await self._adopt():
            return False
        self.registered.set()
        self.registrations += 1
        log.info(
            Events.SLAB_REGISTERED,
            node=node.node_id,
            incarnation=node.incarnation,
            registrations=self.registrations,
            manager=self.url,
            shard=str(self.shard),
        )
        self._hooks.registered()
        return True

    async def _confirm(self) -> bool:
        """A manager that restarted asks which of this node's memory extents still hold
        the entries it has on record: those whose payload still hashes to the entry's
        checksum (hashed off the loop, a batch at a time). Only those come back."""
        view = self._view

        def check(batch: list[tuple[int, int, str]]) -> list[tuple[int, str, bool]]:
            return [(o, c, xxhash.xxh3_64_hexdigest(view[o : o + n]) == c) for o, n, c in batch]

        held: list[tuple[int, str, bool]] = []
        try:
            while batch := await self.control.confirm(
                self.node.ref, held, time.monotonic() + self._timeout
            ):
                held = await asyncio.to_thread(check, batch)
        except PolarKVError as exc:
            log.warning(Events.REGISTRATION_REFUSED, error=str(exc), manager=self.url)
            return False
        return True

    async def _adopt(self) -> bool:
        """Tell the manager which of this node's files are in its range, so they serve
        hits again (each file's key names exactly one shard)."""
        assert self.disk is not None
        files = [f for f in self.disk.inventory() if self.shard.owns(f["key"])]
        for start in range(0, len(files), ADOPT_BATCH):
            try:
                delete = await self.control.adopt(
                    self.node.ref,
                    files[start : start + ADOPT_BATCH],
                    time.monotonic() + ADOPT_TIMEOUT,
                )
            except (BadRequest, AccessDenied) as exc:
                log.error(
                    Events.ADOPTION_REFUSED, status=exc.status, error=str(exc), manager=self.url
                )
                return False
            for key in delete:  # the manager has a fresher copy elsewhere
                await asyncio.to_thread(self.disk.store.delete, key)
        if files:
            log.info(Events.DISK_ADOPTED, files=len(files), manager=self.url)
        return True

    async def _beat(self) -> None:
        if not self.registered.is_set():
            await self._register()
            return
        try:
            await self.control.heartbeat(
                self.node.ref, self._hooks.stats(), time.monotonic() + self._timeout
            )
        except BadRequest as exc:
            if exc.status != 404:
                raise
            log.warning(Events.SLAB_FORGOTTEN, node=self.node.node_id, manager=self.url)
            self.registered.clear()
            await self._register()

    async def _loop(self) -> None:
        while True:
            try:
                await self._beat()
                self._down.clear(Events.MANAGER_UNREACHABLE)
            except ShardOrderError as exc:  # slab.manager_url out of order: stop the node
                self._hooks.fail(ConfigError(f"slab.manager_url: {exc}"))
                return
            except PolarKVError as exc:  # unreachable, timed out, refused: keep knocking
                self._down.warning(
                    Events.MANAGER_UNREACHABLE,
                    node=self.node.node_id,
                    manager=self.url,
                    error=str(exc) or type(exc).__name__,
                )
            await asyncio.sleep(
                self._interval if self.registered.is_set() else min(self._interval, 0.2)
            )
