"""Control-API body parsing (polarkv_lib/wire/control.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polarkv_lib.errors import BadRequest
from polarkv_lib.wire import control
from polarkv_lib.wire.control import Limits

LIMITS = Limits(max_batch=4, max_object_size=1 << 20)
K1 = "0123456789abcdef" * 2
K2 = "f" * 32
LEASE = "0123456789abcdef"
SUM = "00112233aabbccdd"

BAD_KEYS: list[Any] = [
    K1.upper(),
    K1[:31],
    K1 + "0",
    "../etc/passwd",
    "",
    None,
    1,
    True,
    ["x"],
    {"k": K1},
    "g" * 32,
    K1[:31] + "/",
]
BAD_LEASES: list[Any] = [
    "",
    "0123456789abcde",
    "0123456789ABCDEF",
    "x" * 16,
    "0" * 65,
    None,
    12,
    True,
    "../../../../etc/x",
    " 0123456789abcdef",
]


def bad(fn: Callable[[], object], *needles: str, status: int = 400) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        fn()
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)
    assert info.value.status == status, message
    return info.value


# -- parse_body ---------------------------------------------------------------------------


def test_parse_body_object() -> None:
    assert control.parse_body(b'{"keys": ["a"], "n": 1}') == {"keys": ["a"], "n": 1}
    assert control.parse_body(b"{}") == {}


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b"\xff\xfe", b"{'a': 1}", b'{"a":1}x'])
def test_parse_body_not_json(raw: bytes) -> None:
    bad(lambda: control.parse_body(raw), "not valid JSON")


@pytest.mark.parametrize("raw", [b"[]", b'[{"keys": []}]', b"1", b'"x"', b"null", b"true"])
def test_parse_body_not_an_object(raw: bytes) -> None:
    bad(lambda: control.parse_body(raw), "JSON object")


# -- lookup -------------------------------------------------------------------------------


def test_lookup_valid() -> None:
    req = control.parse_lookup({"keys": [K1, K2]}, LIMITS)
    assert req.keys == [K1, K2]
    assert req.lease is True
    assert control.parse_lookup({"keys": [K1], "lease": False}, LIMITS).lease is False
    # a full batch is fine
    assert len(control.parse_lookup({"keys": [K1] * 4}, LIMITS).keys) == 4


def test_lookup_missing_and_wrong_types() -> None:
    bad(lambda: control.parse_lookup({}, LIMITS), "'keys'", "required")
    bad(lambda: control.parse_lookup({"keys": K1}, LIMITS), "'keys'", "list", "str")
    bad(lambda: control.parse_lookup({"keys": None}, LIMITS), "'keys'", "list")
    bad(lambda: control.parse_lookup({"keys": {K1: 1}}, LIMITS), "'keys'", "list")
    bad(lambda: control.parse_lookup({"keys": []}, LIMITS), "'keys'", "empty")


@pytest.mark.parametrize("lease", [1, 0, "true", None, []])
def test_lookup_lease_must_be_bool(lease: object) -> None:
    bad(lambda: control.parse_lookup({"keys": [K1], "lease": lease}, LIMITS), "'lease'", "bool")


def test_lookup_batch_too_large_is_413() -> None:
    bad(lambda: control.parse_lookup({"keys": [K1] * 5}, LIMITS), "'keys'", "5", "4", status=413)


@pytest.mark.parametrize("key", BAD_KEYS)
def test_lookup_bad_key_names_its_index(key: object) -> None:
    bad(lambda: control.parse_lookup({"keys": [K1, key]}, LIMITS), "keys[1]", "32 lowercase hex")


# -- allocate -----------------------------------------------------------------------------


def test_allocate_valid() -> None:
    req = control.parse_allocate(
        {"items": [{"key": K1, "size": 1}, {"key": K2, "size": LIMITS.max_object_size}]}, LIMITS
    )
    assert [(i.key, i.size) for i in req.items] == [(K1, 1), (K2, LIMITS.max_object_size)]
    assert req.wait == 0.0  # a writer does not wait for room unless it asks to


def test_allocate_batch_shape() -> None:
    bad(lambda: control.parse_allocate({}, LIMITS), "'items'", "required")
    bad(lambda: control.parse_allocate({"items": []}, LIMITS), "'items'", "empty")
    bad(lambda: control.parse_allocate({"items": {"key": K1}}, LIMITS), "'items'", "list")
    bad(
        lambda: control.parse_allocate({"items": [{"key": K1, "size": 1}] * 5}, LIMITS),
        "'items'",
        status=413,
    )


@pytest.mark.parametrize("item", [K1, [K1, 1], None, 3])
def test_allocate_item_must_be_object(item: object) -> None:
    bad(
        lambda: control.parse_allocate({"items": [{"key": K1, "size": 1}, item]}, LIMITS),
        "items[1]",
        "object",
    )


@pytest.mark.parametrize("key", BAD_KEYS)
def test_allocate_bad_key(key: object) -> None:
    bad(
        lambda: control.parse_allocate({"items": [{"key": key, "size": 1}]}, LIMITS), "items[0].key"
    )


def test_allocate_missing_key() -> None:
    bad(lambda: control.parse_allocate({"items": [{"size": 1}]}, LIMITS), "items[0].key")


@pytest.mark.parametrize("size", [True, False, 1.0, "1", None, [1]])
def test_allocate_size_must_be_int(size: object) -> None:
    bad(
        lambda: control.parse_allocate({"items": [{"key": K1, "size": size}]}, LIMITS),
        "items[0].size",
        "integer",
    )


def test_allocate_missing_size() -> None:
    bad(lambda: control.parse_allocate({"items": [{"key": K1}]}, LIMITS), "items[0].size")


@pytest.mark.parametrize("size", [0, -1, -(2**40)])
def test_allocate_size_must_be_positive(size: int) -> None:
    bad(
        lambda: control.parse_allocate({"items": [{"key": K1, "size": size}]}, LIMITS),
        "items[0].size",
        "> 0",
    )


@pytest.mark.parametrize("size", [LIMITS.max_object_size + 1, 2**63])
def test_allocate_size_above_max_is_413(size: int) -> None:
    bad(
        lambda: control.parse_allocate(
            {"items": [{"key": K2, "size": 1}, {"key": K1, "size": size}]}, LIMITS
        ),
        "items[1].size",
        str(LIMITS.max_object_size),
        status=413,
    )


# -- commit -------------------------------------------------------------------------------


def test_commit_valid() -> None:
    req = control.parse_commit(
        {
            "lease": LEASE,
            "items": [{"key": K1, "checksum": SUM}, {"key": K2, "checksum": "0" * 16}],
        },
        LIMITS,
    )
    assert req.lease == LEASE
    assert req.items == [(K1, SUM), (K2, "0" * 16)]
    # lease ids may be up to 64 hex characters
    assert (
        control.parse_commit(
            {"lease": "a" * 64, "items": [{"key": K1, "checksum": SUM}]}, LIMITS
        ).lease
        == "a" * 64
    )


@pytest.mark.parametrize("lease", BAD_LEASES)
def test_commit_bad_lease(lease: object) -> None:
    bad(
        lambda: control.parse_commit(
            {"lease": lease, "items": [{"key": K1, "checksum": SUM}]}, LIMITS
        ),
        "lease",
    )


def test_commit_missing_fields() -> None:
    bad(
        lambda: control.parse_commit({"items": [{"key": K1, "checksum": SUM}]}, LIMITS),
        "'lease'",
        "required",
    )
    bad(lambda: control.parse_commit({"lease": LEASE}, LIMITS), "'items'", "required")
    bad(lambda: control.parse_commit({"lease": LEASE, "items": []}, LIMITS), "'items'", "empty")
    bad(lambda: control.parse_commit({"lease": LEASE, "items": [K1]}, LIMITS), "items[0]", "object")
    bad(
        lambda: control.parse_commit(
            {"lease": LEASE, "items": [{"key": K1, "checksum": SUM}] * 5}, LIMITS
        ),
        "'items'",
        status=413,
    )


@pytest.mark.parametrize("key", BAD_KEYS)
def test_commit_bad_key(key: object) -> None:
    bad(
        lambda: control.parse_commit(
            {"lease": LEASE, "items": [{"key": key, "checksum": SUM}]}, LIMITS
        ),
        "items[0].key",
    )


@pytest.mark.parametrize(
    "checksum",
    [
        None,
        0,
        123456,
        SUM.upper(),
        SUM[:15],
        SUM + "0",
        "g" * 16,
        "",
        "0x" + SUM[:14],
    ],
)
def test_commit_bad_checksum(checksum: object) -> None:
    bad(
        lambda: control.parse_commit(
            {
                "lease": LEASE,
                "items": [{"key": K1, "checksum": SUM}, {"key": K2, "checksum": checksum}],
            },
            LIMITS,
        ),
        "items[1].checksum",
    )


# -- abort --------------------------------------------------------------------------------


def test_abort_valid() -> None:
    everything = control.parse_abort({"lease": LEASE}, LIMITS)
    assert everything.lease == LEASE and everything.keys is None
    assert control.parse_abort({"lease": LEASE, "keys": [K1]}, LIMITS).keys == [K1]
    # an explicit empty list means "none of them", unlike a missing list
    assert control.parse_abort({"lease": LEASE, "keys": []}, LIMITS).keys == []


@pytest.mark.parametrize("lease", BAD_LEASES)
def test_abort_bad_lease(lease: object) -> None:
    bad(lambda: control.parse_abort({"lease": lease}, LIMITS), "lease")


def test_abort_bad_keys() -> None:
    bad(lambda: control.parse_abort({"lease": LEASE, "keys": None}, LIMITS), "'keys'", "list")
    bad(lambda: control.parse_abort({"lease": LEASE, "keys": K1}, LIMITS), "'keys'", "list")
    bad(
        lambda: control.parse_abort({"lease": LEASE, "keys": [K1, "../etc/passwd"]}, LIMITS),
        "keys[1]",
    )
    bad(
        lambda: control.parse_abort({"lease": LEASE, "keys": [K1] * 5}, LIMITS),
        "'keys'",
        status=413,
    )
    bad(lambda: control.parse_abort({}, LIMITS), "'lease'", "required")


# -- release / renew ----------------------------------------------------------------------


def test_release_valid() -> None:
    req = control.parse_release({"leases": [LEASE, "b" * 32]}, LIMITS)
    assert req.leases == [LEASE, "b" * 32]
    assert req.corrupt == []
    req = control.parse_release({"leases": [LEASE], "corrupt": [K1]}, LIMITS)
    assert req.corrupt == [K1]
    assert control.parse_release({"leases": [LEASE], "corrupt": []}, LIMITS).corrupt == []


@pytest.mark.parametrize("lease", BAD_LEASES)
def test_release_bad_lease_names_its_index(lease: object) -> None:
    bad(lambda: control.parse_release({"leases": [LEASE, lease]}, LIMITS), "leases[1]")


def test_release_bad_shapes() -> None:
    bad(lambda: control.parse_release({}, LIMITS), "'leases'", "required")
    bad(lambda: control.parse_release({"leases": []}, LIMITS), "'leases'", "empty")
    bad(lambda: control.parse_release({"leases": LEASE}, LIMITS), "'leases'", "list")
    bad(lambda: control.parse_release({"leases": [LEASE] * 5}, LIMITS), "'leases'", status=413)
    bad(
        lambda: control.parse_release({"leases": [LEASE], "corrupt": [K1.upper()]}, LIMITS),
        "corrupt[0]",
    )
    bad(lambda: control.parse_release({"leases": [LEASE], "corrupt": K1}, LIMITS), "'corrupt'")
    bad(
        lambda: control.parse_release({"leases": [LEASE], "corrupt": [K1] * 5}, LIMITS),
        "'corrupt'",
        status=413,
    )


def test_renew() -> None:
    assert control.parse_renew({"leases": [LEASE, "c" * 16]}, LIMITS) == [LEASE, "c" * 16]
    bad(lambda: control.parse_renew({"leases": []}, LIMITS), "'leases'", "empty")
    bad(lambda: control.parse_renew({"leases": [LEASE, 5]}, LIMITS), "leases[1]")
    bad(lambda: control.parse_renew({"leases": [LEASE] * 5}, LIMITS), "'leases'", status=413)
    bad(lambda: control.parse_renew({}, LIMITS), "'leases'", "required")


# -- register / node refs -----------------------------------------------------------------


def register_body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "node_id": "slab-1.example:8171",
        "incarnation": 42,
        "address": "10.0.0.1:8171",
        "capacity": 1 << 30,
        "shm_path": "/dev/shm/polarkv-1",
        "host_id": "host-a",
        "transports": ["tcp", "shm"],
    }
    for name, value in changes.items():
        if value is ...:
            del body[name]
        else:
            body[name] = value
    return body


def test_register_valid_and_defaults() -> None:
    req = control.parse_register(register_body())
    assert req.node_id == "slab-1.example:8171"
    assert req.incarnation == 42
    assert req.address == "10.0.0.1:8171"
    assert req.capacity == 1 << 30
    assert req.transports == ["tcp", "shm"]
    minimal = control.parse_register(register_body(shm_path=..., host_id=..., transports=...))
    assert minimal.shm_path == "" and minimal.host_id == ""
    assert minimal.transports == ["tcp"]
    assert control.parse_register(register_body(node_id="[::1]:8171")).node_id == "[::1]:8171"
    assert control.parse_register(register_body(address="[::1]:8171")).address == "[::1]:8171"


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("node_id", ..., "'node_id'"),
        ("node_id", "", "'node_id'"),
        ("node_id", "a" * 129, "'node_id'"),
        ("node_id", "../etc/passwd", "'node_id'"),
        ("node_id", "slab 1", "'node_id'"),
        ("node_id", 7, "'node_id'"),
        ("incarnation", ..., "'incarnation'"),
        ("incarnation", 0, "'incarnation'"),
        ("incarnation", -1, "'incarnation'"),
        ("incarnation", 2**63, "'incarnation'"),
        ("incarnation", True, "'incarnation'"),
        ("incarnation", "42", "'incarnation'"),
        ("incarnation", 4.2, "'incarnation'"),
        ("address", ..., "'address'"),
        ("address", "10.0.0.1", "'address'"),
        ("address", ":8171", "'address'"),
        ("address", "host:0", "'address'"),
        ("address", "host:65536", "'address'"),
        ("address", "host:port", "'address'"),
        ("address", 8171, "'address'"),
        ("capacity", ..., "'capacity'"),
        ("capacity", 0, "'capacity'"),
        ("capacity", -4096, "'capacity'"),
        ("capacity", 2**50, "'capacity'"),
        ("capacity", True, "'capacity'"),
        ("capacity", "1GiB", "'capacity'"),
        ("transports", [], "'transports'"),
        ("transports", ["udp"], "'transports'"),
        ("transports", ["tcp", "udp"], "'transports'"),
        ("transports", "tcp", "'transports'"),
        ("shm_path", 5, "'shm_path'"),
        ("host_id", None, "'host_id'"),
    ],
)
def test_register_bad_fields(field: str, value: object, needle: str) -> None:
    bad(lambda: control.parse_register(register_body(**{field: value})), needle)


@pytest.mark.parametrize(
    "port", ["\u00b2", "\u0661\u0662", "\uff18\uff11"]
)  # ², Arabic-Indic, fullwidth
def test_register_unicode_digit_port_is_bad_request(port: str) -> None:
    bad(lambda: control.parse_register(register_body(address=f"host:{port}")), "'address'")


def test_node_ref() -> None:
    ref = control.parse_node_ref({"node_id": "n1", "incarnation": 1})
    assert (ref.node_id, ref.incarnation) == ("n1", 1)
    assert (
        control.parse_node_ref({"node_id": "n", "incarnation": 2**63 - 1}).incarnation == 2**63 - 1
    )
    bad(lambda: control.parse_node_ref({"node_id": "n1"}), "'incarnation'")
    bad(lambda: control.parse_node_ref({"incarnation": 1}), "'node_id'")
    bad(lambda: control.parse_node_ref({"node_id": "n1", "incarnation": False}), "'incarnation'")
    bad(lambda: control.parse_node_ref({"node_id": "n/1", "incarnation": 1}), "'node_id'")


def test_parse_body_then_parse_end_to_end() -> None:
    raw = b'{"items": [{"key": "%s", "size": 4096}]}' % K1.encode()
    items = control.parse_allocate(control.parse_body(raw), LIMITS).items
    assert items[0].key == K1 and items[0].size == 4096
    # a JSON float size is not an integer even if it is whole
    raw = b'{"items": [{"key": "%s", "size": 4096.0}]}' % K1.encode()
    bad(lambda: control.parse_allocate(control.parse_body(raw), LIMITS), "items[0].size")


# -- waits, disk capacity and the disk role's messages -------------------------------------


def test_wait_defaults_and_bounds() -> None:
    assert control.parse_lookup({"keys": [K1]}, LIMITS).wait == 1.0
    assert control.parse_lookup({"keys": [K1], "wait": 0}, LIMITS).wait == 0.0
    assert (
        control.parse_allocate({"items": [{"key": K1, "size": 1}], "wait": 2.5}, LIMITS).wait == 2.5
    )
    assert (
        control.parse_allocate({"items": [{"key": K1, "size": 1}], "wait": 10}, LIMITS).wait == 10.0
    )
    _, wait = control.parse_orders({"node_id": "n1", "incarnation": 1})
    assert wait == 5.0


@pytest.mark.parametrize("wait", [-0.001, 10.5, 1e9, float("inf"), float("nan"), True, "1", None])
def test_wait_out_of_range_or_wrong_type(wait: object) -> None:
    bad(lambda: control.parse_lookup({"keys": [K1], "wait": wait}, LIMITS), "'wait'")
    bad(
        lambda: control.parse_allocate({"items": [{"key": K1, "size": 1}], "wait": wait}, LIMITS),
        "'wait'",
    )
    bad(lambda: control.parse_orders({"node_id": "n1", "incarnation": 1, "wait": wait}), "'wait'")


def test_register_disk_capacity() -> None:
    assert control.parse_register(register_body()).disk_capacity == 0  # no disk role
    assert control.parse_register(register_body(disk_capacity=1 << 40)).disk_capacity == 1 << 40
    for value in (-1, 2**62, 1.5, True, "1GiB", None):
        bad(
            functools.partial(
                lambda v: control.parse_register(register_body(disk_capacity=v)), value
            ),
            "'disk_capacity'",
        )


def test_heartbeat_stats() -> None:
    ref, stats = control.parse_heartbeat(
        {"node_id": "n1", "incarnation": 3, "stats": {"offloads": 2}}
    )
    assert (ref.node_id, ref.incarnation, stats) == ("n1", 3, {"offloads": 2})
    assert control.parse_heartbeat({"node_id": "n1", "incarnation": 3})[1] == {}
    stats_values: list[object] = [
        {"x": True},
        {"x": 1.5},
        {"x" * 65: 1},
        {str(i): i for i in range(257)},
        [],
    ]
    for stats_value in stats_values:
        body = {"node_id": "n1", "incarnation": 3, "stats": stats_value}
        bad(functools.partial(control.parse_heartbeat, body), "'stats'")


def done_body(**changes: Any) -> dict[str, Any]:
    item: dict[str, Any] = {
        "op": "offload",
        "key": K1,
        "gen": 7,
        "ok": True,
        "file_bytes": 8192,
        "seconds": 0.25,
    }
    for name, value in changes.items():
        if value is ...:
            del item[name]
        else:
            item[name] = value
    return {"node_id": "n1", "incarnation": 2, "results": [item]}


def test_done_valid_and_defaults() -> None:
    ref, (r,) = control.parse_done(done_body(), LIMITS)
    assert (ref.node_id, ref.incarnation) == ("n1", 2)
    assert (r.op, r.key, r.gen, r.ok, r.reason, r.file_bytes, r.seconds) == (
        "offload",
        K1,
        7,
        True,
        "",
        8192,
        0.25,
    )
    _, (r,) = control.parse_done(
        done_body(op="reload", ok=False, reason="checksum", file_bytes=..., seconds=...), LIMITS
    )
    assert (r.op, r.ok, r.reason, r.file_bytes, r.seconds) == ("reload", False, "checksum", 0, 0.0)
    bad(
        lambda: control.parse_done({"node_id": "n1", "incarnation": 2, "results": []}, LIMITS),
        "'results'",
        "empty",
    )


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("op", "move", "results[0].op"),
        ("op", ..., "results[0].op"),
        ("ok", ..., "'ok'"),
        ("ok", 1, "'ok'"),
        ("reason", 7, "'reason'"),
        ("reason", "x" * 65, "'reason'"),
        ("gen", ..., "results[0].gen"),  # an answer must say which generation it is about
        ("gen", -1, "results[0].gen"),
        ("gen", True, "results[0].gen"),
        ("file_bytes", -1, "results[0].file_bytes"),
        ("file_bytes", 1.0, "results[0].file_bytes"),
        ("seconds", -0.5, "results[0].seconds"),
        ("seconds", "1", "results[0].seconds"),
        ("key", K1.upper(), "results[0].key"),
        ("offset", 0, "unknown field"),
    ],
)
def test_done_rejects(field: str, value: object, needle: str) -> None:
    bad(lambda: control.parse_done(done_body(**{field: value}), LIMITS), needle)


def test_done_and_adopt_batches_are_bounded() -> None:
    body = done_body()
    body["results"] = body["results"] * 5
    bad(lambda: control.parse_done(body, LIMITS), "'results'", status=413)
    files = [{"key": K1, "size": 1, "checksum": SUM, "file_bytes": 4097}] * 5
    bad(
        lambda: control.parse_adopt({"node_id": "n1", "incarnation": 1, "files": files}, LIMITS),
        "'files'",
        status=413,
    )


def test_adopt_valid() -> None:
    body = {
        "node_id": "n1",
        "incarnation": 4,
        "files": [{"key": K1, "size": 100, "checksum": SUM, "file_bytes": 4196}],
    }
    ref, files = control.parse_adopt(body, LIMITS)
    assert (ref.node_id, ref.incarnation) == ("n1", 4)
    assert files == [(K1, 100, SUM, 4196)]
    assert control.parse_adopt({"node_id": "n1", "incarnation": 4, "files": []}, LIMITS)[1] == []


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("size", 0, "files[0].size"),
        ("size", LIMITS.max_object_size + 1, "maximum object size"),
        ("size", True, "files[0].size"),
        ("file_bytes", 0, "files[0].file_bytes"),
        ("checksum", SUM.upper(), "files[0].checksum"),
        ("checksum", SUM[:15], "files[0].checksum"),
        ("key", "../" + K1[3:], "files[0].key"),
        ("path", "/tmp/x", "unknown field"),
    ],
)
def test_adopt_rejects(field: str, value: object, needle: str) -> None:
    item: dict[str, Any] = {
        "key": K1,
        "size": 100,
        "checksum": SUM,
        "file_bytes": 4196,
        field: value,
    }
    bad(
        lambda: control.parse_adopt({"node_id": "n1", "incarnation": 4, "files": [item]}, LIMITS),
        needle,
    )


def test_node_messages_refuse_unknown_fields() -> None:
    bad(lambda: control.parse_register(register_body(disk=1)), "unknown field")
    bad(
        lambda: control.parse_node_ref({"node_id": "n1", "incarnation": 1, "x": 1}), "unknown field"
    )
    bad(
        lambda: control.parse_orders({"node_id": "n1", "incarnation": 1, "files": []}),
        "unknown field",
    )


# -- the fast paths agree with the checked ones --------------------------------------------

_VALUES: list[Any] = [K1, K2, SUM, 1, 0, -1, True, 1 << 20, (1 << 20) + 1, None, "x", [K1]]
_ITEM = st.dictionaries(
    st.sampled_from(["key", "size", "checksum", "other"]), st.sampled_from(_VALUES), max_size=3
)
_ITEMS = st.lists(st.one_of(_ITEM, st.sampled_from(_VALUES)), min_size=1, max_size=4)


def _outcome(parse: Callable[[], object]) -> object:
    try:
        return parse()
    except BadRequest as exc:
        return (str(exc), exc.status)


@settings(max_examples=300, deadline=None, database=None)
@given(items=_ITEMS)
def test_allocate_and_commit_items_parse_as_the_checked_pass_does(items: list[Any]) -> None:
    """Well-formed batches take a few C-level passes; anything else the item-by-item
    pass, so a bad batch is refused with the same reason, naming the same first item."""
    assert _outcome(lambda: control.parse_allocate({"items": items}, LIMITS).items) == _outcome(
        lambda: control._allocate_items(items, LIMITS)
    )
    body = {"lease": LEASE, "items": items}
    assert _outcome(lambda: control.parse_commit(body, LIMITS).items) == _outcome(
        lambda: control._commit_items(items)
    )


@settings(max_examples=200, deadline=None, database=None)
@given(keys=st.lists(st.sampled_from([K1, K2, *BAD_KEYS[:8]]), min_size=1, max_size=4))
def test_lookup_keys_parse_as_the_checked_pass_does(keys: list[Any]) -> None:
    checked = _outcome(lambda: [control._key(k, f"keys[{i}]") for i, k in enumerate(keys)])
    assert _outcome(lambda: control.parse_lookup({"keys": keys}, LIMITS).keys) == checked
