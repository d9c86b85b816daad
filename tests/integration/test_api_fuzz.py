"""Schemathesis against /openapi.json of a running manager: no 5xx, no crash, and every
response matches the document."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from polarkv_lib.manager.openapi import openapi_spec
from tests.conftest import Cluster, http

MAX_BATCH, MAX_OBJECT = 64, 1 << 20
schema = schemathesis.openapi.from_dict(openapi_spec(MAX_BATCH, MAX_OBJECT))
# Too many keys or too large an object is refused with 413 (Content Too Large), as documented.
_rejection = schema.config.checks.negative_data_rejection
_rejection.expected_statuses = [*_rejection.expected_statuses, "413"]


@pytest.fixture(scope="module")
def manager_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cluster = Cluster(tmp_path_factory.mktemp("fuzz"))
    try:
        node = cluster.start(
            [],
            {
                "slab.memory": "16MiB",
                "manager.max_batch": str(MAX_BATCH),
                "manager.max_object_size": str(MAX_OBJECT),
                "disk.capacity": "64MiB",
            },
        )
        yield node.manager_url
        assert node.proc.poll() is None, "the manager died under fuzzing"
        assert http("GET", node.manager_url + "/healthz")[0] == 200
    finally:
        cluster.close()


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_conforms(case: schemathesis.Case[Any], manager_url: str) -> None:
    case.call_and_validate(base_url=manager_url, timeout=15)  # long polls wait up to 10 s
