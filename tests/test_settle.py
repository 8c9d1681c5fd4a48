"""Stored before answered, also when the store fails after the forward (CONTRACT "When the store fails after the
forward"): PostgreSQL reached through a TCP relay the test cuts while the upstream is working.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
import pytest

from tests.conftest import ProxyFactory, RunningProxy, empty_records
from tests.proxyproc import ProxyProcess
from tests.relay import Relay
from tests.upstream import RecordingUpstream

CHARGE = {"amount": 1000, "currency": "eur"}
# upstream.timeout 1 s + the 2 s lease margin: the shortest lease the config accepts, so takeovers come quickly.
FAST = {"upstream": {"timeout": "1s"}, "idempotency": {"lease": "3s", "settle_timeout": "10s"}}


def via(relay: Relay, dsn: str) -> str:
    """``dsn`` with its host and port replaced by the relay's."""
    parts = urlsplit(dsn)
    user = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{relay.port}" if user else f"127.0.0.1:{relay.port}"))


def pg_section(dsn: str, **extra: Any) -> dict[str, Any]:
    return {"postgres": {"dsn": dsn, "pool_min": 1, "pool_max": 10}, **extra}


@pytest.fixture
def pg_relay(clean_pg: str) -> Iterator[Relay]:
    parts = urlsplit(clean_pg)
    with Relay(parts.hostname or "127.0.0.1", parts.port or 5432, name="pg") as relay:
        yield relay


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def until_async(condition: Callable[[], Awaitable[bool]], timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def lease_run_out(dsn: str, key: str, *, expired: bool = False) -> None:
    """Until ``key``'s lease (and, ``expired``, its ttl) has run out, as PostgreSQL itself sees it (the proxy's own
    path to it may be cut)."""
    direct = await asyncpg.connect(dsn)
    try:
        async def ran_out() -> bool:
            return bool(await direct.fetchval(
                "SELECT lease_expires_at <= now() AND (NOT $2 OR expires_at <= now()) FROM idemproxy_records "
                "WHERE key = $1", key, expired))
        await until_async(ran_out, timeout=10)
    finally:
        await direct.close()


@pytest.fixture
async def cut_proxy(make_proxy: ProxyFactory, pg_relay: Relay, clean_pg: str) -> AsyncIterator[RunningProxy]:
    """A proxy on PostgreSQL alone, reached through the relay."""
    yield await make_proxy(storage_section=pg_section(via(pg_relay, clean_pg)), **FAST)


async def started(proxy: RunningProxy, upstream: RecordingUpstream, key: str,
                  **kw: Any) -> asyncio.Future[tuple[Any, bytes]]:
    """Send a request and return once the upstream has begun executing it."""
    pending = asyncio.ensure_future(proxy.post("/v1/charges", key=key, body=CHARGE, **kw))
    await until(lambda: upstream.count(key=key) == 1)
    return pending


async def forwarded_then_cut(holder: RunningProxy, upstream: RecordingUpstream, relay: Relay, key: str,
                             delay: str) -> None:
    """``holder`` forwards ``key`` (the upstream taking ``delay`` seconds), its path to the store is cut meanwhile,
    and its client gets 503 ``forwarded: true``: the executed answer waits in ``holder``, unstored."""
    pending = await started(holder, upstream, key, headers={"X-Test-Delay": delay})
    relay.cut()
    resp, body = await pending
    assert resp.status == 503 and json.loads(body)["forwarded"] is True


async def replayed_once(proxy: RunningProxy, upstream: RecordingUpstream, key: str) -> None:
    """The retry of ``key`` sent to ``proxy`` is the replay of the one execution, never a second one."""
    again, again_body = await proxy.post("/v1/charges", key=key, body=CHARGE)
    assert upstream.count(key=key) == 1, "the key was executed a second time"
    assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert json.loads(again_body)["serial"] == upstream.executed[-1].serial


def metric(proxy: RunningProxy, line_start: str) -> float:
    for line in proxy.proxy.metrics.render().decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_store_cut_during_the_forward_the_client_waits_for_the_stored_answer(
    cut_proxy: RunningProxy, upstream: RecordingUpstream, pg_relay: Relay
) -> None:
    pending = await started(cut_proxy, upstream, "cut-1", headers={"X-Test-Delay": "0.3"})
    pg_relay.cut()
    await asyncio.sleep(1.2)  # the upstream has answered by now; the store is still away
    assert not pending.done(), "nothing of the answer may be sent before it is durable"
    pg_relay.restore()
    resp, body = await pending
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    assert metric(cut_proxy, 'idemproxy_settle_retries_total{operation="complete"}') >= 1

    await asyncio.sleep(3.1)  # past the lease: a record left in flight would now be taken over
    again, again_body = await cut_proxy.post("/v1/charges", key="cut-1", body=CHARGE)
    assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert again_body == body
    assert upstream.count(key="cut-1") == 1


async def idle(direct: asyncpg.Connection) -> bool:
    """No other connection to the database is running a statement (the proxy's pool is at rest)."""
    return not await direct.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND state <> 'idle'")


async def test_a_completion_that_landed_with_its_reply_lost_answers_as_executed_not_as_a_replay(
    cut_proxy: RunningProxy, upstream: RecordingUpstream, pg_relay: Relay, clean_pg: str
) -> None:
    """PostgreSQL commits the completion, its reply is lost (the connection cut after the commit): the retry finds the
    record completed with this very answer. The client executed the request and gets its answer as executed, not
    marked as a replay."""
    # (statements prepared on the pooled connection: a muted prepare would hold the completion before it runs)
    assert (await cut_proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
    pending = await started(cut_proxy, upstream, "lost-reply", headers={"X-Test-Delay": "0.3"})
    direct = await asyncpg.connect(clean_pg)
    try:
        await until_async(lambda: idle(direct))  # the claim's connection back in the pool, nothing on the wire
        pg_relay.mute()  # statements reach PostgreSQL; their replies are held

        async def completed() -> bool:
            return bool(await direct.fetchval(
                "SELECT state = 'completed' FROM idemproxy_records WHERE key = 'lost-reply'"))
        await until_async(completed, timeout=5)
    finally:
        await direct.close()
    pg_relay.cut()  # the reply of the committed completion is lost
    pg_relay.restore()
    resp, body = await pending
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    assert json.loads(body)["serial"] == upstream.executed[-1].serial
    again, again_body = await cut_proxy.post("/v1/charges", key="lost-reply", body=CHARGE)
    assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true" and again_body == body
    assert upstream.count(key="lost-reply") == 1


def fail(relay: Relay, fault: str) -> None:
    """``cut``: the store's connections close (each attempt fails at once); ``stall``: they hang (each attempt
    waits out the store's own 5 s operation timeout)."""
    relay.cut() if fault == "cut" else relay.stall()


@pytest.mark.parametrize("fault", ["cut", "stall"])
async def test_store_away_past_settle_timeout_503_forwarded_then_the_background_completion_lands(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_relay: Relay, clean_pg: str, fault: str
) -> None:
    proxy = await make_proxy(storage_section=pg_section(via(pg_relay, clean_pg)),
                             upstream={"timeout": "1s"}, idempotency={"lease": "3s", "settle_timeout": "500ms"})
    pending = await started(proxy, upstream, "away-1", headers={"X-Test-Delay": "0.2"})
    fail(pg_relay, fault)
    failed_at = time.monotonic()
    resp, body = await pending
    # settle_timeout bounds the client's wait from the upstream's answer, whatever one attempt in the store takes
    assert time.monotonic() - failed_at < 2.5
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    problem = json.loads(body)
    assert problem["code"] == "store_unavailable" and problem["forwarded"] is True
    assert "Idempotent-Replayed" not in resp.headers
    # (a hung first attempt is pending once the store's own timeout ends it and the retries take over)
    await until(lambda: metric(proxy, "idemproxy_pending_settles") == 1, timeout=8)

    await asyncio.sleep(3.5)  # longer than the lease: only the background completion prevents a takeover now
    pg_relay.restore()
    await until(lambda: metric(proxy, "idemproxy_pending_settles") == 0)
    again, again_body = await proxy.post("/v1/charges", key="away-1", body=CHARGE)
    assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert json.loads(again_body)["serial"] == upstream.executed[-1].serial
    assert upstream.count(key="away-1") == 1
    assert metric(proxy, "idemproxy_settles_dropped_total") == 0


async def test_owner_cut_off_and_taken_over_never_answers_its_own_unstored_result(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_relay: Relay, clean_pg: str
) -> None:
    owner = await make_proxy(storage_section=pg_section(via(pg_relay, clean_pg)), **FAST)
    other = await make_proxy(storage_section=pg_section(clean_pg), **FAST)
    pending = await started(owner, upstream, "taken", headers={"X-Test-Delay": "0.2"})
    pg_relay.cut()  # the owner loses PostgreSQL; its completion keeps failing
    await asyncio.sleep(3.2)  # the owner's lease runs out
    retry, retry_body = await other.post("/v1/charges", key="taken", body=CHARGE)
    assert retry.status == 201 and retry.headers["Idempotent-Replayed"] == "false"  # the allowed takeover
    assert upstream.count(key="taken") == 2
    pg_relay.restore()  # the owner's fenced completion is refused now

    resp, body = await pending
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "true"
    assert body == retry_body, "the owner's client must get the record's answer, never its own"
    assert json.loads(body)["serial"] == upstream.executed[-1].serial


@pytest.mark.parametrize("fault", ["cut", "stall"])
async def test_release_status_answered_at_once_and_key_usable_as_soon_as_the_store_is_back(
    cut_proxy: RunningProxy, upstream: RecordingUpstream, pg_relay: Relay, fault: str
) -> None:
    pending = await started(cut_proxy, upstream, "rel-1",
                            headers={"X-Test-Delay": "0.3", "X-Test-Status": "503"})
    fail(pg_relay, fault)
    started_at = time.monotonic()
    resp, body = await pending
    assert resp.status == 503 and json.loads(body)["serial"] == 1  # the upstream's own answer, not a problem
    assert time.monotonic() - started_at < 1.5  # not held for settle_timeout, nor for a hung attempt
    pg_relay.restore()

    async def usable() -> bool:
        again, _ = await cut_proxy.post("/v1/charges", key="rel-1", body=CHARGE)
        return again.status == 201

    await until_async(usable, timeout=2.5)  # within the background release's retries, well before the lease
    assert upstream.count(key="rel-1") == 2
    # cut: a retry landed it; stalled: the first attempt, held by the store, landed once its bytes flowed again
    retries = metric(cut_proxy, 'idemproxy_settle_retries_total{operation="release"}')
    assert retries >= 1 if fault == "cut" else retries == 0


async def test_pending_settles_are_bounded_oldest_dropped(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_relay: Relay, clean_pg: str
) -> None:
    proxy = await make_proxy(
        storage_section=pg_section(via(pg_relay, clean_pg), pending_settles={"max_count": 2}),
        upstream={"timeout": "1s"}, idempotency={"lease": "3s", "settle_timeout": "200ms"},
    )
    keys = ["b-1", "b-2", "b-3"]
    pending = []
    for delay, key in zip(("0.3", "0.5", "0.7"), keys, strict=True):  # settled oldest first
        pending.append(await started(proxy, upstream, key, headers={"X-Test-Delay": delay}))
    pg_relay.cut()
    results = await asyncio.gather(*pending)
    assert {resp.status for resp, _ in results} == {503}
    assert metric(proxy, "idemproxy_pending_settles") == 2
    assert metric(proxy, "idemproxy_settles_dropped_total") == 1
    pg_relay.restore()
    await until(lambda: metric(proxy, "idemproxy_pending_settles") == 0)
    # the two newest landed and replay; the oldest was dropped and stays in flight until its lease runs out
    statuses = [(await proxy.post("/v1/charges", key=key, body=CHARGE))[0].status for key in keys]
    assert statuses == [409, 201, 201]
    assert sum(upstream.count(key=key) for key in keys) == 3


async def test_graceful_shutdown_flushes_pending_completions(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_relay: Relay, clean_pg: str
) -> None:
    proxy = await make_proxy(storage_section=pg_section(via(pg_relay, clean_pg)),
                             upstream={"timeout": "1s"}, idempotency={"lease": "3s", "settle_timeout": "200ms"})
    pending = await started(proxy, upstream, "flush-1", headers={"X-Test-Delay": "0.2"})
    pg_relay.cut()
    assert (await pending)[0].status == 503
    stopping = asyncio.ensure_future(proxy.server.close())  # graceful: the app's cleanup stops the Proxy
    await asyncio.sleep(0.5)
    assert not stopping.done()  # still retrying the completion
    pg_relay.restore()
    await asyncio.wait_for(stopping, 10)
    assert metric(proxy, "idemproxy_settles_dropped_total") == 0
    conn = await asyncpg.connect(clean_pg)
    try:
        state = await conn.fetchval("SELECT state FROM idemproxy_records WHERE key = 'flush-1'")
    finally:
        await conn.close()
    assert state == "completed"
    assert upstream.count(key="flush-1") == 1


@pytest.mark.parametrize("fronted", [False, True], ids=["postgres", "redis"])
@pytest.mark.parametrize("fault", ["cut", "stall"])
async def test_shutdown_timeout_bounds_a_shutdown_with_a_completion_still_pending(
    proxy_process: Callable[..., ProxyProcess], upstream: RecordingUpstream, pg_relay: Relay, clean_pg: str,
    redis_url: str, redis_prefix: str, fronted: bool, fault: str,
) -> None:
    """The store goes away after the forward and stays away through the shutdown: the process exits 0 within
    shutdown_timeout (and the 0.5 s given to what was cut), not after the store's own operation timeouts. A cut
    store refuses each attempt (the pending completion is retried until the time is up, then dropped); a stalled
    one holds the attempt on the wire (it is cut, with the pool's connections)."""
    timeout = 2.0
    redis = {"redis": {"url": redis_url, "key_prefix": redis_prefix}} if fronted else {}
    proxy = proxy_process({
        "upstream": {"url": upstream.url, "timeout": "1s"},
        "storage": {"postgres": {"dsn": via(pg_relay, clean_pg), "pool_min": 1, "pool_max": 4}, **redis},
        "idempotency": {"lease": "30s", "settle_timeout": "200ms"},
        "drain_delay": "0s", "shutdown_timeout": f"{timeout}s", "log": {"access": "off"},
    })
    await proxy.start()
    assert proxy.proc is not None
    async with aiohttp.ClientSession() as session:
        pending = asyncio.ensure_future(session.post(
            proxy.url + "/v1/charges", json=CHARGE,
            headers={"Idempotency-Key": "late-1", "Authorization": "t", "X-Test-Delay": "0.3"}))
        await until(lambda: upstream.count(key="late-1") == 1)
        getattr(pg_relay, fault)()
        async with await pending as resp:
            assert resp.status == 503 and (await resp.json())["forwarded"] is True
    signalled = time.monotonic()
    proxy.proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(proxy.proc.wait, 30)
    took = time.monotonic() - signalled
    assert code == 0
    # (0.5 s to unwind, and the process's own exit; it took up to 8 s more before: the store's 5 s timeouts)
    assert took < timeout + 1.5, f"exited {took:.2f}s after SIGTERM:\n{proxy.log()}"
    said = {"cut": "dropped a pending complete (shutdown", "stall": "1 forward(s) or completion(s) still running: cut"}
    assert said[fault] in proxy.log()
    assert upstream.count(key="late-1") == 1


async def test_a_claim_blocked_in_the_store_never_forwards_into_its_own_takeover(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, clean_pg: str
) -> None:
    """The lease runs from when the claim was sent: a claim that sat 1.5 s behind a lock has too little of its
    3 s lease left to forward within it (upstream.timeout 1 s + the 2 s margin), so nothing is sent."""
    proxy = await make_proxy(storage_section=pg_section(clean_pg), **FAST)
    assert (await proxy.post("/v1/charges", key="warm", body=CHARGE))[0].status == 201
    locker = await asyncpg.connect(clean_pg)
    try:
        lock = locker.transaction()
        await lock.start()
        await locker.execute("LOCK TABLE idemproxy_records IN ACCESS EXCLUSIVE MODE")
        pending = asyncio.ensure_future(proxy.post("/v1/charges", key="slow-claim", body=CHARGE))
        await asyncio.sleep(1.5)
        await lock.rollback()
    finally:
        await locker.close()
    resp, body = await pending
    assert resp.status == 503 and json.loads(body)["code"] == "store_unavailable"
    assert upstream.count(key="slow-claim") == 0

    async def released() -> bool:  # released at once (nothing was sent), not held for the lease
        again, _ = await proxy.post("/v1/charges", key="slow-claim", body=CHARGE)
        return again.status == 201

    await until_async(released, timeout=2.5)


async def test_background_releases_never_push_out_a_pending_completion() -> None:
    """During an outage many claims fail and leave releases to retry; the bound on them must not drop the
    completion whose loss would mean a second execution."""
    from idemproxy.config import PendingSettlesConfig
    from idemproxy.metrics import Metrics
    from idemproxy.problems import StoreUnavailable
    from idemproxy.settle import Settler

    store_up = asyncio.Event()
    landed: list[str] = []

    def operation(name: str) -> Callable[[], Coroutine[Any, Any, bool]]:
        async def run() -> bool:
            if not store_up.is_set():
                raise StoreUnavailable("down")
            landed.append(name)
            return True
        return run

    metrics = Metrics()
    settler = Settler(metrics, PendingSettlesConfig(max_count=2, max_bytes=1 << 20))
    assert await settler.complete(operation("complete"), size=100, wait=0.05, give_up_after=60) is None
    for i in range(5):
        settler.release_later(operation(f"release-{i}"), until=time.monotonic() + 60)
    assert settler.pending == 3  # the completion and the two newest releases
    store_up.set()
    await settler.flush(5, 1)
    assert "complete" in landed and sorted(landed) == ["complete", "release-3", "release-4"]


async def test_a_release_again_runs_from_its_instant_and_holds_no_shutdown(caplog: pytest.LogCaptureFixture) -> None:
    """``release_again_at``: nothing runs before its instant; then one attempt, which says what it released. None
    while the release it follows is still retrying (the store away: that one lands later anyway), none past its
    deadline, and one not yet started at a shutdown holds nothing up and is dropped without a word."""
    from idemproxy.config import PendingSettlesConfig
    from idemproxy.metrics import Metrics
    from idemproxy.problems import StoreUnavailable
    from idemproxy.settle import Settler

    ran: list[str] = []

    def release(name: str, away: bool = False) -> Callable[[], Coroutine[Any, Any, bool]]:
        async def run() -> bool:
            ran.append(name)
            if away:
                raise StoreUnavailable("away")
            return True
        return run

    settler = Settler(Metrics(), PendingSettlesConfig(max_count=10, max_bytes=1 << 20))
    now = time.monotonic()
    landed = settler.release_later(release("first"), until=now + 60)
    retrying = settler.release_later(release("first, store away", away=True), until=now + 60)
    await until(lambda: landed.task is not None and landed.task.done(), timeout=5)
    settler.release_again_at(release("soon"), at=now + 0.2, until=now + 60, after=landed)
    settler.release_again_at(release("behind one retrying"), at=now + 0.2, until=now + 60, after=retrying)
    settler.release_again_at(release("past its deadline"), at=now + 0.2, until=now + 0.1, after=landed)
    settler.release_again_at(release("after the shutdown"), at=now + 30, until=now + 60, after=landed)
    with caplog.at_level(logging.INFO, "idemproxy.settle"):
        await until(lambda: "soon" in ran, timeout=5)
        await until(lambda: bool(caplog.records), timeout=5)
        assert time.monotonic() - now >= 0.2
        assert [r.getMessage() for r in caplog.records if "once more" in r.getMessage()] == [
            "released, once more, a claim whose reply was lost (it landed after the release that followed its "
            "failure, or that release never got through)"]
        await asyncio.sleep(0.3)  # (time passing is the point: the ones skipped or not due stay so)
        caplog.clear()
        began = time.monotonic()
        await settler.flush(0.5, 1)  # (the release still retrying is dropped: the store stays away)
    assert time.monotonic() - began < 2
    assert sorted(set(ran)) == ["first", "first, store away", "soon"]
    assert not [r for r in caplog.records if "once more" in r.getMessage()]


async def test_an_unexpected_error_of_a_retry_reaches_the_waiting_caller() -> None:
    """Not "still pending" (the engine would promise a background completion that no longer runs): the error
    the retry met, as the first attempt's would have been."""
    from idemproxy.config import PendingSettlesConfig
    from idemproxy.metrics import Metrics
    from idemproxy.problems import StoreUnavailable
    from idemproxy.settle import Settler

    calls = 0

    async def run() -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise StoreUnavailable("down")
        raise RuntimeError("a bug, not an outage")

    settler = Settler(Metrics(), PendingSettlesConfig(max_count=10, max_bytes=1 << 20))
    with pytest.raises(RuntimeError, match="a bug"):
        await settler.complete(run, size=10, wait=5, give_up_after=60)
    assert calls == 2 and settler.pending == 0


@pytest.mark.parametrize("ttl", ["24h", "1500ms"])
async def test_a_retry_the_moment_the_store_is_back_gets_the_pending_answer_not_a_second_execution(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_relay: Relay, clean_pg: str, ttl: str
) -> None:
    """The store was away longer than the lease: the record's lease has run out while this replica still holds the
    executed answer, waiting between two background attempts. A retry sent to it as soon as the store answers must
    get that answer (a replay), never take the key over and execute it again. With a ttl shorter than the lease
    (valid), the background completion gave up at the ttl, before the key could even be taken over."""
    proxy = await make_proxy(storage_section=pg_section(via(pg_relay, clean_pg)), upstream={"timeout": "1s"},
                             idempotency={"lease": "3s", "ttl": ttl, "settle_timeout": "200ms"})
    await forwarded_then_cut(proxy, upstream, pg_relay, "back-1", "0.2")
    assert metric(proxy, "idemproxy_pending_settles") == 1
    await lease_run_out(clean_pg, "back-1")
    pg_relay.restore()
    await replayed_once(proxy, upstream, "back-1")


@pytest.mark.parametrize("fronted", [False, True], ids=["postgres", "redis"])
async def test_a_retry_reaching_another_replica_as_the_store_comes_back_gets_the_answer_not_a_second_execution(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_relay: Relay, clean_pg: str, redis_url: str,
    redis_prefix: str, fronted: bool,
) -> None:
    """The store was away from the replica holding the executed answer for longer than the lease. As it came
    back, a retry sent to *another* replica claimed first, found the lease run out and took the key over: the
    payment ran a second time, and the holder's completion (retried at most 0.5 s apart) was refused. The store
    now gives a lapsed lease a grace (TAKEOVER_GRACE) before a takeover; the retry waits it out, and meanwhile
    the holder's completion lands: the retry is a replay."""
    timing = {"upstream": {"timeout": "1s"}, "idempotency": {"lease": "3s", "settle_timeout": "200ms"}}
    redis = {"redis": {"url": redis_url, "key_prefix": redis_prefix}} if fronted else {}
    holder = await make_proxy(storage_section={**pg_section(via(pg_relay, clean_pg)), **redis}, **timing)
    other = await make_proxy(storage_section={**pg_section(clean_pg), **redis}, **timing)
    await forwarded_then_cut(holder, upstream, pg_relay, "across-1", "0.2")
    await lease_run_out(clean_pg, "across-1")
    pg_relay.restore()  # the holder's next attempt comes within 0.5 s; the retry reaches the other first
    await replayed_once(other, upstream, "across-1")


def one_table(dsn: str) -> dict[str, object]:
    section = pg_section(dsn)
    section["postgres"]["partitions"] = "none"
    return section


@pytest.mark.parametrize("fronted", [False, True], ids=["postgres", "redis"])
async def test_a_sweep_between_the_lease_and_the_retry_does_not_take_the_grace_away(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, pg_relay: Relay, pg_one_table_dsn: str, redis_url: str,
    redis_prefix: str, fronted: bool,
) -> None:
    """test_settle's across-replica test on the one-table layout, the ttl as long as the lease. The store was away
    from the holder past the lease and the ttl (the holder retries its completion for a ttl from when it began,
    so it is still at it). As the store comes back, the other replica's periodic sweep (every 30 s, on every
    replica) runs before the retry arrives: it deletes the lapsed in-flight record outright, with no grace, so the
    retry finds no record and executes the payment again, and the holder's completion is refused."""
    dsn = await empty_records(pg_one_table_dsn)
    timing = {"upstream": {"timeout": "1s"},
              "idempotency": {"lease": "3s", "ttl": "3s", "settle_timeout": "200ms"}}
    redis = {"redis": {"url": redis_url, "key_prefix": redis_prefix}} if fronted else {}
    holder = await make_proxy(storage_section={**one_table(via(pg_relay, dsn)), **redis}, **timing)
    other = await make_proxy(storage_section={**one_table(dsn), **redis}, **timing)
    await forwarded_then_cut(holder, upstream, pg_relay, "swept-1", "0.9")
    await lease_run_out(dsn, "swept-1", expired=True)
    pg_relay.restore()  # the holder's next attempt comes within 0.5 s (it retries for a ttl: ~0.9 s more)
    await other.proxy.sweep_once()  # the other replica's periodic sweep happens to run now
    await replayed_once(other, upstream, "swept-1")
