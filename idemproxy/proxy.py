"""Forwarding to the upstream: header hygiene, streaming, and client errors translated at one boundary.

This module knows HTTP and nothing of idempotency records.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import socket
import struct
import termios
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import aiohttp
from aiohttp import HttpVersion11, web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from idemproxy.client import (
    ConnectionPool,
    HeaderInjection,
    Interim,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamSendLate,
    UpstreamUnrelayable,
)
from idemproxy.config import HOP_BY_HOP, Config, IPNetwork, RouteConfig, UpstreamConfig, forged_by_client
from idemproxy.problems import (
    BadRequest,
    ClientGone,
    ClientStalled,
    StoreUnavailable,
    UpstreamAnswerRefused,
    UpstreamReset,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from idemproxy.tracing import Tracer

log = logging.getLogger("idemproxy.proxy")

CHUNK = 64 * 1024
SMALL_BODY = 64 * 1024  # plain proxying reads bodies up to this size whole instead of streaming them


REQUEST_ID = web.RequestKey("request_id", str)
"""This request's id (set by the app before the engine runs)."""

UPSTREAM_SERVER = web.RequestKey("upstream_server", bool)
"""True when the response being sent carries the upstream's own ``Server`` header (kept, not stripped)."""

CONTINUE = web.RequestKey("continue", bool)
"""True while the request's ``Expect: 100-continue`` still waits for its interim 100. The 100 goes out when the
body is first read (``continue_body``), as Go's net/http does, not as the head arrives: a request refused
before its body is read (no key on a required route, a Content-Length over ``max_request_body``) gets its final
answer without the client uploading a body that would be thrown away."""

UPLOAD_ANSWERED = web.RequestKey("upload_answered", bool)
"""True once the upstream answered a pass-through upload still streaming to it (an early answer): the rest of its
body is no longer waited for (``listen.body_timeout`` does not cut it), so a client that stops sending then is not
cut mid-answer. What is left of the upload goes with the upstream's connection when the answer ends."""

_CONTINUE_LINE = b"HTTP/1.1 100 Continue\r\n\r\n"

_R = TypeVar("_R", bound=web.StreamResponse)

UNTYPED = web.ResponseKey("untyped", bool)
"""Set on an upstream's answer (live or replayed) that came without ``Content-Type``: aiohttp adds
``application/octet-stream`` to any body without one, and the app's response hook takes it off again."""


def upstream_answer(status: int, reason: str | None, headers: CIMultiDict[str], body: bytes) -> web.Response:
    """A whole upstream answer (or a replay of one) as a response, its headers as they were."""
    return _as_sent(web.Response(status=status, reason=reason, headers=headers, body=body), headers)


def _as_sent(response: _R, headers: CIMultiDict[str]) -> _R:
    """``response``, built from the upstream's ``headers``, marked UNTYPED when they had no Content-Type."""
    if "Content-Type" not in headers:
        response[UNTYPED] = True
    return response


@dataclass(frozen=True)
class HeaderPolicy:
    """How this hop writes the forwarding headers: whom to believe, and where the request id goes."""

    trusted_proxies: tuple[IPNetwork, ...] = ()
    request_id_header: str = "X-Request-Id"

    def trusts(self, peer: str | None) -> bool:
        if not peer or not self.trusted_proxies:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:  # a unix socket peer, or none
            return False
        return any(address in network for network in self.trusted_proxies)


# Not sent upstream: Host (the upstream's own is set), and Expect, which the proxy answered itself (the 100 is
# the proxy's, and the body goes upstream whole with the head, as Envoy does by default).
_NOT_FORWARDED = ("host", "expect")
_CONTENT_LENGTH = ("content-length",)


