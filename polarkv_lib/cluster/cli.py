"""`polarkv cluster up|down|status|exec`: a multi-VM cluster on this machine (needs root).

polarkv cluster up --shards 2 --memory-vms 3 --client-vms 2 --nic 2Gbit
polarkv cluster exec cli0 -- polarkv admin stats
polarkv cluster status
polarkv cluster down
"""

from __future__ import annotations

import signal
import subprocess
import sys
from types import FrameType
from typing import NoReturn

import click
import orjson

from polarkv_lib.cluster import netns, procs
from polarkv_lib.cluster.harness import DEFAULT_ROOT, Cluster
from polarkv_lib.cluster.netns import ClusterError
from polarkv_lib.cluster.spec import ClusterSpec
from polarkv_lib.errors import ExitCode, fail

_name = click.option(
    "--name",
    default="pkv",
    show_default=True,
    help="Cluster name: prefix of its namespaces and links, and its state directory.",
)
_root = click.option(
    "--state-dir",
    default=DEFAULT_ROOT,
    show_default=True,
    help="Where clusters keep their state, logs and data.",
)


def _fail(message: str, code: ExitCode = ExitCode.RUNTIME) -> NoReturn:
    fail("polarkv cluster", message, code)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM during `up`: the same clean teardown as Ctrl-C


@click.group()
def cluster() -> None:
    """A cluster of VMs as network namespaces on this machine (root needed)."""


@cluster.command()
@_name
@_root
@click.option("--shards", default=1, show_default=True, help="Manager shards (one VM each).")
@click.option("--memory-vms", default=2, show_default=True, help="Memory VMs (slab + disk each).")
@click.option(
    "--client-vms", default=1, show_default=True, help="Client VMs (for tools and tests)."
)
@click.option(
    "--nic",
    default="2Gbit",
    show_default=True,
    help="Each VM's link cap, both ways ('none': no cap).",
)
@click.option(
    "--slab-memory", default="256MiB", show_default=True, help="Slab buffer per memory VM."
)
@click.option("--disk-capacity", default="2GiB", show_default=True, help="Disk tier per memory VM.")
@click.option(
    "--subnet",
    default="10.77.0",
    show_default=True,
    help="First three octets of the cluster's /24.",
)
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Passed to every polarkv process of the cluster; repeatable.",
)
def up(
    name: str,
    state_dir: str,
    shards: int,
    memory_vms: int,
    client_vms: int,
    nic: str,
    slab_memory: str,
    disk_capacity: str,
    subnet: str,
    settings: tuple[str, ...],
) -> None:
    """Create the VMs and start the managers and memory VMs (replaces an earlier run)."""
    why = netns.available()
    if why:
        _fail(why, ExitCode.CONFIG)
    try:
        spec = ClusterSpec(
            name=name,
            subnet=subnet,
            shards=shards,
            memory_vms=memory_vms,
            client_vms=client_vms,
            nic=nic,
            slab_memory=slab_memory,
            disk_capacity=disk_capacity,
            settings=settings,
        )
    except ClusterError as exc:
        _fail(str(exc), ExitCode.CONFIG)
    handle = Cluster(spec, state_dir)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        handle.up()
    except ClusterError as exc:
        _fail(f"up failed, everything removed again: {exc}")
    except KeyboardInterrupt:
        _fail("interrupted; everything removed again")
    finally:
        signal.signal(signal.SIGTERM, previous)
    click.echo(orjson.dumps(handle.status(), option=orjson.OPT_INDENT_2))
    click.echo(
        f"cluster {name} is up; `polarkv cluster exec cli0 -- CMD` runs CMD in a client VM; "
        f"`polarkv cluster down --name {name}` removes it",
        err=True,
    )


@cluster.command()
@_name
@_root
def down(name: str, state_dir: str) -> None:
    """Stop every process of the cluster and remove its namespaces, links and buffers."""
    try:
        handle = Cluster.load(name, state_dir)
    except ClusterError:
        handle = Cluster(ClusterSpec(name=name), state_dir)  # no records: remove by prefix
    removed = handle.down()
    left = {k: v for k, v in handle.leftovers().items() if v}
    if left:
        _fail(f"could not remove: {left}")
    click.echo(
        f"cluster {name} removed ({len(removed['namespaces'])} namespaces, "
        f"{len(removed['links'])} links)"
    )


@cluster.command()
@_name
@_root
def status(name: str, state_dir: str) -> None:
    """VMs, addresses, processes, link counters and each shard's key counts (JSON)."""
    try:
        handle = Cluster.load(name, state_dir)
    except ClusterError as exc:
        _fail(str(exc))
    click.echo(orjson.dumps(handle.status(), option=orjson.OPT_INDENT_2))


@cluster.command("exec", context_settings={"ignore_unknown_options": True})
@_name
@_root
@click.argument("vm")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(name: str, state_dir: str, vm: str, command: tuple[str, ...]) -> None:
    """Run COMMAND in VM, with the cluster's manager URLs and token in its environment."""
    try:
        handle = Cluster.load(name, state_dir)
        target = handle.spec.vm(vm)
    except ClusterError as exc:
        _fail(str(exc), ExitCode.CONFIG)
    done = subprocess.run(
        procs.in_vm(target, command), env=procs.vm_env(handle.spec.client_env()), check=False
    )
    sys.exit(done.returncode)
