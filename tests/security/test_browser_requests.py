"""What a web page in the operator's browser can make a manager without a token do: read
nothing cross-origin, reach nothing by DNS rebinding, change nothing with the "simple"
requests a browser sends without a CORS preflight. Raw HTTP, shaped as the browser
would send it, against the default loopback config."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from polarkv_lib.client import PolarKVClient
from polarkv_lib.client.admin import AdminClient
from tests.conftest import Cluster, PolarKV, http
from tests.security.rawhttp import send

EVIL = "http://evil.example"


@pytest.fixture
def node(cluster: Cluster) -> PolarKV:
    return cluster.embedded(slab__transports="tcp")  # no token: the default


def nodes(url: str) -> list[dict[str, Any]]:
    return list(http("GET", url + "/v1/nodes")[1]["nodes"])


def test_a_foreign_page_cannot_read_the_manager(node: PolarKV) -> None:
    url = node.manager_url
    for path in ("/v1/nodes", "/v1/stats", "/v1/events", "/healthz"):
        reply = send("GET", url + path, {"Origin": EVIL})
        assert reply.status == 200  # answered (curl may read it) ...
        assert "access-control-allow-origin" not in reply.headers, path  # ... a page may not
        preflight = send(
            "OPTIONS",
            url + path,
            {"Origin": EVIL, "Access-Control-Request-Method": "GET"},
        )
        assert "access-control-allow-origin" not in preflight.headers, path


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8170", "localhost.evil.example"])
def test_dns_rebinding_is_refused(node: PolarKV, host: str) -> None:
    """The attacker's name, resolved to 127.0.0.1: the browser sends it as Host."""
    url = node.manager_url
    for method, path in (("GET", "/v1/nodes"), ("GET", "/"), ("GET", "/healthz")):
        reply = send(method, url + path, {"Host": host})
        assert reply.status == 403, (path, reply)
        assert "Host" in str(reply.json()), reply
    # the manager's own names, with or without a port
    port = url.rpartition(":")[2]
    for own in (
        "localhost",
        f"localhost:{port}",
        f"127.0.0.1:{port}",
        "127.0.0.5",
        f"[::1]:{port}",
    ):
        assert send("GET", url + "/v1/nodes", {"Host": own}).status == 200, own


SIMPLE_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x", ""]


@pytest.mark.parametrize("ctype", SIMPLE_TYPES)
def test_no_preflight_writes_change_nothing(node: PolarKV, ctype: str) -> None:
    """What `fetch(url, {method: "POST", mode: "no-cors", body})` or a form can send from
    any page: the manager refuses it before it acts."""
    url = node.manager_url
    (mine,) = nodes(url)
    ref = {"node_id": mine["id"], "incarnation": mine["incarnation"]}
    fake = {
        "node_id": "fake",
        "incarnation": 7,
        "address": "127.0.0.1:9",
        "capacity": 1 << 20,
        "shm_path": "",
        "host_id": "x",
        "transports": ["tcp"],
    }
    headers = {"Origin": EVIL, **({"Content-Type": ctype} if ctype else {})}
    for path, body in (
        (f"/v1/nodes/{mine['id']}/drain", {}),
        ("/v1/nodes/unregister", ref),
        ("/v1/nodes/register", fake),
        ("/v1/allocate", {"items": [{"key": "a" * 32, "size": 10}]}),
    ):
        reply = send("POST", url + path, headers, orjson.dumps(body))
        assert reply.status == 415, (path, reply)
        assert "application/json" in str(reply.json())
    # a DELETE is never sent cross-origin without a preflight, and that is refused
    preflight = send(
        "OPTIONS",
        url + f"/v1/keys/{'a' * 32}",
        {"Origin": EVIL, "Access-Control-Request-Method": "DELETE"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    (still,) = nodes(url)
    assert still["id"] == mine["id"] and still["state"] == "alive" and not still["draining"]
    assert http("GET", url + "/v1/stats")[1]["allocations"] == 0


def test_the_project_clients_still_work(node: PolarKV) -> None:
    """Every POST of the client, the admin client (the CLI's) and the slab's link is JSON."""
    url = node.manager_url
    with PolarKVClient(url, timeout=5.0) as client:
        assert client.put("b" * 32, b"v" * 1000) and client.get("b" * 32) == b"v" * 1000
    admin = AdminClient(url)
    assert admin.delete("b" * 32) == {"deleted": "b" * 32}  # DELETE needs no body type
    (mine,) = admin.nodes()
    assert admin.drain(mine["id"])["draining"]
    assert node.log().count("registration refused") == 0