def hop_by_hop(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> frozenset[str]:
    """The standard hop-by-hop names plus every name listed in ``Connection``."""
    listed = headers.getall("Connection", ())
    if not listed:
        return HOP_BY_HOP
    named = {token.strip().lower() for value in listed for token in value.split(",") if token.strip()}
    return HOP_BY_HOP | named


def filter_headers(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: Iterable[str] = ()
) -> CIMultiDict[str]:
    """A copy without hop-by-hop headers and without the names in ``drop`` (lower case)."""
    # Copy, then delete the few names that must go: a copy is made in C, while testing each header's lowered
    # name in Python cost several times more (names compare case-insensitively either way, as str.lower()).
    out = CIMultiDict(headers)
    for name in hop_by_hop(headers):
        if name in out:
            out.popall(name)
    for name in drop:
        if name in out:
            out.popall(name)
    return out


def upstream_request_headers(
    request: web.BaseRequest, policy: HeaderPolicy, drop: Iterable[str] = ()
) -> CIMultiDict[str]:
    """The client's headers as the upstream should see them: X-Forwarded-* and the request id set.

    X-Forwarded-Proto/-Host sent by a trusted proxy (``forwarded.trusted_proxies``) describe the client's
    original request and pass through; from anyone else they could be forged, so this hop sets them, and drops
    every other header an upstream could read the client's hop from (``forged_by_client``).
    """
    # What came in, hop-by-hop headers gone: an X-Forwarded-* the client named in Connection is not passed on,
    # nor appended to.
    headers = filter_headers(request.headers, drop=(*_NOT_FORWARDED, *drop) if drop else _NOT_FORWARDED)
    trusted = policy.trusts(request.remote)
    if not trusted:
        names = " ".join(headers.keys()).lower()  # (one search in C first: most requests carry none)
        if "forwarded" in names or "real" in names or "url" in names:
            for name in [name for name in headers.keys() if forged_by_client(name)]:
                headers.popall(name, None)
    remote = request.remote or ""
    forwarded_for = ", ".join([*headers.getall("X-Forwarded-For", ()), remote])
    headers["X-Forwarded-For"] = forwarded_for.strip(", ")
    if not (trusted and "X-Forwarded-Proto" in headers):
        headers["X-Forwarded-Proto"] = request.scheme
    if not (trusted and "X-Forwarded-Host" in headers):
        headers.popall("X-Forwarded-Host", None)
        host = _requested_host(request)
        if host:
            headers["X-Forwarded-Host"] = host
    request_id = request.get(REQUEST_ID)
    if request_id:
        headers[policy.request_id_header] = request_id
    return headers


def _requested_host(request: web.BaseRequest) -> str | None:
    """The host the client asked for: an absolute-form target's authority (RFC 9112 §3.2.2: Host is then
    ignored), else its Host header; never the address the request arrived on (aiohttp's ``request.host``
    without Host), and None when the client named none."""
    raw = request.raw_path
    if raw.startswith("/"):
        return request.headers.get("Host")
    authority = _target_url(raw).raw_authority.rpartition("@")[2]  # without any userinfo
    return authority or None


def _target_url(raw: str) -> URL:
    """A target that is not a path, read as a URL (empty when it is not one)."""
    try:
        return URL(raw, encoded=True)
    except ValueError:
        return URL()


def request_target(request: web.BaseRequest) -> str:
    """Path and query exactly as the client sent them; an absolute-form target (``POST http://host/x``,
    RFC 9112 §3.2.2) means its path and query. Anything else (``*``, authority-form) is a 400."""
    raw = request.raw_path
    if raw.startswith("/"):
        return raw
    url = _target_url(raw)
    if not url.is_absolute() or not url.raw_path.startswith("/"):
        raise BadRequest("The request target must be a path (or an absolute URL).")
    if not url.raw_query_string and "?" in raw.partition("#")[0]:  # (an empty query, which yarl drops, is one too)
        return url.raw_path + "?"
    return url.raw_path_qs


def client_response_headers(
    upstream: UpstreamResponse, own: Iterable[tuple[str, str]] = ()
) -> CIMultiDict[str]:
    """The upstream's headers for the client, with the proxy's ``own`` in place of any the upstream sent by
    the same names (an upstream with idempotency of its own may send ``Idempotent-Replayed`` itself)."""
    # Content-Length is set again by whoever writes the body.
    headers = filter_headers(upstream.headers, drop=_CONTENT_LENGTH)
    for name, value in own:
        headers.popall(name, None)
        headers.add(name, value)
    return headers


def upstream_errors() -> _UpstreamErrors:
    """Translate client errors into problems, telling "nothing was sent" from "outcome unknown".

    UpstreamUnreachable means the request certainly never reached the upstream (connect failed or timed
    out); UpstreamTimeout and UpstreamReset mean it may have been executed.
    """
    return _UPSTREAM_ERRORS


class _UpstreamErrors:
    """``upstream_errors()``: a class, not a generator, since every forward enters it (it keeps no state)."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            return
        if isinstance(exc.__cause__, ClientStalled):  # the client's body stalled as it streamed upstream
            raise exc.__cause__.problem("the upstream's connection was cut before the body's end: it never got the "
                                        "request whole.") from exc
        if isinstance(exc, UpstreamSendLate):  # (only a covered request has a time to send by: its lease's)
            raise StoreUnavailable("This proxy was held up until the key's lease had all but run out; nothing was "
                                   "sent.", maybe_applied=False) from exc
        if isinstance(exc, UpstreamConnectError):
            raise UpstreamUnreachable("The upstream could not be reached; nothing was sent.") from exc
        if isinstance(exc, TimeoutError):
            raise UpstreamTimeout("The upstream did not answer in time.") from exc
        if isinstance(exc, UpstreamUnrelayable):
            answered = f" {exc.status}" if exc.status else ""
            raise UpstreamAnswerRefused(f"The upstream answered{answered} with {exc.what}, which the proxy does not "
                                        "relay.", exc.status) from exc
        if isinstance(exc, UpstreamProtocolError):  # (its message is the client's own: what broke, no address)
            raise UpstreamReset(f"The upstream connection broke before a full answer. {exc}") from exc
        if isinstance(exc, aiohttp.ClientError | OSError):  # (aiohttp's: a client's streamed body that broke)
            raise UpstreamReset("The upstream connection broke before a full answer.") from exc


_UPSTREAM_ERRORS = _UpstreamErrors()


class Upstream:
    """One connection pool to the upstream (``idemproxy.client``)."""

    def __init__(
        self, config: UpstreamConfig, tracer: Tracer | None = None, policy: HeaderPolicy | None = None
    ) -> None:
        self.config = config
        self.base = config.url
        self.tracer = tracer if tracer is not None else Tracer()
        self.policy = policy if policy is not None else HeaderPolicy()
        self._pool: ConnectionPool | None = None

    async def open(self) -> None:
        self._pool = ConnectionPool(
            self.config.url, limit=self.config.max_connections,
            connect_timeout=self.config.connect_timeout, read_timeout=self.config.timeout,
        )

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    @property
    def pool(self) -> ConnectionPool:
        assert self._pool is not None, "Upstream.open() was not awaited"
        return self._pool

    @staticmethod
    def target(request: web.BaseRequest) -> str:
        """The request target exactly as the client sent it (path and query byte for byte), or 400."""
        target = request_target(request)
        if " " in target or "\r" in target or "\n" in target:
            raise BadRequest("The request target cannot be forwarded.")
        return target

    def request_headers(self, request: web.BaseRequest, drop: Iterable[str] = ()) -> CIMultiDict[str]:
        """The client's headers as this upstream is to get them (:func:`upstream_request_headers`)."""
        return upstream_request_headers(request, self.policy, drop)

    async def send(
        self, request: web.BaseRequest, headers: CIMultiDict[str], body: bytes | AsyncIterator[bytes] | None,
        timeout: float | None = None, interim: Interim | None = None, send_by: float | None = None,
    ) -> UpstreamResponse:
        """Send the request (never retried: RFC 9110 §9.2.2) and return the response head. ``timeout`` bounds
        the exchange and the body's reads (``ConnectionPool.request``); ``interim`` is given its 1xx answers;
        past ``send_by`` (``time.monotonic()``) nothing is sent (``UpstreamSendLate``)."""
        self.tracer.inject(headers)  # tracing on: the upstream continues the trace under the current span
        target = self.target(request)
        with upstream_errors():
            try:
                return await self.pool.request(request.method, target, headers, body, timeout, interim, send_by)
            except HeaderInjection as exc:  # refused before anything was sent
                raise BadRequest("The request cannot be forwarded: a header holds a line break.") from exc

    async def passthrough(self, request: web.BaseRequest) -> web.StreamResponse:
        """Plain reverse proxy. Bodies up to SMALL_BODY bytes (declared) are read whole and sent in one write:
        cheaper than chunked streaming, which costs a write per chunk and chunked framing. Anything larger, or
        of unknown length, streams in chunks, so memory stays bounded."""
        length = request.content_length
        body: bytes | AsyncIterator[bytes] | None = None
        if request.body_exists:
            try:
                if not request.content.is_eof():  # (a body still to come may wait for its 100)
                    await continue_body(request)
                body = await request.read() if length is not None and length <= SMALL_BODY else _stream_body(request)
            except ConnectionResetError as exc:  # (a streamed body that breaks later is the upstream's 502)
                raise ClientGone from exc
            except ClientStalled as exc:  # (read whole before the forward: nothing was sent)
                raise exc.problem("nothing was forwarded.") from exc
        interim = _interim_relay(request) if request.version >= HttpVersion11 else None  # (none to HTTP/1.0)
        upstream = await self.send(request, self.request_headers(request), body, interim=interim)
        if body is not None and not isinstance(body, bytes):
            request[UPLOAD_ANSWERED] = True
        try:
            if _small_answer(request, upstream):
                with upstream_errors():  # nothing sent to the client yet: a broken body is a proper 502
                    payload = await read_answer(upstream)
                return upstream_answer(upstream.status, upstream.reason, client_response_headers(upstream), payload)
            return await stream_response(request, upstream)
        finally:
            upstream.release()


class Upstreams:
    """Every upstream of the config, one pool each, and which one serves a route.

    The top-level upstream has a pool, and so does each route that names an upstream, even with the same settings
    as another (README: "its own connection pool"): a route given the same API to keep a slow prefix from
    starving the rest keeps its own ``max_connections``. Routes naming none use the top-level upstream's pool.
    """

    def __init__(self, config: Config, tracer: Tracer | None = None) -> None:
        policy = HeaderPolicy(
            trusted_proxies=config.forwarded.trusted_proxies, request_id_header=config.request_id.header,
        )
        self._default = Upstream(config.upstream, tracer, policy)
        # By the route itself (its position), not its settings: equal routes would share a pool otherwise.
        self._routes: dict[int, Upstream] = {
            id(route): Upstream(route.upstream, tracer, policy) for route in config.routes if route.upstream is not None
        }
        self._config = config  # (keeps the routes, and so their ids, alive)

    @property
    def default(self) -> Upstream:
        return self._default

    def for_route(self, route: RouteConfig | None) -> Upstream:
        if route is None or route.upstream is None:
            return self._default
        return self._routes[id(route)]

    def __iter__(self) -> Iterator[Upstream]:
        return iter((self._default, *self._routes.values()))

    async def open(self) -> None:
        for upstream in self:
            await upstream.open()

    async def close(self) -> None:
        for upstream in reversed(tuple(self)):
            await upstream.close()


def _interim_relay(request: web.BaseRequest) -> Interim:
    """Hands an upstream's 1xx answers (a 103 Early Hints, a 102) on to the client as they come, as RFC 9110
    §15.2 asks of a proxy: hop-by-hop headers dropped, the rest byte for byte. Pass-through only: a covered
    request's answer is stored before the client sees a byte of it."""

    def relay(status: int, reason: bytes, headers: list[tuple[str, str]]) -> None:
        transport = request.transport
        if transport is None or transport.is_closing():  # (the client is gone: its final answer will find out)
            return
        kept = filter_headers(CIMultiDict(headers))
        lines = [f"HTTP/1.1 {status} ".encode() + reason + b"\r\n"]
        lines.extend(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape") for name, value in kept.items())
        lines.append(b"\r\n")
        transport.write(b"".join(lines))

    return relay


def _small_answer(request: web.BaseRequest, upstream: UpstreamResponse) -> bool:
    """A response with a declared small body (HEAD, 204 and 304 keep the streaming path's header handling)."""
    length = upstream.content_length
    return (length is not None and length <= SMALL_BODY and request.method != "HEAD"
            and upstream.status not in (204, 304))


async def continue_body(request: web.BaseRequest) -> None:
    """Before the body is read: the interim 100 the client waits for, if it waits for one (``CONTINUE``)."""
    if request.get(CONTINUE):
        request[CONTINUE] = False
        await request.writer.write(_CONTINUE_LINE)
        request.writer.output_size = 0  # the interim answer is not part of the response's size
        await request.writer.drain()


async def _stream_body(request: web.BaseRequest) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_chunked(CHUNK):
        yield chunk


_OUTQ = getattr(termios, "TIOCOUTQ", None)  # SIOCOUTQ on a socket (Linux)


def unsent_bytes(transport: asyncio.Transport) -> int:
    """The bytes written to a client it has not taken yet: this process's buffer, and the kernel's bytes the
    client has not acknowledged (it acknowledges what its side's buffer takes in). A client that reads makes this
    go down as its kernel makes room again: about a segment at a time, or half its receive buffer."""
    queued = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None and _OUTQ is not None:
        with contextlib.suppress(OSError, ValueError):
            queued += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0" * 4))[0]
    return int(queued)


_NO_LINGER = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection, its queue dropped


def reset(transport: asyncio.Transport) -> None:
    """Cut a client that does not take its answer: reset, as nginx's reset_timedout_connection. A socket closed
    with bytes queued sends them, then its FIN, as the client reads, and the kernel holds them meanwhile (an orphan
    in FIN-WAIT-1, for as long as the client keeps its end: loopback's 2.8 MB a connection); with no linger its
    close sends RST and drops the queue at once. (``abort``: close() would wait for the client to take this
    process's bytes first.)"""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):  # (ValueError: its fd is -1, the socket closed already)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
    transport.abort()


async def _write_patiently(
    request: web.BaseRequest, response: web.StreamResponse, chunk: bytes, patience: float | None
) -> None:
    """``response.write(chunk)``, cut (TimeoutError) once the client has taken no byte for ``patience`` seconds:
    one write (a chunk, then aiohttp's drain down to the low-water mark) may take longer than that for a client
    that reads slowly but steadily, and that client is not gone."""
    transport = request.transport
    if patience is None or transport is None:
        await response.write(chunk)
        return
    write = asyncio.ensure_future(response.write(chunk))

    def unsent() -> int:
        if transport.is_closing():  # the client left (its socket's fd may be -1 already) while the write waited
            raise ConnectionResetError("the client's connection closed mid-response")
        return unsent_bytes(transport)

    try:
        await asyncio.sleep(0)  # the write runs first: its bytes are in the buffers measured
        left = unsent()
        while True:
            done, _ = await asyncio.wait((write,), timeout=patience)
            if done:
                return write.result()
            now = unsent()
            if now >= left:  # not a byte taken for ``patience``
                raise TimeoutError
            left = now
    finally:
        if not write.done():
            write.cancel()
        # (also a write that failed already, the client gone, as the look at its progress raised: its error is
        # retrieved here, never logged by asyncio as "Task exception was never retrieved")
        write.add_done_callback(lambda task: task.cancelled() or task.exception())


async def stream_response(
    request: web.BaseRequest,
    upstream: UpstreamResponse,
    *,
    head: bytes = b"",
    extra_headers: Iterable[tuple[str, str]] = (),
) -> web.StreamResponse:
    """Stream the upstream's answer to the client (``head``: bytes already read from it)."""
    headers = client_response_headers(upstream, extra_headers)
    request[UPSTREAM_SERVER] = "Server" in headers
    response = _as_sent(web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers), headers)
    if upstream.content_length is not None:
        response.content_length = upstream.content_length
    elif request.version < HttpVersion11:
        # No chunked framing for HTTP/1.0: the body ends at the close. aiohttp leaves "Connection: keep-alive" off
        # such an answer but keeps the connection, so the client waits for the close (or reads the next answer).
        response.force_close()
    reading = False  # which side failed, if one does: the upstream's read or the client's write
    # A client that takes no bytes for as long as the upstream may stay silent is gone as far as this answer goes:
    # aiohttp's write waits for the client without a bound, and the upstream connection (a pool slot) with it.
    patience = upstream.read_timeout
    try:
        await response.prepare(request)  # (a client gone before the head is written fails here)
        if head:
            await _write_patiently(request, response, head, patience)
        while True:
            reading = True
            chunk = await upstream.read_chunk(CHUNK)
            if not chunk:
                break
            reading = False
            await _write_patiently(request, response, chunk, patience)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        if reading:
            # Headers are gone already: the only honest signal left is to cut the connection.
            log.warning("upstream body broke mid-stream (%s); closing the client connection",
                        type(exc).__name__)
        else:  # the client hung up (or stalled past the server's limits): its loss, nothing wrong upstream
            log.info("client went away mid-response (%s); the rest of the upstream's answer is dropped",
                     type(exc).__name__)
        if request.transport is not None:
            # A client that stopped reading would hold a close() up for as long as it stays connected (its
            # unsent bytes wait to be flushed): cut it. An upstream fault closes, flushing what the client has.
            if reading:
                request.transport.close()
            else:
                reset(request.transport)
        return response
    await response.write_eof()
    return response


async def read_answer(upstream: UpstreamResponse) -> bytes:
    """The whole body of an answer whose head came: one that breaks off or stalls is the upstream's answer in a
    form not relayed (502 ``upstream_reset`` with its status, as the engine settles a covered one), not a timeout."""
    try:
        return await upstream.read()
    except (ConnectionError, TimeoutError) as exc:
        if isinstance(exc, UpstreamUnrelayable):
            raise
        what = "a body that stalled" if isinstance(exc, TimeoutError) else "a body that broke off"
        raise UpstreamUnrelayable(upstream.status, what) from exc


async def read_at_most(upstream: UpstreamResponse, limit: int) -> tuple[bytes, bool]:
    """Read the body up to ``limit`` bytes; returns (bytes, complete). A read that fails (timeout, reset)
    closes the response (``UpstreamResponse.read_chunk`` does): a half-read connection never goes back to the
    pool."""
    parts: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await upstream.read_chunk(min(CHUNK, limit + 1 - size))
        if not chunk:
            return b"".join(parts), True
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts), False
