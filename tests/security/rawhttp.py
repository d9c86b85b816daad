"""HTTP/1.1 by hand, as an attacker writes it: any Host, any header, any body, and a
socket the test keeps (to stall on, or to see closed)."""

from __future__ import annotations

import socket
import urllib.parse
from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> object:
        return orjson.loads(self.body)


def address(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def request_bytes(
    method: str, url: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> bytes:
    parts = urllib.parse.urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    given = {"Host": parts.netloc, **(headers or {})}
    if body or method in ("POST", "PUT"):
        given.setdefault("Content-Length", str(len(body)))
    head = "".join(f"{k}: {v}\r\n" for k, v in given.items())
    return f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode() + body


def read_reply(sock: socket.socket) -> Reply:
    """One response (Content-Length framed, as the manager sends them)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a whole response head: {data[:200]!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return Reply(int(lines[0].split()[1]), headers, rest[:length])


def send(
    method: str,
    url: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    timeout: float = 5.0,
) -> Reply:
    """One request on a fresh connection; its reply."""
    with socket.create_connection(address(url), timeout=timeout) as sock:
        sock.sendall(request_bytes(method, url, headers, body))
        return read_reply(sock)


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds (anything it sends before
    is read and dropped)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
