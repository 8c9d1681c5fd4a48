"""The admin API and `idemproxy keys`, against real stores; and what the logs say (and never say)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from idemproxy.app import AdminRunner
from idemproxy.config import ConfigError, load_config
from idemproxy.store.redis import RedisFrontedStore
from tests.conftest import ProxyFactory, RunningProxy, StorageFactory
from tests.proxyproc import ProxyProcess
from tests.rawhttp import build_request, send_raw
from tests.upstream import RecordingUpstream

TOKEN = "admin-token-123"
CHARGE = {"amount": 1000}
ALICE = hashlib.sha256(b"Bearer alice").hexdigest()


class Admin:
    def __init__(self, server: TestServer, session: aiohttp.ClientSession) -> None:
        self.server, self.session = server, session

    async def call(self, method: str, tenant: str, key: str, token: str | None = TOKEN) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        url = self.server.make_url(f"/admin/keys/{tenant}/{key}")
        async with self.session.request(method, url, headers=headers) as resp:
            if resp.content_type not in ("application/json", "application/problem+json"):
                return resp.status, None
            return resp.status, await resp.json(content_type=None)


@pytest.fixture
async def admin_for() -> AsyncIterator[Callable[[RunningProxy], Any]]:
    servers: list[TestServer] = []
    session = aiohttp.ClientSession()

    async def make(proxy: RunningProxy) -> Admin:
        server = TestServer(proxy.proxy.admin_app(), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return Admin(server, session)

    yield make
    await session.close()
    for server in servers:
        await server.close()


@pytest.mark.parametrize("backend", ["redis", "embedded"])
async def test_show_a_record_only_to_its_own_tenant(
    make_proxy: ProxyFactory, admin_for: Any, backend: str
) -> None:
    proxy = await make_proxy(backend, admin={"token": TOKEN})
    await proxy.post("/v1/charges", key="ord/1", body=CHARGE, tenant="Bearer alice")
    admin = await admin_for(proxy)
    status, body = await admin.call("GET", ALICE, "ord%2F1")
    assert status == 200
    assert body["state"] == "completed" and body["stored_status"] == 201 and body["replayable"]
    assert body["tenant"] == ALICE and body["key"] == "ord/1" and len(body["fingerprint"]) == 64
    assert "lease_token" not in body and "Bearer alice" not in json.dumps(body)
    bob = hashlib.sha256(b"Bearer bob").hexdigest()
    status, body = await admin.call("GET", bob, "ord%2F1")
    assert status == 404 and body["code"] == "not_found" and "fingerprint" not in body


@pytest.mark.parametrize("token", [None, "wrong", ""])
async def test_wrong_or_missing_token_is_401(make_proxy: ProxyFactory, admin_for: Any, token: str | None) -> None:
    proxy = await make_proxy(admin={"token": TOKEN})
    await proxy.post("/v1/charges", key="k", body=CHARGE, tenant="Bearer alice")
    admin = await admin_for(proxy)
    for method in ("GET", "DELETE"):
        status, body = await admin.call(method, ALICE, "k", token=token)
        assert status == 401 and body["code"] == "unauthorized"
    assert (await admin.call("GET", ALICE, "k"))[0] == 200  # nothing was deleted


async def test_a_refused_admin_call_logs_the_key_as_its_hash_never_raw(
    make_proxy: ProxyFactory, admin_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """"raw keys are never logged" (docs/operating.md; SECURITY.md has them in scope): the line for a call with a
    bad token quoted its path, /admin/keys/{tenant}/{key}, raw key and all (audit Q, 2026-11-27)."""
    proxy = await make_proxy(admin={"token": TOKEN})
    admin = await admin_for(proxy)
    with caplog.at_level(logging.INFO, logger="idemproxy.admin"):
        for method in ("GET", "DELETE"):
            assert (await admin.call(method, ALICE, "order%2Fraw-key-42", token="wrong"))[0] == 401
    refused = [record.getMessage() for record in caplog.records if "refused" in record.getMessage()]
    assert len(refused) == 2 and all(ALICE in line for line in refused), refused
    assert hashlib.sha256(b"order/raw-key-42").hexdigest()[:12] in refused[0]
    assert "raw-key-42" not in caplog.text


async def test_a_token_of_undecodable_bytes_is_401_and_a_nul_names_no_record(
    make_proxy: ProxyFactory, admin_for: Any
) -> None:
    """Bad input from the admin port's clients is their error (401, 404), never a 500 or a store outage."""
    proxy = await make_proxy("postgres", admin={"token": TOKEN})
    await proxy.post("/v1/charges", key="k", body=CHARGE, tenant="Bearer alice")
    admin = await admin_for(proxy)
    for method in (b"GET", b"DELETE"):
        raw = await send_raw(str(admin.server.make_url("/")), build_request(
            method, f"/admin/keys/{ALICE}/k".encode(), [(b"Authorization", b"Bearer \xff\xfe")], b""))
        assert raw.status == 401 and json.loads(raw.body)["code"] == "unauthorized", raw
        for tenant, key in ((f"{ALICE}%00", "k"), (ALICE, "k%00"), ("t%00x", "k")):
            status, body = await admin.call(method.decode(), tenant, key)
            assert status == 404 and body["code"] == "not_found", (status, body)
    assert (await admin.call("GET", ALICE, "k"))[0] == 200  # nothing was deleted
    errors = [line for line in proxy.proxy.metrics.render().decode().splitlines()
              if line.startswith("idemproxy_store_errors_total{") and not line.endswith(" 0.0")]
    assert errors == []  # (a NUL sent to PostgreSQL was counted as a store error, and answered 503)


