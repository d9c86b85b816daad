"""Hugging Face transformers: a causal LM's past key values in PolarKV, chunk by chunk
(DESIGN §9).

    store = HFKVStore.for_model(model, model_id="org/model@rev", manager_url=url)
    n, cache = store.load(prompt[:-1])           # the longest stored prefix, or (0, None)
    out = model(input_ids=ids[:, n:], past_key_values=cache or DynamicCache(config=...))
    store.store(prompt, out.past_key_values)     # its full chunks, for the next request

Chunk i is the KV of tokens [i*T, (i+1)*T) (T = chunk_tokens), keyed by the client's
chained chunk keys, so it is only ever reused behind the same i*T tokens at the same
positions. Only full chunks are stored.

Byte layout of one chunk: a C-order array of shape [layers, 2, kv_heads, T, head_dim]
in the model's KV dtype (native byte order, little-endian on every supported machine);
index 0 of the second axis is the keys, 1 the values, exactly as the model caches them
(keys after RoPE). A layer's keys or values for one chunk are therefore one contiguous
run, and a loaded prefix becomes each layer's [1, kv_heads, n*T, head_dim] by one
concatenation.

The namespace holds what changes those bytes: `model_id` (name and revision of the
weights: the caller's to get right, as PolarKV cannot tell two checkpoints apart), dtype,
layers, KV heads, head dim, T and the layout. Supported: models whose cache is a
DynamicCache of full-attention layers (Llama, Qwen2, Mistral without sliding window...),
batch size 1. As everywhere in PolarKV, a fault is a miss: `load` returns (0, None)
and `store` returns 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from polarkv_lib.client import CallerError, PolarKVClient
from polarkv_lib.integrations.common import make_client, namespace, settings_from_extra

log = logging.getLogger("polarkv.hf")

LAYOUT = "L2HTD"  # [layers, K/V, kv_heads, tokens, head_dim]
DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a model's per-token KV, which fixes the bytes of a chunk."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: Any  # torch.dtype

    @classmethod
    def from_config(cls, config: Any, dtype: Any) -> KVGeometry:
        text = config.get_text_config(decoder=True)
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(int(text.num_hidden_layers), int(kv_heads), int(head_dim), dtype)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def chunk_shape(self, chunk_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, chunk_tokens, self.head_dim)

    def chunk_bytes(self, chunk_tokens: int) -> int:
        itemsize = int(torch.empty((), dtype=self.dtype).element_size())
        return 2 * self.layers * self.kv_heads * chunk_tokens * self.head_dim * itemsize


class HFKVStore:
    """Stores and loads a causal LM's past key values in PolarKV (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        *,
        model_id: str,
        dtype: Any,
        manager_url: str | None = None,
        extra: Mapping[str, Any] | None = None,
        chunk_tokens: int | None = None,
        device: Any = "cpu",
    ) -> None:
        """`extra` holds the settings of integrations.common (manager_url, token, timeout,
        transport, namespace, chunk_tokens...); `manager_url` and `chunk_tokens` override it.
        Loaded caches are built on `device` (the model's)."""
        if not model_id:
            raise ValueError("model_id must name the weights (e.g. 'org/model@revision')")
        merged = dict(extra or {})
        if manager_url is not None:
            merged["manager_url"] = manager_url
        if chunk_tokens is not None:
            merged["chunk_tokens"] = chunk_tokens
        self.settings = settings_from_extra(merged)
        self.config = config
        self.device = torch.device(device)
        self.chunk_tokens = self.settings.chunk_tokens or DEFAULT_CHUNK_TOKENS
        self.geometry = geo = KVGeometry.from_config(config, dtype)
        probe = DynamicCache(config=config)
        if len(probe.layers) != geo.layers or any(
            type(la) is not DynamicLayer for la in probe.layers
        ):
            raise ValueError(
                "HFKVStore supports full-attention DynamicCache layers only "
                f"(this config gives {sorted({type(la).__name__ for la in probe.layers})})"
            )
        self.namespace = namespace(
            self.settings,
            "hf",
            f"model={model_id}",
            geo.dtype_name,
            f"layers={geo.layers}-kvh={geo.kv_heads}-hd={geo.head_dim}",
            f"chunk={self.chunk_tokens}",
            f"layout={LAYOUT}",
        )
        self.client: PolarKVClient = make_client(self.settings, self.namespace, self.chunk_tokens)

    @classmethod
    def for_model(cls, model: Any, *, model_id: str, **kwargs: Any) -> HFKVStore:
        kwargs.setdefault("device", model.device)
        return cls(model.config, model_id=model_id, dtype=model.dtype, **kwargs)

    # -- chunks <-> cache -----------------------------------------------------------------

    def pack(self, cache: Any, n_chunks: int) -> Any:
        """The first n_chunks chunks of `cache` as one tensor [n, layers, 2, kv_heads, T,
        head_dim]; row i is chunk i's bytes."""
        geo, t = self.geometry, self.chunk_tokens
        layers = cache.layers
        if len(layers) != geo.layers:
            raise ValueError(f"the cache has {len(layers)} layers, the model {geo.layers}")
        out = torch.empty((n_chunks, *geo.chunk_shape(t)), dtype=geo.dtype)
        for i, layer in enumerate(layers):
            for kv, states in enumerate((layer.keys, layer.values)):
                expect = (1, geo.kv_heads, states.shape[2], geo.head_dim)
                if tuple(states.shape) != expect or states.dtype != geo.dtype:
                    raise ValueError(
                        f"layer {i}: cache states {tuple(states.shape)} {states.dtype}, "
                        f"expected {expect} {geo.dtype} (batch size 1)"
                    )
                # [1, H, n*T, D] -> [n, H, T, D]
                run = states[0, :, : n_chunks * t].reshape(geo.kv_heads, n_chunks, t, geo.head_dim)
                out[:, i, kv].copy_(run.transpose(0, 1))
        return out

    def unpack(self, chunks: Any, n_chunks: int) -> Any:
        """A DynamicCache holding the first n_chunks rows of `chunks` (see pack)."""
        cache = DynamicCache(config=self.config)
        for i in range(self.geometry.layers):
            keys = torch.cat(list(chunks[:n_chunks, i, 0]), dim=1).unsqueeze(0)
            values = torch.cat(list(chunks[:n_chunks, i, 1]), dim=1).unsqueeze(0)
            cache.update(keys.to(self.device), values.to(self.device), i)
        return cache

    # -- PolarKV ----------------------------------------------------------------------------

    def store(self, tokens: Any, cache: Any) -> int:
        """Store the full chunks of `tokens` whose KV `cache` holds (it may hold more
        tokens, e.g. a generated continuation). Returns how many tokens are now stored;
        chunks already in PolarKV are not written again."""
        ids = _token_ids(tokens)
        n_chunks = min(len(ids), cache.get_seq_length()) // self.chunk_tokens
        if n_chunks == 0:
            return 0
        packed = self.pack(cache, n_chunks)
        chunks = [_bytes_of(packed[c]) for c in range(n_chunks)]
        return self.client.store_kv(ids[: n_chunks * self.chunk_tokens], chunks) * self.chunk_tokens

    def load(self, tokens: Any) -> tuple[int, Any]:
        """The KV of the longest stored prefix of `tokens` as (n_tokens, DynamicCache), or
        (0, None). Pass all but the last prompt token so at least one is left to compute."""
        ids = _token_ids(tokens)
        n_full = len(ids) // self.chunk_tokens
        if n_full == 0:
            return 0, None
        buf = torch.empty(
            (n_full, *self.geometry.chunk_shape(self.chunk_tokens)), dtype=self.geometry.dtype
        )
        out = [_bytes_of(buf[c]) for c in range(n_full)]  # chunks land in place
        try:
            _, views = self.client.load_kv(ids, out=out)
        except CallerError as exc:  # a stored chunk larger than this geometry's: not ours
            log.warning("PolarKV chunk of %s does not fit: %s; a miss", self.namespace, exc)
            return 0, None
        size = self.geometry.chunk_bytes(self.chunk_tokens)
        n = next((i for i, v in enumerate(views) if len(v) != size), len(views))
        if n < len(views):
            log.warning(
                "a PolarKV chunk of %s has %d bytes, expected %d: a miss from there on",
                self.namespace,
                len(views[n]),
                size,
            )
        return (n * self.chunk_tokens, self.unpack(buf, n)) if n else (0, None)

    def lookup(self, tokens: Any) -> int:
        """How many leading tokens of `tokens` are stored (no transfer)."""
        return self.client.lookup_kv(_token_ids(tokens))

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> HFKVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _token_ids(tokens: Any) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() == 2:
            if tokens.shape[0] != 1:
                raise ValueError("batch size 1 only")
            tokens = tokens[0]
        return [int(t) for t in tokens.tolist()]
    return [int(t) for t in tokens]


