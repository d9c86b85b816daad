"""PolarKVConnector (vLLM 0.33) against vLLM's own pieces, on CPU, with real polarkv
processes: KVConnectorFactory, the v1 Scheduler, the KV cache planner and allocator (every
KVCacheLayout), and the worker-side driver a model runner uses
(KVConnectorModelRunnerMixin). There are no weights: a tiny llama config.json, and a
stand-in forward pass that writes deterministic KV (a function of the token prefix) for
the tokens a step computes, into the slots vLLM's block table gives them."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm  # noqa: F401

from tests.conftest import Cluster, PolarKV, http, wait_for

with warnings.catch_warnings():
    # torch's own deprecation, raised while vLLM's worker utilities import (deep_gemm ->
    # torch.compile -> torch.utils.mkldnn): not ours, and only this import is excused.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning
    )
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import set_forward_context
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
    from vllm.v1.worker.utils import allocate_kv_cache

from polarkv_lib.client import PolarKVClient
from polarkv_lib.integrations.common import settings_from_extra
from polarkv_lib.integrations.vllm import (
    LoadOp,
    PolarKVConnector,
    PolarKVConnectorMetadata,
    SaveOp,
)
from polarkv_lib.integrations.vllm_loads import HostBuffers
from polarkv_lib.integrations.vllm_setup import PolarKVStats, chunk_tokens_for

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
BLOCK, HEADS, HEAD_SIZE = 16, 2, 16
CELL = 2 * HEAD_SIZE  # floats per (head, token) cell of the logical view: K then V
NUM_BLOCKS = 96
CHUNK = 256  # the default for 16-token blocks
PER_CHUNK = CHUNK // BLOCK
SPEC = FullAttentionSpec(
    block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    model = tmp_path_factory.mktemp("tiny-llama")
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": HEADS,
                "num_hidden_layers": len(LAYERS),
                "vocab_size": 1000,
                "max_position_embeddings": 2048,
                "torch_dtype": "float32",
                "rms_norm_eps": 1e-5,
            }
        )
    )
    init_none_hash(sha256)
    return ModelConfig(
        model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=2048
    )


@pytest.fixture(scope="module")
def polarkv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolarKV]:
    cluster = Cluster(tmp_path_factory.mktemp("polarkv"))
    try:
        yield cluster.embedded()
    finally:
        cluster.close()


def vllm_config(
    model_config: ModelConfig,
    manager_url: str,
    layout: str = "LBHNC",
    batch: int = 2048,
    parallel: ParallelConfig | None = None,
    **extra: Any,
) -> VllmConfig:
    transfer = KVTransferConfig(
        kv_connector="PolarKVConnector",
        kv_connector_module_path="polarkv_lib.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"manager_url": manager_url, "timeout": 1.0, **extra},
    )
    config = VllmConfig(
        model_config=copy.deepcopy(model_config),
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=batch,
            max_num_seqs=8,
            max_model_len=2048,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
        parallel_config=parallel or ParallelConfig(),
    )
    config.cache_config.kv_cache_layout = layout  # what the engine core's resolution records
    return config


def kv_cache_config(config: VllmConfig) -> KVCacheConfig:
    """vLLM's own planner: the tensors' strides for the config's layout."""
    kcc = get_kv_cache_config_from_groups(
        config,
        [KVCacheGroupSpec(list(LAYERS), SPEC)],
        SPEC.page_size_bytes * len(LAYERS) * NUM_BLOCKS,
    )
    kcc.kv_cache_layout = config.cache_config.kv_cache_layout
    config.cache_config.num_gpu_blocks = kcc.num_blocks
    return kcc


def expected_kv(layer: int, tokens: list[int], start: int, end: int) -> Any:
    """KV of tokens [start, end) as a model would give it: a function of the whole prefix.
    [tokens, heads, cell] float32, exact (integers below 2**24)."""
    prefix = torch.cumsum(torch.tensor(tokens[:end], dtype=torch.float64), 0)[start:end] % 9973
    base = (prefix * 31 + torch.arange(start, end, dtype=torch.float64) * 7 + layer * 1009) % 65521
    cells = torch.arange(HEADS * CELL, dtype=torch.float64)
    return (base[:, None] + cells[None, :]).reshape(-1, HEADS, CELL).to(torch.float32)


