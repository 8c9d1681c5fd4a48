"""The proxy's own fixed cost per request: CPU of the idemproxy process alone, for each hot path.

    .venv/bin/python bench/overhead.py [--seconds 5] [--rounds 3] [--modes plain,replay,first]
    .venv/bin/python bench/overhead.py --callgrind [--seconds 20]   # instructions per request (valgrind)

Starts the benchmark upstream (bench/upstream.py) and one idemproxy on the embedded store (tenant static, route
``/plain`` with idempotency off), then drives each path with ``wrk -t1 -c20`` in interleaved rounds:

  plain    POST /plain/charges, no key: plain pass-through
  replay   POST /v1/charges with one of 100 warm keys: answered from the in-process replay cache
  first    POST /v1/charges with a new key: claim, forward, store (embedded store, SQLite in this process)

It reports CPU µs per request of the proxy process (utime+stime of all its threads, from /proc): unlike req/s or
latency, that hardly moves when something else loads the machine, so two versions can be compared on a shared
box. With ``--callgrind`` the proxy runs under ``valgrind --tool=callgrind`` and the figure is instructions per
request (counted only while wrk runs), steadier still but about 50 times slower: use longer ``--seconds``.
``--profile MODE`` samples the proxy with py-spy while wrk drives MODE and prints the heaviest frames instead.
``--root A --root B`` measures the idemproxy of two checkouts side by side, their rounds interleaved (to compare
a change with its parent: ``git worktree add /tmp/before HEAD~1``). ``--store redis`` (or ``postgres``) puts the
proxies on Redis + PostgreSQL (or PostgreSQL alone) instead, throwaway servers of the bench's own unless
IDEMPROXY_TEST_REDIS_URL / IDEMPROXY_TEST_POSTGRES_DSN name some; the stores' own CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import BODY, WRK_SCRIPT, Target, cpu_seconds, profile, proxy_config, stores  # noqa: E402
from tests.proxyproc import wait_ready  # noqa: E402
from tests.servers import free_port  # noqa: E402

MODES = {"plain": ("/plain/charges", "none"), "replay": ("/v1/charges", "replay"),
         "first": ("/v1/charges", "first")}


def start_proxy(
    root: Path, workdir: Path, upstream: str, callgrind: bool, storage: dict[str, Any] | None = None,
) -> tuple[subprocess.Popen[bytes], str, str]:
    import yaml

    port, admin = free_port(), free_port()
    config = proxy_config(upstream, storage or {"embedded": {"path": str(workdir / "overhead.sqlite3")}})
    config.update(listen={"host": "127.0.0.1", "port": port}, admin={"host": "127.0.0.1", "port": admin})
    path = workdir / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "idemproxy", "serve", "--config", str(path)]
    if callgrind:
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={workdir}/callgrind.out.%p", *command]
    env = {**os.environ, "PYTHONPATH": str(root)}
    log = (workdir / "proxy.log").open("ab")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    return proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"


def tail(log: Path) -> str:
    """The end of a proxy's log, shown when it fails to start."""
    return log.read_text(errors="replace")[-3000:]


def wrk(url: str, mode: str, seconds: float, script: Path, connections: int) -> int:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "-s", str(script), url, "--", mode, uuid.uuid4().hex[:8]],
        capture_output=True, text=True, check=True,
    ).stdout
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if bad:
        print(f"  warning: {bad.group(1)} non-2xx answers")
    return int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]


def instructions(pid: int, workdir: Path) -> int:
    """Dump the callgrind counters collected since the last dump and return their instruction total."""
    before = set(workdir.glob(f"callgrind.out.{pid}*"))
    subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, capture_output=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = set(workdir.glob(f"callgrind.out.{pid}*")) - before
        for path in new:
            text = path.read_text(errors="replace")
            match = re.search(r"^totals: (\d+)", text, re.M)
            if match:
                keep = os.environ.get("IDEMPROXY_CALLGRIND_KEEP")
                if keep:  # for callgrind_annotate: where the instructions went, function by function
                    shutil.copy(path, Path(keep) / f"{path.name}.{uuid.uuid4().hex[:6]}")
                return int(match.group(1))
        time.sleep(0.2)
    raise RuntimeError("no callgrind dump appeared")


def measure(proc: subprocess.Popen[bytes], url: str, mode: str, seconds: float, script: Path,
            callgrind: bool, workdir: Path, connections: int) -> float:
    if callgrind:
        control = ["callgrind_control", str(proc.pid)]
        subprocess.run([*control, "--instr=on"], check=True, capture_output=True)
        subprocess.run([*control, "--zero"], check=True, capture_output=True)
        count = wrk(url, mode, seconds, script, connections)
        total = instructions(proc.pid, workdir)
        subprocess.run([*control, "--instr=off"], check=True, capture_output=True)
        return total / count
    before = cpu_seconds([proc.pid])
    count = wrk(url, mode, seconds, script, connections)
    return (cpu_seconds([proc.pid]) - before) / count * 1e6


