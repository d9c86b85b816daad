"""TTFT of a replayed trace on the paper's hardware, modelled (docs/PAPER-RESULTS.md,
"The paper's hardware, modelled").

The replay measures hits (how many blocks of each request were found, in memory or on
disk); this module turns them into TTFT on the paper's hardware with the form of the
engine-calibrated model (`ttft_model.TtftModel`): prefill of a request of L prompt
tokens of which H are cached costs

    a + b * (L - H) + c * (L^2 - H^2)  seconds, with FIFO queueing,

and the coefficients come from the paper's model and GPUs instead of a fit:

- b = 2 x active parameters / F: a forward pass costs 2 FLOPs (multiply, add) per
  active weight per token; F = GPUs x 148 TFLOPS dense BF16 (NVIDIA H20) x 40% MFU
  (`presets.prefill_flops_per_s`, the one definition of the GPUs' throughput).
- c = layers x heads x (d_qk + d_v) / F, the causal attention: a new token at position p
  takes, per layer and query head, p dot products q.k of d_qk (2 d_qk p FLOPs) and a
  p-weighted sum of values of d_v (2 d_v p FLOPs). Over positions p = H .. L-1:
  2 x layers x heads x (d_qk + d_v) x sum(p), and sum(p) = (L^2 - H^2)/2 - (L - H)/2
  ~ (L^2 - H^2)/2, so layers x heads x (d_qk + d_v) x (L^2 - H^2) FLOPs. GQA shares K/V
  heads but every query head still does its own dot products, so `heads` is the query
  heads. MLA in prefill runs as ordinary attention over decompressed K/V (d_qk =
  qk_nope + qk_rope = 192, d_v = 128), which is what vLLM and SGLang do for prefill.
  Shapes (`presets.PRESETS`): Qwen3-235B-A22B 94 layers, 64 query heads, head dim 128
  (https://huggingface.co/Qwen/Qwen3-235B-A22B; MaxText's
  src/MaxText/configs/models/qwen3-235b-a22b.yml); DeepSeek-R1 61 layers, 128 heads,
  key 192, value 128 (https://huggingface.co/deepseek-ai/DeepSeek-R1/blob/main/config.json;
  its GGUF metadata: https://ollama.com/library/deepseek-r1:671b/blobs/439dd1a5e052).
- a = 0: no measured fixed cost per request on the paper's hardware.

Loads come from the pool `polarkv plan` buys for each design: its memory VMs, each
serving over its NIC (the price table's VM type), and each VM's share of the design's
ESSD volumes (the plan's disk throughput over its VMs: PL0 gives min(180, 100 + 0.25 x
GiB) MB/s per volume). A request's hit blocks are spread evenly over the VMs of its
cache (the manager allocates over all slab nodes). On each VM, memory hits occupy the
NIC for bytes / NIC rate; disk hits occupy the VM's disk for bytes / disk rate and,
streamed as they are reloaded (PolarKV reloads a block into the paired slab, then the
client reads it), the NIC for bytes / NIC rate, finishing no earlier than the disk.
The blocks a request misses are stored while it prefills: the engine does not wait for
them; they reach the VMs over the NICs' inbound direction (full duplex: no contention
with loads, which leave the VMs) and take disk time where the pool has disk (written
through in disk-only, offloaded from the small memory tier in tiered; a disk's
throughput is shared by reads and writes). Each NIC and disk is a FIFO server: a load
starts when its request starts and the server is free. The engines are FIFO servers
too, as in `TtftModel.predict`: a request starts when it has arrived and its engine is
free, loads (the engine waits: the load is part of its service, as in the calibrated
model), then prefills the rest; TTFT = the end of its prefill - its arrival.

Left out: batching of prefills on one engine; fair sharing of a NIC or disk (FIFO makes
a small load wait for a large one ahead of it); skipping the store of a missed block
that is already there (every missed block is charged); the inference node's own NIC
(taken as faster than the pool's); the engine recomputing a hit that would load slower
than it computes; any software cost of the cache (3FS's, Mooncake's or PolarKV's): at
equal hit rates on equal hardware only the tiers' rates and queues tell designs apart.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from polarkv_lib.tools.plan import Prices, load_prices
from polarkv_lib.tools.presets import Preset
from polarkv_lib.tools.replay.report import spread
from polarkv_lib.tools.replay.trace import Request
from polarkv_lib.tools.replay.ttft_model import TtftModel


class PaperHardwareError(ValueError):
    """The replay's output cannot be modelled; the message names the field and request."""


def prefill_model(model: Preset) -> TtftModel:
    """The paper's GPUs as a TtftModel: a = 0, b linear, c attention (module docstring)."""
    return TtftModel(0.0, model.prefill_s_per_token, model.attention_s_per_token2)


