"""The idempotency state machine: the one place that decides replay / 409 / 422 / forward / store / release.

For each request, in the order CONTRACT "How a request is handled" gives:

1. method not covered or route disabled           → plain reverse proxy (streamed)
2. no key and the route does not require one      → plain reverse proxy
3. tenant (401 missing_tenant), key (400 missing_key / invalid_key)
4. body read up to max_request_body               → 413 body_too_large
5. fingerprint over method, path+query, chosen headers, body
6. claim: replay | 422 payload_mismatch | 409 in_flight (or wait) | own the key
7. own: forward once, then complete / release / keep the lease per the outcome table, then answer.
   Step 7 runs in a shielded task: a client that vanishes cancels neither the upstream call nor the
   store write that follows it.

Stores know nothing of HTTP and the proxy module knows nothing of records; this module joins them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from idemproxy.config import Config, IdempotencyConfig
from idemproxy.fingerprint import fingerprint
from idemproxy.metrics import Metrics
from idemproxy.problems import (
    BodyTooLarge,
    InFlight,
    InvalidKey,
    MissingKey,
    MissingTenant,
    PayloadMismatch,
    Problem,
    ResponseNotReplayable,
    StoreUnavailable,
    UpstreamReset,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from idemproxy.proxy import (
    CHUNK,
    REQUEST_ID,
    Upstream,
    Upstreams,
    client_response_headers,
    filter_headers,
    read_at_most,
    stream_response,
    upstream_errors,
    upstream_request_headers,
)
from idemproxy.store.base import Claim, State, Store, StoredResponse

_T = TypeVar("_T")

log = logging.getLogger("idemproxy.engine")
access_log = logging.getLogger("idemproxy.access")

UNGUARDED_HEADER = "Idempotency-Status"
ANONYMOUS_TENANT = "-"
_UNKNOWN_STATUSES = frozenset({502, 504})  # the upstream (or a gateway before it) may have executed


@dataclass
class _Exchange:
    """What one request did, for metrics and the access log."""

    upstream: Upstream  # the route's upstream, chosen once per request
    outcome: str = "passthrough"
    upstream_seconds: float = 0.0
    tenant: str = ""
    key: str = ""
    status: int = 0


@dataclass
class _Forwarded:
    """The upstream's answer after the record was settled."""

    upstream: aiohttp.ClientResponse
    head: bytes
    complete: bool


def parse_key(values: list[str], max_length: int) -> str:
    """Validate the Idempotency-Key header; a quoted sf-string means the same key unquoted."""
    if len(values) != 1:
        raise InvalidKey("The idempotency key header must be sent exactly once.")
    key = values[0].strip()
    if key.startswith('"'):  # an RFC 9651 sf-string: must be closed, and means the key it quotes
        if len(key) < 2 or not key.endswith('"'):
            raise InvalidKey("The quoted idempotency key has no closing quote.")
        key = _unquote_sf_string(key[1:-1])
    if not key:
        raise InvalidKey("The idempotency key is empty.")
    if len(key) > max_length:
        raise InvalidKey(f"The idempotency key is longer than {max_length} characters.")
    if not all(" " <= ch <= "~" for ch in key):
        raise InvalidKey("The idempotency key must be printable ASCII.")
    return key


def _unquote_sf_string(inner: str) -> str:
    out: list[str] = []
    chars = iter(inner)
    for ch in chars:
        if ch == "\\":
            escaped = next(chars, "")
            if escaped not in ('"', "\\"):
                raise InvalidKey("The quoted idempotency key has an invalid escape.")
            out.append(escaped)
        elif ch == '"':
            raise InvalidKey("The quoted idempotency key has an unescaped quote.")
        else:
            out.append(ch)
    return "".join(out)


def short_hash(value: str) -> str:
    """A log-safe stand-in for a tenant or key (raw keys and credentials never reach the logs)."""
    return hashlib.sha256(value.encode()).hexdigest()[:12] if value else ""


