"""Progress for long CLI work: a bar on a terminal, nothing (or sparse JSON log lines)
elsewhere.

Every long task (benchmarks, replay, a disk scan at start-up, a metadata restore) reports
through `progress(...)` so that a person at a terminal sees it move and a pipe, a CI log
or a `--log-format json` process is not filled with carriage returns.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

import structlog

log = structlog.get_logger("polarkv.progress")

# Off a terminal, one log line at most this often (seconds) keeps long runs visible in
# JSON logs without flooding them.
LOG_EVERY_S = 10.0


class Progress:
    """A counter that a task advances; renders a bar on a terminal or logs sparsely."""

    def __init__(
        self, total: int | None, desc: str, unit: str, stream: TextIO, tty: bool, log_lines: bool
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.done = 0
        self._stream = stream
        self._tty = tty
        self._log_lines = log_lines
        self._bar: object | None = None
        self._last_log = time.monotonic()
        if tty:
            try:  # imported here: only terminals pay for it; tqdm comes with the bench extra
                from tqdm import tqdm
            except ImportError:  # a daemon installed without extras: no bar, still counts
                return
            self._bar = tqdm(
                total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True, leave=True
            )

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)  # type: ignore[attr-defined]
        elif self._log_lines and time.monotonic() - self._last_log >= LOG_EVERY_S:
            self._last_log = time.monotonic()
            log.info("progress", task=self.desc, done=self.done, total=self.total, unit=self.unit)

    def set_postfix(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text)  # type: ignore[attr-defined]

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()  # type: ignore[attr-defined]
        elif self._log_lines:
            log.info(
                "progress_done", task=self.desc, done=self.done, total=self.total, unit=self.unit
            )


@contextmanager
def progress(
    total: int | None,
    desc: str,
    unit: str = "it",
    *,
    stream: TextIO | None = None,
    log_lines: bool = False,
) -> Iterator[Progress]:
    """Yield a Progress for `total` units of `desc`. A bar when `stream` (stderr by
    default) is a terminal; otherwise silent, or one structured log line every
    LOG_EVERY_S seconds and one at the end when `log_lines` is set (for services whose
    logs are read by machines)."""
    out = stream if stream is not None else sys.stderr
    bar = Progress(total, desc, unit, out, tty=out.isatty(), log_lines=log_lines)
    try:
        yield bar
    finally:
        bar.close()
