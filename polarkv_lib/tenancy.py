"""Tenants: which client token belongs to which team, and how a team's entries are kept
apart from every other team's (DESIGN §14).

`security.tenants` lists `name:token` pairs; `security.token` is the tenant `default`, a
tenant like any other. An entry belongs to the tenant whose token stored it, and carries
it: the manager files it under its identity (keys.ident: the client's key and the
tenant's name), persists the tenant with its row and names its file by it, so another
tenant's lookup of the same key misses and its store creates a separate entry (its own
memory extent, file and grants). No key a client can send is another tenant's identity:
a request's keys are always made its own tenant's. `security.tenant_quotas`
(`name:size`) caps the memory a tenant holds and writes: past it, its own least recently
used entries leave memory first (manager/tiering.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable

from polarkv_lib.keys import TENANT_NAME

DEFAULT = ""  # the tenant of security.token (and of the admin's requests), "default"


def parse_tenants(entries: Iterable[str]) -> dict[str, str]:
    """`name:token` pairs -> {token: name}. Raises ValueError saying which entry is wrong."""
    out: dict[str, str] = {}
    names: set[str] = set()
    for entry in entries:
        name, sep, token = entry.partition(":")
        if not sep or not TENANT_NAME.fullmatch(name):
            raise ValueError(
                f"{entry.split(':')[0]!r}: each entry is name:token, the name up to "
                "64 letters, digits, '.', '_' or '-'"
            )
        if name == "default":
            raise ValueError("'default' is security.token's tenant: give this one another name")
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


class Tenants:
    """Who is which tenant, and each one's quota: parsed once, by config.py, from
    `security.tenants`, `security.token` and `security.tenant_quotas`; the manager's
    middleware and its core take it from there."""

    def __init__(self, by_token: dict[str, str], quotas: dict[str, int] | None = None) -> None:
        self.by_token = by_token  # token -> tenant name ("" the default tenant)
        self.quotas = quotas or {}  # tenant name -> bytes it may hold and write

    @property
    def enabled(self) -> bool:
        return any(name != DEFAULT for name in self.by_token.values())

    def names(self) -> list[str]:
        """Every tenant, the default one ("") included."""
        return sorted({*self.by_token.values(), DEFAULT})

    def of(self, presented: str) -> str | None:
        """The tenant a presented token belongs to; None for none."""
        for token, name in self.by_token.items():
            if secrets.compare_digest(presented, token):
                return name
        return None


def label(tenant: str) -> str:
    return tenant or "default"
