"""The slab role: owns the buffer, serves it over the data plane, registers and heartbeats.
With the disk role in the same process, the buffer is also what offloads are written
from and reloads are read into (paired sharding).

The slab keeps one `ManagerLink` per manager shard in `slab.manager_url` (one, unless
the manager is sharded: DESIGN §11); each registers, heartbeats, re-registers and takes
its shard's tier orders on its own, over the one buffer, data server and disk.

The data server starts before registration succeeds (it refuses every request until it
has the grant key), so a slab started before its manager simply keeps trying to
register. Without `security.grant_key` (one shard only: several need a shared key), the
slab takes the manager's key from every registration: a restarted manager makes a new
one.
"""

from __future__ import annotations

import asyncio
import secrets
import socket

import structlog

from polarkv_lib.client.control import NodeRef
from polarkv_lib.config import Config
from polarkv_lib.errors import ConfigError
from polarkv_lib.logs import Events
from polarkv_lib.node.admission import Gate
from polarkv_lib.node.buffer import SlabBuffer
from polarkv_lib.node.dataserver import DataServer
from polarkv_lib.node.disk import DiskStore
from polarkv_lib.node.disk_role import DiskRole
from polarkv_lib.node.manager_link import LinkHooks, ManagerLink, NodeIdentity, call_timeout
from polarkv_lib.node.rdma_server import RdmaServer
from polarkv_lib.node.rdma_server import start as start_rdma
from polarkv_lib.shards import Shard, split_urls
from polarkv_lib.wire.grants import epoch_key

log = structlog.get_logger("polarkv.slab")

__all__ = ["SlabService", "call_timeout"]


class SlabService:
    def __init__(self, config: Config, disk: DiskStore | None = None) -> None:
        self.config = config
        self.store = disk  # with a store, this process runs the disk role too
        self.incarnation = secrets.randbits(63) or 1
        self.node_id = ""
        self.address = ""
        self.buffer: SlabBuffer | None = None
        self.server: DataServer | None = None
        self.rdma: RdmaServer | None = None
        self.registered = asyncio.Event()  # set once every shard has registered this node
        # A configuration mistake found while running (shard URLs out of order): the
        # runner stops the process and exits with it.
        self.failure: ConfigError | None = None
        self.failed = asyncio.Event()
        self._fixed_key = config.security.grant_key.encode() if config.security.grant_key else None
        # Per manager shard, the key its current incarnation signs grants with: a grant
        # of a manager that has since restarted verifies with none of them.
        self._grant_keys: dict[int, bytes] = {}
        self.links: list[ManagerLink] = []  # made at start, once the node knows who it is

    @property
    def ref(self) -> NodeRef:
        return NodeRef(self.node_id, self.incarnation)

    @property
    def registrations(self) -> int:
        """Successful registrations, with every shard together."""
        return sum(link.registrations for link in self.links)

    async def start(self, sock: socket.socket) -> None:
        s = self.config.slab
        host, port = sock.getsockname()[:2]
        self.address = s.advertise or f"{host}:{port}"
        self.node_id = s.node_id or self.address
        store = self.store
        if store is not None:
            found = await asyncio.to_thread(store.scan)
            log.info(
                Events.DISK_SCANNED,
                paths=list(store.paths),
                files=len(found),
                bytes=store.used,
                capacity=store.capacity,
                o_direct=store.o_direct,
            )
        # Reserving the whole buffer (posix_fallocate) takes a while for a large slab:
        # off the loop, which may be serving an embedded manager meanwhile.
        self.buffer = await asyncio.to_thread(
            SlabBuffer, s.shm_dir, self.node_id, self.incarnation, s.memory
        )
        # One gate (and so one fence) for every request on the data port, tcp or rdma.
        gate = Gate(self.buffer.size, self.incarnation, self.grant_keys, s.frame_timeout)
        if "rdma" in s.transports:  # registering a large buffer takes a while: off the loop
            self.rdma = await asyncio.to_thread(
                start_rdma,
                self.buffer.view,
                gate,
                s.rdma_device,
                s.rdma_port,
                s.rdma_gid_index,
                s.rdma_windows,
            )
        self.server = DataServer(sock, self.buffer.view, gate, s, self.rdma)
        self.server.start()
        identity = NodeIdentity(
            self.node_id,
            self.incarnation,
            self.address,
            self.buffer.size,
            self.buffer.path if "shm" in s.transports else "",
            tuple(s.transports),
            self.config.disk.capacity if store is not None else 0,
        )
        hooks = LinkHooks(self.take_grant_key, self.link_registered, self.fail, self.stats)
        urls = split_urls(s.manager_url)
        for i, url in enumerate(urls):
            disk = None
            if store is not None:  # each shard's orders, over the one store and buffer
                disk = DiskRole(
                    store, self.buffer.view, self.node_id, self.config.disk.io_threads, gate.fence
                )
            self.links.append(
                ManagerLink(
                    self.config, url, Shard(i, len(urls)), identity, self.buffer.view, hooks, disk
                )
            )
        for link in self.links:
            link.start()
        log.info(
            Events.SLAB_SERVING,
            node=self.node_id,
            address=self.address,
            memory=s.memory,
            buffer=self.buffer.path,
            incarnation=self.incarnation,
            managers=len(self.links),
        )

    async def stop(self) -> None:
        """Ordered: stop talking to the managers (and tell them), then stop serving, then
        release the buffer. Each step is bounded by its own timeouts."""
        await asyncio.gather(*(link.stop() for link in self.links))
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        if self.rdma is not None:  # deregistered before the buffer is unmapped
            self.rdma.close()
        if self.buffer is not None:
            self.buffer.close()
        log.info(Events.SLAB_STOPPED, node=self.node_id)

    def take_grant_key(self, shard: int, key: bytes | None, manager_incarnation: int) -> bool:
        """A registration with shard `shard`: the key its manager incarnation signs with,
        from the configured grant key or else the one the manager shares. False: none."""
        base = self._fixed_key if self._fixed_key is not None else key
        if base is None:
            log.error(Events.NO_GRANT_KEY)
            return False
        epoch = epoch_key(base, manager_incarnation)
        if shard in self._grant_keys and self._grant_keys[shard] != epoch:
            log.info(Events.GRANT_KEY_CHANGED, node=self.node_id, shard=shard)
        self._grant_keys[shard] = epoch
        return True

    def grant_keys(self) -> tuple[bytes, ...]:
        """The keys a grant may verify with now: one per registered manager shard."""
        return tuple(self._grant_keys.values())

    def fail(self, error: ConfigError) -> None:
        if self.failure is None:
            log.error(Events.SLAB_MISCONFIGURED, error=str(error))
            self.failure = error
            self.failed.set()

    def link_registered(self) -> None:
        if all(link.registered.is_set() for link in self.links):
            self.registered.set()

    def stats(self) -> dict[str, int]:
        assert self.server is not None
        counts = vars(self.server.stats) | vars(self.server.gate.stats)
        out = {f"data_{k}": v for k, v in counts.items()}
        if self.rdma is not None:
            out.update(vars(self.rdma.stats))
        roles = [link.disk for link in self.links if link.disk is not None]
        if self.store is not None and roles:
            out.update(self.store.stats())
            for role in roles:
                for k, v in role.failures.items():
                    out[f"disk_failures_{k}"] = out.get(f"disk_failures_{k}", 0) + v
            out["tiering_bytes_to_other_nodes"] = sum(role.bytes_for_other_nodes for role in roles)
        return out
