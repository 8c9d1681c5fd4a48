"""Real concurrent duplicates and real crashes; every assertion counts what the upstream actually executed."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from idemproxy.proxy import Upstream
from tests.conftest import BACKENDS, ProxyFactory, StorageFactory
from tests.proxyproc import ProxyProcess
from tests.upstream import RecordingUpstream

N = 50
LEASE = "4s"  # shared by the multi-process tests; the kill -9 test waits it out
CHARGE = {"amount": 1000, "currency": "eur"}
# The first request is held this long upstream, so all duplicates arrive while it is in flight even on a busy CI box.
HEADERS = {"Authorization": "Bearer t1", "X-Test-Delay": "1.5"}


Result = tuple[int, dict[str, str], bytes]


async def fire(urls: list[str], key: str, n: int = N, headers: dict[str, str] | None = None) -> list[Result]:
    """Send ``n`` identical requests at once, spread round-robin over ``urls``."""
    send = {**HEADERS, **(headers or {}), "Idempotency-Key": key}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one(i: int) -> tuple[int, dict[str, str], bytes]:
            async with session.post(urls[i % len(urls)] + "/v1/charges", json=CHARGE, headers=send) as resp:
                return resp.status, dict(resp.headers), await resp.read()

        return await asyncio.gather(*(one(i) for i in range(n)))


def assert_one_execution_and_409s(results: list[tuple[int, dict[str, str], bytes]], upstream: RecordingUpstream,
                                  key: str) -> None:
    statuses = Counter(status for status, _, _ in results)
    assert upstream.count(key=key) == 1
    assert statuses == {201: 1, 409: N - 1}, statuses
    for status, headers, body in results:
        if status == 409:
            assert int(headers["Retry-After"]) >= 1
            assert json.loads(body)["code"] == "in_flight"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_50_concurrent_duplicates_execute_once(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    proxy = await make_proxy(backend)
    results = await fire([proxy.url], "c-50")
    assert_one_execution_and_409s(results, upstream, "c-50")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_wait_mode_gives_all_50_the_same_answer(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, backend: str
) -> None:
    proxy = await make_proxy(backend, idempotency={"in_flight": "wait"})
    results = await fire([proxy.url], "w-50")
    assert upstream.count(key="w-50") == 1
    assert {status for status, _, _ in results} == {201}
    assert len({body for _, _, body in results}) == 1
    assert Counter(h["Idempotent-Replayed"] for _, h, _ in results) == {"false": 1, "true": N - 1}


async def test_wait_mode_runs_out_with_409(make_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await make_proxy(idempotency={"in_flight": "wait", "wait_timeout": "200ms"})
    results = await fire([proxy.url], "w-out", n=3, headers={"X-Test-Delay": "1.5"})
    assert sorted(status for status, _, _ in results) == [201, 409, 409]
    assert upstream.count(key="w-out") == 1


def shared_config(upstream: RecordingUpstream, storage: StorageFactory, **idempotency: Any) -> dict[str, Any]:
    return {
        "upstream": {"url": upstream.url, "timeout": "2s"},
        "idempotency": {"lease": LEASE, **idempotency},
        "storage": storage("redis"),
        "log": {"access": "off"},
    }


@pytest.mark.parametrize("mode", ["reject", "wait"])
async def test_50_duplicates_over_3_processes_execute_once(
    upstream: RecordingUpstream, storage: StorageFactory, proxy_process: Callable[..., ProxyProcess], mode: str
) -> None:
    config = shared_config(upstream, storage, in_flight=mode)
    procs = [proxy_process(config, name=f"p{i}") for i in range(3)]
    await asyncio.gather(*(p.start() for p in procs))
    results = await fire([p.url for p in procs], f"multi-{mode}")
    if mode == "reject":
        assert_one_execution_and_409s(results, upstream, f"multi-{mode}")
    else:
        assert upstream.count(key=f"multi-{mode}") == 1
        assert {status for status, _, _ in results} == {201}
        assert len({body for _, _, body in results}) == 1
    # Each process (uvloop, the store's own Redis connection) took the fast path: Redis answered every claim.
    for proc in procs:
        claims, errors = await redis_claims(proc)
        assert claims > 0 and errors == 0, proc.log()


async def redis_claims(proc: ProxyProcess) -> tuple[float, float]:
    """(Redis claims timed, Redis errors) from a proxy process's /metrics."""
    async with aiohttp.ClientSession() as session, session.get(proc.admin_url + "/metrics") as resp:
        text = await resp.text()
    claims = errors = 0.0
    for line in text.splitlines():
        if line.startswith('idemproxy_store_duration_seconds_count{backend="redis",operation="claim"}'):
            claims += float(line.rsplit(" ", 1)[1])
        elif line.startswith('idemproxy_store_errors_total{backend="redis"'):
            errors += float(line.rsplit(" ", 1)[1])
    return claims, errors


