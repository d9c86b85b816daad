"""The docs' examples, run: the README's five-minute tour against a real `polarkv`, and
the config snippets of docs/OPERATIONS.md through the config loader and a real process.
A doc that drifts from the code fails here."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from polarkv_lib.client import AdminClient, PolarKVClient
from polarkv_lib.config import load_config
from tests.conftest import ROOT, Cluster, free_port, stats

README = (ROOT / "README.md").read_text()
OPERATIONS = (ROOT / "docs" / "OPERATIONS.md").read_text()
TOUR_ADDRESS = re.compile(r"(localhost|127\.0\.0\.1):8170")


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    return [(m[1], m[2]) for m in re.finditer(r"```(\w+)\n(.*?)```", text, re.S)]


def commands(body: str) -> list[str]:
    """A bash block's commands, their trailing comments dropped."""
    lines = [line.split("  #")[0].strip() for line in body.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_readme_tour_runs_as_written(cluster: Cluster, tmp_path: Path) -> None:
    tour = blocks(section(README, "Five-minute tour"))
    (lang, start), *rest = tour
    argv = shlex.split(commands(start)[0])
    assert lang == "bash" and argv[0] == "polarkv" and argv[1::2] == ["--set"] * (len(argv) // 2)
    settings = dict(a.split("=", 1) for a in argv[2::2])  # the tour's own settings
    node = cluster.start([], settings)  # every role, as `polarkv` with no --role
    url = node.manager_url
    address = url.removeprefix("http://")
    env = {
        **os.environ,
        "POLARKV_CLIENT__MANAGER_URL": url,  # what `polarkv admin` asks by default
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }

    def shell(line: str) -> str:
        line = TOUR_ADDRESS.sub(address, line)
        if line.endswith("--watch"):
            line += " --count 1 --interval 0.1"  # a watch ends only with Ctrl-C
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", line],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 0, (line, done.stdout, done.stderr)
        return done.stdout

    key = ""
    for lang, body in rest:
        if lang == "python":
            done = subprocess.run(
                [sys.executable, "-c", TOUR_ADDRESS.sub(address, body)],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
                cwd=tmp_path,
            )
            assert done.returncode == 0, done.stderr
            printed = done.stdout.splitlines()
            assert printed[:3] == ["4", "512", "b'any value'"], printed
            keys = ast.literal_eval(printed[3])
            assert len(keys) == 4 and stats(url)["keys_memory"] == 5
            key = keys[0]
            continue
        assert lang == "bash"
        for line in commands(body):
            if "<32-hex-key>" in line:
                assert key, "the tour names a key before it stores one"
                line = line.replace("<32-hex-key>", key)
            out = shell(line)
            if line.startswith("curl -s") and "/healthz" in line:
                assert '"status":"ok"' in out.replace(" ", "")
            if line.startswith("polarkv admin key"):
                assert key in out
    assert key, "the tour stores nothing"
    assert stats(url)["deletes"] == 1  # `polarkv admin delete` did


def config_snippets() -> list[str]:
    """OPERATIONS' inline `section.key = value` settings with no placeholder in them."""
    found = re.findall(r"`([a-z_]+\.[a-z_]+ = [^`]+)`", OPERATIONS)
    return [s for s in found if not re.search(r"\b[A-Z]/[A-Z]\b|…", s)]


def test_the_operations_config_snippets_make_a_valid_config(tmp_path: Path) -> None:
    """Together, as the doc gives them (a tenant's quota names one of its tenants)."""
    sections: dict[str, list[str]] = {"security": ['admin_token = "admin-token-1"']}
    for snippet in config_snippets():
        dotted, value = snippet.split(" = ", 1)
        section_name, key = dotted.split(".")
        sections.setdefault(section_name, []).append(f"{key} = {value}")
    assert len(sections["security"]) >= 3  # the tenants and their quotas at least
    urls = [line for line in sections.get("manager", []) if line.startswith("shard_urls")]
    if urls:  # a shard of as many as the URLs it lists (the doc's shard is "I/N")
        count = len(ast.literal_eval(urls[0].split(" = ", 1)[1]))
        sections["manager"].append(f'shard = "0/{count}"')
        sections["security"].append(f'grant_key = "{"k" * 32}"')  # shards need one (the doc says)
    path = tmp_path / "polarkv.toml"
    path.write_text("".join(f"[{n}]\n" + "\n".join(lines) + "\n" for n, lines in sections.items()))
    config = load_config(str(path), environ={})  # raises ConfigError, naming the key, if not
    assert config.security.tenancy.enabled


def test_the_sharded_config_file_of_operations_is_valid(tmp_path: Path) -> None:
    """The shared polarkv.toml of "A sharded manager", with each VM's drop-in (its shard)
    and a grant key where the doc elides one."""
    text = section(OPERATIONS, "A sharded manager and many memory VMs")
    ((_, body),) = [b for b in blocks(text) if b[0] == "toml"]
    path = tmp_path / "polarkv.toml"
    path.write_text(body.replace("…", "k" * 32))
    for shard in ("0/2", "1/2"):
        config = load_config(str(path), environ={"POLARKV_MANAGER__SHARD": shard})
        assert len(config.manager.shard_urls.split(",")) == 2


def test_the_tenants_example_serves_its_tenants(cluster: Cluster, tmp_path: Path) -> None:
    (snippet,) = [s for s in config_snippets() if s.startswith("security.tenants = ")]
    tenants = ast.literal_eval(snippet.split(" = ", 1)[1])
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[security]\ntenants = {snippet.split(" = ", 1)[1]}\nadmin_token = "admin-token-1"\n'
    )
    node = cluster.start(["manager", "slab"], config_file=path)
    (name_a, token_a), (_, token_b) = (t.split(":", 1) for t in tenants)
    key = "cd" * 16
    with PolarKVClient(node.manager_url, token=token_a) as a:
        assert a.put(key, b"team a's value") and a.get(key) == b"team a's value"
    with PolarKVClient(node.manager_url, token=token_b) as b:
        assert b.get(key) is None  # another tenant's entry is not there for it
    assert name_a == "team-a"


def test_a_restarted_manager_says_its_restore_finished(cluster: Cluster) -> None:
    """docs/OPERATIONS.md names the log line `metadata restore finished`: a manager that
    crashed comes back, its slab (same address, so the same node id) registers again."""
    assert "`metadata restore finished`" in OPERATIONS
    settings = {
        "manager.metadata_url": f"sqlite:///{cluster.workdir}/restore-meta.db",
        "slab.listen": f"127.0.0.1:{free_port()}",
    }
    first = cluster.start([], settings, name="restore")
    with PolarKVClient(first.manager_url) as client:
        assert client.put("ef" * 16, b"a row to restore")
    AdminClient(first.manager_url).wait_flushed()
    first.kill()  # a crash: the row stays in the store
    again = cluster.start([], settings, name="restore")
    until = time.monotonic() + 20.0
    while "metadata restore finished" not in again.log() and time.monotonic() < until:
        time.sleep(0.1)
    (line,) = [x for x in again.log().splitlines() if "metadata restore finished" in x]
    assert "entries=1" in line and f"node={settings['slab.listen']}" in line, line
