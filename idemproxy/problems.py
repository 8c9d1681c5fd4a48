"""Every error the proxy answers by itself, and the one place that renders them (RFC 9457).

    Problem                        (status, code, title; rendered as application/problem+json)
    ├── BadRequest                 400 bad_request        (a request target no upstream URL can be made of)
    ├── MissingKey                 400 missing_key
    ├── InvalidKey                 400 invalid_key
    │   └── StoreRejected          400 invalid_key        (a value the store refuses to index: never "unavailable")
    ├── MissingTenant              401 missing_tenant
    ├── Unauthorized               401 unauthorized       (admin API: wrong or missing bearer token)
    ├── RecordNotFound             404 not_found          (admin API)
    ├── UnknownPath                404 unknown_path       (admin port: no such path)
    ├── MethodNotAllowed           405 method_not_allowed (admin port) + Allow
    ├── InFlight                   409 in_flight          + Retry-After (or idempotency.in_flight_status)
    ├── RequestTimeout             408 request_timeout    (a request head or body that did not come in time)
    ├── BodyTooLarge               413 body_too_large
    ├── PayloadMismatch            422 payload_mismatch   (or idempotency.mismatch_status)
    ├── UpstreamUnreachable        502 upstream_unreachable
    ├── UpstreamReset              502 upstream_reset
    │   └── UpstreamAnswerRefused  502 upstream_reset     (+ original_status: an answer the proxy does not relay)
    ├── ResponseNotReplayable      502 response_not_replayable (+ original_status)
    ├── StoreUnavailable           503 store_unavailable  + Retry-After (+ forwarded: true after the forward)
    │   └── RecordUnreadable       503 store_unavailable  (a stored response that does not open: never forwarded)
    └── UpstreamTimeout            504 upstream_timeout

Stores raise ``StoreUnavailable`` (translated from driver errors at their boundary); the engine and the
proxy raise the rest; ``problem_middleware`` turns any of them into a response. Problem bodies never carry
a stack trace, an internal host name or another tenant's data. A problem's ``type`` is a URN
(``urn:idemproxy:problem:in-flight``): it names the problem without pointing at a domain.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

from aiohttp import web

log = logging.getLogger("idemproxy")

PROBLEM_CONTENT_TYPE = "application/problem+json"
RETRY_AFTER_SECONDS = 1
_TYPE_BASE = "urn:idemproxy:problem:"


CLIENT_CLOSED = 499  # nginx's "client closed request": the status the access log shows when nobody was left


class ClientGone(Exception):
    """The client went away (a reset, or its connection closed) before its request was read whole: nobody is
    left to answer, and nothing was forwarded on its behalf (bodies are read before anything is sent)."""


class ClientStalled(TimeoutError):
    """No byte of a request body came for ``listen.body_timeout`` while the proxy waited for one: set on the body's
    stream by the server's look at its connections (``app._Server``) and raised to whoever reads it, who answers
    408 (``problem``). A TimeoutError: aiohttp's read-off of a body left unread after an answer takes it as its
    own time running out, and closes the connection."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"no byte of the request body for {timeout:g}s")
        self.timeout = timeout

    def problem(self, what: str) -> RequestTimeout:
        return RequestTimeout(f"No byte of the request body came for {self.timeout:g}s; {what}")


class Problem(Exception):
    """An error answered by the proxy itself."""

    status: int = 500  # a class's default; an instance may answer with another (configured) status
    code: ClassVar[str] = "internal_error"
    title: ClassVar[str] = "Internal proxy error"
    outcome: ClassVar[str] = "error"  # the metrics outcome label

    def __init__(self, detail: str, *, status: int | None = None, **extensions: Any) -> None:
        super().__init__(detail)
        if status is not None:
            self.status = status
        self.detail = detail
        self.extensions = extensions
        self.headers: dict[str, str] = {}

    def body(self) -> dict[str, Any]:
        return {
            "type": _TYPE_BASE + self.code.replace("_", "-"),
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
            **self.extensions,
        }

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=json.dumps(self.body()).encode(),
            content_type=PROBLEM_CONTENT_TYPE,
            headers=self.headers,
        )


class BadRequest(Problem):
    status, code, title, outcome = 400, "bad_request", "Bad request", "invalid_key"


class MissingKey(Problem):
    status, code, title, outcome = 400, "missing_key", "Idempotency key required", "missing_key"


class InvalidKey(Problem):
    status, code, title, outcome = 400, "invalid_key", "Invalid idempotency key", "invalid_key"


class StoreRejected(InvalidKey):
    """The store refused the key or tenant as data (too long to index, say): a permanent error, so never
    treated as "store unavailable" (that would answer 503 forever, or forward unguarded with fail_open)."""

    title = "Idempotency key cannot be stored"


class MissingTenant(Problem):
    status, code, title, outcome = 401, "missing_tenant", "Tenant required", "missing_tenant"


class Unauthorized(Problem):
    status, code, title, outcome = 401, "unauthorized", "Admin token required", "unauthorized"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.headers["WWW-Authenticate"] = 'Bearer realm="idemproxy-admin"'


class RecordNotFound(Problem):
    status, code, title, outcome = 404, "not_found", "No such idempotency record", "not_found"


