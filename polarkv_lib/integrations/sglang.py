"""SGLang HiCache storage backend (DESIGN §9): `PolarKVStorage`, a `HiCacheStorage`.

Loaded by SGLang's dynamic backend factory, constructed as `Cls(storage_config, kwargs)`:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "polarkv",
        "module_path": "polarkv_lib.integrations.sglang", "class_name": "PolarKVStorage",
        "manager_url": "http://10.0.0.5:8170", "interface_v1": 1}'

Settings are those of `integrations.common` (`manager_url` required; `token`, `transport`,
`timeout`, `namespace`, `connections`), plus `model` (overrides the model name SGLang
passes) and `interface_v1` (truthy: SGLang calls the zero-copy batch_get_v1/batch_set_v1).

How pages become keys and objects, and which faults are misses: docs/ARCHITECTURE.md
("Engine adapters").
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

from polarkv_lib.client import PolarKVClient
from polarkv_lib.integrations.common import (
    call_or_miss,
    fault_is_miss,
    make_client,
    namespace,
    settings_from_extra,
)

log = logging.getLogger("polarkv.sglang")

T = TypeVar("T")
CALL_BYTES = 64 * 1024**2  # most bytes one client call moves; each call has its own deadline
_PERSON = b"polarkv-sglang"


class KeyedIO:
    """Batches of SGLang's page keys over a PolarKVClient's keyed batch calls: one
    control round trip per window of keys, transfers straight from and into the given
    buffers, every fault a miss. Calls are cut at CALL_BYTES so each has its own
    deadline."""

    def __init__(self, client: PolarKVClient) -> None:
        self.client = client

    def _call(self, what: str, call: Callable[[], T], miss: T) -> T:
        return call_or_miss(log, what, call, miss)

    def count(self, keys: list[str]) -> int:
        """How many leading keys are stored (no lease, no transfer)."""
        return self._call("lookup", lambda: self.client.lookup_keys(keys), 0) if keys else 0

    def write(self, keys: list[str], views: list[memoryview]) -> int:
        """Store views[i] under keys[i]; how many are now stored (written or present)."""
        stored = 0
        for part in _by_bytes([len(v) for v in views]):
            done = self._call(
                "store",
                lambda part=part: self.client.put_many(  # type: ignore[misc]
                    [keys[i] for i in part], [views[i] for i in part]
                ),
                0,
            )
            stored += done
            if done < len(part):  # a fault: what follows would not count as a prefix anyway
                break
        return stored

    def read(self, keys: list[str], targets: list[memoryview]) -> int:
        """Read the leading stored keys into targets (each exactly the object's size);
        return how many were read whole."""
        done = 0
        miss: list[memoryview] = []
        for part in _by_bytes([len(t) for t in targets]):
            views = self._call(
                "load",
                lambda part=part: self.client.get_many(  # type: ignore[misc]
                    [keys[i] for i in part], [targets[i] for i in part]
                ),
                miss,
            )
            for i, view in zip(part, views, strict=False):
                if len(view) != len(targets[i]):
                    log.warning(
                        "PolarKV object %s holds %d bytes, the page needs %d: a miss",
                        keys[i],
                        len(view),
                        len(targets[i]),
                    )
                    return done
                done += 1
            if len(views) < len(part):
                break
        return done

    def read_any(self, keys: list[str]) -> list[bytes]:
        """The leading stored keys' values, whatever their size."""
        miss: list[memoryview] = []
        return [bytes(v) for v in self._call("load", lambda: self.client.get_many(keys), miss)]


def _no_pages(_self: object, keys: list[str], *_: object, **__: object) -> list[bool]:
    return [False] * len(keys)


def _by_bytes(sizes: list[int]) -> list[range]:
    """Split indices into consecutive runs of at most CALL_BYTES (at least one each)."""
    runs: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > CALL_BYTES:
            runs.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


def _describe_sizes(sizes: list[int]) -> str:
    return f"{len(sizes)}x{sizes[0]}" if len(set(sizes)) == 1 else "+".join(map(str, sizes))


def _tensor_bytes(tensor: Any) -> memoryview:
    """The bytes of a tensor (a CPU copy only if it is elsewhere or strided)."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def _host_view(ptr: int, size: int) -> memoryview:
    """A writable view of `size` bytes of host memory at `ptr` (a host-pool page buffer)."""
    if not isinstance(ptr, int) or not isinstance(size, int) or ptr <= 0 or size <= 0:
        raise ValueError(f"bad page buffer ({ptr!r}, {size!r})")
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


def shard_parts(storage_config: Any, extra: dict[str, Any]) -> list[str]:
    """The parts of the namespace that storage_config decides (DESIGN §9)."""
    model = extra.get("model") or storage_config.model_name
    if not model:
        raise ValueError("PolarKV: SGLang passed no model name; set 'model' in the extra config")
    parts = [f"model={model}"]
    if storage_config.is_mla_model:
        parts.append("tp=replicated")  # MLA KV is the same on every TP rank: one shared copy
    else:
        parts.append(f"tp={storage_config.tp_rank}of{storage_config.tp_size}")
    parts.append(f"pp={storage_config.pp_rank}of{storage_config.pp_size}")
    parts.append(f"cp={storage_config.attn_cp_rank}of{storage_config.attn_cp_size}")
    dcp_size = getattr(storage_config, "dcp_size", 1)
    if dcp_size > 1:
        parts.append(
            f"dcp={storage_config.dcp_rank}of{dcp_size}-page{storage_config.logical_page_size}"
        )
    return parts


class PolarKVStorage(HiCacheStorage):  # type: ignore[misc]
    """PolarKV as SGLang's L3 (storage) tier; see the module docstring for the contract."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.settings = settings_from_extra(extra)
        self.interface_v1 = bool(extra.get("interface_v1", False))
        self._base = namespace(self.settings, "sglang", *shard_parts(storage_config, extra))
        self.mem_pool_host: Any = None
        self._usable = True  # False: a host pool we could not describe; every call misses
        self._page_objects = 1  # v1: objects per page (the page's host buffers)
        self._page_tokens = 0  # v1: host slots per page
        self._set_namespaces("pool=none", "pool=none")
        # chunk_tokens is unused here: pages are keyed by SGLang's own page hashes.
        self._client = make_client(self.settings, self._base, self.settings.chunk_tokens or 1)
        self._io = KeyedIO(self._client)

    # -- namespace and keys -------------------------------------------------------------

    def _set_namespaces(self, flat_pool: str, v1_pool: str) -> None:
        self.flat_namespace = f"{self._base}/io=flat/{flat_pool}"
        self.v1_namespace = f"{self._base}/io=v1/{v1_pool}"
        self.namespace = self.v1_namespace if self.interface_v1 else self.flat_namespace
        self._flat_secret = blake2b(
            self.flat_namespace.encode(), digest_size=32, person=_PERSON
        ).digest()
        self._v1_secret = blake2b(
            self.v1_namespace.encode(), digest_size=32, person=_PERSON
        ).digest()

    def flat_keys(self, page_hashes: Sequence[str]) -> list[str]:
        """The keys of the generic interface's objects: one per page."""
        return [
            blake2b(h.encode(), digest_size=16, key=self._flat_secret, person=_PERSON).hexdigest()
            for h in page_hashes
        ]

    def v1_keys(self, page_hashes: Sequence[str]) -> list[str]:
        """The keys of the v1 interface's objects: `_page_objects` per page, page by page."""
        keys = []
        for page_hash in page_hashes:
            for j in range(self._page_objects):
                h = blake2b(page_hash.encode(), digest_size=16, key=self._v1_secret, person=_PERSON)
                h.update(b"\x00" + j.to_bytes(4, "little"))
                keys.append(h.hexdigest())
        return keys

    def page_keys(self, page_hashes: Sequence[str]) -> list[str]:
        """The keys exists/batch_exists look at: those of the interface SGLang uses."""
        return self.v1_keys(page_hashes) if self.interface_v1 else self.flat_keys(page_hashes)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool fixes the page's byte format: it completes the namespaces."""
        super().register_mem_pool_host(mem_pool_host)
        try:
            page = mem_pool_host.get_dummy_flat_data_page()
            dtype = str(page.dtype).removeprefix("torch.")
            pool = (
                f"pool={type(mem_pool_host).__name__}-{getattr(mem_pool_host, 'layout', 'none')}"
                f"-page{int(mem_pool_host.page_size)}-{dtype}x{page.numel()}"
            )
            objects, page_tokens, v1_pool = 1, 0, pool
            if self.interface_v1:
                page_tokens = int(
                    self.storage_config.logical_page_size
                    if self.storage_config.dcp_size > 1
                    else mem_pool_host.page_size
                )
                ptrs, sizes = mem_pool_host.get_page_buffer_meta(
                    torch.arange(page_tokens, dtype=torch.int64)
                )
                objects = len(ptrs)
                v1_pool += f"-buffers={_describe_sizes([int(s) for s in sizes])}"
        except Exception as exc:  # a pool we cannot describe: no storage I/O, never a crash
            log.error(
                "PolarKV cannot describe SGLang host pool %s (%r): every lookup misses",
                type(mem_pool_host).__name__,
                exc,
            )
            self._usable = False
            return
        self._page_objects, self._page_tokens = objects, page_tokens
        self._set_namespaces(pool, v1_pool)
        log.info("PolarKV SGLang storage: namespace %s", self.namespace)

    # -- existence ----------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @fault_is_miss(log, lambda *_, **__: 0)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The number of leading pages stored whole."""
        if not keys or not self._usable:
            return 0
        per_page = self._page_objects if self.interface_v1 else 1
        return self._io.count(self.page_keys(keys)) // per_page

    # -- generic interface: one flat page tensor per key ---------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]

    @fault_is_miss(log, lambda _self, keys, *_, **__: [None] * len(keys))
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Tensors for the leading stored pages, None from the first miss on. Each lands
        in its target tensor (in place when that is contiguous CPU memory), or in a fresh
        flat page of the host pool, or, with neither, in a uint8 tensor."""
        misses: list[Any] = [None] * len(keys)
        if not keys or not self._usable:
            return misses
        pkeys = self.flat_keys(keys)
        if target_locations is None and self.mem_pool_host is not None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        if target_locations is None:
            values = self._io.read_any(pkeys)
            return [torch.frombuffer(bytearray(v), dtype=torch.uint8) for v in values] + misses[
                len(values) :
            ]
        targets = list(target_locations)
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys, {len(targets)} target locations")
        buffers: list[memoryview] = []
        staged: list[bool] = []
        for t in targets:
            direct = t.device.type == "cpu" and t.is_contiguous()
            staged.append(not direct)
            buffers.append(
                memoryview(t.view(torch.uint8).reshape(-1).numpy())
                if direct
                else memoryview(bytearray(t.numel() * t.element_size()))
            )
        n = self._io.read(pkeys, buffers)
        out: list[Any] = []
        for t, buf, copy in zip(targets[:n], buffers[:n], staged[:n], strict=True):
            if copy:  # not CPU-contiguous: read aside, then one copy into place
                t.copy_(torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).reshape(t.shape))
            out.append(t)
        return out + misses[n:]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value] if value is not None else None)

    @fault_is_miss(log, lambda *_, **__: False)
    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store each page tensor's bytes; True only if every page is now stored."""
        if not keys or values is None or not self._usable:
            return False
        values = list(values)
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys, {len(values)} values")
        views = [_tensor_bytes(v) for v in values]
        return self._io.write(self.flat_keys(keys), views) == len(keys)

    # -- zero-copy interface: the host pool's own page buffers ---------------------------

    def _page_buffers(self, keys: list[str], host_indices: Any) -> list[memoryview]:
        pool = self.mem_pool_host
        if pool is None or not self.interface_v1 or not self._usable:
            raise ValueError("no host pool registered for the v1 interface")
        if host_indices.numel() != len(keys) * self._page_tokens:
            raise ValueError(
                f"{host_indices.numel()} host slots for {len(keys)} pages of {self._page_tokens}"
            )
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(sizes) or len(ptrs) != len(keys) * self._page_objects:
            raise ValueError(
                f"{len(ptrs)} page buffers for {len(keys)} pages of {self._page_objects}"
            )
        return [_host_view(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]

    @fault_is_miss(log, _no_pages)
    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Read pages straight into their host-pool buffers; True for the leading pages
        read whole."""
        buffers = self._page_buffers(keys, host_indices) if keys else []
        pages = self._io.read(self.v1_keys(keys), buffers) // self._page_objects if keys else 0
        return [i < pages for i in range(len(keys))]

    @fault_is_miss(log, _no_pages)
    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Write pages straight from their host-pool buffers. Pages already stored are not
        written again. True for each page known stored whole."""
        if not keys:
            return []
        pkeys = self.v1_keys(keys)
        stored = self._io.write(pkeys, self._page_buffers(keys, host_indices))
        if stored == len(pkeys):
            return [True] * len(keys)
        pages = self._io.count(pkeys) // self._page_objects  # which pages made it
        return [i < pages for i in range(len(keys))]

    # -- v2 (hybrid models' side pools: Mamba, SWA, DSA...): not supported, always a miss ---

    def _v2_unsupported(self) -> None:
        if not getattr(self, "_v2_warned", False):
            self._v2_warned = True
            log.warning(
                "PolarKV does not store SGLang's hybrid side pools (the v2 interface): "
                "those requests are served without the storage tier"
            )

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        self._v2_unsupported()
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        self._v2_unsupported()
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        self._v2_unsupported()
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    # -- lifecycle -----------------------------------------------------------------------

    def clear(self) -> bool:
        """PolarKV is shared: one engine does not wipe it. Entries age out by its LRU."""
        log.info("PolarKV storage clear() ignored: the cache is shared")
        return False

    def get_stats(self) -> None:
        return None

    @fault_is_miss(log, lambda *_, **__: None)
    def close(self) -> None:
        self._client.close()
