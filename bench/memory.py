"""Memory under many pending keys: the proxy's resident set while N first requests wait on a slow upstream.

    .venv/bin/python bench/memory.py [--keys 10000] [--delay 8] [--store redis|embedded] [--max-connections N]
                                     [--connect-timeout S] [--no-reference]

Starts the benchmark upstream (bench/upstream.py, which holds each request ``--delay`` seconds), idemproxy on Redis +
PostgreSQL (or the embedded store) and the stores as bench/run.py does, then sends ``--keys`` first requests with
distinct keys at once, so that every key is claimed and pending (in flight) together. Reports the proxy's RSS at rest,
its peak (VmHWM) while the keys are pending, the peak's cost per pending key, RSS after they completed, and what the
clients got. First the same bursts go through the reference pass-through proxy (bench/reference.py), whose cost per
pending request is the floor any Python proxy pays (sockets, buffers, a task per request). Run it after a change to
the request path or the stores; the figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import BODY, process, proxy_config, stores
from tests.proxyproc import ProxyProcess
from tests.servers import free_port


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


async def bursts(url: str, pid: int, name: str, keys: int, delay: float) -> None:
    """Warm up, then three bursts of ``keys`` requests at once; print each burst's peak RSS per pending request."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def one(key: str, delay: float) -> str:
            """The status, with the problem's code when the proxy answered itself."""
            headers = {"Content-Type": "application/json", "Idempotency-Key": key, "X-Bench-Delay": str(delay)}
            async with session.post(url + "/v1/charges", data=BODY, headers=headers) as resp:
                body = await resp.read()
                if resp.content_type == "application/problem+json":
                    return f"{resp.status} {json.loads(body).get('code')}"
                return str(resp.status)

        await asyncio.gather(*(one(f"warm-{n}", 0) for n in range(200)))  # pools and caches warm
        at_rest = rss_bytes(pid)
        mib = 2**20
        print(f"{name}: RSS at rest {at_rest / mib:.1f} MiB")
        for burst in (1, 2, 3):  # a leak grows each burst's peak; memory kept for reuse does not
            started = time.perf_counter()
            pending = [asyncio.ensure_future(one(f"pending-{burst}-{n}", delay)) for n in range(keys)]
            statuses = Counter(await asyncio.gather(*pending))
            took = time.perf_counter() - started
            peak = rss_bytes(pid, "VmHWM")
            await asyncio.sleep(1.0)
            print(f"  burst {burst}: answered in {took:.1f} s {dict(statuses)}; peak RSS {peak / mib:.1f} MiB "
                  f"(+{(peak - at_rest) / keys / 1024:.1f} KiB per pending request), afterwards "
                  f"{rss_bytes(pid) / mib:.1f} MiB")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=10_000, help="first requests pending at once (default 10000)")
    parser.add_argument("--delay", type=float, default=8.0, help="seconds the upstream holds each (default 8)")
    parser.add_argument("--store", choices=("redis", "embedded"), default="redis")
    parser.add_argument("--max-connections", type=int, default=512,
                        help="upstream.max_connections (default 512, the product's): keys beyond it wait for a "
                             "connection, still claimed, for up to upstream.connect_timeout (5 s)")
    parser.add_argument("--connect-timeout", type=float, default=5.0,
                        help="upstream.connect_timeout in seconds (default 5, the product's): how long a key beyond "
                             "--max-connections waits for one. Past this machine's open-file limit, set "
                             "--max-connections under it and this above --delay: every key stays pending, claimed, "
                             "and is answered")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference proxy's bursts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="idemproxy-memory-") as tmp:
        workdir = Path(tmp)
        sections, _, cleanup = await stores(workdir)
        up_port = free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        config = proxy_config(upstream, sections[args.store])
        config["upstream"]["max_connections"] = args.max_connections
        config["upstream"]["connect_timeout"] = args.connect_timeout
        proxy = ProxyProcess(config, workdir, name="memory")
        print(f"{args.keys} requests pending at once, three times; the upstream holds each {args.delay:g} s")
        try:
            with process("bench/upstream.py", port=up_port):
                if not args.no_reference:
                    ref_port = free_port()
                    # quiet: with 10,000 connects at once a few are reset, and aiohttp prints each traceback
                    with process("bench/reference.py", upstream, port=ref_port, quiet=True) as ref:
                        await bursts(f"http://127.0.0.1:{ref_port}", ref.pid,
                                     "reference (bench/reference.py, no connection limit)", args.keys, args.delay)
                await proxy.start()
                assert proxy.proc is not None
                await bursts(proxy.url, proxy.proc.pid,
                             f"idemproxy, first requests ({args.store} store, upstream.max_connections "
                             f"{args.max_connections}, connect_timeout {args.connect_timeout:g} s)", args.keys,
                             args.delay)
        finally:
            proxy.stop()
            await asyncio.to_thread(cleanup)


if __name__ == "__main__":
    asyncio.run(main())
