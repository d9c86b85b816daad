"""Config parsing, precedence and validation (polarkv_lib/config.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

from polarkv_lib.config import (
    SECTIONS,
    Config,
    ManagerConfig,
    describe_keys,
    load_config,
    parse_address,
    parse_duration,
    parse_size,
    validate,
)
from polarkv_lib.errors import ConfigError

# -- parse_size ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("0", 0),
        ("123", 123),
        ("123b", 123),
        ("1k", 1000),
        ("2KB", 2000),
        ("512KiB", 512 * 1024),
        ("64MiB", 64 * 1024**2),
        ("64mib", 64 * 1024**2),
        ("3m", 3 * 1000**2),
        ("4GiB", 4 * 1024**3),
        ("1g", 1000**3),
        ("2TiB", 2 * 1024**4),
        ("1tb", 1000**4),
        ("1.5KiB", 1536),
        (" 8 MiB ", 8 * 1024**2),
    ],
)
def test_parse_size_accepts(text: object, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_exact_for_large_byte_counts() -> None:
    assert parse_size(str(2**53 + 1)) == 2**53 + 1
    assert float(2**53 + 1) != 2**53 + 1  # a float round trip would have lost the low bit
    assert parse_size(f"{2**60 + 1} B") == 2**60 + 1
    assert parse_size("1.5 KiB") == 1536
    assert parse_size("0.1 GiB") == 1024**3 // 10  # exact tenth, truncated to whole bytes


@pytest.mark.parametrize(
    "bad",
    [
        -1,
        True,
        False,
        1.5,
        None,
        [],
        "",
        "MiB",
        "-1",
        "1 XiB",
        "1e3",
        "1.2.3",
        "64 MiB MiB",
        "0x10",
    ],
)
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


# -- parse_duration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0.0),
        (5, 5.0),
        (2.5, 2.5),
        ("5", 5.0),
        ("5s", 5.0),
        ("500ms", 0.5),
        ("1m", 60.0),
        ("2min", 120.0),
        ("1h", 3600.0),
        ("1.5s", 1.5),
        (" 250 ms ", 0.25),
    ],
)
def test_parse_duration_accepts(text: object, expected: float) -> None:
    got = parse_duration(text)
    assert isinstance(got, float)
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("bad", [-1, -0.5, True, None, [], "", "s", "5x", "5 days", "-5s", "1d"])
def test_parse_duration_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


# -- parse_address ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8170", ("127.0.0.1", 8170)),
        ("localhost:0", ("localhost", 0)),
        ("example.org:65535", ("example.org", 65535)),
        ("[::1]:8171", ("::1", 8171)),
    ],
)
def test_parse_address_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "8170",
        ":8170",
        "host:",
        "host:65536",
        "host:-1",
        "host:http",
        8170,
        None,
        "host:\u00b2",
        "host:\u0661\u0662",
        "host:\uff18\uff11",
    ],  # non-ASCII digits
)
def test_parse_address_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_address(bad)


# -- load_config: precedence --------------------------------------------------------------


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "polarkv.toml"
    path.write_text(text)
    return str(path)


def test_defaults_when_nothing_given() -> None:
    config = load_config(environ={})
    assert config == Config()
    assert config.manager.max_batch == 4096
    assert config.slab.transports == ("tcp", "shm")
    assert config.manager.max_object_size == 256 * 1024**2


def test_toml_overrides_defaults_and_parses_kinds(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        """
[manager]
heartbeat_ttl = "8s"
read_lease = "250ms"
max_object_size = "1MiB"
memory_high_watermark = 1
memory_low_watermark = 0.5

[slab]
memory = "64MiB"
transports = ["tcp"]
listen = "0.0.0.0:9000"

