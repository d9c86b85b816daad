"""`polarkv admin`: the manager's admin API from a terminal.

Human tables by default, `--json` for scripts, `--watch` for a live view. `--url` takes
one manager URL or several separated by commas (the shards, in shard order); counts are
summed over shards and each shard keeps its own row. Exit codes: 2 for a bad argument or
config, 3 when a manager cannot be reached or refuses.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import click
import orjson

from polarkv_lib import errors
from polarkv_lib.cli import views
from polarkv_lib.cli.api import AdminError, Shard, Shards
from polarkv_lib.config import Config, load_config
from polarkv_lib.errors import ConfigError, ExitCode
from polarkv_lib.keys import is_valid_key

EXIT_CONFIG = ExitCode.CONFIG
EXIT_RUNTIME = ExitCode.RUNTIME


def fail(message: str, code: ExitCode = EXIT_CONFIG) -> NoReturn:
    errors.fail("polarkv", message, code)


def _config(ctx: click.Context) -> Config:
    obj = ctx.find_root().obj or {}
    try:
        return load_config(obj.get("config_path"), obj.get("overrides", []))
    except ConfigError as exc:
        fail(str(exc))


def _shards(ctx: click.Context, url: str | None) -> Shards:
    config = _config(ctx)
    sec = config.security
    try:
        return Shards.from_urls(
            url or config.client.manager_url,
            sec.token,
            sec.admin_token,
            timeout=config.client.timeout + 3,
        )
    except ValueError as exc:
        fail(f"--url: {exc}")


def _dump(data: Any) -> None:
    click.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())


def _check_key(key: str) -> str:
    if not is_valid_key(key):
        fail(f"KEY: a key is 32 lowercase hex characters, got {key!r:.60}")
    return key


def _url_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--url",
        default=None,
        metavar="URL[,URL...]",
        help="Manager URL(s), shards in order (default: client.manager_url).",
    )(f)


def _json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(f)


def _watch_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--count",
        default=0,
        show_default=True,
        type=click.IntRange(min=0),
        help="With --watch: stop after this many refreshes (0: until Ctrl-C).",
    )(f)
    f = click.option(
        "--interval",
        default=2.0,
        show_default=True,
        type=click.FloatRange(min=0.1),
        help="Seconds between refreshes with --watch.",
    )(f)
    return click.option("--watch", is_flag=True, help="Refresh until Ctrl-C (a live view).")(f)


@click.group()
def admin() -> None:
    """Look at and steer a running cache through the managers' admin API."""


# -- stats --------------------------------------------------------------------------------


PerShard = list[tuple[str, dict[str, Any] | AdminError]]


def collect_stats(shards: Shards) -> tuple[dict[str, Any], PerShard]:
    """(summed stats, per-shard answers or errors)."""
    per_shard: PerShard = [(s.url, a) for s, a in shards.each("stats")]
    good = [a for _, a in per_shard if isinstance(a, dict)]
    merged = None
    if len(shards.shards) > 1:  # count nodes once by id, not once per shard
        node_lists = [a for _, a in shards.each("nodes") if not isinstance(a, AdminError)]
        merged = views.merge_nodes(node_lists)
    return views.sum_stats(good, merged), per_shard


def _stats_json(total: dict[str, Any], per_shard: PerShard) -> dict[str, Any]:
    return {
        **total,
        "shards": [
            {"url": u, "stats": a}
            if isinstance(a, dict)
            else {"url": u, "error": str(a), "status": a.status}
            for u, a in per_shard
        ],
    }


@admin.command("stats")
@_url_option
@_json_option
@_watch_options
@click.pass_context
def stats(
    ctx: click.Context, url: str | None, as_json: bool, watch: bool, interval: float, count: int
) -> None:
    """Keys, bytes and capacity by tier, hits, misses, tiering: summed over shards."""
    shards = _shards(ctx, url)
    previous: tuple[float, dict[str, Any]] | None = None
    for _ in _refreshes(watch, interval, count):
        total, per_shard = collect_stats(shards)
        errors = [str(a) for _, a in per_shard if isinstance(a, AdminError)]
        if as_json:
            click.echo(
                orjson.dumps(_stats_json(total, per_shard)).decode()
                if watch
                else orjson.dumps(
                    _stats_json(total, per_shard), option=orjson.OPT_INDENT_2
                ).decode()
            )
        else:
            text = views.stats_table(per_shard, total)
            now = time.monotonic()
            if previous is not None:
                text += "\n\n" + views.rates_line(previous[1], total, now - previous[0])
            previous = (now, total)
            _show(text, watch, ", ".join(s.url for s in shards.shards))
        if errors and not watch:
            fail(
                errors[0] if len(errors) == 1 else f"{len(errors)} shards failed: {errors[0]}",
                EXIT_RUNTIME,
            )


def _refreshes(watch: bool, interval: float, count: int) -> Any:
    """Yield once, or (with --watch) every `interval` seconds `count` times (0: forever);
    Ctrl-C ends the view cleanly."""
    n = 0
    try:
        while True:
            started = time.monotonic()
            yield n
            n += 1
            if not watch or (count and n >= count):
                return
            time.sleep(max(interval - (time.monotonic() - started), 0.0))
    except KeyboardInterrupt:
        return


