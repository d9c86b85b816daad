"""A foreign web server for attacks through a browser: it records every request that
reaches it and answers as a willing accomplice would (any origin may read it, with any
header), so a test sees what a page would hand over if it were let."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    authorization: str


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def _answer(self, status: int, body: bytes = b"") -> None:
        self.server.seen.append(
            Seen(self.command, self.path, self.headers.get("Authorization", ""))
        )
        self.send_response(status)
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Access-Control-Allow-Headers", "Authorization")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_OPTIONS(self) -> None:
        self._answer(204)

    def do_GET(self) -> None:
        body = b'{"nodes": [], "events": [], "last_seq": 0, "shard_urls": []}'
        self._answer(200, body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    seen: list[Seen]


@contextmanager
def recorder() -> Iterator[tuple[str, list[Seen]]]:
    """(URL of the foreign server, the requests it has seen so far)."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, name="foreign-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
