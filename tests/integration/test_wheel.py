"""The wheel installs cleanly in a fresh virtual environment, without extras, and runs
from there: `polarkv --version`, the admin commands, the status page served from the
installed package (its static files are package data), every role as its own process
serving a store and a load, and `polarkv bench` saying which extra it needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import orjson
import pytest

import polarkv_lib
from tests.conftest import ROOT, http, wait_for

pytestmark = pytest.mark.slow
SOURCES = ["polarkv.py", "polarkv_lib", "setup.cfg", "pyproject.toml", "README.md"]


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    assert done.returncode == 0, (
        f"{args}: {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel built from a copy of the sources (the working tree
    gets no build/ or egg-info) and its dependencies installed by pip."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    dist = base / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", dist, src, cwd=base)
    wheels = list(dist.glob("polarkv-*.whl"))
    assert len(wheels) == 1, wheels
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    for needed in (
        "polarkv.py",
        "polarkv_lib/cli/admin.py",
        "polarkv_lib/manager/static/index.html",
        "polarkv_lib/manager/static/status.js",
        "polarkv_lib/manager/static/status.css",
    ):
        assert needed in names, f"{needed} missing from the wheel"
    assert not any(n.startswith("tests/") for n in names)
    env_dir = base / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    run(env_dir / "bin" / "pip", "install", "--quiet", wheels[0], cwd=base)  # no extras
    return env_dir


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _start(installed: Path, cwd: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    (cwd / name).mkdir()
    return subprocess.Popen(
        [installed / "bin" / "polarkv", *args, "--ready-file", cwd / name / "ready.json"],
        cwd=cwd / name,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _ready(cwd: Path, name: str) -> dict[str, object]:
    path = cwd / name / "ready.json"
    wait_for(path.exists, timeout=30)
    info = orjson.loads(path.read_bytes())
    assert isinstance(info, dict)
    return info


STORE_LOAD = """
import sys
from polarkv_lib.client import PolarKVClient
tokens = list(range(64))
data = [bytes([i]) * 65536 for i in range(4)]
with PolarKVClient(sys.argv[1], namespace="wheel", chunk_tokens=16, transport="tcp") as c:
    stored = c.store_kv(tokens, data)
    n, views = c.load_kv(tokens)
    print(stored, n, [bytes(v) for v in views] == data)
"""


def test_the_install_carries_no_benchmark_package(installed: Path, tmp_path: Path) -> None:
    probe = "import importlib.util as u; print([m for m in {} if u.find_spec(m)])"
    modules = ["tqdm", "matplotlib", "redis", "hiredis", "numpy"]
    done = run(installed / "bin" / "python", "-c", probe.format(modules), cwd=tmp_path)
    assert done.stdout.strip() == "[]"


def test_every_role_of_a_plain_install_serves_a_store_and_load(
    installed: Path, tmp_path: Path
) -> None:
    manager = _start(
        installed, tmp_path, "manager", "--role", "manager", "--set", "manager.listen=127.0.0.1:0"
    )
    node = None
    try:
        url = str(_ready(tmp_path, "manager")["manager_url"])
        node = _start(
            installed,
            tmp_path,
            "node",
            *("--role", "slab", "--role", "disk"),
            *("--set", "slab.listen=127.0.0.1:0", "--set", f"slab.manager_url={url}"),
            *("--set", "slab.memory=16MiB", "--set", "disk.capacity=64MiB"),
        )
        assert _ready(tmp_path, "node")["roles"] == ["disk", "slab"]
        wait_for(lambda: '"nodes": 1' in admin_stats(installed, url, tmp_path), timeout=15)
        done = run(installed / "bin" / "python", "-c", STORE_LOAD, url, cwd=tmp_path)
        assert done.stdout.split() == ["4", "64", "True"]
    finally:
        for proc in (node, manager):
            if proc is not None:
                proc.terminate()
                assert proc.wait(20) == 0


def admin_stats(installed: Path, url: str, cwd: Path) -> str:
    return run(
        installed / "bin" / "polarkv", "admin", "stats", "--json", "--url", url, cwd=cwd
    ).stdout


def test_bench_without_its_extra_names_the_extra(installed: Path, tmp_path: Path) -> None:
    for argv in (["bench", "datapath"], ["bench", "load", "--seconds", "1"]):
        done = subprocess.run(
            [installed / "bin" / "polarkv", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(),
            check=False,
        )
        assert done.returncode == 2, done
        assert done.stderr.count("\n") == 1 and "pip install 'polarkv[bench]'" in done.stderr


def test_version_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    done = run(installed / "bin" / "polarkv", "--version", cwd=tmp_path)
    assert done.stdout.strip() == f"polarkv {polarkv_lib.__version__}"
    # it imports the installed copy, not this checkout
    where = run(
        installed / "bin" / "python",
        "-c",
        "import polarkv_lib; print(polarkv_lib.__file__)",
        cwd=tmp_path,
    )
    assert str(installed) in where.stdout and str(ROOT) not in where.stdout
    assert "drain" in run(installed / "bin" / "polarkv", "admin", "--help", cwd=tmp_path).stdout


def test_installed_service_serves_its_status_page(installed: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [
            installed / "bin" / "polarkv",
            "--set",
            "manager.listen=127.0.0.1:0",
            "--set",
            "slab.listen=127.0.0.1:0",
            "--set",
            "slab.memory=16MiB",
            "--set",
            "disk.capacity=64MiB",
            "--ready-file",
            ready,
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(ready.exists, timeout=30)
        url = orjson.loads(ready.read_bytes())["manager_url"]
        status, page = http("GET", url + "/")
        assert status == 200 and "<title>PolarKV status</title>" in page
        status, script = http("GET", url + "/static/status.js")
        assert status == 200 and "function drawChart" in script
        stats = run(
            installed / "bin" / "polarkv", "admin", "stats", "--json", "--url", url, cwd=tmp_path
        )
        assert '"nodes": 1' in stats.stdout
    finally:
        proc.terminate()
        proc.wait(20)
