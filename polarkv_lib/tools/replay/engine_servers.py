"""The vLLM servers of `polarkv replay --engine vllm`: one inside a cluster VM, the
streamed completion that times the first token and reads the engine's cached-token
count, the model's build, and vLLM's hit counters."""

from __future__ import annotations

import contextlib
import json
import random
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from polarkv_lib.cluster import procs
from polarkv_lib.cluster.spec import Vm
from polarkv_lib.tools.bench.core import BenchError
from polarkv_lib.tools.tiny_llama import TinyLlama
from polarkv_lib.tools.vllm_server import ServerError, VllmServer, build_model

MODEL = TinyLlama(
    layers=4, hidden=256, heads=4, kv_heads=2, intermediate=704, vocab=4096, max_len=2048
)
GEN_TOKENS = 4  # generated per request (the trace's output lengths are not replayed)


def block(block_id: int, tokens: int) -> list[int]:
    """The token ids of one trace block: the same wherever the id appears."""
    rng = random.Random(block_id * 1_000_003 + tokens)
    return [rng.randrange(MODEL.vocab - 1) for _ in range(tokens)]


@dataclass
class VmServer(VllmServer):
    """A `vllm serve` inside a cluster VM, listening on the VM's address."""

    vm: Vm | None = None

    @property
    def url(self) -> str:
        assert self.vm is not None
        return f"http://{self.vm.address}:{self.port}"

    def command(self) -> list[str]:
        assert self.vm is not None
        cmd = super().command()
        cmd[cmd.index("--host") + 1] = self.vm.address
        return procs.in_vm(self.vm, [*cmd, "--enable-prompt-tokens-details"])


def stream(
    url: str, model: str, tokens: list[int], timeout: float = 600.0
) -> tuple[float, list[int], int]:
    """Greedy streamed completion: (seconds to the first streamed token, the generated
    token ids, the prompt tokens the engine reports cached), timed by the client."""
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": GEN_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start, first, out, cached = time.perf_counter(), 0.0, [], 0
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                ids = [int(t) for c in chunk.get("choices") or [] for t in c.get("token_ids") or []]
                if ids and not first:
                    first = time.perf_counter() - start
                out += ids
                details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                cached = int(details.get("cached_tokens") or cached)
    except OSError as exc:
        raise BenchError(f"{url}: completion failed: {exc}") from None
    return first, out, cached


@contextlib.contextmanager
def servers_up(servers: list[VllmServer]) -> Iterator[list[VllmServer]]:
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
            stream(server.url, server.model, block(-2, 64))  # lazy set-up, off the clock
        yield servers
    except ServerError as exc:
        raise BenchError(str(exc)) from None
    finally:
        for server in servers:
            server.stop()


def counters(server: VllmServer) -> dict[str, float]:
    m = server.metrics()
    return {
        "prompt": m.get("vllm:prompt_tokens_total", 0.0),
        "local": m.get("vllm:prefix_cache_hits_total", 0.0),
        "external": m.get("vllm:external_prefix_cache_hits_total", 0.0),
    }


def build_engine_model(python: str, path: str) -> None:
    """The replay's model, built by the engines' own Python."""
    try:
        build_model(python, path, MODEL)
    except ServerError as exc:
        raise BenchError(str(exc)) from None