def read_kv(caches: dict[str, Any], table: list[int], start: int, end: int) -> Any:
    """[layers, tokens, heads, cell] of tokens [start, end) through the logical views."""
    positions = torch.arange(start, end)
    blocks, offsets = torch.tensor(table)[positions // BLOCK], positions % BLOCK
    return torch.stack([caches[name][blocks, :, offsets] for name in LAYERS])


def same_bytes(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


@contextmanager
def kv_transfer_group(connector: Any) -> Iterator[None]:
    """vLLM keeps the worker's connector in a process global; two engines share a process
    here, so each step installs its own."""
    previous = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = previous


class Engine:
    """One vLLM engine in miniature: the real v1 Scheduler (which builds the scheduler-side
    connector through the factory) and a worker-side connector over KV caches from vLLM's
    allocator, driven step by step the way the model runner drives it."""

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self.kv_cache_config = kv_cache_config(config)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        self.caches = allocate_kv_cache(
            self.kv_cache_config,
            torch.device("cpu"),
            KVCacheLayout[config.cache_config.kv_cache_layout],
            [BLOCK],
        )
        self.worker = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        self.worker.register_kv_caches(self.caches)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}

    @property
    def connector(self) -> PolarKVConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, PolarKVConnector)
        return connector

    def add(self, req_id: str, prompt: list[int]) -> None:
        self.tokens[req_id] = list(prompt)
        self.scheduler.add_request(
            Request(
                req_id, list(prompt), SamplingParams(max_tokens=1), None, block_hasher=self.hasher
            )
        )

    def step(self, out: Any = None) -> tuple[Any, KVConnectorOutput]:
        """schedule (unless given its output) -> worker (load, forward, save) ->
        update_from_output."""
        out = out if out is not None else self.scheduler.schedule()
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
            if (ids := cached.new_block_ids[i]) is not None:
                if req_id in cached.resumed_req_ids:
                    self.tables[req_id] = list(ids[0])
                else:
                    self.tables[req_id].extend(ids[0])
        with (
            kv_transfer_group(self.worker),
            set_forward_context(None, self.config),
            KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(out) as kv_output,
        ):
            for req_id, n in out.num_scheduled_tokens.items():
                self.forward(req_id, computed[req_id], computed[req_id] + n)
        assert kv_output is not None
        req_ids = list(out.num_scheduled_tokens)
        sampled = [
            [7] if computed[r] + out.num_scheduled_tokens[r] >= len(self.tokens[r]) else []
            for r in req_ids
        ]
        self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kv_output,
            ),
        )
        return out, kv_output

    def forward(self, req_id: str, start: int, end: int) -> None:
        positions = torch.arange(start, end)
        blocks = torch.tensor(self.tables[req_id])[positions // BLOCK]
        for layer, name in enumerate(LAYERS):
            self.caches[name][blocks, :, positions % BLOCK] = expected_kv(
                layer, self.tokens[req_id], start, end
            )

    def kv(self, req_id: str, start: int, end: int) -> Any:
        return read_kv(self.caches, self.tables[req_id], start, end)

    def expected(self, req_id: str, start: int, end: int) -> Any:
        return torch.stack(
            [expected_kv(layer, self.tokens[req_id], start, end) for layer in range(len(LAYERS))]
        )

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    try:
        yield made
    finally:
        for engine in made:
            engine.close()


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- 1. the factory builds both roles ------------------------------------------------------


def test_factory_builds_both_roles_from_a_kv_transfer_config(
    model_config: ModelConfig, polarkv: PolarKV
) -> None:
    config = vllm_config(model_config, polarkv.manager_url)
    kcc = kv_cache_config(config)
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is PolarKVConnector
    # Not SupportsHMA: vLLM turns the hybrid allocator off for it.
    assert config.scheduler_config.disable_hybrid_kv_cache_manager
    built = [
        KVConnectorFactory.create_connector(config, role, kcc)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
    ]
    try:
        for connector, role in zip(
            built, (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER), strict=True
        ):
            assert isinstance(connector, PolarKVConnector) and connector.role == role
            assert connector.enabled and connector.chunk_tokens == CHUNK
            assert not connector.requires_kv_delivery
        # Both roles address the same keys: the scheduler looks up what rank 0 stores.
        assert built[0].namespace == built[1].namespace
        for part in ("vllm/pages-v1/", "/float32/LBHNC/b16-h2-c128/cpu/tp0of1/pp0of1/chunk256"):
            assert part in built[0].namespace
        assert built[1].chunk_bytes == len(LAYERS) * PER_CHUNK * SPEC.page_size_bytes
    finally:
        for connector in built:
            connector.shutdown()


def test_chunk_tokens_follow_the_block_size_and_bad_settings_raise(
    model_config: ModelConfig, polarkv: PolarKV
) -> None:
    def build(url: str = polarkv.manager_url, **extra: Any) -> PolarKVConnector:
        config = vllm_config(model_config, url, **extra)
        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, kv_cache_config(config)
        )
        assert isinstance(connector, PolarKVConnector)
        connector.shutdown()
        return connector

    # Default: the smallest multiple of the block size that is at least 256 tokens.
    assert chunk_tokens_for(settings_from_extra({"manager_url": polarkv.manager_url}), 48) == 288
    assert build(chunk_tokens=48).chunk_tokens == 48
    assert "chunk48" in build(chunk_tokens=48).namespace
    assert build(namespace="team-a").namespace.startswith("team-a/vllm/")
    with pytest.raises(ValueError, match="multiple of the KV cache block size"):
        build(chunk_tokens=100)
    with pytest.raises(ValueError, match="manager_url"):
        build(url="127.0.0.1:8170")
    with pytest.raises(ValueError, match="load_mode"):
        build(load_mode="eager")
    with pytest.raises(ValueError, match="step_load_limit"):
        build(step_load_limit="a lot")
    with pytest.raises(ValueError, match="load_switch_interval"):
        build(load_switch_interval=-1)
    with pytest.raises(ValueError, match="lookup_timeout"):
        build(lookup_timeout=0)
    with pytest.raises(ValueError, match="load_threads"):
        build(load_threads=0)
    for bad in ("cores", "2-1", 3):
        with pytest.raises(ValueError, match="io_cpus"):
            build(io_cpus=bad)


def test_namespace_keeps_ranks_and_layouts_apart(
    model_config: ModelConfig, polarkv: PolarKV
) -> None:
    def namespace(role: Any, layout: str = "LBHNC", rank: int = 0) -> str:
        config = vllm_config(
            model_config,
            polarkv.manager_url,
            layout=layout,
            parallel=ParallelConfig(tensor_parallel_size=2, rank=rank),
        )
        connector = KVConnectorFactory.create_connector(config, role, kv_cache_config(config))
        connector.shutdown()
        return str(connector.namespace)

    scheduler = namespace(KVConnectorRole.SCHEDULER)
    assert "/tp0of2/" in scheduler and scheduler == namespace(KVConnectorRole.WORKER, rank=0)
    assert "/tp1of2/" in namespace(KVConnectorRole.WORKER, rank=1)
    assert "/LBNHC/" in namespace(KVConnectorRole.WORKER, layout="LBNHC")


# -- 2. the real scheduler schedules around PolarKV hits ------------------------------------


