"""The rows the manager persists: one per node and one per ready entry, written behind
in batches by manager/store.py and read back by manager/snapshot.py after a restart."""

from __future__ import annotations

from dataclasses import dataclass

NODE_COLUMNS = (
    "node_id",
    "incarnation",
    "address",
    "capacity",
    "disk_capacity",
    "shm_path",
    "host_id",
    "transports",
)
ENTRY_COLUMNS = (
    "tenant",
    "key",
    "node_id",
    "incarnation",
    "size",
    "checksum",
    "mem_offset",
    "mem_extent",
    "in_memory",
    "on_disk",
    "file_bytes",
    "created",
)
ENTRY_KEY = ("tenant", "key")  # an entry is its tenant's: two tenants, two rows


@dataclass(frozen=True, slots=True)
class NodeRow:
    node_id: str
    incarnation: int
    address: str
    capacity: int
    disk_capacity: int
    shm_path: str
    host_id: str
    transports: str  # comma separated


@dataclass(frozen=True, slots=True)
class EntryRow:
    key: str  # the client's key; with `tenant`, the entry's identity (keys.ident)
    node_id: str
    incarnation: int
    size: int
    checksum: str
    mem_offset: int
    mem_extent: int
    in_memory: bool
    on_disk: bool
    file_bytes: int
    created: float
    tenant: str = ""  # whose entry it is ("" the default tenant's)


@dataclass(slots=True)
class Batch:
    nodes: list[NodeRow]
    entries: list[EntryRow]
    deleted_keys: list[str]  # entries' identities (keys.ident)

    def __len__(self) -> int:
        return len(self.nodes) + len(self.entries) + len(self.deleted_keys)
