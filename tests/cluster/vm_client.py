"""A client run inside a client VM by the cluster tests: store or load a prompt's chunks
through the public client API and print one JSON line about what happened.

    python -m tests.cluster.vm_client store|load --namespace NS --chunks 64 --size 262144

The manager URL(s) and token come from the environment the harness gives every command
it runs in a VM. Chunk i of a prompt is derived from (namespace, prompt, i), so the loader
knows the exact bytes the storer wrote without sharing anything but those names.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import time

import orjson

from polarkv_lib.client import PolarKVClient

CHUNK_TOKENS = 16


def chunk_bytes(namespace: str, prompt: int, index: int, size: int) -> bytes:
    seed = hashlib.blake2b(f"{namespace}/{prompt}/{index}".encode(), digest_size=32).digest()
    block = hashlib.shake_256(seed).digest(min(size, 1 << 16))
    return (block * (size // len(block) + 1))[:size]


def tokens(prompt: int, chunks: int) -> list[int]:
    return [prompt * 1_000_003 + t for t in range(chunks * CHUNK_TOKENS)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("op", choices=("store", "load"))
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--first-prompt", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--size", type=int, default=256 * 1024)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    url = os.environ["POLARKV_CLIENT__MANAGER_URL"]
    token = os.environ.get("POLARKV_SECURITY__TOKEN") or None
    out: dict[str, object] = {"hostname": socket.gethostname(), "op": args.op}
    done, exact, per_prompt = 0, True, []
    started = time.perf_counter()
    with PolarKVClient(
        url,
        namespace=args.namespace,
        chunk_tokens=CHUNK_TOKENS,
        token=token,
        transport="auto",
        timeout=args.timeout,
    ) as client:
        for prompt in range(args.first_prompt, args.first_prompt + args.prompts):
            toks = tokens(prompt, args.chunks)
            if args.op == "store":
                chunks = [
                    chunk_bytes(args.namespace, prompt, i, args.size) for i in range(args.chunks)
                ]
                n = client.store_kv(toks, chunks)
            else:
                n_tokens, views = client.load_kv(toks)
                n = n_tokens // CHUNK_TOKENS
                exact = exact and all(
                    bytes(v) == chunk_bytes(args.namespace, prompt, i, args.size)
                    for i, v in enumerate(views)
                )
            done += n
            per_prompt.append(n)
        out["faults"] = client.stats.faults if hasattr(client, "stats") else None
    out.update(
        chunks=done,
        per_prompt=per_prompt,
        byte_exact=exact,
        seconds=round(time.perf_counter() - started, 3),
    )
    sys.stdout.write(orjson.dumps(out).decode() + "\n")


if __name__ == "__main__":
    main()
