#!/usr/bin/env python3
"""Disk-tier benchmark: DiskStore and a running node's offload/reload beside raw file I/O
on the same path, and loads with the disk role on and off. The same as
`polarkv bench disk`.

    python scripts/bench_disk.py [--path DIR] [--sizes 1MiB,4MiB] [--total 256MiB]
                                 [--memory 256MiB] [--working-set 1GiB] [--threads 4]
                                 [--no-o-direct] [--parts store,service,fit]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from polarkv_lib.tools.bench_disk import main


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default="",
                        help="directory on the disk to measure; the bench works in a temporary "
                             "directory under it and removes it (default: the system temp dir)")
    parser.add_argument("--sizes", default="1MiB,4MiB", help="object sizes, comma separated")
    parser.add_argument("--total", default="256MiB", help="bytes per DiskStore-part measurement")
    parser.add_argument("--memory", default="256MiB", help="slab memory of the nodes the bench starts")
    parser.add_argument("--working-set", default="1GiB",
                        help="bytes stored and loaded back per service-part round (>= 4x --memory)")
    parser.add_argument("--threads", default="4", help="I/O threads on both sides (disk.io_threads)")
    parser.add_argument("--no-o-direct", dest="o_direct", action="store_false",
                        help="use the page cache on both sides (dropped before reads; needs root)")
    parser.add_argument("--parts", default="store,service,fit", help="parts to run")
    args = parser.parse_args()
    main(args.path, args.sizes, args.total, args.memory, args.working_set, args.threads,
         args.o_direct, args.parts)


if __name__ == "__main__":
    cli()
