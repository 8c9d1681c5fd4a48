"""Group commit (store/batch.py): concurrent claims and completions share statements and pipelines, and still
decide exactly as one call each would: one owner per key, a refused call fails alone, no deadlock between
replicas, scripts Redis lost are loaded again."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
import redis as sync_redis

from idemproxy.config import PostgresConfig, SecretURL, load_config
from idemproxy.problems import StoreRejected, StoreUnavailable
from idemproxy.store import StoredResponse, postgres
from idemproxy.store.base import Claim, Watchers
from idemproxy.store.batch import Batcher, CallTimeout
from idemproxy.store.postgres import BATCH_BYTES, BATCHES_IN_FLIGHT, NOTIFY_CHANNEL, PostgresStore
from idemproxy.store.redis import RedisFrontedStore
from tests.conftest import ProxyFactory, RunningProxy
from tests.relay import Relay
from tests.test_faults import durable
from tests.test_partitions import store_on
from tests.test_redis import redis_relay  # noqa: F401  (a fixture)
from tests.test_relay import wait_for
from tests.upstream import RecordingUpstream

FP = "f" * 64
OK = StoredResponse(status=201, headers=(("Content-Type", "application/json"),), body=b'{"id": 1}')
CHARGE = {"amount": 1000, "currency": "eur"}


@pytest.fixture
async def pg_store(clean_pg: str) -> AsyncIterator[PostgresStore]:
    store = store_on(clean_pg)
    await store.open()
    yield store
    await store.close()


def redis_errors(proxy: RunningProxy) -> float:
    metric = proxy.proxy.metrics.store_errors
    total: float = sum(metric.labels("redis", op)._value.get() for op in ("claim", "settle"))
    return total


async def test_the_batcher_groups_calls_of_one_loop_turn_and_fails_a_whole_batch_together() -> None:
    sent: list[list[int]] = []
    gate = asyncio.Event()

    async def send(items: list[int]) -> list[int | BaseException]:
        sent.append(items)
        await gate.wait()
        if 13 in items:
            raise ConnectionError("cut")
        return [item * 2 if item != 7 else ValueError("seven") for item in items]

    batcher: Batcher[int, int] = Batcher(send, max_batch=4, max_in_flight=1)
    first = [asyncio.ensure_future(batcher.call(n)) for n in range(6)]  # one turn: 4 go, 2 wait
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    later = [asyncio.ensure_future(batcher.call(n)) for n in (7, 13)]  # wait for the batch on the wire
    await asyncio.sleep(0)
    assert sent == [[0, 1, 2, 3]]
    gate.set()
    results = await asyncio.gather(*first, *later, return_exceptions=True)
    assert sent == [[0, 1, 2, 3], [4, 5, 7, 13]]
    assert results[:4] == [0, 2, 4, 6]
    assert all(isinstance(r, ConnectionError) for r in results[4:])  # 13 cut the second batch: all of it


async def test_calls_past_the_batchers_timeout_fail_queued_ones_unsent_sent_ones_abandoned() -> None:
    """With a ``timeout``, a call fails that long after it was made, however long the batches ahead of it take: one
    still queued never leaves, one on the wire has its late outcome handed to ``abandoned``. One timer serves every
    call: it waits, in turn, for each call still pending; calls answered in time are untouched by it."""
    sent: list[list[int]] = []
    gate = asyncio.Event()
    abandoned: list[tuple[int, object]] = []

    async def send(items: list[int]) -> list[int | BaseException]:
        sent.append(items)
        if 0 not in items:  # (the first batch, in time)
            await gate.wait()
        return [item * 2 for item in items]

    batcher: Batcher[int, int] = Batcher(send, max_in_flight=1, timeout=0.3,
                                         abandoned=lambda item, outcome: abandoned.append((item, outcome)))
    loop = asyncio.get_running_loop()
    assert await batcher.call(0) == 0  # answered in time: its deadline passes harmlessly
    began = loop.time()
    on_the_wire = asyncio.ensure_future(batcher.call(1))
    while not sent[1:]:
        await asyncio.sleep(0)
    queued = asyncio.ensure_future(batcher.call(2))  # behind the stalled batch
    await asyncio.sleep(0.1)
    later = asyncio.ensure_future(batcher.call(3))  # its deadline 0.1 s after the others'
    results = await asyncio.gather(on_the_wire, queued, return_exceptions=True)
    first_failed = loop.time() - began
    assert [type(r) for r in results] == [CallTimeout, CallTimeout]
    assert [r.sent for r in results if isinstance(r, CallTimeout)] == [True, False]
    assert 0.3 <= first_failed < 0.39, first_failed
    with pytest.raises(CallTimeout):
        await later
    assert 0.4 <= loop.time() - began < 0.49
    gate.set()
    await batcher.close(5)
    assert sent == [[0], [1]]  # neither queued call ever left
    assert abandoned == [(1, 2)]  # the stalled one's late outcome, for the store to undo
    assert await batcher.call(4) == 8  # and the batcher serves on


async def test_claims_of_one_key_in_one_batch_make_one_owner(pg_store: PostgresStore) -> None:
    assert pg_store.batching
    calls = [pg_store.claim("t", "same", FP, lease=30, ttl=60) for _ in range(20)]
    calls += [pg_store.claim("t", f"other-{n}", FP, lease=30, ttl=60) for n in range(20)]
    claims = await asyncio.gather(*calls)
    assert sum(c.owned for c in claims[:20]) == 1
    assert all(c.owned for c in claims[20:])
    assert pg_store._claims.batches < pg_store._claims.items  # they did share statements
    owner = next(c for c in claims[:20] if c.owned)
    assert {c.record.lease_token for c in claims[:20]} == {owner.token}  # the others saw the owner's record


async def test_completions_in_one_batch_are_each_fenced(pg_store: PostgresStore) -> None:
    claims = await asyncio.gather(*(pg_store.claim("t", f"k{n}", FP, lease=30, ttl=60) for n in range(10)))
    stale = claims[0].record.lease_token
    taken = await pg_store.claim("t", "k0", FP, lease=30, ttl=60)
    assert not taken.owned and taken.record.lease_token == stale
    forged = type(claims[1])(record=type(claims[1].record)(**{**claims[1].record.__dict__, "lease_token": "x"}),
                             owned=True, now=claims[1].now, sent=claims[1].sent)
    done = await asyncio.gather(*(pg_store.complete(c, OK, ttl=60) for c in [forged, *claims[2:]]))
    assert done == [False] + [True] * 8  # the forged token is refused, alone
    assert (await pg_store.get("t", "k1")).state == "in_flight"  # type: ignore[union-attr]
    assert (await pg_store.get("t", "k5")).response == OK  # type: ignore[union-attr]


async def test_a_claim_postgresql_refuses_fails_alone_in_its_batch(pg_store: PostgresStore) -> None:
    bad = pg_store.claim(secrets.token_urlsafe(3000), secrets.token_urlsafe(3000), FP, lease=30, ttl=60)
    good = [pg_store.claim("t", f"good-{n}", FP, lease=30, ttl=60) for n in range(10)]
    results = await asyncio.gather(bad, *good, return_exceptions=True)
    assert isinstance(results[0], StoreRejected) and not isinstance(results[0], StoreUnavailable)
    assert all(not isinstance(r, BaseException) and r.owned for r in results[1:]), results[1:]


def closed(conn: Any) -> bool:
    """Whether a pooled connection has ended (asyncpg then hands it back to the pool and its handle refuses calls)."""
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        return True


async def backend_pid(conn: Any) -> int:
    pid: int = await conn.fetchval("SELECT pg_backend_pid()")
    return pid


async def test_a_batch_leaves_its_connection_for_the_next_and_the_pool_gets_it_back_when_idle(
    clean_pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool checkout and release cost about half a small statement's CPU: consecutive batches share one
    connection, which goes back to the pool once no batch used it for SPARE_IDLE seconds."""
    monkeypatch.setattr(postgres, "SPARE_IDLE", 0.2)
    store = store_on(clean_pg)
    await store.open()
    try:
        assert (await store.claim("t", "a", FP, lease=30, ttl=60)).owned
        [(kept, _)] = store._spares
        pid = await backend_pid(kept)
        claim = await store.claim("t", "b", FP, lease=30, ttl=60)
        assert await store.complete(claim, OK, ttl=60)
        [(again, _)] = store._spares
        assert again is kept and await backend_pid(again) == pid  # the claim and the completion used it too
        idle = store._pool.get_idle_size()
        await wait_for(lambda: not store._spares and not store._returning)  # the idle timer gives it back
        assert store._pool.get_idle_size() == idle + 1
    finally:
        await store.close()


