"""Prometheus metrics of the manager.

Counters and gauges are read from the metadata core at scrape time (one source of
truth, so /metrics and /v1/stats can never disagree); request latency is a histogram
observed by the HTTP shell. Each manager owns its own registry, so several managers can
live in one process (tests, embedded use).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

Source = str | dict[str, str]  # a stats key, or {label value: stats key}
_COUNTERS: dict[str, tuple[str, str, Source]] = {
    # metric name: (help, stats key or {label value: stats key})
    "polarkv_hits": ("chunks found by lookups, by tier", "tier", {"memory": "hits_memory", "disk": "hits_disk"}),
    "polarkv_misses": ("chunks looked up past the hit prefix", "", "misses"),
    "polarkv_lookups": ("lookup requests", "", "lookups"),
    "polarkv_allocations": ("allocate results, by result", "result", {
        "allocated": "allocations", "exists": "alloc_exists",
        "in_progress": "alloc_in_progress", "no_space": "alloc_no_space"}),
    "polarkv_commits": ("entries made visible by write-finish", "", "commits"),
    "polarkv_aborts": ("writes aborted by their writer", "", "aborts"),
    "polarkv_evictions": ("ready entries evicted from memory", "", "evictions"),
    "polarkv_offloads": ("entries written to disk", "", "offloads"),
    "polarkv_reloads": ("entries read back from disk", "", "reloads"),
    "polarkv_expired_leases": ("leases that ran out, by kind", "kind", {
        "read": "expired_read_leases", "write": "expired_write_leases"}),
    "polarkv_checksum_failures": ("entries dropped because their bytes failed the checksum", "",
                                  "checksum_failures"),
    "polarkv_deletes": ("entries deleted through the admin API", "", "deletes"),
    "polarkv_entries_lost": ("ready entries lost with a dead node", "", "entries_lost"),
}
_GAUGES: dict[str, tuple[str, str, Source]] = {
    "polarkv_keys": ("ready entries, by tier", "tier", {"memory": "keys_memory", "disk": "keys_disk"}),
    "polarkv_bytes": ("payload bytes of ready entries, by tier", "tier",
                      {"memory": "bytes_memory", "disk": "bytes_disk"}),
    "polarkv_capacity_bytes": ("capacity of alive nodes, by tier", "tier",
                               {"memory": "capacity_memory", "disk": "capacity_disk"}),
    "polarkv_allocated_bytes": ("memory held by allocations, ready or being written", "",
                                "bytes_memory_allocated"),
    "polarkv_leases": ("live leases, by kind", "kind", {"read": "read_leases", "write": "write_leases"}),
    "polarkv_nodes": ("registered nodes, by state", "state", {"alive": "nodes", "dead": "nodes_dead"}),
}


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
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
    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats))
        self.request_seconds = Histogram(
            "polarkv_request_seconds", "manager request latency, by endpoint", ["endpoint"],
            registry=self.registry,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0))
