"""Benchmark: idemproxy against a reference pass-through proxy, in one run, as ratios.

    make bench                       # or: .venv/bin/python bench/run.py [--seconds 5] [--rounds 3]

Processes, all on this machine (loopback): the upstream (bench/upstream.py), the reference proxy
(bench/reference.py: ~50 lines of aiohttp + uvloop), idemproxy on Redis + PostgreSQL, idemproxy on the embedded
store, and real Redis/PostgreSQL (IDEMPROXY_TEST_REDIS_URL / IDEMPROXY_TEST_POSTGRES_DSN, else throwaway servers of
the bench's own, so their CPU can be read alone). `wrk -t2 -c50` drives each target in turn, rounds interleaved:

  reference   client -> reference proxy -> upstream
  off         idemproxy, a route with idempotency disabled (plain proxying)
  first       idemproxy on Redis + PostgreSQL, a new Idempotency-Key per request (claim, forward, store)
  replay      idemproxy on Redis + PostgreSQL, 100 keys sent again and again (answered from the store)
  pg-first    idemproxy on PostgreSQL alone, new keys
  embedded    idemproxy on the embedded store, new keys

For each: req/s and its ratio to the reference in the same round (median over rounds), wrk's p50/p99, CPU per
request of the proxy process (utime+stime from /proc) and its ratio to the reference, of Redis and of PostgreSQL,
and of the whole machine ("box": every busy jiffy in /proc/stat, whoever spent it). Then
an open-loop client at 200 req/s measures the latency each path adds over calling the upstream directly, in
interleaved rounds that each measure the upstream directly first (median over rounds, and the range).
Everything shares 2 cores here: compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import redis as sync_redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.proxyproc import ProxyProcess  # noqa: E402
from tests.servers import PostgresServer, RedisServer, free_port  # noqa: E402

BODY = '{"amount": 1000, "currency": "eur", "description": "benchmark charge"}'
TICK = os.sysconf("SC_CLK_TCK")
WRK_SCRIPT = """
local mode, prefix, counter = "none", "k", 0
local id = 0
function setup(thread) id = id + 1; thread:set("tid", id) end
function init(args) mode = args[1]; prefix = args[2] end
function request()
  counter = counter + 1
  local headers = {["Content-Type"] = "application/json"}
  if mode == "first" then headers["Idempotency-Key"] = prefix .. "-" .. tid .. "-" .. counter
  elseif mode == "replay" then headers["Idempotency-Key"] = "warm-" .. (counter % 100) end
  return wrk.format("POST", nil, headers, '@BODY@')
end
local shown = os.getenv("IDEMPROXY_BENCH_SHOW") == nil
function response(status, headers, body)
  if status >= 300 and not shown then shown = true; io.stderr:write(status .. " " .. body .. "\\n") end
end
""".replace("@BODY@", BODY)


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes and all their descendants, from /proc."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0.0, list(pids)
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += (int(stats[pid][11]) + int(stats[pid][12])) / TICK
        todo.extend(children.get(pid, []))
    return total


def box_seconds() -> float:
    """CPU time the whole machine spent busy (every core, every process, the kernel), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / TICK


