"""A separate client process for the end-to-end tests: store or load, print JSON.

    python client_proc.py store URL NAMESPACE TRANSPORT CHUNKS CHUNK_BYTES
    python client_proc.py load  URL NAMESPACE TRANSPORT CHUNKS
Chunks are random bytes; both modes print the sha256 of every chunk they handled.
"""

from __future__ import annotations

import hashlib
import os
import sys

import orjson

from polarkv_lib.client import PolarKVClient

CHUNK_TOKENS = 16


def main() -> None:
    mode, url, namespace, transport, count = sys.argv[1:6]
    tokens = list(range(int(count) * CHUNK_TOKENS))
    with PolarKVClient(
        url, namespace=namespace, chunk_tokens=CHUNK_TOKENS, transport=transport, timeout=30.0
    ) as client:
        if mode == "store":
            chunks = [os.urandom(int(sys.argv[6])) for _ in range(int(count))]
            stored = client.store_kv(tokens, chunks)
            out = {"stored": stored, "digests": [hashlib.sha256(c).hexdigest() for c in chunks]}
        else:
            n_tokens, views = client.load_kv(tokens)
            out = {"n_tokens": n_tokens, "digests": [hashlib.sha256(v).hexdigest() for v in views]}
        out["stats"] = vars(client.stats)
    sys.stdout.write(orjson.dumps(out).decode())


if __name__ == "__main__":
    main()
