"""The fast path's own Redis connection (store/resp.py), against a real Redis: every reply reaches the caller that
asked for it (under concurrency, cancellation and replies split across reads, on asyncio's loop and uvloop's),
error replies stay with their command, and a stall or a cut fails what is on the wire and leaves the next batch a
fresh connection."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

import pytest
import redis as sync_redis
import uvloop
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from idemproxy.store.resp import RespClient, pack, supports
from tests.relay import Relay
from tests.servers import RedisServer
from tests.test_redis import redis_relay  # noqa: F401  (a fixture)
from tests.test_relay import wait_for

# Holds Redis itself busy for ARGV[1] ms (a script runs alone): a real slow answer, without DEBUG SLEEP (which
# Redis 7 refuses by default). It holds the whole server, so tests using it run on this worker's own Redis
# (running_redis): on a Redis shared by the workers (IDEMPROXY_TEST_REDIS_URL), the other worker's commands and
# connections waited behind it ("redis did not accept a connection within 0.5 s").
BUSY = """
local t = redis.call('TIME'); local stop = t[1] * 1000000 + t[2] + ARGV[1] * 1000
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= stop
return ARGV[2]
"""


@contextlib.asynccontextmanager
async def stalled_client(relay: Relay, timeout: float) -> AsyncIterator[RespClient]:
    """A client connected through ``relay`` (one PING answered), then the relay stalled."""
    client = RespClient(f"redis://127.0.0.1:{relay.port}/0", timeout=timeout)
    try:
        assert await client.execute([(b"PING",)]) == [b"PONG"]
        relay.stall()
        yield client
    finally:
        client.close()


def test_supports_only_what_it_implements() -> None:
    assert supports("redis://127.0.0.1:6379/0")
    assert supports("redis://user:p%40ss@host:6379/3")
    assert supports("unix:///run/redis.sock?db=2")
    assert supports("redis://host:6379?db=1")
    assert not supports("rediss://host:6379/0")  # TLS: redis-py's pipeline
    assert not supports("redis://host:6379/0?socket_timeout=2")  # an option we would silently ignore
    assert not supports("redis://host:6379/0?db=1&client_name=x")


def test_pack_writes_resp_bulk_strings() -> None:
    assert pack([(b"SET", "k\u00e9", 12)]) == b"*3\r\n$3\r\nSET\r\n$3\r\nk\xc3\xa9\r\n$2\r\n12\r\n"
    assert pack([(b"PING",), (b"ECHO", b"", -7, 2**70)]) == (
        b"*1\r\n$4\r\nPING\r\n*4\r\n$4\r\nECHO\r\n$0\r\n\r\n$2\r\n-7\r\n$22\r\n1180591620717411303424\r\n"
    )
    for odd in (True, None):  # not silently written as something Redis would take
        command: Any = (b"SET", "k", odd)  # outside pack's declared types, on purpose
        with pytest.raises(TypeError):
            pack([command])
    with pytest.raises(UnicodeEncodeError):  # strict UTF-8, as redis-py: a lone surrogate is refused
        pack([(b"GET", "\udcff")])


async def _crowd(url: str, prefix: str) -> tuple[int, int]:
    """Many concurrent batches on one client, some cancelled before they were written and some after (while on
    the wire), some replies large enough to arrive in many reads: every caller that waited gets exactly its own
    replies. Returns (batches checked, connections opened)."""
    client = RespClient(url, timeout=5.0)
    rng = random.Random(7)
    values = {n: secrets.token_bytes(rng.choice((8, 300, 70_000, 400_000))) for n in range(300)}

    async def batch(n: int) -> list[object]:
        key = f"{prefix}{n}"
        return await client.execute([(b"SET", key, values[n]), (b"GET", key), (b"ECHO", str(n))])

    try:
        assert await client.execute([(b"PING",)]) == [b"PONG"]  # connected: a batch is written when it starts
        # Redis runs one script at a time, so no reply to the batches below can come back before this one ends:
        # the cancellations below happen while the batches are written and unanswered, whatever the timing.
        busy = asyncio.ensure_future(client.execute([(b"EVAL", BUSY, 0, 500, "busy")]))
        tasks = [asyncio.ensure_future(batch(n)) for n in range(300)]
        for n in range(0, 300, 7):
            tasks[n].cancel()  # before its first step: never written
        await asyncio.sleep(0)  # every other batch has taken its first step, so it is on the wire
        for n in range(3, 300, 11):
            tasks[n].cancel()  # written, its replies still owed
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert await busy == [b"busy"]
        checked = 0
        for n, outcome in enumerate(outcomes):
            if n % 7 == 0 or n % 11 == 3:
                assert isinstance(outcome, asyncio.CancelledError), n
                continue
            assert outcome == [b"OK", values[n], str(n).encode()], n
            checked += 1
        assert await client.execute([(b"ECHO", "after")]) == [b"after"]  # the stream is still in step
        # Each batch cancelled on the wire had its replies read and dropped; none cancelled before it was written
        # put anything on the wire.
        cancelled_on_wire = sum(1 for n in range(300) if n % 11 == 3 and n % 7 != 0)
        assert client.dropped == cancelled_on_wire
        return checked, client.connects
    finally:
        client.close()


async def test_every_reply_reaches_its_own_caller(running_redis: RedisServer, redis_prefix: str) -> None:
    checked, connects = await _crowd(running_redis.url, redis_prefix)
    assert checked > 200 and connects == 1


async def test_every_reply_reaches_its_own_caller_on_uvloop(running_redis: RedisServer, redis_prefix: str) -> None:
    # The product runs on uvloop, whose transports are not asyncio's classes.
    checked, connects = await asyncio.to_thread(uvloop.run, _crowd(running_redis.url, redis_prefix))
    assert checked > 200 and connects == 1


async def test_an_error_reply_stays_with_its_command(redis_url: str, redis_prefix: str) -> None:
    client = RespClient(redis_url, timeout=5.0)
    try:
        replies = await client.execute([
            (b"SET", f"{redis_prefix}a", "1"),
            (b"EVALSHA", "0" * 40, 0),
            (b"NOSUCHCOMMAND",),
            (b"GET", f"{redis_prefix}a"),
        ])
        assert replies[0] == b"OK" and replies[3] == b"1"
        assert isinstance(replies[1], NoScriptError)
        assert isinstance(replies[2], ResponseError) and not isinstance(replies[2], NoScriptError)
    finally:
        client.close()


async def on_loop(loop: str, work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` on this test's loop (asyncio's) or on uvloop's, the product's (its timers run on libuv's
    millisecond clock)."""
    if loop == "uvloop":
        await asyncio.to_thread(uvloop.run, work)
    else:
        await work


LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


@LOOPS
async def test_a_stalled_redis_times_out_and_the_next_batch_reconnects(
    redis_relay: Relay, loop: str  # noqa: F811
) -> None:
    async def work() -> None:
        async with stalled_client(redis_relay, timeout=0.3) as client:
            pending = [asyncio.ensure_future(client.execute([(b"ECHO", str(n))])) for n in range(3)]
            outcomes = await asyncio.gather(*pending, return_exceptions=True)
            assert all(isinstance(o, RedisTimeoutError) for o in outcomes), outcomes
            redis_relay.restore()
            assert await client.execute([(b"ECHO", "fresh")]) == [b"fresh"]
            assert client.connects == 2  # the batch after a timeout went on a new connection

    await on_loop(loop, work())


@LOOPS
async def test_a_slow_answer_is_not_a_timeout_while_replies_keep_coming(running_redis: RedisServer, loop: str) -> None:
    """The deadline counts from the last byte heard: two 0.35 s answers in a row, on a 0.5 s timeout, both land
    (the second is still owed when the first batch's deadline passes)."""
    async def work() -> None:
        client = RespClient(running_redis.url, timeout=0.5)
        try:
            first = asyncio.ensure_future(client.execute([(b"EVAL", BUSY, 0, 350, "a")]))
            await asyncio.sleep(0.05)
            second = asyncio.ensure_future(client.execute([(b"EVAL", BUSY, 0, 350, "b")]))
            assert await first == [b"a"] and await second == [b"b"]
            assert client.connects == 1
            # Replies that stop coming after some did: the deadline moved with the first reply, and still holds.
            first = asyncio.ensure_future(client.execute([(b"EVAL", BUSY, 0, 350, "c")]))
            await asyncio.sleep(0.05)
            stuck = asyncio.ensure_future(client.execute([(b"EVAL", BUSY, 0, 1000, "d")]))
            assert await first == [b"c"]
            with pytest.raises(RedisTimeoutError):
                await stuck
            with pytest.raises(RedisTimeoutError):  # one answer slower than the timeout does fail
                await client.execute([(b"EVAL", BUSY, 0, 1000, "e")])
        finally:
            client.close()

    await on_loop(loop, work())


