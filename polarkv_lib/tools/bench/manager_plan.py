"""What `polarkv bench manager` was asked to do, its rows and its constants (the
method is in bench/manager.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polarkv_lib.stats import percentile
from polarkv_lib.tools.bench import core
from polarkv_lib.tools.bench.core import MiB, Pairs

BATCH = 64
NODE_ID = "bench-node"
CHECKSUM = "0" * 16  # never verified here: no bytes move
REQUEST_TIMEOUT = 60.0
SERVICE_TIMEOUT = 600.0  # start and stop of a manager with a million entries
RESTORE_TIMEOUT = 600.0
POLL_S = 0.02
FLUSH_WAIT_S = 30.0  # most to wait for a write-behind round (every 200 ms by default)
STABLE_S = 5.0  # a restore that has not grown for this long is over, complete or not
LEASED = 0.9  # of a full node's entries, held under read leases in the leased row


@dataclass(frozen=True)
class Plan:
    entries: list[int]
    size: int
    seconds: float
    rounds: int
    concurrency: int
    restart: bool


@dataclass
class Row(Pairs):
    """Pairs per second; `base` is the bare aiohttp handler's."""

    entries: int
    op: str
    latency_ms: list[float] = field(
        default_factory=list
    )  # the manager's first requests, all rounds

    def percentile(self, q: float) -> float:
        return percentile(self.latency_ms, q)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        del out["latency_ms"]  # thousands of values: the percentiles stand for them
        out["p50_ms"], out["p99_ms"] = self.percentile(0.5), self.percentile(0.99)
        return out


@dataclass
class Table:
    """What one table size showed besides the rates."""

    entries: int
    fill_s: float = 0.0
    bytes_per_entry: float = 0.0
    ready_s: float = 0.0
    first_hit_s: float = 0.0
    restored_s: float = 0.0
    restored: int = 0
    notes: list[str] = field(default_factory=list)


def parse_plan(
    entries: str, size: str, seconds: str, rounds: str, concurrency: str, restart: bool
) -> Plan:
    counts = core.parse_ints(
        entries.replace("k", "000").replace("M", "000000"), "--entries", BATCH, 10**8
    )
    try:
        secs = float(seconds)
    except ValueError:
        raise core.BadArguments(f"--seconds: not a number: {seconds!r}") from None
    if not 0.1 <= secs <= 60:
        raise core.BadArguments("--seconds: between 0.1 and 60")
    size_b = core.parse_bytes(size, "--size")
    if not 4096 <= size_b <= 256 * MiB:
        raise core.BadArguments("--size: from 4KiB to 256MiB")
    return Plan(
        counts,
        size_b,
        secs,
        core.parse_ints(rounds, "--rounds", 1, 20)[0],
        core.parse_ints(concurrency, "--concurrency", 1, 64)[0],
        restart,
    )
