"""vLLM (v1 engine) integration: `PolarKVConnector`, a KVConnectorBase_V1, for vLLM 0.32
(the CPU build, served end to end in the tests) and 0.33.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PolarKVConnector",
        "kv_connector_module_path": "polarkv_lib.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"manager_url": "http://127.0.0.1:8170"}}'

docs/ENGINES.md describes it: settings, chunks, namespace, the chunk byte format
("pages-v1"), when transfers happen, and what a fault does (always a miss).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from polarkv_lib.client import PolarKVClient
from polarkv_lib.integrations.common import (
    AdapterSettings,
    make_client,
    namespace,
    settings_from_extra,
)
from polarkv_lib.integrations.vllm_pages import PageGeometry, Saver, page_view

log = logging.getLogger("polarkv.integrations.vllm")

CHUNK_FORMAT = "pages-v1"
MIN_DEFAULT_CHUNK_TOKENS = 256
SCHEDULER_LOOKUP_TIMEOUT = 0.5  # seconds: the scheduler loop is single-threaded


# -- metadata: scheduler -> workers ------------------------------------------------------


@dataclass
class LoadOp:
    """Load the chunks of `tokens` (all full chunks, from chunk 0) and scatter the blocks
    at positions first_block, first_block + 1, ... of the request into `block_ids`."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    first_block: int


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


@dataclass
class ConnectorStats:
    """Counters of one connector (scheduler or worker), for logs and tests."""

    lookups: int = 0
    hit_tokens: int = 0
    loaded_chunks: int = 0
    failed_load_blocks: int = 0
    saved_chunks: int = 0
    failed_saves: int = 0
    dropped_saves: int = 0


# -- geometry and namespace (both roles, from the config alone) ---------------------------


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _geometry(vllm_config: Any, kv_cache_config: Any) -> tuple[PageGeometry | None, str]:
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


