"""PostgreSQL daily partitions: uniqueness across a midnight boundary, maintenance, and converting a live table."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import UTC, date, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from idemproxy.app import Proxy
from idemproxy.config import load_config
from idemproxy.metrics import Metrics
from idemproxy.store import State, StoredResponse
from idemproxy.store.postgres import (
    DEFAULT_PARTITION,
    IDLE_IN_TRANSACTION_TIMEOUT,
    MAINTAIN_LOCK,
    PARTITION_DAYS_AHEAD,
    PostgresStore,
    apply_migrations,
    create_partition,
    layout,
    migrate,
)
from tests.conftest import scratch_database
from tests.relay import Relay
from tests.test_settle import via

FP = "f" * 64
OK = StoredResponse(status=201, headers=(("Content-Type", "application/json"),), body=b'{"id": 1}')
CLAIM = "SELECT (c.rec).*, c.owned FROM idemproxy_claim($1, $2, $3, $4, $5, $6, $7) AS c"


@pytest.fixture
def db(pg_admin_dsn: str) -> Iterator[str]:
    with scratch_database(pg_admin_dsn, "idemproxy_part") as dsn:
        yield dsn


def store_on(dsn: str, partitions: str = "daily", metrics: Metrics | None = None) -> PostgresStore:
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"},
                          "storage": {"postgres": {"dsn": dsn, "pool_min": 1, "pool_max": 10,
                                                   "partitions": partitions}}})
    assert config.storage.postgres is not None
    return PostgresStore(config.storage.postgres, metrics)


@pytest.fixture
async def store(db: str) -> AsyncIterator[PostgresStore]:
    backend = store_on(db)
    await backend.open()
    yield backend
    await backend.close()


async def connect(dsn: str) -> Any:
    return await asyncpg.connect(dsn)


def partition(day: date) -> str:
    return f"idemproxy_records_p{day:%Y%m%d}"


async def partitions(conn: Any) -> set[str]:
    rows = await conn.fetch("SELECT inhrelid::regclass::text AS name FROM pg_inherits "
                            "WHERE inhparent = 'idemproxy_records'::regclass")
    return {row["name"] for row in rows}


async def where(conn: Any, tenant: str, key: str) -> list[str]:
    """The partitions holding (tenant, key): exactly one when all is well."""
    rows = await conn.fetch("SELECT tableoid::regclass::text AS part FROM idemproxy_records "
                            "WHERE tenant = $1 AND key = $2", tenant, key)
    return [row["part"] for row in rows]


async def test_a_new_schema_is_partitioned_by_expiry_day_created_ahead(store: PostgresStore, db: str) -> None:
    conn = await connect(db)
    try:
        today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
        assert await layout(conn) == "daily"
        expected = {partition(today + timedelta(days=n)) for n in range(PARTITION_DAYS_AHEAD + 1)}
        assert await partitions(conn) == expected | {DEFAULT_PARTITION}
        claim = await store.claim("t", "k", FP, lease=30, ttl=2 * 86400)
        assert await where(conn, "t", "k") == [partition(today + timedelta(days=2))]
        assert await store.complete(claim, OK, ttl=3 * 86400)  # the completion's TTL moves it to its new day
        assert await where(conn, "t", "k") == [partition(today + timedelta(days=3))]
        assert (await store.claim("t", "k", FP, lease=30, ttl=60)).record.response == OK
    finally:
        await conn.close()


async def test_a_completion_finds_its_record_even_where_the_claim_did_not_leave_it(store: PostgresStore) -> None:
    """complete() looks in the claim's expiry day first; a record elsewhere (moved out of the default partition,
    or a caller with a guessed expiry) is still found, and the fence still holds."""
    claim = await store.claim("t", "moved", FP, lease=30, ttl=60)
    elsewhere = replace(claim, record=replace(claim.record, expires_at=claim.record.expires_at + 3 * 86400))
    stranger = replace(elsewhere, record=replace(elsewhere.record, lease_token="not-the-owner"))
    assert not await store.complete(stranger, OK, ttl=60)
    assert await store.complete(elsewhere, OK, ttl=60)
    assert (await store.claim("t", "moved", FP, lease=30, ttl=60)).record.response == OK


async def test_a_claim_racing_one_from_before_midnight_waits_and_sees_it(store: PostgresStore, db: str) -> None:
    """A claim at 23:59:59.999 (its record expiring in day D) and a retry at 00:00:00.001 (expiring in day D+1)
    would land in different partitions, where no unique index can see both: the second must wait for the first
    and then see its record, never insert its own."""
    first, second = await connect(db), await connect(db)
    try:
        midnight = datetime.combine(await first.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date"),
                                    datetime.min.time(), UTC) + timedelta(days=1)
        before, after = midnight - timedelta(milliseconds=1), midnight + timedelta(milliseconds=1)
        transaction = first.transaction()
        await transaction.start()
        mine = await first.fetchrow(CLAIM, "t", "midnight", FP, "token-a", 30.0, 86400.0, before)
        assert mine["owned"]
        racing = asyncio.ensure_future(second.fetchrow(CLAIM, "t", "midnight", FP, "token-b", 30.0, 86400.0, after))
        await asyncio.sleep(0.5)
        assert not racing.done(), "the second claim did not wait for the first: both may own the key"
        await transaction.commit()
        theirs = await asyncio.wait_for(racing, 5)
        assert not theirs["owned"] and theirs["lease_token"] == "token-a"
        assert await where(first, "t", "midnight") == [partition(midnight.date())]
    finally:
        await first.close()
        await second.close()


async def test_many_claims_straddling_midnight_have_one_owner_per_key(store: PostgresStore, db: str) -> None:
    conn = await connect(db)
    pool = await asyncpg.create_pool(db, min_size=10, max_size=10)
    try:
        midnight = datetime.combine(await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date"),
                                    datetime.min.time(), UTC) + timedelta(days=1)
        instants = (midnight - timedelta(milliseconds=1), midnight + timedelta(milliseconds=1))

        async def claim(key: str, at: datetime, token: str) -> bool:
            async with pool.acquire() as c:
                return bool((await c.fetchrow(CLAIM, "t", key, FP, token, 30.0, 86400.0, at))["owned"])

        keys = [f"k{i}" for i in range(100)]
        owned = await asyncio.gather(*(claim(k, at, f"{k}-{n}") for k in keys for n, at in enumerate(instants)))
        assert sum(owned) == len(keys)
        counts = await conn.fetch("SELECT key, count(*) AS n FROM idemproxy_records GROUP BY key")
        assert {row["key"]: row["n"] for row in counts} == dict.fromkeys(keys, 1)
    finally:
        await pool.close()
        await conn.close()


async def test_maintenance_drops_expired_days_whole_and_keeps_today(db: str) -> None:
    metrics = Metrics()
    backend = store_on(db, metrics=metrics)
    await backend.open()
    conn = await connect(db)
    try:
        today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
        yesterday = today - timedelta(days=1)
        assert await create_partition(conn, yesterday)
        at = datetime.combine(yesterday, datetime.min.time(), UTC) + timedelta(hours=1)
        for i in range(20):
            await conn.fetchrow(CLAIM, "t", f"old{i}", FP, f"tok{i}", 30.0, 60.0, at)
        assert len(await where(conn, "t", "old0")) == 1
        await backend.complete(await backend.claim("t", "live", FP, lease=30, ttl=60), OK, ttl=60)

        done = await backend.maintain()
        assert done is not None and done.dropped == (partition(yesterday),) and not done.created
        assert partition(yesterday) not in await partitions(conn)
        assert await conn.fetchval("SELECT count(*) FROM idemproxy_records WHERE key LIKE 'old%'") == 0
        assert (await backend.get("t", "live")) is not None
        text = metrics.render().decode()
        assert "idemproxy_partitions_dropped_total 1.0" in text
        assert f"idemproxy_partitions {PARTITION_DAYS_AHEAD + 1}.0" in text
        again = await backend.maintain()
        assert again is not None and not again.dropped and not again.created
    finally:
        await conn.close()
        await backend.close()


async def test_a_proxy_maintains_the_partitions_as_it_starts(db: str) -> None:
    """A day that expired while no proxy ran is dropped at start, not an interval later, and the partitions
    gauge reads the partitions standing from the start (it read 0 for the first 30 s of every replica)."""
    backend = store_on(db)
    await backend.open()  # the daily layout
    await backend.close()
    conn = await connect(db)
    proxy = Proxy(load_config({"upstream": {"url": "http://127.0.0.1:1"}, "log": {"access": "off"},
                               "storage": {"postgres": {"dsn": db, "pool_min": 1, "partitions": "daily"}}}))
    try:
        yesterday = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date - 1")
        assert await create_partition(conn, yesterday)
        await proxy.start()
        deadline = asyncio.get_running_loop().time() + 10  # well inside SWEEP_INTERVAL (30 s)
        while "idemproxy_partitions_dropped_total 1.0" not in (text := proxy.metrics.render().decode()):
            assert asyncio.get_running_loop().time() < deadline, "the expired day was not dropped at start"
            await asyncio.sleep(0.05)
        assert f"idemproxy_partitions {PARTITION_DAYS_AHEAD + 1}.0" in text
        assert partition(yesterday) not in await partitions(conn)
    finally:
        await proxy.stop()
        await conn.close()


async def test_a_drop_blocked_by_a_long_transaction_waits_for_the_next_pass(store: PostgresStore, db: str) -> None:
    conn, other = await connect(db), await connect(db)
    try:
        yesterday = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date - 1")
        assert await create_partition(conn, yesterday)
        transaction = other.transaction()
        await transaction.start()
        await other.execute(f"LOCK TABLE {partition(yesterday)} IN ACCESS SHARE MODE")  # a long reader
        blocked = await store.maintain()
        assert blocked is not None and blocked.dropped == ()  # no store error: skipped after the lock timeout
        assert (await store.claim("t", "meanwhile", FP, lease=30, ttl=60)).owned
        await transaction.rollback()
        done = await store.maintain()
        assert done is not None and done.dropped == (partition(yesterday),)
    finally:
        await other.close()
        await conn.close()


async def test_one_replica_at_a_time_maintains(store: PostgresStore, db: str) -> None:
    other = await connect(db)
    try:
        await other.execute("SELECT pg_advisory_lock($1)", MAINTAIN_LOCK)
        assert await store.maintain() is None
        await other.execute("SELECT pg_advisory_unlock($1)", MAINTAIN_LOCK)
        assert await store.maintain() is not None
    finally:
        await other.close()


async def test_a_record_beyond_the_days_ahead_waits_in_default_then_moves_to_its_day(
    store: PostgresStore, db: str
) -> None:
    conn = await connect(db)
    try:
        today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
        far = PARTITION_DAYS_AHEAD + 3
        claim = await store.claim("t", "far", FP, lease=30, ttl=far * 86400)
        assert await store.complete(claim, OK, ttl=far * 86400)
        assert await where(conn, "t", "far") == [DEFAULT_PARTITION]
        assert await create_partition(conn, today + timedelta(days=far))
        assert await where(conn, "t", "far") == [partition(today + timedelta(days=far))]
        assert (await store.claim("t", "far", FP, lease=30, ttl=60)).record.response == OK
    finally:
        await conn.close()


async def waiting_on_locks(conn: Any, count: int) -> None:
    """Until `count` other sessions of this database wait on a lock (no timing guess about who got where)."""
    query = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
             "AND wait_event_type = 'Lock'")
    for _ in range(500):
        if await conn.fetchval(query) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {count} sessions ever waited on a lock")


async def test_a_retry_while_its_record_moves_out_of_default_finds_it_and_is_not_forwarded(db: str) -> None:
    """A record of a TTL beyond the days created ahead waits in DEFAULT until maintenance creates its day and
    moves it there. A claim planned while the move was under way (a fresh connection: its partition list read
    before the ATTACH) found the record in neither place and inserted a second one: the retry of a completed
    request was told to forward (found by audit, 2026-11-27). Maintenance now locks the whole table first, so a
    claim waits before it lists the partitions. Another session holding the table (a manual ANALYZE) keeps the
    window open; the test waits until both the maintenance and the retry are queued on locks."""
    first, second = store_on(db), store_on(db)
    await first.open()
    conn, blocker, maintenance = await connect(db), await connect(db), await connect(db)
    try:
        far = PARTITION_DAYS_AHEAD + 3
        claim = await first.claim("t", "pay-1", FP, lease=60, ttl=far * 86400)
        assert await first.complete(claim, OK, ttl=far * 86400)
        assert await where(conn, "t", "pay-1") == [DEFAULT_PARTITION]
        day = (await conn.fetchval("SELECT expires_at FROM idemproxy_records")).astimezone(UTC).date()
        await second.open()  # another replica, its connections fresh
        analyze = blocker.transaction()
        await analyze.start()
        await blocker.execute("LOCK TABLE idemproxy_records IN SHARE UPDATE EXCLUSIVE MODE")
        creating = asyncio.ensure_future(create_partition(maintenance, day))
        await waiting_on_locks(conn, 1)
        retry = asyncio.ensure_future(second.claim("t", "pay-1", FP, lease=60, ttl=far * 86400))
        await waiting_on_locks(conn, 2)
        await analyze.commit()
        assert await asyncio.wait_for(creating, 10)
        again = await asyncio.wait_for(retry, 10)
        assert await where(conn, "t", "pay-1") == [partition(day)], "one record, in its day"
        assert not again.owned and again.record.response == OK, "the retry of a completed request would be forwarded"
    finally:
        for c in (conn, blocker, maintenance):
            await c.close()
        await first.close()
        await second.close()


async def test_the_default_partition_is_swept_by_rows(store: PostgresStore, db: str) -> None:
    conn = await connect(db)
    try:
        at = datetime.now(UTC) - timedelta(days=30)  # expired long ago: before every partition, so in default
        await conn.fetchrow(CLAIM, "t", "ancient", FP, "tok", 1.0, 1.0, at)
        assert await where(conn, "t", "ancient") == [DEFAULT_PARTITION]
        assert await store.sweep(100) == 1
        assert await where(conn, "t", "ancient") == []
    finally:
        await conn.close()


async def test_a_first_start_on_an_empty_database_warns_of_nothing(db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="idemproxy.store")
    applied, shape = await apply_migrations(store_on(db).config)
    assert applied and shape == "daily"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []  # a new schema is laid out, not "converted"
    assert any("laid out in daily partitions" in r.getMessage() for r in caplog.records)


async def test_migrate_converts_a_live_single_table_without_losing_or_duplicating_a_record(
    db: str, caplog: pytest.LogCaptureFixture,
) -> None:
    old = store_on(db, partitions="none")
    await old.open()
    assert old.layout == "none"
    completed = {}
    for i in range(50):
        claim = await old.claim("t", f"done{i}", FP, lease=30, ttl=3600)
        response = StoredResponse(status=201, headers=(("X-N", str(i)),), body=f"body {i}".encode())
        assert await old.complete(claim, response, ttl=3600)
        completed[f"done{i}"] = response
    in_flight = await old.claim("t", "running", FP, lease=30, ttl=3600)
    expired = await old.claim("t", "stale", FP, lease=0.05, ttl=0.05)
    await old.complete(expired, OK, ttl=0.05)
    await asyncio.sleep(0.1)

    # A replica starting with the default (daily) does not convert a table holding records by itself.
    starting = store_on(db)
    await starting.open()
    assert starting.layout == "none"
    await starting.close()

    caplog.set_level(logging.INFO, logger="idemproxy.store")
    applied, shape = await apply_migrations(store_on(db).config)
    assert (applied, shape) == ([], "daily")
    assert "converted idemproxy_records to daily partitions (52 records)" in [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # A replica still running on the single table follows the conversion at its next claim.
    assert (await old.claim("t", "during", FP, lease=30, ttl=3600)).owned and old.layout == "daily"
    assert not (await old.claim("t", "during", FP, lease=30, ttl=3600)).owned
    await old.close()

    new = store_on(db)
    await new.open()
    conn = await connect(db)
    try:
        assert new.layout == "daily" and await layout(conn) == "daily"
        counts = await conn.fetch("SELECT key, count(*) AS n FROM idemproxy_records GROUP BY key")
        assert {row["key"]: row["n"] for row in counts} == dict.fromkeys([*completed, "running", "stale", "during"], 1)
        assert await conn.fetchval("SELECT to_regclass('idemproxy_records_unpartitioned')") is None
        for key, response in completed.items():
            replay = await new.claim("t", key, FP, lease=30, ttl=3600)
            assert not replay.owned and replay.record.response == response
        standing = await new.claim("t", "running", FP, lease=30, ttl=3600)
        assert not standing.owned and standing.record.state is State.IN_FLIGHT
        assert await new.complete(in_flight, OK, ttl=3600)  # the lease token survived the conversion
        assert (await new.claim("t", "stale", FP, lease=30, ttl=3600)).replaced_expired
        assert (await new.claim("t", "new-key", FP, lease=30, ttl=3600)).owned

        assert await apply_migrations(new.config) == ([], "daily")  # safe to run twice
        assert await conn.fetchval("SELECT count(*) FROM idemproxy_records") == len(completed) + 4
    finally:
        await conn.close()
        await new.close()


async def test_partitions_none_keeps_one_table(db: str) -> None:
    conn = await connect(db)
    try:
        await migrate(conn, "none")
        assert await layout(conn) == "none"
        assert await conn.fetchval("SELECT to_regproc('idemproxy_claim')") is None
    finally:
        await conn.close()


async def test_maintenance_whose_connection_went_dark_under_its_lock_does_not_hold_the_table(db: str) -> None:
    """Creating a day's partition locks the records table (ACCESS EXCLUSIVE) over several round trips. Should its
    connection go dark in between (a network partition, the replica standing still), the server hears nothing and
    keeps the transaction and its lock until its own TCP keepalive, two hours by default: every claim of every
    replica waits behind it and fails. Each pooled connection now has the server end a transaction of ours left
    idle for IDLE_IN_TRANSACTION_TIMEOUT (5 s), so the lock goes with it."""
    host, port = urlsplit(db).hostname or "127.0.0.1", urlsplit(db).port or 5432
    with Relay(host, port, name="pg") as relay:
        store = store_on(via(relay, db))
        await store.open()
        direct = await connect(db)  # a claim's connection, straight to the server
        try:
            day = await direct.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date") + timedelta(days=40)
            locked = asyncio.Event()

            class DarkAfterTheLock:  # the pooled connection, its network gone dark once the table is locked
                def __init__(self, conn: Any) -> None:
                    self.conn = conn

                def __getattr__(self, name: str) -> Any:
                    return getattr(self.conn, name)

                async def execute(self, sql: str, *args: Any) -> Any:
                    done = await self.conn.execute(sql, *args)
                    if sql.startswith("LOCK TABLE"):
                        relay.strand()  # open connections silent for good, both ways; no close passed on
                        locked.set()
                    return done

            async with store._pool.acquire() as conn:
                ddl = asyncio.ensure_future(create_partition(DarkAfterTheLock(conn), day))
                await asyncio.wait_for(locked.wait(), 10)
                began = asyncio.get_running_loop().time()
                count = await asyncio.wait_for(direct.fetchval("SELECT count(*) FROM idemproxy_records"), 20)
                waited = asyncio.get_running_loop().time() - began
                with contextlib.suppress(Exception):  # (its statement went unanswered: the driver's timeout)
                    await ddl
            assert count == 0 and waited < IDLE_IN_TRANSACTION_TIMEOUT + 3, waited
            assert partition(day) not in await partitions(direct)  # rolled back whole, created by the next pass
        finally:
            await direct.close()
            await store.close()
