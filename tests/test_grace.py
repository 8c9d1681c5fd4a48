"""The takeover grace (store.base.TAKEOVER_GRACE) on PostgreSQL: claims racing on a lapsed record, and a grace
given by a claim that queued on a lock (the sweeper's part is in tests/test_settle.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest

from idemproxy.config import load_config
from idemproxy.store import build_store
from idemproxy.store.base import Claim, StoredResponse
from idemproxy.store.postgres import PostgresStore
from tests.conftest import empty_records

FP = "f" * 64
N = 6


async def open_store(dsn: str, partitions: str) -> PostgresStore:
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"},
                          "storage": {"postgres": {"dsn": dsn, "partitions": partitions, "pool_max": 20}}})
    store = build_store(config.storage)
    await store.open()
    assert isinstance(store, PostgresStore)
    return store


async def waiting(dsn: str, n: int) -> None:
    """Until ``n`` sessions wait on a lock (one round trip per look)."""
    conn = await asyncpg.connect(dsn)
    try:
        while await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                  "AND datname = current_database()") < n:
            pass
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def holding(dsn: str, layout: str, key: str) -> AsyncIterator[None]:
    """A session holding the record's lock (the row, or the key's advisory lock) until the block ends, as a
    slow writer of it would."""
    held = await asyncpg.connect(dsn)
    try:
        async with held.transaction():
            if layout == "none":
                await held.execute("UPDATE idemproxy_records SET claim_kind = claim_kind WHERE tenant = 't' "
                                   "AND key = $1", key)
            else:
                await held.execute("SELECT pg_advisory_xact_lock(hashtextextended('t' || chr(31) || $1, 0))", key)
            yield
    finally:
        await held.close()


async def claims_behind_a_lock(stores: list[PostgresStore], dsn: str, layout: str, key: str) -> list[Claim]:
    """Every store claims ``key`` at once, all queued behind a session holding the record's lock, then let go."""
    async with holding(dsn, layout, key):
        claims = [asyncio.ensure_future(s.claim("t", key, FP, lease=30, ttl=60)) for s in stores]
        await waiting(dsn, len(stores))
    return await asyncio.gather(*claims)  # (no claim fails: an error would fail the test here)


@pytest.mark.parametrize("layout", ["none", "daily"])
async def test_concurrent_claims_on_a_lapsed_record_give_one_grace_then_one_takeover(
    layout: str, pg_one_table_dsn: str, clean_pg: str
) -> None:
    """Claims queued on a lapsed record's lock all at once: none owns it (one gave the grace, the owner's token
    kept); once the grace is over, all at once again: exactly one takes it over, and the old owner is fenced."""
    dsn = await empty_records(pg_one_table_dsn) if layout == "none" else clean_pg
    stores = [await open_store(dsn, layout) for _ in range(N)]
    try:
        owner = await stores[0].claim("t", "k", FP, lease=0.2, ttl=60)
        await asyncio.sleep(0.3)  # (the lease runs out)
        got = await claims_behind_a_lock(stores[1:], dsn, layout, "k")
        assert not any(c.owned for c in got), "a takeover without the grace"
        rec = await stores[0].get("t", "k")
        assert rec is not None and rec.lease_token == owner.token
        await asyncio.sleep(max((rec.lease_expires_at or 0) - time.time(), 0) + 0.05)  # (the grace runs out)
        got = await claims_behind_a_lock(stores[1:], dsn, layout, "k")
        assert sum(c.owned for c in got) == 1
        assert not await stores[0].complete(owner, StoredResponse(200, (), b"x"), ttl=60)
    finally:
        for s in stores:
            await s.close()


@pytest.mark.parametrize("layout", ["none", "daily"])
async def test_a_grace_given_by_a_claim_that_queued_on_a_lock_still_lasts_after_it_is_given(
    layout: str, pg_one_table_dsn: str, clean_pg: str
) -> None:
    """The grace was counted from the granting claim's transaction start (now()), not from when it is written: a
    claim that queued on the record's lock for over TAKEOVER_GRACE wrote a grace already over, and the very next
    claim took the record over: the holder had no window at all."""
    dsn = await empty_records(pg_one_table_dsn) if layout == "none" else clean_pg
    stores = [await open_store(dsn, layout) for _ in range(2)]
    try:
        owner = await stores[0].claim("t", "q", FP, lease=0.2, ttl=60)
        await asyncio.sleep(0.3)  # (the lease runs out)
        async with holding(dsn, layout, "q"):  # a slow writer of the record, as while the store recovers
            first = asyncio.ensure_future(stores[1].claim("t", "q", FP, lease=30, ttl=60))
            await waiting(dsn, 1)
            await asyncio.sleep(1.1)  # the lock is held this long: the queued claim's transaction started before
        graced = await first
        assert not graced.owned and graced.grace
        after = await stores[1].claim("t", "q", FP, lease=30, ttl=60)  # right after the grace was given
        assert not after.owned, "taken over the moment the grace was given: the holder had no window"
        assert await stores[0].complete(owner, StoredResponse(200, (), b"x"), ttl=60)
    finally:
        for s in stores:
            await s.close()