async def test_no_token_configured_means_no_admin_api(make_proxy: ProxyFactory, admin_for: Any) -> None:
    proxy = await make_proxy()
    admin = await admin_for(proxy)
    assert (await admin.call("GET", ALICE, "k", token=""))[0] == 404


async def test_a_token_from_a_secret_file_with_its_trailing_newline_still_opens_the_admin_api(
    make_proxy: ProxyFactory, admin_for: Any
) -> None:
    """admin.token from a Kubernetes secret or a file (``${IDEMPROXY_ADMIN_TOKEN}``) often ends in a newline, which
    no Authorization header can carry: every admin call was 401, and ``idemproxy keys`` refused the token as not
    printable. As for the upstream URL and the store keys, whitespace around the value is not part of it; a
    control character inside it is refused at start, naming the key, never the value."""
    proxy = await make_proxy(admin={"token": TOKEN + "\n"})
    admin = await admin_for(proxy)
    assert (await admin.call("GET", ALICE, "k"))[0] == 404  # (not found: the token was taken)
    assert (await admin.call("GET", ALICE, "k", token=TOKEN + "x"))[0] == 401
    with pytest.raises(ConfigError) as refused:
        load_config({"upstream": {"url": "http://127.0.0.1:1"}, "admin": {"token": "admin\x01token"}}, env={})
    [error] = refused.value.errors
    assert error.startswith("admin.token: ") and "admin" not in error.removeprefix("admin.token: ")


async def test_delete_releases_a_stuck_in_flight_record(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, admin_for: Any
) -> None:
    proxy = await make_proxy(admin={"token": TOKEN}, upstream={"timeout": "200ms"})
    resp, _ = await proxy.post("/v1/charges", key="stuck", body=CHARGE, tenant="Bearer alice",
                               headers={"X-Test-Delay": "1"})
    assert resp.status == 504  # outcome unknown: the key keeps its 60 s lease
    assert (await proxy.post("/v1/charges", key="stuck", body=CHARGE, tenant="Bearer alice"))[0].status == 409
    admin = await admin_for(proxy)
    status, body = await admin.call("GET", ALICE, "stuck")
    assert status == 200 and body["state"] == "in_flight" and body["lease_alive"]
    status, body = await admin.call("DELETE", ALICE, "stuck")
    assert status == 200 and body == {"deleted": True, "state": "in_flight"}
    resp, _ = await proxy.post("/v1/charges", key="stuck", body=CHARGE, tenant="Bearer alice")
    assert resp.status == 201 and upstream.count(key="stuck") == 2
    assert (await admin.call("DELETE", ALICE, "nope"))[0] == 404


async def executed_as_alice(proc: ProxyProcess, key: str) -> ProxyProcess:
    """``proc`` started, with ``key`` executed through it by the credential ``Bearer alice``."""
    await proc.start()
    async with aiohttp.ClientSession() as session:
        async with session.post(proc.url + "/v1/charges", json=CHARGE,
                                headers={"Authorization": "Bearer alice", "Idempotency-Key": key}) as resp:
            assert resp.status == 201
    return proc