async def test_kill_9_then_exactly_one_retry_takes_over_after_the_lease(
    upstream: RecordingUpstream, storage: StorageFactory, proxy_process: Callable[..., ProxyProcess]
) -> None:
    config = shared_config(upstream, storage)
    victim = proxy_process(config, name="victim")
    survivor = proxy_process(config, name="survivor")  # a second replica, already up: no start-up in the window
    await asyncio.gather(victim.start(), survivor.start())
    async with aiohttp.ClientSession() as session:
        doomed = asyncio.ensure_future(session.post(
            victim.url + "/v1/charges", json=CHARGE,
            headers={"Authorization": "Bearer t1", "Idempotency-Key": "crash", "X-Test-Hang": "1"},
        ))
        while upstream.count(key="crash") == 0:  # the upstream is working on it now
            await asyncio.sleep(0.01)
        claimed_at = time.time()
        victim.kill()  # kill -9: no release, no completion
        with pytest.raises(aiohttp.ClientError):
            await doomed

    early = await fire([survivor.url], "crash", n=5, headers={"X-Test-Delay": "0"})
    assert time.time() < claimed_at + 4.0, "the check ran too late to mean anything"
    assert {status for status, _, _ in early} == {409}
    assert upstream.count(key="crash") == 1

    await asyncio.sleep(max(claimed_at + 4.0 - time.time(), 0) + 0.1)  # the 4 s lease runs out
    late = await fire([survivor.url], "crash", n=10, headers={"X-Test-Delay": "1.5"})
    assert Counter(status for status, _, _ in late) == {201: 1, 409: 9}
    assert upstream.count(key="crash") == 2  # the lost original plus exactly one takeover
    replay = await fire([survivor.url], "crash", n=1, headers={"X-Test-Delay": "0"})
    assert replay[0][0] == 201 and replay[0][1]["Idempotent-Replayed"] == "true"
    async with aiohttp.ClientSession() as session, session.get(survivor.admin_url + "/metrics") as resp:
        assert "idemproxy_lease_takeovers_total 1.0" in await resp.text()


async def test_embedded_store_survives_kill_9(
    upstream: RecordingUpstream, proxy_process: Callable[..., ProxyProcess], tmp_path: Path
) -> None:
    config = {"upstream": {"url": upstream.url}, "storage": {"embedded": {"path": str(tmp_path / "e.sqlite3")}}}
    first = proxy_process(config, name="first")
    await first.start()
    original = await fire([first.url], "durable", n=1, headers={"X-Test-Delay": "0"})
    first.kill()
    second = proxy_process(config, name="second")
    await second.start()
    replay = await fire([second.url], "durable", n=1, headers={"X-Test-Delay": "0"})
    assert replay[0][0] == 201 and replay[0][1]["Idempotent-Replayed"] == "true"
    assert replay[0][2] == original[0][2]
    assert upstream.count(key="durable") == 1


async def test_second_process_on_one_embedded_file_is_refused(
    upstream: RecordingUpstream, proxy_process: Callable[..., ProxyProcess], tmp_path: Path
) -> None:
    config = {"upstream": {"url": upstream.url}, "storage": {"embedded": {"path": str(tmp_path / "one.sqlite3")}}}
    await proxy_process(config, name="owner").start()
    intruder = proxy_process(config, name="intruder")
    with pytest.raises(RuntimeError, match="in use by another idemproxy process"):
        await intruder.start()
    assert intruder.proc is not None and intruder.proc.returncode == 1
    # The same file by another name (a volume, a "current" link) is the same file: it got past the lock.
    (tmp_path / "link.sqlite3").symlink_to(tmp_path / "one.sqlite3")
    linked = proxy_process({**config, "storage": {"embedded": {"path": str(tmp_path / "link.sqlite3")}}},
                           name="linked")
    with pytest.raises(RuntimeError, match="in use by another idemproxy process"):
        await linked.start()


