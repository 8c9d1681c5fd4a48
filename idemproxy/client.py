"""A lean HTTP/1.1 client for the upstream: pooled keep-alive connections, the answer parsed by llhttp.

aiohttp's ClientSession was half of plain proxying's CPU and a quarter of a first request's (a request object, URL
handling, connector bookkeeping, header copies and several timers per call). A proxy needs much less: it sends
headers it has already filtered to one known host, and hands the answer on. This client writes the request itself
and parses the answer with httptools (llhttp, the parser Node.js uses), and keeps the distinctions the engine
relies on:

- ``UpstreamConnectError``: the request certainly never left (connect failed or timed out, or no pooled
  connection came free within ``connect_timeout``).
- anything raised after a byte was written (``UpstreamDisconnected``, ``UpstreamProtocolError``,
  ``UpstreamReadTimeout``): the outcome is unknown. Nothing is ever sent twice: no request is retried here, even
  on a pooled connection the upstream closed under it (RFC 9110 §9.2.2).

A connection goes back to the pool only after its answer was read to the end and both sides allow keep-alive;
an answer left half read, cancelled or broken closes its connection. Streamed bodies are flow-controlled both
ways: writes wait for the socket to drain, and reading pauses while more than ``HIGH_WATER`` bytes of the answer
wait for the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools
from multidict import CIMultiDict
from yarl import URL

HIGH_WATER = 256 * 1024  # answer bytes buffered before reading from the socket pauses
KEEPALIVE = 30.0  # an idle pooled connection older than this is closed rather than reused (aiohttp: after 15-30 s)
KEEPALIVE_MARGIN = 1.0  # below the upstream's own ``Keep-Alive: timeout=N``, so it never closes one as we send
_ONE_WRITE = 64 * 1024  # a body up to this size goes out in the same write as the head
MAX_HEAD = 64 * 1024  # an answer's status line and header section, in bytes (Envoy's default is 60 KiB)
MAX_INTERIM = 100  # 1xx answers before the final one (Go's client stops at 5 where it drops them; these are relayed)
_NO_BODY_STATUSES = frozenset({204, 304})
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # none in a reason phrase (RFC 9112 §4: HTAB, SP, VCHAR, obs-text)

Interim = Callable[[int, bytes, list[tuple[str, str]]], None]
"""Given a 1xx answer as it comes: its status, its reason phrase's bytes and its headers."""
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # sent with Content-Length: 0 when they have no body


class UpstreamConnectError(ConnectionError):
    """No connection to the upstream: nothing was sent."""


class UpstreamSendLate(UpstreamConnectError):
    """The caller's ``send_by`` instant had passed when the request was about to be written: nothing was sent."""


class UpstreamDisconnected(ConnectionError):
    """The upstream closed or reset the connection before a full answer."""


class UpstreamProtocolError(ConnectionError):
    """The upstream's answer was not valid HTTP/1.1."""


class UpstreamUnrelayable(UpstreamProtocolError):
    """The upstream answered, in a form the proxy does not pass on: a head or a trailer line larger than
    ``MAX_HEAD`` (not read on), a transfer coding other than chunked (it would pass on undecoded and unnamed, as
    nginx refuses to), a head broken or cut after its status code came whole (or, raised by the engine, a body
    lost after a whole head). ``status`` is the final answer's status (0 when there is none: the head that
    overflowed was a 1xx answer's, or its code never came whole); ``what`` says what was wrong with it."""

    def __init__(self, status: int, what: str) -> None:
        super().__init__(f"The upstream answered with {what}.")
        self.status = status if status >= 200 else 0
        self.what = what


def _head_too_large(status: int) -> UpstreamUnrelayable:
    return UpstreamUnrelayable(status, f"a header section larger than {MAX_HEAD // 1024} KiB")


class UpstreamReadTimeout(TimeoutError):
    """No final answer's head, or none of the body awaited, came within ``timeout`` seconds (1xx answers do not
    count; a streamed upload still moving starts the wait again), or the caller's deadline passed after the
    request was sent."""


