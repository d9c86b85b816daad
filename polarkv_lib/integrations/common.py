"""What every engine adapter shares: settings from the engine's extra config, the
namespace that keeps models, dtypes, layouts and ranks apart, and the client.

Settings (DESIGN §9): `manager_url` (required), `token`, `transport`, `timeout`,
`chunk_tokens`, `namespace` (a prefix for the derived one), `connections`. A missing or
unreachable PolarKV never stops an engine: adapters built with bad settings raise at
construction (a configuration mistake: shard URLs out of order too, as far as the
managers that answer then can tell), and once running every fault is a miss.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from polarkv_lib.client import PolarKVClient
from polarkv_lib.client.async_client import DEFAULTS
from polarkv_lib.shards import split_urls

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class AdapterSettings:
    manager_url: str
    token: str | None = None
    transport: str = DEFAULTS.transport
    timeout: float = DEFAULTS.timeout
    chunk_tokens: int | None = None  # None: the adapter picks (a multiple of the block size)
    namespace: str = ""
    connections: int = DEFAULTS.connections


TOKEN_ENV = "POLARKV_SECURITY__TOKEN"  # the service's own name for security.token


def settings_from_extra(extra: Mapping[str, Any] | None) -> AdapterSettings:
    """Read adapter settings from an engine's extra-config dict; ValueError if wrong."""
    extra = dict(extra or {})
    url = extra.get("manager_url")
    try:  # one URL, or one per manager shard (a list, or comma separated), in shard order
        url = ",".join(split_urls(url if isinstance(url, list) else str(url or "")))
    except (ValueError, TypeError, AttributeError):
        raise ValueError(
            "PolarKV: the engine's extra config needs 'manager_url' (http://host:port, "
            "or a list of shard URLs)"
        ) from None
    chunk = extra.get("chunk_tokens")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError("PolarKV: 'chunk_tokens' must be a positive integer")
    timeout = extra.get("timeout", DEFAULTS.timeout)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError("PolarKV: 'timeout' must be a positive number of seconds")
    # Engines log their extra config: the token may come from the environment instead.
    token = extra.get("token") or os.environ.get(TOKEN_ENV)
    return AdapterSettings(
        manager_url=url,
        token=str(token) if token else None,
        transport=str(extra.get("transport", DEFAULTS.transport)),
        timeout=float(timeout),
        chunk_tokens=chunk,
        namespace=str(extra.get("namespace", "")),
        connections=int(extra.get("connections", DEFAULTS.connections)),
    )


def namespace(settings: AdapterSettings, *parts: object) -> str:
    """Everything that changes the bytes of KV goes into the namespace: model, dtype, KV
    layout, tensor-parallel rank and size, chunk size. Same tokens + other namespace ->
    other keys, so ranks and models can never read each other's KV."""
    derived = "/".join(str(p) for p in parts)
    return f"{settings.namespace}/{derived}" if settings.namespace else derived


def make_client(settings: AdapterSettings, ns: str, chunk_tokens: int) -> PolarKVClient:
    config = dataclasses.replace(
        DEFAULTS,
        manager_url=settings.manager_url,
        chunk_tokens=chunk_tokens,
        transport=settings.transport,
        timeout=settings.timeout,
        connections=settings.connections,
    )
    client = PolarKVClient.from_config(config, namespace=ns, token=settings.token)
    try:  # shard URLs out of order are a configuration mistake: the engine says so at start
        client.check_shards()
    except ValueError:
        client.close()
        raise
    return client


def call_or_miss(log: logging.Logger, what: str, call: Callable[[], T], miss: T) -> T:
    """Run `call`; any exception (a closed client, a backstop timeout, an engine object
    we could not describe) is logged once and answered with `miss`."""
    try:
        return call()
    except Exception as exc:  # the contract: the engine never sees our faults
        log.warning("PolarKV %s became a miss: %r", what, exc)
        return miss


def fault_is_miss(
    log: logging.Logger, miss: Callable[..., T]
) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Decorate an engine-facing method so that any fault inside it becomes the miss
    that `miss`, called with the same arguments, builds (e.g. one False per key)."""

    def decorate(method: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(method)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return method(*args, **kwargs)
            except Exception as exc:
                log.warning("PolarKV %s became a miss: %r", method.__name__, exc)
                return miss(*args, **kwargs)

        return guarded

    return decorate
