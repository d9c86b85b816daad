"""`polarkv replay --engine vllm`: the trace through real vLLM servers (DESIGN §13).

Per layout, a fresh `polarkv cluster` (one manager shard, two memory VMs with capped
links, one client VM per engine) and, in each client VM, a `vllm serve` (the CPU build,
a small Llama with random weights built once per run) with its own prefix cache and,
except in `local`, PolarKVConnector pointed at the cluster's manager over TCP. A router
on the host sends each trace request at its arrival time (scaled) to one engine and
times its first streamed token. Before the layouts, one engine with no cache at all, on
the host, measures TTFT at a few prompt lengths (the TTFT model's calibration) and
gives the reference tokens of the sampled requests.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from polarkv_lib.cluster.harness import Cluster
from polarkv_lib.cluster.netns import ClusterError
from polarkv_lib.cluster.spec import ClusterSpec
from polarkv_lib.progress import progress
from polarkv_lib.stats import percentile
from polarkv_lib.tools.bench.core import BenchError
from polarkv_lib.tools.replay.engine_servers import (
    GEN_TOKENS,
    MODEL,
    VmServer,
    block,
    build_engine_model,
    counters,
    servers_up,
    stream,
)
from polarkv_lib.tools.replay.trace import Request
from polarkv_lib.tools.replay.ttft_model import Served, TtftModel, fit_prefill
from polarkv_lib.tools.vllm_server import VllmServer, kv_transfer_config

LAYOUTS = ("local", "memory", "tiered", "global")
CHUNK_TOKENS = 128  # one vLLM CPU block: the finest chunk the connector allows
IN_FLIGHT = 16  # requests the router keeps open at once
POLARKV_STATS = ("hits_memory", "hits_disk", "misses", "evictions", "offloads", "reloads")


@dataclass(frozen=True)
class EnginePlan:
    python: str
    engines: int = 2
    layouts: tuple[str, ...] = ("local", "memory", "tiered")
    router: str = "round-robin"
    session_blocks: int = 2
    block_tokens: int = 32
    time_scale: float = 1.0
    sample: int = 16
    slab_memory: str = "16MiB"  # per memory VM, the same in every PolarKV layout
    nic: str = "2Gbit"
    cpus: tuple[str, ...] = ("0", "1")  # engine i's OpenMP threads: cpus[i % len]
    workdir: str = ""
    tag: int = field(default_factory=lambda: os.getpid() % 60)  # names this run's clusters


def kv_bytes_per_token() -> int:
    return MODEL.layers * 2 * MODEL.kv_heads * (MODEL.hidden // MODEL.heads) * 4  # float32


def prompt(request: Request, block_tokens: int) -> list[int]:
    """The request's blocks, as many as fit the model with the generated tokens."""
    most = (MODEL.max_len - GEN_TOKENS - 1) // block_tokens
    ids = request.hash_ids[:most] or (-1,)
    return [t for i in ids for t in block(i, block_tokens)]


@dataclass
class Reference:
    """What the engine with no cache measured: calibration points and sampled tokens."""

    points: list[tuple[int, float]] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)  # request index -> tokens


LENGTHS = (128, 510, 1021, 1532, MODEL.max_len - GEN_TOKENS - 1)  # calibration prompts
REPEATS = 3


def measure_prefill(servers: list[VllmServer]) -> list[tuple[int, float]]:
    """No-cache TTFT at each calibration length, the median over the engines and repeats
    (fresh tokens every time, so nothing is found cached)."""
    points = []
    with progress(len(LENGTHS) * REPEATS * len(servers), "calibrate", "req") as bar:
        for n in LENGTHS:
            times = []
            for rep in range(REPEATS):
                for k, server in enumerate(servers):
                    times.append(
                        stream(server.url, server.model, block(-100 - 10 * n - 3 * rep - k, n))[0]
                    )
                    bar.update(1)
            points.append((n, statistics.median(times)))
    return points


LOAD_LENGTHS = (512, 1024, MODEL.max_len - GEN_TOKENS - 1)


def _wait_saves(cluster: Cluster, url: str, timeout: float = 60.0) -> None:
    """Saves are asynchronous: until the manager's commit count stops moving."""
    last, deadline = -1, time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = cluster.admin(url, "/v1/stats")
        if stats.get("commits") == last and not stats.get("keys_writing"):
            return
        last = stats.get("commits", 0)
        time.sleep(0.3)