async def test_a_connection_left_aside_is_never_the_pools_last_nor_used_once_closed(clean_pg: str) -> None:
    """With a pool of one, nothing is left aside (a release or a read would wait for it); a connection left
    aside whose server session ended (a restart, an administrator) is dropped, and the next batch goes on."""
    lone = PostgresStore(PostgresConfig(dsn=SecretURL(clean_pg), pool_min=1, pool_max=1))
    await lone.open()
    try:
        assert (await lone.claim("t", "lone", FP, lease=30, ttl=60)).owned
        assert lone._spares == [] and lone._pool.get_idle_size() == 1
    finally:
        await lone.close()
    store = store_on(clean_pg)
    await store.open()
    admin = await asyncpg.connect(clean_pg)
    try:
        assert (await store.claim("t", "before", FP, lease=30, ttl=60)).owned
        [(kept, _)] = store._spares
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", await backend_pid(kept))
        await wait_for(lambda: closed(kept))  # this process read the end of that session
        assert (await store.claim("t", "after", FP, lease=30, ttl=60)).owned
    finally:
        await admin.close()
        await store.close()


async def test_what_batches_left_aside_never_keeps_a_small_pool_from_a_health_check_or_a_read(
    clean_pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool of two, one connection left aside by a batch, the other held by a release waiting on a key's lock:
    a health check gets a connection at once, not when the idle timer gives the spare back (never, under steady
    load). Then a batch and that release both wait on locks: a read waiting for a connection gets the batch's as
    soon as the batch ends, which leaves nothing aside meanwhile."""
    monkeypatch.setattr(postgres, "SPARE_IDLE", 600.0)  # as if batches kept coming
    store = PostgresStore(PostgresConfig(dsn=SecretURL(clean_pg), pool_min=2, pool_max=2))
    await store.open()
    busy_lock = slow_lock = None
    try:
        busy = await store.claim("t", "busy", FP, lease=30, ttl=60)
        assert (await store.claim("t", "other", FP, lease=30, ttl=60)).owned and len(store._spares) == 1
        busy_lock = await hold_key_locks(clean_pg, ["busy"])
        release = asyncio.ensure_future(store.release(busy))  # waits on the lock, on the pool's other connection
        while store._pool.get_idle_size():
            await asyncio.sleep(0.01)
        health = await store.health()
        assert health.ready, health.details  # the spare went back to the pool for it
        slow_lock = await hold_key_locks(clean_pg, ["slow"])
        slow = asyncio.ensure_future(store.claim("t", "slow", FP, lease=30, ttl=60))  # a batch waiting on a lock
        while store._pool.get_idle_size():
            await asyncio.sleep(0.01)
        read = asyncio.ensure_future(store.get("t", "other"))  # no connection left: it waits
        while not store._waiting:
            await asyncio.sleep(0.01)
        await slow_lock.close()  # the batch ends (the release still waits): its connection goes to the read
        assert (await slow).owned and (await read) is not None
        await busy_lock.close()
        assert await release
    finally:
        for lock in (busy_lock, slow_lock):
            if lock is not None and not lock.is_closed():
                await lock.close()
        await store.close()


async def test_two_replicas_batching_the_same_keys_in_opposite_orders_never_deadlock(clean_pg: str) -> None:
    """Each batch locks its keys in one global order; in queue order, two replicas' batches would deadlock
    (PostgreSQL then aborts one: a 503 for every request in it)."""
    one, two = store_on(clean_pg), store_on(clean_pg)
    await one.open()
    await two.open()
    try:
        for round_ in range(5):
            keys = [f"r{round_}-k{n}" for n in range(60)]
            results = await asyncio.gather(
                *(one.claim("t", k, FP, lease=30, ttl=60) for k in keys),
                *(two.claim("t", k, FP, lease=30, ttl=60) for k in reversed(keys)),
                return_exceptions=True,
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            assert not errors, errors[:3]
            owners: dict[str, int] = {}
            for claim in results:
                assert not isinstance(claim, BaseException)
                owners[claim.record.key] = owners.get(claim.record.key, 0) + claim.owned
            assert owners == dict.fromkeys(keys, 1)
        assert one._claims.batches < one._claims.items and two._claims.batches < two._claims.items
    finally:
        await one.close()
        await two.close()


@pytest.mark.parametrize("options", ["", "health_check_interval=30"], ids=["own-connection", "redis-py"])
async def test_concurrent_first_requests_share_statements_and_pipelines_and_execute_once(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, redis_url: str, clean_pg: str, redis_prefix: str,
    options: str,
) -> None:
    """On the store's own connection (store/resp.py) and on redis-py's (a url with options only it implements)."""
    proxy = await make_proxy(storage_section={"postgres": {"dsn": clean_pg, "pool_min": 1, "pool_max": 10},
                                              "redis": {"url": with_query(redis_url, options),
                                                        "key_prefix": redis_prefix}})
    store = proxy.proxy.store
    assert isinstance(store, RedisFrontedStore) and store._pipelines is not None
    assert (store._lean is None) == bool(options)

    def sent() -> tuple[int, int]:  # (pipelines, script calls) so far
        assert store._pipelines is not None
        return store._pipelines.batches, store._pipelines.items

    pg = durable(proxy)
    before, (trips, calls) = pg.statements, sent()
    answers = await asyncio.gather(*(proxy.post("/v1/charges", key=f"b-{n}", body=CHARGE) for n in range(60)))
    assert [resp.status for resp, _ in answers] == [201] * 60
    assert all(upstream.count(key=f"b-{n}") == 1 for n in range(60))
    assert pg.statements - before < 120  # one claim and one completion each, unbatched
    assert sent()[1] - calls >= 120  # a claim and a settle each, in Redis
    assert sent()[0] - trips < sent()[1] - calls  # they did share pipelines
    replays = await asyncio.gather(*(proxy.post("/v1/charges", key=f"b-{n}", body=CHARGE) for n in range(60)))
    assert all(resp.headers["Idempotent-Replayed"] == "true" and body == first[1]
               for (resp, body), first in zip(replays, answers, strict=True))
    assert len(upstream.executed) == 60
    assert redis_errors(proxy) == 0


def with_query(url: str, option: str) -> str:
    return url if not option else f"{url}{'&' if '?' in url else '?'}{option}"


@pytest.mark.parametrize("options", ["", "health_check_interval=30"], ids=["own-connection", "redis-py"])
async def test_scripts_redis_lost_are_loaded_again_in_a_pipeline(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, redis_url: str, clean_pg: str, redis_prefix: str,
    options: str,
) -> None:
    """On the store's own connection (store/resp.py) and, for a url with options only redis-py implements, on
    redis-py's pipeline."""
    proxy = await make_proxy(storage_section={"postgres": {"dsn": clean_pg, "pool_min": 1, "pool_max": 10},
                                              "redis": {"url": with_query(redis_url, options),
                                                                        "key_prefix": redis_prefix}})
    assert isinstance(proxy.proxy.store, RedisFrontedStore)
    assert (proxy.proxy.store._lean is None) == bool(options)
    resp, _ = await proxy.post("/v1/charges", key="warm", body=CHARGE)
    assert resp.status == 201
    sync_redis.Redis.from_url(redis_url).script_flush()
    answers = await asyncio.gather(*(proxy.post("/v1/charges", key=f"s-{n}", body=CHARGE) for n in range(10)))
    assert [resp.status for resp, _ in answers] == [201] * 10
    assert redis_errors(proxy) == 0  # no call fell back to PostgreSQL alone: Redis answered every one
    locked = [proxy.post("/v1/charges", key="s-0", body=CHARGE)]
    (resp, _), = await asyncio.gather(*locked)
    assert resp.headers["Idempotent-Replayed"] == "true"


async def test_a_failed_batch_gives_each_caller_its_own_exception() -> None:
    async def send(items: list[int]) -> list[int | BaseException]:
        try:
            raise OSError("cut")
        except OSError as cut:
            raise StoreUnavailable("down") from cut

    batcher: Batcher[int, int] = Batcher(send)
    results = await asyncio.gather(*(batcher.call(n) for n in range(3)), return_exceptions=True)
    assert all(isinstance(r, StoreUnavailable) and isinstance(r.__cause__, OSError) for r in results)
    assert len({id(r) for r in results}) == 3


async def hold_key_locks(dsn: str, keys: list[str]) -> asyncpg.Connection:
    """A session holding the per-key advisory locks the store's functions take: their calls wait on it."""
    conn = await asyncpg.connect(dsn)
    for key in keys:
        await conn.execute("SELECT pg_advisory_lock(hashtextextended($1 || chr(31) || $2, 0))", "t", key)
    return conn


async def test_a_cancelled_claim_that_was_not_sent_yet_is_never_sent(pg_store: PostgresStore, clean_pg: str) -> None:
    held = await hold_key_locks(clean_pg, [f"busy-{n}" for n in range(BATCHES_IN_FLIGHT)])
    try:
        busy = []
        for n in range(BATCHES_IN_FLIGHT):  # one batch per loop turn, each waiting on its key's lock
            busy.append(asyncio.ensure_future(pg_store.claim("t", f"busy-{n}", FP, lease=60, ttl=60)))
            while pg_store._claims.batches < n + 1:
                await asyncio.sleep(0)
        queued = asyncio.ensure_future(pg_store.claim("t", "queued", FP, lease=60, ttl=60))
        await asyncio.sleep(0)
        queued.cancel()
    finally:
        await held.close()  # the locks go with the session
    assert all(c.owned for c in await asyncio.gather(*busy))
    assert pg_store._claims.items == BATCHES_IN_FLIGHT  # the cancelled call never left
    assert await pg_store.get("t", "queued") is None  # never claimed: a retry owns it at once
    assert (await pg_store.claim("t", "queued", FP, lease=60, ttl=60)).owned


@pytest.mark.parametrize("batching", [True, False], ids=["behind-batches", "behind-the-pool"])
async def test_a_claim_counts_its_lease_from_when_its_statement_left_not_from_its_call(
    clean_pg: str, batching: bool
) -> None:
    """A claim may wait before its statement is even written: queued behind the batches on the wire (group
    commit), or for a pooled connection. PostgreSQL starts its lease only once the statement arrives. Counted from
    the claim's call (as the engine did), that wait came off the lease, and the forward's time to send with it."""
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"},
                          "storage": {"postgres": {"dsn": clean_pg, "pool_min": 1, "pool_max": 2}}})
    assert config.storage.postgres is not None
    store = PostgresStore(config.storage.postgres)
    await store.open()
    store.batching = batching
    busy_keys = [f"busy-{n}" for n in range(BATCHES_IN_FLIGHT if batching else config.storage.postgres.pool_max)]
    held = await hold_key_locks(clean_pg, busy_keys)
    try:
        busy = []
        for key in busy_keys:  # each on the wire (a batch, a connection), waiting on its key's lock
            busy.append(asyncio.ensure_future(store.claim("t", key, FP, lease=60, ttl=60)))
            while await held.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                      "AND datname = current_database()") < len(busy):
                pass  # one round trip per look
        called = time.monotonic()
        queued = asyncio.ensure_future(store.claim("t", "queued", FP, lease=60, ttl=60))
        await asyncio.sleep(0.3)  # it cannot leave before a busy one comes back: the wait it must not be charged
        let_go = time.monotonic()
    finally:
        await held.close()  # the locks go with the session
    try:
        claim = await queued
        answered = time.monotonic()
        assert claim.owned and let_go < claim.sent < answered
        assert claim.lease_end() == pytest.approx(claim.sent + 60, abs=0.001)
        assert all(c.owned and c.sent < called for c in await asyncio.gather(*busy))
    finally:
        await store.close()


