"""The tools' optional dependencies. A plain `pip install polarkv` is the daemon (every
role, the client, `polarkv admin`); the benchmarks' packages come with the `bench` extra
(setup.cfg). A command that needs an extra that is not installed says so in one line
and exits 2 before it starts anything."""

from __future__ import annotations

import importlib.util

from polarkv_lib.errors import ExitCode, fail

# extra -> the modules it brings that its commands import (setup.cfg [options.extras_require])
EXTRAS: dict[str, tuple[str, ...]] = {"bench": ("tqdm", "matplotlib", "redis", "hiredis")}


def missing(extra: str) -> list[str]:
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(command: str, extra: str) -> None:
    """Exit with one line naming `extra` unless every module of it is installed."""
    if lacking := missing(extra):
        fail(
            f"polarkv {command}",
            f"needs the {extra} extra: pip install 'polarkv[{extra}]' "
            f"(missing: {', '.join(lacking)})",
            ExitCode.CONFIG,
        )
