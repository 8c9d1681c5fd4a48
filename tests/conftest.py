"""Fixtures shared by every test: real Redis, real PostgreSQL, a real upstream, proxies in and out of process.

IDEMPROXY_TEST_REDIS_URL / IDEMPROXY_TEST_POSTGRES_DSN (an admin DSN) point the suite at existing servers;
without them the run starts its own. Each run uses its own database and Redis key prefix and removes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
import pytest
import redis as sync_redis
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestServer

from idemproxy.app import Proxy
from idemproxy.config import Config, load_config
from tests.proxyproc import ProxyProcess
from tests.servers import PostgresServer, RedisServer
from tests.upstream import RecordingUpstream

BACKENDS = ("redis", "postgres", "embedded")  # "redis" = Redis in front of PostgreSQL


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("IDEMPROXY_TEST_REDIS_URL")
    if url:
        yield url
        return
    server = RedisServer()
    server.start()
    yield server.url
    server.destroy()


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    dsn = os.environ.get("IDEMPROXY_TEST_POSTGRES_DSN")
    if dsn:
        yield dsn
        return
    server = PostgresServer()
    server.start()
    yield server.admin_dsn
    server.destroy()


def _admin_sql(admin_dsn: str, sql: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(admin_dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


@contextlib.contextmanager
def scratch_database(admin_dsn: str, prefix: str, before_drop: Callable[[], None] = lambda: None) -> Iterator[str]:
    """A new database on the server of ``admin_dsn``; yields its DSN and drops it afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    _admin_sql(admin_dsn, f"CREATE DATABASE {name}")
    try:
        yield urlunsplit(urlsplit(admin_dsn)._replace(path=f"/{name}"))  # (a query may hold paths: sslrootcert)
    finally:
        before_drop()
        _admin_sql(admin_dsn, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def pg_dsn(pg_admin_dsn: str) -> Iterator[str]:
    """A database of this run's own, dropped at the end."""
    with scratch_database(pg_admin_dsn, "idemproxy_test") as dsn:
        yield dsn


@pytest.fixture(scope="session")
def pg_one_table_dsn(pg_admin_dsn: str) -> Iterator[str]:
    """A database of this run's own for the single-table layout (`partitions: none`), dropped at the end."""
    with scratch_database(pg_admin_dsn, "idemproxy_one") as dsn:
        yield dsn


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"idemtest:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = sync_redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


async def empty_records(dsn: str) -> str:
    """Empty the records table of ``dsn`` (if it exists); returns ``dsn``."""
    conn = await asyncpg.connect(dsn)
    try:
        exists = await conn.fetchval("SELECT to_regclass('idemproxy_records') IS NOT NULL")
        if exists:
            await conn.execute("TRUNCATE idemproxy_records")
    finally:
        await conn.close()
    return dsn


@pytest.fixture
async def clean_pg(pg_dsn: str) -> str:
    """The run's database with an empty records table."""
    return await empty_records(pg_dsn)


StorageFactory = Callable[[str], dict[str, Any]]


@pytest.fixture
def storage(clean_pg: str, redis_url: str, redis_prefix: str, tmp_path: Path) -> StorageFactory:
    """The ``storage:`` config section for a backend name."""

    def make(backend: str) -> dict[str, Any]:
        if backend == "embedded":
            return {"embedded": {"path": str(tmp_path / "store.sqlite3")}}
        section: dict[str, Any] = {"postgres": {"dsn": clean_pg, "pool_min": 1, "pool_max": 10}}
        if backend == "redis":
            section["redis"] = {"url": redis_url, "key_prefix": redis_prefix}
        return section

    return make


@contextlib.asynccontextmanager
async def recording_upstream() -> AsyncIterator[RecordingUpstream]:
    """A RecordingUpstream on a real port, its hanging requests let go and the server closed afterwards."""
    recorder = RecordingUpstream()
    server = TestServer(recorder.app(), host="127.0.0.1")
    await server.start_server()
    recorder.url = str(server.make_url("")).rstrip("/")
    try:
        yield recorder
    finally:
        recorder.release_hangs()
        await server.close()


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with recording_upstream() as recorder:
        yield recorder


def build_config(upstream_url: str, storage_section: dict[str, Any], **sections: Any) -> Config:
    raw: dict[str, Any] = {
        "upstream": {"url": upstream_url, "timeout": "5s", "connect_timeout": "2s"},
        "tenant": {"from": "header", "header": "Authorization", "required": True},
        "storage": storage_section,
        "log": {"access": "off"},
    }
    for name, value in sections.items():
        raw[name] = {**raw.get(name, {}), **value} if isinstance(value, dict) else value
    return load_config(raw)


class ProxyTestServer(BaseTestServer):
    """A Proxy's port (``Proxy.runner``: aiohttp's low-level server) on a free local port, opened and stopped
    as ``idemproxy serve`` does."""

    def __init__(self, proxy: Proxy, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.proxy = proxy

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        # aiohttp's test server cancels a handler whose client hung up; `serve` does not (aiohttp's default), so
        # neither do these: a handler goes on after its client is gone, as in production.
        kwargs.pop("handler_cancellation", None)
        return self.proxy.runner(**kwargs)


class RunningProxy:
    """An in-process proxy on a real port, with a client session pointed at it."""

    def __init__(self, proxy: Proxy, server: ProxyTestServer, session: aiohttp.ClientSession) -> None:
        self.proxy = proxy
        self.server = server
        self.session = session
        self.url = str(server.make_url("")).rstrip("/")

    @property
    def port(self) -> int:
        assert self.server.port is not None
        return self.server.port

    async def post(self, path: str, *, key: str | None = None, tenant: str | None = "Bearer t1",
                   body: Any = None, headers: dict[str, str] | None = None,
                   method: str = "POST") -> tuple[aiohttp.ClientResponse, bytes]:
        send = dict(headers or {})
        if key is not None:
            send["Idempotency-Key"] = key
        if tenant is not None:
            send["Authorization"] = tenant
        data = body if isinstance(body, bytes | str | type(None)) else None
        json_body = None if data is not None or body is None else body
        async with self.session.request(method, self.url + path, headers=send, data=data,
                                        json=json_body) as resp:
            return resp, await resp.read()


ProxyFactory = Callable[..., Awaitable[RunningProxy]]


@pytest.fixture
async def make_proxy(
    upstream: RecordingUpstream, storage: StorageFactory
) -> AsyncIterator[ProxyFactory]:
    running: list[RunningProxy] = []

    async def make(backend: str = "redis", *, storage_section: dict[str, Any] | None = None,
                   **sections: Any) -> RunningProxy:
        section = storage_section if storage_section is not None else storage(backend)
        config = build_config(sections.pop("upstream_url", upstream.url), section, **sections)
        proxy = Proxy(config)
        server = ProxyTestServer(proxy, host="127.0.0.1")
        await server.start_server()
        # The sweep a proxy runs as it starts, and its first store check (a ping), are over before the test's first
        # request: a test counting store statements, round trips or expired records counts its own, and the pool is
        # the test's alone. (A ping that came late, behind the sweep, was counted as a third statement of a first
        # request in test_round_trips_on_postgres_alone, once.)
        async with asyncio.timeout(30):
            await proxy.first_sweep_done.wait()
            await proxy.first_probe_done.wait()
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200))
        item = RunningProxy(proxy, server, session)
        running.append(item)
        return item

    yield make
    for item in running:
        await item.session.close()
        upstream.release_hangs()
        await item.server.close()


