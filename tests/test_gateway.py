"""Gateway features on real servers: per-route upstreams, forwarded headers, request ids, other status
conventions, and no server banner (CONTRACT "Gateway and operations")."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import warnings
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from idemproxy.app import new_request_id
from tests.conftest import ProxyFactory, RunningProxy, recording_upstream
from tests.rawhttp import build_request, raw_exchange, send_raw
from tests.upstream import RecordingUpstream

CHARGE = {"amount": 1000, "currency": "eur"}
BANNER = "aiohttp"


@pytest.fixture
async def upstream_b() -> AsyncIterator[RecordingUpstream]:
    async with recording_upstream() as recorder:
        yield recorder


def problem(body: bytes) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(body)
    return parsed


# ------------------------------------------------------------------ several upstreams


async def test_routes_reach_their_own_upstream_through_their_own_pool(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, upstream_b: RecordingUpstream
) -> None:
    b = {"url": upstream_b.url, "timeout": "5s"}
    proxy = await make_proxy("embedded", routes=[
        {"prefix": "/v1/charges", "upstream": b},
        {"prefix": "/v1/refunds", "upstream": b},
        {"prefix": "/v1/events", "enabled": False},
    ])
    for path in ("/v1/charges", "/v1/refunds", "/v1/events", "/v2/other"):
        resp, _ = await proxy.post(path, key=f"k{path}", body=CHARGE)
        assert resp.status == 201, path
        plain, _ = await proxy.post(path, method="GET", tenant=None)
        assert plain.status == 200
    again, _ = await proxy.post("/v1/charges", key="k/v1/charges", body=CHARGE)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert sorted(e.path_qs for e in upstream_b.executed) == [
        "/v1/charges", "/v1/charges", "/v1/refunds", "/v1/refunds"
    ]
    assert sorted(e.path_qs for e in upstream.executed) == ["/v1/events", "/v1/events", "/v2/other", "/v2/other"]

    upstreams = proxy.proxy.upstreams
    config = proxy.proxy.config
    charges, refunds = upstreams.for_route(config.routes[0]), upstreams.for_route(config.routes[1])
    assert charges.pool is not refunds.pool  # a route naming an upstream has a pool of its own, equal settings or not
    assert charges.pool is not upstreams.default.pool
    assert upstreams.for_route(config.routes[2]) is upstreams.default is upstreams.for_route(None)


async def test_an_absolute_form_target_without_a_path_falls_under_the_root_route(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, upstream_b: RecordingUpstream
) -> None:
    """``POST http://host HTTP/1.1`` (or ``http://host?x=1``) means the path ``/`` (RFC 9112 §3.2.2, RFC 3986
    §6.2.3), and ``/`` is what is forwarded: the route of ``/`` (its policy, its upstream) applies, not the
    defaults and the top-level upstream."""
    root = {"prefix": "/", "required": True, "upstream": {"url": upstream_b.url}}
    proxy = await make_proxy("embedded", routes=[root])
    headers = [(b"Authorization", b"t"), (b"Content-Type", b"application/json")]
    for target in (b"http://api.example", b"http://api.example?x=1", b"/"):
        keyless = await send_raw(proxy.url, build_request(b"POST", target, headers, b"{}"))
        assert keyless.status == 400 and problem(keyless.body)["code"] == "missing_key", target
    assert upstream.executed == [] and upstream_b.executed == []
    keyed = [*headers, (b"Idempotency-Key", b"abs-root")]
    resp = await send_raw(proxy.url, build_request(b"POST", b"http://api.example?x=1", keyed, b"{}"))
    assert resp.status == 201 and resp.headers["idempotent-replayed"] == "false"
    assert upstream.executed == [] and [e.path_qs for e in upstream_b.executed] == ["/?x=1"]  # the route's own


async def test_a_route_naming_an_upstream_is_not_starved_by_another_route_with_equal_settings(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """README: each route may name its own upstream, "its own connection pool". A route given the same API as
    another (or as the top-level upstream) to keep a slow prefix from starving the rest gets that: its
    max_connections are its own, whatever the other blocks say."""
    same = {"url": upstream.url, "timeout": "5s", "connect_timeout": "300ms", "max_connections": 1}
    proxy = await make_proxy("embedded", upstream=same, routes=[
        {"prefix": "/slow", "upstream": same},
        {"prefix": "/other", "upstream": same},
    ])
    hanging = asyncio.ensure_future(proxy.post("/slow", method="GET", tenant=None, headers={"X-Test-Hang": "1"}))
    try:
        while upstream.count(path="/slow") == 0:
            await asyncio.sleep(0.01)
        for path in ("/other", "/v1/charges"):  # the other route's pool, and the top-level one
            resp, body = await proxy.post(path, key=f"iso{path}", body=CHARGE)
            assert resp.status == 201, (path, body)
    finally:
        upstream.release_hangs()
        await hanging


async def test_a_route_upstream_has_its_own_timeout(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, upstream_b: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded", routes=[
        {"prefix": "/slow-ok", "upstream": {"url": upstream_b.url, "timeout": "3s"}},
        {"prefix": "/", "upstream": {"url": upstream_b.url, "timeout": "200ms"}},
    ])
    slow, _ = await proxy.post("/slow-ok", key="s1", body=CHARGE, headers={"X-Test-Delay": "0.5"})
    assert slow.status == 201
    late, body = await proxy.post("/fast", key="s2", body=CHARGE, headers={"X-Test-Delay": "0.5"})
    assert late.status == 504 and problem(body)["code"] == "upstream_timeout"
    assert upstream.executed == []


# ------------------------------------------------------------------ forwarded headers


async def test_forwarded_headers_from_an_untrusted_peer_are_set_by_this_hop(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded", forwarded={"trusted_proxies": ["10.0.0.0/8"]})
    sent = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "pay.example", "X-Forwarded-For": "203.0.113.7"}
    await proxy.post("/f", method="GET", tenant=None, headers=sent)
    seen = upstream.executed[0].headers
    assert seen["X-Forwarded-Proto"] == "http"
    assert seen.getall("X-Forwarded-Host") == [proxy.url.removeprefix("http://")]
    assert seen["X-Forwarded-For"] == "203.0.113.7, 127.0.0.1"
    # HTTP/1.0 without Host names no host: none is sent on (the proxy's own address is not the client's host)
    status, _, _ = await raw_exchange(proxy.port, "GET /h HTTP/1.0\r\nX-Forwarded-Host: pay.example\r\n\r\n")
    assert status == 200
    assert upstream.executed[1].headers.getall("X-Forwarded-Host", []) == []
    # an absolute-form target names the host, and Host is then ignored (RFC 9112 §3.2.2)
    for head in ("GET http://abs.example:8443/a HTTP/1.1\r\nHost: hdr.example\r\nConnection: close\r\n\r\n",
                 "GET http://u@abs.example/a HTTP/1.0\r\n\r\n"):
        status, _, _ = await raw_exchange(proxy.port, head)
        assert status == 200
    assert [e.headers.getall("X-Forwarded-Host", []) for e in upstream.executed[2:]] == [
        ["abs.example:8443"], ["abs.example"]]


FORGED = {"Forwarded": "for=6.6.6.6;proto=https;host=shop-a.example", "X_Forwarded_Host": "shop-a.example",
          "X-Forwarded_Proto": "https", "X_Forwarded_For": "6.6.6.6", "X-Forwarded-Port": "443",
          "X-Forwarded-Prefix": "/admin", "x-forwarded-ssl": "on", "X_Forwarded_Scheme": "https",
          "X-Real-IP": "6.6.6.6", "X_Real_Ip": "6.6.6.6", "X-Original-URL": "/v1/charges",
          "X_Rewrite_Url": "/v1/charges"}


@pytest.mark.parametrize("covered", [False, True])
@pytest.mark.parametrize("trusted", [False, True])
async def test_other_spellings_of_the_forwarding_headers_pass_only_from_a_trusted_peer(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, covered: bool, trusted: bool
) -> None:
    """RFC 7239 ``Forwarded`` says what X-Forwarded-* say, a CGI/WSGI upstream reads ``X_Forwarded_Host`` as
    X-Forwarded-Host, and frameworks read X-Real-IP and more of the X-Forwarded-* family (-Port, -Prefix, -Ssl):
    from a peer not trusted they went on as sent, so a client could name the shop, the scheme or the address
    this hop vouches for; X-Original-URL and X-Rewrite-URL, read by some frameworks as the path asked for, could
    take an uncovered request to a covered route. A header that merely looks alike is no such header and passes."""
    networks = ["127.0.0.0/8", "::1"] if trusted else ["10.0.0.0/8"]
    proxy = await make_proxy("embedded", forwarded={"trusted_proxies": networks})
    alike = {"X-Forwardedness": "1", "X-Realm": "r", "X-Callback-Url": "https://shop.example/cb"}
    resp, _ = await proxy.post("/f", headers={**FORGED, **alike}, body=CHARGE, key="fs" if covered else None)
    assert resp.status == 201
    seen = upstream.executed[0].headers
    assert {name: seen[name] for name in alike} == alike
    for name, value in FORGED.items():
        assert seen.getall(name, []) == ([value] if trusted else []), name
    assert seen.getall("X-Forwarded-For") == ["127.0.0.1"]
    assert seen.getall("X-Forwarded-Proto") == ["http"]


@pytest.mark.parametrize("covered", [False, True])
async def test_forwarded_headers_the_client_named_in_connection_are_dropped_not_passed_on(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, covered: bool
) -> None:
    """Named in ``Connection``, a header is hop-by-hop (RFC 9110 §7.6.1): X-Forwarded-For was still appended
    to, and a trusted peer's X-Forwarded-Proto still passed through."""
    proxy = await make_proxy("embedded", forwarded={"trusted_proxies": ["127.0.0.0/8", "::1"]})
    sent = {"X-Forwarded-For": "6.6.6.6", "X-Forwarded-Proto": "https",
            "Connection": "keep-alive, X-Forwarded-For, X-Forwarded-Proto"}
    resp, _ = await proxy.post("/f", headers=sent, body=CHARGE, key="fc" if covered else None)
    assert resp.status == 201
    seen = upstream.executed[0].headers
    assert seen.getall("X-Forwarded-For") == ["127.0.0.1"] and seen.getall("X-Forwarded-Proto") == ["http"]


