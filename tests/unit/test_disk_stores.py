"""`disk.store`: a short name or an import string chooses the disk role's store
(node/stores.py); a name that chooses nothing is a ConfigError naming the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from polarkv_lib.cluster.remote_disk import RemoteDiskStore
from polarkv_lib.config import DiskConfig
from polarkv_lib.errors import ConfigError
from polarkv_lib.node.disk import DiskStore
from polarkv_lib.node.stores import open_store, resolve


def test_local_is_the_default_and_makes_files_on_the_configured_paths(tmp_path: Path) -> None:
    config = DiskConfig(paths=(str(tmp_path / "a"),), capacity=1024**2)
    store = open_store(config)
    assert type(store) is DiskStore and store.paths == [str(tmp_path / "a")]
    assert store.capacity == 1024**2


def test_an_import_string_names_the_experiment_which_the_daemon_never_imports() -> None:
    config = DiskConfig(
        store="polarkv_lib.cluster.remote_disk:remote_store", remote="127.0.0.1:9", capacity=1
    )
    store = open_store(config)
    assert isinstance(store, RemoteDiskStore) and store.paths == ["remote://127.0.0.1:9"]
    store.close()


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("nvme", "neither a known store (local)"),
        ("polarkv_lib.node.disk", "neither a known store"),
        ("polarkv_lib.nowhere:store", "cannot import 'polarkv_lib.nowhere'"),
        ("polarkv_lib.node.disk:nothing", "has no 'nothing'"),
        ("polarkv_lib.node.disk:ALIGN", "is not callable"),
    ],
)
def test_a_store_that_names_nothing_is_a_config_error(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=r"disk\.store: ") as info:
        resolve(spec)
    assert needle in str(info.value)


def test_a_factory_that_makes_no_store_is_refused() -> None:
    config = dataclasses.replace(DiskConfig(), store="polarkv_lib.config:DiskConfig")
    with pytest.raises(ConfigError, match="did not make a DiskStore"):
        open_store(config)
