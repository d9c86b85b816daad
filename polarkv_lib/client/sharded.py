"""The control API over several manager shards, behind the data-path calls of one.

`ShardedControl` answers lookup / allocate / commit / abort / release / renew exactly as
`ControlClient` does, so the cache client does not know how many shards there are. A
window's keys are split by owning shard (polarkv_lib.shards) and each shard gets one
request, all in flight at once: one round trip per shard per window, never one per key.

Replies are merged in key order. A lookup's hits are the longest prefix of the window
that every shard confirms: a key's shard must have hit it and every key before it in
that shard. A shard that cannot answer (down, refusing, past the deadline) simply hits
nothing, so the prefix stops at its first key and the other shards' keys before that
still load (DESIGN §11). Each shard's /healthz is asked at first contact which shard it
is; a URL out of place makes every call raise ShardOrderError (a configuration mistake,
not a fault: with the URLs misordered every shard would refuse every key as
wrong_shard, and the client would miss everything in silence). The leases of several shards travel as one composite lease
string (`0=LEASE,1=LEASE`); a shard whose hits lie past the prefix has its lease
released at once rather than holding its entries for a lease TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from polarkv_lib.client.control import ControlClient
from polarkv_lib.errors import PolarKVError
from polarkv_lib.shards import Shard, group_by_shard, split_urls

log = logging.getLogger("polarkv.client")
T = TypeVar("T")
FAILED = "shard_unavailable"  # allocate status for the keys of a shard that did not answer
# A shard that accepts and never answers is given up on once this share of the time left
# has passed, so the other shards' prefix still has time to be read (the manager's own
# server-side wait is at most half of it: client/async_client.py `_server_wait`).
SHARD_SHARE = 0.75


def _shard_deadline(deadline: float) -> float:
    now = time.monotonic()
    return now + max(0.0, deadline - now) * SHARD_SHARE


def control_for(
    manager_url: str | Sequence[str], token: str | None, breaker_interval: float = 1.0
) -> ControlClient | ShardedControl:
    """A ControlClient for one manager URL, a ShardedControl for several (shard order)."""
    urls = split_urls(manager_url)
    if len(urls) == 1:  # checked at first contact to be the only shard (0/1)
        return ControlClient(urls[0], token, breaker_interval, shard=Shard(0, 1))
    return ShardedControl(urls, token, breaker_interval)


def _join(leases: dict[int, str]) -> str | None:
    return ",".join(f"{i}={lease}" for i, lease in sorted(leases.items())) or None


def _split(lease: str | None) -> dict[int, str]:
    out: dict[int, str] = {}
    for part in (lease or "").split(","):
        index, sep, value = part.partition("=")
        if sep and index.isdigit():
            out[int(index)] = value
    return out


class ShardedControl:
    def __init__(
        self, urls: Sequence[str], token: str | None, breaker_interval: float = 1.0
    ) -> None:
        self.shards = [
            ControlClient(url, token, breaker_interval, shard=Shard(i, len(urls)))
            for i, url in enumerate(urls)
        ]
        self.base = ",".join(c.base for c in self.shards)
        self.shard_faults = 0  # shard calls that became misses
        self._pending: set[asyncio.Task[Any]] = set()

    async def check_shards(self, deadline: float) -> None:
        """Ask every shard not yet heard from which shard it is (ControlClient.check_shard):
        ShardOrderError if one is out of place; one that does not answer is checked later."""
        found = await asyncio.gather(
            *(shard.check_shards(deadline) for shard in self.shards), return_exceptions=True
        )
        for error in found:  # the first URL out of place, in list order
            if isinstance(error, BaseException):
                raise error

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(self._pending, timeout=2.0)
        for shard in self.shards:
            await shard.close()

    async def _each(self, calls: dict[int, Awaitable[T]]) -> dict[int, T]:
        """Run one call per shard at once; the shards that failed are left out."""
        indices = list(calls)
        results = await asyncio.gather(*calls.values(), return_exceptions=True)
        out: dict[int, T] = {}
        for index, result in zip(indices, results, strict=True):
            if isinstance(result, PolarKVError):
                self.shard_faults += 1
                log.debug("shard %d (%s) became a miss: %s", index, self.shards[index].base, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                out[index] = result
        return out

    def _by_shard(self, keys: Sequence[str]) -> dict[int, list[int]]:
        return group_by_shard(keys, len(self.shards))

    def _release_soon(self, leases: dict[int, str]) -> None:
        if not leases:
            return
        task = asyncio.get_running_loop().create_task(
            self._each(
                {
                    i: self.shards[i].release([lease], time.monotonic() + 2.0)
                    for i, lease in leases.items()
                }
            )
        )
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def lookup(
        self,
        keys: Sequence[str],
        deadline: float,
        wait: float = 0.0,
        lease: bool = True,
        resume: str | None = None,
    ) -> dict[str, Any]:
        groups = self._by_shard(keys)
        until = _shard_deadline(deadline)
        before = _split(resume)
        replies = await self._each(
            {
                i: self.shards[i].lookup([keys[j] for j in pos], until, wait, lease, before.get(i))
                for i, pos in groups.items()
            }
        )
        entries: list[dict[str, Any]] = []
        nodes: dict[str, Any] = {}
        rank = {j: (i, n) for i, pos in groups.items() for n, j in enumerate(pos)}
        hits = memory = 0
        for j in range(len(keys)):
            i, n = rank[j]
            reply = replies.get(i)
            if reply is None or n >= int(reply["hits"]):
                break
            hits += 1
            # in memory while every key so far is: each shard counts its own from its first
            if memory == j and n < int(reply.get("memory", 0)):
                memory += 1
            if lease:
                entries.append(reply["entries"][n])
        # The stream goes on if the shard of the first key not served stopped right there
        # at the end of a window (not at a miss).
        more = False
        if hits < len(keys):
            i, n = rank[hits]
            stop = replies.get(i)
            more = stop is not None and n == int(stop["hits"]) and bool(stop.get("more"))
        used = {rank[j][0] for j in range(hits)}
        leases = {i: r["lease"] for i, r in replies.items() if r.get("lease")}
        # Shards whose hits lie past the prefix let go at once, unless the stream goes
        # on (its next lookup takes them up again); so do shards of the stream's last
        # window that this one did not ask (what they served was read).
        keep = set(leases) if more else used
        self._release_soon({i: v for i, v in leases.items() if i not in keep})
        self._release_soon({i: v for i, v in before.items() if i not in groups})
        for i in used:
            nodes.update(replies[i].get("nodes", {}))
        return {
            "hits": hits,
            "memory": memory,
            "entries": entries,
            "nodes": nodes,
            "lease": _join({i: v for i, v in leases.items() if i in keep}),
            "more": more,
        }

    async def allocate(
        self,
        items: Sequence[tuple[str, int]],
        deadline: float,
        wait: float = 0.0,
        resume: str | None = None,
        more: bool = False,
    ) -> dict[str, Any]:
        groups = self._by_shard([key for key, _ in items])
        until = _shard_deadline(deadline)
        leases = _split(resume)
        replies = await self._each(
            {
                i: self.shards[i].allocate(
                    [items[j] for j in pos], until, wait, leases.get(i), more
                )
                for i, pos in groups.items()
            }
        )
        results: list[dict[str, Any]] = [{"key": key, "status": FAILED} for key, _ in items]
        nodes: dict[str, Any] = {}
        for i, reply in replies.items():
            for j, result in zip(groups[i], reply["results"], strict=True):
                results[j] = result
            nodes.update(reply.get("nodes", {}))
            if reply.get("lease"):
                leases[i] = reply["lease"]
            else:
                leases.pop(i, None)
        # a store's lease on shards this window did not touch goes on with it
        return {"results": results, "nodes": nodes, "lease": _join(leases)}

    async def commit(
        self, lease: str, items: Sequence[tuple[str, str]], deadline: float, more: bool = False
    ) -> dict[str, str]:
        leases = _split(lease)
        groups = self._by_shard([key for key, _ in items])
        replies = await self._each(
            {
                i: self.shards[i].commit(leases[i], [items[j] for j in pos], deadline, more)
                for i, pos in groups.items()
                if i in leases
            }
        )
        out: dict[str, str] = {}
        for reply in replies.values():
            out.update(reply)
        return out

    async def abort(self, lease: str, keys: Sequence[str], deadline: float) -> None:
        leases = _split(lease)
        await self._each(
            {
                i: self.shards[i].abort(leases[i], [keys[j] for j in pos], deadline)
                for i, pos in self._by_shard(keys).items()
                if i in leases
            }
        )

    async def release(
        self, leases: Sequence[str], deadline: float, corrupt: Sequence[str] = ()
    ) -> None:
        per: dict[int, list[str]] = {}
        for composite in leases:
            for i, value in _split(composite).items():
                per.setdefault(i, []).append(value)
        bad = {i: [corrupt[j] for j in pos] for i, pos in self._by_shard(corrupt).items()}
        await self._each(
            {
                i: self.shards[i].release(per.get(i, []), deadline, bad.get(i, []))
                for i in set(per) | set(bad)
            }
        )

    async def tiered(self, deadline: float) -> bool:
        """Whether the cluster has a disk tier: every shard knows every slab, so any
        shard that answers knows."""
        return any(
            (await self._each({i: s.tiered(deadline) for i, s in enumerate(self.shards)})).values()
        )

    async def renew(self, leases: Sequence[str], deadline: float) -> dict[str, Any]:
        per: dict[int, list[str]] = {}
        for composite in leases:
            for i, value in _split(composite).items():
                per.setdefault(i, []).append(value)
        replies = await self._each({i: self.shards[i].renew(v, deadline) for i, v in per.items()})
        return {"shards": {str(i): r for i, r in replies.items()}}
