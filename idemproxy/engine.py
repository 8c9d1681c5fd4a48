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
from functools import partial
from typing import Literal, TypeVar

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from idemproxy.client import UpstreamResponse, UpstreamUnrelayable
from idemproxy.config import (
    TENANT_MAX_BYTES,
    AmbiguousPath,
    Config,
    IdempotencyConfig,
    TenantConfig,
    lease_margin,
)
from idemproxy.fingerprint import OFFLOAD_BYTES, Fingerprinter
from idemproxy.metrics import Metrics, adder
from idemproxy.problems import (
    BadRequest,
    BodyTooLarge,
    ClientGone,
    ClientStalled,
    InFlight,
    InvalidKey,
    MissingKey,
    MissingTenant,
    PayloadMismatch,
    Problem,
    RecordUnreadable,
    ResponseNotReplayable,
    StoreUnavailable,
    UpstreamAnswerRefused,
    UpstreamReset,
    UpstreamTimeout,
    UpstreamUnreachable,
    loggable_path,
)
from idemproxy.proxy import (
    CHUNK,
    REQUEST_ID,
    SMALL_BODY,
    Upstream,
    Upstreams,
    client_response_headers,
    continue_body,
    filter_headers,
    read_at_most,
    request_target,
    stream_response,
    upstream_answer,
    upstream_errors,
)
from idemproxy.replays import ReplayCache
from idemproxy.settle import Settler
from idemproxy.store.base import TAKEOVER_GRACE, Claim, Record, State, Store, StoredResponse, new_token
from idemproxy.tracing import HTTP_STATUS, Span, Tracer

_T = TypeVar("_T")

log = logging.getLogger("idemproxy.engine")
access_log = logging.getLogger("idemproxy.access")

UNGUARDED_HEADER = "Idempotency-Status"
ANONYMOUS_TENANT = "-"
_UNKNOWN_STATUSES = frozenset({502, 504})  # the upstream (or a gateway before it) may have executed
# Claims a reject-mode request makes past records in their grace (store.base.TAKEOVER_GRACE) before it answers
# with what the store says: one to meet the grace, one after it, and one more for a row read stale.
GRACE_ROUNDS = 3
# How long a request waits for the one completion attempt it hurried (a pending answer of its key, held here):
# a store that hangs rather than refuses does not hold it longer; its claim then meets the same store.
HURRY_WAIT = 1.0
# While the store's notifications cannot reach this process (Redis unreachable, PostgreSQL's LISTEN lost), a
# wait-mode request is woken by nothing: it looks at the record again after this long instead of at its deadline,
# twice as long each time up to DEAF_POLL_MAX (a burst of waiters on one key is not a burst of claims every 0.25 s).
DEAF_POLL = 0.25
DEAF_POLL_MAX = 1.0
SETTLE_CHECK = 0.1  # seconds between looks for completions past settle_timeout (one timer, not one per request)


@dataclass
class _Exchange:
    """What one request did, for metrics and the access log."""

    upstream: Upstream  # the route's upstream, chosen once per request
    outcome: str = "passthrough"
    upstream_seconds: float = 0.0
    waited_seconds: float = 0.0  # (wait mode) time waiting for another request's upstream answer
    tenant: str = ""
    key: str = ""
    status: int = 0


@dataclass
class _Forwarded:
    """The upstream's answer after the record was settled."""

    upstream: UpstreamResponse
    head: bytes
    complete: bool


def parse_key(values: list[str], max_length: int) -> str:
    """Validate the Idempotency-Key header; a quoted sf-string means the same key unquoted."""
    if len(values) != 1:
        raise InvalidKey("The idempotency key header must be sent exactly once.")
    key = values[0].strip(" \t")  # HTTP's whitespace only: a no-break space (U+00A0) is no part of HTTP
    if "," in key and _joined_repeat(key):
        raise InvalidKey("The idempotency key header must be sent exactly once (it came as one line repeating "
                         "the same key between commas, as a hop joins a header sent twice).")
    if key.startswith('"'):  # an RFC 9651 sf-string: must be closed, and means the key it quotes
        if len(key) < 2 or not key.endswith('"'):
            raise InvalidKey("The quoted idempotency key has no closing quote.")
        key = _unquote_sf_string(key[1:-1])
    if not key:
        raise InvalidKey("The idempotency key is empty.")
    if len(key) > max_length:
        raise InvalidKey(f"The idempotency key is longer than {max_length} characters.")
    if not (key.isascii() and key.isprintable()):  # exactly " " to "~"
        raise InvalidKey("The idempotency key must be printable ASCII.")
    return key


def _joined_repeat(value: str) -> bool:
    """``k, k``: the form a hop gives a header sent twice when it joins the lines (RFC 9110 §5.3). Read as one key,
    a retry through a hop that keeps one line (``k``) would be another key and run again. Only a list of one key
    repeated is refused: a key may hold a comma (``a, b`` stays the key ``a, b``)."""
    first, *rest = (item.strip(" \t") for item in value.split(","))
    return bool(first) and all(item == first for item in rest)


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


def forwarded_key(key: str) -> str:
    """``key`` as a header value the upstream reads back as ``key``: bare, or as an sf-string when it starts
    with a quote or starts or ends with a space (which a bare value would lose: ``"k "`` would reach the
    upstream as ``k``, another key)."""
    if key[0] not in ' "' and key[-1] != " ":
        return key
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _fingerprint_headers(
    forwarded: CIMultiDict[str], received: CIMultiDictProxy[str], names: tuple[str, ...]
) -> list[tuple[str, list[str]]]:
    """Each of ``names`` with its lines as the upstream gets them (``Upstream.request_headers``): none for one this
    hop drops (named in ``Connection``), this hop's own value for one it sets (X-Forwarded-Host and -Proto from an
    untrusted peer): the bytes hashed are the bytes forwarded. ``Host`` is the exception: this hop sends its own
    (the upstream's) and passes the client's on as X-Forwarded-Host, so it is hashed as received."""
    return [(name, (received if name.lower() == "host" else forwarded).getall(name, [])) for name in names]


