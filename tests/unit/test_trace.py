"""Trace parsing, model presets and the replay report's arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from polarkv_lib.stats import percentile
from polarkv_lib.tools.presets import PRESETS, preset
from polarkv_lib.tools.replay.report import TtftModel, spread, summarize
from polarkv_lib.tools.replay.runner import ReplayResult, ReplaySettings, RequestResult
from polarkv_lib.tools.replay.trace import TraceError, load_trace


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    return str(path)


def test_load_trace_reads_mooncake_lines(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}\n'
        "\n"
        '{"timestamp": 27.5, "input_length": 600, "output_length": 1, "hash_ids": [0, 2]}\n',
    )
    reqs = load_trace(path)
    assert [r.hash_ids for r in reqs] == [(0, 1), (0, 2)]
    assert reqs[1].timestamp_ms == 27.5 and reqs[1].input_length == 600
    assert reqs[1].session(2) == (0, 2)
    assert len(load_trace(path, limit=1)) == 1


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}', "timestamp"),
        (
            '{"timestamp": 0, "input_length": "9", "output_length": 1, "hash_ids": []}',
            "input_length",
        ),
        (
            '{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, -2]}',
            "hash_ids",
        ),
        ('{"timestamp": 0, "input_length": 9, "output_length": 1}', "hash_ids"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    ok = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}'
    path = write(tmp_path, ok + "\n" + line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert f"{path}:2" in str(info.value)


def test_missing_or_empty_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(str(tmp_path / "absent.jsonl"))
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write(tmp_path, "\n"))


def test_presets_kv_bytes_per_token() -> None:
    # layers x KV heads x head dim x 2 (K, V) x 2 bytes (bf16)
    assert preset("llama-3-8b").kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    assert preset("Qwen3-235B-A22B").kv_bytes_per_token == 94 * 4 * 128 * 2 * 2 == 192512
    # MLA: layers x (kv_lora_rank 512 + rope dim 64) x 2 bytes, one latent per token
    assert preset("deepseek-r1").kv_bytes_per_token == 61 * 576 * 2 == 70272
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("gpt-5")


def test_prefill_model_matches_the_papers_recompute_time() -> None:
    # The paper: ~3 s to recompute 20K tokens of DeepSeek-R1. The model: 2 x 37e9 FLOPs
    # per token over 8 H20s at 40% of 148 TFLOPS.
    seconds = 20_000 * PRESETS["deepseek-r1"].prefill_s_per_token
    assert seconds == pytest.approx(20_000 * 2 * 37e9 / (8 * 148e12 * 0.4))
    assert 2.5 < seconds < 3.5


def test_percentiles() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 0.5) == 5.0 and percentile(values, 0.9) == 9.0
    assert percentile([7.0], 0.9) == 7.0
    assert spread(values) == {"p50": 5.0, "p90": 9.0, "mean": 5.5}


def test_summary_rates_and_modelled_ttft() -> None:
    settings = ReplaySettings(kv_bytes_per_token=1000, block_tokens=10, scale=4)
    run = ReplayResult(
        results=[
            # 3 blocks, none hit; then 3 blocks, 2 hit (1 from disk), 25 input tokens
            RequestResult(3, 0, 0, 0, 30, 0, 0.001, 0.002, 3, 0),
            RequestResult(3, 2, 1, 1, 25, 20, 0.010, 0.001, 1, 0),
        ]
    )
    model = TtftModel(prefill_s_per_token=0.01, load_bandwidth=10_000.0, disk_bandwidth=5_000.0)
    s = summarize(run, settings, model)
    assert s["blocks"] == 6 and s["hit_blocks"] == 2 and s["hit_rate"] == pytest.approx(2 / 6)
    assert s["token_hit_rate"] == pytest.approx(20 / 55)
    assert s["block_bytes"] == 2500 and s["bytes_loaded"] == 5000 and s["bytes_stored"] == 10000
    assert s["hit_blocks_memory"] == 1 and s["hit_blocks_disk"] == 1
    # request 2: 5 missed tokens x 0.01 + 10,000 B / 10,000 B/s + 10,000 B / 5,000 B/s
    assert model.ttft_s(run.results[1], settings) == pytest.approx(0.05 + 1.0 + 2.0)
    # measured load time, scaled back up by the block scale
    measured = TtftModel(prefill_s_per_token=0.01)
    assert measured.load_s(run.results[1], settings) == pytest.approx(0.010 * 4)
    assert s["ttft_no_cache_s"]["mean"] == pytest.approx((0.30 + 0.25) / 2)
