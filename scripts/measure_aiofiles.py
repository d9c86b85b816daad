"""The measurement behind docs/ARCHITECTURE.md's aiofiles row: reload N files of SIZE
bytes into one buffer, CONC in flight, the disk role's way (a dedicated thread pool,
`os.preadv` straight into the buffer, one job per file) against aiofiles (open, seek,
readinto and close, each a hop through the loop's default executor of CONC threads).
Interleaved rounds over the same files (page cache warm: the per-call cost is what
differs). aiofiles is not a dependency: run it where it is installed,

    pip install aiofiles && python scripts/measure_aiofiles.py
"""

from __future__ import annotations

import asyncio
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import aiofiles

N, SIZE, CONC, ROUNDS = 64, 4 << 20, 4, 15


def make_files(d: str) -> list[str]:
    paths = [os.path.join(d, str(i)) for i in range(N)]
    for p in paths:
        with open(p, "wb") as fh:
            fh.write(os.urandom(SIZE))
    return paths


async def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        paths = make_files(d)
        buf = mmap.mmap(-1, N * SIZE)
        view = memoryview(buf)
        pool = ThreadPoolExecutor(CONC)
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(CONC))
        sem = asyncio.Semaphore(CONC)

        def pread(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                done = 0
                while done < SIZE:
                    done += os.preadv(fd, [view[i * SIZE + done : (i + 1) * SIZE]], done)
            finally:
                os.close(fd)

        async def dedicated(i: int) -> None:
            async with sem:
                await loop.run_in_executor(pool, pread, i)

        async def with_aiofiles(i: int) -> None:
            async with sem, aiofiles.open(paths[i], "rb", buffering=0) as f:
                await f.seek(0)
                done = 0
                while done < SIZE:
                    done += await f.readinto(view[i * SIZE + done : (i + 1) * SIZE])

        ways: dict[str, Callable[[int], Awaitable[None]]] = {
            "dedicated pool + preadv": dedicated,
            "aiofiles": with_aiofiles,
        }
        rates: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(ROUNDS):
            for name, one in ways.items():
                started = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(N)))
                rates[name].append(N * SIZE / (time.perf_counter() - started) / 1e9)
        for name, values in rates.items():
            print(f"{name}: median {statistics.median(values):.2f} GB/s, best {max(values):.2f}")
        pairs = [
            a / b for a, b in zip(rates["aiofiles"], rates["dedicated pool + preadv"], strict=True)
        ]
        print(f"aiofiles / dedicated, median of per-round ratios: {statistics.median(pairs):.2f}")


if __name__ == "__main__":
    asyncio.run(main())
