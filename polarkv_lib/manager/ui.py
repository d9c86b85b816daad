"""The operator's routes of the manager: the status page, the events feed, and drain.

`/` and `/static/*` are the page itself (HTML, one script, one stylesheet, read from the
package at start): they carry no data, so they are served without a token; the script
asks for the token once, keeps it in the tab's sessionStorage and sends it as a header,
so every number still passes the same token rules as the admin API.

With several shards the page, loaded from any one of them, reads every shard itself.
It learns which from its own origin (`/healthz`'s `shard_urls`, the manager's
`manager.shard_urls`) and talks to those and to its origin only: a `?shards=` in its
address is refused, not followed, so nobody can hand an operator a link that sends the
token they type somewhere else, and the page's Content-Security-Policy says the same to
the browser (manager/browser.py: CORS for those shards' origins alone).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

import orjson
import structlog
from aiohttp import web

from polarkv_lib.errors import BadRequest
from polarkv_lib.logs import Events
from polarkv_lib.manager.browser import CORS_PATHS, BrowserGuard
from polarkv_lib.manager.core import Metadata
from polarkv_lib.manager.events import CAPACITY, EventRing, Kind
from polarkv_lib.wire import control

log = structlog.get_logger("polarkv.manager")

CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def _load_static() -> dict[str, tuple[bytes, str]]:
    folder = resources.files("polarkv_lib.manager") / "static"
    files: dict[str, tuple[bytes, str]] = {}
    for item in folder.iterdir():
        suffix = "." + item.name.rpartition(".")[2]
        if suffix in CONTENT_TYPES:
            files[item.name] = (item.read_bytes(), CONTENT_TYPES[suffix])
    return files


def is_public(request: web.Request) -> bool:
    """Requests that need no token: the page's own files and CORS preflights."""
    return (request.method == "OPTIONS" and request.path in CORS_PATHS) or (
        request.method in ("GET", "HEAD")
        and (request.path == "/" or request.path.startswith("/static/"))
    )


class OperatorRoutes:
    def __init__(
        self,
        events: EventRing,
        meta: Metadata,
        kick: Callable[[], None],
        browser: BrowserGuard,
        viewer: Callable[[web.Request], str | None],
    ) -> None:
        self.events = events
        self.meta = meta
        self._kick = kick  # plan tiering and wake the disk roles
        self._browser = browser
        self._viewer = viewer  # the tenant a request acts for; None: the admin (auth.py)
        self._files = _load_static()

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/", self.index)
        r.add_get("/static/{name}", self.static)
        r.add_get("/v1/events", self.recent_events)
        r.add_post("/v1/nodes/{node_id}/drain", self.drain)  # /v1/nodes/*: the admin token
        self._browser.add_routes(app)  # CORS for the other shards' pages

    def _file(self, name: str) -> web.Response:
        found = self._files.get(name)
        if found is None:
            raise web.HTTPNotFound(text="no such file")
        body, ctype = found
        # no-cache: a new version of the manager serves its own page at once
        return web.Response(
            body=body,
            content_type=ctype,
            charset="utf-8",
            headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"},
        )

    async def index(self, request: web.Request) -> web.Response:
        page = self._file("index.html")
        page.headers["Content-Security-Policy"] = self._browser.content_security_policy()
        page.headers["Referrer-Policy"] = "no-referrer"
        return page

    async def static(self, request: web.Request) -> web.Response:
        return self._file(request.match_info["name"])

    async def recent_events(self, request: web.Request) -> web.Response:
        """`?since=SEQ` (events after it) and `?limit=N` (the last N of them)."""
        try:
            since = int(request.query.get("since", "0"))
            limit = int(request.query.get("limit", str(CAPACITY)))
        except ValueError:
            raise BadRequest("since and limit are integers") from None
        if since < 0 or not 0 < limit <= CAPACITY:
            raise BadRequest(f"since must be >= 0 and limit in 1..{CAPACITY}")
        # the admin sees every event; a tenant the nodes' and its own entries' (events.py)
        viewer = self._viewer(request)
        events = self.events.since(since, limit, viewer or "", admin=viewer is None)
        # a tenant learns the sequence numbers of what it may see, no others
        last = self.events.last_seq
        if viewer is not None:
            last = events[-1]["seq"] if events else min(since, last)
        body = {"events": events, "last_seq": last}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def drain(self, request: web.Request) -> web.Response:
        """Start draining a node (see manager/drain.py); answers where it stands. The body
        is `{}`: a JSON body, like every POST's, so a web page cannot send one."""
        if control.parse_body(await request.read()):
            raise BadRequest("drain takes an empty JSON object, {}")
        node_id = request.match_info["node_id"]
        node = self.meta.nodes.get(node_id)
        first = node is not None and node.alive and not node.draining
        view = self.meta.drain(node_id)
        if view is None:
            raise BadRequest("no such live node", 404)
        if first:
            log.info(Events.NODE_DRAINING, node=node_id, keys_memory=view["keys_memory"])
            self.events.add(Kind.NODE_DRAINING, node_id, "node draining (operator)")
        self._kick()
        return web.Response(body=orjson.dumps(view), content_type="application/json")
