"""Wiring and lifecycle: the proxy app, the admin app, the sweeper, readiness, draining and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import random
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from functools import partial
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from idemproxy.admin import ADMIN_MARK, AdminAPI
from idemproxy.config import Config, ListenConfig, SecretURL, advisories, to_plain
from idemproxy.engine import Engine
from idemproxy.metrics import REDIS_ERROR_ONLY_OPERATIONS, Metrics
from idemproxy.problems import (
    BadRequest,
    ClientStalled,
    InvalidKey,
    Problem,
    RequestTimeout,
    StoreUnavailable,
    loggable_path,
    problem_middleware,
    render_problems,
)
from idemproxy.proxy import (
    CONTINUE,
    REQUEST_ID,
    UNTYPED,
    UPLOAD_ANSWERED,
    UPSTREAM_SERVER,
    Upstreams,
    reset,
    unsent_bytes,
)
from idemproxy.store import Store, build_store
from idemproxy.store.base import Health
from idemproxy.tracing import build_tracer
from idemproxy.workers import ABORT, DRAIN, drain_when_orphaned

log = logging.getLogger("idemproxy")

SWEEP_INTERVAL = 30.0  # seconds between sweeps; expired records are claimable anyway, this reclaims space
SWEEP_BATCH = 1000
# The cyclic garbage collector while serving: what start-up built (modules, config, pools) is frozen out of its
# scans, and a young-generation collection comes every 20,000 container allocations instead of 700. A request's
# objects are freed by reference counting; only cycles (an exception's traceback and frame) wait for a collection.
# Measured: 3-5 % of a first request's CPU and 16 % of a plain one's (bench/overhead.py, docs/performance.md); peak
# RSS unchanged.
GC_THRESHOLDS = (20_000, 10, 10)
STORE_PROBE_INTERVAL = 10.0  # seconds between background store checks feeding idemproxy_store_up
STORE_PROBE_TIMEOUT = 2.0  # a store that does not answer a ping within this is reported unavailable
# Shutdown: requests still running at shutdown_timeout are cancelled and get this long to unwind; aiohttp's own
# per-connection wait (which would wait shutdown_timeout twice over) is given only this long to close connections.
CLOSE_GRACE = 0.5
CLOSE_FLOOR = 0.1  # seconds the stores' close gets however little is left (a store that answers closes in less)
_OCTET_STREAM = "application/octet-stream"  # what aiohttp gives a body without a type

_WELL_FORMED_ID = re.compile(r"[\x21-\x7e]{1,128}")  # 1-128 visible ASCII characters

# Request ids must be unique, not secret: a generator seeded from os.urandom (afresh in a forked child) makes
# them without the system call per request that uuid4 (os.urandom) costs.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def new_request_id() -> str:
    """128 random bits in hex, as ``uuid4().hex`` has (unique across processes; nobody relies on them secret)."""
    return f"{_ids.getrandbits(128):032x}"


class Phase(StrEnum):
    """Where the process is in its life; only READY takes traffic from a load balancer."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"



