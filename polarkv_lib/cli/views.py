"""What the admin commands print: shard answers summed, then laid out as text tables.

Pure functions (answers in, text or dicts out), so the layout is tested without a
server. Every count a manager reports is summed over shards, except the node counts:
every slab registers with every shard, so nodes are counted once by id.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from polarkv_lib.cli.api import AdminError

# Stats fields that are not additive counts (derived here, or node counts from /v1/nodes).
NOT_SUMMED = frozenset({"nodes", "nodes_dead", "hit_rate"})


def human_bytes(n: float) -> str:
    """1536 -> '1.5KiB' (short: tables have many columns)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}B" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def used_of(used: int, capacity: int) -> str:
    if not capacity:
        return "-"
    return f"{human_bytes(used)}/{human_bytes(capacity)} {100 * used / capacity:.0f}%"


def hit_rate(stats: dict[str, Any]) -> float | None:
    asked = int(stats.get("hits", 0)) + int(stats.get("misses", 0))
    return int(stats.get("hits", 0)) / asked if asked else None


def percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def sum_stats(
    per_shard: Sequence[dict[str, Any]], nodes: Sequence[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Add up the shards' /v1/stats. `nodes` (merged, see merge_nodes) gives the node
    counts; without it the largest shard's counts stand in."""
    total: dict[str, Any] = {}
    for stats in per_shard:
        for name, value in stats.items():
            if name in NOT_SUMMED or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            total[name] = total.get(name, 0) + value
    if nodes is not None:
        total["nodes"] = sum(1 for n in nodes if n["state"] == "alive")
        total["nodes_dead"] = len(nodes) - total["nodes"]
    else:
        total["nodes"] = max((int(s.get("nodes", 0)) for s in per_shard), default=0)
        total["nodes_dead"] = max((int(s.get("nodes_dead", 0)) for s in per_shard), default=0)
    total["hit_rate"] = hit_rate(total)
    return total


NODE_SUMMED = (
    "memory_used",
    "memory_capacity",
    "keys_memory",
    "bytes_memory",
    "disk_used",
    "disk_capacity",
    "keys_disk",
)


def merge_nodes(per_shard: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per node id over all shards: what each shard holds of it summed; alive
    only where every shard that knows it says so; the freshest heartbeat."""
    merged: dict[str, dict[str, Any]] = {}
    for index, nodes in enumerate(per_shard):
        for node in nodes:
            row = merged.get(node["id"])
            if row is None:
                row = merged[node["id"]] = {**node, "shards": [index]}
                continue
            row["shards"].append(index)
            for name in NODE_SUMMED:
                row[name] = int(row.get(name, 0)) + int(node.get(name, 0))
            if node["state"] != "alive":
                row["state"] = node["state"]
            row["draining"] = bool(row.get("draining")) or bool(node.get("draining"))
            row["last_heartbeat"] = max(
                float(row.get("last_heartbeat") or 0), float(node.get("last_heartbeat") or 0)
            )
    return sorted(merged.values(), key=lambda n: (n["state"] != "alive", str(n["id"])))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to fit; numbers (and their text forms) right-aligned."""
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [
        all(_looks_numeric(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))
    ]
    lines = []
    for r in cells:
        parts = [
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _looks_numeric(text: str) -> bool:
    stripped = (
        text.replace(",", "").replace(".", "").replace("%", "").replace("/", "").replace("-", "")
    )
    return stripped.isdigit() or text == "-"


def count(n: Any) -> str:
    return f"{int(n):,}"


STATS_HEADERS = (
    "SHARD",
    "NODES",
    "MEMORY",
    "DISK",
    "KEYS MEM/DISK",
    "HIT RATE",
    "HITS MEM/DISK",
    "MISSES",
    "STORES",
    "OFFLOADS/RELOADS",
    "EVICTIONS",
    "FAILURES",
)


def stats_row(label: str, s: dict[str, Any]) -> list[str]:
    failures = int(s.get("tier_failures", 0)) + int(s.get("checksum_failures", 0))
    dead = int(s.get("nodes_dead", 0))
    return [
        label,
        f"{s.get('nodes', 0)} up" + (f" {dead} dead" if dead else ""),
        used_of(int(s.get("bytes_memory", 0)), int(s.get("capacity_memory", 0))),
        used_of(int(s.get("bytes_disk", 0)), int(s.get("capacity_disk", 0))),
        f"{count(s.get('keys_memory', 0))}/{count(s.get('keys_disk', 0))}",
        percent(hit_rate(s)),
        f"{count(s.get('hits_memory', 0))}/{count(s.get('hits_disk', 0))}",
        count(s.get("misses", 0)),
        count(s.get("commits", 0)),
        f"{count(s.get('offloads', 0))}/{count(s.get('reloads', 0))}",
        count(s.get("evictions", 0)),
        count(failures),
    ]


def stats_table(
    shards: Sequence[tuple[str, dict[str, Any] | AdminError]], total: dict[str, Any]
) -> str:
    """One row per shard, then the total; a shard that did not answer, or refused (an
    HTTP status: a wrong token is not a network fault), says so below."""
    rows: list[list[str]] = []
    failed: list[str] = []
    for url, answer in shards:
        label = url.removeprefix("http://")
        if isinstance(answer, AdminError):
            what = f"refused ({answer.status})" if answer.status else "unreachable"
            rows.append([label, what] + ["-"] * (len(STATS_HEADERS) - 2))
            failed.append(f"{what}: {answer}")
        else:
            rows.append(stats_row(label, answer))
    if len(shards) > 1:
        rows.append(stats_row("total", total))
    return "\n".join([table(STATS_HEADERS, rows), *failed])


RATE_FIELDS = (
    ("lookups", "lookups/s"),
    ("hits", "hits/s"),
    ("commits", "stores/s"),
    ("offloads", "offloads/s"),
    ("reloads", "reloads/s"),
    ("evictions", "evictions/s"),
)


def rates_line(before: dict[str, Any], after: dict[str, Any], seconds: float) -> str:
    """Per-second rates between two summed stats (the --watch view)."""
    if seconds <= 0:
        return ""
    parts = [
        f"{label} {(int(after.get(k, 0)) - int(before.get(k, 0))) / seconds:,.1f}"
        for k, label in RATE_FIELDS
    ]
    return "  ".join(parts)


NODE_HEADERS = (
    "NODE",
    "STATE",
    "ADDRESS",
    "MEMORY",
    "DISK",
    "KEYS MEM",
    "KEYS DISK",
    "HEARTBEAT",
    "SHARDS",
)


def nodes_table(nodes: Sequence[dict[str, Any]], now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = []
    for n in nodes:
        state = str(n["state"]) + (" draining" if n.get("draining") else "")
        beat = n.get("last_heartbeat")
        age = f"{max(now - float(beat), 0):.1f}s ago" if beat else "-"
        rows.append(
            [
                n["id"],
                state,
                n.get("address", ""),
                used_of(int(n.get("memory_used", 0)), int(n.get("memory_capacity", 0))),
                used_of(int(n.get("disk_used", 0)), int(n.get("disk_capacity", 0))),
                count(n.get("keys_memory", 0)),
                count(n.get("keys_disk", 0)),
                age,
                ",".join(str(s) for s in n.get("shards", [0])),
            ]
        )
    if not rows:
        return "no nodes registered"
    return table(NODE_HEADERS, rows)


def key_view(view: dict[str, Any]) -> str:
    """A key's record, one field per line."""
    rows = []
    for name, value in view.items():
        if name in ("created", "last_access") and isinstance(value, int | float) and value > 1e9:
            value = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
        elif name == "size" and isinstance(value, int):
            value = f"{value:,} ({human_bytes(value)})"
        elif isinstance(value, list):
            value = ",".join(str(v) for v in value) or "-"
        rows.append([name, value])
    return table(("FIELD", "VALUE"), rows)