def test_scheduler_takes_a_shared_prefix_from_polarkv(
    model_config: ModelConfig, polarkv: PolarKV, engines: list[Engine]
) -> None:
    # Engine A prefills in 256-token steps (chunked prefill): each chunk is saved in the
    # step that computes its last token, chunk 0 with store_kv, chunk 1 with put.
    a = Engine(vllm_config(model_config, polarkv.manager_url, batch=CHUNK))
    engines.append(a)
    first = prompt(1, 600)
    a.add("a1", first)
    saves = []
    for _ in range(3):
        out, _ = a.step()
        saves.append(
            [(s.first_chunk, len(s.tokens) // CHUNK) for s in out.kv_connector_metadata.saves]
        )
    assert saves == [[(0, 1)], [(1, 2)], []]
    assert a.worker.flush_saves(10)
    assert a.worker.stats.saved_chunks == 2 and a.worker.stats.failed_saves == 0
    with PolarKVClient(polarkv.manager_url, a.connector.namespace, CHUNK) as client:
        assert client.lookup_kv(first) == 2 * CHUNK

    # Engine B (another process in real life: its own scheduler, blocks and vLLM block
    # hashes) gets a prompt sharing 512 tokens; the scheduler takes them from PolarKV,
    # loaded before the step's forward pass (the synchronous mode).
    b = Engine(vllm_config(model_config, polarkv.manager_url, load_mode="sync"))
    engines.append(b)
    second = first[: 2 * CHUNK] + prompt(2, 100)
    b.add("b1", second)
    out, kv_output = b.step()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 2 * CHUNK
    assert out.num_scheduled_tokens == {"b1": len(second) - 2 * CHUNK}
    assert out.has_sync_kv_loads
    (load,) = out.kv_connector_metadata.loads
    assert load.first_block == 0 and load.block_ids == b.tables["b1"][: 2 * PER_CHUNK]
    assert not kv_output.invalid_block_ids
    assert b.worker.stats.loaded_chunks == 2
    # The loaded KV is A's, byte for byte, in B's own blocks.
    assert same_bytes(b.kv("b1", 0, 2 * CHUNK), a.kv("a1", 0, 2 * CHUNK))
    assert same_bytes(b.kv("b1", 0, len(second)), b.expected("b1", 0, len(second)))
    assert b.connector.stats.lookups == 1 and b.connector.stats.hit_tokens == 2 * CHUNK
    # A prompt of exactly the cached chunks still leaves its last token to vLLM.
    b.add("b2", first[: 2 * CHUNK])
    out, _ = b.step()
    assert out.num_scheduled_tokens["b2"] >= 1


def test_local_prefix_cache_hits_are_not_loaded_again(
    model_config: ModelConfig, polarkv: PolarKV, engines: list[Engine]
) -> None:
    engine = Engine(vllm_config(model_config, polarkv.manager_url, load_mode="sync"))
    engines.append(engine)
    shared = prompt(3, 3 * CHUNK)
    engine.add("r1", shared[: CHUNK + 40])  # computes chunk 0 and 40 more tokens locally
    engine.step()
    assert engine.worker.flush_saves(10)
    with PolarKVClient(polarkv.manager_url, engine.connector.namespace, CHUNK) as client:
        # Chunk 1 reaches PolarKV from elsewhere (another engine, same namespace).
        other = Engine(vllm_config(model_config, polarkv.manager_url, load_mode="sync"))
        engines.append(other)
        other.add("o1", shared[: 2 * CHUNK + 1])
        other.step()
        assert other.worker.flush_saves(10)
        assert client.lookup_kv(shared) == 2 * CHUNK
    engine.add("r2", shared)
    out, _ = engine.step()
    (new,) = out.scheduled_new_reqs
    (load,) = out.kv_connector_metadata.loads
    # vLLM's own prefix cache holds chunk 0 and two more blocks; only the rest is written.
    local = (CHUNK + 40) // BLOCK * BLOCK
    assert new.num_computed_tokens == 2 * CHUNK
    assert load.first_block == local // BLOCK
    assert load.block_ids == engine.tables["r2"][local // BLOCK : 2 * PER_CHUNK]
    assert same_bytes(engine.kv("r2", 0, len(shared)), engine.expected("r2", 0, len(shared)))


# -- 2b. asynchronous loads: the step never waits for PolarKV ------------------------------


def saved_engine(model_config: ModelConfig, url: str, tokens: list[int]) -> Engine:
    """An engine that has computed `tokens` and saved their chunks to PolarKV."""
    engine = Engine(vllm_config(model_config, url))
    engine.add("src", tokens)
    engine.step()
    assert engine.worker.flush_saves(10)
    assert engine.worker.stats.saved_chunks == len(tokens) // CHUNK
    return engine


def steps_until_scheduled(engine: Engine, req_id: str, limit: int = 50) -> tuple[Any, list[Any]]:
    """Step (the loads running meanwhile) until `req_id` is scheduled: its step's output
    and the connector outputs of every step before it."""
    outputs = []
    for _ in range(limit):
        engine.worker.flush_loads(10)
        out, kv_output = engine.step()
        if req_id in out.num_scheduled_tokens:
            return out, outputs
        outputs.append(kv_output)
    raise AssertionError(f"{req_id} was never scheduled")


def gate_loads(engine: Engine) -> threading.Event:
    """Hold the worker's real loads at their start until the returned event is set."""
    client = engine.worker._client
    assert client is not None
    gate, real_load = threading.Event(), client.load_kv

    def gated_load(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(10)
        return real_load(*args, **kwargs)

    client.load_kv = gated_load  # type: ignore[method-assign]
    return gate


def test_async_load_leaves_other_requests_running(
    model_config: ModelConfig, polarkv: PolarKV, engines: list[Engine]
) -> None:
    shared = prompt(11, 2 * CHUNK)
    engines.append(saved_engine(model_config, polarkv.manager_url, shared))
    b = Engine(vllm_config(model_config, polarkv.manager_url, load_mode="async"))
    engines.append(b)
    assert b.connector.asynchronous and b.worker.asynchronous
    second = [*shared, *prompt(12, 90)]
    b.add("b1", second)
    b.add("other", prompt(13, 300))
    out, first_output = b.step()
    # The scheduler was told to load asynchronously: b1 waits for its KV, and the same
    # step computes the other request instead of waiting with it.
    assert out.num_scheduled_tokens == {"other": 300} and not out.has_sync_kv_loads
    (load,) = out.kv_connector_metadata.loads
    assert load.req_id == "b1" and load.first_block == 0
    assert b.scheduler.requests["b1"].status.name == "WAITING_FOR_REMOTE_KVS"
    out, before = steps_until_scheduled(b, "b1")
    outputs = [first_output, *before]
    # Reported finished exactly once, with nothing failed, then scheduled past the hit.
    assert sum("b1" in (o.finished_recving or ()) for o in outputs) == 1
    assert not any(o.invalid_block_ids for o in outputs)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 2 * CHUNK
    assert out.num_scheduled_tokens == {"b1": len(second) - 2 * CHUNK}
    assert same_bytes(b.kv("b1", 0, len(second)), b.expected("b1", 0, len(second)))
    assert b.worker.stats.loaded_chunks == 2 and b.worker.stats.failed_load_blocks == 0
    # vLLM's own connector statistics carry PolarKV's figures, from both roles.
    stats = [o.kv_connector_stats for o in outputs if o.kv_connector_stats is not None]
    assert stats
    total = PolarKVConnector.build_kv_connector_stats({})
    for one in stats:
        total = total.aggregate(one)
    reduced = total.reduce()
    assert reduced["polarkv_loads"] == 1 and reduced["polarkv_loaded_tokens"] == 2 * CHUNK
    assert reduced["polarkv_avg_load_ms"] > 0
    # The scheduler's (its own figures go into vLLM's scheduler stats, each step).
    assert b.connector.stats.lookups == 2 and b.connector.stats.hit_tokens == 2 * CHUNK
    assert b.connector.get_kv_connector_stats() is None  # taken by the scheduler already


@pytest.mark.parametrize("deleted", [0, 1])
def test_async_load_failure_is_recomputed(
    model_config: ModelConfig, polarkv: PolarKV, engines: list[Engine], deleted: int
) -> None:
    """Chunk `deleted` goes between the lookup and the load. With chunk 0 gone nothing
    arrives: vLLM frees the request's blocks and asks again, and gets a miss (not the
    same load again)."""
    tokens = prompt(14 + 100 * deleted, 3 * CHUNK + 32)
    engines.append(saved_engine(model_config, polarkv.manager_url, tokens))
    b = Engine(vllm_config(model_config, polarkv.manager_url, load_mode="async"))
    engines.append(b)
    b.add("b1", tokens)
    out = b.scheduler.schedule()  # the lookup: all three chunks are there
    (load,) = out.kv_connector_metadata.loads
    table = list(load.block_ids)
    with PolarKVClient(polarkv.manager_url, b.connector.namespace, CHUNK) as client:
        key = client.keys(tokens)[deleted]
        status, _ = http("DELETE", f"{polarkv.manager_url}/v1/keys/{key}")
        assert status == 200
    _, first_output = b.step(out)
    out, before = steps_until_scheduled(b, "b1")
    outputs = [first_output, *before]
    # The blocks that did not arrive are reported no later than the request's finish.
    reported = [i for i, o in enumerate(outputs) if "b1" in (o.finished_recving or ())]
    assert len(reported) == 1
    invalid = set().union(*(o.invalid_block_ids for o in outputs[: reported[0] + 1]))
    assert invalid == set(table[deleted * PER_CHUNK :])
    # vLLM recomputes from the first failed block; the KV is exact and saved again.
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == deleted * CHUNK
    assert out.num_scheduled_tokens == {"b1": len(tokens) - deleted * CHUNK}
    assert not out.kv_connector_metadata.loads and b.worker.stats.loads == 1
    assert same_bytes(b.kv("b1", 0, len(tokens)), b.expected("b1", 0, len(tokens)))
    assert [(s.first_chunk, len(s.tokens) // CHUNK) for s in out.kv_connector_metadata.saves] == [
        (deleted, 3)
    ]
    assert b.worker.flush_saves(10)
    with PolarKVClient(polarkv.manager_url, b.connector.namespace, CHUNK) as client:
        assert client.lookup_kv(tokens) == 3 * CHUNK


def test_request_aborted_while_loading_releases_its_blocks(
    model_config: ModelConfig, polarkv: PolarKV, engines: list[Engine]
) -> None:
    tokens = prompt(15, 2 * CHUNK + 20)
    engines.append(saved_engine(model_config, polarkv.manager_url, tokens))
    b = Engine(vllm_config(model_config, polarkv.manager_url, load_mode="async"))
    engines.append(b)
    pool = b.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    # Hold the real load at its start, so the abort lands while it is in flight.
    gate = gate_loads(b)
    b.add("b1", tokens)
    out, kv_output = b.step()
    assert not out.num_scheduled_tokens and not kv_output.finished_recving
    assert pool.get_num_free_blocks() < free
    b.scheduler.finish_requests("b1", RequestStatus.FINISHED_ABORTED)
    # vLLM keeps the blocks of a request whose load is in flight...
    assert "b1" in b.scheduler.requests and pool.get_num_free_blocks() < free
    out, kv_output = b.step()  # the worker hears of the abort and cancels the load
    gate.set()
    for _ in range(50):
        if "b1" not in b.scheduler.requests:
            break
        b.worker.flush_loads(10)
        b.step()
    # ...until the worker reports the load ended: then every block is free again, the
    # load wrote nothing and holds nothing.
    assert "b1" not in b.scheduler.requests
    assert pool.get_num_free_blocks() == free
    assert b.worker.stats.cancelled_loads == 1 and b.worker.stats.loaded_chunks == 0
    assert b.worker._loader is not None and b.worker._loader.in_flight == 0


def test_the_gil_is_handed_over_sooner_only_while_a_load_is_in_flight(
    model_config: ModelConfig, polarkv: PolarKV, engines: list[Engine]
) -> None:
    tokens = prompt(21, 2 * CHUNK + 20)
    engines.append(saved_engine(model_config, polarkv.manager_url, tokens))
    b = Engine(vllm_config(model_config, polarkv.manager_url, load_mode="async"))
    engines.append(b)
    gate = gate_loads(b)
    before = sys.getswitchinterval()
    assert before > 0.0005
    try:
        b.add("b1", tokens)
        b.step()  # the load is handed to the loader and waits at the gate
        assert sys.getswitchinterval() == 0.0005
        b.step()  # still loading: still quick
        assert sys.getswitchinterval() == 0.0005
        gate.set()
        steps_until_scheduled(b, "b1")
        assert sys.getswitchinterval() == before  # nothing in flight: Python's own again
        assert b.worker.stats.loaded_chunks == 2
    finally:
        gate.set()
        sys.setswitchinterval(before)
    off = Engine(vllm_config(model_config, polarkv.manager_url, load_switch_interval=0))
    engines.append(off)
    off.add("c1", tokens)
    off.step()
    assert sys.getswitchinterval() == before  # 0: left alone


def test_lookup_of_a_silent_manager_is_bounded_and_asked_once(
    model_config: ModelConfig,
) -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        config = vllm_config(model_config, url, lookup_timeout=0.2)
        scheduler_side = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, kv_cache_config(config)
        )
        assert isinstance(scheduler_side, PolarKVConnector)
        try:
            request = Request("r", prompt(16, 2 * CHUNK + 1), SamplingParams(max_tokens=1), None)
            started = time.monotonic()
            assert scheduler_side.get_num_new_matched_tokens(request, 0) == (0, False)
            assert time.monotonic() - started < 0.6
            assert scheduler_side.stats.lookups == 1 and scheduler_side.stats.lookup_faults == 1
            # Asked again (no room last step): the first answer stands, at no cost.
            started = time.monotonic()
            assert scheduler_side.get_num_new_matched_tokens(request, 0) == (0, False)
            assert time.monotonic() - started < 0.05
            assert scheduler_side.stats.lookups == 1 and scheduler_side.stats.lookups_reused == 1
        finally:
            scheduler_side.shutdown()


def test_sync_mode_loads_before_the_forward_pass(
    model_config: ModelConfig, polarkv: PolarKV
) -> None:
    tokens = prompt(17, 2 * CHUNK + 1)
    request = Request("r", tokens, SamplingParams(max_tokens=1), None)
    for mode, expected in (("sync", False), ("async", True), ("auto", False)):
        config = vllm_config(model_config, polarkv.manager_url, load_mode=mode)
        scheduler_side = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, kv_cache_config(config)
        )
        try:
            with PolarKVClient(polarkv.manager_url, scheduler_side.namespace, CHUNK) as client:
                assert client.store_kv(tokens, [b"x" * 8] * 2) == 2
            assert scheduler_side.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, expected)
            # Nothing to load is never asynchronous.
            assert scheduler_side.get_num_new_matched_tokens(request, 2 * CHUNK) == (0, False)
        finally:
            scheduler_side.shutdown()


def test_auto_mode_loads_a_short_memory_hit_on_the_step(
    model_config: ModelConfig, polarkv: PolarKV, engines: list[Engine]
) -> None:
    """A hit that is one memory read of at most step_load_limit loads before the forward
    pass that computes the rest of the prompt, in the same step."""
    shared = prompt(19, 2 * CHUNK)
    engines.append(saved_engine(model_config, polarkv.manager_url, shared))
    b = Engine(vllm_config(model_config, polarkv.manager_url, load_mode="auto"))
    engines.append(b)
    assert b.worker._loader is not None  # for its other loads
    second = [*shared, *prompt(20, 90)]
    b.add("b1", second)
    out, kv_output = b.step()
    assert out.num_scheduled_tokens == {"b1": len(second) - 2 * CHUNK} and out.has_sync_kv_loads
    (load,) = out.kv_connector_metadata.loads
    assert load.on_step and not kv_output.finished_recving
    assert b.worker.stats.step_loads == 1 and b.worker.stats.loaded_chunks == 2
    assert b.worker._loader.in_flight == 0
    assert same_bytes(b.kv("b1", 0, len(second)), b.expected("b1", 0, len(second)))


def test_auto_mode_loads_disk_and_long_hits_asynchronously(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    """A hit that must come back from PolarKV's disk, or is longer than step_load_limit,
    would hold every running request's step: it loads asynchronously."""
    cluster = Cluster(tmp_path)
    sides: list[Any] = []
    try:
        node = cluster.embedded(disk=True, slab__memory="2MiB", disk__capacity="64MiB")
        url = node.manager_url
        for limit in ("32MiB", "1KiB"):
            config = vllm_config(model_config, url, load_mode="auto", step_load_limit=limit)
            sides.append(
                KVConnectorFactory.create_connector(
                    config, KVConnectorRole.SCHEDULER, kv_cache_config(config)
                )
            )
        auto, limited = sides
        assert auto.namespace == limited.namespace
        prompts = [prompt(30 + i, 2 * CHUNK + 1) for i in range(8)]
        with PolarKVClient(url, auto.namespace, CHUNK) as client:
            for tokens in prompts:  # 8 x 512 KiB through 2 MiB: the first go to disk
                assert client.store_kv(tokens, [os.urandom(256 << 10) for _ in range(2)]) == 2
            keys = client.keys(prompts[0])
        wait_for(
            lambda: all(http("GET", f"{url}/v1/keys/{k}")[1]["tiers"] == ["disk"] for k in keys)
        )

        def ask(side: Any, name: str, tokens: list[int]) -> tuple[int, bool]:
            request = Request(name, tokens, SamplingParams(max_tokens=1), None)
            answer: tuple[int, bool] = side.get_num_new_matched_tokens(request, 0)
            return answer

        assert ask(auto, "latest", prompts[-1]) == (2 * CHUNK, False)  # in memory: on the step
        assert ask(auto, "oldest", prompts[0]) == (2 * CHUNK, True)  # on disk: asynchronous
        assert ask(limited, "long", prompts[-1]) == (2 * CHUNK, True)  # past the limit
        assert ask(auto, "none", prompt(99, 2 * CHUNK + 1)) == (0, False)
    finally:
        for side in sides:
            side.shutdown()
        cluster.close()


def test_a_rank_vllm_cannot_tell_stops_the_connector(
    model_config: ModelConfig, polarkv: PolarKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed import parallel_state

    def broken() -> int:
        raise AssertionError("tensor model parallel group is not initialized")

    config = vllm_config(model_config, polarkv.manager_url)
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", broken)
    with pytest.raises(RuntimeError, match="cannot read this worker's tensor/pipeline"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config(config))
    # The scheduler speaks for rank 0 and never asks.
    KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config(config)
    ).shutdown()


# -- 3. worker round trips: every layout, byte-exact, and failures -------------------------

LAYOUT_CASES = [pytest.param(layout.name, BLOCK, id=layout.name) for layout in KVCacheLayout]
LAYOUT_CASES.append(pytest.param("LBNHC", 8, id="LBNHC-kernel-blocks-of-8"))


def fill_random(caches: dict[str, Any], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name in LAYERS:
        cache = caches[name].view(torch.uint8)
        cache.copy_(torch.randint(0, 256, cache.shape, dtype=torch.uint8, generator=generator))


def pages(caches: dict[str, Any], block_ids: list[int]) -> Any:
    """[layers, blocks, H, bs, C bytes]: the chunk format's pages, computed independently:
    a manager block's kernel blocks put side by side along the token axis."""
    out = []
    for name in LAYERS:
        cache = caches[name].view(torch.uint8)
        ratio = BLOCK // cache.shape[2]
        out.append(
            torch.stack(
                [torch.cat([cache[b * ratio + j] for j in range(ratio)], dim=1) for b in block_ids]
            )
        )
    return torch.stack(out)


def worker(config: VllmConfig, kcc: KVCacheConfig, caches: dict[str, Any]) -> PolarKVConnector:
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
    assert isinstance(connector, PolarKVConnector)
    connector.register_kv_caches(caches)
    return connector


def run_step(connector: PolarKVConnector, meta: PolarKVConnectorMetadata) -> set[int]:
    """One step as the model runner drives a worker's connector; returns the failed blocks."""
    with kv_transfer_group(connector):
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)
        connector.wait_for_save()
        assert connector.flush_loads(10)  # asynchronous loads end before they are reported
        connector.get_finished(set())
        connector.clear_connector_metadata()
        return connector.get_block_ids_with_load_errors()


@pytest.mark.parametrize(("layout", "kernel_block"), LAYOUT_CASES)
def test_worker_round_trips_paged_kv_in_every_layout(
    model_config: ModelConfig, polarkv: PolarKV, layout: str, kernel_block: int
) -> None:
    config = vllm_config(model_config, polarkv.manager_url, layout=layout)
    kcc = kv_cache_config(config)
    source = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout], [kernel_block])
    target = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout], [kernel_block])
    assert tuple(source[LAYERS[0]].shape) == (
        NUM_BLOCKS * BLOCK // kernel_block,
        HEADS,
        kernel_block,
        CELL,
    )
    fill_random(source, seed=sum(map(ord, layout)) + kernel_block)
    tokens = prompt(100 + kernel_block + sum(map(ord, layout)), 3 * CHUNK + 5)
    src_blocks = list(range(45, 45 + 3 * PER_CHUNK))[::-1]  # any order vLLM may hand out
    dst_blocks = list(range(2, 2 + 3 * PER_CHUNK))
    a, b = worker(config, kcc, source), worker(config, kcc, target)
    try:
        assert not run_step(
            a, PolarKVConnectorMetadata(saves=[SaveOp("r", tokens[: 3 * CHUNK], src_blocks, 0)])
        )
        assert a.flush_saves(10) and a.stats.saved_chunks == 3
        # The stored bytes are the documented format: layers, then blocks, then pages.
        expected = pages(source, src_blocks).view(len(LAYERS), 3, PER_CHUNK, -1).transpose(0, 1)
        with PolarKVClient(polarkv.manager_url, a.namespace, CHUNK) as client:
            for i, key in enumerate(client.keys(tokens)):
                assert client.get(key) == expected[i].contiguous().numpy().tobytes()
        # A local prefix of 20 blocks: only blocks 20.. of the request are written.
        load = LoadOp("r", tokens[: 3 * CHUNK], dst_blocks[20:], first_block=20)
        assert not run_step(b, PolarKVConnectorMetadata(loads=[load]))
        assert same_bytes(pages(target, dst_blocks[20:]), pages(source, src_blocks[20:]))
        untouched = [i for i in range(NUM_BLOCKS) if i not in dst_blocks[20:]]
        assert not pages(target, untouched).any()
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("stacked", ["2-blocks", "blocks-2", "2-blocks-hnd"])
def test_worker_round_trips_kv_stacked_caches(
    model_config: ModelConfig, polarkv: PolarKV, stacked: str
) -> None:
    """The K/V-stacked per-layer shapes of older backends, [2, blocks, bs, H, D] and
    [blocks, 2, bs, H, D] (HND: the same logical shape over [2, blocks, H, bs, D] memory).
    vLLM 0.33's allocator no longer hands these out, so they are built here."""
    config = vllm_config(model_config, polarkv.manager_url, layout="LBNHC")
    kcc = kv_cache_config(config)

    def make() -> dict[str, Any]:
        if stacked == "2-blocks":
            return {n: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE) for n in LAYERS}
        if stacked == "blocks-2":
            return {n: torch.zeros(NUM_BLOCKS, 2, BLOCK, HEADS, HEAD_SIZE) for n in LAYERS}
        return {
            n: torch.zeros(2, NUM_BLOCKS, HEADS, BLOCK, HEAD_SIZE).transpose(2, 3) for n in LAYERS
        }

    def kv_pages(caches: dict[str, Any], blocks: list[int]) -> Any:  # [L, blocks, H, bs, K|V]
        kv = [
            c if stacked != "blocks-2" else c.transpose(0, 1) for c in (caches[n] for n in LAYERS)
        ]
        return torch.stack(
            [
                torch.cat([c[0, blocks].transpose(1, 2), c[1, blocks].transpose(1, 2)], -1)
                for c in kv
            ]
        )

    source, target = make(), make()
    generator = torch.Generator().manual_seed(7)
    for name in LAYERS:
        source[name].copy_(torch.randn(source[name].shape, generator=generator))
    tokens = prompt(200 + ["2-blocks", "blocks-2", "2-blocks-hnd"].index(stacked), 2 * CHUNK)
    src_blocks, dst_blocks = list(range(40, 40 + 2 * PER_CHUNK)), list(range(2 * PER_CHUNK))
    a, b = worker(config, kcc, source), worker(config, kcc, target)
    try:
        run_step(a, PolarKVConnectorMetadata(saves=[SaveOp("r", tokens, src_blocks, 0)]))
        assert a.flush_saves(10) and a.stats.saved_chunks == 2
        with PolarKVClient(polarkv.manager_url, a.namespace, CHUNK) as client:
            chunk0 = client.get(client.keys(tokens)[0])
        assert chunk0 == kv_pages(source, src_blocks[:PER_CHUNK]).contiguous().numpy().tobytes()
        assert not run_step(b, PolarKVConnectorMetadata(loads=[LoadOp("r", tokens, dst_blocks, 0)]))
        assert same_bytes(kv_pages(target, dst_blocks), kv_pages(source, src_blocks))
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize(
    "first_block",
    [0, 1, PER_CHUNK - 1, PER_CHUNK, PER_CHUNK + 3],
    ids=lambda f: f"first-block-{f}",
)
def test_loads_scatter_every_split_of_chunks_into_blocks(
    model_config: ModelConfig, polarkv: PolarKV, first_block: int
) -> None:
    """A load writes request blocks first_block.. : whole chunks go as one span, a part of
    a chunk as another (vllm_loads._spans); every split lands byte-exact, nothing else is
    written, and the host buffer is kept for the next load."""
    config = vllm_config(model_config, polarkv.manager_url)
    kcc = kv_cache_config(config)
    layout = KVCacheLayout[config.cache_config.kv_cache_layout]
    source = allocate_kv_cache(kcc, torch.device("cpu"), layout, [BLOCK])
    target = allocate_kv_cache(kcc, torch.device("cpu"), layout, [BLOCK])
    fill_random(source, seed=300 + first_block)
    tokens = prompt(300 + first_block, 2 * CHUNK)
    src_blocks = list(range(60, 60 + 2 * PER_CHUNK))
    dst_blocks = [2 * i + 1 for i in range(2 * PER_CHUNK)]  # no two in a row
    a, b = worker(config, kcc, source), worker(config, kcc, target)
    try:
        run_step(a, PolarKVConnectorMetadata(saves=[SaveOp("r", tokens, src_blocks, 0)]))
        assert a.flush_saves(10) and a.stats.saved_chunks == 2
        written = dst_blocks[first_block:]
        load = LoadOp("r", tokens, written, first_block=first_block)
        assert not run_step(b, PolarKVConnectorMetadata(loads=[load]))
        assert same_bytes(pages(target, written), pages(source, src_blocks[first_block:]))
        assert not pages(target, [i for i in range(NUM_BLOCKS) if i not in written]).any()
        assert b.load_buffers_idle() == 2 * b.chunk_bytes  # kept for the next load
    finally:
        a.shutdown()
        b.shutdown()