def _bytes_of(tensor: Any) -> memoryview:
    return memoryview(tensor.view(torch.uint8).reshape(-1).numpy())


# -- prefill with a PolarKV prefix -----------------------------------------------------------


@dataclass
class Prefill:
    logits: Any  # [1, vocab]: the next-token logits of the prompt
    cache: Any  # the DynamicCache after the prompt
    loaded_tokens: int  # prompt tokens whose KV came from PolarKV
    seconds: float  # wall time to the logits (load + prefill): the TTFT
    load_seconds: float  # of which loading from PolarKV (lookup, transfer, building the cache)


def prefill(model: Any, input_ids: Any, store: HFKVStore | None = None) -> Prefill:
    """Run the prompt `input_ids` ([1, n]) through `model`: load its longest stored
    prefix from `store` (if any) and compute only the rest. Stores nothing."""
    start = time.perf_counter()
    with torch.inference_mode():
        loaded, cache = (0, None)
        if store is not None:
            loaded, cache = store.load(input_ids[0, :-1])
        loaded_at = time.perf_counter()
        if cache is None:
            cache = DynamicCache(config=model.config)
        out = model(
            input_ids=input_ids[:, loaded:], past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        logits = out.logits[:, -1].float()
    end = time.perf_counter()
    return Prefill(logits, out.past_key_values, loaded, end - start, loaded_at - start)


def greedy(model: Any, first: Prefill, steps: int) -> list[int]:
    """Greedy continuation of `steps` tokens after a prefill (extends its cache)."""
    tokens = [int(first.logits.argmax(-1))]
    cache = first.cache
    with torch.inference_mode():
        for _ in range(steps - 1):
            ids = torch.tensor([[tokens[-1]]], dtype=torch.long)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            tokens.append(int(out.logits[:, -1].argmax(-1)))
    return tokens
