"""`polarkv plan`: the paper's cloud cost model (DESIGN §12).

Memory is bought as VMs: their NIC caps what their memory can serve, so memory is sized
for bandwidth. Cloud disks are cheap per GiB, but a volume's throughput is tied to its
provisioned capacity (ESSD: min(max, base + k x GiB) MB/s), so a disk sized for
bandwidth is sized far beyond the data. Three designs side by side:

    tiered       VMs for the bandwidth (their memory is the hot tier) + cheap disk for
                 the capacity, paired on the same VMs (PolarKV)
    memory_only  VMs for bandwidth and for the whole capacity in memory (Mooncake-like)
    disk_only    VMs for the network + disks provisioned for bandwidth and capacity
                 (3FS-like)

With --budget, each design instead spends the same monthly amount: what memory and disk
it buys. Units: rates in bytes/s (MB = 10^6 B, as the ESSD rules use), disk capacity in
GiB as the cloud sells it.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any, NoReturn

import click
import orjson

from polarkv_lib.config import parse_size
from polarkv_lib.errors import ExitCode, fail

MB = 10**6
GIB = 2**30
_BITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(value: str) -> float:
    """'4GB/s' -> 4e9, '12.5Gbps' -> 1.5625e9, '350MB/s', '3GiB/s'; bare: bytes/s."""
    text = value.strip()
    bits = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(?:bps|bit/s)", text)
    if bits:
        return float(bits.group(1)) * _BITS[bits.group(2).lower()] / 8
    if text.endswith("/s"):
        text = text[:-2]
    try:
        return float(parse_size(text))
    except ValueError:
        raise ValueError(f"not a rate: {value!r} (use e.g. 4GB/s, 500MB/s, 12.5Gbps)") from None


@dataclass(frozen=True)
class VmType:
    name: str
    cache_memory: int  # bytes of slab memory per VM
    nic: float  # bytes/s
    monthly: float


@dataclass(frozen=True)
class DiskClass:
    name: str
    gib_monthly: float
    base_mbps: float
    per_gib_mbps: float
    max_mbps: float
    min_gib: int
    max_gib: int

    def gib_for(self, mbps: float) -> int:
        """Smallest volume of this class that delivers `mbps` (<= max_mbps)."""
        need = (
            math.ceil((mbps - self.base_mbps) / self.per_gib_mbps) if mbps > self.base_mbps else 0
        )
        return max(self.min_gib, need)

    def volumes_for(self, rate: float) -> tuple[int, int]:
        """(volumes, GiB) provisioned so that their summed throughput reaches `rate`
        bytes/s: full-speed volumes, and one smaller volume for the remainder."""
        mbps = rate / MB
        full = int(mbps // self.max_mbps)
        rest = mbps - full * self.max_mbps
        gib = full * self.gib_for(self.max_mbps)
        if rest > 1e-9:
            return full + 1, gib + self.gib_for(rest)
        return full, gib

    def throughput(self, gib: int) -> float:
        """Bytes/s of `gib` GiB of this class spread over full-speed volumes."""
        per_volume = self.gib_for(self.max_mbps)
        full, rest = divmod(gib, per_volume)
        mbps = full * self.max_mbps
        if rest:
            mbps += min(self.max_mbps, self.base_mbps + self.per_gib_mbps * rest)
        return mbps * MB


@dataclass(frozen=True)
class Prices:
    currency: str
    vms: tuple[VmType, ...]
    disks: dict[str, DiskClass]
    tiered_disk_class: str


class PriceError(ValueError):
    """The price table is missing something or holds a wrong value."""


def load_prices(path: str | None = None) -> Prices:
    try:
        if path is None:
            raw = resources.files("polarkv_lib.tools").joinpath("prices.toml").read_bytes()
        else:
            with open(path, "rb") as fh:
                raw = fh.read()
        table = tomllib.loads(raw.decode())
    except OSError as exc:
        raise PriceError(f"cannot read price table {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PriceError(f"price table {path or 'prices.toml'} is not valid TOML: {exc}") from None
    where = path or "prices.toml"
    try:
        vms = tuple(
            VmType(
                str(v["name"]),
                parse_size(v["cache_memory"]),
                parse_rate(str(v["nic"])),
                float(v["monthly"]),
            )
            for v in table["vm"]
        )
        disks = {
            name: DiskClass(
                name,
                float(d["gib_monthly"]),
                float(d["base_mbps"]),
                float(d["per_gib_mbps"]),
                float(d["max_mbps"]),
                int(d["min_gib"]),
                int(d["max_gib"]),
            )
            for name, d in table["disk"].items()
        }
        prices = Prices(str(table["currency"]), vms, disks, str(table["plan"]["tiered_disk_class"]))
    except KeyError as exc:
        raise PriceError(f"{where}: missing key {exc}") from None
    except (TypeError, ValueError) as exc:
        raise PriceError(f"{where}: bad value: {exc}") from None
    if not vms or not disks or prices.tiered_disk_class not in disks:
        raise PriceError(
            f"{where}: needs at least one [[vm]], one [disk.X] and plan.tiered_disk_class"
        )
    if any(v.nic <= 0 or v.monthly <= 0 for v in vms) or any(
        d.max_mbps <= 0 or d.per_gib_mbps <= 0 or d.gib_monthly <= 0 for d in disks.values()
    ):
        raise PriceError(f"{where}: rates and prices must be positive")
    return prices


def disk_for_rate(prices: Prices, disk_class: str, rate: float) -> dict[str, Any]:
    """The disk a class must provision to deliver `rate` and its monthly price."""
    disk = _disk_class(prices, disk_class)
    volumes, gib = disk.volumes_for(rate)
    return {
        "disk_class": disk.name,
        "disk_bytes": gib * GIB,
        "disk_gib": gib,
        "volumes": volumes,
        "monthly_cost": round(gib * disk.gib_monthly, 2),
        "currency": prices.currency,
    }


def _disk_class(prices: Prices, name: str) -> DiskClass:
    try:
        return prices.disks[name]
    except KeyError:
        raise PriceError(
            f"unknown disk class {name!r} (known: {', '.join(prices.disks)})"
        ) from None


def _design(
    name: str, vm: VmType | None, nodes: int, disk: DiskClass | None, gib: int, bandwidth: float
) -> dict[str, Any]:
    vm_cost = nodes * vm.monthly if vm else 0.0
    disk_cost = gib * disk.gib_monthly if disk else 0.0
    return {
        "name": name,
        "monthly_cost": round(vm_cost + disk_cost, 2),
        "memory_bytes": nodes * vm.cache_memory if vm and name != "disk_only" else 0,
        "disk_bytes": gib * GIB,
        "nodes": nodes,
        "bandwidth_bytes_per_s": bandwidth,
        "vm": vm.name if vm else None,
        "disk_class": disk.name if disk else None,
        "disk_bandwidth_bytes_per_s": disk.throughput(gib) if disk and gib else 0.0,
        "vm_cost": round(vm_cost, 2),
        "disk_cost": round(disk_cost, 2),
    }


def _network_nodes(vm: VmType, bandwidth: float) -> int:
    return max(1, math.ceil(bandwidth / vm.nic - 1e-9))


def plan(prices: Prices, bandwidth: float, capacity: int) -> list[dict[str, Any]]:
    """Designs that serve `bandwidth` bytes/s and hold `capacity` bytes, each cheapest."""
    gib = math.ceil(capacity / GIB)
    # tiered: VMs for the bandwidth (most memory among the cheapest), disk for the capacity
    tier_vm = min(
        prices.vms, key=lambda v: (_network_nodes(v, bandwidth) * v.monthly, -v.cache_memory)
    )
    nodes = _network_nodes(tier_vm, bandwidth)
    tier_disk = prices.disks[prices.tiered_disk_class]
    tiered = _design(
        "tiered",
        tier_vm,
        nodes,
        tier_disk,
        max(gib, tier_disk.min_gib * nodes),
        nodes * tier_vm.nic,
    )

    def memory_nodes(v: VmType) -> int:
        return max(_network_nodes(v, bandwidth), math.ceil(capacity / v.cache_memory))

    mem_vm = min(prices.vms, key=lambda v: memory_nodes(v) * v.monthly)
    memory_only = _design(
        "memory_only", mem_vm, memory_nodes(mem_vm), None, 0, memory_nodes(mem_vm) * mem_vm.nic
    )

    # disk only: the disk itself must deliver the bandwidth, and hold the capacity
    net_vm = min(prices.vms, key=lambda v: _network_nodes(v, bandwidth) * v.monthly)
    net_nodes = _network_nodes(net_vm, bandwidth)
    best: dict[str, Any] | None = None
    for disk in prices.disks.values():
        need = max(gib, disk.volumes_for(bandwidth)[1])
        option = _design(
            "disk_only",
            net_vm,
            net_nodes,
            disk,
            need,
            min(net_nodes * net_vm.nic, disk.throughput(need)),
        )
        if best is None or option["monthly_cost"] < best["monthly_cost"]:
            best = option
    assert best is not None
    return [tiered, memory_only, best]


def plan_budget(prices: Prices, bandwidth: float, budget: float) -> list[dict[str, Any]]:
    """What each design buys for the same monthly `budget` at `bandwidth` bytes/s."""
    designs = []
    tier_vm = min(
        prices.vms, key=lambda v: (_network_nodes(v, bandwidth) * v.monthly, -v.cache_memory)
    )
    nodes = _network_nodes(tier_vm, bandwidth)
    tier_disk = prices.disks[prices.tiered_disk_class]
    left = budget - nodes * tier_vm.monthly
    designs.append(
        _design(
            "tiered",
            tier_vm,
            nodes,
            tier_disk,
            max(0, int(left // tier_disk.gib_monthly)),
            nodes * tier_vm.nic,
        )
    )
    fits = [v for v in prices.vms if int(budget // v.monthly) >= _network_nodes(v, bandwidth)]
    mem_vm = max(fits, key=lambda v: int(budget // v.monthly) * v.cache_memory) if fits else tier_vm
    mem_nodes = int(budget // mem_vm.monthly)
    designs.append(_design("memory_only", mem_vm, mem_nodes, None, 0, mem_nodes * mem_vm.nic))
    best: dict[str, Any] | None = None
    for disk in prices.disks.values():  # most capacity that still delivers the bandwidth
        gib = max(0, int(left // disk.gib_monthly))
        option = _design(
            "disk_only", tier_vm, nodes, disk, gib, min(nodes * tier_vm.nic, disk.throughput(gib))
        )
        ok = disk.throughput(gib) >= bandwidth * (1 - 1e-9)
        if ok and (best is None or option["disk_bytes"] > best["disk_bytes"]):
            best = option
    if best is None:
        raise PriceError("the budget left after the VMs buys no disk that delivers the bandwidth")
    designs.append(best)
    for d in designs:
        if d["monthly_cost"] > budget + 0.01:
            raise PriceError(f"a budget of {budget:g} cannot pay the VMs for that bandwidth")
    return designs


def _fail(message: str) -> NoReturn:
    fail("polarkv plan", message, ExitCode.CONFIG)


def _table(designs: list[dict[str, Any]], currency: str) -> str:
    rows = [
        f"{'design':<12} {'nodes':>5} {'memory GB':>10} {'disk GiB':>10} {'GB/s':>6} "
        f"{'disk GB/s':>9} {'monthly ' + currency:>14}  vm / disk class"
    ]
    for d in designs:
        rows.append(
            f"{d['name']:<12} {d['nodes']:>5} {d['memory_bytes'] / 1e9:>10.1f} "
            f"{d['disk_bytes'] // GIB:>10,} {d['bandwidth_bytes_per_s'] / 1e9:>6.2f} "
            f"{d['disk_bandwidth_bytes_per_s'] / 1e9:>9.2f} {d['monthly_cost']:>14,.0f}  "
            f"{d['vm'] or '-'} / {d['disk_class'] or '-'}"
        )
    return "\n".join(rows)


@click.command("plan")
@click.option(
    "--bandwidth", default="12GB/s", show_default=True, help="Aggregate bandwidth to serve."
)
@click.option("--capacity", default="20TiB", show_default=True, help="Bytes of KV to keep.")
@click.option("--budget", default=None, help="Monthly budget: what each design buys for it.")
@click.option(
    "--prices", "prices_path", default=None, help="Price table (TOML); default: the shipped one."
)
@click.option("--disk-class", default=None, help="With --disk-bandwidth: one ESSD class, e.g. PL3.")
@click.option("--disk-bandwidth", default=None, help="With --disk-class: the rate it must deliver.")
@click.option("--json", "as_json", is_flag=True, default=False, help="Print JSON.")
def plan_command(
    bandwidth: str,
    capacity: str,
    budget: str | None,
    prices_path: str | None,
    disk_class: str | None,
    disk_bandwidth: str | None,
    as_json: bool,
) -> None:
    """Cloud cost of tiered vs memory-only vs disk-only KV caches (the paper's model)."""
    try:
        prices = load_prices(prices_path)
        if (disk_class is None) != (disk_bandwidth is None):
            _fail("--disk-class and --disk-bandwidth go together")
        if disk_class is not None and disk_bandwidth is not None:
            rate = parse_rate(disk_bandwidth)
            if rate <= 0:
                _fail("--disk-bandwidth must be positive")
            result: dict[str, Any] = disk_for_rate(prices, disk_class, rate)
            click.echo(
                orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
                if as_json
                else f"{result['disk_class']}: {result['disk_gib']:,} GiB in {result['volumes']} "
                f"volume(s) for {rate / 1e9:g} GB/s: {result['monthly_cost']:,.0f} "
                f"{result['currency']}/month"
            )
            return
        rate = parse_rate(bandwidth)
        if rate <= 0:
            _fail("--bandwidth must be positive")
        if budget is not None:
            try:
                amount = float(budget)
            except ValueError:
                _fail(f"--budget must be a number, got {budget!r}")
            if amount <= 0:
                _fail("--budget must be positive")
            designs = plan_budget(prices, rate, amount)
        else:
            size = parse_size(capacity)
            if size <= 0:
                _fail("--capacity must be positive")
            designs = plan(prices, rate, size)
    except (PriceError, ValueError) as exc:
        _fail(str(exc))
    out = {"currency": prices.currency, "bandwidth_bytes_per_s": rate, "designs": designs}
    click.echo(
        orjson.dumps(out, option=orjson.OPT_INDENT_2).decode()
        if as_json
        else _table(designs, prices.currency)
    )
