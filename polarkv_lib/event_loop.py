"""Which event loop a PolarKV process runs on.

uvloop (libuv) is the common loop for asyncio servers; `runtime.event_loop = "auto"`
takes it when it is installed (the `fast` extra) and the standard loop otherwise, so a
plain install keeps working. docs/BENCHMARKS.md ("Event loop") has what it changes."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from polarkv_lib.errors import ConfigError

T = TypeVar("T")


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for `choice` (auto, uvloop, asyncio); None is the standard loop."""
    if choice == "asyncio" or (choice == "auto" and not uvloop_installed()):
        return None
    try:
        import uvloop
    except ImportError:
        raise ConfigError(
            "runtime.event_loop: uvloop is not installed (pip install 'polarkv[fast]')"
        ) from None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def running() -> str:
    """The name of the loop this coroutine runs on, as the ready file reports it."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """asyncio.run on the loop `choice` names."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
