"""`polarkv plan`: the paper's cloud arithmetic against hand-computed cases."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from polarkv_lib.tools.plan import (
    GIB,
    DiskClass,
    PriceError,
    load_prices,
    parse_rate,
    plan,
    plan_budget,
)
from tests.conftest import assert_usage_error

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "polarkv.py"), "plan", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_rates() -> None:
    assert parse_rate("4GB/s") == 4e9
    assert parse_rate("12.5Gbps") == 12.5e9 / 8
    assert parse_rate("350MB/s") == 350e6
    assert parse_rate("1GiB/s") == 2**30
    with pytest.raises(ValueError, match="not a rate"):
        parse_rate("fast")


def test_paper_pl3_example() -> None:
    # PL3: min(4000, 120 + 0.5 x GiB) MB/s = 4000 -> (4000 - 120) / 0.5 = 7,760 GiB;
    # at 4 CNY per GiB-month: 31,040 CNY a month (the paper: ~7.76 TB, ~31,040 CNY).
    done = run_cli("--disk-class", "PL3", "--disk-bandwidth", "4GB/s", "--json")
    assert done.returncode == 0, done.stderr
    out = orjson.loads(done.stdout)
    assert out["disk_class"] == "PL3" and out["currency"] == "CNY"
    assert out["disk_bytes"] == 7760 * GIB
    assert out["monthly_cost"] == 31040.0


def test_volumes_split_beyond_one_volume_max() -> None:
    pl3 = load_prices().disks["PL3"]
    # 6 GB/s: one volume at 4000 MB/s (7,760 GiB) + one at 2000 MB/s ((2000-120)/0.5 = 3,760)
    assert pl3.volumes_for(6e9) == (2, 7760 + 3760)
    # a small rate still pays the class's minimum volume
    assert pl3.volumes_for(100e6) == (1, 1261)
    pl0 = load_prices().disks["PL0"]
    # 12 GB/s over PL0 at 180 MB/s per 320 GiB volume: 66 full volumes + 120 MB/s on
    # a (120-100)/0.25 = 80 GiB one
    assert pl0.volumes_for(12e9) == (67, 66 * 320 + 80)
    assert pl0.throughput(67 * 320) == 67 * 180e6


def test_designs_for_bandwidth_and_capacity() -> None:
    prices = load_prices()
    designs = {d["name"]: d for d in plan(prices, 12e9, 21440 * GIB)}
    # tiered: ceil(12 GB/s / 1.5625 GB/s) = 8 network VMs (960) + 21,440 GiB PL0 (0.5)
    tiered = designs["tiered"]
    assert tiered["nodes"] == 8 and tiered["vm"] == "network-vm"
    assert tiered["memory_bytes"] == 8 * 19.5e9
    assert tiered["monthly_cost"] == 8 * 960 + 21440 * 0.5 == 18400
    # memory only: ceil(21,440 GiB / 116 GB) = 199 memory VMs x 2,300
    mem = designs["memory_only"]
    assert mem["nodes"] == 199 and mem["disk_bytes"] == 0
    assert mem["monthly_cost"] == 199 * 2300
    # disk only: the cheapest class delivering 12 GB/s and holding 21,440 GiB is PL0:
    # 67 volumes (21,200 GiB) for the rate, more for the capacity
    disk = designs["disk_only"]
    assert disk["disk_class"] == "PL0" and disk["memory_bytes"] == 0
    assert disk["disk_bytes"] == 21440 * GIB
    assert disk["monthly_cost"] == 8 * 960 + 21440 * 0.5
    assert disk["bandwidth_bytes_per_s"] == 67 * 180e6  # 21,440 GiB = 67 full PL0 volumes


def test_equal_budget_reproduces_the_papers_setup() -> None:
    # The paper's comparison: 18.4K CNY/month, >= ~12 GB/s each: Mooncake 928 GB of
    # memory; 3FS ~21.4 TB of disk; PolarKV the same disk + a 156 GB memory tier.
    designs = {d["name"]: d for d in plan_budget(load_prices(), 12e9, 18400)}
    assert designs["memory_only"]["memory_bytes"] == 928e9
    assert designs["tiered"]["memory_bytes"] == 156e9
    assert designs["tiered"]["disk_bytes"] == designs["disk_only"]["disk_bytes"] == 21440 * GIB
    assert all(d["monthly_cost"] <= 18400 for d in designs.values())
    with pytest.raises(PriceError, match="budget"):
        plan_budget(load_prices(), 12e9, 5000)


def test_disk_class_rule() -> None:
    pl1 = DiskClass("PL1", 1.0, 120, 0.5, 350, 20, 65536)
    assert pl1.gib_for(350) == 460  # (350 - 120) / 0.5
    assert pl1.gib_for(50) == 20  # below the base rate: the minimum volume


def test_custom_price_file(tmp_path: Path) -> None:
    table = tmp_path / "prices.toml"
    table.write_text(
        'currency = "USD"\n[[vm]]\nname = "a"\ncache_memory = "100GB"\n'
        'nic = "8Gbps"\nmonthly = 100\n[disk.X]\ngib_monthly = 0.1\nbase_mbps = 0\n'
        "per_gib_mbps = 1\nmax_mbps = 1000\nmin_gib = 1\nmax_gib = 10000\n"
        '[plan]\ntiered_disk_class = "X"\n'
    )
    done = run_cli(
        "--prices", str(table), "--bandwidth", "2GB/s", "--capacity", "1000GiB", "--json"
    )
    assert done.returncode == 0, done.stderr
    out = orjson.loads(done.stdout)
    designs = {d["name"]: d for d in out["designs"]}
    assert out["currency"] == "USD"
    # 2 GB/s over 1 GB/s NICs: 2 VMs; 1000 GiB at 0.1
    assert designs["tiered"]["nodes"] == 2
    assert designs["tiered"]["monthly_cost"] == 2 * 100 + 1000 * 0.1
    # memory only: max(2, ceil(1000 GiB / 100 GB) = 11) VMs
    assert designs["memory_only"]["nodes"] == 11
    # disk only: 2 GB/s needs 2 x 1000 GiB volumes, more than the 1000 GiB of data
    assert designs["disk_only"]["disk_bytes"] == 2000 * GIB


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bandwidth", "lots"], "not a rate"),
        (["--capacity", "big"], "not a size"),
        (["--budget", "x"], "--budget must be a number"),
        (["--disk-class", "PL3"], "go together"),
        (["--disk-class", "PL9", "--disk-bandwidth", "1GB/s"], "unknown disk class"),
        (["--prices", "/nonexistent/prices.toml"], "cannot read price table"),
        (["--bandwidth", "0GB/s"], "must be positive"),
    ],
)
def test_bad_flags_one_line(args: list[str], message: str) -> None:
    done = run_cli(*args)
    assert_usage_error(done, message)


def test_bad_price_table(tmp_path: Path) -> None:
    table = tmp_path / "prices.toml"
    table.write_text('currency = "CNY"\n[[vm]]\nname = "a"\n')
    done = run_cli("--prices", str(table))
    assert done.returncode == 2 and "missing key" in done.stderr
    table.write_text("not toml [")
    done = run_cli("--prices", str(table))
    assert done.returncode == 2 and "not valid TOML" in done.stderr
