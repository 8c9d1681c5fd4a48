"""The plain reverse proxy: methods, bytes, headers both ways, errors; against a real upstream."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import json
import logging
import re
import socket
import time
from types import SimpleNamespace

import aiohttp
import pytest
from yarl import URL

from idemproxy.proxy import _write_patiently
from tests.conftest import ProxyFactory
from tests.rawhttp import build_request, parse_response, raw_exchange, send_raw, send_raw_bytes
from tests.servers import free_port
from tests.test_relay import wait_for
from tests.upstream import RecordingUpstream


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "OPTIONS", "POST", "PATCH"])
async def test_every_method_reaches_the_upstream_with_its_body(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, method: str
) -> None:
    proxy = await make_proxy("embedded")
    resp, body = await proxy.post("/things/1", method=method, body=b"payload-bytes", tenant=None)
    assert resp.status in (200, 201)
    assert [(e.method, e.body) for e in upstream.executed] == [(method, b"payload-bytes")]
    if method != "HEAD":
        assert json.loads(body)["method"] == method


async def test_head_is_proxied(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy("embedded")
    resp, body = await proxy.post("/h", method="HEAD", tenant=None)
    assert resp.status == 200 and body == b""
    assert upstream.executed[0].method == "HEAD"


async def test_path_and_query_reach_the_upstream_byte_for_byte(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    raw = "/a%2Fb/c%20d/./e?x=1&x=2&y=%7E&z=a+b&empty="
    async with proxy.session.get(URL(proxy.url + raw, encoded=True)) as resp:
        assert resp.status == 200
    assert upstream.executed[0].path_qs == raw


async def test_hop_by_hop_headers_are_dropped_both_ways(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    headers = {
        "Connection": "keep-alive, X-Client-Private",
        "X-Client-Private": "secret",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Proxy-Authorization": "Basic Zm9vOmJhcg==",
        "X-End-To-End": "kept",
        "X-Test-Hop": "1",
    }
    resp, _ = await proxy.post("/hop", method="GET", headers=headers, tenant=None)
    seen = upstream.executed[0].headers
    for name in ("X-Client-Private", "Keep-Alive", "TE", "Proxy-Authorization"):
        assert name not in seen, name
    assert seen["X-End-To-End"] == "kept"
    # and on the way back
    assert "X-Up-Private" not in resp.headers
    assert "Keep-Alive" not in resp.headers
    assert resp.headers["X-Custom"] == "kept"


async def test_an_answer_without_length_to_an_http_1_0_keep_alive_client_ends_with_the_connection(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """An HTTP/1.0 client cannot be sent chunked framing: a body of unknown length (a chunked or to-the-close answer,
    streamed) ends where the connection does. aiohttp (3.14) drops its "Connection: keep-alive" for such an answer
    but still keeps the connection: the client waited for the close for ever, and a pipelined request's answer was
    read as the end of this one's body."""
    proxy = await make_proxy("embedded")
    request = (b"GET /stream HTTP/1.0\r\nConnection: keep-alive\r\nX-Test-Coding: chunked\r\n\r\n"
               b"GET /next HTTP/1.0\r\n\r\n")
    head, _, body = (await send_raw_bytes(proxy.url, request, timeout=10)).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"content-length" not in head.lower()
    assert b"keep-alive" not in head.lower() and body == b"hello"


@pytest.mark.parametrize("key", [None, "auto-1"])
async def test_the_upstream_gets_no_header_the_client_did_not_send(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, key: str | None
) -> None:
    """aiohttp's client adds User-Agent, Accept, Accept-Encoding and a Content-Type of its own unless told not to."""
    proxy = await make_proxy("embedded", tenant={"from": "static"})
    sent = [(b"Idempotency-Key", key.encode())] if key else []
    await send_raw(proxy.url, build_request(b"POST", b"/auto", sent, b"\x00raw bytes"))
    await send_raw(proxy.url, build_request(b"POST", b"/auto", [
        (b"User-Agent", b"client/1"), (b"Accept", b"text/csv"), (b"Accept-Encoding", b"identity"),
        (b"Content-Type", b"application/x-thing")], b"more"))
    bare, dressed = (e.headers for e in upstream.executed)
    for name in ("User-Agent", "Accept", "Accept-Encoding", "Content-Type"):
        assert name not in bare, name
    assert [(n, dressed.getall(n)) for n in ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")] == [
        ("User-Agent", ["client/1"]), ("Accept", ["text/csv"]), ("Accept-Encoding", ["identity"]),
        ("Content-Type", ["application/x-thing"])]


