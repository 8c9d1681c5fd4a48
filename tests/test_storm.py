"""Jepsen in miniature: three real proxy processes on a real PostgreSQL and Redis, under a seeded storm of faults.

Clients (asyncio tasks here) each own a key and retry it, with the same body, on 409, 5xx and broken connections
until they get a final answer. Meanwhile, one at a time: a replica is killed with SIGKILL and restarted, or paused
with SIGSTOP for up to a lease and more (a stop-the-world pause: it wakes up believing its leases and timers are
where it left them, and must not act on a lease another replica has taken over since), the network
to PostgreSQL or Redis is cut or black-holed (a relay from tests/relay.py sits between the proxies and each store;
held bytes go through late when it lifts), PostgreSQL is
restarted in immediate mode, Redis is restarted empty, and the upstream executes requests and then hangs up without
answering. Afterwards every key is read once more, and the upstream's own log of what it executed is held against
what the clients were told. Every violation is collected and printed before the test fails.

test_storm_on_a_redis_cluster runs the same storm with `storage.redis.cluster: true` on a real Redis Cluster (three
masters, a replica each, a password; the url names every node). Its Redis faults are the cluster's own: a master
killed and started again empty (back before or after its replica was promoted), a master stopped past the failover
timeout (it wakes up demoted, its unreplicated writes lost), and every node stopped at once.

  IDEMPROXY_STORM_SEED=1234      replay a run (the seed is printed; timing still varies)
  IDEMPROXY_STORM_SECONDS=600    the long form (default: 25 s of faults)
  IDEMPROXY_STORM_WAIT=1         duplicates wait for the owner (in_flight: wait) instead of getting 409
  IDEMPROXY_STORM_TLS=1          on servers that speak TLS only (see TLS below)
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import re
import shutil
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count, pairwise
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import redis as sync_redis
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import database_on
from tests.proxyproc import ProxyProcess
from tests.relay import Relay
from tests.servers import NoTlsServer, PostgresServer, RedisClusterServers, RedisServer, make_tls_files

STORM_SECONDS = float(os.environ.get("IDEMPROXY_STORM_SECONDS", "25"))
# IDEMPROXY_STORM_LEASE=1.5 attacks a lease just over upstream.timeout (1 s): the forward is then cut at the lease
# minus the 0.5 s it leaves, not minus 2 s (config.lease_margin).
LEASE = float(os.environ.get("IDEMPROXY_STORM_LEASE", "3.5"))
# The proxies' idempotency section; extend it as the config grows (e.g. settle_timeout).
# The TTL outlasts the whole run (the verify pass included): an expired key executing again is no violation.
IDEMPOTENCY: dict[str, Any] = {"lease": f"{LEASE}s", "ttl": f"{2 * STORM_SECONDS + 600:g}s", "settle_timeout": "5s"}
# IDEMPROXY_STORM_WAIT=1 has duplicates wait for the owner's answer (in_flight: wait) instead of getting 409: the
# waits, their wake-ups (pub/sub, or looking again while a replica cannot hear announcements) and the
# takeovers at their lease's end run under the same faults.
if os.environ.get("IDEMPROXY_STORM_WAIT", "") == "1":
    IDEMPOTENCY.update({"in_flight": "wait", "wait_timeout": "2s"})
# IDEMPROXY_STORM_SEAL=1 stores every answer compressed and sealed (storage.compression, storage.encryption), so
# the codec's frames and their binding to the record are read back under the same faults.
SEAL = os.environ.get("IDEMPROXY_STORM_SEAL", "") == "1"
# IDEMPROXY_STORM_CACHE_TTL=2s lets Redis's replay copies expire during the run (default 1 h: only a Redis
# restart empties them), so retries meet PostgreSQL's completed records behind a Redis that has lost them.
CACHE_TTL = os.environ.get("IDEMPROXY_STORM_CACHE_TTL", "1h")
# IDEMPROXY_STORM_TLS=1 runs either storm on servers of its own that speak TLS only (PostgreSQL, and the Redis or
# every cluster node), each verified by the proxies (skipped where no binaries here are built with TLS): the
# relays' cuts and stalls, and the restarts, kills and pauses, land on TLS streams, and a single Redis is reached
# through redis-py's client (a rediss:// url), not the store's own connection.
TLS = os.environ.get("IDEMPROXY_STORM_TLS", "") == "1"
MIN_TAKEOVER_GAP = LEASE - 1.0  # a second execution comes only after the first one's lease ran out
SETTLE_GRACE = LEASE + 10  # after the faults stop, every key must get its answer within this
CLIENT_TIMEOUT = 20.0  # one request; longer than any answer a healthy proxy holds back
WORKERS = 12
REPLICAS = 3
BASE_DROP_RATE = 0.01  # the upstream executes and hangs up without answering, now and then...
STORM_DROP_RATE = 0.3  # ...and often during an upstream_drop fault
FAULT_KINDS = ("kill_proxy", "pause_proxy", "pg_cut", "pg_stall", "pg_restart", "redis_cut", "redis_stall",
               "redis_restart", "upstream_drop")
CLUSTER_FAULT_KINDS = ("kill_proxy", "pause_proxy", "pg_cut", "pg_stall", "pg_restart", "redis_master_kill",
                       "redis_master_pause", "redis_freeze", "upstream_drop")
NODE_TIMEOUT_MS = 1000  # the cluster's: a master silent this long is failed over (plus the election, about 1 s)
WORK_SECONDS = (0.02, 0.4)  # how long the upstream takes; well under upstream.timeout (1 s)
PATH = "/v1/charges"
EXAMPLES = 6
LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:")  # a line of the proxy's log that starts a new record


# ---------------------------------------------------------------------------------------------- the upstream


@dataclass
class Execution:
    key: str
    body: bytes
    at: float  # time.monotonic() in this process when the upstream took the request
    serial: int
    dropped: bool


class StormUpstream:
    """Executes every request it receives (logging it), answers 201 with its serial, or hangs up after executing."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.drop_rate = 0.0
        self.executions: list[Execution] = []
        self._serial = count(1)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        serial = next(self._serial)
        dropped = self.rng.random() < self.drop_rate
        self.executions.append(Execution(request.headers.get("Idempotency-Key", ""), body, time.monotonic(),
                                         serial, dropped))
        # A payment takes a while: the store can fail between a claim and its completion.
        await asyncio.sleep(self.rng.uniform(*WORK_SECONDS))
        if dropped:  # executed, but the answer is lost: the outcome is unknown to the proxy
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return web.json_response({"serial": serial, "body": body.decode()}, status=201)


