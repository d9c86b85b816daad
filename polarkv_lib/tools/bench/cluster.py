"""`polarkv bench cluster`: the paper's argument on a real (namespaced) network.

One run brings up the same cluster (manager shards, memory VMs, client VMs, every link
capped at `--nic` both ways) once per layout and drives the same offload-heavy mixed
load through it:

    tiered   each memory VM tiers to its own disk (PolarKV's design)
    global   each memory VM's disk tier is served by the next memory VM over the
             network (global pools; experiment only, cluster/remote_disk.py)
    memory   no disk tier, the same total memory (misses where the others reload)
    memory-ws  no disk tier, memory for the whole working set (what tiering replaces)

Per layout: fill a working set of `--working-set` times the cluster's total memory, then
`--seconds` of mixed load (random prompts of the working set loaded, new ones stored)
from every client VM at once. Reported: load throughput (bytes loaded per second of the
mixed phase), hit rate, offloads and reloads, the bytes memory VMs sent one another
(htb counters at the switch ports; all of it tiering traffic), and each VM's NIC bytes.
Loaded bytes are compared with what was stored; a wrong byte fails the run. Needs root.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import click
import orjson

from polarkv_lib.cluster import netns
from polarkv_lib.cluster.harness import Cluster
from polarkv_lib.cluster.netns import ClusterError
from polarkv_lib.cluster.spec import ClusterSpec
from polarkv_lib.progress import progress
from polarkv_lib.tools.bench import core

LAYOUTS = ("tiered", "global", "memory", "memory-ws")
MB = 1e6


@dataclass(frozen=True)
class Plan:
    layouts: list[str]
    shards: int
    memory_vms: int
    client_vms: int
    nic: str
    slab_memory: int
    working_set: float
    chunk_size: int
    chunks: int
    seconds: float
    store_ratio: float
    state_dir: str

    @property
    def prompts(self) -> int:
        total = self.slab_memory * self.memory_vms * self.working_set
        return max(self.client_vms, int(total // (self.chunk_size * self.chunks)))


@dataclass
class Result:
    layout: str
    load: dict[str, float] = field(default_factory=dict)
    nic: dict[str, dict[str, int]] = field(default_factory=dict)
    between_memory_vms: int = 0
    manager: dict[str, int] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.load["bytes_loaded"] / self.load["seconds"] if self.load.get("seconds") else 0.0

    @property
    def hit_rate(self) -> float:
        return (
            self.load["chunks_hit"] / self.load["chunks_wanted"]
            if self.load.get("chunks_wanted")
            else 0.0
        )


def parse_plan(
    layouts: str,
    shards: int,
    memory_vms: int,
    client_vms: int,
    nic: str,
    slab_memory: str,
    working_set: float,
    chunk_size: str,
    chunks: int,
    seconds: float,
    store_ratio: float,
    state_dir: str,
) -> Plan:
    plan = Plan(
        core.parse_choices(layouts, "--layouts", LAYOUTS),
        shards,
        memory_vms,
        client_vms,
        nic,
        core.parse_bytes(slab_memory, "--slab-memory"),
        working_set,
        core.parse_bytes(chunk_size, "--chunk-size"),
        chunks,
        seconds,
        store_ratio,
        state_dir,
    )
    if working_set <= 0 or chunks < 1 or seconds <= 0 or not 0 <= store_ratio < 1 or client_vms < 1:
        raise core.BadArguments(
            "--working-set, --chunks, --seconds, --client-vms > 0; --store-ratio in [0, 1)"
        )
    if "global" in plan.layouts and memory_vms < 2:
        raise core.BadArguments("the global layout needs --memory-vms >= 2")
    return plan


def _spec(plan: Plan, layout: str) -> ClusterSpec:
    disk = max(4 * plan.slab_memory * plan.working_set, 256 * 1024**2)
    memory = plan.slab_memory
    if layout == "memory-ws":  # the working set and its stores under the watermark, per VM
        need = plan.prompts * plan.chunks * plan.chunk_size * 1.5 / plan.memory_vms / 0.85
        memory = -(-int(need) // 2**20) * 2**20
    return ClusterSpec(
        name="pkvb",
        subnet="10.77.30",
        shards=plan.shards,
        memory_vms=plan.memory_vms,
        client_vms=plan.client_vms,
        nic=plan.nic,
        slab_memory=str(memory),
        disk_capacity=str(int(disk)),
        global_pools=layout == "global",
        disk_tier=layout in ("tiered", "global"),
        settings=("log.level=warning", "client.timeout=10s"),
    )


def _clients(cluster: Cluster, plan: Plan, phase: str) -> list[dict[str, Any]]:
    """Run the workload phase in every client VM at once; their JSON reports."""
    per = -(-plan.prompts // plan.client_vms)
    argvs = []
    for i in range(plan.client_vms):
        argv = [
            sys.executable,
            "-m",
            "polarkv_lib.cluster.workload",
            phase,
            "--chunks",
            str(plan.chunks),
            "--size",
            str(plan.chunk_size),
            "--seed",
            str(i),
            "--timeout",
            "10",
        ]
        if phase == "fill":
            argv += ["--prompts", str(min(per, plan.prompts - i * per)), "--first", str(i * per)]
        else:
            argv += [
                "--prompts",
                str(plan.prompts),
                "--seconds",
                str(plan.seconds),
                "--store-ratio",
                str(plan.store_ratio),
            ]
        argvs.append((f"cli{i}", argv))
    limit = 600.0 if phase == "fill" else plan.seconds + 120
    with concurrent.futures.ThreadPoolExecutor(len(argvs)) as pool:
        done = list(pool.map(lambda a: cluster.run_in(a[0], a[1], limit), argvs))
    return [orjson.loads(d.stdout.splitlines()[-1]) for d in done]


def _manager_totals(cluster: Cluster) -> dict[str, int]:
    out: dict[str, int] = {}
    for url in cluster.spec.manager_urls():
        stats = cluster.admin(url, "/v1/stats")
        for key in ("offloads", "reloads", "evictions", "keys_memory", "keys_disk"):
            out[key] = out.get(key, 0) + int(stats.get(key, 0))
    return out


def measure(plan: Plan, layout: str) -> Result:
    with Cluster(_spec(plan, layout), plan.state_dir) as cluster:
        vms = [vm.name for vm in cluster.spec.vms()]
        _clients(cluster, plan, "fill")
        before = {vm: cluster.counters(vm) for vm in vms}
        peers_before = sum(cluster.peer_bytes(f"mem{i}") for i in range(plan.memory_vms))
        managers_before = _manager_totals(cluster)
        reports = _clients(cluster, plan, "mixed")
        result = Result(layout)
        for key in reports[0]:
            if isinstance(reports[0][key], int | float) and key != "seconds":
                result.load[key] = sum(r[key] for r in reports)
        result.load["seconds"] = max(r["seconds"] for r in reports)
        for vm in vms:
            delta = cluster.counters(vm) - before[vm]
            result.nic[vm] = {"sent": delta.sent, "received": delta.received}
        result.between_memory_vms = (
            sum(cluster.peer_bytes(f"mem{i}") for i in range(plan.memory_vms)) - peers_before
        )
        after = _manager_totals(cluster)
        result.manager = {
            k: after[k] - managers_before.get(k, 0)
            if k in ("offloads", "reloads", "evictions")
            else after[k]
            for k in after
        }
    return result


def render(plan: Plan, results: list[Result]) -> str:
    """One row per layout; load throughput as a ratio to each memory-only layout run."""
    base = {r.layout: r.throughput for r in results if r.layout.startswith("memory")}

    def ratio(layout: str, value: float) -> str:
        return f"{value / base[layout]:.2f}" if base.get(layout) else "-"

    lines = [
        [
            "layout",
            "load MB/s",
            "vs memory",
            "vs memory-ws",
            "hit rate",
            "offloads",
            "reloads",
            "memory VM <-> memory VM MB",
            "client VMs received MB",
            "memory VMs sent MB",
        ]
    ]
    for r in results:
        clients = sum(n["received"] for vm, n in r.nic.items() if vm.startswith("cli"))
        memory = sum(n["sent"] for vm, n in r.nic.items() if vm.startswith("mem"))
        lines.append(
            [
                r.layout,
                f"{r.throughput / MB:.1f}",
                ratio("memory", r.throughput),
                ratio("memory-ws", r.throughput),
                f"{r.hit_rate:.3f}",
                str(r.manager.get("offloads", 0)),
                str(r.manager.get("reloads", 0)),
                f"{r.between_memory_vms / MB:.1f}",
                f"{clients / MB:.1f}",
                f"{memory / MB:.1f}",
            ]
        )
    return core.markdown_table(lines)


def run(plan: Plan, json_path: str) -> bool:
    why = netns.available()
    if why:
        raise core.BenchError(f"needs network namespaces: {why}")
    if not plan.state_dir:  # disk tiers and logs of every layout: gone with the run
        with tempfile.TemporaryDirectory(prefix="polarkv-bench-cluster-") as state_dir:
            return run(dataclasses.replace(plan, state_dir=state_dir), json_path)
    results = []
    with progress(len(plan.layouts), "cluster layouts", "layout") as bar:
        for layout in plan.layouts:
            try:
                results.append(measure(plan, layout))
            except ClusterError as exc:
                raise core.BenchError(f"{layout}: {exc}") from None
            bar.update(1)
    print(
        f"{core.machine_text()}; {plan.shards} shard(s), {plan.memory_vms} memory VMs x "
        f"{core.size_text(plan.slab_memory)}, {plan.client_vms} client VMs, NIC {plan.nic}; working set "
        f"{plan.prompts} prompts x {plan.chunks} x {core.size_text(plan.chunk_size)}; {plan.seconds:g} s mixed, "
        f"store ratio {plan.store_ratio}"
    )
    print(render(plan, results))
    if json_path:
        doc = {
            "bench": "cluster",
            "params": {**plan.__dict__, "prompts": plan.prompts},
            "machine": core.machine(),
            "results": [
                {**r.__dict__, "throughput_bytes_per_s": r.throughput, "hit_rate": r.hit_rate}
                for r in results
            ],
        }
        with open(json_path, "wb") as fh:
            fh.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return all(r.load.get("wrong_bytes", 0) == 0 for r in results)


@click.command("cluster")
@click.option("--layouts", default=",".join(LAYOUTS), show_default=True, help="Layouts to compare.")
@click.option("--shards", default=1, show_default=True, help="Manager shards.")
@click.option("--memory-vms", default=2, show_default=True, help="Memory VMs.")
@click.option("--client-vms", default=2, show_default=True, help="Client VMs driving the load.")
@click.option("--nic", default="1Gbit", show_default=True, help="Every VM's link cap, both ways.")
@click.option("--slab-memory", default="64MiB", show_default=True, help="Memory per memory VM.")
@click.option("--working-set", default=3.0, show_default=True, help="Working set / total memory.")
@click.option("--chunk-size", default="1MiB", show_default=True, help="Bytes per chunk.")
@click.option("--chunks", default=8, show_default=True, help="Chunks per prompt.")
@click.option("--seconds", default=20.0, show_default=True, help="Mixed-load phase per layout.")
@click.option(
    "--store-ratio", default=0.2, show_default=True, help="Share of operations that store."
)
@click.option("--state-dir", default="", help="Cluster state directory (default: a temporary one).")
@click.option("--json", "json_path", default="", help="Also write the results to this file.")
def command(
    layouts: str,
    shards: int,
    memory_vms: int,
    client_vms: int,
    nic: str,
    slab_memory: str,
    working_set: float,
    chunk_size: str,
    chunks: int,
    seconds: float,
    store_ratio: float,
    state_dir: str,
    json_path: str,
) -> None:
    """Tiered-locally vs global pools vs memory-only on capped links (root needed)."""
    core.guarded(
        "cluster",
        lambda: run(
            parse_plan(
                layouts,
                shards,
                memory_vms,
                client_vms,
                nic,
                slab_memory,
                working_set,
                chunk_size,
                chunks,
                seconds,
                store_ratio,
                state_dir,
            ),
            json_path,
        ),
    )