async def test_a_request_whose_claim_waited_behind_batches_still_has_its_whole_time_to_forward(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str
) -> None:
    """The engine counts the lease from when the claim's statement was written (Claim.sent), not from its call:
    a request whose claim queued 2.5 s behind stalled batches still forwards with its whole upstream timeout (3 s)
    rather than what was left of it (1.5 s before a takeover could come: the lease, 6 s, less its 2 s margin)."""
    proxy = await make_proxy(storage_section={"postgres": {"dsn": clean_pg, "pool_min": 1, "pool_max": 10}},
                             upstream={"timeout": "3s"}, idempotency={"lease": "6s"})
    store = durable(proxy)
    assert isinstance(store, PostgresStore) and store.batching
    tenant = proxy.proxy.engine.resolve_tenant_value("Bearer t1")
    held = await asyncpg.connect(clean_pg)
    busy_keys = [f"busy-{n}" for n in range(BATCHES_IN_FLIGHT)]
    for key in busy_keys:
        await held.execute("SELECT pg_advisory_lock(hashtextextended($1 || chr(31) || $2, 0))", tenant, key)
    try:
        busy = []
        for key in busy_keys:  # one batch each, waiting on its key's lock
            busy.append(asyncio.ensure_future(proxy.post("/v1/charges", key=key, body=CHARGE)))
            while await held.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                      "AND datname = current_database()") < len(busy):
                pass  # one round trip per look
        queued = asyncio.ensure_future(proxy.post("/v1/charges", key="queued", body=CHARGE,
                                                  headers={"X-Test-Delay": "2"}))
        await asyncio.sleep(2.5)  # the claim waits for a batch to come back, before PostgreSQL starts its lease
        assert store._claims.batches == BATCHES_IN_FLIGHT
    finally:
        await held.close()  # the locks go with the session
    resp, _ = await queued
    assert resp.status == 201 and upstream.count(key="queued") == 1
    assert [resp.status for resp, _ in await asyncio.gather(*busy)] == [201] * BATCHES_IN_FLIGHT


