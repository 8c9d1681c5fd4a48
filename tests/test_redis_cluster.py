"""Redis Cluster (`storage.redis.cluster: true`) on a real local cluster: slots spread over masters, notifications
across nodes, and a master killed mid-run (the proxy keeps answering from PostgreSQL, nothing runs twice)."""

from __future__ import annotations

import asyncio
import logging
import random
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis as sync_redis
import uvloop

from idemproxy.config import cluster_nodes, load_config
from idemproxy.store import StoredResponse, build_store
from idemproxy.store.postgres import PostgresStore
from idemproxy.store.redis import CLUSTER_STEP_TIMEOUT, RedisFrontedStore, at_node
from tests.conftest import ProxyFactory
from tests.servers import NoTlsServer, RedisClusterServers, make_tls_files
from tests.upstream import RecordingUpstream

FP = "f" * 64
OK = StoredResponse(status=201, headers=(("Content-Type", "application/json"),), body=b'{"id": 1}')
CHARGE = {"amount": 1000, "currency": "eur"}


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000) as servers:
        yield servers


@pytest.fixture
def guarded_cluster() -> Iterator[RedisClusterServers]:
    """A cluster whose every node requires a password (AUTH), as production ones do."""
    with RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000, password="pw-of-the-cluster") as servers:
        yield servers


@pytest.fixture
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A cluster speaking TLS only, to clients and between nodes, with a password (skipped where no redis-server
    here is built with TLS)."""
    try:
        servers = RedisClusterServers(masters=3, replicas=0, password="pw-of-the-cluster",
                                      tls=make_tls_files(tmp_path_factory.mktemp("tls")))
    except NoTlsServer as exc:
        pytest.skip(str(exc))
    with servers:
        yield servers


def section(cluster: RedisClusterServers, pg_dsn: str, url: str = "") -> dict[str, Any]:
    return {"postgres": {"dsn": pg_dsn, "pool_min": 1, "pool_max": 10},
            "redis": {"url": url or cluster.url, "key_prefix": "cl:", "cluster": True}}


async def open_store(cluster: RedisClusterServers, pg_dsn: str, url: str = "") -> RedisFrontedStore:
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"}, "storage": section(cluster, pg_dsn, url)})
    store = build_store(config.storage)
    assert isinstance(store, RedisFrontedStore)
    await store.open()
    return store


async def hearing(*stores: RedisFrontedStore, within: float = 10) -> None:
    """Until every store's subscriber has heard its Redis (its notifications are live)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not all(store.notifications_live() for store in stores):
        assert loop.time() < deadline, "a subscriber never heard Redis"
        await asyncio.sleep(0.05)


@pytest.fixture
async def stores(cluster: RedisClusterServers, clean_pg: str) -> AsyncIterator[list[RedisFrontedStore]]:
    opened = [await open_store(cluster, clean_pg) for _ in range(2)]
    yield opened
    for store in opened:
        await store.close()


def keys_per_master(cluster: RedisClusterServers) -> dict[int, int]:
    return {port: int(sync_redis.Redis(port=port).dbsize()) for port in cluster.masters()}


async def test_records_spread_over_every_master_and_replay_from_the_cache(
    stores: list[RedisFrontedStore], cluster: RedisClusterServers
) -> None:
    store = stores[0]
    for i in range(30):
        claim = await store.claim("t", f"k{i}", FP, lease=30, ttl=60)
        assert claim.owned
        assert await store.complete(claim, OK, ttl=60)
    spread = keys_per_master(cluster)
    assert len(spread) == 3 and all(count > 0 for count in spread.values()), spread
    statements = store.durable.statements  # type: ignore[attr-defined]
    for i in range(30):
        replay = await store.claim("t", f"k{i}", FP, lease=30, ttl=60)
        assert not replay.owned and replay.record.response == OK
    assert store.durable.statements == statements  # type: ignore[attr-defined]  # every replay from Redis


async def test_a_completion_wakes_waiters_whichever_node_holds_its_slot(stores: list[RedisFrontedStore]) -> None:
    first, second = stores
    await asyncio.sleep(0.3)  # both subscribers listening
    for i in range(12):  # keys hashed over every master, the subscriber sits on one node
        claim = await first.claim("t", f"w{i}", FP, lease=30, ttl=60)
        with second.watch("t", f"w{i}") as changed:
            await first.complete(claim, OK, ttl=60)
            await asyncio.wait_for(changed, 2)


