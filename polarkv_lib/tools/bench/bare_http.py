"""The HTTP stack's limit for `polarkv bench manager`: an aiohttp server whose one
handler reads the request body and answers with a ready-made body of the size the
client asks for (`?reply=BYTES`): the manager's work without the manager.

    python -m polarkv_lib.tools.bench.bare_http READY_FILE     (started by the bench)
"""

from __future__ import annotations

import asyncio
import os
import sys

from aiohttp import web

from polarkv_lib import event_loop


async def _serve(ready_file: str) -> None:
    replies: dict[int, bytes] = {}

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        size = int(request.query.get("reply", "2"))
        body = replies.get(size)
        if body is None:  # JSON of exactly `size` bytes, made once
            body = replies[size] = b'{"x":"' + b"a" * max(0, size - 8) + b'"}'
        return web.Response(body=body, content_type="application/json")

    app = web.Application(client_max_size=64 * 1024**2)
    app.router.add_post("/{name}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    with open(ready_file + ".tmp", "w") as fh:
        fh.write(f"http://127.0.0.1:{port}")
    os.replace(ready_file + ".tmp", ready_file)
    await asyncio.Event().wait()  # until terminated


if __name__ == "__main__":
    try:
        # the loop the manager under test runs on (runtime.event_loop), for a like ratio
        event_loop.run(_serve(sys.argv[1]), os.environ.get("POLARKV_RUNTIME__EVENT_LOOP", "auto"))
    except KeyboardInterrupt:
        pass
