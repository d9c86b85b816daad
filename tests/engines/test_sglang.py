"""PolarKVStorage inside SGLang 0.5.23: built by SGLang's own dynamic backend factory and
driven against a running PolarKV, with page keys from SGLang's own page hashing.

SGLang's real host KV pools cannot be imported on this machine (sglang.srt.mem_cache
.pool_host pulls in torchvision, whose PyPI build is CUDA-only), so the zero-copy v1
path runs against `HostPool` below: a small MHA host pool with the same page-buffer
methods SGLang's host pools expose (get_data_page, get_dummy_flat_data_page,
set_from_flat_data_page, get_page_buffer_meta), for the page-first and layer-first
layouts, written here from the shapes SGLang documents.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from polarkv_lib.integrations import sglang as sglang_integration
from polarkv_lib.integrations.sglang import PolarKVStorage
from tests.conftest import http

PAGE = 4  # tokens per page


class HostPool:
    """An MHA host KV pool: kv_buffer holds K and V for `size` token slots.

    page_first: kv_buffer[2, size, layers, heads, dim]; a flat page is [2, page, layers,
    heads, dim]. layer_first: kv_buffer[2, layers, size, heads, dim]; a flat page is
    [2, layers, page, heads, dim]. get_page_buffer_meta names the contiguous runs of
    each page's bytes: K then V for page_first, K and V of every layer for layer_first.
    """

    def __init__(
        self,
        layout: str,
        size: int = 64,
        layers: int = 3,
        heads: int = 2,
        dim: int = 8,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.layout, self.size, self.page_size = layout, size, PAGE
        self.layer_num, self.head_num, self.head_dim, self.dtype = layers, heads, dim, dtype
        shape = (
            (2, size, layers, heads, dim)
            if layout == "page_first"
            else (2, layers, size, heads, dim)
        )
        self.kv_buffer = torch.zeros(shape, dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + self.page_size]
        return self.kv_buffer[:, :, index : index + self.page_size]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(int(index))
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            2 * self.layer_num * self.page_size * self.head_num * self.head_dim, dtype=self.dtype
        )

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(int(index))
        page.copy_(data_page.reshape(page.shape))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        ptrs, sizes = [], []
        for first in indices.tolist()[:: self.page_size]:
            if self.layout == "page_first":
                runs = [self.kv_buffer[kv, first : first + self.page_size] for kv in (0, 1)]
            else:
                runs = [
                    self.kv_buffer[kv, layer, first : first + self.page_size]
                    for layer in range(self.layer_num)
                    for kv in (0, 1)
                ]
            for run in runs:
                assert run.is_contiguous()
                ptrs.append(run.data_ptr())
                sizes.append(run.numel() * run.element_size())
        return ptrs, sizes

    def slots(self, pages: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def storage_config(
    url: str,
    model: str = "org/model-a",
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    **extra: Any,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config={
            "backend_name": "polarkv",
            "module_path": "polarkv_lib.integrations.sglang",
            "class_name": "PolarKVStorage",
            "manager_url": url,
            "timeout": 5.0,
            **extra,
        },
    )


def build(config: HiCacheStorageConfig, pool: HostPool | None = None) -> PolarKVStorage:
    """As SGLang's cache controller does: the factory, then register_mem_pool_host."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(backend, PolarKVStorage)
    if pool is not None:
        backend.register_mem_pool_host(pool)
    return backend


def page_hashes(n: int, seed: int = 0) -> list[str]:
    """SGLang's own page keys for n pages of tokens."""
    hashes = get_hash_str(list(range(seed, seed + n * PAGE)), page_size=PAGE)
    assert isinstance(hashes, list) and len(hashes) == n
    return hashes


