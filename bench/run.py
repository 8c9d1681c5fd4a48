"""Benchmark: latency, proxy overhead, throughput and memory per path and store.

    .venv/bin/python bench/run.py [--seconds 5] [--concurrency 32] [--stores redis,postgres,embedded]

Starts a trivial upstream, the proxy as a real process (`idemproxy serve`), and real Redis/PostgreSQL (from
IDEMPROXY_TEST_REDIS_URL / IDEMPROXY_TEST_POSTGRES_DSN, else throwaway servers like the test suite's). For each
store it drives four paths with a bounded number of concurrent clients for a bounded time, all on loopback:
  direct       client -> upstream, no proxy (the baseline)
  passthrough  client -> proxy -> upstream, no key
  first        a new Idempotency-Key per request (claim, forward, store)
  replay       the same key and payload again (served from the store)
and reports client-side p50/p99 latency and throughput, the proxy's own overhead histogram
(idemproxy_overhead_seconds: time in the proxy minus time waiting on the upstream), and the proxy's peak RSS.
Everything shares this machine's cores, so absolute numbers are pessimistic; compare paths with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.proxyproc import ProxyProcess
from tests.servers import PostgresServer, RedisServer

BODY = {"amount": 1000, "currency": "eur", "description": "benchmark charge"}


def upstream_app() -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "ch_1", "status": "succeeded"}, status=201)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


Headers = Callable[[int], dict[str, str]]


async def drive(url: str, seconds: float, concurrency: int, headers: Headers) -> dict[str, float]:
    """``concurrency`` clients sending back to back for ``seconds``; client-side latency and throughput."""
    latencies: list[float] = []
    counter = itertools.count()
    deadline = time.perf_counter() + seconds
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def client() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                async with session.post(url, json=BODY, headers=headers(next(counter))) as resp:
                    await resp.read()
                    if resp.status != 201:
                        errors += 1
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    latencies.sort()
    return {
        "requests": len(latencies),
        "rps": len(latencies) / seconds,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "errors": errors,
    }


def quantiles(metrics_text: str, histogram: str, *selectors: str) -> tuple[float, float]:
    """p50 and p99 (upper bucket bound, ms) of one labelled series of a histogram."""
    buckets: list[tuple[float, float]] = []
    for line in metrics_text.splitlines():
        if line.startswith(f"{histogram}_bucket{{") and all(s in line for s in selectors):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0

    def quantile(q: float) -> float:
        return next((le for le, count in buckets if count >= q * total), float("nan")) * 1000

    return quantile(0.5), quantile(0.99)


async def metrics(proxy: ProxyProcess) -> str:
    async with aiohttp.ClientSession() as session, session.get(proxy.admin_url + "/metrics") as resp:
        return await resp.text()


async def storage_sections(stores: list[str], workdir: Path) -> tuple[dict[str, dict[str, Any]], Callable[[], None]]:
    owned: list[Any] = []
    redis_url = os.environ.get("IDEMPROXY_TEST_REDIS_URL")
    pg_admin = os.environ.get("IDEMPROXY_TEST_POSTGRES_DSN")
    if redis_url is None and "redis" in stores:
        server = RedisServer()
        server.start()
        owned.append(server)
        redis_url = server.url
    if pg_admin is None and ({"redis", "postgres"} & set(stores)):
        pg = PostgresServer()
        pg.start()
        owned.append(pg)
        pg_admin = pg.admin_dsn
    sections: dict[str, dict[str, Any]] = {}
    database = f"idemproxy_bench_{uuid.uuid4().hex[:8]}"
    if pg_admin is not None:
        conn = await asyncpg.connect(pg_admin)
        await conn.execute(f"CREATE DATABASE {database}")
        await conn.close()
        dsn = pg_admin.rsplit("/", 1)[0] + f"/{database}"
        sections["postgres"] = {"postgres": {"dsn": dsn, "pool_min": 4, "pool_max": 20}}
        if redis_url is not None:
            sections["redis"] = {**sections["postgres"],
                                 "redis": {"url": redis_url, "key_prefix": f"bench:{uuid.uuid4().hex[:8]}:"}}
    sections["embedded"] = {"embedded": {"path": str(workdir / "bench.sqlite3")}}

    def cleanup() -> None:
        if pg_admin is not None:
            async def drop() -> None:
                conn = await asyncpg.connect(pg_admin)
                await conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
                await conn.close()
            asyncio.run(drop())
        for server in owned:
            server.destroy()

    return {name: sections[name] for name in stores if name in sections}, cleanup


async def bench_store(name: str, storage: dict[str, Any], upstream_url: str, args: argparse.Namespace,
                      workdir: Path) -> None:
    proxy = ProxyProcess({"upstream": {"url": upstream_url}, "storage": storage,
                          "tenant": {"from": "static"}, "log": {"access": "off", "level": "warning"}},
                         workdir, name=f"bench-{name}")
    await proxy.start()
    try:
        url = proxy.url + "/v1/charges"
        run = uuid.uuid4().hex[:8]
        results = {
            "passthrough": await drive(url, args.seconds, args.concurrency, lambda i: {}),
            "first": await drive(url, args.seconds, args.concurrency,
                                 lambda i: {"Idempotency-Key": f"{run}-{i}"}),
            "replay": await drive(url, args.seconds, args.concurrency,
                                  lambda i: {"Idempotency-Key": f"{run}-{i % 100}"}),
        }
        text = await metrics(proxy)
        rss = proxy.peak_rss_bytes() / 2**20
    finally:
        proxy.stop()
    print(f"\nstore: {name}   (peak RSS of the proxy process: {rss:.1f} MiB)")
    print(f"{'path':12} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'overhead p50 ms':>16} {'overhead p99 ms':>16}")
    labels = {"passthrough": "passthrough", "first": "forwarded", "replay": "replayed"}
    for path, r in results.items():
        o50, o99 = quantiles(text, "idemproxy_overhead_seconds", f'outcome="{labels[path]}"')
        errors = f"  ({r['errors']:.0f} non-201)" if r["errors"] else ""
        o50_text, o99_text = f"≤ {o50:.2f}", f"≤ {o99:.2f}"
        print(f"{path:12} {r['rps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {o50_text:>16} {o99_text:>16}{errors}")
    operations = sorted({(line.split('backend="')[1].split('"')[0], line.split('operation="')[1].split('"')[0])
                         for line in text.splitlines()
                         if line.startswith("idemproxy_store_duration_seconds_count{")})
    print("store operations, p50 / p99 ms: " + ", ".join(
        "{}.{} ≤ {:.2f} / {:.2f}".format(b, o, *quantiles(
            text, "idemproxy_store_duration_seconds", f'backend="{b}"', f'operation="{o}"'))
        for b, o in operations))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="per path and store (default 5)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--stores", default="redis,postgres,embedded")
    args = parser.parse_args()
    stores = args.stores.split(",")
    runner = web.AppRunner(upstream_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    upstream_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="idemproxy-bench-") as tmp:
        workdir = Path(tmp)
        sections, cleanup = await storage_sections(stores, workdir)
        try:
            direct = await drive(upstream_url + "/v1/charges", args.seconds, args.concurrency, lambda i: {})
            print(f"concurrency {args.concurrency}, {args.seconds:g} s per path, {os.cpu_count()} cores shared "
                  "by client, proxy, upstream and stores")
            print(f"direct to upstream: {direct['rps']:.0f} req/s, p50 {direct['p50_ms']:.2f} ms, "
                  f"p99 {direct['p99_ms']:.2f} ms")
            for name, storage in sections.items():
                await bench_store(name, storage, upstream_url, args, workdir)
        finally:
            await runner.cleanup()
            await asyncio.to_thread(cleanup)


if __name__ == "__main__":
    asyncio.run(main())