def measure_loads(
    cluster: Cluster, url: str, servers: list[VllmServer]
) -> list[tuple[int, int, float]]:
    """(prompt tokens, tokens the engine found cached, TTFT) of loads from PolarKV: the
    first engine stores a fresh prompt, the second (which never saw it) loads it."""
    if len(servers) < 2:
        return []
    out = []
    for n in LOAD_LENGTHS:
        tokens = block(-7_000_000 - n, n)
        stream(servers[0].url, servers[0].model, tokens)
        _wait_saves(cluster, url)
        ttft, _, cached = stream(servers[1].url, servers[1].model, tokens)
        out.append((n, cached, ttft))
    return out


def reference(
    plan: EnginePlan, model: str, requests: list[Request], sample: list[int], calibrate: bool
) -> Reference:
    """The engine with no cache at all: the sampled requests' tokens and, when no
    `local` layout runs (whose engines calibrate the model), the calibration points."""
    ref = Reference()
    server = VllmServer(
        python=plan.python,
        model=model,
        workdir=os.path.join(plan.workdir, "reference"),
        name="reference",
        max_model_len=MODEL.max_len,
        cpus=plan.cpus[0],
    )
    with servers_up([server]):
        if calibrate:
            ref.points = measure_prefill([server])
        with progress(len(sample), "reference tokens", "req") as bar:
            for i in sample:
                ref.tokens[i] = stream(server.url, model, prompt(requests[i], plan.block_tokens))[1]
                bar.update(1)
    return ref


def _spec(plan: EnginePlan, layout: str, index: int) -> ClusterSpec:
    return ClusterSpec(
        # per run and layout, so that two replays on one host do not meet
        name=f"r{plan.tag:02d}{index}",
        subnet=f"10.79.{plan.tag * 4 + index}",
        memory_vms=2,
        client_vms=plan.engines,
        nic=plan.nic,
        slab_memory=plan.slab_memory,
        disk_capacity="2GiB",
        settings=("log.level=warning",),
        disk_tier=layout in ("tiered", "global"),
        global_pools=layout == "global",
    )


def run_layout(
    plan: EnginePlan,
    layout: str,
    index: int,
    model: str,
    requests: list[Request],
    route: Callable[[int, Request], int],
    reference: Reference,
) -> tuple[dict[str, Any], list[Served]]:
    spec = _spec(plan, layout, index)
    cluster = Cluster(spec, os.path.join(plan.workdir, "clusters"))
    manager = spec.manager_urls()[0]
    transfer = None
    if layout != "local":
        transfer = kv_transfer_config(
            manager, token=spec.token, transport="tcp", chunk_tokens=CHUNK_TOKENS, timeout=5.0
        )
    servers: list[VllmServer] = [
        VmServer(
            python=plan.python,
            model=model,
            workdir=os.path.join(plan.workdir, layout),
            name=f"engine{i}",
            kv_transfer=transfer,
            prefix_caching=True,
            max_model_len=MODEL.max_len,
            cpus=plan.cpus[i % len(plan.cpus)],
            vm=spec.vm(f"cli{i}"),
        )
        for i in range(plan.engines)
    ]
    started = time.monotonic()
    try:
        with cluster, servers_up(servers):
            if layout == "local":  # these engines, as loaded as in the replay, with no PolarKV
                reference.points = measure_prefill(servers)
            loads = [] if transfer is None else measure_loads(cluster, manager, servers)
            before = [counters(s) for s in servers]
            records = _replay(plan, layout, servers, requests, route, reference)
            after = [counters(s) for s in servers]
            stats = {} if transfer is None else cluster.admin(manager, "/v1/stats")
            between = sum(cluster.peer_bytes(name) for name in spec.memory_services())
    except ClusterError as exc:
        raise BenchError(f"layout {layout}: {exc}") from None
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in before[0]}
    share = delta["external"] / (delta["local"] + delta["external"]) if delta["external"] else 0.0
    served = [
        Served(r["arrival_s"], r["engine"], r["prompt_tokens"], r["cached"], share, r["ttft_s"])
        for r in records
    ]
    ttfts = sorted(r.ttft_s for r in served)
    hits = int(delta["local"] + delta["external"])
    row = {
        "layout": layout,
        "requests": len(served),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4),
        "hit_tokens": hits,
        "prompt_tokens": int(delta["prompt"]),
        "hit_rate": round(hits / delta["prompt"], 4) if delta["prompt"] else 0.0,
        "local_hit_tokens": int(delta["local"]),
        "polarkv_hit_tokens": int(delta["external"]),
        "polarkv": {k: stats.get(k, 0) for k in POLARKV_STATS} if stats else {},
        "bytes_between_memory_vms": between,
        "sampled": len(reference.tokens),
        "wrong_tokens": sum(r["wrong"] for r in records),
        "run_s": round(time.monotonic() - started, 1),
        "measured_loads": [
            {"prompt_tokens": n, "cached_tokens": h, "ttft_s": round(t, 4)} for n, h, t in loads
        ],
    }
    return row, served


