"""Draining a node from the terminal: ask every shard, then watch its memory empty.

A node registers with every shard, so every shard is asked to drain it; the node is
drained when no shard holds a memory entry on it any more (the disk copies stay, and
come back when the node restarts and reports its files).
"""

from __future__ import annotations

import time
from typing import Any

from polarkv_lib.cli.api import AdminError, Shards
from polarkv_lib.progress import progress

POLL_S = 0.2


def _remaining(shards: Shards, node_id: str) -> tuple[int, int, int]:
    """(memory entries, entries being offloaded, disk keys) of `node_id` over all shards."""
    keys_memory = offloading = keys_disk = 0
    for shard in shards.shards:
        for node in shard.nodes():
            if node["id"] == node_id:
                keys_memory += int(node.get("keys_memory", 0))
                offloading += int(node.get("offloads_pending", 0))
                keys_disk += int(node.get("keys_disk", 0))
    return keys_memory, offloading, keys_disk


def drain_node(shards: Shards, node_id: str, wait: bool, timeout: float) -> dict[str, Any]:
    """Start draining `node_id` on every shard; with `wait`, return once its memory is
    empty (TimeoutError after `timeout` seconds). Raises AdminError if no shard knows it."""
    answers: list[dict[str, Any]] = []
    unknown: list[AdminError] = []
    for shard in shards.shards:
        try:
            answers.append({"url": shard.url, **shard.drain(node_id)})
        except AdminError as exc:
            if exc.status != 404:
                raise
            unknown.append(exc)
    if not answers:
        raise unknown[0]
    keys_memory, pending, keys_disk = _remaining(shards, node_id)
    if wait and (keys_memory or pending):
        deadline = time.monotonic() + timeout
        with progress(keys_memory, f"drain {node_id}", unit="keys") as bar:  # stderr
            start = keys_memory
            while keys_memory or pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"node {node_id} still holds {keys_memory} memory entries "
                        f"after {timeout:.0f}s (it keeps draining)"
                    )
                time.sleep(POLL_S)
                keys_memory, pending, keys_disk = _remaining(shards, node_id)
                bar.update(max(start - keys_memory - bar.done, 0))
    return {
        "node": node_id,
        "drained": not keys_memory and not pending,
        "keys_memory": keys_memory,
        "keys_disk": keys_disk,
        "shards": answers,
    }