@dataclass(frozen=True)
class Pool:
    """The KV pool one design buys: `vms` memory VMs, each with a NIC and a disk share."""

    name: str
    vms: int
    nic: float  # bytes/s of one VM's NIC
    disk: float  # bytes/s of one VM's share of the disk volumes; 0: no disk
    disk_volumes: int = 0
    volume_rate: float = 0.0  # bytes/s of one full-speed volume

    def to_json(self) -> dict[str, Any]:
        return {
            "design": self.name,
            "memory_vms": self.vms,
            "nic_bytes_per_s": self.nic,
            "disk_bytes_per_s_per_vm": round(self.disk),
            "disk_volumes": self.disk_volumes,
            "volume_bytes_per_s": self.volume_rate,
        }


def pool_from_plan(
    design: Mapping[str, Any],
    disk_design: Mapping[str, Any] | None = None,
    prices: Prices | None = None,
) -> Pool:
    """The pool of one design of `polarkv plan --json` (its memory VMs; the disk of
    `disk_design` when given, else its own). NIC rates come from the price table the plan
    used (`prices`, default the shipped one), by the design's VM type."""
    prices = prices or load_prices()
    try:
        vm_name, vms = design["vm"], int(design["nodes"])
        disk_of = disk_design or design
        disk_rate = float(disk_of["disk_bandwidth_bytes_per_s"])
        disk_class, disk_gib = disk_of["disk_class"], int(disk_of["disk_bytes"]) // 2**30
    except (KeyError, TypeError, ValueError) as exc:
        raise PaperHardwareError(f"plan design {design.get('name')!r}: bad or no {exc}") from None
    nic = {v.name: v.nic for v in prices.vms}.get(vm_name)
    if nic is None or vms < 1:
        raise PaperHardwareError(f"plan design {design.get('name')!r}: unknown VM {vm_name!r}")
    volumes, volume_rate = 0, 0.0
    if disk_rate > 0 and disk_class in prices.disks:
        dc = prices.disks[disk_class]
        volumes = math.ceil(disk_gib / dc.gib_for(dc.max_mbps))
        volume_rate = dc.max_mbps * 1e6
    name = str(design.get("name"))
    if disk_design is not None:
        name += f"+{disk_design.get('name')}_disk"
    return Pool(name, vms, nic, disk_rate / vms, volumes, volume_rate)


@dataclass(frozen=True)
class Job:
    """One request as the model needs it."""

    arrival_s: float
    engine: int
    group: int  # which cache (set of VMs) serves its loads
    prompt: int
    cached: int
    memory_bytes: float
    disk_bytes: float
    store_bytes: float = 0.0  # the missed blocks, stored once computed


def simulate(
    jobs: Sequence[Job], pool: Pool, prefill: TtftModel, engines: int, groups: int = 1
) -> list[float]:
    """Modelled TTFT of each job (in the given order). VM v belongs to cache v % groups;
    requests are taken in the order they start on their engines, so every NIC and disk
    sees its loads in time order (FIFO)."""
    if groups < 1 or pool.vms < groups:
        raise PaperHardwareError(f"{groups} caches need at least as many VMs ({pool.vms})")
    members = [[v for v in range(pool.vms) if v % groups == g] for g in range(groups)]
    queues: list[deque[int]] = [deque() for _ in range(engines)]
    for i in sorted(range(len(jobs)), key=lambda i: jobs[i].arrival_s):
        queues[jobs[i].engine].append(i)
    engine_free = [0.0] * engines
    nic_free = [0.0] * pool.vms
    disk_free = [0.0] * pool.vms
    out = [0.0] * len(jobs)
    for _ in range(len(jobs)):
        e = min(
            (e for e in range(engines) if queues[e]),
            key=lambda e: max(jobs[queues[e][0]].arrival_s, engine_free[e]),
        )
        index = queues[e].popleft()
        job = jobs[index]
        start = max(job.arrival_s, engine_free[e])
        loaded = start
        vms = members[job.group]
        for v in vms:
            memory, disk = job.memory_bytes / len(vms), job.disk_bytes / len(vms)
            if memory > 0:
                nic_free[v] = max(start, nic_free[v]) + memory / pool.nic
                loaded = max(loaded, nic_free[v])
            if disk > 0:
                if pool.disk <= 0:
                    raise PaperHardwareError(f"disk hits on pool {pool.name}, which has no disk")
                disk_start = max(start, disk_free[v])
                disk_free[v] = disk_start + disk / pool.disk
                sent = max(disk_start, nic_free[v]) + disk / pool.nic
                nic_free[v] = max(sent, disk_free[v])
                loaded = max(loaded, nic_free[v])
        for v in vms if job.store_bytes > 0 and pool.disk > 0 else ():
            # the computed blocks are written during the prefill (the engine does not
            # wait for them): into the VMs over the NICs' other direction (full duplex,
            # no contention with loads), then onto the disk, through which every block
            # passes (written through, or offloaded: memory is a few % of the data)
            disk_free[v] = max(loaded, disk_free[v]) + job.store_bytes / len(vms) / pool.disk
        engine_free[e] = loaded + prefill.prefill_s(job.prompt, job.cached)
        out[index] = engine_free[e] - job.arrival_s
    return out


_FIELDS = ("blocks", "hit_blocks", "hit_memory", "hit_disk", "cache")


