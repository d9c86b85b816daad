"""`polarkv replay`: replay a Mooncake-format trace against PolarKV (DESIGN §12).

Without --manager-url it starts an embedded service (all roles, or --embedded-roles)
configured by --set, in a temporary directory; with --nodes N it starts N of them and
routes each request to one (per-node caches: round-robin or by session), which is how
the scenarios compare local caches with one shared pool.
"""

from __future__ import annotations

import contextlib
import tempfile
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import click
import orjson

from polarkv_lib.errors import ConfigError, ExitCode, fail
from polarkv_lib.tools.replay.trace import Request, TraceError

if TYPE_CHECKING:  # the client and its dependencies load only when a replay runs
    from polarkv_lib.tools.replay.runner import ReplayResult, ReplaySettings


def _fail(message: str, code: ExitCode = ExitCode.CONFIG) -> NoReturn:
    fail("polarkv replay", message, code)


def _number(value: str, what: str, kind: type[int] | type[float], minimum: float) -> Any:
    try:
        number = kind(value)
    except ValueError:
        _fail(f"{what} must be a number, got {value!r}")
    if number < minimum:
        _fail(f"{what} must be >= {minimum:g}, got {value}")
    return number


def _rate(value: str | None, what: str) -> float | None:
    from polarkv_lib.tools.plan import parse_rate

    if value is None:
        return None
    try:
        rate = parse_rate(value)
    except ValueError as exc:
        _fail(f"{what}: {exc}")
    if rate <= 0:
        _fail(f"{what} must be positive")
    return rate


def _router(route: str, nodes: int, session_blocks: int) -> Callable[[int, Request], int]:
    if nodes == 1:
        return lambda i, r: 0
    if route == "rr":
        return lambda i, r: i % nodes
    # by session: the trace has no session id; every request of the public trace starts
    # with one shared block (a system prompt), so the next block names the conversation
    return lambda i, r: zlib.crc32(orjson.dumps(list(r.session(session_blocks)))) % nodes