class HeaderInjection(ValueError):
    """A header name or value, or the target, holds a line break or the target a space: refused, nothing sent."""


class UpstreamResponse:
    """The head of an upstream answer, and its body as it arrives."""

    __slots__ = ("_conn", "content_length", "headers", "reason", "status")

    def __init__(
        self, status: int, reason: str, headers: CIMultiDict[str], content_length: int | None, conn: _Connection
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.content_length = content_length
        self._conn: _Connection | None = conn

    async def read_chunk(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the body; ``b""`` at its end."""
        conn = self._conn
        if conn is None:
            return b""
        try:
            return await conn.read_body(limit)
        except BaseException:
            self.close()
            raise

    async def read(self) -> bytes:
        """The whole body."""
        parts: list[bytes] = []
        while chunk := await self.read_chunk(1 << 30):
            parts.append(chunk)
        return b"".join(parts)

    @property
    def read_timeout(self) -> float | None:
        """How long a read waits for the upstream's next bytes (``upstream.timeout``); None once released."""
        return None if self._conn is None else self._conn._read_timeout

    def no_deadline(self) -> None:
        """The caller's deadline no longer bounds the rest of the body: each read waits ``read_timeout`` for the
        upstream's next bytes, as a pass-through does (the body of a kept answer, once its record is settled,
        streams as long as the upstream goes on sending)."""
        if self._conn is not None:
            self._conn.lift_deadline()

    def release(self) -> None:
        """Done with the answer: its connection is pooled again if it was read to the end, else closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish()

    def close(self) -> None:
        """Done with the answer, and its connection is closed whatever was read."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


class _Connection(asyncio.Protocol):
    """One connection to the upstream; one exchange at a time. It is reusable only while ``_clean`` stays True
    through a whole exchange (see ``finish``)."""

    # Slots: past 30 attributes CPython (3.11) gives an instance a dict of its own instead of shared keys, and
    # every attribute access on this, the hottest object of a forward, costs more (1 % of a plain request).
    __slots__ = (
        "_body", "_body_sent", "_buffered", "_busy", "_clean", "_complete", "_deadline", "_discarded", "_drain",
        "_exc", "_head_only", "_head_size", "_headers", "_interim", "_interims", "_keep_alive", "_line", "_lines",
        "_parser", "_paused", "_read_timeout", "_reason", "_response", "_until_eof", "_waiter", "_writer", "_written",
        "idle_limit", "idle_since", "loop", "lost", "pool", "transport",
    )

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self.idle_limit = KEEPALIVE  # lowered by the upstream's Keep-Alive hint
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._busy = False
        self._discarded = False
        self._read_timeout = 30.0
        self._deadline: float | None = None  # the caller's, on the loop's clock
        # the exchange in progress
        self._parser: httptools.HttpResponseParser | None = None
        self._head_only = False
        self._interim: Interim | None = None  # who is given the exchange's 1xx answers (none: they are dropped)
        self._interims = 0  # 1xx answers in this exchange so far
        self._reason = b""
        self._headers: list[tuple[str, str]] = []
        self._head_size = 0  # bytes of the answer's head so far (a 1xx answer's head counts on its own)
        self._line = 0  # bytes of a head's line not yet ended, as received (llhttp hands on whole lines only)
        self._lines = True  # the bytes coming are lines (a head or trailer section), not a body's
        self._response: UpstreamResponse | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._complete = False
        self._until_eof = False
        self._keep_alive = False
        self._writer: asyncio.Task[None] | None = None
        self._body_sent = False  # every byte of the request was handed to the transport
        self._written = 0  # chunks of a streamed body written so far (a slow upload is not a silent upstream)
        self._clean = True  # nothing odd happened in this exchange (stray bytes, a body cut short)

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports do not subclass asyncio's)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or self._complete:  # bytes nobody asked for: the connection cannot be trusted
            self._fail(UpstreamProtocolError("The upstream sent bytes outside an answer."))
            return
        try:
            parser.feed_data(data)
            if self._lines:
                # A header or trailer line reaches on_header only once it is whole (httptools buffers it meanwhile,
                # a trailer's at a cost that grows as its square): a line that never ends is bounded here, by the
                # bytes since the last line break (not by how they came).
                end = data.rfind(b"\n")
                self._line = self._line + len(data) if end < 0 else len(data) - end - 1
                if self._line > MAX_HEAD:
                    response = self._response
                    raise (_head_too_large(parser.get_status_code()) if response is None else UpstreamUnrelayable(
                        response.status, f"a trailer line longer than {MAX_HEAD // 1024} KiB"))
        except UpstreamUnrelayable as exc:
            self._fail(exc)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("The upstream switched protocols, which a proxied request cannot."))
        except httptools.HttpParserError as exc:
            raised = exc.__context__  # (what one of our callbacks raised, if it was one: on_header's count)
            status = self._final_status(exc)
            if isinstance(raised, UpstreamProtocolError):  # (an UpstreamUnrelayable names its status)
                self._fail(raised)
            elif status:  # the status came: it answered, in a broken head
                self._fail(UpstreamUnrelayable(status, f"a head that is not valid HTTP/1.1 ({exc})"))
            else:
                self._fail(UpstreamProtocolError(f"The upstream's answer is not valid HTTP/1.1: {exc!r}"))

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if (self._until_eof and exc is None and self._exc is None and self._response is not None
                and not self._complete):
            self._complete = True  # an answer without length ends where the connection does
            self._keep_alive = False
        elif not self._complete or self._response is None:
            status = self._final_status()
            self._set_exception(UpstreamUnrelayable(status, "a head cut short") if status else UpstreamDisconnected(
                "The upstream closed the connection before a full answer."))
        self._wake()
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)  # (the writer sees ``lost`` next; nobody may be awaiting this one)
        if not self._busy:
            self.pool.forget_idle(self)

    def _final_status(self, error: Exception | None = None) -> int:
        """The final answer's status while its head is incomplete, once its code came whole (followed by a space
        or a line break: "HTTP/1.1 2000" stops llhttp at 200, "HTTP/1.1 201" may go on); else 0. ``error``: what
        stopped llhttp, if it did."""
        parser = self._parser
        if parser is None or self._response is not None:
            return 0
        status = parser.get_status_code()
        if status < 200:
            return 0
        if error is not None:  # only an error in the code itself leaves it in doubt
            return 0 if isinstance(error, httptools.HttpParserInvalidStatusError) else status
        try:  # the connection ended mid-head: one more byte errs only while the code is not yet delimited
            parser.feed_data(b"X")
        except httptools.HttpParserError:
            return 0
        return status

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = self.loop.create_future()

    def resume_writing(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # ---------------------------------------------------------------- llhttp callbacks

    def on_message_begin(self) -> None:
        if self._response is not None:  # a second answer to one request: nothing after it can be trusted
            raise UpstreamProtocolError("The upstream sent a second answer to one request.")
        self._headers = []
        self._reason = b""
        self._head_size = 0
        self._lines = True

    def on_status(self, status: bytes) -> None:
        self._reason += status
        self._head_size += len(status)
        if self._head_size > MAX_HEAD:
            self._refuse_head()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._response is not None:  # a trailer field, after a chunked body: never passed on, so not kept
            if len(name) + len(value) > MAX_HEAD:  # (one that came whole in one read: as data_received's bound)
                raise UpstreamUnrelayable(self._response.status, f"a trailer line longer than {MAX_HEAD // 1024} KiB")
            return
        self._head_size += len(name) + len(value) + 4  # (inline: a call per header is a cost on every answer)
        if self._head_size > MAX_HEAD:
            self._refuse_head()
        self._headers.append((name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))

    def _refuse_head(self) -> None:
        assert self._parser is not None
        raise _head_too_large(self._parser.get_status_code())  # (through llhttp, to data_received)

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        status = parser.get_status_code()
        if status < 100:  # (llhttp takes any three digits: "099" is no 1xx answer, nor a final one; RFC 9110 §15)
            raise UpstreamProtocolError(f"The upstream answered with the invalid status code {status:03d}.")
        if _CONTROL.search(self._reason):  # (llhttp passes any byte but CR and LF; aiohttp would not write it)
            # A reason phrase means nothing (RFC 9112 §4: a client ignores it, and none is stored): the answer goes
            # on without it ("HTTP/1.1 201 "), never relayed raw, never lost over it.
            self._reason = b""
        if status < 200:  # an interim answer (100 Continue, 103 Early Hints): the final one follows
            self._interims += 1
            if self._interims > MAX_INTERIM:  # each is bounded; so is their number (an endless stream of them)
                raise UpstreamProtocolError(f"The upstream sent more than {MAX_INTERIM} 1xx answers to one request.")
            if not parser.should_keep_alive():  # a 1xx saying close: the final answer is read, the connection not kept
                self._clean = False
            # (a 100 is this hop's: the proxy answers Expect; a 101 is refused below: the proxy sends no Upgrade)
            if self._interim is not None and status != 100 and status != 101:
                self._interim(status, self._reason, self._headers)
            # The waiter is not woken: a 1xx answer is no answer, and the read timeout goes on running for the
            # final one (a 1xx now and then would hold the request open for ever).
            return
        self._interim = None  # (the final answer: nothing more to hand on, nor a request to hold on to)
        self._lines = False  # (a body follows, if any; a chunked one's trailer section is lines again)
        headers = CIMultiDict(self._headers)
        length_text = headers.get("Content-Length")
        length = int(length_text) if length_text is not None and length_text.isdigit() else None
        no_body = self._head_only or status in _NO_BODY_STATUSES
        chunked = False
        if "Transfer-Encoding" in headers and not no_body:
            codings = headers.getall("Transfer-Encoding")
            # (ASCII first: str.lower() makes "chunked" of a Kelvin sign, U+212A, which llhttp never would)
            if len(codings) != 1 or not codings[0].isascii() or codings[0].strip(" ").lower() != "chunked":
                # llhttp decodes chunked off the end of a list and leaves the rest undecoded: relayed without its
                # name, such a body would be read as something else (nginx refuses these answers too). Only what
                # llhttp surely reads as chunked alone passes (it takes "chunked," or "chunked\t" for no coding
                # at all, and reads to the connection's end).
                raise UpstreamUnrelayable(status, f"the transfer coding {', '.join(codings)[:64]!r}")
            chunked = True
        self._until_eof = not no_body and length is None and not chunked
        hint = headers.get("Keep-Alive")
        if hint is not None:
            self.idle_limit = min(KEEPALIVE, _keep_alive_timeout(hint) - KEEPALIVE_MARGIN)
        self._response = UpstreamResponse(status, self._reason.decode("utf-8", "surrogateescape"), headers,
                                          length, self)
        if self._head_only:  # llhttp cannot be told a HEAD answer has no body: it ends here
            self._complete = True
            self._keep_alive = parser.should_keep_alive() and length is not None
        self._wake()

    def on_chunk_header(self) -> None:
        self._lines = True  # (the last chunk, of size 0, is followed by the trailer section; any other by data)
        self._line = 0

    def on_body(self, body: bytes) -> None:
        if self._response is None:  # llhttp frames a body for a 1xx answer with a length: no 1xx has one
            raise UpstreamProtocolError("The upstream sent a 1xx answer with a body.")  # (RFC 9110 15.2)
        self._lines = False
        if self._complete:  # a body after a HEAD answer: not for anyone, and the framing is off from here
            self._clean = False
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        if self._response is None:  # the end of an interim answer
            return
        self._complete = True
        self._keep_alive = parser.should_keep_alive() and not self._until_eof
        self._wake()

    # ---------------------------------------------------------------- the exchange

    async def exchange(
        self, method: str, head: bytes, body: bytes | AsyncIterator[bytes] | None, length: int | None,
        read_timeout: float, deadline: float | None, interim: Interim | None = None, send_by: float | None = None,
    ) -> UpstreamResponse:
        """Send the request and wait for the answer's head. ``length``: a streamed body's declared length (it
        goes chunked when None). ``interim`` is handed each 1xx answer but a 100 or 101, as it comes. ``send_by``
        (``time.monotonic()``): past it, nothing is written (``UpstreamSendLate``)."""
        transport = self.transport
        assert transport is not None and not self._busy
        self._busy = True
        self._parser = httptools.HttpResponseParser(self)
        self._line = 0
        self._lines = True
        self._interims = 0
        # A 1xx answer saying "Connection: close" (or an HTTP/1.0 one) made llhttp refuse every byte after it, the
        # final answer too: an answer the upstream gave was lost (an unknown outcome, run again after the lease).
        # The final answer's own Connection header still decides whether the connection is kept.
        self._parser.set_dangerous_leniencies(lenient_keep_alive=True)
        self._head_only = method == "HEAD"
        self._interim = interim
        self._read_timeout = read_timeout
        self._deadline = deadline
        # The last look before the first byte leaves, on a clock read now (the loop's is read once per turn): a
        # process stopped for a while (SIGSTOP, a frozen VM, a starved container) must not send a request whose
        # lease ran out meanwhile, and may have been taken over by another replica.
        if send_by is not None and time.monotonic() >= send_by:
            raise UpstreamSendLate("The request's time to be sent had passed when it was about to be written "
                                   "(this process was held up); nothing was sent.")
        if body is None:
            transport.write(head)
            self._body_sent = True
        elif isinstance(body, bytes):
            if len(body) <= _ONE_WRITE:
                transport.write(head + body)
            else:
                transport.write(head)
                transport.write(body)
            self._body_sent = True
        else:
            transport.write(head)
            writer = self._writer = asyncio.ensure_future(self._write_stream(body, length))
            writer.add_done_callback(self._written_all)
        while self._response is None:
            self._raise_if_failed()
            uploading = self._writer is not None and not self._writer.done()
            progress = self._written
            try:
                await self._wait()
            except UpstreamReadTimeout:
                # The timer counts the upstream's silence, not a slow upload: go on while body bytes still move.
                if uploading and self._written != progress and not self._past_deadline():
                    continue
                raise
        # (a streamed body goes on being sent while the answer is read: an upstream may answer before the end)
        return self._response

    async def _write_stream(self, body: AsyncIterator[bytes], length: int | None) -> None:
        transport = self.transport
        assert transport is not None
        sent = 0
        async for chunk in body:
            if not chunk:
                continue
            sent += len(chunk)
            if length is not None and sent > length:
                raise UpstreamProtocolError("The request body is longer than its Content-Length.")
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if length is None else chunk)
            self._written += 1
            if self._drain is not None:
                await self._drain
            if self.lost:
                raise UpstreamDisconnected("The upstream closed the connection while the body was sent.")
        if length is not None and sent != length:
            raise UpstreamProtocolError("The request body is shorter than its Content-Length.")
        if length is None:
            transport.write(b"0\r\n\r\n")

    def _written_all(self, writer: asyncio.Task[None]) -> None:
        if writer.cancelled():
            return
        exc = writer.exception()  # (retrieved here, always: a failed upload is this connection's failure)
        if exc is None:
            self._body_sent = True
            self._wake()
            return
        failure = exc if isinstance(exc, UpstreamProtocolError | UpstreamDisconnected) else UpstreamDisconnected(
            f"The request body could not be sent whole: {exc!r}")
        failure.__cause__ = exc if failure is not exc else None
        self._fail(failure)

    async def read_body(self, limit: int) -> bytes:
        while not self._body:
            if self._complete:
                return b""
            self._raise_if_failed()
            await self._wait()
        chunk = self._body.popleft()
        if len(chunk) > limit:
            self._body.appendleft(chunk[limit:])
            chunk = chunk[:limit]
        self._buffered -= len(chunk)
        if self._paused and self._buffered <= HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def finish(self) -> None:
        """The caller is done: pool the connection if the exchange ended cleanly both ways, else close it."""
        transport = self.transport
        reusable = (self._complete and self._keep_alive and not self._body and self._exc is None
                    and self._clean and self._body_sent and not self.lost and transport is not None
                    and self._drain is None and transport.get_write_buffer_size() == 0)
        if not reusable:
            self.abort()
            return
        self._reset()
        self.pool.put_back(self)

    def abort(self) -> None:
        """Close now (unsent bytes are dropped) and give the slot back."""
        self._reset()
        self.lost = True
        if self.transport is not None:
            self.transport.abort()
        self.pool.discard(self)

    def drop(self) -> None:
        """Close, keeping the slot for the caller (who opens another connection in it)."""
        self._discarded = True
        self.abort()

    def usable(self) -> bool:
        """An idle connection fit to carry a request."""
        transport = self.transport
        return (not self.lost and self._exc is None and transport is not None and not transport.is_closing()
                and time.monotonic() - self.idle_since < self.idle_limit)

    def _reset(self) -> None:
        self._busy = False
        self._parser = None
        self._reason = b""
        self._headers = []
        self._response = None
        self._body.clear()
        self._buffered = 0
        self._complete = self._until_eof = self._keep_alive = self._body_sent = False
        self._deadline = None
        writer, self._writer = self._writer, None
        if writer is not None and not writer.done():
            writer.cancel()
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()

    # ---------------------------------------------------------------- waiting

    def lift_deadline(self) -> None:
        self._deadline = None

    def _past_deadline(self) -> bool:
        return self._deadline is not None and self.loop.time() >= self._deadline

    async def _wait(self) -> None:
        timeout = self._read_timeout
        if self._deadline is not None:
            timeout = min(timeout, self._deadline - self.loop.time())
            if timeout <= 0:
                raise UpstreamReadTimeout("The upstream did not answer within the time left.")
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, _time_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _set_exception(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc

    def _raise_if_failed(self) -> None:
        if self._exc is not None:
            raise self._exc

    def _fail(self, exc: BaseException) -> None:
        """Something is wrong with this connection: it is cut at once (an answer already complete still reads)."""
        self._set_exception(exc)
        self._clean = False
        if self.transport is not None:
            self.transport.abort()
        self._wake()
        if not self._busy:
            self.pool.forget_idle(self)


def _keep_alive_timeout(hint: str) -> float:
    """``timeout=N`` of a Keep-Alive header (RFC 2068 §19.7.1.1), or KEEPALIVE when it has none that parses."""
    for part in hint.split(","):
        name, _, value = part.partition("=")
        if name.strip().lower() == "timeout":
            try:
                return float(value.strip())
            except ValueError:
                break
    return KEEPALIVE + KEEPALIVE_MARGIN


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamReadTimeout("The upstream's answer did not come in time."))


