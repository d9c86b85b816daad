"""Which disk store a disk role uses (`disk.store`), chosen as uvicorn chooses its loop
and protocol: a short name from `STORES`, or an import string `"module:attr"` naming a
callable that takes the `DiskConfig` and returns a `DiskStore`.

The daemon names only its own store here; an experiment lives in its own room and is
named by the configuration that wants it (the cluster harness's global pools set
`disk.store = "polarkv_lib.cluster.remote_disk:remote_store"`), so that no room of the
daemon imports it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from polarkv_lib.config import DiskConfig
from polarkv_lib.errors import ConfigError
from polarkv_lib.node.disk import DiskStore

StoreFactory = Callable[[DiskConfig], DiskStore]

# short name -> import string
STORES: dict[str, str] = {"local": "polarkv_lib.node.disk:local_store"}


def resolve(spec: str) -> StoreFactory:
    """The factory `spec` names; a ConfigError naming `disk.store` when it names none."""
    target = STORES.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"disk.store: {spec!r} is neither a known store ({', '.join(sorted(STORES))}) "
            "nor an import string 'module:attribute'"
        )
    try:
        found: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"disk.store: cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ConfigError(f"disk.store: {module_name!r} has no {attr!r}") from None
    if not callable(found):
        raise ConfigError(f"disk.store: {target!r} is not callable")
    return cast(StoreFactory, found)


def open_store(config: DiskConfig) -> DiskStore:
    store = resolve(config.store)(config)
    if not isinstance(store, DiskStore):
        raise ConfigError(f"disk.store: {config.store!r} did not make a DiskStore")
    return store