@click.command("replay")
@click.option("--trace", "trace_path", required=True, help="Mooncake-format JSONL trace.")
@click.option(
    "--manager-url",
    default=None,
    help="A running service: manager URL, or several comma-separated shards. "
    "Default: start an embedded one.",
)
@click.option(
    "--model", default=None, help="Model preset: llama-3-8b, qwen3-235b-a22b, deepseek-r1."
)
@click.option("--kv-bytes-per-token", default=None, help="KV bytes per token (instead of --model).")
@click.option(
    "--block-tokens", default=None, help="Tokens per trace block (default 512; 32 with --engine)."
)
@click.option(
    "--scale",
    default="1",
    show_default=True,
    help="Divide each block's bytes by this (fit a long trace on a small machine).",
)
@click.option("--requests", "limit", default=None, help="Replay only the first N requests.")
@click.option(
    "--time-scale",
    default="0",
    show_default=True,
    help="0: as fast as possible; 1: the trace's pace; 10: ten times faster.",
)
@click.option(
    "--prefill-s-per-token",
    default=None,
    help="Modelled prefill seconds per token (default: the preset's).",
)
@click.option(
    "--load-bandwidth",
    default=None,
    help="Model loads of memory hits at this rate, e.g. 3GB/s (default: measured x scale).",
)
@click.option("--disk-bandwidth", default=None, help="Model loads of disk hits at this rate.")
@click.option(
    "--nodes",
    default="1",
    show_default=True,
    help="Embedded only: N separate caches, each request routed to one.",
)
@click.option(
    "--route",
    type=click.Choice(["rr", "session"]),
    default="rr",
    show_default=True,
    help="With --nodes: round-robin, or by session (hash of the first blocks).",
)
@click.option(
    "--session-blocks",
    default="2",
    show_default=True,
    help="Leading blocks that name a session for --route session.",
)
@click.option(
    "--embedded-roles",
    default="manager,slab,disk",
    show_default=True,
    help="Roles of the embedded service(s), e.g. manager,slab for memory only.",
)
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Config of the embedded service(s); repeatable.",
)
@click.option(
    "--transport", type=click.Choice(["auto", "tcp", "shm"]), default="auto", show_default=True
)
@click.option("--timeout", default="10", show_default=True, help="Client timeout, seconds.")
@click.option(
    "--json", "json_path", default=None, help="Write the report as JSON here ('-': stdout)."
)
@click.option(
    "--per-request", is_flag=True, default=False, help="Add every request's numbers to the JSON."
)
@click.option(
    "--plot", "plot_path", default=None, help="Write hit rate and TTFT over the trace to this PNG."
)
@click.option("--title", default="", help="Title of the plot.")
@click.option(
    "--engine",
    default=None,
    help="vllm: replay through real vLLM servers on a namespace cluster (DESIGN §13).",
)
@click.option("--python", "engine_python", default=None, help="--engine: vLLM CPU build's Python.")
@click.option("--engines", default="2", show_default=True, help="--engine: vLLM servers.")
@click.option(
    "--layouts",
    default="local,memory,tiered",
    show_default=True,
    help="--engine: of local, memory, tiered, global; each on fresh services.",
)
@click.option(
    "--router",
    default="round-robin",
    show_default=True,
    help="--engine: round-robin, or session (hash of the first --session-blocks blocks).",
)
@click.option(
    "--sample", default="16", show_default=True, help="--engine: requests whose tokens are checked."
)
@click.option(
    "--engine-memory",
    default="16MiB",
    show_default=True,
    help="--engine: PolarKV memory per memory VM (memory, tiered and global alike).",
)
@click.option(
    "--nic", default="2Gbit", show_default=True, help="--engine: every cluster VM's link rate."
)
@click.pass_context
def replay(
    ctx: click.Context,
    trace_path: str,
    manager_url: str | None,
    model: str | None,
    kv_bytes_per_token: str | None,
    block_tokens: str,
    scale: str,
    limit: str | None,
    time_scale: str,
    prefill_s_per_token: str | None,
    load_bandwidth: str | None,
    disk_bandwidth: str | None,
    nodes: str,
    route: str,
    session_blocks: str,
    embedded_roles: str,
    settings: tuple[str, ...],
    transport: str,
    timeout: str,
    json_path: str | None,
    per_request: bool,
    plot_path: str | None,
    title: str,
    engine: str | None,
    engine_python: str | None,
    engines: str,
    layouts: str,
    router: str,
    sample: str,
    engine_memory: str,
    nic: str,
) -> None:
    """Replay a trace: per request, load the longest cached prefix, store the rest."""
    import logging

    # This command owns its process's logging: warnings only, one line each (an optional
    # library that configures the root logger on import then finds it already set).
    logging.basicConfig(level=logging.WARNING, format="polarkv replay: %(name)s: %(message)s")
    from polarkv_lib.config import load_config
    from polarkv_lib.service import ServiceError
    from polarkv_lib.tools import extras
    from polarkv_lib.tools.bench.core import BenchError
    from polarkv_lib.tools.presets import preset
    from polarkv_lib.tools.replay import report, runner
    from polarkv_lib.tools.replay.trace import load_trace

    if engine is not None:
        from polarkv_lib.tools.replay.engine_cli import engine_replay

        engine_replay(
            engine=engine,
            python=engine_python,
            engines=engines,
            layouts=layouts,
            router=router,
            sample=sample,
            memory=engine_memory,
            nic=nic,
            trace_path=trace_path,
            block_tokens=block_tokens or "32",
            limit=limit,
            time_scale=time_scale,
            session_blocks=session_blocks,
            json_path=json_path,
        )
        return
    if model is not None and kv_bytes_per_token is not None:
        _fail("give --model or --kv-bytes-per-token, not both")
    try:
        chosen = preset(model or "llama-3-8b") if kv_bytes_per_token is None else None
    except ValueError as exc:
        _fail(str(exc))
    per_token = (
        chosen.kv_bytes_per_token
        if chosen
        else _number(kv_bytes_per_token or "", "--kv-bytes-per-token", int, 1)
    )
    prefill = chosen.prefill_s_per_token if chosen else 0.0
    if prefill_s_per_token is not None:
        prefill = _number(prefill_s_per_token, "--prefill-s-per-token", float, 0)
    n_nodes = _number(nodes, "--nodes", int, 1)
    roles = tuple(r.strip() for r in embedded_roles.split(",") if r.strip())
    if (
        not set(roles) <= {"manager", "slab", "disk"}
        or "manager" not in roles
        or "slab" not in roles
    ):
        _fail(
            f"--embedded-roles must name manager and slab (and optionally disk), got {embedded_roles!r}"
        )
    if manager_url is not None and (n_nodes > 1 or settings):
        _fail("--nodes and --set configure embedded services; they cannot go with --manager-url")
    if manager_url is not None:
        from polarkv_lib.shards import split_urls

        try:  # one clear line for a URL without a scheme, or one listed twice
            split_urls(manager_url)
        except ValueError as exc:
            _fail(f"--manager-url: {exc}")
    root = ctx.find_root().obj or {}
    overrides = [*root.get("overrides", []), *settings]
    try:  # validate the embedded config here: one clear line naming a bad key
        token = load_config(root.get("config_path"), overrides).security.token or None
    except ConfigError as exc:
        _fail(str(exc))
    config: dict[str, str] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        config[key.strip()] = value.strip()
    block_tokens = block_tokens or "512"
    options = runner.ReplaySettings(
        kv_bytes_per_token=per_token,
        block_tokens=_number(block_tokens, "--block-tokens", int, 1),
        scale=_number(scale, "--scale", int, 1),
        time_scale=_number(time_scale, "--time-scale", float, 0),
        transport=transport,
        timeout=_number(timeout, "--timeout", float, 0.001),
        namespace=f"replay/{model or 'custom'}/{per_token}/{block_tokens}",
        token=token,
    )
    ttft = report.TtftModel(
        prefill,
        _rate(load_bandwidth, "--load-bandwidth"),
        _rate(disk_bandwidth, "--disk-bandwidth"),
    )
    if options.scale > 1 and ttft.load_bandwidth is None:
        _fail(
            "--scale above 1 needs --load-bandwidth: the measured load time is of "
            "scaled-down blocks and says little about full-size ones"
        )
    if ttft.disk_bandwidth is not None and ttft.load_bandwidth is None:
        _fail("--disk-bandwidth needs --load-bandwidth (the rate of memory hits)")
    if plot_path:  # before the replay: a missing extra must not cost the run
        extras.require("replay --plot", "bench")
    try:
        requests = load_trace(trace_path, _number(limit, "--requests", int, 1) if limit else None)
    except TraceError as exc:
        _fail(str(exc))
    route_fn = _router(route, n_nodes, _number(session_blocks, "--session-blocks", int, 1))
    try:
        run = _run(requests, manager_url, n_nodes, roles, config, options, route_fn)
    except (BenchError, ServiceError) as exc:
        _fail(str(exc), ExitCode.RUNTIME)
    summary = report.summarize(run, options, ttft, per_request)
    summary["trace"] = trace_path
    summary["model"] = model or ("custom" if kv_bytes_per_token else "llama-3-8b")
    summary["nodes"] = n_nodes
    summary["route"] = route if n_nodes > 1 else "none"
    click.echo(report.table(summary), err=json_path == "-")
    if json_path == "-":
        click.echo(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    elif json_path:
        with open(json_path, "wb") as fh:
            fh.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    if plot_path:
        report.plot(
            run, options, ttft, plot_path, title or f"replay of {summary['requests']} requests"
        )
    if run.wrong_blocks:
        _fail(f"{run.wrong_blocks} loaded blocks held wrong bytes", ExitCode.RUNTIME)


def _run(
    requests: list[Request],
    manager_url: str | None,
    nodes: int,
    roles: tuple[str, ...],
    config: dict[str, str],
    options: ReplaySettings,
    route: Callable[[int, Request], int],
) -> ReplayResult:
    from polarkv_lib import service
    from polarkv_lib.tools.replay import runner

    with contextlib.ExitStack() as stack:
        if manager_url is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="polarkv-replay-"))
            procs = [service.Service(f"{workdir}/node{i}", roles, config) for i in range(nodes)]
            urls = stack.enter_context(service.running(*procs))
        else:
            urls = [manager_url]
        caches = [runner.Cache(url, options) for url in urls]
        for cache in caches:
            stack.callback(cache.close)
        for cache in caches:
            cache.check_reachable()
        return runner.replay(requests, caches, route, options)
