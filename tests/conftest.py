"""Fixtures that start real `polarkv` processes on loopback ephemeral ports."""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import subprocess
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from polarkv_lib.client.admin import AdminClient
from polarkv_lib.service import Service

ROOT = Path(__file__).resolve().parent.parent


def http(
    method: str,
    url: str,
    body: Any = None,
    raw: bytes | None = None,
    token: str | None = None,
    timeout: float = 5.0,
) -> tuple[int, Any]:
    """One HTTP request to a full URL; returns (status, parsed JSON or text). The
    project's blocking AdminClient does the work."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return AdminClient(f"{parts.scheme}://{parts.netloc}", timeout=timeout).request(
        method, path, body, raw, token=token
    )


def assert_usage_error(done: subprocess.CompletedProcess[str], message: str) -> None:
    """A CLI refusal: exit status 2 and one line on stderr that says `message`."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


def prompt(conversation: int, chunks: int, chunk_tokens: int) -> list[int]:
    """The tokens of a test prompt: `chunks` full chunks, distinct per conversation."""
    return [conversation * 100_000 + t for t in range(chunks * chunk_tokens)]


def free_port() -> int:
    """A loopback port nothing listens on (for a moment: bind it soon)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PolarKV(Service):
    """One `polarkv` process of a test, in its own directory under the test's."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        roles: list[str],
        settings: Mapping[str, str | None],
        **options: Any,
    ) -> None:
        super().__init__(str(workdir / name), roles, settings, **options)
        self.name = name

    @property
    def manager_url(self) -> str:
        return str(self.info["manager_url"])

    @property
    def slab_address(self) -> str:
        return str(self.info["slab_address"])

    def log(self) -> str:
        return self.log_text()

    def close(self) -> None:
        self.stop()


class Cluster:
    """Starts processes for one test and stops them all afterwards."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[PolarKV] = []

    def start(
        self,
        roles: list[str],
        settings: Mapping[str, str | None] | None = None,
        name: str | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
        config_file: Path | None = None,
        extra_args: list[str] | None = None,
        max_files: int | None = None,
    ) -> PolarKV:
        base: dict[str, str | None] = {"log.level": "info"}
        if "manager" in roles or not roles:
            base["manager.listen"] = "127.0.0.1:0"
        if "slab" in roles or not roles:
            base.update(
                {
                    "slab.listen": "127.0.0.1:0",
                    "slab.memory": "64MiB",
                    "slab.heartbeat_interval": "200ms",
                    "manager.heartbeat_ttl": "1s",
                }
            )
        name = name or f"p{len(self.procs)}"
        if "disk" in roles or not roles:
            base.update({"disk.paths": str(self.workdir / name / "disk"), "disk.capacity": "1GiB"})
        proc = PolarKV(
            self.workdir,
            name,
            roles,
            {**base, **(settings or {})},
            env=env,
            config_file=config_file,
            extra_args=extra_args or (),
            max_files=max_files,
        )
        self.procs.append(proc)
        proc.start()
        if wait:
            proc.wait_ready()
        return proc

    def manager(self, **settings: str) -> PolarKV:
        return self.start(["manager"], {"manager.heartbeat_ttl": "1s", **_dotted(settings)})

    def slab(self, manager_url: str, **settings: str) -> PolarKV:
        proc = self.start(["slab"], {"slab.manager_url": manager_url, **_dotted(settings)})
        wait_for(
            lambda: any(
                n["id"] == proc.info["node_id"] and n["state"] == "alive"
                for n in http("GET", manager_url + "/v1/nodes")[1]["nodes"]
            )
        )
        return proc

    def embedded(self, disk: bool = False, **settings: str) -> PolarKV:
        """Manager and slab in one process; with `disk`, the disk role too (the default
        `polarkv` with no role)."""
        return self.start([] if disk else ["manager", "slab"], _dotted(settings))

    def slab_disk(self, manager_url: str, **settings: str) -> PolarKV:
        proc = self.start(["slab", "disk"], {"slab.manager_url": manager_url, **_dotted(settings)})
        wait_for(
            lambda: any(
                n["id"] == proc.info["node_id"] and n["state"] == "alive"
                for n in http("GET", manager_url + "/v1/nodes")[1]["nodes"]
            )
        )
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.close()


def _dotted(settings: dict[str, str]) -> dict[str, str]:
    """manager__read_lease='1s' -> {'manager.read_lease': '1s'}"""
    return {k.replace("__", "."): v for k, v in settings.items()}


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def stats(url: str) -> dict[str, int]:
    status, body = http("GET", url + "/v1/stats")
    assert status == 200
    return dict(body)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


# -- metadata stores ----------------------------------------------------------------------

PG = "postgresql://postgres@127.0.0.1:5432/test"


def pg(sql: str) -> list[tuple[object, ...]]:
    """One statement on the test PostgreSQL database; its rows."""

    async def run() -> list[tuple[object, ...]]:
        import asyncpg

        conn = await asyncpg.connect(PG)
        try:
            return [tuple(r) for r in await conn.fetch(sql)]
        finally:
            await conn.close()

    return asyncio.run(run())


@pytest.fixture
def clean_pg() -> Iterator[None]:
    """The test database without the manager's tables, before and after the test."""
    pg("DROP TABLE IF EXISTS polarkv_entries, polarkv_nodes")
    yield
    pg("DROP TABLE IF EXISTS polarkv_entries, polarkv_nodes")


@pytest.fixture(params=["sqlite", "postgresql"])
def metadata_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The manager's metadata store, each kind in turn: a SQLite file in the test's
    directory, or the (emptied) PostgreSQL test database."""
    if request.param == "postgresql":
        request.getfixturevalue("clean_pg")
        return PG
    return f"sqlite:///{tmp_path / 'meta.db'}"


# -- the event loop stays free ------------------------------------------------------------

# Seconds one step of the loop may take. Wall clock: a loaded 2-core box preempts for a
# few hundred ms now and then; real blocking (a restore, a whole-buffer fallocate) is longer.
SLOW_CALLBACK_BOUND = 0.5


class _SlowCallbacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reports: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing ") and " took " in message:
            self.reports.append(message)


@pytest.fixture
async def loop_stays_free() -> AsyncIterator[None]:
    """Fail the test if any callback held the event loop longer than the bound: asyncio's
    debug mode reports each one ("Executing <Handle ...> took 0.3 seconds")."""
    loop = asyncio.get_running_loop()
    handler = _SlowCallbacks()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    debug, duration = loop.get_debug(), loop.slow_callback_duration
    loop.set_debug(True)
    loop.slow_callback_duration = SLOW_CALLBACK_BOUND
    try:
        yield
    finally:
        loop.set_debug(debug)
        loop.slow_callback_duration = duration
        logger.removeHandler(handler)
    assert not handler.reports, "the event loop was blocked:\n" + "\n".join(handler.reports)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every in-process async test runs under `loop_stays_free`."""
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.function):
            item.fixturenames.append("loop_stays_free")
