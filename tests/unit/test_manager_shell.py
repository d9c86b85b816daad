"""The manager's aiohttp shell in process (aiohttp's test server): its wait loops await
what the core's outcome says, and the core counts each request once.

The test plays the node's disk role itself over the node API, so it decides when (and
whether) a reload or an offload lands.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from polarkv_lib.config import load_config
from polarkv_lib.manager.app import ManagerService
from polarkv_lib.manager.model import new_id

CHUNK = 64 * 1024
FILE = CHUNK + 4096
SUM = "0123456789abcdef"
NODE = {"node_id": "d1", "incarnation": 1}


def key(i: int) -> str:
    return f"{i:032x}"


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    config = load_config(
        overrides=[f"manager.metadata_url=sqlite:///{tmp_path / 'meta.db'}"], environ={}
    )
    service = ManagerService(config)
    async with TestClient(TestServer(service.app)) as client:
        yield client
    await service.store.close()


async def call(client: TestClient[Any, Any], path: str, body: dict[str, Any]) -> Any:
    reply = await client.post(path, json=body)
    assert reply.status == 200, await reply.text()
    return await reply.json()


async def join(client: TestClient[Any, Any], chunks: int) -> None:
    """A node with a disk and room for `chunks` chunks of memory."""
    await call(
        client,
        "/v1/nodes/register",
        {
            **NODE,
            "address": "127.0.0.1:9",
            "capacity": chunks * CHUNK,
            "transports": ["tcp"],
            "disk_capacity": 1 << 30,
        },
    )


async def take_orders(client: TestClient[Any, Any]) -> list[dict[str, Any]]:
    orders: list[dict[str, Any]] = (await call(client, "/v1/nodes/orders", {**NODE, "wait": 5}))[
        "orders"
    ]
    return orders


async def stats(client: TestClient[Any, Any]) -> dict[str, int]:
    reply = await client.get("/v1/stats")
    result: dict[str, int] = await reply.json()
    return result


@pytest.mark.parametrize("ok", [True, False])
async def test_a_lookup_waits_for_its_reload_and_counts_once(
    manager: TestClient[Any, Any], ok: bool
) -> None:
    await join(manager, 16)
    adopted = await call(
        manager,
        "/v1/nodes/adopt",
        {**NODE, "files": [{"key": key(1), "size": CHUNK, "checksum": SUM, "file_bytes": FILE}]},
    )
    assert adopted == {"adopted": 1, "delete": []}
    lookup = asyncio.ensure_future(
        call(manager, "/v1/lookup", {"keys": [key(1), key(2)], "wait": 5})
    )
    (order,) = await take_orders(manager)  # the disk role gets the reload ...
    assert order["op"] == "reload" and order["key"] == key(1)
    await asyncio.sleep(0.05)
    assert not lookup.done()  # ... and the lookup waits for it
    result = {"op": "reload", "key": key(1), "gen": order["gen"], "ok": ok}
    await call(
        manager,
        "/v1/nodes/done",
        {**NODE, "results": [result if ok else {**result, "reason": "checksum"}]},
    )
    reply = await asyncio.wait_for(lookup, 5)
    s = await stats(manager)
    assert s["lookups"] == 1 and s["hits"] + s["misses"] == 2
    if ok:
        assert reply["hits"] == 1 and reply["entries"][0]["key"] == key(1) and reply["lease"]
        assert (s["hits_disk"], s["hits_memory"], s["reloads"]) == (1, 0, 1)
    else:
        assert reply["hits"] == 0 and reply["lease"] is None
        assert (s["hits"], s["misses"], s["checksum_failures"]) == (0, 2, 1)


async def test_an_allocate_waits_for_the_room_offloads_make(manager: TestClient[Any, Any]) -> None:
    await join(manager, 10)  # 9 chunks under the high watermark
    for i in range(9):
        reply = await call(manager, "/v1/allocate", {"items": [{"key": key(i), "size": CHUNK}]})
        assert reply["results"][0]["status"] == "allocated"
        await call(
            manager,
            "/v1/commit",
            {"lease": reply["lease"], "items": [{"key": key(i), "checksum": SUM}]},
        )
    waiting = asyncio.ensure_future(
        call(manager, "/v1/allocate", {"items": [{"key": key(100), "size": CHUNK}], "wait": 5})
    )
    orders = await take_orders(manager)  # offloads down to the low watermark
    assert orders and {o["op"] for o in orders} == {"offload"}
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await call(
        manager,
        "/v1/nodes/done",
        {
            **NODE,
            "results": [
                {"op": "offload", "key": o["key"], "gen": o["gen"], "ok": True, "file_bytes": FILE}
                for o in orders
            ],
        },
    )
    reply = await asyncio.wait_for(waiting, 5)
    assert reply["results"][0]["status"] == "allocated"
    s = await stats(manager)
    # the key was refused while it waited, and is counted once: as allocated
    assert (s["allocations"], s["alloc_no_space"], s["offloads"]) == (10, 0, len(orders))


def test_lease_ids_stay_unique_and_well_formed_across_draws() -> None:
    # Ids are drawn from the OS 512 at a time: crossing several draws, from several
    # threads at once, none repeats and each is what the wire accepts as a lease.
    got: list[list[str]] = [[] for _ in range(4)]

    def draw(out: list[str]) -> None:
        out.extend(new_id() for _ in range(1500))

    threads = [threading.Thread(target=draw, args=(out,)) for out in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [i for out in got for i in out]
    assert len(set(ids)) == len(ids) == 6000
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)  # 8 bytes: the wire's lease form


def test_a_forked_process_never_hands_out_its_parents_next_lease_ids() -> None:
    new_id()  # the pool holds ids now
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its first ids, to the parent
        os.write(write, "".join(new_id() for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    theirs = os.read(read, 64).decode()
    os.close(read)
    mine = "".join(new_id() for _ in range(4))
    assert len(theirs) == 64 and theirs != mine
