"""Setup of the vLLM connector, from vLLM's config alone (both roles): the page geometry,
the chunk size, the rank and the namespace; the connector's own options; and its
counters, also reported through vLLM's KV connector statistics."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from polarkv_lib.config import parse_size
from polarkv_lib.integrations.common import AdapterSettings, namespace
from polarkv_lib.integrations.cpu_affinity import parse_cpus
from polarkv_lib.integrations.vllm_pages import PageGeometry

log = logging.getLogger("polarkv.integrations.vllm")

CHUNK_FORMAT = "pages-v1"
MIN_DEFAULT_CHUNK_TOKENS = 256
LOAD_MODES = ("auto", "async", "sync")
# auto's bound on a load it runs on the step: 16 MiB from memory took ~14 ms (read and
# scatter) with the CPU build here (docs/BENCHMARKS.md, bench stall), so this much costs
# the step about one decode step's time; over RDMA into a GPU, a few milliseconds.
DEFAULT_STEP_LOAD_LIMIT = 32 << 20


@dataclass(frozen=True)
class ConnectorOptions:
    """The vLLM connector's own keys of kv_connector_extra_config (docs/ENGINES.md)."""

    # "async": the step never waits for a load; "sync": it always does; "auto": on the
    # step when the hit is all in PolarKV's memory and at most step_load_limit bytes,
    # else asynchronously.
    load_mode: str = "async"
    lookup_timeout: float = 0.2  # seconds the scheduler's loop gives one lookup
    load_threads: int = 2  # concurrent asynchronous loads per worker
    io_cpus: str = "auto"  # where the loader, saver and client threads run (cpu_affinity)
    step_load_limit: int = DEFAULT_STEP_LOAD_LIMIT  # bytes: auto's largest load on the step
    # seconds: the worker's GIL switch interval while asynchronous loads are in flight
    # (vllm_loads.Loader._quicken); 0 leaves Python's own (5 ms)
    load_switch_interval: float = 0.0005


def options_from_extra(extra: Mapping[str, Any] | None) -> ConnectorOptions:
    """Read the connector's options; ValueError with the key's name if one is wrong."""
    extra = dict(extra or {})
    defaults = ConnectorOptions()
    mode = extra.get("load_mode", defaults.load_mode)
    if mode not in LOAD_MODES:
        raise ValueError(f"PolarKV: 'load_mode' must be one of {', '.join(LOAD_MODES)}")
    bound = extra.get("lookup_timeout", defaults.lookup_timeout)
    if not isinstance(bound, int | float) or isinstance(bound, bool) or bound <= 0:
        raise ValueError("PolarKV: 'lookup_timeout' must be a positive number of seconds")
    threads = extra.get("load_threads", defaults.load_threads)
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError("PolarKV: 'load_threads' must be a positive integer")
    cpus = extra.get("io_cpus", defaults.io_cpus)
    if not isinstance(cpus, str):
        raise ValueError('PolarKV: \'io_cpus\' must be "auto", "none" or a CPU list')
    if cpus not in ("auto", "none"):
        try:
            parse_cpus(cpus)
        except ValueError:
            raise ValueError(
                f'PolarKV: \'io_cpus\' must be "auto", "none" or a CPU list like "1,3-4" '
                f"(got {cpus!r})"
            ) from None
    limit = extra.get("step_load_limit", defaults.step_load_limit)
    try:
        limit = parse_size(limit)
    except ValueError:
        raise ValueError(
            f"PolarKV: 'step_load_limit' must be a size like \"16MiB\" (got {limit!r})"
        ) from None
    switch = extra.get("load_switch_interval", defaults.load_switch_interval)
    if not isinstance(switch, int | float) or isinstance(switch, bool) or not 0 <= switch <= 1:
        raise ValueError("PolarKV: 'load_switch_interval' must be 0..1 seconds (0: leave it)")
    return ConnectorOptions(str(mode), float(bound), threads, cpus, limit, float(switch))