[disk]
o_direct = true
paths = ["/a", "/b"]
""",
    )
    config = load_config(path, environ={})
    assert config.manager.heartbeat_ttl == 8.0
    assert config.manager.read_lease == pytest.approx(0.25)
    assert config.manager.max_object_size == 1024**2
    assert config.manager.memory_high_watermark == 1.0
    assert config.slab.memory == 64 * 1024**2
    assert config.slab.transports == ("tcp",)
    assert config.slab.listen == "0.0.0.0:9000"
    assert config.disk.o_direct is True
    assert config.disk.paths == ("/a", "/b")
    # untouched keys keep their defaults
    assert config.manager.write_lease == 30.0
    assert config.client == Config().client


def test_precedence_defaults_file_env_set(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path, "[manager]\nwrite_lease = '8s'\nmax_batch = 10\nread_lease = '2s'\n"
    )
    env = {
        "POLARKV_MANAGER__MAX_BATCH": "20",
        "POLARKV_MANAGER__READ_LEASE": "3s",
        "POLARKV_CLIENT__CHUNK_TOKENS": "64",
    }
    config = load_config(path, overrides=["manager.read_lease=4s"], environ=env)
    assert config.manager.write_lease == 8.0  # file beats default
    assert config.manager.max_batch == 20  # env beats file
    assert config.manager.read_lease == 4.0  # --set beats env and file
    assert config.client.chunk_tokens == 64  # env beats default


def test_set_beats_env_without_file() -> None:
    config = load_config(overrides=["slab.memory=2MiB"], environ={"POLARKV_SLAB__MEMORY": "8MiB"})
    assert config.slab.memory == 2 * 1024**2


def test_env_list_and_bool_forms() -> None:
    config = load_config(
        environ={
            "POLARKV_SLAB__TRANSPORTS": "tcp, rdma",
            "POLARKV_DISK__PATHS": '["/x", "/y"]',
            "POLARKV_DISK__O_DIRECT": "yes",
        }
    )
    assert config.slab.transports == ("tcp", "rdma")
    assert config.disk.paths == ("/x", "/y")
    assert config.disk.o_direct is True


def test_unrelated_env_is_ignored() -> None:
    # no double underscore, or no POLARKV_ prefix: not a config variable
    config = load_config(environ={"POLARKV_DEBUG": "1", "MANAGER__PARTITIONS": "3", "HOME": "/"})
    assert config == Config()


def test_env_none_reads_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("POLARKV_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("POLARKV_MANAGER__MAX_BATCH", "5")
    assert load_config().manager.max_batch == 5


def test_set_values_keep_text_after_first_equals() -> None:
    config = load_config(overrides=["security.token=a=b=c"], environ={})
    assert config.security.token == "a=b=c"


# -- load_config: errors name the key -----------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"environ": {"POLARKV_NOPE__X": "1"}}, "nope"),
        ({"environ": {"POLARKV_MANAGER__NOPE": "1"}}, "manager.nope"),
        ({"overrides": ["nope.x=1"]}, "nope"),
        ({"overrides": ["manager.nope=1"]}, "manager.nope"),
        ({"overrides": ["slab.memory=lots"]}, "slab.memory"),
        ({"overrides": ["manager.read_lease=soon"]}, "manager.read_lease"),
        ({"overrides": ["manager.max_batch=1.5"]}, "manager.max_batch"),
        ({"overrides": ["manager.partitions=16"]}, "manager.partitions: removed"),
        ({"overrides": ["disk.o_direct=maybe"]}, "disk.o_direct"),
        ({"overrides": ["manager.listen=nowhere"]}, "manager.listen"),
        ({"overrides": ["disk.paths=[1, 2]"]}, "disk.paths"),
        ({"overrides": ["disk.store="]}, "disk.store"),
        ({"overrides": ["disk.remote=10.0.0.2:8172"]}, "disk.remote: is read by a remote store"),
        ({"overrides": ["manager.memory_high_watermark=high"]}, "manager.memory_high_watermark"),
        ({"environ": {"POLARKV_SLAB__MEMORY": "-5"}}, "slab.memory"),
        ({"environ": {"POLARKV_MANAGER__WRITE_LEASE": "30 days"}}, "manager.write_lease"),
    ],
)
def test_errors_name_the_key(kwargs: dict[str, object], needle: str) -> None:
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)  # type: ignore[arg-type]
    assert needle in str(info.value)


def test_env_error_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="POLARKV_SLAB__MEMORY"):
        load_config(environ={"POLARKV_SLAB__MEMORY": "huge"})


@pytest.mark.parametrize("item", ["manager.max_batch", "max_batch=3", "=3", "manager=3"])
def test_malformed_set_is_rejected(item: str) -> None:
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(overrides=[item], environ={})


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[nope]\nx = 1\n", "nope"),
        ("[manager]\nnope = 1\n", "manager.nope"),
        ("[manager]\nmax_object_size = '12 parsecs'\n", "manager.max_object_size"),
        ("[manager]\nheartbeat_ttl = 'forever'\n", "manager.heartbeat_ttl"),
        ("[slab]\nmemory = -1\n", "slab.memory"),
        ("[disk]\no_direct = 3\n", "disk.o_direct"),
        ("[manager]\nmax_batch = true\n", "manager.max_batch"),
        ("manager = 3\n", "manager"),
        ("[manager\n", "not valid TOML"),
    ],
)
def test_toml_errors_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    path = write_toml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert needle in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=r"absent\.toml"):
        load_config(str(missing), environ={})


# -- validate -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["manager.max_body_size=1000"], "manager.max_body_size"),
        (["manager.metadata_flush=61s"], "manager.metadata_flush"),
        (["manager.memory_low_watermark=0.95"], "manager.memory_low_watermark"),  # low > high
        (["manager.memory_low_watermark=0"], "manager.memory_low_watermark"),
        (["manager.memory_high_watermark=1.01"], "manager.memory_high_watermark"),
        (["manager.memory_high_watermark=1.5"], "manager.memory_high_watermark"),
        (["manager.memory_high_watermark=0"], "manager.memory_high_watermark"),
        (["manager.disk_high_watermark=0"], "manager.disk_high_watermark"),
        (["manager.disk_high_watermark=1.5"], "manager.disk_high_watermark"),
        (["manager.read_lease=0"], "manager.read_lease"),
        (["manager.write_lease=0ms"], "manager.write_lease"),
        (["manager.heartbeat_ttl=0"], "manager.heartbeat_ttl"),
        (["manager.max_object_size=0"], "manager.max_object_size"),
        (["manager.max_batch=0"], "manager.max_batch"),
        (["manager.max_body_size=1023"], "manager.max_body_size"),
        (["manager.metadata_url=mysql://x"], "manager.metadata_url"),
        (["slab.memory=1000000"], "slab.memory"),
        (["slab.heartbeat_interval=0"], "slab.heartbeat_interval"),
        (["slab.transports=shm"], "slab.transports"),  # tcp is mandatory
        (["slab.transports=tcp,udp"], "slab.transports"),
        (["slab.max_connections=0"], "slab.max_connections"),
        (["slab.manager_url=ftp://x"], "slab.manager_url"),
        (["slab.advertise=nohost"], "slab.advertise"),
        (["disk.paths="], "disk.paths"),
        (["client.chunk_tokens=0"], "client.chunk_tokens"),
        (["client.transport=udp"], "client.transport"),
        (["client.timeout=0"], "client.timeout"),
        (["client.connections=0"], "client.connections"),
        (["client.manager_url=127.0.0.1:8170"], "client.manager_url"),
        (["log.format=xml"], "log.format"),
        (["log.level=verbose"], "log.level"),
    ],
)
def test_validate_range_checks(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides, environ={})
    assert str(info.value).startswith(needle)


@pytest.mark.parametrize(
    "overrides",
    [
        ["manager.memory_low_watermark=0.9", "manager.memory_high_watermark=0.9"],
        ["manager.memory_low_watermark=0.1", "manager.memory_high_watermark=1"],
        ["manager.max_batch=1"],
        ["manager.max_batch=4096"],
        ["slab.memory=1MiB"],
        ["slab.transports=tcp,shm,rdma"],
        ["slab.advertise=10.0.0.1:9000"],
        ["log.format=json", "log.level=debug"],
        ["client.transport=rdma"],
        ["manager.metadata_url=postgresql://db/polarkv"],
    ],
)
def test_validate_accepts_boundaries(overrides: list[str]) -> None:
    load_config(overrides=overrides, environ={})


def test_validate_checks_a_directly_built_config() -> None:
    bad = Config(manager=ManagerConfig(max_batch=0))
    with pytest.raises(ConfigError, match=r"manager\.max_batch"):
        validate(bad)
    validate(Config())


def test_config_is_frozen() -> None:
    config = load_config(environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.manager.max_batch = 3  # type: ignore[misc]


# -- describe_keys ------------------------------------------------------------------------


def test_describe_keys_covers_every_field() -> None:
    rows = describe_keys()
    described = {row[0] for row in rows}
    expected = {
        f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
    }
    assert described == expected
    assert len(rows) == len(described)  # no duplicates
    # every section of Config is described
    assert {f.name for f in dataclasses.fields(Config)} == set(SECTIONS)


def test_describe_keys_defaults_match_the_dataclasses() -> None:
    defaults = Config()
    for dotted, default, kind, help_text in describe_keys():
        section, key = dotted.split(".")
        assert getattr(getattr(defaults, section), key) == default, dotted
        assert kind in {
            "size",
            "duration",
            "address",
            "bool",
            "int",
            "float",
            "str",
            "list",
            "urls",
            "shard",
        }
        assert help_text.strip(), dotted


def test_every_described_key_can_be_set_to_its_default() -> None:
    # round trip: each key accepts the textual form of its default through --set
    def text(kind: str, value: object) -> str:
        if kind == "list":
            return ",".join(value)  # type: ignore[arg-type]
        if kind == "bool":
            return "true" if value else "false"
        return str(value)

    overrides = [f"{dotted}={text(kind, default)}" for dotted, default, kind, _ in describe_keys()]
    # empty strings stay empty; the round trip must reproduce the defaults
    assert load_config(overrides=overrides, environ={}) == Config()


# -- clients from a config -----------------------------------------------------------------


def test_clients_take_their_settings_from_one_config() -> None:
    from polarkv_lib.client import AsyncPolarKVClient, PolarKVClient
    from polarkv_lib.client.async_client import DEFAULTS, client_kwargs
    from polarkv_lib.config import ClientConfig

    config = load_config(
        overrides=[
            "client.timeout=7s",
            "client.window=8",
            "client.connections=2",
            "security.token=secret",
            "client.manager_url=http://127.0.0.1:9",
        ],
        environ={},
    )
    kwargs = client_kwargs(config, None)
    assert kwargs["timeout"] == 7.0 and kwargs["window"] == 8 and kwargs["token"] == "secret"
    assert client_kwargs(config, "other")["token"] == "other"  # an explicit token wins
    assert client_kwargs(ClientConfig(), None)["token"] is None
    # the constructors' defaults are the config's defaults: written once
    assert ClientConfig() == DEFAULTS
    with PolarKVClient.from_config(config, namespace="ns") as client:
        assert (client.namespace, client.chunk_tokens) == ("ns", DEFAULTS.chunk_tokens)

    async def check() -> None:
        async with AsyncPolarKVClient.from_config(config.client) as aclient:
            assert aclient.timeout == 7.0 and aclient.window == 8

    asyncio.run(check())
