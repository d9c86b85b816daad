"""The error tree. Third-party exceptions are translated into these at module boundaries.

The client library never lets any of these escape its cache operations: an
infrastructure fault is a cache miss (DESIGN §7). They exist so the layers below the
client can say *why* something failed, and so logs and metrics can count it by kind.
"""

from __future__ import annotations


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


class AccessDenied(PolarKVError):
    """A grant or token was refused."""


class BadRequest(PolarKVError):
    """Input that a caller must fix; the API answers it with a 4xx."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