@dataclass
class ConnectorStats:
    """Counters of one connector (scheduler or worker); they only rise."""

    lookups: int = 0
    lookups_reused: int = 0  # answered from the request's earlier lookup
    lookup_faults: int = 0  # timed out or failed: a miss
    hit_tokens: int = 0
    loads: int = 0  # load operations started (one per request and step)
    step_loads: int = 0  # of them, run on the step (sync mode, auto's short memory hits)
    cancelled_loads: int = 0  # the request finished or was aborted while loading
    loaded_chunks: int = 0
    loaded_tokens: int = 0
    load_seconds: float = 0.0
    # Asynchronous loads: from a load's end to the get_finished that reports it (the
    # step that was running when it ended), summed; vLLM schedules it the step after.
    load_report_wait_seconds: float = 0.0
    failed_load_blocks: int = 0
    saved_chunks: int = 0
    failed_saves: int = 0
    dropped_saves: int = 0  # the saver's queue was full: not stored (a later miss)
    # What wait_for_save costs the step (the gather and the hand-off to the saver; the
    # network and the disk are the saver thread's): steps that saved, their seconds, and
    # the longest since the last interval (StatsInterval resets it).
    save_steps: int = 0
    save_step_seconds: float = 0.0
    save_step_max_seconds: float = 0.0

    def snapshot(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    def record_save_step(self, seconds: float) -> None:
        self.save_steps += 1
        self.save_step_seconds += seconds
        self.save_step_max_seconds = max(self.save_step_max_seconds, seconds)


# Keys that are an interval's maximum, not a rise: aggregated with max, not summed.
MAX_KEYS = frozenset({"save_step_max_seconds"})
SECONDS_KEYS = frozenset(
    {"load_seconds", "load_report_wait_seconds", "save_step_seconds", "save_step_max_seconds"}
)


@dataclass
class PolarKVStats(KVConnectorStats):  # type: ignore[misc]
    """One interval's rise of the counters above, summed over workers and the
    scheduler; vLLM logs `reduce()` as "KV Transfer metrics"."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> PolarKVStats:
        for key, value in other.data.items():
            if key in MAX_KEYS:
                self.data[key] = max(self.data.get(key, 0), value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            f"polarkv_{k}": (round(v, 4) if k in SECONDS_KEYS else int(v))
            for k, v in self.data.items()
            if v and k not in SECONDS_KEYS - {"load_seconds"}
        }
        loads = self.data.get("loads", 0)
        if loads and self.data.get("load_seconds"):
            out["polarkv_avg_load_ms"] = round(1000 * self.data["load_seconds"] / loads, 2)
        if loads and self.data.get("load_report_wait_seconds"):
            wait = self.data["load_report_wait_seconds"]
            out["polarkv_avg_report_wait_ms"] = round(1000 * wait / loads, 2)
        steps = self.data.get("save_steps", 0)
        if steps:
            out["polarkv_avg_save_step_ms"] = round(
                1000 * self.data.get("save_step_seconds", 0) / steps, 3
            )
            out["polarkv_max_save_step_ms"] = round(
                1000 * self.data.get("save_step_max_seconds", 0), 3
            )
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


# The counters vLLM's /metrics shows, as vllm:polarkv_<key>_total (seconds in seconds).
PROM_COUNTERS: dict[str, str] = {
    "lookups": "Manager lookups by the scheduler (one per request)",
    "lookup_faults": "Lookups that timed out or failed (each a miss)",
    "hit_tokens": "Prompt tokens PolarKV had and the scheduler chose to load",
    "loads": "Load operations started (one per request and step)",
    "step_loads": "Loads run on the step (synchronous mode, or auto's short memory hits)",
    "cancelled_loads": "Loads cancelled: the request finished or was aborted while loading",
    "loaded_chunks": "Chunks loaded from PolarKV into vLLM's KV cache",
    "loaded_tokens": "Tokens loaded from PolarKV into vLLM's KV cache",
    "load_seconds": "Seconds the loads took, summed over loads",
    "load_report_wait_seconds": "Seconds from an asynchronous load's end to its report",
    "failed_load_blocks": "KV blocks a load did not fill (recomputed by vLLM)",
    "saved_chunks": "Chunks stored in PolarKV",
    "failed_saves": "Saves that failed (gather, network or PolarKV)",
    "dropped_saves": "Saves dropped because the saver's queue was full",
    "save_steps": "Steps in which wait_for_save gathered chunks to save",
    "save_step_seconds": "Seconds wait_for_save spent on the step, summed over steps",
}


class PolarKVPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """PolarKV's counters in vLLM's Prometheus /metrics, beside its prefix-cache ones:
    vLLM hands observe() each interval's PolarKVStats data, summed over workers."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, doc in PROM_COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:polarkv_{key}",
                documentation=f"PolarKV: {doc}.",
                labelnames=labelnames,
            )
            self._counters[key] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        gauge = self._gauge_cls(
            name="vllm:polarkv_save_step_max_seconds",
            documentation="PolarKV: the longest wait_for_save of the last interval, seconds.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._max_save_step = {
            idx: gauge.labels(*values) for idx, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, counters in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value > 0 and engine_idx in counters:
                counters[engine_idx].inc(value)
        longest = transfer_stats_data.get("save_step_max_seconds")
        if longest is not None and engine_idx in self._max_save_step:
            self._max_save_step[engine_idx].set(longest)


class StatsInterval:
    """The rise of a ConnectorStats since the last call, as vLLM's connector stats."""

    def __init__(self, stats: ConnectorStats) -> None:
        self._stats = stats
        self._last = stats.snapshot()

    def take(self) -> Any:
        now = self._stats.snapshot()
        rise = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        for key in MAX_KEYS:  # the interval's maximum, then a new interval
            rise[key] = now[key]
            setattr(self._stats, key, 0.0)
            now[key] = 0.0
        self._last = now
        rise = {k: v for k, v in rise.items() if v}
        return PolarKVStats(data=rise) if rise else None


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def page_geometry(vllm_config: Any, kv_cache_config: Any) -> tuple[PageGeometry | None, str]:
    """The page geometry, or None and why the connector cannot serve this model."""
    parallel = vllm_config.parallel_config
    if (
        getattr(parallel, "decode_context_parallel_size", 1) > 1
        or getattr(parallel, "prefill_context_parallel_size", 1) > 1
    ):
        return None, "context parallelism shards a block's tokens across ranks"
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        return (
            None,
            f"{len(groups)} KV cache groups (only one group of attention layers is supported)",
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        return None, f"KV cache spec {type(spec).__name__} is not attention"
    if spec.tokens_per_state != 1:
        return None, "compressed KV (tokens_per_state != 1)"
    return PageGeometry(
        block_size=int(spec.block_size),
        num_heads=int(spec.num_heads),
        content_bytes=int(spec.state_content_size_bytes),
        layers=tuple(sorted(groups[0].layer_names, key=_natural_key)),
    ), ""


def chunk_tokens_for(settings: AdapterSettings, block_size: int) -> int:
    if settings.chunk_tokens is None:
        return -(-MIN_DEFAULT_CHUNK_TOKENS // block_size) * block_size
    if settings.chunk_tokens % block_size:
        raise ValueError(
            f"PolarKV: 'chunk_tokens' ({settings.chunk_tokens}) must be a multiple "
            f"of the KV cache block size ({block_size})"
        )
    return settings.chunk_tokens


def parallel_ranks(vllm_config: Any, role: Any) -> tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size); the scheduler speaks for rank 0. The ranks
    go into the namespace, so a wrong one would let ranks read each other's KV: once
    vLLM's model-parallel groups exist, a rank that cannot be read is an error."""
    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    if role != KVConnectorRole.WORKER:
        return 0, tp, 0, pp
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        # A worker built outside vLLM's executor (tests, tools): the config's rank.
        rank = int(getattr(parallel, "rank", 0))
        return rank % tp, tp, (rank // tp) % pp, pp
    try:
        tp_rank = int(parallel_state.get_tensor_model_parallel_rank())
        pp_rank = int(parallel_state.get_pp_group().rank_in_group)
    except Exception as exc:
        raise RuntimeError(
            f"PolarKV: cannot read this worker's tensor/pipeline-parallel rank from vLLM "
            f"({exc!r}); refusing to guess it, since the rank keeps the ranks' KV apart"
        ) from exc
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise RuntimeError(
            f"PolarKV: vLLM reports tensor-parallel rank {tp_rank} of {tp} and "
            f"pipeline-parallel rank {pp_rank} of {pp}; refusing a namespace for them"
        )
    return tp_rank, tp, pp_rank, pp


def connector_namespace(
    settings: AdapterSettings,
    vllm_config: Any,
    kv_cache_config: Any,
    geometry: PageGeometry,
    chunk_tokens: int,
    role: Any,
) -> str:
    from vllm.platforms import current_platform

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    dtype = str(spec.dtype).removeprefix("torch.")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype != "auto":
        dtype = f"{dtype}-{cache_dtype}"
    layout = (
        getattr(kv_cache_config, "kv_cache_layout", None)
        or getattr(vllm_config.cache_config, "kv_cache_layout", None)
        or "unresolved"
    )
    tp_rank, tp, pp_rank, pp = parallel_ranks(vllm_config, role)
    return namespace(
        settings,
        "vllm",
        CHUNK_FORMAT,
        vllm_config.model_config.model,
        dtype,
        layout,
        f"b{geometry.block_size}-h{geometry.num_heads}-c{geometry.content_bytes}",
        current_platform.device_type,
        f"tp{tp_rank}of{tp}",
        f"pp{pp_rank}of{pp}",
        f"chunk{chunk_tokens}",
    )
