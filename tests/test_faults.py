"""Faults on real servers this run owns: Redis and PostgreSQL stopped under a running proxy.

Also the round-trip budget per path, counted on the servers' side of the wire (Redis commandstats) and by the
driver (statements sent to PostgreSQL).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp
import redis as sync_redis
from aiohttp.test_utils import TestServer

from idemproxy.store.postgres import PostgresStore
from idemproxy.store.redis import RedisFrontedStore
from tests.conftest import ProxyFactory, RunningProxy
from tests.servers import PostgresServer, RedisServer
from tests.test_concurrency import fire
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


async def test_redis_down_mid_run_costs_latency_never_correctness(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, running_redis: RedisServer, clean_pg: str
) -> None:
    proxy = await make_proxy(storage_section=redis_section(running_redis, clean_pg))
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
    text = proxy.proxy.metrics.render().decode()
    assert 'idemproxy_store_errors_total{backend="postgres",operation="claim"}' in text


async def test_postgres_down_fail_open_forwards_unguarded(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, own_pg: PostgresServer, own_pg_dsn: str
) -> None:
    proxy = await make_proxy(storage_section=pg_section(own_pg_dsn, on_store_error="fail_open"))
    await proxy.post("/v1/charges", key="warm", body=CHARGE)
    own_pg.stop()
    resp, _ = await proxy.post("/v1/charges", key="open", body=CHARGE)
    assert resp.status == 201
    assert resp.headers["Idempotency-Status"] == "unguarded"
    assert upstream.count(key="open") == 1
    text = proxy.proxy.metrics.render().decode()
    assert 'outcome="store_error"' in text


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
    """The upstream executed, so the client gets its real answer; the key keeps its lease (never released)."""
    proxy = await make_proxy(storage_section=pg_section(own_pg_dsn))
    pending = asyncio.ensure_future(
        proxy.post("/v1/charges", key="mid", body=CHARGE, headers={"X-Test-Delay": "1.5"})
    )
    while upstream.count(key="mid") == 0:
        await asyncio.sleep(0.005)
    await asyncio.to_thread(own_pg.stop)
    resp, body = await pending
    assert resp.status == 201 and json.loads(body)["serial"] >= 1
    assert resp.headers["Idempotent-Replayed"] == "false"
    assert 'idemproxy_store_errors_total{backend="postgres",operation="complete"} 1.0' in (
        proxy.proxy.metrics.render().decode()
    )
    await asyncio.to_thread(own_pg.start)
    await wait_store_ok(proxy, "postgres")
    retry, body = await proxy.post("/v1/charges", key="mid", body=CHARGE)
    assert retry.status == 409 and json.loads(body)["lease_expires_in"] > 0  # not re-executed
    assert upstream.count(key="mid") == 1
