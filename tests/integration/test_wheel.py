"""The wheel installs cleanly in a fresh virtual environment and runs from there:
`polarkv --version`, the admin commands, and the status page served from the installed
package (its static files are package data)."""

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
    run(env_dir / "bin" / "pip", "install", "--quiet", wheels[0], cwd=base)
    return env_dir


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
