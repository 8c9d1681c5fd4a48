"""Wiring and lifecycle: the proxy app, the admin app, the sweeper, graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import AsyncIterator

from aiohttp import web

from idemproxy.admin import AdminAPI
from idemproxy.config import Config, to_plain
from idemproxy.engine import Engine
from idemproxy.metrics import Metrics
from idemproxy.problems import StoreUnavailable, problem_middleware
from idemproxy.proxy import Upstream
from idemproxy.store import Store, build_store

log = logging.getLogger("idemproxy")

SWEEP_INTERVAL = 30.0  # seconds between sweeps; expired records are claimable anyway, this reclaims space
SWEEP_BATCH = 1000



class Proxy:
    """One running idemproxy: config, metrics, store, upstream pool and engine."""

    def __init__(self, config: Config, *, store: Store | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.store = store if store is not None else build_store(config.storage, self.metrics)
        self.upstream = Upstream(config.upstream)
        self.engine = Engine(config, self.store, self.upstream, self.metrics)
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.store.open()
        await self.upstream.open()
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="idemproxy-sweeper")

    async def stop(self) -> None:
        """Close in reverse order of opening, after the in-flight store writes finished."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.engine.drain(self.config.shutdown_timeout)
        await self.upstream.close()
        await self.store.close()

    async def sweep_once(self) -> int:
        """Delete expired records in bounded batches until none is left; returns how many."""
        total = 0
        while True:
            removed = await self.store.sweep(SWEEP_BATCH)
            total += removed
            self.metrics.records_expired.inc(removed)
            if removed < SWEEP_BATCH:
                return total

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            try:
                removed = await self.sweep_once()
            except StoreUnavailable:
                log.warning("sweep skipped: store unavailable")
                continue
            if removed:
                log.info("swept %d expired records", removed)

    def proxy_app(self) -> web.Application:
        """The public app; its cleanup context owns this Proxy's start and stop."""
        # auto_decompress off: a gzip request body must reach the upstream (and the fingerprint) as sent.
        app = web.Application(
            middlewares=[problem_middleware],
            handler_args={"max_field_size": 16384, "auto_decompress": False},
        )
        app[PROXY] = self
        app.cleanup_ctx.append(self._lifecycle)
        app.router.add_route("*", "/{tail:.*}", self.engine.handle)
        return app

    async def _lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        await self.start()
        yield
        await self.stop()

    def admin_app(self) -> web.Application:
        app = web.Application(middlewares=[problem_middleware])
        app[PROXY] = self
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        if self.config.admin.token:  # no token configured: the admin API does not exist
            AdminAPI(self.store, self.config.admin.token).add_routes(app)
        return app

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _request: web.Request) -> web.Response:
        health = await self.store.health()
        return web.json_response(
            {"status": "ready" if health.ready else "unavailable", "stores": health.details},
            status=200 if health.ready else 503,
        )

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


async def serve(config: Config, *, reuse_port: bool = False) -> None:
    """Run until SIGTERM/SIGINT, then stop accepting and drain in-flight requests."""
    proxy = Proxy(config)
    proxy_runner = web.AppRunner(
        proxy.proxy_app(), access_log=None, shutdown_timeout=config.shutdown_timeout,
        handle_signals=False,
    )
    admin_runner = web.AppRunner(proxy.admin_app(), access_log=None, handle_signals=False)
    await proxy_runner.setup()  # opens the store (bounded retries) and the upstream pool
    try:
        await admin_runner.setup()
        await web.TCPSite(admin_runner, config.admin.host, config.admin.port,
                          reuse_port=reuse_port or None).start()
        await web.TCPSite(proxy_runner, config.listen.host, config.listen.port,
                          reuse_port=reuse_port or None).start()
        log.info(
            "idemproxy serving on %s:%d -> %s (store: %s); admin on %s:%d; effective config: %s",
            config.listen.host, config.listen.port, config.upstream.url, proxy.store.backend,
            config.admin.host, config.admin.port, json.dumps(to_plain(config), separators=(",", ":")),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down: draining in-flight requests (up to %gs)", config.shutdown_timeout)
    finally:
        await proxy_runner.cleanup()  # stops accepting, waits for handlers, then closes the store
        await admin_runner.cleanup()


PROXY = web.AppKey("proxy", Proxy)