def pids_named(*names: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in names:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@dataclass
class Target:
    name: str
    url: str
    mode: str  # none | first | replay
    pids: Callable[[], list[int]]
    rounds: list[dict[str, float]] = field(default_factory=list)


def run_wrk(target: Target, seconds: float, script: Path, store_pids: dict[str, list[int]]) -> dict[str, float]:
    redis_pids, pg_pids = store_pids.get("redis", []), store_pids.get("postgres", [])
    before, box_before = cpu_seconds(target.pids()), box_seconds()
    redis_before, pg_before = cpu_seconds(redis_pids), cpu_seconds(pg_pids)
    result = subprocess.run(
        ["wrk", "-t2", "-c50", f"-d{seconds:g}s", "--latency", "-s", str(script), target.url, "--",
         target.mode, uuid.uuid4().hex[:8]],
        capture_output=True, text=True, check=True,
    )
    if result.stderr:
        print(f"{target.name}: first non-2xx answer: {result.stderr.strip()[:300]}")
    out = result.stdout
    cpu, box = cpu_seconds(target.pids()) - before, box_seconds() - box_before
    redis_cpu, pg_cpu = cpu_seconds(redis_pids) - redis_before, cpu_seconds(pg_pids) - pg_before
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "p50": _ms(re.search(r"50%\s+([\d.]+\w+)", out).group(1)),  # type: ignore[union-attr]
        "p99": _ms(re.search(r"99%\s+([\d.]+\w+)", out).group(1)),  # type: ignore[union-attr]
        "cpu_us": cpu / requests * 1e6,
        "redis_us": redis_cpu / requests * 1e6,
        "pg_us": pg_cpu / requests * 1e6,
        "box_us": box / requests * 1e6,
        "bad": float(non_2xx.group(1)) if non_2xx else 0.0,
    }


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


async def open_loop(url: str, mode: str, rate: float, seconds: float) -> tuple[float, float]:
    """Requests at a fixed rate (not back to back): p50/p99 latency in ms at that load. Replays use the keys
    ``warm-0`` .. ``warm-99`` (sent once first), as the wrk script does."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    prefix = "warm" if mode == "replay" else uuid.uuid4().hex[:8]
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> None:
            headers = {"Content-Type": "application/json"}
            if mode != "none":
                headers["Idempotency-Key"] = f"{prefix}-{i if mode == 'first' else i % 100}"
            started = time.perf_counter()
            async with session.post(url, data=BODY, headers=headers) as resp:
                await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
            latencies.append(time.perf_counter() - started)

        if mode == "replay":
            await asyncio.gather(*(one(i) for i in range(100)))
            latencies.clear()
            if set(statuses) != {201}:
                print(f"warning: replay warm-up statuses {statuses}")
        tasks, start = [], time.perf_counter()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*tasks)
    latencies.sort()
    return statistics.median(latencies) * 1000, latencies[int(len(latencies) * 0.99) - 1] * 1000


LATENCY_PATHS = ("reference", "off", "first", "pg-first", "replay", "embedded")


async def added_latency(direct_url: str, targets: list[Target], seconds: float, rounds: int) -> None:
    """The latency each path adds at 200 req/s over calling the upstream directly. The paths run in interleaved
    rounds, each round measuring the upstream directly first, so a slow spell of the machine (a shared VM's steal
    time moves p99 by several ms) lands on one round of every path rather than on every round of one path. Prints
    the median over rounds of each round's added p50 and p99, and their range."""
    paths = [t for t in targets if t.name in LATENCY_PATHS]
    added: dict[str, list[tuple[float, float]]] = {t.name: [] for t in paths}
    directs: list[tuple[float, float]] = []
    for _ in range(rounds):
        direct = await open_loop(direct_url, "none", 200, seconds)
        directs.append(direct)
        for target in paths:
            p50, p99 = await open_loop(target.url, target.mode, 200, seconds)
            added[target.name].append((p50 - direct[0], p99 - direct[1]))
    print(f"\nadded latency at 200 req/s over the upstream called directly, median of {rounds} interleaved rounds "
          f"of {seconds:g} s [range] (direct: p50 {statistics.median(d[0] for d in directs):.2f} ms, "
          f"p99 {statistics.median(d[1] for d in directs):.2f} ms):")
    for name, values in added.items():
        p50s, p99s = [v[0] for v in values], [v[1] for v in values]
        print(f"  {name:10} p50 {statistics.median(p50s):+.2f} ms [{min(p50s):+.2f}, {max(p50s):+.2f}]   "
              f"p99 {statistics.median(p99s):+.2f} ms [{min(p99s):+.2f}, {max(p99s):+.2f}]")