class Engine:
    """Serves every request on the proxy port."""

    def __init__(self, config: Config, store: Store, upstreams: Upstreams, metrics: Metrics) -> None:
        self.config = config
        self.store = store
        self.upstreams = upstreams
        self.metrics = metrics
        self._tasks: set[asyncio.Task[_Forwarded]] = set()
        # Access lines are written at the configured level (so "debug" hides them under an info root).
        level = config.log.access
        self._access_level: int | None = None if level == "OFF" else logging.getLevelName(level)

    async def drain(self) -> None:
        """Wait for every shielded forward-and-store task (called at shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ entry

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        route = self.config.route_for(request.path)
        idem = route.idempotency if route is not None else self.config.idempotency
        exchange = _Exchange(upstream=self.upstreams.for_route(route))
        try:
            if (route is not None and not route.enabled) or request.method not in idem.methods:
                response = await self._passthrough(request, exchange)
            else:
                response = await self._covered(request, idem, exchange)
            exchange.status = response.status
            return response
        except Problem as problem:
            exchange.outcome, exchange.status = problem.outcome, problem.status
            raise
        finally:
            self._observe(request, route.prefix if route else "other", exchange, started)

    def _observe(self, request: web.Request, route: str, ex: _Exchange, started: float) -> None:
        total = time.perf_counter() - started
        m = self.metrics
        m.requests.labels(route, request.method, ex.outcome).inc()
        m.request_duration.labels(ex.outcome).observe(total)
        m.overhead.labels(ex.outcome).observe(max(total - ex.upstream_seconds, 0.0))
        if ex.upstream_seconds:
            m.upstream_duration.observe(ex.upstream_seconds)
        if self._access_level is None or not access_log.isEnabledFor(self._access_level):
            return
        access_log.log(
            self._access_level, "%s %s %s %s %.1fms", request.method, request.path, ex.status, ex.outcome,
            total * 1000,
            extra={
                "method": request.method, "path": request.path,
                "outcome": ex.outcome, "status": ex.status, "route": route,
                "tenant": self._loggable_tenant(ex.tenant), "key_hash": short_hash(ex.key),
                "duration_ms": round(total * 1000, 3),
                "upstream_ms": round(ex.upstream_seconds * 1000, 3), "request_id": request.get(REQUEST_ID, ""),
            },
        )

    def _loggable_tenant(self, tenant: str) -> str:
        """The tenant id (what the admin API takes) when it is a hash or a static name; else its hash."""
        tenant_config = self.config.tenant
        return tenant if tenant_config.hash or tenant_config.from_ == "static" else short_hash(tenant)

    async def _timed_upstream(self, ex: _Exchange, call: Callable[[], Awaitable[_T]]) -> _T:
        started = time.perf_counter()
        try:
            return await call()
        finally:
            ex.upstream_seconds += time.perf_counter() - started

    async def _passthrough(self, request: web.Request, ex: _Exchange) -> web.StreamResponse:
        ex.outcome = "passthrough"
        return await self._timed_upstream(ex, lambda: ex.upstream.passthrough(request))

    # ------------------------------------------------------------------ covered requests

    async def _covered(
        self, request: web.Request, idem: IdempotencyConfig, ex: _Exchange
    ) -> web.StreamResponse:
        key_values = request.headers.getall(idem.header, [])
        if not key_values and not idem.required:
            return await self._passthrough(request, ex)
        ex.tenant = tenant = self.resolve_tenant(request)
        if not key_values:
            raise MissingKey(f"This route requires an {idem.header} header.")
        ex.key = key = parse_key(key_values, idem.key_max_length)
        body = await read_body(request, idem.max_request_body)
        fp = fingerprint(
            request.method, request.raw_path,
            ((name, ",".join(request.headers.getall(name, []))) for name in idem.fingerprint_headers),
            body, canonical=idem.canonical_json,
        )
        try:
            claim = await self._claim(tenant, key, fp, idem)
        except StoreUnavailable:
            if self.config.storage.on_store_error == "fail_closed":
                raise
            return await self._unguarded(request, body, idem, ex)
        return await self._decide(request, claim, fp, body, idem, ex)

    def resolve_tenant(self, request: web.Request) -> str:
        """The tenant a key belongs to; the credential itself is hashed and never stored."""
        return self.resolve_tenant_value(request.headers.get(self.config.tenant.header))

    def resolve_tenant_value(self, value: str | None) -> str:
        """The tenant id for a tenant header value (the same rule the admin API uses)."""
        tenant = self.config.tenant
        if tenant.from_ == "static":
            return tenant.static
        if not value:
            if tenant.required:
                raise MissingTenant(f"The {tenant.header} header is required to scope idempotency keys.")
            return ANONYMOUS_TENANT
        return hashlib.sha256(value.encode()).hexdigest() if tenant.hash else value

    async def _claim(self, tenant: str, key: str, fp: str, idem: IdempotencyConfig) -> Claim:
        """Claim the key; in ``wait`` mode, wait (woken by the store's notifications) for the owner."""
        if idem.in_flight == "reject":
            return await self.store.claim(tenant, key, fp, lease=idem.lease, ttl=idem.ttl)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + idem.wait_timeout
        while True:
            # Watch before reading: a completion between the read and the wait still wakes us.
            with self.store.watch(tenant, key) as changed:
                claim = await self.store.claim(tenant, key, fp, lease=idem.lease, ttl=idem.ttl)
                record = claim.record
                if claim.owned or record.state is State.COMPLETED or record.fingerprint != fp:
                    return claim
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return claim
                lease_left = (record.lease_expires_at or claim.now) - claim.now
                # Past the lease the record may be taken over, so look again then at the latest.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed, min(remaining, max(lease_left, 0.01)))

    async def _decide(
        self, request: web.Request, claim: Claim, fp: str, body: bytes,
        idem: IdempotencyConfig, ex: _Exchange,
    ) -> web.StreamResponse:
        record = claim.record
        if claim.owned:
            if claim.took_over:
                self.metrics.lease_takeovers.inc()
                log.warning("lease taken over for tenant %s key %s", short_hash(record.tenant),
                            short_hash(record.key))
            if claim.replaced_expired:
                self.metrics.records_expired.inc()
            ex.outcome = "forwarded"
            return await self._execute(request, claim, body, idem, ex)
        if record.fingerprint != fp:
            ex.outcome = "payload_mismatch"
            raise PayloadMismatch(
                "This idempotency key was already used with a different request payload.",
                status=idem.mismatch_status,
            )
        if record.state is State.COMPLETED:
            ex.outcome = "replayed"
            return self._replay(claim, idem)
        lease_left = (record.lease_expires_at or claim.now) - claim.now
        raise InFlight(
            "A request with this idempotency key is still being processed; retry later.",
            lease_expires_in=lease_left, status=idem.in_flight_status,
        )

    def _replay(self, claim: Claim, idem: IdempotencyConfig) -> web.Response:
        stored = claim.record.response
        assert stored is not None
        if stored.body is None:
            raise ResponseNotReplayable(
                "The original response was too large to store; the request was executed once "
                "and will not be executed again.",
                original_status=stored.status,
            )
        headers = CIMultiDict(stored.headers)
        headers[idem.replay_header] = "true"
        return web.Response(status=stored.status, headers=headers, body=stored.body)

    # ------------------------------------------------------------------ forwarding the owner

    async def _execute(
        self, request: web.Request, claim: Claim, body: bytes, idem: IdempotencyConfig, ex: _Exchange
    ) -> web.StreamResponse:
        task = asyncio.ensure_future(self._forward_and_settle(request, claim, body, idem, ex))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.metrics.in_flight.inc()
        task.add_done_callback(lambda _: self.metrics.in_flight.dec())
        try:
            forwarded = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_release_upstream)  # nobody will read the answer now
            raise
        except (UpstreamReset, UpstreamTimeout, UpstreamUnreachable):
            ex.outcome = "upstream_error"
            raise
        headers = [(idem.replay_header, "false")]
        try:
            if forwarded.complete:
                out = client_response_headers(forwarded.upstream)
                out.extend(headers)
                return web.Response(
                    status=forwarded.upstream.status, reason=forwarded.upstream.reason,
                    headers=out, body=forwarded.head,
                )
            return await stream_response(
                request, forwarded.upstream, head=forwarded.head, extra_headers=headers
            )
        finally:
            forwarded.upstream.release()

    async def _forward_and_settle(
        self, request: web.Request, claim: Claim, body: bytes, idem: IdempotencyConfig, ex: _Exchange
    ) -> _Forwarded:
        """Forward once; then store, release or keep the lease (outcome table) before answering."""
        headers = upstream_request_headers(request, drop=() if ex.upstream.config.forward_key
                                           else (idem.header,))
        started = time.perf_counter()
        try:
            with upstream_errors():
                async with asyncio.timeout(ex.upstream.config.timeout):
                    upstream = await ex.upstream.send(request, headers, body)
                    head, complete = await read_at_most(upstream, idem.max_stored_response)
        except UpstreamUnreachable:
            await self._settle(self.store.release(claim), "release")
            raise
        except (UpstreamTimeout, UpstreamReset) as problem:
            await self._unknown_outcome(claim, idem, problem_response(problem))
            raise
        finally:
            ex.upstream_seconds += time.perf_counter() - started
        try:
            await self._settle_answer(claim, idem, upstream, head, complete, request.get(REQUEST_ID, ""))
        except BaseException:
            upstream.release()
            raise
        return _Forwarded(upstream=upstream, head=head, complete=complete)

    async def _settle_answer(
        self, claim: Claim, idem: IdempotencyConfig, upstream: aiohttp.ClientResponse,
        head: bytes, complete: bool, request_id: str = "",
    ) -> None:
        status = upstream.status
        stored = StoredResponse(
            status=status,
            headers=tuple(replay_headers(upstream, idem, request_id).items()),
            body=head if complete else None,
        )
        if status in idem.release_statuses or (status >= 500 and not idem.store_5xx
                                                and status not in _UNKNOWN_STATUSES):
            await self._settle(self.store.release(claim), "release")
        elif status in _UNKNOWN_STATUSES:
            await self._unknown_outcome(claim, idem, stored)
        else:
            await self._complete(claim, stored, idem)

    async def _unknown_outcome(
        self, claim: Claim, idem: IdempotencyConfig, answer: StoredResponse
    ) -> None:
        """The upstream may or may not have executed: apply ``on_unknown_outcome``."""
        if idem.on_unknown_outcome == "release":
            await self._settle(self.store.release(claim), "release")
        elif idem.on_unknown_outcome == "store":
            await self._complete(claim, answer, idem)
        # keep_lease: the record stays in flight; after the lease a retry takes it over.

    async def _complete(self, claim: Claim, stored: StoredResponse, idem: IdempotencyConfig) -> None:
        done = await self._settle(self.store.complete(claim, stored, ttl=idem.ttl), "complete")
        if done is False:
            log.warning("completion refused: the lease was taken over (tenant %s key %s)",
                        short_hash(claim.record.tenant), short_hash(claim.record.key))

    async def _settle(self, operation: Awaitable[bool], name: str) -> bool | None:
        """Run a store write after the upstream answered. If the store is down now, the client still
        gets the upstream's answer (it was executed); the record keeps its lease and runs out."""
        try:
            return await operation
        except StoreUnavailable:
            log.error("store unavailable during %s; the record keeps its lease until it runs out", name)
            return None

    # ------------------------------------------------------------------ fail open

    async def _unguarded(
        self, request: web.Request, body: bytes, idem: IdempotencyConfig, ex: _Exchange
    ) -> web.StreamResponse:
        ex.outcome = "store_error"
        log.warning("store unavailable: forwarding %s %s unguarded (fail_open)",
                    request.method, request.path)

        async def call() -> web.StreamResponse:
            upstream = await ex.upstream.send(request, upstream_request_headers(request), body)
            try:
                return await stream_response(
                    request, upstream,
                    extra_headers=[(UNGUARDED_HEADER, "unguarded"), (idem.replay_header, "false")],
                )
            finally:
                upstream.release()

        return await self._timed_upstream(ex, call)


