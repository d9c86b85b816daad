"""The paper-hardware TTFT model: its attention term, the plan's pools, FIFO queueing on
shared NICs, and the join of a replay's per-request JSON with its trace."""

from __future__ import annotations

from typing import Any

import pytest

from polarkv_lib.tools.plan import load_prices, plan_budget
from polarkv_lib.tools.presets import preset
from polarkv_lib.tools.replay.paper_hardware import (
    Job,
    PaperHardwareError,
    Pool,
    jobs_from_replay,
    model_run,
    pool_from_plan,
    prefill_model,
    simulate,
)
from polarkv_lib.tools.replay.trace import Request
from polarkv_lib.tools.replay.ttft_model import TtftModel

QWEN = preset("qwen3-235b-a22b")


def test_attention_term_of_a_known_length() -> None:
    # layers x query heads x (q.k dim + value dim) FLOPs per unit of L^2 - H^2
    assert QWEN.attention_flops_per_token2 == 94 * 64 * (128 + 128)
    assert preset("deepseek-r1").attention_flops_per_token2 == 61 * 128 * (192 + 128)
    # the closed form is the sum over positions of 2 x layers x heads x (d_qk + d_v) x p
    length = 32_768
    exact = sum(2 * 94 * 64 * 256 * p for p in range(length))
    assert QWEN.attention_flops_per_token2 * length**2 == pytest.approx(exact, rel=1e-4)
    model = prefill_model(QWEN)
    flops = 8 * 148e12 * 0.40
    attention = model.prefill_s(length, 0) - length * 2 * 22e9 / flops
    assert attention == pytest.approx(94 * 64 * 256 * length**2 / flops)  # 3.49 s
    assert 3.4 < attention < 3.6
    # attention costs as much as the linear term at 2 x 22e9 / (94 x 64 x 256) tokens
    even = 2 * 22e9 / QWEN.attention_flops_per_token2
    assert 28_000 < even < 29_000
    # a cached first half saves half the linear term but only a quarter of attention:
    # the tokens after it still attend to it
    half = model.prefill_s(length, length // 2)
    assert half == pytest.approx(model.b * length / 2 + model.c * 0.75 * length**2)


def test_pools_come_from_the_plan() -> None:
    prices = load_prices()
    designs = {d["name"]: d for d in plan_budget(prices, 12e9, 18400)}
    tiered = pool_from_plan(designs["tiered"], prices=prices)
    assert tiered.vms == 8 and tiered.nic == pytest.approx(12.5e9 / 8)
    # 21,440 GiB of PL0 in 320 GiB volumes of min(180, 100 + 0.25 x 320) = 180 MB/s
    assert tiered.disk_volumes == 67 and tiered.volume_rate == 180e6
    assert tiered.disk * 8 == pytest.approx(designs["tiered"]["disk_bandwidth_bytes_per_s"])
    memory = pool_from_plan(designs["memory_only"], prices=prices)
    assert memory.disk == 0 and memory.nic == tiered.nic
    both = pool_from_plan(designs["memory_only"], designs["tiered"], prices=prices)
    assert both.disk == tiered.disk and both.name == "memory_only+tiered_disk"


def test_second_of_two_simultaneous_loads_waits_for_the_nic() -> None:
    pool = Pool("one", vms=1, nic=1000.0, disk=0.0)
    free = TtftModel(0.0, 0.0, 0.0)  # no prefill: TTFT is the load alone
    jobs = [Job(0.0, engine, 0, 100, 100, 1000.0, 0.0) for engine in (0, 1)]
    assert simulate(jobs, pool, free, engines=2) == pytest.approx([1.0, 2.0])
    # on two VMs each load is split over both NICs: half as long, the second still waits
    two = Pool("two", 2, 1000.0, 0.0)
    assert simulate(jobs, two, free, engines=2) == pytest.approx([0.5, 1.0])
    # a disk hit streams through the NIC and finishes no earlier than the disk
    disk = Pool("disk", vms=1, nic=1000.0, disk=500.0)
    assert simulate([Job(0.0, 0, 0, 1, 1, 0.0, 1000.0)], disk, free, 1) == pytest.approx([2.0])
    # a store does not delay its own request, nor loads from memory (the NIC's other
    # direction), but the next load from disk
    stored = [Job(0.0, 0, 0, 1, 1, 0.0, 0.0, 500.0), Job(0.0, 1, 0, 1, 1, 1000.0, 0.0)]
    assert simulate(stored, disk, free, engines=2) == pytest.approx([0.0, 1.0])
    stored[1] = Job(0.0, 1, 0, 1, 1, 0.0, 1000.0)
    assert simulate(stored, disk, free, engines=2) == pytest.approx([0.0, 3.0])


def test_one_engine_queues_in_arrival_order() -> None:
    pool = Pool("one", vms=1, nic=1e12, disk=0.0)
    linear = TtftModel(0.0, 0.001, 0.0)
    jobs = [Job(0.0, 0, 0, 1000, 0, 0.0, 0.0), Job(0.5, 0, 0, 1000, 0, 0.0, 0.0)]
    # the second arrives at 0.5 s and starts when the first is done at 1 s
    assert simulate(jobs, pool, linear, engines=1) == pytest.approx([1.0, 1.5])


def _trace(n: int) -> list[Request]:
    # n requests 100 s apart that share the same 20 blocks of 512 tokens
    return [Request(100_000.0 * i, 20 * 512, 1, tuple(range(20))) for i in range(n)]


def _replay(hits: list[tuple[int, int]], nodes: int = 1) -> dict[str, Any]:
    """A replay's JSON: per request (memory hits, disk hits)."""
    return {
        "block_tokens": 512,
        "block_bytes_full": QWEN.kv_bytes_per_token * 512,
        "nodes": nodes,
        "per_request": [
            {"blocks": 20, "hit_blocks": m + d, "hit_memory": m, "hit_disk": d, "cache": 0}
            for m, d in hits
        ],
    }


def test_tiered_beats_memory_only_when_its_disk_keeps_the_hits() -> None:
    prices = load_prices()
    designs = {d["name"]: d for d in plan_budget(prices, 12e9, 18400)}
    trace = _trace(3)
    # memory-only loses request 2's prefix (evicted); tiered finds it on disk
    memory = model_run(
        _replay([(0, 0), (20, 0), (0, 0)]),
        trace,
        pool_from_plan(designs["memory_only"], prices=prices),
        QWEN,
        4,
    )
    tiered = model_run(
        _replay([(0, 0), (20, 0), (0, 20)]),
        trace,
        pool_from_plan(designs["tiered"], prices=prices),
        QWEN,
        4,
    )
    assert tiered["ttft_s"]["mean"] < memory["ttft_s"]["mean"] < memory["ttft_no_cache_s"]["mean"]
    # a 10,240-token prompt: 0.95 s of linear prefill + 0.34 s of attention with no cache
    assert memory["ttft_no_cache_s"]["p50"] == pytest.approx(
        prefill_model(QWEN).prefill_s(10_240, 0)
    )
    # the disk hit loads 1.97 GB over 8 VMs' disks and NICs: ~0.16 s
    assert tiered["ttft_s"]["p50"] < 0.2


def test_per_node_caches_map_to_their_engines() -> None:
    result = _replay([(0, 0)] * 4, nodes=2)
    for i, row in enumerate(result["per_request"]):
        row["cache"] = i % 2
    jobs, caches = jobs_from_replay(result, _trace(4), engines=4)
    assert caches == 2 and [j.engine for j in jobs] == [0, 2, 1, 3]
    # all 20 blocks missed: each request stores them; with no cache nothing is stored
    assert jobs[0].store_bytes == 20 * QWEN.kv_bytes_per_token * 512
    none, _ = jobs_from_replay(result, _trace(4), engines=4, no_cache=True)
    assert all(j.store_bytes == 0 and j.cached == 0 for j in none)
    with pytest.raises(PaperHardwareError, match="multiple of 2 engines"):
        jobs_from_replay(result, _trace(4), engines=3)


def test_missing_field_in_the_per_request_json_is_named() -> None:
    result = _replay([(0, 0), (20, 0)])
    del result["per_request"][1]["hit_disk"]
    with pytest.raises(PaperHardwareError, match=r"per_request\[1\]: `hit_disk` must be"):
        jobs_from_replay(result, _trace(2), engines=1)
    with pytest.raises(PaperHardwareError, match="run it with --per-request"):
        jobs_from_replay({"block_tokens": 512}, _trace(2), engines=1)
    other = _replay([(0, 0)])
    other["per_request"][0]["blocks"] = 3
    with pytest.raises(PaperHardwareError, match="not the replay of this trace"):
        jobs_from_replay(other, _trace(1), engines=1)