# ---------------------------------------------------------------------------------------------- the storm


@dataclass
class KeyPlan:
    key: str
    tenant: str
    body: bytes
    mismatch: bytes | None  # a different body sent once with the same key after it completed
    dup: bool  # a second client sends the same request concurrently
    late: bool  # the same request again once it completed (a client that did not trust its answer)


@dataclass
class Answer:
    key: str
    sender: str  # first | dup | late | verify | mismatch
    status: int
    replayed: str | None
    serial: int | None
    at: float
    proxy: int
    text: str


@dataclass
class Fault:
    kind: str
    start: float
    end: float = 0.0
    detail: str = ""


@dataclass
class Storm:
    seed: int
    upstream: StormUpstream
    proxies: list[ProxyProcess]
    pg: PostgresServer
    pg_relay: Relay
    redis: RedisServer | None = None  # a single Redis behind a relay...
    redis_relay: Relay | None = None
    cluster: RedisClusterServers | None = None  # ...or a cluster, faulted node by node
    rng: random.Random = field(init=False)
    live: set[int] = field(init=False)
    keys: dict[str, KeyPlan] = field(default_factory=dict)
    answers: list[Answer] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    faults: list[Fault] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    deadline: float = float("inf")
    faults_over: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}:faults")
        self.live = set(range(len(self.proxies)))
        assert (self.cluster is None) == (self.redis is not None and self.redis_relay is not None)

    @property
    def fault_kinds(self) -> tuple[str, ...]:
        return FAULT_KINDS if self.cluster is None else CLUSTER_FAULT_KINDS

    # ------------------------------------------------------------------ clients

    def new_key(self, rng: random.Random, worker: int) -> KeyPlan:
        key = f"storm-{worker}-{len(self.keys)}-{rng.getrandbits(32):08x}"
        amount = rng.randint(100, 100_000)
        body = json.dumps({"amount": amount, "currency": "eur", "key": key}).encode()
        other = json.dumps({"amount": amount + 1, "currency": "eur", "key": key}).encode()
        plan = KeyPlan(key, f"Bearer tenant-{rng.randint(1, 3)}", body,
                       mismatch=other if rng.random() < 0.25 else None,
                       dup=rng.random() < 0.25, late=rng.random() < 0.3)
        self.keys[key] = plan
        return plan

    async def worker(self, session: aiohttp.ClientSession, worker: int) -> None:
        rng = random.Random(f"{self.seed}:client:{worker}")
        while not self.faults_over.is_set():
            plan = self.new_key(rng, worker)
            senders = [self.send_until_final(session, plan, "first", rng)]
            if plan.dup:
                senders.append(self.send_until_final(session, plan, "dup", random.Random(rng.random())))
            results = await asyncio.gather(*senders)
            if all(results) and plan.late:
                await asyncio.sleep(rng.uniform(0, 2))
                await self.send_until_final(session, plan, "late", rng)
            if all(results) and plan.mismatch is not None:
                await self.send(session, plan, plan.mismatch, "mismatch", rng)
            await asyncio.sleep(rng.uniform(0.2, 1.2))

    async def send_until_final(self, session: aiohttp.ClientSession, plan: KeyPlan, sender: str,
                               rng: random.Random) -> bool:
        """Retry on 409, 5xx and broken connections until a 2xx or another 4xx; True on a 2xx."""
        attempt = 0
        last = "no attempt"
        while time.monotonic() < self.deadline:
            status = await self.send(session, plan, plan.body, sender, rng)
            if status is not None and 200 <= status < 300:
                return True
            last = "no answer" if status is None else str(status)
            if status is not None and 400 <= status < 500 and status != 409:
                self.unanswered.append(f"{plan.key} ({sender}): gave up on {status}")
                return False
            attempt += 1
            await asyncio.sleep(rng.uniform(0.5, 1.0) * min(0.05 * 2**attempt, 0.5))
        self.unanswered.append(f"{plan.key} ({sender}): deadline passed, last {last}")
        return False

    async def send(self, session: aiohttp.ClientSession, plan: KeyPlan, body: bytes, sender: str,
                   rng: random.Random) -> int | None:
        """One request to a live replica; the answer is recorded (None: no answer came)."""
        proxy = rng.choice(sorted(self.live))
        headers = {"Idempotency-Key": plan.key, "Authorization": plan.tenant, "Content-Type": "application/json"}
        self.requests += 1
        try:
            async with session.post(self.proxies[proxy].url + PATH, data=body, headers=headers) as resp:
                raw = await resp.read()
                status, replayed = resp.status, resp.headers.get("Idempotent-Replayed")
        except (aiohttp.ClientError, TimeoutError):
            self.statuses["no answer"] += 1
            return None
        self.statuses[str(status)] += 1
        text = raw.decode(errors="replace")
        self.answers.append(Answer(plan.key, sender, status, replayed, _serial(status, raw), time.monotonic(),
                                   proxy, text[:200]))
        return status

    async def verify(self, session: aiohttp.ClientSession) -> None:
        """Every key once more, now the storm is over: the stored answer must be the one delivered."""
        gate = asyncio.Semaphore(32)
        self.deadline = time.monotonic() + SETTLE_GRACE

        async def one(plan: KeyPlan) -> None:
            async with gate:
                await self.send_until_final(session, plan, "verify", random.Random(plan.key))

        await asyncio.gather(*(one(plan) for plan in self.keys.values()))

    # ------------------------------------------------------------------ faults

    async def fault_schedule(self) -> None:
        end = time.monotonic() + STORM_SECONDS
        await asyncio.sleep(1.0)  # the clients get going first
        cycle: list[str] = []
        while time.monotonic() < end:
            if not cycle:  # every kind once per cycle, in a seeded order
                cycle = list(self.fault_kinds)
                self.rng.shuffle(cycle)
            fault = Fault(cycle.pop(), time.monotonic())
            self.faults.append(fault)
            await getattr(self, f"_{fault.kind}")(fault)
            fault.end = time.monotonic()
            await asyncio.sleep(self.rng.uniform(0.5, 1.5))
        self.assert_restored()
        self.deadline = time.monotonic() + SETTLE_GRACE
        self.faults_over.set()

    async def _kill_proxy(self, fault: Fault) -> None:
        victim = self.rng.choice(sorted(self.live))
        self.live.discard(victim)
        await asyncio.to_thread(self.proxies[victim].kill)
        down = self.rng.uniform(0.3, 1.5)
        fault.detail = f"p{victim} down {down:.1f}s"
        await asyncio.sleep(down)
        await self.proxies[victim].start()
        self.live.add(victim)

    async def _pause_proxy(self, fault: Fault) -> None:
        """SIGSTOP a replica, then SIGCONT: its clients wait (the kernel still accepts their connections), and the
        pause runs past its leases about half the time, so other replicas take its keys over meanwhile."""
        victim = self.rng.choice(sorted(self.live))
        # At most twice the lease: a request a paused replica sent late, after another took its key over (lease,
        # then TAKEOVER_GRACE), lands within LEASE - 1 s of that takeover's execution, which check (a) flags
        # (MIN_TAKEOVER_GAP). Longer pauses would let such a late send pass as a takeover of its own.
        paused = self.rng.uniform(0.5, 2 * LEASE)
        fault.detail = f"p{victim} paused {paused:.1f}s"
        proxy = self.proxies[victim]
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(paused)
        finally:
            proxy.proc.send_signal(signal.SIGCONT)

    async def _cut(self, relay: Relay, fault: Fault, low: float, high: float, stall: bool = False) -> None:
        """Cut (connections closed, new ones refused) or stall (a black hole: held, answered by nobody, then
        let through late) the network to a store for a while."""
        seconds = self.rng.uniform(low, high)
        fault.detail = f"{seconds:.1f}s"
        relay.stall() if stall else relay.cut()
        await asyncio.sleep(seconds)
        relay.restore()

    async def _pg_cut(self, fault: Fault) -> None:
        await self._cut(self.pg_relay, fault, 2, 4)

    async def _pg_stall(self, fault: Fault) -> None:  # past the store's 5 s operation timeout, now and then
        await self._cut(self.pg_relay, fault, 2, 6, stall=True)

    async def _redis_cut(self, fault: Fault) -> None:
        assert self.redis_relay is not None
        await self._cut(self.redis_relay, fault, 1, 3)

    async def _redis_stall(self, fault: Fault) -> None:
        assert self.redis_relay is not None
        await self._cut(self.redis_relay, fault, 1, 4, stall=True)

    async def _pg_restart(self, fault: Fault) -> None:
        down = self.rng.uniform(0, 1)
        await asyncio.to_thread(self.pg.stop)  # immediate mode: no checkpoint, connections dropped
        await asyncio.sleep(down)
        await asyncio.to_thread(self.pg.start)
        fault.detail = f"down {time.monotonic() - fault.start:.1f}s"

    async def _redis_restart(self, fault: Fault) -> None:
        assert self.redis is not None
        down = self.rng.uniform(0, 1)
        await asyncio.to_thread(self.redis.stop)  # SIGKILL, no persistence: it comes back empty
        await asyncio.sleep(down)
        await asyncio.to_thread(self.redis.start)
        fault.detail = f"down {time.monotonic() - fault.start:.1f}s"

    async def _redis_master_kill(self, fault: Fault) -> None:
        """SIGKILL a master and start it again, empty: back before its replica was promoted it serves its slots
        again with none of their keys (its replica resyncs to empty); back after, it rejoins as a replica."""
        cluster = self._cluster()
        victim = self.rng.choice(await asyncio.to_thread(cluster.masters))
        down = self.rng.uniform(0.3, 3.5)
        await asyncio.to_thread(cluster.kill, victim)
        await asyncio.sleep(down)
        await asyncio.to_thread(cluster.restart, victim)
        await self._cluster_ok(fault, f"{victim} down {down:.1f}s")

    async def _redis_master_pause(self, fault: Fault) -> None:
        """SIGSTOP a master, past the failover timeout more often than not: it wakes up to find itself demoted,
        and what it had not yet passed to its replica is gone."""
        cluster = self._cluster()
        victim = self.rng.choice(await asyncio.to_thread(cluster.masters))
        paused = self.rng.uniform(0.5, 4)
        cluster.signal(victim, signal.SIGSTOP)
        try:
            await asyncio.sleep(paused)
        finally:
            cluster.signal(victim, signal.SIGCONT)
        await self._cluster_ok(fault, f"{victim} paused {paused:.1f}s")

    async def _redis_freeze(self, fault: Fault) -> None:
        """SIGSTOP every node at once: the whole cluster answers nobody for a while, then all of it wakes up."""
        cluster = self._cluster()
        paused = self.rng.uniform(1, 4)
        ports = list(cluster.procs)
        for port in ports:
            cluster.signal(port, signal.SIGSTOP)
        try:
            await asyncio.sleep(paused)
        finally:
            for port in ports:
                cluster.signal(port, signal.SIGCONT)
        await self._cluster_ok(fault, f"all {len(ports)} nodes paused {paused:.1f}s")

    def _cluster(self) -> RedisClusterServers:
        assert self.cluster is not None
        return self.cluster

    async def _cluster_ok(self, fault: Fault, detail: str) -> None:
        """Until every slot is served again (the next fault starts from a whole cluster)."""
        await asyncio.to_thread(self._cluster().wait_ok)
        fault.detail = f"{detail}, whole again after {time.monotonic() - fault.start:.1f}s"

    async def _upstream_drop(self, fault: Fault) -> None:
        seconds = self.rng.uniform(2, 3)
        fault.detail = f"{seconds:.1f}s at {STORM_DROP_RATE:.0%}"
        self.upstream.drop_rate = STORM_DROP_RATE
        await asyncio.sleep(seconds)
        self.upstream.drop_rate = BASE_DROP_RATE

    def assert_restored(self) -> None:
        assert self.live == set(range(len(self.proxies)))
        assert all(p.proc is not None and p.proc.poll() is None for p in self.proxies)
        assert self.pg_relay.mode == "open" and self.upstream.drop_rate == BASE_DROP_RATE
        if self.cluster is not None:
            assert sorted(self.cluster.procs) == sorted(self.cluster.ports)
            assert all(proc.poll() is None for proc in self.cluster.procs.values())
        else:
            assert self.redis_relay is not None and self.redis_relay.mode == "open"
            assert self.redis is not None and self.redis.proc is not None

    def faults_near(self, start: float, end: float) -> list[Fault]:
        return [f for f in self.faults if f.start <= end and (f.end or float("inf")) >= start]


