"""Tier orders (manager -> a node's disk role) and their results (disk role -> manager).

The manager queues an `Order` per offload, reload or file deletion; the disk role long
polls `/v1/nodes/orders` and gets them as JSON objects (`Order.to_json`), decodes each
with `Order.from_json`, runs it and reports an `OrderResult` (`to_json`) to
`/v1/nodes/done`, where the manager decodes it with `OrderResult.from_json`. Both
decoders raise `BadRequest` with the offending field named, so the manager answers 400
and the disk role can log and skip a malformed order.

The disk file layout constants live here too, because both sides need them: the disk
role writes the files, and the manager books disk space for a file before it exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from polarkv_lib.errors import BadRequest
from polarkv_lib.keys import is_valid_ident

# A key file is this header, then the payload; with O_DIRECT the payload is padded to
# FILE_ALIGN. The manager books the padded size, the most a file can take.
FILE_HEADER_SIZE = 4096
FILE_ALIGN = 4096
_HEX16 = re.compile(r"[0-9a-f]{16}")


def file_bytes_bound(size: int) -> int:
    """The most disk space the file of a `size`-byte payload can take."""
    return FILE_HEADER_SIZE + -(-size // FILE_ALIGN) * FILE_ALIGN


class TierOp(StrEnum):
    OFFLOAD = "offload"  # write the memory extent to a file
    RELOAD = "reload"  # read the file into the memory extent
    DELETE = "delete"  # remove the file


def _int(obj: dict[str, Any], name: str, where: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"{where}.{name} must be a non-negative integer")
    return value


def _op(obj: dict[str, Any], where: str) -> TierOp:
    try:
        return TierOp(str(obj.get("op")))
    except ValueError:
        raise BadRequest(f"{where}.op must be one of {', '.join(TierOp)}") from None


def _key(obj: dict[str, Any], where: str) -> str:
    """An entry's identity (keys.ident): its key, and `.tenant` for a tenant's entry."""
    key = obj.get("key")
    if not isinstance(key, str) or not is_valid_ident(key):
        raise BadRequest(f"{where}.key must be 32 lowercase hex characters (and .tenant)")
    return key


@dataclass(frozen=True, slots=True)
class Order:
    """One tier order. `gen` tells this entry's orders from an older entry's of the same
    key; `offset`/`extent` name the memory extent in the node's own buffer."""

    op: TierOp
    key: str
    gen: int
    node: str
    offset: int = 0
    size: int = 0
    extent: int = 0
    checksum: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op.value,
            "key": self.key,
            "gen": self.gen,
            "node": self.node,
            "offset": self.offset,
            "size": self.size,
            "extent": self.extent,
            "checksum": self.checksum,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = "order") -> Order:
        if not isinstance(obj, dict):
            raise BadRequest(f"{where} must be an object")
        node, checksum = obj.get("node"), obj.get("checksum", "")
        if not isinstance(node, str) or not isinstance(checksum, str):
            raise BadRequest(f"{where} needs 'node' and 'checksum' strings")
        order = cls(
            _op(obj, where),
            _key(obj, where),
            _int(obj, "gen", where),
            node,
            _int(obj, "offset", where),
            _int(obj, "size", where),
            _int(obj, "extent", where),
            checksum,
        )
        if order.op is not TierOp.DELETE and (
            not _HEX16.fullmatch(checksum) or order.size <= 0 or order.extent < order.size
        ):
            raise BadRequest(
                f"{where}: an {order.op} needs a checksum and an extent that holds size"
            )
        return order


@dataclass(frozen=True, slots=True)
class OrderResult:
    """What became of one order; `file_bytes` is the file's size after an offload."""

    op: TierOp
    key: str
    gen: int
    ok: bool
    reason: str = ""
    file_bytes: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "op": self.op.value,
            "key": self.key,
            "gen": self.gen,
            "ok": self.ok,
            "seconds": self.seconds,
        }
        if self.reason:
            out["reason"] = self.reason
        if self.file_bytes:
            out["file_bytes"] = self.file_bytes
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = "result") -> OrderResult:
        if not isinstance(obj, dict):
            raise BadRequest(f"{where} must be an object")
        extra = set(obj) - {"op", "key", "gen", "ok", "reason", "file_bytes", "seconds"}
        if extra:
            raise BadRequest(f"{where}: unknown field {sorted(extra)[0]!r}")
        ok, reason, seconds = obj.get("ok"), obj.get("reason", ""), obj.get("seconds", 0.0)
        op = _op(obj, where)
        if not isinstance(ok, bool) or not isinstance(reason, str) or len(reason) > 64:
            raise BadRequest(f"{where} needs 'ok' (bool) and an optional short 'reason'")
        gen = _int(obj, "gen", where)
        file_bytes = _int(obj, "file_bytes", where) if "file_bytes" in obj else 0
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0:
            raise BadRequest(f"{where}.seconds must be a non-negative number")
        return cls(op, _key(obj, where), gen, ok, reason, file_bytes, float(seconds))
