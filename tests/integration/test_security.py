"""Attacks on the data plane with raw frames: grants kept past their entry's life.

An attacker is an ordinary client that keeps what the manager gave it (grants) after
its lease, and sends hand-made frames to the slab's tcp port. Whatever it does, it must
neither read nor overwrite the bytes of whoever holds that space next.
"""

from __future__ import annotations

import os

from polarkv_lib.client import PolarKVClient
from polarkv_lib.wire import frames
from polarkv_lib.wire.grants import Op
from tests.conftest import Cluster, http, stats, wait_for
from tests.integration.raw import key, only, post, raw, read, write

MiB = 1 << 20


def test_a_kept_read_grant_reads_nothing_of_the_next_owner_after_a_delete(cluster: Cluster) -> None:
    url = cluster.embedded(slab__memory="8MiB", slab__transports="tcp").manager_url
    mine = os.urandom(MiB)
    write(url, key(1), mine)
    held = post(url, "/v1/lookup", {"keys": [key(1)]})
    entry, address = only(held)
    assert raw(address, Op.READ, entry["grant"]) == (frames.Status.OK, mine)  # its own: fine
    post(url, "/v1/release", {"leases": [held["lease"]]})
    assert http("DELETE", f"{url}/v1/keys/{key(1)}")[0] == 200
    theirs = os.urandom(MiB)
    victim, _ = only(write(url, key(2), theirs), "results")
    assert victim["offset"] == entry["offset"]  # the same space, another owner now
    status, body = raw(address, Op.READ, entry["grant"])
    assert status is frames.Status.DENIED and theirs[:64] not in body
    assert stats(url)["keys_memory"] == 1


def test_a_kept_read_grant_reads_nothing_after_its_entry_is_evicted(cluster: Cluster) -> None:
    url = cluster.embedded(slab__memory="8MiB", slab__transports="tcp").manager_url
    write(url, key(10), os.urandom(MiB))
    held = post(url, "/v1/lookup", {"keys": [key(10)]})
    entry, address = only(held)
    post(url, "/v1/release", {"leases": [held["lease"]]})
    for i in range(11, 18):  # fill the rest of the node
        write(url, key(i), os.urandom(MiB))
    theirs = os.urandom(MiB)
    victim, _ = only(write(url, key(18), theirs), "results")  # evicts the oldest: key(10)
    assert http("GET", f"{url}/v1/keys/{key(10)}")[0] == 404
    assert victim["offset"] == entry["offset"]
    status, body = raw(address, Op.READ, entry["grant"])
    assert status is frames.Status.DENIED and theirs[:64] not in body


def test_a_kept_write_grant_cannot_overwrite_another_keys_committed_bytes(cluster: Cluster) -> None:
    url = cluster.embedded(slab__memory="8MiB", slab__transports="tcp").manager_url
    mine = write(url, key(20), os.urandom(MiB))  # allocate, write, commit: keeps the grant
    entry, address = only(mine, "results")
    assert http("DELETE", f"{url}/v1/keys/{key(20)}")[0] == 200
    theirs = os.urandom(MiB)
    victim, _ = only(write(url, key(21), theirs), "results")
    assert victim["offset"] == entry["offset"]
    status, _ = raw(address, Op.WRITE, entry["grant"], b"\xff" * MiB)
    assert status is frames.Status.DENIED
    hit = post(url, "/v1/lookup", {"keys": [key(21)]})
    assert hit["hits"] == 1 and read(url, hit, hit["entries"][0]) == theirs


def test_a_kept_write_grant_still_writes_its_own_uncommitted_entry(cluster: Cluster) -> None:
    """The fence refuses only what a newer entry holds: retrying one's own write works."""
    url = cluster.embedded(slab__memory="8MiB", slab__transports="tcp").manager_url
    reply = write(url, key(30), os.urandom(MiB), commit=False)
    entry, address = only(reply, "results")
    data = os.urandom(MiB)
    assert raw(address, Op.WRITE, entry["grant"], data) == (frames.Status.OK, b"")
    hit_before = post(url, "/v1/lookup", {"keys": [key(30)]})
    assert hit_before["hits"] == 0  # still invisible until committed


