"""The admin API of one or several manager shards, as the terminal commands use it.

`Shards` is the narrow interface the commands are written against: a blocking call per
shard, errors turned into `AdminError` carrying the shard's URL and the HTTP status.
Keys are routed to the shard that owns them (DESIGN §11, polarkv_lib/shards.py); node
operations go to every shard, since every slab registers with every one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polarkv_lib.client.admin import AdminClient
from polarkv_lib.errors import PolarKVError
from polarkv_lib.shards import shard_of, split_urls


class AdminError(Exception):
    """A shard could not answer (unreachable) or refused (HTTP status and reason)."""

    def __init__(self, url: str, message: str, status: int = 0) -> None:
        super().__init__(message if url in message else f"{url}: {message}")
        self.url = url
        self.status = status


class Shard(AdminClient):
    """One manager's admin API, its failures raised as AdminError."""

    def __init__(
        self, url: str, token: str = "", admin_token: str = "", timeout: float = 5.0
    ) -> None:
        # Reads take the token, or the admin token when it is the only one given.
        super().__init__(url, token or admin_token, admin_token, timeout)
        self.url = url

    def call(self, method: str, path: str, body: Any = None, admin: bool = False) -> Any:
        try:
            return super().call(method, path, body, admin=admin)
        except PolarKVError as exc:
            raise AdminError(self.url, str(exc), getattr(exc, "status", 0)) from None


@dataclass(frozen=True)
class Shards:
    """All the shards of one deployment, in shard order."""

    shards: list[Shard]

    @classmethod
    def from_urls(
        cls, urls: str | list[str], token: str = "", admin_token: str = "", timeout: float = 5.0
    ) -> Shards:
        return cls([Shard(u, token, admin_token, timeout) for u in split_urls(urls)])

    def owner(self, key: str) -> Shard:
        return self.shards[shard_of(key, len(self.shards))]

    def each(self, what: str, *args: Any) -> list[tuple[Shard, Any]]:
        """Ask every shard; an AdminError takes the place of a failed shard's answer."""
        out: list[tuple[Shard, Any]] = []
        for shard in self.shards:
            try:
                out.append((shard, getattr(shard, what)(*args)))
            except AdminError as exc:
                out.append((shard, exc))
        return out