async def test_cli_mirrors_the_admin_api_and_logs_are_json_without_secrets(
    upstream: RecordingUpstream, storage: StorageFactory, proxy_process: Callable[..., ProxyProcess]
) -> None:
    config = {"upstream": {"url": upstream.url}, "admin": {"token": TOKEN}, "storage": storage("redis"),
              "log": {"format": "json", "access": "info"}}
    proc = await executed_as_alice(proxy_process(config), "cli-key-7")

    def keys(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "idemproxy", "keys", *args, "--config", str(proc.config_path)],
                              capture_output=True, text=True, timeout=30)

    shown = await asyncio.to_thread(keys, "show", "Bearer alice", "cli-key-7", "--credential")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["state"] == "completed"
    released = await asyncio.to_thread(keys, "release", ALICE, "cli-key-7")
    assert released.returncode == 0 and json.loads(released.stdout)["deleted"] is True
    gone = await asyncio.to_thread(keys, "show", ALICE, "cli-key-7")
    assert gone.returncode == 1 and "404" in gone.stderr

    proc.stop()
    lines = [json.loads(line) for line in proc.log_path.read_text().splitlines() if line.startswith("{")]
    text = proc.log_path.read_text()
    assert "cli-key-7" not in text and "Bearer alice" not in text and TOKEN not in text
    start = next(line for line in lines if "effective config" in line["msg"])
    assert '"token":"***"' in start["msg"]
    access = next(line for line in lines if line["logger"] == "idemproxy.access")
    assert access["outcome"] == "forwarded" and access["status"] == 201 and access["tenant"] == ALICE
    assert access["key_hash"] == hashlib.sha256(b"cli-key-7").hexdigest()[:12]
    assert {"duration_ms", "upstream_ms", "route"} <= access.keys()
    actions = [line["admin_action"] for line in lines if "admin_action" in line]
    assert actions == ["show", "delete", "show"]


@pytest.mark.parametrize("tenant", [{"hash": False}, {"from": "static", "static": "shop-1"}])
async def test_cli_credential_names_the_tenant_as_the_proxy_does(
    upstream: RecordingUpstream, tmp_path: Any, proxy_process: Callable[..., ProxyProcess], tenant: dict[str, Any]
) -> None:
    """``--credential`` makes the tenant id the proxy makes: hashed only under ``tenant.hash`` (the default),
    the static id under ``from: static``."""
    config = {"upstream": {"url": upstream.url}, "admin": {"token": TOKEN}, "tenant": tenant,
              "storage": {"embedded": {"path": str(tmp_path / "t.sqlite3")}}}
    proc = await executed_as_alice(proxy_process(config), "k-9")
    shown = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "idemproxy", "keys", "show", "Bearer alice", "k-9", "--credential",
                         "--config", str(proc.config_path)], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["tenant"] == ("Bearer alice" if tenant.get("hash") is False else "shop-1")


async def test_a_release_with_no_durable_record_left_still_purges_redis(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, admin_for: Any
) -> None:
    """A release that failed between its two Redis purges (the durable record deleted, then Redis refused the
    second purge: a 503 that says to retry) may leave a copy a concurrent read put back in Redis. The retry finds
    no durable record, answers 404, and must still purge that copy, or it would answer for replay_cache_ttl."""
    proxy = await make_proxy("redis", admin={"token": TOKEN})
    resp, _ = await proxy.post("/v1/charges", key="half", body=CHARGE, tenant="Bearer alice")
    assert resp.status == 201
    again, _ = await proxy.post("/v1/charges", key="half", body=CHARGE, tenant="Bearer alice")
    assert again.headers["Idempotent-Replayed"] == "true"  # (Redis holds its copy)
    store = proxy.proxy.store
    assert isinstance(store, RedisFrontedStore)
    assert await store.durable.forget(ALICE, "half")  # the delete landed; the last purge did not
    admin = await admin_for(proxy)
    status, body = await admin.call("DELETE", ALICE, "half")
    assert status == 404 and body["code"] == "not_found"
    fresh, _ = await proxy.post("/v1/charges", key="half", body=CHARGE, tenant="Bearer alice")
    assert fresh.status == 201 and fresh.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="half") == 2
    # What the 404 did clears copies only: a record created after the release read none is not deleted under it.
    await store.clear_copies(ALICE, "half")
    kept, _ = await proxy.post("/v1/charges", key="half", body=CHARGE, tenant="Bearer alice")
    assert kept.headers["Idempotent-Replayed"] == "true" and upstream.count(key="half") == 2


