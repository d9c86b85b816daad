"""Configuration: frozen dataclasses built from defaults, a TOML file, env and --set.

Precedence (lowest first): defaults, `--config FILE`, `POLARKV_SECTION__KEY` environment
variables, `--set section.key=value`. Every value is parsed by the kind its field declares
(size, duration, address, ...) and the whole config is validated before any role starts,
so an operator gets one line naming the bad key instead of a half-started process.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from polarkv_lib.errors import ConfigError
from polarkv_lib.shards import Shard, split_urls
from polarkv_lib.tenancy import DEFAULT, Tenants, parse_quotas, parse_tenants

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_size(value: object) -> int:
    """'64MiB' -> 67108864; bare integers are bytes."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r}")
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 512KiB, 64MiB, 4GiB)")
    return int(Fraction(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])  # exact, unlike float


def parse_duration(value: object) -> float:
    """'500ms' -> 0.5, '5s' -> 5.0; bare numbers are seconds."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"duration must not be negative: {value}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"not a duration: {value!r}")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", value)
    unit = m.group(2) if m else None
    if not m or (unit and unit not in _DURATION_UNITS):
        raise ValueError(f"not a duration: {value!r} (use e.g. 500ms, 5s, 1m)")
    return float(m.group(1)) * _DURATION_UNITS[unit or "s"]


def parse_address(value: object) -> tuple[str, int]:
    """'127.0.0.1:8170' -> ('127.0.0.1', 8170); port 0 asks the kernel for one."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"not a host:port address: {value!r}")
    host, _, port_text = value.rpartition(":")
    host = host.strip("[]")
    if (
        not host
        or not (port_text.isascii() and port_text.isdigit())
        or not 0 <= int(port_text) <= 65535
    ):
        raise ValueError(f"not a host:port address: {value!r}")
    return host, int(port_text)


def _parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in (
        "1",
        "true",
        "yes",
        "on",
        "0",
        "false",
        "no",
        "off",
    ):
        return value.lower() in ("1", "true", "yes", "on")
    raise ValueError(f"not a boolean: {value!r}")


def _parse_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"not an integer: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    raise ValueError(f"not an integer: {value!r}")


