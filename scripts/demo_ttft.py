#!/usr/bin/env python3
"""TTFT demo: a transformers causal LM reusing a long shared prefix's KV from PolarKV.

A real architecture (Llama or Qwen2) with random weights (torch.manual_seed) runs on the
CPU. Every request is one long shared prefix plus a short suffix of its own. Each
request runs twice: a full prefill (no PolarKV), and with PolarKV, where the first
request prefills everything and stores the prompt's full chunks, and later ones load
the prefix KV and prefill only the rest. Each pair must agree: next-token logits within
float tolerance and identical greedy continuations. The table gives both TTFTs (load +
prefill to the first logits; for the warm requests the best of --repeats runs, as the
machine is usually shared and noisy), the load's share of the PolarKV one, the ratio,
and the time the cold request took to store its chunks (after its first token).

    python scripts/demo_ttft.py                        # starts its own PolarKV
    python scripts/demo_ttft.py --url http://h:8170    # uses a running one
    python scripts/demo_ttft.py --prefix-tokens 1024 --requests 3 --layers 4
    python scripts/demo_ttft.py --size small --prefix-tokens 512,1024,2048,4096  # the gain by length

Run it with the engines virtualenv (torch, transformers); set HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from polarkv_lib.integrations.hf import HFKVStore, greedy, prefill
from polarkv_lib.service import running_service

LOGIT_ATOL = 1e-3  # float32; the logits are O(1): differences come from summation order


@dataclass(frozen=True)
class DemoSpec:
    arch: str = "llama"  # llama | qwen2
    prefix_tokens: int = 4096
    suffix_tokens: int = 64
    requests: int = 4
    gen_tokens: int = 8
    chunk_tokens: int = 256
    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1408
    vocab: int = 32000
    seed: int = 0
    repeats: int = 3  # warm requests: each TTFT is the best of this many runs
    threads: int | None = 2  # torch CPU threads; None leaves torch's setting alone
    transport: str = "auto"  # PolarKV client transport: auto (shm on one host), tcp, shm
    timeout: float = 30.0  # PolarKV client timeout (seconds)


@dataclass
class Row:
    request: int
    prompt_tokens: int
    loaded_tokens: int
    ttft_full_ms: float
    ttft_polarkv_ms: float
    load_ms: float
    store_ms: float | None
    max_logit_diff: float
    greedy_match: bool

    @property
    def speedup(self) -> float:
        return self.ttft_full_ms / self.ttft_polarkv_ms


@dataclass
class DemoReport:
    spec: DemoSpec
    model: str
    kv_bytes_per_token: int
    params: int
    rows: list[Row] = field(default_factory=list)

    @property
    def warm(self) -> list[Row]:
        return [r for r in self.rows if r.loaded_tokens > 0]

    @property
    def median_speedup(self) -> float:
        return statistics.median(r.speedup for r in self.warm) if self.warm else 0.0


def build_model(spec: DemoSpec) -> torch.nn.Module:
    kwargs = dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.prefix_tokens + spec.suffix_tokens + spec.gen_tokens + 64,
    )
    torch.manual_seed(spec.seed)
    if spec.arch == "llama":
        model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**kwargs))
    elif spec.arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    else:
        raise ValueError(f"arch must be llama or qwen2, got {spec.arch!r}")
    return model.eval()


@contextlib.contextmanager
def polarkv_url(url: str | None) -> Iterator[str]:
    """The given PolarKV, or one started here (and always stopped)."""
    if url:
        yield url
        return
    with (
        tempfile.TemporaryDirectory(prefix="polarkv-demo-") as workdir,
        running_service(workdir, ("manager", "slab"), {"slab.memory": "1GiB"}) as info,
    ):
        yield str(info["manager_url"])


def run_demo(spec: DemoSpec, url: str | None = None) -> DemoReport:
    """Run the demo against PolarKV at `url` (None: start one); raise AssertionError if
    KV from PolarKV changes a next-token distribution or a greedy continuation."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    model = build_model(spec)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    prefix = torch.randint(spec.vocab, (spec.prefix_tokens,), generator=gen)
    prompts = [
        torch.cat(
            [prefix, torch.randint(spec.vocab, (spec.suffix_tokens,), generator=gen)]
        ).unsqueeze(0)
        for _ in range(spec.requests)
    ]
    # The weights are fixed by arch, sizes and seed; the run id keeps the first request
    # cold even against a PolarKV that served an earlier run.
    model_id = f"demo/{spec.arch}-seed{spec.seed}/run-{uuid.uuid4().hex[:12]}"
    with (
        polarkv_url(url) as manager_url,
        HFKVStore.for_model(
            model,
            model_id=model_id,
            manager_url=manager_url,
            chunk_tokens=spec.chunk_tokens,
            extra={"timeout": spec.timeout, "transport": spec.transport},
        ) as store,
    ):
        report = DemoReport(
            spec,
            type(model).__name__,
            store.geometry.chunk_bytes(spec.chunk_tokens) // spec.chunk_tokens,
            sum(p.numel() for p in model.parameters()),
        )
        prefill(model, prompts[0][:, :32])  # warm-up: first-call allocations are not TTFT
        for i, ids in enumerate(prompts):
            full = prefill(model, ids)
            ours = prefill(model, ids, store)
            full_s, ours_s, load_s = full.seconds, ours.seconds, ours.load_seconds
            store_ms = None
            if ours.loaded_tokens == 0:  # a miss: store the prompt's chunks for the next ones
                start = time.perf_counter()
                store.store(ids, ours.cache)
                store_ms = (time.perf_counter() - start) * 1e3
            else:  # the machine is shared and noisy: best of `repeats`, as a benchmark does
                for _ in range(spec.repeats - 1):
                    full_s = min(full_s, prefill(model, ids).seconds)
                    again = prefill(model, ids, store)
                    if again.seconds < ours_s:
                        ours_s, load_s = again.seconds, again.load_seconds
            diff = float((full.logits - ours.logits).abs().max())
            same = greedy(model, full, spec.gen_tokens) == greedy(model, ours, spec.gen_tokens)
            if diff > LOGIT_ATOL or not same:
                raise AssertionError(
                    f"request {i}: logits differ by {diff:.2e} (tolerance "
                    f"{LOGIT_ATOL}), greedy continuations match: {same}"
                )
            report.rows.append(
                Row(
                    i,
                    ids.shape[1],
                    ours.loaded_tokens,
                    full_s * 1e3,
                    ours_s * 1e3,
                    load_s * 1e3,
                    store_ms,
                    diff,
                    same,
                )
            )
    return report


