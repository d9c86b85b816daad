"""Mixed store/load traffic from several client processes, with every loaded byte checked.

Each process loops until its time is up: it picks a prompt from a shared working set
(skewed towards a hot part, as real prefix traffic is), and either stores it or loads
it. Chunk contents are a pure function of (prompt, chunk), so a loader knows exactly
what it must get back; a chunk that differs is counted as a wrong byte served (which
must stay 0). Exceptions escaping the client are counted too (must stay 0).

    polarkv bench load --url http://127.0.0.1:8170 --clients 8 --seconds 60
    python -m polarkv_lib.tools.loadgen client URL SEED SECONDS PROMPTS CHUNKS CHUNK_BYTES STORE_RATIO
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

from polarkv_lib.client import PolarKVClient

CHUNK_TOKENS = 16


def chunk_bytes(prompt: int, chunk: int, size: int) -> bytes:
    return hashlib.shake_128(f"polarkv-load/{prompt}/{chunk}".encode()).digest(size)


def prompt_tokens(prompt: int, chunks: int) -> list[int]:
    # prompts share their first chunk in groups of 4 (a system prompt), then diverge
    head = [prompt // 4] * CHUNK_TOKENS
    return head + [prompt * 1_000_003 + t for t in range((chunks - 1) * CHUNK_TOKENS)]


@dataclass
class ClientReport:
    stores: int = 0
    loads: int = 0
    chunks_stored: int = 0
    chunks_loaded: int = 0
    chunks_wanted: int = 0
    bytes_loaded: int = 0
    wrong_bytes: int = 0
    exceptions: int = 0
    store_ms: list[float] = field(default_factory=list)
    load_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0


def run_client(
    url: str, seed: int, seconds: float, prompts: int, chunks: int, size: int, store_ratio: float
) -> ClientReport:
    rng = random.Random(seed)
    report = ClientReport()
    expected: dict[tuple[int, int], str] = {}

    def data(p: int) -> list[bytes]:
        # the first chunk is shared by a group of prompts: same tokens, same bytes
        out = [chunk_bytes(p // 4 + 10**9, 0, size)] + [
            chunk_bytes(p, c, size) for c in range(1, chunks)
        ]
        for c, blob in enumerate(out):
            expected.setdefault((p, c), xxhash.xxh3_64_hexdigest(blob))
        return out

    hot = max(1, prompts // 5)
    started = time.monotonic()
    with PolarKVClient(url, namespace="loadgen", chunk_tokens=CHUNK_TOKENS, timeout=2.0) as client:
        while time.monotonic() - started < seconds:
            p = rng.randrange(hot) if rng.random() < 0.8 else rng.randrange(prompts)
            tokens = prompt_tokens(p, chunks)
            t0 = time.perf_counter()
            try:
                if rng.random() < store_ratio:
                    report.chunks_stored += client.store_kv(tokens, data(p))
                    report.stores += 1
                    report.store_ms.append((time.perf_counter() - t0) * 1000)
                else:
                    _, views = client.load_kv(tokens)
                    report.load_ms.append((time.perf_counter() - t0) * 1000)
                    report.loads += 1
                    report.chunks_wanted += chunks
                    report.chunks_loaded += len(views)
                    if (p, 0) not in expected:
                        data(p)
                    for c, view in enumerate(views):
                        report.bytes_loaded += len(view)
                        if len(view) != size or xxhash.xxh3_64_hexdigest(view) != expected[(p, c)]:
                            report.wrong_bytes += 1
            except Exception:  # the client must never raise: count it if it does
                report.exceptions += 1
    report.seconds = time.monotonic() - started
    return report


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(
    url: str, clients: int, seconds: float, prompts: int, chunks: int, size: int, store_ratio: float
) -> dict[str, Any]:
    """Start `clients` processes against `url`, wait for them, and sum up."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "polarkv_lib.tools.loadgen",
                "client",
                url,
                str(seed),
                str(seconds),
                str(prompts),
                str(chunks),
                str(size),
                str(store_ratio),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for seed in range(clients)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=seconds + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"load client failed: {err.decode(errors='replace')[-2000:]}")
        reports.append(ClientReport(**orjson.loads(out)))
    store_ms = [v for r in reports for v in r.store_ms]
    load_ms = [v for r in reports for v in r.load_ms]
    wall = max(r.seconds for r in reports)
    loaded = sum(r.bytes_loaded for r in reports)
    return {
        "clients": clients,
        "seconds": round(wall, 1),
        "stores": sum(r.stores for r in reports),
        "loads": sum(r.loads for r in reports),
        "ops_per_s": round(sum(r.stores + r.loads for r in reports) / wall, 1),
        "load_gbps": round(loaded / wall / 1e9, 3),
        "hit_ratio": round(
            sum(r.chunks_loaded for r in reports) / max(1, sum(r.chunks_wanted for r in reports)), 3
        ),
        "store_p50_ms": round(_percentile(store_ms, 0.5), 2),
        "store_p99_ms": round(_percentile(store_ms, 0.99), 2),
        "load_p50_ms": round(_percentile(load_ms, 0.5), 2),
        "load_p99_ms": round(_percentile(load_ms, 0.99), 2),
        "wrong_bytes": sum(r.wrong_bytes for r in reports),
        "exceptions": sum(r.exceptions for r in reports),
    }


def main() -> None:
    if len(sys.argv) == 9 and sys.argv[1] == "client":
        url, seed, seconds, prompts, chunks, size, ratio = sys.argv[2:]
        report = run_client(
            url, int(seed), float(seconds), int(prompts), int(chunks), int(size), float(ratio)
        )
        sys.stdout.write(orjson.dumps(vars(report)).decode())
        return
    sys.exit(__doc__)


if __name__ == "__main__":
    main()
