"""vLLM (v1 engine) integration: `PolarKVConnector`, a KVConnectorBase_V1, for vLLM 0.32
(the CPU build, served end to end in the tests) and 0.33.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PolarKVConnector",
        "kv_connector_module_path": "polarkv_lib.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"manager_url": "http://127.0.0.1:8170"}}'

docs/ENGINES.md describes it: settings, chunks, namespace, the chunk byte format
("pages-v1"), when transfers happen (`load_mode`: asynchronous by default; "sync" on
the step; "auto" on the step for a short hit all in PolarKV's memory, else
asynchronously), and what a fault does (always a miss). Setup and counters are
in vllm_setup.py, loads in vllm_loads.py, the page view and saver in vllm_pages.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from polarkv_lib.client import PolarKVClient
from polarkv_lib.integrations.common import make_client, settings_from_extra
from polarkv_lib.integrations.cpu_affinity import io_cpus, pin
from polarkv_lib.integrations.vllm_loads import Loader, PageTarget, load_into_pages
from polarkv_lib.integrations.vllm_pages import Saver, page_view
from polarkv_lib.integrations.vllm_setup import (
    CHUNK_FORMAT,
    ConnectorStats,
    PolarKVPromMetrics,
    PolarKVStats,
    StatsInterval,
    chunk_tokens_for,
    connector_namespace,
    options_from_extra,
    page_geometry,
)

__all__ = ["CHUNK_FORMAT", "ConnectorStats", "PolarKVConnector"]

log = logging.getLogger("polarkv.integrations.vllm")


# -- metadata: scheduler -> workers ------------------------------------------------------


@dataclass
class LoadOp:
    """Load the chunks of `tokens` (all full chunks, from chunk 0) and scatter the blocks
    at positions first_block, first_block + 1, ... of the request into `block_ids`."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    first_block: int
    on_step: bool = False  # load before the forward pass (vLLM was told: not async)


