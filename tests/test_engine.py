"""The request order and the outcome table, end to end: real client, real proxy, real stores, real upstream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from idemproxy.app import Proxy
from idemproxy.store import build_store
from tests.conftest import BACKENDS, ProxyFactory, RunningProxy, StorageFactory, build_config, empty_records
from tests.rawhttp import build_request, raw_exchange, send_raw
from tests.servers import free_port
from tests.upstream import RecordingUpstream

CHARGE = {"amount": 1000, "currency": "eur"}


def problem(body: bytes) -> dict[str, Any]:
    return dict(json.loads(body))


async def first_and_retry(proxy: RunningProxy, key: str, **kw: Any) -> tuple[Any, Any]:
    return await proxy.post("/v1/charges", key=key, **kw), await proxy.post("/v1/charges", key=key, **kw)


# ---------------------------------------------------------------------------------------------- replay


@pytest.mark.parametrize("backend", BACKENDS)
async def test_retry_is_replayed_byte_for_byte_and_executed_once(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    proxy = await make_proxy(backend)
    headers = {"X-Test-Set-Cookie": "session=abc", "Content-Type": "application/json"}
    (first, first_body), (again, again_body) = await first_and_retry(
        proxy, "k-1", body=json.dumps(CHARGE), headers=headers
    )
    assert first.status == 201 and first.headers["Idempotent-Replayed"] == "false"
    assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert again_body == first_body
    assert again.headers["Content-Type"] == first.headers["Content-Type"]
    assert again.headers["X-Custom"] == "kept" and again.headers["X-Upstream-Serial"] == "1"
    assert "Set-Cookie" in first.headers and "Set-Cookie" not in again.headers
    assert "Date" in again.headers
    assert upstream.count(key="k-1") == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_same_key_other_payload_is_422_and_not_executed(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    proxy = await make_proxy(backend)
    await proxy.post("/v1/charges", key="k-2", body=CHARGE)
    resp, body = await proxy.post("/v1/charges", key="k-2", body={**CHARGE, "amount": 2500})
    assert resp.status == 422 and problem(body)["code"] == "payload_mismatch"
    assert resp.headers["Content-Type"] == "application/problem+json"
    assert "Idempotent-Replayed" not in resp.headers
    assert upstream.count(key="k-2") == 1


async def test_json_key_order_and_whitespace_do_not_matter(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy()
    await proxy.post("/v1/charges", key="k-3", body=b'{"amount": 1000, "currency": "eur"}')
    resp, _ = await proxy.post("/v1/charges", key="k-3", body=b'{ "currency":"eur",\n "amount":1000 }')
    assert resp.headers["Idempotent-Replayed"] == "true"
    assert upstream.count(key="k-3") == 1


async def test_path_and_query_are_part_of_the_fingerprint(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy()
    await proxy.post("/v1/charges?x=1", key="k-q", body=CHARGE)
    resp, _body = await proxy.post("/v1/charges?x=2", key="k-q", body=CHARGE)
    assert resp.status == 422
    assert upstream.count(key="k-q") == 1


async def test_fingerprint_headers_must_match(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy(idempotency={"fingerprint_headers": ["X-Account"]})
    await proxy.post("/v1/charges", key="k-h", body=CHARGE, headers={"X-Account": "a"})
    resp, _ = await proxy.post("/v1/charges", key="k-h", body=CHARGE, headers={"X-Account": "b"})
    assert resp.status == 422
    resp, _ = await proxy.post("/v1/charges", key="k-h", body=CHARGE, headers={"X-Account": "a"})
    assert resp.headers["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_tenants_are_sealed_off(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    proxy = await make_proxy(backend)
    a, a_body = await proxy.post("/v1/charges", key="shared", body=CHARGE, tenant="Bearer alice")
    b, b_body = await proxy.post("/v1/charges", key="shared", body={"other": 1}, tenant="Bearer bob")
    assert a.status == b.status == 201
    assert b.headers["Idempotent-Replayed"] == "false"
    assert json.loads(a_body)["serial"] != json.loads(b_body)["serial"]
    again, again_body = await proxy.post("/v1/charges", key="shared", body={"other": 1}, tenant="Bearer bob")
    assert again_body == b_body and again.headers["Idempotent-Replayed"] == "true"
    assert upstream.count(key="shared") == 2
    # the raw credential is never stored
    record = await proxy.proxy.store.get("Bearer alice", "shared")
    assert record is None


# ---------------------------------------------------------------------------------- request order


async def test_uncovered_method_is_proxied_even_with_a_key(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy()
    for _ in range(2):
        resp, _ = await proxy.post("/v1/charges", key="k-get", method="GET")
        assert "Idempotent-Replayed" not in resp.headers
    assert upstream.count(key="k-get") == 2


async def test_disabled_route_is_plain_proxy(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy(routes=[{"prefix": "/v1/events", "enabled": False}])
    for _ in range(2):
        await proxy.post("/v1/events", key="k-ev", body=CHARGE)
    assert upstream.count(key="k-ev") == 2


async def test_no_key_is_pass_through_without_tenant(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy()
    resp, _ = await proxy.post("/v1/charges", body=CHARGE, tenant=None)
    assert resp.status == 201 and "Idempotent-Replayed" not in resp.headers


async def test_required_route_without_key_is_400(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy(routes=[{"prefix": "/v1/charges", "required": True}])
    resp, body = await proxy.post("/v1/charges", body=CHARGE)
    assert resp.status == 400 and problem(body)["code"] == "missing_key"
    resp, body = await proxy.post("/v1/charges", body=CHARGE, tenant=None)
    assert resp.status == 401 and problem(body)["code"] == "missing_tenant"  # tenant is checked first
    assert upstream.executed == []


@pytest.mark.parametrize(
    "target",
    [b"//v1/charges", b"/./v1/charges", b"/v1/x/../charges", b"/v1/%2e%2e/v1/charges", b"/v1/charges/../events/x"],
)
async def test_a_path_that_reads_as_another_route_once_normalised_is_refused(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, target: bytes
) -> None:
    """An upstream that merges slashes and resolves dot segments executes //v1/charges as /v1/charges; one that
    does not executes /v1/charges/../events as a charge. Where the two readings fall under different routes the
    proxy cannot know which route's policy applies (here: required, and a disabled one), so it forwards neither."""
    proxy = await make_proxy(routes=[{"prefix": "/v1/charges", "required": True},
                                     {"prefix": "/v1/events", "enabled": False}])
    headers = [(b"Authorization", b"t"), (b"Content-Type", b"application/json")]
    for extra in ([], [(b"Idempotency-Key", b"k")]):
        resp = await send_raw(proxy.url, build_request(b"POST", target, [*headers, *extra], b"{}"))
        assert resp.status == 400 and json.loads(resp.body)["code"] == "bad_request"
    assert upstream.executed == []
    text = proxy.proxy.metrics.render().decode()  # answered, so counted and timed (a 400's outcome)
    assert 'idemproxy_requests_total{method="POST",outcome="invalid_key",route="other"} 2.0' in text
    assert 'idemproxy_request_duration_seconds_count{outcome="invalid_key"} 2.0' in text



