"""The manager's request handlers without HTTP (docs/BENCHMARKS.md, section "Event loop,
grant MACs, and where a 1M-entry manager spends its time"): a ManagerService whose core
holds N entries of 64 KiB on one full node (restored from synthetic rows, as a restart
would), its write-behind running on SQLite, and its handlers called with stub requests:

  lookup    64 random resident keys with a lease, then the release of the lease
  allocate  64 fresh keys on the full node (64 evictions), then their commit

Prints pairs per second and the process's CPU per pair (all threads: the SQLite thread
too). What `polarkv bench manager` adds on top is aiohttp and its client. Runs against
whichever tree is on PYTHONPATH:

    PYTHONPATH=. python scripts/measure_manager_handlers.py [N] [SECONDS]
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from polarkv_lib.config import load_config
from polarkv_lib.manager.app import ManagerService
from polarkv_lib.manager.auth import TENANT
from polarkv_lib.manager.rows import NodeRow
from tests.unit.drive import confirm_all, synthetic_rows

SIZE, BATCH, CHECKSUM = 65536, 64, "0123456789abcdef"


class Request(dict[Any, Any]):
    """What the handlers read of an aiohttp request: the body and the tenant."""

    def __init__(self, body: Any) -> None:
        super().__init__()
        self[TENANT] = None  # the default tenant's token
        self._body = orjson.dumps(body)

    async def read(self) -> bytes:
        return self._body


async def reply(handler: Callable[[Any], Awaitable[Any]], body: Any) -> Any:
    return orjson.loads((await handler(Request(body))).body)


async def main(n: int, seconds: float) -> None:
    config = load_config(
        overrides=[f"manager.metadata_url=sqlite:///{tempfile.mkdtemp()}/meta.db"], environ={}
    )
    service = ManagerService(config)
    await service.store.open()
    node = NodeRow("n1", 1, "127.0.0.1:9", n * SIZE, 0, "", "h", "tcp")
    rows = synthetic_rows(node, n, SIZE)
    gc.disable()
    service.meta.snapshots.restore([node], rows)
    service.meta.register("n1", 1, node.address, node.capacity, "", "h", ["tcp"], 0)
    confirm_all(service.meta, "n1", 1)
    while service.meta.snapshots.restore_step(100_000):
        pass
    gc.enable()
    gc.freeze()
    keys = [r.key for r in rows]
    del rows
    service.writer.start()
    rng = random.Random(1)
    fresh = iter(range(10**9, 10**12, BATCH))

    async def lookup() -> None:
        asked = [keys[rng.randrange(n)] for _ in range(BATCH)]
        got = await reply(service.lookup, {"keys": asked, "lease": True})
        await reply(service.release, {"leases": [got["lease"]]})

    async def allocate() -> None:
        first = next(fresh)
        fresh_keys = [f"{i:032x}" for i in range(first, first + BATCH)]
        items = [{"key": k, "size": SIZE} for k in fresh_keys]
        got = await reply(service.allocate, {"items": items})
        done = [r["key"] for r in got["results"] if r["status"] == "allocated"]
        commits = [{"key": k, "checksum": CHECKSUM} for k in done]
        await reply(service.commit, {"lease": got["lease"], "items": commits})

    for name, pair in (("lookup + release", lookup), ("allocate + commit", allocate)):
        for _ in range(20):
            await pair()
        done, wall, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - wall < seconds:
            await pair()
            done += 1
            if done % 8 == 0:
                await asyncio.sleep(0)  # the write-behind's turn, as between requests
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(
            f"{n:,} entries, {name}: {done / wall:,.0f} pairs/s, "
            f"{cpu / done * 1e6:,.0f} us CPU per pair"
        )
    await service.writer.stop()


if __name__ == "__main__":
    asyncio.run(
        main(
            int(sys.argv[1]) if len(sys.argv) > 1 else 200_000,
            float(sys.argv[2]) if len(sys.argv) > 2 else 4.0,
        )
    )