def test_load_buffers_are_kept_for_the_next_load_within_their_bound() -> None:
    spare = HostBuffers(keep=3 << 20)
    one = spare.take(1 << 20)
    spare.give(one)
    assert spare.take(1000) is one  # the smallest idle buffer that fits comes back
    two = spare.take(2 << 20)  # nothing idle fits: a new one
    assert two is not one and two.numel() == 2 << 20
    spare.give(one)
    spare.give(two)
    assert spare.idle_bytes == 3 << 20
    spare.give(spare.take(4 << 20))  # beyond the bound: let go, the others stay
    assert spare.idle_bytes == 3 << 20
    assert spare.take(1 << 20) is one and spare.take(2 << 20) is two
    assert spare.idle_bytes == 0


def test_unknown_cache_shape_is_refused_at_registration(
    model_config: ModelConfig, polarkv: PolarKV
) -> None:
    config = vllm_config(model_config, polarkv.manager_url)
    kcc = kv_cache_config(config)
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
    try:
        with pytest.raises(ValueError, match="unsupported KV cache shape"):
            connector.register_kv_caches(
                {n: torch.zeros(NUM_BLOCKS, 3, BLOCK, CELL) for n in LAYERS}
            )
    finally:
        connector.shutdown()


def test_chunk_deleted_between_lookup_and_load_is_recomputed(
    model_config: ModelConfig, polarkv: PolarKV, engines: list[Engine]
) -> None:
    a = Engine(vllm_config(model_config, polarkv.manager_url))
    engines.append(a)
    tokens = prompt(4, 3 * CHUNK + 32)
    a.add("a1", tokens)
    a.step()
    assert a.worker.flush_saves(10) and a.worker.stats.saved_chunks == 3

    b = Engine(vllm_config(model_config, polarkv.manager_url, load_mode="sync"))
    engines.append(b)
    b.add("b1", tokens)
    out = b.scheduler.schedule()  # the lookup: all three chunks are there
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * CHUNK
    with PolarKVClient(polarkv.manager_url, b.connector.namespace, CHUNK) as client:
        status, _ = http("DELETE", f"{polarkv.manager_url}/v1/keys/{client.keys(tokens)[1]}")
        assert status == 200
    _, kv_output = b.step(out)
    table = b.tables["b1"]
    assert kv_output.invalid_block_ids == set(table[PER_CHUNK : 3 * PER_CHUNK])
    assert b.worker.stats.loaded_chunks == 1
    assert same_bytes(b.kv("b1", 0, CHUNK), b.expected("b1", 0, CHUNK))
    # update_from_output took the failure: vLLM recomputes from the first failed block.
    request = b.scheduler.requests["b1"]
    assert request.num_computed_tokens == CHUNK
    out, kv_output = b.step()
    assert out.num_scheduled_tokens == {"b1": len(tokens) - CHUNK}
    assert not kv_output.invalid_block_ids and not out.kv_connector_metadata.loads
    assert same_bytes(b.kv("b1", 0, len(tokens)), b.expected("b1", 0, len(tokens)))
    # The recomputed chunks are saved again, so the deleted one is back.
    assert [(s.first_chunk, len(s.tokens) // CHUNK) for s in out.kv_connector_metadata.saves] == [
        (1, 3)
    ]
    assert b.worker.flush_saves(10)
    with PolarKVClient(polarkv.manager_url, b.connector.namespace, CHUNK) as client:
        assert client.lookup_kv(tokens) == 3 * CHUNK


def test_slab_killed_between_lookup_and_load_reports_every_block(
    model_config: ModelConfig, cluster: Cluster
) -> None:
    """tcp, so the dead slab is noticed at once (shm would still read its buffer file
    until the manager declares the node dead)."""
    manager = cluster.manager()
    slab = cluster.slab(manager.manager_url)
    config = vllm_config(model_config, manager.manager_url, transport="tcp", load_mode="sync")
    kcc = kv_cache_config(config)
    source = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BLOCK])
    target = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BLOCK])
    fill_random(source, seed=5)
    tokens = prompt(5, 2 * CHUNK)
    blocks = list(range(2 * PER_CHUNK))
    a, b = worker(config, kcc, source), worker(config, kcc, target)
    scheduler_side = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kcc)
    try:
        run_step(a, PolarKVConnectorMetadata(saves=[SaveOp("r", tokens, blocks, 0)]))
        assert a.flush_saves(10) and a.stats.saved_chunks == 2
        with PolarKVClient(manager.manager_url, a.namespace, CHUNK) as client:
            assert client.lookup_kv(tokens) == 2 * CHUNK
        slab.kill()
        started = time.monotonic()
        failed = run_step(b, PolarKVConnectorMetadata(loads=[LoadOp("r", tokens, blocks, 0)]))
        assert failed == set(blocks)
        assert time.monotonic() - started < 5
        assert not pages(target, list(range(NUM_BLOCKS))).any()
        # Once the manager has declared the slab dead, the scheduler sees misses (each
        # request is asked once: a new one each time).
        asked = iter(range(1000))

        def hit() -> Any:
            request = Request(f"r{next(asked)}", [*tokens, 1], SamplingParams(max_tokens=1), None)
            return scheduler_side.get_num_new_matched_tokens(request, 0)

        wait_for(lambda: hit() == (0, False))
    finally:
        a.shutdown()
        b.shutdown()
        scheduler_side.shutdown()


