"""The one generator of test and benchmark traffic through the public client API: the
prompts, their tokens, their chunks' bytes, and a `Workload` that stores and loads them,
checks every loaded byte and times every call.

Used by `polarkv bench load` (tools/loadgen.py: processes on this host), the cluster's
client VMs (cluster/workload.py: `polarkv bench cluster` and the cluster tests) and the
fault tests. Chunk i of prompt p in namespace ns is a pure function of (ns, p, i): a
loader in another process or VM knows the exact bytes without sharing anything but
those names. The bytes are a 64 KiB pseudo-random block repeated, so a read at a wrong
offset (below 64 KiB) fails the check. A loaded chunk is compared by its xxh3-128 digest
with the stored one's (computed once per chunk): comparing a memoryview with bytes goes
byte by byte in CPython, over a hundred times slower, which on a busy host slows the
very traffic it checks.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from polarkv_lib.client import PolarKVClient
from polarkv_lib.stats import percentiles

CHUNK_TOKENS = 16
BLOCK = 1 << 16


def chunk(namespace: str, prompt: int, index: int, size: int) -> bytes:
    seed = hashlib.blake2b(f"{namespace}/{prompt}/{index}".encode(), digest_size=32).digest()
    block = hashlib.shake_256(seed).digest(min(size, BLOCK))
    return (block * (size // len(block) + 1))[:size]


def prompt_tokens(prompt: int, chunks: int) -> list[int]:
    return [prompt * 1_000_003 + t for t in range(chunks * CHUNK_TOKENS)]


@dataclass
class Counts:
    stores: int = 0
    loads: int = 0
    chunks_stored: int = 0
    bytes_stored: int = 0
    chunks_wanted: int = 0
    chunks_hit: int = 0
    bytes_loaded: int = 0
    wrong_bytes: int = 0  # loaded chunks whose bytes differ from the stored ones: must be 0
    exceptions: int = 0  # exceptions that escaped the client (it must not raise): must be 0
    store_ms: list[float] = field(default_factory=list)
    load_ms: list[float] = field(default_factory=list)

    def add(self, other: Counts) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)

    def summary(self) -> dict[str, Any]:
        """The counts with latencies as seconds in all and p50/p99 (stats.percentile)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("store_ms", "load_ms")}
        out["store_seconds"] = round(sum(self.store_ms) / 1000, 6)
        out["load_seconds"] = round(sum(self.load_ms) / 1000, 6)
        for op, values in (("store", self.store_ms), ("load", self.load_ms)):
            p50, p99 = percentiles(values, 0.5, 0.99)
            out[f"{op}_p50_ms"], out[f"{op}_p99_ms"] = round(p50, 2), round(p99, 2)
        return out


class Workload:
    """Stores and loads whole prompts of `chunks` chunks of `size` bytes in `namespace`."""

    def __init__(self, client: PolarKVClient, namespace: str, chunks: int, size: int) -> None:
        self.client, self.namespace, self.chunks, self.size = client, namespace, chunks, size
        self.counts = Counts()
        self._digests: dict[tuple[int, int], bytes] = {}

    def digest(self, prompt: int, index: int) -> bytes:
        """The xxh3-128 digest of the chunk as stored (kept: loads repeat prompts)."""
        key = (prompt, index)
        if key not in self._digests:
            self._digests[key] = xxhash.xxh3_128_digest(
                chunk(self.namespace, prompt, index, self.size)
            )
        return self._digests[key]

    def data(self, prompt: int) -> list[bytes]:
        return [chunk(self.namespace, prompt, i, self.size) for i in range(self.chunks)]

    def store(self, prompt: int) -> int:
        """Store the prompt; the chunks the client reports stored."""
        data = self.data(prompt)
        started = time.perf_counter()
        n = self.client.store_kv(prompt_tokens(prompt, self.chunks), data)
        c = self.counts
        c.store_ms.append((time.perf_counter() - started) * 1000)
        c.stores += 1
        c.chunks_stored += n
        c.bytes_stored += n * self.size
        return n

    def load(self, prompt: int) -> tuple[int, bool]:
        """Load the prompt: the chunks hit (a prefix) and whether every byte was right."""
        started = time.perf_counter()
        _, views = self.client.load_kv(prompt_tokens(prompt, self.chunks))
        c = self.counts
        c.load_ms.append((time.perf_counter() - started) * 1000)
        c.loads += 1
        c.chunks_wanted += self.chunks
        c.chunks_hit += len(views)
        c.bytes_loaded += sum(len(v) for v in views)
        wrong = sum(
            1 for i, v in enumerate(views) if v != chunk(self.namespace, prompt, i, self.size)
        )
        c.wrong_bytes += wrong
        return len(views), wrong == 0

    def mixed(
        self,
        rng: random.Random,
        seconds: float,
        prompts: int,
        store_ratio: float,
        *,
        hot_share: float = 0.0,
        fresh_from: int | None = None,
        count_exceptions: bool = False,
    ) -> None:
        """Until `seconds` have passed: a load of one of `prompts` (with `hot_share`, that
        share of them goes to the hottest fifth, as prefix traffic is skewed) or, with
        probability `store_ratio`, a store: of a new prompt numbered from `fresh_from`
        (no one else's), else of the same working set. `count_exceptions`: an exception
        out of the client is counted, not raised (the fault tests count them)."""
        hot = max(1, prompts // 5)
        fresh = fresh_from
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            if hot_share and rng.random() < hot_share:
                prompt = rng.randrange(hot)
            else:
                prompt = rng.randrange(prompts)
            try:
                if rng.random() < store_ratio and (fresh is None or self.counts.loads):
                    if fresh is not None:
                        prompt, fresh = fresh, fresh + 1
                    self.store(prompt)
                else:
                    self.load(prompt)
            except Exception:
                if not count_exceptions:
                    raise
                self.counts.exceptions += 1