async def test_forwarded_headers_are_set_and_appended(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    await proxy.post("/xff", method="GET", headers={"X-Forwarded-For": "203.0.113.7"}, tenant=None)
    await proxy.post("/xff", method="GET", tenant=None)
    first, second = upstream.executed
    assert first.headers["X-Forwarded-For"] == "203.0.113.7, 127.0.0.1"
    assert second.headers["X-Forwarded-For"] == "127.0.0.1"
    assert first.headers["X-Forwarded-Proto"] == "http"
    assert first.headers["X-Forwarded-Host"] == URL(proxy.url).raw_authority


async def test_encoded_bodies_pass_through_untouched(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    compressed = gzip.compress(b'{"a": 1}')
    async with proxy.session.post(
        proxy.url + "/gz", data=compressed,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    ) as resp:
        assert resp.status == 201
    assert upstream.executed[0].body == compressed
    assert upstream.executed[0].headers["Content-Encoding"] == "gzip"


async def test_unreachable_upstream_is_502_problem(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy("embedded", upstream_url=f"http://127.0.0.1:{free_port()}")
    resp, body = await proxy.post("/x", method="GET", tenant=None)
    assert resp.status == 502
    assert resp.headers["Content-Type"] == "application/problem+json"
    problem = json.loads(body)
    assert problem["code"] == "upstream_unreachable" and problem["status"] == 502
    assert {"type", "title", "detail"} <= problem.keys()
    assert "127.0.0.1" not in body.decode()  # no internal host names


async def test_slow_upstream_is_504_and_not_retried(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded", upstream={"timeout": "300ms"})
    resp, body = await proxy.post("/slow", method="GET", headers={"X-Test-Delay": "3"}, tenant=None)
    assert resp.status == 504
    assert json.loads(body)["code"] == "upstream_timeout"
    assert upstream.count(path="/slow") == 1


async def test_dropped_connection_is_502_reset_and_not_retried(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    resp, body = await proxy.post("/drop", method="POST", headers={"X-Test-Drop": "1"}, tenant=None)
    assert resp.status == 502
    assert json.loads(body)["code"] == "upstream_reset"
    assert upstream.count(path="/drop") == 1


async def test_an_upstream_body_that_breaks_mid_stream_cuts_the_client_and_blames_the_upstream(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await make_proxy("embedded")
    with caplog.at_level(logging.INFO, "idemproxy.proxy"):
        async with proxy.session.get(proxy.url + "/stream/broken?size=1000000") as resp:
            assert resp.status == 200 and resp.content_length == 1000000
            with pytest.raises(aiohttp.ClientPayloadError):  # cut short: never taken for the whole answer
                await resp.read()
    assert "upstream body broke mid-stream" in caplog.text
    assert "client went away" not in caplog.text


async def test_a_client_that_hangs_up_mid_response_is_not_logged_as_an_upstream_fault(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await make_proxy("embedded")
    with caplog.at_level(logging.INFO, "idemproxy.proxy"):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"GET /stream/download?size=200000000 HTTP/1.1\r\nHost: proxy\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(65536)  # the answer is flowing
        writer.transport.abort()  # and the client is gone
        await wait_for(lambda: "client went away mid-response" in caplog.text)
    assert "upstream body broke" not in caplog.text
    resp, _ = await proxy.post("/after", method="GET", tenant=None)  # the proxy carries on
    assert resp.status == 200


async def test_a_client_that_stops_reading_frees_its_upstream_connection_within_the_upstream_timeout(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """aiohttp waits for a client's socket without a bound: a client that asked for a large answer and read
    none of it held its upstream connection for as long as it stayed connected, so max_connections such clients
    locked every request out of the upstream (502 upstream_unreachable; audit, 2026-11-27). A client taking no
    bytes for upstream.timeout is now gone as far as that answer goes."""
    proxy = await make_proxy("embedded", upstream={"timeout": "1s", "max_connections": 1})
    pool = proxy.proxy.upstreams.default.pool
    _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer.write(b"GET /stream/download?size=200000000 HTTP/1.1\r\nHost: proxy\r\n\r\n")  # never read
        await wait_for(lambda: pool._open == 1)
        await wait_for(lambda: pool._open == 0, timeout=15)
        resp, _ = await proxy.post("/after", method="GET", tenant=None)
        assert resp.status == 200
    finally:
        writer.transport.abort()
        await writer.wait_closed()


async def close_server(server: asyncio.Server, accepted: list[asyncio.StreamWriter]) -> None:
    """Close ``server`` and the connections it accepted."""
    for writer in accepted:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    server.close()
    await server.wait_closed()


async def test_a_client_that_leaves_while_a_write_waits_is_a_client_gone() -> None:
    """Its transport closing and its socket's fd -1 by the time the wait for progress looks: the first version
    asked the kernel about fd -1 and raised ValueError, an unhandled error (seen under uvloop, now and then, when
    a slow client left mid-download). A real connection; a write that waits for good."""
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _, writer: accepted.append(writer), "127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_connection(asyncio.Protocol, *server.sockets[0].getsockname()[:2])
    try:
        request = SimpleNamespace(transport=transport)
        never: asyncio.Future[None] = loop.create_future()
        response = SimpleNamespace(write=lambda chunk: never)
        transport.abort()
        await asyncio.sleep(0)  # (the loop closes its socket)
        assert transport.is_closing() and transport.get_extra_info("socket").fileno() == -1
        with pytest.raises(ConnectionResetError):
            await _write_patiently(request, response, b"x", 0.05)  # type: ignore[arg-type]
    finally:
        await close_server(server, accepted)


async def test_a_write_that_failed_as_the_client_left_leaves_no_unretrieved_error() -> None:
    """The client gone between a chunk's write and the look at its progress: the write (its own task) has failed
    already ("Cannot write to closing transport") when the look raises ConnectionResetError. Its error was never
    retrieved: asyncio logged "Task exception was never retrieved" with a traceback for every client that hung up
    on a large pass-through answer (seen on a serve process, a client closing after the head)."""
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _, writer: accepted.append(writer), "127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, object]] = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    transport, _ = await loop.create_connection(asyncio.Protocol, *server.sockets[0].getsockname()[:2])
    try:
        async def write(chunk: bytes) -> None:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

        request = SimpleNamespace(transport=transport)
        response = SimpleNamespace(write=write)
        transport.abort()
        gone = False
        try:
            await _write_patiently(request, response, b"x", 0.05)  # type: ignore[arg-type]
        except ConnectionResetError:
            gone = True  # (the exception and its frames dropped here: the write's task goes with them)
        assert gone
        await asyncio.sleep(0)  # (a done callback that retrieves it runs now)
        gc.collect()
        assert unretrieved == []
    finally:
        loop.set_exception_handler(handler)
        await close_server(server, accepted)


async def test_a_slow_client_that_keeps_reading_is_not_cut(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """Cut only when it has taken no bytes for upstream.timeout: one write (a 64 KiB chunk and aiohttp's drain)
    takes longer than that for a client on a slow link, and the first version cut such a client mid-download
    (review, 2026-11-27). Here 1 KiB every 50 ms, with upstream.timeout 1 s, for 4 s."""
    proxy = await make_proxy("embedded", upstream={"timeout": "1s"})

    def slow_client() -> tuple[int, str]:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", proxy.port))
            sock.sendall(b"GET /stream/download?size=200000000 HTTP/1.1\r\nHost: proxy\r\n\r\n")
            got, until = 0, time.monotonic() + 4
            while time.monotonic() < until:
                try:
                    data = sock.recv(1024)
                except ConnectionResetError as exc:
                    return got, repr(exc)
                if not data:
                    return got, "EOF"
                got += len(data)
                time.sleep(0.05)  # the client's own pace: a slow link
            return got, "still reading"

    with caplog.at_level(logging.INFO, "idemproxy.proxy"):
        got, how = await asyncio.to_thread(slow_client)
    # (once it has left, the proxy notices it gone: that line names the connection error, not a timeout)
    assert how == "still reading" and "mid-response (TimeoutError)" not in caplog.text, (got, how, caplog.text)


@pytest.mark.parametrize("request_line", [
    b"GET /big HTTP/1.1\r\nHost: proxy\r\nX-Test-Size: 200000\r\n",  # a streamed pass-through answer
    b"HEAD /big HTTP/1.1\r\nHost: proxy\r\n",
    b"POST /v1/charges HTTP/1.1\r\nHost: proxy\r\nX-Test-Size: 200000\r\nIdempotency-Key: gone\r\n"
    b"Authorization: t\r\nContent-Length: 2\r\n",  # a covered answer too large to keep, streamed
], ids=["get", "head", "covered"])
async def test_a_client_gone_before_the_answer_starts_is_not_an_error(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture, request_line: bytes
) -> None:
    """Writing the head to a client that hung up failed outside the streaming loop's handling: an ERROR with a
    traceback ('unhandled error while serving') for an everyday event."""
    proxy = await make_proxy("embedded", idempotency={"max_stored_response": "4KiB"})
    with caplog.at_level(logging.INFO):
        _reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        body = b"{}" if request_line.startswith(b"POST") else b""
        writer.write(request_line + b"X-Test-Delay: 0.3\r\n\r\n" + body)
        await wait_for(lambda: len(upstream.executed) == 1)  # the upstream has it and answers in 0.3 s
        writer.transport.abort()  # the client is gone before the answer's head
        await wait_for(lambda: "client went away" in caplog.text or "unhandled error" in caplog.text)
    assert "unhandled error" not in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]
    resp, _ = await proxy.post("/after", method="GET", tenant=None)  # the proxy carries on
    assert resp.status == 200


@pytest.mark.parametrize("framing", ["small", "large", "chunked"])
async def test_a_covered_upload_that_stalls_gets_408_and_one_that_trickles_does_not(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, framing: str
) -> None:
    """A client that stopped sending mid-body was cut unanswered once no byte had come for the route's
    upstream.timeout (a bound meant for the upstream, with a timer per read), and not counted. It now gets 408
    request_timeout once no byte came for listen.body_timeout, counted as body_too_large (a bound on the body,
    as its size is); the body is read before the claim, so no record is touched: the same key, sent whole, is
    forwarded. A client that keeps sending, however slowly, is not cut."""
    proxy = await make_proxy("embedded", listen={"body_timeout": "400ms"})
    size = 100_000 if framing == "large" else 100  # (past SMALL_BODY or not: the two read paths)
    framing_header = (b"Transfer-Encoding: chunked" if framing == "chunked" else b"Content-Length: %d" % size)

    def head(key: bytes) -> bytes:
        return (b"POST /v1/charges HTTP/1.1\r\nHost: proxy\r\nAuthorization: t\r\nIdempotency-Key: " + key +
                b"\r\n" + framing_header + b"\r\n\r\n")

    def piece(data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data) if framing == "chunked" else data

    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(head(b"stall") + piece(b"x" * 10))  # then nothing more, still connected
    await writer.drain()
    sent = loop.time()
    async with asyncio.timeout(10):
        answer = parse_response(await reader.read())  # answered, and the connection closed after it
    writer.close()
    assert loop.time() - sent >= 0.4
    assert answer.status == 408 and json.loads(answer.body)["code"] == "request_timeout"
    assert answer.headers["content-type"] == "application/problem+json" and answer.headers["x-request-id"]
    assert upstream.executed == []
    counted = 'idemproxy_requests_total{method="POST",outcome="body_too_large",route="other"} 1.0'
    assert counted in proxy.proxy.metrics.render().decode()

    # a client sending a piece every 150 ms for ~1.2 s (three times the timeout) gets its answer; the stalled
    # key, sent whole, is forwarded: it was never claimed
    for key in (b"trickle", b"stall"):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(head(key))
        sent_bytes = 0
        for i in range(8):
            part = b"y" * (size // 8 if i < 7 else size - 7 * (size // 8))
            writer.write(piece(part))
            sent_bytes += len(part)
            await writer.drain()
            if key == b"trickle":
                await asyncio.sleep(0.15)  # (the pace of a slow client, not a wait for the proxy)
        if framing == "chunked":
            writer.write(b"0\r\n\r\n")
        async with asyncio.timeout(10):
            status_line = await reader.readline()
        writer.close()
        assert status_line.startswith(b"HTTP/1.1 201"), status_line
    assert sent_bytes == size and [len(e.body) for e in upstream.executed] == [size, size]
    assert [e.headers["Idempotency-Key"] for e in upstream.executed] == ["trickle", "stall"]


@pytest.mark.parametrize("head", [
    b"POST /v1/charges HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: half\r\nAuthorization: t\r\n"
    b"Content-Length: 10\r\n\r\n{\"a\"",  # covered, part of its body sent
    b"PUT /v1/things HTTP/1.1\r\nHost: proxy\r\nContent-Length: 10\r\n\r\n{\"a\"",  # passed through
    b"POST /v1/charges HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: exp\r\nAuthorization: t\r\n"
    b"Expect: 100-continue\r\nContent-Length: 10\r\n\r\n",  # gone before the 100 is written
], ids=["covered", "passthrough", "expecting"])
@pytest.mark.parametrize("leaving", ["reset", "close"])
async def test_a_client_gone_before_its_body_came_whole_is_not_an_error(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture, head: bytes,
    leaving: str,
) -> None:
    """An everyday event (a client that timed out mid-upload) was an ERROR with a traceback, counted as a
    request the proxy answered with 500 (as a passthrough on a covered route)."""
    proxy = await make_proxy("embedded")
    with caplog.at_level(logging.INFO):
        _reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(head)
        await writer.drain()
        if leaving == "reset":
            writer.transport.abort()
        else:
            writer.close()
        await wait_for(lambda: "client went away" in caplog.text or "unhandled error" in caplog.text)
    method, path = head.decode().split()[:2]
    assert f"client went away before {method} {path} was read whole" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert upstream.executed == []
    assert "idemproxy_requests_total{" not in proxy.proxy.metrics.render().decode()  # not a request answered
    # the proxy carries on, and an upstream's own 499 is an answer like any other: counted
    resp, _ = await proxy.post("/after", method="GET", tenant=None, headers={"X-Test-Status": "499"})
    assert resp.status == 499
    assert 'idemproxy_requests_total{method="GET",outcome="passthrough",route="other"} 1.0' in (
        proxy.proxy.metrics.render().decode())


async def test_upstream_status_and_headers_are_passed_through(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    resp, _ = await proxy.post("/teapot", method="GET", headers={"X-Test-Status": "418"}, tenant=None)
    assert resp.status == 418
    assert resp.headers["X-Upstream-Serial"] == "1"
    assert "Idempotent-Replayed" not in resp.headers  # not a covered request


async def test_admin_endpoints(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy("embedded")
    await proxy.post("/m", method="GET", tenant=None)
    from aiohttp.test_utils import TestServer

    admin = TestServer(proxy.proxy.admin_app(), host="127.0.0.1")
    await admin.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(admin.make_url("/healthz")) as resp:
                assert resp.status == 200
            async with session.get(admin.make_url("/readyz")) as resp:
                assert resp.status == 200
                assert (await resp.json())["stores"] == {"embedded": "ok"}
            async with session.get(admin.make_url("/metrics")) as resp:
                text = await resp.text()
        assert 'idemproxy_requests_total{method="GET",outcome="passthrough",route="other"} 1.0' in text
    finally:
        await admin.close()


@pytest.mark.parametrize(("method", "key"), [("PUT", "put-1"), ("GET", None)])  # covered, and pass-through
async def test_the_proxy_never_resends_a_request_the_upstream_may_have_executed(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, method: str, key: str | None
) -> None:
    """aiohttp's client resends PUT/DELETE/GET once when a pooled connection drops; guarantee 6 forbids it."""
    proxy = await make_proxy("embedded", idempotency={"methods": ["POST", "PUT"]})
    await proxy.post("/warm", method="GET", tenant=None)  # leaves a pooled upstream connection to be reused
    resp, body = await proxy.post("/v1/things/1", method=method, key=key, body=b"x" if key else None,
                                  headers={"X-Test-Drop": "1"})
    assert resp.status == 502, body  # the connection broke after sending: outcome unknown, not retried
    assert upstream.count(path="/v1/things/1") == 1


async def test_expect_100_continue_gets_the_interim_answer_before_the_body_is_sent(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """RFC 9110 §10.1.1: a client that sends ``Expect: 100-continue`` waits for the 100 before its body."""
    proxy = await make_proxy("embedded")
    body = b'{"amount": 100}'
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(b"POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: exp-1\r\nAuthorization: Bearer t1\r\n"
                     b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        await writer.drain()
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert upstream.executed == []  # nothing forwarded before the body came
        writer.write(body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 201 ")
    assert [e.body for e in upstream.executed] == [body]


async def _first_answer(port: int, head: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Send a head that expects 100-continue, and no body; the first answer's status line, headers and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        status_line, _, block = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).partition(b"\r\n")
        headers = dict(line.decode().split(": ", 1) for line in block.split(b"\r\n") if line)
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("Content-Length", "0"))), 10)
    finally:
        writer.close()  # (as curl does: an answer before the 100 means the body is not sent)
    return status_line, headers, body


@pytest.mark.parametrize(("head", "status", "code"), [
    (b"POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big\r\nAuthorization: Bearer t1\r\n"
     b"Content-Length: 2000000\r\n", 413, "body_too_large"),  # over max_request_body (1 MiB), by its length
    (b"POST /v1/refunds HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t1\r\nContent-Length: 20\r\n",
     400, "missing_key"),
    (b"POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: anon\r\nContent-Length: 20\r\n",
     401, "missing_tenant"),
    (b"POST /v1/refunds HTTP/1.1\r\nHost: x\r\nIdempotency-Key: a\x7fb\r\nAuthorization: Bearer t1\r\n"
     b"Content-Length: 20\r\n", 400, "invalid_key"),
], ids=["too-large", "missing-key", "missing-tenant", "invalid-key"])
async def test_a_request_refused_before_its_body_is_answered_without_asking_for_it(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, head: bytes, status: int, code: str
) -> None:
    """RFC 9110 §10.1.1: the 100 asks the client for its body; a request refused without it gets its final answer
    instead (no upload of a body that would be thrown away), and ``Connection: close`` says the body is not
    awaited."""
    proxy = await make_proxy("embedded", routes=[{"prefix": "/v1/refunds", "required": True}])
    status_line, headers, body = await _first_answer(proxy.port, head + b"Expect: 100-continue\r\n\r\n")
    assert int(status_line.split()[1]) == status, status_line  # never the 100 first
    # (the parser's own answer to a key it refused is HTTP/1.0, which closes without saying so)
    assert headers.get("Connection") == "close" or status_line.startswith(b"HTTP/1.0 ")
    assert json.loads(body)["code"] == code and upstream.executed == []
    # A body that does come is still forwarded once the 100 asked for it: covered and passed through alike.
    framings = {"Content-Length: 2": b"{}", "Transfer-Encoding: chunked": b"2\r\n{}\r\n0\r\n\r\n"}
    length, chunked = framings
    sent = [("POST", "exp-5", length), ("POST", "exp-6", chunked), ("PUT", None, length), ("PUT", None, chunked)]
    for method, key, framing in sent:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            writer.write(f"{method} /v1/charges HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t1\r\n"
                         f"{f'Idempotency-Key: {key}' + chr(13) + chr(10) if key else ''}"
                         f"Expect: 100-continue\r\n{framing}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(framings[framing])
            assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 20")
        finally:
            writer.close()
    assert [(e.method, e.body) for e in upstream.executed] == [(method, b"{}") for method, _, _ in sent]
    # the proxy answered the expectation: the upstream gets the body with the head, and no Expect to answer
    assert [e.headers.get("Expect") for e in upstream.executed] == [None] * len(sent)


@pytest.mark.parametrize(("head", "sent", "status"), [
    # a chunked body found over max_request_body (1 KiB here) while it was being read
    (b"POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big-1\r\nAuthorization: Bearer t1\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n", b"800\r\n" + b"a" * 0x800 + b"\r\n", 413),
    # refused (no key on a required route) while most of its declared body is still to come
    (b"POST /v1/refunds HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t1\r\nContent-Length: 100000\r\n\r\n",
     b"a" * 100, 400),
], ids=["chunked-over-the-limit", "refused-mid-body"])
async def test_an_answer_given_before_the_body_came_whole_closes_the_connection(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, head: bytes, sent: bytes, status: int
) -> None:
    """The rest of the body is not wanted, so the answer says ``Connection: close`` (as Go's net/http and nginx
    do): a client must not send its next request on a connection that still carries an unread body."""
    proxy = await make_proxy("embedded", idempotency={"max_request_body": "1KiB"},
                             routes=[{"prefix": "/v1/refunds", "required": True}])
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(head + sent)
        await writer.drain()
        answer_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()
    assert answer_head.startswith(b"HTTP/1.1 %d " % status), answer_head
    assert b"\r\nConnection: close\r\n" in answer_head
    assert upstream.executed == []
    # A refusal whose body did come whole keeps the connection: the next request on it is served.
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(b"POST /v1/refunds HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t1\r\nContent-Length: 2\r\n\r\n{}"
                     b"GET /public HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        both = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert both.startswith(b"HTTP/1.1 400 ") and b"\r\nConnection: close\r\n" not in both.split(b"\r\n\r\n")[0]
    assert b"HTTP/1.1 200 " in both and [e.path_qs for e in upstream.executed] == ["/public"]


async def test_interim_answers_are_forwarded_on_pass_through_only(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """RFC 9110 §15.2: a proxy forwards 1xx answers (here a 103 Early Hints), but not to an HTTP/1.0 client and not
    a 100 (the proxy answers ``Expect`` itself). A covered request's answer is stored before any byte of it
    reaches the client, so its interim answers are not forwarded."""
    proxy = await make_proxy("embedded")
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </caf\xc3\xa9.css>; rel=preload\r\n\r\n"  # (hop-by-hop dropped)
    for head in (b"GET /hinted HTTP/1.1\r\n", b"POST /hinted HTTP/1.1\r\nContent-Length: 2\r\n"):
        body = b"{}" if head.startswith(b"POST") else b""
        rest = b"Host: x\r\nX-Test-Interim: 1\r\nConnection: close\r\n\r\n" + body
        passed = await send_raw_bytes(proxy.url, head + rest)
        assert passed.startswith(hints + b"HTTP/1.1 20"), passed
        assert passed.count(b"HTTP/1.1 ") == 2
    covered = await send_raw_bytes(proxy.url, b"POST /hinted HTTP/1.1\r\nHost: x\r\nX-Test-Interim: 1\r\n"
                                              b"Idempotency-Key: hint-1\r\nAuthorization: Bearer t1\r\n"
                                              b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
    assert covered.startswith(b"HTTP/1.1 201 ") and covered.count(b"HTTP/1.1 ") == 1, covered
    old = await send_raw_bytes(proxy.url, b"GET /hinted HTTP/1.0\r\nHost: x\r\nX-Test-Interim: 1\r\n\r\n")
    assert old.startswith(b"HTTP/1.0 200 OK\r\n") and b" 103 " not in old, old
    # A 101 is no interim answer here (the proxy sent no Upgrade): the answer is broken, and the client gets a 502.
    switched = await send_raw_bytes(proxy.url, b"GET /hinted HTTP/1.1\r\nHost: x\r\nX-Test-Interim: 101\r\n"
                                               b"Connection: close\r\n\r\n")
    assert switched.startswith(b"HTTP/1.1 502 ") and b" 101 " not in switched, switched
    assert upstream.count(path="/hinted") == 5


async def test_an_interim_answer_whose_reason_phrase_holds_a_control_character_loses_only_its_phrase(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """A reason phrase means nothing (RFC 9112 §4: a client ignores it), and a 1xx answer is no answer: one whose
    phrase holds a control character (which llhttp lets through) made the whole exchange a broken answer, 502
    upstream_reset, though its final answer was whole. A covered request, which relays no 1xx answer, lost its
    stored 201 (an outcome unknown: the key held until its lease ran out), and a pass-through lost its answer over a
    100 that is never relayed. The final answer goes through; a relayed 1xx answer goes without its phrase."""
    proxy = await make_proxy("embedded")
    covered = await send_raw_bytes(proxy.url, b"POST /odd-hints HTTP/1.1\r\nHost: x\r\nX-Test-Interim: odd\r\n"
                                              b"Idempotency-Key: odd-hint-1\r\nAuthorization: Bearer t1\r\n"
                                              b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
    assert covered.startswith(b"HTTP/1.1 201 Created\r\n") and covered.count(b"HTTP/1.1 ") == 1, covered
    replayed = await send_raw_bytes(proxy.url, b"POST /odd-hints HTTP/1.1\r\nHost: x\r\nX-Test-Interim: odd\r\n"
                                               b"Idempotency-Key: odd-hint-1\r\nAuthorization: Bearer t1\r\n"
                                               b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
    assert replayed.startswith(b"HTTP/1.1 201 ") and b"Idempotent-Replayed: true" in replayed, replayed
    passed = await send_raw_bytes(proxy.url, b"GET /odd-hints HTTP/1.1\r\nHost: x\r\nX-Test-Interim: odd\r\n"
                                             b"Connection: close\r\n\r\n")
    assert passed.startswith(b"HTTP/1.1 103 \r\nLink: </a.css>; rel=preload\r\n\r\nHTTP/1.1 200 OK\r\n"), passed
    assert upstream.count(path="/odd-hints") == 2


async def test_a_final_answer_whose_reason_phrase_holds_a_control_character_is_relayed_and_stored_without_it(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """aiohttp would not write such a phrase (an unhandled exception, the client's connection closed with no
    answer); a first fix made the answer a 502 and the record an answer without its body, the charge's answer lost
    over a phrase no client reads. The answer goes out without its phrase, and is stored and replayed whole."""
    proxy = await make_proxy("embedded")
    heads = {"X-Test-Phrase": "1"}
    first, body = await proxy.post("/odd-phrase", key="odd-phrase-1", body={"amount": 1}, headers=heads)
    assert (first.status, first.reason, first.headers["Idempotent-Replayed"]) == (201, "", "false"), body
    again, replayed = await proxy.post("/odd-phrase", key="odd-phrase-1", body={"amount": 1}, headers=heads)
    assert (again.status, again.headers["Idempotent-Replayed"], replayed) == (201, "true", body)
    passed = await send_raw_bytes(proxy.url, b"GET /odd-phrase HTTP/1.1\r\nHost: x\r\nX-Test-Phrase: 1\r\n"
                                             b"Connection: close\r\n\r\n")
    assert passed.startswith(b"HTTP/1.1 200 \r\n") and passed.endswith(b'{"serial": 2}'), passed
    assert upstream.count(path="/odd-phrase") == 2


async def test_interim_answers_without_an_end_are_504_within_the_upstream_timeout(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """An upstream sending a 103 every 100 ms and never its answer held a pass-through open for as long as it went
    on (each 1xx started the read timeout again). Now the timeout runs for the final answer; the hints before it
    were relayed as they came."""
    proxy = await make_proxy("embedded", upstream={"timeout": "1s"})
    started = asyncio.get_running_loop().time()
    answer = await send_raw_bytes(proxy.url, b"GET /hinting HTTP/1.1\r\nHost: x\r\nX-Test-Interim: hints\r\n"
                                             b"Connection: close\r\n\r\n")
    assert asyncio.get_running_loop().time() - started < 4.0
    assert answer.startswith(b"HTTP/1.1 103 Early Hints\r\n") and answer.count(b"HTTP/1.1 103 ") >= 5, answer
    final = answer[answer.rindex(b"HTTP/1.1 "):]
    assert final.startswith(b"HTTP/1.1 504 ") and b'"upstream_timeout"' in final, final
    assert upstream.count(path="/hinting") == 1


async def test_more_than_100_interim_answers_are_a_broken_answer_and_the_detail_says_so(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    answer = await send_raw_bytes(proxy.url, b"GET /flood HTTP/1.1\r\nHost: x\r\nX-Test-Interim: flood\r\n"
                                             b"Connection: close\r\n\r\n")
    assert answer.count(b"HTTP/1.1 103 ") == 100, answer[:200]  # (relayed as they came, up to the limit)
    final = answer[answer.rindex(b"HTTP/1.1 "):]
    assert final.startswith(b"HTTP/1.1 502 "), final
    problem = json.loads(final.partition(b"\r\n\r\n")[2])
    assert problem["code"] == "upstream_reset" and "more than 100 1xx answers" in problem["detail"], problem
    assert upstream.count(path="/flood") == 1


async def test_a_covered_answer_after_a_1xx_saying_close_is_stored_and_replayed(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """llhttp refused every byte after a 1xx answer saying ``Connection: close``, the final 201 too: the charge
    was made, the client got 502 and (``on_unknown_outcome: release``) its retry made it again."""
    proxy = await make_proxy("embedded", idempotency={"on_unknown_outcome": "release"})
    headers = {"X-Test-Interim": "close"}
    first, first_body = await proxy.post("/v1/charges", key="close-1", body={"amount": 1}, headers=headers)
    again, again_body = await proxy.post("/v1/charges", key="close-1", body={"amount": 1}, headers=headers)
    assert (first.status, again.status) == (201, 201), first_body
    assert first.headers["Idempotent-Replayed"] == "false" and again.headers["Idempotent-Replayed"] == "true"
    assert again_body == first_body
    assert upstream.count(key="close-1") == 1


async def test_an_unknown_expectation_is_417_and_an_http_1_0_expect_is_ignored(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    port = proxy.port
    head = ("POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: exp-2\r\nAuthorization: Bearer t1\r\n"
            "Expect: 200-ok\r\nContent-Length: 2\r\nConnection: close\r\n\r\n")
    status, headers, payload = await raw_exchange(port, head, b"{}")
    assert status == 417 and headers["Content-Type"] == "application/problem+json"
    assert json.loads(payload)["status"] == 417 and "200-ok" in json.loads(payload)["detail"]
    assert "X-Request-Id" in headers and "Server" not in headers
    assert upstream.executed == []
    # Refused before its body came: the connection closes, so what the client sends next on it (its retry
    # without the expectation, or bytes shaped as a request) is never read as that body, nor run.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /public HTTP/1.1\r\nHost: x\r\nExpect: x\r\nContent-Length: 5\r\n\r\n")
        answer_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert answer_head.startswith(b"HTTP/1.1 417 ") and b"\r\nConnection: close\r\n" in answer_head
        writer.write(b"AAAAAGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(reader.read(), 10)  # until the proxy closes
    finally:
        writer.close()
    assert upstream.executed == []
    old = head.replace("HTTP/1.1", "HTTP/1.0", 1).replace("exp-2", "exp-3").replace("200-ok", "100-continue")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(old.encode() + b"{}")
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.0 201 ")  # no interim 100 for HTTP/1.0 (RFC 9110: MUST ignore)
    assert upstream.count() == 1
    empty = head.replace("Expect: 200-ok", "Expect: ").replace("exp-2", "exp-4")  # names no expectation at all
    status, _, _ = await raw_exchange(port, empty, b"{}")
    assert status == 201 and upstream.count() == 2
    # Expect is a list (RFC 9110 §10.1.1): an unknown member is refused wherever it stands, in one line or two.
    for expects in ("Expect: 100-continue\r\nExpect: 200-ok", "Expect: 100-continue, 200-ok"):
        status, _, payload = await raw_exchange(port, head.replace("Expect: 200-ok", expects), b"{}")
        assert status == 417 and "200-ok" in json.loads(payload)["detail"], expects
    assert upstream.count() == 2


@pytest.mark.parametrize("codings", ["gzip, chunked", "deflate, chunked", "x-custom, chunked"])
async def test_a_request_in_a_transfer_coding_other_than_chunked_is_501_and_never_forwarded(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, codings: str
) -> None:
    """aiohttp decodes chunked off the end of the list and left the rest: the gzip-coded bytes reached the
    upstream as the body itself, the coding no longer named (and were fingerprinted so). As nginx does, 501."""
    proxy = await make_proxy("embedded")
    for target, key in (("/v1/charges", "Idempotency-Key: te-1\r\n"), ("/public", "")):
        head = (f"POST {target} HTTP/1.1\r\nHost: x\r\n{key}Authorization: Bearer t1\r\n"
                f"Transfer-Encoding: {codings}\r\n\r\n")
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            writer.write(head.encode() + b"5\r\nhello\r\n0\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)  # until the proxy closes: its body is not read
        finally:
            writer.close()
        response = parse_response(answer)
        assert response.status == 501, answer
        assert response.headers["content-type"] == "application/problem+json"
        assert "transfer coding" in json.loads(response.body)["detail"]
    assert upstream.executed == []
    chunked = ("POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: te-2\r\nAuthorization: Bearer t1\r\n"
               "Transfer-Encoding: Chunked\r\nConnection: close\r\n\r\n")  # chunked alone, in any case
    status, _, _ = await raw_exchange(proxy.port, chunked, b"5\r\nhello\r\n0\r\n\r\n")
    assert status == 201 and upstream.executed[0].body == b"hello"


_KEYED = b"Host: x\r\nIdempotency-Key: early-1\r\nAuthorization: Bearer t1\r\nConnection: close\r\n"


@pytest.mark.parametrize(
    ("raw", "status", "method", "route"),
    [
        (b"POST /v1/charges HTTP/1.1\r\n" + _KEYED + b"Expect: 200-ok\r\nContent-Length: 2\r\n\r\n{}",
         417, "POST", "/v1/charges"),
        (b"POST /v1/charges HTTP/1.1\r\n" + _KEYED + b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
         501, "POST", "/v1/charges"),
        (b"POST /v1/charges HTTP/1.0\r\n" + _KEYED + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
         400, "POST", "/v1/charges"),
        (b"PATCH /public HTTP/1.1\r\n" + _KEYED + b"Expect: 200-ok\r\nContent-Length: 2\r\n\r\n{}",
         417, "PATCH", "other"),
        (b"CONNECT pay.example:443 HTTP/1.1\r\nHost: pay.example:443\r\n\r\n", 400, "CONNECT", "other"),
        (build_request(b"POST", b"/v1/charges", [(b"Idempotency-Key", b"k\x01ey"), (b"Authorization", b"t")], b"{}"),
         400, "UNKNOWN", "other"),
    ],
    ids=["expectation", "transfer-coding", "http10-transfer-coding", "uncovered-route", "connect", "unreadable-key"],
)
async def test_a_request_refused_before_the_engine_is_counted_and_access_logged(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture, raw: bytes, status: int,
    method: str, route: str,
) -> None:
    """A 417 (an unknown expectation), a 501 (a transfer coding other than chunked), the 400s for an HTTP/1.0
    request with a transfer coding and for CONNECT were answered before the engine ran: the client got a problem
    with a request id, but no access line named that id and idemproxy_requests_total never counted the request
    (a key header the parser refused was counted, never access-logged). Counted and logged as the engine's own
    refusals are: outcome invalid_key, the route the path names."""
    proxy = await make_proxy("embedded", log={"access": "INFO"}, routes=[{"prefix": "/v1/charges"}])
    with caplog.at_level("INFO", logger="idemproxy.access"):
        response = parse_response(await send_raw_bytes(proxy.url, raw, timeout=10))
    assert response.status == status and response.headers["content-type"] == "application/problem+json"
    request_id = response.headers["x-request-id"]
    lines = [record.getMessage() for record in caplog.records if record.name == "idemproxy.access"]
    assert len(lines) == 1 and lines[0].startswith(f"{method} ") and lines[0].endswith(f" {request_id}"), lines
    assert f" {status} invalid_key " in lines[0]
    counted = f'idemproxy_requests_total{{method="{method}",outcome="invalid_key",route="{route}"}} 1.0'
    assert counted in proxy.proxy.metrics.render().decode()
    assert upstream.executed == []


@pytest.mark.parametrize("target", ["/v1/charges", "/public"])
async def test_an_http10_request_with_a_transfer_coding_is_400_and_its_connection_closed(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, target: str
) -> None:
    """HTTP/1.0 has no chunked coding (RFC 9112 §6.1: the framing is faulty, the connection closes). aiohttp
    decoded it as chunked and kept the connection alive: a front hop reading the body to the close would have
    seen the request behind it as body bytes, this proxy as a second request it forwarded."""
    proxy = await make_proxy("embedded")
    head = (f"POST {target} HTTP/1.0\r\nHost: x\r\nIdempotency-Key: te10\r\nAuthorization: Bearer t1\r\n"
            "Connection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n")
    behind = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(head.encode() + b"5\r\nhello\r\n0\r\n\r\n" + behind)
        answer = await asyncio.wait_for(reader.read(), 10)  # until the proxy closes
    finally:
        writer.close()
    response = parse_response(answer)
    assert response.status == 400, answer
    assert "HTTP/1.0" in json.loads(response.body)["detail"]
    assert len(re.findall(rb"(?:^|\r\n)HTTP/1\.[01] \d{3} ", answer)) == 1  # nothing answered for the bytes behind it
    assert upstream.executed == []


async def test_an_escaped_line_break_in_the_path_cannot_forge_a_log_line(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """The access log writes the path as it came (%0A), never decoded into a line break."""
    proxy = await make_proxy("embedded", log={"access": "INFO"})
    forged = "/x%0A2026-11-24%2006:00:00,000%20ERROR%20idemproxy:%20FORGED%0D"
    with caplog.at_level("INFO", logger="idemproxy.access"):
        status, _, _ = await raw_exchange(proxy.port, f"GET {forged}?secret=s3 HTTP/1.1\r\nHost: x\r\n"
                                                      "Connection: close\r\n\r\n")
    assert status == 404  # forwarded: the test upstream's own router matches no decoded path with a line break
    lines = [record.getMessage() for record in caplog.records if record.name == "idemproxy.access"]
    assert len(lines) == 1 and forged in lines[0]
    assert "\n" not in lines[0] and "\r" not in lines[0] and "s3" not in lines[0]  # nor the query


async def test_answers_aiohttp_makes_itself_carry_a_request_id_and_no_banner(make_proxy: ProxyFactory) -> None:
    """A request that cannot be parsed is answered by aiohttp, before any handler: it too gets an id."""
    proxy = await make_proxy("embedded")
    status, headers, _ = await raw_exchange(proxy.port, "GET /x HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
    assert status == 400
    assert len(headers["X-Request-Id"]) == 32 and "Server" not in headers


async def test_absolute_form_target_is_forwarded_as_its_path(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """RFC 9112 §3.2.2: a server accepts an absolute-form target; it means its path and query."""
    proxy = await make_proxy("embedded")
    body = b'{"amount": 1}'
    head = ("POST http://api.example/v1/charges?x=1 HTTP/1.1\r\nHost: api.example\r\nIdempotency-Key: abs-1\r\n"
            f"Authorization: Bearer t1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    port = proxy.port
    first = await raw_exchange(port, head, body)
    again = await raw_exchange(port, head, body)
    assert first[0] == again[0] == 201
    assert (first[1]["Idempotent-Replayed"], again[1]["Idempotent-Replayed"]) == ("false", "true")
    assert [e.path_qs for e in upstream.executed] == ["/v1/charges?x=1"]


async def test_an_absolute_form_target_keeps_its_empty_query(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """The query reaches the upstream byte for byte, an empty one ("?" and nothing after it) too, as it does from an
    origin-form target; yarl's raw_path_qs dropped it from an absolute-form one ("http://api.example/things?" went
    as "/things", and was fingerprinted so)."""
    proxy = await make_proxy("embedded")
    for target in ("/things?", "http://api.example/things?", "http://api.example/things?#top"):
        status, _, _ = await raw_exchange(
            proxy.port, f"GET {target} HTTP/1.1\r\nHost: api.example\r\nConnection: close\r\n\r\n")
        assert status == 200
    assert [e.path_qs for e in upstream.executed] == ["/things?"] * 3


async def test_connect_is_refused_whatever_its_target(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """CONNECT asks for a tunnel (RFC 9110 §9.3.6) and its target is an authority (RFC 9112 §3.2.3). One with a
    path for a target was forwarded: aiohttp reads every byte after a CONNECT's head as the tunnel's, so its
    declared body was lost (the upstream got Content-Length: 0), and the upstream's answer reached the client
    without its body (a 2xx answer to CONNECT has none: the client takes it for a tunnel opened)."""
    proxy = await make_proxy("embedded")
    for target in ("/things", "api.example:443"):
        status, headers, body = await raw_exchange(
            proxy.port, f"CONNECT {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n", b"abc")
        assert status == 400 and headers["Connection"] == "close"
        assert json.loads(body)["code"] == "bad_request"
    assert upstream.executed == []


async def test_asterisk_target_is_a_problem_not_a_500(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy("embedded")
    port = proxy.port
    for target in ("*", "api.example:443"):  # asterisk-form, authority-form: no path to forward
        status, _, _ = await raw_exchange(port, f"OPTIONS {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert 400 <= status < 500
    status, _, _ = await raw_exchange(
        port, "POST * HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\r\nAuthorization: Bearer t1\r\n"
        "Content-Length: 0\r\nConnection: close\r\n\r\n")
    assert 400 <= status < 500
    assert upstream.executed == []


async def test_the_access_lines_are_what_docs_operating_says(
    make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/operating.md, Logs: the JSON line's fields are the ones it lists, and the text line is its example's
    shape. The text line was said to be "the same line for people", and the alert table sent operators to "the
    tenant in the access log", which the default text line does not hold: the doc says where the tenant is."""
    from pathlib import Path

    from idemproxy.engine import short_hash

    doc = (Path(__file__).resolve().parent.parent / "docs/operating.md").read_text()
    logs = doc.split("## Logs", 1)[1].split("\n## ", 1)[0]
    json_part, text_part = logs.split("The\ndefault text format", 1)
    fields = set(re.findall(r"`([a-z_]+)`", re.sub(r"\([^()]*\)", "", json_part.split(" with ", 1)[1])))
    example = re.search(r"`(POST [^`]*<request id>)`", text_part)
    assert example is not None, text_part
    shape = re.escape(example.group(1)).replace(re.escape("3.1"), r"\d+\.\d").replace(
        re.escape("<request id>"), "[0-9a-f]{32}")

    proxy = await make_proxy("embedded", log={"access": "INFO"})
    with caplog.at_level("INFO", logger="idemproxy.access"):
        resp, _ = await proxy.post("/v1/charges", key="log-1", body={"amount": 1})
    assert resp.status == 201
    [record] = [r for r in caplog.records if r.name == "idemproxy.access"]
    extras = {name for name in vars(record) if name not in vars(logging.makeLogRecord({}))} - {"message", "asctime"}
    assert fields == extras, (fields, extras)
    assert re.fullmatch(shape, record.getMessage()), (shape, record.getMessage())
    tenant = vars(record)["tenant"]
    assert tenant not in record.getMessage() and short_hash("log-1") not in record.getMessage()
    assert "in the JSON line\nonly" in text_part or "in the JSON line only" in text_part, text_part
