"""`Cluster`: bring a cluster up, run things in it, take it down, whatever happened.

State lives in ./.cluster/NAME/ (git-ignored): `state.json` (the spec, its secrets, and
each service process's pid and start time), one directory per VM (metadata file of a
manager, disk path of a memory VM) and ready files, all removed by `down`, and the logs,
kept until the next `up`. The state file is written
before anything is created and removed only once everything is gone, so after a crash
the next `up` or `down` finds what to remove; beyond the records, `down` also removes
every namespace and link that carries the cluster's prefix.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from polarkv_lib.client.admin import AdminClient
from polarkv_lib.cluster import netns, procs
from polarkv_lib.cluster.netns import ClusterError, Counters
from polarkv_lib.cluster.spec import MANAGER_PORT, POOL_PORT, SLAB_PORT, ClusterSpec, Vm
from polarkv_lib.errors import PolarKVError
from polarkv_lib.service import Service, ServiceError, polarkv_argv

DEFAULT_ROOT = ".cluster"
JOIN_TIMEOUT = 30.0


class Cluster:
    def __init__(self, spec: ClusterSpec, root: str | os.PathLike[str] = DEFAULT_ROOT) -> None:
        self.spec = spec
        self.dir = Path(root).resolve() / spec.name
        self.shm_dir = Path("/dev/shm") / f"polarkv-cluster-{spec.name}"
        self._procs: dict[str, dict[str, Any]] = {}
        self._services: dict[str, Service] = {}
        self._phase = "down"

    # -- state --------------------------------------------------------------------------

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    def _save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the tokens
        with os.fdopen(fd, "w") as fh:
            json.dump(
                {"phase": self._phase, "spec": self.spec.to_json(), "procs": self._procs},
                fh,
                indent=1,
            )
        os.replace(tmp, self.state_file)

    @classmethod
    def load(cls, name: str, root: str | os.PathLike[str] = DEFAULT_ROOT) -> Cluster:
        """The cluster recorded under root/name; ClusterError if there is none."""
        path = Path(root).resolve() / name / "state.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ClusterError(
                f"no cluster {name!r} recorded under {Path(root).resolve()}"
            ) from None
        cluster = cls(ClusterSpec.from_json(data["spec"]), root)
        cluster._procs = data.get("procs", {})
        cluster._phase = data.get("phase", "unknown")
        return cluster

    # -- up / down ----------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.down()

    def up(self) -> None:
        """Create the network and start every service; on any failure (Ctrl-C included)
        remove all of it again before raising."""
        if self.state_file.exists():  # an earlier run of this name crashed: its records
            with contextlib.suppress(ClusterError):
                self._procs = Cluster.load(self.spec.name, self.dir.parent)._procs
        self.down()  # and whatever else it left behind
        shutil.rmtree(self.dir / "logs", ignore_errors=True)  # a new cluster: new logs, no data
        self._phase = "starting"
        self._save()
        try:
            self._create_network()
            # Managers first (slabs register with them), then any global-pools disk
            # servers (disk roles connect to them), then the memory VMs.
            for stage in (
                self.spec.manager_services(),
                self.spec.pool_services(),
                self.spec.memory_services(),
            ):
                for name in stage:
                    self.start_service(name, wait=False)
                for name in stage:
                    self.wait_service(name)
            self.wait_joined()
            self._phase = "up"
            self._save()
        except BaseException:
            self.down()
            raise

    def down(self) -> dict[str, list[str]]:
        """Stop every process in the cluster's namespaces, delete namespaces, links and
        bridge, free the slab buffers. Safe to call at any time, any number of times."""
        prefix = f"{self.spec.name}-"
        spaces = netns.list_netns(prefix)
        # Every process in our namespaces (recorded or not), and the recorded ones whose
        # namespace an earlier, interrupted `down` already deleted; all at once, so the
        # whole stop takes one shutdown bound, not one per VM.
        found = [
            (pid, procs.start_time(pid)) for space in spaces for pid in netns.netns_pids(space)
        ]
        procs.stop_pids(found + [(p["pid"], p.get("started")) for p in self._procs.values()])
        for service in self._services.values():  # collect our children's exit status
            service.stop()
        self._services.clear()
        for space in spaces:
            netns.delete_netns(space)
        links = netns.list_links(prefix)
        for link in links:
            netns.delete_link(link)
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        # Data (metadata files, disk tiers) goes with the cluster: a later `up` must not
        # adopt an earlier cluster's files. The logs stay for a post-mortem.
        for path in self.dir.glob("*"):
            if path.is_dir() and path.name != "logs":
                shutil.rmtree(path, ignore_errors=True)
        self.state_file.unlink(missing_ok=True)
        self._procs.clear()
        self._phase = "down"
        return {"namespaces": spaces, "links": links}

    def leftovers(self) -> dict[str, list[str]]:
        """What of this cluster still exists in the kernel (empty lists once down)."""
        prefix = f"{self.spec.name}-"
        spaces = netns.list_netns(prefix)
        pids = [str(pid) for space in spaces for pid in netns.netns_pids(space)]
        links = netns.list_links(prefix)
        qdiscs = [
            f"{link}:{kind}"
            for link in links
            for kind in netns.qdisc_kinds(link)
            if kind in ("tbf", "htb")
        ]
        shm = sorted(str(p) for p in self.shm_dir.glob("*")) if self.shm_dir.exists() else []
        return {
            "namespaces": spaces,
            "pids": pids,
            "links": links,
            "qdiscs": qdiscs,
            "buffers": shm,
        }

    def _create_network(self) -> None:
        spec = self.spec
        rate = netns.parse_rate(spec.nic)
        netns.create_bridge(spec.bridge, f"{spec.host_address}/24")
        for vm in spec.vms():
            netns.create_netns(vm.netns)
            netns.create_link(vm.netns, vm.netns, spec.bridge, f"{vm.address}/24")
            netns.cap(vm.netns, vm.netns, rate, spec.memory_block)

    # -- services -----------------------------------------------------------------------

    def _service(self, name: str) -> tuple[Vm, list[str]]:
        """The VM a service runs in and its command line."""
        spec, ready = self.spec, str(self._ready_file(name))
        settings = [*spec.security_settings(), "log.level=info", *spec.settings]
        if name.startswith("pool"):  # the disk tier of memory VM i, on VM i+1
            owner = spec.vm(f"mem{name[4:]}")
            vm = spec.pool_host(owner)
            path = self.dir / vm.name / f"pool-for-{owner.name}"
            return vm, [
                sys.executable,
                "-m",
                "polarkv_lib.cluster.remote_disk",
                "--listen",
                f"{vm.address}:{POOL_PORT}",
                "--path",
                str(path),
                "--capacity",
                spec.disk_capacity,
                "--ready-file",
                ready,
            ]
        vm, home = spec.vm(name), self.dir / name
        if vm.role == "manager":
            roles = ["manager"]
            settings += [
                f"manager.listen={vm.address}:{MANAGER_PORT}",
                f"manager.metadata_url=sqlite:///{home}/meta.db",
            ]
            if spec.shards > 1:
                settings.append(f"manager.shard={vm.index}/{spec.shards}")
        elif vm.role == "memory":
            roles = ["slab", "disk"] if spec.disk_tier else ["slab"]
            self.shm_dir.mkdir(mode=0o700, exist_ok=True)
            settings += [
                f"slab.listen={vm.address}:{SLAB_PORT}",
                f"slab.manager_url={','.join(spec.manager_urls())}",
                f"slab.node_id={vm.name}",
                f"slab.memory={spec.slab_memory}",
                f"slab.shm_dir={self.shm_dir}",
                f"disk.paths={home / 'disk'}",
                f"disk.capacity={spec.disk_capacity}",
            ]
            if spec.global_pools:
                settings += [
                    "disk.store=polarkv_lib.cluster.remote_disk:remote_store",
                    f"disk.remote={spec.pool_host(vm).address}:{POOL_PORT}",
                ]
        else:
            raise ClusterError(f"VM {vm.name} runs no service (it is a {vm.role} VM)")
        as_set = dict(item.partition("=")[::2] for item in settings)  # the last one wins
        return vm, polarkv_argv(roles, as_set, ready)

    def _ready_file(self, name: str) -> Path:
        return self.dir / "run" / f"{name}.ready.json"

    def log_path(self, name: str) -> Path:
        return self.dir / "logs" / f"{name}.log"

    def start_service(self, name: str, wait: bool = True) -> None:
        """Start (or start again, after `kill`) a service: a manager shard `mgrI`, the
        slab and disk of a memory VM `memI`, or (global pools) the disk server `poolI`."""
        vm, argv = self._service(name)
        old = self._procs.get(name)
        if old is not None and procs.alive(old["pid"], old.get("started")):
            raise ClusterError(f"{name} is already running (pid {old['pid']})")
        (self.dir / vm.name).mkdir(parents=True, exist_ok=True)
        ready = self._ready_file(name)
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.unlink(missing_ok=True)
        service = Service(
            str(self.dir / vm.name),
            (),
            {},
            procs.STOP_TIMEOUT,
            procs.READY_TIMEOUT,
            wrapper=procs.in_vm(vm),
            argv=argv,
            ready_file=ready,
            log_path=self.log_path(name),
            inherit_settings=False,
            append_log=True,
            new_session=True,
            shm_dir=str(self.shm_dir),
        )
        service.start()
        pid = service.pid
        self._procs[name] = {"pid": pid, "started": procs.start_time(pid), "vm": vm.name}
        self._services[name] = service
        self._save()
        if wait:
            self.wait_service(name)

    def wait_service(self, name: str) -> None:
        try:
            self._services[name].wait_ready()
        except ServiceError as exc:
            raise ClusterError(f"{name} {exc}") from None

    def kill(self, vm_name: str, sig: int) -> None:
        """Send `sig` to a VM's service (SIGKILL: the crash a failure test wants)."""
        rec = self._procs.get(vm_name)
        if rec is None or not procs.signal_pid(rec["pid"], rec.get("started"), sig):
            raise ClusterError(f"{vm_name} has no running service")
        service = self._services.get(vm_name)
        if service is not None:
            try:
                service.proc.wait(procs.STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise ClusterError(
                    f"{vm_name} did not exit within {procs.STOP_TIMEOUT:.0f}s"
                ) from None

    def wait_joined(self, timeout: float = JOIN_TIMEOUT) -> None:
        """Until every shard lists every memory VM as alive."""
        want = {
            name
            for name in self.spec.memory_services()
            if name in self._procs
            and procs.alive(self._procs[name]["pid"], self._procs[name].get("started"))
        }
        deadline = time.monotonic() + timeout
        for url in self.spec.manager_urls():
            while True:
                try:
                    alive = {
                        n["id"]
                        for n in self.admin(url, "/v1/nodes")["nodes"]
                        if n["state"] == "alive"
                    }
                except ClusterError:
                    alive = set()
                if want <= alive:
                    break
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"{url} sees nodes {sorted(alive)}, expected {sorted(want)} "
                        f"within {timeout:.0f}s"
                    )
                time.sleep(0.1)

    # -- using it -----------------------------------------------------------------------

    def admin(self, url: str, path: str, method: str = "GET", timeout: float = 5.0) -> Any:
        """One admin API call from the host's seat on the bridge."""
        client = AdminClient(url, self.spec.token, self.spec.admin_token, timeout)
        try:
            return client.call(method, path, admin=method != "GET")
        except PolarKVError as exc:
            raise ClusterError(f"{method} {url}{path}: {exc}") from None

    def run_in(
        self,
        vm_name: str,
        argv: Sequence[str],
        timeout: float,
        env: Mapping[str, str] = {},
        check: bool = True,
    ) -> subprocess.CompletedProcess[bytes]:
        """Run a command in a VM with the cluster's client settings in its environment
        (manager URLs and token), bounded by `timeout`; its output is returned."""
        vm = self.spec.vm(vm_name)
        try:
            done = subprocess.run(
                procs.in_vm(vm, argv),
                env=procs.vm_env({**self.spec.client_env(), **env}),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:  # subprocess.run has killed it
            raise ClusterError(f"{' '.join(argv)} in {vm_name} ran past {timeout:.0f}s") from None
        if check and done.returncode != 0:
            raise ClusterError(
                f"{' '.join(argv)} in {vm_name} exited {done.returncode}:\n"
                f"{done.stderr.decode(errors='replace')[-3000:]}"
            )
        return done

    def counters(self, vm_name: str) -> Counters:
        return netns.counters(self.spec.vm(vm_name).netns)

    def peer_bytes(self, vm_name: str) -> int:
        """Bytes the VM received from memory VMs (all of it tiering traffic, for a
        memory VM: clients and managers are elsewhere)."""
        return netns.peer_bytes(self.spec.vm(vm_name).netns)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.spec.name,
            "phase": self._phase,
            "nic": self.spec.nic,
            "manager_urls": self.spec.manager_urls(),
            "state_dir": str(self.dir),
            "vms": [],
        }
        for vm in self.spec.vms():
            row: dict[str, Any] = {
                "vm": vm.name,
                "role": vm.role,
                "address": vm.address,
                "namespace": vm.netns,
            }
            rec = self._procs.get(vm.name)
            if rec is not None:
                row["pid"] = rec["pid"]
                row["running"] = procs.alive(rec["pid"], rec.get("started"))
            try:
                c = self.counters(vm.name)
                row.update(
                    sent_bytes=c.sent,
                    received_bytes=c.received,
                    from_memory_vms_bytes=self.peer_bytes(vm.name),
                )
            except ClusterError:
                row["link"] = "missing"
            if vm.role == "manager":
                url = f"http://{vm.address}:{MANAGER_PORT}"
                try:
                    stats = self.admin(url, "/v1/stats", timeout=2.0)
                    row.update({k: stats.get(k) for k in ("keys_memory", "keys_disk", "nodes")})
                except ClusterError as exc:
                    row["error"] = str(exc)
            out["vms"].append(row)
        return out
