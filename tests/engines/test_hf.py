"""transformers past key values through PolarKV: a real architecture with random weights,
its prefix KV stored by one request and loaded by the next, which must then produce the
logits and the greedy continuation of a full recompute."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from polarkv_lib.integrations.hf import HFKVStore, greedy, prefill

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 32
SIZES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def small_model(arch: str = "llama", dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SIZES))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**SIZES))
    return model.to(dtype).eval()


def prompt(prefix: torch.Tensor, suffix_len: int, seed: int) -> torch.Tensor:
    suffix = torch.randint(
        SIZES["vocab_size"], (suffix_len,), generator=torch.Generator().manual_seed(seed)
    )
    return torch.cat([prefix, suffix]).unsqueeze(0)


@pytest.fixture
def url(cluster: Any) -> str:
    return str(cluster.embedded().manager_url)


@pytest.mark.parametrize(
    ("arch", "dtype", "atol"), [("llama", torch.float32, 1e-4), ("qwen2", torch.bfloat16, 5e-2)]
)
def test_loaded_kv_gives_the_logits_and_continuation_of_a_recompute(
    url: str, arch: str, dtype: torch.dtype, atol: float
) -> None:
    model = small_model(arch, dtype)
    prefix = torch.randint(
        SIZES["vocab_size"], (5 * CHUNK + 7,), generator=torch.Generator().manual_seed(1)
    )
    first, second = prompt(prefix, 9, seed=2), prompt(prefix, 13, seed=3)
    with HFKVStore.for_model(
        model, model_id=f"test/{arch}", manager_url=url, chunk_tokens=CHUNK
    ) as store:
        cold = prefill(model, first, store)
        assert cold.loaded_tokens == 0
        assert store.store(first, cold.cache) == 5 * CHUNK  # full chunks only
        assert store.lookup(second) == 5 * CHUNK

        warm = prefill(model, second, store)
        assert warm.loaded_tokens == 5 * CHUNK  # the shared full chunks
        full = prefill(model, second)
        for ours, ref, stored in zip(
            warm.cache.layers, full.cache.layers, cold.cache.layers, strict=True
        ):
            # The bytes that came back are the bytes that were stored...
            assert torch.equal(ours.keys[:, :, : 5 * CHUNK], stored.keys[:, :, : 5 * CHUNK])
            assert torch.equal(ours.values[:, :, : 5 * CHUNK], stored.values[:, :, : 5 * CHUNK])
            # ...and the whole cache is the one a recompute builds.
            torch.testing.assert_close(ours.keys, ref.keys, atol=atol, rtol=0)
            torch.testing.assert_close(ours.values, ref.values, atol=atol, rtol=0)
        torch.testing.assert_close(warm.logits, full.logits, atol=atol, rtol=0)
        assert greedy(model, warm, 12) == greedy(model, full, 12)


def test_chunk_bytes_follow_the_documented_layout(url: str) -> None:
    model = small_model()
    ids = torch.randint(
        SIZES["vocab_size"], (1, 2 * CHUNK), generator=torch.Generator().manual_seed(4)
    )
    with HFKVStore.for_model(
        model, model_id="test/layout", manager_url=url, chunk_tokens=CHUNK
    ) as store:
        cache = prefill(model, ids).cache
        assert store.store(ids, cache) == 2 * CHUNK
        geo = store.geometry
        for c, key in enumerate(store.client.keys(ids[0])):
            data = store.client.get(key)
            assert data is not None and len(data) == geo.chunk_bytes(CHUNK)
            chunk = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(
                geo.layers, 2, geo.kv_heads, CHUNK, geo.head_dim
            )
            for i, layer in enumerate(cache.layers):
                span = slice(c * CHUNK, (c + 1) * CHUNK)
                assert torch.equal(chunk[i, 0], layer.keys[0, :, span])
                assert torch.equal(chunk[i, 1], layer.values[0, :, span])


def test_namespace_keeps_models_and_dtypes_apart(url: str) -> None:
    ids = torch.randint(
        SIZES["vocab_size"], (1, 2 * CHUNK + 1), generator=torch.Generator().manual_seed(5)
    )
    f32, bf16 = small_model(), small_model(dtype=torch.bfloat16)
    stores = [
        HFKVStore.for_model(f32, model_id="test/a", manager_url=url, chunk_tokens=CHUNK),
        HFKVStore.for_model(f32, model_id="test/b", manager_url=url, chunk_tokens=CHUNK),
        HFKVStore.for_model(bf16, model_id="test/a", manager_url=url, chunk_tokens=CHUNK),
    ]
    try:
        assert len({s.namespace for s in stores}) == 3
        assert stores[0].store(ids, prefill(f32, ids).cache) == 2 * CHUNK
        assert stores[0].load(ids)[0] == 2 * CHUNK
        assert stores[1].load(ids) == (0, None)
        assert stores[2].load(ids) == (0, None)
    finally:
        for s in stores:
            s.close()


def test_polarkv_down_falls_back_to_a_full_prefill(caplog: Any) -> None:
    caplog.set_level(logging.CRITICAL, logger="polarkv")
    model = small_model()
    ids = torch.randint(
        SIZES["vocab_size"], (1, 3 * CHUNK), generator=torch.Generator().manual_seed(6)
    )
    with HFKVStore.for_model(
        model,
        model_id="test/down",
        manager_url="http://127.0.0.1:9",
        chunk_tokens=CHUNK,
        extra={"timeout": 0.5},
    ) as store:
        result = prefill(model, ids, store)
        assert result.loaded_tokens == 0
        assert store.store(ids, result.cache) == 0
        assert store.lookup(ids) == 0
        torch.testing.assert_close(result.logits, prefill(model, ids).logits, atol=0, rtol=0)


def test_unsupported_cache_layouts_are_refused() -> None:
    sliding = Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(ValueError, match="full-attention"):
        HFKVStore(
            sliding, model_id="test/sliding", dtype=torch.float32, manager_url="http://127.0.0.1:9"
        )
    with pytest.raises(ValueError, match="model_id"):
        HFKVStore(
            LlamaConfig(**SIZES), model_id="", dtype=torch.float32, manager_url="http://127.0.0.1:9"
        )


def _demo() -> Any:
    spec = importlib.util.spec_from_file_location("demo_ttft", ROOT / "scripts" / "demo_ttft.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_demo_core_end_to_end() -> None:
    """The demo as the script runs it: its own PolarKV process, a cold request, then
    requests that load the shared prefix."""
    demo = _demo()
    spec = demo.DemoSpec(
        prefix_tokens=4 * CHUNK + 5,
        suffix_tokens=11,
        requests=3,
        gen_tokens=6,
        chunk_tokens=CHUNK,
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=512,
        repeats=2,
        threads=None,
        timeout=10.0,
    )
    report = demo.run_demo(spec)
    assert not psutil.Process().children(recursive=True)  # its PolarKV process is stopped
    assert [r.loaded_tokens for r in report.rows] == [0, 4 * CHUNK, 4 * CHUNK]
    assert report.rows[0].store_ms is not None
    assert all(r.greedy_match and r.max_logit_diff <= demo.LOGIT_ATOL for r in report.rows)
    table = demo.format_report(report)
    assert "| 2 | 144 | 128 |" in table and "TTFT speedup" in table
