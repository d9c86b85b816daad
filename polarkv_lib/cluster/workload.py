"""The client side of `polarkv bench cluster`, run in a client VM: fill a working set of
prompts, or run a mixed load over it, through the public client API; one JSON line out.

    python -m polarkv_lib.cluster.workload fill  --prompts 48 --chunks 8 --size 1048576
    python -m polarkv_lib.cluster.workload load  --prompts 48 --chunks 8 --size 1048576
    python -m polarkv_lib.cluster.workload mixed --prompts 48 --seconds 20 --store-ratio 0.2

Chunk i of prompt p is a 16-byte stamp of (namespace, p, i) repeated, so every loaded
byte is compared with what was stored at memcpy speed, without keeping the working set.
The manager URLs and token come from the environment `Cluster.run_in` provides.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time
from typing import Any

import orjson

from polarkv_lib.client import PolarKVClient

CHUNK_TOKENS = 16


def chunk(namespace: str, prompt: int, index: int, size: int) -> bytes:
    stamp = hashlib.blake2b(f"{namespace}/{prompt}/{index}".encode(), digest_size=16).digest()
    return stamp * (size // 16) + stamp[: size % 16]


def prompt_tokens(prompt: int, chunks: int) -> list[int]:
    return [prompt * 65_537 + t for t in range(chunks * CHUNK_TOKENS)]


class Workload:
    def __init__(self, client: PolarKVClient, namespace: str, chunks: int, size: int) -> None:
        self.client, self.namespace, self.chunks, self.size = client, namespace, chunks, size
        self.counts: dict[str, Any] = {
            "loads": 0,
            "chunks_wanted": 0,
            "chunks_hit": 0,
            "bytes_loaded": 0,
            "load_seconds": 0.0,
            "stores": 0,
            "chunks_stored": 0,
            "bytes_stored": 0,
            "store_seconds": 0.0,
            "wrong_bytes": 0,
        }

    def store(self, prompt: int) -> None:
        data = [chunk(self.namespace, prompt, i, self.size) for i in range(self.chunks)]
        started = time.perf_counter()
        n = self.client.store_kv(prompt_tokens(prompt, self.chunks), data)
        c = self.counts
        c["store_seconds"] += time.perf_counter() - started
        c["stores"] += 1
        c["chunks_stored"] += n
        c["bytes_stored"] += n * self.size

    def load(self, prompt: int) -> None:
        started = time.perf_counter()
        _, views = self.client.load_kv(prompt_tokens(prompt, self.chunks))
        c = self.counts
        c["load_seconds"] += time.perf_counter() - started
        c["loads"] += 1
        c["chunks_wanted"] += self.chunks
        c["chunks_hit"] += len(views)
        c["bytes_loaded"] += sum(len(v) for v in views)
        c["wrong_bytes"] += sum(
            1 for i, v in enumerate(views) if v != chunk(self.namespace, prompt, i, self.size)
        )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="polarkv_lib.cluster.workload")
    parser.add_argument("phase", choices=("fill", "load", "mixed"))
    parser.add_argument("--namespace", default="bench")
    parser.add_argument("--prompts", type=int, required=True, help="working set, in prompts")
    parser.add_argument("--first", type=int, default=0, help="fill, load: first prompt id")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--seconds", type=float, default=20.0, help="mixed: how long")
    parser.add_argument("--store-ratio", type=float, default=0.2, help="mixed: share of stores")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    url = os.environ["POLARKV_CLIENT__MANAGER_URL"]
    token = os.environ.get("POLARKV_SECURITY__TOKEN") or None
    rng = random.Random(args.seed)
    started = time.perf_counter()
    with PolarKVClient(
        url, namespace=args.namespace, chunk_tokens=CHUNK_TOKENS, token=token, timeout=args.timeout
    ) as client:
        work = Workload(client, args.namespace, args.chunks, args.size)
        if args.phase in ("fill", "load"):
            for prompt in range(args.first, args.first + args.prompts):
                (work.store if args.phase == "fill" else work.load)(prompt)
        else:
            fresh = 1_000_000 + args.seed * 100_000  # new prompts: ids no one else uses
            while time.perf_counter() - started < args.seconds:
                if work.counts["loads"] and rng.random() < args.store_ratio:  # a load first
                    work.store(fresh)
                    fresh += 1
                else:
                    work.load(rng.randrange(args.prompts))
    out = {**work.counts, "phase": args.phase, "seconds": round(time.perf_counter() - started, 3)}
    sys.stdout.write(orjson.dumps(out).decode() + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
