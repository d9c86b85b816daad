"""structlog set-up: console lines for a terminal, one JSON object per line for machines.

Everything a process prints goes through one renderer: stdlib loggers (aiohttp's access
and server logs, asyncio's "Task exception was never retrieved", warnings) are routed
through structlog's formatter too, so with `--log-format json` every line parses.

Event names are constants (`Events`), not f-strings: a log search or an alert matches
one fixed string, and the details travel as fields. `Events` is the one vocabulary of
events: every process's log lines are named here, and the operator's feed of recent
events (manager/events.py `Kind`, `GET /v1/events`) records a chosen few of the
manager's under the same names (`LOG_EVENTS` there maps each kind to its line). `RateLimiter` turns a flood of one
repeated error (an accept loop past the fd limit, a manager that is down) into one line
per interval with a count.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

import structlog


class Events:
    """Event names of the log lines of every role, the runner and the data plane."""

    READY = "polarkv ready"
    SHUTTING_DOWN = "shutting down"
    SHUTDOWN_STEP_SLOW = "shutdown step ran past its bound"
    SLAB_SERVING = "slab serving"
    SLAB_STOPPED = "slab stopped"
    SLAB_REGISTERED = "slab registered"
    SLAB_FORGOTTEN = "manager forgot this node; registering again"
    REGISTRATION_REFUSED = "registration refused"
    SLAB_MISCONFIGURED = "slab stopping: its configuration is wrong"
    NO_GRANT_KEY = "manager sent no grant key; set security.grant_key on both sides"
    GRANT_KEY_CHANGED = "manager has a new grant key; grants are checked with it from now on"
    MANAGER_UNREACHABLE = "manager unreachable"
    ADOPTION_REFUSED = "file adoption refused"
    DISK_SCANNED = "disk scanned"
    DISK_ADOPTED = "disk files adopted"
    ORDER_FAILED = "tier order failed"
    ORDER_CRASHED = "tier order crashed"
    ORDER_POLL_FAILED = "order poll failed"
    REPORT_FAILED = "result report failed"
    ACCEPT_FAILED = "data-plane accept failed"
    CONNECTION_EVICTED = "idle data connection closed to make room"
    CONNECTION_REFUSED = "data connection refused"
    CONNECTION_CLOSED = "data connection closed"
    REPEATED = "repeated"
    # the manager's; those of the operator's feed first (manager/events.py LOG_EVENTS)
    NODE_JOINED = "node joined"
    NODE_LEFT = "node left"
    NODE_DIED = "node died"
    NODE_DRAINING = "node draining"
    CHECKSUM_FAILURE = "checksum mismatch confirmed; entry dropped"
    TIER_FAILURE = "tier order failed on the node"
    STORE_RETRYING = "metadata write-behind failed; will retry"
    STORE_CAUGHT_UP = "metadata write-behind caught up"
    RESTORE_FINISHED = "metadata restore finished"


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class _StderrPrinter:
    """structlog's output: one line to whatever `sys.stderr` is at the time of the call.

    Binding the stream once, at `configure()`, breaks as soon as that stream is replaced
    and closed (a CLI runner or a test's captured stderr): every later line would raise
    inside the caller."""

    def __init__(self, *_args: Any) -> None:
        self._lock = threading.Lock()

    def msg(self, message: str) -> None:
        with self._lock:
            print(message, file=sys.stderr, flush=True)

    debug = info = warning = warn = error = critical = exception = fatal = log = msg


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The stdlib side of the same rule: write to the current `sys.stderr`."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure(fmt: str = "console", level: str = "info") -> None:
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=_StderrPrinter,
        cache_logger_on_first_use=False,
    )
    # The stdlib's loggers (aiohttp, asyncio, warnings) render through the same chain.
    handler = _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                *shared,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ExtraAdder(),
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    handler.addFilter(_RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[level])
    logging.captureWarnings(True)


class HoldBack:
    """Per key, admit one occurrence per `interval` seconds and count the rest."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._lock = threading.Lock()  # the data server logs from many threads
        self._state: dict[object, tuple[float, int]] = {}  # key -> (last admitted, held back)

    def admit(self, key: object) -> int | None:
        """None: hold this one back. Else admitted, with how many were held back since."""
        now = time.monotonic()
        with self._lock:
            last, held = self._state.get(key, (-self.interval - 1.0, 0))
            if now - last < self.interval:
                self._state[key] = (last, held + 1)
                return None
            self._state[key] = (now, 0)
            return held

    def clear(self, key: object) -> None:
        with self._lock:
            self._state.pop(key, None)


class RateLimiter:
    """At most one line per `interval` seconds per event; the next line that passes
    carries `repeated=N`, the number held back meanwhile."""

    def __init__(self, logger: Any, interval: float) -> None:
        self._log = logger
        self._hold = HoldBack(interval)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(self._log.warning, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(self._log.error, event, fields)

    def _emit(self, method: Any, event: str, fields: dict[str, Any]) -> None:
        held = self._hold.admit(event)
        if held is not None:
            method(event, **({Events.REPEATED: held} if held else {}), **fields)

    def clear(self, event: str) -> None:
        """The condition ended: the next occurrence is logged at once."""
        self._hold.clear(event)


class _RepeatFilter(logging.Filter):
    """The same stdlib warning or error (e.g. asyncio's accept error past the fd limit)
    from the same place at most once per second, with the count held back since."""

    def __init__(self) -> None:
        super().__init__()
        self._hold = HoldBack(1.0)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:  # e.g. access lines: all distinct, all kept
            return True
        held = self._hold.admit((record.name, record.pathname, record.lineno))
        if held:
            record.repeated = held  # rendered as a field by ExtraAdder
        return held is not None
