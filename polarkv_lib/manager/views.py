"""Read-only views of the manager core: one key, the nodes, and the stats.

`STATS_KEYS` is the one schema of `/v1/stats`: `stats()` returns exactly these keys,
`openapi.py` describes them and `metrics.py` reads its Prometheus values from them.
"""

from __future__ import annotations

from typing import Any

from polarkv_lib.manager.model import TenantStats
from polarkv_lib.manager.tables import Tables

STATS_KEYS = (
    "keys_memory",
    "keys_disk",
    "keys_writing",
    "bytes_memory",
    "bytes_memory_allocated",
    "bytes_disk",
    "capacity_memory",
    "capacity_disk",
    "hits",
    "misses",
    "hits_memory",
    "hits_disk",
    "lookups",
    "allocations",
    "alloc_exists",
    "alloc_in_progress",
    "alloc_no_space",
    "commits",
    "aborts",
    "offloads",
    "offload_bytes",
    "bytes_offloading",
    "reloads",
    "reload_bytes",
    "evictions",
    "disk_evictions",
    "tier_failures",
    "expired_write_leases",
    "expired_read_leases",
    "checksum_failures",
    "corrupt_reports",
    "corrupt_reports_rejected",
    "deletes",
    "entries_lost",
    "read_leases",
    "write_leases",
    "nodes",
    "nodes_dead",
)


class Views:
    """Read-only over the core's tables (composed into `Metadata` as `views`)."""

    def __init__(self, tables: Tables) -> None:
        self.tables = tables

    def describe(self, key: str) -> dict[str, Any] | None:
        entry = self.tables.get(key)
        if entry is None:
            return None
        tiers = (["memory"] if entry.in_memory and entry.alloc_size else []) + (
            ["disk"] if entry.on_disk else []
        )
        return {
            "key": key,
            "state": entry.state.value,
            "tiers": tiers,
            "node": entry.node.node_id,
            "size": entry.size,
            "checksum": entry.checksum or None,
            "readers": entry.readers,
            "offloading": entry.offloading,
            "reloading": entry.reloading,
            "created": entry.created,
            "last_access": entry.last_access,
        }

    def node_views(self) -> list[dict[str, Any]]:
        return [
            {
                "id": n.node_id,
                "address": n.address,
                "state": "alive" if n.alive else "dead",
                "incarnation": n.incarnation,
                "transports": n.transports,
                "memory_used": n.allocator.used if n.alive else 0,
                "memory_capacity": n.capacity,
                "keys_memory": n.keys_memory,
                "bytes_memory": n.ready_bytes,
                "disk_used": n.disk_used,
                "disk_capacity": n.disk_capacity,
                "keys_disk": len(n.disk_lru),
                "last_heartbeat": n.last_heartbeat_wall,
                "reported": n.reported,
                "draining": n.draining,
                "offloads_pending": len(n.offloads),
            }
            for n in self.tables.nodes.values()
        ]

    def tenant_views(self) -> dict[str, dict[str, int]]:
        """Per tenant (by name; "default" for the default namespace): its counters and
        the memory its ready entries take."""
        return {
            name or "default": {f: getattr(t, f) for f in TenantStats.__slots__}
            for name, t in sorted(self.tables.tenant_stats.items())
        }

    def tier_failures(self) -> dict[str, int]:
        return dict(self.tables.counters.tier_failures)

    def stats(self) -> dict[str, int]:
        alive = [n for n in self.tables.nodes.values() if n.alive]
        c = self.tables.counters
        stats = {
            "keys_memory": sum(n.keys_memory for n in alive),
            "keys_disk": sum(len(n.disk_lru) for n in alive),
            "keys_writing": sum(len(w.entries) for w in self.tables.write_leases.values()),
            "bytes_memory": sum(n.ready_bytes for n in alive),
            "bytes_memory_allocated": sum(n.allocator.used for n in alive),
            "bytes_disk": sum(n.disk_used for n in alive),
            "capacity_memory": sum(n.allocator.capacity for n in alive),
            "capacity_disk": sum(n.disk_capacity for n in alive),
            "hits": c.hits,
            "misses": c.misses,
            "hits_memory": c.hits_memory,
            "hits_disk": c.hits_disk,
            "lookups": c.lookups,
            "allocations": c.allocations,
            "alloc_exists": c.exists,
            "alloc_in_progress": c.in_progress,
            "alloc_no_space": c.no_space,
            "commits": c.commits,
            "aborts": c.aborts,
            "offloads": c.offloads,
            "offload_bytes": c.offload_bytes,
            "bytes_offloading": sum(n.offloading_bytes for n in alive),
            "reloads": c.reloads,
            "reload_bytes": c.reload_bytes,
            "evictions": c.evictions,
            "disk_evictions": c.disk_evictions,
            "tier_failures": sum(c.tier_failures.values()),
            "expired_write_leases": c.expired_writes,
            "expired_read_leases": c.expired_reads,
            "checksum_failures": c.checksum_failures,
            "corrupt_reports": c.corrupt_reports,
            "corrupt_reports_rejected": c.corrupt_reports_rejected,
            "deletes": c.deletes,
            "entries_lost": c.entries_lost,
            "read_leases": len(self.tables.read_leases),
            "write_leases": len(self.tables.write_leases),
            "nodes": len(alive),
            "nodes_dead": len(self.tables.nodes) - len(alive),
        }
        assert tuple(stats) == STATS_KEYS  # one schema: openapi and metrics read STATS_KEYS
        return stats
