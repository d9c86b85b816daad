"""What a web browser may make the manager do: the status page of its own shards, and
nothing for any other page the operator happens to open.

The threat is a page from anywhere, in the browser of someone who can reach the
manager (on loopback, its own machine). Three rules keep that page out:

- CORS answers only the manager's own shards (`manager.shard_urls`): a page from any
  of their origins may read the status endpoints of every shard (that is how one
  status page shows them all); every other origin gets no `Access-Control-Allow-Origin`,
  so its script cannot read a reply, and no preflight passes, so it cannot send a
  request with a header (a token, `Content-Type: application/json`) at all.
- Without any token configured nothing else would stop a page, so then every request
  must name the manager by address in `Host` (`localhost`, or an IP address literal:
  DNS rebinding needs a name the attacker controls that resolves to this host), and
  every POST must be `Content-Type: application/json`: a browser sends that
  cross-origin only after a preflight, which fails, so the form and text/plain POSTs a
  page can send without one are refused (415). POST is the one state-changing method a
  page can send without a preflight; DELETE (and PUT, PATCH) always get one.
- With a token the bearer header is the guard: a browser never adds it by itself.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Iterable

from aiohttp import web

from polarkv_lib.errors import AccessDenied, BadRequest

CORS_PATHS = frozenset({"/healthz", "/v1/stats", "/v1/nodes", "/v1/events"})
JSON = "application/json"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(url: str) -> str:
    """The browser's Origin for a URL: 'http://host:port', lower case, default port left out."""
    parts = urllib.parse.urlsplit(url)
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    port = parts.port
    return f"{scheme}://{host}" + ("" if port in (None, _DEFAULT_PORTS.get(scheme)) else f":{port}")


def names_this_host(host_header: str) -> bool:
    """A Host header that names the manager by address: localhost or an IP literal, any
    port. A DNS name (what a rebinding page's requests carry) does not."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1 : host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host, _, port = host.partition(":")
        if not port.isdigit():
            return False
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class BrowserGuard:
    def __init__(self, shard_urls: Iterable[str], open_manager: bool) -> None:
        self.origins = frozenset(origin_of(url) for url in shard_urls)
        self.open = open_manager  # no token of any kind configured

    def check(self, request: web.Request) -> None:
        """Refuse what only a foreign page would send to a manager without tokens."""
        if not self.open:
            return
        host = request.headers.get("Host")
        if host is not None and not names_this_host(host):  # browsers always send one
            raise AccessDenied(
                f"Host {host!r:.80} is not localhost or an IP address: without a token this "
                "manager answers only requests that name it by address (DNS rebinding)",
                403,
            )
        served = request.match_info.http_exception is None  # else 404/405 says it better
        if served and request.method == "POST" and request.content_type != JSON:
            raise BadRequest(
                f"POST needs Content-Type: {JSON} (got {request.content_type}): "
                "without a token that is what keeps web pages from sending it",
                415,
            )

    def add_routes(self, app: web.Application) -> None:
        for path in sorted(CORS_PATHS):
            app.router.add_route("OPTIONS", path, self.preflight)
        app.on_response_prepare.append(self._cors)

    async def preflight(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def _cors(self, request: web.Request, response: web.StreamResponse) -> None:
        if request.path not in CORS_PATHS or request.method not in ("GET", "OPTIONS"):
            return
        response.headers["Vary"] = "Origin"
        origin = request.headers.get("Origin", "")
        if origin.lower() in self.origins:
            response.headers.update(
                {
                    "Access-Control-Allow-Origin": origin,
                    "Access-Control-Allow-Methods": "GET",
                    "Access-Control-Allow-Headers": "Authorization",
                    "Access-Control-Max-Age": "600",
                }
            )

    def content_security_policy(self) -> str:
        """The status page's CSP: its script may connect to its own origin and to the
        manager's shards, nowhere else (the browser enforces it, whatever the URL says)."""
        connect = " ".join(["'self'", *sorted(self.origins)])
        return (
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
            f"connect-src {connect}; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        )
