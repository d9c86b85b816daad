"""Manager shards: which shard owns a key, and the list of shard URLs (DESIGN §11).

A manager started with `manager.shard=I/N` owns the keys whose first four hex digits,
read as an integer k in [0, 65536), satisfy I*65536//N <= k < (I+1)*65536//N. Keys are
hash outputs, so contiguous ranges of equal width get equal shares of the keys; and
because the range is a function of (I, N) only, every client, slab and manager computes
the same owner without asking anyone.

A slab serves every shard from one buffer: shard I manages the arena
[I*size//N, (I+1)*size//N) (rounded to pages), so no two shards ever hand out the same
bytes, and the disk budget is split the same way. See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SPACE = 65536  # the first four hex digits of a key
PAGE = 4096  # arenas start on a page: O_DIRECT offloads write straight from them
_SHARD_RE = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


@dataclass(frozen=True, slots=True)
class Shard:
    """Shard `index` of `count`; `0/1` (the default) owns every key."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.count <= SPACE:
            raise ValueError(f"shard count must be between 1 and {SPACE}, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index must be in [0, {self.count}), got {self.index}")

    @classmethod
    def parse(cls, text: object) -> Shard:
        """'1/4' -> Shard(1, 4)."""
        if isinstance(text, Shard):
            return text
        m = _SHARD_RE.fullmatch(text) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"not a shard: {text!r} (use I/N, e.g. 0/2)")
        return cls(int(m.group(1)), int(m.group(2)))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def low(self) -> int:
        return self.index * SPACE // self.count

    @property
    def high(self) -> int:
        """One past the last prefix this shard owns."""
        return (self.index + 1) * SPACE // self.count

    def owns(self, key: str) -> bool:
        return self.low <= int(key[:4], 16) < self.high

    def describe(self) -> str:
        """The range as key prefixes, for messages: '0000-7fff'."""
        return f"{self.low:04x}-{self.high - 1:04x}"

    def arena(self, size: int) -> tuple[int, int]:
        """(offset, length) of this shard's part of a buffer (or budget) of `size` bytes:
        page aligned, disjoint from every other shard's, together covering the buffer
        up to page rounding."""
        start = self.index * size // self.count // PAGE * PAGE
        end = (
            size
            if self.index == self.count - 1
            else (self.index + 1) * size // self.count // PAGE * PAGE
        )
        return start, max(0, end - start)


def shard_of(key: str, count: int) -> int:
    """The index of the shard (of `count`) that owns `key`."""
    k = int(key[:4], 16)
    index = k * count // SPACE
    # The ranges are floor(I*SPACE/N): where that rounds down, k may already belong to
    # the next shard.
    if index + 1 < count and (index + 1) * SPACE // count <= k:
        index += 1
    return index


class ShardOrderError(ValueError):
    """A manager URL list out of shard order (or naming one shard of several as the only
    manager): a configuration mistake, so raised, never turned into a miss."""


def misplaced(url: str, place: Shard, health: Mapping[str, object]) -> ShardOrderError | None:
    """The error for a URL whose manager says, in its /healthz, that it is another shard
    than its place in the URL list makes it; None if it is that shard (or does not say)."""
    said = health.get("shard")
    if not isinstance(said, str) or said == str(place):
        return None
    where = "the only manager URL" if place.count == 1 else f"shard {place} in the URL list"
    return ShardOrderError(
        f"{url} is {where} (keys {place.describe()}) but says it is shard {said} "
        f"(keys {health.get('key_range', '?')}): list every manager shard's URL, in shard order"
    )


def split_urls(value: str | Sequence[str]) -> tuple[str, ...]:
    """One URL, several separated by commas, or a list of them, in shard order."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    urls = tuple(p.strip().rstrip("/") for p in parts if p.strip())
    if not urls:
        raise ValueError("needs at least one manager URL")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"not an http(s) URL: {url!r}")
    if len(set(urls)) != len(urls):
        raise ValueError("the same manager URL is listed twice")
    return urls


def group_by_shard(keys: Sequence[str], count: int) -> dict[int, list[int]]:
    """Positions of `keys` per owning shard, each list in the keys' order."""
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(shard_of(key, count), []).append(i)
    return groups