def replay_headers(
    upstream: aiohttp.ClientResponse, idem: IdempotencyConfig, request_id: str = ""
) -> CIMultiDict[str]:
    """The headers a replay may carry: no hop-by-hop, Date, Content-Length or stripped names; plus the
    executing request's id as Original-Request-Id (only replays carry it: the live answer is not built
    from these)."""
    drop = {"date", "content-length", idem.replay_header.lower(), "original-request-id"}
    drop.update(name.lower() for name in idem.strip_replay_headers)
    headers = filter_headers(upstream.headers, drop=drop)
    if request_id:
        headers["Original-Request-Id"] = request_id
    return headers


def problem_response(problem: Problem) -> StoredResponse:
    """A proxy problem as a storable answer (``on_unknown_outcome: store``)."""
    response = problem.response()
    assert isinstance(response.body, bytes)
    return StoredResponse(
        status=problem.status,
        headers=(("Content-Type", "application/problem+json"),),
        body=response.body,
    )


def _release_upstream(task: asyncio.Task[_Forwarded]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().upstream.release()


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` (checked before reading when declared)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"The request body is larger than {limit} bytes.", max_bytes=limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(CHUNK):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"The request body is larger than {limit} bytes.", max_bytes=limit)
        parts.append(chunk)
    return b"".join(parts)
