"""The client side of `polarkv bench cluster` and of the cluster tests, run in a client
VM: store a range of prompts, load them, or run a mixed load over a working set, through
the public client API (the traffic is polarkv_lib/workload.py's); one JSON line out.

    python -m polarkv_lib.cluster.workload fill  --prompts 48 --chunks 8 --size 1048576
    python -m polarkv_lib.cluster.workload load  --prompts 48 --chunks 8 --size 1048576
    python -m polarkv_lib.cluster.workload mixed --prompts 48 --seconds 20 --store-ratio 0.2

The line holds the counts (`Counts.summary`), the VM's hostname, the chunks stored or
hit per prompt (`per_prompt`, fill and load), their sum (`chunks`) and whether every
loaded byte was right (`byte_exact`). The manager URLs and token come from the
environment `Cluster.run_in` provides.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import time

import orjson

from polarkv_lib.client import PolarKVClient
from polarkv_lib.workload import CHUNK_TOKENS, Workload


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
    started = time.perf_counter()
    per_prompt: list[int] = []
    exact = True
    with PolarKVClient(
        url,
        namespace=args.namespace,
        chunk_tokens=CHUNK_TOKENS,
        token=token,
        transport="auto",
        timeout=args.timeout,
    ) as client:
        work = Workload(client, args.namespace, args.chunks, args.size)
        if args.phase == "fill":
            per_prompt = [work.store(p) for p in range(args.first, args.first + args.prompts)]
        elif args.phase == "load":
            for prompt in range(args.first, args.first + args.prompts):
                hit, right = work.load(prompt)
                per_prompt.append(hit)
                exact = exact and right
        else:
            work.mixed(
                random.Random(args.seed),
                args.seconds,
                args.prompts,
                args.store_ratio,
                fresh_from=1_000_000 + args.seed * 100_000,  # new prompts: ids no one else uses
            )
            exact = work.counts.wrong_bytes == 0
    out = {
        **work.counts.summary(),
        "phase": args.phase,
        "hostname": socket.gethostname(),
        "per_prompt": per_prompt,
        "chunks": sum(per_prompt),
        "byte_exact": exact,
        "seconds": round(time.perf_counter() - started, 3),
    }
    sys.stdout.write(orjson.dumps(out).decode() + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
