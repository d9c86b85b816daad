"""polarkv: the PolarKV executable (DESIGN §1).

    polarkv                              all roles in one process (embedded single node)
    polarkv --role manager               the metadata service
    polarkv --role slab                  a memory node
    polarkv bench datapath               data-plane throughput beside its limits
    polarkv admin stats|nodes|key|delete the admin API from a terminal
"""

from __future__ import annotations

import asyncio
import sys
import urllib.error
import urllib.request
from typing import Any

import click
import orjson

from polarkv_lib.config import Config, load_config
from polarkv_lib.errors import ConfigError

EXIT_CONFIG = 2
EXIT_RUNTIME = 3


def _fail(message: str, code: int = EXIT_CONFIG) -> None:
    click.echo(f"polarkv: {message}", err=True)
    sys.exit(code)


def _config(ctx: click.Context) -> Config:
    obj = ctx.find_root().obj
    try:
        config = load_config(obj["config_path"], obj["overrides"])
    except ConfigError as exc:
        _fail(str(exc))
    if obj["log_format"]:
        import dataclasses
        config = dataclasses.replace(config, log=dataclasses.replace(config.log, format=obj["log_format"]))
    return config


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--role", "roles", multiple=True, type=click.Choice(["manager", "slab", "disk"]),
              help="Role(s) of this process; repeatable. None: all roles, embedded single node.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one config key; repeatable.")
@click.option("--log-format", type=click.Choice(["json", "console"]), default=None,
              help="Log format (overrides log.format).")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
              help="Write a JSON line with the bound addresses here once serving.")
@click.option("--insecure", is_flag=True, default=False,
              help="Allow listening beyond loopback without security.token.")
@click.pass_context
def main(ctx: click.Context, roles: tuple[str, ...], config_path: str | None,
         overrides: tuple[str, ...], log_format: str | None, ready_file: str | None,
         insecure: bool) -> None:
    """PolarKV: a shared, tiered KV cache for LLM inference."""
    ctx.obj = {"config_path": config_path, "overrides": list(overrides), "log_format": log_format}
    if ctx.invoked_subcommand is not None:
        return
    from polarkv_lib import logs, runner

    config = _config(ctx)
    try:
        role_set = runner.resolve_roles(roles)
    except ConfigError as exc:
        _fail(str(exc))
    logs.configure(config.log.format, config.log.level)
    try:
        asyncio.run(runner.run(config, role_set, ready_file, insecure=insecure))
    except ConfigError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        pass


# -- admin -----------------------------------------------------------------------------


def _admin_request(config: Config, method: str, path: str, url: str | None) -> Any:
    base = (url or config.client.manager_url).rstrip("/")
    token = config.security.admin_token if method == "DELETE" and config.security.admin_token \
        else config.security.token
    request = urllib.request.Request(base + path, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=config.client.timeout + 3) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        _fail(f"{method} {path}: HTTP {exc.code} {detail}", EXIT_RUNTIME)
    except (urllib.error.URLError, OSError) as exc:
        _fail(f"cannot reach the manager at {base}: {exc}", EXIT_RUNTIME)
    if path == "/metrics":
        return body.decode()
    return orjson.loads(body)


@main.group()
def admin() -> None:
    """Talk to a running manager's admin API."""


def _admin_command(name: str, method: str, path: str, takes_key: bool = False) -> None:
    @click.option("--url", default=None, help="Manager URL (default: client.manager_url).")
    @click.pass_context
    def command(ctx: click.Context, url: str | None, key: str | None = None) -> None:
        result = _admin_request(_config(ctx), method, path.format(key=key), url)
        click.echo(result if isinstance(result, str) else orjson.dumps(result, option=orjson.OPT_INDENT_2))

    if takes_key:
        command = click.argument("key")(command)
    admin.command(name, help=f"{method} {path}")(command)


_admin_command("stats", "GET", "/v1/stats")
_admin_command("nodes", "GET", "/v1/nodes")
_admin_command("metrics", "GET", "/metrics")
_admin_command("key", "GET", "/v1/keys/{key}", takes_key=True)
_admin_command("delete", "DELETE", "/v1/keys/{key}", takes_key=True)