def jobs_from_replay(
    result: Mapping[str, Any], trace: Sequence[Request], engines: int, no_cache: bool = False
) -> tuple[list[Job], int]:
    """Join a replay's `--per-request` JSON with its trace, request by request (the replay
    keeps trace order). Returns the jobs and the number of caches (VM groups). With one
    cache, requests go round-robin over the engines; a replay with --nodes N has N
    per-node caches, each serving engines / N engines, and a request goes round-robin
    over the engines of the cache the replay routed it to."""
    per = result.get("per_request")
    if not isinstance(per, list):
        raise PaperHardwareError(
            "the replay JSON has no `per_request` list (run it with --per-request)"
        )
    for name in ("block_tokens", "block_bytes_full"):
        if not isinstance(result.get(name), int):
            raise PaperHardwareError(f"the replay JSON has no integer `{name}`")
    if len(per) > len(trace):
        raise PaperHardwareError(f"{len(per)} replayed requests but {len(trace)} in the trace")
    caches = int(result.get("nodes") or 1)
    if engines < 1 or engines % caches:
        raise PaperHardwareError(
            f"a replay over {caches} per-node caches needs a multiple of {caches} engines"
        )
    per_cache = engines // caches
    sent = [0] * caches
    block_tokens, block_bytes = int(result["block_tokens"]), int(result["block_bytes_full"])
    start = trace[0].timestamp_ms if trace else 0.0
    jobs = []
    for i, (row, req) in enumerate(zip(per, trace, strict=False)):
        if not isinstance(row, dict):
            raise PaperHardwareError(f"per_request[{i}]: expected an object")
        for name in _FIELDS:
            value = row.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PaperHardwareError(
                    f"per_request[{i}]: `{name}` must be a non-negative integer, got {value!r:.40}"
                )
        if row["blocks"] != len(req.hash_ids):
            raise PaperHardwareError(
                f"per_request[{i}] has {row['blocks']} blocks, the trace's request "
                f"{len(req.hash_ids)}: not the replay of this trace"
            )
        hits = 0 if no_cache else row["hit_blocks"]
        disk = 0 if no_cache else min(row["hit_disk"], hits)
        cache = row["cache"] if caches > 1 else 0
        if cache >= caches:
            raise PaperHardwareError(f"per_request[{i}]: cache {cache} of {caches}")
        engine = cache * per_cache + sent[cache] % per_cache
        sent[cache] += 1
        jobs.append(
            Job(
                (req.timestamp_ms - start) / 1000.0,
                engine,
                cache,
                req.input_length,
                min(hits * block_tokens, req.input_length),
                (hits - disk) * block_bytes,
                disk * block_bytes,
                0 if no_cache else (row["blocks"] - hits) * block_bytes,
            )
        )
    return jobs, caches


def model_run(
    result: Mapping[str, Any],
    trace: Sequence[Request],
    pool: Pool,
    model: Preset,
    engines: int,
) -> dict[str, Any]:
    """TTFT spreads of one replay on the paper's hardware, beside the same requests with
    no cache, and what the model assumed."""
    prefill = prefill_model(model)
    jobs, caches = jobs_from_replay(result, trace, engines)
    base, _ = jobs_from_replay(result, trace, engines, no_cache=True)
    ttft = simulate(jobs, pool, prefill, engines, caches)
    none = simulate(base, pool, prefill, engines, caches)
    # the same with the attention term left out, and with stores left off the disks:
    # what each adds
    linear = TtftModel(0.0, prefill.b, 0.0)
    linear_ttft = simulate(jobs, pool, linear, engines, caches)
    linear_none = simulate(base, pool, linear, engines, caches)
    unstored = [replace(j, store_bytes=0.0) for j in jobs]
    unstored_ttft = simulate(unstored, pool, prefill, engines, caches)
    span = max(j.arrival_s for j in jobs) if jobs else 0.0
    work = sum(prefill.prefill_s(j.prompt, 0) for j in base)
    return {
        "model": model.name,
        "engines": engines,
        "gpus_per_engine": model.gpus,
        "caches": caches,
        "pool": pool.to_json(),
        "prefill": {
            **prefill.to_json(),
            "flops_per_s": model.prefill_flops_per_s,
            "attention_flops_per_token2": model.attention_flops_per_token2,
        },
        # prefill work with no cache over the trace's span and the engines: above 1 the
        # queues grow for as long as the trace lasts
        "offered_load_no_cache": round(work / span / engines, 3) if span > 0 else None,
        "ttft_s": spread(ttft),
        "ttft_no_cache_s": spread(none),
        "ttft_mean_reduction": _reduction(ttft, none),
        "without_attention": {
            "ttft_s": spread(linear_ttft),
            "ttft_no_cache_s": spread(linear_none),
            "ttft_mean_reduction": _reduction(linear_ttft, linear_none),
        },
        "without_stores": {
            "ttft_s": spread(unstored_ttft),
            "ttft_mean_reduction": _reduction(unstored_ttft, none),
        },
    }


def _reduction(ttft: Sequence[float], base: Sequence[float]) -> float:
    if not ttft or statistics.fmean(base) <= 0:
        return 0.0
    return round(1 - statistics.fmean(ttft) / statistics.fmean(base), 4)