def test_a_stopped_polarkv_never_stalls_the_step_in_wait_for_save(
    model_config: ModelConfig, cluster: Cluster
) -> None:
    """PolarKV SIGSTOPped (it accepts connections and never answers): the step pays for
    the gather and the hand-off only; the saver's thread waits, and once its bounded
    queue is full the step's saves are dropped, counted, never waited for."""
    polarkv = cluster.embedded()
    config = vllm_config(model_config, polarkv.manager_url)
    kcc = kv_cache_config(config)
    caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BLOCK])
    fill_random(caches, seed=11)
    connector = worker(config, kcc, caches)
    assert connector._saver is not None
    connector._saver._max = 2 * connector.chunk_bytes  # room for one two-chunk save
    blocks = list(range(2 * PER_CHUNK))
    steps = 6
    os.kill(polarkv.pid, signal.SIGSTOP)
    try:
        costs = []
        for step in range(steps):
            tokens = prompt(200 + step, 2 * CHUNK)
            started = time.perf_counter()
            run_step(connector, PolarKVConnectorMetadata(saves=[SaveOp("r", tokens, blocks, 0)]))
            costs.append(time.perf_counter() - started)
        # The client's timeout is 1 s: a step that waited on PolarKV would show it.
        assert max(costs) < 0.5, costs
        assert connector.stats.save_steps == steps
        assert connector.stats.save_step_max_seconds < 0.5
        assert connector.stats.dropped_saves >= steps - 2
        interval = connector.get_kv_connector_stats().reduce()
        assert interval["polarkv_save_steps"] == steps
        assert 0 < interval["polarkv_max_save_step_ms"] < 500
        assert connector.stats.save_step_max_seconds == 0  # a new interval
    finally:
        os.kill(polarkv.pid, signal.SIGCONT)
        assert connector.flush_saves(30)
        connector.shutdown()


