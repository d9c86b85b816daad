"""The error tree, the CLI's exit codes, and the translation of third-party errors.

    PolarKVError
    ├── ConfigError          invalid configuration; the message names the key
    ├── BadRequest           input a caller must fix (the API answers 4xx)
    ├── AccessDenied         a token or grant was refused (401 / 403)
    ├── OperationTimeout     a bounded wait ran out
    ├── NetworkError         a peer could not be reached or dropped the connection
    ├── ProtocolError        a peer sent something outside the wire format
    ├── IntegrityError       bytes that do not match their checksum
    └── DiskFailure          an offload or reload did not happen, with a `Failure` reason

The client library never lets any of these escape its cache operations: an
infrastructure fault is a cache miss (DESIGN §7). They exist so the layers below the
client can say *why* something failed, and so logs and metrics can count it by kind.
Each boundary that talks to a third-party library translates its errors into this tree
where it catches them, so nothing foreign travels further up: the blocking admin client
(client/admin.py) with `map_exceptions` and one table of urllib's errors; the control
client (client/control.py, aiohttp) with `except` clauses around its one request
method, where a retry of a closed pooled connection and the circuit breaker need the
exception in hand; the transports (transport/, sockets and mmap) and the disk store
(node/disk.py, files) at each system call, where the message names the peer, the
deadline or the file. `map_exceptions` is for a boundary whose translation is a table.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from enum import IntEnum, StrEnum
from typing import NoReturn


class ExitCode(IntEnum):
    """What `polarkv` and its tools exit with; scripts and CI tell failures apart by it."""

    OK = 0
    CONFIG = 2  # bad flags, config or input: nothing was started or changed
    RUNTIME = 3  # the work ran and failed: a peer unreachable or refusing, or wrong bytes


def fail(prefix: str, message: str, code: ExitCode) -> NoReturn:
    """The CLI's answer to bad input or a failed run: one line on stderr, named after the
    command (`polarkv replay: ...`), and a named exit code."""
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)
    sys.exit(int(code))


class PolarKVError(Exception):
    """Base of every PolarKV error."""


class ConfigError(PolarKVError):
    """Invalid configuration; the message names the key."""


class OperationTimeout(PolarKVError):
    """A bounded wait ran out."""


class NetworkError(PolarKVError):
    """A peer could not be reached or dropped the connection."""


class ProtocolError(PolarKVError):
    """A peer sent something that does not follow the wire format."""


class IntegrityError(PolarKVError):
    """Bytes that do not match their checksum: a miss, never served."""


class BadRequest(PolarKVError):
    """Input that a caller must fix; the API answers it with a 4xx."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class AccessDenied(PolarKVError):
    """A grant or token was refused: 401 when no valid token was shown, 403 when the
    token is valid but not allowed to do this."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


class Failure(StrEnum):
    """Why an offload or reload did not happen; counted by reason."""

    DISK_FULL = "disk_full"
    IO_ERROR = "io_error"
    MISSING = "missing"
    TRUNCATED = "truncated"
    BAD_HEADER = "bad_header"
    CHECKSUM = "checksum"
    WRONG_NODE = "wrong_node"  # an order naming another node's buffer: refused, not an I/O fault


class DiskFailure(PolarKVError):
    def __init__(self, reason: Failure, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason


ErrorMap = Mapping[type[BaseException], type[PolarKVError]]


@contextlib.contextmanager
def map_exceptions(mapping: ErrorMap, where: str = "") -> Iterator[None]:
    """Re-raise a third-party exception as the PolarKV error it maps to (the first
    matching entry, in order); PolarKV errors and anything unmapped pass unchanged."""
    try:
        yield
    except PolarKVError:
        raise
    except Exception as exc:
        for source, target in mapping.items():
            if isinstance(exc, source):
                detail = str(exc) or type(exc).__name__
                raise target(f"{where}: {detail}" if where else detail) from exc
        raise