async def test_a_cancelled_claim_already_on_the_wire_is_released_when_it_lands(
    pg_store: PostgresStore, clean_pg: str
) -> None:
    held = await hold_key_locks(clean_pg, ["busy"])
    try:
        busy = asyncio.ensure_future(pg_store.claim("t", "busy", FP, lease=60, ttl=60))
        abandoned = asyncio.ensure_future(pg_store.claim("t", "abandoned", FP, lease=60, ttl=60))
        while pg_store._claims.batches < 1:  # both left in one batch, which waits on busy's lock
            await asyncio.sleep(0)
        abandoned.cancel()
    finally:
        await held.close()
    assert (await busy).owned
    while pg_store._unclaiming or pg_store._claims._tasks:
        await asyncio.wait(pg_store._unclaiming | pg_store._claims._tasks)
    assert await pg_store.get("t", "abandoned") is None  # released, not left in flight for the whole lease


async def test_batched_completions_are_not_announced_unless_someone_waits(clean_pg: str) -> None:
    store = store_on(clean_pg)
    store.listen = True  # PostgreSQL alone: its NOTIFY wakes waiters
    store.announce_completions(False)
    await store.open()
    heard: list[str] = []
    arrived = asyncio.Event()
    listener = await asyncpg.connect(clean_pg)

    def hear(*args: Any) -> None:
        heard.append(args[3])
        arrived.set()

    await listener.add_listener(NOTIFY_CHANNEL, hear)
    try:
        done, released = await asyncio.gather(*(store.claim("t", k, FP, lease=30, ttl=60) for k in ("d", "r")))
        assert await store.complete(done, OK, ttl=60) and await store.release(released)
        await arrived.wait()  # notifications come in commit order: the completion's would be first
        assert heard == [Watchers.message("t", "r")]
    finally:
        await listener.close()
        await store.close()


