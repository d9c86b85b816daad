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
    key: str
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


@dataclass(slots=True)
class Batch:
    nodes: list[NodeRow]
    entries: list[EntryRow]
    deleted_keys: list[str]

    def __len__(self) -> int:
        return len(self.nodes) + len(self.entries) + len(self.deleted_keys)
