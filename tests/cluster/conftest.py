"""Cluster tests: real namespaces, links, tc caps and polarkv processes (root needed).

Every cluster a test makes is taken down by the fixture, and the fixture then asserts that
nothing of it is left in the kernel: no namespace, process, link, qdisc or slab buffer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from polarkv_lib.cluster import netns
from polarkv_lib.cluster.harness import Cluster
from polarkv_lib.cluster.spec import ClusterSpec

_WHY = netns.available()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.cluster)
            if _WHY:
                item.add_marker(
                    pytest.mark.skip(reason=f"cluster tests need network namespaces: {_WHY}")
                )


MakeCluster = Callable[..., Cluster]


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[MakeCluster]:
    """Bring up clusters (each test gets its own names and /24s); all come down after."""
    made: list[Cluster] = []

    def make(name: str, subnet: str, **kwargs: Any) -> Cluster:
        kwargs.setdefault("nic", "1Gbit")
        kwargs.setdefault("slab_memory", "64MiB")
        kwargs.setdefault("settings", ("log.level=warning",))
        cluster = Cluster(ClusterSpec(name=name, subnet=subnet, **kwargs), tmp_path / "clusters")
        made.append(cluster)
        cluster.up()
        return cluster

    yield make
    for cluster in made:
        cluster.down()
    for cluster in made:
        assert cluster.leftovers() == {
            "namespaces": [],
            "pids": [],
            "links": [],
            "qdiscs": [],
            "buffers": [],
        }


def run_client(
    cluster: Cluster,
    vm: str,
    op: str,
    namespace: str,
    timeout: float = 60.0,
    **options: int | float,
) -> dict[str, Any]:
    """Store (`op="store"`) or load prompts in a client VM with the cluster's workload
    (polarkv_lib/cluster/workload.py, as `polarkv bench cluster` does); its JSON report.
    `options`: prompts, first_prompt, chunks, size, timeout."""
    phase = {"store": "fill", "load": "load"}[op]
    options = {"prompts": 1, "chunks": 64, "size": 256 * 1024, **options}
    argv = [sys.executable, "-m", "polarkv_lib.cluster.workload", phase, "--namespace", namespace]
    for key, value in options.items():
        argv += [f"--{'first' if key == 'first_prompt' else key}", str(value)]
    done = cluster.run_in(vm, argv, timeout)
    report = orjson.loads(done.stdout.splitlines()[-1])
    assert isinstance(report, dict)
    return report
