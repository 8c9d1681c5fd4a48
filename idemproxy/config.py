"""Typed configuration, loaded and checked once.

One YAML file becomes a tree of frozen dataclasses. Every problem found is reported with the key's
dotted path and the bad value (``upstream.timeout: 'soon' is not a duration``); all of them are
collected before failing so a user fixes a file in one pass. Secrets hide themselves in ``repr``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import ipaddress
import math
import os
import re
import secrets
import socket
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, TypeVar, cast
from urllib.parse import unquote_plus, urlsplit, urlunsplit

import yaml
from yarl import URL

T = TypeVar("T")

# The lease starts when the key is claimed, but the answer is stored only after the whole forward: the lease
# should outlast upstream.timeout by the claim and completion round trips plus the scheduling delay of a loaded
# replica. 2 s is ample for a store that answers at all (a completion normally takes milliseconds); a store
# slower than that is a store fault, handled by the fenced settle retries, never by a second forward. The contract
# asks only that the timeout be shorter than the lease: a smaller margin is accepted with a warning at start, and
# the forward is then cut at the lease minus what margin there is (lease_margin).
LEASE_MARGIN = 2.0


def lease_margin(lease: float, timeout: float) -> float:
    """How long before its lease ends a forward under this lease and upstream timeout is cut short: LEASE_MARGIN,
    or all the room the lease leaves over the timeout when that is less."""
    return min(LEASE_MARGIN, lease - timeout)


# Keys and unhashed tenants are bounded so every backend can index (tenant, key): PostgreSQL's btree refuses
# index rows over ~2700 bytes, so 1024 bytes each leaves room for the row header.
KEY_MAX_LENGTH_LIMIT = 1024
TENANT_MAX_BYTES = 1024


class ConfigError(Exception):
    """The configuration is invalid; ``errors`` lists every problem with its key path."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


class Secret:
    """A string that never shows itself in ``repr``/``str``; ``reveal()`` gives the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def masked(self) -> str:
        return "***" if self._value else ""

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return f"Secret({self.masked()!r})"

    __str__ = __repr__


# Query parameters that carry a secret in a DSN or URL (libpq's and asyncpg's password and sslpassword, redis-py's
# password, a collector's api_key or auth; anything else named like a secret, to be safe: a path such as sslkey
# shown masked costs nothing).
_SECRET_PARAMETER = re.compile(r"password|passwd|secret|token|key|auth|credential|signature", re.IGNORECASE)
# user:password@ as written, whatever the password holds: from the user's colon to the last @ (more than needed,
# never less), for what urllib cannot take apart.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*:).*@")
_KEY_VALUE_SECRET = re.compile(r"(\w*(?:password|passwd|secret|token)\w*)(\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)",
                               re.IGNORECASE)


class SecretURL(Secret):
    """A URL or DSN whose password is masked when shown: in its user part and in its query
    (``?password=...``)."""

    def masked(self) -> str:
        if "://" not in self._value:  # libpq's key=value form: password=... (quoted or not)
            return _KEY_VALUE_SECRET.sub(r"\1\2***", self._value)
        try:
            parts = original = urlsplit(self._value)
        except ValueError:  # not a URL urllib can take apart (a bad IPv6 host)
            return _USERINFO.sub(r"\1***@", self._value)
        if parts.password is not None:
            parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
        elif "@" in self._value and _USERINFO.match(self._value):
            # A password holding an unescaped / ? or # ends the URL's authority early for urllib, which then finds
            # none.
            return _USERINFO.sub(r"\1***@", self._value)
        if parts.query:
            shown = []
            for item in parts.query.split("&"):
                name, equals, _ = item.partition("=")
                secret = equals and _SECRET_PARAMETER.search(unquote_plus(name))
                shown.append(f"{name}=***" if secret else item)
            parts = parts._replace(query="&".join(shown))
        return self._value if parts == original else urlunsplit(parts)


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class ListenConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    # A request's head must come whole within this of its first byte (a new connection's first head: of its accept),
    # as nginx's client_header_timeout (60 s): any client sends one in a single write, long before.
    header_timeout: float = 60.0
    # A request body may go this long without a byte while the proxy waits for one (progress, not a total: a slow
    # upload that keeps moving is never cut), as nginx's client_body_timeout (60 s); past it, 408.
    body_timeout: float = 60.0
    # An answer may go this long without the client taking a byte of it while the proxy has bytes waiting for it
    # (progress, not a total: a slow reader is never cut if it reads about a TCP segment's worth in that time: its
    # kernel tells of its reads as it makes room), as nginx's send_timeout (60 s); past it the connection is reset
    # (the answer's head is gone: nothing else can be said).
    send_timeout: float = 60.0
    # How long a connection may wait for its next request (docs/deploying.md "Slow and idle clients"). aiohttp's
    # default, just over an hour: longer than a balancer's idle timeout (AWS ALB: 60 s unless raised;
    # Google's: 600 s, fixed; Envoy's: an hour), so a balancer never sends a request on a connection this proxy
    # is closing (a 502 from the balancer, for a request nobody read).
    keepalive_timeout: float = 3630.0


@dataclass(frozen=True)
class AdminConfig:
    host: str = "127.0.0.1"
    port: int = 9090
    token: Secret = field(default_factory=lambda: Secret(""))
    ready_requires_store: bool = False  # true: /readyz is 503 while the durable store does not answer


@dataclass(frozen=True)
class UpstreamConfig:
    url: str = ""
    connect_timeout: float = 5.0
    timeout: float = 30.0
    max_connections: int = 512
    forward_key: bool = True


@dataclass(frozen=True)
class TenantConfig:
    from_: Literal["header", "static"] = "header"
    header: str = "Authorization"
    hash: bool = True
    required: bool = True
    static: str = "default"


@dataclass(frozen=True)
class IdempotencyConfig:
    header: str = "Idempotency-Key"
    methods: tuple[str, ...] = ("POST", "PATCH")
    required: bool = False
    key_max_length: int = 255
    ttl: float = 24 * 3600.0
    lease: float = 60.0
    in_flight: Literal["reject", "wait"] = "reject"
    wait_timeout: float = 10.0
    store_5xx: bool = True
    release_statuses: tuple[int, ...] = (408, 409, 425, 429, 503)
    on_unknown_outcome: Literal["keep_lease", "release", "store"] = "keep_lease"
    canonical_json: bool = True
    fingerprint_headers: tuple[str, ...] = ()
    replay_header: str = "Idempotent-Replayed"
    strip_replay_headers: tuple[str, ...] = ("Set-Cookie",)
    max_request_body: int = 1024 * 1024
    max_stored_response: int = 1024 * 1024
    settle_timeout: float = 30.0  # how long a client waits while its completion is retried (store down)
    in_flight_status: int = 409  # 425 or 202 for clients built to other conventions; code stays in_flight
    mismatch_status: int = 422  # 409 or 400; code stays payload_mismatch


@dataclass(frozen=True)
class RouteConfig:
    """A path prefix with its own idempotency settings (the defaults, overridden) and, optionally, upstream."""

    prefix: str
    enabled: bool
    idempotency: IdempotencyConfig
    upstream: UpstreamConfig | None = None  # None: the top-level upstream


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class ForwardedConfig:
    """Peers whose X-Forwarded-Proto/-Host are believed (a load balancer in front); none by default."""

    trusted_proxies: tuple[IPNetwork, ...] = ()


@dataclass(frozen=True)
class RequestIdConfig:
    header: str = "X-Request-Id"


@dataclass(frozen=True)
class EmbeddedConfig:
    path: str = "idemproxy.sqlite3"


@dataclass(frozen=True)
class RedisConfig:
    url: SecretURL = field(default_factory=lambda: SecretURL("redis://127.0.0.1:6379/0"))
    key_prefix: str = "idem:"
    replay_cache_ttl: float = 3600.0
    cluster: bool = False  # Redis Cluster: the url names any node, the client learns the rest


@dataclass(frozen=True)
class PostgresConfig:
    dsn: SecretURL = field(
        default_factory=lambda: SecretURL("postgresql://idemproxy@127.0.0.1:5432/idemproxy")
    )
    pool_min: int = 2
    pool_max: int = 20
    migrate: Literal["auto", "off"] = "auto"
    # daily: records live in daily partitions by expiry day, dropped whole once expired (new schemas);
    # none: one table, expired rows deleted by the sweeper. `idemproxy migrate` converts none → daily.
    partitions: Literal["daily", "none"] = "daily"


@dataclass(frozen=True)
class PendingSettlesConfig:
    """Bounds on completions and releases retried in the background while the store is down."""

    max_count: int = 10_000
    max_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True)
class CompressionConfig:
    """zstd over stored responses at least ``min_size`` bytes long (headers and body together)."""

    min_size: int = 1024
    level: int = 3


@dataclass(frozen=True)
class EncryptionConfig:
    """AES-256-GCM over stored responses: ``key`` seals new values; every key opens the values it sealed."""

    key: Secret = field(default_factory=lambda: Secret(""))  # base64 of 32 bytes; empty: seal nothing new
    previous_keys: tuple[Secret, ...] = ()


@dataclass(frozen=True)
class StorageConfig:
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    redis: RedisConfig | None = None
    postgres: PostgresConfig | None = None
    on_store_error: Literal["fail_closed", "fail_open"] = "fail_closed"
    pending_settles: PendingSettlesConfig = field(default_factory=PendingSettlesConfig)
    compression: CompressionConfig | None = None  # None: stored raw
    encryption: EncryptionConfig | None = None  # None: stored in clear
    replay_memory: int = 16 * 1024 * 1024  # bytes of completed records kept in-process for replays; 0: none

    @property
    def backend(self) -> Literal["embedded", "postgres"]:
        """The durable store in use: PostgreSQL when configured, else the embedded file."""
        return "postgres" if self.postgres is not None else "embedded"


@dataclass(frozen=True)
class LogConfig:
    level: str = "INFO"
    format: Literal["text", "json"] = "text"
    access: str = "INFO"  # level of the one-line-per-request access log; "off" disables it


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry spans for claim, forward and settle (needs ``idemproxy[otel]``); off unless enabled."""

    enabled: bool = False
    service_name: str = "idemproxy"
    exporter: Literal["otlp", "console", "none"] = "otlp"  # none: traceparent still continued, spans not sent
    endpoint: str = ""  # OTLP/HTTP traces URL; empty: the exporter's default (OTEL_EXPORTER_OTLP_* or localhost)