async def refused_with_a_key_or_without(
    proxy: RunningProxy, upstream: RecordingUpstream, target: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    """``target`` is refused (400 ``bad_request``) with an idempotency key and without one, and nothing executed."""
    for extra in ([], [(b"Idempotency-Key", b"k")]):
        resp = await send_raw(proxy.url, build_request(b"POST", target, [*headers, *extra], b"{}"))
        assert resp.status == 400 and json.loads(resp.body)["code"] == "bad_request", resp.body
    assert upstream.executed == []

@pytest.mark.parametrize(
    "target", [b"//pay.example/v1/charges", b"/\\pay.example/v1/charges", b"/v1/events\\..\\charges"],
)
async def test_a_path_that_reads_as_another_route_to_a_url_parser_is_refused(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, target: bytes
) -> None:
    """A WHATWG URL parser, as in Node's documented ``new URL(req.url, base)``, reads a backslash as a slash and a
    leading ``//`` as an authority: ``//pay.example/v1/charges`` and ``/\\pay.example/v1/charges`` are the path
    ``/v1/charges`` on host ``pay.example`` (Python's ``urlsplit`` reads the first so too), and
    ``/v1/events\\..\\charges`` is ``/v1/charges``. They went on as sent: the first two unkeyed under no route (the
    required one skipped), the last as a disabled route's plain pass-through, a charge executed unguarded."""
    proxy = await make_proxy(routes=[{"prefix": "/v1/charges", "required": True},
                                     {"prefix": "/v1/events", "enabled": False}])
    headers = [(b"Authorization", b"t"), (b"Content-Type", b"application/json")]
    await refused_with_a_key_or_without(proxy, upstream, target, headers)
    # a path with a backslash or a leading // whose readings all fall under one route is forwarded as sent
    for fine in (b"//pay.example/v2/x", b"/v1/charges/a\\b"):
        resp = await send_raw(proxy.url, build_request(b"POST", fine, [*headers, (b"Idempotency-Key", fine)], b"{}"))
        assert resp.status == 201, (fine, resp.body)
    assert [e.path_qs for e in upstream.executed] == ["//pay.example/v2/x", "/v1/charges/a\\b"]


@pytest.mark.parametrize("target", [b"///pay.example/v1/charges", b"/\\\\pay.example/v1/charges",
                                    b"/\\/pay.example/v1/charges", b"////pay.example/v1/charges"])
async def test_a_path_whose_authority_follows_more_than_two_slashes_is_refused(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, target: bytes
) -> None:
    """A WHATWG URL parser skips every slash and backslash before an authority, not two: ``///pay.example/v1/charges``
    and ``/\\\\pay.example/v1/charges`` are the path ``/v1/charges`` there, as ``//pay.example/v1/charges`` is.
    They went on as sent, unkeyed under no route (the required one skipped)."""
    proxy = await make_proxy(routes=[{"prefix": "/v1/charges", "required": True}])
    headers = [(b"Authorization", b"t"), (b"Content-Type", b"application/json")]
    resp = await send_raw(proxy.url, build_request(b"POST", target, headers, b"{}"))
    assert resp.status == 400 and json.loads(resp.body)["code"] == "bad_request", resp.body
    assert upstream.executed == []


@pytest.mark.parametrize(("target", "named"), [(b"/v1;x=1/charges", "parameters"), (b"/v1\\charges", "backslash"),
                                              (b"//pay.example/v1/charges", "leading //")])
async def test_the_refusal_of_a_path_read_as_another_route_names_the_reading(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, target: bytes, named: str
) -> None:
    """The 400 said "once its repeated slashes or dot segments are resolved; send it resolved" for every path read
    as another route, also for one with no repeated slash or dot segment at all (a ``;`` parameter, a backslash,
    a host): its client was told to fix what it had not sent."""
    proxy = await make_proxy(routes=[{"prefix": "/v1/charges", "required": True}])
    resp = await send_raw(proxy.url, build_request(b"POST", target, [(b"Authorization", b"t")], b"{}"))
    assert resp.status == 400 and named in json.loads(resp.body)["detail"], resp.body
    assert upstream.executed == []


@pytest.mark.parametrize("target", [b"/v1;x=1/charges", b"/v1/events/..;/charges"])
async def test_a_path_that_reads_as_another_route_to_a_servlet_container_is_refused(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, target: bytes
) -> None:
    """Servlet containers (Tomcat, Jetty; Spring's UrlPathHelper too) drop each segment's ``;`` parameters before
    they resolve dot segments: ``/v1;x=1/charges`` and ``/v1/events/..;/charges`` are ``/v1/charges`` there (the
    ``..;/`` of Tomcat behind another proxy). They went on as sent, unkeyed under no route or as a disabled route's
    plain pass-through."""
    proxy = await make_proxy(routes=[{"prefix": "/v1/charges", "required": True},
                                     {"prefix": "/v1/events", "enabled": False}])
    headers = [(b"Authorization", b"t"), (b"Content-Type", b"application/json")]
    await refused_with_a_key_or_without(proxy, upstream, target, headers)
    # parameters that leave the route as it is go on as sent
    keyed = [*headers, (b"Idempotency-Key", b"param")]
    resp = await send_raw(proxy.url, build_request(b"POST", b"/v1/charges;v=2", keyed, b"{}"))
    assert resp.status == 201 and [e.path_qs for e in upstream.executed] == ["/v1/charges;v=2"]


async def test_a_path_with_one_reading_is_forwarded_as_sent(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy(routes=[{"prefix": "/v1/charges", "required": True}])
    headers = [(b"Authorization", b"t"), (b"Content-Type", b"application/json")]
    keyless = await send_raw(proxy.url, build_request(b"POST", b"/v1/charges//x/./y", headers, b"{}"))
    assert keyless.status == 400 and json.loads(keyless.body)["code"] == "missing_key"  # the route applies
    keyed = [*headers, (b"Idempotency-Key", b"k")]
    resp = await send_raw(proxy.url, build_request(b"POST", b"/other//x", keyed, b"{}"))
    assert resp.status == 201 and resp.headers["idempotent-replayed"] == "false"
    assert [e.path_qs for e in upstream.executed] == ["/other//x"]  # byte for byte


async def test_missing_tenant_is_401(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy()
    resp, body = await proxy.post("/v1/charges", key="k", body=CHARGE, tenant=None)
    assert resp.status == 401 and problem(body)["code"] == "missing_tenant"
    assert upstream.executed == []


@pytest.mark.parametrize("required", [True, False])
async def test_a_tenant_header_sent_twice_is_refused_not_scoped_to_either(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, required: bool
) -> None:
    """A gateway that appends the tenant it authenticated after a line the client forged: scoped to the first
    line, the key would read, block or replay the forged tenant's record (guarantee 5)."""
    proxy = await make_proxy(tenant={"required": required})
    victim, _ = await proxy.post("/v1/charges", key="k-twice", body=CHARGE, tenant="Bearer victim")
    assert victim.status == 201
    for lines in ([b"Bearer victim", b"Bearer me"], [b"Bearer me", b"Bearer me"]):
        headers = [(b"Authorization", line) for line in lines]
        headers += [(b"Idempotency-Key", b"k-twice"), (b"Content-Type", b"application/json")]
        resp = await send_raw(proxy.url, build_request(b"POST", b"/v1/charges", headers, json.dumps(CHARGE).encode()))
        assert resp.status == 401 and json.loads(resp.body)["code"] == "missing_tenant", resp.body
        assert b"sent 2 times" in resp.body
    assert upstream.count(key="k-twice") == 1
    # keyless, the request is a pass-through with no tenant needed: both lines go on as sent
    keyless = [(b"Authorization", b"Bearer a"), (b"Authorization", b"Bearer b")]
    assert (await send_raw(proxy.url, build_request(b"GET", b"/plain", keyless, b""))).status == 200


async def test_static_tenant(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy(tenant={"from": "static", "static": "shop-1"})
    await proxy.post("/v1/charges", key="k-s", body=CHARGE, tenant=None)
    resp, _ = await proxy.post("/v1/charges", key="k-s", body=CHARGE, tenant="Bearer anyone")
    assert resp.headers["Idempotent-Replayed"] == "true"
    assert await proxy.proxy.store.get("shop-1", "k-s") is not None


@pytest.mark.parametrize(
    "key", ["", "x" * 256, "caf\u00e9", "tab\there", '"unterminated', '"bad\\escape"'],
    ids=["empty", "too-long", "non-ascii", "control", "quote", "escape"],
)
async def test_invalid_keys_are_400(make_proxy: ProxyFactory, upstream: RecordingUpstream, key: str) -> None:
    proxy = await make_proxy()
    resp, body = await proxy.post(
        "/v1/charges", body=CHARGE, headers={"Idempotency-Key": key.encode("utf-8").decode("latin-1")}
    )
    assert resp.status == 400 and problem(body)["code"] == "invalid_key"
    assert upstream.executed == []


@pytest.mark.parametrize("key", [b"k-nbsp\xc2\xa0", b"\xe3\x80\x80k", b'"k"\xc2\xa0', b"k\xc2\x85"],
                         ids=["trailing-no-break-space", "leading-ideographic-space", "after-the-quotes", "next-line"])
async def test_a_key_ending_in_unicode_whitespace_is_invalid_not_the_key_without_it(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, key: bytes
) -> None:
    """HTTP strips only spaces and tabs around a value: U+00A0 or U+3000 is part of the key, which is then not
    printable ASCII; stripped, it would be replayed the answer of another key."""
    proxy = await make_proxy()
    await proxy.post("/v1/charges", key="k", body=CHARGE)
    resp = await send_raw(proxy.url, build_request(
        b"POST", b"/v1/charges", [(b"Idempotency-Key", key), (b"Authorization", b"Bearer t1")], b"{}"))
    assert resp.status == 400 and json.loads(resp.body)["code"] == "invalid_key"
    assert upstream.count() == 1


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (build_request(b"POST", b"/v1/charges", [(b"Idempotency-Key", b"k\x01ey"), (b"Authorization", b"t")], b"{}"),
         "invalid_key"),
        # The parser quotes a line holding a single quote as b"...": such a key was a bad_request, not invalid_key.
        (build_request(b"POST", b"/v1/charges", [(b"Idempotency-Key", b"k'\x01ey"), (b"Authorization", b"t")], b"{}"),
         "invalid_key"),
        (build_request(b"POST", b"/v1/charges", [(b"Idempotency-Key", b"k"), (b"Authorization", b"sk_live_SECRET\x01")],
                       b"{}"), "bad_request"),
        (build_request(b"POST", b"/v1/charges", [(b"Idempotency-Key", b"k"), (b"Authorization", b"sk_'SECRET\x01")],
                       b"{}"), "bad_request"),
        (b"GARBAGE\r\n\r\n", "bad_request"),
    ],
    ids=["control-char-in-key", "control-char-and-quote-in-key", "control-char-in-credential",
         "control-char-and-quote-in-credential", "not-http"],
)
async def test_a_request_the_parser_refuses_gets_a_problem_and_logs_nothing_of_it(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture, raw: bytes, code: str
) -> None:
    """aiohttp's parser refuses such requests before the handler runs; its own answer was text/plain, and it logged
    the refused line (a credential here) with a traceback at ERROR."""
    proxy = await make_proxy()
    with caplog.at_level(logging.DEBUG):
        resp = await send_raw(proxy.url, raw)
    assert resp.status == 400 and resp.headers["content-type"] == "application/problem+json"
    assert json.loads(resp.body)["code"] == code and resp.headers["x-request-id"]
    assert b"SECRET" not in resp.body and "SECRET" not in caplog.text and "ERROR" not in caplog.text
    assert "refused a request that is not valid HTTP/1.1" in caplog.text
    assert upstream.executed == []
    counted = 'idemproxy_requests_total{method="UNKNOWN",outcome="invalid_key",route="other"} 1.0'
    assert (counted in proxy.proxy.metrics.render().decode()) == (code == "invalid_key")


async def test_repeated_key_header_is_400(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy()
    from multidict import CIMultiDict

    headers = CIMultiDict([("Idempotency-Key", "a"), ("Idempotency-Key", "b"), ("Authorization", "t")])
    async with proxy.session.post(proxy.url + "/v1/charges", json=CHARGE, headers=headers) as resp:
        assert resp.status == 400 and (await resp.json(content_type=None))["code"] == "invalid_key"
    assert upstream.executed == []


@pytest.mark.parametrize("joined", ["m1, m1", "m1,m1", "m1 ,  m1,m1", '"m1", "m1"'])
async def test_a_key_header_sent_twice_and_joined_by_a_hop_is_400(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, joined: str
) -> None:
    """A hop that joins a header sent twice gives one line, ``m1, m1`` (RFC 9110 §5.3); a hop that keeps one gives
    ``m1``. Read as a key of its own, the first executed again on a retry through the second. A key holding a
    comma that is not one key repeated stays a key."""
    proxy = await make_proxy()
    resp, body = await proxy.post("/v1/charges", key=joined, body=CHARGE)
    assert resp.status == 400 and problem(body)["code"] == "invalid_key", (resp.status, body)
    assert upstream.executed == []
    for key in ("m1", "a, b", "m1,", ",m1"):
        assert (await proxy.post("/v1/charges", key=key, body=CHARGE))[0].status == 201, key
    assert upstream.count() == 4


async def test_quoted_key_is_the_same_key(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy()
    await proxy.post("/v1/charges", key='"order-\\"7"', body=CHARGE)
    resp, _ = await proxy.post("/v1/charges", key='order-"7', body=CHARGE)
    assert resp.headers["Idempotent-Replayed"] == "true"
    assert upstream.count() == 1


async def test_body_over_the_limit_is_413(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy(idempotency={"max_request_body": "1KiB"})
    resp, body = await proxy.post("/v1/charges", key="big", body=b"x" * 1025)
    assert resp.status == 413 and problem(body)["code"] == "body_too_large"

    async def chunked() -> Any:  # no Content-Length: the limit is enforced while reading
        for _ in range(3):
            yield b"y" * 600

    async with proxy.session.post(proxy.url + "/v1/charges", data=chunked(),
                                  headers={"Idempotency-Key": "big2", "Authorization": "t"}) as resp:
        assert resp.status == 413
    resp, _ = await proxy.post("/v1/charges", key="ok", body=b"x" * 1024)
    assert resp.status == 201
    assert upstream.count() == 1


async def test_key_is_forwarded_upstream_unless_disabled(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy()
    await proxy.post("/v1/charges", key="fwd", body=CHARGE)
    assert upstream.executed[-1].headers["Idempotency-Key"] == "fwd"
    # A key a bare header value cannot carry goes as the sf-string it came as: '"k "' is not 'k'.
    await proxy.post("/v1/charges", key='" edge "', body=CHARGE)
    assert upstream.executed[-1].headers["Idempotency-Key"] == '" edge "'
    await proxy.post("/v1/charges", key='"\\"q\\\\"', body=CHARGE)  # the key "q\ (a quote first)
    assert upstream.executed[-1].headers["Idempotency-Key"] == '"\\"q\\\\"'
    quiet = await make_proxy(upstream={"forward_key": False})
    await quiet.post("/v1/other", key="nofwd", body=CHARGE)
    assert "Idempotency-Key" not in upstream.executed[-1].headers


# ---------------------------------------------------------------------------------------- outcomes


@pytest.mark.parametrize("status", [200, 201, 400, 404, 500])
async def test_kept_statuses_are_replayed(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, status: int
) -> None:
    proxy = await make_proxy()
    (first, _), (again, _) = await first_and_retry(
        proxy, f"s-{status}", body=CHARGE, headers={"X-Test-Status": str(status)}
    )
    assert first.status == again.status == status
    assert again.headers["Idempotent-Replayed"] == "true"
    assert upstream.count(key=f"s-{status}") == 1


@pytest.mark.parametrize("status", [408, 409, 425, 429, 503])
async def test_release_statuses_free_the_key(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, status: int
) -> None:
    proxy = await make_proxy()
    (first, _), (again, _) = await first_and_retry(
        proxy, f"r-{status}", body=CHARGE, headers={"X-Test-Status": str(status)}
    )
    assert first.status == again.status == status
    assert first.headers["Idempotent-Replayed"] == again.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key=f"r-{status}") == 2


async def test_5xx_released_when_store_5xx_is_off(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy(idempotency={"store_5xx": False})
    await first_and_retry(proxy, "s5", body=CHARGE, headers={"X-Test-Status": "500"})
    assert upstream.count(key="s5") == 2


@pytest.mark.parametrize("backend", BACKENDS)
async def test_unreachable_upstream_releases_the_key(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    dead = await make_proxy(backend, upstream_url=f"http://127.0.0.1:{free_port()}")
    resp, body = await dead.post("/v1/charges", key="unr", body=CHARGE)
    assert resp.status == 502 and problem(body)["code"] == "upstream_unreachable"
    tenant = dead.proxy.engine.resolve_tenant_value("Bearer t1")
    assert await dead.proxy.store.get(tenant, "unr") is None
    await dead.session.close()
    await dead.server.close()
    live = await make_proxy(backend)  # same store: the key is free, the retry executes
    resp, _ = await live.post("/v1/charges", key="unr", body=CHARGE)
    assert resp.status == 201 and upstream.count(key="unr") == 1


async def test_a_budget_spent_waiting_for_an_upstream_connection_sends_nothing_and_frees_the_key(
    make_proxy: ProxyFactory,
) -> None:
    # One upstream connection, held by a plain download that trickles (never silent long enough to time out):
    # the covered request waits for it until its budget (upstream.timeout) runs out. Nothing was sent, so the
    # answer is 502 upstream_unreachable and the key is released, not kept in flight as "outcome unknown".
    done = asyncio.Event()
    charges: list[str] = []

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        while not done.is_set():
            await response.write(b".")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.1)
        await response.write_eof()
        return response

    async def charge(request: web.Request) -> web.Response:
        charges.append(request.headers.get("Idempotency-Key", ""))
        return web.json_response({"ok": True}, status=201)

    app = web.Application()
    app.router.add_get("/slow", trickle)
    app.router.add_post("/v1/charges", charge)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        proxy = await make_proxy("embedded", upstream_url=str(server.make_url("")).rstrip("/"),
                                 upstream={"max_connections": 1, "connect_timeout": "30s", "timeout": "1s"})
        holder = asyncio.ensure_future(proxy.post("/slow", method="GET", tenant=None))
        while proxy.proxy.upstreams.default.pool._open == 0:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        resp, body = await proxy.post("/v1/charges", key="starved", body=CHARGE)
        assert resp.status == 502 and problem(body)["code"] == "upstream_unreachable"
        assert time.monotonic() - started < 5.0 and charges == []
        done.set()
        await holder
        again, _ = await proxy.post("/v1/charges", key="starved", body=CHARGE)
        assert again.status == 201 and charges == ["starved"]
    finally:
        done.set()
        await server.close()


@pytest.mark.parametrize(
    ("policy", "retry_status", "executions"),
    [("keep_lease", 409, 1), ("release", 201, 2), ("store", 504, 1)],
)
async def test_timeout_follows_on_unknown_outcome(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, policy: str, retry_status: int, executions: int
) -> None:
    proxy = await make_proxy(upstream={"timeout": "300ms"}, idempotency={"on_unknown_outcome": policy})
    resp, body = await proxy.post("/v1/charges", key=f"t-{policy}", body=CHARGE,
                                  headers={"X-Test-Delay": "2"})
    assert resp.status == 504 and problem(body)["code"] == "upstream_timeout"
    again, _ = await proxy.post("/v1/charges", key=f"t-{policy}", body=CHARGE)
    assert again.status == retry_status
    if retry_status == 409:
        assert int(again.headers["Retry-After"]) >= 1
    assert upstream.count(key=f"t-{policy}") == executions


async def test_a_stored_timeout_replays_with_the_executing_request_id(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy(upstream={"timeout": "300ms"}, idempotency={"on_unknown_outcome": "store"})
    resp, _ = await proxy.post("/v1/charges", key="t-id", body=CHARGE,
                               headers={"X-Test-Delay": "2", "X-Request-Id": "executed-1"})
    assert resp.status == 504 and "Original-Request-Id" not in resp.headers  # only replays carry it
    again, body = await proxy.post("/v1/charges", key="t-id", body=CHARGE, headers={"X-Request-Id": "retry-1"})
    assert again.status == 504 and problem(body)["code"] == "upstream_timeout"
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Original-Request-Id"] == "executed-1" and again.headers["X-Request-Id"] == "retry-1"
    assert upstream.count(key="t-id") == 1


async def test_connection_reset_keeps_the_lease(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy()
    resp, body = await proxy.post("/v1/charges", key="reset", body=CHARGE, headers={"X-Test-Drop": "1"})
    assert resp.status == 502 and problem(body)["code"] == "upstream_reset"
    again, body = await proxy.post("/v1/charges", key="reset", body=CHARGE)
    assert again.status == 409 and problem(body)["code"] == "in_flight"
    assert upstream.count(key="reset") == 1


@pytest.mark.parametrize(("policy", "retry_status"), [("keep_lease", 409), ("store", 502)])
async def test_upstream_502_is_an_unknown_outcome(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, policy: str, retry_status: int
) -> None:
    proxy = await make_proxy(idempotency={"on_unknown_outcome": policy})
    resp, _ = await proxy.post("/v1/charges", key="u502", body=CHARGE, headers={"X-Test-Status": "502"})
    assert resp.status == 502 and resp.headers["Idempotent-Replayed"] == "false"
    again, _ = await proxy.post("/v1/charges", key="u502", body=CHARGE)
    assert again.status == retry_status
    assert upstream.count(key="u502") == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_response_too_large_to_store_is_never_re_executed(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    proxy = await make_proxy(backend, idempotency={"max_stored_response": "4KiB"})
    resp, body = await proxy.post("/v1/charges", key="huge", body=CHARGE, headers={"X-Test-Size": "100000"})
    assert resp.status == 201 and len(body) == 100000
    again, body = await proxy.post("/v1/charges", key="huge", body=CHARGE)
    assert again.status == 502
    assert problem(body)["code"] == "response_not_replayable" and problem(body)["original_status"] == 201
    # who executed it, as a replay would say
    assert again.headers["Original-Request-Id"] == resp.headers["X-Request-Id"] != again.headers["X-Request-Id"]
    assert upstream.count(key="huge") == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_answer_whose_head_is_too_large_is_settled_by_its_status_and_never_relayed(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    """Past 64 KiB of headers (client.MAX_HEAD) an answer is not relayed, nor stored (its headers used to be
    stored whole: 20 MB of them in one record). The upstream did answer, so its status is settled as the outcome
    table says: a kept answer is recorded without headers or body, as one too large to store is, and a retry
    gets 502 response_not_replayable; it used to be taken for a broken connection (outcome unknown), so a retry
    after the lease executed the charge again."""
    proxy = await make_proxy(backend)
    huge = {"X-Test-Head": str(80 * 1024)}
    first, body = await proxy.post("/v1/charges", key="big-head", body=CHARGE, headers=huge)
    assert first.status == 502 and "Idempotent-Replayed" not in first.headers
    assert problem(body)["code"] == "upstream_reset" and problem(body)["original_status"] == 201
    assert "larger than 64 KiB" in problem(body)["detail"] and "not executed again" in problem(body)["detail"]
    assert not any(name.startswith("X-Head-") for name in first.headers)
    again, body = await proxy.post("/v1/charges", key="big-head", body=CHARGE, headers=huge)
    assert again.status == 502
    assert problem(body)["code"] == "response_not_replayable" and problem(body)["original_status"] == 201
    assert again.headers["Original-Request-Id"] == first.headers["X-Request-Id"]
    assert upstream.count(key="big-head") == 1
    # a release status releases the key as ever; an answer within the limit is relayed and replayed whole
    released, body = await proxy.post("/v1/charges", key="big-429", body=CHARGE,
                                      headers={**huge, "X-Test-Status": "429"})
    assert released.status == 502 and problem(body)["original_status"] == 429
    assert "not executed again" not in problem(body)["detail"]
    await proxy.post("/v1/charges", key="big-429", body=CHARGE)
    assert upstream.count(key="big-429") == 2
    within = {"X-Test-Head": str(48 * 1024)}
    (live, _), (replayed, _) = await first_and_retry(proxy, "head-within", body=CHARGE, headers=within)
    assert live.status == replayed.status == 201 and replayed.headers["Idempotent-Replayed"] == "true"
    assert len(live.headers.getall("X-Head-11")) == len(replayed.headers.getall("X-Head-11")) == 1
    assert upstream.count(key="head-within") == 1


@pytest.mark.parametrize("codings", ["gzip, chunked", "chunked,"])
async def test_an_answer_in_a_transfer_coding_other_than_chunked_is_settled_by_its_status_and_never_relayed(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, codings: str
) -> None:
    """Its body used to be handed on, and stored, still gzip-coded but no longer named so. "chunked," is no
    coding at all to llhttp (a body to the connection's end); the first form of the check took it for chunked,
    waited for a chunked end that never came, and the broken answer's key was executed again after its lease."""
    proxy = await make_proxy("embedded")
    coded = {"X-Test-Coding": codings}
    first, body = await proxy.post("/v1/charges", key="coded", body=CHARGE, headers=coded)
    assert first.status == 502 and problem(body)["code"] == "upstream_reset"
    assert problem(body)["original_status"] == 201 and f"{codings!r}" in problem(body)["detail"]
    again, body = await proxy.post("/v1/charges", key="coded", body=CHARGE, headers=coded)
    assert again.status == 502 and problem(body)["code"] == "response_not_replayable"
    assert upstream.count(key="coded") == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_answer_whose_body_breaks_off_after_its_head_is_settled_by_its_status(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    """The head came, so the upstream answered: only the body was lost. That used to be an unknown outcome
    (502 upstream_reset, the lease kept), and a retry after the lease executed the charge a second time; guarantee
    1 forwards again only when the outcome stayed unknown."""
    proxy = await make_proxy(backend, upstream={"timeout": "1s"}, idempotency={"lease": "10s"})
    cut = {"X-Test-Cut": "1"}
    first, body = await proxy.post("/v1/charges", key="cut-201", body=CHARGE, headers=cut)
    assert first.status == 502 and problem(body)["code"] == "upstream_reset"
    assert problem(body)["original_status"] == 201 and "broke off" in problem(body)["detail"]
    again, body = await proxy.post("/v1/charges", key="cut-201", body=CHARGE, headers=cut)
    assert again.status == 502 and problem(body)["code"] == "response_not_replayable"
    assert upstream.count(key="cut-201") == 1
    stalled, body = await proxy.post("/v1/charges", key="stall-201", body=CHARGE,
                                     headers={"X-Test-Trickle": "3,2"})  # a chunk, then 2 s of silence: past 1 s
    assert stalled.status == 502 and problem(body)["original_status"] == 201 and "stalled" in problem(body)["detail"]
    again, body = await proxy.post("/v1/charges", key="stall-201", body=CHARGE)
    assert again.status == 502 and problem(body)["code"] == "response_not_replayable"
    assert upstream.count(key="stall-201") == 1
    released, body = await proxy.post("/v1/charges", key="cut-429", body=CHARGE,
                                      headers={**cut, "X-Test-Status": "429"})
    assert released.status == 502 and problem(body)["original_status"] == 429
    await proxy.post("/v1/charges", key="cut-429", body=CHARGE)  # a release status: released, so executed again
    assert upstream.count(key="cut-429") == 2


async def test_an_unknown_outcome_with_a_head_too_large_keeps_the_lease_and_pass_through_gets_502(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    huge = {"X-Test-Head": str(80 * 1024)}
    first, body = await proxy.post("/v1/charges", key="big-504", body=CHARGE, headers={**huge, "X-Test-Status": "504"})
    assert first.status == 502 and problem(body)["original_status"] == 504
    again, body = await proxy.post("/v1/charges", key="big-504", body=CHARGE)
    assert again.status == 409 and problem(body)["code"] == "in_flight"  # keep_lease: as any unknown outcome
    assert upstream.count(key="big-504") == 1
    passed, body = await proxy.post("/v1/things", method="GET", headers=huge)
    assert passed.status == 502 and problem(body)["code"] == "upstream_reset"
    assert problem(body)["original_status"] == 200


async def test_a_pass_through_answer_whose_body_breaks_off_or_stalls_gets_502_with_its_status(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """The outcome table's row for a body lost after the head came: 502 upstream_reset with original_status, and
    "an uncovered request gets the same". A pass-through reads a small declared body whole before answering, and
    answered a body that broke off with a 502 naming no status, and one that stalled with 504 upstream_timeout (an
    upstream that did answer, in time)."""
    proxy = await make_proxy("embedded", upstream={"timeout": "1s"}, idempotency={"lease": "10s"})
    cut, body = await proxy.post("/v1/things", method="GET", headers={"X-Test-Cut": "1"})
    assert cut.status == 502 and problem(body)["code"] == "upstream_reset"
    assert problem(body)["original_status"] == 200 and "broke off" in problem(body)["detail"]
    stalled, body = await proxy.post("/v1/things", method="GET", headers={"X-Test-Trickle": "3,2"})
    assert stalled.status == 502 and problem(body)["code"] == "upstream_reset"
    assert problem(body)["original_status"] == 200 and "stalled" in problem(body)["detail"]


async def test_an_answer_too_large_to_store_streams_past_the_upstream_timeout_while_it_flows(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """Once its record is settled, the rest of such an answer streams as a pass-through does: each read waits up
    to upstream.timeout. It used to be cut at the forward's budget (upstream.timeout from the send), losing the
    only copy of an executed answer: the record then says it completed, and a retry gets 502."""
    proxy = await make_proxy(upstream={"timeout": "1s"}, idempotency={"max_stored_response": "4KiB"})
    started = time.monotonic()
    resp, body = await proxy.post("/v1/charges", key="trickle", body=CHARGE, headers={"X-Test-Trickle": "8,0.25"})
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    assert body == b"".join(bytes([65 + n]) * 2048 for n in range(8)), len(body)
    assert time.monotonic() - started > 1.0  # longer than the upstream timeout in all
    assert upstream.count(key="trickle") == 1


@pytest.mark.parametrize("size", ["stored", "streamed"])
async def test_an_upstreams_own_replay_header_gives_way_to_the_proxys(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, size: str
) -> None:
    """An upstream with idempotency of its own may answer Idempotent-Replayed itself: a response just executed
    through the proxy still says false, once (an answer kept whole and one streamed past max_stored_response)."""
    proxy = await make_proxy(idempotency={"max_stored_response": "4KiB"})
    headers = {"X-Test-Replayed": "true", **({"X-Test-Size": "100000"} if size == "streamed" else {})}
    resp, _ = await proxy.post("/v1/charges", key=f"own-{size}", body=CHARGE, headers=headers)
    assert resp.status == 201 and resp.headers.getall("Idempotent-Replayed") == ["false"]
    if size == "stored":
        replay, _ = await proxy.post("/v1/charges", key=f"own-{size}", body=CHARGE, headers=headers)
        assert replay.headers.getall("Idempotent-Replayed") == ["true"]
    assert upstream.count(key=f"own-{size}") == 1


@pytest.mark.parametrize("size", ["stored", "streamed"])
async def test_an_answer_without_content_type_gets_none_added(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, size: str
) -> None:
    """aiohttp gives any body without a Content-Type application/octet-stream; an upstream's answer (live, replayed,
    or passed through) keeps the headers it came with."""
    proxy = await make_proxy(idempotency={"max_stored_response": "4KiB"})
    headers = {"X-Test-No-Type": "1", "X-Test-Size": "100000" if size == "streamed" else "10"}
    fresh, body = await proxy.post("/v1/charges", key=f"untyped-{size}", body=CHARGE, headers=headers)
    assert fresh.status == 201 and body and "Content-Type" not in fresh.headers
    if size == "stored":
        replay, body = await proxy.post("/v1/charges", key=f"untyped-{size}", body=CHARGE, headers=headers)
        assert replay.headers["Idempotent-Replayed"] == "true" and body and "Content-Type" not in replay.headers
    async with proxy.session.get(proxy.url + "/v1/plain", headers=headers) as plain:
        assert plain.status == 200 and await plain.read() and "Content-Type" not in plain.headers
    typed, _ = await proxy.post("/v1/charges", key=f"typed-{size}", body=CHARGE)
    assert typed.headers["Content-Type"].startswith("application/json")  # one the upstream sent is kept


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_covered_head_answer_keeps_the_upstreams_content_length_live_and_replayed(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    """A HEAD answer has no body, and its Content-Length is the upstream's own header (the size a GET would get,
    RFC 9110 §8.6), as a pass-through HEAD relays it: a covered HEAD answered without it, live and replayed."""
    proxy = await make_proxy(backend, idempotency={"methods": ["POST", "HEAD"]})
    plain, _ = await proxy.post("/v1/things", method="HEAD", tenant=None, headers={"X-Test-Size": "100"})
    assert plain.headers["Content-Length"] == "100"  # pass-through: the upstream's header
    for replayed in ("false", "true"):
        resp, body = await proxy.post("/v1/things", key="head-1", method="HEAD", headers={"X-Test-Size": "100"})
        assert (resp.status, body, resp.headers["Idempotent-Replayed"]) == (200, b"", replayed)
        assert resp.headers.getall("Content-Length") == ["100"]
    assert upstream.count(key="head-1") == 1


async def test_in_flight_duplicate_is_409_with_retry_after(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy()
    first = asyncio.ensure_future(proxy.post("/v1/charges", key="busy", body=CHARGE,
                                             headers={"X-Test-Delay": "1"}))
    while upstream.count(key="busy") == 0:
        await asyncio.sleep(0.005)
    resp, body = await proxy.post("/v1/charges", key="busy", body=CHARGE)
    assert resp.status == 409 and problem(body)["code"] == "in_flight"
    assert resp.headers["Retry-After"] == "1"  # come back soon: the first attempt is about to answer
    assert 55 <= problem(body)["lease_expires_in"] <= 60  # a crashed owner's key is taken over after this
    assert (await first)[0].status == 201
    assert upstream.count(key="busy") == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_client_disconnect_does_not_stop_execution_or_store(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    proxy = await make_proxy(backend)
    first = asyncio.ensure_future(proxy.post("/v1/charges", key="gone", body=CHARGE,
                                             headers={"X-Test-Delay": "1"}))
    while upstream.count(key="gone") == 0:
        await asyncio.sleep(0.005)
    first.cancel()  # the client goes away mid-request
    await proxy.session.close()
    await proxy.proxy.engine.drain(30, 1)  # the shielded forward-and-store finishes on its own
    import aiohttp

    proxy.session = aiohttp.ClientSession()
    resp, _body = await proxy.post("/v1/charges", key="gone", body=CHARGE)
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "true"
    assert upstream.count(key="gone") == 1


async def past_the_lease(proxy: RunningProxy, key: str) -> None:
    """Until the in-flight record of ``key`` (tenant "Bearer t1") has outlived its lease."""
    record = await proxy.proxy.store.get(proxy.proxy.engine.resolve_tenant_value("Bearer t1"), key)
    assert record is not None and record.lease_expires_at is not None
    await asyncio.sleep(max(record.lease_expires_at - time.time(), 0) + 0.05)


async def test_lease_takeover_after_the_lease_runs_out(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy(upstream={"timeout": "200ms"}, idempotency={"lease": "2200ms"})
    resp, _ = await proxy.post("/v1/charges", key="take", body=CHARGE, headers={"X-Test-Delay": "2"})
    assert resp.status == 504  # outcome unknown: the lease is kept
    resp, _ = await proxy.post("/v1/charges", key="take", body=CHARGE)
    assert resp.status == 409
    await past_the_lease(proxy, "take")
    resp, _ = await proxy.post("/v1/charges", key="take", body=CHARGE)
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="take") == 2
    assert proxy.proxy.metrics.lease_takeovers._value.get() == 1


@pytest.mark.parametrize("backend", ["embedded", "postgres", "redis", "postgres-one-table"])
async def test_a_takeover_is_counted_as_one_when_the_ttl_is_no_longer_than_the_lease(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_one_table_dsn: str, backend: str
) -> None:
    """A ttl shorter than the lease is valid, and an in-flight record stands for its whole lease: the same request
    after the lease takes it over (the upstream may execute it twice), and idemproxy_lease_takeovers_total (the
    IdempotencyLeaseTakeovers alert) must say so. It was counted as an expired record instead."""
    timing = {"upstream": {"timeout": "300ms"}, "idempotency": {"lease": "1s", "ttl": "500ms"}}
    if backend == "postgres-one-table":
        one_table = {"postgres": {"dsn": await empty_records(pg_one_table_dsn), "partitions": "none"}}
        proxy = await make_proxy(storage_section=one_table, **timing)
    else:
        proxy = await make_proxy(backend, **timing)
    resp, _ = await proxy.post("/v1/charges", key="short-ttl", body=CHARGE, headers={"X-Test-Delay": "0.6"})
    assert resp.status == 504  # outcome unknown: the lease is kept
    await past_the_lease(proxy, "short-ttl")
    resp, _ = await proxy.post("/v1/charges", key="short-ttl", body=CHARGE)
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="short-ttl") == 2
    text = proxy.proxy.metrics.render().decode()
    assert "idemproxy_lease_takeovers_total 1.0" in text
    assert "idemproxy_records_expired_total 0.0" in text


async def test_ttl_expiry_makes_the_key_usable_again(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy(upstream={"timeout": "100ms"},
                             idempotency={"lease": "2100ms", "ttl": "2100ms"})
    await proxy.post("/v1/charges", key="ttl", body=CHARGE)
    resp, _ = await proxy.post("/v1/charges", key="ttl", body={"different": True})
    assert resp.status == 422
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    record = await proxy.proxy.store.get(tenant, "ttl")
    assert record is not None
    await asyncio.sleep(max(record.expires_at - time.time(), 0) + 0.05)
    resp, _ = await proxy.post("/v1/charges", key="ttl", body={"different": True})
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="ttl") == 2


@pytest.mark.parametrize("backend", ["embedded", "postgres", "redis"])
async def test_a_ttl_shorter_than_the_lease_and_a_lease_just_over_the_timeout(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    # The contract asks only timeout < lease; a ttl under the lease is valid too (no bound on it).
    proxy = await make_proxy(backend, upstream={"timeout": "1s"}, idempotency={"lease": "1500ms", "ttl": "1s"})
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    # A slow answer inside the timeout is forwarded whole: the forward is cut at the lease minus the 0.5 s the
    # lease leaves, not minus the 2 s advised (which would leave nothing to forward with).
    resp, _ = await proxy.post("/v1/charges", key="short", body=CHARGE, headers={"X-Test-Delay": "0.6"})
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    again, _ = await proxy.post("/v1/charges", key="short", body=CHARGE)
    assert again.headers["Idempotent-Replayed"] == "true"
    record = await proxy.proxy.store.get(tenant, "short")
    assert record is not None
    await asyncio.sleep(max(record.expires_at - time.time(), 0) + 0.05)
    resp, _ = await proxy.post("/v1/charges", key="short", body=CHARGE)
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="short") == 2

    # An in-flight record stands for its whole lease, though its ttl is shorter: a retry past the ttl but inside
    # the lease is a 409, never a second forward.
    claimed = time.time()
    hung, body = await proxy.post("/v1/charges", key="held", body=CHARGE, headers={"X-Test-Delay": "5"})
    assert hung.status == 504 and problem(body)["code"] == "upstream_timeout"  # keep_lease
    record = await proxy.proxy.store.get(tenant, "held")
    assert record is not None and record.lease_expires_at is not None
    assert record.lease_expires_at - claimed >= 1.4
    if record.lease_expires_at - time.time() > 0.1:
        retry, body = await proxy.post("/v1/charges", key="held", body=CHARGE)
        assert retry.status == 409 and problem(body)["code"] == "in_flight"
    await asyncio.sleep(max(record.lease_expires_at - time.time(), 0) + 0.05)
    taken, _ = await proxy.post("/v1/charges", key="held", body=CHARGE)
    assert taken.status == 201
    assert upstream.count(key="held") == 2


# -------------------------------------------------------------------------------------- metrics


async def test_metrics_label_routes_and_outcomes(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy(routes=[{"prefix": "/v1/charges"}])
    await first_and_retry(proxy, "m1", body=CHARGE)
    await proxy.post("/v1/charges", key="m1", body={"x": 1})
    await proxy.post("/elsewhere/123", key="m2", body=CHARGE)
    text = proxy.proxy.metrics.render().decode()
    for outcome in ("forwarded", "replayed", "payload_mismatch"):
        assert f'idemproxy_requests_total{{method="POST",outcome="{outcome}",route="/v1/charges"}} 1.0' in text
    assert 'idemproxy_requests_total{method="POST",outcome="forwarded",route="other"} 1.0' in text
    assert "m1" not in text and "/elsewhere/123" not in text
    assert 'idemproxy_overhead_seconds_bucket{le="0.0001",outcome="replayed"}' in text
    assert 'idemproxy_store_duration_seconds_count{backend="redis",operation="claim"}' in text
    assert 'idemproxy_store_duration_seconds_count{backend="postgres",operation="complete"}' in text
    assert "idemproxy_in_flight_requests 0.0" in text


async def test_overhead_of_a_streamed_answer_leaves_out_the_upstream_s_body_time(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """An answer too large to keep streams on after its head: the upstream's slow body is time waiting on the
    upstream (as for a pass-through), never the proxy's overhead."""
    proxy = await make_proxy("postgres", idempotency={"max_stored_response": 1024})
    # 5 chunks of 2 KiB, 0.2 s apart: the body takes 0.8 s to come, after the first 1 KiB settled the key
    resp, body = await proxy.post("/v1/charges", key="slow-big", body=CHARGE, headers={"X-Test-Trickle": "5,0.2"})
    assert resp.status == 201 and len(body) == 5 * 2048
    text = proxy.proxy.metrics.render().decode()

    def total(name: str, labels: str = "") -> float:
        found = re.search(rf"^{name}_sum{labels} (\S+)$", text, re.M)
        assert found is not None, name
        return float(found.group(1))

    assert total("idemproxy_upstream_duration_seconds") >= 0.7
    assert total("idemproxy_overhead_seconds", '{outcome="forwarded"}') < 0.3


async def test_a_streamed_answer_is_in_flight_until_its_body_is_relayed(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """idemproxy_in_flight_requests counts covered requests being forwarded. An answer too large to keep streams on
    from the upstream after its head, the key settled: that request is still being forwarded, and read 0 (the
    gauge fell as the forward's task returned the head, before the body was relayed)."""
    proxy = await make_proxy("postgres", idempotency={"max_stored_response": 1024})

    def in_flight() -> str:
        text = proxy.proxy.metrics.render().decode()
        return next(line for line in text.splitlines() if line.startswith("idemproxy_in_flight_requests "))

    # 10 chunks of 2 KiB, 0.2 s apart: once the head is here the upstream is still sending for about 1.6 s
    headers = {"Idempotency-Key": "slow-big", "Authorization": "Bearer t1", "X-Test-Trickle": "10,0.2"}
    async with proxy.session.post(proxy.url + "/v1/charges", json=CHARGE, headers=headers) as resp:
        assert resp.status == 201
        first = await resp.content.readexactly(2048)
        assert in_flight() == "idemproxy_in_flight_requests 1.0"
        rest = await resp.read()
    assert len(first) + len(rest) == 10 * 2048
    assert in_flight() == "idemproxy_in_flight_requests 0.0"


async def test_overhead_of_a_wait_leaves_out_the_owner_s_upstream_time(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """In ``wait`` mode a duplicate waits while the owner's upstream works: that is time waiting on the upstream,
    never the proxy's overhead (which the overhead alert reads as a slow store)."""
    proxy = await make_proxy("postgres", idempotency={"in_flight": "wait"})
    owner = asyncio.ensure_future(proxy.post("/v1/charges", key="waited", body=CHARGE,
                                             headers={"X-Test-Delay": "1"}))
    while upstream.count(key="waited") == 0:
        await asyncio.sleep(0.01)
    resp, _ = await proxy.post("/v1/charges", key="waited", body=CHARGE)  # waits about 1 s for the owner
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "true"
    assert (await owner)[0].status == 201
    text = proxy.proxy.metrics.render().decode()

    def total(name: str) -> float:
        found = re.search(rf'^{name}_sum{{outcome="replayed"}} (\S+)$', text, re.M)
        assert found is not None, name
        return float(found.group(1))

    assert total("idemproxy_request_duration_seconds") >= 0.5
    assert total("idemproxy_overhead_seconds") < 0.3
    assert upstream.count(key="waited") == 1


async def test_sweeper_counts_removed_records(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_one_table_dsn: str
) -> None:
    one_table = {"postgres": {"dsn": await empty_records(pg_one_table_dsn), "partitions": "none"}}
    proxy = await make_proxy(storage_section=one_table, upstream={"timeout": "100ms"},
                             idempotency={"lease": "2100ms", "ttl": "2100ms"})
    for key in ("sw1", "sw2"):
        await proxy.post("/v1/charges", key=key, body=CHARGE)
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    record = await proxy.proxy.store.get(tenant, "sw2")
    assert record is not None
    await asyncio.sleep(max(record.expires_at - time.time(), 0) + 0.05)
    assert await proxy.proxy.sweep_once() == 2
    assert await proxy.proxy.store.get(tenant, "sw1") is None
    assert "idemproxy_records_expired_total 2.0" in proxy.proxy.metrics.render().decode()


async def test_sweeper_drops_passed_days_of_the_daily_layout(make_proxy: ProxyFactory, clean_pg: str) -> None:
    from idemproxy.store.postgres import create_partition

    proxy = await make_proxy("postgres")
    conn = await asyncpg.connect(clean_pg)
    try:
        yesterday = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date - 1")
        await create_partition(conn, yesterday)
        await conn.fetchrow("SELECT * FROM idemproxy_claim('t', 'old', 'f', 'tok', 1, 1, $1)",
                            datetime.combine(yesterday, datetime.min.time(), UTC))
        await proxy.proxy.sweep_once()
        assert await conn.fetchval("SELECT count(*) FROM idemproxy_records WHERE key = 'old'") == 0
        assert await conn.fetchval("SELECT to_regclass($1)", f"idemproxy_records_p{yesterday:%Y%m%d}") is None
    finally:
        await conn.close()
    assert "idemproxy_partitions_dropped_total 1.0" in proxy.proxy.metrics.render().decode()


# ------------------------------------------------------------------------------ review regressions


async def test_admin_release_of_an_in_flight_key_the_owner_never_answers_its_unstored_result(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("postgres")
    pending = asyncio.ensure_future(proxy.post("/v1/charges", key="rel", body=CHARGE,
                                               headers={"X-Test-Delay": "0.5"}))
    while upstream.count(key="rel") == 0:
        await asyncio.sleep(0.005)
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    assert await proxy.proxy.store.forget(tenant, "rel")  # an operator released the stuck-looking key
    resp, body = await pending
    assert resp.status == 409 and problem(body)["code"] == "in_flight"  # its completion was refused
    assert "Idempotent-Replayed" not in resp.headers


async def test_a_refused_owner_in_wait_mode_waits_for_the_new_owner_past_settle_timeout(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """settle_timeout bounds a wait for the store, not wait mode's wait for a new owner's answer: with the store
    healthy, the refused owner's client gets that answer (a replay), never a 503 "store unavailable"."""
    proxy = await make_proxy("postgres", idempotency={"in_flight": "wait", "wait_timeout": "5s",
                                                      "settle_timeout": "500ms"})
    first = asyncio.ensure_future(proxy.post("/v1/charges", key="w", body=CHARGE, headers={"X-Test-Delay": "0.5"}))
    while upstream.count(key="w") == 0:
        await asyncio.sleep(0.005)
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    assert await proxy.proxy.store.forget(tenant, "w")  # released by an operator while it executes
    second = asyncio.ensure_future(proxy.post("/v1/charges", key="w", body=CHARGE, headers={"X-Test-Delay": "2"}))
    while upstream.count(key="w") < 2:
        await asyncio.sleep(0.005)
    resp, body = await first  # refused, then waits ~1.5 s for the second's answer: longer than settle_timeout
    new_resp, new_body = await second
    assert new_resp.status == 201 and new_resp.headers["Idempotent-Replayed"] == "false"
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "true", (resp.status, body)
    assert body == new_body


@pytest.mark.parametrize("backend", ["redis", "postgres", "embedded"])
async def test_a_refused_timeout_answer_in_store_mode_gives_what_the_record_says(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    """on_unknown_outcome: store keeps the proxy's own 504; when that completion is refused (the key was taken
    over or released meanwhile, and a new owner completed it), the client gets what the record says, never its
    own unstored 504 (guarantee 2). The 504 was re-raised and the record's answer thrown away (audit, 2026-11-27):
    the client was told the upstream timed out while the record says the payment went through."""
    proxy = await make_proxy(backend, upstream={"timeout": "1s"}, idempotency={"on_unknown_outcome": "store"})
    first = asyncio.ensure_future(proxy.post("/v1/charges", key="t-o", body=CHARGE, headers={"X-Test-Delay": "3"}))
    while upstream.count(key="t-o") == 0:
        await asyncio.sleep(0.005)
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    assert await proxy.proxy.store.forget(tenant, "t-o")  # released by an operator while it executes
    new_resp, new_body = await proxy.post("/v1/charges", key="t-o", body=CHARGE)  # a retry executes, completes
    assert new_resp.status == 201 and new_resp.headers["Idempotent-Replayed"] == "false"
    resp, body = await first  # its 504 is refused: the record holds the retry's answer
    assert (resp.status, resp.headers.get("Idempotent-Replayed"), body) == (201, "true", new_body)
    assert upstream.count(key="t-o") == 2


async def test_forward_key_sends_the_key_as_the_proxy_understood_it(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    await proxy.post("/v1/charges", key='"order-7"', body=CHARGE)
    resp, _ = await proxy.post("/v1/charges", key="order-7", body=CHARGE)
    assert resp.headers["Idempotent-Replayed"] == "true"  # one key to the proxy ...
    assert [e.headers["Idempotency-Key"] for e in upstream.executed] == ["order-7"]  # ... and to the upstream


async def test_undecodable_tenant_bytes_are_hashed_not_a_500(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    port = proxy.port
    head = ("POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: ff-1\r\nAuthorization: Bearer \udcff\r\n"
            "Content-Length: 2\r\nConnection: close\r\n\r\n")
    statuses = [(await raw_exchange(port, head, b"{}"))[0] for _ in range(2)]
    assert statuses == [201, 201] and upstream.count(key="ff-1") == 1


@pytest.mark.parametrize("backend", ["postgres", "embedded"])
async def test_an_unhashed_tenant_too_long_to_index_is_refused_not_unavailable(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    proxy = await make_proxy(backend, tenant={"hash": False})
    resp, body = await proxy.post("/v1/charges", key="long-tenant", body=CHARGE, tenant="x" * 3000)
    assert resp.status == 401 and problem(body)["code"] == "missing_tenant"
    ok, _ = await proxy.post("/v1/charges", key="long-tenant", body=CHARGE, tenant="y" * 1000)
    assert ok.status == 201
    assert upstream.count(key="long-tenant") == 1


async def test_an_unhashed_tenant_named_as_the_tenantless_are_cannot_read_their_records(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """Requests without a tenant (``required: false``) share the id "-"; an unhashed tenant header "-" used to be
    that id too, and replayed their answers (or answered 422 to their keys)."""
    proxy = await make_proxy("embedded", tenant={"hash": False, "required": False})
    first, _ = await proxy.post("/v1/charges", key="anon-1", body=CHARGE, tenant=None)
    assert first.status == 201
    posing, body = await proxy.post("/v1/charges", key="anon-1", body=CHARGE, tenant="-")
    assert posing.status == 401 and problem(body)["code"] == "missing_tenant"
    again, _ = await proxy.post("/v1/charges", key="anon-1", body=CHARGE, tenant=None)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert upstream.count(key="anon-1") == 1


async def test_a_proxy_that_fails_to_start_leaves_its_store_closed(
    storage: StorageFactory, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No half-started proxy: the store opened before the failure is closed again (its file lock released)."""
    config = build_config(upstream.url, storage("embedded"))
    proxy = Proxy(config)

    async def refuse() -> None:
        raise RuntimeError("no upstream pool")

    monkeypatch.setattr(proxy.upstreams, "open", refuse)
    with pytest.raises(RuntimeError, match="no upstream pool"):
        await proxy.start()
    again = build_store(config.storage)  # the same file: refused with StoreLocked while the first holds it
    await again.open()
    await again.close()
