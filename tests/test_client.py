"""The upstream client (idemproxy/client.py) against real sockets that misbehave on purpose.

Each test's upstream is a TCP server whose answers are written byte by byte, so framing, keep-alive and broken
connections are exactly what the test says; it counts the connections it accepted and the requests it read.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from multidict import CIMultiDict

from idemproxy.client import (
    HIGH_WATER,
    KEEPALIVE,
    MAX_HEAD,
    MAX_INTERIM,
    ConnectionPool,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamProtocolError,
    UpstreamReadTimeout,
    UpstreamResponse,
    UpstreamUnrelayable,
    _Connection,
)

Answer = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]
"""Given a request's head (and the streams, to read its body), write the answer; False closes the connection."""


@dataclass
class ScriptedUpstream:
    answer: Answer
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    open_now: int = 0
    most_open: int = 0
    server: asyncio.Server | None = None
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self.requests.append(head)
                if not await self.answer(head, reader, writer):
                    return
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):  # the client cut the connection
            return
        finally:
            self.open_now -= 1
            writer.close()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Answer], Awaitable[ScriptedUpstream]]]:
    started: list[ScriptedUpstream] = []

    async def start(answer: Answer) -> ScriptedUpstream:
        upstream = ScriptedUpstream(answer)
        upstream.server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
        started.append(upstream)
        return upstream

    yield start
    for upstream in started:
        assert upstream.server is not None
        upstream.server.close()
        for task in upstream.handlers:
            task.cancel()
        await asyncio.gather(*upstream.handlers, return_exceptions=True)
        await upstream.server.wait_closed()


@pytest.fixture
async def pools() -> AsyncIterator[Callable[..., ConnectionPool]]:
    made: list[ConnectionPool] = []

    def make(url: str, limit: int = 10, connect_timeout: float = 5.0, read_timeout: float = 10.0) -> ConnectionPool:
        pool = ConnectionPool(url, limit=limit, connect_timeout=connect_timeout, read_timeout=read_timeout)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        await pool.close()


@pytest.fixture(autouse=True)
async def loop_errors(scripted: object, pools: object) -> AsyncIterator[list[str]]:
    """Whatever the loop would only log (a task or future exception never retrieved) fails the test; checked
    before the test's servers are torn down (cancelling their handlers logs by itself)."""
    loop = asyncio.get_running_loop()
    errors: list[str] = []
    loop.set_exception_handler(lambda _, context: errors.append(context["message"]))
    yield errors
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert errors == []