# -- bench -----------------------------------------------------------------------------


@main.group()
def bench() -> None:
    """Benchmarks (they report speed; tests check behaviour)."""


@bench.command("datapath")
@click.option("--sizes", default="1MiB,4MiB,16MiB", help="Object sizes, comma separated.")
@click.option("--concurrency", default="1,4", help="Concurrent transfers, comma separated.")
@click.option("--transports", default="tcp,shm", help="Transports to measure.")
@click.option("--total", default="256MiB", help="Bytes moved per measurement.")
@click.option("--memory", default="1GiB", help="Slab memory of the service the bench starts.")
def bench_datapath(sizes: str, concurrency: str, transports: str, total: str, memory: str) -> None:
    """Store/load throughput over tcp and shm beside raw socket and memcpy limits."""
    from polarkv_lib.tools.bench_datapath import main as run_bench

    run_bench(sizes, concurrency, transports, total, memory)


@bench.command("disk")
@click.option("--path", default="", help="Directory on the disk to measure (default: the system temp dir).")
@click.option("--sizes", default="1MiB,4MiB", show_default=True, help="Object sizes, comma separated.")
@click.option("--total", default="256MiB", show_default=True, help="Bytes per file-store measurement.")
@click.option("--memory", default="256MiB", show_default=True, help="Slab memory of the nodes it starts.")
@click.option("--working-set", default="1GiB", show_default=True,
              help="Bytes stored and loaded back per service round (>= 4x --memory).")
@click.option("--threads", default="4", show_default=True, help="I/O threads on both sides.")
@click.option("--o-direct/--no-o-direct", default=True, show_default=True,
              help="O_DIRECT on both sides, or the page cache (dropped before reads; needs root).")
@click.option("--parts", default="store,service,fit", show_default=True, help="Parts to run.")
def bench_disk(path: str, sizes: str, total: str, memory: str, working_set: str, threads: str,
               o_direct: bool, parts: str) -> None:
    """Offload/reload throughput beside raw sequential file I/O; hybrid vs memory-only."""
    from polarkv_lib.tools.bench_disk import main as run_bench

    run_bench(path, sizes, total, memory, working_set, threads, o_direct, parts)


@bench.command("load")
@click.option("--url", default=None, help="Manager URL (default: start an embedded node).")
@click.option("--clients", default=8, show_default=True, help="Client processes.")
@click.option("--seconds", default=60.0, show_default=True, help="How long each client runs.")
@click.option("--prompts", default=64, show_default=True, help="Prompts in the working set.")
@click.option("--chunks", default=8, show_default=True, help="Chunks per prompt.")
@click.option("--chunk-size", default="256KiB", show_default=True, help="Bytes per chunk.")
@click.option("--store-ratio", default=0.3, show_default=True, help="Share of operations that store.")
@click.option("--memory", default="64MiB", show_default=True, help="Slab memory of the embedded node.")
@click.pass_context
def bench_load(ctx: click.Context, url: str | None, clients: int, seconds: float, prompts: int,
               chunks: int, chunk_size: str, store_ratio: float, memory: str) -> None:
    """Mixed store/load from several processes; every loaded byte checked."""
    import contextlib
    import tempfile

    from polarkv_lib.config import parse_size
    from polarkv_lib.tools import loadgen
    from polarkv_lib.tools.service import running_service

    size = parse_size(chunk_size)
    with contextlib.ExitStack() as stack:
        if url is None:  # an embedded node (manager, slab and disk) of its own
            workdir = stack.enter_context(tempfile.TemporaryDirectory())
            info = stack.enter_context(running_service(workdir, settings={"slab.memory": memory}))
            url = str(info["manager_url"])
        result = loadgen.run(url, clients, seconds, prompts, chunks, size, store_ratio)
    result["working_set_mib"] = prompts * chunks * size >> 20
    click.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    if result["wrong_bytes"] or result["exceptions"]:
        sys.exit(EXIT_RUNTIME)


if __name__ == "__main__":
    main()
