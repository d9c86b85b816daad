"""`polarkv replay` end to end: real embedded services, the public trace (or a synthetic
one), and hit rates checked against an independent infinite-cache computation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.conftest import Cluster, assert_usage_error, http, wait_for

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_TRACE = "traces/mooncake_conversation_trace.jsonl"
BLOCK_BYTES = 8 * 512  # --kv-bytes-per-token 8 at 512 tokens per block


def public_trace() -> Path | None:
    for shared in (ROOT.parent / "shared", ROOT / "shared"):
        if (shared / PUBLIC_TRACE).is_file():
            return shared / PUBLIC_TRACE
    return None


def synthetic_lines(n: int) -> list[bytes]:
    """Multi-turn conversations: each turn repeats the whole previous prompt and adds
    blocks; every prompt starts with one shared system-prompt block (id 0)."""
    lines: list[bytes] = []
    talks: list[list[int]] = []
    next_id = 1
    for i in range(n):
        if i % 3 == 0 or not talks:
            talks.append([0])
        talk = talks[(i * 7) % len(talks)]
        talk.extend(range(next_id, next_id + 20 + i % 8))
        next_id += 20 + i % 8
        lines.append(
            orjson.dumps(
                {
                    "timestamp": i * 10,
                    "input_length": len(talk) * 512 - 100,
                    "output_length": 10,
                    "hash_ids": talk,
                }
            )
        )
    return lines


def trace_slice(tmp_path: Path, n: int) -> tuple[Path, list[dict[str, Any]]]:
    """The first n requests of the public trace, copied at run time (a synthetic trace
    where the shared directory is absent)."""
    source = public_trace()
    if source is not None:
        with open(source, "rb") as fh:
            lines = [fh.readline() for _ in range(n)]
    else:
        lines = synthetic_lines(n)
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(line.rstrip(b"\n") + b"\n" for line in lines))
    return path, [orjson.loads(line) for line in lines]


def infinite_cache(requests: list[dict[str, Any]], route: int = 1) -> tuple[int, int, int]:
    """(blocks, prefix-hit blocks, distinct prefixes) with unbounded caches, request i
    served by cache i % route: a block hits only if its whole prefix was seen before."""
    seen: list[set[tuple[int, ...]]] = [set() for _ in range(route)]
    blocks = hits = 0
    for i, req in enumerate(requests):
        ids, cache = req["hash_ids"], seen[i % route]
        prefixes = [tuple(ids[: k + 1]) for k in range(len(ids))]
        hit = 0
        while hit < len(ids) and prefixes[hit] in cache:
            hit += 1
        blocks += len(ids)
        hits += hit
        cache.update(prefixes)
    return blocks, hits, sum(len(s) for s in seen)


def replay(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "polarkv.py"), "replay", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_json(tmp_path: Path, *args: str, kv_bytes_per_token: int = 8) -> dict[str, Any]:
    out = tmp_path / "replay.json"
    done = replay(*args, "--kv-bytes-per-token", str(kv_bytes_per_token), "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = orjson.loads(out.read_bytes())
    return result


def test_hit_rate_equals_infinite_cache_rate(tmp_path: Path) -> None:
    trace, requests = trace_slice(tmp_path, 400)
    blocks, hits, distinct = infinite_cache(requests)
    assert hits > 0
    plot = tmp_path / "replay.png"
    s = run_json(
        tmp_path,
        "--trace",
        str(trace),
        "--embedded-roles",
        "manager,slab",
        "--set",
        "slab.memory=128MiB",
        "--plot",
        str(plot),
        "--prefill-s-per-token",
        "0.001",
    )
    assert s["requests"] == 400 and s["blocks"] == blocks
    assert s["hit_blocks"] == hits
    assert s["hit_rate"] == hits / blocks
    assert s["hit_blocks_memory"] == hits and s["hit_blocks_disk"] == 0
    assert s["bytes_loaded"] == hits * BLOCK_BYTES
    assert s["bytes_stored"] == distinct * BLOCK_BYTES  # every new prefix stored once
    assert s["wrong_blocks"] == 0 and s["client_faults"] == 0
    tokens = sum(r["input_length"] for r in requests)
    assert s["tokens"] == tokens and 0 < s["hit_tokens"] <= hits * 512
    # modelled TTFT: prefill of the missed tokens plus the measured load time
    assert s["ttft_no_cache_s"]["mean"] == pytest.approx(tokens / 400 * 0.001, rel=1e-3)
    assert s["ttft_s"]["mean"] < s["ttft_no_cache_s"]["mean"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_tiered_cache_serves_disk_hits_at_the_same_hit_rate(tmp_path: Path) -> None:
    # Memory holds a small part of the working set; the disk holds it all: every prefix
    # hit is still served (reloaded from disk), and some of them come from the disk.
    trace, requests = trace_slice(tmp_path, 300)
    blocks, hits, distinct = infinite_cache(requests)
    assert distinct * BLOCK_BYTES > 4 * 4 * 2**20
    s = run_json(
        tmp_path,
        "--trace",
        str(trace),
        "--set",
        "slab.memory=4MiB",
        "--set",
        "disk.capacity=256MiB",
        "--load-bandwidth",
        "1GB/s",
        "--disk-bandwidth",
        "100MB/s",
        "--scale",
        "2",
        kv_bytes_per_token=16,
    )
    assert s["block_bytes"] == BLOCK_BYTES
    assert s["hit_blocks"] == hits and s["blocks"] == blocks
    assert s["hit_blocks_disk"] > 0
    assert s["hit_blocks_memory"] + s["hit_blocks_disk"] == hits
    assert s["wrong_blocks"] == 0


def test_per_node_caches_round_robin(tmp_path: Path) -> None:
    trace, requests = trace_slice(tmp_path, 200)
    blocks, hits, _ = infinite_cache(requests, route=2)
    _, shared_hits, _ = infinite_cache(requests)
    assert hits < shared_hits  # local caches lose the hits another node's cache holds
    s = run_json(
        tmp_path,
        "--trace",
        str(trace),
        "--embedded-roles",
        "manager,slab",
        "--set",
        "slab.memory=64MiB",
        "--nodes",
        "2",
        "--route",
        "rr",
    )
    assert s["nodes"] == 2 and s["route"] == "rr"
    assert s["blocks"] == blocks and s["hit_blocks"] == hits


def test_replay_against_two_manager_shards(tmp_path: Path, cluster: Cluster) -> None:
    # Several comma-separated URLs are shards of one service: one slab serves both, every
    # key goes to its own shard, and the tier counters are summed over the shards.
    grant = {"security__grant_key": "replay-test-grant-key-0123456789"}
    shards = [cluster.manager(manager__shard=f"{i}/2", **grant) for i in range(2)]
    urls = ",".join(m.manager_url for m in shards)
    cluster.start(
        ["slab"],
        {
            "slab.manager_url": urls,
            "slab.memory": "128MiB",
            "security.grant_key": grant["security__grant_key"],
        },
    )
    for m in shards:
        wait_for(lambda m=m: http("GET", m.manager_url + "/v1/stats")[1]["nodes"] == 1)
    trace, requests = trace_slice(tmp_path, 200)
    blocks, hits, _ = infinite_cache(requests)
    s = run_json(tmp_path, "--trace", str(trace), "--manager-url", urls)
    assert s["blocks"] == blocks and s["hit_blocks"] == hits
    assert s["hit_blocks_memory"] == hits
    per_shard = [http("GET", m.manager_url + "/v1/stats")[1]["hits"] for m in shards]
    assert all(n > 0 for n in per_shard) and sum(per_shard) == hits


def test_replay_with_a_token(tmp_path: Path) -> None:
    # A service that requires a bearer token: the replay's client and its stats reads
    # use the token from the config (here the embedded service's own --set).
    trace, requests = trace_slice(tmp_path, 60)
    _, hits, _ = infinite_cache(requests)
    s = run_json(
        tmp_path,
        "--trace",
        str(trace),
        "--embedded-roles",
        "manager,slab",
        "--set",
        "security.token=replay-secret-token-0123456789",
    )
    assert s["hit_blocks"] == hits > 0 and s["client_faults"] == 0


def test_time_scale_keeps_the_traces_pace(tmp_path: Path) -> None:
    trace = tmp_path / "paced.jsonl"
    trace.write_bytes(
        b"".join(
            orjson.dumps(
                {"timestamp": t, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]}
            )
            + b"\n"
            for t in (0, 400, 800)
        )
    )
    s = run_json(
        tmp_path, "--trace", str(trace), "--embedded-roles", "manager,slab", "--time-scale", "2"
    )
    assert s["wall_seconds"] >= 0.4  # the last request is due 800 ms / 2 after the first
    assert s["hit_blocks"] == 4  # requests 1 and 2 find both blocks of request 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trace", "/nonexistent.jsonl"], "cannot read trace"),
        (["--model", "gpt-5"], "unknown model preset"),
        (["--model", "llama-3-8b", "--kv-bytes-per-token", "8"], "not both"),
        (["--requests", "many"], "--requests must be a number"),
        (["--scale", "64"], "needs --load-bandwidth"),
        (["--load-bandwidth", "fast"], "not a rate"),
        (["--manager-url", "http://127.0.0.1:9", "--nodes", "2"], "cannot go with --manager-url"),
        (["--set", "slab.nonsense=1"], "slab.nonsense"),
        (["--embedded-roles", "slab"], "--embedded-roles"),
        (["--manager-url", "127.0.0.1:8170"], "not an http(s) URL"),
        (["--manager-url", "http://127.0.0.1:9,http://127.0.0.1:9"], "listed twice"),
        (["--engine", "sglang"], "only vllm"),
        (["--engine", "vllm", "--python", "/nonexistent/python"], "does not exist"),
        (["--engine", "vllm", "--python", sys.executable, "--layouts", "local,disk"], "--layouts"),
        (["--engine", "vllm", "--python", sys.executable, "--layouts", "local,local"], "distinct"),
        (["--engine", "vllm", "--python", sys.executable, "--router", "random"], "--router"),
        (["--engine", "vllm", "--python", sys.executable, "--engines", "0"], "--engines must be"),
        (["--engine", "vllm", "--python", sys.executable, "--block-tokens", "9999"], "below"),
        (["--engine", "vllm", "--python", sys.executable, "--engine-memory", "lots"], "memory"),
        (["--engine", "vllm", "--python", sys.executable, "--nic", "fast"], "--nic"),
    ],
)
def test_bad_flags_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    trace, _ = trace_slice(tmp_path, 5)
    if "--trace" not in args:
        args = ["--trace", str(trace), *args]
    done = replay(*args)
    assert_usage_error(done, message)


def test_bad_trace_line_and_unreachable_manager(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": "x"}\n')
    done = replay("--trace", str(bad))
    assert done.returncode == 2 and f"{bad}:1" in done.stderr and "hash_ids" in done.stderr
    trace, _ = trace_slice(tmp_path, 5)
    done = replay("--trace", str(trace), "--manager-url", "http://127.0.0.1:9", "--timeout", "1")
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "cannot use the manager at http://127.0.0.1:9" in done.stderr