async def test_a_release_that_found_no_record_deletes_none_created_meanwhile(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, admin_for: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release reads the record, then deletes it. A request that lands in between must not lose its record
    under a 404 that says nothing was found (its retry would execute again)."""
    proxy = await make_proxy("redis", admin={"token": TOKEN})
    store = proxy.proxy.store
    read = store.get

    async def read_then_a_request_lands(tenant: str, key: str) -> Any:
        record = await read(tenant, key)
        resp, _ = await proxy.post("/v1/charges", key="late", body=CHARGE, tenant="Bearer alice")
        assert resp.status == 201
        return record

    admin = await admin_for(proxy)
    monkeypatch.setattr(store, "get", read_then_a_request_lands)
    status, _ = await admin.call("DELETE", ALICE, "late")
    monkeypatch.undo()
    assert status == 404
    retry, _ = await proxy.post("/v1/charges", key="late", body=CHARGE, tenant="Bearer alice")
    assert retry.headers["Idempotent-Replayed"] == "true" and upstream.count(key="late") == 1


@pytest.mark.parametrize("raw", [
    b"GET /admin/keys/t/k HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer " + TOKEN.encode() + b"\x01x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: a\r\nX-Big: " + b"x" * 20_000 + b"\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
], ids=["control-byte-in-token", "oversized-header", "http2-preface"])
async def test_a_request_the_admin_port_refuses_gets_a_problem_no_banner_and_no_echo(
    make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture, raw: bytes
) -> None:
    """aiohttp answered these itself on the admin port: text/plain with its Server banner, quoting the refused
    line (the admin token) in the body, and logging it with a traceback at ERROR."""
    proxy = await make_proxy("embedded", admin={"token": TOKEN})
    runner = AdminRunner(proxy.proxy.admin_app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        with caplog.at_level(logging.DEBUG):
            resp = await send_raw(f"http://127.0.0.1:{port}", raw)
        assert resp.status == 400 and resp.headers["content-type"] == "application/problem+json"
        assert "server" not in resp.headers and json.loads(resp.body)["code"] == "bad_request"
        assert TOKEN not in resp.body.decode() and TOKEN not in caplog.text and "ERROR" not in caplog.text
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/healthz") as ok:
            assert ok.status == 200 and "Server" not in ok.headers  # routed answers as before
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("token", [TOKEN, ""])
async def test_a_path_or_method_the_admin_port_has_not_is_a_problem(
    make_proxy: ProxyFactory, admin_for: Any, token: str
) -> None:
    """aiohttp's router answered these as text/plain ("404: Not Found"), where every other error of the proxy is
    application/problem+json."""
    proxy = await make_proxy("embedded", admin={"token": token})
    admin = await admin_for(proxy)
    unknown = ["/nope", "/admin/keys/t", "/healthz/x"] + ([] if token else ["/admin/keys/t/k"])
    wrong = [("POST", "/healthz", "GET, HEAD"), ("DELETE", "/metrics", "GET, HEAD"), ("PUT", "/readyz", "GET, HEAD")]
    wrong += [("PUT", "/admin/keys/t/k", "DELETE, GET, HEAD")] if token else []
    calls = [("GET", path, None) for path in unknown] + wrong
    for method, path, allowed in calls:
        async with admin.session.request(method, admin.server.make_url(path),
                                         headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.headers["Content-Type"] == "application/problem+json", (method, path)
            problem = await resp.json(content_type=None)
            assert resp.headers["Idemproxy-Admin"] == "1" and "Server" not in resp.headers
        status, code = (404, "unknown_path") if allowed is None else (405, "method_not_allowed")
        assert resp.status == problem["status"] == status and problem["code"] == code, (method, path, problem)
        assert problem["type"] == "urn:idemproxy:problem:" + code.replace("_", "-") and problem["title"]
        assert problem["detail"], problem
        if allowed is not None:
            assert resp.headers["Allow"] == allowed  # (RFC 9110 §15.5.6: a 405 names what is allowed)
    # what the admin port serves is answered as before
    for path, content_type in (("/healthz", "application/json"), ("/readyz", "application/json"),
                               ("/metrics", "text/plain")):
        async with admin.session.get(admin.server.make_url(path)) as resp:
            assert resp.status == 200 and resp.content_type == content_type, path