async def warm(url: str) -> None:
    """The 100 replay keys exist (and are cached), and every path has run once."""
    async with aiohttp.ClientSession() as session:
        for i in range(100):
            async with session.post(url + "/v1/charges", data=BODY, headers={
                    "Content-Type": "application/json", "Idempotency-Key": f"warm-{i}"}) as resp:
                await resp.read()
        async with session.post(url + "/v1/charges", data=BODY, headers={
                "Content-Type": "application/json", "Idempotency-Key": "warm-7"}) as resp:
            if resp.headers.get("Idempotent-Replayed") != "true":
                raise RuntimeError(f"warm-up replay answered {resp.status}: {await resp.text()}")
        async with session.post(url + "/plain/charges", data=BODY) as resp:
            await resp.read()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="plain,replay,first")
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--connections", type=int, default=20, help="wrk -c (1: no batching, steadiest)")
    parser.add_argument("--profile", choices=sorted(MODES), help="py-spy the proxy while wrk drives this path")
    parser.add_argument("--store", choices=("embedded", "redis", "postgres"), default="embedded",
                        help="redis: Redis + PostgreSQL, postgres: PostgreSQL alone (throwaway servers unless "
                             "IDEMPROXY_TEST_REDIS_URL / IDEMPROXY_TEST_POSTGRES_DSN name some; only the proxy "
                             "process is measured)")
    parser.add_argument("--root", type=Path, action="append",
                        help="a checkout whose idemproxy is measured (repeat to compare, rounds interleaved; "
                             "default: this one)")
    args = parser.parse_args()
    seconds = args.seconds if args.seconds is not None else (20.0 if args.callgrind else 5.0)
    modes = args.modes.split(",")
    roots = [root.resolve() for root in args.root or [ROOT]]
    with tempfile.TemporaryDirectory(prefix="idemproxy-overhead-") as tmp:
        workdir = Path(tmp)
        script = workdir / "bench.lua"
        script.write_text(WRK_SCRIPT)
        storage, cleanup = None, None
        if args.store != "embedded":
            sections, _, cleanup = await stores(workdir)
            storage = sections[args.store]
        up_port = free_port()
        upstream = subprocess.Popen([sys.executable, str(ROOT / "bench" / "upstream.py"), str(up_port)])
        procs: list[subprocess.Popen[bytes]] = []
        try:
            proxies = []
            for i, root in enumerate(roots):
                (workdir / str(i)).mkdir()
                proc, url, admin = start_proxy(root, workdir / str(i), f"http://127.0.0.1:{up_port}", args.callgrind,
                                               storage)
                procs.append(proc)
                proxies.append((root, proc, url, admin, workdir / str(i)))
            for _, proc, url, admin, home in proxies:
                await wait_ready(admin, proc, timeout=300 if args.callgrind else 30,
                                 log=functools.partial(tail, home / "proxy.log"))
                await warm(url)
            if args.profile:
                _, proc, url, _, home = proxies[0]
                path, wrk_mode = MODES[args.profile]
                target = Target(args.profile, url + path, wrk_mode, lambda: [proc.pid])
                await asyncio.to_thread(profile, target, seconds, script, home)
                return
            results: dict[tuple[Path, str], list[float]] = {}
            for _ in range(args.rounds):
                for mode in modes:
                    path, wrk_mode = MODES[mode]
                    for root, proc, url, _, home in proxies:
                        results.setdefault((root, mode), []).append(await asyncio.to_thread(
                            measure, proc, url + path, wrk_mode, seconds, script, args.callgrind, home,
                            args.connections))
            report(results, roots, modes, args.callgrind,
                   f"wrk -t1 -c{args.connections}, {seconds:g} s x {args.rounds} rounds, interleaved")
        finally:
            for p in (*procs, upstream):
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if cleanup is not None:
                await asyncio.to_thread(cleanup)


def report(results: dict[tuple[Path, str], list[float]], roots: list[Path], modes: list[str], callgrind: bool,
           how: str) -> None:
    unit = "instructions/req" if callgrind else "CPU µs/req"
    print(f"{unit}, median (each round); {how}")
    for mode in modes:
        first = statistics.median(results[(roots[0], mode)])
        for root in roots:
            values = results[(root, mode)]
            median = statistics.median(values)
            shown = " ".join(f"{v:,.0f}" if callgrind else f"{v:.1f}" for v in values)
            delta = f"{100 * (median / first - 1):+6.1f}%" if root != roots[0] else " " * 7
            figure = f"{median:>11,.0f}" if callgrind else f"{median:>7.1f}"
            print(f"  {mode:7} {figure} {delta}  ({shown})  {root}")


if __name__ == "__main__":
    asyncio.run(main())