async def test_a_replica_paused_past_its_lease_sends_nothing_once_another_took_the_key_over(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, storage: StorageFactory,
    proxy_process: Callable[..., ProxyProcess], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guarantee 1 under a stop-the-world pause (SIGSTOP, a frozen VM, a starved container): replica A claims the
    key, then its process stands still, between its last look at the lease and its write upstream, until well
    after the lease ran out. Meanwhile a retry reaches replica B, which takes the key over and forwards it. A,
    waking up, must not send its copy: the upstream executes the charge once, not twice."""
    lease, pause = 2.0, 4.0  # B's retry meets the lease's end plus TAKEOVER_GRACE (1 s) well inside the pause
    a = await make_proxy("redis", upstream={"timeout": "1s"}, idempotency={"lease": f"{lease:g}s"})
    b = proxy_process({**shared_config(upstream, storage), "upstream": {"url": upstream.url, "timeout": "1s"},
                       "idempotency": {"lease": f"{lease:g}s"}}, name="b")
    await b.start()
    send = {"Authorization": "Bearer t1", "Idempotency-Key": "paused", "Content-Type": "application/json"}
    body = json.dumps(CHARGE).encode()
    b_answer: list[int] = []

    def retry_on_b() -> None:  # a client retrying on B while A stands still (a thread: the test's loop is A's)
        time.sleep(lease + 0.3)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            req = urllib.request.Request(b.url + "/v1/charges", data=body, headers=send, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=20) as resp:
                    b_answer.append(resp.status)
                    return
            except urllib.error.HTTPError as exc:  # 409 while A's lease, then its grace, lasts
                if exc.code != 409:
                    b_answer.append(exc.code)
                    return
            time.sleep(0.1)

    original = Upstream.target
    stalled: list[threading.Thread] = []

    def target(request: web.BaseRequest) -> str:
        if request.headers.get("X-Test-Pause") and not stalled:  # the first look: after the lease was judged
            stalled.append(threading.Thread(target=retry_on_b))
            stalled[0].start()
            time.sleep(pause)  # the whole process stands still: loop, upstream, A's store connections
        return original(request)

    monkeypatch.setattr(Upstream, "target", staticmethod(target))
    resp, raw = await a.post("/v1/charges", key="paused", body=body,
                             headers={"Content-Type": "application/json", "X-Test-Pause": "1"})
    await asyncio.to_thread(stalled[0].join)
    assert b_answer == [201]
    assert upstream.count(key="paused") == 1, "the paused replica sent its copy after B took the key over"
    assert resp.status == 503 and json.loads(raw)["code"] == "store_unavailable", raw
    assert "nothing was sent" in json.loads(raw)["detail"]
    replay, _ = await a.post("/v1/charges", key="paused", body=body, headers={"Content-Type": "application/json"})
    assert replay.status == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert upstream.count(key="paused") == 1


async def test_a_request_held_up_past_its_time_to_send_is_refused_leaving_nothing_and_a_warning(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The 503 a replica gives when it woke past its lease's end less the margin (nothing sent): no key left in
    flight (the next request executes at once, not 409), the in-flight gauge back at 0, the problem's Retry-After
    and request id, and a warning saying why: the stores are fine, so nothing else in the logs would explain it."""
    lease, pause = 2.0, 2.5  # no other replica: the key is simply late, not taken over
    a = await make_proxy("redis", upstream={"timeout": "1s"}, idempotency={"lease": f"{lease:g}s"})
    original = Upstream.target
    paused: list[bool] = []

    def target(request: web.BaseRequest) -> str:
        if request.headers.get("X-Test-Pause") and not paused:  # the first look: after the lease was judged
            paused.append(True)
            time.sleep(pause)  # the whole process stands still
        return original(request)

    monkeypatch.setattr(Upstream, "target", staticmethod(target))
    body = json.dumps(CHARGE).encode()
    with caplog.at_level(logging.WARNING, logger="idemproxy.engine"):
        resp, raw = await a.post("/v1/charges", key="late", body=body, headers={
            "Content-Type": "application/json", "X-Test-Pause": "1", "X-Request-Id": "held-up-1"})
    assert resp.status == 503 and json.loads(raw)["code"] == "store_unavailable", raw
    assert resp.headers["Retry-After"] and resp.headers["X-Request-Id"] == "held-up-1"
    assert upstream.count(key="late") == 0
    assert a.proxy.metrics.in_flight._value.get() == 0
    warned = [r.getMessage() for r in caplog.records if "held up" in r.getMessage()]
    assert len(warned) == 1 and "nothing was sent" in warned[0], caplog.text
    again, _ = await a.post("/v1/charges", key="late", body=body, headers={"Content-Type": "application/json"})
    assert again.status == 201 and again.headers["Idempotent-Replayed"] == "false"
    assert upstream.count(key="late") == 1