@contextmanager
def process(*argv: str, port: int, quiet: bool = False) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``python ARGV PORT`` and wait until it listens (``quiet``: its stderr is dropped)."""
    proc = subprocess.Popen([sys.executable, *argv, str(port)], cwd=ROOT,
                            stderr=subprocess.DEVNULL if quiet else None)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(["sh", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"], capture_output=True,
                             executable="/bin/bash").returncode != 0:
            assert time.monotonic() < deadline and proc.poll() is None, f"{argv} did not start"
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


async def stores(workdir: Path) -> tuple[dict[str, Any], dict[str, list[int]], Callable[[], None]]:
    """Redis and PostgreSQL sections; the pids whose CPU counts as the stores'; a cleanup."""
    owned: list[Any] = []
    redis_url, pg_admin = os.environ.get("IDEMPROXY_TEST_REDIS_URL"), os.environ.get("IDEMPROXY_TEST_POSTGRES_DSN")
    store_pids: dict[str, list[int]] = {}
    if redis_url is None:
        redis = RedisServer()
        redis.start()
        owned.append(redis)
        redis_url = redis.url
        assert redis.proc is not None
        store_pids["redis"] = [redis.proc.pid]
    if pg_admin is None:
        pg = PostgresServer()
        pg.start()
        owned.append(pg)
        pg_admin = pg.admin_dsn
        store_pids["postgres"] = [int((pg.data / "postmaster.pid").read_text().split()[0])]
    # shared servers: their CPU includes whatever else runs on them
    store_pids.setdefault("redis", pids_named("redis-server"))
    store_pids.setdefault("postgres", pids_named("postgres"))
    database = f"idemproxy_bench_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(pg_admin)
    await conn.execute(f"CREATE DATABASE {database}")
    await conn.close()
    postgres = {"dsn": pg_admin.rsplit("/", 1)[0] + f"/{database}", "pool_min": 4, "pool_max": 20}
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    sections = {
        "redis": {"postgres": postgres, "redis": {"url": redis_url, "key_prefix": prefix}},
        "postgres": {"postgres": postgres},
        "embedded": {"embedded": {"path": str(workdir / "bench.sqlite3")}},
    }

    def cleanup() -> None:
        async def drop() -> None:
            conn = await asyncpg.connect(pg_admin)
            await conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
            await conn.close()

        asyncio.run(drop())
        if not any(isinstance(server, RedisServer) for server in owned):  # a shared Redis: this run's keys go
            client = sync_redis.Redis.from_url(redis_url)
            try:
                names = list(client.scan_iter(match=prefix + "*", count=1000))
                for start in range(0, len(names), 1000):
                    client.delete(*names[start:start + 1000])
            finally:
                client.close()
        for server in owned:
            server.destroy()

    return sections, store_pids, cleanup


def proxy_config(upstream: str, storage: dict[str, Any], workers: int = 1) -> dict[str, Any]:
    return {"upstream": {"url": upstream}, "storage": storage, "tenant": {"from": "static"},
            "routes": [{"prefix": "/plain", "enabled": False}],
            "log": {"access": "off", "level": "warning"}, "drain_delay": "0s", "workers": workers}


# Where a sample's CPU goes: the innermost frame of its stack that names one of these (aiohttp's writer, streams and
# asyncio itself serve every part, so they are passed over for the frame that called them).
COMPONENTS = (
    ("PostgreSQL (asyncpg, store/postgres.py)", ("asyncpg/", "store/postgres.py")),
    ("Redis (redis-py, store/redis.py)", ("/redis/", "hiredis", "store/redis.py")),
    ("embedded store (SQLite thread)", ("store/embedded.py", "concurrent/futures")),
    ("group commit (store/batch.py)", ("store/batch.py",)),
    ("fingerprint", ("fingerprint.py", "json/")),
    ("metrics", ("prometheus_client/", "metrics.py")),
    ("logging", ("logging/", "logs.py")),
    ("upstream client (idemproxy/client.py, httptools)", ("idemproxy/client.py", "httptools/", "proxy.py")),
    ("server (aiohttp web)", ("aiohttp/web_",)),
    ("engine (engine, settle, replays, app)", ("idemproxy/",)),
)
GENERIC = ("aiohttp/http_writer", "aiohttp/streams", "aiohttp/base_protocol", "aiohttp/helpers", "asyncio/",
           "contextlib", "dataclasses", "_weakrefset", "functools", "abc>", "enum", "idemproxy/cli.py",
           "idemproxy/__main__.py", "runpy", "threading.py")


