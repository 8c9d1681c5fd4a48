"""The proxy as a real process: bounded memory while streaming, draining and graceful shutdown, readiness,
CLI start-up."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from idemproxy.config import load_config
from idemproxy.logs import setup_logging
from tests.proxyproc import ProxyProcess, wait_ready
from tests.rawhttp import build_request, parse_response, send_raw
from tests.servers import free_port
from tests.upstream import RecordingUpstream, pattern_sha256

MiB = 1024 * 1024
SIZE = 100 * MiB
RSS_LIMIT = 100 * MiB

Factory = Callable[..., ProxyProcess]


def embedded(upstream: RecordingUpstream, tmp_path: Path) -> dict[str, object]:
    return {"upstream": {"url": upstream.url, "timeout": "20s"},
            "storage": {"embedded": {"path": str(tmp_path / "s.sqlite3")}},
            "log": {"access": "off"}}


async def test_100_mib_each_way_streams_with_bounded_memory(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    proxy = proxy_process(embedded(upstream, tmp_path))
    await proxy.start()
    block = bytes(range(256)) * 4096  # 1 MiB
    sent = hashlib.sha256()

    async def body() -> AsyncIterator[bytes]:
        for _ in range(SIZE // len(block)):
            sent.update(block)
            yield block

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # POST without an idempotency key: a plain streamed pass-through
        async with session.post(proxy.url + "/stream/upload", data=body()) as resp:
            assert resp.status == 200
            result = await resp.json()
        assert result == {"size": SIZE, "sha256": sent.hexdigest()}

        received = hashlib.sha256()
        size = 0
        async with session.get(proxy.url + f"/stream/download?size={SIZE}") as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_chunked(1 << 16):
                received.update(chunk)
                size += len(chunk)
        assert size == SIZE and received.hexdigest() == pattern_sha256(SIZE)

    peak = proxy.peak_rss_bytes()
    print(f"proxy peak RSS after 100 MiB each way: {peak / MiB:.1f} MiB")
    assert peak < RSS_LIMIT, f"peak RSS {peak / MiB:.1f} MiB"


async def test_clients_that_read_slowly_stop_reading_or_leave_mid_stream_under_uvloop(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """The real server (uvloop), where a client's progress is read from its socket: one reading slowly is served,
    one that stops reading is cut after upstream.timeout, and one that leaves while a write waits is a client
    gone, never an unhandled error."""
    proxy = proxy_process({**embedded(upstream, tmp_path), "upstream": {"url": upstream.url, "timeout": "1s"}})
    await proxy.start()
    port = int(proxy.url.rsplit(":", 1)[1])

    def download(pace: float, seconds: float) -> int:
        """Read 1 KiB every ``pace`` s (nothing, with 0) for ``seconds``, then leave; the bytes read."""
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /stream/download?size=200000000 HTTP/1.1\r\nHost: proxy\r\n\r\n")
            got, deadline = 0, time.monotonic() + seconds
            while pace and time.monotonic() < deadline:
                data = sock.recv(1024)
                assert data, f"cut after {got} bytes although it kept reading"
                got += len(data)
                time.sleep(pace)  # the client's own pace: a slow link
            time.sleep(max(deadline - time.monotonic(), 0))
            return got

    # Slowly, past upstream.timeout, then it leaves (while a write waits, now and then: the race the unit test in
    # test_proxy.py pins), and one that reads nothing at all: cut.
    assert await asyncio.to_thread(download, 0.05, 2.5) > 0
    await asyncio.to_thread(download, 0, 2.5)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while "client went away mid-response (TimeoutError)" not in proxy.log():
        assert loop.time() < deadline, proxy.log()
        await asyncio.sleep(0.05)
    log = proxy.log()
    assert "unhandled error" not in log and "Traceback" not in log, log


async def test_sigterm_lets_in_flight_requests_finish(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    proxy = proxy_process(embedded(upstream, tmp_path))
    await proxy.start()
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(session.post(
            proxy.url + "/pay", data=b"{}",
            headers={"Idempotency-Key": "k1", "Authorization": "t", "X-Test-Delay": "1"},
        ))
        while upstream.count(key="k1") == 0:  # the upstream is executing it now
            await asyncio.sleep(0.01)
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGTERM)
        resp = await request
        assert resp.status == 201
        assert resp.headers["Idempotent-Replayed"] == "false"
        resp.release()
    assert await asyncio.to_thread(proxy.proc.wait, 20) == 0


async def get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json()


def pay(session: aiohttp.ClientSession, proxy: ProxyProcess, key: str, delay: float = 0) -> Any:
    headers = {"Idempotency-Key": key, "Authorization": "t"}
    if delay:
        headers["X-Test-Delay"] = str(delay)
    return session.post(proxy.url + "/pay", data=b"{}", headers=headers)


async def test_sigterm_drains_then_stops_accepting_then_exits_0(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    drain = 1.5
    proxy = proxy_process({**embedded(upstream, tmp_path), "drain_delay": f"{drain}s", "shutdown_timeout": "20s"})
    await proxy.start()
    assert proxy.proc is not None
    loop = asyncio.get_running_loop()
    fresh = aiohttp.TCPConnector(force_close=True)  # a new connection for every request
    async with aiohttp.ClientSession() as session, aiohttp.ClientSession(connector=fresh) as other:
        slow = asyncio.ensure_future(pay(session, proxy, "slow", delay=drain + 2.5))
        while upstream.count(key="slow") == 0:  # the upstream is executing it now
            await asyncio.sleep(0.01)
        proxy.proc.send_signal(signal.SIGTERM)
        signalled = loop.time()
        status, body = await get_json(other, proxy.admin_url + "/readyz")
        while status == 200 and loop.time() - signalled < 1:  # the signal is handled within moments
            await asyncio.sleep(0.02)
            status, body = await get_json(other, proxy.admin_url + "/readyz")
        assert (status, body["status"]) == (503, "draining")
        async with pay(other, proxy, "during") as resp:  # load balancers still send some: served
            assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
        assert loop.time() - signalled < drain
        assert (await get_json(other, proxy.admin_url + "/healthz"))[0] == 200

        await asyncio.sleep(drain + 0.7 - (loop.time() - signalled))
        assert not slow.done()  # still running upstream, and now the port is closed to new connections
        try:
            async with pay(other, proxy, "after") as late:
                raise AssertionError(f"accepted after the drain delay: {late.status}")
        except aiohttp.ClientConnectionError:
            pass
        resp = await slow
        assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
        resp.release()
    assert await asyncio.to_thread(proxy.proc.wait, 20) == 0
    assert upstream.count(key="after") == 0 and upstream.count(key="slow") == 1
    assert "draining: /readyz is 503" in proxy.log()


async def test_an_idle_keep_alive_connection_is_closed_when_the_drain_ends(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """Once the port stops accepting, a connection with no request in progress is closed at once. It was left
    open, unread, until the last request in flight ended: a request sent on it meanwhile got no answer and no
    close for up to shutdown_timeout (an unknown outcome, for all the client could tell)."""
    drain = 1.0
    proxy = proxy_process({**embedded(upstream, tmp_path), "drain_delay": f"{drain}s", "shutdown_timeout": "20s"})
    await proxy.start()
    assert proxy.proc is not None
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(b"GET /plain HTTP/1.1\r\nHost: a\r\n\r\n")  # served; the connection stays open, idle
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length" in head
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        async with aiohttp.ClientSession() as session:
            slow = asyncio.ensure_future(pay(session, proxy, "slow", delay=drain + 6))
            while upstream.count(key="slow") == 0:
                await asyncio.sleep(0.01)
            proxy.proc.send_signal(signal.SIGTERM)
            signalled = loop.time()
            await asyncio.sleep(drain + 0.5)  # past the drain delay: the port no longer accepts
            writer.write(b"GET /late HTTP/1.1\r\nHost: a\r\n\r\n")
            late = await asyncio.wait_for(reader.read(), 5)
            assert late == b"" and loop.time() - signalled < drain + 3 and not slow.done()
            resp = await slow
            assert resp.status == 201
            resp.release()
    finally:
        writer.close()
    assert await asyncio.to_thread(proxy.proc.wait, 20) == 0
    assert not any(e.path_qs == "/late" for e in upstream.executed)


async def test_shutdown_timeout_bounds_the_whole_shutdown(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """Requests that outlive shutdown_timeout (the upstream never answers) are cut at it: the process exits 0
    within shutdown_timeout once the drain delay is over, not after two or three of them (aiohttp's runner waits
    the timeout twice per connection, and the forwards' drain a third time)."""
    timeout = 2.0
    proxy = proxy_process({**embedded(upstream, tmp_path), "drain_delay": "0s", "shutdown_timeout": f"{timeout}s"})
    await proxy.start()
    assert proxy.proc is not None
    loop = asyncio.get_running_loop()
    # And an answer whose client does not read it (answered: its rest is cut, and the warning says which is which).
    unread = socket.socket()
    unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    unread.connect(("127.0.0.1", proxy.port))
    unread.sendall(b"GET /big HTTP/1.1\r\nHost: a\r\nX-Test-Size: 6000000\r\n\r\n")
    ends = f"0100007F:{proxy.port:04X} 0100007F:{unread.getsockname()[1]:04X}"
    while not any(" ".join(fields[1:3]) == ends and int(fields[4].split(":")[0], 16) > 0
                  for fields in map(str.split, Path("/proc/net/tcp").read_text().splitlines()[1:])):
        await asyncio.sleep(0.01)  # (until the proxy's side of it holds bytes the client has not taken)
    async with aiohttp.ClientSession() as session:
        hang = {"X-Test-Hang": "1", "Authorization": "t"}
        covered = asyncio.ensure_future(session.post(
            proxy.url + "/pay", data=b"{}", headers={**hang, "Idempotency-Key": "stuck"}))
        plain = asyncio.ensure_future(session.get(proxy.url + "/plain", headers=hang))
        while len(upstream.executed) < 3:  # both are at the upstream, which will not answer (and /big)
            await asyncio.sleep(0.01)
        proxy.proc.send_signal(signal.SIGTERM)
        signalled = loop.time()
        code = await asyncio.to_thread(proxy.proc.wait, 30)
        took = loop.time() - signalled
        for request in (covered, plain):
            try:
                (await request).release()
                raise AssertionError("a request cut at shutdown_timeout was answered")
            except aiohttp.ClientConnectionError:
                pass  # its connection closed unanswered
    unread.close()
    assert code == 0
    assert timeout <= took < timeout + 1.5, took
    assert ("shutdown_timeout (2s) reached with 2 request(s) still in progress and 1 answer(s) still being sent "
            "to clients not reading them") in proxy.log()


async def test_an_answer_still_being_written_at_shutdown_is_written_whole(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """A whole answer is written after the handler returned; to a slow reader that takes a while. Shutdown waits
    for the connection, not only the handler, so the reader gets every byte (within shutdown_timeout)."""
    size = 8 * MiB
    proxy = proxy_process({
        **embedded(upstream, tmp_path), "drain_delay": "0s", "shutdown_timeout": "20s",
        "idempotency": {"max_stored_response": "9MiB"},
        "storage": {"embedded": {"path": str(tmp_path / "s.sqlite3")}, "pending_settles": {"max_bytes": "64MiB"}},
    })
    await proxy.start()
    assert proxy.proc is not None
    request = build_request(b"POST", b"/pay", [(b"Idempotency-Key", b"big"), (b"Authorization", b"t"),
                                             (b"X-Test-Size", str(size).encode())], b"{}")
    host, port = proxy.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader: a small window
    sock.connect((host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")  # answered: the handler is done, the body is being written
    assert head.startswith(b"HTTP/1.1 201")
    proxy.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(1.5)  # read nothing for a while: the proxy is shutting down meanwhile
    body = await reader.read()
    writer.close()
    assert len(body) == size
    assert await asyncio.to_thread(proxy.proc.wait, 20) == 0


async def test_a_second_signal_exits_at_once(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    proxy = proxy_process({**embedded(upstream, tmp_path), "drain_delay": "60s"})
    await proxy.start()
    assert proxy.proc is not None
    proxy.proc.send_signal(signal.SIGTERM)
    async with aiohttp.ClientSession() as session:
        while (await get_json(session, proxy.admin_url + "/readyz"))[0] == 200:
            await asyncio.sleep(0.02)
    proxy.proc.send_signal(signal.SIGINT)
    code = await asyncio.to_thread(proxy.proc.wait, 10)  # long before the 60 s drain delay
    assert code == 128 + signal.SIGINT
    assert "SIGINT again: exiting at once" in proxy.log()


@pytest.mark.parametrize("requires_store", [False, True], ids=["default", "ready_requires_store"])
async def test_readyz_is_503_while_starting(proxy_process: Factory, requires_store: bool) -> None:
    """503 "starting", naming the store it waits for, while the attempts at start go on; then, PostgreSQL still
    unreachable, ready with it named unavailable (a store outage does not take the replica out of service), or
    503 with ``admin.ready_requires_store``. The process keeps serving either way."""
    dsn = f"postgresql://idem@127.0.0.1:{free_port()}/idem"  # nobody listens: start-up keeps retrying
    proxy = proxy_process({"upstream": {"url": "http://127.0.0.1:1"}, "storage": {"postgres": {"dsn": dsn}},
                           "admin": {"ready_requires_store": requires_store}})
    await proxy.start(wait=False)
    assert proxy.proc is not None
    after = ((503, "store_unavailable", '{"postgres": "unavailable"}') if requires_store
             else (200, "ready", '{"postgres": "unavailable"}'))
    seen: set[tuple[int, str, str]] = set()
    deadline = asyncio.get_running_loop().time() + 30
    async with aiohttp.ClientSession() as session:
        while proxy.proc.poll() is None and after not in seen and asyncio.get_running_loop().time() < deadline:
            try:
                status, body = await get_json(session, proxy.admin_url + "/readyz")
                healthz, _ = await get_json(session, proxy.admin_url + "/healthz")
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
                continue
            seen.add((status, body["status"], json.dumps(body["stores"])))
            assert healthz == 200
            async with session.get(proxy.admin_url + "/metrics") as resp:  # the gauge says what /readyz says
                assert 'idemproxy_store_up{backend="postgres"} 0.0' in await resp.text()
            await asyncio.sleep(0.05)
    # (between the attempts' end and the port's listening, "starting" may name it unavailable already)
    assert {(503, "starting", '{"postgres": "opening"}'), after} <= seen <= {
        (503, "starting", '{"postgres": "opening"}'), (503, "starting", '{"postgres": "unavailable"}'), after,
    }, (seen, proxy.log())
    assert proxy.proc.poll() is None, proxy.log()
    # serve's admin port answers what its parser refuses as the proxy port does (tests/test_admin.py has more)
    refused = await send_raw(proxy.admin_url, b"GET /healthz HTTP/1.1\r\nHost: a\r\nX-A: b\x01\r\n\r\n")
    assert refused.status == 400 and "server" not in refused.headers
    assert refused.headers["content-type"] == "application/problem+json"


async def test_serve_with_only_an_upstream_flag_runs_on_the_embedded_store(
    upstream: RecordingUpstream, tmp_path: Path
) -> None:
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "idemproxy", "serve", "--upstream", upstream.url, "--port", str(port),
         "--admin-port", str(admin)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        await wait_ready(f"http://127.0.0.1:{admin}", proc)
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/charges"
            # the defaults, as with a file that sets nothing: the tenant is the Authorization header, required
            async with session.post(url, json={"a": 1}, headers={"Idempotency-Key": "first-try"}) as resp:
                assert resp.status == 401 and (await resp.json())["code"] == "missing_tenant"
            for _ in range(2):
                async with session.post(url, json={"a": 1}, headers={"Idempotency-Key": "first-try",
                                                                     "Authorization": "Bearer sk_a"}) as resp:
                    assert resp.status == 201
                    replayed = resp.headers["Idempotent-Replayed"]
            async with session.post(url, json={"a": 1}, headers={"Idempotency-Key": "first-try",
                                                                 "Authorization": "Bearer sk_b"}) as resp:
                assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"  # another tenant
        assert replayed == "true" and upstream.count(key="first-try") == 2
    finally:
        proc.terminate()
        output = proc.communicate(timeout=20)[0].decode()
    assert "single-instance only" in output
    assert (tmp_path / "idemproxy.sqlite3").exists()


def test_asyncpgs_pool_warning_is_one_line_without_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """While PostgreSQL is away, asyncpg's pool logs "Failed to restore the pool connection floor" with a whole
    traceback each time; the proxy's own lines already say the store is down."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging(load_config({"upstream": {"url": "http://127.0.0.1:1"}}).log)
        try:
            raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")
        except ConnectionRefusedError:
            logging.getLogger("asyncpg.pool").warning("Failed to restore the pool connection floor; %s", "retrying",
                                                      exc_info=True)
        logging.getLogger("idemproxy.test").warning("ours keep theirs", exc_info=ValueError("kept"))
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    err = capsys.readouterr().err
    pool_line, *rest = err.splitlines()
    assert pool_line.endswith("WARNING asyncpg.pool: Failed to restore the pool connection floor; retrying "
                              "(ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 5432))")
    assert rest[-1] == "ValueError: kept"  # other loggers keep their exception text


# ---------------------------------------------------------------------------------------- slow and idle clients


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer with a Content-Length off a kept-alive connection: its head and its body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, await reader.readexactly(length)


async def test_an_idle_keep_alive_connection_is_closed_after_listen_keepalive_timeout(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """aiohttp's keep-alive timeout (3,630 s) was the only bound on an idle connection, and could not be set: a
    proxy facing clients directly held each one that went quiet (or vanished without a FIN) for an hour.
    ``listen.keepalive_timeout`` sets it; it counts idle time, not the connection's age."""
    proxy = proxy_process({**embedded(upstream, tmp_path), "listen": {"keepalive_timeout": "500ms"}})
    await proxy.start()
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        started = loop.time()
        for n in range(6):  # a request every 0.2 s for over 1 s: never idle for 0.5 s, never closed
            if n:
                await asyncio.sleep(0.2)  # (the pace of a client, not a wait for the proxy)
            writer.write(b"GET /kept/%d HTTP/1.1\r\nHost: a\r\n\r\n" % n)
            head, _ = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200"), head
        idle = loop.time()
        assert idle - started > 1.0
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # then idle: closed, without a word
        assert loop.time() - idle >= 0.45
    finally:
        writer.close()
    assert [e.path_qs for e in upstream.executed] == [f"/kept/{n}" for n in range(6)]


async def trickle_until_answered(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes, every: float
) -> tuple[bytes, float]:
    """Send ``data`` a byte every ``every`` seconds (a client's pace) until the proxy answers or closes; returns
    what it sent back (up to the close) and when its first byte came, on the loop's clock."""
    loop = asyncio.get_running_loop()
    first = asyncio.ensure_future(reader.read(1))
    for byte in data:
        done, _ = await asyncio.wait({first}, timeout=every)
        if done:
            break
        writer.write(bytes([byte]))
    async with asyncio.timeout(10):
        head = await first
        came = loop.time()
        return head + await reader.read(), came


async def test_a_request_head_that_does_not_come_whole_within_listen_header_timeout_gets_408(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """Nothing bounded the time a client took to send a request head: one trickling a byte every few seconds
    held its connection until aiohttp's keep-alive timeout, 3,630 s after the accept (slowloris), and a connection
    that sent nothing at all as long. A head now comes whole within listen.header_timeout of its first byte (a new
    connection's first head: of its accept), or is answered 408 problem+json and the connection closed, counted
    as the requests refused as malformed are; a connection that sent nothing is closed without a word."""
    timeout = 0.5
    proxy = proxy_process({**embedded(upstream, tmp_path), "log": {"access": "info"},
                           "listen": {"header_timeout": f"{timeout}s", "keepalive_timeout": "30s"}})
    await proxy.start()
    loop = asyncio.get_running_loop()
    head = b"POST /v1/charges HTTP/1.1\r\nHost: a\r\nIdempotency-Key: slow\r\nX-Pad: " + b"p" * 100

    # a new connection trickling its first head
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    opened = loop.time()
    answer, came = await trickle_until_answered(reader, writer, head, 0.05)
    writer.close()
    assert timeout <= came - opened < timeout + 5
    refused = parse_response(answer)
    assert refused.status == 408 and refused.headers["content-type"] == "application/problem+json"
    assert json.loads(refused.body)["code"] == "request_timeout" and refused.headers["x-request-id"]
    # (and closed: trickle_until_answered read up to the close; the answer is HTTP/1.0, as aiohttp's own refusals of
    # a head are, which closes by itself)

    # a kept-alive connection: its next head is held to the same bound from its first byte, not keepalive_timeout
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"GET /first HTTP/1.1\r\nHost: a\r\n\r\n")
    first, _ = await read_answer(reader)
    assert first.startswith(b"HTTP/1.1 200")
    await asyncio.sleep(2 * timeout)  # idle for longer than header_timeout first: idle is keepalive_timeout's
    began = loop.time()
    answer, came = await trickle_until_answered(reader, writer, head, 0.05)
    writer.close()
    assert timeout <= came - began < timeout + 5 and parse_response(answer).status == 408

    # a head sent in pieces that comes whole in time is served
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    for piece in (b"GET /pieces HTTP/1.1\r\n", b"Host: a\r\n", b"\r\n"):
        writer.write(piece)
        await asyncio.sleep(timeout / 5)
    served, _ = await read_answer(reader)
    writer.close()
    assert served.startswith(b"HTTP/1.1 200")

    # a connection that sends nothing is closed, unanswered
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    opened = loop.time()
    async with asyncio.timeout(10):
        assert await reader.read() == b""
    writer.close()
    assert loop.time() - opened >= timeout

    assert [e.path_qs for e in upstream.executed] == ["/first", "/pieces"]
    async with aiohttp.ClientSession() as session, session.get(proxy.admin_url + "/metrics") as resp:
        metrics = await resp.text()
    assert ('idemproxy_requests_total{method="UNKNOWN",outcome="invalid_key",route="other"} 2.0' in metrics), metrics
    assert proxy.log().count("UNKNOWN / 408 invalid_key") == 2


class RawUpstream:
    """An upstream on a real socket that answers 200 once a request came whole, and notes each connection's peer
    port and how it ended: ``cut`` when it closed before the request on it came whole."""

    def __init__(self) -> None:
        self.served: list[tuple[int, str]] = []  # (peer port, request line)
        self.cut: list[int] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[1]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if b"content-length:" in head.lower():
                    await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
                else:  # chunked
                    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                        await reader.readexactly(size + 2)
                    await reader.readuntil(b"\r\n")
                self.served.append((peer, head.split(b"\r\n", 1)[0].decode()))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.cut.append(peer)
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def test_a_pass_through_upload_that_stalls_gets_408_and_frees_its_upstream_connection(
    proxy_process: Factory, tmp_path: Path
) -> None:
    """A pass-through upload that stalled held its upstream connection (a slot of upstream.max_connections) until
    the upstream's own silence ran out, twice over (measured: 60 s with the default 30 s timeout, then 504
    upstream_timeout, blaming the upstream), and one trickling a byte every few seconds held it for good; a body
    read whole before the forward (up to 64 KiB) that stalled had no bound at all. Once no byte came for
    listen.body_timeout the client gets 408 request_timeout (counted as body_too_large), and a streamed upload's
    upstream connection is cut, never reused: the slot is free for the next request at once."""
    upstream = RawUpstream()
    url = await upstream.start()
    try:
        proxy = proxy_process({"upstream": {"url": url, "timeout": "5s", "max_connections": 1},
                               "storage": {"embedded": {"path": str(tmp_path / "s.sqlite3")}},
                               "log": {"access": "info"}, "listen": {"body_timeout": "400ms"}})
        await proxy.start()
        loop = asyncio.get_running_loop()
        stalls = {
            "streamed": b"POST /upload HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n",
            "read whole": b"POST /small HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n" + b"x" * 10,
        }
        for name, request in stalls.items():
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(request)  # then nothing more, still connected
            sent = loop.time()
            async with asyncio.timeout(10):
                answer = parse_response(await reader.read())  # answered, and closed after it
            writer.close()
            assert loop.time() - sent >= 0.4, name
            assert answer.status == 408 and json.loads(answer.body)["code"] == "request_timeout", (name, answer)
        assert upstream.served == [] and len(upstream.cut) == 1  # the streamed upload's connection, cut mid-body

        # the one upstream slot is free, and the cut connection is not reused
        async with aiohttp.ClientSession() as session:
            async with session.post(proxy.url + "/after", data=b"whole", timeout=aiohttp.ClientTimeout(3)) as resp:
                assert resp.status == 200 and await resp.read() == b"ok"
            async with session.get(proxy.admin_url + "/metrics") as resp:
                metrics = await resp.text()
        assert [line for _, line in upstream.served] == ["POST /after HTTP/1.1"]
        assert upstream.served[0][0] != upstream.cut[0]
        assert 'idemproxy_requests_total{method="POST",outcome="body_too_large",route="other"} 2.0' in metrics
    finally:
        upstream.close()


async def test_a_body_still_coming_at_shutdown_is_read_whole_and_its_request_served(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """At shutdown the requests in progress get shutdown_timeout to finish, but aiohttp's pre_shutdown closes every
    connection first, after which it drops whatever a connection still sends: the rest of a body being uploaded
    too. Such a request hung until shutdown_timeout cut it; with listen.body_timeout it got 408 request_timeout,
    "no byte of the request body came", for a client that was sending. The body of the request in progress is
    now read to its end, and the request served; nothing after it is (the connection closes after the answer)."""
    proxy = proxy_process({**embedded(upstream, tmp_path), "drain_delay": "0s", "shutdown_timeout": "10s",
                           "listen": {"body_timeout": "1s"}})
    await proxy.start()
    assert proxy.proc is not None
    covered = (b"POST /pay HTTP/1.1\r\nHost: a\r\nAuthorization: t\r\nIdempotency-Key: drained\r\n"
               b"Content-Length: 20\r\nExpect: 100-continue\r\n\r\n")
    streamed = (b"POST /stream/upload HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
                b"Expect: 100-continue\r\n\r\n")
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    connections = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(2)]
    try:
        idle_writer.write(b"GET /plain HTTP/1.1\r\nHost: a\r\n\r\n")
        await read_answer(idle_reader)  # served; the connection stays open, idle
        for (reader, writer), head, half in zip(connections, (covered, streamed),
                                                (b"x" * 10, b"4000\r\n" + b"s" * 0x4000 + b"\r\n"), strict=True):
            writer.write(head)
            async with asyncio.timeout(10):
                assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"  # being read
            writer.write(half)
            await writer.drain()
        proxy.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):  # closed by the shutdown's first step: every connection is closing now
            assert await idle_reader.read() == b""
        for (_, writer), rest in zip(connections, (b"y" * 10, b"4000\r\n" + b"t" * 0x4000 + b"\r\n0\r\n\r\n"),
                                     strict=True):
            writer.write(rest)
        answers = []
        for reader, _ in connections:
            async with asyncio.timeout(10):
                answers.append(parse_response(await reader.read()))  # answered, then closed
    finally:
        idle_writer.close()
        for _, writer in connections:
            writer.close()
    assert [answer.status for answer in answers] == [201, 200], answers
    assert json.loads(answers[1].body)["size"] == 2 * 0x4000
    assert [e.body for e in upstream.executed if e.path_qs == "/pay"] == [b"x" * 10 + b"y" * 10]
    assert await asyncio.to_thread(proxy.proc.wait, 20) == 0


async def test_a_head_begun_after_an_answer_is_held_to_listen_header_timeout_not_keepalive_timeout(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """On a kept-alive connection the look at its pace took every byte that came before it first saw the wait for
    the next head as the answered request's, and counted the wait as idle: part of a head sent while the request
    before it was served (pipelined), or right after its answer and before that look (up to a tenth of the
    timeout: 6 s by default), then nothing more, was held for listen.keepalive_timeout (an hour by default), not
    header_timeout. An idle connection costs 9 KiB; such a head, up to 128 header lines of 16 KiB, held the
    parser's copy of it (measured: 100 connections, 53 -> 364 MiB resident, all still open long past
    header_timeout). Bytes that come once the last request's body came whole are now a head's, from its first."""
    timeout = 0.5
    proxy = proxy_process({**embedded(upstream, tmp_path), "log": {"access": "info"},
                           "listen": {"header_timeout": f"{timeout}s", "keepalive_timeout": "30s"}})
    await proxy.start()
    loop = asyncio.get_running_loop()
    partial = b"GET /never HTTP/1.1\r\nHost: a\r\n" + b"".join(b"X-Pad-%d: %s\r\n" % (n, b"p" * 8000)
                                                                 for n in range(8))

    # sent while the request before it is served, then nothing more
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"GET /first HTTP/1.1\r\nHost: a\r\nX-Test-Delay: 0.5\r\n\r\n")
    await writer.drain()
    while upstream.count(path="/first") == 0:  # being served: what comes now is the next request's
        await asyncio.sleep(0.01)
    writer.write(partial)
    first, _ = await read_answer(reader)
    answered = loop.time()
    async with asyncio.timeout(10):
        refused = parse_response(await reader.read())  # answered 408, and closed
    writer.close()
    assert first.startswith(b"HTTP/1.1 200") and refused.status == 408, refused
    assert timeout <= loop.time() - answered < timeout + 5

    # sent right after the answer, then nothing more
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"GET /second HTTP/1.1\r\nHost: a\r\n\r\n")
    second, _ = await read_answer(reader)
    writer.write(partial)
    answered = loop.time()
    async with asyncio.timeout(10):
        refused = parse_response(await reader.read())
    writer.close()
    assert second.startswith(b"HTTP/1.1 200") and refused.status == 408, refused
    assert timeout <= loop.time() - answered < timeout + 5

    # a body that came in many reads is not taken for a head: the connection then idles past header_timeout, and
    # its next request is served
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 400000\r\n\r\n")
    for _ in range(8):
        writer.write(b"u" * 50_000)
        await writer.drain()
        await asyncio.sleep(timeout / 10)
    uploaded, _ = await read_answer(reader)
    await asyncio.sleep(3 * timeout)
    writer.write(b"GET /after HTTP/1.1\r\nHost: a\r\n\r\n")
    after, _ = await read_answer(reader)
    writer.close()
    assert uploaded.startswith(b"HTTP/1.1 201") and after.startswith(b"HTTP/1.1 200"), (uploaded, after)
    assert [e.path_qs for e in upstream.executed] == ["/first", "/second", "/upload", "/after"]


async def test_a_pass_through_upload_the_upstream_answered_is_not_cut_when_its_body_stalls(
    proxy_process: Factory, tmp_path: Path
) -> None:
    """An upstream may answer an upload before its body came whole (an early refusal, an answer streamed as the
    body comes), and a client may stop sending then (curl does once an error answer came). listen.body_timeout
    still failed the body's stream, which cut the upstream's connection mid-answer: the client got the answer
    truncated, the log blamed the upstream ("upstream body broke mid-stream") and said 408 was answered when 200
    had gone out. Once the upstream answered, the rest of the upload is not waited for: the answer is relayed
    whole, as before listen.body_timeout."""
    async def answer_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")  # the head only: the body is not read
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for n in range(8):
                writer.write(b"6\r\npart-%d\r\n" % n)
                await writer.drain()
                await asyncio.sleep(0.2)  # (the upstream's pace: 1.6 s in all, four times body_timeout)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer_at_once, "127.0.0.1", 0)
    try:
        proxy = proxy_process({"upstream": {"url": f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"},
                               "storage": {"embedded": {"path": str(tmp_path / "s.sqlite3")}},
                               "log": {"access": "info"}, "listen": {"body_timeout": "400ms"}})
        await proxy.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            writer.write(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 200000\r\n\r\n" + b"u" * 1000)
            await writer.drain()  # then nothing more, still connected
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.readuntil(b"\r\n0\r\n\r\n")
        finally:
            writer.close()
    finally:
        server.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    assert parse_response(head + body).body == b"".join(b"part-%d" % n for n in range(8))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while "POST /upload 200 passthrough" not in proxy.log():  # (the access line follows the answer's end)
        assert loop.time() < deadline, proxy.log()
        await asyncio.sleep(0.05)
    log = proxy.log()
    assert "answering 408" not in log and "broke mid-stream" not in log, log


SEND_CUT = "the client took no byte of its answer for listen.send_timeout (0.5s)"


def assert_cut_for_not_reading(proxy: ProxyProcess, times: int) -> None:
    """The proxy logged ``times`` cuts by ``listen.send_timeout`` (0.5 s here), and no traceback."""
    log = proxy.log()
    assert log.count(SEND_CUT) == times, log
    assert "Traceback" not in log, log


async def test_an_answer_the_client_takes_no_byte_of_is_cut_after_listen_send_timeout(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """aiohttp's write waits without a bound for a client that does not read: an answer the proxy writes whole (a
    first request's, a replay) held its bytes for as long as the client kept its connection (measured: 50 clients
    asking for a 6 MB replay and reading none of it took the proxy from 72 to 645 MiB, held for good).
    ``listen.send_timeout`` cuts a connection whose client took no byte of its answer for that long; a slow reader
    that keeps reading is never cut; an answer is stored before it is sent, so a cut first request's retry is a
    replay, not a second execution."""
    size = 6_000_000  # more than loopback's kernel buffers take in (about 3 MB): the rest waits in the proxy
    proxy = proxy_process({**embedded(upstream, tmp_path), "listen": {"send_timeout": "500ms"},
                           "idempotency": {"max_stored_response": "8MiB"}})
    await proxy.start()

    def pay(key: str, *, stall: float = 0.0, pause: float = 0.0) -> tuple[bytes, int, bool]:
        """POST with ``key`` asking for ``size`` bytes; read nothing for ``stall`` s, then read it all, pausing
        ``pause`` s after each MiB (a slow link). Returns the head, the body bytes read, and whether the connection
        was cut before the whole answer came."""
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # (no autotuning: the client's pace shows)
            sock.connect(("127.0.0.1", proxy.port))
            sock.sendall(build_request(b"POST", b"/pay", [(b"Idempotency-Key", key.encode()), (b"Authorization", b"t"),
                                                          (b"X-Test-Size", b"%d" % size)], b"{}"))
            time.sleep(stall)  # (the client's own pace: it does not read)
            received, paused_at = bytearray(), 0
            sock.settimeout(10)
            try:
                while b"\r\n\r\n" not in received or len(received) - received.index(b"\r\n\r\n") - 4 < size:
                    data = sock.recv(65536)
                    if not data:
                        break
                    received += data
                    if pause and len(received) >= paused_at + MiB:
                        paused_at = len(received)
                        time.sleep(pause)
            except ConnectionResetError:
                pass
            head, _, body = bytes(received).partition(b"\r\n\r\n")
            return head, len(body), len(body) < size

    # A first request whose client reads nothing: cut; its answer was stored, so its retry is a replay (executed
    # once), and a replay nobody reads is cut too.
    head, _, cut = await asyncio.to_thread(pay, "k1", stall=2.0)
    assert cut and head.startswith(b"HTTP/1.1 201"), head
    head, _, cut = await asyncio.to_thread(pay, "k1", stall=2.0)
    assert cut and b"Idempotent-Replayed: true" in head, head
    # A slow reader that keeps reading, pausing 0.3 s after each MiB (for longer than listen.send_timeout in all):
    # served whole, a first request and a replay.
    loop = asyncio.get_running_loop()
    started = loop.time()
    head, got, cut = await asyncio.to_thread(pay, "k2", pause=0.3)
    assert not cut and got == size and b"Idempotent-Replayed: false" in head, head
    head, got, cut = await asyncio.to_thread(pay, "k1", pause=0.3)
    assert not cut and got == size and b"Idempotent-Replayed: true" in head, head
    assert loop.time() - started > 2 * 0.5
    assert upstream.count(key="k1") == 1 and upstream.count(key="k2") == 1

    def download(pace: float, seconds: float) -> bool:
        """A streamed answer (upstream.timeout 20 s): read 64 KiB (the size the proxy writes it in) every ``pace``
        s, nothing with 0, for ``seconds``; whether the proxy cut the connection meanwhile."""
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.connect(("127.0.0.1", proxy.port))
            sock.sendall(b"GET /stream/download?size=2000000000 HTTP/1.1\r\nHost: proxy\r\n\r\n")
            sock.settimeout(5)
            try:
                if not pace:
                    time.sleep(seconds)  # (the client's own pace: it reads nothing)
                    # then it reads on: a cut connection is reset (its first bytes may come first)
                    return any(not sock.recv(65536) for _ in range(1000))
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    if not sock.recv(65536):
                        return True
                    time.sleep(pace)  # (the client's own pace: a slow link)
            except ConnectionResetError:
                return True
            return False

    # A streamed answer read steadily (what waits for the client may stay the same size from look to look: the
    # proxy writes on as it reads) is not cut; one nobody reads is, at send_timeout, not at upstream.timeout.
    assert not await asyncio.to_thread(download, 0.1, 2.0)
    assert await asyncio.to_thread(download, 0, 2.0)
    assert_cut_for_not_reading(proxy, times=3)


async def test_an_answer_whose_rest_waits_below_the_write_buffer_limit_is_cut_too(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """An answer a little larger than what the kernel takes in for a client that reads nothing leaves its last
    bytes in the proxy's buffer, below the mark at which writes pause: the answer counts as written, and the
    connection was never looked at by ``listen.send_timeout``. Measured: an answer 40 KB larger than the kernel's
    share was held for good, with its fd and the kernel's 2.8 MB: closing after it (Connection: close) waits for the
    client to take the bytes, and ``listen.keepalive_timeout`` closes the same way (not even its socket freed)."""
    proxy = proxy_process({**embedded(upstream, tmp_path), "listen": {"send_timeout": "500ms",
                                                                      "keepalive_timeout": "300ms"},
                           "idempotency": {"max_stored_response": "8MiB"}})
    await proxy.start()

    def ask(key: str, size: int, *, close: bool) -> int:
        """POST asking for ``size`` bytes; read nothing for 2 s (4 times listen.send_timeout), then all that
        comes; the body's bytes read."""
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", proxy.port))
            headers = [(b"Idempotency-Key", key.encode()), (b"Authorization", b"t"), (b"X-Test-Size", b"%d" % size)]
            request = build_request(b"POST", b"/pay", headers, b"{}")
            sock.sendall(request if close else request.replace(b"Connection: close\r\n", b""))
            time.sleep(2)  # (the client's own pace: it does not read)
            received, body = bytearray(), 0
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                while body < size:
                    data = sock.recv(65536)
                    if not data:
                        break
                    received += data
                    body = len(received) - received.find(b"\r\n\r\n") - 4 if b"\r\n\r\n" in received else 0
            return body

    def kernel_share() -> int:
        """What the kernel takes in on the proxy's side of a connection whose client reads nothing (loopback:
        2.8 MB): the most its send queue held (/proc/net/tcp) while a 6 MB answer waited, until it was cut."""
        most = 0
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", proxy.port))
            ends = f"0100007F:{proxy.port:04X} 0100007F:{sock.getsockname()[1]:04X}"
            sock.sendall(build_request(b"POST", b"/pay", [(b"Idempotency-Key", b"probe"), (b"Authorization", b"t"),
                                                          (b"X-Test-Size", b"6000000")], b"{}"))
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                for line in Path("/proc/net/tcp").read_text().splitlines():
                    fields = line.split()
                    if " ".join(fields[1:3]) == ends:
                        most = max(most, int(fields[4].split(":")[0], 16))
                time.sleep(0.01)  # (a look every 10 ms)
        return most

    kernel = await asyncio.to_thread(kernel_share)
    assert 0 < kernel < 6_000_000
    # An answer 32 KiB larger (half the buffer's limit, the client's few KiB aside): cut too, whether the
    # connection was to close after it or kept alive (and closed as idle by listen.keepalive_timeout meanwhile).
    for key, close in (("closing", True), ("kept", False)):
        size = kernel + 32 * 1024
        body = await asyncio.to_thread(ask, key, size, close=close)
        assert body < size, key
    assert_cut_for_not_reading(proxy, times=3)


async def test_a_connection_cut_for_not_reading_is_reset_its_queue_dropped(
    upstream: RecordingUpstream, proxy_process: Factory, tmp_path: Path
) -> None:
    """A cut connection (``listen.send_timeout``, or ``upstream.timeout`` for a streamed answer) was closed with the
    kernel's queue still in it: the kernel sent it, then a FIN, as the client read, holding it meanwhile (the
    proxy's socket an orphan in FIN-WAIT-1 with 2.8 MB queued on loopback, for as long as the client kept its end:
    measured 240 s; 50 such clients: 187 MiB of the kernel's TCP memory). It is reset: the queue dropped at once,
    and the client told."""
    by_send = proxy_process({**embedded(upstream, tmp_path), "listen": {"send_timeout": "500ms"},
                             "idempotency": {"max_stored_response": "8MiB"}}, name="send")
    by_upstream = proxy_process({**embedded(upstream, tmp_path), "upstream": {"url": upstream.url, "timeout": "500ms"},
                                 "storage": {"embedded": {"path": str(tmp_path / "up.sqlite3")}}}, name="up")
    await by_send.start()
    await by_upstream.start()

    def cut(port: int, request: bytes) -> tuple[list[str], int, bool]:
        """An answer nobody reads for 1.5 s: the proxy's side of its connection then (/proc/net/tcp: state and
        send queue), and what the client gets when it reads on (bytes, whether it was reset)."""
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            ends = f"0100007F:{port:04X} 0100007F:{sock.getsockname()[1]:04X}"
            sock.sendall(request)
            time.sleep(1.5)  # (the client's own pace: it does not read)
            left = [" ".join([fields[3], fields[4]]) for fields in map(str.split, Path("/proc/net/tcp").read_text()
                                                                       .splitlines()) if " ".join(fields[1:3]) == ends]
            got = 0
            sock.settimeout(5)
            try:
                while data := sock.recv(65536):
                    got += len(data)
            except ConnectionResetError:
                return left, got, True
            return left, got, False

    left, got, reset = await asyncio.to_thread(
        cut, by_send.port, build_request(b"POST", b"/pay", [(b"Idempotency-Key", b"k"), (b"Authorization", b"t"),
                                                            (b"X-Test-Size", b"6000000")], b"{}"))
    assert reset and got < 65536 and left == [], (left, got)
    assert SEND_CUT in by_send.log()
    left, got, reset = await asyncio.to_thread(
        cut, by_upstream.port, b"GET /stream/download?size=2000000000 HTTP/1.1\r\nHost: proxy\r\n\r\n")
    assert reset and got < 65536 and left == [], (left, got)
    assert "client went away mid-response (TimeoutError)" in by_upstream.log()
