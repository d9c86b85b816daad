#!/usr/bin/env python3
"""The paper's scenarios on the public trace, each one `polarkv replay` run (method and
results: docs/EVALUATION.md, docs/PAPER-RESULTS.md).

    (a) equal budget: memory-only vs disk-only vs tiered, sized by `polarkv plan --budget`
    (b) per-node local caches (round-robin / by session) vs one shared PolarKV

Sizes are the plan's bytes divided by --scale, as are the blocks' bytes, so every
capacity keeps its ratio to the trace's working set. Summaries (with the exact command
of each run) and one plot per scenario go to --out; raw per-request JSON to bench-out/.
`--hardware paper` adds to each run its TTFT on the paper's hardware, modelled
(polarkv_lib/tools/replay/paper_hardware.py), beside the fixed-rate model's.

    scripts/replay_scenarios.py --requests 2000 --out docs/results
    scripts/replay_scenarios.py --hardware paper --engines 4,16,64 [--model deepseek-r1] [--replot]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
MODEL = "qwen3-235b-a22b"  # the paper's equal-budget comparison ran Qwen3-235B-A22B
MODELS = {"qwen3-235b": "qwen3-235b-a22b", "deepseek-r1": "deepseek-r1"}
BUDGET, BANDWIDTH = "18400", "12GB/s"  # its pool budget (CNY/month) and bandwidth floor
LOAD_BW, DISK_BW = "3GB/s", "1.5GB/s"  # modelled per-request rates (docs/EVALUATION.md)
NODES = 4  # inference nodes in scenario (b)


def polarkv(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "polarkv.py"), *args]


def paper_hardware(
    key: str,
    results: dict[str, dict[str, Any]],
    designs: dict[str, dict[str, Any]],
    trace_path: str,
    model: str,
    engine_counts: list[int],
) -> None:
    """Add `paper_hardware` (one entry per engine count) to each run of scenario `key`."""
    from polarkv_lib.tools.presets import preset
    from polarkv_lib.tools.replay.paper_hardware import model_run, pool_from_plan
    from polarkv_lib.tools.replay.trace import load_trace

    memory = designs["memory_only"]
    # each run's pool: (a) its own design; (b) the memory-only design's VMs, and for the
    # tiered run the tiered design's disk behind them
    pools = {
        "memory_only": pool_from_plan(memory),
        "disk_only": pool_from_plan(designs["disk_only"]),
        "tiered": pool_from_plan(designs["tiered"]),
        "local_rr": pool_from_plan(memory),
        "local_session": pool_from_plan(memory),
        "shared": pool_from_plan(memory),
        "shared_tiered": pool_from_plan(memory, designs["tiered"]),
    }
    preset_ = preset(model)
    longest = max(len(r["per_request"]) for r in results.values())
    trace = load_trace(trace_path, longest)
    for name, r in results.items():
        runs = []
        for engines in engine_counts:
            one = model_run(r, trace, pools[name], preset_, engines)
            runs.append(one)
            t, b = one["ttft_s"], one["ttft_no_cache_s"]
            print(
                f"   {key}-{name}, {one['engines']} engines: paper hardware TTFT p50 "
                f"{t['p50']:.3f} p90 {t['p90']:.3f} mean {t['mean']:.3f} s "
                f"(no cache {b['p50']:.3f} / {b['p90']:.3f} / {b['mean']:.3f}); mean without "
                f"the attention term {one['without_attention']['ttft_s']['mean']:.3f}, "
                f"without stores on the disks {one['without_stores']['ttft_s']['mean']:.3f}",
                flush=True,
            )
        r["paper_hardware"] = runs


def plan_designs() -> dict[str, dict[str, Any]]:
    done = subprocess.run(
        polarkv("plan", "--budget", BUDGET, "--bandwidth", BANDWIDTH, "--json"),
        capture_output=True,
        check=True,
        timeout=60,
    )
    return {d["name"]: d for d in orjson.loads(done.stdout)["designs"]}


def replay(name: str, args: list[str], common: list[str], raw: Path) -> dict[str, Any]:
    out = raw / f"{name}.json"
    cmd = polarkv("replay", *common, *args, "--json", str(out), "--per-request")
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, timeout=1800)
    result: dict[str, Any] = orjson.loads(out.read_bytes())
    # as a user types it from the checkout, without the raw per-request JSON
    result["command"] = "polarkv " + " ".join(cmd[2:-3]).replace(str(ROOT.parent), "..")
    result["trace"] = str(result["trace"]).replace(str(ROOT.parent), "..")
    out.write_bytes(orjson.dumps(result))
    return result


def cumulative(per_request: list[dict[str, Any]]) -> list[float]:
    rates, hits, blocks = [], 0, 0
    for r in per_request:
        hits += r["hit_blocks"]
        blocks += r["blocks"]
        rates.append(hits / max(blocks, 1))
    return rates


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, r in results.items():
        per = r["per_request"]
        top.plot(range(1, len(per) + 1), cumulative(per), label=name)
    top.set_xlabel("request")
    top.set_ylabel("cumulative block hit rate")
    top.set_ylim(0, 1)
    top.legend(fontsize=8)
    names = ["no cache", *results]
    ttft = [next(iter(results.values()))["ttft_no_cache_s"]] + [
        r["ttft_s"] for r in results.values()
    ]
    xs = range(len(names))
    bottom.bar([x - 0.2 for x in xs], [t["p50"] for t in ttft], 0.4, label="p50")
    bottom.bar([x + 0.2 for x in xs], [t["p90"] for t in ttft], 0.4, label="p90")
    bottom.set_xticks(list(xs), names, fontsize=8, rotation=15)
    bottom.set_ylabel("modelled TTFT (s)")
    bottom.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace", default=str(ROOT.parent / "shared/traces/mooncake_conversation_trace.jsonl")
    )
    parser.add_argument("--requests", default="2000")
    parser.add_argument("--scale", type=int, default=4096)
    parser.add_argument("--out", default=str(ROOT / "docs/results"))
    parser.add_argument("--only", choices=["a", "b"], default=None)
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="qwen3-235b",
        help="Model preset of the replay's block sizes and of the paper-hardware prefill.",
    )
    parser.add_argument(
        "--hardware",
        choices=["fixed", "paper"],
        default="fixed",
        help="paper: also model each run's TTFT on the paper's hardware.",
    )
    parser.add_argument(
        "--engines",
        default=str(NODES),
        help="With --hardware paper: inference engines (8 GPUs each), comma-separated "
        "for several; a multiple of the per-node caches of (b).",
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="Redo summaries and plots from the last runs' raw JSON, run nothing.",
    )
    opts = parser.parse_args()
    out, raw = Path(opts.out), ROOT / "bench-out/replay"
    model = MODELS[opts.model]
    engine_counts = [int(n) for n in opts.engines.split(",") if n.strip()]
    # the default model keeps the file names it always had
    tag = "" if model == MODEL else f"-{opts.model}"
    out.mkdir(parents=True, exist_ok=True)
    raw.mkdir(parents=True, exist_ok=True)
    scale = opts.scale
    common = [
        "--trace",
        opts.trace,
        "--requests",
        opts.requests,
        "--model",
        model,
        "--scale",
        str(scale),
        "--load-bandwidth",
        LOAD_BW,
        "--disk-bandwidth",
        DISK_BW,
    ]
    designs = plan_designs()

    def size(n: float) -> str:
        return f"{max(1, int(n // scale // 2**20))}MiB"

    scenarios: dict[str, dict[str, list[str]]] = {
        "a": {
            "memory_only": [
                "--embedded-roles",
                "manager,slab",
                "--set",
                f"slab.memory={size(designs['memory_only']['memory_bytes'])}",
            ],
            # a disk-only pool still needs a buffer to read files into: 4 MiB (0.1% of its disk)
            "disk_only": [
                "--set",
                "slab.memory=4MiB",
                "--set",
                f"disk.capacity={size(designs['disk_only']['disk_bytes'])}",
            ],
            "tiered": [
                "--set",
                f"slab.memory={size(designs['tiered']['memory_bytes'])}",
                "--set",
                f"disk.capacity={size(designs['tiered']['disk_bytes'])}",
            ],
        },
        # (b): the same total memory (the memory-only design's), split over NODES private
        # caches or pooled; the shared tiered pool adds the tiered design's disk
        "b": {
            "local_rr": [
                "--embedded-roles",
                "manager,slab",
                "--nodes",
                str(NODES),
                "--route",
                "rr",
                "--set",
                f"slab.memory={size(designs['memory_only']['memory_bytes'] / NODES)}",
            ],
            "local_session": [
                "--embedded-roles",
                "manager,slab",
                "--nodes",
                str(NODES),
                "--route",
                "session",
                "--set",
                f"slab.memory={size(designs['memory_only']['memory_bytes'] / NODES)}",
            ],
            "shared": [
                "--embedded-roles",
                "manager,slab",
                "--set",
                f"slab.memory={size(designs['memory_only']['memory_bytes'])}",
            ],
            "shared_tiered": [
                "--set",
                f"slab.memory={size(designs['memory_only']['memory_bytes'])}",
                "--set",
                f"disk.capacity={size(designs['tiered']['disk_bytes'])}",
            ],
        },
    }
    titles = {
        "a": f"(a) equal budget ({BUDGET} CNY/month at {BANDWIDTH}), {model}, 1/{scale} scale",
        "b": f"(b) {NODES} per-node caches vs one shared pool (same memory), 1/{scale} scale",
    }
    for key, runs in scenarios.items():
        if opts.only and key != opts.only:
            continue
        if opts.replot:
            results = {
                name: orjson.loads((raw / f"{key}-{name}{tag}.json").read_bytes()) for name in runs
            }
        else:
            results = {
                name: replay(f"{key}-{name}{tag}", args, common, raw) for name, args in runs.items()
            }
        if opts.hardware == "paper":
            paper_hardware(key, results, designs, opts.trace, model, engine_counts)
        plot(results, out / f"replay-scenario-{key}{tag}.png", titles[key])
        for r in results.values():
            del r["per_request"]
        summary = {
            "scenario": titles[key],
            "plan": designs if key == "a" else None,
            "runs": results,
        }
        (out / f"replay-scenario-{key}{tag}.json").write_bytes(
            orjson.dumps(summary, option=orjson.OPT_INDENT_2)
        )


if __name__ == "__main__":
    main()