# Innermost frames of threads that wait rather than work: the embedded store's SQLite thread blocks in its work
# queue's get() inside C, which py-spy samples as busy.
IDLE = ("concurrent/futures/thread.py:81",)


def component(stack: list[str]) -> str:
    for frame in reversed(stack):
        if any(marker in frame for marker in GENERIC):
            continue
        for name, markers in COMPONENTS:
            if any(marker in frame for marker in markers):
                return name
    return "event loop and the rest (uvloop, socket calls from generic frames)"


def profile(target: Target, seconds: float, script: Path, workdir: Path) -> None:
    """py-spy samples the target's process while wrk drives it; prints the heaviest frames, self and inclusive."""
    out = workdir / "profile.txt"
    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--format", "raw", "-r", "500",
                            "-o", str(out), "-d", f"{seconds:g}", "-p", str(target.pids()[0])],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target.rounds.append(run_wrk(target, seconds, script, {}))  # py-spy's own sampling costs are in this figure
    spy.wait(seconds + 30)
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    parts: dict[str, int] = {}
    total = 0
    for line in out.read_text().splitlines():
        stack, _, field = line.rpartition(" ")
        if any(marker in stack.rsplit(";", 1)[-1] for marker in IDLE):
            continue  # a thread waiting for work, which py-spy did not see as idle
        samples = int(field)
        parts[component(stack.split(";"))] = parts.get(component(stack.split(";")), 0) + samples
        frames = [f.split(" (")[0] + " " + f.split("/")[-1].rstrip(")") for f in stack.split(";")]
        total += samples
        own[frames[-1]] = own.get(frames[-1], 0) + samples
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + samples
    cpu_us = target.rounds[-1]["cpu_us"] if target.rounds else 0.0
    print(f"\nby component ({target.name}, {total} samples; CPU per request {cpu_us:.0f} µs):")
    for name, count in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {100 * count / total:5.1f}%  {cpu_us * count / total:6.0f} µs  {name}")
    limit = int(os.environ.get("IDEMPROXY_PROFILE_TOP", "25"))
    for title, table in (("self", own), ("inclusive", inclusive)):
        print(f"\n{title} time, top {limit} of {total} samples ({target.name}):")
        for frame, count in sorted(table.items(), key=lambda kv: -kv[1])[:limit]:
            print(f"  {100 * count / total:5.1f}%  {frame}")


