"""The building blocks of the manager's OpenAPI document (manager/openapi.py): the
schemas of keys, leases, nodes, regions, orders, events and errors, and the helpers that
make an object, an array and an operation of them.
"""

from __future__ import annotations

from typing import Any

from polarkv_lib.manager.events import Kind
from polarkv_lib.wire.orders import TierOp

KEY = {"type": "string", "pattern": "^[0-9a-f]{32}$"}
# an entry's identity (keys.ident): its key, and `.tenant` for a tenant's entry
IDENT = {"type": "string", "pattern": "^[0-9a-f]{32}([.][A-Za-z0-9][A-Za-z0-9._-]{0,63})?$"}
BOOL = {"type": "boolean"}
OFFSET = {"type": "integer", "minimum": 0, "maximum": 2**62 - 1}
LEASE = {"type": "string", "pattern": "^[0-9a-f]{16,64}$"}
CHECKSUM = {"type": "string", "pattern": "^[0-9a-f]{16}$"}
INT = {"type": "integer"}
STR = {"type": "string"}
NUM = {"type": "number"}


def obj(
    required: dict[str, Any], optional: dict[str, Any] | None = None, additional: bool = False
) -> dict[str, Any]:
    props = {**required, **(optional or {})}
    return {
        "type": "object",
        "required": list(required),
        "properties": props,
        "additionalProperties": additional,
    }


def arr(items: dict[str, Any], min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items}


NULLABLE_LEASE = {"oneOf": [LEASE, {"type": "null"}]}
ERROR = obj({"error": STR})
NODE_ID = {"type": "string", "pattern": "^[A-Za-z0-9._:\\-\\[\\]]{1,128}$"}
INCARNATION = {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}
POSITIVE = {"type": "integer", "minimum": 1, "maximum": 2**62}  # JSON numbers stay within 64 bits
NONNEGATIVE = {"type": "integer", "minimum": 0, "maximum": 2**62}
NODE_REF = obj({"node_id": NODE_ID, "incarnation": INCARNATION})
NODE_VIEW = obj(
    {"address": STR, "shm_path": STR, "host_id": STR, "transports": arr(STR), "incarnation": INT}
)
REGION = {
    "key": KEY,
    "node": STR,
    "offset": INT,
    "size": INT,
    "checksum": STR,
    "grant": {"type": "string", "pattern": "^[0-9a-f]+$"},
}

WAIT = {"type": "number", "minimum": 0, "maximum": 10}
TIER_OP = {"enum": [op.value for op in TierOp]}
# wire.orders.Order.to_json
ORDER = obj(
    {
        "op": TIER_OP,
        "key": KEY,
        "gen": INT,
        "node": STR,
        "offset": INT,
        "size": INT,
        "extent": INT,
        "checksum": STR,
    }
)


def json_content(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def operation(
    summary: str,
    ok: dict[str, Any],
    body: dict[str, Any] | None = None,
    errors: tuple[int, ...] = (400, 401, 413),
    extra: dict[int, str] | None = None,
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": json_content(ok, "OK")}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    for code in errors:
        op["responses"][str(code)] = json_content(ERROR, "error with a reason")
    for code, why in (extra or {}).items():
        op["responses"][str(code)] = json_content(ERROR, why)
    return op


KEY_PARAM = [{"name": "key", "in": "path", "required": True, "schema": KEY}]
EVENT = obj(
    {
        "seq": INT,
        "id": INT,
        "time": NUM,
        "kind": {"enum": [k.value for k in Kind]},
        "level": {"enum": ["info", "warning", "error"]},
        "subject": STR,
        "message": STR,
        "count": INT,
    },
    additional=True,
)


def preflight() -> dict[str, Any]:
    return {
        "summary": "CORS preflight (the status page of one shard reads every shard)",
        "responses": {
            "204": {
                "description": "answered; allowed (GET with an Authorization header) only "
                "for the origins of manager.shard_urls"
            }
        },
    }