async def test_a_master_killed_mid_run_costs_speed_never_correctness(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, cluster: RedisClusterServers, clean_pg: str
) -> None:
    proxy = await make_proxy(storage_section=section(cluster, clean_pg))
    rng = random.Random(12)
    answers: dict[str, list[tuple[int, bytes]]] = {}

    async def client(n: int) -> None:
        for i in range(30):
            key = f"c{n}-{i}"
            for _attempt in range(2):  # a request and its retry
                resp, body = await proxy.post("/v1/charges", key=key, body=CHARGE)
                answers.setdefault(key, []).append((resp.status, body))
                await asyncio.sleep(rng.uniform(0, 0.02))

    async def kill_a_master() -> None:
        await asyncio.sleep(0.3)
        await asyncio.to_thread(cluster.kill, cluster.masters()[1])

    await asyncio.gather(*(client(n) for n in range(6)), kill_a_master())
    for key, got in answers.items():
        assert [status for status, _ in got] == [201, 201], (key, got)
        assert got[0][1] == got[1][1], key  # the retry is the replay of the one execution
        assert upstream.count(key=key) == 1, key
    await asyncio.to_thread(cluster.wait_ok)  # the replica took over: the fast path serves again
    resp, _ = await proxy.post("/v1/charges", key="after", body=CHARGE)
    replay, _ = await proxy.post("/v1/charges", key="after", body=CHARGE)
    assert resp.status == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert upstream.count(key="after") == 1


async def test_the_subscriber_leaves_a_lost_node_and_stops_at_once_on_close(
    stores: list[RedisFrontedStore], cluster: RedisClusterServers
) -> None:
    """redis-py's own reconnect attempts to a lost node (with backoff) kept the subscriber deaf to close()."""
    store = stores[0]
    await asyncio.sleep(0.3)
    listening = sorted(store.redis.get_nodes(), key=lambda node: node.name)[0]  # where attempt 0 subscribes
    await asyncio.to_thread(cluster.kill, listening.port)
    await asyncio.sleep(0.5)
    task = store._subscriber
    assert task is not None
    started = asyncio.get_running_loop().time()
    await store.close()
    assert task.done() and not task.cancelled()
    assert asyncio.get_running_loop().time() - started < 1.0


def clients_of(port: int) -> list[dict[str, str]]:
    """The connections a node has from clients: not from its master or replicas, not this look's own."""
    with sync_redis.Redis(port=port) as node:
        own = str(node.client_id())
        return [client for client in node.client_list()
                if not {"M", "S"} & set(client["flags"]) and client["id"] != own]


async def test_closing_after_a_node_was_lost_closes_every_connection(
    cluster: RedisClusterServers, clean_pg: str
) -> None:
    """redis-py's cluster client skips its own close while it owes a topology refresh, which it does from any
    connection error until its next command: a store closed after a master was lost, before the client had
    refreshed, left its connections to every other node open (the sockets outlived the store, and the process
    held them until it exited)."""
    store = await open_store(cluster, clean_pg)
    try:
        for i in range(12):  # keys on every master: a connection to each
            await store.claim("t", f"c{i}", FP, lease=30, ttl=60)
        masters = cluster.masters()
        assert all(clients_of(port) for port in masters)
        await asyncio.to_thread(cluster.kill, masters[1])
        for i in range(12, 24):  # some hash to the lost master: their calls fail, the store falls back
            await store.claim("t", f"c{i}", FP, lease=30, ttl=60)
    finally:
        await store.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while left := {port: clients_of(port) for port in cluster.procs if clients_of(port)}:
        assert loop.time() < deadline, left  # (a node drops a closed connection at its next loop turn)
        await asyncio.sleep(0.05)


def test_a_write_on_a_connection_closed_under_the_client_is_redis_failing(
    cluster: RedisClusterServers, pg_dsn: str
) -> None:
    """On uvloop (the proxy's loop, so this test runs on it) a write on a transport already closed raises
    RuntimeError ("unable to perform operation on <TCPTransport closed=True ...>; the handler is closed"), and
    redis-py's cluster client writes on connections its topology refresh is disconnecting: the cluster fault storm
    got a 500 from it, a claim in the handshake of such a connection. Each node's idle connections are closed
    here under the client, which still holds them as connected: the claims must be decided by PostgreSQL."""
    prefix = f"closed-{random.getrandbits(32):08x}"

    async def scenario() -> None:
        store = await open_store(cluster, pg_dsn)
        try:
            for i in range(12):  # keys on every master: an idle connection to each
                await store.claim("t", f"{prefix}-{i}", FP, lease=30, ttl=60)
            closed = 0
            for node in store.redis.get_nodes():
                for connection in node._free:
                    connection._writer.transport.abort()
                    closed += 1
            assert closed >= 3
            for i in range(12, 24):
                claim = await store.claim("t", f"{prefix}-{i}", FP, lease=30, ttl=60)
                assert claim.owned, i
        finally:
            await store.close()

    uvloop.run(scenario())


