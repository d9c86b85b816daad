"""Tenants: which client token belongs to which team, and how a team's keys are kept
apart from every other team's.

`security.tenants` lists `name:token` pairs. An entry belongs to the tenant whose token
stored it: the manager files it under a key of its own, derived from the tenant's name
and the client's key, so another tenant's lookup of the same key misses and its store
creates a separate entry (with its own memory extent, file and grants). Clients never
see the derived keys: the shell maps them back in every reply. `security.tenant_quotas`
(`name:size`) caps the memory a tenant's ready entries take: past it, its own least
recently used entries leave memory first (manager/core.py). `security.token`, and
the admin token, work in the default namespace, where keys are the clients' own; so
with a single token nothing changes.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable, Iterable

DEFAULT = ""  # the namespace of security.token and the admin token
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def parse_tenants(entries: Iterable[str]) -> dict[str, str]:
    """`name:token` pairs -> {token: name}. Raises ValueError saying which entry is wrong."""
    out: dict[str, str] = {}
    names: set[str] = set()
    for entry in entries:
        name, sep, token = entry.partition(":")
        if not sep or not _NAME.fullmatch(name):
            raise ValueError(
                f"{entry.split(':')[0]!r}: each entry is name:token, the name up to "
                "64 letters, digits, '.', '_' or '-'"
            )
        if len(token) < 8:
            raise ValueError(f"tenant {name!r}: its token must be at least 8 characters")
        if name in names or token in out:
            raise ValueError(f"tenant {name!r}: names and tokens must be unique")
        names.add(name)
        out[token] = name
    return out


def parse_quotas(
    entries: Iterable[str], tenants: Iterable[str], size: Callable[[str], int]
) -> dict[str, int]:
    """`name:size` pairs -> {tenant: bytes}. Raises ValueError saying which entry is wrong."""
    known = set(tenants)
    out: dict[str, int] = {}
    for entry in entries:
        name, sep, amount = entry.partition(":")
        if not sep or name not in known:
            raise ValueError(f"{name!r}: each entry is name:size, for a tenant of security.tenants")
        out[name] = size(amount)
        if out[name] <= 0:
            raise ValueError(f"tenant {name!r}: its quota must be positive")
    return out


def scoped_key(tenant: str, key: str) -> str:
    """The key the manager files a tenant's entry under (a 32-hex key like any other, so
    tables, shards, persisted rows and disk files need no change)."""
    if tenant == DEFAULT:
        return key
    return hashlib.blake2b(f"{tenant}\0{key}".encode(), digest_size=16).hexdigest()


class Tenants:
    def __init__(self, entries: Iterable[str], token: str) -> None:
        self.by_token = parse_tenants(entries)
        if token:
            self.by_token.setdefault(token, DEFAULT)

    @property
    def enabled(self) -> bool:
        return any(name != DEFAULT for name in self.by_token.values())

    def names(self) -> list[str]:
        return sorted({*self.by_token.values(), DEFAULT})

    def of(self, presented: str) -> str | None:
        """The tenant a presented token belongs to; None for none."""
        for token, name in self.by_token.items():
            if secrets.compare_digest(presented, token):
                return name
        return None


def label(tenant: str) -> str:
    return tenant or "default"