def ok(body: bytes, extra: bytes = b"") -> Answer:
    async def answer(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await read_declared_body(head, reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b%b" % (len(body), body, extra))
        return True
    return answer


async def read_declared_body(head: bytes, reader: asyncio.StreamReader) -> bytes:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return await reader.readexactly(int(line.split(b":", 1)[1]))
    return b""


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked request body, to its last chunk."""
    data = bytearray()
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        data += await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readexactly(2)
    return bytes(data)


def gated(gate: asyncio.Event, answer: bytes) -> Answer:
    """Answers each request with ``answer`` once ``gate`` is set."""
    async def held(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await gate.wait()
        writer.write(answer)
        return True
    return held


async def get(pool: ConnectionPool, method: str = "GET", target: str = "/",
              body: bytes | AsyncIterator[bytes] | None = None,
              headers: CIMultiDict[str] | None = None) -> tuple[UpstreamResponse, bytes]:
    response = await pool.request(method, target, headers if headers is not None else CIMultiDict(), body)
    try:
        data = await response.read()
    finally:
        response.release()
    return response, data


async def endless_line(start: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Write ``start``, then three times MAX_HEAD of a line that never ends, and hold it open until the client
    cuts the connection (within 30 s)."""
    writer.write(start)
    for _ in range(3 * MAX_HEAD // 4096):
        writer.write(b"l" * 4096)
        await writer.drain()
    with contextlib.suppress(ConnectionError):
        await asyncio.wait_for(reader.read(), 30)


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for something the event loop will do (a FIN processed, a connection counted), within a bound."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_connection_is_reused_only_after_its_answer_was_read_whole(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    upstream = await scripted(ok(b"x" * 100_000))
    pool = pools(upstream.url)
    for _ in range(3):
        _, body = await get(pool)
        assert body == b"x" * 100_000
    assert upstream.connections == 1

    half = await pool.request("GET", "/", CIMultiDict(), None)
    assert len(await half.read_chunk(10)) == 10
    half.release()  # not read to the end: its connection must not carry the rest into the next answer
    _, body = await get(pool)
    assert body == b"x" * 100_000
    assert upstream.connections == 2


async def test_every_framing_reads_exactly_its_own_bytes(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def answer(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        path = head.split(b" ")[1]
        if path == b"/chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        elif path == b"/head":  # a HEAD answer declares the length a GET would have, and has no body
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n")
        elif path == b"/empty":
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        elif path == b"/interim":
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                         b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\ndone")
        elif path == b"/eof":  # no length: the body ends where the connection does
            writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
            return False
        return True

    upstream = await scripted(answer)
    pool = pools(upstream.url)
    response, body = await get(pool, target="/chunked")
    assert (response.status, body, response.content_length) == (200, b"hello world", None)
    response, body = await get(pool, method="HEAD", target="/head")
    assert (response.status, body, response.content_length) == (200, b"", 12)
    response, body = await get(pool, target="/empty")
    assert (response.status, body) == (204, b"")
    response, body = await get(pool, target="/interim")
    assert (response.status, response.reason, body) == (201, "Created", b"done")
    assert "Link" not in response.headers  # the interim answer's headers are not the final one's
    assert upstream.connections == 1  # all of the above on one kept-alive connection, nothing leaked between
    response, body = await get(pool, target="/eof")
    assert (response.status, body) == (200, b"until the end")
    _, body = await get(pool, target="/chunked")
    assert body == b"hello world"
    assert upstream.connections == 2  # the answer without a length closed its connection


async def test_bytes_after_an_answer_end_that_connection(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    upstream = await scripted(ok(b"mine", extra=b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nstolen"))
    pool = pools(upstream.url)
    _, body = await get(pool)
    assert body == b"mine"
    _, body = await get(pool)
    assert body == b"mine"  # never the stray answer
    assert upstream.connections == 2


async def test_nothing_sent_is_told_apart_from_outcome_unknown(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    refused = await scripted(ok(b""))
    assert refused.server is not None
    url = refused.url
    refused.server.close()
    await refused.server.wait_closed()
    with pytest.raises(UpstreamConnectError):
        await get(pools(url))

    async def hang_up(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        return False

    async def silent(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await asyncio.Event().wait()
        return False

    async def garbage(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 2OO OK\r\n\r\n")
        return True

    async def cut_mid_body(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        return False

    for answer, error in ((hang_up, UpstreamDisconnected), (garbage, UpstreamProtocolError),
                          (cut_mid_body, UpstreamDisconnected), (silent, UpstreamReadTimeout)):
        upstream = await scripted(answer)
        with pytest.raises(error):
            await get(pools(upstream.url, read_timeout=0.3), method="POST", body=b"{}")
        assert len(upstream.requests) == 1, answer.__name__  # it was sent (once): the outcome is unknown


async def test_a_pooled_connection_the_upstream_closed_is_not_used(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def answer_then_close(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return False  # keep-alive on the wire, but the server closes right after (an idle timeout)

    upstream = await scripted(answer_then_close)
    pool = pools(upstream.url, limit=1)
    await get(pool)
    await until(lambda: not pool._idle)  # the FIN was seen: the slot is free again
    _, body = await get(pool)
    assert body == b"ok"
    assert upstream.connections == 2 and len(upstream.requests) == 2


async def test_the_pool_keeps_its_limit_and_a_wait_past_connect_timeout_sends_nothing(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    gate = asyncio.Event()
    upstream = await scripted(gated(gate, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
    pool = pools(upstream.url, limit=2, connect_timeout=0.3)
    holding = [asyncio.ensure_future(get(pool)) for _ in range(2)]
    await until(lambda: len(upstream.requests) == 2)
    with pytest.raises(UpstreamConnectError):  # no connection came free within connect_timeout
        await get(pool)
    assert len(upstream.requests) == 2 and upstream.most_open == 2
    gate.set()
    assert [body for _, body in await asyncio.gather(*holding)] == [b"ok"] * 2
    # More requests than connections: the rest wait for one to come back, and get it.
    answers = await asyncio.gather(*(get(pool) for _ in range(7)))
    assert [body for _, body in answers] == [b"ok"] * 7
    assert upstream.connections == 2 and upstream.most_open == 2


async def test_a_cancelled_exchange_closes_its_connection_and_frees_its_slot(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    first = True

    async def slow_once(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        nonlocal first
        if first:
            first = False
            await asyncio.Event().wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    upstream = await scripted(slow_once)
    pool = pools(upstream.url, limit=1, connect_timeout=2.0)
    stuck = asyncio.ensure_future(get(pool))
    await until(lambda: len(upstream.requests) == 1)
    stuck.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stuck
    _, body = await get(pool)  # the one slot came back
    assert body == b"ok"
    assert upstream.connections == 2


async def test_a_line_break_in_a_header_is_refused_before_anything_is_sent(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    upstream = await scripted(ok(b"ok"))
    pool = pools(upstream.url)
    for headers, target in ((CIMultiDict({"X-A": "1\r\nX-Injected: yes"}), "/"),
                            (CIMultiDict({"X-A\nB": "1"}), "/"), (CIMultiDict(), "/a HTTP/1.1\r\nX: y")):
        with pytest.raises(ValueError):
            await get(pool, headers=headers, target=target)
    assert upstream.connections == 0


@pytest.mark.parametrize("declared", [True, False])
async def test_streamed_request_bodies_arrive_whole(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool], declared: bool
) -> None:
    async def digest(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if b"transfer-encoding: chunked" in head.lower():
            data = await read_chunked(reader)
        else:
            data = await read_declared_body(head, reader)
        answer = hashlib.sha256(data).hexdigest().encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(answer), answer))
        return True

    parts = [bytes([i]) * 200_000 for i in range(10)]

    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    upstream = await scripted(digest)
    pool = pools(upstream.url)
    headers = CIMultiDict({"Content-Length": str(2_000_000)} if declared else {})
    _, answer = await get(pool, method="PUT", body=body(), headers=headers)
    assert answer == hashlib.sha256(b"".join(parts)).hexdigest().encode()
    _, answer = await get(pool, method="POST", body=b"small")  # and the connection is fit for the next one
    assert answer == hashlib.sha256(b"small").hexdigest().encode()
    assert upstream.connections == 1
    assert (b"transfer-encoding: chunked" in upstream.requests[0].lower()) is not declared


async def test_a_slow_reader_holds_back_the_upstream(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    size = 64 * 1024 * 1024
    sent = 0

    async def big(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        block = b"z" * 65536
        while sent < size:
            writer.write(block)
            await writer.drain()
            sent += len(block)
        return True

    upstream = await scripted(big)
    pool = pools(upstream.url)
    response = await pool.request("GET", "/", CIMultiDict(), None)
    try:
        assert await response.read_chunk(65536)
        # The upstream stops once the kernel's buffers and the client's HIGH_WATER are full.
        before = -1
        while before != sent:
            before = sent
            for _ in range(50):
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)
        assert sent < 16 * 1024 * 1024
        conn = response._conn
        assert conn is not None and conn._buffered <= HIGH_WATER + 65536 * 2
    finally:
        response.close()


async def test_a_second_answer_to_one_request_is_never_taken_for_it(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def two_answers(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-First: 1\r\n\r\nok"
                     b"HTTP/1.1 204 No Content\r\nX-Second: 1\r\n\r\n")  # one segment
        return True

    upstream = await scripted(two_answers)
    pool = pools(upstream.url)
    response, body = await get(pool)
    assert (response.status, response.reason, body) == (200, "OK", b"ok")
    assert "X-Second" not in response.headers
    await get(pool)
    assert upstream.connections == 2  # the connection that carried the stray answer was not reused


@pytest.mark.parametrize("shape", ["many-lines", "one-endless-line", "in-a-1xx-answer", "just-within"])
async def test_an_answer_head_is_read_up_to_max_head_and_no_further(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool], shape: str
) -> None:
    """An upstream's head used to be read and kept whatever its size (20 MB of headers were stored with the
    record). Past MAX_HEAD the exchange fails at once, naming the answer's status when it got that far, and the
    socket is cut: a header line that never ends is not buffered on until the read timeout."""
    line = b"X-Big: " + b"a" * 1000 + b"\r\n"  # 1,009 bytes as on the wire, 1,009 as counted (name + value + 4)
    fitting = MAX_HEAD // len(line) - 1  # the status line and Content-Length fit beside these

    async def big_head(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await read_declared_body(head, reader)
        if shape == "in-a-1xx-answer":
            writer.write(b"HTTP/1.1 103 Early Hints\r\n" + line * (fitting + 2) + b"\r\n")
        writer.write(b"HTTP/1.1 201 Created\r\n")
        if shape == "one-endless-line":
            await endless_line(b"X-Endless: ", reader, writer)
            return False
        writer.write(line * (fitting + (2 if shape == "many-lines" else 0)) + b"Content-Length: 2\r\n\r\nok")
        return True

    upstream = await scripted(big_head)
    pool = pools(upstream.url, read_timeout=20.0)
    if shape == "just-within":
        response, body = await get(pool, "POST", body=b"{}")
        assert (response.status, body) == (201, b"ok") and len(response.headers.getall("X-Big")) == fitting
        return
    started = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamUnrelayable) as raised:
        await get(pool, "POST", body=b"{}")
    assert asyncio.get_running_loop().time() - started < 5.0
    assert raised.value.status == (0 if shape == "in-a-1xx-answer" else 201)
    assert isinstance(raised.value, UpstreamProtocolError)  # (an outcome unknown, to anyone who asks no more)
    await until(lambda: upstream.open_now == 0)  # the socket was cut, not kept for another request


@pytest.mark.parametrize("piece", [0, 8192, 997])
async def test_interim_answers_each_within_max_head_pass_however_their_bytes_arrive(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool], piece: int
) -> None:
    """Four 103 answers of 40 KB each, then the answer: every head is within MAX_HEAD. The first form of the limit
    counted every byte before the final head against 128 KiB, so whether they passed hung on how the socket
    reads split them, and a refused one was an unknown outcome (a second execution after the lease)."""
    hint = b"Link: <" + b"l" * 8000 + b">; rel=preload\r\n"
    data = (b"HTTP/1.1 103 Early Hints\r\n" + hint * 5 + b"\r\n") * 4
    data += b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"

    async def hinted(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        for start in range(0, len(data), piece or len(data)):
            writer.write(data[start:start + (piece or len(data))])
            await writer.drain()
            if piece:
                await asyncio.sleep(0)
        return True

    upstream = await scripted(hinted)
    response, body = await get(pools(upstream.url))
    assert (response.status, body) == (201, b"ok")


async def test_interim_answers_do_not_hold_off_the_read_timeout(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    """A 1xx answer is no answer: each used to start the wait for the final one again, so an upstream sending a
    103 every so often held the request open for ever (a pass-through has no deadline but the read timeout)."""
    async def hinting(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        while True:  # a 103 every 100 ms, never the answer (until the client hangs up)
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)

    upstream = await scripted(hinting)
    hints: list[int] = []
    pool = pools(upstream.url, read_timeout=1.0)
    started = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamReadTimeout):
        await asyncio.wait_for(pool.request("GET", "/", CIMultiDict(), None,
                                            interim=lambda status, reason, headers: hints.append(status)), 10.0)
    assert asyncio.get_running_loop().time() - started < 3.0
    assert len(hints) >= 5  # (they were relayed meanwhile)
    await until(lambda: upstream.open_now == 0)


@pytest.mark.parametrize("count", [MAX_INTERIM, MAX_INTERIM + 1])
async def test_the_number_of_interim_answers_is_bounded(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool], count: int
) -> None:
    """Each 1xx head is bounded by MAX_HEAD; their number was not. Past MAX_INTERIM the answer is broken, with
    no final status: an outcome unknown, and the socket is cut."""
    async def hinted(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n" * count
                     + b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
        return True

    upstream = await scripted(hinted)
    pool = pools(upstream.url)
    if count <= MAX_INTERIM:
        response, body = await get(pool)
        assert (response.status, body) == (201, b"ok")
        return
    with pytest.raises(UpstreamProtocolError) as raised:
        await get(pool)
    assert not isinstance(raised.value, UpstreamUnrelayable) and f"more than {MAX_INTERIM} 1xx" in str(raised.value)
    await until(lambda: upstream.open_now == 0)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 201 Cre\x01ated\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 201 Created\x7f\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 201 A\x00B\r\nContent-Length: 2\r\n\r\nok",
])
async def test_a_reason_phrase_with_a_control_character_is_dropped_and_the_answer_read(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool], answer: bytes
) -> None:
    """llhttp lets any byte but CR and LF through in a reason phrase, where RFC 9112 §4 allows HTAB, SP, VCHAR and
    obs-text only; aiohttp then refused to write the status line to the client ("Forbidden control character"): an
    unhandled exception with its traceback in the log, and the client's connection closed with no answer at all.
    A phrase means nothing (and none is stored): the answer is read without it, whole; it is never lost over it
    (a first fix made it a 502 and a covered request's record an answer without its body). A 1xx answer's phrase
    likewise: test_an_interim_answer_whose_reason_phrase_holds_a_control_character_loses_only_its_phrase."""
    async def odd(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer)
        return True

    upstream = await scripted(odd)
    response = await pools(upstream.url).request("GET", "/", CIMultiDict(), None)
    try:
        assert (response.status, response.reason, await response.read()) == (201, "", b"ok")
    finally:
        response.release()


@pytest.mark.parametrize("first", [b"HTTP/1.1 099 Odd\r\nContent-Length: 0\r\n\r\n",
                                   b"HTTP/1.1 000 Zero\r\n\r\n", b"HTTP/1.1 050 Odd\r\nContent-Length: 2\r\n\r\nok"])
async def test_a_status_below_100_is_no_interim_answer_but_a_broken_one(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool], first: bytes
) -> None:
    """llhttp reads any three digits as a status: "099" was taken for a 1xx answer (below 200) and handed on to
    the client of a pass-through as "HTTP/1.1 99 Odd", a status line no client reads (curl: "Unsupported response
    code"), and the answer after it taken as the final one. RFC 9110 §15: codes outside 100-599 are invalid; one
    below 100 is not even an interim answer: the answer is broken, with no final status (an outcome unknown)."""
    async def odd(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(first + b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
        return True

    upstream = await scripted(odd)
    handed: list[int] = []
    with pytest.raises(UpstreamProtocolError) as raised:
        response = await pools(upstream.url).request(
            "GET", "/", CIMultiDict(), None, interim=lambda status, reason, headers: handed.append(status))
        response.release()
    assert handed == []
    assert not isinstance(raised.value, UpstreamUnrelayable) and "status" in str(raised.value)
    await until(lambda: upstream.open_now == 0)


@pytest.mark.parametrize("interim", [b"HTTP/1.1 103 Early Hints\r\nConnection: close\r\n\r\n",
                                     b"HTTP/1.0 103 Early Hints\r\n\r\n"])
async def test_the_answer_after_a_1xx_saying_close_is_read_and_the_connection_not_kept(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool], interim: bytes
) -> None:
    """llhttp took a 1xx answer's ``Connection: close`` (or its HTTP/1.0) as the end of the connection and refused
    the final answer after it: an upstream that answered 201 looked like one whose outcome was unknown."""
    async def hinted(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(interim + b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
        return True

    upstream = await scripted(hinted)
    pool = pools(upstream.url)
    for _ in range(2):
        response, body = await get(pool)
        assert (response.status, body) == (201, b"ok")
    assert upstream.connections == 2  # (the 1xx said close: the connection was not kept, though the 201 did not)


async def test_a_trailer_line_that_never_ends_is_cut_at_max_head_with_the_answers_status(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    """httptools buffers a trailer line by ``bytes +=`` until it ends (time growing as its square: 40 MB took
    6 s of the event loop, every other request stalled behind it) and it was bounded by nothing."""
    async def endless(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await endless_line(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-T: ",
                           reader, writer)
        return False

    upstream = await scripted(endless)
    response = await pools(upstream.url, read_timeout=20.0).request("GET", "/", CIMultiDict(), None)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamUnrelayable) as raised:
            await response.read()
    finally:
        response.release()
    assert asyncio.get_running_loop().time() - started < 5.0
    assert raised.value.status == 201 and "trailer line" in str(raised.value)
    await until(lambda: upstream.open_now == 0)


async def test_a_head_broken_after_its_status_line_is_refused_with_that_status(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    """The upstream answered 201, in a head llhttp refuses (an obsolete folded line): that was an outcome
    unknown, and a covered key was executed again after its lease. Its status settles the key now."""
    async def folded(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 201 Created\r\nX-A: 1\r\n  folded\r\nContent-Length: 2\r\n\r\nok")
        return True

    upstream = await scripted(folded)
    with pytest.raises(UpstreamUnrelayable) as raised:
        await get(pools(upstream.url))
    assert raised.value.status == 201 and "not valid HTTP/1.1" in str(raised.value)


@pytest.mark.parametrize(("answer", "status"), [
    (b"HTTP/1.1 201 Created\r\n", 201),  # the status line whole, then the connection closed
    (b"HTTP/1.1 201 Created\r\nX-A: 1\r\nX-B: 2", 201),  # cut inside a header line
    (b"HTTP/1.1 201 \r\nX-A: 1\r\n", 201),  # an empty reason phrase, one header line whole
    (b"HTTP/1.1 201\r\n", 201),  # no reason phrase at all
    (b"HTTP/1.1 201 ", 201),  # the code delimited by its space
    (b"HTTP/1.1 201\r\nbad\r\n\r\n", 201),  # a broken head after a code with no reason phrase
    (b"HTTP/1.1 201", 0),  # the code not delimited: "2010" could follow
    (b"HTTP/1.1 201X\r\n\r\n", 0),
    (b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\nok", 0),  # llhttp stops at 200: not the upstream's status
    (b"HTTP/1.1 199 Hint\r\nContent-Length: 5\r\n\r\nEVIL!HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok", 0),
])
async def test_a_head_that_never_came_whole_names_the_status_only_once_its_status_line_did(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool],
    answer: bytes, status: int
) -> None:
    """A head cut short after its status line is an answer (settled by that status); one cut before it, or a
    status llhttp read off a broken line, is no answer (an unknown outcome). A 1xx answer with a body (llhttp
    frames one by Content-Length) is broken framing: its body used to be put in front of the final answer's
    ("EVIL!ok", stored and replayed so)."""
    async def cut(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer)
        return False

    upstream = await scripted(cut)
    with pytest.raises((UpstreamProtocolError, UpstreamDisconnected)) as raised:
        await get(pools(upstream.url))
    assert (raised.value.status if isinstance(raised.value, UpstreamUnrelayable) else 0) == status, raised.value


async def test_a_trailer_line_over_max_head_is_refused_however_it_arrives(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def long_trailer(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
                     b"X-T: " + b"t" * (MAX_HEAD + 5000) + b"\r\n\r\n")  # whole, in one write
        return True

    upstream = await scripted(long_trailer)
    with pytest.raises(UpstreamUnrelayable) as raised:
        await get(pools(upstream.url))
    assert raised.value.status == 201 and "trailer line" in str(raised.value)


async def test_trailers_are_not_counted_as_the_head_nor_kept(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    """httptools hands on a chunked body's trailer fields through on_header: they counted toward the head's
    limit (a valid answer with a 40 KB head and a 30 KB trailer was refused after its head went out)."""
    async def trailed(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nX-Head: " + b"h" * 40000 + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n0\r\nX-Trailer: " + b"t" * 30000 + b"\r\nX-Two: " + b"u" * 40000 + b"\r\n\r\n")
        return True

    upstream = await scripted(trailed)
    response, body = await get(pools(upstream.url))
    assert (response.status, body) == (200, b"hello")
    assert "X-Trailer" not in response.headers and len(response.headers["X-Head"]) == 40000


async def test_an_upstream_may_answer_before_the_body_ends_and_still_read_it(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def echo(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")  # the head first
        await writer.drain()
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            writer.write(b"%x\r\n%b\r\n" % (len(data), data))
            await writer.drain()
        await reader.readexactly(2)
        writer.write(b"0\r\n\r\n")
        return True

    sent = asyncio.Queue[bytes]()

    async def body() -> AsyncIterator[bytes]:
        for i in range(5):
            yield b"part%d;" % i
            await sent.get()  # the next part only once the upstream echoed this one (the head came first)

    upstream = await scripted(echo)
    pool = pools(upstream.url, read_timeout=5.0)
    response = await pool.request("POST", "/", CIMultiDict(), body())
    echoed = b""
    try:
        while chunk := await response.read_chunk(65536):
            echoed += chunk
            sent.put_nowait(chunk)
    finally:
        response.release()
    assert echoed == b"part0;part1;part2;part3;part4;"


async def test_a_slow_upload_is_not_a_silent_upstream(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def after_body(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await read_chunked(reader)
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
        return True

    async def body() -> AsyncIterator[bytes]:
        for _ in range(6):  # 6 x 0.1 s: twice the read timeout in all, never silent for as long as one
            yield b"slow"
            await asyncio.sleep(0.1)

    upstream = await scripted(after_body)
    response, _ = await get(pools(upstream.url, read_timeout=0.3), method="POST", body=body())
    assert response.status == 201


async def test_a_deadline_spent_before_sending_means_nothing_was_sent(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    gate = asyncio.Event()
    upstream = await scripted(gated(gate, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    pool = pools(upstream.url, limit=1, connect_timeout=30.0, read_timeout=30.0)
    holder = asyncio.ensure_future(get(pool))
    await until(lambda: len(upstream.requests) == 1)
    with pytest.raises(UpstreamConnectError):  # waited for the one connection past the caller's deadline
        await pool.request("POST", "/", CIMultiDict(), b"{}", timeout=0.2)
    assert len(upstream.requests) == 1  # nothing was sent
    gate.set()
    await holder
    gate.clear()
    with pytest.raises(UpstreamReadTimeout):  # sent, then the deadline passed: outcome unknown
        await pool.request("POST", "/", CIMultiDict(), b"{}", timeout=0.2)
    assert len(upstream.requests) == 2
    gate.set()


@pytest.mark.parametrize("codings", [b"chunked, gzip", b"gzip, chunked", b"gzip\r\nTransfer-Encoding: chunked",
                                     b"gzip", b"chunked,", b"chunked\t", b"chunked , ", b"identity",
                                     "chun\u212aed".encode()])  # (a Kelvin sign: Python lower-cases it to k)
async def test_a_transfer_coding_other_than_chunked_is_refused_with_the_answers_status(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool], codings: bytes
) -> None:
    """llhttp decodes chunked off the end of the list and leaves the rest undecoded: such a body used to be handed
    on (and stored) with its coding no longer named, as if it were the representation itself."""
    async def coded(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: %b\r\n\r\n5\r\nhello\r\n0\r\n\r\n" % codings)
        return True

    upstream = await scripted(coded)
    pool = pools(upstream.url)
    with pytest.raises(UpstreamUnrelayable) as raised:
        await get(pool)
    assert raised.value.status == 201 and "transfer coding" in str(raised.value)
    await until(lambda: upstream.open_now == 0)


@pytest.mark.parametrize("method", ["HEAD", "GET"])
async def test_a_transfer_coding_on_an_answer_without_a_body_frames_nothing_and_passes(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool], method: str
) -> None:
    """A HEAD answer or a 204/304 has no body to be left undecoded (RFC 9112 allows the header on HEAD and 304)."""
    async def bodiless(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        status = b"200 OK" if head.startswith(b"HEAD") else b"304 Not Modified"
        writer.write(b"HTTP/1.1 %b\r\nTransfer-Encoding: gzip, chunked\r\nX-Ok: 1\r\n\r\n" % status)
        return True

    upstream = await scripted(bodiless)
    pool = pools(upstream.url)
    for _ in range(2):
        response, body = await get(pool, method)
        assert (response.status, body, response.headers["X-Ok"]) == (200 if method == "HEAD" else 304, b"", "1")
    if method == "GET":  # the 304's connection is reused: nothing was left unread (a HEAD answer without a
        assert upstream.connections == 1  # Content-Length is never reused: its end is not known for sure)


async def test_chunked_named_in_any_case_and_spacing_is_read(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def chunked(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding:  Chunked \r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        return True

    upstream = await scripted(chunked)
    response, body = await get(pools(upstream.url))
    assert (response.status, body) == (200, b"hello")


async def test_a_broken_exchange_cuts_its_socket_at_once(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def never_reads(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await asyncio.Event().wait()
        return False

    upstream = await scripted(never_reads)
    pool = pools(upstream.url, limit=1, read_timeout=0.2)
    sockets: list[socket.socket] = []
    connect = pool._connect

    async def connect_and_note(deadline: float | None) -> _Connection:
        conn = await connect(deadline)
        assert conn.transport is not None
        sockets.append(conn.transport.get_extra_info("socket"))
        return conn

    pool._connect = connect_and_note  # type: ignore[method-assign]
    for _ in range(3):  # a body far larger than the socket buffers: unsent bytes must not keep a socket open
        with pytest.raises(UpstreamReadTimeout):
            await pool.request("POST", "/", CIMultiDict(), b"x" * (16 << 20))
    assert pool._open == 0 and not pool._idle
    await until(lambda: all(sock.fileno() == -1 for sock in sockets))  # closed, not left to drain forever
    assert len(sockets) == 3


async def test_an_upload_that_breaks_never_leaves_its_connection_pooled(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def answer_at_once(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        return True  # keeps the connection: only the client can tell that its upload broke

    answered = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield b"first"
        await answered.wait()
        raise ConnectionResetError("the client went away mid-upload")

    upstream = await scripted(answer_at_once)
    pool = pools(upstream.url)
    response = await pool.request("POST", "/", CIMultiDict(), body())
    conn = response._conn
    assert conn is not None and conn._writer is not None
    answered.set()
    writer = conn._writer
    await until(writer.done)  # the upload has failed before the caller is done with the answer
    with contextlib.suppress(UpstreamDisconnected):
        await response.read()
    response.release()
    assert not pool._idle
    _, data = await get(pool)
    assert data == b"ok" and upstream.connections == 2


async def test_a_reset_under_a_large_body_leaves_no_unretrieved_error(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def reset(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()
        return False

    upstream = await scripted(reset)
    with pytest.raises(UpstreamDisconnected):
        await pools(upstream.url).request("POST", "/", CIMultiDict(), b"x" * (32 << 20))
    # (the autouse loop_errors fixture fails the test on a "Future exception was never retrieved")


async def test_idle_connections_are_reused_only_within_the_upstreams_keep_alive(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool]
) -> None:
    async def hinted(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        hint = b"Keep-Alive: timeout=5\r\n" if b"/hinted" in head else b""
        writer.write(b"HTTP/1.1 200 OK\r\n%bContent-Length: 2\r\n\r\nok" % hint)
        return True

    upstream = await scripted(hinted)
    pool = pools(upstream.url, limit=1)
    await get(pool, target="/plain")
    pool._idle[0].idle_since -= KEEPALIVE - 1  # idle just under the default: reused
    await get(pool, target="/hinted")
    assert upstream.connections == 1
    pool._idle[0].idle_since -= 4.5  # past the upstream's 5 s less a margin: it may be closing it as we send
    await get(pool, target="/plain")
    assert upstream.connections == 2
    pool._idle[0].idle_since -= KEEPALIVE  # and the default bounds a connection without a hint
    await get(pool, target="/plain")
    assert upstream.connections == 3


@pytest.mark.parametrize("size", [5, 20])
async def test_a_streamed_body_that_breaks_its_declared_length_fails_instead_of_desyncing(
    scripted: Callable[[Answer], Awaitable[ScriptedUpstream]], pools: Callable[..., ConnectionPool], size: int
) -> None:
    async def after_declared(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await read_declared_body(head, reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    async def body() -> AsyncIterator[bytes]:
        yield b"x" * size  # 10 declared: too short (the upstream would wait forever) or too long (a smuggled tail)

    upstream = await scripted(after_declared)
    pool = pools(upstream.url, read_timeout=5.0)
    with pytest.raises(UpstreamProtocolError):
        await get(pool, method="PUT", body=body(), headers=CIMultiDict({"Content-Length": "10"}))
    assert not pool._idle and pool._open == 0