def random_pages(pool: HostPool, n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    numel = pool.get_dummy_flat_data_page().numel()
    return [torch.randn(numel, generator=gen).to(pool.dtype) for _ in range(n)]


@pytest.fixture
def url(cluster: Any) -> str:
    return str(cluster.embedded().manager_url)


def test_factory_builds_backend_and_pages_round_trip(url: str) -> None:
    pool = HostPool("page_first")
    storage = build(storage_config(url), pool)
    try:
        assert "model=org/model-a" in storage.namespace and "tp=0of1" in storage.namespace
        keys = page_hashes(5)
        pages = random_pages(pool, 5, seed=1)
        assert not storage.exists(keys[0])
        assert storage.batch_exists(keys) == 0
        assert storage.get(keys[0]) is None

        assert storage.set(keys[0], pages[0])
        assert storage.exists(keys[0])
        assert storage.batch_set(keys[1:3], pages[1:3])
        assert storage.batch_exists(keys) == 3  # the leading run only
        assert storage.batch_exists(keys[3:]) == 0
        assert storage.set(keys[4], pages[4])
        assert storage.batch_exists(keys) == 3  # page 3 is missing: 4 does not count

        got = storage.get(keys[1], pool.get_dummy_flat_data_page())
        assert got is not None and torch.equal(got, pages[1])
        targets = [pool.get_dummy_flat_data_page() for _ in keys]
        results = storage.batch_get(keys, targets)
        assert [r is not None for r in results] == [True, True, True, False, False]
        for i in range(3):
            assert results[i] is targets[i] and torch.equal(targets[i], pages[i])
        # No target: a fresh flat page of the registered pool.
        (fresh,) = storage.batch_get(keys[2:3])
        assert fresh.dtype == pool.dtype and torch.equal(fresh, pages[2])
        # A target SGLang cannot read into directly (strided) is filled all the same.
        strided = torch.zeros(pages[0].numel() * 2, dtype=pool.dtype)[::2]
        assert storage.get(keys[0], strided) is strided and torch.equal(strided, pages[0])
        # The flat page goes straight into the host pool as SGLang's generic path does.
        pool.set_from_flat_data_page(8, results[0])
        assert torch.equal(pool.get_data_page(8), pages[0])
        # Writing a stored page again is not an error.
        assert storage.set(keys[0], pages[0])
        # Hybrid models' side pools (the v2 interface) are not stored: misses, no errors.
        assert storage.batch_exists_v2(keys).kv_hit_pages == 0
        mamba = PoolTransfer(name=PoolName.MAMBA, host_indices=pool.slots([0]), keys=keys[:1])
        assert storage.batch_set_v2([mamba]) == {PoolName.MAMBA: [False]}
        assert storage.batch_get_v2([mamba]) == {PoolName.MAMBA: [False]}
    finally:
        storage.close()


def test_ranks_and_models_never_see_each_others_pages(url: str) -> None:
    pool = HostPool("page_first")
    keys = page_hashes(3)
    shards = {
        ("a", 0): build(storage_config(url, tp_rank=0, tp_size=2), pool),
        ("a", 1): build(storage_config(url, tp_rank=1, tp_size=2), pool),
        ("b", 0): build(storage_config(url, model="org/model-b", tp_rank=0, tp_size=2), pool),
        ("b", 1): build(storage_config(url, model="org/model-b", tp_rank=1, tp_size=2), pool),
    }
    try:
        assert len({s.page_keys(keys[:1])[0] for s in shards.values()}) == 4
        data = {name: random_pages(pool, 3, seed=10 + i) for i, name in enumerate(shards)}
        assert shards["a", 0].batch_set(keys, data["a", 0])
        for name, storage in shards.items():
            assert storage.batch_exists(keys) == (3 if name == ("a", 0) else 0)
            assert (storage.get(keys[0]) is not None) == (name == ("a", 0))
        for name, storage in shards.items():
            assert storage.batch_set(keys, data[name])
        for name, storage in shards.items():
            got = storage.batch_get(keys)
            assert all(torch.equal(g, d) for g, d in zip(got, data[name], strict=True)), name
        # MLA KV is the same on every TP rank: the ranks share one copy.
        mla = [
            build(storage_config(url, model="org/mla", tp_rank=r, tp_size=2, mla=True), pool)
            for r in (0, 1)
        ]
        try:
            assert mla[0].set(keys[0], data["a", 0][0])
            assert mla[1].exists(keys[0])
            assert mla[0].page_keys(keys) == mla[1].page_keys(keys)
        finally:
            for s in mla:
                s.close()
    finally:
        for storage in shards.values():
            storage.close()


@pytest.mark.parametrize(
    ("layout", "call_bytes"), [("page_first", 64 * 1024**2), ("layer_first", 1000)]
)
def test_zero_copy_v1_reads_and_writes_the_host_pool(
    url: str, layout: str, call_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sglang_integration, "CALL_BYTES", call_bytes)  # 1000: many small calls
    writer_pool, reader_pool = HostPool(layout), HostPool(layout)
    writer = build(storage_config(url, interface_v1=1), writer_pool)
    reader = build(storage_config(url, interface_v1=1), reader_pool)
    flat = build(storage_config(url), HostPool(layout))
    try:
        assert "io=v1" in writer.namespace and layout in writer.namespace
        keys = page_hashes(4, seed=100)
        pages = random_pages(writer_pool, 4, seed=2)
        src = [3, 7, 1, 5]  # scattered host pages, as a radix tree hands them out
        for page, slot in zip(pages, src, strict=True):
            writer_pool.set_from_flat_data_page(slot * PAGE, page)

        assert writer.batch_set_v1(keys[:3], writer_pool.slots(src[:3])) == [True] * 3
        assert reader.batch_exists(keys) == 3
        assert flat.batch_exists(keys) == 0  # the generic interface keeps its own objects...
        assert reader.get(keys[0]) is None  # ...in every instance
        dst = [12, 0, 9, 4]
        got = reader.batch_get_v1(keys, reader_pool.slots(dst))
        assert got == [True, True, True, False]
        for i in range(3):
            assert torch.equal(reader_pool.get_data_page(dst[i] * PAGE), pages[i])
        assert not reader_pool.get_data_page(dst[3] * PAGE).any()  # the miss left it alone

        # Stored pages are skipped, new ones written; all reported stored.
        assert writer.batch_set_v1(keys, writer_pool.slots(src)) == [True] * 4
        assert reader.batch_get_v1(keys[3:], reader_pool.slots(dst[3:])) == [True]
        assert torch.equal(reader_pool.get_data_page(dst[3] * PAGE), pages[3])
        # A page with one of its objects gone counts as missing.
        lost = writer.page_keys(keys[1:2])[-1]
        assert http("DELETE", f"{url}/v1/keys/{lost}")[0] == 200
        assert reader.batch_exists(keys) == 1
        assert reader.batch_get_v1(keys, reader_pool.slots(dst)) == [True, False, False, False]
        # Slots that do not cover the pages are a failed call, not an exception.
        assert reader.batch_get_v1(keys, reader_pool.slots(dst[:2])) == [False] * 4
    finally:
        for s in (writer, reader, flat):
            s.close()


def test_polarkv_down_is_a_miss_never_an_exception(cluster: Any, caplog: Any) -> None:
    caplog.set_level(logging.CRITICAL, logger="polarkv")
    pool = HostPool("page_first")
    keys = page_hashes(2)
    pages = random_pages(pool, 2, seed=3)
    slots = pool.slots([0, 1])

    def all_miss(storage: PolarKVStorage) -> None:
        start = time.monotonic()
        assert storage.exists(keys[0]) is False
        assert storage.batch_exists(keys) == 0
        assert storage.get(keys[0], pool.get_dummy_flat_data_page()) is None
        assert storage.batch_get(keys) == [None, None]
        assert storage.set(keys[0], pages[0]) is False
        assert storage.batch_set(keys, pages) is False
        assert time.monotonic() - start < 10  # bounded by the client's timeout

    # Nothing listens at the manager URL.
    down = build(storage_config("http://127.0.0.1:9", timeout=0.5), pool)
    v1 = build(storage_config("http://127.0.0.1:9", timeout=0.5, interface_v1=True), pool)
    try:
        all_miss(down)
        assert v1.batch_set_v1(keys, slots) == [False, False]
        assert v1.batch_get_v1(keys, slots) == [False, False]
        assert v1.batch_exists(keys) == 0
    finally:
        down.close()
        v1.close()

    # PolarKV stops under a running engine.
    proc = cluster.embedded()
    storage = build(storage_config(proc.manager_url, timeout=0.5), pool)
    try:
        assert storage.batch_set(keys, pages) and storage.batch_exists(keys) == 2
        proc.kill()
        all_miss(storage)
    finally:
        storage.close()
    # A closed backend misses too.
    assert storage.batch_exists(keys) == 0 and storage.get(keys[0]) is None
