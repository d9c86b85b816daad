#!/usr/bin/env python3
"""The manager benchmark from a checkout: the same as `polarkv bench manager ARGS`
(see docs/BENCHMARKS.md; `--help` lists the options)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from polarkv import main

if __name__ == "__main__":
    main(["bench", "manager", *sys.argv[1:]], prog_name="polarkv")
