"""Network plumbing of the cluster: namespaces, veth pairs, one bridge, tc caps.

Everything goes through `ip` and `tc` (iproute2), the tools an operator would use to
look at it, so what the harness made can be inspected and removed by hand too. Each VM
gets one veth pair: `eth0` inside its namespace, and on the host side a link named like
the namespace, enslaved to the bridge. A link's counters on the host side are the VM's
traffic seen from the switch: what the host end receives the VM sent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass

from polarkv_lib.errors import PolarKVError

COMMAND_TIMEOUT = 20.0
IFNAME_MAX = 15  # IFNAMSIZ - 1
VM_IFNAME = "eth0"


class ClusterError(PolarKVError):
    """The cluster could not be set up, or a step of it failed."""


_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(value: str) -> int:
    """'2Gbit' -> 2_000_000_000 bits/s; '0' or 'none' -> 0 (no cap)."""
    text = value.strip().lower()
    if text in ("0", "none", "off", ""):
        return 0
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?bit)", text)
    if not m:
        raise ValueError(f"not a link rate: {value!r} (use e.g. 2Gbit, 500Mbit, or none)")
    return int(float(m.group(1)) * _RATE_UNITS[m.group(2)])


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
        )
    except FileNotFoundError:
        raise ClusterError(f"{args[0]} not found: the cluster needs iproute2 (ip, tc)") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(args)}: no answer in {COMMAND_TIMEOUT:.0f}s") from None
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def available() -> str | None:
    """None if this process can make namespaces, links and qdiscs; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "tc", "unshare"):
        try:
            subprocess.run([tool, "-V"], capture_output=True, timeout=COMMAND_TIMEOUT, check=False)
        except FileNotFoundError:
            return f"{tool} is not installed (iproute2 / util-linux)"
    probe = "pkvprobe"
    try:
        run("ip", "netns", "add", probe)
    except ClusterError as exc:
        return f"cannot create a network namespace: {exc}"
    run("ip", "netns", "del", probe, check=False)
    return None


def list_netns(prefix: str) -> list[str]:
    out = run("ip", "-j", "netns", "list", check=False).stdout.strip()
    names = [entry["name"] for entry in json.loads(out)] if out else []
    return sorted(n for n in names if n.startswith(prefix))


def list_links(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/sys/class/net") if n.startswith(prefix))


def netns_pids(name: str) -> list[int]:
    out = run("ip", "netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def create_bridge(name: str, address: str) -> None:
    """The switch every VM's link hangs off; `address` (CIDR) is the host's seat on it,
    from which `polarkv cluster status` and the tests' admin calls reach the managers."""
    run("ip", "link", "add", name, "type", "bridge")
    run("ip", "addr", "add", address, "dev", name)
    run("ip", "link", "set", name, "up")


def create_netns(name: str) -> None:
    run("ip", "netns", "add", name)
    run("ip", "-n", name, "link", "set", "lo", "up")


def create_link(netns: str, host_end: str, bridge: str, address: str) -> None:
    """A veth pair: `eth0` with `address` (CIDR) inside `netns`, `host_end` on the bridge."""
    if len(host_end) > IFNAME_MAX:
        raise ClusterError(f"link name {host_end!r} is longer than {IFNAME_MAX} characters")
    run("ip", "link", "add", host_end, "type", "veth", "peer", "name", VM_IFNAME, "netns", netns)
    run("ip", "link", "set", host_end, "master", bridge, "up")
    run("ip", "-n", netns, "addr", "add", address, "dev", VM_IFNAME)
    run("ip", "-n", netns, "link", "set", VM_IFNAME, "up")


def cap(host_end: str, netns: str, rate_bits: int, peer_block: str) -> None:
    """Cap the VM's link at `rate_bits` per second each way, like a cloud NIC: what the
    VM sends leaves through its own eth0, what it receives leaves the bridge through the
    host end, so one shaper on each egress caps both directions.

    The shaper is htb with one capped parent and two children that share it: traffic
    with the memory VMs' block (`peer_block`) on the far side, and the rest. The
    children only count (each may borrow the whole rate): their byte counters are what
    `peer_bytes` reads to tell tiering traffic between memory VMs from client traffic.
    A rate of 0 means no cap (a shaper at 100 Gbit/s keeps the counters)."""
    rate = rate_bits or 100 * 10**9
    burst = str(max(64 * 1024, rate // 8 // 100))  # 10 ms at line rate, >= a GSO packet
    for ns, dev, side in ((None, host_end, "src"), (netns, VM_IFNAME, "dst")):
        tc = ["tc", "-n", ns] if ns else ["tc"]
        run(*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
        run(
            *tc,
            "class",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "classid",
            "1:1",
            "htb",
            "rate",
            f"{rate}bit",
            "burst",
            burst,
            "quantum",
            "60000",
        )
        for child in ("1:10", "1:20"):
            run(
                *tc,
                "class",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "classid",
                child,
                "htb",
                "rate",
                f"{rate // 2}bit",
                "ceil",
                f"{rate}bit",
                "burst",
                burst,
                "quantum",
                "60000",
            )
        run(
            *tc,
            "filter",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            "match",
            "ip",
            side,
            peer_block,
            "flowid",
            "1:10",
        )


def peer_bytes(host_end: str) -> int:
    """Bytes this VM received from the memory VMs' block (counted at the switch port)."""
    out = run("tc", "-s", "class", "show", "dev", host_end, check=False).stdout
    m = re.search(r"class htb 1:10 .*?\n\s*Sent (\d+) bytes", out)
    return int(m.group(1)) if m else 0


def qdisc_kinds(host_end: str) -> list[str]:
    """Root qdisc kinds on a host-side link (empty once the link is gone)."""
    if not os.path.exists(f"/sys/class/net/{host_end}"):
        return []
    out = run("tc", "-j", "qdisc", "show", "dev", host_end, check=False).stdout.strip()
    return [q.get("kind", "") for q in json.loads(out)] if out else []


def delete_netns(name: str) -> None:
    """Deleting a namespace deletes its veth end, and with it the host end."""
    run("ip", "netns", "del", name, check=False)


def delete_link(name: str) -> None:
    if os.path.exists(f"/sys/class/net/{name}"):
        run("ip", "link", "del", name, check=False)


@dataclass(frozen=True, slots=True)
class Counters:
    """Bytes a VM sent and received on its link, read at the switch port."""

    sent: int
    received: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.sent - other.sent, self.received - other.received)

    @property
    def total(self) -> int:
        return self.sent + self.received


def counters(host_end: str) -> Counters:
    base = f"/sys/class/net/{host_end}/statistics"
    try:
        with open(f"{base}/rx_bytes") as rx, open(f"{base}/tx_bytes") as tx:
            return Counters(sent=int(rx.read()), received=int(tx.read()))
    except OSError as exc:
        raise ClusterError(f"no counters for link {host_end}: {exc.strerror}") from None
