"""Shard URLs in the wrong order fail loudly: every shard would refuse every key it was
sent as wrong_shard, and the caller would miss everything in silence (issue: 0 hits,
nothing stored, no exception, nothing logged above DEBUG). Each shard says in /healthz
which shard it is; the client, the engine adapters and the slab check it at first
contact. Real manager shards and slabs."""

from __future__ import annotations

import asyncio
import logging
import subprocess

import pytest

from polarkv_lib.client import AsyncPolarKVClient, PolarKVClient
from polarkv_lib.integrations.common import make_client, settings_from_extra
from tests.conftest import Cluster, http, wait_for

GRANT_KEY = "g" * 32
ORDER = "in shard order"  # what every refusal says to do


@pytest.fixture
def shards(cluster: Cluster) -> list[str]:
    """Two manager shards and a slab that serves both (URLs in shard order)."""
    urls = [
        cluster.manager(manager__shard=f"{i}/2", security__grant_key=GRANT_KEY).manager_url
        for i in range(2)
    ]
    cluster.start(["slab"], {"slab.manager_url": ",".join(urls), "security.grant_key": GRANT_KEY})
    for url in urls:
        wait_for(lambda url=url: [n["state"] for n in _nodes(url)] == ["alive"])
    return urls


def keys() -> list[str]:
    return [f"{i:04x}" + "0" * 28 for i in (0x0100, 0x9000)]  # one key in each shard


def test_a_client_with_the_urls_reversed_raises_and_stores_nothing(
    shards: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    with PolarKVClient(",".join(shards), timeout=3.0) as good:
        assert good.put_many(keys(), [b"a" * 1000, b"b" * 1000]) == 2
    before = [http("GET", url + "/v1/stats")[1]["allocations"] for url in shards]
    reversed_urls = ",".join(reversed(shards))
    with caplog.at_level(logging.ERROR), PolarKVClient(reversed_urls, timeout=3.0) as client:
        for call in (
            lambda: client.get_many(keys()),
            lambda: client.put_many(keys(), [b"c" * 1000] * 2),
            lambda: client.lookup_keys(keys()),
            lambda: client.check_shards(),
        ):
            with pytest.raises(ValueError, match=ORDER) as refused:
                call()
            assert shards[1] in str(refused.value)  # the URL listed first, which is shard 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) >= 1 and ORDER in errors[0].getMessage()
    assert [http("GET", url + "/v1/stats")[1]["allocations"] for url in shards] == before


def test_one_shard_given_as_the_only_manager_raises(shards: list[str]) -> None:
    with PolarKVClient(shards[1], timeout=3.0) as client, pytest.raises(ValueError) as refused:
        client.put(keys()[1], b"x" * 100)
    assert "only manager" in str(refused.value) and ORDER in str(refused.value)


def test_the_async_client_raises_at_its_first_call(shards: list[str]) -> None:
    async def first_call() -> None:
        async with AsyncPolarKVClient(",".join(reversed(shards)), timeout=3.0) as client:
            with pytest.raises(ValueError, match=ORDER):
                await client.get(keys()[0])
            assert client.stats.faults == 0  # a mistake to fix, not a fault

    asyncio.run(first_call())


def test_an_engine_adapter_refuses_to_start(shards: list[str]) -> None:
    settings = settings_from_extra({"manager_url": list(reversed(shards))})
    with pytest.raises(ValueError, match=ORDER):
        make_client(settings, "model/bf16", 256)
    make_client(settings_from_extra({"manager_url": shards}), "model/bf16", 256).close()


def test_a_slab_with_the_urls_reversed_exits_naming_the_url(
    cluster: Cluster, shards: list[str]
) -> None:
    slab = cluster.start(
        ["slab"],
        {"slab.manager_url": ",".join(reversed(shards)), "security.grant_key": GRANT_KEY},
        wait=False,
    )
    try:
        code = slab.proc.wait(15)
    except subprocess.TimeoutExpired:
        pytest.fail("the slab kept running with its manager URLs out of order")
    assert code == 2, slab.log()
    last = slab.log().strip().splitlines()[-1]
    # both URLs are out of place: whichever link heard back first names its own
    assert "slab.manager_url" in last and ORDER in last, last
    assert any(f"{url} is shard" in last for url in shards), last
    # and it left no registration behind on either shard (the first slab's node only)
    for url in shards:
        wait_for(lambda url=url: sum(n["state"] == "alive" for n in _nodes(url)) == 1)


def _nodes(url: str) -> list[dict[str, object]]:
    return list(http("GET", url + "/v1/nodes")[1]["nodes"])