class ConnectionPool:
    """Keep-alive connections to one upstream, at most ``limit`` open at once."""

    def __init__(self, url: str, *, limit: int, connect_timeout: float, read_timeout: float) -> None:
        parsed = URL(url)
        self.scheme = parsed.scheme
        self.host = parsed.raw_host or ""
        self.port = parsed.port or (443 if self.scheme == "https" else 80)
        self.prefix = parsed.raw_path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if parsed.is_default_port() else f"{host}:{self.port}"
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self.scheme == "https" else None
        self.loop = asyncio.get_running_loop()
        self._idle: list[_Connection] = []
        self._open = 0  # connections counted against the limit (idle, busy or connecting)
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self._closed = False

    async def request(
        self, method: str, target: str, headers: CIMultiDict[str], body: bytes | AsyncIterator[bytes] | None,
        timeout: float | None = None, interim: Interim | None = None, send_by: float | None = None,
    ) -> UpstreamResponse:
        """Send one request (never retried) and return the answer's head; ``target`` is path and query.
        ``interim`` is handed each 1xx answer but a 100 or 101 (status, reason as sent, headers), as it comes.

        ``timeout`` bounds the whole exchange, the body's reads included: spent before a byte was sent, it is an
        ``UpstreamConnectError`` (nothing sent); after, an ``UpstreamReadTimeout``. ``send_by``, an instant of
        ``time.monotonic()``, is looked at just before the first byte is written: past it, ``UpstreamSendLate``
        (nothing sent).
        """
        head, length = self._head(method, target, headers, body)
        deadline = None if timeout is None else self.loop.time() + timeout
        conn = await self._acquire(deadline)
        try:
            return await conn.exchange(method, head, body, length, self.read_timeout, deadline, interim, send_by)
        except BaseException:
            conn.abort()
            raise

    def _head(
        self, method: str, target: str, headers: CIMultiDict[str], body: bytes | AsyncIterator[bytes] | None
    ) -> tuple[bytes, int | None]:
        """The request line and headers, and a streamed body's declared length (None: it goes chunked)."""
        length: int | None = None
        declared = headers.popall("Content-Length", None)  # framing is this hop's: set below from the body
        headers.popall("Transfer-Encoding", None)
        headers.popall("Host", None)
        lines = [f"{method} {self.prefix}{target} HTTP/1.1\r\nHost: {self.host_header}\r\n"]
        lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        if isinstance(body, bytes):
            lines.append(f"Content-Length: {len(body)}\r\n")
        elif body is not None:
            if declared and len(declared) == 1 and declared[0].isdigit() and declared[0].isascii():
                length = int(declared[0])
                lines.append(f"Content-Length: {length}\r\n")
            else:
                lines.append("Transfer-Encoding: chunked\r\n")
        elif method in _BODY_METHODS:
            lines.append("Content-Length: 0\r\n")
        lines.append("\r\n")
        text = "".join(lines)
        # One line per entry, exactly: a CR or LF inside a name, value or target would split a request in two.
        breaks = len(lines) + 1  # (the first entry holds the request line and Host)
        if text.count("\n") != breaks or text.count("\r") != breaks or " " in target:
            raise HeaderInjection("A header or the request target holds a line break or space.")
        return text.encode("utf-8", "surrogateescape"), length

    def _left(self, deadline: float | None) -> float:
        """Time to get a connection: ``connect_timeout``, or less when the caller's deadline comes first."""
        if deadline is None:
            return self.connect_timeout
        return min(self.connect_timeout, deadline - self.loop.time())

    async def _acquire(self, deadline: float | None) -> _Connection:
        if self._closed:
            raise UpstreamConnectError("The upstream client is closed.")
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                return conn
            conn.abort()
        if self._open < self.limit:
            self._open += 1
            return await self._connect(deadline)
        waiter: asyncio.Future[_Connection | None] = self.loop.create_future()
        self._waiters.append(waiter)
        try:
            left = self._left(deadline)
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):
                handed = await waiter
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():  # handed a slot just as we gave up: pass it on
                self._hand_on(waiter.result())
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise UpstreamConnectError("No upstream connection came free in time; nothing was sent.") from exc
            raise
        if handed is not None:
            if handed.usable():
                return handed
            handed.drop()  # dead while it was being handed over: its slot is ours, for a new connection
        return await self._connect(deadline)

    async def _connect(self, deadline: float | None) -> _Connection:
        """Open a connection in a slot already counted in ``_open``."""
        try:
            left = self._left(deadline)
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None,
                )
        except BaseException as exc:
            self._hand_on(None)
            if isinstance(exc, OSError | TimeoutError):
                raise UpstreamConnectError(f"The upstream could not be reached: {exc!r}") from exc
            raise
        return conn

    def _hand_on(self, conn: _Connection | None) -> None:
        """A connection (or, with None, a free slot) goes to the longest waiter, or back to the pool."""
        if conn is not None:
            conn.idle_since = time.monotonic()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        if conn is None:
            self._open -= 1
        else:
            self._idle.append(conn)

    def put_back(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        self._hand_on(conn)

    def discard(self, conn: _Connection) -> None:
        """A connection closed for good: its slot goes on."""
        if conn._discarded:
            return
        conn._discarded = True
        self._hand_on(None)

    def forget_idle(self, conn: _Connection) -> None:
        """A pooled connection the upstream closed (or that failed) while idle."""
        if conn in self._idle:
            self._idle.remove(conn)
            self.discard(conn)

    async def close(self) -> None:
        self._closed = True
        waiters, self._waiters = self._waiters, deque()  # failed first: a slot freed below must not reach them
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(UpstreamConnectError("The upstream client is closed."))
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()
