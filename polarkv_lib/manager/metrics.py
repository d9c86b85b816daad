"""Prometheus metrics of the manager.

Counters and gauges are read from the metadata core at scrape time (one source of
truth, so /metrics and /v1/stats can never disagree); request latency is a histogram
observed by the HTTP shell. Each manager owns its own registry, so several managers can
live in one process (tests, embedded use).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from polarkv_lib.manager.views import STATS_KEYS

Source = str | dict[str, str]  # a stats key, or {label value: stats key}
_COUNTERS: dict[str, tuple[str, str, Source]] = {
    # metric name: (help, stats key or {label value: stats key})
    "polarkv_hits": (
        "chunks found by lookups, by tier",
        "tier",
        {"memory": "hits_memory", "disk": "hits_disk"},
    ),
    "polarkv_misses": ("chunks looked up past the hit prefix", "", "misses"),
    "polarkv_lookups": ("lookup requests", "", "lookups"),
    "polarkv_allocations": (
        "allocate results, by result",
        "result",
        {
            "allocated": "allocations",
            "exists": "alloc_exists",
            "in_progress": "alloc_in_progress",
            "no_space": "alloc_no_space",
        },
    ),
    "polarkv_commits": ("entries made visible by write-finish", "", "commits"),
    "polarkv_aborts": ("writes aborted by their writer", "", "aborts"),
    "polarkv_evictions": ("ready entries evicted from memory", "", "evictions"),
    "polarkv_offloads": ("entries written to disk", "", "offloads"),
    "polarkv_reloads": ("entries read back from disk", "", "reloads"),
    "polarkv_expired_leases": (
        "leases that ran out, by kind",
        "kind",
        {"read": "expired_read_leases", "write": "expired_write_leases"},
    ),
    "polarkv_checksum_failures": (
        "entries dropped because their bytes failed the checksum",
        "",
        "checksum_failures",
    ),
    "polarkv_corrupt_reports": (
        "clients' checksum-mismatch reports (checked on the slab before any drop)",
        "",
        "corrupt_reports",
    ),
    "polarkv_corrupt_reports_rejected": (
        "reports the slab's bytes did not bear out",
        "",
        "corrupt_reports_rejected",
    ),
    "polarkv_deletes": ("entries deleted through the admin API", "", "deletes"),
    "polarkv_entries_lost": ("ready entries lost with a dead node", "", "entries_lost"),
}
_GAUGES: dict[str, tuple[str, str, Source]] = {
    "polarkv_keys": (
        "ready entries, by tier",
        "tier",
        {"memory": "keys_memory", "disk": "keys_disk"},
    ),
    "polarkv_bytes": (
        "payload bytes of ready entries, by tier",
        "tier",
        {"memory": "bytes_memory", "disk": "bytes_disk"},
    ),
    "polarkv_capacity_bytes": (
        "capacity of alive nodes, by tier",
        "tier",
        {"memory": "capacity_memory", "disk": "capacity_disk"},
    ),
    "polarkv_allocated_bytes": (
        "memory held by allocations, ready or being written",
        "",
        "bytes_memory_allocated",
    ),
    "polarkv_leases": (
        "live leases, by kind",
        "kind",
        {"read": "read_leases", "write": "write_leases"},
    ),
    "polarkv_nodes": (
        "registered nodes, by state",
        "state",
        {"alive": "nodes", "dead": "nodes_dead"},
    ),
}


def _stats_keys(table: dict[str, tuple[str, str, Source]]) -> set[str]:
    return {
        k
        for _, _, source in table.values()
        for k in (source.values() if isinstance(source, dict) else [source])
    }


# every value comes from the one stats schema (manager/views.py)
assert _stats_keys(_COUNTERS) | _stats_keys(_GAUGES) <= set(STATS_KEYS)

_NODE_GAUGES = {
    # per node, from the manager's view and from what the node itself reports
    "polarkv_node_memory_used_bytes": ("memory held by allocations on the node", "memory_used"),
    "polarkv_node_memory_capacity_bytes": ("the node's memory", "memory_capacity"),
    "polarkv_node_disk_used_bytes": ("bytes of the node's files", "disk_used"),
    "polarkv_node_disk_capacity_bytes": ("the node's disk budget", "disk_capacity"),
    "polarkv_node_keys_memory": ("entries with a memory copy on the node", "keys_memory"),
    "polarkv_node_keys_disk": ("entries with a file on the node", "keys_disk"),
}
_NODE_REPORTED = {
    "polarkv_node_tiering_bytes_to_other_nodes": (
        "bytes of tiering orders that named another node's buffer (stays 0: tiering is local)",
        "tiering_bytes_to_other_nodes",
    ),
    "polarkv_node_offload_bytes": ("bytes the node's disk role wrote to its disk", "offload_bytes"),
    "polarkv_node_reload_bytes": (
        "bytes the node's disk role read into its memory",
        "reload_bytes",
    ),
    "polarkv_node_data_bytes_read": (
        "bytes clients read from the node's buffer over tcp",
        "data_bytes_read",
    ),
    "polarkv_node_data_bytes_written": (
        "bytes clients wrote into the node's buffer over tcp",
        "data_bytes_written",
    ),
}


_TENANT = {
    # per tenant (tenancy.py), from the core's TenantStats
    "polarkv_tenant_lookups": ("lookup requests of the tenant", CounterMetricFamily, "lookups"),
    "polarkv_tenant_hits": ("chunks the tenant's lookups found", CounterMetricFamily, "hits"),
    "polarkv_tenant_misses": ("chunks the tenant's lookups missed", CounterMetricFamily, "misses"),
    "polarkv_tenant_allocations": (
        "entries allocated for the tenant",
        CounterMetricFamily,
        "allocations",
    ),
    "polarkv_tenant_alloc_no_space": (
        "allocations the tenant was refused for room",
        CounterMetricFamily,
        "alloc_no_space",
    ),
    "polarkv_tenant_commits": ("entries the tenant made visible", CounterMetricFamily, "commits"),
    "polarkv_tenant_keys_memory": (
        "the tenant's ready entries in memory",
        GaugeMetricFamily,
        "keys_memory",
    ),
    "polarkv_tenant_bytes_memory": (
        "payload bytes of the tenant's entries in memory",
        GaugeMetricFamily,
        "bytes_memory",
    ),
}
Tenants = Callable[[], dict[str, dict[str, int]]]


class _StatsCollector(Collector):
    def __init__(
        self,
        stats: Callable[[], dict[str, int]],
        failures: Callable[[], dict[str, int]],
        nodes: Callable[[], list[dict[str, Any]]],
    ) -> None:
        self._stats = stats
        self._failures = failures
        self._nodes = nodes

    def collect(self) -> Iterator[Metric]:
        failures = CounterMetricFamily(
            "polarkv_tier_failures",
            "offloads and reloads that failed, by reason",
            labels=["op", "reason"],
        )
        for name, count in sorted(self._failures().items()):
            op, _, reason = name.partition("_")
            failures.add_metric([op, reason], count)
        yield failures
        nodes = self._nodes()
        for name, (help_text, field) in _NODE_GAUGES.items():
            gauge = GaugeMetricFamily(name, help_text, labels=["node"])
            for node in nodes:
                if node["state"] == "alive":
                    gauge.add_metric([node["id"]], node[field])
            yield gauge
        for name, (help_text, field) in _NODE_REPORTED.items():
            gauge = GaugeMetricFamily(name, help_text, labels=["node"])
            for node in nodes:
                if node["state"] == "alive" and field in node["reported"]:
                    gauge.add_metric([node["id"]], node["reported"][field])
            yield gauge
        stats = self._stats()
        for table, family in ((_COUNTERS, CounterMetricFamily), (_GAUGES, GaugeMetricFamily)):
            for name, (help_text, label, source) in table.items():
                if isinstance(source, dict):
                    metric = family(name, help_text, labels=[label])
                    for value, key in source.items():
                        metric.add_metric([value], stats[key])
                else:
                    metric = family(name, help_text, value=stats[source])
                yield metric


class ManagerMetrics:
    def __init__(
        self,
        stats: Callable[[], dict[str, int]],
        failures: Callable[[], dict[str, int]],
        nodes: Callable[[], list[dict[str, Any]]],
        tenants: Tenants | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats, failures, nodes))
        self._tenants = tenants
        tier_buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
        self.offload_seconds = Histogram(
            "polarkv_offload_seconds",
            "time to write one entry to disk",
            registry=self.registry,
            buckets=tier_buckets,
        )
        self.reload_seconds = Histogram(
            "polarkv_reload_seconds",
            "time to read one entry back",
            registry=self.registry,
            buckets=tier_buckets,
        )
        self.request_seconds = Histogram(
            "polarkv_request_seconds",
            "manager request latency, by endpoint",
            ["endpoint"],
            registry=self.registry,
            buckets=(
                0.0001,
                0.00025,
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.5,
                1.0,
            ),
        )

    def scrape(self, viewer: str | None) -> bytes:
        """The text of `/metrics` for a viewer: everything, and every tenant's series, for
        the admin (None); a tenant's token gets only its own tenant's series (DESIGN §14)."""
        text: bytes = generate_latest(self.registry)
        views = self._tenants() if self._tenants is not None else {}
        if not set(views) - {"default"}:  # tenants are not configured
            return text
        shown = views if viewer is None else {k: v for k, v in views.items() if k == viewer}
        own = CollectorRegistry()
        own.register(_TenantCollector(shown))
        return text + bytes(generate_latest(own))


class _TenantCollector(Collector):
    def __init__(self, views: dict[str, dict[str, int]]) -> None:
        self._views = views

    def collect(self) -> Iterator[Metric]:
        for name, (help_text, kind, field) in _TENANT.items():
            metric = kind(name, help_text, labels=["tenant"])
            for tenant, values in self._views.items():
                metric.add_metric([tenant], values[field])
            yield metric
