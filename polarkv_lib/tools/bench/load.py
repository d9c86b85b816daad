"""`polarkv bench load`: mixed store/load traffic from several client processes against a
running service or an embedded node of its own, every loaded byte checked
(polarkv_lib/tools/loadgen.py does the traffic). It reports counts, not a ratio: it is
the load half of the fault suite, run by hand."""

from __future__ import annotations

import contextlib
import tempfile

import click
import orjson

from polarkv_lib.service import running_service
from polarkv_lib.tools import loadgen
from polarkv_lib.tools.bench import core


def run(
    url: str | None,
    clients: int,
    seconds: float,
    prompts: int,
    chunks: int,
    chunk_size: str,
    store_ratio: float,
    memory: str,
    json_path: str,
) -> bool:
    size = core.parse_bytes(chunk_size, "--chunk-size")
    core.parse_bytes(memory, "--memory")
    if clients < 1 or seconds <= 0 or prompts < 1 or chunks < 1 or not 0 <= store_ratio <= 1:
        raise core.BadArguments(
            "--clients, --prompts, --chunks >= 1; --seconds > 0; --store-ratio between 0 and 1"
        )
    with contextlib.ExitStack() as stack:
        if url is None:  # an embedded node (manager, slab and disk) of its own
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="polarkv-bench-load-"))
            info = stack.enter_context(running_service(workdir, settings={"slab.memory": memory}))
            url = str(info["manager_url"])
        result = loadgen.run(url, clients, seconds, prompts, chunks, size, store_ratio)
    result["working_set_mib"] = prompts * chunks * size >> 20
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2)
    click.echo(text)
    if json_path:
        with open(json_path, "wb") as fh:
            fh.write(text)
    return not (result["wrong_bytes"] or result["exceptions"])


@click.command("load")
@click.option("--url", default=None, help="Manager URL (default: start an embedded node).")
@click.option("--clients", default=8, show_default=True, help="Client processes.")
@click.option("--seconds", default=60.0, show_default=True, help="How long each client runs.")
@click.option("--prompts", default=64, show_default=True, help="Prompts in the working set.")
@click.option("--chunks", default=8, show_default=True, help="Chunks per prompt.")
@click.option("--chunk-size", default="256KiB", show_default=True, help="Bytes per chunk.")
@click.option(
    "--store-ratio", default=0.3, show_default=True, help="Share of operations that store."
)
@click.option(
    "--memory", default="64MiB", show_default=True, help="Slab memory of the embedded node."
)
@click.option("--json", "json_path", default="", help="Also write the result to this file.")
def command(
    url: str | None,
    clients: int,
    seconds: float,
    prompts: int,
    chunks: int,
    chunk_size: str,
    store_ratio: float,
    memory: str,
    json_path: str,
) -> None:
    """Mixed store/load from several processes; every loaded byte checked."""
    core.guarded(
        "load",
        lambda: run(
            url, clients, seconds, prompts, chunks, chunk_size, store_ratio, memory, json_path
        ),
    )