def _serial(status: int, raw: bytes) -> int | None:
    if not 200 <= status < 300:
        return None
    try:
        return int(json.loads(raw)["serial"])
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------- the checks


class Verdict:
    """The checks (a)-(f) over the upstream's log and the clients' answers; every violation is collected."""

    def __init__(self, storm: Storm) -> None:
        self.storm = storm
        self.violations: dict[str, list[str]] = defaultdict(list)
        self.takeovers: Counter[str] = Counter()
        self.takeover_examples: list[str] = []
        self.executions: dict[str, list[Execution]] = defaultdict(list)
        for execution in storm.upstream.executions:
            self.executions[execution.key].append(execution)
        self.delivered: dict[str, list[Answer]] = defaultdict(list)
        for answer in storm.answers:
            if 200 <= answer.status < 300 and answer.sender != "mismatch":
                self.delivered[answer.key].append(answer)

    def run(self) -> dict[str, list[str]]:
        self.check_executions()
        for key, answers in self.delivered.items():
            self.check_same_answer(key, answers)
            self.check_replay_marks(key, answers)
        self.check_mismatches()
        for line in self.storm.unanswered:
            self.violations["e unanswered"].append(line)
        for answer in self.storm.answers:
            if answer.status == 500:
                self.violations["f http 500"].append(f"{answer.key} ({answer.sender}) via p{answer.proxy}: "
                                                      f"{answer.text}")
        return self.violations

    def check_executions(self) -> None:
        """(a) executions of one key are at least a lease apart, less the slack; each one is attributed."""
        for key, runs in self.executions.items():
            runs.sort(key=lambda e: e.at)
            for before, after in pairwise(runs):
                gap = after.at - before.at
                cause = self.cause(before)
                self.takeovers[cause] += 1
                line = (f"{key}: serial {before.serial}{' (dropped)' if before.dropped else ''} then "
                        f"{after.serial} {gap:.2f}s later; faults around the first: {cause}")
                if len(self.takeover_examples) < EXAMPLES:
                    self.takeover_examples.append(line)
                if gap < MIN_TAKEOVER_GAP:
                    self.violations["a executed twice within a lease"].append(line)

    def cause(self, first: Execution) -> str:
        near = self.storm.faults_near(first.at - 1.5, first.at + LEASE)
        kinds = {f.kind for f in near} | ({"dropped by upstream"} if first.dropped else set())
        return "+".join(sorted(kinds)) or "none"

    def check_same_answer(self, key: str, answers: list[Answer]) -> None:
        """(b) every 2xx delivered for a key carries the same serial."""
        serials = {a.serial for a in answers}
        if len(serials) > 1 or None in serials:
            shown = ", ".join(f"{a.sender}:{a.serial}/replayed={a.replayed}/p{a.proxy}" for a in answers[:8])
            self.violations["b different 2xx answers for one key"].append(
                f"{key}: serials {sorted(serials, key=str)} executed {len(self.executions[key])}x: {shown}")

    def check_replay_marks(self, key: str, answers: list[Answer]) -> None:
        """(c) one fresh answer per executed serial, every 2xx marked, and only executed serials replayed."""
        fresh = Counter(a.serial for a in answers if a.replayed == "false")
        for serial, times in fresh.items():
            if times > 1:
                self.violations["c fresh answer delivered twice"].append(f"{key}: serial {serial} {times}x")
        for a in answers:
            if a.replayed not in ("true", "false"):
                self.violations["c 2xx without replay mark"].append(f"{key} ({a.sender}): {a.replayed!r}")
        plan = self.storm.keys[key]
        executed = {e.serial for e in self.executions[key] if e.body == plan.body and not e.dropped}
        for serial in {a.serial for a in answers} - executed - {None}:
            self.violations["c answer from no execution of this key"].append(f"{key}: serial {serial}")

    def check_mismatches(self) -> None:
        """(d) a different body with a used key is never answered 2xx, and never reaches the upstream."""
        for answer in self.storm.answers:
            if answer.sender == "mismatch" and 200 <= answer.status < 300:
                self.violations["d different body got a 2xx"].append(f"{answer.key}: {answer.text}")
        for key, runs in self.executions.items():
            plan = self.storm.keys.get(key)
            for run in runs:
                if plan is None or run.body != plan.body:
                    self.violations["d different body executed"].append(f"{key}: serial {run.serial}")

    def report(self) -> str:
        storm = self.storm
        second = sum(max(len(runs) - 1, 0) for runs in self.executions.values())
        faults = Counter(f.kind for f in storm.faults)
        lines = [
            f"storm seed={storm.seed} seconds={STORM_SECONDS:g} lease={LEASE:g} sealed={SEAL} "
            f"redis={'cluster' if storm.cluster is not None else 'single'} "
            f"wait={IDEMPOTENCY.get('in_flight') == 'wait'} cache_ttl={CACHE_TTL} "
            f"tls={TLS} "
            f"(replay: IDEMPROXY_STORM_SEED={storm.seed})",
            f"keys={len(storm.keys)} requests={storm.requests} executions={len(storm.upstream.executions)} "
            f"dropped-by-upstream={sum(e.dropped for e in storm.upstream.executions)} second-executions={second}",
            f"faults: {dict(sorted(faults.items()))}",
            "fault log: " + "; ".join(f"{f.kind}({f.detail})" for f in storm.faults),
            f"second executions by faults around the first: {dict(self.takeovers.most_common())}",
            *(f"  {line}" for line in self.takeover_examples),
            f"statuses: {dict(sorted(storm.statuses.items()))}",
            f"violations: {({kind: len(found) for kind, found in sorted(self.violations.items())}) or 'none'}",
        ]
        for kind, found in sorted(self.violations.items()):
            lines.append(f"  {kind}:")
            lines.extend(f"    {line}" for line in found[:EXAMPLES])
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the test


