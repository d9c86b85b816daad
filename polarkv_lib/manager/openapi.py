"""The OpenAPI 3 description of the manager's HTTP API.

A test checks that every route the app serves is described here (and nothing more),
and that real responses validate against these schemas, so this stays true.
"""

from __future__ import annotations

from typing import Any

from polarkv_lib import __version__
from polarkv_lib.manager.browser import CORS_PATHS
from polarkv_lib.manager.events import CAPACITY as EVENTS_CAPACITY
from polarkv_lib.manager.model import TenantStats
from polarkv_lib.manager.schemas import (
    BOOL,
    CHECKSUM,
    ERROR,
    EVENT,
    IDENT,
    INCARNATION,
    INT,
    KEY,
    KEY_PARAM,
    LEASE,
    NODE_ID,
    NODE_REF,
    NODE_VIEW,
    NONNEGATIVE,
    NULLABLE_LEASE,
    NUM,
    OFFSET,
    ORDER,
    POSITIVE,
    REGION,
    STR,
    TIER_OP,
    WAIT,
    arr,
    json_content,
    obj,
    operation,
    preflight,
)
from polarkv_lib.manager.views import STATS_KEYS
from polarkv_lib.wire.control import CONFIRM_BATCH


def _operator_paths() -> dict[str, Any]:
    """manager/ui.py: the status page, its events feed, drain, and CORS preflights."""

    def text(ctype: str, what: str) -> dict[str, Any]:
        return {
            "summary": what,
            "security": [],
            "responses": {
                "200": {"description": what, "content": {ctype: {"schema": STR}}},
                "404": json_content(ERROR, "no such file"),
            },
        }

    int_param = {"type": "integer", "minimum": 0}
    return {
        "/": {"get": text("text/html", "the status page (its numbers need the token)")},
        "/static/{name}": {
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": STR}],
            "get": text("text/javascript", "the status page's script and stylesheet"),
        },
        # the query parameters belong to GET only: the path's CORS preflight takes none
        "/v1/events": {
            "get": {
                **operation(
                    "recent events after `since`, oldest first",
                    obj({"events": arr(EVENT), "last_seq": INT}),
                    errors=(400, 401),
                ),
                "parameters": [
                    {"name": "since", "in": "query", "schema": int_param},
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": EVENTS_CAPACITY},
                    },
                ],
            }
        },
        "/v1/nodes/{node_id}/drain": {
            "parameters": [{"name": "node_id", "in": "path", "required": True, "schema": STR}],
            "post": operation(
                "stop placing writes on a node and move its memory entries out",
                obj(
                    {
                        "node": STR,
                        "draining": {"type": "boolean"},
                        "keys_memory": INT,
                        "offloads_pending": INT,
                        "keys_disk": INT,
                        "drained": {"type": "boolean"},
                    }
                ),
                body=obj({}),  # `{}`: a JSON body, as every POST has (manager/browser.py)
                errors=(400, 401, 403),
                extra={404: "no such live node"},
            ),
        },
    }