def _show(text: str, watch: bool, where: str) -> None:
    if watch:
        if sys.stdout.isatty():
            click.clear()
        click.echo(f"polarkv {where}  {time.strftime('%H:%M:%S')}  (Ctrl-C to stop)\n")
    click.echo(text)
    if watch and not sys.stdout.isatty():
        click.echo("")


# -- nodes --------------------------------------------------------------------------------


@admin.command("nodes")
@_url_option
@_json_option
@_watch_options
@click.pass_context
def nodes(
    ctx: click.Context, url: str | None, as_json: bool, watch: bool, interval: float, count: int
) -> None:
    """The slab/disk nodes: state, memory and disk against capacity, keys, heartbeat."""
    shards = _shards(ctx, url)
    for _ in _refreshes(watch, interval, count):
        answers = shards.each("nodes")
        failed = [a for _, a in answers if isinstance(a, AdminError)]
        errors = [str(a) for a in failed]
        merged = views.merge_nodes([a for _, a in answers if not isinstance(a, AdminError)])
        if as_json:
            doc = {
                "nodes": merged,
                "shards": [
                    {"url": s.url, "error": str(a)}
                    if isinstance(a, AdminError)
                    else {"url": s.url, "nodes": a}
                    for s, a in answers
                ],
            }
            click.echo(
                orjson.dumps(doc).decode()
                if watch
                else orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
            )
        else:
            text = views.nodes_table(merged)
            if errors:
                text += "\n" + "\n".join(
                    f"{f'refused ({a.status})' if a.status else 'unreachable'}: {a}" for a in failed
                )
            _show(text, watch, ", ".join(s.url for s in shards.shards))
        if errors and not watch:
            sys.exit(EXIT_RUNTIME)


# -- one key ------------------------------------------------------------------------------


def _ask_owner(
    ctx: click.Context, url: str | None, key: str, call: Callable[[Shard, str], dict[str, Any]]
) -> tuple[Shard, dict[str, Any]]:
    """`call` on the shard that owns KEY; a refusal or an unreachable shard ends the command."""
    _check_key(key)
    shard = _shards(ctx, url).owner(key)
    try:
        return shard, call(shard, key)
    except AdminError as exc:
        fail(str(exc), EXIT_RUNTIME)


@admin.command("key")
@click.argument("key")
@_url_option
@_json_option
@click.pass_context
def key(ctx: click.Context, key: str, url: str | None, as_json: bool) -> None:
    """Where KEY is: tier(s), node, size, checksum, state, last access (asks its shard)."""
    _, view = _ask_owner(ctx, url, key, Shard.key)
    if as_json:
        _dump(view)
    else:
        click.echo(views.key_view(view))


@admin.command("delete")
@click.argument("key")
@_url_option
@_json_option
@click.pass_context
def delete(ctx: click.Context, key: str, url: str | None, as_json: bool) -> None:
    """Drop KEY everywhere (memory and disk). Needs the admin token where one is set."""
    shard, result = _ask_owner(ctx, url, key, Shard.delete)
    if as_json:
        _dump(result)
    else:
        click.echo(f"deleted {key} (shard {shard.url})")


# -- drain --------------------------------------------------------------------------------


@admin.command("drain")
@click.argument("node_id", metavar="NODE")
@_url_option
@_json_option
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait until NODE holds no memory entries (then it can be stopped).",
)
@click.option(
    "--timeout",
    default=300.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds to wait with --wait.",
)
@click.pass_context
def drain(
    ctx: click.Context, node_id: str, url: str | None, as_json: bool, wait: bool, timeout: float
) -> None:
    """Stop placing writes on NODE and move its memory entries out: those with a disk
    copy drop their memory copy, the others are offloaded to its disk (or dropped when
    it has none). Then NODE can be stopped without losing its disk copies."""
    from polarkv_lib.cli.drain import drain_node

    shards = _shards(ctx, url)
    try:
        report = drain_node(shards, node_id, wait, timeout)
    except (AdminError, TimeoutError) as exc:
        fail(str(exc), EXIT_RUNTIME)
    if as_json:
        _dump(report)
    elif report["drained"]:
        click.echo(
            f"node {node_id} drained: no memory entries left; "
            f"{report['keys_disk']:,} keys stay on its disk. It can be stopped now."
        )
    else:
        click.echo(
            f"node {node_id} draining: {report['keys_memory']:,} memory entries left "
            f"(new writes go elsewhere)"
        )


# -- metrics ------------------------------------------------------------------------------


@admin.command("metrics")
@_url_option
@click.pass_context
def metrics(ctx: click.Context, url: str | None) -> None:
    """Prometheus text of each shard (a comment line names the shard when several)."""
    shards = _shards(ctx, url)
    failed = False
    for shard, answer in shards.each("metrics"):
        if isinstance(answer, AdminError):
            click.echo(f"polarkv: {answer}", err=True)
            failed = True
            continue
        if len(shards.shards) > 1:
            click.echo(f"# shard {shard.url}")
        click.echo(answer, nl=False)
    if failed:
        sys.exit(EXIT_RUNTIME)
