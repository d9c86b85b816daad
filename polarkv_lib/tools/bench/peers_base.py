"""What a system measured by `polarkv bench peers` provides, and PolarKV itself as one.

Every peer stores n objects of one size from the bench's source buffer and loads them
back into the caller's buffers, with conc callers and the batching of `limits.batches`,
and reports whether every byte it loaded equals the source (checked untimed, after the
timed part)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from polarkv_lib.tools.bench.limits import Buffers


class PeerUnavailable(Exception):
    """This peer cannot run here (not installed, no namespace); the message says why."""


class Peer:
    name = ""

    def store(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int]:
        """Seconds taken and objects stored, keys fresh for `tag`."""
        raise NotImplementedError

    def load(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int, bool]:
        """Seconds taken, objects that hit, whether every hit is byte-exact."""
        raise NotImplementedError

    def warm_up(self, bufs: Buffers, n: int, tags: Iterator[int], notes: list[str]) -> None:
        """Untimed: connect and allocate before the first timed round."""
        tag = next(tags)
        self.store(bufs, n, tag)
        self.load(bufs, n, tag)
        self.forget(n, tag)

    def forget(self, n: int, tag: int) -> None:
        """Untimed: drop a round's objects where the system allows it."""

    def close(self) -> None:
        pass


class PolarKVPeer(Peer):
    """An AsyncPolarKVClient over tcp or shm against the service the bench started (the
    data-plane bench's client side), run on an event loop of its own."""

    def __init__(self, manager_url: str, transport: str, conc: int, memory: int) -> None:
        from polarkv_lib.tools.bench.datapath import Ours

        self.name = f"polarkv-{transport}"
        self.transport = transport
        self.conc = conc
        self.memory = memory
        self._loop = asyncio.new_event_loop()
        self._ours = Ours(manager_url, transport, conc)

    def store(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int]:
        return self._loop.run_until_complete(self._ours.store(bufs, n, tag))

    def load(self, bufs: Buffers, n: int, tag: int) -> tuple[float, int, bool]:
        return self._loop.run_until_complete(self._ours.load(bufs, n, tag))

    def warm_up(self, bufs: Buffers, n: int, tags: Iterator[int], notes: list[str]) -> None:
        """For shm, touch the whole slab once (see the data-plane bench)."""
        from polarkv_lib.tools.bench.datapath import warm_up

        self._loop.run_until_complete(
            warm_up(self._ours, bufs, self.transport, self.conc, self.memory, tags, notes)
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.run_until_complete(self._ours.close())
        self._loop.close()
