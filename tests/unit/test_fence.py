"""The slab's fence (polarkv_lib/node/fence.py): no grant touches space a newer entry holds."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from polarkv_lib.client import checksum
from polarkv_lib.errors import AccessDenied, DiskFailure
from polarkv_lib.node.disk import DiskStore
from polarkv_lib.node.disk_role import DiskRole
from polarkv_lib.node.fence import PAGE, Fence
from polarkv_lib.wire.orders import Order, TierOp

KEY = "ab" * 16


def test_a_write_claims_its_pages_for_its_generation() -> None:
    fence = Fence(16 * PAGE)
    fence.leave(fence.enter(0, 4 * PAGE, gen=10, claim=True))
    fence.leave(fence.enter(0, 4 * PAGE, gen=10, claim=False))  # its own reader
    fence.leave(fence.enter(0, PAGE, gen=11, claim=False))  # a newer entry's, not written yet
    fence.leave(fence.enter(2 * PAGE, 4 * PAGE, gen=12, claim=True))  # a newer writer overlaps
    with pytest.raises(AccessDenied):
        fence.enter(0, 4 * PAGE, gen=10, claim=False)  # the old reader: a page is gone
    with pytest.raises(AccessDenied):
        fence.enter(3 * PAGE, 10, gen=11, claim=True)  # an older writer, even one byte
    fence.leave(fence.enter(0, 2 * PAGE, gen=10, claim=False))  # what is still its own
    fence.leave(fence.enter(6 * PAGE, 2 * PAGE, gen=1, claim=False))  # never claimed pages
    assert fence.refused == 2


def test_a_claim_cuts_older_uses_of_its_pages_short() -> None:
    fence = Fence(8 * PAGE)
    fence.leave(fence.enter(0, PAGE, gen=5, claim=True))
    aborted = threading.Event()
    stale = fence.enter(0, PAGE, gen=5, claim=False, abort=aborted.set)  # a slow read in flight
    other = fence.enter(
        4 * PAGE, PAGE, gen=1, claim=False, abort=lambda: pytest.fail("not overlapping")
    )

    def reader_notices() -> None:
        assert aborted.wait(5)
        time.sleep(0.05)
        fence.leave(stale)

    t = threading.Thread(target=reader_notices)
    t.start()
    started = time.monotonic()
    token = fence.enter(0, PAGE, gen=6, claim=True)  # returns once the stale read let go
    assert aborted.is_set() and time.monotonic() - started >= 0.05
    t.join(5)
    fence.leave(token)
    fence.leave(other)
    assert fence.aborted == 1


def test_a_claim_gives_up_on_a_use_that_never_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("polarkv_lib.node.fence.ABORT_WAIT", 0.1)
    fence = Fence(PAGE)
    fence.enter(0, PAGE, gen=1, claim=False)  # ignores its abort
    with pytest.raises(AccessDenied):
        fence.enter(0, PAGE, gen=2, claim=True)
    with pytest.raises(AccessDenied):  # the claim stands: the old generation is out
        fence.enter(0, PAGE, gen=1, claim=False)


def test_a_reload_claims_its_extent_before_the_bytes_land(tmp_path: Path) -> None:
    """The disk role writes into memory without a grant: it claims the extent for the
    entry's reload generation, so the previous occupant's kept grants stop working."""
    buffer = memoryview(bytearray(8 * PAGE))
    fence = Fence(len(buffer))
    store = DiskStore((str(tmp_path),), 1 << 20, o_direct=False)
    payload = os.urandom(PAGE)
    buffer[:PAGE] = payload
    store.offload(KEY, buffer[:PAGE], PAGE, checksum(payload))
    fence.leave(fence.enter(0, PAGE, gen=7, claim=True))  # the previous occupant wrote here
    role = DiskRole(store, buffer, "n1", 1, fence)
    order = Order(TierOp.RELOAD, KEY, 9, "n1", 0, PAGE, PAGE, checksum(payload))
    role._reload(order, buffer[:PAGE])
    assert bytes(buffer[:PAGE]) == payload
    fence.leave(fence.enter(0, PAGE, gen=9, claim=False))  # the reloaded entry's readers
    with pytest.raises(AccessDenied):
        fence.enter(0, PAGE, gen=7, claim=False)  # the previous occupant's kept grant
    stale = Order(TierOp.RELOAD, KEY, 8, "n1", 0, PAGE, PAGE, checksum(payload))
    with pytest.raises(DiskFailure):  # an older reload never lands over a newer claim
        role._reload(stale, buffer[:PAGE])