STORM_KEY = base64.b64encode(os.urandom(32)).decode()


def proxy_config(upstream_url: str, pg_dsn: str, redis_url: str, cluster: bool = False) -> dict[str, Any]:
    return {
        "upstream": {"url": upstream_url, "timeout": "1s", "connect_timeout": "1s"},
        "idempotency": dict(IDEMPOTENCY),
        "tenant": {"from": "header", "header": "Authorization"},
        "storage": {
            "postgres": {"dsn": pg_dsn, "pool_min": 1, "pool_max": 5},
            "redis": {"url": redis_url, "key_prefix": "storm:", "replay_cache_ttl": CACHE_TTL, "cluster": cluster},
            **({"compression": {"min_size": 0}, "encryption": {"key": STORM_KEY}} if SEAL else {}),
        },
        "log": {"access": "off"},
        "shutdown_timeout": "3s",
    }


def via(url: str, relay: Relay) -> str:
    """``url`` with its host and port replaced by the relay's."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    return parts._replace(netloc=f"{user}127.0.0.1:{relay.port}").geturl()


@pytest.fixture(scope="module")
def storm_tls(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """IDEMPROXY_STORM_TLS=1: the certificates the storm's own servers present (None: the suite's plain ones)."""
    return make_tls_files(tmp_path_factory.mktemp("storm-tls")) if TLS else None


@pytest.fixture
def storm_pg(request: pytest.FixtureRequest, storm_tls: Path | None) -> Iterator[tuple[PostgresServer, str]]:
    """The PostgreSQL the storm attacks, with a database of the run's own: the suite's stoppable one, or one of its
    own speaking TLS only."""
    if storm_tls is None:
        yield request.getfixturevalue("own_pg"), request.getfixturevalue("own_pg_dsn")
        return
    try:
        pg = PostgresServer(tls=storm_tls)
    except NoTlsServer as exc:
        pytest.skip(str(exc))
    try:
        pg.start()
        with database_on(pg, "idemproxy_storm") as dsn:
            yield pg, dsn
    finally:
        pg.destroy()


@pytest.fixture
def storm_redis(request: pytest.FixtureRequest, storm_tls: Path | None) -> Iterator[RedisServer]:
    """The single Redis the storm attacks: the suite's stoppable one, or one of its own speaking TLS only."""
    if storm_tls is None:
        yield request.getfixturevalue("running_redis")
        return
    redis = RedisServer(tls=storm_tls)
    try:
        try:
            redis.start()
        except NoTlsServer as exc:
            pytest.skip(str(exc))
        yield redis
    finally:
        redis.destroy()