def report(targets: list[Target], reference: Target) -> None:
    print(f"\n{'target':10} {'req/s':>8} {'x ref':>6} {'p50 ms':>7} {'p99 ms':>7} {'CPU µs/req':>11} "
          f"{'x ref':>6} {'Redis µs':>9} {'PG µs':>6} {'box µs/req':>11} {'non-2xx':>8}")
    for target in targets:
        ratios = [r["rps"] / ref["rps"] for r, ref in zip(target.rounds, reference.rounds, strict=True)]
        cpu_ratios = [r["cpu_us"] / ref["cpu_us"] for r, ref in zip(target.rounds, reference.rounds, strict=True)]

        def med(key: str, t: Target = target) -> float:
            return statistics.median(r[key] for r in t.rounds)

        print(f"{target.name:10} {med('rps'):8.0f} {statistics.median(ratios):6.2f} {med('p50'):7.2f} "
              f"{med('p99'):7.2f} {med('cpu_us'):11.0f} {statistics.median(cpu_ratios):6.2f} "
              f"{med('redis_us'):9.0f} {med('pg_us'):6.0f} {med('box_us'):11.0f} "
              f"{sum(r['bad'] for r in target.rounds):8.0f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="per target and round (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--rate-seconds", type=float, default=4.0,
                        help="open-loop latency run per path and round (default 4)")
    parser.add_argument("--rate-rounds", type=int, default=3,
                        help="interleaved rounds of the latency pass, each with its own direct baseline (default 3)")
    parser.add_argument("--only", help="comma-separated targets to measure (the reference always runs)")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes of the Redis + PostgreSQL and PostgreSQL proxies (default 1; the "
                             "embedded store is single-process; the reference always runs one)")
    parser.add_argument("--profile", metavar="TARGET",
                        help="instead: run py-spy on TARGET's proxy under wrk load and print where its CPU goes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="idemproxy-bench-") as tmp:
        workdir = Path(tmp)
        script = workdir / "keys.lua"
        script.write_text(WRK_SCRIPT)
        sections, store_pids, cleanup = await stores(workdir)
        up_port, ref_port = free_port(), free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        proxies = {name: ProxyProcess(proxy_config(upstream, sections[name],
                                              args.workers if name != "embedded" else 1), workdir, name=name)
                   for name in ("redis", "postgres", "embedded")}
        try:
            with process("bench/upstream.py", port=up_port), \
                    process("bench/reference.py", upstream, port=ref_port) as ref_proc:
                for proxy in proxies.values():
                    await proxy.start()

                def pid_of(name: str) -> Callable[[], list[int]]:
                    return lambda: [proxies[name].proc.pid] if proxies[name].proc else []  # type: ignore[union-attr]

                reference = Target("reference", f"http://127.0.0.1:{ref_port}/v1/charges", "none",
                                   lambda: [ref_proc.pid])
                targets = [
                    reference,
                    Target("off", proxies["redis"].url + "/plain/charges", "none", pid_of("redis")),
                    Target("first", proxies["redis"].url + "/v1/charges", "first", pid_of("redis")),
                    replay := Target("replay", proxies["redis"].url + "/v1/charges", "replay", pid_of("redis")),
                    Target("pg-first", proxies["postgres"].url + "/v1/charges", "first", pid_of("postgres")),
                    Target("embedded", proxies["embedded"].url + "/v1/charges", "first", pid_of("embedded")),
                ]
                await open_loop(replay.url, "replay", 100, 0.5)  # the 100 replay keys exist
                async with aiohttp.ClientSession() as session, session.post(
                        replay.url, data=BODY, headers={"Content-Type": "application/json",
                                                        "Idempotency-Key": "warm-7"}) as resp:
                    if resp.headers.get("Idempotent-Replayed") != "true":
                        print(f"warning: replay warm-up answered {resp.status}: {await resp.text()}")
                if args.profile:
                    target = next(t for t in targets if t.name == args.profile)
                    await asyncio.to_thread(profile, target, args.seconds, script, workdir)
                    return
                if args.only:
                    targets = [t for t in targets if t is reference or t.name in args.only.split(",")]
                for _ in range(args.rounds):
                    for target in targets:
                        uses_store = target.name in ("first", "replay", "pg-first")
                        target.rounds.append(await asyncio.to_thread(
                            run_wrk, target, args.seconds, script, store_pids if uses_store else {}))
                print(f"wrk -t2 -c50, {args.seconds:g} s per target, {args.rounds} interleaved rounds, "
                      f"{os.cpu_count()} cores shared by wrk, upstream, proxies and stores")
                report(targets, reference)
                await added_latency(upstream + "/v1/charges", targets, args.rate_seconds, args.rate_rounds)
                if os.environ.get("IDEMPROXY_BENCH_SHOW"):
                    print(proxies["redis"].log()[-3000:])
                for name, proxy in proxies.items():
                    print(f"peak RSS, idemproxy on {name}: {proxy.peak_rss_bytes() / 2**20:.1f} MiB")
        finally:
            for proxy in proxies.values():
                proxy.stop()
            await asyncio.to_thread(cleanup)


if __name__ == "__main__":
    asyncio.run(main())