@dataclass(frozen=True)
class Config:
    listen: ListenConfig = field(default_factory=ListenConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    tenant: TenantConfig = field(default_factory=TenantConfig)
    idempotency: IdempotencyConfig = field(default_factory=IdempotencyConfig)
    routes: tuple[RouteConfig, ...] = ()
    storage: StorageConfig = field(default_factory=StorageConfig)
    log: LogConfig = field(default_factory=LogConfig)
    forwarded: ForwardedConfig = field(default_factory=ForwardedConfig)
    request_id: RequestIdConfig = field(default_factory=RequestIdConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    drain_delay: float = 5.0  # after SIGTERM: /readyz 503 but still serving, so load balancers notice
    shutdown_timeout: float = 30.0
    workers: int = 1

    def upstream_for(self, route: RouteConfig | None) -> UpstreamConfig:
        """The upstream a route's requests go to (its own, else the top-level one)."""
        return route.upstream if route is not None and route.upstream is not None else self.upstream

    @property
    def max_stored_response(self) -> int:
        """The largest body any route may store (what reading a stored value back may have to hold)."""
        return max([self.idempotency.max_stored_response, *(r.idempotency.max_stored_response for r in self.routes)])

    @property
    def waits(self) -> bool:
        """Whether any route answers a duplicate in flight by waiting for the owner (``in_flight: wait``)."""
        return any(i.in_flight == "wait" for i in (self.idempotency, *(r.idempotency for r in self.routes)))

    def route_for(self, path: str) -> RouteConfig | None:
        """The first route whose prefix matches ``path`` (None: the defaults apply).

        Raises :class:`AmbiguousPath` when ``path`` read as an upstream may read it (``other_readings``: slashes
        merged and dot segments resolved, or as a URL parser or a Servlet container reads it) matches another route
        than ``path`` as sent (``//v1/charges``, ``/v1/charges/../events``, ``//host/v1/charges``,
        ``/v1/events\\..\\charges``, ``/v1;x=1/charges``): which of them the upstream executes is not known here,
        so no route's policy can be trusted to apply."""
        route = self._first_route(path)
        if ("//" in path or "/." in path or "\\" in path or ";" in path) and any(
                self._first_route(reading) is not route for reading in other_readings(path)):
            raise AmbiguousPath(path)
        return route

    def _first_route(self, path: str) -> RouteConfig | None:
        for route in self.routes:
            if path.startswith(route.prefix):
                return route
        return None


class AmbiguousPath(ValueError):
    """A path whose routes as sent and as an upstream may read it (``other_readings``) differ."""


_PATH_PARAMETERS = re.compile(r";[^/]*")


def other_readings(path: str) -> list[str]:
    """The paths an upstream may execute for ``path``: ``normalised_path``; as a WHATWG URL parser reads it
    (Node's documented ``new URL(req.url, base)``), a backslash taken for a slash and a leading ``//`` for an
    authority (after every slash it starts with), as Python's ``urlsplit`` takes a leading ``//`` too:
    ``//host/v1/charges``, ``///host/v1/charges`` and ``/\\host/v1/charges`` are the path ``/v1/charges`` (on host
    ``host``), ``/v1/events\\..\\charges`` is
    ``/v1/charges``; and as a Servlet container reads it (Tomcat, Jetty, Spring's ``UrlPathHelper``), each
    segment's ``;`` parameters dropped: ``/v1;x=1/charges`` and ``/v1/events/..;/charges`` are ``/v1/charges``."""
    readings = [normalised_path(path)]
    slashed = path.replace("\\", "/")
    if slashed != path:
        readings.append(normalised_path(slashed))
    if slashed.startswith("//"):  # (every slash before the authority is skipped: ``///host/v1/charges`` too)
        authority = slashed.lstrip("/")
        end = authority.find("/")  # the authority ends at the next slash (a path has no ? or # left)
        readings.append(normalised_path(authority[end:] if end >= 0 else "/"))
    if ";" in path:  # Servlet containers drop each segment's ;parameters, then resolve dot segments
        readings.append(normalised_path(_PATH_PARAMETERS.sub("", path)))
    return readings


def _request_path(written: str) -> str:
    """``written`` as aiohttp's ``request.path`` (what routes match) reads it: escapes decoded, but one that is no
    UTF-8 (``%E9``) kept as written, where ``unquote`` would make it U+FFFD, which no path holds."""
    return URL.build(path=written, encoded=True).path


def _unresolved(prefix: str) -> bool:
    """Whether a route prefix holds what ``other_readings`` resolves away (no path under it then reads as itself)."""
    segments = prefix.split("/")[1:]
    return ";" in prefix or "\\" in prefix or "" in segments[:-1] or any(s in (".", "..") for s in segments)


def normalised_path(path: str) -> str:
    """``path`` with repeated slashes merged and ``.`` / ``..`` segments resolved (RFC 3986 §5.2.4), a trailing
    slash kept: ``//a/./b/../c/`` → ``/a/c/``."""
    kept: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if kept:
                kept.pop()
            continue
        kept.append(segment)
    trailing = bool(kept) and path.endswith(("/", "/.", "/.."))
    return "/" + "/".join(kept) + ("/" if trailing else "")


# --------------------------------------------------------------------------- value parsers

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
# Past this a duration is a slip, not a setting: YAML's .nan and .inf, or a number no timer, interval or
# timestamp can hold (a ttl of 1e15 s would make every claim fail in PostgreSQL, a timeout of nan every forward).
DURATION_MAX = 100 * 365 * 86400.0
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_SIZE_UNITS = {
    None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3,
}
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # RFC 9110 token (methods, header names)


class _Invalid(Exception):
    """One bad value; the loader adds the key path. ``where`` is the part of the path below the key the parser
    was given (a list item's ``[2]``)."""

    def __init__(self, message: str, where: str = "", also: tuple[_Invalid, ...] = ()) -> None:
        super().__init__(message)
        self.where = where
        self.also = also  # the other bad items of the same list

    def each(self) -> tuple[_Invalid, ...]:
        return (self, *self.also)


def parse_duration(value: Any) -> float:
    """``500ms``, ``30s``, ``5m``, ``24h``, ``1d`` or plain seconds → seconds."""
    if isinstance(value, bool):
        raise _Invalid(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        if value < 0:
            raise _Invalid(f"{value!r} is not a duration (negative)")
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise _Invalid(f"{value!r} is not a duration (use e.g. 500ms, 30s, 24h)")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds):
        raise _Invalid(f"{value!r} is not a duration (not a finite number)")
    if seconds > DURATION_MAX:
        raise _Invalid(f"{value!r} is not a duration (at most 100 years)")
    return seconds


def _positive_duration(value: Any) -> float:
    """A duration that must pass before anything can happen (a timeout, a record's life): zero is refused."""
    seconds = parse_duration(value)
    if seconds <= 0:
        raise _Invalid(f"{value!r} is not a duration above zero")
    return seconds


def parse_size(value: Any) -> int:
    """``512KiB``, ``1MiB`` or plain bytes → bytes."""
    if isinstance(value, bool):
        raise _Invalid(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise _Invalid(f"{value!r} is not a size (negative)")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise _Invalid(f"{value!r} is not a size (use e.g. 512KiB, 1MiB or bytes)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
        return value.lower() in ("true", "yes", "on", "1")
    raise _Invalid(f"{value!r} is not a boolean")


def _int(low: int, high: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise _Invalid(f"{value!r} is not an integer")  # 8080.9 refused, never cut to 8080
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):
            raise _Invalid(f"{value!r} is not an integer") from None
        if not low <= number <= high:
            raise _Invalid(f"{value!r} is out of range ({low}..{high})")
        return number

    return parse


def _str(value: Any) -> str:
    """Text as written in the file; a value YAML typed as something else is refused, never converted."""
    return _text(value, secret=False)


def _secret_text(value: Any) -> str:
    """Like :func:`_str`, but the error never shows the value."""
    return _text(value, secret=True)


def _text(value: Any, *, secret: bool) -> str:
    if isinstance(value, str):
        return str(value)  # plain text, never a subclass (an ``_EnvList``) kept in the config
    shown = "the value (a secret, not shown)" if secret else _short(value)
    if value is None or isinstance(value, dict | list):
        raise _Invalid(f"{shown} is not a string")
    # Unquoted, 0012345 is the octal number 5349, on is true, 1e3 is 1000.0, 2024-01-02 a date: str() of
    # what YAML made would silently be another token or password than the one written.
    raise _Invalid(f"{shown} is not a string: YAML read the unquoted value as {_kind(value)}; quote it")


_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
          type(None): "empty"}


def _kind(value: Any) -> str:
    """What YAML made of a value, in words (never the value itself)."""
    return _KINDS.get(type(value), f"a {type(value).__name__}")


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in options:
            raise _Invalid(f"{value!r} is not one of {', '.join(options)}")
        return str(value)

    return parse


def _migrate(value: Any) -> str:
    """``auto`` or ``off``; YAML 1.1 reads a bare ``off`` as false, which means the same."""
    return "off" if value is False else _choice("auto", "off")(value)


def _token(value: Any) -> str:
    text = _str(value)
    if not _TOKEN.match(text):
        raise _Invalid(f"{value!r} is not a valid HTTP token")
    return text


# RFC 9110 §7.6.1, plus the legacy names proxies meet in practice: dropped at every hop (idemproxy/proxy.py).
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
    "upgrade", "proxy-authenticate", "proxy-authorization",
})


# Headers this hop writes anew for every attempt: hashed, they would tell every retry from its first attempt
# (422), whatever the client sent. (X-Forwarded-Host and -Proto are hashed as forwarded: from an untrusted peer,
# this hop's own value, from Host and the scheme; and the request id header is refused by _cross_checks.)
PER_ATTEMPT = ("x-forwarded-for", "traceparent", "tracestate")


def _forwarded_header(value: Any) -> str:
    """A header name that reaches the upstream: what is hashed must be what is forwarded."""
    name = _token(value)
    if name.lower() in HOP_BY_HOP or name.lower() == "expect":
        raise _Invalid(f"{value!r} never reaches the upstream (this hop drops it), so it cannot tell two "
                       "requests apart")
    if name.lower() in PER_ATTEMPT:
        raise _Invalid(f"{value!r} is written by this hop for each attempt (the peer's address, the trace), so "
                       "every retry would be another payload")
    return name


# Headers with a meaning of their own in a request or an answer, which this hop or the upstream writes: a replay
# marker or request id under one of these names would replace it (request_id.header: Host sent the id nowhere
# upstream and wrote a Host header into every answer; Content-Type replaced the upstream's).
# (Forwarded and the X-Forwarded-* family but -For: ``forged_by_client``, below.)
_MEANINGFUL = frozenset({
    "host", "date", "server", "location", "set-cookie", "x-forwarded-for", "traceparent", "tracestate",
    "retry-after", "vary", "etag", "cache-control", "expires", "age", "last-modified",
})
# Headers only a proxy may write, about the client's hop (the upstream trusts this proxy, so it believes them):
# dropped from what a client sent unless it came through a trusted proxy (``forged_by_client``).
FORGED_NAMES = frozenset(("forwarded", "x-real-ip", "x-original-url", "x-rewrite-url"))


def forged_by_client(name: str) -> bool:
    """A header only a proxy may write, about the client's hop: the upstream trusts this proxy, so it believes
    every such header this proxy passes on. RFC 7239's Forwarded, X-Real-IP, and the whole X-Forwarded-* family
    (-Proto, -Host, -Port, -Prefix, -Ssl, -Scheme... which frameworks read) in any spelling (CGI/WSGI servers
    read an underscore as a hyphen: X_Forwarded_Host is HTTP_X_FORWARDED_HOST). X-Forwarded-For itself is kept
    and appended to, as the contract says. Also X-Original-URL and X-Rewrite-URL, by which a rewriting proxy in
    front tells some frameworks the path it was asked for: from a client, a path other than the one this proxy
    routed (a covered route reached through an uncovered one)."""
    lowered = name.lower()
    if lowered == "x-forwarded-for":
        return False
    folded = lowered.replace("_", "-")
    return folded.startswith("x-forwarded-") or folded in FORGED_NAMES


def _response_header(value: Any) -> str:
    """A header name this hop writes into every response (the replay marker, the request id): never one that
    frames the message, or the answer would carry two framings, or one that is not its body's; nor one with a
    meaning of its own that it would replace. Nor one the upstream believes as this hop's word about the client
    (X-Forwarded-*, X-Real-IP, X-Original-URL...): a client's well-formed request id is kept and sent upstream
    under this name, past the drop of those headers from what the client sent."""
    name = _token(value)
    lowered = name.lower()
    if lowered in HOP_BY_HOP or lowered == "content-length":
        raise _Invalid(f"{value!r} frames the HTTP message (this hop writes it): name another header")
    if lowered in _MEANINGFUL or lowered.startswith("content-") or forged_by_client(lowered):
        raise _Invalid(f"{value!r} has a meaning of its own in requests or answers, which this header would "
                       "replace: name another header")
    return name


def _list(item: Callable[[Any], T]) -> Callable[[Any], tuple[T, ...]]:
    def parse(value: Any) -> tuple[T, ...]:
        if isinstance(value, _EnvList):  # a list that is one ``${NAME}`` (``_Loader.parse``)
            value = value.items()
        if not isinstance(value, list):
            raise _Invalid(f"{value!r} is not a list")
        items: list[T] = []
        bad: list[_Invalid] = []
        for index, value_ in enumerate(value):
            try:
                items.append(item(value_))
            except _Invalid as exc:  # every bad item is named, not only the first
                bad.extend(_Invalid(str(one), f"[{index}]{one.where}") for one in exc.each())
        if bad:
            raise _Invalid(str(bad[0]), bad[0].where, tuple(bad[1:]))
        return tuple(items)

    parse.reads_list = True  # type: ignore[attr-defined]
    return parse


class _EnvList(str):
    """A list written as one ``${NAME}`` reference: the environment holds text, read as items separated by commas,
    in brackets or not (``POST,PATCH``, ``[408, 429]``; empty: no items). Never read as YAML."""

    def items(self) -> list[str]:
        text = self.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        return [one.strip() for one in text.split(",") if one.strip()]


def _status(value: Any) -> int:
    return _int(100, 599)(value)


def _method(value: Any) -> str:
    return _token(value).upper()


_UPSTREAM_CREDENTIALS = (", which are never sent upstream: remove them (the client's own headers, Authorization "
                         "included, are passed on)")


def _http_url(value: Any, credentials: str = _UPSTREAM_CREDENTIALS) -> str:
    """An http(s) URL with a host (and a valid port, if any). Shown masked in errors: it may hold a password.
    ``credentials`` says what to do instead of writing a user and password in it."""
    text = _str(value).strip()  # a trailing newline from a secret or a file is not part of it
    shown = repr(SecretURL(text).masked())
    if any(ord(char) <= 0x20 or ord(char) == 0x7F for char in text):
        raise _Invalid(f"{shown} holds whitespace or a control character")
    try:
        parts = urlsplit(text)
        port = parts.port  # raises for a port that is not a number, or past 65535
    except ValueError:
        raise _Invalid(f"{shown} is not a valid URL (check the host and the port)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Invalid(f"{shown} is not an http(s) URL with a host")
    if port == 0:
        raise _Invalid(f"{shown} has port 0")
    if parts.username is not None or parts.password is not None:
        raise _Invalid(f"{shown} holds credentials{credentials}")
    return text.rstrip("/")


def _upstream_url(value: Any) -> str:
    """An upstream's http(s) URL: a path in it goes before every request's path; a query or a fragment would
    be dropped (each request's own query is passed on), so it is refused rather than ignored."""
    url = _http_url(value)
    if "?" in url or "#" in url:  # (an empty one too: "http://h/?")
        raise _Invalid(f"{SecretURL(url).masked()!r} has a query or a fragment, which would never be sent (each "
                       "request's own query is passed on): remove it")
    return url


# tracing.endpoint is the OTLP collector's, not an upstream's: a collector that wants a token takes it as a header.
_COLLECTOR_CREDENTIALS = ": give the collector's in OTEL_EXPORTER_OTLP_HEADERS (Authorization=...) instead"


def _optional_http_url(value: Any) -> str:
    """An http(s) URL, or empty for "not set" (what ``${NAME:-}`` gives)."""
    return "" if _str(value) == "" else _http_url(value, _COLLECTOR_CREDENTIALS)


def _redis_url(value: Any) -> SecretURL:
    return _store_url(value, ("redis", "rediss", "unix"), "a redis:// URL")


def _pg_dsn(value: Any) -> SecretURL:
    return _store_url(value, ("postgres", "postgresql"),
                      "a postgresql:// DSN (the URL form; libpq's key=value form is not read)")


def _store_url(value: Any, schemes: tuple[str, ...], what: str) -> SecretURL:
    """A store's URL, its hosts and ports checked at start (a port that is not a number or past 65535, a broken
    IPv6 host), so a slip fails ``check-config`` naming the key rather than ``serve`` or every request later.
    PostgreSQL's several hosts (``h1:5432,h2:5433``) are checked one by one."""
    url = SecretURL(_secret_text(value))
    try:
        parts = urlsplit(url.reveal())
        for host in parts.netloc.rpartition("@")[2].split(","):
            urlsplit(f"//{host}").port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError:
        raise _Invalid(f"{url.masked()!r} is not a valid URL (check the host and the port)") from None
    if parts.scheme not in schemes:
        raise _Invalid(f"{url.masked()!r} is not {what}")
    return url


def _admin_token(value: Any) -> Secret:
    """The admin API's bearer token, sent in an HTTP header: whitespace around it (the newline a secret file or a
    Kubernetes secret ends in) is not part of it, and a control character inside it could never be sent. Never
    shown in errors."""
    text = _secret_text(value).strip()
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in text):
        raise _Invalid("the value (a secret, not shown) holds a control character, which no Authorization header "
                       "can carry")
    return Secret(text)


STORE_KEY_BYTES = 32  # AES-256
REDIS_PORT = 6379  # a Redis node named without a port (redis-py's default too)


def _store_key(value: Any) -> Secret:
    """A storage encryption key: base64 of 32 random bytes (``idemproxy gen-key``); never shown in errors."""
    text = _secret_text(value).strip()
    if not text:
        raise _Invalid("is empty (generate a key with: idemproxy gen-key)")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _Invalid("the value (a secret, not shown) is not valid base64 (generate one with: idemproxy gen-key)"
                       ) from None
    if len(raw) != STORE_KEY_BYTES:
        raise _Invalid(f"decodes to {len(raw)} bytes, not {STORE_KEY_BYTES} (generate one with: idemproxy gen-key)")
    return Secret(text)


def _store_keys(value: Any) -> tuple[Any, ...]:
    """``previous_keys``: a list here; each item is checked by :func:`_encryption`, with its index in the path."""
    if not isinstance(value, list):
        raise _Invalid("is not a list of keys")
    return tuple(value)


def _network(value: Any) -> IPNetwork:
    text = _str(value)
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise _Invalid(f"{text!r} is not an IP address or CIDR network") from None


def _log_level(value: Any) -> str:
    if value is False:  # ``access: off`` unquoted is YAML's false: the documented way to say off
        return "OFF"
    text = _str(value).upper()
    if text not in ("DEBUG", "INFO", "WARNING", "ERROR", "OFF"):
        raise _Invalid(f"{value!r} is not one of debug, info, warning, error, off")
    return text


# --------------------------------------------------------------------------- loader

_Spec = dict[str, Callable[[Any], Any]]

_IDEMPOTENCY_SPEC: _Spec = {
    "header": _token,
    "methods": _list(_method),
    "required": _bool,
    "key_max_length": _int(1, KEY_MAX_LENGTH_LIMIT),
    "ttl": _positive_duration,
    "lease": parse_duration,
    "in_flight": _choice("reject", "wait"),
    "wait_timeout": _positive_duration,
    "store_5xx": _bool,
    "release_statuses": _list(_status),
    "on_unknown_outcome": _choice("keep_lease", "release", "store"),
    "canonical_json": _bool,
    "fingerprint_headers": _list(_forwarded_header),
    "replay_header": _response_header,
    "strip_replay_headers": _list(_token),
    "max_request_body": parse_size,
    "max_stored_response": parse_size,
    "settle_timeout": _positive_duration,
    "in_flight_status": lambda v: _status_in(v, (409, 425, 202)),
    "mismatch_status": lambda v: _status_in(v, (422, 409, 400)),
}


def _status_in(value: Any, allowed: tuple[int, ...]) -> int:
    status = _status(value)
    if status not in allowed:
        raise _Invalid(f"{value!r} is not one of {', '.join(map(str, allowed))}")
    return status

_SPECS: dict[type[Any], _Spec] = {
    ListenConfig: {
        "host": _str,
        "port": _int(0, 65535),
        "header_timeout": _positive_duration,
        "body_timeout": _positive_duration,
        "send_timeout": _positive_duration,
        "keepalive_timeout": _positive_duration,
    },
    AdminConfig: {
        "host": _str,
        "port": _int(0, 65535),
        "token": _admin_token,
        "ready_requires_store": _bool,
    },
    ForwardedConfig: {"trusted_proxies": _list(_network)},
    RequestIdConfig: {"header": _response_header},
    UpstreamConfig: {
        "url": _upstream_url,
        "connect_timeout": _positive_duration,
        "timeout": _positive_duration,
        "max_connections": _int(1, 100_000),
        "forward_key": _bool,
    },
    TenantConfig: {
        "from": _choice("header", "static"),
        "header": _token,
        "hash": _bool,
        "required": _bool,
        "static": _str,
    },
    IdempotencyConfig: _IDEMPOTENCY_SPEC,
    EmbeddedConfig: {"path": _str},
    PendingSettlesConfig: {"max_count": _int(1, 10_000_000), "max_bytes": parse_size},
    CompressionConfig: {"min_size": parse_size, "level": _int(1, 19)},
    EncryptionConfig: {"key": _store_key, "previous_keys": _store_keys},
    RedisConfig: {"url": _redis_url, "key_prefix": _str, "replay_cache_ttl": parse_duration, "cluster": _bool},
    PostgresConfig: {
        "dsn": _pg_dsn,
        "pool_min": _int(1, 1000),
        "pool_max": _int(1, 1000),
        "migrate": _migrate,
        "partitions": _choice("daily", "none"),
    },
    TracingConfig: {
        "enabled": _bool,
        "service_name": _str,
        "exporter": _choice("otlp", "console", "none"),
        "endpoint": _optional_http_url,
    },
    LogConfig: {
        "level": _log_level,
        "format": _choice("text", "json"),
        "access": _log_level,
    },
}


_NOTHING: Any = object()  # a parse that gave nothing (the error is noted): the field keeps its value


class _Loader:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.errors: list[str] = []
        self._failed: set[str] = set()
        self._whole_refs: set[str] = set()  # paths whose value is exactly one ``${NAME}`` reference

    def error(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}")
        self._failed.add(path)

    def failed(self, path: str) -> bool:
        """Whether ``path`` (or an item of it) already has an error: one mistake is reported once."""
        return any(failed == path or failed.startswith((f"{path}.", f"{path}[")) for failed in self._failed)

    def refused(self, path: str) -> bool:
        """Whether the value at ``path`` itself was refused (a section written as a string, say): a field of it
        then has no error of its own to add."""
        return path in self._failed

    def invalid(self, path: str, exc: _Invalid) -> None:
        for one in exc.each():
            self.error(path + one.where, str(one))

    def parse(self, path: str, parser: Callable[[Any], T], value: Any, default: T) -> T:
        """``parser(value)``, or ``default`` with the error noted; ``default`` also when ``path`` already has its
        error (an unset ``${NAME}``: that is the error, not the empty value it left)."""
        if self.failed(path):
            return default
        if path in self._whole_refs and isinstance(value, str) and getattr(parser, "reads_list", False):
            value = _EnvList(value)  # (a list due, given as one reference: its text read as items)
        try:
            return parser(value)
        except _Invalid as exc:
            self.invalid(path, exc)
            return default

    def substitute(self, path: str, value: Any) -> Any:
        """Expand ``${NAME}`` / ``${NAME:-default}`` in every string scalar."""
        if isinstance(value, dict):
            return {k: self.substitute(f"{path}.{_key_name(k)}" if path else _key_name(k), v)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [self.substitute(f"{path}[{i}]", v) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value

        def expand(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            held = self.env.get(name)
            if default is not None and not held:  # ":-" as in the shell: unset or empty takes the default
                return default
            if held is not None:
                return held
            self.error(path, f"environment variable {name} is not set (use ${{{name}:-default}})")
            return ""

        # The result stays a string even when it is all one variable: the environment holds text, and each
        # field's parser reads its type from text (ports, booleans, durations), so TOKEN=0012345 stays
        # "0012345" where YAML would make it the number 5349. Where a list is due, such a string is read as
        # items separated by commas (``_EnvList``).
        if _ENV.fullmatch(value):
            self._whole_refs.add(path)
        return _ENV.sub(expand, value)

    def section(self, cls: type[T], path: str, raw: Any, base: T | None = None, also_known: tuple[str, ...] = ()
                ) -> T:
        """Build dataclass ``cls`` from mapping ``raw``; unknown keys and bad values are errors. ``also_known``:
        keys the caller took out of ``raw`` itself, named among the known ones in an unknown key's error."""
        result = base if base is not None else cls()
        if raw is None:
            return result
        if not isinstance(raw, dict):
            self.error(path, _not_a("a mapping", raw))
            return result
        spec = _SPECS[cls]
        changes: dict[str, Any] = {}
        for key, value in raw.items():
            key_path = f"{path}.{_key_name(key)}"
            parser = spec.get(str(key))
            if parser is None:
                self.error(key_path, f"unknown key (known: {', '.join((*also_known, *spec))})")
                continue
            parsed = self.parse(key_path, parser, value, _NOTHING)
            if parsed is not _NOTHING:
                changes["from_" if key == "from" else str(key)] = parsed
        return replace(cast(Any, result), **changes)  # type: ignore[no-any-return]


def _not_a(due: str, value: Any) -> str:
    """A value of the wrong shape where a section or a list is due, by its kind alone: the value itself may be a
    secret written one level too high (``postgres: postgresql://app:pw@db/app`` for ``postgres: {dsn: ...}``)."""
    return f"{_kind(value)}, not {due} (the value is not shown)"


_KEY_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _key_name(key: Any) -> str:
    """A mapping key as an error's path names it: a key no section knows may be a value written as a key (a DSN
    in braces, ``postgres: {postgresql://app:pw@db/app}``): anything but a plain name is not shown."""
    text = str(key)
    return text if _KEY_NAME.match(text) else "<a key that is not a name (not shown)>"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_TOP_LEVEL = (
    "listen", "admin", "upstream", "tenant", "idempotency", "routes", "storage", "log",
    "forwarded", "request_id", "tracing", "drain_delay", "shutdown_timeout", "workers",
)


_ROUTE_OWN_KEYS = ("prefix", "enabled", "upstream")  # a route's keys beside the idempotency fields it overrides


def _routes(loader: _Loader, raw: Any, defaults: IdempotencyConfig) -> tuple[RouteConfig, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        loader.error("routes", _not_a("a list", raw))
        return ()
    routes = []
    for index, item in enumerate(raw):
        path = f"routes[{index}]"
        if not isinstance(item, dict):
            loader.error(path, _not_a("a mapping", item))
            continue
        overrides = dict(item)
        prefix = overrides.pop("prefix", None)
        enabled_raw = overrides.pop("enabled", True)
        own_upstream = "upstream" in overrides
        upstream_raw = overrides.pop("upstream", None)
        if loader.failed(f"{path}.prefix"):  # an unset ${NAME}: that is its error
            prefix = "/"
        elif prefix is None:
            loader.error(f"{path}.prefix", "is required (a path starting with '/')")
            prefix = "/"
        elif not isinstance(prefix, str) or not prefix.startswith("/"):
            loader.error(f"{path}.prefix", f"{prefix!r} must be a path starting with '/'")
            prefix = "/"
        elif (decoded := _request_path(prefix)) != prefix:  # (an escape request.path decodes would never match)
            loader.error(f"{path}.prefix", f"{prefix!r} is matched against the decoded path (%-escapes read as the "
                         f"characters they stand for): write it decoded ({decoded!r})")
        elif _unresolved(prefix):  # (every path under it would read as another at the upstream: AmbiguousPath)
            loader.error(f"{path}.prefix", f"{prefix!r} holds a repeated slash, a '.' or '..' segment, a ';' parameter "
                         "or a backslash: every request under it would be refused (400 bad_request) as a path an "
                         "upstream reads as another; write it resolved")
        enabled = loader.parse(f"{path}.enabled", _bool, enabled_raw, True)
        idem = loader.section(IdempotencyConfig, path, overrides, base=defaults, also_known=_ROUTE_OWN_KEYS)
        upstream = None
        if own_upstream:
            upstream = _switch(loader, UpstreamConfig, f"{path}.upstream", upstream_raw,
                               f"give its url, or remove {path}.upstream for the top-level upstream")
            if not (upstream.url or loader.failed(f"{path}.upstream.url") or loader.refused(f"{path}.upstream")):
                loader.error(f"{path}.upstream.url", "is required when a route names its own upstream")
        routes.append(RouteConfig(prefix=prefix, enabled=enabled, idempotency=idem, upstream=upstream))
    return tuple(routes)


def _storage(loader: _Loader, raw: Any) -> StorageConfig:
    if raw is None:
        return StorageConfig()
    if not isinstance(raw, dict):
        loader.error("storage", _not_a("a mapping", raw))
        return StorageConfig()
    known = ("embedded", "redis", "postgres", "on_store_error", "pending_settles", "compression", "encryption",
             "replay_memory")
    for key in raw:
        if key not in known:
            loader.error(f"storage.{_key_name(key)}", f"unknown key (known: {', '.join(known)})")
    redis = postgres = None
    if "redis" in raw:
        redis = _switch(loader, RedisConfig, "storage.redis", raw["redis"],
                        "give its url, or remove storage.redis to run without Redis")
    if "postgres" in raw:
        postgres = _switch(loader, PostgresConfig, "storage.postgres", raw["postgres"],
                           "give its dsn, or remove storage.postgres for the embedded store")
    compression = None
    if "compression" in raw:
        compression = _switch(loader, CompressionConfig, "storage.compression", raw["compression"],
                              "write `compression: {}` for its defaults, or remove it to store responses as they are")
    on_error = loader.parse("storage.on_store_error", _choice("fail_closed", "fail_open"),
                            raw.get("on_store_error", "fail_closed"), "fail_closed")
    return StorageConfig(
        embedded=loader.section(EmbeddedConfig, "storage.embedded", raw.get("embedded")),
        redis=redis,
        postgres=postgres,
        on_store_error=cast(Literal["fail_closed", "fail_open"], on_error),
        pending_settles=loader.section(PendingSettlesConfig, "storage.pending_settles", raw.get("pending_settles")),
        compression=compression,
        encryption=_encryption(loader, raw),
        replay_memory=_top_value(loader, raw, "replay_memory", parse_size, 16 * 1024 * 1024, "storage."),
    )


def _switch(loader: _Loader, cls: type[T], path: str, value: Any, fix: str) -> T:
    """A section that turns something on by being there, with its defaults for what it leaves out (``redis: {}``
    is Redis at 127.0.0.1:6379). Written with no value (YAML's null, as when every key under it is commented out)
    it is refused, saying how to ``fix`` it: read as ``{}``, a commented-out url turned on a Redis nobody named.
    Neither is ``false`` a way to turn it off (it was read as ``{}`` too): anything but a mapping is refused."""
    if value is None:
        loader.error(path, f"has no value (is every key under it commented out?): {fix}")
        return cls()
    return loader.section(cls, path, value)


def _encryption(loader: _Loader, raw: dict[str, Any]) -> EncryptionConfig | None:
    if "encryption" not in raw:
        return None
    # (written with no value: refused below, as storage.encryption.key is then missing)
    config = loader.section(EncryptionConfig, "storage.encryption", raw["encryption"] or {})
    # Without a key but with previous_keys, new values are stored in clear and old sealed ones still open:
    # the way to turn encryption off without losing the records it sealed.
    given = raw["encryption"] or {}
    if isinstance(given, dict) and "key" not in given and not config.previous_keys:
        loader.error("storage.encryption.key", "is required when storage.encryption is set "
                     "(e.g. key: ${IDEMPROXY_STORE_KEY}; generate one with: idemproxy gen-key)")
    previous = []
    for index, item in enumerate(config.previous_keys):
        try:
            previous.append(_store_key(item))
        except _Invalid as exc:
            loader.invalid(f"storage.encryption.previous_keys[{index}]", exc)
    return replace(config, previous_keys=tuple(previous))


def _top_value(loader: _Loader, raw: dict[str, Any], key: str, parse: Callable[[Any], T], default: T,
               path: str = "") -> T:
    return loader.parse(path + key, parse, raw[key], default) if key in raw else default


def _policies(config: Config) -> list[tuple[str, IdempotencyConfig, str, UpstreamConfig]]:
    """(path, idempotency, its upstream's path, upstream) for the defaults and every route."""
    policies = [("idempotency", config.idempotency, "upstream", config.upstream)]
    policies += [
        (f"routes[{i}]", r.idempotency, f"routes[{i}].upstream" if r.upstream else "upstream", config.upstream_for(r))
        for i, r in enumerate(config.routes)
    ]
    return policies


def advisories(config: Config) -> list[str]:
    """What a valid config does that an operator should know of (logged at start, printed by check-config)."""
    notes = []
    for path, idem, upstream_path, upstream in _policies(config):
        if lease_margin(idem.lease, upstream.timeout) < LEASE_MARGIN:  # the forward's own rule, one definition
            notes.append(
                f"{path}.lease: {_fmt_seconds(idem.lease)} leaves {_fmt_seconds(idem.lease - upstream.timeout)} "
                f"over {upstream_path}.timeout ({_fmt_seconds(upstream.timeout)}), under the "
                f"{_fmt_seconds(LEASE_MARGIN)} advised: a completion slower than that may lose the lease to a "
                "retry, which would forward again"
            )
    return notes


def _cross_checks(loader: _Loader, config: Config) -> None:
    if not (config.upstream.url or loader.failed("upstream.url") or loader.refused("upstream")):
        loader.error("upstream.url", "is required (the API to put idempotency in front of)")
    # Every upstream's timeout against the lease of every route that uses it (paths matching no route use
    # the top-level upstream with the idempotency defaults).
    # (A ttl shorter than the lease is fine: an in-flight record stands for its whole lease in every store, and a
    # completed one for the ttl.)
    _request_id_carries_no_secret(loader, config)
    for path, idem, upstream_path, upstream in _policies(config):
        if config.request_id.header.lower() in (name.lower() for name in idem.fingerprint_headers):
            loader.error(f"{path}.fingerprint_headers", f"{config.request_id.header!r} is request_id.header: each "
                         "attempt has its own (this hop makes one when the client's is missing or malformed), so "
                         "every retry would be another payload")
        if idem.replay_header.lower() == config.request_id.header.lower() and (
                path == "idempotency" or idem.replay_header != config.idempotency.replay_header):  # (said once)
            loader.error(f"{path}.replay_header", f"{idem.replay_header!r} is request_id.header too: each would "
                         "overwrite the other in every response")
        if idem.lease <= upstream.timeout:
            loader.error(
                f"{path}.lease",
                f"{_fmt_seconds(idem.lease)} must be longer than {upstream_path}.timeout "
                f"({_fmt_seconds(upstream.timeout)}), or a slow request loses its lease before its answer is stored",
            )
    _own_ports(loader, config.listen, config.admin)
    storage = config.storage
    largest = max(idem.max_stored_response for idem in [config.idempotency, *(r.idempotency for r in config.routes)])
    if storage.pending_settles.max_bytes < largest + 64 * 1024:
        loader.error(
            "storage.pending_settles.max_bytes",
            f"{storage.pending_settles.max_bytes} bytes cannot hold one stored answer (max_stored_response "
            f"{largest} bytes plus headers): a completion would be dropped as soon as the store failed",
        )
    if storage.redis is not None and storage.postgres is None:
        loader.error(
            "storage.redis",
            "Redis alone is refused: it is not durable; add storage.postgres (Redis is its fast path)",
        )
    if storage.redis is not None:
        _redis_url_fits(loader, storage.redis)
    if config.workers > 1 and storage.postgres is None:
        loader.error(
            "workers",
            f"{config.workers} workers need storage.postgres: the embedded store is single-instance only",
        )
    if storage.postgres is not None and storage.postgres.pool_min > storage.postgres.pool_max:
        loader.error("storage.postgres.pool_min", "must not exceed storage.postgres.pool_max")
    if config.tracing.endpoint and config.tracing.exporter != "otlp":
        loader.error("tracing.endpoint", f"is only used with exporter: otlp (not {config.tracing.exporter})")


def cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """A Redis Cluster's url split into the url of its first node and the (host, port) of the others it names
    (``redis://:pw@h1:6379,h2:6379/0``): any one of them answering is enough to learn the cluster from."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    first, *others = hosts.split(",")
    nodes = [urlsplit(f"//{host}") for host in others]
    return (parts._replace(netloc=f"{userinfo}{at}{first}").geturl(),
            [(node.hostname or "localhost", node.port or REDIS_PORT) for node in nodes])


def _redis_url_fits(loader: _Loader, redis: RedisConfig) -> None:
    """``storage.redis.url`` as redis-py reads it, and as ``cluster`` allows: several hosts (``h1:6379,h2:6379``)
    are the nodes a cluster client may learn the cluster from, a single Redis has one; a cluster has database 0
    only and is not reached through a unix socket; an option redis-py cannot read (``?db=x``) fails its every
    command. Each passed check-config, then failed ``serve`` or left the proxy on PostgreSQL alone."""
    path = "storage.redis.url"
    if loader.failed(path):
        return
    url = redis.url.reveal()
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2].split(",")
    shown = repr(redis.url.masked())
    if len(hosts) > 1 and not redis.cluster:
        loader.error(path, f"{shown} names {len(hosts)} hosts: only a Redis Cluster's url may "
                     "(storage.redis.cluster: true), each a node to learn the cluster from")
    elif redis.cluster and parts.scheme == "unix":
        loader.error(path, f"{shown}: a Redis Cluster is not reached through a unix socket "
                     "(storage.redis.cluster: true): name its nodes' hosts and ports")
    elif len(hosts) > 1 and not all(hosts):
        loader.error(path, f"{shown} has an empty host in its list of nodes")
    else:
        # (imported here, as the store imports redis-py: a config without Redis loads none of it, nor what it
        # loads, such as OpenTelemetry when installed, which a proxy with tracing off must not load)
        from redis.asyncio.connection import parse_url

        try:
            database = parse_url(cluster_nodes(url)[0]).get("db", 0)
        except ValueError as exc:  # (redis-py's words name the option, never a value)
            loader.error(path, f"{shown}: {exc}")
            return
        if redis.cluster and database != 0:
            loader.error(path, f"{shown}: a Redis Cluster has database 0 only (storage.redis.cluster: true), "
                         f"not {database}")


def _own_ports(loader: _Loader, listen: ListenConfig, admin: AdminConfig) -> None:
    """The proxy and its admin API on one port of one address: bound twice in one process, "address already in
    use" (by our own admin port); with --workers (SO_REUSEPORT) both bind, and the kernel hands each connection
    to the proxy or to the admin API. (`serve` compares the sockets as bound, for names only a resolver knows.)"""
    if not listen.port or listen.port != admin.port or any(
            loader.failed(path) for path in ("listen.host", "listen.port", "admin.host", "admin.port")):
        return  # (a host refused is its own error: its default, 0.0.0.0, would collide with anything)
    on_listen, on_admin = _addresses(listen.host), _addresses(admin.host)
    if on_listen is None or on_admin is None or on_listen & on_admin:
        named = f": {admin.host} and {listen.host} are one address" if on_listen and listen.host != admin.host else ""
        loader.error("admin.port", f"{admin.port} is listen.port too (on an address both listen on{named}): the proxy "
                     "and its admin API need ports of their own")


_INET_ATON = re.compile(r"[0-9a-fx.]+")  # what the resolver may read as an IPv4 address: 127.1, 0x7f.0.0.1, 0


def _addresses(host: str) -> frozenset[str] | None:
    """The addresses a server listening on ``host`` takes, as far as they are known without asking a resolver:
    None for every address (a wildcard, ``""``, ``0``, ``::``, overlapping any other); an address in whatever
    spelling the system's resolver reads as one (``127.1``, ``0:0::1``) as that address; ``localhost`` as the
    loopback addresses; any other name as itself (compared as written, case aside)."""
    name = host.lower()
    if name == "localhost":
        return frozenset(("127.0.0.1", "::1"))
    if not name:
        return None
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        try:  # (inet_aton, as getaddrinfo uses it; the pattern keeps out what glibc's reads past: "1.2.3.4 x")
            address = ipaddress.IPv4Address(socket.inet_aton(name) if _INET_ATON.fullmatch(name) else b"")
        except (OSError, ValueError):
            return frozenset((name,))
    return None if address.is_unspecified else frozenset((str(address),))


def _request_id_carries_no_secret(loader: _Loader, config: Config) -> None:
    """The request id header is echoed in every response, written to the access log, and replaced upstream by this
    hop's own id when the client's is malformed: never a header that carries the tenant's credential or the key
    (a credential without a space, ``sk_live_...``, was echoed and logged in clear; ``Bearer ...`` reached the
    upstream as a random id; a key was logged raw)."""
    name = config.request_id.header
    if name.lower() in ("authorization", "cookie") or (
            config.tenant.from_ == "header" and name.lower() == config.tenant.header.lower()):
        loader.error("request_id.header", f"{name!r} carries a credential (tenant.header, Authorization or Cookie): "
                     "the request id is echoed in every response, written to the access log and replaced upstream "
                     "by this hop's own id when malformed; name another header")
        return
    for path, idem, _upstream_path, _upstream in _policies(config):
        if idem.header.lower() == name.lower():  # (the first policy that names it: one error)
            loader.error("request_id.header", f"{name!r} is {path}.header (the idempotency key): the request id is "
                         "echoed in every response, written to the access log and replaced upstream by this hop's "
                         "own id when malformed; name another header")
            return


def _fmt_seconds(value: float) -> str:
    return f"{value:g}s"


def load_config(
    raw: Any,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build a checked :class:`Config` from parsed YAML; raise :class:`ConfigError` listing all errors.

    ``overrides`` holds dotted keys (``upstream.url``) set by command-line flags; they win over the file.
    """
    loader = _Loader(os.environ if env is None else env)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"<root>: {_not_a('a mapping', raw)}"])
    raw = loader.substitute("", _apply_overrides(raw, overrides or {}))
    for key in raw:
        if key not in _TOP_LEVEL:
            loader.error(_key_name(key), f"unknown key (known: {', '.join(_TOP_LEVEL)})")
    idempotency = loader.section(IdempotencyConfig, "idempotency", raw.get("idempotency"))
    config = Config(
        listen=loader.section(ListenConfig, "listen", raw.get("listen")),
        admin=loader.section(AdminConfig, "admin", raw.get("admin")),
        upstream=loader.section(UpstreamConfig, "upstream", raw.get("upstream")),
        tenant=loader.section(TenantConfig, "tenant", raw.get("tenant")),
        idempotency=idempotency,
        routes=_routes(loader, raw.get("routes"), idempotency),
        storage=_storage(loader, raw.get("storage")),
        log=loader.section(LogConfig, "log", raw.get("log")),
        forwarded=loader.section(ForwardedConfig, "forwarded", raw.get("forwarded")),
        request_id=loader.section(RequestIdConfig, "request_id", raw.get("request_id")),
        tracing=loader.section(TracingConfig, "tracing", raw.get("tracing")),
        drain_delay=_top_value(loader, raw, "drain_delay", parse_duration, 5.0),
        # (zero would cut every in-flight request and pending completion at once: executed answers never stored)
        shutdown_timeout=_top_value(loader, raw, "shutdown_timeout", _positive_duration, 30.0),
        workers=_top_value(loader, raw, "workers", _int(1, 256), 1),
    )
    _cross_checks(loader, config)
    if loader.errors:
        raise ConfigError(loader.errors)
    return config


def _apply_overrides(raw: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    result = dict(raw)
    for dotted, value in overrides.items():
        node = result
        *parents, last = dotted.split(".")
        for part in parents:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, dict) else {}
            node = node[part]
        node[last] = value
    return result


def load_config_file(
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Read and check a YAML file (None: defaults plus ``overrides``)."""
    if path is None:
        return load_config({}, env=env, overrides=overrides)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read the file ({exc.strerror})"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text (byte {exc.start})"]) from exc
    try:
        return load_config(_parse_yaml(path, text), env=env, overrides=overrides)
    except RecursionError:  # (the parser's, or the loader's walk over a value that holds itself)
        raise ConfigError([f"{path}: a value is nested too deeply, or holds itself through an alias (`*name` "
                           "inside the value anchored `&name`): write it out"]) from None


def _parse_yaml(path: str | os.PathLike[str], text: str) -> Any:
    """The YAML document, with every ``${NAME}`` / ``${NAME:-default}`` left as written for ``load_config`` to
    expand: each is shielded from the YAML parser first, so one may stand anywhere a plain word may, in a flow
    mapping too (``{token: ${TOKEN:-}}``, where YAML alone would read its braces as the mapping's). A value from
    the environment never passes through the parser, so it cannot change the document's structure."""
    nonce = secrets.token_hex(6)
    written: list[str] = []

    def shield(match: re.Match[str]) -> str:
        if "\n" in match.group(0):  # a default over several lines: left to YAML, as before
            return match.group(0)
        written.append(match.group(0))
        return f"idemproxyref{nonce}n{len(written) - 1}x"

    placeholder = re.compile(f"idemproxyref{nonce}n([0-9]+)x")
    loader = yaml.SafeLoader(_ENV.sub(shield, text) if "${" in text else text)
    try:
        node = loader.get_single_node()
        repeated = _repeated_keys(node, lambda key: placeholder.sub(lambda m: written[int(m.group(1))], key))
        raw = loader.construct_document(node) if node is not None and not repeated else None
    except yaml.YAMLError as exc:
        # Where and what, in one line; never the excerpt PyYAML quotes, which may hold a secret.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "cannot be parsed"
        raise ConfigError([f"{path}: not valid YAML{where}: {problem}"]) from None
    finally:
        loader.dispose()
    if repeated:
        raise ConfigError(repeated)
    if not written:
        return raw

    def unshield(value: Any) -> Any:
        if isinstance(value, str):
            return placeholder.sub(lambda m: written[int(m.group(1))], value)
        if isinstance(value, dict):
            return {unshield(k): unshield(v) for k, v in value.items()}
        if isinstance(value, list):
            return [unshield(v) for v in value]
        return value

    return unshield(raw)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _repeated_keys(node: yaml.Node | None, written: Callable[[str], str]) -> list[str]:
    """Every key a mapping gives twice, by its path: YAML would keep the last one without a word, so a second
    ``idempotency:`` block, or a second ``lease:``, would silently undo the first. A merge key's (``<<``) keys may
    be overridden, as merging means; an alias is the node it names, walked once. ``written``: a key as written
    (its ``${NAME}`` references back in place)."""
    errors: list[str] = []
    walked: set[int] = set()
    pending: deque[tuple[yaml.Node, str]] = deque([(node, "")] if node is not None else [])
    while pending:
        current, path = pending.popleft()
        if id(current) in walked:
            continue
        walked.add(id(current))
        if isinstance(current, yaml.SequenceNode):
            pending.extend((item, f"{path}[{index}]") for index, item in enumerate(current.value))
        elif isinstance(current, yaml.MappingNode):
            lines: dict[tuple[str, str], int] = {}
            for key, value in current.value:
                if key.tag == _MERGE_TAG or not isinstance(key, yaml.ScalarNode):
                    pending.append((value, path))
                    continue
                name = _key_name(written(key.value))
                child = f"{path}.{name}" if path else name
                line = key.start_mark.line + 1
                if (key.tag, key.value) in lines:
                    errors.append(f"{child}: given twice (lines {lines[key.tag, key.value]} and {line}); YAML "
                                  "would keep only the last: write it once")
                else:
                    lines[key.tag, key.value] = line
                pending.append((value, child))
    return errors


# --------------------------------------------------------------------------- output


# Plain-text URLs that may still carry a credential (``?token=`` for an API gateway or a collector, a user's
# password): shown masked as the stores' URLs are.
_URL_FIELDS = frozenset({"url", "endpoint"})


def to_plain(config: Config) -> dict[str, Any]:
    """The effective config as plain data with every secret masked (for check-config and logs)."""
    return cast(dict[str, Any], _plain(config))


def _plain(value: Any) -> Any:
    if isinstance(value, Secret):
        return value.masked()
    if isinstance(value, RouteConfig):
        route = {"prefix": value.prefix, "enabled": value.enabled, **_plain(value.idempotency)}
        return route if value.upstream is None else {**route, "upstream": _plain(value.upstream)}
    if isinstance(value, ipaddress.IPv4Network | ipaddress.IPv6Network):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A section that is off (storage.redis, .postgres, .compression, .encryption) is left out, as a route's
        # own upstream is: written back as `null`, the loader would refuse it.
        return {
            ("from" if f.name == "from_" else f.name): _plain_field(f.name, getattr(value, f.name))
            for f in fields(value) if getattr(value, f.name) is not None
        }
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _plain_field(name: str, value: Any) -> Any:
    if name in _URL_FIELDS and isinstance(value, str):
        return SecretURL(value).masked()
    return _plain(value)


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(to_plain(config), sort_keys=False)
