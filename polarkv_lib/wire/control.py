"""Control-API request bodies: parse JSON objects into typed requests, or raise BadRequest.

Everything the manager accepts passes through here first, so the manager's core only
ever sees well-formed keys, positive sizes and bounded batches. Error messages name the
field so a caller can fix the request without reading the source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from polarkv_lib.errors import BadRequest
from polarkv_lib.keys import all_valid_keys, is_valid_ident, is_valid_key
from polarkv_lib.wire.orders import OrderResult

_HEX16 = re.compile(r"[0-9a-f]{16}")
_LEASE = re.compile(r"[0-9a-f]{16,64}")
_NODE_ID = re.compile(r"[A-Za-z0-9._:\-\[\]]{1,128}")


# Extents a restarted manager asks one slab to confirm per reply (and so the most one
# `held` list answers): a batch hashes in well under a second.
CONFIRM_BATCH = 16384


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch: int
    max_object_size: int


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def _only(obj: dict[str, Any], allowed: set[str], where: str = "body") -> None:
    """Unknown fields are refused, not ignored: a misspelt option must not pass silently."""
    for name in obj:
        if name not in allowed:
            raise BadRequest(f"{where}: unknown field {name!r:.40}")


def _field(
    body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    if name not in body:
        if default is ...:
            raise BadRequest(f"'{name}' is required")
        return default
    value = body[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        expected = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise BadRequest(f"'{name}' must be {expected}, got {type(value).__name__}")
    return value


def _batch(
    body: dict[str, Any],
    name: str,
    limits: Limits,
    allow_empty: bool = False,
    most: int | None = None,
) -> list[Any]:
    items: list[Any] = _field(body, name, list)
    if not items and not allow_empty:
        raise BadRequest(f"'{name}' must not be empty")
    most = limits.max_batch if most is None else most
    if len(items) > most:
        raise BadRequest(f"'{name}' has {len(items)} entries, the maximum is {most}", 413)
    return items


def _key(value: Any, where: str) -> str:
    if not is_valid_key(value):
        raise BadRequest(f"{where}: a key is 32 lowercase hex characters, got {value!r:.60}")
    return str(value)


def _lease(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _LEASE.fullmatch(value):
        raise BadRequest(f"{where}: not a lease id: {value!r:.60}")
    return value


def _keys(body: dict[str, Any], name: str, limits: Limits, allow_empty: bool = False) -> list[str]:
    values = _batch(body, name, limits, allow_empty)
    if all_valid_keys(values):
        return list(values)  # JSON strings already
    return [_key(k, f"{name}[{i}]") for i, k in enumerate(values)]  # raises on the first bad one


MAX_WAIT = 10.0  # seconds: a client's whole budget; a disk role's long poll


def _wait(body: dict[str, Any], default: float) -> float:
    """How long the caller is willing to wait for a reload or for room (seconds)."""
    value = _field(body, "wait", (int, float), default)
    if not 0 <= value <= MAX_WAIT:
        raise BadRequest(f"'wait' must be between 0 and {MAX_WAIT:g} seconds")
    return float(value)


def _continued(body: dict[str, Any]) -> str | None:
    """The lease of the same stream, from its previous window (`continue`)."""
    value = _field(body, "continue", (str, type(None)), None)
    return None if value is None else _lease(value, "continue")


@dataclass(frozen=True, slots=True)
class LookupRequest:
    keys: list[str]
    lease: bool
    wait: float
    resume: str | None = None  # `continue`: this stream's read lease, its last window read


def parse_lookup(body: dict[str, Any], limits: Limits) -> LookupRequest:
    _only(body, {"keys", "lease", "wait", "continue"})
    lease = _field(body, "lease", bool, True)
    resume = _continued(body)  # a probe ('lease': false) holds nothing, so continues nothing
    return LookupRequest(_keys(body, "keys", limits), lease, _wait(body, 1.0), resume)


class AllocateItem(NamedTuple):  # a tuple: 64 per request, built cheaply
    key: str
    size: int


@dataclass(frozen=True, slots=True)
class AllocateRequest:
    items: list[AllocateItem]
    wait: float
    resume: str | None = None  # `continue`: the store's write lease from its earlier windows
    more: bool = False  # more windows of the same store follow


_ALLOCATE_ITEM = frozenset({"key", "size"})
_COMMIT_ITEM = frozenset({"key", "checksum"})


def parse_allocate(body: dict[str, Any], limits: Limits) -> AllocateRequest:
    _only(body, {"items", "wait", "continue", "more"})
    items = _batch(body, "items", limits)
    out = _plain_allocate_items(items, limits)
    if out is None:  # something is wrong: the checked pass says what, at the first item
        out = _allocate_items(items, limits)
    return AllocateRequest(
        out, _wait(body, 0.0), _continued(body), _field(body, "more", bool, False)
    )


def _plain_allocate_items(items: list[Any], limits: Limits) -> list[AllocateItem] | None:
    """The items of a well-formed request, checked in a few C-level passes; None if any
    item is not plainly right (then `_allocate_items` finds and names the first)."""
    top = limits.max_object_size
    try:
        if not all(item.keys() <= _ALLOCATE_ITEM for item in items):
            return None
        out = [AllocateItem(item["key"], item["size"]) for item in items]
    except (AttributeError, KeyError):  # not an object, or a field missing
        return None
    for item in out:
        size = item.size
        if type(size) is not int or not 0 < size <= top:
            return None
    return out if all_valid_keys([item.key for item in out]) else None


def _allocate_items(items: list[Any], limits: Limits) -> list[AllocateItem]:
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"items[{i}] must be an object with 'key' and 'size'")
        _only(item, {"key", "size"}, f"items[{i}]")
        key = _key(item.get("key"), f"items[{i}].key")
        size = item.get("size")
        if not isinstance(size, int) or isinstance(size, bool):
            raise BadRequest(f"items[{i}].size must be an integer")
        if size <= 0:
            raise BadRequest(f"items[{i}].size must be > 0, got {size}")
        if size > limits.max_object_size:
            raise BadRequest(
                f"items[{i}].size {size} is above the maximum object size {limits.max_object_size}",
                413,
            )
        out.append(AllocateItem(key, size))
    return out


@dataclass(frozen=True, slots=True)
class CommitRequest:
    lease: str
    items: list[tuple[str, str]]  # (key, checksum as 16 hex chars)
    more: bool = False  # the store goes on under this lease


def parse_commit(body: dict[str, Any], limits: Limits) -> CommitRequest:
    _only(body, {"lease", "items", "more"})
    lease = _lease(_field(body, "lease", str), "lease")
    batch = _batch(body, "items", limits)
    items = _plain_commit_items(batch)
    if items is None:  # something is wrong: the checked pass says what, at the first item
        items = _commit_items(batch)
    return CommitRequest(lease, items, _field(body, "more", bool, False))


def _plain_commit_items(batch: list[Any]) -> list[tuple[str, str]] | None:
    """As `_plain_allocate_items`, for commit items."""
    try:
        if not all(item.keys() <= _COMMIT_ITEM for item in batch):
            return None
        items = [(item["key"], item["checksum"]) for item in batch]
    except (AttributeError, KeyError):
        return None
    keys, sums = zip(*items, strict=True)
    if not all_valid_keys(list(keys)):
        return None
    try:
        if not all(map(_HEX16.fullmatch, sums)):
            return None
    except TypeError:
        return None
    return items


def _commit_items(batch: list[Any]) -> list[tuple[str, str]]:
    items = []
    for i, item in enumerate(batch):
        if not isinstance(item, dict):
            raise BadRequest(f"items[{i}] must be an object with 'key' and 'checksum'")
        _only(item, {"key", "checksum"}, f"items[{i}]")
        key = _key(item.get("key"), f"items[{i}].key")
        checksum = item.get("checksum")
        if not isinstance(checksum, str) or not _HEX16.fullmatch(checksum):
            raise BadRequest(f"items[{i}].checksum must be 16 lowercase hex characters (xxh3-64)")
        items.append((key, checksum))
    return items


@dataclass(frozen=True, slots=True)
class AbortRequest:
    lease: str
    keys: list[str] | None  # None: everything still open under the lease


def parse_abort(body: dict[str, Any], limits: Limits) -> AbortRequest:
    _only(body, {"lease", "keys"})
    lease = _lease(_field(body, "lease", str), "lease")
    keys = _keys(body, "keys", limits, allow_empty=True) if "keys" in body else None
    return AbortRequest(lease, keys)


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    leases: list[str]
    corrupt: list[str]


def parse_release(body: dict[str, Any], limits: Limits) -> ReleaseRequest:
    _only(body, {"leases", "corrupt"})
    leases = [_lease(v, f"leases[{i}]") for i, v in enumerate(_batch(body, "leases", limits))]
    corrupt = _keys(body, "corrupt", limits, allow_empty=True) if "corrupt" in body else []
    return ReleaseRequest(leases, corrupt)


def parse_renew(body: dict[str, Any], limits: Limits) -> list[str]:
    _only(body, {"leases"})
    return [_lease(v, f"leases[{i}]") for i, v in enumerate(_batch(body, "leases", limits))]


def _node_id(body: dict[str, Any]) -> str:
    node_id = _field(body, "node_id", str)
    if not _NODE_ID.fullmatch(node_id):
        raise BadRequest("'node_id' must be 1-128 characters of [A-Za-z0-9._:-[]]")
    return str(node_id)


def _incarnation(body: dict[str, Any]) -> int:
    value = _field(body, "incarnation", int)
    if not 0 < value < 2**63:
        raise BadRequest("'incarnation' must be a positive 63-bit integer")
    return int(value)


@dataclass(frozen=True, slots=True)
class RegisterRequest:
    node_id: str
    incarnation: int
    address: str
    capacity: int
    shm_path: str
    host_id: str
    transports: list[str]
    disk_capacity: int

    def encode(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "address": self.address,
            "capacity": self.capacity,
            "shm_path": self.shm_path,
            "host_id": self.host_id,
            "transports": list(self.transports),
            "disk_capacity": self.disk_capacity,
        }


def parse_register(body: dict[str, Any]) -> RegisterRequest:
    _only(
        body,
        {
            "node_id",
            "incarnation",
            "address",
            "capacity",
            "shm_path",
            "host_id",
            "transports",
            "disk_capacity",
        },
    )
    address = _field(body, "address", str)
    host, _, port = address.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise BadRequest("'address' must be host:port")
    capacity = _field(body, "capacity", int)
    if not 0 < capacity < 2**50:
        raise BadRequest("'capacity' must be a positive byte count")
    transports = _field(body, "transports", list, ["tcp"])
    if not transports or not all(t in ("tcp", "shm", "rdma") for t in transports):
        raise BadRequest("'transports' must list tcp, shm or rdma")
    return RegisterRequest(
        node_id=_node_id(body),
        incarnation=_incarnation(body),
        address=address,
        capacity=capacity,
        shm_path=_field(body, "shm_path", str, ""),
        host_id=_field(body, "host_id", str, ""),
        transports=transports,
        disk_capacity=_nonnegative(body, "disk_capacity"),
    )


def _nonnegative(body: dict[str, Any], name: str) -> int:
    value = _field(body, name, int, 0)
    if not 0 <= value < 2**62:
        raise BadRequest(f"'{name}' must be a non-negative integer")
    return int(value)


@dataclass(frozen=True, slots=True)
class NodeRef:
    node_id: str
    incarnation: int

    def encode(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "incarnation": self.incarnation}


def parse_node_ref(body: dict[str, Any], extra: tuple[str, ...] = ()) -> NodeRef:
    _only(body, {"node_id", "incarnation", *extra})
    return NodeRef(_node_id(body), _incarnation(body))


def parse_confirm(
    body: dict[str, Any], limits: Limits
) -> tuple[NodeRef, list[tuple[int, str, bool]]]:
    """A slab's answers to the manager's checks of its memory extents after a restart:
    `held` lists {offset, checksum, ok} (the payload there still hashes to it)."""
    out = []
    # The answer to the manager's own question, which names up to CONFIRM_BATCH extents
    # whatever manager.max_batch is.
    held = _batch(body, "held", limits, allow_empty=True, most=CONFIRM_BATCH)
    for i, item in enumerate(held):
        where = f"held[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object with offset, checksum and ok")
        _only(item, {"offset", "checksum", "ok"}, where)
        checksum = _field(item, "checksum", str)
        if not _HEX16.fullmatch(checksum):
            raise BadRequest(f"{where}.checksum must be 16 lowercase hex characters")
        out.append((_nonnegative(item, "offset"), checksum, _field(item, "ok", bool)))
    return parse_node_ref(body, ("held",)), out


def parse_heartbeat(body: dict[str, Any]) -> tuple[NodeRef, dict[str, int]]:
    stats = _field(body, "stats", dict, {})
    if len(stats) > 256 or not all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, int) and not isinstance(v, bool)
        for k, v in stats.items()
    ):
        raise BadRequest("'stats' must map up to 256 short names to integers")
    return parse_node_ref(body, ("stats",)), stats


def parse_done(body: dict[str, Any], limits: Limits) -> tuple[NodeRef, list[OrderResult]]:
    results = [
        OrderResult.from_json(item, f"results[{i}]")
        for i, item in enumerate(_batch(body, "results", limits))
    ]
    return parse_node_ref(body, ("results",)), results


def parse_orders(body: dict[str, Any]) -> tuple[NodeRef, float]:
    return parse_node_ref(body, ("wait",)), _wait(body, 5.0)


def parse_adopt(
    body: dict[str, Any], limits: Limits
) -> tuple[NodeRef, list[tuple[str, int, str, int]]]:
    files = []
    for i, item in enumerate(_batch(body, "files", limits, allow_empty=True)):
        where = f"files[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object")
        _only(item, {"key", "size", "checksum", "file_bytes"}, where)
        size, file_bytes, checksum = item.get("size"), item.get("file_bytes"), item.get("checksum")
        for name, value in (("size", size), ("file_bytes", file_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BadRequest(f"{where}.{name} must be a positive integer")
        assert isinstance(size, int) and isinstance(file_bytes, int)
        if size > limits.max_object_size:
            raise BadRequest(f"{where}.size is above the maximum object size")
        if not isinstance(checksum, str) or not _HEX16.fullmatch(checksum):
            raise BadRequest(f"{where}.checksum must be 16 lowercase hex characters")
        key = item.get("key")
        if not is_valid_ident(key):
            raise BadRequest(f"{where}.key: not an entry's identity: {key!r:.80}")
        assert isinstance(key, str)
        files.append((key, size, checksum, file_bytes))
    return parse_node_ref(body, ("files",)), files
