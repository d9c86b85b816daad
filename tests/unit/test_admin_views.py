"""`polarkv admin` layout: shard answers summed and laid out (no server needed)."""

from __future__ import annotations

from polarkv_lib.cli import views
from polarkv_lib.cli.api import AdminError, Shards


def node(id_: str, state: str = "alive", **kw: int) -> dict[str, object]:
    return {
        "id": id_,
        "state": state,
        "address": id_,
        "memory_used": 0,
        "memory_capacity": 100,
        "keys_memory": 0,
        "disk_used": 0,
        "disk_capacity": 0,
        "keys_disk": 0,
        "last_heartbeat": 1.0,
        **kw,
    }


def test_counts_sum_and_nodes_count_once() -> None:
    a = {
        "hits": 3,
        "misses": 1,
        "keys_memory": 5,
        "nodes": 2,
        "nodes_dead": 0,
        "capacity_memory": 100,
    }
    b = {
        "hits": 1,
        "misses": 3,
        "keys_memory": 7,
        "nodes": 2,
        "nodes_dead": 0,
        "capacity_memory": 100,
    }
    merged = views.merge_nodes([[node("n1"), node("n2")], [node("n1"), node("n2", "dead")]])
    total = views.sum_stats([a, b], merged)
    assert total["hits"] == 4 and total["misses"] == 4 and total["keys_memory"] == 12
    assert total["capacity_memory"] == 200
    assert (total["nodes"], total["nodes_dead"]) == (1, 1)  # n2 is dead on one shard
    assert total["hit_rate"] == 0.5
    assert views.sum_stats([a])["nodes"] == 2  # one shard: its own count


def test_merge_nodes_sums_each_shards_part() -> None:
    merged = views.merge_nodes(
        [
            [node("n1", memory_used=10, keys_memory=1)],
            [node("n1", memory_used=5, keys_memory=2, last_heartbeat=9)],
        ]
    )
    assert len(merged) == 1
    row = merged[0]
    assert (row["memory_used"], row["memory_capacity"], row["keys_memory"]) == (15, 200, 3)
    assert row["shards"] == [0, 1] and row["last_heartbeat"] == 9


def test_tables_align_and_say_what_is_down() -> None:
    text = views.stats_table(
        [
            ("http://a:1", {"keys_memory": 1234, "hits": 1, "misses": 1, "nodes": 1}),
            ("http://b:2", AdminError("http://b:2", "cannot reach the manager")),
            ("http://c:3", AdminError("http://c:3", "HTTP 401 unauthorized", 401)),
        ],
        views.sum_stats([{"keys_memory": 1234, "hits": 1, "misses": 1}]),
    )
    lines = text.splitlines()
    assert lines[0].startswith("SHARD") and "a:1" in lines[1] and "unreachable" in lines[2]
    assert "refused (401)" in lines[3]  # it answered: a token problem, not the network
    assert lines[4].startswith("total") and "50.0%" in lines[4]
    assert lines[-2:] == [
        "unreachable: http://b:2: cannot reach the manager",
        "refused (401): http://c:3: HTTP 401 unauthorized",
    ]
    assert lines[0].index("NODES") == lines[1].index("1 up") and "1,234/0" in lines[1]
    assert views.nodes_table([]) == "no nodes registered"
    table = views.nodes_table([node("n1", memory_used=50)], now=3.0)
    assert "n1" in table and "50B/100B 50%" in table and "2.0s ago" in table


def test_keys_go_to_their_shard() -> None:
    shards = Shards.from_urls("http://a:1, http://b:2/")
    assert [s.url for s in shards.shards] == ["http://a:1", "http://b:2"]
    assert shards.owner("7fff" + "0" * 28).url == "http://a:1"
    assert shards.owner("8000" + "0" * 28).url == "http://b:2"
    assert views.human_bytes(1536) == "1.5KiB" and views.human_bytes(10) == "10B"