@pytest.fixture
def proxy_process(tmp_path: Path) -> Iterator[Callable[..., ProxyProcess]]:
    started: list[ProxyProcess] = []

    def make(config: dict[str, Any], name: str = "proxy") -> ProxyProcess:
        process = ProxyProcess(config, tmp_path, name)
        started.append(process)
        return process

    yield make
    for process in started:
        process.stop()


@pytest.fixture(scope="session")
def own_redis() -> Iterator[RedisServer]:
    """A Redis this run may stop and start (fault tests)."""
    server = RedisServer()
    server.start()
    yield server
    server.destroy()


@pytest.fixture(scope="session")
def own_pg() -> Iterator[PostgresServer]:
    """A PostgreSQL this run may stop and start (fault tests)."""
    server = PostgresServer()
    server.start()
    yield server
    server.destroy()


@pytest.fixture
def own_pg_dsn(own_pg: PostgresServer) -> Iterator[str]:
    """A fresh database on the stoppable PostgreSQL; the server is running again when the test ends."""
    with database_on(own_pg, "idemproxy_fault") as dsn:
        yield dsn


@contextlib.contextmanager
def database_on(server: PostgresServer, prefix: str) -> Iterator[str]:
    """A fresh database on ``server``, which a test may stop: it is running again before the database is dropped."""

    def restart() -> None:
        if not server.running():
            server.start()

    with scratch_database(server.admin_dsn, prefix, before_drop=restart) as dsn:
        yield dsn


@pytest.fixture
def running_redis(own_redis: RedisServer) -> Iterator[RedisServer]:
    """The stoppable Redis, emptied, and running again when the test ends."""
    if own_redis.proc is None:
        own_redis.start()
    sync_redis.Redis.from_url(own_redis.url).flushall()
    yield own_redis
    if own_redis.proc is None:
        own_redis.start()