class UnknownPath(Problem):
    status, code, title = 404, "unknown_path", "No such path"


class MethodNotAllowed(Problem):
    status, code, title = 405, "method_not_allowed", "Method not allowed"

    def __init__(self, allowed: set[str]) -> None:
        names = ", ".join(sorted(allowed))
        super().__init__(f"This path answers {names} only.")
        self.headers["Allow"] = names


_ADMIN_PATHS = ("The admin port serves /healthz, /readyz and /metrics, and /admin/keys/{tenant}/{key} when "
                "admin.token is set.")


class InFlight(Problem):
    status, code, title, outcome = 409, "in_flight", "Request already in flight", "in_flight"

    def __init__(self, detail: str, lease_expires_in: float, *, status: int | None = None) -> None:
        # Retry-After is a short hint: the first attempt usually answers within moments, and a retry then gets
        # the replay. When the owner is gone, the key is taken over only after lease_expires_in seconds.
        super().__init__(detail, status=status, lease_expires_in=max(0, math.ceil(lease_expires_in)))
        self.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)


class RequestTimeout(Problem):
    """The client did not send its request in time: its body stalled (``ClientStalled``), counted as a body refused
    for its size is (the contract's outcomes are fixed: a bound on the request body, nothing forwarded whole, no
    record touched); or its head did not come whole (``listen.header_timeout``), counted as the requests aiohttp's
    parser refused are (``Engine.refused``: ``invalid_key``, route ``other``)."""

    status, code, title, outcome = 408, "request_timeout", "Request timeout", "body_too_large"


class BodyTooLarge(Problem):
    status, code, title, outcome = 413, "body_too_large", "Request body too large", "body_too_large"


class PayloadMismatch(Problem):
    status, code, title = 422, "payload_mismatch", "Idempotency key reused with another payload"
    outcome = "payload_mismatch"


class UpstreamUnreachable(Problem):
    status, code, title, outcome = 502, "upstream_unreachable", "Upstream unreachable", "upstream_error"


class UpstreamReset(Problem):
    status, code, title, outcome = 502, "upstream_reset", "Upstream connection broke", "upstream_error"


class UpstreamAnswerRefused(UpstreamReset):
    """The upstream answered in a form the proxy does not relay (``client.UpstreamUnrelayable``). Its status,
    when the head got that far, is ``original_status``: the outcome is known, though the answer is not passed on."""

    def __init__(self, detail: str, original_status: int) -> None:
        super().__init__(detail, **({"original_status": original_status} if original_status else {}))
        self.original_status = original_status


class UpstreamTimeout(Problem):
    status, code, title, outcome = 504, "upstream_timeout", "Upstream timed out", "upstream_error"


class ResponseNotReplayable(Problem):
    status, code, title = 502, "response_not_replayable", "Stored response cannot be replayed"
    outcome = "replayed"


class StoreUnavailable(Problem):
    status, code, title, outcome = 503, "store_unavailable", "Idempotency store unavailable", "store_error"

    def __init__(self, detail: str, *, maybe_applied: bool = True, **extensions: Any) -> None:
        super().__init__(detail, **extensions)
        self.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        # False when the operation certainly never reached the store (no connection): nothing to undo.
        self.maybe_applied = maybe_applied


class RecordUnreadable(StoreUnavailable):
    """The store answered, but the stored response does not open (unknown key id, tampered or moved bytes).

    Unlike other store failures it is never a reason to forward unguarded (``on_store_error: fail_open``):
    the request was executed once already, and its record stands. Nor did a claim that read it take the key:
    nothing to release (``maybe_applied`` False).
    """

    def __init__(self, detail: str, **extensions: Any) -> None:
        super().__init__(detail, maybe_applied=False, **extensions)


_R = TypeVar("_R", bound=web.BaseRequest)


def loggable_path(request: web.BaseRequest) -> str:
    """The path as it came, percent-escapes kept (never the query, which may carry secrets): the decoded path
    can hold a CR or LF (``%0A``), which would start a forged line in a text log."""
    return request.rel_url.raw_path


async def render_problems(
    request: _R, handler: Callable[[_R], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Render any :class:`Problem` (and any unexpected error, without its trace) as problem+json."""
    try:
        return await handler(request)
    except Problem as problem:
        return problem.response()
    except ClientGone as gone:  # its loss, nothing wrong here: one INFO line, no trace
        log.info("client went away before %s %s was read whole (%s); nothing was forwarded, nothing counted",
                 request.method, loggable_path(request), type(gone.__cause__).__name__)
        return web.Response(status=CLIENT_CLOSED)  # (never written: no one is there to read it)
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unhandled error while serving %s %s", request.method, loggable_path(request))
        return Problem("The proxy failed to handle this request.").response()


@web.middleware
async def problem_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """:func:`render_problems` as an app's middleware (the admin port), its router's 404 and 405 included (aiohttp
    answers them as text/plain)."""
    try:
        return await render_problems(request, handler)
    except web.HTTPNotFound:
        return UnknownPath(_ADMIN_PATHS).response()
    except web.HTTPMethodNotAllowed as exc:
        return MethodNotAllowed(exc.allowed_methods).response()