def _parse_float(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError(f"not a number: {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError(f"not a number: {value!r}")


def _parse_str(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"not a string: {value!r}")


def _parse_str_list(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        # env / --set form: comma separated, or a TOML-ish list literal
        text = value.strip()
        if text.startswith("["):
            try:
                value = tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"not a list of strings: {value!r}") from exc
        else:
            return tuple(part.strip() for part in text.split(",") if part.strip())
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"not a list of strings: {value!r}")


def _parse_urls(value: object) -> str:
    """One manager URL, several separated by commas, or a TOML array of them (shard
    order); kept as one comma-separated string, so a single URL reads as before. Whether
    they are URLs is for validate() to say."""
    return ",".join(p.strip().rstrip("/") for p in _parse_str_list(value))


def _parse_shard(value: object) -> str:
    return str(Shard.parse(value))


_PARSERS = {
    "size": parse_size,
    "duration": parse_duration,
    "address": lambda v: (parse_address(v), v)[1],
    "bool": _parse_bool,
    "int": _parse_int,
    "float": _parse_float,
    "str": _parse_str,
    "list": _parse_str_list,
    "urls": _parse_urls,
    "shard": _parse_shard,
}


def _opt(kind: str, default: Any, help: str) -> Any:
    return field(default=default, metadata={"kind": kind, "help": help})


@dataclass(frozen=True)
class ManagerConfig:
    listen: str = _opt("address", "127.0.0.1:8170", "manager HTTP address")
    shard: str = _opt("shard", "0/1", "this manager owns key range I of N (I/N; 0/1: every key)")
    shard_urls: str = _opt(
        "urls",
        "",
        "every shard's URL in shard order, as browsers reach them: the status page reads "
        "these and only these (empty: this manager alone)",
    )
    metadata_url: str = _opt(
        "str", "sqlite:///./polarkv-data/meta.db", "write-behind metadata store"
    )
    metadata_flush: float = _opt(
        "duration", 0.2, "write-behind batch interval: the loss window after a crash"
    )
    memory_high_watermark: float = _opt(
        "float", 0.90, "offload starts (fraction of a node's memory)"
    )
    memory_low_watermark: float = _opt("float", 0.80, "offload stops (fraction of a node's memory)")
    disk_high_watermark: float = _opt("float", 0.95, "disk LRU deletion starts")
    read_lease: float = _opt("duration", 5.0, "how long a lookup protects what it returned")
    write_lease: float = _opt(
        "duration", 30.0, "how long a writer may take before its space is reclaimed"
    )
    heartbeat_ttl: float = _opt("duration", 3.0, "a node silent this long is dead")
    max_object_size: int = _opt("size", 256 * 1024**2, "largest value one key may hold")
    max_batch: int = _opt("int", 4096, "most keys in one control request")
    max_body_size: int = _opt("size", 4 * 1024**2, "largest control request body")
    stream_window: int = _opt(
        "size", 64 * 1024**2, "most memory one stream takes per window of a node (reads, writes)"
    )
    header_timeout: float = _opt(
        "duration", 10.0, "a request's line and headers must arrive whole within this"
    )
    body_timeout: float = _opt("duration", 30.0, "a request's body must arrive whole within this")
    idle_timeout: float = _opt(
        "duration", 60.0, "a connection with no request for this long is closed"
    )


@dataclass(frozen=True)
class SlabConfig:
    listen: str = _opt("address", "127.0.0.1:8171", "data-plane address of this slab")
    advertise: str = _opt("str", "", "address clients dial (default: the bound listen address)")
    node_id: str = _opt("str", "", "stable node name (default: host:port of the data plane)")
    memory: int = _opt("size", 1024**3, "size of the slab buffer")
    manager_url: str = _opt(
        "urls",
        "http://127.0.0.1:8170",
        "where the slab registers: every manager shard, in shard order",
    )
    shm_dir: str = _opt(
        "str", "/dev/shm", "directory of the buffer file (tmpfs, shared with same-host clients)"
    )
    transports: tuple[str, ...] = _opt("list", ("tcp", "shm"), "transports offered to clients")
    heartbeat_interval: float = _opt("duration", 1.0, "how often the slab heartbeats the manager")
    max_connections: int = _opt("int", 256, "most concurrent data-plane connections")
    max_connections_per_peer: int = _opt(
        "int", 128, "most data-plane connections from one client host"
    )
    idle_timeout: float = _opt(
        "duration", 60.0, "a data connection silent this long between requests is closed"
    )
    frame_timeout: float = _opt("duration", 5.0, "a request header must arrive whole within this")
    send_timeout: float = _opt(
        "duration", 5.0, "a client that takes nothing of a READ's payload this long is cut off"
    )
    max_bytes_in_flight_per_peer: int = _opt(
        "size", 256 * 1024**2, "most READ bytes one client host may have not yet taken"
    )
    rdma_device: str = _opt(
        "str", "", "RDMA device for the rdma transport (empty: the first with an active port)"
    )
    rdma_port: int = _opt("int", 1, "port of the RDMA device")
    rdma_gid_index: int = _opt(
        "int", -1, "GID index for rdma (-1: the first RoCE v2 GID, else the first non-zero)"
    )
    rdma_windows: bool = _opt(
        "bool", False, "bind a memory window per grant instead of exposing the whole buffer"
    )


@dataclass(frozen=True)
class DiskConfig:
    paths: tuple[str, ...] = _opt(
        "list", ("./polarkv-data/disk",), "one or more directories, striped"
    )
    capacity: int = _opt("size", 16 * 1024**3, "disk tier budget of this node")
    o_direct: bool = _opt("bool", False, "bypass the page cache for offload/reload files")
    io_threads: int = _opt("int", 4, "parallel file operations of the disk role")
    store: str = _opt(
        "str",
        "local",
        "the disk role's store: local (files on this node's disks), or an import string "
        "module:attribute naming a callable that takes the disk section and returns a store",
    )
    remote: str = _opt(
        "str",
        "",
        "experiment only (global pools): host:port of the remote disk server that "
        "disk.store = polarkv_lib.cluster.remote_disk:remote_store reads; empty otherwise",
    )


@dataclass(frozen=True)
class ClientConfig:
    manager_url: str = _opt(
        "urls",
        "http://127.0.0.1:8170",
        "used by the client and the CLI tools: every manager shard, in shard order",
    )
    chunk_tokens: int = _opt("int", 256, "tokens per chunk")
    transport: str = _opt("str", "auto", "auto, tcp, shm or rdma")
    timeout: float = _opt("duration", 2.0, "bound on any one client operation's wait")
    connections: int = _opt("int", 4, "parallel data-plane transfers per client")
    window: int = _opt("int", 64, "chunks per control round trip of one store or load")
    breaker_interval: float = _opt("duration", 1.0, "how long an unreachable peer is not retried")


@dataclass(frozen=True)
class SecurityConfig:
    token: str = _opt("str", "", "bearer token required by the control and admin API when set")
    admin_token: str = _opt("str", "", "required for admin writes when set")
    grant_key: str = _opt(
        "str", "", "HMAC key shared by manager and slabs (empty: manager makes one)"
    )
    tenants: tuple[str, ...] = _opt(
        "list", (), "name:token of each tenant: it sees only the entries it stored"
    )
    tenant_quotas: tuple[str, ...] = _opt(
        "list", (), "name:size: memory a tenant's entries may take (none: no cap)"
    )

    @functools.cached_property
    def tenancy(self) -> Tenants:
        """The three above, parsed once: the middleware and the manager's core take it.
        Raises ConfigError naming the key (validate() asks first, at start)."""
        try:
            by_token = parse_tenants(self.tenants)
        except ValueError as exc:
            raise ConfigError(f"security.tenants: {exc}") from None
        try:
            quotas = parse_quotas(self.tenant_quotas, by_token.values(), parse_size)
        except ValueError as exc:
            raise ConfigError(f"security.tenant_quotas: {exc}") from None
        if self.token:
            by_token.setdefault(self.token, DEFAULT)
        return Tenants(by_token, quotas)


@dataclass(frozen=True)
class LogConfig:
    format: str = _opt("str", "console", "console or json")
    level: str = _opt("str", "info", "debug, info, warning or error")


@dataclass(frozen=True)
class RuntimeConfig:
    event_loop: str = _opt(
        "str",
        "auto",
        "auto (uvloop when installed), uvloop or asyncio: the event loop of each process",
    )


@dataclass(frozen=True)
class Config:
    manager: ManagerConfig = field(default_factory=ManagerConfig)
    slab: SlabConfig = field(default_factory=SlabConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    log: LogConfig = field(default_factory=LogConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


SECTIONS: dict[str, type[Any]] = {
    "manager": ManagerConfig,
    "slab": SlabConfig,
    "disk": DiskConfig,
    "client": ClientConfig,
    "security": SecurityConfig,
    "log": LogConfig,
    "runtime": RuntimeConfig,
}


def _section_fields(section: str) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


# Keys that existed once: naming one says why it went, rather than "unknown key".
REMOVED_KEYS = {
    "manager.partitions": "removed: partitions of one manager process's table changed nothing; "
    "shard the manager across processes with manager.shard (docs/OPERATIONS.md)",
}


def _apply(
    values: dict[str, dict[str, Any]], section: str, key: str, raw: object, origin: str
) -> None:
    if f"{section}.{key}" in REMOVED_KEYS:
        raise ConfigError(f"{origin}: {section}.{key}: {REMOVED_KEYS[f'{section}.{key}']}")
    if section not in SECTIONS:
        raise ConfigError(f"{origin}: unknown config section '{section}'")
    fields = _section_fields(section)
    if key not in fields:
        raise ConfigError(f"{origin}: unknown config key '{section}.{key}'")
    try:
        values.setdefault(section, {})[key] = _PARSERS[fields[key].metadata["kind"]](raw)
    except ValueError as exc:
        raise ConfigError(f"{origin}: {section}.{key}: {exc}") from None


def load_config(
    path: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build and validate the config. Raises ConfigError with one line naming the key."""
    values: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: '{section}' must be a [section] table")
            for key, raw in table.items():
                _apply(values, section, key, raw, path)
    env = os.environ if environ is None else environ
    for name, raw in sorted(env.items()):
        if name.startswith("POLARKV_") and "__" in name:
            section, _, key = name[len("POLARKV_") :].lower().partition("__")
            _apply(values, section, key, raw, f"env {name}")
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        _apply(values, section, key, raw, "--set")
    config = Config(**{s: SECTIONS[s](**kv) for s, kv in values.items()})
    validate(config)
    return config


def validate(config: Config) -> None:
    """Cross-field and range checks; raise ConfigError naming the key."""

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: {why}")

    m, s, c = config.manager, config.slab, config.client
    need(0 < m.memory_high_watermark <= 1, "manager.memory_high_watermark", "must be in (0, 1]")
    need(
        0 < m.memory_low_watermark <= m.memory_high_watermark,
        "manager.memory_low_watermark",
        "must be in (0, memory_high_watermark]",
    )
    need(0 < m.disk_high_watermark <= 1, "manager.disk_high_watermark", "must be in (0, 1]")
    need(m.read_lease > 0, "manager.read_lease", "must be > 0")
    need(m.write_lease > 0, "manager.write_lease", "must be > 0")
    need(m.heartbeat_ttl > 0, "manager.heartbeat_ttl", "must be > 0")
    need(0 < m.metadata_flush <= 60, "manager.metadata_flush", "must be in (0, 60s]")
    need(m.max_object_size > 0, "manager.max_object_size", "must be > 0")
    need(m.max_batch >= 1, "manager.max_batch", "must be >= 1")
    need(m.max_body_size >= 1024, "manager.max_body_size", "must be >= 1KiB")
    need(m.stream_window > 0, "manager.stream_window", "must be > 0")
    for key, value in (
        ("header_timeout", m.header_timeout),
        ("body_timeout", m.body_timeout),
        ("idle_timeout", m.idle_timeout),
    ):
        need(value > 0, f"manager.{key}", "must be > 0")
    if m.shard_urls:
        try:
            listed = len(split_urls(m.shard_urls))
        except ValueError as exc:
            raise ConfigError(f"manager.shard_urls: {exc}") from None
        count = Shard.parse(m.shard).count
        need(
            listed == count,
            "manager.shard_urls",
            f"lists {listed} URL(s) for {count} shard(s) (manager.shard): one per shard, in order",
        )
    need(
        m.metadata_url.startswith(("sqlite://", "postgresql://", "postgres://")),
        "manager.metadata_url",
        "must start with sqlite:// or postgresql://",
    )
    need(s.memory >= 1024**2, "slab.memory", "must be at least 1MiB")
    need(s.heartbeat_interval > 0, "slab.heartbeat_interval", "must be > 0")
    need(
        set(s.transports) <= {"tcp", "shm", "rdma"} and "tcp" in s.transports,
        "slab.transports",
        "a subset of tcp, shm, rdma that includes tcp",
    )
    need(s.max_connections >= 1, "slab.max_connections", "must be >= 1")
    need(s.max_connections_per_peer >= 1, "slab.max_connections_per_peer", "must be >= 1")
    need(s.idle_timeout > 0, "slab.idle_timeout", "must be > 0")
    need(s.frame_timeout > 0, "slab.frame_timeout", "must be > 0")
    need(s.send_timeout > 0, "slab.send_timeout", "must be > 0")
    need(s.max_bytes_in_flight_per_peer >= 1, "slab.max_bytes_in_flight_per_peer", "must be >= 1")
    need(s.rdma_port >= 1, "slab.rdma_port", "must be >= 1")
    need(s.rdma_gid_index >= -1, "slab.rdma_gid_index", "must be >= -1 (-1: automatic)")
    for key, urls in (("slab.manager_url", s.manager_url), ("client.manager_url", c.manager_url)):
        try:
            split_urls(urls)
        except ValueError as exc:
            raise ConfigError(f"{key}: must be http(s) URLs, one per shard: {exc}") from None
    # Grants of every shard must verify on every slab: one key, configured on all of them.
    shared_key = "security.grant_key, the same on every manager shard and slab"
    need(
        Shard.parse(m.shard).count == 1 or bool(config.security.grant_key),
        "manager.shard",
        f"a sharded manager needs {shared_key}",
    )
    need(
        "," not in s.manager_url or bool(config.security.grant_key),
        "slab.manager_url",
        f"several shards need {shared_key}",
    )
    if s.advertise:
        try:
            parse_address(s.advertise)
        except ValueError as exc:
            raise ConfigError(f"slab.advertise: {exc}") from None
    need(len(config.disk.paths) >= 1, "disk.paths", "needs at least one directory")
    need(config.disk.capacity >= 1024**2, "disk.capacity", "must be at least 1MiB")
    need(1 <= config.disk.io_threads <= 64, "disk.io_threads", "must be between 1 and 64")
    need(bool(config.disk.store), "disk.store", "names a store (local, or module:attribute)")
    need(
        not config.disk.remote or config.disk.store != "local",
        "disk.remote",
        "is read by a remote store only: set disk.store = "
        "polarkv_lib.cluster.remote_disk:remote_store with it",
    )
    if config.disk.remote:
        try:
            parse_address(config.disk.remote)
        except ValueError as exc:
            raise ConfigError(f"disk.remote: {exc}") from None
    tenants = config.security.tenancy.by_token
    need(
        not config.security.tenancy.enabled or bool(config.security.admin_token),
        "security.tenants",
        "tenants need security.admin_token (nodes and the admin must not share a tenant's token)",
    )
    need(
        not config.security.admin_token or config.security.admin_token not in tenants,
        "security.tenants",
        "a tenant's token is the admin token",
    )
    need(c.chunk_tokens >= 1, "client.chunk_tokens", "must be >= 1")
    need(
        c.transport in ("auto", "tcp", "shm", "rdma"), "client.transport", "auto, tcp, shm or rdma"
    )
    need(c.timeout > 0, "client.timeout", "must be > 0")
    need(c.connections >= 1, "client.connections", "must be >= 1")
    need(c.window >= 1, "client.window", "must be >= 1")
    need(config.log.format in ("console", "json"), "log.format", "console or json")
    need(
        config.runtime.event_loop in ("auto", "uvloop", "asyncio"),
        "runtime.event_loop",
        "auto, uvloop or asyncio",
    )
    need(
        config.log.level in ("debug", "info", "warning", "error"),
        "log.level",
        "debug, info, warning or error",
    )


def describe_keys() -> list[tuple[str, Any, str, str]]:
    """(dotted key, default, kind, help) for every key: used by docs and tests."""
    rows = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            rows.append((f"{section}.{f.name}", f.default, f.metadata["kind"], f.metadata["help"]))
    return rows
