"""The store-side figures behind docs/scaling.md: per-operation cost, bytes per record, WAL per request.

    IDEMPROXY_TEST_POSTGRES_DSN=postgresql://postgres@127.0.0.1:5432/postgres \\
    IDEMPROXY_TEST_REDIS_URL=redis://127.0.0.1:6379/0 \\
    .venv/bin/python bench/capacity.py [--records 20000] [--concurrency 16]

Drives the stores directly (no HTTP, no upstream) in a scratch database and a scratch Redis key prefix, both
removed afterwards. For each layout (daily partitions, one table) it measures, with ``--concurrency`` clients:
first requests (claim + complete of a new key), replays (claim of a completed key), their median latency on one
client, WAL bytes per first request (pg_current_wal_lsn before/after), and table + index bytes per stored record
(pg_total_relation_size); then the same for Redis in front (fast path only: its scripts, timed on their own).
The stored response is a typical payment answer: 6 headers, a 400-byte JSON body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from idemproxy.config import load_config
from idemproxy.store import Store, StoredResponse, build_store
from idemproxy.store.base import Record, State
from idemproxy.store.redis import RedisFrontedStore, _encode

FP = "ab" * 32
BODY = json.dumps({"id": "ch_" + "x" * 24, "object": "charge", "amount": 1000, "currency": "eur",
                   "status": "succeeded", "metadata": {"order": "o" * 200}, "pad": "p" * 60}).encode()[:400]
RESPONSE = StoredResponse(status=201, headers=(
    ("Content-Type", "application/json"), ("Content-Length", str(len(BODY))), ("X-Request-Id", "r" * 36),
    ("Cache-Control", "no-store"), ("Idempotency-Key", "k" * 36), ("Stripe-Version", "2024-06-20"),
), body=BODY)
TENANT = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # a SHA-256 tenant id, as stored


async def rate(n: int, concurrency: int, op: Callable[[int], Awaitable[Any]]) -> float:
    """Operations a second over ``n`` operations run by ``concurrency`` clients."""
    counter = iter(range(n))

    async def client() -> None:
        for i in counter:
            await op(i)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return n / (time.perf_counter() - started)


async def median_ms(n: int, op: Callable[[int], Awaitable[Any]]) -> float:
    times = []
    for i in range(n):
        started = time.perf_counter()
        await op(i)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def postgres_cpu() -> float:
    """CPU seconds used so far by the local server's processes (``postgres`` in /proc; a local server only)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if fields[0].endswith("(postgres"):
            values = fields[1].split()
            total += int(values[11]) + int(values[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


async def first(store: Store, key: str) -> None:
    claim = await store.claim(TENANT, key, FP, lease=60, ttl=86400)
    assert claim.owned
    assert await store.complete(claim, RESPONSE, ttl=86400)


async def replay(store: Store, key: str) -> None:
    claim = await store.claim(TENANT, key, FP, lease=60, ttl=86400)
    assert not claim.owned and claim.record.response is not None


async def measure(label: str, storage: dict[str, Any], dsn: str, records: int, concurrency: int) -> None:
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"}, "storage": storage})
    store = build_store(config.storage)
    await store.open()
    conn = await asyncpg.connect(dsn)
    try:
        run = uuid.uuid4().hex[:8]
        wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()")
        cpu0 = postgres_cpu()
        first_rate = await rate(records, concurrency, lambda i: first(store, f"{run}-{i:012d}"))
        cpu1 = postgres_cpu()
        wal1 = await conn.fetchval("SELECT pg_current_wal_lsn()")
        wal = await conn.fetchval("SELECT $1::pg_lsn - $2::pg_lsn", wal1, wal0)
        replay_rate = await rate(records, concurrency, lambda i: replay(store, f"{run}-{i:012d}"))
        cpu2 = postgres_cpu()
        first_ms = await median_ms(500, lambda i: first(store, f"{run}-solo-{i}"))
        replay_ms = await median_ms(500, lambda i: replay(store, f"{run}-solo-{i}"))
        await conn.execute("CHECKPOINT")
        await conn.execute("ANALYZE idemproxy_records")
        size = await conn.fetchval(
            "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c "
            "WHERE c.relname LIKE 'idemproxy_records%' AND c.relkind = 'r'")
        stored = await conn.fetchval("SELECT count(*) FROM idemproxy_records")
        print(f"{label:28s} first {first_rate:7.0f}/s  replay {replay_rate:7.0f}/s  "
              f"first p50 {first_ms:5.2f} ms  replay p50 {replay_ms:5.2f} ms  "
              f"WAL/first {int(wal) / records:6.0f} B  bytes/record {int(size) / stored:6.0f} B  "
              f"PG CPU/first {(cpu1 - cpu0) / records * 1e6:4.0f} us  "
              f"PG CPU/replay {(cpu2 - cpu1) / records * 1e6:4.0f} us")
        await conn.execute("TRUNCATE idemproxy_records")
    finally:
        await conn.close()
        await store.close()


async def expiry_cost(dsn: str, one_dsn: str, records: int) -> None:
    """WAL written to get rid of ``records`` expired records: row by row (one table: the sweeper's DELETE, then
    the VACUUM it calls for) against dropping their day's partition."""
    from datetime import UTC, datetime, timedelta

    from idemproxy.store.postgres import create_partition, maintain_partitions

    conn = await asyncpg.connect(one_dsn)
    store = build_store(load_config({"upstream": {"url": "http://127.0.0.1:1"},
                                     "storage": {"postgres": {"dsn": one_dsn, "partitions": "none"}}}).storage)
    await store.open()
    try:
        await rate(records, 16, lambda i: first_with_ttl(store, f"x{i}", 1.0))
        await asyncio.sleep(1.5)
        await conn.execute("CHECKPOINT")
        wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()")
        while await store.sweep(1000):
            pass
        wal1 = await conn.fetchval("SELECT pg_current_wal_lsn()")
        await conn.execute("VACUUM idemproxy_records")
        wal2 = await conn.fetchval("SELECT pg_current_wal_lsn()")
        delete = await conn.fetchval("SELECT $1::pg_lsn - $2::pg_lsn", wal1, wal0)
        vacuum = await conn.fetchval("SELECT $1::pg_lsn - $2::pg_lsn", wal2, wal1)
    finally:
        await store.close()
        await conn.close()
    conn = await asyncpg.connect(dsn)
    try:
        today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
        await create_partition(conn, today - timedelta(days=1))
        at = datetime.combine(today - timedelta(days=1), datetime.min.time(), UTC)
        for start in range(0, records, 1000):  # each claim holds a key lock to commit: batches of 1000
            await conn.execute(
                "SELECT count(*) FROM generate_series($3::int, $3::int + 999) AS n, "
                "LATERAL idemproxy_claim('t', 'd' || n, $1, 'tok', 60, 60, $2) AS c",
                FP, at, start)
        await conn.execute("CHECKPOINT")
        wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()")
        done = await maintain_partitions(conn)
        wal1 = await conn.fetchval("SELECT pg_current_wal_lsn()")
        dropped = await conn.fetchval("SELECT $1::pg_lsn - $2::pg_lsn", wal1, wal0)
    finally:
        await conn.close()
    print(f"{'expiring ' + str(records) + ' records':28s} one table: DELETE {int(delete) / records:5.0f} B/record + "
          f"VACUUM {int(vacuum) / records:5.0f} B/record of WAL;  daily: DROP of {len(done.dropped)} partition "
          f"{int(dropped)} B of WAL in all")


async def first_with_ttl(store: Store, key: str, ttl: float) -> None:
    claim = await store.claim(TENANT, key, FP, lease=ttl, ttl=ttl)
    await store.complete(claim, RESPONSE, ttl=ttl)


async def redis_scripts(storage: dict[str, Any], records: int, concurrency: int) -> None:
    """The fast path alone: the claim script (lock acquired, or replay from the cache) and the settle script,
    called through the store's own steps (so their arguments are what the proxy sends)."""
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"}, "storage": storage})
    store = build_store(config.storage)
    assert isinstance(store, RedisFrontedStore)
    run = uuid.uuid4().hex[:8]
    now = time.time()
    payload = _encode(Record(tenant=TENANT, key="k", fingerprint=FP, state=State.COMPLETED, lease_token=None,
                             lease_expires_at=None, response=RESPONSE, created_at=now, completed_at=now,
                             expires_at=now + 3600))
    epochs: dict[int, str] = {}

    async def claim(i: int, expect: str) -> None:
        fast = await store._fast_claim(TENANT, f"{run}-{i}", FP, f"tok-{i}", 60)
        assert fast is not None and fast.kind == expect, f"redis answered {fast} where {expect} was due"
        epochs[i] = fast.epoch

    async def lock(i: int) -> None:
        await claim(i, "acquired")

    async def settle(i: int) -> None:
        await store._settle(TENANT, f"{run}-{i}", f"tok-{i}", payload=payload, ttl=3600, epoch=epochs[i])

    async def cached(i: int) -> None:
        await claim(i, "completed")

    before = (await store.redis.info("memory"))["used_memory"]
    def cpu(info: dict[str, Any]) -> float:
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    cpu0 = cpu(await store.redis.info("cpu"))
    lock_rate = await rate(records, concurrency, lock)
    settle_rate = await rate(records, concurrency, settle)
    cpu1 = cpu(await store.redis.info("cpu"))
    replay_rate = await rate(records, concurrency, cached)  # the cache now answers: the replay path
    cpu2 = cpu(await store.redis.info("cpu"))
    grown = (await store.redis.info("memory"))["used_memory"] - before
    assert not store._degraded, "a Redis step failed (and was skipped): the rates would be wrong"
    print(f"{'redis scripts':28s} lock {lock_rate:7.0f}/s  settle {settle_rate:7.0f}/s  replay {replay_rate:7.0f}/s  "
          f"memory {grown / records:6.0f} B per cached record  CPU/first {(cpu1 - cpu0) / records * 1e6:3.0f} us  "
          f"CPU/replay {(cpu2 - cpu1) / records * 1e6:3.0f} us")
    async for key in store.redis.scan_iter(match=f"{store.config.key_prefix}*", count=1000):
        await store.redis.delete(key)
    await store.redis.aclose()


def process_cpu(pid: int) -> float:
    values = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(values[11]) + int(values[12])) / os.sysconf("SC_CLK_TCK")


async def proxy_cpu(storage: dict[str, Any], requests: int, concurrency: int) -> None:
    """CPU seconds the proxy process spends per first request and per replay (Redis + PostgreSQL behind it)."""
    import tempfile

    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from bench.upstream import handle
    from tests.proxyproc import ProxyProcess

    application = web.Application()  # the benchmark's upstream (bench/upstream.py), in this process
    application.router.add_route("*", "/{tail:.*}", handle)
    upstream = TestServer(application, host="127.0.0.1")
    await upstream.start_server()
    workdir = Path(tempfile.mkdtemp(prefix="idemproxy-capacity-"))
    proxy = ProxyProcess({"upstream": {"url": str(upstream.make_url("")).rstrip("/")},
                          "tenant": {"from": "static"}, "log": {"access": "off"}, "storage": storage}, workdir)
    await proxy.start()
    assert proxy.proc is not None
    run = uuid.uuid4().hex[:8]
    try:
        async with aiohttp.ClientSession() as session:
            async def post(i: int) -> None:
                headers = {"Idempotency-Key": f"{run}-{i}", "Content-Type": "application/json"}
                async with session.post(proxy.url + "/v1/charges", data=BODY, headers=headers) as resp:
                    await resp.read()

            await rate(500, concurrency, lambda i: post(10**9 + i))  # warm up
            cpu0 = process_cpu(proxy.proc.pid)
            first_rate = await rate(requests, concurrency, post)
            cpu1 = process_cpu(proxy.proc.pid)
            replay_rate = await rate(requests, concurrency, post)
            cpu2 = process_cpu(proxy.proc.pid)
    finally:
        proxy.kill()
        await upstream.close()
    print(f"{'proxy process (1 worker)':28s} first {first_rate:7.0f}/s  replay {replay_rate:7.0f}/s  "
          f"CPU/first {(cpu1 - cpu0) / requests * 1e6:4.0f} us  CPU/replay {(cpu2 - cpu1) / requests * 1e6:4.0f} us")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    admin = os.environ["IDEMPROXY_TEST_POSTGRES_DSN"]
    redis_url = os.environ["IDEMPROXY_TEST_REDIS_URL"]
    name = f"idemproxy_capacity_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(admin)
    await conn.execute(f"CREATE DATABASE {name}")
    dsn = f"{admin.rpartition('/')[0]}/{name}"
    one_table = f"{name}_one"
    await conn.execute(f"CREATE DATABASE {one_table}")
    one_dsn = f"{admin.rpartition('/')[0]}/{one_table}"
    prefix = f"capacity:{uuid.uuid4().hex[:8]}:"
    try:
        pool = {"pool_min": 2, "pool_max": args.concurrency}
        await measure("postgres, daily partitions", {"postgres": {"dsn": dsn, **pool}}, dsn, args.records,
                      args.concurrency)
        await measure("postgres, one table", {"postgres": {"dsn": one_dsn, "partitions": "none", **pool}},
                      one_dsn, args.records, args.concurrency)
        await measure("redis + postgres (daily)", {"postgres": {"dsn": dsn, **pool},
                                                   "redis": {"url": redis_url, "key_prefix": prefix}},
                      dsn, args.records, args.concurrency)
        await proxy_cpu({"postgres": {"dsn": dsn, **pool}, "redis": {"url": redis_url, "key_prefix": prefix}},
                        min(args.records, 5000), args.concurrency)
        await expiry_cost(dsn, one_dsn, args.records)
        await redis_scripts({"postgres": {"dsn": dsn, **pool}, "redis": {"url": redis_url, "key_prefix": prefix}},
                            args.records, args.concurrency)
    finally:
        for db in (name, one_table):
            await conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
