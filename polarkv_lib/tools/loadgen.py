"""Mixed store/load traffic from several client processes on this host, with every
loaded byte checked (the traffic itself is polarkv_lib/workload.py's, as in the
cluster's client VMs).

Each process loops until its time is up: it picks a prompt from a shared working set
(80% of picks go to its hottest fifth, as real prefix traffic is skewed), and either
stores it or loads it. A loaded chunk that differs from what was stored is counted as a
wrong byte served (which must stay 0); exceptions escaping the client are counted too
(must stay 0).

    polarkv bench load --url http://127.0.0.1:8170 --clients 8 --seconds 60
    python -m polarkv_lib.tools.loadgen client URL SEED SECONDS PROMPTS CHUNKS CHUNK_BYTES STORE_RATIO
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import time
from typing import Any

import orjson

from polarkv_lib.client import PolarKVClient
from polarkv_lib.workload import CHUNK_TOKENS, Counts, Workload

NAMESPACE = "loadgen"
HOT_SHARE = 0.8


def run_client(
    url: str, seed: int, seconds: float, prompts: int, chunks: int, size: int, store_ratio: float
) -> tuple[Counts, float]:
    """One client's traffic; its counts and how long it ran."""
    started = time.monotonic()
    with PolarKVClient(url, namespace=NAMESPACE, chunk_tokens=CHUNK_TOKENS, timeout=2.0) as client:
        work = Workload(client, NAMESPACE, chunks, size)
        work.mixed(
            random.Random(seed),
            seconds,
            prompts,
            store_ratio,
            hot_share=HOT_SHARE,
            count_exceptions=True,
        )
    return work.counts, time.monotonic() - started


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
    total, wall = Counts(), 0.0
    for proc in procs:
        out, err = proc.communicate(timeout=seconds + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"load client failed: {err.decode(errors='replace')[-2000:]}")
        report = orjson.loads(out)
        wall = max(wall, report.pop("seconds"))
        total.add(Counts(**report))
    wall = max(wall, 1e-9)
    s = total.summary()
    return {
        "clients": clients,
        "seconds": round(wall, 1),
        "stores": total.stores,
        "loads": total.loads,
        "ops_per_s": round((total.stores + total.loads) / wall, 1),
        "load_gbps": round(total.bytes_loaded / wall / 1e9, 3),
        "hit_ratio": round(total.chunks_hit / max(1, total.chunks_wanted), 3),
        **{k: s[k] for k in ("store_p50_ms", "store_p99_ms", "load_p50_ms", "load_p99_ms")},
        "wrong_bytes": total.wrong_bytes,
        "exceptions": total.exceptions,
    }


def main() -> None:
    if len(sys.argv) == 9 and sys.argv[1] == "client":
        url, seed, seconds, prompts, chunks, size, ratio = sys.argv[2:]
        counts, ran = run_client(
            url, int(seed), float(seconds), int(prompts), int(chunks), int(size), float(ratio)
        )
        sys.stdout.write(orjson.dumps({**dataclasses.asdict(counts), "seconds": ran}).decode())
        return
    sys.exit(__doc__)


if __name__ == "__main__":
    main()