def test_registering_over_a_live_node_is_refused_and_keeps_its_entries(cluster: Cluster) -> None:
    url = cluster.embedded(slab__memory="8MiB").manager_url
    data = os.urandom(4096)
    write(url, key(40), data)
    (node,) = http("GET", f"{url}/v1/nodes")[1]["nodes"]
    for incarnation, capacity in (
        (node["incarnation"] + 1, 8 << 20),
        (node["incarnation"], 1 << 49),
    ):
        status, body = http(
            "POST",
            f"{url}/v1/nodes/register",
            {
                "node_id": node["id"],
                "incarnation": incarnation,
                "address": "10.9.9.9:9",
                "capacity": capacity,
                "transports": ["tcp"],
            },
        )
        assert status == 409 and "alive" in body["error"], body
        assert "grant_key" not in body
    hit = post(url, "/v1/lookup", {"keys": [key(40)]})
    assert hit["hits"] == 1 and read(url, hit, hit["entries"][0]) == data
    assert stats(url)["nodes"] == 1 and stats(url)["entries_lost"] == 0


def test_a_client_token_cannot_join_as_a_node(cluster: Cluster) -> None:
    url = cluster.embedded(
        security__token="client-t0ken", security__admin_token="admin-t0ken"
    ).manager_url
    status, body = http(
        "POST",
        f"{url}/v1/nodes/register",
        {
            "node_id": "intruder",
            "incarnation": 1,
            "address": "10.9.9.9:9",
            "capacity": 1 << 49,
            "transports": ["tcp"],
        },
        token="client-t0ken",
    )
    assert status == 403 and "grant_key" not in body
    assert http("GET", f"{url}/v1/stats", token="client-t0ken")[1]["nodes"] == 1


def test_a_false_corruption_report_deletes_nothing(cluster: Cluster) -> None:
    """A client token cannot DELETE; crying "corrupt" on release must not do it either."""
    url = cluster.embedded(
        slab__memory="8MiB", security__token="client-t0ken", security__admin_token="admin-t0ken"
    ).manager_url
    tok = "client-t0ken"
    data = os.urandom(MiB)
    with PolarKVClient(url, chunk_tokens=4, token=tok) as c:
        assert c.store_kv(list(range(4)), [data]) == 1
        (k,) = c.keys(list(range(4)))
    for _ in range(3):
        status, held = http("POST", f"{url}/v1/lookup", {"keys": [k]}, token=tok)
        assert status == 200 and held["hits"] == 1
        assert http(
            "POST", f"{url}/v1/release", {"leases": [held["lease"]], "corrupt": [k]}, token=tok
        ) == (200, {"released": 1})
    admin = "admin-t0ken"
    wait_for(
        lambda: http("GET", f"{url}/v1/stats", token=admin)[1]["corrupt_reports_rejected"] == 3
    )
    s = http("GET", f"{url}/v1/stats", token=admin)[1]
    assert (s["corrupt_reports"], s["checksum_failures"], s["keys_memory"]) == (3, 0, 1)
    with PolarKVClient(url, chunk_tokens=4, token=tok) as c:
        n, chunks = c.load_kv(list(range(4)))
        assert n == 4 and bytes(chunks[0]) == data


def test_a_true_corruption_report_drops_the_entry(cluster: Cluster) -> None:
    url = cluster.embedded(slab__memory="8MiB", slab__transports="tcp").manager_url
    reply = write(url, key(50), os.urandom(MiB))
    entry, address = only(reply, "results")
    # the bytes go bad in the slab's memory (the writer's own grant still reaches them)
    assert raw(address, Op.WRITE, entry["grant"], b"\x00" * MiB)[0] is frames.Status.OK
    held = post(url, "/v1/lookup", {"keys": [key(50)]})
    post(url, "/v1/release", {"leases": [held["lease"]], "corrupt": [key(50)]})
    wait_for(lambda: http("GET", f"{url}/v1/keys/{key(50)}")[0] == 404)
    s = stats(url)
    assert (s["corrupt_reports"], s["corrupt_reports_rejected"], s["checksum_failures"]) == (
        1,
        0,
        1,
    )
