#!/usr/bin/env python3
"""Data-plane benchmark: PolarKV store/load over tcp and shm beside raw-socket and memcpy
limits. The same as `polarkv bench datapath`; see docs/BENCHMARKS.md.

    python scripts/bench_datapath.py [--sizes 1MiB,4MiB,16MiB] [--concurrency 1,4]
                                     [--transports tcp,shm] [--total 256MiB] [--memory 1GiB]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from polarkv_lib.tools.bench_datapath import main


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1MiB,4MiB,16MiB", help="object sizes, comma separated")
    parser.add_argument("--concurrency", default="1,4", help="concurrent transfers, comma separated")
    parser.add_argument("--transports", default="tcp,shm", help="transports to measure")
    parser.add_argument("--total", default="256MiB", help="bytes moved per measurement")
    parser.add_argument("--memory", default="1GiB", help="slab memory of the service the bench starts")
    args = parser.parse_args()
    main(args.sizes, args.concurrency, args.transports, args.total, args.memory)


if __name__ == "__main__":
    cli()
