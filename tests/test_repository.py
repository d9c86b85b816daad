"""Files that document contracts stay true to the code."""

from __future__ import annotations

import tomllib

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
