"""The rows the manager persists: one per node and one per ready entry, written behind
in batches by manager/store.py and read back by manager/snapshot.py after a restart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


# Rows are named tuples in their columns' order: the store writes them as they are (a
# frozen dataclass cost ~1.4 us to build on the loop and ~1 us to turn into a tuple in
# the store's thread, per row; at 1M entries that thread held the GIL for a fifth of
# the manager's time).
class NodeRow(NamedTuple):
    node_id: str
    incarnation: int
    address: str
    capacity: int
    disk_capacity: int
    shm_path: str
    host_id: str
    transports: str  # comma separated


class EntryRow(NamedTuple):
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


NODE_COLUMNS: tuple[str, ...] = NodeRow._fields
ENTRY_COLUMNS: tuple[str, ...] = EntryRow._fields
ENTRY_KEY = ("tenant", "key")  # an entry is its tenant's: two tenants, two rows


@dataclass(slots=True)
class Batch:
    nodes: list[NodeRow]
    entries: list[EntryRow]
    deleted_keys: list[str]  # entries' identities (keys.ident)

    def __len__(self) -> int:
        return len(self.nodes) + len(self.entries) + len(self.deleted_keys)