def test_a_release_sends_its_purge_again_after_a_connection_closed_under_the_client(
    cluster: RedisClusterServers, pg_dsn: str
) -> None:
    """An admin release purges Redis, and sends the purge once more when its connection was found dead (the
    script is idempotent). On a cluster a connection closed under the client by a topology refresh fails as
    RuntimeError (uvloop) rather than ConnectionError: the release answered 503 where the second send would have
    done it."""
    key = f"purge-{random.getrandbits(32):08x}"

    async def scenario() -> None:
        store = await open_store(cluster, pg_dsn)
        try:
            claim = await store.claim("t", key, FP, lease=30, ttl=60)
            assert await store.complete(claim, OK, ttl=60)
            copy = store._keys("t", key)[1]
            assert await store.redis.exists(copy) == 1
            node = store.redis.get_node_from_key(copy)
            node._free[0]._writer.transport.abort()  # the connection the purge takes first
            await store.clear_copies("t", key)
            assert await store.redis.exists(copy) == 0
        finally:
            await store.close()

    uvloop.run(scenario())


async def test_a_cluster_that_requires_a_password_carries_completions(
    guarded_cluster: RedisClusterServers, clean_pg: str
) -> None:
    """The subscriber's client to one node was built from the node's host and port alone, without the url's
    password: a cluster requiring AUTH refused it, so no completion was ever heard (a waiter woke only at its own
    next look, and no replay was answered from memory, which needs live notifications). Built from the url, it
    must leave out the cluster client's own options, which a plain client refuses as unknown arguments."""
    url = f"{guarded_cluster.url}?reinitialize_steps=5"  # an option of the cluster client's own, as well
    first, second = [await open_store(guarded_cluster, clean_pg, url) for _ in range(2)]
    try:
        await hearing(first, second)
        claim = await first.claim("t", "pw", FP, lease=30, ttl=60)
        with second.watch("t", "pw") as changed:
            await first.complete(claim, OK, ttl=60)
            await asyncio.wait_for(changed, 2)
    finally:
        await first.close()
        await second.close()


