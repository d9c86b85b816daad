"""The PolarKV client library (DESIGN §8). Importing it never imports torch.

Caches use `PolarKVClient` (blocking) or `AsyncPolarKVClient`; operators' tools use
`AdminClient`, the small blocking client of the admin API."""

from polarkv_lib.client.admin import AdminClient
from polarkv_lib.client.async_client import AsyncPolarKVClient, CallerError
from polarkv_lib.client.sync_client import PolarKVClient
from polarkv_lib.client.transfers import ClientStats, checksum
from polarkv_lib.keys import chunk_keys
from polarkv_lib.shards import ShardOrderError

__all__ = [
    "AdminClient",
    "AsyncPolarKVClient",
    "CallerError",
    "ClientStats",
    "PolarKVClient",
    "ShardOrderError",
    "checksum",
    "chunk_keys",
]
