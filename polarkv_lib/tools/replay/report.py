"""Turn a replay into its report: hit rates, bytes, load throughput and modelled TTFT.

TTFT per request is modelled as prefill of the tokens that missed (the preset's time
per token) plus the time to load the tokens that hit. The load time is either the
measured one, times `scale` when the replay moved scaled-down blocks (a linear
extrapolation: per-request overheads are scaled too, so it errs on the slow side), or
the full-size bytes over given bandwidths for memory and disk hits (`load_bandwidth`,
`disk_bandwidth`), for modelling a deployment other than this machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polarkv_lib.stats import percentile
from polarkv_lib.tools.replay.runner import ReplayResult, ReplaySettings, RequestResult


@dataclass(frozen=True)
class TtftModel:
    prefill_s_per_token: float
    load_bandwidth: float | None = None  # bytes/s for memory hits; None: measured
    disk_bandwidth: float | None = None  # bytes/s for disk hits; None: as memory hits

    def load_s(self, r: RequestResult, settings: ReplaySettings) -> float:
        if self.load_bandwidth is None:
            return r.load_s * settings.scale
        disk_rate = self.disk_bandwidth or self.load_bandwidth
        full = settings.block_bytes_full
        on_disk = r.hit_disk * full / disk_rate
        return (r.hit_blocks - r.hit_disk) * full / self.load_bandwidth + on_disk

    def ttft_s(self, r: RequestResult, settings: ReplaySettings) -> float:
        return (r.input_tokens - r.hit_tokens) * self.prefill_s_per_token + self.load_s(r, settings)

    def no_cache_s(self, r: RequestResult) -> float:
        return r.input_tokens * self.prefill_s_per_token


def spread(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "mean": 0.0}
    return {
        "p50": round(percentile(values, 0.5), 6),
        "p90": round(percentile(values, 0.9), 6),
        "mean": round(statistics.fmean(values), 6),
    }


def summarize(
    run: ReplayResult, settings: ReplaySettings, model: TtftModel, per_request: bool = False
) -> dict[str, Any]:
    rs = run.results
    blocks = sum(r.blocks for r in rs)
    hit_blocks = sum(r.hit_blocks for r in rs)
    tokens = sum(r.input_tokens for r in rs)
    hit_tokens = sum(r.hit_tokens for r in rs)
    load_s = sum(r.load_s for r in rs)
    size = settings.block_bytes
    loaded = hit_blocks * size
    ttft = [model.ttft_s(r, settings) for r in rs]
    base = [model.no_cache_s(r) for r in rs]
    out: dict[str, Any] = {
        "requests": len(rs),
        "blocks": blocks,
        "hit_blocks": hit_blocks,
        "hit_rate": hit_blocks / blocks if blocks else 0.0,
        "hit_blocks_memory": sum(r.hit_memory for r in rs),
        "hit_blocks_disk": sum(r.hit_disk for r in rs),
        "tokens": tokens,
        "hit_tokens": hit_tokens,
        "token_hit_rate": hit_tokens / tokens if tokens else 0.0,
        "bytes_loaded": loaded,
        "bytes_stored": sum(r.stored_blocks for r in rs) * size,
        "bytes_loaded_full_size": hit_blocks * settings.block_bytes_full,
        "load_seconds": round(load_s, 6),
        "load_throughput_bytes_per_s": round(loaded / load_s) if load_s > 0 else 0,
        "store_seconds": round(sum(r.store_s for r in rs), 6),
        "wall_seconds": round(run.seconds, 3),
        "wrong_blocks": run.wrong_blocks,
        "client_faults": run.client_faults,
        "block_tokens": settings.block_tokens,
        "kv_bytes_per_token": settings.kv_bytes_per_token,
        "block_bytes_full": settings.block_bytes_full,
        "block_bytes": size,
        "scale": settings.scale,
        "ttft_model": {
            "prefill_s_per_token": model.prefill_s_per_token,
            "load": "measured x scale" if model.load_bandwidth is None else "bandwidth",
            "load_bandwidth_bytes_per_s": model.load_bandwidth,
            "disk_bandwidth_bytes_per_s": model.disk_bandwidth,
        },
        "ttft_s": spread(ttft),
        "ttft_no_cache_s": spread(base),
        "ttft_mean_reduction": round(1 - statistics.fmean(ttft) / statistics.fmean(base), 4)
        if rs and statistics.fmean(base) > 0
        else 0.0,
    }
    if per_request:
        out["per_request"] = [
            {
                "blocks": r.blocks,
                "hit_blocks": r.hit_blocks,
                "hit_memory": r.hit_memory,
                "hit_disk": r.hit_disk,
                "load_s": round(r.load_s, 6),
                "cache": r.cache,
                "ttft_s": round(t, 6),
            }
            for r, t in zip(rs, ttft, strict=True)
        ]
    return out


def table(summary: dict[str, Any]) -> str:
    """A short human-readable report."""
    s = summary
    lines = [
        f"requests {s['requests']}, blocks {s['blocks']} ({s['block_bytes']} B each, "
        f"full size {s['block_bytes_full']} B)",
        f"hit rate   {s['hit_rate']:.2%} of blocks, {s['token_hit_rate']:.2%} of tokens "
        f"(memory {s['hit_blocks_memory']}, disk {s['hit_blocks_disk']} blocks)",
        f"bytes      loaded {s['bytes_loaded']:,}  stored {s['bytes_stored']:,}  "
        f"load {s['load_throughput_bytes_per_s'] / 1e6:.1f} MB/s",
        f"TTFT (s)   p50 {s['ttft_s']['p50']:.3f}  p90 {s['ttft_s']['p90']:.3f}  "
        f"mean {s['ttft_s']['mean']:.3f}   without a cache: p50 {s['ttft_no_cache_s']['p50']:.3f}  "
        f"p90 {s['ttft_no_cache_s']['p90']:.3f}  mean {s['ttft_no_cache_s']['mean']:.3f}",
        f"checks     wrong blocks {s['wrong_blocks']}, client faults {s['client_faults']}",
    ]
    return "\n".join(lines)


def plot(
    run: ReplayResult, settings: ReplaySettings, model: TtftModel, path: str, title: str
) -> None:
    """Hit rate (cumulative and per 100 requests) and TTFT over the trace, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = run.results
    xs = list(range(1, len(rs) + 1))
    cum, hits, blocks = [], 0, 0
    for r in rs:
        hits += r.hit_blocks
        blocks += r.blocks
        cum.append(hits / max(blocks, 1))
    window = [
        sum(r.hit_blocks for r in rs[max(0, i - 99) : i + 1])
        / max(1, sum(r.blocks for r in rs[max(0, i - 99) : i + 1]))
        for i in range(len(rs))
    ]
    ttft = [model.ttft_s(r, settings) for r in rs]
    base = [model.no_cache_s(r) for r in rs]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(xs, cum, label="cumulative")
    top.plot(xs, window, label="last 100 requests", alpha=0.7)
    top.set_ylabel("block hit rate")
    top.set_ylim(0, 1)
    top.legend(loc="lower right")
    top.set_title(title)
    bottom.plot(xs, base, ",", color="grey", label="no cache (modelled)")
    bottom.plot(xs, ttft, ",", color="C0", label="with PolarKV (modelled)")
    bottom.set_yscale("log")
    bottom.set_ylabel("TTFT (s)")
    bottom.set_xlabel("request")
    bottom.legend(loc="upper right", markerscale=20)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
