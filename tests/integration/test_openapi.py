"""/openapi.json describes every route the manager serves, and real replies match it."""

from __future__ import annotations

import os
import re
from typing import Any

import jsonschema
import pytest

from polarkv_lib.client import checksum
from polarkv_lib.config import Config
from polarkv_lib.manager.app import ManagerService
from polarkv_lib.manager.openapi import openapi_spec
from tests.conftest import Cluster, http
from tests.integration.raw import key, post


def test_every_route_is_described_and_nothing_else() -> None:
    service = ManagerService(Config())
    served = {
        (r.resource.canonical, r.method.lower())  # type: ignore[union-attr]
        for r in service.app.router.routes()
        if r.method != "HEAD"
    }
    described = {
        (path, method)
        for path, ops in openapi_spec()["paths"].items()
        for method in ops
        if method != "parameters"
    }
    assert served == described


def _schema(spec: dict[str, Any], path: str, method: str, status: int) -> dict[str, Any]:
    response = spec["paths"][path][method]["responses"][str(status)]
    return dict(response["content"]["application/json"]["schema"])


def _request_schema(spec: dict[str, Any], path: str) -> dict[str, Any]:
    return dict(spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])


@pytest.fixture
def url(cluster: Cluster) -> str:
    return cluster.embedded(disk=True).manager_url


def test_replies_match_the_document(url: str) -> None:
    status, spec = http("GET", url + "/openapi.json")
    assert status == 200 and spec["openapi"].startswith("3.")

    def check(method: str, path: str, template: str, body: Any = None, expect: int = 200) -> Any:
        if method == "POST":
            jsonschema.validate(body, _request_schema(spec, template))
        got, reply = http(method.upper(), url + path, body)
        assert got == expect, reply
        jsonschema.validate(reply, _schema(spec, template, method.lower(), got))
        return reply

    data = os.urandom(3000)
    k = key(42)
    check("GET", "/healthz", "/healthz")
    allocated = check(
        "POST", "/v1/allocate", "/v1/allocate", {"items": [{"key": k, "size": len(data)}]}
    )
    check("POST", "/v1/renew", "/v1/renew", {"leases": [allocated["lease"]]})
    check(
        "POST",
        "/v1/commit",
        "/v1/commit",
        {"lease": allocated["lease"], "items": [{"key": k, "checksum": checksum(data)}]},
    )
    check("POST", "/v1/allocate", "/v1/allocate", {"items": [{"key": k, "size": len(data)}]})
    hit = check("POST", "/v1/lookup", "/v1/lookup", {"keys": [k, key(43)]})
    check("POST", "/v1/lookup", "/v1/lookup", {"keys": [k], "lease": False})
    check("POST", "/v1/release", "/v1/release", {"leases": [hit["lease"]]})
    second = post(url, "/v1/allocate", {"items": [{"key": key(44), "size": 10}]})
    check("POST", "/v1/abort", "/v1/abort", {"lease": second["lease"]})
    check("GET", "/v1/stats", "/v1/stats")
    check("GET", "/v1/nodes", "/v1/nodes")
    check("GET", f"/v1/keys/{k}", "/v1/keys/{key}")
    check("GET", f"/v1/keys/{key(45)}", "/v1/keys/{key}", expect=404)
    check("GET", "/v1/keys/bad", "/v1/keys/{key}", expect=400)
    check(
        "POST",
        "/v1/nodes/heartbeat",
        "/v1/nodes/heartbeat",
        {"node_id": "x", "incarnation": 1},
        404,
    )
    check("DELETE", f"/v1/keys/{k}", "/v1/keys/{key}")
    status, text = http("GET", url + "/metrics")
    assert status == 200 and re.search(r"^polarkv_commits_total 1\.0$", text, re.M)
    # the stats document lists every key the endpoint returns, and no more
    stats_schema = _schema(spec, "/v1/stats", "get", 200)
    assert set(stats_schema["required"]) == set(http("GET", url + "/v1/stats")[1])
