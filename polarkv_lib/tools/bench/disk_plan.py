"""What `polarkv bench disk` was asked to do, checked before anything starts, and its
rows."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

from polarkv_lib.tools.bench import core
from polarkv_lib.tools.bench.core import BadArguments, MiB, Pairs

CALLERS = 4  # concurrent store_kv/load_kv callers in one client, like a few engine workers
PARTS = ("store", "service", "fit", "large")
# ratio goals (fit: the paper's "about equal"; large: against the raw read of its bytes)
GOALS = {"store": 0.8, "service": 0.8, "fit": 0.9, "large": 0.8}
DISK_SLACK = 1024 * MiB  # free space left to others beyond what the bench itself needs


@dataclass(frozen=True)
class Plan:
    root: str  # the bench's temporary directory goes under this path
    sizes: list[int]
    total: int  # bytes per store-part measurement
    memory: int  # slab memory of every service
    working_set: int  # bytes the service part stores and loads per round
    threads: int
    o_direct: bool
    parts: tuple[str, ...]

    def chunks_per_prompt(self, size: int) -> int:
        """Chunks per store_kv/load_kv call. A loading prompt pins its chunks in memory
        until it has read them, so CALLERS prompts in flight must leave most of memory
        free for the reloads behind them: a quarter of memory for all of them together."""
        return max(1, min(64, self.memory // (4 * CALLERS * size)))


@dataclass
class Row(Pairs):
    """`base` is the baseline the row names (raw write, raw read, memory-only load)."""

    part: str
    size: int
    op: str
    baseline: str


def parse_plan(
    path: str,
    sizes: str,
    total: str,
    memory: str,
    working_set: str,
    threads: str,
    o_direct: bool,
    parts: str,
) -> Plan:
    size_list = core.parse_sizes(sizes, "--sizes")
    total_b, memory_b = core.parse_bytes(total, "--total"), core.parse_bytes(memory, "--memory")
    ws_b = core.parse_bytes(working_set, "--working-set")
    n_threads = core.parse_ints(threads, "--threads", 1, 64)[0]  # the range of disk.io_threads
    part_list = tuple(core.parse_choices(parts, "--parts", PARTS))
    if any(s < 64 * 1024 or s % 4096 or s > 64 * MiB for s in size_list):
        raise BadArguments(
            "--sizes: multiples of 4KiB from 64KiB to 64MiB (O_DIRECT needs whole pages)"
        )
    if total_b < max(size_list) * n_threads:
        raise BadArguments("--total: must hold at least one object per thread")
    if memory_b < 4 * CALLERS * max(size_list):
        raise BadArguments(f"--memory: at least {4 * CALLERS} objects of the largest size")
    if ws_b < 4 * memory_b:
        raise BadArguments("--working-set: at least 4x --memory, so that most of it lives on disk")
    root = os.path.abspath(path) if path else tempfile.gettempdir()
    if not os.path.isdir(root):
        raise BadArguments(f"--path: {root} is not a directory")
    plan = Plan(root, size_list, total_b, memory_b, ws_b, n_threads, o_direct, part_list)
    _check_room(plan)
    return plan


def _check_room(plan: Plan) -> None:
    """Refuse to start rather than fill a disk or /dev/shm that others share."""
    need_disk = 0
    if "store" in plan.parts:  # raw and DiskStore files of one round live together
        need_disk = max(need_disk, 2 * plan.total * 11 // 10)
    if "service" in plan.parts:  # the node's files and two sets of raw files of one round
        need_disk = max(need_disk, 3 * plan.working_set * 11 // 10)
    if "large" in plan.parts:  # 8x memory: the node's files and the raw ones
        need_disk = max(need_disk, 2 * 8 * plan.memory * 11 // 10)
    free = shutil.disk_usage(plan.root).free
    if free < need_disk + DISK_SLACK:
        raise BadArguments(
            f"--path: {plan.root} has {free // MiB} MiB free; the bench needs "
            f"{need_disk // MiB} MiB plus {DISK_SLACK // MiB} MiB to spare"
        )
    need_shm = max(
        2 * plan.total if "store" in plan.parts else 0,
        2 * plan.memory,
        9 * plan.memory * 9 // 8 if "large" in plan.parts else 0,  # the memory-only node
    )
    shm_free = shutil.disk_usage("/dev/shm").free
    if shm_free < need_shm + DISK_SLACK:
        raise BadArguments(
            f"/dev/shm has {shm_free // MiB} MiB free; the bench needs "
            f"{need_shm // MiB} MiB plus {DISK_SLACK // MiB} MiB to spare"
        )