class Proxy:
    """One running idemproxy: config, metrics, store, upstream pool and engine."""

    def __init__(self, config: Config, *, store: Store | None = None, ready_after_start: bool = True) -> None:
        self.config = config
        self.metrics = Metrics()
        self.store = store if store is not None else build_store(
            config.storage, self.metrics, max_body=config.max_stored_response, wait_for_postgres=True)
        self.tracer = build_tracer(config.tracing)
        self.upstreams = Upstreams(config, self.tracer)
        self.engine = Engine(config, self.store, self.upstreams, self.metrics, self.tracer)
        self.phase = Phase.STARTING
        # serve() marks the process ready itself, once the proxy port listens.
        self._ready_after_start = ready_after_start
        # Until the first check: each configured store "opening" (while starting, /readyz names them so).
        storage = config.storage
        self._store_states: dict[str, str] = {
            name: "opening" for name, used in (("postgres", storage.postgres is not None),
                                               ("redis", storage.redis is not None),
                                               ("embedded", storage.postgres is None)) if used}
        for backend in self._store_states:  # and idemproxy_store_up says the same: 0, not absent, until then
            self.metrics.store_up.labels(backend).set(0)
            # Exported at 0 before the first one: a series that first appears at 1 has no increase() in
            # Prometheus, so IdempotencyRecordsUnreadable would miss the first unreadable record of a backend.
            self.metrics.records_unreadable.labels(backend)
        if storage.redis is not None:  # and so IdempotencyStoreErrors would miss the first of these (metrics.py)
            for operation in REDIS_ERROR_ONLY_OPERATIONS:
                self.metrics.store_errors.labels("redis", operation)
        self._background: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        # set once the sweep at start, and the first store check, have run (or failed): with both, the store work of
        # the start is over
        self.first_sweep_done = asyncio.Event()
        self.first_probe_done = asyncio.Event()
        self._shutdown_deadline: float | None = None  # monotonic; shutdown_timeout counted once, from the first step

    async def start(self) -> None:
        await self.store.open()
        try:
            await self.upstreams.open()
        except BaseException:  # no half-started proxy: the runner stops only what started whole
            await self.store.close()
            raise
        self._background = [
            asyncio.create_task(self._sweep_forever(), name="idemproxy-sweeper"),
            asyncio.create_task(self._probe_stores_forever(), name="idemproxy-store-probe"),
        ]
        if self._ready_after_start:
            self.phase = Phase.READY

    def begin_draining(self) -> None:
        """From now on /readyz answers 503 so load balancers stop sending; requests are still served."""
        self.phase = Phase.DRAINING

    async def stop(self) -> None:
        """Close in reverse order of opening, after the in-flight store writes finished."""
        self.phase = Phase.DRAINING
        self._stopping.set()
        for task in self._background:
            task.cancel()
        # Not awaited unbounded: redis-py can swallow a cancellation mid-command, so the probe also ends by
        # the flag above, within one probe timeout.
        await asyncio.wait(self._background, timeout=min(STORE_PROBE_TIMEOUT + 1, self._unwind_left()))
        await self.engine.drain(self._shutdown_left(), min(CLOSE_GRACE, self._unwind_left()))
        await self.upstreams.close()
        # A store that does not answer is not waited for past the budget: its busy connections are cut.
        await self.store.close(max(self._unwind_left(), CLOSE_FLOOR))
        await self.tracer.shutdown()  # last: the spans of the drained requests are exported too

    def _shutdown_left(self) -> float:
        """What is left of shutdown_timeout, counted from the first shutdown step (all of it before one)."""
        if self._shutdown_deadline is None:
            self._shutdown_deadline = time.monotonic() + self.config.shutdown_timeout
        return max(self._shutdown_deadline - time.monotonic(), 0.0)

    def _unwind_left(self) -> float:
        """What is left of shutdown_timeout and the CLOSE_GRACE after it, in which what was cut unwinds."""
        return self._shutdown_left() + CLOSE_GRACE if self._shutdown_deadline is None else max(
            self._shutdown_deadline + CLOSE_GRACE - time.monotonic(), 0.0)

    async def finish_requests(self, server: web.Server) -> None:
        """At shutdown, once no new connection is accepted and each connection was told to close after its
        current request (aiohttp's ``pre_shutdown``): let the requests in progress finish, their answers written
        whole, within shutdown_timeout; then cancel the connections still busy (their clients get no answer). A
        cancelled request's forward and completion go on, shielded, within what is left of the same
        shutdown_timeout (``stop``): one budget for everything, not one per step.

        A connection's own task is waited on, not the handler's: it covers a request read but not yet handed to
        the handler, and an answer still being written after the handler returned. Each connection's socket is
        closed as its task ends: an idle keep-alive connection's task ends at ``pre_shutdown`` (its wait for the
        next request cancelled) without closing the socket, and a request sent on it would wait, never read,
        until the last busy connection ended."""
        left = self._shutdown_left()
        busy: dict[asyncio.Task[None], RequestHandler] = {}
        for conn in server.connections:
            task = conn.task if isinstance(conn, _ProblemRequestHandler) else None
            if task is None or task.done():
                conn.force_close()
            else:
                task.add_done_callback(partial(_close_connection, conn))
                busy[task] = conn
        if busy:
            await asyncio.wait(busy, timeout=left)
        late = [task for task in busy if not task.done()]
        if late:
            # A connection with bytes waiting for its client is writing an answer that client does not take (not
            # for listen.send_timeout yet): its request was answered, and the answer is cut, not lost.
            sending = sum(1 for task in late
                          if isinstance(conn := busy[task], _ProblemRequestHandler) and conn.answer_waits())
            log.warning("shutdown_timeout (%gs) reached with %d request(s) still in progress and %d answer(s) "
                        "still being sent to clients not reading them: closing their connections (those requests "
                        "unanswered, those answers cut)", self.config.shutdown_timeout, len(late) - sending,
                        sending)
            for task in late:
                task.cancel()
            await asyncio.wait(late, timeout=CLOSE_GRACE)

    async def check_stores(self) -> Health:
        """Ping the stores (bounded in time), and record the answer in ``idemproxy_store_up``."""
        try:
            async with asyncio.timeout(STORE_PROBE_TIMEOUT):
                health = await self.store.health()
        except TimeoutError:
            health = Health(ready=False, details={self.config.storage.backend: "unavailable (no answer)"})
        for backend, state in health.details.items():
            self.metrics.store_up.labels(backend).set(1 if state == "ok" else 0)
        self._store_states = dict(health.details)
        return health

    async def _probe_stores_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.check_stores()
            finally:
                self.first_probe_done.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), STORE_PROBE_INTERVAL)

    async def sweep_once(self) -> int:
        """Maintain the store's partitions (daily layout: create days ahead, drop passed days whole), then delete
        expired records in bounded batches until none is left; returns how many rows were deleted."""
        await self.store.maintain()
        total = 0
        while True:
            removed = await self.store.sweep(SWEEP_BATCH)
            total += removed
            self.metrics.records_expired.inc(removed)
            if removed < SWEEP_BATCH:
                return total

    async def _sweep_forever(self) -> None:
        """Sweep (and maintain partitions) once at start, so a restart neither waits an interval to drop a day
        that expired while the proxy was down nor shows ``idemproxy_partitions`` at 0; then every interval."""
        while True:
            try:
                removed = await self.sweep_once()
            except StoreUnavailable:
                log.warning("sweep skipped: store unavailable")
            else:
                if removed:
                    log.info("swept %d expired records", removed)
            finally:
                self.first_sweep_done.set()
            await asyncio.sleep(SWEEP_INTERVAL)

    def runner(self, **kwargs: Any) -> web.BaseRunner:
        """The proxy port's runner: ``setup()`` opens this Proxy (store, pools), ``cleanup()`` stops accepting,
        waits for the requests in progress (``finish_requests``), then stops it. ``kwargs`` as for
        ``web.AppRunner``; its ``shutdown_timeout`` (aiohttp's own wait per connection, which would wait twice
        over) only closes connections: this Proxy's ``shutdown_timeout`` is kept by ``finish_requests``."""
        kwargs.setdefault("shutdown_timeout", CLOSE_GRACE)
        return _ProxyRunner(self, **kwargs)

    def proxy_server(self, **kwargs: Any) -> web.Server:
        """aiohttp's low-level server with ``_serve`` as its one handler.

        Not a ``web.Application``: a router with one catch-all route, its match info and the response
        signal cost about a quarter of a replay's CPU (``bench/overhead.py``). What they did is done here:
        the hook below for every response (``_ProxyRequest``), and ``Expect`` in ``_serve``.
        """
        loop = asyncio.get_running_loop()
        hook = self._on_proxy_response

        def request_factory(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
            return _ProxyRequest(message, payload, protocol, writer, task, loop, state={_ON_PREPARE: hook})

        # auto_decompress off: a gzip request body must reach the upstream (and the fingerprint) as sent. An idle
        # connection is closed by aiohttp's own keep-alive check (one timer per connection, moved on, not re-made,
        # by each request).
        settings: dict[str, Any] = {**kwargs, "max_field_size": 16384, "auto_decompress": False,
                                    "keepalive_timeout": self.config.listen.keepalive_timeout}
        key_headers = frozenset(idem.header.lower() for idem in (
            self.config.idempotency, *(route.idempotency for route in self.config.routes)))
        return _Server(self._serve, request_factory=request_factory, key_headers=key_headers,
                       on_unparsed=self._count_unparsed, request_ids=True, limits=self.config.listen, **settings)

    def _count_unparsed(self, request: web.BaseRequest, status: int) -> None:
        """A request refused before its head was read whole, counted and access-logged as the requests refused as
        malformed are (``invalid_key``; route and method unknown: ``other`` and aiohttp's ``UNKNOWN``): a key header
        the parser refused, and a head that did not come whole within ``listen.header_timeout``."""
        self.engine.refused(request, status, parsed=False)

    def _refuse(self, request: web.BaseRequest, refused: web.Response) -> web.Response:
        """An answer made before the engine ran, counted and access-logged as the engine's own refusals are."""
        self.engine.refused(request, refused.status)
        return refused

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        """The one handler of the proxy port: the request id, ``Expect``, the engine, problems rendered.

        A handler, not middlewares: aiohttp wraps every middleware in a partial and a coroutine per request.
        """
        request[REQUEST_ID] = self._request_id(request)
        if request.method == "CONNECT":  # (aiohttp reads the bytes after its head as a tunnel's: no body to forward)
            tunnel = BadRequest("CONNECT is not supported: this proxy opens no tunnels.").response()
            tunnel.force_close()
            return self._refuse(request, tunnel)
        if "Transfer-Encoding" in request.headers:
            refused = _transfer_coding(request)
            if refused is not None:
                return self._refuse(request, refused)
        expecting = "Expect" in request.headers
        if expecting:
            refused = _expect(request)
            if refused is not None:
                return self._refuse(request, refused)
        response = await render_problems(request, self.engine.handle)
        if not response.prepared:  # (a streamed answer was marked by the proxy before it started)
            request[UPSTREAM_SERVER] = "Server" in response.headers
            # Answered before the body came whole (refused first, or found too large mid-stream), or before the
            # body it was to send: the rest is not wanted, so the connection closes (as Go's net/http and nginx
            # do; aiohttp reads off what still comes, within its lingering time, before it closes).
            if not request.content.is_eof() or (expecting and request.get(CONTINUE)):
                response.force_close()
        return response

    def _request_id(self, request: web.BaseRequest) -> str:
        """A well-formed incoming request id, else a new one: 128 random bits in hex, as uuid4().hex has."""
        given = request.headers.getall(self.config.request_id.header, ())
        if len(given) == 1 and _WELL_FORMED_ID.fullmatch(given[0]):
            return given[0]
        return new_request_id()

    async def _on_proxy_response(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        """Every response of the proxy port: the request id, and no aiohttp banner (only the upstream's own)."""
        _strip_server_banner(request, response)
        # (the type first: a mapping lookup of a missing key raises and catches KeyError, on every response)
        if response.headers.get("Content-Type") == _OCTET_STREAM and response.get(UNTYPED):
            response.headers.popall("Content-Type", None)
        request_id = request.get(REQUEST_ID)
        if request_id is None:  # an answer aiohttp made without the handler: a 400 for a request it could not
            request_id = request[REQUEST_ID] = new_request_id()  # parse (its headers are not to be trusted)
        response.headers[self.config.request_id.header] = request_id
        # (named if its client does not take it: ``_watch_send``; a _ProblemRequestHandler, no cast() call)
        request.protocol.answering = request_id  # type: ignore[attr-defined]

    def admin_app(self) -> web.Application:
        app = web.Application(middlewares=[problem_middleware])
        app[PROXY] = self
        app.on_response_prepare.append(_admin_response_hook)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        if self.config.admin.token:  # no token configured: the admin API does not exist
            AdminAPI(self.store, self.config.admin.token).add_routes(app)
        return app

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _request: web.Request) -> web.Response:
        """200 while this process accepts work; a store outage alone does not take it out of service
        (the proxy answers 503 store_unavailable itself) unless admin.ready_requires_store is set."""
        if self.phase is not Phase.READY:
            return web.json_response({"status": self.phase.value, "stores": self._store_states}, status=503)
        health = await self.check_stores()
        ready = health.ready or not self.config.admin.ready_requires_store
        return web.json_response(
            {"status": "ready" if ready else "store_unavailable", "stores": health.details},
            status=200 if ready else 503,
        )

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


def _strip_server_banner(request: web.BaseRequest, response: web.StreamResponse) -> None:
    # aiohttp fills in "Server: Python/3.x aiohttp/3.x" before this hook runs; only a Server header that came
    # from the upstream (proxied or stored with a replay) is kept.
    if not request.get(UPSTREAM_SERVER, False):
        response.headers.popall("Server", None)


async def _admin_response_hook(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Every answer of the admin port: no aiohttp banner, and the mark that tells ``idemproxy keys`` it found
    the admin port."""
    _strip_server_banner(request, response)
    response.headers[ADMIN_MARK] = "1"


class CannotListen(OSError):
    """A configured address that cannot be listened on; the message names the config keys (one line)."""


async def _listen(runner: web.BaseRunner, section: str, host: str, port: int, reuse_port: bool) -> None:
    try:
        await web.TCPSite(runner, host, port, reuse_port=reuse_port or None).start()
    except OSError as exc:
        raise _cannot_listen(section, host, port, exc) from exc


def _cannot_listen(section: str, host: str, port: int, exc: OSError) -> CannotListen:
    reason = (exc.strerror or str(exc)).rpartition("): ")[2]  # (asyncio names the address again first)
    if isinstance(exc, socket.gaierror):
        reason = f"the host does not resolve: {reason}"
    return CannotListen(f"{section}.host / {section}.port: cannot listen on {host}:{port} ({reason.lower()})")


async def check_ports(config: Config) -> None:
    """``--workers N``, in the parent: bind (without listening) what every worker will listen on, and let it go. A
    port that is taken, or the admin and proxy ports under two names, is then said once, by the parent, instead of
    once by each worker. (Taken between this and the workers' start, it is still said by each.)"""
    loop = asyncio.get_running_loop()
    servers: list[asyncio.Server] = []
    try:
        for section, host, port in (("admin", config.admin.host, config.admin.port),
                                    ("listen", config.listen.host, config.listen.port)):
            try:
                servers.append(await loop.create_server(asyncio.Protocol, host, port, reuse_port=True,
                                                        start_serving=False))
            except OSError as exc:
                raise _cannot_listen(section, host, port, exc) from exc
        admin, listen = ([sock.getsockname() for sock in server.sockets] for server in servers)
        _own_ports(admin, listen)
    finally:
        for server in servers:
            server.close()


def _own_ports(admin: list[Any], listen: list[Any]) -> None:
    """The admin API and the proxy on sockets of their own, as bound: ``check-config`` refuses one port written
    twice, but not one address under two names (``localhost`` and ``127.0.0.1``), which a worker of --workers
    (SO_REUSEPORT) binds twice, the kernel then handing each connection to the proxy or to the admin API."""
    for a_host, a_port, *_ in admin:
        for l_host, l_port, *_ in listen:
            if a_port != l_port:
                continue
            ipv4 = ":" not in a_host and ":" not in l_host
            if a_host == l_host or "::" in (a_host, l_host) or (ipv4 and "0.0.0.0" in (a_host, l_host)):
                raise CannotListen(f"admin.port: {a_port} is listen.port too ({a_host} and {l_host} are one "
                                   "address): the proxy and its admin API need ports of their own")


def _bound_port(runner: web.BaseRunner, port: int) -> int:
    """The port as bound: the one the system picked for a configured 0, which the start-up line must name."""
    return int(runner.addresses[0][1]) if port == 0 and runner.addresses else port


async def serve(config: Config, *, reuse_port: bool = False) -> None:
    """Run until SIGTERM/SIGINT; then drain (CONTRACT "Draining") and stop. A second signal exits at once."""
    proxy = Proxy(config, ready_after_start=False)
    proxy_runner = proxy.runner(access_log=None)
    admin_runner = AdminRunner(proxy.admin_app(), access_log=None, handle_signals=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    signalled: list[signal.Signals] = []  # the operator's SIGTERM/SIGINT, not --workers' own DRAIN

    def on_signal(sig: signal.Signals) -> None:
        if sig is ABORT or (sig is not DRAIN and signalled):
            again = sig if sig is not ABORT else (signalled or [signal.SIGTERM])[0]
            log.warning("%s again%s: exiting at once, without draining", again.name,
                        " (to the workers' parent)" if sig is ABORT else "")
            logging.shutdown()
            os._exit(128 + again.value)
        if sig is not DRAIN:
            signalled.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, DRAIN, ABORT):
        loop.add_signal_handler(sig, on_signal, sig)
    drain_when_orphaned()  # (a worker of --workers N)
    # Admin first: /healthz answers and /readyz says "starting" while the stores open (bounded retries).
    await admin_runner.setup()
    try:
        await _listen(admin_runner, "admin", config.admin.host, config.admin.port, reuse_port)
        await proxy_runner.setup()  # opens the store and the upstream pools
        await _listen(proxy_runner, "listen", config.listen.host, config.listen.port, reuse_port)
        _own_ports(admin_runner.addresses, proxy_runner.addresses)
        proxy.phase = Phase.READY
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        for note in advisories(config):
            log.warning("%s", note)
        log.info(
            "idemproxy serving on %s:%d -> %s (store: %s); admin on %s:%d; effective config: %s",
            config.listen.host, _bound_port(proxy_runner, config.listen.port),
            ", ".join(dict.fromkeys(SecretURL(u.base).masked() for u in proxy.upstreams)),  # (a URL once)
            proxy.store.backend, config.admin.host, _bound_port(admin_runner, config.admin.port),
            json.dumps(to_plain(config), separators=(",", ":")),
        )
        await stop.wait()
        proxy.begin_draining()
        log.info("draining: /readyz is 503; serving for %gs more so load balancers notice", config.drain_delay)
        await asyncio.sleep(config.drain_delay)
        log.info("shutting down: no new connections; in-flight requests have up to %gs",
                 config.shutdown_timeout)
    finally:
        await proxy_runner.cleanup()  # stops accepting, waits for handlers, then closes the store
        await admin_runner.cleanup()


PROXY = web.AppKey("proxy", Proxy)

_Hook = Callable[[web.BaseRequest, web.StreamResponse], Awaitable[None]]
_ON_PREPARE: web.RequestKey[_Hook] = web.RequestKey("on_prepare")


class _ProxyRequest(web.BaseRequest):
    """A request of the proxy port. aiohttp runs ``_prepare_hook`` on every response just before its head is
    written (after its own headers, such as the ``Server`` banner, are filled in); ``web.Request`` sends the
    app's ``on_response_prepare`` signal from there. This one calls the proxy's hook: also for the answers
    aiohttp makes itself (a 400 for a malformed request, a 500), which the app's signal never saw."""

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        await self[_ON_PREPARE](self, response)


class _HeadTimeout(TimeoutError):
    """A request head that did not come whole within ``listen.header_timeout`` (``_ProblemRequestHandler``)."""


_DATA_RECEIVED = RequestHandler.data_received


class _ProblemRequestHandler(RequestHandler):
    """aiohttp's connection handler for the proxy port, its own error answers as problem+json like every other
    answer the proxy makes. A request aiohttp's parser refused (a malformed request line, a header value with a
    control character, an oversized header) never reaches the handler: aiohttp answered it text/plain, and logged
    the parser's message, which quotes the offending line (an Authorization header, a key) with a traceback, at
    ERROR, for any client that sends one."""

    key_headers: frozenset[str] = frozenset()  # lower-case names of the idempotency key header (all routes)
    # counts a request refused before its head was read whole (a status)
    on_unparsed: Callable[[web.BaseRequest, int], None] = staticmethod(lambda _request, _status: None)
    request_ids = False  # (the proxy port) every answer carries a request id: the log line names it too
    limits: ListenConfig | None = None  # (the proxy port) the client's pace, looked at by ``check_pace``
    # What each read notes (``data_received``): the number of requests parsed when bytes last came that may be a
    # head's (-1: none yet), and the body of the last request parsed, whose bytes are not a head's until it ends.
    fed_at = -1
    _reading: StreamReader = EMPTY_PAYLOAD
    # What ``check_pace`` noted: the wait for a head it last saw (the number of requests parsed by then; -1: none)
    # and when the head it waits for was due to start; the body it last saw being read, how much of it had come
    # then and since when.
    _waited = -1
    _head_since = 0.0
    _body: StreamReader | None = None
    _body_seen = 0
    _body_since = 0.0
    # The answer being written (``_watch_send``): the id of the request it answers (set as its head is made); how
    # many bytes the client had taken at the look that last saw it take one (of which writer: its id), and since
    # when (-1: none waiting).
    answering = ""
    _taken = 0
    _taken_of: tuple[int, str] = (0, "")
    _send_since = -1.0
    # The connection's transport, kept once aiohttp let go of it (``force_close``: an idle connection closed by
    # listen.keepalive_timeout, or at shutdown) while it still held bytes for the client.
    _sending: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._sending = self.transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self._sending = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # No timer, a few attributes per read: bytes that come once the last request's body came whole (or before
        # any request) are a head's, the next one's: ``check_pace`` tells a head begun from an idle wait by them,
        # whenever they came (while the request before was served, or right after its answer). (aiohttp calls this
        # with no bytes itself, to parse what it held back while reading was paused: no byte came then.)
        requests = self._request_count
        if data and self._reading.is_eof():
            self.fed_at = requests
        if self._close and not self._force_close:  # (closing: at shutdown, or after a refused head)
            self._received_closing(data)
            return
        _DATA_RECEIVED(self, data)
        if self._request_count != requests:  # a head came whole: its body's bytes are not a head's
            self._reading = self._messages[-1][1]

    def _received_closing(self, data: bytes) -> None:
        """Bytes that came once this connection was told to close after its request in progress: aiohttp drops
        them all (at shutdown ``pre_shutdown`` closes every connection, and ``Proxy.finish_requests`` then lets the
        requests in progress finish), the rest of that request's body too: it would never come whole, and its
        client, still sending, would get 408 from ``listen.body_timeout``. That body is still read; nothing after it
        is parsed for an answer (the connection closes after this one)."""
        request = self._current_request
        if request is None or request.content.is_eof():
            return
        self._close = False
        try:
            _DATA_RECEIVED(self, data)
        finally:
            self._close = True

    def check_pace(self, now: float, limits: ListenConfig) -> None:
        """The server's look at this connection (``_Server``, every tick): a request head that has not come whole
        ``listen.header_timeout`` after it began is answered 408 and the connection closed; a new connection that
        sent nothing at all by then is closed (no request to answer, as nginx does). A head began when the
        connection's first byte came (its accept, for the first head: a client connects to send one), or when a
        byte came once the request before it had come whole (its body too): seen at a tick, so counted from that
        tick, never early; a connection waiting for a head none of whose bytes came waits as an idle one, for
        ``listen.keepalive_timeout`` (aiohttp's own check). A request body: ``_watch_body``; an answer the client
        does not take: ``_watch_send``."""
        # Bytes for the client wait in this process: its writes paused (the transport's buffer is full), or an
        # answer's last bytes below that mark (it counts as written: the connection went on to wait for the next
        # request, or is closing, which waits for them to be taken first).
        transport = self.answer_waits()
        if transport is not None:
            if self._watch_send(transport, now, limits.send_timeout):
                return
        elif self._send_since >= 0:
            self._send_since = -1.0
        request = self._current_request
        if request is not None:
            self._waited = -1
            self._watch_body(request, now, limits.body_timeout)
            return
        self._body = None
        waiter = self._waiter
        if waiter is None or waiter.done() or self._close or self._force_close:
            self._waited = -1  # not waiting for a head: a request in progress or queued, or closing
            return
        requests = self._request_count
        begun = self.fed_at == requests  # bytes of the head it waits for came
        if requests != self._waited:  # a wait this check has not seen yet
            self._waited = requests
            # a new connection's first head is due from its accept; a later one from its first byte (idle till then)
            self._head_since = now if begun or not requests else -1.0
        elif self._head_since < 0 and begun:
            self._head_since = now
        if 0 <= self._head_since <= now - limits.header_timeout:
            self._head_timed_out(waiter)

    def _watch_body(self, request: web.BaseRequest, now: float, timeout: float) -> None:
        """A request body the proxy waits for that has not moved for ``listen.body_timeout``: its stream fails with
        :class:`ClientStalled`, and whoever reads it answers 408 (and cuts a pass-through's upstream connection,
        never reused). Only time waiting on the client counts: a body held up by the proxy (bytes come and not read
        yet, as while the upstream takes a streamed upload slowly) or waiting for its interim 100 is not stalled,
        nor is the rest of a pass-through upload the upstream already answered (its answer is relayed whole).
        Progress, not a total: a slow upload that keeps moving is never cut."""
        body = request.content
        if body.is_eof() or body.exception() is not None or request.get(CONTINUE) or request.get(UPLOAD_ANSWERED):
            self._body = None
            return
        if body is not self._body or body.total_bytes != self._body_seen or body._size:
            self._body, self._body_seen, self._body_since = body, body.total_bytes, now
        elif self._body_since <= now - timeout:
            log.info("no byte of the body of %s %s for listen.body_timeout (%gs), request id %s: answering 408",
                     request.method, loggable_path(request), timeout, request.get(REQUEST_ID, ""))
            body.set_exception(ClientStalled(timeout))

    def answer_waits(self) -> asyncio.Transport | None:
        """This connection's transport when bytes of an answer wait in this process for its client: its writes
        paused, or an answer's last bytes in the buffer below that mark (``check_pace``, the shutdown warning)."""
        transport = self._sending
        if transport is not None and (self._paused or transport.get_write_buffer_size()):
            return transport
        return None

    def _watch_send(self, transport: asyncio.Transport, now: float, timeout: float) -> bool:
        """An answer the client has taken no byte of for ``listen.send_timeout`` while the proxy has bytes waiting
        for it: the connection is cut (True). Its head is gone, so nothing else can tell the client; a covered
        answer is stored before its first byte is sent, so the retry of a request cut so is never a second execution.
        aiohttp's write waits for such a client without a bound, holding the answer's bytes: a replay, or a covered
        answer of up to ``max_stored_response``, that nobody reads. Progress, not a total: a client that keeps
        reading is never cut, if it reads enough for its kernel to tell (about a segment: its reads show only as
        its window reopens). A connection closing (after its answer, or as idle) waits for the client to take
        those bytes first, without a bound: watched too."""
        unsent = unsent_bytes(transport)
        # What it took: what was written, less what waits. An answer the handler writes on as the client takes it
        # (streamed) is written by the request in progress, and what waits alone may stay the same size from look
        # to look while the client reads; one written whole (aiohttp's ``finish_response``) is written already.
        # (Of which answer: the writer of the request in progress, or the id of the last answer made, so that a
        # look after another whole answer was made starts over.)
        request = self._current_request
        answer = (0 if request is None else id(request.writer), self.answering)
        taken = (0 if request is None else request.writer.output_size) - unsent
        if self._send_since < 0 or answer != self._taken_of or taken != self._taken:
            self._taken, self._taken_of, self._send_since = taken, answer, now
            return False
        if self._send_since > now - timeout:
            return False
        log.info("the client took no byte of its answer for listen.send_timeout (%gs), %d bytes unsent, request id "
                 "%s: connection reset", timeout, unsent, self.answering)
        self._send_since = -1.0
        reset(transport)
        return True

    def _head_timed_out(self, waiter: asyncio.Future[None]) -> None:
        if self.fed_at < 0:  # a new connection that sent nothing
            self.force_close()
            return
        # Answered as aiohttp answers a head its parser refused: an error queued for this connection's task, which
        # answers it (``handle_error``) and closes; what the client still sends is not parsed.
        self._close = True
        self._messages.append((_ErrInfo(status=408, exc=_HeadTimeout(), message=""), EMPTY_PAYLOAD))
        waiter.set_result(None)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """This connection's task: it reads requests and answers them one after another (at shutdown it ends
        after the request in progress, once aiohttp's ``pre_shutdown`` closed the connection)."""
        return self._task_handler

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        problem: Problem
        # The id this answer will carry (``_on_proxy_response``), in its log line: the request is found by it.
        named = ""
        if self.request_ids:
            request[REQUEST_ID] = request.get(REQUEST_ID) or new_request_id()
            named = f", request id {request[REQUEST_ID]}"
        if isinstance(exc, _HeadTimeout):
            timeout = self.limits.header_timeout if self.limits is not None else 0.0
            log.info("closed a connection whose request head did not come whole within listen.header_timeout "
                     "(%gs)%s", timeout, named)
            self.on_unparsed(request, status)
            problem = RequestTimeout(f"The request head did not come whole within {timeout:g}s; nothing was "
                                     "forwarded.")
        elif 400 <= status < 500:
            log.info("refused a request that is not valid HTTP/1.1 (%s)%s", type(exc).__name__ if exc else status,
                     named)
            # The parser's message quotes the line it refused, as b'Name: value' (b"Name: value" when the value
            # holds a single quote): the name alone says whether it was the key (never logged or echoed: the value
            # may be a credential).
            quoted = (message or "").lower()
            if any(f"b'{name}:" in quoted or f'b"{name}:' in quoted for name in self.key_headers):
                self.on_unparsed(request, status)
                problem = InvalidKey("The idempotency key header could not be read (not printable ASCII, or too "
                                     "long); nothing was forwarded.")
            else:
                problem = BadRequest("The request is not valid HTTP/1.1 (for example, a header value holding a "
                                     "control character); nothing was forwarded.", status=status)
        else:
            log.error("unexpected error handling a request%s", named, exc_info=exc)
            problem = Problem("The proxy failed to handle the request.", status=status)
        if request.writer.output_size > 0:  # as aiohttp: an answer was started, the connection is broken
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        response = problem.response()
        response.force_close()  # as aiohttp's own error answer: the connection's state is not to be trusted
        return response


class _Server(web.Server):
    """aiohttp's low-level server, with :class:`_ProblemRequestHandler` for each connection. With ``limits`` (the
    proxy port), one look at every connection's pace per tick while any is open (``check_pace``), a tenth of the
    shortest limit: a limit is kept within a tenth of it, late, never early. One timer for the server, none per
    request or per read (a ``call_later`` and its cancel cost a first request about 1 % more instructions)."""

    def __init__(self, *args: Any, key_headers: frozenset[str], on_unparsed: Callable[[web.BaseRequest, int], None],
                 request_ids: bool = False, limits: ListenConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key_headers = key_headers
        self.on_unparsed = on_unparsed
        self.request_ids = request_ids
        self.limits = limits
        self._tick = min(limits.header_timeout, limits.body_timeout, limits.send_timeout) / 10 if limits else 0.0
        self._pace: asyncio.TimerHandle | None = None

    def __call__(self) -> RequestHandler:
        handler = _ProblemRequestHandler(self, loop=self._loop, **self._kwargs)
        handler.key_headers = self.key_headers
        handler.on_unparsed = self.on_unparsed
        handler.request_ids = self.request_ids
        handler.limits = self.limits
        return handler

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if self._pace is None and self.limits is not None:
            self._pace = self._loop.call_later(self._tick, self._check_pace)

    def _check_pace(self) -> None:
        self._pace = None
        limits = self.limits
        assert limits is not None
        now = self._loop.time()
        try:
            for conn in list(self._connections):
                if isinstance(conn, _ProblemRequestHandler):
                    conn.check_pace(now, limits)
        finally:  # (while any connection is open; the next one made starts it again)
            if self._connections:
                self._pace = self._loop.call_later(self._tick, self._check_pace)

    async def shutdown(self, timeout: float | None = None) -> None:
        if self._pace is not None:
            self._pace.cancel()
            self._pace = None
        await super().shutdown(timeout)


def _close_connection(conn: RequestHandler, _task: asyncio.Task[None]) -> None:
    conn.force_close()


class _AdminRequest(web.Request):
    """A request of the admin port. A request aiohttp's parser refused has no route, so the app's response
    signal never ran for its answer, which went out with aiohttp's banner."""

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        if self._match_info is None:
            await _admin_response_hook(self, response)
        else:
            await super()._prepare_hook(response)


class AdminRunner(web.AppRunner):
    """``web.AppRunner`` for the admin port, its own error answers made as the proxy port's are: problem+json,
    no banner, and the refused line neither echoed nor logged (it may hold the admin token)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return _Server(
            server.request_handler, request_factory=partial(self.app._make_request, _cls=_AdminRequest),
            handler_cancellation=server.handler_cancellation, loop=server._loop,
            key_headers=frozenset(), on_unparsed=lambda _request, _status: None, **server._kwargs,
        )


class _ProxyRunner(web.BaseRunner):
    """``web.AppRunner``'s life cycle for the proxy's low-level server: open the Proxy before serving, stop it
    after the last handler finished."""

    def __init__(self, proxy: Proxy, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proxy = proxy
        self._started = False

    async def shutdown(self) -> None:
        # aiohttp calls this once the sites stopped accepting, before closing the connections
        assert self.server is not None
        await self._proxy.finish_requests(self.server)

    async def _make_server(self) -> web.Server:
        await self._proxy.start()
        self._started = True
        return self._proxy.proxy_server(**self._kwargs)

    async def _cleanup_server(self) -> None:
        if self._started:
            self._started = False
            await self._proxy.stop()


def _transfer_coding(request: web.BaseRequest) -> web.Response | None:
    """A transfer coding other than chunked gets 501 (RFC 9112 §6.1; nginx answers so too): aiohttp takes chunked
    off the end of a list and leaves the rest undecoded, so the body would reach the upstream as something else,
    no longer named (and be fingerprinted so). The connection closes: the body is not read.

    HTTP/1.0 has no transfer codings: its framing is faulty whatever the coding (RFC 9112 §6.1), and a hop in
    front that reads it by Content-Length or to the close would see other requests in the bytes aiohttp decodes
    as chunked and keeps the connection alive past. 400, and the connection closes."""
    if request.version < HttpVersion11:
        refused = BadRequest("HTTP/1.0 has no transfer codings; send the body with Content-Length.").response()
        refused.force_close()
        return refused
    codings = ",".join(request.headers.getall("Transfer-Encoding"))
    if codings.isascii() and [coding.strip().lower() for coding in codings.split(",") if coding.strip()] == ["chunked"]:
        return None
    refused = BadRequest(f"The transfer coding {codings[:64]!r} is not supported; send the body with "
                         "Content-Length, or chunked alone.", status=501).response()
    refused.force_close()
    return refused


def _expect(request: web.BaseRequest) -> web.Response | None:
    """``Expect`` (RFC 9110 §10.1.1): any expectation but "100-continue" gets 417; "100-continue" with a body to
    come gets its interim 100 when the body is first read (``proxy.CONTINUE``), so a request refused before
    that is answered without the upload; HTTP/1.0 requests' ``Expect`` is ignored."""
    if request.version != HttpVersion11:
        return None
    # A list, in one header line or several; an empty member names no expectation (as web.Application read it).
    members = [member.strip() for value in request.headers.getall("Expect") for member in value.split(",")]
    unknown = [member for member in members if member and member.lower() != "100-continue"]
    if unknown:
        refused = BadRequest(f"Unknown expectation: {', '.join(unknown)[:64]!r}; only 100-continue is supported.",
                             status=417).response()
        if request.body_exists:  # answered without reading its body: the client's retry must not be read as it
            refused.force_close()
        return refused
    if any(members) and request.body_exists and not request.content.is_eof():
        request[CONTINUE] = True
    return None
