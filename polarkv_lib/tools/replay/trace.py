"""Mooncake-format traces: one JSON object per line with `timestamp` (ms), `input_length`
and `output_length` (tokens) and `hash_ids` (one id per block of the input; equal ids
at equal positions after equal predecessors mean equal prefix blocks)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson


class TraceError(ValueError):
    """The trace file cannot be used; the message names the file and the line."""


@dataclass(frozen=True)
class Request:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def session(self, blocks: int) -> tuple[int, ...]:
        """What a router can see of the conversation: the first `blocks` block ids."""
        return self.hash_ids[:blocks]


def _field_int(obj: dict[str, object], name: str, where: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: `{name}` must be a non-negative integer, got {value!r:.40}")
    return value


def parse_line(line: bytes, where: str) -> Request:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    stamp = obj.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or stamp < 0:
        raise TraceError(
            f"{where}: `timestamp` must be a non-negative number of ms, got {stamp!r:.40}"
        )
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in ids
    ):
        raise TraceError(f"{where}: `hash_ids` must be a list of non-negative integers")
    return Request(
        float(stamp),
        _field_int(obj, "input_length", where),
        _field_int(obj, "output_length", where),
        tuple(ids),
    )


def load_trace(path: str, limit: int | None = None) -> list[Request]:
    """The first `limit` requests (all when None), in file order. Blank lines are skipped."""
    requests: list[Request] = []
    try:
        with open(path, "rb") as fh:
            for number, line in enumerate(fh, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if line.strip():
                    requests.append(parse_line(line, f"{path}:{number}"))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    if not requests:
        raise TraceError(f"{path}: no requests in the trace")
    return requests
