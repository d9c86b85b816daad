"""This manager's shard (DESIGN §11): which keys it may touch, and which part of each
slab's buffer and disk budget it manages.

A request naming a key outside the range is refused as a whole with 421 Misdirected
Request and `{"error": "wrong_shard: ..."}` before the core sees it, so it changes
nothing: a client or slab configured with the shard URLs in the wrong order finds out at
once instead of scattering keys over the wrong managers.

Every slab registers with every shard and reports its whole buffer; each shard manages
only its arena of it (`Shard.arena`), so the shards never hand out the same bytes and no
slab-side bookkeeping is needed. Offsets stay absolute buffer offsets, as grants, orders
and the shm transport expect. The disk budget is split the same way: each shard's disk
watermark keeps its files within its share of the node's `disk.capacity`.
"""

from __future__ import annotations

from collections.abc import Iterable

from polarkv_lib.errors import BadRequest
from polarkv_lib.shards import Shard

WRONG_SHARD_STATUS = 421  # Misdirected Request: this server is not the one for the key


class ShardGuard:
    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.sharded = shard.count > 1

    def check(self, keys: Iterable[str]) -> None:
        """Raise BadRequest (421, wrong_shard) if any key is not this shard's."""
        if not self.sharded:
            return
        for key in keys:
            if not self.shard.owns(key):
                raise BadRequest(
                    f"wrong_shard: key {key} is not in shard {self.shard} "
                    f"(keys {self.shard.describe()})",
                    WRONG_SHARD_STATUS,
                )

    def arena(self, capacity: int) -> tuple[int, int]:
        """(offset, length) of this shard's part of a slab buffer of `capacity` bytes."""
        return self.shard.arena(capacity)

    def disk_share(self, disk_capacity: int) -> int:
        return self.shard.arena(disk_capacity)[1] if self.sharded else disk_capacity
