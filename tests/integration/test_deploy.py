"""The deployment files stay true: Kubernetes manifests validate offline against the
Kubernetes schemas, every process they start gets a config PolarKV accepts, /dev/shm is
sized from slab.memory, and the systemd units run a command line `polarkv` accepts."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import yaml

import polarkv
from polarkv_lib.config import Config, load_config, parse_size
from polarkv_lib.runner import MANAGER_STOP_BOUND, SLAB_STOP_BOUND
from polarkv_lib.shards import Shard, split_urls
from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in MANIFESTS:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


def k8s_quantity(text: str) -> int:
    """'9Gi' -> bytes (the binary suffixes the manifests use)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text)
    assert m, text
    return int(m.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[m.group(2)]


def test_manifests_validate_against_the_kubernetes_schemas() -> None:
    assert {p.name for p in MANIFESTS} >= {
        "config.yaml",
        "secret.yaml",
        "node.yaml",
        "manager-shard-0.yaml",
        "manager-shard-1.yaml",
    }
    version = kubernetes_validate.latest_version()
    for doc in documents():
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any error
    kinds = sorted(d["kind"] for d in documents())
    assert kinds.count("StatefulSet") == 2 and kinds.count("DaemonSet") == 1
    assert {"Secret", "ConfigMap", "Service", "Namespace"} <= set(kinds)


def test_the_validator_catches_a_broken_manifest() -> None:
    node = by_kind("DaemonSet")[0]
    node["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(node, kubernetes_validate.latest_version(), strict=True)


def _container_config(workload: dict[str, Any], tmp_path: Path) -> tuple[Config, list[str]]:
    """The config its container would load: the ConfigMap's file, then its env (secret
    values and $(VAR) references resolved as the kubelet does), then its args."""
    secret = by_kind("Secret")[0]["stringData"]
    toml = by_kind("ConfigMap")[0]["data"]["polarkv.toml"]
    (tmp_path / "polarkv.toml").write_text(toml)
    container = workload["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"]
            )
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = secret[var["valueFrom"]["secretKeyRef"]["key"]]
        else:  # downward API: a stand-in of the same shape
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = {"status.podIP": "10.1.2.3", "spec.nodeName": "worker-7"}[path]
    args = container["args"]
    assert args[args.index("--config") + 1] == "/etc/polarkv/polarkv.toml"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/polarkv"] == "config"
    ctx = polarkv.main.make_context("polarkv", list(args))  # the CLI accepts the flags
    assert ctx.params["roles"]
    return load_config(str(tmp_path / "polarkv.toml"), [], env), list(ctx.params["roles"])


def test_every_workload_gets_a_config_polarkv_accepts(tmp_path: Path) -> None:
    managers = by_kind("StatefulSet")
    shards = []
    for sts in managers:
        config, roles = _container_config(sts, tmp_path)
        assert roles == ["manager"] and sts["spec"]["replicas"] == 1
        assert config.security.token and config.security.admin_token and config.security.grant_key
        shard = Shard.parse(
            next(
                v["value"]
                for v in sts["spec"]["template"]["spec"]["containers"][0]["env"]
                if v["name"] == "POLARKV_MANAGER__SHARD"
            )
        )
        shards.append((shard.index, sts["metadata"]["name"], config))
        # its metadata survives the pod: a volume (SQLite) or PostgreSQL
        if config.manager.metadata_url.startswith("sqlite:"):
            db_dir = str(Path(config.manager.metadata_url.removeprefix("sqlite:///")).parent)
            mounts = {
                m["mountPath"]: m["name"]
                for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
            }
            claims = [c["metadata"]["name"] for c in sts["spec"].get("volumeClaimTemplates", [])]
            assert mounts.get(db_dir) in claims, (
                f"{sts['metadata']['name']}: {db_dir} is not on a volume"
            )
        else:
            assert config.manager.metadata_url.startswith("postgresql://")
    shards.sort()
    assert [s[0] for s in shards] == list(range(len(shards)))
    services = {s["metadata"]["name"] for s in by_kind("Service")}
    # slabs and clients list the shard Services in shard order
    node, roles = _container_config(by_kind("DaemonSet")[0], tmp_path)
    assert roles == ["slab", "disk"]
    for urls in (node.slab.manager_url, node.client.manager_url):
        hosts = [u.removeprefix("http://").split(".")[0] for u in split_urls(urls)]
        assert hosts == [name for _, name, _ in shards] and set(hosts) <= services
    assert node.slab.node_id == "worker-7" and node.slab.advertise == "10.1.2.3:8171"


def test_dev_shm_is_sized_by_slab_memory(tmp_path: Path) -> None:
    daemonset = by_kind("DaemonSet")[0]
    config, _ = _container_config(daemonset, tmp_path)
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    container = pod["containers"][0]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    shm = volumes[mounts[config.slab.shm_dir]]["emptyDir"]
    assert shm["medium"] == "Memory"
    size_limit = k8s_quantity(shm["sizeLimit"])
    assert config.slab.memory <= size_limit <= config.slab.memory + parse_size("2GiB")
    # tmpfs pages count against the container: its limit covers the buffer
    assert k8s_quantity(container["resources"]["limits"]["memory"]) >= size_limit
    disk = volumes[mounts[config.disk.paths[0]]]
    assert disk["hostPath"]["type"] == "DirectoryOrCreate"


@pytest.mark.parametrize("unit", ["polarkv-manager.service", "polarkv-node.service"])
def test_systemd_units_run_a_command_polarkv_accepts(unit: str) -> None:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.read(DEPLOY / "systemd" / unit)
    assert parser["Install"]["WantedBy"] == "multi-user.target"
    service = parser["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0] == "/usr/local/bin/polarkv"
    ctx = polarkv.main.make_context("polarkv", argv[1:])
    expected = ["manager"] if "manager" in unit else ["slab", "disk"]
    assert list(ctx.params["roles"]) == expected and ctx.params["log_format"] == "json"
    # above the process's own stop bound, which the unit's comment names truly
    bound = MANAGER_STOP_BOUND if "manager" in unit else SLAB_STOP_BOUND
    assert int(service["TimeoutStopSec"]) > bound
    text = (DEPLOY / "systemd" / unit).read_text()
    assert all(int(n) == bound for n in re.findall(r"(\d+) s bound", text)), text
    with pytest.raises(click.UsageError):  # the check would notice a flag that does not exist
        polarkv.main.make_context("polarkv", [*argv[1:], "--no-such-flag"])
    assert f"deploy/systemd/{unit}" in (ROOT / "docs" / "OPERATIONS.md").read_text()


@pytest.mark.parametrize(
    ("name", "bound"),
    [
        ("manager-shard-0.yaml", MANAGER_STOP_BOUND),
        ("manager-shard-1.yaml", MANAGER_STOP_BOUND),
        ("node.yaml", SLAB_STOP_BOUND),
    ],
)
def test_kubernetes_grace_periods_cover_the_stop_bound_they_name(name: str, bound: float) -> None:
    text = (DEPLOY / "kubernetes" / name).read_text()
    grace = re.findall(r"terminationGracePeriodSeconds: (\d+) +# .*stop bound is (\d+) s", text)
    assert grace, f"{name}: no grace period naming the stop bound"
    assert all(int(period) > bound and int(named) == bound for period, named in grace)
