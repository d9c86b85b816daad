"""Who may call what on the manager's HTTP API, and the middleware every request passes.

Tokens (security.token, security.admin_token, security.tenants): node calls and DELETE
need the admin token when one is set; everything else needs a client (tenant) token or
the admin's. The tenant a request acts for is kept on the request (TENANT; None: the
admin, who sees every tenant). Refusals raise errors.AccessDenied (401 without a valid
token, 403 with a valid one that may not do this); the middleware turns every error
into {"error": reason} with its status and times each endpoint.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from polarkv_lib.errors import AccessDenied, BadRequest
from polarkv_lib.manager.browser import BrowserGuard
from polarkv_lib.manager.metrics import ManagerMetrics
from polarkv_lib.manager.responses import error_response
from polarkv_lib.manager.ui import is_public
from polarkv_lib.tenancy import DEFAULT, Tenants

log = structlog.get_logger("polarkv.manager")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TENANT: web.RequestKey[str | None] = web.RequestKey("tenant")  # whose token; None: the admin's


class Auth:
    def __init__(self, token: str, admin_token: str, tenants: Tenants) -> None:
        self._token = token
        self._admin_token = admin_token
        self.tenants = tenants
        self.open = not (token or admin_token or tenants.enabled)  # no token of any kind

    def authorize(self, request: web.Request) -> None:
        """Check the bearer token; note whose it is (request[TENANT], None: the admin)."""
        request[TENANT] = DEFAULT
        if request.path == "/healthz" or is_public(request) or self.open:
            return
        header = request.headers.get("Authorization", "")
        presented = header[7:] if header.startswith("Bearer ") else ""
        admin_write = request.method == "DELETE" or request.path.startswith("/v1/nodes/")
        if admin_write and self._admin_token:
            if not presented:
                raise AccessDenied("missing bearer token", 401)
            if not secrets.compare_digest(presented, self._admin_token):
                raise AccessDenied("this operation needs the admin token", 403)
            request[TENANT] = None
            return
        if not presented:
            raise AccessDenied("missing bearer token", 401)
        if self._admin_token and secrets.compare_digest(presented, self._admin_token):
            request[TENANT] = None
            return
        tenant = self.tenants.of(presented)
        if tenant is None:
            raise AccessDenied("wrong bearer token", 401)
        request[TENANT] = tenant


def middleware(auth: Auth, browser: BrowserGuard, metrics: ManagerMetrics) -> Middleware:
    """Refuse what only a foreign web page sends (manager/browser.py), authorize, run the
    handler, turn errors into JSON replies, time the endpoint."""

    @web.middleware
    async def handle(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        try:
            browser.check(request)
            auth.authorize(request)
            return await handler(request)
        except (AccessDenied, BadRequest) as exc:
            return error_response(str(exc), exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            reason = (
                exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
            )
            response = error_response(reason, exc.status)
            if "Allow" in exc.headers:  # 405 must say what is allowed (RFC 9110)
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except Exception:
            log.exception("unhandled error", endpoint=endpoint)
            return error_response("internal error", 500)
        finally:
            metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)

    return handle
