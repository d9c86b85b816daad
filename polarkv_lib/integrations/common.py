"""What every engine adapter shares: settings from the engine's extra config, the
namespace that keeps models, dtypes, layouts and ranks apart, and the client.

Settings (DESIGN §9): `manager_url` (required), `token`, `transport`, `timeout`,
`chunk_tokens`, `namespace` (a prefix for the derived one), `connections`. A missing or
unreachable PolarKV never stops an engine: adapters built with bad settings raise at
construction (a configuration mistake), and once running every fault is a miss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polarkv_lib.client import PolarKVClient


@dataclass(frozen=True)
class AdapterSettings:
    manager_url: str
    token: str | None = None
    transport: str = "auto"
    timeout: float = 2.0
    chunk_tokens: int | None = None  # None: the adapter picks (a multiple of the block size)
    namespace: str = ""
    connections: int = 4


def settings_from_extra(extra: Mapping[str, Any] | None) -> AdapterSettings:
    """Read adapter settings from an engine's extra-config dict; ValueError if wrong."""
    extra = dict(extra or {})
    url = extra.get("manager_url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError("PolarKV: the engine's extra config needs 'manager_url' (http://host:port)")
    chunk = extra.get("chunk_tokens")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError("PolarKV: 'chunk_tokens' must be a positive integer")
    timeout = extra.get("timeout", 2.0)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError("PolarKV: 'timeout' must be a positive number of seconds")
    token = extra.get("token")
    return AdapterSettings(
        manager_url=url,
        token=str(token) if token else None,
        transport=str(extra.get("transport", "auto")),
        timeout=float(timeout),
        chunk_tokens=chunk,
        namespace=str(extra.get("namespace", "")),
        connections=int(extra.get("connections", 4)),
    )


def namespace(settings: AdapterSettings, *parts: object) -> str:
    """Everything that changes the bytes of KV goes into the namespace: model, dtype, KV
    layout, tensor-parallel rank and size, chunk size. Same tokens + other namespace ->
    other keys, so ranks and models can never read each other's KV."""
    derived = "/".join(str(p) for p in parts)
    return f"{settings.namespace}/{derived}" if settings.namespace else derived


def make_client(settings: AdapterSettings, ns: str, chunk_tokens: int) -> PolarKVClient:
    return PolarKVClient(settings.manager_url, namespace=ns, chunk_tokens=chunk_tokens,
                         token=settings.token, transport=settings.transport,
                         timeout=settings.timeout, connections=settings.connections)
