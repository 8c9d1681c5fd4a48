"""The benchmark's upstream: answers every request at once with a small JSON body (201 for POST); a request with
``X-Bench-Delay: SECONDS`` is answered that much later (bench/memory.py holds keys pending with it).

    python bench/upstream.py PORT
"""

from __future__ import annotations

import asyncio
import sys

import uvloop
from aiohttp import web

BODY = b'{"id": "ch_1", "object": "charge", "status": "succeeded", "amount": 1000, "currency": "eur"}'


async def handle(request: web.Request) -> web.Response:
    await request.read()
    delay = request.headers.get("X-Bench-Delay")
    if delay:
        await asyncio.sleep(float(delay))
    return web.Response(status=201 if request.method == "POST" else 200, body=BODY,
                        content_type="application/json")


if __name__ == "__main__":
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(application, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None,
                loop=uvloop.new_event_loop())