@pytest.fixture
def relays(storm_pg: tuple[PostgresServer, str], storm_redis: RedisServer) -> Iterator[tuple[Relay, Relay]]:
    with Relay("127.0.0.1", storm_pg[0].port, name="pg") as pg, \
            Relay("127.0.0.1", storm_redis.port, name="redis") as redis:
        yield pg, redis


@pytest.mark.timeout(STORM_SECONDS + 2 * SETTLE_GRACE + 60)
async def test_storm(
    storm_pg: tuple[PostgresServer, str], storm_redis: RedisServer, relays: tuple[Relay, Relay],
    proxy_process: Callable[..., ProxyProcess],
) -> None:
    (pg, pg_dsn), redis = storm_pg, storm_redis
    pg_relay, redis_relay = relays
    await storm_and_verdict(
        lambda upstream_url: proxy_config(upstream_url, via(pg_dsn, pg_relay), via(redis.url, redis_relay)),
        proxy_process,
        lambda seed, upstream, proxies: Storm(seed, upstream, proxies, pg, pg_relay, redis=redis,
                                              redis_relay=redis_relay),
    )


@pytest.fixture
def storm_cluster(storm_tls: Path | None) -> Iterator[RedisClusterServers]:
    try:
        servers = RedisClusterServers(masters=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS, password="storm-pw",
                                      tls=storm_tls)
    except NoTlsServer as exc:
        pytest.skip(str(exc))
    with servers:
        yield servers