async def test_a_cluster_that_refuses_the_urls_password_is_said_at_start(
    guarded_cluster: RedisClusterServers, clean_pg: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong password: an error at start naming storage.redis.url (not the password) and the node that refused,
    a node of the url that is down passed over for the next; the store serves on PostgreSQL alone."""
    masters = guarded_cluster.masters()
    down = next(port for port in guarded_cluster.procs if port not in masters)
    guarded_cluster.kill(down)
    url = f"redis://:wrong-pw@127.0.0.1:{down},127.0.0.1:{masters[0]}/0"
    with caplog.at_level(logging.WARNING, "idemproxy.store.redis"):
        store = await open_store(guarded_cluster, clean_pg, url)
    try:
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(said) == 1 and "wrong-pw" not in caplog.text
        assert f"Redis at 127.0.0.1:{masters[0]} refused the credentials storage.redis.url gives" in said[0]
        claim = await store.claim("t", "pw", FP, lease=30, ttl=60)
        assert claim.owned  # PostgreSQL decided
    finally:
        await store.close()


async def test_the_store_learns_the_cluster_from_any_node_its_url_names(
    guarded_cluster: RedisClusterServers, clean_pg: str
) -> None:
    """With one node in the url and that node down, a store opened meanwhile ran on PostgreSQL alone until it
    came back, however whole the rest of the cluster was. A url may name several (as a PostgreSQL dsn may), each
    reached with the url's credentials: the first that answers is enough."""
    masters = guarded_cluster.masters()
    down = next(port for port in guarded_cluster.procs if port not in masters)  # a replica: no failover to wait for
    guarded_cluster.kill(down)
    url = f"redis://:{guarded_cluster.password}@127.0.0.1:{down},127.0.0.1:{masters[0]}/0"
    store = await open_store(guarded_cluster, clean_pg, url)
    try:
        for i in range(12):
            claim = await store.claim("t", f"any{i}", FP, lease=30, ttl=60)
            assert claim.owned
            assert await store.complete(claim, OK, ttl=60)
        statements = store.durable.statements  # type: ignore[attr-defined]
        for i in range(12):
            replay = await store.claim("t", f"any{i}", FP, lease=30, ttl=60)
            assert not replay.owned and replay.record.response == OK
        assert store.durable.statements == statements  # type: ignore[attr-defined]  # every replay from Redis
    finally:
        await store.close()


def test_a_url_naming_several_nodes_gives_each_its_credentials_and_tls() -> None:
    # (an IPv6 host first: Pythons patched for CVE-2024-11168, Debian's 3.11.2, refuse brackets after a name)
    url = "rediss://app:p%40ss@[2001:db8::1]:7000,c2:7001,c3/0?ssl_cert_reqs=none&read_from_replicas=yes"
    assert cluster_nodes(url) == ("rediss://app:p%40ss@[2001:db8::1]:7000/0?ssl_cert_reqs=none&read_from_replicas=yes",
                                  [("c2", 7001), ("c3", 6379)])
    assert cluster_nodes("redis://c1:7000/0") == ("redis://c1:7000/0", [])
    # the subscriber's client to one node: the url's credentials, TLS and connection options at that node's
    # address, without the cluster client's own options, which a plain client refuses
    assert at_node(url, "2001:db8::2", 7005) == "rediss://app:p%40ss@[2001:db8::2]:7005/0?ssl_cert_reqs=none"
    assert at_node("redis://c1:7000", "10.0.0.1", 7005) == "redis://10.0.0.1:7005"


async def test_a_stopped_cluster_costs_each_claim_one_bounded_step(
    cluster: RedisClusterServers, clean_pg: str
) -> None:
    """redis-py's cluster client retries a timed-out command after re-reading the slot map, and the re-reads of
    concurrent commands queue behind one another: with every node stopped (SIGSTOP), 12 concurrent claims took
    3 to 31 s, one every 2.5 s, where a Redis that does not answer is meant to cost one SOCKET_TIMEOUT-sized step
    before PostgreSQL decides. (Time counted against the lease, too: a forward then left with too little of it
    was cut short, its outcome unknown, and executed again once the lease ran out.)"""
    store = await open_store(cluster, clean_pg)
    stopped = list(cluster.procs)
    try:
        for i in range(6):  # the slot map known, connections open
            await store.claim("t", f"warm{i}", FP, lease=30, ttl=60)
        for port in stopped:
            cluster.signal(port, signal.SIGSTOP)
        loop = asyncio.get_running_loop()

        async def claim(i: int) -> float:
            started = loop.time()
            assert (await store.claim("t", f"stopped{i}", FP, lease=30, ttl=60)).owned  # PostgreSQL decided
            return loop.time() - started

        took = await asyncio.gather(*(claim(i) for i in range(12)))
        assert max(took) < 3 * CLUSTER_STEP_TIMEOUT, sorted(took)  # (one step each; slack for a loaded box)
    finally:
        for port in stopped:
            cluster.signal(port, signal.SIGCONT)
        await store.close()


async def test_a_cluster_over_tls_serves_every_master_and_carries_completions(
    tls_cluster: RedisClusterServers, clean_pg: str
) -> None:
    """`rediss://` on a cluster: the startup node, each master the cluster client learns of (redirected to by
    MOVED), and the subscriber's client to one node (built from the url: at_node) all verify the server with the
    authority the url names and authenticate with its password. Replays of keys spread over every master come from
    Redis alone, and a completion is heard by another replica."""
    first, second = [await open_store(tls_cluster, clean_pg) for _ in range(2)]
    try:
        await hearing(first, second)
        keys = [f"tls{i}" for i in range(12)]
        for key in keys:
            claim = await first.claim("t", key, FP, lease=30, ttl=60)
            assert claim.owned and claim.cache_lock
            with second.watch("t", key) as changed:
                assert await first.complete(claim, OK, ttl=60)
                await asyncio.wait_for(changed, 5)
        assert isinstance(second.durable, PostgresStore)
        statements = second.durable.statements
        for key in keys:
            replay = await second.claim("t", key, FP, lease=30, ttl=60)
            assert not replay.owned and replay.record.response == OK
        assert second.durable.statements == statements  # every replay from Redis
        masters = set(tls_cluster.masters())
        holding = {port for port in masters
                   if int(tls_cluster.info(port, "DBSIZE").strip() or 0) > 0}
        assert holding == masters  # the keys spread over every master, each reached over TLS
    finally:
        await first.close()
        await second.close()