def test_save_step_stats_sum_over_workers_but_keep_the_longest_step() -> None:
    a = PolarKVStats(
        data={"save_steps": 2, "save_step_seconds": 0.003, "save_step_max_seconds": 0.002}
    )
    b = PolarKVStats(
        data={"save_steps": 1, "save_step_seconds": 0.004, "save_step_max_seconds": 0.004}
    )
    out = a.aggregate(b).reduce()
    assert out["polarkv_save_steps"] == 3
    assert out["polarkv_avg_save_step_ms"] == pytest.approx(7 / 3, abs=0.001)
    assert out["polarkv_max_save_step_ms"] == 4.0
    assert "polarkv_save_step_seconds" not in out  # shown as the average and the max


# -- 4. PolarKV down: misses, and the engine goes on ---------------------------------------


def test_polarkv_down_is_a_miss_and_the_engine_proceeds(
    model_config: ModelConfig, engines: list[Engine]
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    engine = Engine(vllm_config(model_config, down))
    engines.append(engine)
    tokens = prompt(6, 2 * CHUNK + 10)
    engine.add("r1", tokens)
    started = time.monotonic()
    out, kv_output = engine.step()
    assert time.monotonic() - started < 5
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 0 and out.num_scheduled_tokens == {"r1": len(tokens)}
    assert not out.kv_connector_metadata.loads and not kv_output.invalid_block_ids
    assert engine.connector.stats.lookups == 1 and engine.connector.stats.hit_tokens == 0
    assert engine.worker.flush_saves(10)  # the save became a miss, not an error
    assert engine.worker.stats.saved_chunks == 0 and engine.worker.stats.failed_saves == 1
    assert "r1" not in engine.scheduler.requests  # finished: one token sampled
    engine.add("r2", tokens)  # and the engine keeps serving
    out, _ = engine.step()
    assert out.num_scheduled_tokens


def test_importing_the_client_does_not_import_torch() -> None:
    code = (
        "import sys, polarkv_lib.client, polarkv_lib.integrations.common; "
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
