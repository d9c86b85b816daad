"""AdminClient: a small blocking client of the manager's HTTP API, for the CLI, the tools
and the tests — no event loop, the standard library only.

`request` answers every HTTP status as (status, body) for callers that look at the
status themselves (tests of bad input); the named calls raise the error tree's classes,
by the same mapping as the asynchronous ControlClient (`reply_error`).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import orjson

from polarkv_lib.client.control import reply_error
from polarkv_lib.errors import NetworkError, OperationTimeout, ProtocolError, map_exceptions

DEFAULT_TIMEOUT = 5.0
# urllib's errors at this boundary, most specific first (a timeout is also an OSError).
_URLLIB_ERRORS = {
    TimeoutError: OperationTimeout,
    urllib.error.URLError: NetworkError,
    OSError: NetworkError,
}


def _send(req: urllib.request.Request, timeout: float) -> tuple[int, bytes, str]:
    """(status, body, content type) of any HTTP answer, error statuses included."""
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:  # an answer, not a failure
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")
    except urllib.error.URLError as exc:  # unwrap, so a timeout maps as one
        if isinstance(exc.reason, BaseException):
            raise exc.reason from None
        raise


class AdminClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        admin_token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.base = url.rstrip("/")
        self.token = token or None
        self.admin_token = admin_token or None  # for admin writes; the token otherwise
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        raw: bytes | None = None,
        token: str | None = None,
        timeout: float | None = None,
    ) -> tuple[int, Any]:
        """One request; (status, parsed JSON or text). Only an unreachable or silent
        manager raises (NetworkError, OperationTimeout)."""
        data = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        bearer = token if token is not None else self.token
        if bearer:
            req.add_header("Authorization", f"Bearer {bearer}")
        with map_exceptions(
            _URLLIB_ERRORS, f"cannot reach the manager at {self.base} ({method} {path})"
        ):
            status, payload, ctype = _send(req, timeout or self.timeout)
        if "json" in ctype:
            try:
                return status, orjson.loads(payload)
            except orjson.JSONDecodeError:
                raise ProtocolError(f"the manager sent broken JSON for {path}") from None
        return status, payload.decode(errors="replace")

    def call(self, method: str, path: str, body: Any = None, admin: bool = False) -> Any:
        """One request whose failure raises: the parsed JSON (or the text of /metrics)."""
        token = self.admin_token if admin and self.admin_token else self.token
        status, reply = self.request(method, path, body, token=token)
        if isinstance(reply, str):
            if status < 400:
                return reply
            reply = {"error": reply.strip()[:200]}
        error = reply_error(status, reply, f"{method} {path}")
        if error is not None:
            raise error
        return reply

    # -- the admin API -----------------------------------------------------------------

    def healthz(self) -> dict[str, Any]:
        return dict(self.call("GET", "/healthz"))

    def wait_flushed(self, timeout: float = 10.0, poll: float = 0.02) -> None:
        """Return once everything committed before the call is in the metadata store: a
        write-behind round that began after it has been written (docs/API.md, /healthz).
        OperationTimeout if none is within `timeout` (the store keeps failing)."""
        taken = int(self.healthz()["metadata_taken_seq"])
        deadline = time.monotonic() + timeout
        while int(self.healthz()["metadata_flushed_seq"]) <= taken:
            if time.monotonic() > deadline:
                raise OperationTimeout(f"{self.base}: no metadata flush within {timeout:g}s")
            time.sleep(poll)

    def stats(self) -> dict[str, Any]:
        return dict(self.call("GET", "/v1/stats"))

    def nodes(self) -> list[dict[str, Any]]:
        return list(self.call("GET", "/v1/nodes")["nodes"])

    def metrics(self) -> str:
        return str(self.call("GET", "/metrics"))

    def key(self, key: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/v1/keys/{key}"))

    def delete(self, key: str) -> dict[str, Any]:
        return dict(self.call("DELETE", f"/v1/keys/{key}", admin=True))

    def events(self, since: int = 0) -> dict[str, Any]:
        return dict(self.call("GET", f"/v1/events?since={since}"))

    def drain(self, node_id: str) -> dict[str, Any]:
        return dict(self.call("POST", f"/v1/nodes/{node_id}/drain", {}, admin=True))
