"""The executable: config errors are one line and a non-zero exit; signals stop it cleanly."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polarkv_lib.node.buffer import buffer_path
from tests.conftest import ROOT, Cluster, assert_usage_error, http

POLARKV = [sys.executable, str(ROOT / "polarkv.py")]


def run(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*POLARKV, *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        check=False,
    )


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["--set", "manager.nope=1"], {}, "unknown config key 'manager.nope'"),
        (["--set", "slab.memory=lots"], {}, "slab.memory: not a size: 'lots'"),
        (["--set", "manager.read_lease=5 parsecs"], {}, "manager.read_lease: not a duration"),
        (["--set", "nosection.key=1"], {}, "unknown config section 'nosection'"),
        (["--set", "justtext"], {}, "expected section.key=value"),
        ([], {"POLARKV_CLIENT__TIMEOUT": "-"}, "client.timeout: not a duration"),
        ([], {"POLARKV_MANAGER__BOGUS": "1"}, "unknown config key 'manager.bogus'"),
        (["--set", "manager.memory_low_watermark=0.95"], {}, "manager.memory_low_watermark"),
        (["--set", "client.transport=carrier-pigeon"], {}, "client.transport"),
        (["--set", "runtime.event_loop=trio"], {}, "runtime.event_loop: auto, uvloop or asyncio"),
        (["--config", "/nonexistent/polarkv.toml"], {}, "--config /nonexistent/polarkv.toml"),
        (["--role", "disk"], {}, "the disk role shares the slab's buffer in one process"),
        (["--role", "manager", "--role", "disk"], {}, "use --role slab --role disk"),
    ],
)
def test_bad_config_is_one_line_and_nonzero(
    args: list[str], env: dict[str, str], message: str
) -> None:
    done = run(*args, env=env)
    assert_usage_error(done, message)


def test_bad_toml_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[manager]\nlisten = \n")
    done = run("--config", str(bad))
    assert done.returncode == 2 and "not valid TOML" in done.stderr
    bad.write_text('[slab]\nmemory = "12 furlongs"\n')
    done = run("--config", str(bad))
    assert done.returncode == 2 and "slab.memory" in done.stderr


def test_unwritable_disk_path_names_the_key(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    done = run(
        "--set",
        "manager.listen=127.0.0.1:0",
        "--set",
        "slab.listen=127.0.0.1:0",
        "--set",
        f"disk.paths={blocker}/disk",
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]  # one line
    assert "disk.paths" in done.stderr and "not writable" in done.stderr


@pytest.mark.parametrize(
    ("store", "needle"),
    [
        ("polarkv_lib.nowhere:store", "cannot import 'polarkv_lib.nowhere'"),
        ("nvme", "neither a known store (local)"),
    ],
)
def test_a_disk_store_that_names_nothing_is_one_line(
    tmp_path: Path, store: str, needle: str
) -> None:
    done = run(
        *("--role", "slab", "--role", "disk", "--set", "slab.listen=127.0.0.1:0"),
        *("--set", f"disk.store={store}", "--set", f"disk.paths={tmp_path}/disk"),
        cwd=tmp_path,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("polarkv: disk.store: ") and needle in lines[0]


def test_refuses_to_listen_beyond_loopback_without_a_token(tmp_path: Path) -> None:
    done = run("--role", "manager", "--set", "manager.listen=0.0.0.0:0", cwd=tmp_path)
    assert done.returncode == 2
    assert "manager.listen" in done.stderr and "--insecure" in done.stderr
    done = run("--role", "slab", "--set", "slab.listen=0.0.0.0:0", cwd=tmp_path)
    assert done.returncode == 2 and "slab.listen" in done.stderr


def test_refuses_a_token_without_an_admin_token_beyond_loopback(tmp_path: Path) -> None:
    """Otherwise every client could register a node and take the grant key."""
    done = run(
        "--role",
        "manager",
        "--set",
        "manager.listen=0.0.0.0:0",
        "--set",
        "security.token=t0ken",
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "security.admin_token" in done.stderr and "grant key" in done.stderr


@pytest.mark.parametrize(
    "extra",
    [["--insecure"], ["--set", "security.token=t0ken", "--set", "security.admin_token=4dmin"]],
)
def test_beyond_loopback_with_a_token_or_insecure(cluster: Cluster, extra: list[str]) -> None:
    node = cluster.start(
        ["manager"], {"manager.listen": "0.0.0.0:0"}, name="open", extra_args=extra
    )
    port = node.manager_url.rpartition(":")[2]
    assert http("GET", f"http://127.0.0.1:{port}/healthz")[0] == 200


def test_port_in_use_names_the_key(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run(
            "--set",
            f"manager.listen=127.0.0.1:{port}",
            "--set",
            "slab.listen=127.0.0.1:0",
            cwd=tmp_path,
        )
        assert done.returncode == 2
        assert "manager.listen: cannot listen on" in done.stderr and "in use" in done.stderr
        done = run(
            "--set",
            "manager.listen=127.0.0.1:0",
            "--set",
            f"slab.listen=127.0.0.1:{port}",
            cwd=tmp_path,
        )
        assert done.returncode == 2 and "slab.listen" in done.stderr


def test_config_file_env_and_set_precedence(cluster: Cluster, tmp_path: Path) -> None:
    conf = tmp_path / "polarkv.toml"
    conf.write_text('[slab]\nmemory = "8MiB"\n[manager]\nmax_batch = 4096\n')

    def capacity(name: str, memory: str | None, env: dict[str, str]) -> int:
        node = cluster.start([], {"slab.memory": memory}, name=name, env=env, config_file=conf)
        capacity = int(http("GET", node.manager_url + "/v1/stats")[1]["capacity_memory"])
        node.close()
        return capacity

    assert capacity("file", None, {}) == 8 << 20
    assert capacity("env", None, {"POLARKV_SLAB__MEMORY": "10MiB"}) == 10 << 20
    assert capacity("set", "12MiB", {"POLARKV_SLAB__MEMORY": "10MiB"}) == 12 << 20


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_gracefully(cluster: Cluster, sig: signal.Signals) -> None:
    node = cluster.embedded(disk=True)
    pattern = buffer_path("/dev/shm", node.info["node_id"], 0).replace("0" * 16, "*")
    assert len(glob.glob(pattern)) == 1  # its buffer
    start = time.monotonic()
    node.proc.send_signal(sig)
    assert node.proc.wait(15) == 0
    assert time.monotonic() - start < 10
    log = node.log()
    assert "slab stopped" in log and "manager stopped" in log
    assert glob.glob(pattern) == []  # the buffer file was removed


def test_admin_cli(cluster: Cluster) -> None:
    node = cluster.embedded()
    done = run("admin", "stats", "--json", "--url", node.manager_url)
    assert done.returncode == 0 and '"nodes": 1' in done.stdout
    done = run("admin", "key", "0" * 32, "--url", node.manager_url)
    assert done.returncode == 3 and "404" in done.stderr
    done = run("admin", "stats", "--url", "http://127.0.0.1:9")
    assert done.returncode == 3 and "cannot reach the manager" in done.stderr
