"""JSON replies of the manager's HTTP API (every error is {"error": reason})."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(message: str, status: int) -> web.Response:
    return json_response({"error": message}, status)