@pytest.mark.timeout(STORM_SECONDS + 2 * SETTLE_GRACE + 120)
async def test_storm_on_a_redis_cluster(
    storm_pg: tuple[PostgresServer, str], storm_cluster: RedisClusterServers, storm_tls: Path | None,
    proxy_process: Callable[..., ProxyProcess],
) -> None:
    pg, pg_dsn = storm_pg
    # Every node in the url (a proxy started again finds one that answers) and a password, as in production.
    first = urlsplit(storm_cluster.url)
    seeds = first._replace(netloc=f":{storm_cluster.password}@"
                           + ",".join(f"127.0.0.1:{port}" for port in storm_cluster.ports)).geturl()
    with Relay("127.0.0.1", pg.port, name="pg") as pg_relay:
        await storm_and_verdict(
            lambda upstream_url: proxy_config(upstream_url, via(pg_dsn, pg_relay), seeds, cluster=True),
            proxy_process,
            lambda seed, upstream, proxies: Storm(seed, upstream, proxies, pg, pg_relay, cluster=storm_cluster),
        )
    copies = 0
    for port in await asyncio.to_thread(storm_cluster.masters):
        with sync_redis.Redis(port=port, password=storm_cluster.password, ssl=storm_tls is not None,
                              ssl_ca_certs=None if storm_tls is None else str(storm_tls / "ca.pem")) as node:
            copies += int(node.dbsize())
    assert copies, "no key in the cluster: the storm never took the Redis fast path"


