"""Tenants (security.tenants): each team sees only what it stored; the admin sees all."""

from __future__ import annotations

import os
import re
import urllib.request

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, http

ADMIN, DEFAULT = "admin-t0ken", "default-t0ken"
TEAM_A, TEAM_B = "team-a-t0ken", "team-b-t0ken"
TOKENS = list(range(8))


def load(client: PolarKVClient) -> tuple[int, list[bytes]]:
    n, chunks = client.load_kv(TOKENS)
    return n, [bytes(c) for c in chunks]


def test_tenants_keep_their_entries_apart(cluster: Cluster) -> None:
    url = cluster.embedded(
        security__token=DEFAULT,
        security__admin_token=ADMIN,
        security__tenants=f"team-a:{TEAM_A},team-b:{TEAM_B}",
    ).manager_url
    mine, theirs = [os.urandom(100), os.urandom(100)], [os.urandom(100), os.urandom(100)]
    with (
        PolarKVClient(url, chunk_tokens=4, token=TEAM_A) as a,
        PolarKVClient(url, chunk_tokens=4, token=TEAM_B) as b,
        PolarKVClient(url, chunk_tokens=4, token=DEFAULT) as d,
    ):
        assert a.store_kv(TOKENS, mine) == 2
        key = a.keys(TOKENS)[0]
        assert b.keys(TOKENS)[0] == key  # the same prompt, the same key ...
        assert load(b) == (0, [])  # ... but not the same entry
        assert load(d) == (0, [])
        assert b.store_kv(TOKENS, theirs) == 2  # its own copy, not "exists"
        assert load(a) == (8, mine)
        assert load(b) == (8, theirs)
    # a tenant sees its own key, and only its own share of the stats
    assert http("GET", f"{url}/v1/keys/{key}", token=TEAM_A)[1]["key"] == key
    assert http("GET", f"{url}/v1/keys/{key}", token=DEFAULT)[0] == 404
    status, body = http("GET", f"{url}/v1/stats", token=TEAM_B)
    assert status == 200 and list(body["tenants"]) == ["team-b"]
    assert body["tenants"]["team-b"]["commits"] == 2 and body["tenants"]["team-b"]["misses"] == 2
    # the admin sees all of them
    body = http("GET", f"{url}/v1/stats", token=ADMIN)[1]
    assert set(body["tenants"]) >= {"team-a", "team-b", "default"}
    assert body["tenants"]["team-a"]["keys_memory"] == body["tenants"]["team-b"]["keys_memory"] == 2
    assert body["keys_memory"] == 4
    assert http("GET", f"{url}/v1/keys/{key}?tenant=team-a", token=ADMIN)[0] == 200
    assert http("GET", f"{url}/v1/keys/{key}?tenant=nobody", token=ADMIN)[0] == 400
    assert http("GET", f"{url}/v1/keys/{key}", token=ADMIN)[0] == 404  # the default namespace
    assert http("DELETE", f"{url}/v1/keys/{key}", token=TEAM_A)[0] == 403
    assert http("DELETE", f"{url}/v1/keys/{key}?tenant=team-b", token=ADMIN)[0] == 200
    with (
        PolarKVClient(url, chunk_tokens=4, token=TEAM_A) as a,
        PolarKVClient(url, chunk_tokens=4, token=TEAM_B) as b,
    ):
        assert load(a) == (8, mine)  # deleting b's copy left a's alone
        assert load(b) == (0, [])


def test_tenant_counters_reach_prometheus(cluster: Cluster) -> None:
    url = cluster.embedded(
        security__admin_token=ADMIN, security__tenants=f"team-a:{TEAM_A}"
    ).manager_url
    with PolarKVClient(url, chunk_tokens=4, token=TEAM_A) as a:
        assert a.store_kv(TOKENS, [os.urandom(64), os.urandom(64)]) == 2
        assert load(a)[0] == 8
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=5) as reply:
        text = reply.read().decode()
    assert re.search(r'^polarkv_tenant_hits_total\{tenant="team-a"\} 2\.0$', text, re.M), text[
        :2000
    ]
    assert re.search(r'^polarkv_tenant_keys_memory\{tenant="team-a"\} 2\.0$', text, re.M)
    # a tenant token is a client token: no node calls, no admin writes
    assert http("POST", f"{url}/v1/nodes/register", {}, token=TEAM_A)[0] == 403


def test_a_tenant_quota_caps_its_memory_not_the_others(cluster: Cluster) -> None:
    url = cluster.embedded(
        security__admin_token=ADMIN,
        security__tenants=f"team-a:{TEAM_A},team-b:{TEAM_B}",
        security__tenant_quotas="team-a:128KiB",
    ).manager_url
    chunk = 64 * 1024
    with (
        PolarKVClient(url, chunk_tokens=4, token=TEAM_A) as a,
        PolarKVClient(url, chunk_tokens=4, token=TEAM_B) as b,
    ):
        assert b.store_kv(TOKENS, [os.urandom(chunk), os.urandom(chunk)]) == 2
        first = [os.urandom(chunk), os.urandom(chunk)]
        assert a.store_kv(TOKENS, first) == 2  # at its quota
        assert a.store_kv(list(range(100, 108)), [os.urandom(chunk), os.urandom(chunk)]) == 2
        assert load(a) == (0, [])  # its older prompt made room ...
        assert load(b)[0] == 8  # ... and the other tenant kept everything
    tenants = http("GET", f"{url}/v1/stats", token=ADMIN)[1]["tenants"]
    assert (
        tenants["team-a"]["bytes_memory"] == 2 * chunk
        and tenants["team-b"]["bytes_memory"] == 2 * chunk
    )
