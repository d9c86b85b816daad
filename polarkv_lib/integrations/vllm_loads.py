"""Worker-side loads of the vLLM connector: one request's chunks from PolarKV into a host
buffer, scattered into vLLM's KV pages; run inline (synchronous mode) or on a small
thread pool (asynchronous mode, the default) that the step polls.

Why the asynchronous scatter cannot race with the forward pass: a request whose load is
in flight is WAITING_FOR_REMOTE_KVS in vLLM's scheduler, so none of its blocks is in a
batch, nor in vLLM's prefix cache (it caches them only once the load is reported), nor
freed (vLLM defers freeing a waiting request's blocks, aborted or not, until the load is
reported finished). The pool only ever writes those blocks, and reports the request
finished once its writes are complete (on a GPU: after its own stream is synchronised).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from polarkv_lib.client import PolarKVClient
from polarkv_lib.integrations.cpu_affinity import pin

if TYPE_CHECKING:
    from polarkv_lib.integrations.vllm import ConnectorStats, LoadOp

log = logging.getLogger("polarkv.integrations.vllm")
_counting = threading.Lock()  # the loading threads add to one ConnectorStats


KEEP_HOST_BYTES = 256 << 20  # idle host buffers of CPU loads kept for the next ones


class HostBuffers:
    """Idle host buffers of CPU loads, kept for the next ones. A fresh buffer's pages
    fault in on first touch, and on a loading thread beside a running step that cost
    24-38 ms of system time per 16 MiB (4,096 faults: docs/ENGINES.md). At most `keep`
    bytes stay idle, the largest buffers first; a larger load allocates its own."""

    def __init__(self, keep: int = KEEP_HOST_BYTES) -> None:
        self._keep = keep
        self._idle: list[Any] = []  # flat uint8 tensors, largest first
        self._lock = threading.Lock()  # the loading threads share it

    def take(self, nbytes: int) -> Any:
        """A flat uint8 buffer of at least `nbytes`: the smallest idle one that fits."""
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):  # from the smallest
                if self._idle[i].numel() >= nbytes:
                    return self._idle.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: Any) -> None:
        with self._lock:
            kept: list[Any] = []
            total = 0
            for b in sorted([*self._idle, buffer], key=lambda b: b.numel(), reverse=True):
                if total + b.numel() <= self._keep:
                    kept.append(b)
                    total += b.numel()
            self._idle = kept

    @property
    def idle_bytes(self) -> int:
        return sum(b.numel() for b in self._idle)


@dataclass(frozen=True)
class PageTarget:
    """Where loads land: the registered page views, their device and the chunk shape."""

    pages: list[Any]
    device: Any
    chunk_tokens: int
    blocks_per_chunk: int
    chunk_bytes: int
    spare: HostBuffers = field(default_factory=HostBuffers, compare=False)

    def host_buffer(self, chunks: int) -> Any:
        pin = self.device is not None and self.device.type == "cuda"
        return torch.empty((chunks, self.chunk_bytes), dtype=torch.uint8, pin_memory=pin)

    @contextlib.contextmanager
    def load_buffer(self, chunks: int) -> Iterator[Any]:
        """A host buffer for one load, kept for the next load once this one ends (on the
        CPU: the scatter has read it by then; pinned buffers for a GPU come from torch's
        caching host allocator, which knows when their copies are done)."""
        if self.device is None or self.device.type != "cpu":
            yield self.host_buffer(chunks)
            return
        nbytes = chunks * self.chunk_bytes
        flat = self.spare.take(nbytes)
        try:
            yield flat[:nbytes].view(chunks, self.chunk_bytes)
        finally:
            self.spare.give(flat)


def load_into_pages(
    client: PolarKVClient,
    target: PageTarget,
    op: LoadOp,
    stats: ConnectorStats,
    cancelled: Callable[[], bool] = lambda: False,
) -> list[int]:
    """Load one request's chunks and scatter them; returns the blocks not filled. With
    `cancelled()` true once the chunks have arrived (the request is gone), nothing is
    written and the host buffer is let go at once."""
    if not target.pages or not op.block_ids:
        return list(op.block_ids)
    started = time.monotonic()
    ct, per_chunk = target.chunk_tokens, target.blocks_per_chunk
    chunks = len(op.tokens) // ct
    with target.load_buffer(chunks) as host:
        data = host.numpy()
        n_tokens, views = client.load_kv(op.tokens, [memoryview(data[i]) for i in range(chunks)])
        loaded = n_tokens // ct
        # A chunk of another size cannot be this format: it ends the usable prefix.
        loaded = next(
            (i for i, v in enumerate(views[:loaded]) if len(v) != target.chunk_bytes), loaded
        )
        del views, data  # no view of the buffer outlives the load
        if cancelled():
            return list(op.block_ids)
        usable = max(0, min(len(op.block_ids), loaded * per_chunk - op.first_block))
        if usable:
            _scatter(target, host, chunks, op, usable)
    with _counting:
        stats.loaded_chunks += loaded
        stats.loaded_tokens += usable * (ct // per_chunk)
        stats.load_seconds += time.monotonic() - started
    return list(op.block_ids[usable:])


def _scatter(target: PageTarget, host: Any, chunks: int, op: LoadOp, usable: int) -> None:
    device, per_chunk, pages = target.device, target.blocks_per_chunk, target.pages
    side = (
        torch.cuda.Stream(device=device)
        if device.type == "cuda" and threading.current_thread() is not threading.main_thread()
        else None
    )
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        # In the page views' words (vllm_pages._widest); a block's bytes are its page's in
        # C order. Straight from the loaded chunks into the pages, with no block-order
        # copy in between: a fresh 16 MiB buffer on a loading thread cost 4,096 page
        # faults, 24-38 ms of system time beside a running step (docs/ENGINES.md).
        src = host.view(pages[0].dtype).view(chunks, len(pages), per_chunk, *pages[0].shape[1:])
        if device.type != "cpu":
            src = src.to(device, non_blocking=True)
        index = torch.tensor(op.block_ids[:usable], dtype=torch.long, device=device)
        for j, c, b, n, whole in _spans(op.first_block, usable, per_chunk):
            ids = index[j : j + n]
            for layer, page in enumerate(pages):
                if whole:  # a 2-D index: the chunks' blocks as they lie
                    page.index_put_((ids.view(-1, per_chunk),), src[c : c + n // per_chunk, layer])
                else:
                    page.index_copy_(0, ids, src[c, layer, b : b + n])
    if side is not None:
        # Off the step's stream: done only when these copies are, before it is reported.
        side.synchronize()


def _spans(first: int, usable: int, per_chunk: int) -> list[tuple[int, int, int, int, bool]]:
    """The request's blocks 0..usable-1, which are blocks first.. of the loaded chunks, as
    (request block, chunk, block in it, count, whole): a part of one chunk each, except
    that whole chunks in a row are one span (whole: block 0, a multiple of per_chunk)."""
    spans: list[tuple[int, int, int, int, bool]] = []
    j = 0
    while j < usable:
        c, b = divmod(first + j, per_chunk)
        n = min(per_chunk - b, usable - j)
        whole = b == 0 and n == per_chunk
        if whole:
            n = (usable - j) // per_chunk * per_chunk
        spans.append((j, c, b, n, whole))
        j += n
    return spans


class Loader:
    """Asynchronous loads: `submit` returns at once; `poll`, once per step, hands back the
    requests whose load has ended (loaded, failed or cancelled) and their unfilled blocks.
    Every submitted request is handed back exactly once, so vLLM can release it."""

    def __init__(
        self,
        client: PolarKVClient,
        target: PageTarget,
        stats: ConnectorStats,
        threads: int,
        cpus: frozenset[int] | None = None,
        switch_interval: float = 0.0,
    ) -> None:
        self._client = client
        self._target = target
        self._stats = stats
        # The worker's GIL switch interval while loads are in flight (0: left alone), and
        # the one to put back when none is. See _quicken.
        self._switch_interval = switch_interval
        self._saved_interval: float | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads,
            thread_name_prefix="polarkv-vllm-load",
            initializer=pin,
            initargs=(0, cpus),  # the pool's threads start from the step's thread
        )
        self._warm_up(threads)
        # Each job's result: the blocks it did not fill, and when it ended.
        self._jobs: dict[str, concurrent.futures.Future[tuple[list[int], float]]] = {}
        self._gone: set[str] = set()  # finished or aborted while loading
        self._lock = threading.Lock()

    def _warm_up(self, threads: int) -> None:
        """Start every thread of the pool now and run one torch copy on each: a pool
        thread's first scatter took 0.1-0.4 s on the CPU build (its threads' set-up,
        measured in `polarkv bench stall`), inside the first requests' TTFT."""
        barrier = threading.Barrier(threads)
        page = self._target.pages[0] if self._target.pages else None

        def warm() -> None:
            barrier.wait(5.0)  # one task per thread: the pool starts them all
            if page is not None:
                row = page[:1].clone()
                page[:1].copy_(row)  # the same bytes: no cache block changes

        for future in [self._pool.submit(warm) for _ in range(threads)]:
            with contextlib.suppress(Exception):
                future.result(10.0)

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def submit(self, op: LoadOp) -> None:
        self._quicken()
        self._jobs[op.req_id] = self._pool.submit(self._run, op)

    def _quicken(self) -> None:
        """While a load is in flight, hand the GIL over sooner. The worker's main thread
        runs vLLM's Python almost without pause, and a thread waiting for the GIL gets it
        only at the next forced switch (5 ms by default); a load makes hundreds of such
        hand-offs (the client's event loop, the transfers, the scatter): at 0.5 ms the
        single-configuration disk-tier runs of `bench stall` had a median worst gap of
        42 ms against 238 ms (docs/ENGINES.md, "The GIL while a load is in flight"; their
        multi-second stalls were a manager bug, since fixed). Put back once nothing
        loads, so decode steps without loads do not pay for the extra switches. Called
        from the worker's main thread only (start_load_kv and get_finished)."""
        if self._switch_interval and self._saved_interval is None:
            self._saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._saved_interval, self._switch_interval))

    def _settle_interval(self) -> None:
        if self._saved_interval is not None and not self._jobs:
            sys.setswitchinterval(self._saved_interval)
            self._saved_interval = None

    def _run(self, op: LoadOp) -> tuple[list[int], float]:
        try:
            missing = load_into_pages(
                self._client, self._target, op, self._stats, lambda: self._is_gone(op.req_id)
            )
        except Exception as exc:  # the engine never sees a PolarKV fault
            log.warning("PolarKV load of request %s failed: %r", op.req_id, exc)
            missing = list(op.block_ids)
        return missing, time.monotonic()

    def _is_gone(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._gone

    def poll(self, finished_req_ids: set[str]) -> tuple[set[str], set[int]]:
        """(requests whose load has ended, blocks they did not fill). A request in
        `finished_req_ids` (finished or aborted while loading) is cancelled: if its load
        has not started it never does, else it writes nothing once its chunks arrive."""
        gone = {r for r in finished_req_ids if r in self._jobs}
        if gone:
            with self._lock:
                self._gone |= gone
            for req_id in gone:
                self._jobs[req_id].cancel()
        done: set[str] = set()
        failed: set[int] = set()
        now = time.monotonic()
        for req_id, future in list(self._jobs.items()):
            if not future.done():
                continue
            del self._jobs[req_id]
            done.add(req_id)
            cancelled = req_id in self._gone
            if cancelled:
                with self._lock:
                    self._gone.discard(req_id)
                self._stats.cancelled_loads += 1
                continue  # a finished request's blocks are vLLM's to free, not to recompute
            missing, ended = future.result()
            with _counting:
                self._stats.load_report_wait_seconds += now - ended
            if missing:
                failed.update(missing)
                self._stats.failed_load_blocks += len(missing)
        self._settle_interval()
        return done, failed

    def wait(self, timeout: float) -> bool:
        """Wait for every submitted load to end (tests, orderly shutdown)."""
        futures = list(self._jobs.values())
        _, pending = concurrent.futures.wait(futures, timeout)
        return not pending

    def close(self, timeout: float) -> None:
        with self._lock:
            self._gone |= set(self._jobs)
        for future in self._jobs.values():
            future.cancel()
        self.wait(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._jobs.clear()
        self._settle_interval()
