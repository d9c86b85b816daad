"""Worker-side pieces of the vLLM connector: the uint8 page view of a layer's paged KV
cache in the chunk format ("pages-v1", docs/ENGINES.md), and the background thread that
stores gathered chunks so that saves never wait on the network in the engine's step."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from polarkv_lib.client import PolarKVClient

if TYPE_CHECKING:
    from polarkv_lib.integrations.vllm import ConnectorStats, SaveOp

log = logging.getLogger("polarkv.integrations.vllm")

MAX_PENDING_SAVE_BYTES = 1 << 30


@dataclass(frozen=True)
class PageGeometry:
    """The page geometry of the group's layers, from vLLM's KV cache spec."""

    block_size: int
    num_heads: int
    content_bytes: int  # C of the logical [blocks, H, N, C] view, in bytes
    layers: tuple[str, ...]

    @property
    def page_bytes(self) -> int:
        return self.num_heads * self.block_size * self.content_bytes


def page_view(cache: Any, geometry: PageGeometry) -> Any:
    """A view of one layer's cache, [manager blocks, ...], whose trailing dims, read in C
    order, are the page bytes of the chunk format, as the widest integer the layout allows
    (copies move words, not bytes: a strided uint8 copy is ~4x slower on the CPU). Raises
    ValueError if the layout is unknown."""
    bs, heads, content = geometry.block_size, geometry.num_heads, geometry.content_bytes
    shape = tuple(cache.shape)
    if cache.dim() == 3:  # [blocks, N, C] (MLA before 0.33): one head slot
        cache, shape = cache.unsqueeze(1), (shape[0], 1, *shape[1:])
    if cache.stride(-1) != 1:
        raise ValueError(f"PolarKV: KV cache with a strided last dim {tuple(cache.stride())}")
    u8 = cache.view(torch.uint8)
    if cache.dim() == 4:  # [blocks * r, H, bs / r, C]: the 0.33 logical view
        blocks, h, n, c = u8.shape
        if h == heads and c == content and n and bs % n == 0 and blocks % (bs // n) == 0:
            ratio = bs // n
            return _widest(u8.unflatten(0, (blocks // ratio, ratio)).permute(0, 2, 1, 3, 4))
    elif cache.dim() == 5:  # K/V stacked: [2, blocks, bs, H, D] or [blocks, 2, bs, H, D]
        for kv_dim, order in ((0, (1, 3, 2, 0, 4)), (1, (0, 3, 2, 1, 4))):
            if (
                u8.shape[kv_dim] == 2
                and u8.shape[2:4] == (bs, heads)
                and 2 * u8.shape[4] == content
            ):
                return _widest(u8.permute(*order))
    raise ValueError(
        f"PolarKV: unsupported KV cache shape {shape} (dtype {cache.dtype}) for "
        f"block size {bs}, {heads} KV heads and {content}-byte cells"
    )


def _widest(u8: Any) -> Any:
    """`u8` (innermost dim contiguous) as the widest of int64/int32/int16 whose size
    divides its innermost dim, its other strides and its offset; else unchanged."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        k = dtype.itemsize
        if (
            u8.shape[-1] % k == 0
            and u8.storage_offset() % k == 0
            and all(stride % k == 0 for stride in u8.stride()[:-1])
        ):
            with contextlib.suppress(RuntimeError):
                return u8.view(dtype)
    return u8


class Saver:
    """One background thread that stores gathered chunks, so saves never wait on the
    network in the engine's step. Bounded in pending bytes: beyond the bound a save is
    dropped (the caller counts it)."""

    def __init__(
        self,
        client: PolarKVClient,
        stats: ConnectorStats,
        max_pending_bytes: int = MAX_PENDING_SAVE_BYTES,
    ) -> None:
        self._client = client
        self._stats = stats
        self._max = max_pending_bytes
        self._queue: deque[tuple[SaveOp, Any, Any]] = deque()
        self._pending_bytes = 0
        self._busy = False
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="polarkv-vllm-saver", daemon=True)
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        return self._thread.native_id

    def submit(self, op: SaveOp, host: Any, ready: Any) -> bool:
        """host: uint8 [chunks, chunk bytes] on the CPU; ready: None or an event to wait
        on before reading it (a device-to-host copy in flight)."""
        size = int(host.numel())
        with self._cond:
            if self._closing or (self._pending_bytes and self._pending_bytes + size > self._max):
                return False
            self._queue.append((op, host, ready))
            self._pending_bytes += size
            self._cond.notify_all()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted save is done; False if `timeout` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if self._closing:
                    return
                op, host, ready = self._queue.popleft()
                self._busy = True
            try:
                self._store(op, host, ready)
            except Exception as exc:  # never let a save take the thread down
                self._stats.failed_saves += 1
                log.warning("PolarKV save of request %s failed: %r", op.req_id, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._pending_bytes -= int(host.numel())
                    self._cond.notify_all()

    def _store(self, op: SaveOp, host: Any, ready: Any) -> None:
        if ready is not None:
            ready.synchronize()
        data = host.numpy()
        chunks = [memoryview(data[i]) for i in range(data.shape[0])]
        if op.first_chunk == 0:
            stored = self._client.store_kv(op.tokens, chunks)
        else:
            # the chunks after the first saved one: one batched store, as store_kv does
            keys = self._client.keys(op.tokens)[op.first_chunk :]
            stored = self._client.put_many(keys, chunks)
        self._stats.saved_chunks += stored
        if stored < len(chunks):
            self._stats.failed_saves += 1