def _chunk_tokens(settings: AdapterSettings, block_size: int) -> int:
    if settings.chunk_tokens is None:
        return -(-MIN_DEFAULT_CHUNK_TOKENS // block_size) * block_size
    if settings.chunk_tokens % block_size:
        raise ValueError(
            f"PolarKV: 'chunk_tokens' ({settings.chunk_tokens}) must be a multiple "
            f"of the KV cache block size ({block_size})"
        )
    return settings.chunk_tokens


def _parallel_ranks(vllm_config: Any, role: Any) -> tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size); the scheduler speaks for rank 0."""
    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    if role != KVConnectorRole.WORKER:
        return 0, tp, 0, pp
    try:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return (
                parallel_state.get_tensor_model_parallel_rank(),
                tp,
                parallel_state.get_pp_group().rank_in_group,
                pp,
            )
    except Exception:  # not initialised (e.g. a bare worker in tests): use the config
        pass
    rank = int(getattr(parallel, "rank", 0))
    return rank % tp, tp, (rank // tp) % pp, pp


def _namespace(
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
    tp_rank, tp, pp_rank, pp = _parallel_ranks(vllm_config, role)
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
        self.settings = settings_from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.stats = ConnectorStats()
        self._load_enabled = bool(self._kv_transfer_config.is_kv_consumer)
        self._save_enabled = bool(self._kv_transfer_config.is_kv_producer)
        geometry, why = _geometry(vllm_config, kv_cache_config)
        self._geometry = geometry
        self._client: PolarKVClient | None = None
        self._saver: Saver | None = None
        self.chunk_tokens = 0
        self.namespace = ""
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._lookups: dict[str, tuple[int, int]] = {}  # req_id -> (local tokens, hit tokens)
        self._pending_loads: list[LoadOp] = []
        # worker side
        self._pages: list[Any] = []
        self._device: Any = None
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()  # requests whose load failed in this step
        if geometry is None:
            log.warning("PolarKVConnector disabled: %s", why)
            return
        self.chunk_tokens = _chunk_tokens(self.settings, geometry.block_size)
        self.namespace = _namespace(
            self.settings, vllm_config, kv_cache_config, geometry, self.chunk_tokens, role
        )
        settings = self.settings
        if role == KVConnectorRole.SCHEDULER:
            settings = replace(settings, timeout=min(settings.timeout, SCHEDULER_LOOKUP_TIMEOUT))
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
            "PolarKVConnector (%s): %s, %d-token chunks, namespace %s",
            role.name.lower(),
            settings.manager_url,
            self.chunk_tokens,
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

    def shutdown(self) -> None:
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
            self._lookups[request.request_id] = (num_computed_tokens, num_computed_tokens)
            return 0, False
        self.stats.lookups += 1
        hit = self._client.lookup_kv(prompt[:limit])  # no lease, no transfer
        self._lookups[request.request_id] = (num_computed_tokens, hit)
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._client is None or not self._cacheable(request):
            return
        assert self._geometry is not None
        req_id = request.request_id
        local, hit = self._lookups.pop(req_id, (request.num_computed_tokens, 0))
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
        """Chunks whose load failed are recomputed by vLLM: save them again afterwards."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid or self._geometry is None:
            return
        per_chunk = self._blocks_per_chunk
        for tracked in self._tracked.values():
            for position, block_id in enumerate(tracked.block_ids):
                if block_id in invalid:
                    tracked.saved_chunks = min(tracked.saved_chunks, position // per_chunk)
                    break

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        return False, None  # saves copy their blocks in the step that computed them

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
        if self._client is not None and self._saver is None:
            self._saver = Saver(self._client, self.stats)

    @property
    def chunk_bytes(self) -> int:
        assert self._geometry is not None
        return len(self._geometry.layers) * self._blocks_per_chunk * self._geometry.page_bytes

    def _host_buffer(self, chunks: int) -> Any:
        pin = self._device is not None and self._device.type == "cuda"
        return torch.empty((chunks, self.chunk_bytes), dtype=torch.uint8, pin_memory=pin)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._failed_reqs = set()
        meta = self._connector_metadata
        if not isinstance(meta, PolarKVConnectorMetadata) or not meta.loads:
            return
        for op in meta.loads:
            try:
                failed = self._load(op)
            except Exception as exc:  # the engine never sees a PolarKV fault
                log.warning("PolarKV load of request %s failed: %r", op.req_id, exc)
                failed = list(op.block_ids)
            if failed:
                self._failed_reqs.add(op.req_id)
                self._load_errors.update(failed)
                self.stats.failed_load_blocks += len(failed)

    def _load(self, op: LoadOp) -> list[int]:
        """Load one request's chunks and scatter them; returns the blocks not filled."""
        if self._client is None or not self._pages or not op.block_ids:
            return list(op.block_ids)
        chunks = len(op.tokens) // self.chunk_tokens
        host = self._host_buffer(chunks)
        data = host.numpy()
        n_tokens, views = self._client.load_kv(
            op.tokens, [memoryview(data[i]) for i in range(chunks)]
        )
        loaded = n_tokens // self.chunk_tokens
        # A chunk of another size cannot be this format: it ends the usable prefix.
        loaded = next(
            (i for i, v in enumerate(views[:loaded]) if len(v) != self.chunk_bytes), loaded
        )
        self.stats.loaded_chunks += loaded
        per_chunk = self._blocks_per_chunk
        usable = max(0, min(len(op.block_ids), loaded * per_chunk - op.first_block))
        if usable:
            layers = len(self._pages)
            src = host.view(chunks, layers, per_chunk, -1)
            if self._device.type != "cpu":
                src = src.to(self._device, non_blocking=True)
            index = torch.tensor(op.block_ids[:usable], dtype=torch.long, device=self._device)
            lo, hi = op.first_block, op.first_block + usable
            for layer, pages in enumerate(self._pages):
                rows = src[:, layer].reshape(chunks * per_chunk, -1)[lo:hi]
                pages.index_copy_(0, index, rows.reshape(usable, *pages.shape[1:]))
        return list(op.block_ids[usable:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # chunks are gathered once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PolarKVConnectorMetadata) or not meta.saves:
            return
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
        for layer, pages in enumerate(self._pages):
            staged[:, layer] = pages.index_select(0, index).reshape(chunks, per_chunk, -1)
        if self._device.type == "cpu":
            return staged.view(chunks, -1), None
        host = self._host_buffer(chunks)
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

    def flush_saves(self, timeout: float | None = None) -> bool:
        """Wait for the background saves submitted so far (tests, orderly shutdown)."""
        return self._saver.flush(timeout) if self._saver is not None else True