async def storm_and_verdict(
    config_for: Callable[[str], dict[str, Any]], proxy_process: Callable[..., ProxyProcess],
    make_storm: Callable[[int, StormUpstream, list[ProxyProcess]], Storm],
) -> None:
    """Start the upstream and the replicas, run the storm, and fail with every violation the verdict finds."""
    seed = int(os.environ.get("IDEMPROXY_STORM_SEED") or random.SystemRandom().randrange(1, 1_000_000))
    print(f"\nstorm seed={seed} (IDEMPROXY_STORM_SEED={seed} replays the schedule)")
    upstream = StormUpstream(random.Random(f"{seed}:upstream"))
    upstream.drop_rate = BASE_DROP_RATE
    server = TestServer(upstream.app(), host="127.0.0.1")
    await server.start_server()
    proxies: list[ProxyProcess] = []
    try:
        config = config_for(str(server.make_url("")).rstrip("/"))
        proxies = [proxy_process(config, name=f"storm{i}") for i in range(REPLICAS)]
        await proxies[0].start()  # creates the schema
        await asyncio.gather(*(p.start() for p in proxies[1:]))
        storm = make_storm(seed, upstream, proxies)
        await run_storm(storm)
    finally:
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in proxies))
        await server.close()
    verdict = Verdict(storm)
    violations = verdict.run()
    summary = verdict.report()
    print(summary)
    if violations:
        print(proxy_tracebacks(proxies))
    found = {kind: len(lines) for kind, lines in sorted(violations.items())}
    assert not violations, f"storm seed={seed} found {found}; the summary is printed above (stdout)"


