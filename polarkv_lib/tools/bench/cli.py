"""The `bench` command group. Each benchmark module is imported only when its command
runs (or when help lists it), so `polarkv` itself starts without loading any of them."""

from __future__ import annotations

import importlib

import click

from polarkv_lib.tools import extras

# name -> module with a click command called `command`; one line per benchmark.
BENCHES: dict[str, str] = {
    "datapath": "polarkv_lib.tools.bench.datapath",
    "disk": "polarkv_lib.tools.bench.disk",
    "load": "polarkv_lib.tools.bench.load",
    "peers": "polarkv_lib.tools.bench.peers",
    "manager": "polarkv_lib.tools.bench.manager",
    "cluster": "polarkv_lib.tools.bench.cluster",
    "ttft": "polarkv_lib.tools.bench.ttft",
    "stall": "polarkv_lib.tools.bench.stall",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(BENCHES)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = BENCHES.get(cmd_name)
        if module is None:
            return None
        command = importlib.import_module(module).command
        assert isinstance(command, click.Command)
        return command


@click.group(cls=_LazyGroup)
def bench() -> None:
    """Benchmarks (they report speed beside a limit measured in the same run; tests
    check behaviour). They need the bench extra: pip install 'polarkv[bench]'."""
    extras.require("bench", "bench")
