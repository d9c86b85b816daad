"""Bearer tokens on the control and admin API; the client with a bad token gets misses."""

from __future__ import annotations

import os

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, http

TOKEN, ADMIN = "client-secret", "admin-secret"


def test_tokens(cluster: Cluster) -> None:
    node = cluster.embedded(security__token=TOKEN, security__admin_token=ADMIN)
    url = node.manager_url
    assert http("GET", url + "/healthz")[0] == 200  # liveness stays open for probes
    assert http("GET", url + "/v1/stats") == (401, {"error": "missing bearer token"})
    assert http("GET", url + "/v1/stats", token="nope") == (401, {"error": "wrong bearer token"})
    assert http("GET", url + "/v1/stats", token=TOKEN)[0] == 200
    assert http("GET", url + "/v1/stats", token=ADMIN)[0] == 200
    assert http("GET", url + "/metrics")[0] == 401
    tokens, chunks = list(range(8)), [os.urandom(100), os.urandom(100)]
    with PolarKVClient(url, chunk_tokens=4, token=TOKEN) as c:
        assert c.store_kv(tokens, chunks) == 2
        key = c.keys(tokens)[0]
    status, body = http("DELETE", f"{url}/v1/keys/{key}", token=TOKEN)
    assert status == 403 and "admin token" in body["error"]
    status, body = http(
        "POST",
        url + "/v1/nodes/register",
        {"node_id": "rogue", "incarnation": 1, "address": "127.0.0.1:1", "capacity": 1 << 20},
        token=TOKEN,
    )
    assert status == 403
    for bad in (None, "wrong"):
        with PolarKVClient(url, chunk_tokens=4, token=bad) as c:
            assert c.load_kv(tokens) == (0, [])
            assert c.store_kv(list(range(100, 108)), chunks) == 0
            assert c.stats.faults == 2
    with PolarKVClient(url, chunk_tokens=4, token=TOKEN) as c:
        assert c.load_kv(tokens)[0] == 8
    assert http("DELETE", f"{url}/v1/keys/{key}", token=ADMIN) == (200, {"deleted": key})
