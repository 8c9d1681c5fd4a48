"""The plain reverse proxy: methods, bytes, headers both ways, errors; against a real upstream."""

from __future__ import annotations

import gzip
import json

import aiohttp
import pytest
from yarl import URL

from tests.conftest import ProxyFactory
from tests.servers import free_port
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
