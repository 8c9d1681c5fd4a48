"""The reference: a minimal aiohttp + uvloop pass-through proxy, what any Python proxy in front of the upstream costs.

    python bench/reference.py UPSTREAM_URL PORT

Bodies are read whole (the benchmark's are small), hop-by-hop headers dropped, nothing else: no idempotency,
no metrics, no logging. idemproxy's figures are reported as ratios to this one, measured in the same run.
"""

from __future__ import annotations

import sys

import aiohttp
import uvloop
from aiohttp import web

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}


def app(upstream: str) -> web.Application:
    session: aiohttp.ClientSession | None = None

    async def start(_app: web.Application) -> None:
        nonlocal session
        # No connection limit (aiohttp's default is 100): bench/memory.py holds 10,000 requests open through it.
        session = aiohttp.ClientSession(auto_decompress=False, connector=aiohttp.TCPConnector(limit=0))

    async def stop(_app: web.Application) -> None:
        if session is not None:
            await session.close()

    async def handle(request: web.Request) -> web.Response:
        assert session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        body = await request.read()
        async with session.request(request.method, upstream + request.raw_path, headers=headers,
                                   data=body) as resp:
            payload = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP}
            return web.Response(status=resp.status, headers=out, body=payload)

    application = web.Application()
    application.on_startup.append(start)
    application.on_cleanup.append(stop)
    application.router.add_route("*", "/{tail:.*}", handle)
    return application


if __name__ == "__main__":
    web.run_app(app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), access_log=None,
                print=None, loop=uvloop.new_event_loop())
