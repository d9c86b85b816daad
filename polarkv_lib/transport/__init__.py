"""Client-side data-plane transports behind one interface, and which ones a client uses.

`tcp` works everywhere; `shm` reaches a slab on this host; `rdma` needs an RDMA device
here and a slab that advertises it. A client asks `open_transports(preference)` once:
an explicit name gives that transport alone (rdma without a usable device is a
start-up error naming the reason); `auto` gives shm, then rdma, then tcp, and each
transfer takes the first one usable for its slab. In `auto`, rdma costs nothing until a
slab advertises it: only then is pyverbs imported and the device probed (once per
process); where none is usable that slab is reached over tcp, with one debug line.
"""

from __future__ import annotations

import logging
import os
import threading

from polarkv_lib.errors import ConfigError
from polarkv_lib.transport.base import NodeTarget, Region, Transport

# stdlib logging, not structlog: the client lives inside engines, which own log config.
log = logging.getLogger("polarkv.client")

NAMES = ("tcp", "shm", "rdma")
PREFERENCES = ("auto", *NAMES)

_probe_lock = threading.Lock()
_probed: list[str | None] = []  # [reason] once probed; None means usable


def rdma_selection() -> tuple[str, int, int]:
    """(device, port, gid index) a client uses: the first device with an active port 1
    and an automatic GID unless POLARKV_RDMA_DEVICE / _PORT / _GID_INDEX say otherwise
    (hosts with several NICs pick the one on the slabs' fabric)."""
    env = os.environ
    try:
        return (
            env.get("POLARKV_RDMA_DEVICE", ""),
            int(env.get("POLARKV_RDMA_PORT", "1")),
            int(env.get("POLARKV_RDMA_GID_INDEX", "-1")),
        )
    except ValueError:
        raise ConfigError("POLARKV_RDMA_PORT and POLARKV_RDMA_GID_INDEX must be integers") from None


def rdma_unavailable() -> str | None:
    """Why this host cannot use rdma (None when it can); probed once per process."""
    with _probe_lock:
        if not _probed:
            from polarkv_lib.transport.rdma_verbs import probe

            device, port, _ = rdma_selection()
            _probed.append(probe(device, port))
        return _probed[0]


def create(name: str, connections: int = 8) -> Transport:
    """One transport by name; RdmaUnavailable (a ConfigError) where rdma cannot run."""
    if name == "tcp":
        from polarkv_lib.transport.tcp import TcpTransport

        return TcpTransport(max_idle_per_node=connections)
    if name == "shm":
        from polarkv_lib.transport.shm import ShmTransport

        return ShmTransport()
    if name == "rdma":
        from polarkv_lib.transport.rdma import RdmaTransport

        device, port, gid_index = rdma_selection()
        return RdmaTransport(device, port, gid_index, max_idle_per_node=connections)
    raise ValueError(f"transport must be one of {', '.join(PREFERENCES)}, got {name!r}")


class AutoRdma(Transport):
    """`auto`'s rdma: usable for slabs that advertise rdma once a device here proved
    usable. Nothing is imported or probed before the first such slab."""

    name = "rdma"

    def __init__(self, connections: int) -> None:
        self._connections = connections
        self._lock = threading.Lock()
        self._tried = False
        self._inner: Transport | None = None

    def _open(self) -> Transport | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                reason = rdma_unavailable()
                try:
                    self._inner = None if reason else create("rdma", self._connections)
                except ConfigError as exc:  # the device went away since the probe
                    reason = str(exc)
                if reason:
                    log.debug("rdma not used, falling back to tcp: %s", reason)
            return self._inner

    @property
    def active(self) -> Transport | None:
        """The rdma transport in use, if any slab needed one and a device was usable."""
        return self._inner

    def usable(self, node: NodeTarget) -> bool:
        if "rdma" not in node.transports:
            return False
        inner = self._open()
        return inner is not None and inner.usable(node)

    def read_into(self, region: Region, view: memoryview, deadline: float) -> str | None:
        inner = self._open()
        assert inner is not None, "usable() said no"
        return inner.read_into(region, view, deadline)

    def write_from(self, region: Region, view: memoryview, deadline: float) -> str | None:
        inner = self._open()
        assert inner is not None, "usable() said no"
        return inner.write_from(region, view, deadline)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()


def choose(preference: str) -> tuple[str, ...]:
    """The transport names a client with `preference` tries, best first (pure)."""
    if preference not in PREFERENCES:
        raise ValueError(f"transport must be one of {', '.join(PREFERENCES)}, got {preference!r}")
    return ("shm", "rdma", "tcp") if preference == "auto" else (preference,)


def open_transports(preference: str, connections: int = 8) -> list[Transport]:
    return [
        AutoRdma(connections)
        if preference == "auto" and name == "rdma"
        else create(name, connections)
        for name in choose(preference)
    ]


def pick(transports: list[Transport], node: NodeTarget) -> Transport | None:
    """The first transport that can reach `node`."""
    for transport in transports:
        if transport.usable(node):
            return transport
    return None


__all__ = [
    "NAMES",
    "PREFERENCES",
    "AutoRdma",
    "NodeTarget",
    "Region",
    "Transport",
    "choose",
    "create",
    "open_transports",
    "pick",
    "rdma_unavailable",
]
