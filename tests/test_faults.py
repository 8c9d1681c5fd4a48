"""Faults on real servers this run owns: Redis and PostgreSQL stopped under a running proxy.

Also the round-trip budget per path, counted on the servers' side of the wire (Redis commandstats) and by the
driver (statements sent to PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import json
import logging
import os
import sqlite3
import struct
import termios
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
import pytest
import redis as sync_redis
from aiohttp.test_utils import TestServer

from idemproxy.config import PostgresConfig, SecretURL
from idemproxy.problems import StoreUnavailable
from idemproxy.store.embedded import EmbeddedStore
from idemproxy.store.postgres import MAINTAIN_LOCK, MIGRATION_LOCK, PostgresStore, _count_at_most, migration_connection
from idemproxy.store.redis import LOCK_MAX, YOUNG_LOCK, RedisFrontedStore
from tests.conftest import ProxyFactory, RunningProxy, _admin_sql, database_on, empty_records
from tests.netns import drop, private_network
from tests.relay import Relay
from tests.servers import NoTlsServer, PostgresServer, RedisServer, make_tls_files
from tests.test_concurrency import fire
from tests.test_settle import until, until_async, via
from tests.upstream import RecordingUpstream

CHARGE = {"amount": 1000, "currency": "eur"}


def pg_section(dsn: str, **extra: Any) -> dict[str, Any]:
    return {"postgres": {"dsn": dsn, "pool_min": 1, "pool_max": 10}, **extra}


def redis_section(redis: RedisServer, pg_dsn: str) -> dict[str, Any]:
    return pg_section(pg_dsn, redis={"url": redis.url, "key_prefix": "fault:"})


def redis_round_trips(redis: RedisServer) -> int:
    """Script calls the proxy sent (commandstats also counts the commands a script runs inside Redis, and
    per request the proxy sends nothing but scripts)."""
    stats = sync_redis.Redis.from_url(redis.url).info("commandstats")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval"))


def durable(proxy: RunningProxy) -> PostgresStore:
    store = proxy.proxy.store
    inner = store.durable if isinstance(store, RedisFrontedStore) else store
    assert isinstance(inner, PostgresStore)
    return inner


async def readyz(proxy: RunningProxy) -> tuple[int, dict[str, Any]]:
    admin = TestServer(proxy.proxy.admin_app(), host="127.0.0.1")
    await admin.start_server()
    try:
        async with aiohttp.ClientSession() as session, session.get(admin.make_url("/readyz")) as resp:
            return resp.status, await resp.json()
    finally:
        await admin.close()


def store_errors(proxy: RunningProxy, operation: str) -> float:
    """idemproxy_store_errors_total for PostgreSQL (the series exists from the first call: read its value)."""
    value = proxy.proxy.metrics.registry.get_sample_value(
        "idemproxy_store_errors_total", {"backend": "postgres", "operation": operation})
    return value or 0.0


async def wait_store_ok(proxy: RunningProxy, backend: str, timeout: float = 15) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (await readyz(proxy))[1]["stores"].get(backend) != "ok" and loop.time() < deadline:
        await asyncio.sleep(0.1)


async def test_ready_requires_store_takes_the_replica_out_while_postgres_is_down(
    make_proxy: ProxyFactory, own_pg: PostgresServer, own_pg_dsn: str
) -> None:
    proxy = await make_proxy(storage_section=pg_section(own_pg_dsn), admin={"ready_requires_store": True})
    assert (await readyz(proxy))[0] == 200
    await asyncio.to_thread(own_pg.stop)
    status, ready = await readyz(proxy)
    assert (status, ready["status"], ready["stores"]) == (503, "store_unavailable", {"postgres": "unavailable"})
    await asyncio.to_thread(own_pg.start)
    await wait_store_ok(proxy, "postgres")
    assert (await readyz(proxy))[0] == 200


async def test_ready_requires_store_takes_the_replica_out_while_another_process_locks_the_embedded_file(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """Every claim fails after its busy wait while another process holds the file's write lock; the health
    check said "ok" all along (its ``SELECT 1`` never touched the file)."""
    proxy = await make_proxy("embedded", admin={"ready_requires_store": True})
    assert (await readyz(proxy))[0] == 200
    assert isinstance(proxy.proxy.store, EmbeddedStore)
    intruder = sqlite3.connect(proxy.proxy.store.path, isolation_level=None, check_same_thread=False)
    try:
        intruder.execute("BEGIN EXCLUSIVE")
        status, ready = await readyz(proxy)
        assert (status, ready["stores"]) == (503, {"embedded": "unavailable"})
        await proxy.proxy.check_stores()
        assert 'idemproxy_store_up{backend="embedded"} 0.0' in proxy.proxy.metrics.render().decode()
        intruder.execute("ROLLBACK")
    finally:
        intruder.close()
    store = proxy.proxy.store

    def busy_timeout() -> int:
        assert store._db is not None
        return int(store._db.execute("PRAGMA busy_timeout").fetchone()[0])

    assert await store._run("test", busy_timeout) == 5000  # claims wait as long as before the probes
    status, ready = await readyz(proxy)
    assert (status, ready["stores"]) == (200, {"embedded": "ok"})
    assert (await proxy.post("/v1/charges", key="after-lock", body=CHARGE))[0].status == 201


async def test_claims_queued_while_another_process_locks_the_embedded_file_get_503_within_the_busy_wait(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """Claims queued behind a batch waiting out its 5 s busy wait for the write lock must not wait a whole one more
    (10 s before their 503 in the audit's run)."""
    proxy = await make_proxy("embedded")
    store = proxy.proxy.store
    assert isinstance(store, EmbeddedStore)
    intruder = sqlite3.connect(store.path, isolation_level=None, check_same_thread=False)

    try:
        intruder.execute("BEGIN EXCLUSIVE")
        first = asyncio.ensure_future(timed_post(proxy, "waiting"))
        await until(lambda: store._committing and not store._queued)  # its batch is in the busy wait
        queued = await asyncio.gather(*(timed_post(proxy, f"queued-{i}") for i in range(3)))
        results = [await first, *queued]
    finally:
        intruder.execute("ROLLBACK")
        intruder.close()
    assert all(status == 503 for status, _ in results), results
    assert max(took for _, took in results) < 6, results
    assert (await proxy.post("/v1/charges", key="after-lock", body=CHARGE))[0].status == 201
    assert upstream.count() == 1


async def test_an_embedded_file_deleted_under_the_proxy_is_a_store_failure_not_a_store(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """Unlinked under a running proxy, the SQLite file took every write and lost all of them at the next start:
    answers were "stored" and /readyz said ok, then every key executed again after a restart (audit,
    2026-11-27). The file opened must still be the one at the path: else claims are 503 and the store is down."""
    proxy = await make_proxy("embedded", admin={"ready_requires_store": True})
    assert (await proxy.post("/v1/charges", key="before", body=CHARGE))[0].status == 201
    store = proxy.proxy.store
    assert isinstance(store, EmbeddedStore)
    for path in (store.path, f"{store.path}-wal", f"{store.path}-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    resp, body = await proxy.post("/v1/charges", key="after", body=CHARGE)
    assert resp.status == 503 and json.loads(body)["code"] == "store_unavailable"
    assert upstream.count(key="after") == 0
    status, ready = await readyz(proxy)
    assert (status, ready["stores"]) == (503, {"embedded": "unavailable"})
    assert caplog.text.count("the file was removed or replaced while open") == 1


async def test_a_hung_postgres_leaves_redis_named_in_readyz(
    make_proxy: ProxyFactory, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    """Asked one after the other under one bound, a PostgreSQL that does not answer hid the Redis that does."""
    parts = urlsplit(clean_pg)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        proxy = await make_proxy(storage_section=pg_section(
            via(relay, clean_pg), redis={"url": redis_url, "key_prefix": redis_prefix}))
        assert (await readyz(proxy))[1]["stores"] == {"postgres": "ok", "redis": "ok"}
        relay.stall()
        status, ready = await readyz(proxy)
        assert (status, ready["stores"]) == (200, {"postgres": "unavailable (no answer)", "redis": "ok"})
        relay.restore()


@pytest.mark.parametrize("fault", ["out_of_memory", "paused"])
async def test_a_lock_a_failed_settle_left_never_answers_409_for_a_completed_key(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, running_redis: RedisServer, clean_pg: str, fault: str
) -> None:
    """Redis failed just as the completion dropped its lock: out of memory (noeviction refused the replay copy's
    SET, which ended the script before its DEL), or paused for writes (the script timed out). The lock stayed
    until it expired (LOCK_MAX, 10 s), and every retry answered 409 in_flight from Redis alone while PostgreSQL
    held the key completed (guarantee 4). Now the lock goes first, and one a settle could not drop is dropped
    in the background once Redis answers."""
    proxy = await make_proxy(storage_section={**redis_section(running_redis, clean_pg), "replay_memory": 0})
    store = proxy.proxy.store
    assert isinstance(store, RedisFrontedStore)
    client = sync_redis.Redis.from_url(running_redis.url)
    lock = store._keys(proxy.proxy.engine.resolve_tenant_value("Bearer t1"), "stale")[0]
    first = asyncio.ensure_future(proxy.post("/v1/charges", key="stale", body=CHARGE,
                                             headers={"X-Test-Delay": "0.6"}))
    while upstream.count(key="stale") == 0:
        await asyncio.sleep(0.01)
    assert client.exists(lock)
    if fault == "out_of_memory":
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
    else:
        client.client_pause(1500, all=False)  # writes (and scripts) wait; reads go on
    resp, _ = await first
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    if fault == "out_of_memory":
        assert not client.exists(lock)  # dropped by the settle itself, before its answer went out
        client.config_set("maxmemory", 0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5  # the lock itself would stand for 10 s from the claim
    while client.exists(lock) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert not client.exists(lock)
    again, _ = await proxy.post("/v1/charges", key="stale", body=CHARGE)
    assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert upstream.count(key="stale") == 1
    client.close()


async def test_a_completion_held_up_by_a_lock_past_its_timeout_never_lands_late_as_a_replay(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A completion that waited on a table lock past the client's 5 s kept waiting on the server after its
    connection was dropped, and committed when the lock lifted; the retry then found the key completed, took
    itself for refused, and the first-time client got its own answer marked as a replay. The server now
    cancels the statement first (statement_timeout 4.5 s)."""
    proxy = await make_proxy(storage_section=pg_section(clean_pg), idempotency={"settle_timeout": "20s"})
    keys = [f"locked-{i}" for i in range(5)]
    requests = [asyncio.ensure_future(proxy.post("/v1/charges", key=key, body=CHARGE,
                                                 headers={"X-Test-Delay": "0.5"})) for key in keys]
    while len(upstream.executed) < len(keys):  # every claim landed; the completions come in 0.5 s
        await asyncio.sleep(0.01)
    holder = await asyncpg.connect(clean_pg)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE idemproxy_records IN ACCESS EXCLUSIVE MODE")
            await asyncio.sleep(7)  # past the 5 s each completion attempt waits
        with caplog.at_level(logging.WARNING, "idemproxy"):
            answers = await asyncio.gather(*requests)
    finally:
        await holder.close()
    assert [(resp.status, resp.headers["Idempotent-Replayed"]) for resp, _ in answers] == [(201, "false")] * 5
    assert "taken over or released" not in caplog.text
    assert all(upstream.count(key=key) == 1 for key in keys)


async def test_redis_down_mid_run_costs_latency_never_correctness(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, running_redis: RedisServer, clean_pg: str
) -> None:
    # the in-process replay cache off: this test watches the Redis fast path itself come back
    proxy = await make_proxy(storage_section={**redis_section(running_redis, clean_pg), "replay_memory": 0})
    first, first_body = await proxy.post("/v1/charges", key="before", body=CHARGE)
    assert first.status == 201

    running_redis.stop()
    results = await fire([proxy.url], "during", n=20)
    assert upstream.count(key="during") == 1  # PostgreSQL alone decided
    assert Counter(status for status, _, _ in results) == {201: 1, 409: 19}
    again, again_body = await proxy.post("/v1/charges", key="before", body=CHARGE)
    assert again.headers["Idempotent-Replayed"] == "true" and again_body == first_body
    status, body = await readyz(proxy)
    assert status == 200 and body["stores"]["redis"].startswith("unavailable")

    running_redis.start()  # back, and empty
    # The breaker tries Redis again within a second; the first replay then refills the cache from PostgreSQL,
    # and from the next one on replays cost no SQL at all.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while loop.time() < deadline:
        statements = durable(proxy).statements
        await proxy.post("/v1/charges", key="before", body=CHARGE)
        if durable(proxy).statements == statements:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the Redis fast path did not come back")
    resp, _ = await proxy.post("/v1/charges", key="after", body=CHARGE)
    assert resp.status == 201
    statements = durable(proxy).statements
    resp, _ = await proxy.post("/v1/charges", key="after", body=CHARGE)
    assert resp.headers["Idempotent-Replayed"] == "true"
    assert durable(proxy).statements == statements  # replayed from Redis: the fast path is back
    assert upstream.count(key="after") == 1


async def test_postgres_down_fails_closed_and_nothing_reaches_the_upstream(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, own_pg: PostgresServer, own_pg_dsn: str
) -> None:
    proxy = await make_proxy(storage_section=pg_section(own_pg_dsn))
    assert (await proxy.post("/v1/charges", key="up", body=CHARGE))[0].status == 201
    own_pg.stop()
    resp, body = await proxy.post("/v1/charges", key="down", body=CHARGE)
    assert resp.status == 503
    problem = json.loads(body)
    assert problem["code"] == "store_unavailable"
    assert "127.0.0.1" not in body.decode() and str(own_pg.port) not in body.decode()
    assert upstream.count(key="down") == 0
    # The replica still accepts work (it answers 503 store_unavailable itself): ready, naming the store's state.
    status, ready = await readyz(proxy)
    assert status == 200 and ready["stores"]["postgres"] == "unavailable"
    assert 'idemproxy_store_up{backend="postgres"} 0.0' in proxy.proxy.metrics.render().decode()
    # uncovered traffic still flows
    plain, _ = await proxy.post("/v1/charges", method="GET")
    assert plain.status == 200

    own_pg.start()
    await wait_store_ok(proxy, "postgres")
    assert 'idemproxy_store_up{backend="postgres"} 1.0' in proxy.proxy.metrics.render().decode()
    resp, _ = await proxy.post("/v1/charges", key="down", body=CHARGE)
    assert resp.status == 201
    assert upstream.count(key="down") == 1
    assert store_errors(proxy, "claim") >= 1


async def test_postgres_down_fail_open_forwards_unguarded(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, own_pg: PostgresServer, own_pg_dsn: str
) -> None:
    proxy = await make_proxy(storage_section=pg_section(own_pg_dsn, on_store_error="fail_open"))
    await proxy.post("/v1/charges", key="warm", body=CHARGE)
    own_pg.stop()
    resp, _ = await proxy.post("/v1/charges", key="open", body=CHARGE, headers={"X-Test-Replayed": "true"})
    assert resp.status == 201
    assert resp.headers["Idempotency-Status"] == "unguarded"
    assert resp.headers.getall("Idempotent-Replayed") == ["false"]  # the proxy's own, not the upstream's
    assert upstream.count(key="open") == 1
    # (counted as the handler ends, which may come after the client has read the whole answer)
    await until(lambda: 'outcome="store_error"' in proxy.proxy.metrics.render().decode())


async def test_an_unguarded_forward_is_a_covered_request_in_flight(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, own_pg: PostgresServer, own_pg_dsn: str
) -> None:
    """idemproxy_in_flight_requests counts covered requests being forwarded: with fail_open during an outage,
    those are the unguarded ones (it read 0 while they were at the upstream)."""
    proxy = await make_proxy(storage_section=pg_section(own_pg_dsn, on_store_error="fail_open"))
    own_pg.stop()

    def in_flight() -> str:
        text = proxy.proxy.metrics.render().decode()
        return next(line for line in text.splitlines() if line.startswith("idemproxy_in_flight_requests "))

    pending = asyncio.ensure_future(proxy.post("/v1/charges", key="open-slow", body=CHARGE,
                                               headers={"X-Test-Delay": "1"}))
    await until(lambda: upstream.count(key="open-slow") == 1)
    assert in_flight() == "idemproxy_in_flight_requests 1.0"
    resp, _ = await pending
    assert resp.status == 201 and resp.headers["Idempotency-Status"] == "unguarded"
    await until(lambda: in_flight() == "idemproxy_in_flight_requests 0.0")


@pytest.mark.parametrize(("sent", "forwarded"), [
    ('"quoted"', "quoted"),
    # A key a bare header value cannot carry goes as an sf-string, as a guarded forward sends it: bare, `" k "`
    # reached the upstream as `k` (another key) and `"\"k"` as `"k` (an unclosed sf-string).
    ('" spaced "', '" spaced "'),
    ('"\\"first"', '"\\"first"'),
])
@pytest.mark.parametrize("forward_key", [True, False])
async def test_an_unguarded_forward_sends_the_key_as_a_guarded_one_would(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, own_pg: PostgresServer, own_pg_dsn: str,
    forward_key: bool, sent: str, forwarded: str,
) -> None:
    proxy = await make_proxy(storage_section=pg_section(own_pg_dsn, on_store_error="fail_open"),
                             upstream={"forward_key": forward_key})
    guarded, _ = await proxy.post("/v1/charges", key=sent, body=CHARGE)
    assert guarded.status == 201 and "Idempotency-Status" not in guarded.headers
    own_pg.stop()
    resp, _ = await proxy.post("/v1/charges", key=sent, body={"amount": 2})
    assert resp.status == 201 and resp.headers["Idempotency-Status"] == "unguarded"
    sent_upstream = [executed.headers.getall("Idempotency-Key", []) for executed in upstream.executed]
    assert sent_upstream == [[forwarded] if forward_key else []] * 2


async def test_round_trips_per_path(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, running_redis: RedisServer, clean_pg: str
) -> None:
    proxy = await make_proxy(storage_section=redis_section(running_redis, clean_pg))
    await proxy.post("/v1/charges", key="warm-up", body=CHARGE)  # scripts loaded, pool warm

    redis_before, pg_before = redis_round_trips(running_redis), durable(proxy).statements
    await proxy.post("/v1/charges", key="rt", body=CHARGE)
    first_redis = redis_round_trips(running_redis) - redis_before
    first_pg = durable(proxy).statements - pg_before

    redis_before, pg_before = redis_round_trips(running_redis), durable(proxy).statements
    resp, _ = await proxy.post("/v1/charges", key="rt", body=CHARGE)
    assert resp.headers["Idempotent-Replayed"] == "true"
    replay_redis = redis_round_trips(running_redis) - redis_before
    replay_pg = durable(proxy).statements - pg_before

    assert (first_redis, first_pg) == (2, 2), (first_redis, first_pg)
    assert (replay_redis, replay_pg) == (1, 0), (replay_redis, replay_pg)


async def test_round_trips_of_a_duplicate_in_flight(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, running_redis: RedisServer, clean_pg: str
) -> None:
    proxy = await make_proxy(storage_section=redis_section(running_redis, clean_pg))
    await proxy.post("/v1/charges", key="warm-up", body=CHARGE)
    first = asyncio.ensure_future(proxy.post("/v1/charges", key="dup", body=CHARGE, headers={"X-Test-Delay": "1.5"}))
    while upstream.count(key="dup") == 0:
        await asyncio.sleep(0.005)
    # A lock younger than YOUNG_LOCK sends its duplicates to PostgreSQL (its claim may not be decided yet); this
    # one's owner is upstream, and once the lock is older Redis alone answers.
    store = proxy.proxy.store
    assert isinstance(store, RedisFrontedStore)
    lock = store._keys(proxy.proxy.engine.resolve_tenant_value("Bearer t1"), "dup")[0]
    client = sync_redis.Redis.from_url(running_redis.url)
    try:
        await until(lambda: 0 < client.pttl(lock) < (LOCK_MAX - YOUNG_LOCK) * 1000)
    finally:
        client.close()
    redis_before, pg_before = redis_round_trips(running_redis), durable(proxy).statements
    resp, _ = await proxy.post("/v1/charges", key="dup", body=CHARGE)
    assert resp.status == 409
    assert (redis_round_trips(running_redis) - redis_before, durable(proxy).statements - pg_before) == (1, 0)
    await first


async def test_round_trips_on_postgres_alone(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str
) -> None:
    proxy = await make_proxy(storage_section=pg_section(clean_pg))
    await proxy.post("/v1/charges", key="warm-up", body=CHARGE)
    before = durable(proxy).statements
    await proxy.post("/v1/charges", key="pg-rt", body=CHARGE)
    first = durable(proxy).statements - before
    before = durable(proxy).statements
    resp, _ = await proxy.post("/v1/charges", key="pg-rt", body=CHARGE)
    assert resp.headers["Idempotent-Replayed"] == "true"
    # claim + complete; the NOTIFY that wakes wait-mode waiters rides inside the complete statement
    assert (first, durable(proxy).statements - before) == (2, 1), first


async def test_postgres_dies_while_the_upstream_executes(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, own_pg: PostgresServer, own_pg_dsn: str
) -> None:
    """PostgreSQL crashes and restarts while the upstream executes: the client waits (settle_timeout) and gets the
    answer only once it is stored; a retry replays it; one execution."""
    proxy = await make_proxy(storage_section=pg_section(own_pg_dsn), idempotency={"settle_timeout": "20s"})
    pending = asyncio.ensure_future(
        proxy.post("/v1/charges", key="mid", body=CHARGE, headers={"X-Test-Delay": "0.5"})
    )
    while upstream.count(key="mid") == 0:
        await asyncio.sleep(0.005)
    await asyncio.to_thread(own_pg.stop)
    await asyncio.sleep(0.8)  # the upstream has answered; the completion is being retried
    assert not pending.done()
    await asyncio.to_thread(own_pg.start)
    resp, body = await pending
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    assert store_errors(proxy, "complete") >= 1
    retry, retry_body = await proxy.post("/v1/charges", key="mid", body=CHARGE)
    assert retry.status == 201 and retry.headers["Idempotent-Replayed"] == "true" and retry_body == body
    assert upstream.count(key="mid") == 1


# ------------------------------------------------------------- every store failure is a 503, never a 500


async def assert_503_then_recovers(proxy: RunningProxy, key: str, lift: Callable[[], Awaitable[None]]) -> None:
    resp, body = await proxy.post("/v1/charges", key=key, body=CHARGE)
    assert resp.status == 503 and json.loads(body)["code"] == "store_unavailable", (resp.status, body)
    await lift()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while True:  # broken connections were discarded: the pool serves again once the fault is gone
        resp, _ = await proxy.post("/v1/charges", key=key, body=CHARGE)
        if resp.status == 201 or loop.time() > deadline:
            break
        # 409: a claim whose answer was lost may have landed once the network let it through; it is released in
        # the background, or taken over after the (short) lease
        assert resp.status in (503, 409)
        await asyncio.sleep(0.1)
    assert resp.status == 201


@pytest.mark.parametrize("mode", ["immediate", "fast"])
async def test_postgres_shutdown_is_503(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, own_pg: PostgresServer, own_pg_dsn: str, mode: str
) -> None:
    proxy = await make_proxy(storage_section=pg_section(own_pg_dsn))
    assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201  # pooled connections
    await asyncio.to_thread(own_pg.stop, mode)
    await assert_503_then_recovers(proxy, f"down-{mode}", lambda: asyncio.to_thread(own_pg.start))
    assert upstream.count(key=f"down-{mode}") == 1


@pytest.mark.parametrize("fault", ["cut", "stall"])
async def test_connection_cut_or_stalled_is_503(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, fault: str
) -> None:
    parts = urlsplit(clean_pg)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432) as relay:
        proxy = await make_proxy(storage_section=pg_section(via(relay, clean_pg)),
                                 upstream={"timeout": "1s"}, idempotency={"lease": "3s"})
        assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
        relay.cut() if fault == "cut" else relay.stall()

        async def lift() -> None:
            relay.restore()

        await assert_503_then_recovers(proxy, f"net-{fault}", lift)
    assert upstream.count(key=f"net-{fault}") == 1


async def test_claims_queued_behind_a_stalled_postgres_get_503_within_the_operation_timeout(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str
) -> None:
    """More concurrent claims than batches on the wire: those queued behind the stalled batches must not wait for
    them to time out first and then for their own statement (10 s in the audit's run), but get their 503 within
    the store's 5 s operation timeout as the others do."""
    parts = urlsplit(clean_pg)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432) as relay:
        proxy = await make_proxy(storage_section=pg_section(via(relay, clean_pg)),
                                 upstream={"timeout": "1s"}, idempotency={"lease": "3s"})
        assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
        relay.stall()

        store = proxy.proxy.store
        assert isinstance(store, PostgresStore)
        sent = store._claims.batches
        first = [asyncio.ensure_future(timed_post(proxy, f"on-the-wire-{i}")) for i in range(2)]
        await until(lambda: store._claims.batches == sent + 2)  # both batches of claims stalled on the wire
        queued = await asyncio.gather(*(timed_post(proxy, f"queued-{i}") for i in range(3)))
        results = [*(await asyncio.gather(*first)), *queued]
        relay.restore()
    assert all(status == 503 for status, _ in results), results
    assert max(took for _, took in results) < 6, results
    assert upstream.count() == 1  # the warm-up only


async def test_a_failover_that_left_the_old_server_dark_fails_the_request_that_found_it_and_no_other(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str
) -> None:
    """The address moved to a new server and the old one went dark: its packets dropped, no reset (a VIP or DNS
    moved, the old host powered off). Each pooled connection to it was found only by its own 5 s timeout when next
    used: the request right after the first 503, and each of a burst that reached deeper into the pool, were 503
    after 5 s too (audit: 8 of 9), though the first timeout had shown the server gone. Now the pool replaces its
    connections after that first timeout: new ones reach the new server. The LISTEN connection finds the silence
    by its own sign of life and listens on the new server."""
    parts = urlsplit(clean_pg)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        proxy = await make_proxy(storage_section={"postgres": {"dsn": via(relay, clean_pg), "pool_min": 10,
                                                               "pool_max": 10}})
        store = durable(proxy)
        assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
        await until(lambda: store._pool.get_size() == 10 and store.notifications_live())
        listener = store._listener
        relay.strand()  # every connection open now goes silent for good; new ones reach the server
        assert relay.stranded == 11
        status, took = await timed_post(proxy, "found-it")
        assert status == 503 and took >= 4.9, (status, took)  # its connection was dead: nothing told it sooner
        after = [await timed_post(proxy, "next"),
                 *await asyncio.gather(*(timed_post(proxy, f"burst-{n}") for n in range(8)))]
        assert [status for status, _ in after] == [201] * 9, after
        await until(lambda: store.notifications_live() and store._listener is not listener)
        # the claim that found it may have landed (its answer lost): released in the background, on a new connection
        await until(lambda: proxy.proxy.metrics.registry.get_sample_value("idemproxy_pending_settles") == 0)
    assert upstream.count(key="found-it") == 0
    assert all(upstream.count(key=key) == 1 for key in ["next", *(f"burst-{n}" for n in range(8))])


async def test_pooled_connections_to_a_server_gone_dark_are_closed_before_a_request_finds_them(clean_pg: str) -> None:
    """The same failover with the old server dark for real: the kernel drops every packet of the connections made
    to it, as a host powered off would. Nothing told the pool: its idle connections stood until a request used
    each one and waited out its 5 s. With TCP keepalive the kernel finds them silent within seconds and closes
    them, so no request pays: the next ones open new connections, which reach the new server."""
    parts = urlsplit(clean_pg)
    with private_network(), Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        store = PostgresStore(PostgresConfig(dsn=SecretURL(via(relay, clean_pg)), pool_min=5, pool_max=5),
                              listen=True)
        await store.open()
        try:
            await until(lambda: store._pool.get_size() == 5 and store.notifications_live())
            listener, accepted = store._listener, relay.accepted
            drop(relay.client_ports())  # the pool's and the LISTEN connection: dark; new ones pass
            # closed by the kernel with no request asking, and opened anew by the pool (pool_min) and the listener
            await until(lambda: relay.accepted >= accepted + 6, timeout=15)
            loop = asyncio.get_running_loop()
            began = loop.time()
            claims = await asyncio.gather(*(store.claim("t", f"after-{n}", "fp", lease=5, ttl=60) for n in range(5)))
            assert all(claim.owned for claim in claims) and loop.time() - began < 2
            await until(lambda: store.notifications_live() and store._listener is not listener)
        finally:
            await store.close()


@pytest.mark.parametrize("whose", ["a replica's", "idemproxy migrate's", "the LISTEN connection's"])
async def test_a_client_gone_dark_holding_a_session_lock_is_let_go_by_the_server(whose: str) -> None:
    """Partition maintenance holds a session-level advisory lock on a pooled connection, and the migrations hold
    one, at a replica's start or in `idemproxy migrate` (on a connection of its own). Should that client go dark
    (a host powered off, a network partition: packets dropped, no reset), the server, hearing nothing, kept the
    session and its lock until its own TCP keepalive gave up, two hours by default: no other replica could
    maintain the partitions, nor start while it waited for the migration lock. Each of those connections now sets
    the server's keepalive on its session as the proxy sets its own (a probe after 2 s idle, then every second, 3
    unanswered: about 5 s), so the server lets the session go. The LISTEN connection (PostgreSQL alone) holds no
    lock, only a connection slot: its session is looked for instead."""
    with private_network():
        server = PostgresServer()  # started from this thread: it lives in the private network, dropped packets too
        server.start()
        try:
            config = PostgresConfig(dsn=SecretURL(server.admin_dsn), pool_min=1, pool_max=2)
            store = PostgresStore(config, listen=whose == "the LISTEN connection's")
            await store.open()
            other = await asyncpg.connect(server.admin_dsn)
            try:
                async with contextlib.AsyncExitStack() as stack:
                    if whose == "the LISTEN connection's":
                        await until(lambda: store.notifications_live())
                        raw = store._listener
                        pid = raw.get_server_pid()

                        async def let_go() -> bool:
                            return not await other.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                                                            pid)
                    else:
                        if whose == "a replica's":
                            conn, lock = await stack.enter_async_context(store._pool.acquire()), MAINTAIN_LOCK
                            raw = conn._con
                        else:
                            conn = raw = await migration_connection(config)
                            lock = MIGRATION_LOCK
                        await conn.execute("SELECT pg_advisory_lock($1)", lock)

                        async def let_go() -> bool:
                            return bool(await other.fetchval("SELECT pg_try_advisory_lock($1)", lock))

                    assert not await let_go()
                    drop([raw._transport.get_extra_info("sockname")[1]])  # that client's session: dark
                    loop = asyncio.get_running_loop()
                    began = loop.time()
                    await until_async(let_go, timeout=20)
                    assert loop.time() - began < 12
                    if not raw.is_closed():
                        raw.terminate()  # (dark: a polite close would wait for an answer)
            finally:
                await other.close()
                await store.close()
        finally:
            server.destroy()


async def test_a_keepalive_setting_the_server_cannot_read_is_replaced_not_set_back(pg_dsn: str) -> None:
    """The server shows a keepalive setting left at 0 as the system's value, read from the socket; where it cannot
    read it, as -1 (PostgreSQL on Windows, always, for tcp_keepalives_idle and _interval). Taken for a smaller value
    the operator set, that -1 was set back: out of the setting's range, the session statement failed, so did every
    pooled connection as it opened, and the store never opened. The statement's own fragment is run here on a
    setting of the test's own showing what such a server shows (this one, on Linux, reads its system's values)."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        for shown, then in (("-1", "2"), ("0", "2"), ("7200", "2"), ("3", "2"), ("2", "2"), ("1", "1")):
            await conn.execute(f"SET idemproxy_test.keepalives_idle = '{shown}'")
            assert await conn.fetchval(f"SELECT {_count_at_most('idemproxy_test.keepalives_idle', 2)}") == then, shown
        with pytest.raises(asyncpg.InvalidParameterValueError):  # (what setting -1 back did on such a server)
            await conn.execute("SELECT set_config('tcp_keepalives_idle', '-1', false)")
    finally:
        await conn.close()


def closing() -> list[asyncio.Task[Any]]:
    """The driver's connection closes still running in this loop (tasks of their own)."""
    return [task for task in asyncio.all_tasks() if "Connection.close" in repr(task.get_coro())]


async def test_the_connections_a_silence_replaces_are_closed_without_an_unheard_error(clean_pg: str) -> None:
    """The failover above, the pool's idle connections to the silent server still open when the first timeout
    replaced them: the pool closed each one politely, in a task of its own, as it was next handed out, and that
    close, unanswered, failed after 5 s with nobody to hear it. asyncio then logged an error with a traceback
    ("Task exception was never retrieved", from asyncpg's Connection.close) for each. The store now closes those
    idle connections itself when it replaces them (and the connections batches kept aside, which no longer hold
    their pool slots for a 5 s polite close), so the failover logs its warnings and nothing else."""
    parts = urlsplit(clean_pg)
    loop = asyncio.get_running_loop()
    unheard: list[dict[str, Any]] = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unheard.append(context))
    try:
        with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
            store = PostgresStore(PostgresConfig(dsn=SecretURL(via(relay, clean_pg)), pool_min=4, pool_max=4))
            await store.open()
            try:
                await backends(store, 4)
                relay.strand()  # the four go silent; new connections reach the server
                with pytest.raises(StoreUnavailable):
                    await store.get("t", "found-it")  # its statement unanswered: the pool's connections replaced
                assert await asyncio.gather(*(store.get("t", f"after-{n}") for n in range(3))) == [None] * 3
                await until(lambda: not closing(), timeout=10)  # (a polite close waits 5 s for an answer)
            finally:
                await store.close()
        gc.collect()
        assert not [context["message"] for context in unheard], unheard
    finally:
        loop.set_exception_handler(handler)


async def backends(store: PostgresStore, connections: int) -> set[int]:
    """The server processes behind the pool's connections (that many used at once)."""
    return set(await asyncio.gather(*(store._live("pid", lambda conn: conn.fetchval(
        "SELECT pg_backend_pid() FROM pg_sleep(0.2)")) for _ in range(connections))))


async def test_claims_that_only_waited_for_an_exhausted_pool_leave_its_connections_alone(
    clean_pg: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Claims in batches, the pool's two connections busy with reads of 3 s each (answered well within the
    server's statement timeout) and two more reads waiting for them: a claim's batch left the queue and waited
    for a connection until the claim's 5 s ran out. Nothing of it had reached the server, yet it was taken as a
    statement left unanswered: the pool's connections were all replaced (and a warning said the server may have
    gone silent), once per 5 s for as long as the pool stayed busy. Only a statement on the wire past the server's
    own statement timeout is a sign of silence."""
    store = PostgresStore(PostgresConfig(dsn=SecretURL(clean_pg), pool_min=2, pool_max=2))
    await store.open()
    try:
        assert store.batching
        before = await backends(store, 2)
        reads = [asyncio.ensure_future(store._live("get", lambda conn: conn.execute("SELECT pg_sleep(3)")))
                 for _ in range(4)]
        await until(lambda: store._pool.get_idle_size() == 0)
        with caplog.at_level(logging.WARNING, "idemproxy"), pytest.raises(StoreUnavailable):
            await store.claim("t", "waited-for-the-pool", "fp", lease=5, ttl=60)
        await asyncio.gather(*reads)
        assert "got no answer in time" not in caplog.text
        # the same connections: none was replaced (one may be busy meanwhile releasing the abandoned claim)
        assert await backends(store, 2) <= before
    finally:
        await store.close()


async def test_a_one_statement_claim_that_waited_for_the_pool_then_a_lock_leaves_the_pool_alone(
    pg_one_table_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One table (claims one statement each), the pool's two connections busy 3 s, the table locked elsewhere:
    the claim got a connection after 3 s and its statement waited 2 s for the lock when the claim's 5 s ran out
    (a 503). The server was answering all along (it would have cancelled the statement itself at 4.5 s), yet the
    pool's connections were replaced; only the claim's own, interrupted, is."""
    dsn = await empty_records(pg_one_table_dsn)
    store = PostgresStore(PostgresConfig(dsn=SecretURL(dsn), pool_min=2, pool_max=2, partitions="none"))
    await store.open()
    locker = await asyncpg.connect(dsn)
    try:
        assert not store.batching
        before = await backends(store, 2)
        lock = locker.transaction()
        await lock.start()
        await locker.execute("LOCK TABLE idemproxy_records IN ACCESS EXCLUSIVE MODE")
        reads = [asyncio.ensure_future(store._live("get", lambda conn: conn.execute("SELECT pg_sleep(3)")))
                 for _ in range(2)]
        await until(lambda: store._pool.get_idle_size() == 0)
        with caplog.at_level(logging.WARNING, "idemproxy"), pytest.raises(StoreUnavailable):
            await store.claim("t", "waited-for-the-pool-then-the-lock", "fp", lease=5, ttl=60)
        await asyncio.gather(*reads)
        await lock.rollback()
        assert "got no answer in time" not in caplog.text
        assert len(await backends(store, 2) & before) == 1  # the claim's connection was replaced, the other kept
    finally:
        await locker.close()
        await store.close()


def unread(sock: Any) -> int:
    """Bytes that arrived on ``sock`` and its owner has not read yet."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])


async def test_retries_on_dead_pooled_connections_share_the_operation_timeout(clean_pg: str) -> None:
    """An operation handed a pooled connection the server had ended tries again on another: up to pool_max more
    times, each try waiting up to 5 s for a connection of its own (pool_max x 5 s in all). Here the pool's one
    connection is busy for 3 s and given back dead (the server ends its session as it finishes: the driver reads
    the goodbye, the relay holds the close), and the server is then slow to take a new connection: a read waited
    3 s, found the connection dead, then waited 5 s more for a new one (a 503 after 8 s). The tries now share the
    5 s a claim has, and the failure is still a 503."""
    parts = urlsplit(clean_pg)
    admin = await asyncpg.connect(clean_pg)
    relay = Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg")
    store = PostgresStore(PostgresConfig(dsn=SecretURL(via(relay, clean_pg)), pool_min=1, pool_max=1))
    try:
        await store.open()
        relay.linger()
        started = asyncio.Event()

        async def busy(conn: Any) -> None:
            """Hold the pooled connection 3 s, then give it back dead, the server slow to take a new one."""
            started.set()
            await conn.execute("SELECT pg_sleep(3)")
            ends = relay.lingering
            await admin.execute("SELECT pg_terminate_backend($1)", conn.get_server_pid())
            sock = conn._transport.get_extra_info("socket")
            await until(lambda: relay.lingering > ends and unread(sock) == 0)  # its goodbye read, no close yet
            relay.stall()  # new connections are accepted and kept waiting

        holder = asyncio.ensure_future(store._live("busy", busy))
        await started.wait()
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(StoreUnavailable) as failed:
            await store.get("t", "k")
        took = loop.time() - began
        assert not failed.value.maybe_applied
        assert took < 5.5, took
        await holder
        relay.restore()
        assert await store.get("t", "k") is None
    finally:
        await store.close()
        relay.close()
        await admin.close()


async def timed_post(proxy: RunningProxy, key: str) -> tuple[int, float]:
    """A covered POST's status, and how long its answer took."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    resp, _ = await proxy.post("/v1/charges", key=key, body=CHARGE)
    return resp.status, loop.time() - began


async def post_while_503(proxy: RunningProxy, key: str, within: float = 15) -> tuple[aiohttp.ClientResponse, bytes]:
    """The first answer to a covered request that is not 503 (the store not open yet: nothing forwarded), or the
    last 503 after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        resp, body = await proxy.post("/v1/charges", key=key, body=CHARGE)
        if resp.status != 503 or loop.time() > deadline:
            return resp, body
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("with_redis", [False, True], ids=["postgres", "redis+postgres"])
async def test_postgres_unreachable_at_start_serves_then_opens_when_it_answers(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    with_redis: bool,
) -> None:
    """CONTRACT "Health": a store outage does not take the replica out of service, and one at start is no
    different. A replica (re)started while PostgreSQL is down used to exit after its five attempts: in a crash
    loop, every request through it failed, uncovered ones included, until PostgreSQL and the loop's backoff
    allowed. Now it serves: 503 ``store_unavailable`` where the store is needed (nothing forwarded), other
    traffic passes, and the store opens (schema and all) once PostgreSQL answers."""
    parts = urlsplit(clean_pg)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        relay.cut()
        section = pg_section(via(relay, clean_pg))
        if with_redis:
            section["redis"] = {"url": redis_url, "key_prefix": redis_prefix}
        proxy = await make_proxy(storage_section=section)  # returns after the five attempts at start
        resp, body = await proxy.post("/v1/charges", key="early", body=CHARGE)
        assert resp.status == 503 and json.loads(body)["code"] == "store_unavailable", (resp.status, body)
        assert resp.headers["Retry-After"]
        resp, _ = await proxy.post("/v1/charges", body=CHARGE)  # no key: not covered, passes through
        assert resp.status == 201
        health = await proxy.proxy.check_stores()
        assert not health.ready and health.details["postgres"] == "unavailable", health
        assert relay.refused >= 5  # it kept trying
        relay.restore()
        resp, body = await post_while_503(proxy, "early")  # open within the retry interval (5 s at most)
        assert resp.status == 201, (resp.status, body)
        replay, _ = await proxy.post("/v1/charges", key="early", body=CHARGE)
        assert replay.status == 201 and replay.headers["Idempotent-Replayed"] == "true"
        assert (await proxy.proxy.check_stores()).ready
    assert upstream.count(key="early") == 1


async def test_a_server_that_refuses_once_reachable_is_said_and_opened_when_it_no_longer_does(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_admin_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Unreachable at start, then reachable but refusing (its database not created yet): an error names what
    it said (once a minute at most, not every retry), the proxy goes on serving 503s, and the store opens, its
    schema created (``migrate: auto``), once the database is there."""
    name = f"idemproxy_late_{uuid.uuid4().hex[:10]}"
    admin = urlsplit(pg_admin_dsn)
    dsn = urlunsplit(admin._replace(path=f"/{name}"))
    try:
        with Relay(admin.hostname or "127.0.0.1", admin.port or 5432, name="pg") as relay:
            relay.cut()
            proxy = await make_proxy(storage_section=pg_section(via(relay, dsn)))
            relay.restore()  # reachable now, and it refuses: the database does not exist
            await until(lambda: f'database "{name}" does not exist' in caplog.text, timeout=10)
            tried = relay.accepted
            await until(lambda: relay.accepted >= tried + 2, timeout=10)  # refused twice more, unsaid
            resp, body = await proxy.post("/v1/charges", key="late", body=CHARGE)
            assert resp.status == 503 and json.loads(body)["code"] == "store_unavailable", (resp.status, body)
            await asyncio.to_thread(_admin_sql, pg_admin_dsn, f"CREATE DATABASE {name}")
            resp, body = await post_while_503(proxy, "late")
            assert resp.status == 201, (resp.status, body)
            refusals = [r for r in caplog.records if f'database "{name}" does not exist' in r.getMessage()]
            assert len(refusals) == 1 and refusals[0].levelname == "ERROR", [r.getMessage() for r in refusals]
            assert "answers: the idempotency store is open" in caplog.text
            await proxy.session.close()
            await proxy.server.close()  # closes the store, before its database is dropped
    finally:
        await asyncio.to_thread(_admin_sql, pg_admin_dsn, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    assert upstream.count(key="late") == 1


async def test_no_statement_runs_before_the_store_knows_its_layout(clean_pg: str) -> None:
    """The opener in the background assigns the pool before it has read the layout: until then no operation may
    use it (single-table SQL run against daily partitions would skip the per-key lock that keeps a key unique
    across partitions). Pinned on the gate itself, as the window is too short to hit from outside."""
    store = PostgresStore(PostgresConfig(dsn=SecretURL(clean_pg), pool_min=1, pool_max=2))
    await store.open()
    try:
        store._usable = False  # as between the pool's opening and the layout's reading
        sent = store.statements
        for call in (lambda: store.claim("t", "gate", "fp", lease=5, ttl=60), lambda: store.get("t", "gate"),
                     lambda: store.sweep(10), store.clock):
            with pytest.raises(StoreUnavailable) as refused:
                await call()
            assert refused.value.maybe_applied is False
        assert not (await store.health()).ready
        assert store.statements == sent
        store._usable = True
        assert (await store.claim("t", "gate", "fp", lease=5, ttl=60)).owned
    finally:
        await store.close()


async def test_a_stalled_listen_connection_stops_the_copies(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str
) -> None:
    """PostgreSQL alone: a release reaches the other replicas by LISTEN. A link that stalls without an error (a
    partition: no FIN, no RST) cannot deliver it, so the reader must stop answering from its copies within
    the live window, not keep them for their whole 30 s (it counted as live while the socket stood)."""
    parts = urlsplit(clean_pg)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        reader = await make_proxy(storage_section=pg_section(via(relay, clean_pg)))
        releaser = await make_proxy(storage_section=pg_section(clean_pg))
        await until(reader.proxy.store.notifications_live)
        tenant = reader.proxy.engine.resolve_tenant_value("Bearer t1")
        while reader.proxy.engine.replays.get(tenant, "listen") is None:  # executed, then kept by a replay
            assert (await reader.post("/v1/charges", key="listen", body=CHARGE))[0].status == 201
        relay.stall()
        await until(lambda: not reader.proxy.store.notifications_live(), timeout=5)
        assert await releaser.proxy.store.forget(tenant, "listen")  # announced where the reader cannot hear it
        relay.restore()
        fresh, _ = await reader.post("/v1/charges", key="listen", body=CHARGE)
        assert fresh.status == 201 and fresh.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="listen") == 2


async def test_statement_timeout_and_exhausted_pool_are_503(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str
) -> None:
    """A table lock held elsewhere: the one pooled connection waits until PostgreSQL cancels the statement
    (statement_timeout) while a second request cannot get a connection at all (pool exhausted)."""
    proxy = await make_proxy(storage_section={"postgres": {"dsn": clean_pg, "pool_min": 1, "pool_max": 1}})
    assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
    locker = await asyncpg.connect(clean_pg)
    # applies to the connections the pool opens from now on; the warm one is replaced after its timeout. Set on
    # this run's database, not on the role: a role's setting would reach every database of a shared server.
    database = await locker.fetchval("SELECT quote_ident(current_database())")
    try:
        await locker.execute(f"ALTER DATABASE {database} SET statement_timeout = '6s'")
        lock = locker.transaction()
        await lock.start()
        await locker.execute("LOCK TABLE idemproxy_records IN ACCESS EXCLUSIVE MODE")
        results = await asyncio.gather(*(proxy.post("/v1/charges", key=f"locked-{i}", body=CHARGE)
                                         for i in range(2)))
        for resp, body in results:
            assert resp.status == 503 and json.loads(body)["code"] == "store_unavailable", (resp.status, body)
        await lock.rollback()
        resp, _ = await proxy.post("/v1/charges", key="after-lock", body=CHARGE)
        assert resp.status == 201  # the interrupted connection was discarded, not handed out again
    finally:
        await locker.execute(f"ALTER DATABASE {database} RESET statement_timeout")
        await locker.close()
    assert upstream.count(key="locked-0") == upstream.count(key="locked-1") == 0


async def test_a_claim_that_gets_the_last_connection_late_still_gets_its_503_within_the_operation_timeout(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_one_table_dsn: str
) -> None:
    """One table (claims one statement each), pool_max 1, the table locked elsewhere: the second claim waited
    4.5 s for the connection, then 4.5 s more for its own statement (9 s before its 503). The pool's wait and the
    statement share the 5 s operation timeout."""
    dsn = await empty_records(pg_one_table_dsn)
    proxy = await make_proxy(storage_section={"postgres": {"dsn": dsn, "pool_min": 1, "pool_max": 1,
                                                           "partitions": "none"}})
    assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
    store = proxy.proxy.store
    assert isinstance(store, PostgresStore) and not store.batching
    locker = await asyncpg.connect(dsn)

    try:
        lock = locker.transaction()
        await lock.start()
        await locker.execute("LOCK TABLE idemproxy_records IN ACCESS EXCLUSIVE MODE")
        first = asyncio.ensure_future(timed_post(proxy, "holds-the-connection"))

        async def blocked() -> bool:  # the first claim's statement waits for the lock
            return bool(await locker.fetchval(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'idemproxy_records'::regclass"))

        while not await blocked():
            await asyncio.sleep(0.01)
        second = await timed_post(proxy, "waits-for-the-pool")
        results = [await first, second]
        await lock.rollback()
    finally:
        await locker.close()
    assert all(status == 503 for status, _ in results), results
    assert max(took for _, took in results) < 6, results
    assert (await proxy.post("/v1/charges", key="after-lock", body=CHARGE))[0].status == 201
    assert upstream.count() == 2


async def test_a_one_statement_claim_timed_out_is_counted_and_released_only_if_it_had_a_connection(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_one_table_dsn: str
) -> None:
    """One table (claims one statement each), pool_max 1, PostgreSQL stalled: the first claim's statement and the
    second claim's wait for the pool (then for a new connection) run out of their 5 s. Both are store errors
    (idemproxy_store_errors_total: the shared timeout's were not counted), and only the first may have landed:
    the second, never sent, leaves no release pending (it was taken as maybe applied, a release for nothing)."""
    dsn = await empty_records(pg_one_table_dsn)
    parts = urlsplit(dsn)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        proxy = await make_proxy(storage_section={"postgres": {"dsn": via(relay, dsn), "pool_min": 1,
                                                               "pool_max": 1, "partitions": "none"}})
        assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
        store = proxy.proxy.store
        assert isinstance(store, PostgresStore) and not store.batching
        errors = store_errors(proxy, "claim")
        relay.stall()
        first = asyncio.ensure_future(proxy.post("/v1/charges", key="holds-the-connection", body=CHARGE))
        await until(lambda: store._pool.get_idle_size() == 0)  # the first claim has the one connection
        second, _ = await proxy.post("/v1/charges", key="waits-for-the-pool", body=CHARGE)
        assert [(await first)[0].status, second.status] == [503, 503]
        assert store_errors(proxy, "claim") == errors + 2
        assert proxy.proxy.metrics.registry.get_sample_value("idemproxy_pending_settles") == 1, \
            "only the claim that was sent may have landed"
        relay.restore()
        await until(lambda: proxy.proxy.metrics.registry.get_sample_value("idemproxy_pending_settles") == 0,
                    timeout=10)
        assert (await proxy.post("/v1/charges", key="after-stall", body=CHARGE))[0].status == 201
    assert upstream.count() == 2


async def test_an_operation_cancelled_midway_never_poisons_the_pool(clean_pg: str) -> None:
    """A claim cancelled while its statement runs (a client gone, a timeout): the connection is discarded, so the
    next operation on the one-connection pool is not refused with "another operation is in progress"."""
    store = PostgresStore(PostgresConfig(dsn=SecretURL(clean_pg), pool_min=1, pool_max=1))
    await store.open()
    locker = await asyncpg.connect(clean_pg)
    try:
        lock = locker.transaction()
        await lock.start()
        await locker.execute("LOCK TABLE idemproxy_records IN ACCESS EXCLUSIVE MODE")
        claim = asyncio.ensure_future(store.claim("t", "cancelled", "fp", lease=5, ttl=60))
        await asyncio.sleep(0.3)
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claim
        await lock.rollback()
        again = await asyncio.wait_for(store.claim("t", "next", "fp", lease=5, ttl=60), 5)
        assert again.owned
    finally:
        await locker.close()
        await store.close()


async def test_listen_is_re_established_after_a_postgres_restart(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, own_pg: PostgresServer, own_pg_dsn: str
) -> None:
    """PostgreSQL alone, wait mode: waiters are woken by NOTIFY, also after PostgreSQL restarted."""
    proxy = await make_proxy(storage_section=pg_section(own_pg_dsn),
                             idempotency={"in_flight": "wait", "wait_timeout": "8s"})

    async def listening() -> bool:
        conn = await asyncpg.connect(own_pg_dsn)
        try:
            return bool(await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%'"
            ))
        finally:
            await conn.close()

    await asyncio.to_thread(own_pg.stop)
    await asyncio.to_thread(own_pg.start)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while not await listening():  # the proxy notices the lost connection and listens again by itself
        assert loop.time() < deadline, "LISTEN was not re-established"
        await asyncio.sleep(0.1)
    owner = asyncio.ensure_future(proxy.post("/v1/charges", key="woken", body=CHARGE,
                                             headers={"X-Test-Delay": "0.5"}))
    while upstream.count(key="woken") == 0:
        await asyncio.sleep(0.005)
    started = loop.time()
    waiter, _ = await proxy.post("/v1/charges", key="woken", body=CHARGE)
    assert waiter.status == 201 and waiter.headers["Idempotent-Replayed"] == "true"
    assert loop.time() - started < 4, "the waiter was not woken: it waited for its deadline"
    assert (await owner)[0].status == 201


def redis_publishes(redis: RedisServer) -> int:
    stats = sync_redis.Redis.from_url(redis.url).info("commandstats")
    return int(stats.get("cmdstat_publish", {}).get("calls", 0))


@pytest.mark.parametrize("in_flight", ["reject", "wait"])
async def test_a_completion_is_announced_only_when_a_route_waits(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, running_redis: RedisServer, clean_pg: str,
    in_flight: str,
) -> None:
    """Only `in_flight: wait` requests listen for a completion; a release is announced either way (a waiter
    may take the key over, a replica may hold a copy of a record an admin release deletes)."""
    proxy = await make_proxy(storage_section=redis_section(running_redis, clean_pg),
                             idempotency={"in_flight": in_flight})
    await proxy.post("/v1/charges", key="warm-up", body=CHARGE)
    before = redis_publishes(running_redis)
    resp, _ = await proxy.post("/v1/charges", key="announce", body=CHARGE)
    assert resp.status == 201
    assert redis_publishes(running_redis) - before == (1 if in_flight == "wait" else 0)
    before = redis_publishes(running_redis)
    resp, _ = await proxy.post("/v1/charges", key="released", body=CHARGE, headers={"X-Test-Status": "503"})
    assert resp.status == 503
    assert redis_publishes(running_redis) - before == 1


# ------------------------------------------------- the server ends pooled sessions: nothing sent, nothing failed


@dataclass
class Layout:
    """PostgreSQL alone or behind Redis, on daily partitions or one table: a record's database, and the proxy's
    storage section for it (``section(dsn)``: the same database, reached at ``dsn``, a relay's, say)."""

    dsn: str
    partitions: str
    redis: dict[str, str] | None

    def section(self, dsn: str, **postgres: Any) -> dict[str, Any]:
        section = pg_section(dsn)
        section["postgres"].update(partitions=self.partitions, **postgres)
        if self.redis is not None:
            section["redis"] = self.redis
        return section


@pytest.fixture(params=[("postgres", "daily"), ("postgres", "none"), ("redis", "daily"), ("redis", "none")],
                ids="-".join)
async def layout(
    request: pytest.FixtureRequest, clean_pg: str, pg_one_table_dsn: str, redis_url: str, redis_prefix: str
) -> Layout:
    backend, partitions = request.param
    return Layout(dsn=clean_pg if partitions == "daily" else await empty_records(pg_one_table_dsn),
                  partitions=partitions,
                  redis={"url": redis_url, "key_prefix": redis_prefix} if backend == "redis" else None)


async def end_sessions(dsn: str) -> int:
    """pg_terminate_backend of every other session on ``dsn``'s database (idle pooled connections, LISTEN): what
    an operator, a failover script or a pooler recycling connections does. Returns how many were ended."""
    return int(await fetched(
        dsn, "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
             "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"))


async def fetched(dsn: str, sql: str, *args: Any) -> Any:
    """The first value of ``sql``'s first row, on a connection of its own to ``dsn`` (not the proxy's)."""
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def test_pooled_connections_the_server_ended_while_idle_fail_no_request(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, layout: Layout
) -> None:
    """The server ends the pool's idle sessions (pg_terminate_backend, idle_session_timeout, a restart); the driver
    has read the server's goodbye but not yet seen the socket close. Such a connection refuses a statement before
    sending any of it: the operation runs on another connection, and the next requests (the claims, batched or
    one statement each, and the completions) are served, not answered 503 (audit: one 503 per ended session)."""
    dsn = layout.dsn
    parts = urlsplit(dsn)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        proxy = await make_proxy(storage_section=layout.section(via(relay, dsn)))
        for round_ in range(2):  # several pooled connections, some kept aside by batches
            answers = await asyncio.gather(*(proxy.post("/v1/charges", key=f"warm-{round_}-{n}", body=CHARGE)
                                             for n in range(6)))
            assert [resp.status for resp, _ in answers] == [201] * 6
        relay.linger()
        ended = await end_sessions(dsn)
        assert ended >= 2
        await until(lambda: relay.lingering >= ended)  # every goodbye reached the proxy; no socket closed yet
        for n in range(3):
            resp, body = await proxy.post("/v1/charges", key=f"after-{n}", body=CHARGE)
            assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false", (resp.status, body)
        answers = await asyncio.gather(*(proxy.post("/v1/charges", key=f"after-many-{n}", body=CHARGE)
                                         for n in range(6)))
        assert [resp.status for resp, _ in answers] == [201] * 6
        relay.restore()
        # The completion: its claim's connection, kept aside for the next batch, is ended while the upstream works.
        pending = asyncio.ensure_future(proxy.post("/v1/charges", key="mid", body=CHARGE,
                                                   headers={"X-Test-Delay": "0.3"}))
        await until(lambda: upstream.count(key="mid") == 1)
        before = relay.lingering
        relay.linger()
        ended = await end_sessions(dsn)
        await until(lambda: relay.lingering >= before + ended)
        resp, _ = await pending
        assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
        relay.restore()
    # nothing failed: no 503, and no completion left for the settle loop to retry
    assert store_errors(proxy, "claim") == 0 and store_errors(proxy, "complete") == 0
    for key in [f"after-{n}" for n in range(3)] + [f"after-many-{n}" for n in range(6)] + ["mid"]:
        assert upstream.count(key=key) == 1


async def test_a_connection_the_server_ends_as_the_pool_sets_it_up_fails_no_request(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_one_table_dsn: str
) -> None:
    """A server ending sessions as they come (an operator, a failover) may end one the pool has just opened,
    during its set-up (the session's SET): nothing of the operation was sent, so it runs on another connection
    (it was a 503). One table: each claim a statement of its own, so concurrent ones make the pool open more."""
    dsn = await empty_records(pg_one_table_dsn)
    parts = urlsplit(dsn)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        plain = via(relay, dsn) + ("&" if parts.query else "?") + "sslmode=disable"  # (the relay counts messages)
        section = pg_section(plain)
        section["postgres"]["partitions"] = "none"
        proxy = await make_proxy(storage_section=section)
        assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
        relay.end_next_at(2)  # the start-up, then the set-up's SET: ended there
        answers = await asyncio.gather(*(proxy.post("/v1/charges", key=f"new-{n}", body=CHARGE) for n in range(6)))
        assert [(resp.status, resp.headers.get("Idempotent-Replayed")) for resp, _ in answers] == [(201, "false")] * 6
        assert relay.ended == 1
    assert store_errors(proxy, "claim") == 0
    assert all(upstream.count(key=f"new-{n}") == 1 for n in range(6))


async def test_requests_racing_the_server_ending_every_session_are_each_served_and_executed_once(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, layout: Layout
) -> None:
    """Rounds of concurrent first requests, each round sent as the server ends every session of the database
    (pg_terminate_backend: a failover, an operator, a pooler recycling its connections). A statement written just
    before its session's goodbye may have landed with its reply lost, and a connection the pool was opening may be
    ended under it. Each was a 503 (162 of 240 requests in one run, before claims were asked again with their
    token); now every request is served, and executed once."""
    dsn = layout.dsn
    proxy = await make_proxy(storage_section=layout.section(dsn))
    keys = [[f"race-{round_}-{n}" for n in range(6)] for round_ in range(40)]
    ended = 0
    for round_keys in keys:
        ending = asyncio.ensure_future(end_sessions(dsn))
        answers = await asyncio.gather(*(proxy.post("/v1/charges", key=key, body=CHARGE) for key in round_keys))
        ended += await ending  # (none, at times: every session was being opened again as it looked)
        assert [(resp.status, resp.headers.get("Idempotent-Replayed")) for resp, _ in answers] == [(201, "false")] * 6
    assert ended >= len(keys)
    assert all(upstream.count(key=key) == 1 for round_keys in keys for key in round_keys)
    replay, _ = await proxy.post("/v1/charges", key=keys[-1][-1], body=CHARGE)
    assert replay.status == 201 and replay.headers["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize("partitions", ["daily", "none"])
async def test_a_claim_the_server_refused_is_not_asked_again(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, pg_one_table_dsn: str, partitions: str
) -> None:
    """A claim PostgreSQL answered with an error (here read-only, as a primary demoted by a failover answers) rolled
    back: it is a 503 after that one statement, not asked again on new connections that would fail the same way."""
    dsn = clean_pg if partitions == "daily" else await empty_records(pg_one_table_dsn)
    section = pg_section(dsn)
    section["postgres"]["partitions"] = partitions
    proxy = await make_proxy(storage_section=section)
    assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute("""
            CREATE FUNCTION idemproxy_test_refuse() RETURNS trigger LANGUAGE plpgsql AS
                $$ BEGIN RAISE EXCEPTION 'read-only transaction' USING ERRCODE = '25006'; END $$;
            CREATE TRIGGER idemproxy_test_refuse BEFORE INSERT ON idemproxy_records
                FOR EACH ROW EXECUTE FUNCTION idemproxy_test_refuse();""")
        resp, body = await proxy.post("/v1/charges", key="refused", body=CHARGE)
        assert resp.status == 503 and json.loads(body)["code"] == "store_unavailable"
        assert store_errors(proxy, "claim") == 1  # (each ask of a claim is timed and counted)
        await admin.execute("DROP TRIGGER idemproxy_test_refuse ON idemproxy_records")
    finally:
        await admin.close()
    assert upstream.count(key="refused") == 0
    resp, _ = await proxy.post("/v1/charges", key="refused", body=CHARGE)
    assert resp.status == 201 and upstream.count(key="refused") == 1


IN_FLIGHT = "SELECT count(*) FROM idemproxy_records WHERE key = $1 AND state = 'in_flight'"


async def in_flight(dsn: str, key: str) -> bool:
    """Whether ``key``'s record stands in flight, as PostgreSQL itself has it committed."""
    return bool(await fetched(dsn, IN_FLIGHT, key))


async def _in_flight(conn: asyncpg.Connection, key: str) -> bool:
    return bool(await conn.fetchval(IN_FLIGHT, key))


async def until_in_flight(direct: asyncpg.Connection, key: str) -> None:
    """Until ``key``'s record stands in flight, committed, looked for often on a connection already open: a claim
    whose connection is then cut is asked again only when that comes within 0.25 s of its call."""
    async with asyncio.timeout(5):
        while not await _in_flight(direct, key):
            await asyncio.sleep(0.002)


@pytest.mark.parametrize("lost", ["reply", "statement"])
async def test_a_claim_cut_off_after_it_was_written_is_asked_again_with_its_token_and_served(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, layout: Layout, lost: str
) -> None:
    """A claim's connection is cut once its statement was written: it may have landed, its reply lost (``reply``:
    PostgreSQL committed it), or not (``statement``: the bytes never reached the server). It was a 503, the claim
    released behind it. Now it is asked again with the same token, on another connection: a record in flight under
    its own token is its own, so the request is forwarded once, answered as executed, and stored."""
    dsn = layout.dsn
    parts = urlsplit(dsn)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        # (one pooled connection, whose statements the first requests prepared: a prepare held by the relay would
        # hold the claim before it ran)
        proxy = await make_proxy(storage_section=layout.section(via(relay, dsn), pool_max=1))
        for n in range(2):  # (one at a time: a claim alone is a statement of its own, a batch's another)
            assert (await proxy.post("/v1/charges", key=f"warm-{n}", body=CHARGE))[0].status == 201
        if lost == "reply":
            relay.mute()  # statements reach PostgreSQL, their replies are held
        else:
            relay.stall()  # nothing reaches it
        held = relay.held
        direct = await asyncpg.connect(dsn)
        try:
            pending = asyncio.ensure_future(proxy.post("/v1/charges", key="cut-off", body=CHARGE))
            if lost == "reply":
                await until_in_flight(direct, "cut-off")  # committed, its reply held
            else:
                async with asyncio.timeout(5):  # written, held in the black hole
                    while relay.held == held:
                        await asyncio.sleep(0.002)
        finally:
            await direct.close()
        relay.cut()
        relay.restore()
        resp, body = await pending
        assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false", (resp.status, body)
        assert upstream.count(key="cut-off") == 1
        again, again_body = await proxy.post("/v1/charges", key="cut-off", body=CHARGE)
        assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true" and again_body == body
    assert upstream.count(key="cut-off") == 1
    assert store_errors(proxy, "claim") == 1  # the try cut off, counted; the one asked again answered
    assert proxy.proxy.metrics.registry.get_sample_value("idemproxy_lease_takeovers_total") == 0


async def test_a_claim_cut_off_too_late_for_the_server_to_give_up_on_a_second_ask_first_is_not_asked_again(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, pg_one_table_dsn: str
) -> None:
    """A second ask must end on the server (its statement timeout, 4.5 s after it arrives) before its claim's 5 s
    do: one still queued on a lock when its caller was told 503 could land after the release behind it and hold the
    key in flight for the lease. So a claim cut off later than 0.25 s after its call is a 503, not asked again."""
    dsn = await empty_records(pg_one_table_dsn)
    parts = urlsplit(dsn)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        section = pg_section(via(relay, dsn))
        section["postgres"].update(partitions="none", pool_max=1)
        proxy = await make_proxy(storage_section=section)
        assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
        relay.stall()
        held = relay.held
        pending = asyncio.ensure_future(proxy.post("/v1/charges", key="late", body=CHARGE))
        await until(lambda: relay.held > held, timeout=5)
        await asyncio.sleep(0.5)  # (time passing is the point: the cut comes 0.5 s into the claim)
        relay.cut()
        relay.restore()
        resp, body = await pending
        assert resp.status == 503 and json.loads(body)["code"] == "store_unavailable", (resp.status, body)
        await proxy.proxy.engine.settler.flush(5, 1)  # the release behind the 503, while the relay still stands
    assert store_errors(proxy, "claim") == 1 and upstream.count(key="late") == 0


async def test_a_claim_that_lands_after_its_503_and_the_release_behind_it_is_released_once_more(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_one_table_dsn: str
) -> None:
    """One table: a claim queued on the key's row lock (another transaction holds the row) when its connection is
    cut is a 503, and the release behind it finds nothing of it (the row it sees is not its own, and a DELETE does
    not wait for a lock on a row it does not match). The claim then lands, holding the key in flight under a token
    nobody will use: a 409 for every retry until the lease ran out. The release is tried once more when, as a rule,
    no statement of the claim can still land (5 s after it failed), so the key is free again long before its 60 s
    lease."""
    dsn = await empty_records(pg_one_table_dsn)
    parts = urlsplit(dsn)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        section = pg_section(via(relay, dsn))
        section["postgres"].update(partitions="none", pool_max=1)
        proxy = await make_proxy(storage_section=section, idempotency={"lease": "60s"})
        assert (await proxy.post("/v1/charges", key="locked", body=CHARGE))[0].status == 201
        admin = await asyncpg.connect(dsn)
        try:
            await admin.execute("UPDATE idemproxy_records SET expires_at = now() - interval '1 second' "
                                "WHERE key = 'locked'")  # (its ttl over: the next claim replaces it)
            holding = admin.transaction()
            await holding.start()
            await admin.execute("SELECT 1 FROM idemproxy_records WHERE key = 'locked' FOR UPDATE")
            pending = asyncio.ensure_future(proxy.post("/v1/charges", key="locked", body=CHARGE))

            await until_async(lambda: waiting_on_a_lock(dsn), timeout=5)  # the proxy's claim waits for the row
            relay.cut()  # (and the second ask, if any, refused)
            resp, body = await pending
            assert resp.status == 503 and json.loads(body)["code"] == "store_unavailable", (resp.status, body)
            relay.restore()
            settler = proxy.proxy.engine.settler
            await until(lambda: settler.pending == 0, timeout=5)  # the release behind the 503: nothing to release
            await holding.commit()  # the queued claim goes on, and lands
            await until_async(lambda: in_flight(dsn, "locked"), timeout=5)
        finally:
            await admin.close()
        busy, _ = await proxy.post("/v1/charges", key="locked", body=CHARGE)
        assert busy.status == 409  # held by the claim nobody answered

        async def released() -> bool:
            return not await in_flight(dsn, "locked")
        await until_async(released, timeout=10)
        retry, _ = await proxy.post("/v1/charges", key="locked", body=CHARGE)
        assert retry.status == 201 and retry.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="locked") == 2  # the first request, and the retry after its ttl: never the lost claim


async def waiting_on_a_lock(dsn: str) -> bool:
    """Whether a session of ``dsn``'s database waits for a lock (a row another transaction holds)."""
    return bool(await fetched(
        dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"))


async def test_a_claim_cut_off_whose_second_ask_finds_no_server_is_a_503_and_released_behind_it(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str
) -> None:
    """The claim landed, its reply lost, and the second ask cannot reach the server (refused, nothing sent): the
    first try still stands in flight, so the request is a 503 and its claim is released in the background once the
    server is back. The key is not held in flight for the lease: the client's retry is executed, once."""
    parts = urlsplit(clean_pg)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        section = pg_section(via(relay, clean_pg))
        section["postgres"]["pool_max"] = 1  # (its statements prepared by the first request: see above)
        proxy = await make_proxy(storage_section=section, idempotency={"lease": "60s"})
        assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
        relay.mute()
        direct = await asyncpg.connect(clean_pg)
        try:
            pending = asyncio.ensure_future(proxy.post("/v1/charges", key="cut-off", body=CHARGE))
            await until_in_flight(direct, "cut-off")
        finally:
            await direct.close()
        relay.cut()  # and it stays cut: the second ask is refused
        resp, body = await pending
        assert resp.status == 503 and json.loads(body)["code"] == "store_unavailable", (resp.status, body)
        relay.restore()

        async def released() -> bool:
            return not await in_flight(clean_pg, "cut-off")
        await until_async(released, timeout=10)
        retry, _ = await proxy.post("/v1/charges", key="cut-off", body=CHARGE)
        assert retry.status == 201 and retry.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="cut-off") == 1


@pytest.fixture(scope="module")
def tls_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """A PostgreSQL accepting TLS connections only (skipped where no PostgreSQL here is built with OpenSSL)."""
    try:
        server = PostgresServer(tls=make_tls_files(tmp_path_factory.mktemp("tls")))
    except NoTlsServer as exc:
        pytest.skip(str(exc))
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture
def tls_pg_dsn(tls_pg: PostgresServer) -> Iterator[str]:
    with database_on(tls_pg, "idemproxy_tls") as dsn:
        yield dsn


async def test_a_postgresql_over_tls_serves_every_connection_the_store_makes(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, tls_pg_dsn: str
) -> None:
    """``sslmode=verify-full`` with the authority's certificate (``sslrootcert``), on a server refusing anything
    but TLS: every connection the store makes (the migrations' and the maintenance's sessions, the pool's, the
    LISTEN one) verifies it, so first requests, replays and a waiter woken by NOTIFY are all served."""
    proxy = await make_proxy(storage_section=pg_section(tls_pg_dsn),
                             idempotency={"in_flight": "wait", "wait_timeout": "8s"})
    await until(durable(proxy).notifications_live)
    answers = await asyncio.gather(*(proxy.post("/v1/charges", key=f"tls-{n}", body=CHARGE) for n in range(6)))
    assert [(resp.status, resp.headers["Idempotent-Replayed"]) for resp, _ in answers] == [(201, "false")] * 6
    owner = asyncio.ensure_future(proxy.post("/v1/charges", key="woken", body=CHARGE,
                                             headers={"X-Test-Delay": "0.3"}))
    await until(lambda: upstream.count(key="woken") == 1)
    waiter, _ = await proxy.post("/v1/charges", key="woken", body=CHARGE)  # woken by the completion's NOTIFY
    assert waiter.status == 201 and waiter.headers["Idempotent-Replayed"] == "true"
    assert (await owner)[0].status == 201
    replay, _ = await proxy.post("/v1/charges", key="tls-0", body=CHARGE)
    assert replay.status == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert upstream.count(key="tls-0") == 1 and upstream.count(key="woken") == 1
    conn = await asyncpg.connect(tls_pg_dsn)
    try:  # the store's sessions and this one, each over TLS (the server refuses any other)
        assert await conn.fetchval("SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) "
                                   "WHERE datname = current_database() AND ssl") >= 3
    finally:
        await conn.close()


async def test_listen_outlives_a_session_the_server_ended_while_idle(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str
) -> None:
    """PostgreSQL alone: the server ends the LISTEN session (pg_terminate_backend, idle_session_timeout) and its
    sign of life is asked after the driver read the goodbye, before the socket's close: the driver refuses it with
    an error of its own (not an interface or server error). The listener took that for fatal and stopped for good:
    no LISTEN again until a restart, waiters polled and the replay cache stayed off."""
    parts = urlsplit(clean_pg)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        proxy = await make_proxy(storage_section=pg_section(via(relay, clean_pg)),
                                 idempotency={"in_flight": "wait", "wait_timeout": "8s"})
        store = durable(proxy)
        await until(store.notifications_live)
        ended_listener = store._listener
        relay.linger()
        ended = await end_sessions(clean_pg)
        await until(lambda: relay.lingering >= ended)
        task = store._listen_task
        assert task is not None
        # its next sign of life (within LISTEN_PING) finds the connection ended
        await until(lambda: store._listener is not ended_listener or task.done())
        relay.restore()
        await until(store.notifications_live)
        assert not task.done()
        owner = asyncio.ensure_future(proxy.post("/v1/charges", key="woken", body=CHARGE,
                                                 headers={"X-Test-Delay": "0.3"}))
        await until(lambda: upstream.count(key="woken") == 1)
        waiter, _ = await proxy.post("/v1/charges", key="woken", body=CHARGE)
        assert waiter.status == 201 and waiter.headers["Idempotent-Replayed"] == "true"
        assert (await owner)[0].status == 201
    assert upstream.count(key="woken") == 1
