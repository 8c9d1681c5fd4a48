"""``idemproxy demo``: a sample payments API with idemproxy in front of it, on the embedded store."""

from __future__ import annotations

import asyncio
import itertools
import signal
import textwrap

from aiohttp import web

from idemproxy.app import AdminRunner, CannotListen, Proxy
from idemproxy.cli import emit
from idemproxy.config import load_config
from idemproxy.problems import StoreUnavailable

CHARGE_DELAY = 0.2  # seconds: slow enough that a double-submit visibly overlaps the first request

CHARGES = web.AppKey("charges", dict)


def payments_app() -> web.Application:
    """A tiny payments API with no idempotency of its own: every POST creates a new charge."""
    app = web.Application()
    app[CHARGES] = {}
    counter = itertools.count(1)

    async def create(request: web.Request) -> web.Response:
        try:
            payload = await request.json()
            amount, currency = int(payload["amount"]), str(payload["currency"])
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "send JSON with amount and currency"}, status=400)
        await asyncio.sleep(CHARGE_DELAY)
        charge = {"id": f"ch_{next(counter):06d}", "amount": amount, "currency": currency,
                  "status": "succeeded"}
        app[CHARGES][charge["id"]] = charge
        return web.json_response(charge, status=201)

    async def show(request: web.Request) -> web.Response:
        charge = app[CHARGES].get(request.match_info["charge_id"])
        if charge is None:
            return web.json_response({"error": "no such charge"}, status=404)
        return web.json_response(charge)

    async def name_itself(_request: web.Request, response: web.StreamResponse) -> None:
        # The proxy passes on an upstream's own Server header: not aiohttp's banner, which would read as the proxy's.
        response.headers["Server"] = "demo-payments"

    app.on_response_prepare.append(name_itself)
    app.router.add_post("/v1/charges", create)
    app.router.add_get("/v1/charges/{charge_id}", show)
    return app


def instructions(port: int, admin_port: int) -> str:
    base = f"http://127.0.0.1:{port}"
    body = '{"amount": 1000, "currency": "eur"}'
    post = f"curl -si {base}/v1/charges -H 'Content-Type: application/json'"
    return textwrap.dedent(f"""\
        idemproxy demo: a sample payments API (POST /v1/charges takes {CHARGE_DELAY * 1000:.0f} ms)
        behind idemproxy at {base}, on the embedded store. Try:

        1. A first request is forwarded and its response stored (Idempotent-Replayed: false):
           {post} -H 'Idempotency-Key: order-1' -d '{body}'

        2. The same key and payload again is replayed: same charge id, Idempotent-Replayed: true,
           and the API is not called again:
           {post} -H 'Idempotency-Key: order-1' -d '{body}'

        3. The same key with another payload is refused, 422 payload_mismatch:
           {post} -H 'Idempotency-Key: order-1' -d '{{"amount": 2500, "currency": "eur"}}'

        4. A double submit while the first is still running gets 409 in_flight with Retry-After:
           ({post} -H 'Idempotency-Key: order-2' -d '{body}' &
            sleep 0.05; {post} -H 'Idempotency-Key: order-2' -d '{body}'; wait)

        Metrics: curl -s http://127.0.0.1:{admin_port}/metrics | grep idemproxy_requests
        Stop with Ctrl-C.
        """)


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _listen(runner: web.BaseRunner, host: str, port: int, flag: str) -> None:
    """Listen on one of the demo's ports; one that is taken names the flag to change (the demo has no config)."""
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        reason = (exc.strerror or str(exc)).rpartition("): ")[2]  # (asyncio names the address again first)
        raise CannotListen(f"{flag}: cannot listen on {host}:{port} ({reason.lower()}); give another port with "
                           f"{flag} N") from exc


async def _set_up(runner: web.BaseRunner) -> None:
    """Set a runner up (the proxy's opens its store); a store file that cannot be opened names --store, the demo's
    flag for it, not the config key storage.embedded.path a demo user never wrote."""
    try:
        await runner.setup()
    except StoreUnavailable as exc:
        key = "storage.embedded.path: "
        if not exc.detail.startswith(key):
            raise
        reason = exc.detail[len(key):].partition("; ")[0]
        raise StoreUnavailable(f"--store: {reason}; give a file in a directory this process may write with "
                               "--store FILE", maybe_applied=False) from exc


async def run_api(port: int) -> None:
    """The sample payments API alone (the upstream of the docker compose stack)."""
    runner = web.AppRunner(payments_app(), access_log=None)
    await runner.setup()
    await _listen(runner, "0.0.0.0", port, "--upstream-port")
    emit(f"sample payments API on :{port}\n")
    try:
        await _until_signalled()
    finally:
        await runner.cleanup()


async def run_demo(port: int, upstream_port: int, admin_port: int, store_path: str) -> None:
    config = load_config({
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": admin_port},
        "upstream": {"url": f"http://127.0.0.1:{upstream_port}", "timeout": "10s"},
        "tenant": {"from": "static", "static": "demo"},
        "storage": {"embedded": {"path": store_path}},
    })
    upstream_runner = web.AppRunner(payments_app(), access_log=None)
    await upstream_runner.setup()
    await _listen(upstream_runner, "127.0.0.1", upstream_port, "--upstream-port")
    proxy = Proxy(config)
    runners = [proxy.runner(access_log=None),
               AdminRunner(proxy.admin_app(), access_log=None)]
    try:
        for runner, listen_port, flag in zip(runners, (port, admin_port), ("--port", "--admin-port"), strict=True):
            await _set_up(runner)
            await _listen(runner, "127.0.0.1", listen_port, flag)
        emit(instructions(port, admin_port) + "\n")
        await _until_signalled()
    finally:
        for runner in runners:
            await runner.cleanup()
        await upstream_runner.cleanup()