def openapi_spec(max_batch: int = 4096, max_object_size: int = 256 << 20) -> dict[str, Any]:
    """The document for a manager with these limits (each manager serves its own)."""

    def batch(items: dict[str, Any], min_items: int = 0) -> dict[str, Any]:
        return {**arr(items, min_items), "maxItems": max_batch}

    size = {"type": "integer", "minimum": 1, "maximum": max_object_size}
    key_view = obj(
        {
            "key": KEY,
            "state": {"enum": ["writing", "ready"]},
            "tiers": arr({"enum": ["memory", "disk"]}),
            "node": STR,
            "size": INT,
            "checksum": {"oneOf": [CHECKSUM, {"type": "null"}]},
            "readers": INT,
            "offloading": {"type": "boolean"},
            "reloading": {"type": "boolean"},
            "created": NUM,
            "last_access": NUM,
        }
    )
    node = obj(
        {
            "id": STR,
            "address": STR,
            "state": {"enum": ["alive", "dead"]},
            "incarnation": INT,
            "transports": arr(STR),
            "memory_used": INT,
            "memory_capacity": INT,
            "keys_memory": INT,
            "bytes_memory": INT,
            "disk_used": INT,
            "disk_capacity": INT,
            "keys_disk": INT,
            "last_heartbeat": NUM,
            "reported": {"type": "object", "additionalProperties": INT},
            "draining": {"type": "boolean"},
            "offloads_pending": INT,
        }
    )
    paths: dict[str, Any] = {
        "/healthz": {
            "get": operation(
                "liveness",
                obj(
                    {
                        "status": {"enum": ["ok"]},
                        "nodes": INT,
                        "keys_memory": INT,
                        "metadata_store": {"enum": ["ok", "retrying"]},
                        "metadata_taken_seq": INT,
                        "metadata_flushed_seq": INT,
                        "shard": STR,
                        "key_range": STR,
                        "shard_urls": arr(STR),
                    }
                ),
                errors=(),
            )
        },
        "/v1/stats": {
            "get": operation(
                "counters and sizes (and, with tenants configured, each tenant's share)",
                obj(
                    {k: INT for k in STATS_KEYS},
                    {
                        "tenants": {
                            "type": "object",
                            "description": "by tenant name; the admin sees all",
                            "additionalProperties": obj({k: INT for k in TenantStats.__slots__}),
                        }
                    },
                ),
                errors=(401,),
            )
        },
        "/v1/nodes": {
            "get": operation("slab/disk nodes", obj({"nodes": arr(node)}), errors=(401,))
        },
        "/v1/keys/{key}": {
            "parameters": KEY_PARAM,
            "get": operation(
                "where a key is", key_view, errors=(400, 401), extra={404: "no such key"}
            ),
            "delete": operation(
                "drop a key everywhere",
                obj({"deleted": KEY}),
                errors=(400, 401, 403),
                extra={404: "no such key"},
            ),
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": STR}},
                    },
                    "401": json_content(ERROR, "missing or wrong token"),
                },
            }
        },
        "/openapi.json": {"get": operation("this document", {"type": "object"}, errors=(401,))},
        "/v1/lookup": {
            "post": operation(
                "longest ready prefix of keys, with read leases and READ grants; where it "
                "reaches the disk, one window of a stream ('more': continue the lease)",
                obj(
                    {
                        "hits": INT,
                        "memory": INT,  # of the hits, from the first, in memory now
                        "lease": NULLABLE_LEASE,
                        "more": {"type": "boolean"},
                        "nodes": {"type": "object", "additionalProperties": NODE_VIEW},
                        "entries": arr(
                            obj(
                                {"key": KEY, "size": INT, "checksum": STR},
                                {
                                    k: v
                                    for k, v in REGION.items()
                                    if k not in ("key", "size", "checksum")
                                },
                            )
                        ),
                    }
                ),
                obj(
                    {"keys": batch(KEY, 1)},
                    {"lease": {"type": "boolean"}, "wait": WAIT, "continue": NULLABLE_LEASE},
                ),
            )
        },
        "/v1/allocate": {
            "post": operation(
                "first writer wins: allocate space and WRITE grants under one write lease",
                obj(
                    {
                        "lease": NULLABLE_LEASE,
                        "nodes": {"type": "object", "additionalProperties": NODE_VIEW},
                        "results": arr(
                            obj(
                                {
                                    "key": KEY,
                                    "status": {
                                        "enum": [
                                            "allocated",
                                            "exists",
                                            "in_progress",
                                            "no_space",
                                            "later",
                                        ]
                                    },
                                },
                                {k: v for k, v in REGION.items() if k != "key"},
                            )
                        ),
                    }
                ),
                obj(
                    {"items": batch(obj({"key": KEY, "size": size}), 1)},
                    {"wait": WAIT, "continue": NULLABLE_LEASE, "more": {"type": "boolean"}},
                ),
            )
        },
        "/v1/commit": {
            "post": operation(
                "write-finish: make written entries visible",
                obj(
                    {
                        "results": {
                            "type": "object",
                            "additionalProperties": {
                                "enum": ["committed", "lease_expired", "not_in_lease", "dropped"]
                            },
                        }
                    }
                ),
                obj(
                    {"lease": LEASE, "items": batch(obj({"key": KEY, "checksum": CHECKSUM}), 1)},
                    {"more": {"type": "boolean"}},
                ),
            )
        },
        "/v1/abort": {
            "post": operation(
                "give up writes and free their space",
                obj({"aborted": INT}),
                obj({"lease": LEASE}, {"keys": batch(KEY)}),
            )
        },
        "/v1/release": {
            "post": operation(
                "end read leases early; report keys whose bytes failed their checksum",
                obj({"released": INT}),
                obj({"leases": batch(LEASE, 1)}, {"corrupt": batch(KEY)}),
            )
        },
        "/v1/renew": {
            "post": operation(
                "extend read or write leases",
                obj({"renewed": arr(LEASE)}),
                obj({"leases": batch(LEASE, 1)}),
            )
        },
        "/v1/nodes/register": {
            "post": operation(
                "a slab joins (or rejoins) with its incarnation",
                obj(
                    {
                        "node_id": STR,
                        "incarnation": INT,
                        "heartbeat_ttl": NUM,
                        "manager_incarnation": INT,
                    },
                    {"grant_key": STR},
                ),
                obj(
                    {
                        "node_id": NODE_ID,
                        "incarnation": INCARNATION,
                        "address": {
                            "type": "string",
                            "pattern": "^.+:([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3})$",
                        },
                        "capacity": {"type": "integer", "minimum": 1, "maximum": 2**50 - 1},
                    },
                    {
                        "shm_path": STR,
                        "host_id": STR,
                        "transports": arr({"enum": ["tcp", "shm", "rdma"]}, 1),
                        "disk_capacity": {"type": "integer", "minimum": 0, "maximum": 2**62 - 1},
                    },
                ),
                errors=(400, 401, 403),
                extra={409: "the node id belongs to a live node under another incarnation"},
            )
        },
        "/v1/nodes/heartbeat": {
            "post": operation(
                "a slab is alive (and reports its own counters)",
                obj({"ok": {"type": "boolean"}}),
                obj(
                    {"node_id": NODE_ID, "incarnation": INCARNATION},
                    {
                        "stats": {
                            "type": "object",
                            "maxProperties": 256,
                            "propertyNames": {"maxLength": 64},
                            "additionalProperties": {
                                "type": "integer",
                                "minimum": -(2**62),
                                "maximum": 2**62,
                            },
                        }
                    },
                ),
                errors=(400, 401, 403),
                extra={404: "unknown node or incarnation: register again"},
            )
        },
        "/v1/nodes/orders": {
            "post": operation(
                "long poll of a node's disk role for offload/reload/delete orders",
                obj({"orders": arr(ORDER)}),
                obj({"node_id": NODE_ID, "incarnation": INCARNATION}, {"wait": WAIT}),
                errors=(400, 401, 403, 413),
                extra={404: "unknown node or incarnation: register again"},
            )
        },
        "/v1/nodes/done": {
            "post": operation(
                "a disk role reports finished orders",
                obj({"ok": {"type": "boolean"}}),
                obj(
                    {
                        "node_id": NODE_ID,
                        "incarnation": INCARNATION,
                        "results": batch(
                            obj(
                                {
                                    "op": TIER_OP,
                                    "key": KEY,
                                    "gen": NONNEGATIVE,
                                    "ok": {"type": "boolean"},
                                },
                                {
                                    "reason": {"type": "string", "maxLength": 64},
                                    "file_bytes": NONNEGATIVE,
                                    "seconds": {"type": "number", "minimum": 0},
                                },
                            ),
                            1,
                        ),
                    }
                ),
                errors=(400, 401, 403, 413),
                extra={404: "unknown node or incarnation: register again"},
            )
        },
        "/v1/nodes/confirm": {
            "post": operation(
                "a slab registered with a restarted manager answers which of its memory "
                "extents still hash to their entry's checksum, and gets the next to check",
                obj({"check": arr(obj({"offset": INT, "length": INT, "checksum": STR}))}),
                obj(
                    {
                        "node_id": NODE_ID,
                        "incarnation": INCARNATION,
                        "held": {
                            **arr(obj({"offset": OFFSET, "checksum": CHECKSUM, "ok": BOOL})),
                            "maxItems": CONFIRM_BATCH,  # answers the manager's own batch
                        },
                    }
                ),
                errors=(400, 401, 403, 413),
                extra={404: "unknown node or incarnation: register again"},
            )
        },
        "/v1/nodes/adopt": {
            "post": operation(
                "a restarted slab+disk reports the files it holds; they serve hits again",
                obj({"adopted": INT, "delete": arr(IDENT)}),
                obj(
                    {
                        "node_id": NODE_ID,
                        "incarnation": INCARNATION,
                        "files": batch(
                            obj(
                                {
                                    "key": IDENT,
                                    "size": size,
                                    "checksum": CHECKSUM,
                                    "file_bytes": POSITIVE,
                                }
                            )
                        ),
                    }
                ),
                errors=(400, 401, 403, 413),
                extra={404: "unknown node or incarnation, or no disk role"},
            )
        },
        "/v1/nodes/unregister": {
            "post": operation(
                "a slab leaves; its entries are dropped",
                obj({"ok": {"type": "boolean"}}),
                NODE_REF,
                errors=(400, 401, 403),
                extra={404: "unknown node or incarnation"},
            )
        },
        **_operator_paths(),
    }
    wrong_shard = json_content(
        ERROR, "wrong_shard: a key outside this manager shard's range (manager/shard.py)"
    )
    for path, method in (
        ("/v1/lookup", "post"),
        ("/v1/allocate", "post"),
        ("/v1/commit", "post"),
        ("/v1/abort", "post"),
        ("/v1/release", "post"),
        ("/v1/keys/{key}", "get"),
        ("/v1/keys/{key}", "delete"),
        ("/v1/nodes/adopt", "post"),
    ):
        paths[path][method]["responses"]["421"] = wrong_shard
    for path in CORS_PATHS:
        paths[path]["options"] = preflight()
    # Without a token (manager/browser.py): what only a foreign web page would send.
    foreign_host = json_content(
        ERROR, "no token configured and Host is not localhost or an IP address"
    )
    not_json = json_content(ERROR, "no token configured and the body is not application/json")
    for ops in paths.values():
        for method, op in ops.items():
            if method != "parameters":
                op["responses"].setdefault("403", foreign_host)
            if method == "post":
                op["responses"]["415"] = not_json
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "PolarKV manager",
            "version": __version__,
            "description": "Control and admin API of the PolarKV manager. KV bytes never pass "
            "through it: they move on the slab data plane under the grants "
            "handed out here.",
        },
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
        "paths": paths,
    }