@pytest.mark.parametrize("covered", [False, True])
async def test_forwarded_headers_from_a_trusted_peer_pass_through(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, covered: bool
) -> None:
    proxy = await make_proxy("embedded", forwarded={"trusted_proxies": ["127.0.0.0/8", "::1"]})
    sent = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "pay.example", "X-Forwarded-For": "203.0.113.7"}
    resp, _ = await proxy.post("/f", headers=sent, body=CHARGE, key="fw" if covered else None)
    assert resp.status == 201
    seen = upstream.executed[0].headers
    assert seen["X-Forwarded-Proto"] == "https" and seen.getall("X-Forwarded-Host") == ["pay.example"]
    assert seen["X-Forwarded-For"] == "203.0.113.7, 127.0.0.1"
    # a trusted peer that sends none: this hop sets them
    await proxy.post("/g", method="GET", tenant=None)
    assert upstream.executed[1].headers["X-Forwarded-Proto"] == "http"
    assert upstream.executed[1].headers["X-Forwarded-Host"] == proxy.url.removeprefix("http://")


# ------------------------------------------------------------------ request ids


async def test_a_well_formed_request_id_is_kept_end_to_end(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    resp, _ = await proxy.post("/r", key="r1", body=CHARGE, headers={"X-Request-Id": "req-abc_123"})
    assert resp.headers["X-Request-Id"] == "req-abc_123"
    assert upstream.executed[0].headers["X-Request-Id"] == "req-abc_123"
    assert "Original-Request-Id" not in resp.headers  # only replays carry it


@pytest.mark.parametrize("given", [None, "", "x" * 129, "has space", "caf\u00e9"])
async def test_a_missing_or_malformed_request_id_is_replaced(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, given: str | None
) -> None:
    proxy = await make_proxy("embedded")
    headers = {} if given is None else {"X-Request-Id": given}
    resp, _ = await proxy.post("/r", method="GET", tenant=None, headers=headers)
    generated = resp.headers["X-Request-Id"]
    assert generated != given and 1 <= len(generated) <= 128 and generated.isascii()
    assert upstream.executed[0].headers.getall("X-Request-Id") == [generated]
    other, _ = await proxy.post("/r", method="GET", tenant=None, headers=headers)
    assert other.headers["X-Request-Id"] != generated


def test_generated_request_ids_differ_in_a_forked_child_and_its_parent() -> None:
    read, write = os.pipe()
    with warnings.catch_warnings():  # 3.12+ warns of fork() in a process with threads; the child only writes
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    parent = new_request_id()
    assert re.fullmatch("[0-9a-f]{32}", parent) and re.fullmatch("[0-9a-f]{32}", child)
    assert child != parent


async def test_replays_and_problems_carry_the_request_id(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded", request_id={"header": "X-Correlation-Id"})
    first, first_body = await proxy.post("/r", key="r2", body=CHARGE, headers={"X-Correlation-Id": "first"})
    assert first.headers["X-Correlation-Id"] == "first" and "Original-Request-Id" not in first.headers
    replay, replay_body = await proxy.post("/r", key="r2", body=CHARGE, headers={"X-Correlation-Id": "second"})
    assert replay.headers["Idempotent-Replayed"] == "true" and replay_body == first_body
    assert replay.headers["X-Correlation-Id"] == "second"
    assert replay.headers["Original-Request-Id"] == "first"
    missing, body = await proxy.post("/r", key="r3", body=CHARGE, tenant=None,
                                     headers={"X-Correlation-Id": "third"})
    assert missing.status == 401 and problem(body)["code"] == "missing_tenant"
    assert missing.headers["X-Correlation-Id"] == "third"
    assert upstream.count() == 1


async def test_the_access_log_names_the_request_id(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await make_proxy("embedded", log={"access": "info"})
    with caplog.at_level(logging.INFO, logger="idemproxy.access"):
        await proxy.post("/r", key="r4", body=CHARGE, headers={"X-Request-Id": "logged-1"})
    lines = [r for r in caplog.records if r.name == "idemproxy.access"]
    assert [getattr(r, "request_id", None) for r in lines] == ["logged-1"]
    assert re.fullmatch(r"POST /r 20[01] forwarded [0-9.]+ms logged-1", lines[0].getMessage()), lines[0].getMessage()


@pytest.mark.parametrize("head", [b"GARBAGE\r\n\r\n", b"POST /r HTTP/1.1\r\nHost: h\r\nX-A: a\x01b\r\n\r\n",
                                  b"POST /r HTTP/1.1\r\nHost: h\r\nIdempotency-Key: a\x7fb\r\n\r\n"])
async def test_a_request_the_parser_refused_is_logged_with_the_request_id_it_got(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture, head: bytes
) -> None:
    """aiohttp's parser refuses a request before the handler sees it, and the proxy answers it with a problem that
    carries a request id like every other answer; but the one log line such a request writes named only the
    parser's error class: the id its client got stood in no log line, and the request could not be found by it."""
    proxy = await make_proxy("embedded", log={"access": "info"})
    with caplog.at_level(logging.INFO, logger="idemproxy"):
        resp = await send_raw(proxy.url, head)
    assert resp.status == 400 and problem(resp.body)["code"] in ("bad_request", "invalid_key")
    request_id = resp.headers["x-request-id"]
    assert [r for r in caplog.records if request_id in r.getMessage()], [r.getMessage() for r in caplog.records]
    assert upstream.executed == []


# ------------------------------------------------------------------ other status conventions


async def test_in_flight_and_mismatch_statuses_follow_the_config(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded", idempotency={"in_flight_status": 425, "mismatch_status": 409},
                             routes=[{"prefix": "/accepted", "in_flight_status": 202}])

    async def duplicate(path: str) -> tuple[aiohttp.ClientResponse, bytes]:
        first = asyncio.ensure_future(proxy.post(path, key=path, body=CHARGE, headers={"X-Test-Delay": "0.5"}))
        while upstream.count(path=path) == 0:
            await asyncio.sleep(0.01)
        second = await proxy.post(path, key=path, body=CHARGE)
        assert (await first)[0].status == 201
        return second

    resp, body = await duplicate("/pay")
    assert resp.status == 425 and problem(body)["code"] == "in_flight" and problem(body)["status"] == 425
    assert resp.headers["Retry-After"] == "1"
    resp, body = await duplicate("/accepted")
    assert resp.status == 202 and problem(body)["code"] == "in_flight"
    resp, body = await proxy.post("/pay", key="/pay", body={"amount": 1})
    assert resp.status == 409 and problem(body)["code"] == "payload_mismatch" and problem(body)["status"] == 409
    assert upstream.count() == 2


async def test_default_statuses_stay_409_and_422(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy("embedded")
    await proxy.post("/pay", key="d", body=CHARGE)
    resp, body = await proxy.post("/pay", key="d", body={"amount": 1})
    assert resp.status == 422 and problem(body)["type"] == "urn:idemproxy:problem:payload-mismatch"


# ------------------------------------------------------------------ no disclosure


def assert_no_banner(resp: aiohttp.ClientResponse) -> None:
    assert "Server" not in resp.headers, resp.headers.get("Server")


async def test_responses_the_proxy_makes_carry_no_server_banner(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy: RunningProxy = await make_proxy("embedded", admin={"token": "t0ken"})
    resp, body = await proxy.post("/pay", key="b1", body=CHARGE, tenant=None)  # a problem
    assert resp.status == 401 and "idemproxy.dev" not in body.decode()
    assert problem(body)["type"].startswith("urn:idemproxy:problem:")
    assert_no_banner(resp)
    quiet = {"X-Test-No-Server": "1"}
    first, _ = await proxy.post("/pay", key="b2", body=CHARGE, headers=quiet)  # the upstream sent none
    assert_no_banner(first)
    replay, _ = await proxy.post("/pay", key="b2", body=CHARGE, headers=quiet)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert_no_banner(replay)
    plain, _ = await proxy.post("/pay", method="GET", tenant=None, headers=quiet)  # streamed pass-through
    assert plain.status == 200
    assert_no_banner(plain)

    admin = TestServer(proxy.proxy.admin_app(), host="127.0.0.1")
    await admin.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            for path in ("/healthz", "/readyz", "/metrics", "/admin/keys/t/k", "/nowhere"):
                async with session.get(admin.make_url(path)) as got:
                    assert_no_banner(got)
    finally:
        await admin.close()


async def test_proxied_responses_keep_the_upstreams_own_server_header(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    own = {"X-Test-Server": "payments/1.0"}
    first, _ = await proxy.post("/pay", key="s1", body=CHARGE, headers=own)
    replay, _ = await proxy.post("/pay", key="s1", body=CHARGE, headers=own)
    plain, _ = await proxy.post("/pay", method="GET", tenant=None, headers=own)
    big, _ = await proxy.post("/pay", key="s2", body=CHARGE, headers={**own, "X-Test-Size": str(2 * 1024 * 1024)})
    for resp in (first, replay, plain, big):
        assert resp.headers.getall("Server") == ["payments/1.0"]