async def test_completion_batches_stay_under_their_byte_cap(pg_store: PostgresStore) -> None:
    big = StoredResponse(status=201, headers=(), body=b"x" * (BATCH_BYTES // 2 + 1))
    claims = await asyncio.gather(*(pg_store.claim("t", f"big-{n}", FP, lease=30, ttl=60) for n in range(3)))
    before = pg_store._completes.batches
    assert await asyncio.gather(*(pg_store.complete(c, big, ttl=60) for c in claims)) == [True] * 3
    assert pg_store._completes.batches - before == 3  # two of them together would pass the cap


async def decisions(store: PostgresStore, prefix: str, *, together: bool) -> list[tuple[object, ...]]:
    """What the store decides for each kind of claim and completion, each call sent alone or (``together``) in a
    batch with three other calls of its kind, on keys of their own."""
    fillers = iter(range(10_000))

    async def claim(key: str, fp: str, lease: float = 30) -> Claim:
        call = store.claim("t", prefix + key, fp, lease=lease, ttl=60)
        if not together:
            return await call
        batches = store._claims.batches
        got, *_ = await asyncio.gather(call, *(store.claim("t", f"{prefix}f{next(fillers)}", FP, lease=30, ttl=60)
                                              for _ in range(3)))
        assert store._claims.batches == batches + 1  # the four left in one statement
        return got

    async def complete(claim: Claim) -> bool:
        if not together:
            return await store.complete(claim, OK, ttl=60)
        others = [await store.claim("t", f"{prefix}f{next(fillers)}", FP, lease=30, ttl=60) for _ in range(3)]
        batches = store._completes.batches
        done, *rest = await asyncio.gather(*(store.complete(c, OK, ttl=60) for c in (claim, *others)))
        assert rest == [True] * 3 and store._completes.batches == batches + 1
        return done

    def seen(claim: Claim, owner: Claim) -> tuple[object, ...]:
        record = claim.record
        return (claim.owned, claim.took_over, claim.replaced_expired, record.state, record.fingerprint,
                record.lease_token == owner.token, record.response, abs(claim.now - time.time()) < 5)

    owner = await claim("k", FP)
    steps = [seen(owner, owner), seen(await claim("k", FP), owner), seen(await claim("k", "e" * 64), owner)]
    forged = Claim(record=replace(owner.record, lease_token="forged"), owned=True, now=owner.now, sent=owner.sent)
    steps += [(await complete(forged),), (await complete(owner),), seen(await claim("k", FP), owner)]
    lapsed = await claim("lapsed", FP, lease=0)  # its lease ran out as it was granted
    graced = await claim("lapsed", FP)  # the lease's grace first (TAKEOVER_GRACE): the record stands, the owner's
    assert graced.grace
    await asyncio.sleep(max((graced.record.lease_expires_at or 0) - time.time(), 0) + 0.02)
    taker = await claim("lapsed", FP)
    steps += [seen(graced, lapsed), seen(taker, taker), (await complete(lapsed),), (await complete(taker),)]
    return steps


async def test_a_lone_call_runs_the_per_key_function_and_decides_as_a_batched_one(
    pg_store: PostgresStore, clean_pg: str
) -> None:
    """At low load a batch is one call: it runs idemproxy_claim / idemproxy_complete itself (no arrays to encode,
    no loop), and must decide exactly as the batch functions, which loop over the same per-key functions."""
    batched = await decisions(pg_store, "b-", together=True)
    assert batched[:3] == [
        (True, False, False, "in_flight", FP, True, None, True),  # the first: owner
        (False, False, False, "in_flight", FP, True, None, True),  # the same again: in flight, the owner's
        (False, False, False, "in_flight", FP, True, None, True),  # another payload: the record, for a 422
    ]
    assert batched[3:6] == [(False,), (True,), (False, False, False, "completed", FP, False, OK, True)]
    assert batched[6:] == [(False, False, False, "in_flight", FP, True, None, True),  # in its grace
                           (True, True, False, "in_flight", FP, True, None, True), (False,), (True,)]
    conn = await asyncpg.connect(clean_pg)
    await conn.execute("DROP FUNCTION idemproxy_claim_many, idemproxy_complete_many")
    await conn.close()
    try:  # the store still believes it may batch: only calls sent alone can work now
        assert await decisions(pg_store, "l-", together=False) == batched
        pair = await asyncio.gather(*(pg_store.claim("t", f"pair-{n}", FP, lease=30, ttl=60) for n in range(2)),
                                    return_exceptions=True)
        assert all(isinstance(result, StoreUnavailable) for result in pair)  # a batch of two needs them
    finally:
        await reopen(clean_pg)


async def mixed_claims(store: PostgresStore, dsn: str, prefix: str, *, together: bool) -> list[tuple[object, ...]]:
    """Every kind of claim at once: new keys, a new key sent twice, and keys whose record is completed, expired,
    in flight (alive, or lapsed with the same or another payload). ``together``: in one batch (one statement),
    else one call at a time in the same order. What each call was told."""
    def key(name: str) -> str:
        return prefix + name

    done = await store.claim("t", key("done"), FP, lease=30, ttl=60)
    assert await store.complete(done, OK, ttl=60)
    expired = await store.claim("t", key("expired"), FP, lease=30, ttl=60)
    assert await store.complete(expired, OK, ttl=60)
    conn = await asyncpg.connect(dsn)
    try:  # its day passed: the record sits in the default partition until a claim replaces it
        await conn.execute("UPDATE idemproxy_records SET expires_at = now() - interval '2 days' WHERE key = $1",
                           key("expired"))
    finally:
        await conn.close()
    alive = await store.claim("t", key("alive"), FP, lease=30, ttl=60)
    lapsed = await store.claim("t", key("lapsed"), FP, lease=0, ttl=60)  # its lease ran out as it was granted
    other = await store.claim("t", key("other"), FP, lease=0, ttl=60)
    calls = [("new-1", FP, 60), ("twice", FP, 60), ("done", FP, 60), ("twice", FP, 60), ("expired", FP, 60),
             ("alive", FP, 60), ("lapsed", FP, 60), ("other", "e" * 64, 60), ("done", "e" * 64, 60),
             ("new-2", FP, 10),  # a ttl shorter than the lease: the record lives as long as the lease
             ("lapsed", FP, 60),  # after its first call gave it its grace: in flight, the owner's still
             ("other", FP, 60)]  # lapsed under this payload: its grace, though the earlier call could not
    if together:
        batches = store._claims.batches
        claims = await asyncio.gather(*(store.claim("t", key(k), fp, lease=30, ttl=ttl) for k, fp, ttl in calls))
        assert store._claims.batches == batches + 1  # all of them in one statement
    else:
        claims = [await store.claim("t", key(k), fp, lease=30, ttl=ttl) for k, fp, ttl in calls]
    before = {"done": done, "expired": expired, "alive": alive, "lapsed": lapsed, "other": other}
    seen: list[tuple[object, ...]] = []
    for (name, _, _), claim in zip(calls, claims, strict=True):
        record, earlier = claim.record, before.get(name)
        seen.append((name, claim.owned, claim.took_over, claim.grace, claim.replaced_expired, record.state,
                     record.fingerprint,
                     record.lease_token == claim.token if claim.owned else record.lease_token == (
                         earlier.token if earlier is not None else None),
                     record.response, round(record.expires_at - record.created_at) if claim.owned else None,
                     abs(claim.now - time.time()) < 5))
    return seen


async def test_a_batch_mixing_every_kind_of_claim_decides_each_as_one_call_alone(
    pg_store: PostgresStore, clean_pg: str
) -> None:
    """New keys and standing records are decided for the whole batch in one statement, the others by the per-key
    function: the split must not change one decision, nor the order in which a key sent twice is decided."""
    batched = await mixed_claims(pg_store, clean_pg, "b-", together=True)
    alone = await mixed_claims(pg_store, clean_pg, "a-", together=False)
    assert batched == alone
    owned = {name: (took_over, expired) for name, owner, took_over, _, expired, *_ in batched if owner}
    assert owned == {"new-1": (False, False), "twice": (False, False), "expired": (False, True),
                     "new-2": (False, False)}
    # a lapsed lease is given its grace by the first call of its payload; the later one finds it standing
    assert [(row[0], row[3]) for row in batched if row[0] in ("lapsed", "other")] == [
        ("lapsed", True), ("other", False), ("lapsed", True), ("other", True)]
    assert next(row for row in batched if row[0] == "done" and row[6] == FP)[8] == OK  # a replay
    assert [row[9] for row in batched if str(row[0]).startswith("new")] == [60, 30]  # expiry: the ttl, or the lease


async def claim_behind_a_lock(
    store: PostgresStore, dsn: str, key: str, *, together: bool
) -> tuple[Claim, float, float]:
    """Claim ``key`` (alone, or with another key in one batch) while another session holds the key's lock: the
    claim, and the time the lock was let go, on the wall clock and on the monotonic one."""
    held = await hold_key_locks(dsn, [key])
    calls = [store.claim("t", key, FP, lease=30, ttl=60)]
    if together:
        calls.append(store.claim("t", f"{key}-other", FP, lease=30, ttl=60))
    claims = asyncio.gather(*calls)
    try:
        while not await held.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                      "AND datname = current_database()"):
            pass  # one round trip per look, until the claim's transaction waits on the lock
        await asyncio.sleep(0.2)  # not a race: the interval between that transaction's start and its read
        released, let_go = time.time(), time.monotonic()
    finally:
        await held.close()
    return (await claims)[0], released, let_go


@pytest.mark.parametrize("together", [False, True], ids=["alone", "batched"])
async def test_an_owner_counts_from_its_transaction_start_a_standing_record_from_when_it_was_read(
    pg_store: PostgresStore, clean_pg: str, together: bool
) -> None:
    """The owner's lease was counted from the transaction's start, so its clock is that; a record that stands is
    judged (a cached copy's lifetime, lease_expires_in) by the clock when it was read, later. This process counts
    the owner's lease from before that start (Claim.sent, the statement's write), never from the answer."""
    owner, released, let_go = await claim_behind_a_lock(pg_store, clean_pg, "new", together=together)
    assert owner.owned and owner.now < released - 0.1 and owner.sent < let_go - 0.1
    await pg_store.claim("t", "standing", FP, lease=30, ttl=60)
    standing, released, _ = await claim_behind_a_lock(pg_store, clean_pg, "standing", together=together)
    assert not standing.owned and standing.now >= released - 0.01


async def test_a_completion_postgresql_refuses_fails_alone_and_the_others_are_told_they_landed(
    pg_store: PostgresStore,
) -> None:
    claims = await asyncio.gather(*(pg_store.claim("t", f"c{n}", FP, lease=30, ttl=60) for n in range(3)))
    done = await asyncio.gather(pg_store.complete(claims[0], OK, ttl=60), pg_store.complete(claims[1], OK, ttl=1e300),
                                pg_store.complete(claims[2], OK, ttl=60), return_exceptions=True)
    assert done[0] is True and done[2] is True, done
    assert isinstance(done[1], StoreUnavailable)  # a timestamp out of range: that call alone
    assert [(await pg_store.get("t", f"c{n}")).state for n in range(3)] == [  # type: ignore[union-attr]
        "completed", "in_flight", "completed"]


async def test_a_schema_without_the_batch_functions_goes_one_call_at_a_time(clean_pg: str) -> None:
    """A schema last migrated by an older version (migrate: off) has only the per-key functions."""
    await reopen(clean_pg)  # the schema, as a replica with migrate: auto makes it
    conn = await asyncpg.connect(clean_pg)
    await conn.execute("DROP FUNCTION IF EXISTS idemproxy_claim_many, idemproxy_complete_many")
    await conn.close()
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"},
                          "storage": {"postgres": {"dsn": clean_pg, "migrate": "off"}}})
    assert config.storage.postgres is not None
    store = PostgresStore(config.storage.postgres)
    await store.open()
    try:
        assert not store.batching
        claims = await asyncio.gather(*(store.claim("t", k, FP, lease=30, ttl=60) for k in ("a", "a", "b")))
        assert [c.owned for c in claims].count(True) == 2  # one of the two "a", and "b"
        assert await asyncio.gather(*(store.complete(c, OK, ttl=60) for c in claims if c.owned)) == [True, True]
        assert store._claims.batches == 0 and store._completes.batches == 0
    finally:
        await store.close()
        await reopen(clean_pg)  # the functions back for the tests after this one


