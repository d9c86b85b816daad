"""The shape of a cluster: its VMs, their addresses, and what runs in each.

Addresses live in one /24 chosen per cluster (default 10.77.0.0/24) that exists only on
the cluster's bridge: the host sits at .1, manager shards from .16, memory VMs in .32/28
(.32-.47, one subnet so that the bridge can count what they send each other), client VMs
from .64. Names are the cluster's prefix plus the VM's name (`pkv-mem0`),
for the namespace, the host end of its link and its hostname alike.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

from polarkv_lib.cluster.netns import ClusterError, parse_rate
from polarkv_lib.config import parse_size

MANAGER_PORT = 8170
SLAB_PORT = 8171
POOL_PORT = 8172  # global pools only: the remote disk server
MAX_SHARDS, MAX_MEMORY_VMS, MAX_CLIENT_VMS = 8, 16, 16
_BASE = {"manager": 16, "memory": 32, "client": 64}
MEMORY_BLOCK = 28  # prefix length of the memory VMs' block, .32/28
_SHORT = {"manager": "mgr", "memory": "mem", "client": "cli"}


@dataclass(frozen=True)
class Vm:
    name: str  # e.g. mem0
    role: str  # manager, memory or client
    index: int
    netns: str  # also the host end of its link and its hostname
    address: str  # inside the cluster's /24

    @property
    def hostname(self) -> str:
        return self.netns


@dataclass(frozen=True)
class ClusterSpec:
    name: str = "pkv"
    subnet: str = "10.77.0"  # the first three octets of the cluster's /24
    shards: int = 1
    memory_vms: int = 2
    client_vms: int = 1
    nic: str = "2Gbit"
    slab_memory: str = "256MiB"
    disk_capacity: str = "2GiB"
    # Extra `--set` for every polarkv process (e.g. watermarks, log.level).
    settings: tuple[str, ...] = ()
    # Experiment only: each memory VM's disk tier served by the next memory VM over the
    # network (global pools), to measure what pairing memory with its own disk saves.
    global_pools: bool = False
    # False: memory VMs run the slab role only (memory-only, for comparisons).
    disk_tier: bool = True
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    grant_key: str = field(default_factory=lambda: secrets.token_hex(32))

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", self.name):
            raise ClusterError(
                f"cluster name {self.name!r}: 1-6 lowercase letters or digits, "
                f"starting with a letter (it prefixes every link name)"
            )
        octets = self.subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise ClusterError(
                f"subnet {self.subnet!r}: the first three octets of a /24, e.g. 10.77.0"
            )
        for what, n, most, least in (
            ("shards", self.shards, MAX_SHARDS, 1),
            ("memory VMs", self.memory_vms, MAX_MEMORY_VMS, 1),
            ("client VMs", self.client_vms, MAX_CLIENT_VMS, 0),
        ):
            if not least <= n <= most:
                raise ClusterError(f"{what}: {n} is not between {least} and {most}")
        if self.global_pools and self.memory_vms < 2:
            raise ClusterError("global pools need at least two memory VMs")
        if self.global_pools and not self.disk_tier:
            raise ClusterError("global pools are a layout of the disk tier: it cannot be off")
        try:
            parse_rate(self.nic)
        except ValueError as exc:
            raise ClusterError(f"--nic: {exc}") from None
        for what, size in (
            ("--slab-memory", self.slab_memory),
            ("--disk-capacity", self.disk_capacity),
        ):
            try:
                parse_size(size)
            except ValueError as exc:
                raise ClusterError(f"{what}: {exc}") from None

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    @property
    def host_address(self) -> str:
        return f"{self.subnet}.1"

    def vms(self) -> list[Vm]:
        out = []
        for role, count in (
            ("manager", self.shards),
            ("memory", self.memory_vms),
            ("client", self.client_vms),
        ):
            for i in range(count):
                name = f"{_SHORT[role]}{i}"
                out.append(
                    Vm(name, role, i, f"{self.name}-{name}", f"{self.subnet}.{_BASE[role] + i}")
                )
        return out

    def vm(self, name: str) -> Vm:
        for vm in self.vms():
            if vm.name == name:
                return vm
        raise ClusterError(
            f"no VM {name!r} in cluster {self.name} (VMs: {', '.join(v.name for v in self.vms())})"
        )

    @property
    def memory_block(self) -> str:
        return f"{self.subnet}.{_BASE['memory']}/{MEMORY_BLOCK}"

    def manager_services(self) -> list[str]:
        return [vm.name for vm in self.vms() if vm.role == "manager"]

    def memory_services(self) -> list[str]:
        return [vm.name for vm in self.vms() if vm.role == "memory"]

    def pool_services(self) -> list[str]:
        return [f"pool{i}" for i in range(self.memory_vms)] if self.global_pools else []

    def pool_host(self, owner: Vm) -> Vm:
        """Global pools: the memory VM that holds `owner`'s disk tier (the next one)."""
        return self.vm(f"mem{(owner.index + 1) % self.memory_vms}")

    def manager_urls(self) -> list[str]:
        return [f"http://{vm.address}:{MANAGER_PORT}" for vm in self.vms() if vm.role == "manager"]

    def security_settings(self) -> list[str]:
        return [
            f"security.token={self.token}",
            f"security.admin_token={self.admin_token}",
            f"security.grant_key={self.grant_key}",
        ]

    def client_env(self) -> dict[str, str]:
        """What a tool in a client VM needs to find and use the cluster."""
        return {
            "POLARKV_CLIENT__MANAGER_URL": ",".join(self.manager_urls()),
            "POLARKV_SECURITY__TOKEN": self.token,
            "POLARKV_SECURITY__ADMIN_TOKEN": self.admin_token,
        }

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["settings"] = list(self.settings)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterSpec:
        data = dict(data)
        data["settings"] = tuple(data.get("settings", ()))
        return cls(**data)