def proxy_tracebacks(proxies: list[ProxyProcess], limit: int = 3) -> str:
    """The first tracebacks the replicas logged at ERROR level (their logs sit in pytest's tmp_path, which other
    runs rotate away; IDEMPROXY_STORM_KEEP_LOGS=DIR copies them there)."""
    keep = os.environ.get("IDEMPROXY_STORM_KEEP_LOGS")
    shown: list[str] = []
    for i, proxy in enumerate(proxies):
        if keep:
            os.makedirs(keep, exist_ok=True)
            shutil.copy(proxy.log_path, os.path.join(keep, proxy.log_path.name))
        lines = proxy.log_path.read_text(errors="replace").splitlines()
        starts = [n for n, line in enumerate(lines)
                  if line.startswith("Traceback") and n and " ERROR " in lines[n - 1]][:limit]
        for n in starts:
            block = [lines[n - 1]]
            for line in lines[n:n + 200]:  # up to the next log record
                if LOG_RECORD.match(line):
                    break
                if not line.lstrip().startswith("^"):  # drop the caret lines
                    block.append(line)
            shown.append(f"--- p{i}:\n" + "\n".join(block))
    return "\n".join(shown) or "no ERROR tracebacks in the proxy logs"


async def run_storm(storm: Storm) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as session:
        async with asyncio.TaskGroup() as group:  # a failing fault step cancels the clients too
            group.create_task(storm.fault_schedule())
            for i in range(WORKERS):
                group.create_task(storm.worker(session, i))
        await storm.verify(session)
