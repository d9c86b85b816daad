"""polarkv: the PolarKV executable (DESIGN §1).

polarkv                              all roles in one process (embedded single node)
polarkv --role manager               the metadata service
polarkv --role slab                  a memory node
polarkv bench datapath               data-plane throughput beside its limits
polarkv admin stats|nodes|key|delete|drain   the admin API from a terminal
"""

from __future__ import annotations

import sys
from typing import NoReturn

import click
import orjson
import structlog

from polarkv_lib import __version__
from polarkv_lib.cli.admin import admin
from polarkv_lib.cluster.cli import cluster
from polarkv_lib.config import Config, load_config
from polarkv_lib.errors import ConfigError, ExitCode
from polarkv_lib.tools.bench.cli import bench
from polarkv_lib.tools.plan import plan_command
from polarkv_lib.tools.replay.cli import replay


def _fail(
    message: str, code: ExitCode = ExitCode.CONFIG, json_line: bool | None = None
) -> NoReturn:
    """One line and a named exit code; a JSON line when the logs are JSON."""
    if json_line is None:
        ctx = click.get_current_context(silent=True)
        json_line = ctx is not None and (ctx.find_root().obj or {}).get("log_format") == "json"
    if json_line:
        line = {
            "event": "polarkv failed",
            "level": "error",
            "error": message,
            "exit_code": int(code),
        }
        click.echo(orjson.dumps(line).decode(), err=True)
    else:
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

        config = dataclasses.replace(
            config, log=dataclasses.replace(config.log, format=obj["log_format"])
        )
    return config


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="polarkv", message="%(prog)s %(version)s")
@click.option(
    "--role",
    "roles",
    multiple=True,
    type=click.Choice(["manager", "slab", "disk"]),
    help="Role(s) of this process; repeatable. None: all roles, embedded single node.",
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file.")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override one config key; repeatable.",
)
@click.option(
    "--log-format",
    type=click.Choice(["json", "console"]),
    default=None,
    help="Log format (overrides log.format).",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a JSON line with the bound addresses here once serving.",
)
@click.option(
    "--insecure",
    is_flag=True,
    default=False,
    help="Allow listening beyond loopback without security.token.",
)
@click.pass_context
def main(
    ctx: click.Context,
    roles: tuple[str, ...],
    config_path: str | None,
    overrides: tuple[str, ...],
    log_format: str | None,
    ready_file: str | None,
    insecure: bool,
) -> None:
    """PolarKV: a shared, tiered KV cache for LLM inference."""
    ctx.obj = {"config_path": config_path, "overrides": list(overrides), "log_format": log_format}
    if ctx.invoked_subcommand is not None:
        return
    from polarkv_lib import event_loop, logs, runner

    config = _config(ctx)
    try:
        role_set = runner.resolve_roles(roles)
    except ConfigError as exc:
        _fail(str(exc))
    logs.configure(config.log.format, config.log.level)
    json_line = config.log.format == "json"
    try:
        event_loop.run(
            runner.run(config, role_set, ready_file, insecure=insecure), config.runtime.event_loop
        )
    except ConfigError as exc:
        _fail(str(exc), json_line=json_line)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # a crash: still one line in the log's format, and a named exit
        structlog.get_logger("polarkv").exception("polarkv crashed", error=repr(exc))
        sys.exit(ExitCode.RUNTIME)


# -- admin (polarkv_lib/cli/admin.py) ------------------------------------------------

main.add_command(admin)
main.add_command(cluster)


# -- bench -----------------------------------------------------------------------------

main.add_command(bench)  # polarkv_lib/tools/bench/cli.py: one line per benchmark there
main.add_command(replay)  # polarkv_lib/tools/replay/cli.py
main.add_command(plan_command)  # polarkv_lib/tools/plan.py

if __name__ == "__main__":
    main()
