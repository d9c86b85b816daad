"""PolarKVClient: the blocking face of AsyncPolarKVClient for engines and scripts.

It owns one event loop in a daemon thread and runs each call there; the caller's
thread blocks on the result. Results are bounded by the client's timeout like the async
calls (plus a backstop), so a blocked caller always gets its miss back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import warnings
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from polarkv_lib.client.async_client import DEFAULTS, AsyncPolarKVClient, client_kwargs
from polarkv_lib.client.transfers import BufferLike, ClientStats
from polarkv_lib.config import ClientConfig, Config

T = TypeVar("T")


class PolarKVClient:
    def __init__(
        self,
        manager_url: str = DEFAULTS.manager_url,
        namespace: str = "",
        chunk_tokens: int = DEFAULTS.chunk_tokens,
        token: str | None = None,
        transport: str = DEFAULTS.transport,
        timeout: float = DEFAULTS.timeout,
        connections: int = DEFAULTS.connections,
        window: int = DEFAULTS.window,
        breaker_interval: float = DEFAULTS.breaker_interval,
    ) -> None:
        # Validate in the caller's thread so mistakes raise here, before a thread starts.
        self._client = AsyncPolarKVClient(
            manager_url,
            namespace,
            chunk_tokens,
            token,
            transport,
            timeout,
            connections,
            window,
            breaker_interval,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="polarkv-client", daemon=True
        )
        self._thread.start()
        self._closed = False

    @classmethod
    def from_config(
        cls, config: Config | ClientConfig, namespace: str = "", token: str | None = None
    ) -> PolarKVClient:
        """A client with the `[client]` settings of a config; with a whole Config, the
        token defaults to `security.token`."""
        return cls(namespace=namespace, **client_kwargs(config, token))

    @property
    def namespace(self) -> str:
        return self._client.namespace

    @property
    def chunk_tokens(self) -> int:
        return self._client.chunk_tokens

    @property
    def io_thread_id(self) -> int | None:
        """The native id of the thread every call runs on (to place it on CPUs)."""
        return self._thread.native_id

    @property
    def stats(self) -> ClientStats:
        return self._client.stats

    def _run(self, coro: Coroutine[Any, Any, T], miss: T, within: float | None = None) -> T:
        if self._closed:
            coro.close()
            raise ValueError("client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(within if within is not None else self._client.timeout + 5.0)
        except concurrent.futures.TimeoutError:
            # The async call bounds itself; this only fires if the client's own loop
            # thread is starved, or past a caller's own bound (`within`). Still a miss
            # for the caller, never an exception.
            future.cancel()
            self._client.stats.faults += 1
            self._client.stats.timeouts += 1
            return miss

    def keys(self, tokens: Any) -> list[str]:
        return self._client.keys(tokens)

    def check_shards(self) -> None:
        """AsyncPolarKVClient.check_shards: ShardOrderError if `manager_url` is out of
        shard order (as far as the managers that answer can tell)."""
        self._run(self._client.check_shards(), None)

    def store_kv(self, tokens: Any, chunks: Sequence[BufferLike]) -> int:
        return self._run(self._client.store_kv(tokens, chunks), 0)

    def load_kv(
        self, tokens: Any, out: Sequence[BufferLike] | None = None
    ) -> tuple[int, list[memoryview]]:
        return self._run(self._client.load_kv(tokens, out), (0, []))

    def lookup_kv(self, tokens: Any, within: float | None = None) -> int:
        """`within`: a hard bound in seconds for this call (a scheduler's loop); past it
        the call is cancelled and answers 0."""
        return self._run(self._client.lookup_kv(tokens), 0, within)

    def lookup_kv_tiers(self, tokens: Any, within: float | None = None) -> tuple[int, int]:
        """(tokens cached now, how many of them from the start are in memory); `within`
        as for lookup_kv (past it: (0, 0))."""
        return self._run(self._client.lookup_kv_tiers(tokens), (0, 0), within)

    def put(self, key: str, data: BufferLike) -> bool:
        return self._run(self._client.put(key, data), False)

    def get(self, key: str) -> bytes | None:
        return self._run(self._client.get(key), None)

    def lookup_keys(self, keys: Sequence[str]) -> int:
        return self._run(self._client.lookup_keys(keys), 0)

    def put_many(self, keys: Sequence[str], values: Sequence[BufferLike]) -> int:
        return self._run(self._client.put_many(keys, values), 0)

    def get_many(
        self, keys: Sequence[str], out: Sequence[BufferLike] | None = None
    ) -> list[memoryview]:
        return self._run(self._client.get_many(keys, out), [])

    def close(self) -> None:
        if self._closed:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(
                self._client.timeout + 5.0
            )
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            self._loop.close()

    def __enter__(self) -> PolarKVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn("PolarKVClient was not closed", ResourceWarning, stacklevel=1)