def format_report(report: DemoReport) -> str:
    s = report.spec
    lines = [
        f"model: {report.model} ({report.params / 1e6:.1f}M params, random weights, seed {s.seed}), "
        f"{s.layers} layers, hidden {s.hidden}, {s.heads} heads / {s.kv_heads} KV heads, float32, "
        f"{torch.get_num_threads()} CPU threads",
        f"prompt: {s.prefix_tokens}-token shared prefix + {s.suffix_tokens}-token suffix; "
        f"chunks of {s.chunk_tokens} tokens, {report.kv_bytes_per_token / 1024:.0f} KiB of KV per token; "
        f"PolarKV transport {s.transport}; warm TTFTs best of {s.repeats}",
        "",
        "| request | prompt tokens | KV loaded | TTFT full prefill | TTFT with PolarKV "
        "| of which load | speedup | store | max abs logit diff | greedy match |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.rows:
        store = f"{r.store_ms:.0f} ms" if r.store_ms is not None else "-"
        speedup = f"{r.speedup:.2f}x" if r.loaded_tokens else "- (miss)"
        lines.append(
            f"| {r.request} | {r.prompt_tokens} | {r.loaded_tokens} | {r.ttft_full_ms:.0f} ms "
            f"| {r.ttft_polarkv_ms:.0f} ms | {r.load_ms:.0f} ms | {speedup} | {store} "
            f"| {r.max_logit_diff:.1e} | {'yes' if r.greedy_match else 'NO'} |"
        )
    if report.warm:
        mib = (
            statistics.median(r.loaded_tokens for r in report.warm)
            * report.kv_bytes_per_token
            / 2**20
        )
        load_ms = statistics.median(r.load_ms for r in report.warm)
        lines += [
            "",
            f"median over the warm requests: TTFT speedup {report.median_speedup:.1f}x; "
            f"loading {mib:.0f} MiB of prefix KV took {load_ms:.0f} ms",
        ]
    return "\n".join(lines)


# Model sizes for --size; explicit --layers, --hidden ... override them.
SIZES = {
    "small": dict(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=704),
    "medium": dict(layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1408),
    "large": dict(layers=16, hidden=1024, heads=16, kv_heads=4, intermediate=2816),
}
SHAPE = ("layers", "hidden", "heads", "kv_heads", "intermediate")


def format_growth(reports: list[DemoReport]) -> str:
    """One line per prefix length: how the gain grows with the prefix."""
    lines = [
        "| prefix tokens | TTFT full prefill | TTFT with PolarKV | of which load | speedup |",
        "|---|---|---|---|---|",
    ]
    for report in reports:
        warm = report.warm
        if not warm:
            continue
        full = statistics.median(r.ttft_full_ms for r in warm)
        ours = statistics.median(r.ttft_polarkv_ms for r in warm)
        load = statistics.median(r.load_ms for r in warm)
        lines.append(
            f"| {report.spec.prefix_tokens} | {full:.0f} ms | {ours:.0f} ms | {load:.0f} ms "
            f"| {report.median_speedup:.1f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    d = DemoSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="manager URL of a running PolarKV (default: start one)")
    parser.add_argument("--arch", choices=("llama", "qwen2"), default=d.arch)
    parser.add_argument(
        "--size",
        choices=tuple(SIZES),
        default="medium",
        help="model size preset (medium: the defaults)",
    )
    parser.add_argument(
        "--prefix-tokens",
        default=str(d.prefix_tokens),
        help="shared prefix length; a comma-separated list runs the demo once per "
        "length and ends with a table of the gain by length",
    )
    for name in (
        "suffix_tokens",
        "requests",
        "gen_tokens",
        "chunk_tokens",
        *SHAPE,
        "vocab",
        "seed",
        "repeats",
        "threads",
    ):
        default = None if name in SHAPE else getattr(d, name)
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    parser.add_argument("--transport", choices=("auto", "tcp", "shm"), default=d.transport)
    args = vars(parser.parse_args())
    url = args.pop("url")
    size = SIZES[args.pop("size")]
    for name in SHAPE:
        if args[name] is None:
            args[name] = size[name]
    try:
        lengths = [int(n) for n in args.pop("prefix_tokens").split(",") if n.strip()]
    except ValueError:
        parser.error("--prefix-tokens: integers, comma separated")
    if not lengths or min(lengths) < 1:
        parser.error("--prefix-tokens: at least one positive length")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    reports = []
    for n in lengths:
        reports.append(run_demo(DemoSpec(prefix_tokens=n, **args), url))
        print(format_report(reports[-1]), end="\n\n", flush=True)
    if len(reports) > 1:
        print(format_growth(reports))


if __name__ == "__main__":
    main()