async def reopen(dsn: str) -> None:
    """Open and close a store with migrate: auto (it creates or updates the schema and its functions)."""
    store = store_on(dsn)
    await store.open()
    await store.close()


@pytest.mark.parametrize("options", ["", "health_check_interval=30"], ids=["own-connection", "redis-py"])
async def test_a_redis_claim_cancelled_on_the_wire_drops_its_lock_when_the_reply_lands(
    make_proxy: ProxyFactory, redis_relay: Relay, redis_url: str, clean_pg: str, redis_prefix: str,  # noqa: F811
    options: str,
) -> None:
    """The caller of a Redis claim is cancelled while the script is on its way (held in a stalled relay): Redis
    still runs it and grants the lock, nobody will act on it, so the store drops it when the reply comes back.
    Without that, the key would answer 409 for up to LOCK_MAX seconds with nobody behind it."""
    proxy = await make_proxy(storage_section={
        "postgres": {"dsn": clean_pg, "pool_min": 1, "pool_max": 10},
        "redis": {"url": with_query(urlsplit(redis_url)._replace(netloc=f"127.0.0.1:{redis_relay.port}").geturl(),
                                    options), "key_prefix": redis_prefix},
    })
    store = proxy.proxy.store
    assert isinstance(store, RedisFrontedStore) and (store._lean is None) == bool(options)
    assert (await store.claim("t", "warm", FP, lease=60, ttl=60)).owned  # connected, scripts loaded

    def round_trips() -> int:
        assert store._pipelines is not None
        return store._pipelines.batches

    before = round_trips()
    redis_relay.stall()
    try:
        claim = asyncio.ensure_future(store.claim("t", "abandoned", FP, lease=60, ttl=60))
        while round_trips() == before:  # until its pipeline has left for Redis (no wall clock: the relay stalls
            await asyncio.sleep(0)  # only as long as this takes, far below the store's 0.5 s socket timeout)
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claim
    finally:
        redis_relay.restore()
    lock = store._keys("t", "abandoned")[0]
    with sync_redis.Redis.from_url(redis_url) as direct:
        await wait_for(lambda: not store._unlocking and not direct.exists(lock))
    assert await store.get("t", "abandoned") is None  # it never reached PostgreSQL
    assert (await store.claim("t", "abandoned", FP, lease=60, ttl=60)).owned  # a retry owns it at once
