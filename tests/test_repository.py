"""Files that document contracts stay true to the code."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from polarkv_lib.config import Config, describe_keys, load_config
from tests.conftest import ROOT


def test_config_example_lists_every_key_with_its_default() -> None:
    path = ROOT / "config.example.toml"
    data = tomllib.loads(path.read_text())
    listed = {f"{section}.{key}" for section, table in data.items() for key in table}
    assert listed == {dotted for dotted, *_ in describe_keys()}
    assert load_config(str(path), environ={}) == Config()


def test_readme_names_the_test_command_that_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/check" in readme and "scripts/check" in ci


# What each room of the package may import from the package (docs/ARCHITECTURE.md):
# the lower rooms never reach up, the services (manager, node, runner) never reach the
# tools, the cluster harness or an experiment, the manager never reaches the node or
# client side. Every room is listed (a new one fails `test_every_room_is_listed`), and no
# room has an exception.
LEAVES = (
    "polarkv_lib.errors",
    "polarkv_lib.keys",
    "polarkv_lib.logs",
    "polarkv_lib.host",
    "polarkv_lib.shards",
    "polarkv_lib.tenancy",
    "polarkv_lib.progress",
    "polarkv_lib.stats",
    "polarkv_lib.event_loop",
)
_BELOW_SERVICES = (
    "polarkv_lib.client",
    "polarkv_lib.transport",
    "polarkv_lib.wire",
    "polarkv_lib.config",
    *LEAVES,
)
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    **{leaf.rpartition(".")[2]: LEAVES for leaf in LEAVES},  # each other only
    "config": LEAVES,
    "wire": ("polarkv_lib.wire", "polarkv_lib.errors", "polarkv_lib.keys"),
    "transport": ("polarkv_lib.transport", "polarkv_lib.wire", *LEAVES),
    "client": _BELOW_SERVICES,
    "manager": ("polarkv_lib.manager", "polarkv_lib.wire", "polarkv_lib.config", *LEAVES),
    "node": ("polarkv_lib.node", *_BELOW_SERVICES),
    "runner": ("polarkv_lib.manager", "polarkv_lib.node", "polarkv_lib.config", *LEAVES),
    # the one starter of polarkv processes (tools, tests, the cluster harness)
    "service": ("polarkv_lib.node.buffer", *LEAVES),
    # the one generator of test and benchmark traffic, over the public client
    "workload": ("polarkv_lib.client", "polarkv_lib.stats", *LEAVES),
    "integrations": ("polarkv_lib.integrations", *_BELOW_SERVICES),
    "cli": ("polarkv_lib.cli", *_BELOW_SERVICES),
    # namespaces as VMs, and the global-pool experiment (a disk store: node/ below it)
    "cluster": (
        "polarkv_lib.cluster",
        "polarkv_lib.node",
        "polarkv_lib.service",
        "polarkv_lib.workload",
        *_BELOW_SERVICES,
    ),
    "tools": (
        "polarkv_lib.tools",
        "polarkv_lib.cluster",
        "polarkv_lib.service",
        "polarkv_lib.workload",
        "polarkv_lib.node",
        "polarkv_lib.runner",
        *_BELOW_SERVICES,
    ),
}


def _room_paths(room: str) -> list[Path]:
    package = ROOT / "polarkv_lib"
    if (package / room).is_dir():
        return sorted((package / room).rglob("*.py"))
    return [package / f"{room}.py"]


def test_every_room_is_listed() -> None:
    package = ROOT / "polarkv_lib"
    rooms = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    rooms |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(MAY_IMPORT)
    assert _imports(package / "__init__.py") == set()


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("polarkv_lib.")}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("room", sorted(MAY_IMPORT))
def test_imports_run_one_way(room: str) -> None:
    allowed = MAY_IMPORT[room]
    wrong = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in _room_paths(room)
        for name in _imports(path)
        # `from polarkv_lib.wire import frames` names a module; `... import Op` a class in one
        if not _within(name, (*allowed, "polarkv_lib.__version__"))
        and not _within(name.rpartition(".")[0], allowed)
    }
    assert not wrong, sorted(wrong)


def test_leaves_import_nothing_of_the_package_but_leaves() -> None:
    for leaf in LEAVES:
        path = ROOT / (leaf.replace(".", "/") + ".py")
        assert all(_within(name, LEAVES) for name in _imports(path)), leaf