async def test_a_cut_fails_what_is_on_the_wire_and_the_next_batch_reconnects(redis_relay: Relay) -> None:  # noqa: F811
    async with stalled_client(redis_relay, timeout=2.0) as client:
        pending = asyncio.ensure_future(client.execute([(b"PING",)]))
        await asyncio.sleep(0.05)
        redis_relay.cut()
        with pytest.raises(RedisConnectionError):
            await pending
        with pytest.raises(RedisConnectionError):  # still cut: the new connection is closed at once
            await client.execute([(b"PING",)])
        redis_relay.restore()
        assert await client.execute([(b"PING",)]) == [b"PONG"]


@contextlib.contextmanager
def acl(redis_url: str, redis_prefix: str, password: str | None) -> Iterator[str]:
    """A Redis user for the test's keys, with ``password`` (None: nopass), deleted after."""
    name = f"idemtest-{uuid.uuid4().hex[:8]}"
    admin = sync_redis.Redis.from_url(redis_url)
    admin.acl_setuser(name, enabled=True, nopass=password is None,
                      passwords=[f"+{password}"] if password else None, keys=[f"{redis_prefix}*"],
                      commands=["+@all"])
    try:
        yield name
    finally:
        admin.acl_deluser(name)
        admin.close()


@pytest.fixture
def acl_user(redis_url: str, redis_prefix: str) -> Iterator[tuple[str, str]]:
    password = secrets.token_hex(8)
    with acl(redis_url, redis_prefix, password) as name:
        yield name, password


async def test_a_user_a_password_and_a_database_from_the_url(
    redis_url: str, redis_prefix: str, acl_user: tuple[str, str],
) -> None:
    name, password = acl_user
    base = redis_url.split("//", 1)[1].split("/", 1)[0]
    client = RespClient(f"redis://{name}:{password}@{base}/3", timeout=2.0)
    try:
        assert await client.execute([(b"SET", f"{redis_prefix}db", "three")]) == [b"OK"]
        on_three = sync_redis.Redis.from_url(f"redis://{base}/3")
        try:
            assert on_three.get(f"{redis_prefix}db") == b"three"
            on_three.delete(f"{redis_prefix}db")
        finally:
            on_three.close()
    finally:
        client.close()
    wrong = RespClient(f"redis://{name}:not-{password}@{base}/0", timeout=2.0)
    with pytest.raises(AuthenticationError):
        await wrong.execute([(b"PING",)])
    assert wrong.connects == 0


async def test_who_it_logs_in_as_follows_redis_py(redis_url: str, redis_prefix: str) -> None:
    """A user with no password logs in as that user (AUTH user ""), not as default; an empty user and password
    send no AUTH at all."""
    base = redis_url.split("//", 1)[1].split("/", 1)[0]
    with acl(redis_url, redis_prefix, None) as name:
        for url, expected in ((f"redis://{name}@{base}/0", name), (f"redis://:@{base}/0", "default")):
            client = RespClient(url, timeout=2.0)
            try:
                assert await client.execute([(b"ACL", b"WHOAMI")]) == [expected.encode()], url
            finally:
                client.close()


async def test_a_closed_client_opens_nothing_more(redis_relay: Relay) -> None:  # noqa: F811
    client = RespClient(f"redis://127.0.0.1:{redis_relay.port}/0", timeout=2.0)
    assert await client.execute([]) == []  # nothing to send: no connection, no waiter
    connecting = asyncio.ensure_future(client.execute([(b"PING",)]))
    await asyncio.sleep(0)  # its connect is under way
    client.close()
    with pytest.raises(RedisConnectionError):
        await connecting  # the connection it opened is closed again, not kept
    assert client.connects == 0
    # The relay accepted that connection and saw it closed again.
    await wait_for(lambda: redis_relay.accepted == 1 and redis_relay.open_connections() == 0)
    tried = redis_relay.accepted
    with pytest.raises(RedisConnectionError):
        await client.execute([(b"PING",)])
    await asyncio.sleep(0.1)
    assert redis_relay.accepted == tried  # no new connection was even tried


async def test_a_host_that_cannot_be_a_name_is_a_connection_error() -> None:
    client = RespClient("redis://redis..internal:6379/0", timeout=2.0)
    with pytest.raises(RedisConnectionError):  # not a UnicodeError: the store's breaker catches Redis errors
        await client.execute([(b"PING",)])
