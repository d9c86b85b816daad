"""`polarkv cluster up|status|exec|down` from the command line, and an interrupted `up`
that leaves nothing behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from polarkv_lib.cluster.harness import Cluster
from polarkv_lib.cluster.spec import ClusterSpec

NOTHING: dict[str, list[object]] = {
    "namespaces": [],
    "pids": [],
    "links": [],
    "qdiscs": [],
    "buffers": [],
}


def polarkv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polarkv", "cluster", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_up_status_exec_down(tmp_path: Path) -> None:
    where = ["--name", "pkvtc", "--state-dir", str(tmp_path)]
    try:
        up = polarkv(
            "up",
            *where,
            "--subnet",
            "10.77.18",
            "--memory-vms",
            "1",
            "--client-vms",
            "1",
            "--slab-memory",
            "16MiB",
            "--nic",
            "500Mbit",
        )
        assert up.returncode == 0, up.stderr
        assert orjson.loads(up.stdout)["phase"] == "up"
        status = orjson.loads(polarkv("status", *where).stdout)
        assert [(vm["vm"], vm["address"]) for vm in status["vms"]] == [
            ("mgr0", "10.77.18.16"),
            ("mem0", "10.77.18.32"),
            ("cli0", "10.77.18.64"),
        ]
        assert status["vms"][0]["nodes"] == 1
        ran = polarkv(
            "exec",
            *where,
            "cli0",
            "--",
            sys.executable,
            "-c",
            "import os, socket; print(socket.gethostname(), os.environ['POLARKV_CLIENT__MANAGER_URL'])",
        )
        assert ran.returncode == 0 and ran.stdout.split() == [
            "pkvtc-cli0",
            "http://10.77.18.16:8170",
        ]
    finally:
        down = polarkv("down", *where)
    assert down.returncode == 0, down.stderr
    assert Cluster(ClusterSpec(name="pkvtc"), tmp_path).leftovers() == NOTHING
    assert polarkv("status", *where).returncode != 0  # nothing recorded any more


def test_bad_arguments_are_one_line_and_change_nothing(tmp_path: Path) -> None:
    bad = polarkv("up", "--name", "Bad-Name!", "--state-dir", str(tmp_path))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert (
        polarkv("up", "--name", "pkvtd", "--nic", "fast", "--state-dir", str(tmp_path)).returncode
        == 2
    )
    assert Cluster(ClusterSpec(name="pkvtd"), tmp_path).leftovers() == NOTHING


def test_ctrl_c_during_up_removes_everything(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polarkv",
            "cluster",
            "up",
            "--name",
            "pkvti",
            "--state-dir",
            str(tmp_path),
            "--subnet",
            "10.77.19",
            "--memory-vms",
            "2",
            "--slab-memory",
            "16MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it: a suite started in the background (a shell's
        # `&` without job control) would have the child ignore SIGINT and finish `up`.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    handle = Cluster(ClusterSpec(name="pkvti"), tmp_path)
    deadline = time.monotonic() + 30
    while not handle.leftovers()["pids"]:  # some services are starting
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "interrupted" in err
    assert handle.leftovers() == NOTHING


def test_a_failed_up_removes_everything(tmp_path: Path) -> None:
    """A service that cannot start (here: a bad setting every manager refuses) fails `up`
    with its log's tail, and nothing of the half-made cluster stays."""
    failed = polarkv(
        "up",
        "--name",
        "pkvte",
        "--state-dir",
        str(tmp_path),
        "--subnet",
        "10.77.20",
        "--memory-vms",
        "1",
        "--set",
        "manager.max_batch=0",
    )
    assert failed.returncode == 3
    assert (
        "up failed, everything removed again" in failed.stderr
        and "manager.max_batch" in failed.stderr
    )
    assert Cluster(ClusterSpec(name="pkvte"), tmp_path).leftovers() == NOTHING