def short_hash(value: str) -> str:
    """A log-safe stand-in for a tenant or key (raw keys and credentials never reach the logs)."""
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:12] if value else ""


def _is_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Engine:
    """Serves every request on the proxy port."""

    def __init__(
        self, config: Config, store: Store, upstreams: Upstreams, metrics: Metrics, tracer: Tracer | None = None
    ) -> None:
        self.config = config
        self.tracer = tracer if tracer is not None else Tracer()  # off: every span is a no-op
        self.store = store
        self.upstreams = upstreams
        self.metrics = metrics
        self.settler = Settler(metrics, config.storage.pending_settles)
        self.replays = ReplayCache(config.storage.replay_memory, store.notifications_live)
        self.fingerprint = Fingerprinter()  # a retry's same bytes skip the canonical form
        store.announce_completions(config.waits)  # only `wait` requests listen for a completion
        store.watchers.listeners.append(self.replays.invalidate)
        self._tasks: set[asyncio.Task[_Forwarded | web.Response]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Completions in progress, by their handler's future: when settle_timeout passes and the claim they are
        # for. Looked at every SETTLE_CHECK while any is there (a timer per request would cost each first
        # request 1 % more instructions, for a case that is an outage).
        self._settling: dict[asyncio.Future[None], tuple[float, Claim]] = {}
        self._settle_watch: asyncio.TimerHandle | None = None
        self._in_flight_up, self._in_flight_down = adder(metrics.in_flight), adder(metrics.in_flight, -1)
        # Access lines are written at the configured level (so "debug" hides them under an info root).
        level = config.log.access
        self._access_level: int | None = None if level == "OFF" else logging.getLevelName(level)

    async def drain(self, timeout: float, grace: float) -> None:
        """At shutdown: wait for the shielded forward-and-settle tasks, then flush pending settles, all within
        one ``timeout``. What still runs then is cancelled (a forward cut, a completion attempt abandoned: the
        key keeps its lease, as after a crash) and has ``grace`` seconds more to unwind, in all."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        late = set(self._tasks)
        if late:
            log.warning("shutdown_timeout reached with %d forward(s) or completion(s) still running: cut, their "
                        "keys keep their leases", len(late))
            for task in late:
                task.cancel()
            await asyncio.wait(late, timeout=grace / 2)  # (a release it leaves pending is dropped by the flush)
        await self.settler.flush(max(deadline - loop.time(), 0.0), max(deadline + grace - loop.time(), 0.0))

    # ------------------------------------------------------------------ entry

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            # An absolute-form target without a path (``POST http://host``) has an empty path here, and means
            # ``/`` (RFC 3986 §6.2.3): ``/`` is what is forwarded (``request_target``), so ``/``'s route applies.
            route = self.config.route_for(request.path or "/")
        except AmbiguousPath:  # counted and logged as any refused request, under route "other" (none applies)
            refused = _Exchange(upstream=self.upstreams.for_route(None), outcome=BadRequest.outcome, status=400)
            self._observe(request, "other", refused, started)
            raise BadRequest("The path names another route as an upstream may read it (repeated slashes or dot "
                             "segments resolved, a backslash read as a slash, a leading // as a host, or ;parameters "
                             "dropped); send the path it stands for.") from None
        idem = route.idempotency if route is not None else self.config.idempotency
        exchange = _Exchange(upstream=self.upstreams.for_route(route))
        with self.tracer.server_span(request.method, route.prefix if route else None, request.headers) as span:
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
            except ClientGone:
                exchange.outcome = ""  # (no outcome: a request never received whole is not counted)
                raise
            finally:
                if exchange.outcome:
                    self._observe(request, route.prefix if route else "other", exchange, started)
                if self.tracer.enabled:
                    _annotate(span, exchange)

    def refused(self, request: web.BaseRequest, status: int, *, parsed: bool = True) -> None:
        """A request refused as malformed before this engine saw it (an ``Expect`` other than 100-continue, a
        transfer coding other than chunked, ``CONNECT``, a key header aiohttp's parser refused): counted and
        access-logged as any request refused as malformed is (outcome ``invalid_key``, the contract's one for
        it), under the route its path names (``other`` for none, for a path or method that names none, and for a
        request the parser refused: ``parsed`` false, its method and path unread)."""
        route = "other"
        if parsed and request.method != "CONNECT":  # (an authority-form target names a host, not a path)
            with contextlib.suppress(AmbiguousPath):
                matched = self.config.route_for(request.path or "/")
                route = matched.prefix if matched is not None else "other"
        refused = _Exchange(upstream=self.upstreams.for_route(None), outcome=BadRequest.outcome, status=status)
        self._observe(request, route, refused, time.perf_counter())

    def _observe(self, request: web.BaseRequest, route: str, ex: _Exchange, started: float) -> None:
        total = time.perf_counter() - started
        counted = self.metrics.per_request(route, request.method, ex.outcome)
        counted.count()
        counted.duration(total)
        counted.overhead(max(total - ex.upstream_seconds - ex.waited_seconds, 0.0))
        if ex.upstream_seconds:
            self.metrics.observe_upstream(ex.upstream_seconds)
        if self._access_level is None or not access_log.isEnabledFor(self._access_level):
            return
        path = loggable_path(request)
        request_id = request.get(REQUEST_ID, "")
        access_log.log(  # the text line names the request id too: find one request by the id its client got
            self._access_level, "%s %s %s %s %.1fms %s", request.method, path, ex.status, ex.outcome,
            total * 1000, request_id,
            extra={
                "method": request.method, "path": path,
                "outcome": ex.outcome, "status": ex.status, "route": route,
                "tenant": self._loggable_tenant(ex.tenant), "key_hash": short_hash(ex.key),
                "duration_ms": round(total * 1000, 3),
                "upstream_ms": round(ex.upstream_seconds * 1000, 3), "request_id": request_id,
            },
        )

    def _loggable_tenant(self, tenant: str) -> str:
        """The tenant id (what the admin API takes) when it is a hash or a static name; else its hash."""
        tenant_config = self.config.tenant
        return tenant if tenant_config.hash or tenant_config.from_ == "static" else short_hash(tenant)

    async def _timed_upstream(self, ex: _Exchange, call: Callable[[], Awaitable[_T]]) -> _T:
        started = time.perf_counter()
        with self.tracer.span("idemproxy.forward", client=True) as span:
            try:
                result = await call()
            finally:
                ex.upstream_seconds += time.perf_counter() - started
            if isinstance(result, web.StreamResponse):
                span.set_attribute(HTTP_STATUS, result.status)
            return result

    async def _passthrough(self, request: web.BaseRequest, ex: _Exchange) -> web.StreamResponse:
        ex.outcome = "passthrough"
        if self.tracer.enabled:
            return await self._timed_upstream(ex, lambda: ex.upstream.passthrough(request))
        started = time.perf_counter()  # _timed_upstream without its span, lambda and coroutine
        try:
            return await ex.upstream.passthrough(request)
        finally:
            ex.upstream_seconds += time.perf_counter() - started

    # ------------------------------------------------------------------ covered requests

    async def _covered(
        self, request: web.BaseRequest, idem: IdempotencyConfig, ex: _Exchange
    ) -> web.StreamResponse:
        key_values = request.headers.getall(idem.header, [])
        if not key_values and not idem.required:
            return await self._passthrough(request, ex)
        ex.tenant = tenant = self.resolve_tenant(request)
        if not key_values:
            raise MissingKey(f"This route requires an {idem.header} header.")
        ex.key = key = parse_key(key_values, idem.key_max_length)
        body = await read_body(request, idem.max_request_body)
        headers = (_fingerprint_headers(ex.upstream.request_headers(request, drop=(idem.header,)), request.headers,
                                        idem.fingerprint_headers) if idem.fingerprint_headers else ())
        if len(body) < OFFLOAD_BYTES:
            fp = self.fingerprint(request.method, request_target(request), headers, body, canonical=idem.canonical_json)
        else:  # a large body's canonical form off the loop, so it holds up no other client
            fp = await self.fingerprint.large(
                request.method, request_target(request), headers, body, canonical=idem.canonical_json)
        try:
            with self.tracer.span("idemproxy.claim") as span:
                claim = await self._claim(tenant, key, fp, idem, ex)
                span.set_attribute("idemproxy.owned", claim.owned)
        except StoreUnavailable as exc:
            # An unreadable record stands for a request already executed: never forward it again, even fail_open.
            if self.config.storage.on_store_error == "fail_closed" or isinstance(exc, RecordUnreadable):
                raise
            return await self._unguarded(request, body, idem, ex)
        return await self._decide(request, claim, fp, body, idem, ex)

    def resolve_tenant(self, request: web.BaseRequest) -> str:
        """The tenant a key belongs to; the credential itself is hashed and never stored. A tenant header sent
        more than once names no one tenant: refused, as a repeated key is (a gateway that appends the tenant it
        authenticated after one the client forged would otherwise have the key scoped to the forged one)."""
        tenant = self.config.tenant
        if tenant.from_ == "static":
            return tenant.static
        values = request.headers.getall(tenant.header, ())
        if len(values) > 1:
            raise MissingTenant(f"The {tenant.header} header was sent {len(values)} times; a key belongs to one "
                                f"tenant: send it once.")
        return self.resolve_tenant_value(values[0] if values else None)

    def resolve_tenant_value(self, value: str | None) -> str:
        """The tenant id for a tenant header value (the same rule the admin API uses)."""
        return tenant_id(self.config.tenant, value)

    async def _claim(
        self, tenant: str, key: str, fp: str, idem: IdempotencyConfig, ex: _Exchange | None = None
    ) -> Claim:
        """Claim the key; in ``wait`` mode, wait (woken by the store's notifications) for the owner. The wait
        is time waiting on the owner's upstream, not the proxy's overhead (``ex.waited_seconds``).

        A record whose lease ran out is given TAKEOVER_GRACE by the store before a claim may take it over (its
        owner may still land the answer it holds): a request that meets it waits that out, in either mode, and
        claims again: it then takes the key over, or finds the owner's answer."""
        if idem.in_flight == "reject":
            claim = await self._claim_once(tenant, key, fp, idem)
            for _ in range(GRACE_ROUNDS):
                if not _lapsed(claim, fp):
                    return claim
                waiting = time.perf_counter()
                # The grace (and a hair more: the store judges by its transaction's start), or nothing: the row
                # was read stale.
                await asyncio.sleep(max(claim.lease_left() + 0.01, 0.0))
                if ex is not None:
                    ex.waited_seconds += time.perf_counter() - waiting
                claim = await self._claim_once(tenant, key, fp, idem)
            return claim
        loop = asyncio.get_running_loop()
        deadline = loop.time() + idem.wait_timeout
        poll = DEAF_POLL
        while True:
            # Watch before reading: a completion between the read and the wait still wakes us.
            with self.store.watch(tenant, key) as changed:
                claim = await self._claim_once(tenant, key, fp, idem)
                record = claim.record
                if claim.owned or record.state is State.COMPLETED or record.fingerprint != fp:
                    return claim
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return claim
                lease_left = (record.lease_expires_at or claim.now) - claim.now
                # Past the lease the record may be taken over, so look again then at the latest.
                wait = min(remaining, max(lease_left, 0.01))
                if not self.store.notifications_live():
                    wait, poll = min(wait, poll), min(poll * 2, DEAF_POLL_MAX)
                waiting = time.perf_counter()
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed, wait)
                finally:
                    if ex is not None:
                        ex.waited_seconds += time.perf_counter() - waiting

    async def _claim_once(self, tenant: str, key: str, fp: str, idem: IdempotencyConfig) -> Claim:
        cached = self.replays.get(tenant, key)
        if cached is not None:  # a completed record this process read lately: no network at all
            return Claim(record=cached, owned=False, sent=time.monotonic(), now=time.time())
        if self.settler.named:  # an answer this replica executed for the key and still holds: store it first
            await self.settler.hurry((tenant, key), HURRY_WAIT)
        token = new_token()
        # The lease is counted from the instant the store gives (Claim.sent): just before its deciding statement
        # was written, so before the store's clock started the lease; time the statement then spent blocked (a
        # row lock, a commit wait) is already gone from it.
        seen = self.replays.begin()
        sent = time.monotonic()  # (earlier still: a claim that may have landed unanswered is released by then)
        try:
            claim = await self.store.claim(tenant, key, fp, lease=idem.lease, ttl=idem.ttl, token=token)
            if not claim.owned:
                self.replays.put(claim, seen)
            return claim
        except StoreUnavailable as exc:
            if exc.maybe_applied:
                self._release_ghost(tenant, key, fp, token, idem, sent)
            raise
        except asyncio.CancelledError:  # the claim goes on without us (a batch on the wire): it may land
            self._release_ghost(tenant, key, fp, token, idem, sent)
            raise

    def _release_ghost(
        self, tenant: str, key: str, fp: str, token: str, idem: IdempotencyConfig, sent: float
    ) -> None:
        """A claim may have landed although its answer never reached us (a timeout, a cut after the commit, a
        cancelled caller): the key would then sit in flight for a whole lease with nothing sent. Release it with
        the token it would carry (fenced: harmless if it never landed), in the background."""
        now = time.time()
        ghost = Claim(record=Record(
            tenant=tenant, key=key, fingerprint=fp, state=State.IN_FLIGHT, lease_token=token,
            lease_expires_at=now + idem.lease, response=None, created_at=now, completed_at=None,
            expires_at=now + idem.ttl,
        ), owned=True, now=now, sent=sent)
        async def release() -> bool:
            return await self.store.release(ghost)

        first = self.settler.release_later(release, until=sent + idem.lease)
        # A statement of the claim may still be on the server though its connection is gone (queued on a lock the
        # release above does not wait for: one table's rows), and land after that release, holding the key for the
        # lease. As a rule none can by claim_settled_within after the claim failed (now): release once more then
        # (fenced: a no-op when nothing landed, or the key was taken over).
        if self.store.claim_settled_within:
            self.settler.release_again_at(release, after=first,
                                          at=time.monotonic() + self.store.claim_settled_within,
                                          until=sent + idem.lease)

    async def _decide(
        self, request: web.BaseRequest, claim: Claim, fp: str, body: bytes,
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
        return self._answer_record(record, fp, idem, claim.now, ex)

    def _answer_record(
        self, record: Record, fp: str, idem: IdempotencyConfig, now: float, ex: _Exchange | None
    ) -> web.Response:
        """What a standing record means for a request that does not own it: 422, replay or 409."""
        if record.fingerprint != fp:
            if ex is not None:
                ex.outcome = "payload_mismatch"
            raise PayloadMismatch(
                "This idempotency key was already used with a different request payload.",
                status=idem.mismatch_status,
            )
        if record.state is State.COMPLETED:
            if ex is not None:
                ex.outcome = "replayed"
            return self._replay(record, idem)
        lease_left = (record.lease_expires_at or now) - now
        raise InFlight(
            "A request with this idempotency key is still being processed; retry later.",
            lease_expires_in=lease_left, status=idem.in_flight_status,
        )

    def _replay(self, record: Record, idem: IdempotencyConfig) -> web.Response:
        stored = record.response
        assert stored is not None
        headers = CIMultiDict(stored.headers)
        if stored.body is None:
            problem = ResponseNotReplayable(
                "The original response was too large to store, or in a form the proxy does not relay; the "
                "request was executed once and will not be executed again.",
                original_status=stored.status,
            )
            original = headers.get("Original-Request-Id")  # who executed it, as a replay says
            if original is not None:
                problem.headers["Original-Request-Id"] = original
            raise problem
        headers[idem.replay_header] = "true"
        return upstream_answer(stored.status, None, headers, stored.body)

    # ------------------------------------------------------------------ forwarding the owner

    async def _execute(
        self, request: web.BaseRequest, claim: Claim, body: bytes, idem: IdempotencyConfig, ex: _Exchange
    ) -> web.StreamResponse:
        # The forward runs in a task of its own, which this handler waits for without owning it (as
        # asyncio.shield, with one future and one callback instead of shield's two of each): a cancelled handler
        # (a client gone, a shutdown past its timeout) leaves the forward and its settle running.
        loop = self._loop
        if loop is None:  # (the serving loop, kept: asyncio.get_running_loop() costs a system call on 3.11)
            loop = self._loop = asyncio.get_running_loop()
        done = loop.create_future()
        task = loop.create_task(self._forward_and_settle(request, claim, body, idem, ex, done))
        self._tasks.add(task)
        self._in_flight_up()
        task.add_done_callback(partial(self._forward_done, done))
        try:
            await done
            if not task.done():  # settle_timeout passed while the completion was still on its way
                task.add_done_callback(_release_upstream)  # it goes on; nobody will read the answer now
                raise _not_stored_yet()
            forwarded = task.result()
        except asyncio.CancelledError:
            task.add_done_callback(_release_upstream)  # nobody will read the answer now
            raise
        except (UpstreamReset, UpstreamTimeout, UpstreamUnreachable):
            ex.outcome = "upstream_error"
            raise
        if isinstance(forwarded, web.Response):
            return forwarded  # the completion was refused: what the record says now
        headers = [(idem.replay_header, "false")]
        try:
            if forwarded.complete:
                out = client_response_headers(forwarded.upstream, headers)
                _head_length(request.method, forwarded.upstream, out)
                return upstream_answer(forwarded.upstream.status, forwarded.upstream.reason, out, forwarded.head)
            # The rest of a body too large to keep comes from the upstream as it is relayed: time waiting on
            # the upstream, as a pass-through's streamed answer is counted, not the proxy's own overhead. The
            # request is still being forwarded meanwhile (idemproxy_in_flight_requests), its forward's task done.
            started = time.perf_counter()
            self._in_flight_up()
            try:
                return await stream_response(
                    request, forwarded.upstream, head=forwarded.head, extra_headers=headers
                )
            finally:
                self._in_flight_down()
                ex.upstream_seconds += time.perf_counter() - started
        finally:
            forwarded.upstream.release()

    def _forward_done(self, done: asyncio.Future[None], task: asyncio.Task[_Forwarded | web.Response]) -> None:
        self._tasks.discard(task)
        self._in_flight_down()
        if not done.done():  # (cancelled when the handler was)
            done.set_result(None)

    async def _forward_and_settle(
        self, request: web.BaseRequest, claim: Claim, body: bytes, idem: IdempotencyConfig, ex: _Exchange,
        due: asyncio.Future[None],
    ) -> _Forwarded | web.Response:
        """Forward once; then store, release or keep the lease (outcome table) before answering.

        Returns the upstream's answer once its record is settled, or (when the completion was refused) the
        answer the record gives now: an answer that is not stored never reaches the client (guarantee 2).
        ``due`` is the handler's: set when ``settle_timeout`` has passed with the completion still on its way,
        so the client gets its 503 on time while this task goes on.
        """
        try:
            # Everything that can fail before a byte is sent: a failure here releases the key at once.
            headers = ex.upstream.request_headers(request, drop=(idem.header,))
            if ex.upstream.config.forward_key:
                # The key as the proxy understood it, so the upstream can dedupe a takeover ('"k"' is 'k').
                headers[idem.header] = forwarded_key(claim.record.key)
            timeout = ex.upstream.config.timeout
            # The forward is over by ``send_by``, before anyone may take the key over; budget <= 0: the claim
            # itself took most of the lease, never forward into a takeover. The client looks at ``send_by``
            # again just before the first byte leaves, on a clock read then (guarantee 1 under a paused process).
            send_by = claim.lease_end() - lease_margin(idem.lease, timeout)
            budget = min(timeout, send_by - time.monotonic())
            if budget <= 0:
                raise StoreUnavailable("The idempotency store answered too slowly; nothing was sent.")
            ex.upstream.target(request)
        except BaseException:
            await self.settler.release(lambda: self.store.release(claim), until=claim.lease_end())
            raise
        started = time.perf_counter()
        try:
            with self.tracer.span("idemproxy.forward", client=True) as span, upstream_errors():
                # The budget bounds the exchange and the body's reads; spent before a byte left, the key is
                # released as "nothing sent" (UpstreamUnreachable), after, the outcome is unknown until the
                # answer's status came (then it settles the key, whatever is lost after it: _read_answer).
                upstream = await ex.upstream.send(request, headers, body, timeout=budget, send_by=send_by)
                head, complete = await _read_answer(upstream, idem.max_stored_response)
                if complete:
                    upstream.release()  # read whole: its connection serves others while the answer is stored
                span.set_attribute(HTTP_STATUS, upstream.status)
        except (UpstreamUnreachable, BadRequest, StoreUnavailable) as problem:  # nothing was sent (the last: late)
            _note_held_up(problem, claim, send_by)
            await self.settler.release(lambda: self.store.release(claim), until=claim.lease_end())
            raise
        except (UpstreamTimeout, UpstreamReset) as problem:
            with self.tracer.span("idemproxy.settle"):
                if isinstance(problem, UpstreamAnswerRefused) and problem.original_status:
                    return await self._unrelayable(claim, idem, problem, request.get(REQUEST_ID, ""), due)
                refused = await self._unknown_outcome(
                    claim, idem, problem_response(problem, request.get(REQUEST_ID, "")), due)
            if refused is not None:  # (store mode) the completion was refused: what the record says now
                return refused
            raise
        finally:
            ex.upstream_seconds += time.perf_counter() - started
        try:
            with self.tracer.span("idemproxy.settle"):
                refused = await self._settle_answer(claim, idem, upstream, head, complete,
                                                    request.get(REQUEST_ID, ""), due, request.method)
        except BaseException:
            upstream.release()
            raise
        if refused is not None:
            upstream.release()
            return refused
        if not complete:  # settled: the lease no longer bounds the rest of a body too large to keep
            upstream.no_deadline()
        return _Forwarded(upstream=upstream, head=head, complete=complete)

    async def _settle_answer(
        self, claim: Claim, idem: IdempotencyConfig, upstream: UpstreamResponse,
        head: bytes, complete: bool, request_id: str, due: asyncio.Future[None], method: str,
    ) -> web.Response | None:
        """Complete or release per the outcome table; a refused completion returns what the record says."""
        stored = StoredResponse(
            status=upstream.status,
            headers=tuple(replay_headers(upstream, idem, request_id, method).items()),
            body=head if complete else None,
        )
        return await self._settle_stored(claim, idem, stored, due)

    async def _settle_stored(
        self, claim: Claim, idem: IdempotencyConfig, stored: StoredResponse, due: asyncio.Future[None]
    ) -> web.Response | None:
        disposition = _disposition(stored.status, idem)
        if disposition == "release":
            await self.settler.release(lambda: self.store.release(claim), until=claim.lease_end())
            return None
        if disposition == "unknown":
            return await self._unknown_outcome(claim, idem, stored, due)
        return await self._complete(claim, stored, idem, due)

    async def _unrelayable(
        self, claim: Claim, idem: IdempotencyConfig, problem: UpstreamAnswerRefused, request_id: str,
        due: asyncio.Future[None],
    ) -> web.Response:
        """The upstream answered, in a form the proxy does not relay: its status is settled as the outcome table says,
        an answer kept without headers or body (as one too large to store is: a retry gets 502
        ``response_not_replayable`` and is never executed again). The client gets the 502 (or, when the
        completion was refused, what the record says now)."""
        status = problem.original_status
        stored = StoredResponse(
            status=status, headers=(("Original-Request-Id", request_id),) if request_id else (), body=None)
        refused = await self._settle_stored(claim, idem, stored, due)
        if refused is not None:
            return refused
        disposition = _disposition(status, idem)
        if disposition == "complete" or (disposition == "unknown" and idem.on_unknown_outcome == "store"):
            problem.detail += (" It was executed: a retry with this idempotency key is not executed again, and "
                               "gets 502 response_not_replayable.")
        raise problem

    async def _unknown_outcome(
        self, claim: Claim, idem: IdempotencyConfig, answer: StoredResponse, due: asyncio.Future[None]
    ) -> web.Response | None:
        """The upstream may or may not have executed: apply ``on_unknown_outcome``."""
        if idem.on_unknown_outcome == "release":
            await self.settler.release(lambda: self.store.release(claim), until=claim.lease_end())
        elif idem.on_unknown_outcome == "store":
            return await self._complete(claim, answer, idem, due)
        # keep_lease: the record stays in flight; after the lease a retry takes it over.
        return None

    async def _complete(
        self, claim: Claim, stored: StoredResponse, idem: IdempotencyConfig, due: asyncio.Future[None]
    ) -> web.Response | None:
        """Store the answer before anyone sees it. None: stored, send it. A response: the completion was
        refused (taken over or released meanwhile) and this is what the record says instead."""
        size = len(stored.body or b"") + sum(len(k) + len(v) for k, v in stored.headers)
        loop = self._loop or asyncio.get_running_loop()
        # settle_timeout bounds the client's wait for the store whatever it does: an attempt hung on it (up to
        # the store's own timeout), or the first read of the record after a refusal (not a wait for a new owner's
        # answer in wait mode: wait_timeout bounds that). When it passes, the handler answers 503.
        self._settling[due] = (loop.time() + idem.settle_timeout, claim)
        if self._settle_watch is None:
            self._settle_watch = loop.call_later(SETTLE_CHECK, self._watch_settles)
        try:
            landed = await self.settler.complete(
                lambda: self.store.complete(claim, stored, ttl=idem.ttl),
                # (until the record could be taken over at the earliest, with a ttl shorter than the lease too)
                size=size, wait=idem.settle_timeout, give_up_after=max(idem.ttl, idem.lease + TAKEOVER_GRACE),
                name=(claim.record.tenant, claim.record.key),
            )
            if landed:
                if due.done() and not due.cancelled():  # (set by _overdue: the client has had its 503)
                    _said_late(claim, "landed")
                return None
            if landed is None:
                _overdue(claim, due)  # (unless the timer said it already)
                raise _not_stored_yet()
            if due.done():  # the handler has answered, or is gone: nobody reads what the record says
                if not due.cancelled():
                    _said_late(claim, "refused")
                raise _not_stored_yet()
            return await self._record_says(claim, idem, due, stored)
        finally:
            self._settling.pop(due, None)

    def _watch_settles(self) -> None:
        """Tell the handlers whose completion outlived settle_timeout (``_overdue``); again in SETTLE_CHECK while
        any completion is in progress."""
        self._settle_watch = None
        loop = self._loop
        assert loop is not None  # (set by _execute, before any completion)
        try:
            now = loop.time()
            for due, (at, claim) in list(self._settling.items()):
                if at <= now:
                    del self._settling[due]
                    _overdue(claim, due)
        finally:  # (whatever happened, the watch goes on while any completion is in progress)
            if self._settling:
                self._settle_watch = loop.call_later(SETTLE_CHECK, self._watch_settles)

    async def _record_says(
        self, claim: Claim, idem: IdempotencyConfig, due: asyncio.Future[None], mine: StoredResponse
    ) -> web.Response | None:
        """After a refused completion: the record's answer now (replay, 422 or 409; ``wait`` mode waits for
        an in-flight owner). Never a second forward: this request already executed once. settle_timeout still
        bounds the first read (``due`` stays watched), not what follows once the store has answered.

        None: the record holds ``mine``, this request's own answer (its executing request's id included): an
        earlier attempt of this completion landed, its reply lost (a cut after the commit). It was stored, and
        goes out as executed, not as a replay."""
        tenant, key, fp = claim.record.tenant, claim.record.key, claim.record.fingerprint
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (idem.wait_timeout if idem.in_flight == "wait" else 0.0)
        first = True
        while True:
            with self.store.watch(tenant, key) as changed:
                try:
                    record = await self.store.get(tenant, key)
                except StoreUnavailable:
                    raise StoreUnavailable("The request was forwarded, but the store is unavailable.",
                                           forwarded=True) from None
                self._settling.pop(due, None)
                if due.done():  # said overdue during this read: the client has its 503, nobody reads on
                    raise _not_stored_yet()
                now = time.time()
                remaining = deadline - loop.time()
                if record is None or record.expired(now):
                    raise InFlight("A request with this idempotency key was released while being "
                                   "processed; retry later.", lease_expires_in=0, status=idem.in_flight_status)
                if (record.state is State.COMPLETED and record.fingerprint == fp and record.response is not None
                        and _same_answer(record.response, mine)):
                    return None
                if first:
                    first = False
                    log.warning("completion refused: the key was taken over or released (tenant %s key %s)",
                                short_hash(tenant), short_hash(key))
                if record.state is State.COMPLETED or record.fingerprint != fp or remaining <= 0:
                    return self._answer_record(record, fp, idem, now, None)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed, remaining)

    # ------------------------------------------------------------------ fail open

    async def _unguarded(
        self, request: web.BaseRequest, body: bytes, idem: IdempotencyConfig, ex: _Exchange
    ) -> web.StreamResponse:
        ex.outcome = "store_error"
        log.warning("store unavailable: forwarding %s %s unguarded (fail_open)",
                    request.method, loggable_path(request))

        headers = ex.upstream.request_headers(request, drop=(idem.header,))
        if ex.upstream.config.forward_key:  # as a guarded forward sends it: the key as understood, or not at all
            headers[idem.header] = forwarded_key(ex.key)

        async def call() -> web.StreamResponse:
            upstream = await ex.upstream.send(request, headers, body)
            try:
                return await stream_response(
                    request, upstream,
                    extra_headers=[(UNGUARDED_HEADER, "unguarded"), (idem.replay_header, "false")],
                )
            finally:
                upstream.release()

        self._in_flight_up()  # a covered request being forwarded, if unguarded: idemproxy_in_flight_requests
        try:
            return await self._timed_upstream(ex, call)
        finally:
            self._in_flight_down()


def _note_held_up(problem: Problem, claim: Claim, send_by: float) -> None:
    """A forward refused as sent too late (``StoreUnavailable`` there; the client's ``UpstreamSendLate``) is
    logged: the stores are fine, so nothing else in the logs would tell why its client got a 503."""
    if isinstance(problem, StoreUnavailable):
        log.warning("this process was held up %.1fs past the time to send a forward (a pause, a frozen VM, a "
                    "starved CPU?); nothing was sent, 503, the key released (tenant %s key %s)",
                    time.monotonic() - send_by, short_hash(claim.record.tenant), short_hash(claim.record.key))


def _lapsed(claim: Claim, fp: str) -> bool:
    """Not owned, and the record is this payload's in flight with its lease run out: in its grace, or (a claim
    that read the row as it was before a concurrent claim gave the grace) not even that yet."""
    if claim.owned:
        return False
    record = claim.record
    return claim.grace or (record.state is State.IN_FLIGHT and record.fingerprint == fp
                           and not record.lease_alive(claim.now))


def _annotate(span: Span, ex: _Exchange) -> None:
    """What a request did, on its server span: never the raw key or tenant (a key hash, as in the access log)."""
    span.set_attribute("idemproxy.outcome", ex.outcome)
    if ex.status:
        span.set_attribute(HTTP_STATUS, ex.status)
    if ex.key:
        span.set_attribute("idemproxy.key_hash", short_hash(ex.key))


def _disposition(status: int, idem: IdempotencyConfig) -> Literal["release", "unknown", "complete"]:
    """What the outcome table does with an upstream answer of ``status``."""
    if status in idem.release_statuses or (status >= 500 and not idem.store_5xx and status not in _UNKNOWN_STATUSES):
        return "release"
    return "unknown" if status in _UNKNOWN_STATUSES else "complete"


def replay_headers(
    upstream: UpstreamResponse, idem: IdempotencyConfig, request_id: str, method: str
) -> CIMultiDict[str]:
    """The headers a replay may carry: no hop-by-hop, Date, Content-Length (but a HEAD answer's: ``_head_length``)
    or stripped names; plus the executing request's id as Original-Request-Id (only replays carry it: the live
    answer is not built from these)."""
    drop = {"date", "content-length", idem.replay_header.lower(), "original-request-id"}
    drop.update(name.lower() for name in idem.strip_replay_headers)
    headers = filter_headers(upstream.headers, drop=drop)
    _head_length(method, upstream, headers)
    if request_id:
        headers["Original-Request-Id"] = request_id
    return headers


def _head_length(method: str, upstream: UpstreamResponse, headers: CIMultiDict[str]) -> None:
    """A HEAD answer's Content-Length is no framing of a body (it has none) but the upstream's header, the size a GET
    would get (RFC 9110 §8.6): kept, as a pass-through keeps it (aiohttp sends a HEAD answer's own Content-Length)."""
    if method == "HEAD" and upstream.content_length is not None:
        headers["Content-Length"] = str(upstream.content_length)


def problem_response(problem: Problem, request_id: str = "") -> StoredResponse:
    """A proxy problem as a storable answer (``on_unknown_outcome: store``); its replays carry the executing
    request's id as Original-Request-Id, as replays of the upstream's answers do."""
    response = problem.response()
    assert isinstance(response.body, bytes)
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/problem+json"),)
    if request_id:
        headers += (("Original-Request-Id", request_id),)
    return StoredResponse(status=problem.status, headers=headers, body=response.body)


async def _read_answer(upstream: UpstreamResponse, limit: int) -> tuple[bytes, bool]:
    """``read_at_most``, for an answer whose head came: the upstream answered with its status, and a body lost
    after it is no unknown outcome (guarantee 1 forwards again only then). The status settles the key, as for any
    answer the proxy cannot relay."""
    try:
        return await read_at_most(upstream, limit)
    except (ConnectionError, TimeoutError) as exc:
        if isinstance(exc, UpstreamUnrelayable):
            raise
        what = "a body that stalled" if isinstance(exc, TimeoutError) else "a body that broke off"
        raise UpstreamUnrelayable(upstream.status, what) from exc


def tenant_id(tenant: TenantConfig, value: str | None) -> str:
    """The tenant id the proxy makes of a tenant header value (``idemproxy keys --credential`` too)."""
    if tenant.from_ == "static":
        return tenant.static
    if not value:
        if tenant.required:
            raise MissingTenant(f"The {tenant.header} header is required to scope idempotency keys.")
        return ANONYMOUS_TENANT
    # Header values arrive as UTF-8 with undecodable bytes escaped: hash the bytes as received.
    raw = value.encode("utf-8", "surrogateescape")
    if tenant.hash:
        return hashlib.sha256(raw).hexdigest()
    if len(raw) > TENANT_MAX_BYTES or not _is_utf8(value):
        raise MissingTenant(
            f"The {tenant.header} header cannot be used as a tenant unhashed (valid UTF-8 of at most "
            f"{TENANT_MAX_BYTES} bytes); the operator can set tenant.hash: true."
        )
    if value == ANONYMOUS_TENANT:  # the id of requests without a tenant: taken as one, it would read theirs
        raise MissingTenant(f"The {tenant.header} value {ANONYMOUS_TENANT!r} names no tenant.")
    return value


def _same_answer(stored: StoredResponse, mine: StoredResponse) -> bool:
    """Whether ``stored`` is ``mine`` as the store gives it back (its headers carry the executing request's id)."""
    return (stored.status == mine.status and stored.body == mine.body
            and [tuple(h) for h in stored.headers] == [tuple(h) for h in mine.headers])


def _overdue(claim: Claim, due: asyncio.Future[None]) -> None:
    """``settle_timeout`` has passed with the completion still failing, or still waiting on a hung store: the
    handler answers 503 now (``_not_stored_yet``) and the completion goes on in the background. Once only, and
    not for a handler gone (its future cancelled) or answered already."""
    if due.done():
        return
    log.error("store still unavailable after settle_timeout; answering 503 (tenant %s key %s), "
              "the completion goes on in the background", short_hash(claim.record.tenant), short_hash(claim.record.key))
    due.set_result(None)


def _said_late(claim: Claim, verdict: str) -> None:
    log.warning("completion %s after its client got 503 at settle_timeout (tenant %s key %s)", verdict,
                short_hash(claim.record.tenant), short_hash(claim.record.key))


def _not_stored_yet() -> StoreUnavailable:
    return StoreUnavailable(
        "The request was forwarded, but its answer could not be stored yet; retry with the same "
        "idempotency key to get it once the store is back.",
        forwarded=True,
    )


def _release_upstream(task: asyncio.Task[_Forwarded | web.Response]) -> None:
    if not task.cancelled() and task.exception() is None:
        result = task.result()
        if isinstance(result, _Forwarded):
            result.upstream.release()


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` (checked before reading when declared, and then before
    an ``Expect: 100-continue`` is answered: the client is not asked for a body it would send in vain). A client
    gone before its body came whole is :class:`ClientGone`; one that sent no byte of it for ``listen.body_timeout``
    gets 408 (its stream fails with :class:`ClientStalled`, set by the server's look at its connections: no timer
    per read here). Both come before the claim: no record is touched."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"The request body is larger than {limit} bytes.", max_bytes=limit)
    content = request.content
    try:
        if declared is not None and declared <= SMALL_BODY and content.is_eof():
            # (below aiohttp's client_max_size) the whole body came with the head: take it without a read loop
            return content.read_nowait()
        await continue_body(request)
        parts: list[bytes] = []
        size = 0
        while True:
            chunk = await content.read(CHUNK)  # what has come, up to CHUNK
            if not chunk:
                return b"".join(parts)
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"The request body is larger than {limit} bytes.", max_bytes=limit)
            parts.append(chunk)
    except ClientStalled as exc:
        raise exc.problem("nothing was forwarded, and the idempotency key was not used.") from exc
    except ConnectionResetError as exc:  # (aiohttp's ClientConnectionResetError and "Connection lost" too)
        raise ClientGone from exc
