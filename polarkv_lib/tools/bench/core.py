"""What every benchmark shares: argument parsing, rows of paired measurements, the
table and JSON output, and the run wrapper that turns failures into exit codes.

A row holds two lists of GB/s (or any rate), one value per round: ours and the baseline
measured right beside it. The ratio is the median of the per-round ratios, because the
machines these run on are usually shared: a neighbour's load comes and goes, and a pair
measured back to back mostly sees the same load where the two best values may not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import orjson

from polarkv_lib import errors
from polarkv_lib.config import parse_size
from polarkv_lib.errors import ExitCode, PolarKVError

MiB = 1024**2
GB = 1e9  # GB/s columns are 10^9 bytes/s


class BenchError(Exception):
    """A benchmark could not run or measure; the message says why."""


class BadArguments(BenchError):
    """The bench was asked for something it cannot do; nothing was started."""


# -- arguments --------------------------------------------------------------------------


def parse_list(text: str, what: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise BadArguments(f"{what}: give at least one value")
    return items


def parse_sizes(text: str, what: str) -> list[int]:
    return [parse_bytes(s, what) for s in parse_list(text, what)]


def parse_bytes(text: str, what: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise BadArguments(f"{what}: {exc}") from None


def parse_ints(text: str, what: str, low: int, high: int) -> list[int]:
    try:
        values = [int(v) for v in parse_list(text, what)]
    except ValueError:
        raise BadArguments(f"{what}: not a list of integers: {text!r}") from None
    if any(v < low or v > high for v in values):
        raise BadArguments(f"{what}: between {low} and {high}")
    return values


def parse_choices(text: str, what: str, choices: Sequence[str]) -> list[str]:
    names = parse_list(text, what)
    if any(n not in choices for n in names):
        raise BadArguments(f"{what}: choose from {', '.join(choices)}, got {text!r}")
    return names


# -- rows -------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Pairs:
    """Per-round values of ours and of the baseline beside it, and notes. Benchmarks
    subclass it with their own label fields (transport, size, op, ...)."""

    ours: list[float] = field(default_factory=list)
    base: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, ours: float, base: float) -> None:
        self.ours.append(ours)
        self.base.append(base)

    def ratio(self) -> float:
        """The median over rounds of ours / baseline, each pair measured back to back."""
        pairs = [o / b for o, b in zip(self.ours, self.base, strict=True) if b > 0]
        return statistics.median(pairs) if pairs else 0.0

    def best(self) -> tuple[float, float]:
        """Each side's best round."""
        return max(self.ours, default=0.0), max(self.base, default=0.0)

    def note_text(self) -> str:
        return "; ".join(dict.fromkeys(self.notes))

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ratio"] = round(self.ratio(), 4)
        out["ours_best"], out["base_best"] = self.best()
        return out


def size_text(size: int) -> str:
    if size % MiB == 0:
        return f"{size // MiB}MiB"
    return f"{size // 1024}KiB" if size % 1024 == 0 else f"{size}B"


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else 0.0


def goal_text(ratio: float, goal: float | None) -> str:
    if goal is None:
        return ""
    return f">={goal:.1f} {'met' if round(ratio, 2) >= goal else 'MISSED'}"  # as shown


# -- output -----------------------------------------------------------------------------


def markdown_table(lines: Sequence[Sequence[str]]) -> str:
    """lines[0] is the header; columns padded so the table also reads as plain text."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for k, line in enumerate(lines):
        out.append(
            "| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |"
        )
        if k == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def machine() -> dict[str, Any]:
    """What the numbers were measured on, for the JSON and the header line."""
    return {
        "cpus": os.cpu_count(),
        "linux": platform.release(),
        "python": platform.python_version(),
        "loadavg": loadavg(),
    }


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "?"


def write_json(
    path: str,
    bench: str,
    params: dict[str, Any],
    rows: Sequence[Pairs],
    extra: dict[str, Any] | None = None,
) -> None:
    """One JSON document per run: what was asked, where, and every row with its rounds."""
    doc = {
        "bench": bench,
        "params": params,
        "machine": machine(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": [r.to_json() for r in rows],
        **(extra or {}),
    }
    with open(path, "wb") as fh:
        fh.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


# -- running ----------------------------------------------------------------------------


def fail(name: str, message: str, code: ExitCode) -> NoReturn:
    errors.fail(f"bench {name}", message, code)


def guarded(name: str, work: Callable[[], bool]) -> None:
    """Run one bench: BadArguments exit CONFIG, any other BenchError RUNTIME, and a run
    that returns False (a wrong byte, a failed measurement) RUNTIME as well."""
    from polarkv_lib import logs

    try:
        logs.configure("console", "warning")  # a bench process logs warnings only
        ok = work()
    except BadArguments as exc:
        fail(name, str(exc), ExitCode.CONFIG)
    except BenchError as exc:
        fail(name, str(exc), ExitCode.RUNTIME)
    except PolarKVError as exc:  # a service refused or went away mid-run
        fail(name, f"{type(exc).__name__}: {exc}", ExitCode.RUNTIME)
    if not ok:
        fail(name, "failed (see the table's notes)", ExitCode.RUNTIME)


def machine_text() -> str:
    m = machine()
    return (
        f"{m['cpus']} CPUs, Linux {m['linux']}, Python {m['python']}, load average {m['loadavg']}"
    )


@contextlib.contextmanager
def workdir(keep: str, prefix: str) -> Iterator[str]:
    """`keep` (created, and kept afterwards) if given, else a temporary directory that
    is removed at the end: where a benchmark's servers keep their logs and models."""
    if keep:
        os.makedirs(keep, exist_ok=True)
        yield keep
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield tmp