def _replay(
    plan: EnginePlan,
    layout: str,
    servers: list[VllmServer],
    requests: list[Request],
    route: Callable[[int, Request], int],
    reference: Reference,
) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [{} for _ in requests]
    t0 = requests[0].timestamp_ms
    lock = threading.Lock()

    def one(i: int, arrival: float, engine: int) -> None:
        tokens = prompt(requests[i], plan.block_tokens)
        server = servers[engine]
        ttft, out, cached = stream(server.url, server.model, tokens)
        want = reference.tokens.get(i)
        with lock:
            records[i] = {
                "arrival_s": arrival,
                "engine": engine,
                "prompt_tokens": len(tokens),
                "cached": cached,
                "ttft_s": ttft,
                "wrong": int(want is not None and want != out),
            }

    with (
        progress(len(requests), f"replay {layout}", "req") as bar,
        ThreadPoolExecutor(IN_FLIGHT) as pool,
    ):
        start = time.monotonic()
        futures: list[Future[None]] = []
        for i, request in enumerate(requests):
            due = (request.timestamp_ms - t0) / 1000 / plan.time_scale if plan.time_scale else 0.0
            delay = start + due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            fut = pool.submit(one, i, time.monotonic() - start, route(i, request) % len(servers))
            fut.add_done_callback(lambda _: bar.update(1))
            futures.append(fut)
        for fut in futures:
            fut.result()  # a failed request fails the run, with its reason
    return records


def sample_indices(n: int, k: int) -> list[int]:
    """k request indices spread evenly over n (all when k >= n)."""
    if k >= n:
        return list(range(n))
    return sorted({round(j * (n - 1) / max(1, k - 1)) for j in range(k)})


def run(
    plan: EnginePlan, requests: list[Request], route: Callable[[int, Request], int]
) -> dict[str, Any]:
    model = os.path.join(plan.workdir, "model")
    build_engine_model(plan.python, model)
    sample = sample_indices(len(requests), plan.sample)
    ref = reference(plan, model, requests, sample, "local" not in plan.layouts)
    rows: list[dict[str, Any]] = []
    served: dict[str, list[Served]] = {}
    # local first: its engines calibrate the prefill model (the rows keep the given order)
    for layout in sorted(plan.layouts, key=lambda x: x != "local"):
        index = plan.layouts.index(layout)
        row, served[layout] = run_layout(plan, layout, index, model, requests, route, ref)
        rows.append(row)
    rows.sort(key=lambda r: plan.layouts.index(r["layout"]))
    prefill = TtftModel(*fit_prefill(ref.points))
    for row in rows:  # the load rate per layout, from its own measured loads
        loads = [
            (x["prompt_tokens"], x["cached_tokens"], x["ttft_s"]) for x in row["measured_loads"]
        ]
        ttft = prefill.with_load(loads)
        row["load_s_per_token"] = ttft.load_s_per_token
        modelled = statistics.fmean(ttft.predict(served[row["layout"]]))
        row["modelled_ttft_mean_s"] = round(modelled, 4)
        row["model_error"] = (
            round(modelled / row["ttft_mean_s"] - 1, 3) if row["ttft_mean_s"] else None
        )
    return {
        "engine": "vllm",
        "requests": len(requests),
        "engines": plan.engines,
        "router": plan.router,
        "block_tokens": plan.block_tokens,
        "time_scale": plan.time_scale,
        "model": MODEL.__dict__,
        "kv_bytes_per_token": kv_bytes_per_token(),
        "slab_memory_per_vm": plan.slab_memory,
        "ttft_model": {
            **{k: v for k, v in prefill.to_json().items() if k != "load_s_per_token"},
            "calibration": [{"prompt_tokens": n, "ttft_s": round(t, 4)} for n, t in ref.points],
            "calibrated_on": "local" if "local" in plan.layouts else "reference",
        },
        "layouts": rows,
    }