@dataclass
class SaveOp:
    """Store chunks first_chunk .. len(tokens) // chunk_tokens - 1 of `tokens`, gathered
    from `block_ids` (the blocks of those chunks, in token order)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    first_chunk: int


@dataclass
class PolarKVConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


# -- the connector -------------------------------------------------------------------------


@dataclass
class _Tracked:
    """Scheduler-side state of one request."""

    tokens: list[int]  # prompt token ids
    block_ids: list[int]  # its block table (group 0)
    saved_chunks: int  # chunks [0, saved_chunks) are in PolarKV or being saved


class PolarKVConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """PolarKV as vLLM's external KV cache; see the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = settings_from_extra(extra)
        self.options = options_from_extra(extra)
        self.stats = ConnectorStats()
        self._interval = StatsInterval(self.stats)
        self._load_enabled = bool(self._kv_transfer_config.is_kv_consumer)
        self._save_enabled = bool(self._kv_transfer_config.is_kv_producer)
        geometry, why = page_geometry(vllm_config, kv_cache_config)
        self._geometry = geometry
        self._client: PolarKVClient | None = None
        self._saver: Saver | None = None
        self.chunk_tokens = 0
        self.namespace = ""
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        # req_id -> (local tokens, hit tokens, whether the load runs on the step)
        self._lookups: dict[str, tuple[int, int, bool]] = {}
        # req_id -> PolarKV's answer (hit tokens, of them in memory), asked once a request
        self._hits: dict[str, tuple[int, int]] = {}
        self._pending_loads: list[LoadOp] = []
        # worker side
        self._pages: list[Any] = []
        self._device: Any = None
        self._target: PageTarget | None = None
        self._loader: Loader | None = None
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()  # requests whose load failed in this step
        if geometry is None:
            log.warning("PolarKVConnector disabled: %s", why)
            return
        self.chunk_tokens = chunk_tokens_for(self.settings, geometry.block_size)
        self.namespace = connector_namespace(
            self.settings, vllm_config, kv_cache_config, geometry, self.chunk_tokens, role
        )
        settings = self.settings
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler's loop is single-threaded: a lookup gets lookup_timeout at most.
            settings = replace(settings, timeout=min(settings.timeout, self.options.lookup_timeout))
        self._client = make_client(settings, self.namespace, self.chunk_tokens)
        if (
            self._kv_transfer_config.kv_load_failure_policy != "recompute"
            and role == KVConnectorRole.SCHEDULER
        ):
            log.warning(
                "PolarKVConnector: kv_load_failure_policy is %r, so a chunk PolarKV "
                "fails to deliver fails its request; set it to 'recompute' to "
                "recompute such chunks instead",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        log.info(
            "PolarKVConnector (%s): %s, %d-token chunks, %s loads, namespace %s",
            role.name.lower(),
            settings.manager_url,
            self.chunk_tokens,
            self.options.load_mode,
            self.namespace,
        )

    @property
    def enabled(self) -> bool:
        return self._client is not None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    @property
    def _blocks_per_chunk(self) -> int:
        assert self._geometry is not None
        return self.chunk_tokens // self._geometry.block_size

    @property
    def asynchronous(self) -> bool:
        """Whether loads may run asynchronously (every mode but "sync")."""
        return self.options.load_mode != "sync"

    def _on_step(self, hit: int, memory: int) -> bool:
        """Whether a hit of `hit` tokens, `memory` of them in memory from the first, is
        loaded on the step: always in sync mode, never in async mode; in auto mode when
        it is one memory read of at most step_load_limit bytes (a reload from disk, or a
        long read, would hold every running request's step)."""
        mode = self.options.load_mode
        if mode != "auto":
            return mode == "sync"
        chunks = hit // self.chunk_tokens
        return memory >= hit and chunks * self.chunk_bytes <= self.options.step_load_limit

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.close(self.settings.timeout + 5.0)
            self._loader = None
        if self._saver is not None:
            self._saver.close(self.settings.timeout + 5.0)
            self._saver = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- scheduler side ---------------------------------------------------------------

    @staticmethod
    def _cacheable(request: Any) -> bool:
        """Whether the request's KV is a function of its token ids alone."""
        return (
            request.prompt_token_ids is not None
            and not request.mm_features
            and request.lora_request is None
            and getattr(request, "cache_salt", None) is None
            and getattr(request, "prompt_embeds", None) is None
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if (
            self._client is None
            or not self._load_enabled
            or not self._cacheable(request)
            or getattr(request, "skip_reading_prefix_cache", False)
        ):
            return 0, False
        ct = self.chunk_tokens
        prompt = request.prompt_token_ids
        # Leave at least one token for vLLM to compute.
        limit = min(len(prompt), request.num_tokens - 1) // ct * ct
        if limit <= num_computed_tokens:
            # vLLM's own prefix cache covers every chunk PolarKV could add; those chunks
            # were saved when this engine computed (or loaded) them.
            self._lookups[request.request_id] = (num_computed_tokens, num_computed_tokens, True)
            return 0, False
        answer = self._hits.get(request.request_id)
        if answer is None:
            answer = self._hits[request.request_id] = self._lookup(prompt[:limit])
        else:  # asked again (no room last step, or preempted): the first answer stands
            self.stats.lookups_reused += 1
        hit = min(answer[0], limit)
        on_step = self._on_step(hit, answer[1])
        self._lookups[request.request_id] = (num_computed_tokens, hit, on_step)
        new = max(0, hit - num_computed_tokens)
        return new, new > 0 and not on_step

    def _lookup(self, tokens: list[int]) -> tuple[int, int]:
        """PolarKV's hit for `tokens` and how much of it is in memory (no lease, no
        transfer), bounded by lookup_timeout: a slow or dead manager costs the scheduler
        that much at most, and is a miss."""
        assert self._client is not None
        self.stats.lookups += 1
        faults = self._client.stats.faults
        try:
            answer = self._client.lookup_kv_tiers(tokens, within=self.options.lookup_timeout)
        except Exception as exc:  # a closed client: the engine never sees our faults
            log.warning("PolarKV lookup became a miss: %r", exc)
            answer = (0, 0)
            self._client.stats.faults += 1
        if self._client.stats.faults != faults:
            self.stats.lookup_faults += 1
        return answer

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._client is None or not self._cacheable(request):
            return
        assert self._geometry is not None
        req_id = request.request_id
        local, hit, on_step = self._lookups.pop(req_id, (request.num_computed_tokens, 0, True))
        block_ids = list(blocks.get_block_ids()[0])
        previous = self._tracked.get(req_id)
        known = max(hit // self.chunk_tokens, previous.saved_chunks if previous else 0)
        tokens = list(request.prompt_token_ids)
        self._tracked[req_id] = _Tracked(tokens, block_ids, known)
        if num_external_tokens <= 0:
            return
        end = local + num_external_tokens
        bs = self._geometry.block_size
        first_block, last_block = local // bs, -(-end // bs)
        self.stats.hit_tokens += num_external_tokens
        self._pending_loads.append(
            LoadOp(
                req_id,
                tokens[: -(-end // self.chunk_tokens) * self.chunk_tokens],
                block_ids[first_block:last_block],
                first_block,
                on_step,
            )
        )

    def build_connector_meta(self, scheduler_output: Any) -> PolarKVConnectorMetadata:
        meta = PolarKVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if self._client is None or not self._save_enabled:
            return meta
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._plan_save(
                    meta,
                    new.req_id,
                    tracked,
                    new.num_computed_tokens + scheduled.get(new.req_id, 0),
                    block_state,
                )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            self._plan_save(
                meta,
                req_id,
                tracked,
                cached.num_computed_tokens[i] + scheduled.get(req_id, 0),
                block_state,
            )
        return meta

    def _plan_save(
        self,
        meta: PolarKVConnectorMetadata,
        req_id: str,
        tracked: _Tracked,
        computed_after_step: int,
        block_state: Any,
    ) -> None:
        """Save the chunks whose last token this step computes."""
        ct, per_chunk = self.chunk_tokens, self._blocks_per_chunk
        full = min(len(tracked.tokens), computed_after_step) // ct
        if full <= tracked.saved_chunks:
            return
        if block_state is not None:  # the scheduler's own table, when it offers one
            ids = block_state.get_block_ids(req_id)
            if ids:
                tracked.block_ids = list(ids[0])
        if len(tracked.block_ids) < full * per_chunk:
            log.warning(
                "PolarKV: request %s has %d blocks for %d chunks; not saving",
                req_id,
                len(tracked.block_ids),
                full,
            )
            return
        first = tracked.saved_chunks
        meta.saves.append(
            SaveOp(
                req_id,
                tracked.tokens[: full * ct],
                tracked.block_ids[first * per_chunk : full * per_chunk],
                first,
            )
        )
        tracked.saved_chunks = full

    def update_connector_output(self, connector_output: Any) -> None:
        """Chunks whose load failed are recomputed by vLLM: save them again afterwards,
        and never offer them to the request again (a load that failed whole leaves it
        with no computed tokens, so vLLM asks for it anew: it must get a miss, not the
        same failing load over and over)."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid or self._geometry is None:
            return
        per_chunk = self._blocks_per_chunk
        for req_id, tracked in self._tracked.items():
            for position, block_id in enumerate(tracked.block_ids):
                if block_id in invalid:
                    chunk = position // per_chunk
                    tracked.saved_chunks = min(tracked.saved_chunks, chunk)
                    if req_id in self._hits:
                        hit, memory = self._hits[req_id]
                        cut = chunk * self.chunk_tokens
                        self._hits[req_id] = (min(hit, cut), min(memory, cut))
                    break

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        # Saves copy their blocks in the step that computed them. A request finished or
        # aborted while loading asynchronously keeps its blocks anyway: vLLM frees them
        # only once the worker reports the load ended (get_finished).
        return False, None

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._geometry is None:
            return
        # Only the group's own layers: vLLM adds aliases for KV-sharing layers.
        missing = [name for name in self._geometry.layers if name not in kv_caches]
        if missing:
            raise ValueError(f"PolarKV: no KV cache registered for layers {missing[:3]}")
        self._pages = [page_view(kv_caches[name], self._geometry) for name in self._geometry.layers]
        self._device = kv_caches[self._geometry.layers[0]].device
        self._target = PageTarget(
            self._pages, self._device, self.chunk_tokens, self._blocks_per_chunk, self.chunk_bytes
        )
        if self._client is None:
            return
        # vLLM has bound this (the worker's main) thread to its OpenMP cores by now.
        cpus = io_cpus(self.options.io_cpus)
        pin(self._client.io_thread_id, cpus)
        if self._saver is None:
            self._saver = Saver(self._client, self.stats)
            pin(self._saver.thread_id, cpus)
        if self._loader is None and self.asynchronous:
            self._loader = Loader(
                self._client,
                self._target,
                self.stats,
                self.options.load_threads,
                cpus,
                self.options.load_switch_interval,
            )
        if cpus is not None:
            log.info("PolarKV: connector threads on CPUs %s", sorted(cpus))

    @property
    def chunk_bytes(self) -> int:
        assert self._geometry is not None
        return len(self._geometry.layers) * self._blocks_per_chunk * self._geometry.page_bytes

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Hand each asynchronous load to the loader and return; run each load vLLM was
        told is not asynchronous (`on_step`) here, before the forward pass."""
        self._failed_reqs = set()
        meta = self._connector_metadata
        if not isinstance(meta, PolarKVConnectorMetadata) or not meta.loads:
            return
        for op in meta.loads:
            self.stats.loads += 1
            if self._loader is not None and not op.on_step:
                self._loader.submit(op)
                continue
            self.stats.step_loads += 1
            try:
                if self._client is None or self._target is None:
                    raise RuntimeError("no client or no KV caches registered")
                failed = load_into_pages(self._client, self._target, op, self.stats)
            except Exception as exc:  # the engine never sees a PolarKV fault
                log.warning("PolarKV load of request %s failed: %r", op.req_id, exc)
                failed = list(op.block_ids)
            if failed:
                self._failed_reqs.add(op.req_id)
                self._load_errors.update(failed)
                self.stats.failed_load_blocks += len(failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None, the requests whose asynchronous load ended). The blocks a load did not
        fill are reported by get_block_ids_with_load_errors in the same pass, as vLLM
        asks; requests in `finished_req_ids` still loading are cancelled."""
        if self._loader is None:
            return None, None
        done, failed = self._loader.poll(finished_req_ids)
        self._load_errors.update(failed)
        return None, done or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # sync loads complete in start_load_kv; async ones before get_finished

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # chunks are gathered once per step, in wait_for_save

    def wait_for_save(self) -> None:
        """Gather this step's chunks and hand them to the saver: the step pays for the
        gather only (timed in save_step_seconds); Saver.submit never waits, and a full
        queue drops the save."""
        meta = self._connector_metadata
        if not isinstance(meta, PolarKVConnectorMetadata) or not meta.saves:
            return
        started = time.perf_counter()
        try:
            self._save_step(meta)
        finally:
            self.stats.record_save_step(time.perf_counter() - started)

    def _save_step(self, meta: PolarKVConnectorMetadata) -> None:
        for op in meta.saves:
            if op.req_id in self._failed_reqs or self._saver is None or not self._pages:
                continue  # computed after a failed load: not this step's KV to keep
            try:
                host, ready = self._gather(op.block_ids)
                if not self._saver.submit(op, host, ready):
                    self.stats.dropped_saves += 1
            except Exception as exc:
                self.stats.failed_saves += 1
                log.warning("PolarKV could not gather request %s for saving: %r", op.req_id, exc)

    def _gather(self, block_ids: list[int]) -> tuple[Any, Any]:
        """The chunks of `block_ids` in the chunk format: uint8 [chunks, chunk bytes] on
        the CPU, and an event to wait on before reading it (None when already there)."""
        assert self._geometry is not None
        per_chunk = self._blocks_per_chunk
        chunks = len(block_ids) // per_chunk
        index = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        staged = torch.empty(
            (chunks, len(self._pages), per_chunk, self._geometry.page_bytes),
            dtype=torch.uint8,
            device=self._device,
        )
        words = staged.view(self._pages[0].dtype)  # the page views' words
        for layer, pages in enumerate(self._pages):
            words[:, layer] = pages.index_select(0, index).reshape(chunks, per_chunk, -1)
        if self._device.type == "cpu":
            return staged.view(chunks, -1), None
        assert self._target is not None
        host = self._target.host_buffer(chunks)
        if self._device.type != "cuda":
            host.copy_(staged.view(chunks, -1))
            return host, None
        # Pinned memory, copied on the compute stream: the saver thread waits for the
        # event, and later kernels that reuse these blocks are ordered after the copy.
        host.copy_(staged.view(chunks, -1), non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> Any:
        """The counters' rise since the last call, as vLLM's KV connector stats (both
        roles: vLLM sums the workers' and the scheduler's)."""
        return self._interval.take() if self.enabled else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return PolarKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """PolarKV's counters in vLLM's /metrics (vllm:polarkv_*)."""
        return PolarKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def flush_loads(self, timeout: float = 10.0) -> bool:
        """Wait for the asynchronous loads submitted so far to end (tests)."""
        return self._loader.wait(timeout) if self._loader is not None else True

    def load_buffers_idle(self) -> int:
        """Bytes of host buffers kept for the next loads (vllm_loads.HostBuffers)."""
        return self._target.spare.idle_bytes if self._target is not None else 0

    def flush_saves(self, timeout: float | None = None) -> bool:
        """Wait for the background saves submitted so far (tests, orderly shutdown)."""
        return self._saver.flush(timeout) if self._saver is not None else True
