"""Redis: the fast path in front of a durable store, never the only guard.

Redis holds, per (tenant, key): a lock (``token fingerprint``, expiring with the lease) and, once completed, a
copy of the stored response (for ``replay_cache_ttl``). A replay is then one Redis round trip and no SQL; a
duplicate of an in-flight request is refused by Redis alone. Who may *forward* is still decided by the durable
store's claim: the Redis lock only keeps most duplicates away from it.

When Redis errors, the store behaves as if Redis said "unknown" and asks the durable store directly; a
circuit breaker then skips Redis for a short while so an outage costs one failed attempt, not one per request.
All keys of one (tenant, key) share a hash tag so Redis Cluster keeps them in one slot.

With ``cluster: true`` the client is redis-py's cluster client: it learns the slot map from the node the url
names (from the first that answers, when the url names several: ``redis://h1:6379,h2:6379/0``), follows MOVED/ASK,
and re-reads the map after a failover. Every script touches the keys of one (tenant,
key) only, so each runs on the one master of that slot. Notifications stay classic PUBLISH (from inside the
scripts): Redis Cluster broadcasts a classic PUBLISH to every node, so the subscriber listens on any one node and
moves to the next when that node is lost. Sharded pub/sub (SPUBLISH) would spare that broadcast, but a script may
only SPUBLISH to a channel in its own slot: one channel per slot, and a subscriber per master.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
import os
import re
import ssl
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from idemproxy.config import REDIS_PORT, RedisConfig, cluster_nodes
from idemproxy.metrics import Metrics
from idemproxy.problems import StoreUnavailable
from idemproxy.store.base import (
    Claim,
    Health,
    Record,
    State,
    Store,
    StoredResponse,
    new_token,
    quick_init,
    step_bounds,
)
from idemproxy.store.batch import Batcher, follow_up
from idemproxy.store.codec import MAGIC, PLAIN, Codec, json_encoder, record_hash
from idemproxy.store.resp import RespClient, supports

log = logging.getLogger("idemproxy.store.redis")

SOCKET_TIMEOUT = 0.5  # seconds: Redis is the fast path; slower than this, PostgreSQL answers instead
# A script call on a cluster, all of it: redis-py's cluster client retries a timed-out command after re-reading
# the slot map, and its re-reads queue behind one another. With the nodes of a slot stopped, a claim took 2.6 s
# (one master) and 12 concurrent claims 3 to 31 s, 2.5 s apart (every node), where the fast path is meant to give
# way to PostgreSQL after SOCKET_TIMEOUT. Room for a redirect and its refresh on live nodes.
CLUSTER_STEP_TIMEOUT = 2 * SOCKET_TIMEOUT
DURABLE_PROBE_TIMEOUT = 1.5  # a health check's wait for PostgreSQL: inside the app's bound for the whole check
POOL_SIZE = 256  # connections to Redis; past it a request waits up to SOCKET_TIMEOUT for one
# The Redis lock only keeps duplicates away from PostgreSQL; it lives at most this long, so a lock whose removal
# failed (Redis errored at that moment, and the background drop could not reach it either) answers 409 for
# seconds, not for a whole lease. Past it, duplicates of a long request ask PostgreSQL, which still decides.
LOCK_MAX = 10.0
# A lock younger than this may be one a claim took a moment ago and is still waiting on PostgreSQL for: for a key
# whose Redis copy has expired (after replay_cache_ttl, or a Redis restart) PostgreSQL then says "completed", and
# its duplicates answered 409 from that lock meanwhile. So a duplicate meeting a lock this young asks PostgreSQL
# (a double submit pays a statement); an older lock answers 409 alone (its claim was decided, unless PostgreSQL
# took longer than this to answer it: then a duplicate may still get 409 for a completed key, and its retry the
# replay).
YOUNG_LOCK = 0.25
BREAKER_COOLDOWN = 1.0  # seconds Redis is skipped after a failure
# Locks a settle could not drop (Redis failed, or was skipped, just then) are dropped again in the background,
# every STALE_LOCK_RETRY seconds until Redis answers or LOCK_MAX has passed (the lock has expired by then): a lock
# left behind answers 409 for a key PostgreSQL holds completed. At most STALE_LOCKS_MAX are remembered.
STALE_LOCK_RETRY = 0.5
STALE_LOCKS_MAX = 10_000
CLOSE_TIMEOUT = 2.0  # seconds any one shutdown step may take
CLOSE_FLOOR = 0.1  # seconds the subscriber's wake-up may take however little is left of a bounded close
# An epoch must outlive the window between a writer's read of it and its write (a claim and its completion);
# one that expires sooner only costs that write (refused), never correctness.
EPOCH_MIN_TTL = 600.0
SUBSCRIBER_READ_TIMEOUT = 1.0  # how often the subscriber looks up from its socket to see if it should stop
SUBSCRIBER_LIVE_WINDOW = 2.5  # seconds without a message or pong after which notifications count as lost
PIPELINE_MAX = 256  # script calls in one pipeline
PIPELINES_IN_FLIGHT = 2  # pipelines on the wire at once; calls made meanwhile go in the next one

# Per (tenant, key) Redis holds a lock, a replay-cache entry and an epoch. The epoch is a random value an admin
# release (forget) renews: a cache write carries the epoch its writer read *before* it read the durable store,
# and lands only if the epoch is unchanged, so no completion or refill that raced a release can bring a released
# record back into the cache.
#
# An epoch that is missing (never set, evicted, lost in a restart) is created anew by the next claim, never
# read as "unchanged": a writer that read one and finds none (or another) does not write.
#
# GET, for the scripts below: a key of another type under one of our names (never one we wrote: ours are strings)
# made GET, so the whole script, fail; Redis counted as failed, the breaker opened for every key, at each claim of
# that key. Such a key is dropped and read as absent: the durable store still decides (PostgreSQL's claim), and a
# lock or epoch dropped so only ever refuses (a duplicate asks PostgreSQL; a write fenced by the epoch does not land).
_READ = """
local function read(key)
  local value = redis.pcall('GET', key)
  if type(value) == 'table' and value.err then redis.call('DEL', key); return false end
  return value
end
"""
# KEYS: lock, response, epoch. ARGV: "token fingerprint lease-end-ms", lock ttl ms, a fresh epoch, epoch ttl ms.
# Returns {"completed", payload, pttl} | {"in_flight", lock value, pttl, epoch} | {"acquired", epoch}.
# ARGV[5], only when given: a copy that did not decode; dropped first if it is still the one cached (see
# ``_fast_claim``).
# Idempotent: a client may send it again after a connection broke with the reply in flight (redis-py's cluster
# client does so across a failover), and the lock it finds is then its own (the token is unique to this claim):
# acquired, never a 409 against itself.
_CLAIM = _READ + """
local cached = read(KEYS[2])
if cached and cached == ARGV[5] then redis.call('DEL', KEYS[2]); cached = false end
if cached then return {'completed', cached, redis.call('PTTL', KEYS[2])} end
local epoch = read(KEYS[3])
if not epoch then epoch = ARGV[3]; redis.call('SET', KEYS[3], epoch, 'PX', ARGV[4]) end
local lock = read(KEYS[1])
if lock == ARGV[1] then return {'acquired', epoch} end
if lock then return {'in_flight', lock, redis.call('PTTL', KEYS[1]), epoch} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {'acquired', epoch}
"""
# KEYS: lock, response, epoch. ARGV: token, payload ('' = do not cache), cache ttl ms, channel, message,
# epoch seen, publish ('1'/'0').
# Caches the payload only if the epoch is still the one seen; drops the lock if it is still ours; wakes waiters
# everywhere only when something changed.
# The lock goes first. Out of memory (maxmemory, noeviction), Redis refuses a script's first write that could grow
# memory (the copy's SET, when it came first: the script ended there, the lock left standing, a completed key
# answering 409 until the lock expired); a DEL is allowed, and a script that has written goes on past the limit,
# so the copy is written too.
_SETTLE = _READ + """
local lock = read(KEYS[1])
if lock and string.sub(lock, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then redis.call('DEL', KEYS[1]) end
if ARGV[2] ~= '' and read(KEYS[3]) == ARGV[6] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
end
if ARGV[7] == '1' then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
return 1
"""
# KEYS: lock, response, epoch. ARGV: channel, message, new epoch, epoch ttl ms.
_FORGET = """
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"""
UNKNOWN_EPOCH = "?"  # never equals a stored epoch: a writer that never read one may not fill the cache

# RedisClusterException (no node reachable to learn the slot map from) is no RedisError.
_ERRORS = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)
# Also a Redis failure: a value that does not decode (another version's format, a key-prefix collision).
_FAST_ERRORS = (*_ERRORS, ValueError, KeyError, IndexError, TypeError)
# redis-py's async cluster client can fail with AttributeError/TypeError while a lost node's connections are torn
# down under commands still using them, or while its slot map is briefly inconsistent (redis/redis-py#3546,
# #3835; seen here as "'NoneType' object has no attribute 'writelines'" when a master is killed), and with
# uvloop's RuntimeError when it writes on a connection closed meanwhile ("unable to perform operation on
# <TCPTransport closed=True ...>; the handler is closed": found by the cluster fault storm, a claim in the
# handshake of a connection a topology refresh was disconnecting). On a cluster these count as Redis failing
# too: the durable store answers instead of the request getting a 500.
_CLUSTER_TEARDOWN = (AttributeError, TypeError, RuntimeError)
_CLUSTER_ERRORS = (*_FAST_ERRORS, *_CLUSTER_TEARDOWN)
# A connection found dead as a command was sent on it: worth sending the command once more on a fresh one (an
# admin release's purge). On a cluster, the teardown errors above are that too.
_DEAD_CONNECTION = (RedisConnectionError,)
_CLUSTER_DEAD_CONNECTION = (*_DEAD_CONNECTION, *_CLUSTER_TEARDOWN)
# A replay-cache copy that does not decode (another version's format, a key-prefix collision, bytes changed in
# Redis): Redis answered, so it is no Redis failure (no breaker); the copy is dropped and the durable store answers.
_GARBLED = (ValueError, KeyError, IndexError, TypeError, RecursionError)
_NUMBER = (int, float)
# Characters aiohttp refuses in a header it sends (a replay would fail as it is written, after the handler ended).
_FORBIDDEN = re.compile(r"[\r\n\x00]")


# The cluster client's own options (read_from_replicas, require_full_coverage, ...): a plain client to one node,
# the subscriber's, refuses them ("unexpected keyword argument"), so they are left out of the url it is built from.
_CLUSTER_OPTIONS = frozenset(inspect.signature(RedisCluster.__init__).parameters).difference(
    *(inspect.signature(init).parameters for init in (
        aioredis.connection.AbstractConnection.__init__, aioredis.Connection.__init__,
        aioredis.SSLConnection.__init__, aioredis.ConnectionPool.__init__)))


START_CHECK_TIMEOUT = 2.0  # seconds for the PING at start, every node the url names included (cluster_nodes)


# The url's options that name files redis-py reads to connect (TLS): one that cannot be read fails every connection.
_URL_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")


def _unreadable_files(url: str) -> list[str]:
    """The files (or, for ssl_ca_path, the directory) ``url``'s options name that this process cannot read."""
    named = [(option, value) for option, value in parse_qsl(urlsplit(url).query) if option in _URL_FILES]
    return [f"{option}={value}" for option, value in named
            if not (os.path.isdir(value) if option == "ssl_ca_path" else os.path.isfile(value))
            or not os.access(value, os.R_OK)]


def _refused(exc: BaseException) -> str | None:
    """What a Redis that answered said against the url, when a PING failed so (None: not reached, or not that):
    credentials refused, a certificate that does not verify, a database number out of range, or a user its ACL
    does not let PING. Each may be the server's doing (a password rotated there first, a certificate expired or
    not yet valid, an ACL changed), so it is said loudly, and the proxy serves on."""
    seen: BaseException | None = exc
    for _ in range(8):  # (redis-py wraps the OS's error once or twice)
        if seen is None:
            return None
        if isinstance(seen, AuthenticationError):
            return "refused the credentials storage.redis.url gives"
        if isinstance(seen, ssl.SSLCertVerificationError):
            return f"presented a certificate that does not verify ({seen.verify_message})"
        # (only these: BUSY, MASTERDOWN and such are a server's passing state, said as "not reachable")
        if isinstance(seen, NoPermissionError) or (type(seen) is ResponseError and "DB index" in str(seen)):
            return "refused what storage.redis.url asks"
        seen = seen.__cause__ or seen.__context__
    return None


# Whether the user may run what the store's scripts run, on a key of its prefix and on its channel: asked of Redis's
# ACL from inside a script (redis.acl_check_cmd, Redis 7), so nothing is run. KEYS: a key. ARGV: the channel.
_ACL_PROBE = """
local denied = {}
local calls = {{'SET', KEYS[1], 'x'}, {'GET', KEYS[1]}, {'DEL', KEYS[1]}, {'PTTL', KEYS[1]}, {'PUBLISH', ARGV[1], ''}}
for _, call in ipairs(calls) do
    if not redis.acl_check_cmd(unpack(call)) then
        denied[#denied + 1] = call[1]
    end
end
return denied
"""


async def _denied(client: Any, key: str, channel: str, denied: list[str]) -> None:
    """Add to ``denied`` the commands the store runs that ``client``'s user may not run (its ACL), each tried so it
    changes nothing: SCRIPT LOAD of a script that asks the ACL about the commands the store's scripts run (cached,
    as the store's own are), EVALSHA of it on a key of the store's prefix (of no script, if it could not be
    loaded: NOSCRIPT when permitted), a PUBLISH of an empty message on the store's channel (which subscribers
    ignore: ``_subscribe``), and a SUBSCRIBE to it, left at once. An answer other than a refusal (a cluster node's
    MOVED for a key it does not hold, a Redis older than 7 without acl_check_cmd) says nothing."""

    async def script() -> None:
        try:
            sha = await client.script_load(_ACL_PROBE)
        except NoPermissionError:
            denied.append("SCRIPT LOAD")
            sha = "0" * 40
        inside = await _permitted(client.evalsha(sha, 1, key, channel), "EVALSHA", denied)
        if isinstance(inside, list):
            denied.extend(f"{name.decode() if isinstance(name, bytes) else name} (in its scripts)" for name in inside)

    async def subscribe() -> None:
        listening = client.pubsub()
        try:
            await listening.subscribe(channel)
            await listening.get_message(timeout=SOCKET_TIMEOUT)  # (a refusal is raised reading the reply)
        finally:
            await listening.aclose()

    await _permitted(script(), None, denied)
    await _permitted(client.publish(channel, ""), "PUBLISH", denied)
    await _permitted(subscribe(), "SUBSCRIBE", denied)


async def _permitted(call: Awaitable[Any], name: str | None, denied: list[str]) -> Any:
    """``call``'s answer; None, and ``name`` added to ``denied`` when the ACL refused it, or when it failed."""
    try:
        return await call
    except NoPermissionError:
        if name is not None:
            denied.append(name)
    except RedisError:
        pass
    return None


def _node_of(url: str) -> str:
    """``Redis at host:port`` (or at its socket's path), never the credentials, for messages."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"Redis at {parts.path}"
    return f"Redis at {parts.hostname or 'localhost'}:{parts.port or REDIS_PORT}"


def at_node(url: str, host: str, port: int) -> str:
    """``url`` (its credentials, TLS and connection options) at one node of the cluster instead of the hosts it
    names, without the cluster client's own options."""
    parts = urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    name = f"[{host}]" if ":" in host else host
    query = urlencode([(option, value) for option, value in parse_qsl(parts.query, keep_blank_values=True)
                       if option not in _CLUSTER_OPTIONS])
    return parts._replace(netloc=f"{userinfo}{at}{name}:{port}", query=query).geturl()


# The record header's JSON, by an encoder built once (json.dumps builds one per call).
_compact_json = json_encoder(",", ":")

_ScriptCall = tuple[Any, list[str], list[Any]]  # a registered script, its keys, its arguments


@quick_init
@dataclass(frozen=True)
class _Fast:
    kind: str  # completed | in_flight | acquired; or, to ask the durable store: foreign (a lock with another
    # fingerprint), young (a lock whose claim may not be decided yet), unknown (the script was sent and Redis
    # failed: it may have run, and the lock be ours), garbled (a copy that did not decode, twice: nothing locked)
    record: Record | None = None
    epoch: str = UNKNOWN_EPOCH
    now: float | None = None  # with a record: now, on the clock its times were written by


class _FastStep:
    """One Redis step (``RedisFrontedStore._fast``): skipped while the breaker is open; its errors swallowed
    (noted, breaker opened); its duration observed when Redis was used."""

    __slots__ = ("_operation", "_started", "_store", "tried", "usable")

    def __init__(self, store: RedisFrontedStore, operation: str) -> None:
        self._store = store
        self._operation = operation
        self.usable = self.tried = time.monotonic() >= store._down_until  # tried: not skipped (it may have failed)
        self._started = 0.0

    def __enter__(self) -> _FastStep:
        self._started = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object) -> bool:
        if not self.usable:  # skipped: nothing ran, nothing to note (an error here is not Redis's)
            return False
        store = self._store
        if isinstance(exc, store._fast_errors):  # noted, breaker opened; the caller goes on without Redis
            self.usable = False
            store._fast_failed(self._operation, exc)
            return True
        if exc is None and store._degraded:
            log.warning("redis answers again; fast path restored")
            store._degraded = False
        if store.metrics is not None:
            store.metrics.store_children("redis", self._operation).duration(time.perf_counter() - self._started)
        return False


def _only(replies: list[Any]) -> Any:
    """The one reply of a one-command batch; an error reply raised."""
    [reply] = replies
    if isinstance(reply, Exception):
        raise reply
    return reply


def _encode(record: Record, codec: Codec = PLAIN) -> bytes:
    """A completed record as ``<json header>\n<body bytes>`` (no base64 on the hot path); with compression or
    encryption on, the header leaves out the headers (``h``) and the body part is the codec's frame of both."""
    assert record.response is not None
    response = record.response
    head = {
        "f": record.fingerprint,
        "s": response.status,
        "b": response.body is not None,
        "c": record.created_at,
        "d": record.completed_at,
        "e": record.expires_at,
    }
    if not codec.framing:
        head["h"] = response.headers
        tail = response.body or b""
    else:
        tail = codec.pack(record.tenant, record.key, response.headers, response.body or b"",
                          (response.status, response.body is not None, record.fingerprint))
    return _compact_json(head).encode() + b"\n" + tail


def _decode(tenant: str, key: str, payload: bytes, codec: Codec = PLAIN) -> Record:
    """The record a copy holds; ValueError (or another of ``_GARBLED``) when it is not one this version wrote
    whole: a copy is replayed as it stands, so a status or header that could not be sent, or a time that is no
    number, must not pass for one. (Any three-digit status can be sent, and is stored: aiohttp reads an upstream's
    100-999 and writes them back, so 600-999 are records like any other.)"""
    raw_head, _, body = payload.partition(b"\n")
    head = json.loads(raw_head)
    fingerprint, status, kept = head["f"], head["s"], head["b"]
    created, completed, expires = head["c"], head["d"], head["e"]
    if (type(fingerprint) is not str or type(status) is not int or not 100 <= status <= 999
            or type(kept) is not bool or type(created) not in _NUMBER or type(expires) not in _NUMBER
            or (completed is not None and type(completed) not in _NUMBER)):
        raise ValueError("not a record's head")
    if "h" in head:  # written in clear (by this version with both off, or before them)
        pairs = head["h"]
        headers = tuple([(k, v) for k, v in pairs if type(k) is str and type(v) is str])
        if len(headers) != len(pairs) or (
                b"\\" in raw_head and any(_FORBIDDEN.search(k + v) for k, v in headers)):  # (escaped only)
            raise ValueError("headers not readable")
        body = codec.plain_body(tenant, key, body, backend=RedisFrontedStore.backend)
    elif not body.startswith(MAGIC):  # neither in clear nor a frame: no value that does not open, but no value
        raise ValueError("neither headers nor a frame")
    else:
        headers, body = codec.unpack(tenant, key, body, backend=RedisFrontedStore.backend,
                                     outcome=(status, kept, fingerprint))
    response = StoredResponse(status=status, headers=headers, body=body if kept else None)
    return Record(
        tenant=tenant, key=key, fingerprint=fingerprint, state=State.COMPLETED, lease_token=None,
        lease_expires_at=None, response=response, created_at=created, completed_at=completed,
        expires_at=expires,
    )


def _lock(reply: list[Any]) -> tuple[str, int | None] | None:
    """(fingerprint, lease end in ms or None) of the lock an ``in_flight`` claim reply names; None for a lock this
    proxy never writes: not ``token fingerprint [lease-end-ms]`` in text, or without an expiry (every lock is set
    with one, at most LOCK_MAX). Such a lock (another program's key under the prefix, bytes changed in Redis)
    would fail the Redis step at each claim of its key, opening the breaker for every key, or, without an expiry,
    answer 409 for that key for ever, from Redis alone; the durable store decides instead."""
    try:
        _, fingerprint, *deadline = reply[1].decode().split(" ")
        end = int(deadline[0]) if deadline else None
        left = int(reply[2])
    except (ValueError, IndexError, AttributeError):  # (a UnicodeDecodeError is a ValueError)
        return None
    return (fingerprint, end) if left >= 0 else None


def _epoch(raw: bytes) -> str:
    """An epoch as read. One that is not text was not written here: unknown, so nothing fenced by it is written
    (its key goes without a replay-cache copy until it expires), and Redis is not taken for failed."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return UNKNOWN_EPOCH


class RedisFrontedStore(Store):
    """A durable store with Redis in front: lock, replay cache and completion notifications."""

    backend = "redis"

    def __init__(
        self, durable: Store, config: RedisConfig, metrics: Metrics | None = None, *, codec: Codec | None = None
    ) -> None:
        super().__init__(metrics)
        self.durable = durable
        self.claim_settled_within = durable.claim_settled_within  # (the durable store's)
        self.codec = codec or Codec()
        self.watchers = durable.watchers  # one set of waiters, woken by either notification path
        self.config = config
        self.channel = f"{config.key_prefix}changed"
        if config.cluster:
            first, others = cluster_nodes(config.url.reveal())
            self.redis: Any = RedisCluster.from_url(
                first, startup_nodes=[ClusterNode(host, port) for host, port in others],
                socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT, decode_responses=False,
            )
        else:
            # A pool that waits (briefly) for a free connection: redis-py's default one fails at once past 100,
            # and a failed unlock leaves a lock behind.
            pool = aioredis.BlockingConnectionPool.from_url(
                config.url.reveal(), max_connections=POOL_SIZE, timeout=SOCKET_TIMEOUT,
                socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT, decode_responses=False,
            )
            self.redis = aioredis.Redis.from_pool(pool)  # closes the pool with the client
        # Registered once; each call is one EVALSHA (EVAL only after a Redis restart lost the script).
        self._errors = _CLUSTER_ERRORS if config.cluster else _ERRORS
        self._fast_errors = _CLUSTER_ERRORS if config.cluster else _FAST_ERRORS
        self._dead_connection = _CLUSTER_DEAD_CONNECTION if config.cluster else _DEAD_CONNECTION
        self._claim_script = self.redis.register_script(_CLAIM)
        self._settle_script = self.redis.register_script(_SETTLE)
        self._forget_script = self.redis.register_script(_FORGET)
        # Claims and settles of concurrent requests leave in one pipeline per loop turn (store/batch.py): one
        # connection checkout, one write and one read for all of them. The cluster client spreads keys over
        # nodes: there each call goes alone.
        self._pipelines: Batcher[_ScriptCall, Any] | None = None if config.cluster else Batcher(
            self._pipeline, max_batch=PIPELINE_MAX, max_in_flight=PIPELINES_IN_FLIGHT, abandoned=self._unlock)
        # Those pipelines, releases' purges and health pings go over a connection of our own (store/resp.py: a
        # third of redis-py's CPU per round trip) unless the url asks for what only redis-py does (TLS, options
        # such as socket_keepalive); redis-py keeps the subscriber.
        self._lean = RespClient(config.url.reveal(), SOCKET_TIMEOUT) if (
            not config.cluster and supports(config.url.reveal())) else None
        self._unlocking: set[asyncio.Task[Any]] = set()
        # (tenant, key, token) -> (when to give up (monotonic), publish): locks failed settles left behind.
        self._stale_locks: dict[tuple[str, str, str], tuple[float, bool]] = {}
        self._unlocker: asyncio.Task[None] | None = None
        self._down_until = 0.0
        self._degraded = False
        self._heard = float("-inf")  # when the subscriber last heard from Redis (monotonic)
        self._epoch_ms = int(max(config.replay_cache_ttl, EPOCH_MIN_TTL) * 1000)
        self._subscriber: asyncio.Task[None] | None = None
        self._listening: Any = None  # the client whose connection the subscriber reads (a plain one, per node)
        self._closing = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        await self.durable.open()
        try:
            await self._ask_at_start()
        except BaseException:
            await self.durable.close()
            raise
        self._subscriber = asyncio.create_task(self._subscribe(), name="idemproxy-redis-subscriber")

    async def _ask_at_start(self) -> None:
        """Check the url before serving. A file its options name (ssl_ca_certs, ssl_certfile, ssl_keyfile,
        ssl_ca_path) that this process cannot read fails every connection, and no wait mends it: refused at start,
        naming storage.redis.url, as a PostgreSQL dsn's is. Then one PING with the url's credentials and TLS, at each
        node the url names until one answers (2 s in all), and at the one that answers, whether its ACL lets the
        url's user run the commands the store needs (``_denied``). A Redis that answers and refuses the
        credentials, the url's database number or those commands, or a certificate that does not verify, is said at
        once as an error naming storage.redis.url, where it used to show only as a warning at the first claim (or,
        for the commands, as Redis going away with each claim); the proxy still serves, PostgreSQL alone deciding,
        as for a Redis not reached: each can be the server's doing (a password rotated there first, a certificate
        expired, an ACL changed, a network policy), and losing Redis costs latency, never service."""
        url = self.config.url.reveal()
        unreadable = _unreadable_files(url)
        if unreadable:
            raise StoreUnavailable(f"storage.redis.url names a file this process cannot read: {', '.join(unreadable)} "
                                   "(check storage.redis.url)", maybe_applied=False)
        urls = [url]
        if self.config.cluster:  # (a plain client to each node: the cluster client's own options left out)
            first, others = cluster_nodes(url)
            head = urlsplit(first)
            urls = [at_node(url, host, port) for host, port in [(head.hostname or "localhost", head.port or REDIS_PORT),
                                                                   *others]]
        failures: list[tuple[str, BaseException]] = []
        answered = await self._answering(urls, failures)
        if answered is not None:
            node, client = answered
            denied: list[str] = []
            try:  # (the probes' own bound: a Redis that answered a PING is never "not reachable")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(START_CHECK_TIMEOUT):
                        await _denied(client, self._keys("", "")[0], self.channel, denied)
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose()
            if denied:
                log.error("%s: the user storage.redis.url gives may not run %s (its ACL; check storage.redis.url); "
                          "the fast path, or its notifications, fail until it may", _node_of(node), ", ".join(denied))
            return
        for node, failure in failures:
            said = _refused(failure)
            if said is not None:
                log.error("%s %s: %s (%s; check storage.redis.url); serving from %s alone until it answers",
                          _node_of(node), said, failure, type(failure).__name__, self.durable.backend)
                return
        node, failure = failures[0] if failures else (urls[0], TimeoutError())
        log.warning("%s is not reachable at start (%s); serving from %s alone until it answers",
                    _node_of(node), type(failure).__name__, self.durable.backend)

    @staticmethod
    async def _answering(urls: list[str], failures: list[tuple[str, BaseException]]) -> tuple[str, Any] | None:
        """The first node of ``urls`` that answers a PING, with its client (the caller closes it), within
        START_CHECK_TIMEOUT in all; each that did not, with why, in ``failures``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(START_CHECK_TIMEOUT):
                for node in urls:
                    client = aioredis.Redis.from_url(node, socket_timeout=SOCKET_TIMEOUT,
                                                     socket_connect_timeout=SOCKET_TIMEOUT, retry=Retry(NoBackoff(), 0))
                    answered = False
                    try:
                        await client.ping()
                        answered = True
                        return node, client
                    except Exception as exc:
                        failures.append((node, exc))
                    finally:
                        if not answered:
                            with contextlib.suppress(Exception):
                                await client.aclose()
        return None

    async def close(self, timeout: float | None = None) -> None:
        self._closing.set()
        within = step_bounds(timeout)
        if self._unlocker is not None:
            self._unlocker.cancel()  # what it has not dropped expires by itself within LOCK_MAX
        if self._unlocking:
            await asyncio.wait(set(self._unlocking), timeout=within(CLOSE_TIMEOUT))
        if self._pipelines is not None:
            await self._pipelines.close(within(CLOSE_TIMEOUT))
        if self._lean is not None:
            self._lean.close()
        if self._subscriber is not None:
            # Wake it now rather than at its next read timeout, through the client it listens with. On a cluster
            # that is a plain client to one node: a publish through the cluster client can stall in a topology
            # refresh, and a refresh cut short by the timeout leaves sockets of redis-py's temporary nodes open.
            # No listening client: the subscriber is backing off, and wakes at once on the flag.
            wake = self._listening
            if wake is not None:
                with contextlib.suppress(*self._errors):
                    await asyncio.wait_for(wake.publish(self.channel, b""), max(within(CLOSE_TIMEOUT), CLOSE_FLOOR))
            # The subscriber notices the flag within one read timeout and ends by itself: redis-py's pub/sub
            # read can swallow a cancellation, and a task that outlives its loop hangs the process's exit.
            # (Not cut below one read timeout: a cancelled subscriber may not end, and would hang the exit.)
            ends = max(within(SUBSCRIBER_READ_TIMEOUT + CLOSE_TIMEOUT), SUBSCRIBER_READ_TIMEOUT * 1.5)
            await asyncio.wait({self._subscriber}, timeout=ends)
            if not self._subscriber.done():
                log.warning("redis subscriber did not stop in time; cancelling it")
                self._subscriber.cancel()
            if wake is not None and wake is not self.redis:
                # The publish took a connection of its own from the subscriber's client, and could hand it back
                # after the subscriber, woken, had closed that client: it stayed open until the collector found
                # it. Closed again now that both are done.
                with contextlib.suppress(*self._errors):
                    await asyncio.wait_for(wake.aclose(), max(within(CLOSE_TIMEOUT), CLOSE_FLOOR))
        with contextlib.suppress(*self._errors):
            await asyncio.wait_for(self._close_client(), within(CLOSE_TIMEOUT))
        await self.durable.close(None if timeout is None else within(timeout))

    async def _close_client(self) -> None:
        try:
            await self.redis.aclose()
        finally:
            if self.config.cluster:
                # redis-py's cluster client closes nothing while it owes a topology refresh, as it does from any
                # connection error until its next command (a node lost, no call since): its connections to every
                # node stayed open. Close its nodes here, each whatever another's close raised (twice is harmless).
                manager = self.redis.nodes_manager
                nodes = {id(node): node for node in (*manager.nodes_cache.values(), *manager.startup_nodes.values())}
                await asyncio.gather(*(node.disconnect() for node in nodes.values()), return_exceptions=True)

    async def _pubsub(self, attempt: int) -> tuple[Any, Any]:
        """(client to close, pubsub) on a client of the subscriber's own, with no retries: redis-py would
        otherwise reconnect a lost subscription by itself (with backoff: seconds) and subscribe again without a
        word, hiding the gap in which announcements were missed. Failing at once lets the subscriber count as deaf
        from the first error and empty the cache when it is back. On a cluster, a plain connection to one node,
        the next one at each attempt (a classic PUBLISH reaches every node)."""
        options: dict[str, Any] = {"socket_timeout": SOCKET_TIMEOUT, "socket_connect_timeout": SOCKET_TIMEOUT,
                                   "retry": Retry(NoBackoff(), 0)}
        if not self.config.cluster:
            client = aioredis.Redis.from_url(self.config.url.reveal(), **options)
            return client, client.pubsub(ignore_subscribe_messages=True)
        await self.redis.initialize()
        nodes = sorted(self.redis.get_nodes(), key=lambda node: node.name)
        node = nodes[attempt % len(nodes)]
        # The url's credentials and TLS, at that node (a client built from host and port alone was refused by a
        # cluster requiring a password: its subscriber never subscribed, so no completion was ever heard)
        client = aioredis.Redis.from_url(at_node(self.config.url.reveal(), node.host, node.port), **options)
        return client, client.pubsub(ignore_subscribe_messages=True)

    async def _subscribe(self) -> None:
        """Deliver completion messages to local waiters; reconnect after Redis comes back; stop on close."""
        attempt = 0
        while not self._closing.is_set():
            client, pubsub = None, None
            try:
                client, pubsub = await self._pubsub(attempt)
                # (woken on close through a client that outlives it: on a cluster the node's own, since a publish
                # through the cluster client can stall; otherwise the store's, closed after the subscriber ends)
                self._listening = client if self.config.cluster else self.redis
                await pubsub.subscribe(self.channel)
                await pubsub.ping()  # its pong proves the subscription is in place
                resumed = False
                while not self._closing.is_set():
                    message = await pubsub.get_message(timeout=SUBSCRIBER_READ_TIMEOUT)
                    if message is None:  # quiet: ask for a sign of life, or a silent cut would look live
                        await pubsub.ping()
                        continue
                    heard, last = time.monotonic(), self._heard
                    self._heard = heard
                    # Messages sent while we were not subscribed were missed; so were any in a silence long
                    # enough to count as deaf (a gap no error told of).
                    if not resumed or heard - last >= SUBSCRIBER_LIVE_WINDOW:
                        resumed = True
                        self.watchers.notify_all()
                    if message.get("type") == "message" and message["data"]:
                        # (not strict: a message that is not UTF-8 is no one's of ours, and a strict decode raised
                        # past the handler below, ending the subscriber for good)
                        self.watchers.notify_message(message["data"].decode("utf-8", "surrogateescape"))
            except self._errors:
                # Deaf from the first error until the next subscription hears Redis (not only after the back-off
                # below): a release announced meanwhile is missed, so copies of records must not answer
                # (``notifications_live``) until the cache has been emptied on resuming.
                self._heard = float("-inf")
                if self.metrics is not None:
                    self.metrics.store_children("redis", "subscribe").error()
                attempt += 1
                with contextlib.suppress(TimeoutError):  # back off, but wake at once on close
                    await asyncio.wait_for(self._closing.wait(), BREAKER_COOLDOWN)
            finally:
                self._heard = float("-inf")  # (also when it ends otherwise: closing, cancelled)
                self._listening = None
                if pubsub is not None:
                    with contextlib.suppress(*self._errors):
                        await pubsub.aclose()
                if client is not None:  # (even when the pubsub's close failed: its pool's sockets go with it)
                    with contextlib.suppress(*self._errors):
                        await client.aclose()

    # ------------------------------------------------------------------ plumbing

    def _keys(self, tenant: str, key: str) -> list[str]:
        # The tag is a digest: raw keys never appear in Redis, and a '}' in a key cannot split the slot.
        tag = hashlib.sha256(self.watchers.message(tenant, key).encode("utf-8", "surrogateescape")).hexdigest()[:32]
        prefix = self.config.key_prefix
        return [f"{prefix}{{{tag}}}:lock", f"{prefix}{{{tag}}}:resp", f"{prefix}{{{tag}}}:epoch"]

    async def _script(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a registered script: in the next pipeline, or alone on a cluster (bounded as a whole there)."""
        if self._pipelines is None:
            async with asyncio.timeout(CLUSTER_STEP_TIMEOUT):  # TimeoutError: Redis failing, as any timeout
                return await script(keys=keys, args=args)
        return await self._pipelines.call((script, keys, args))

    async def _pipeline(self, calls: list[_ScriptCall], *, breaker: bool = True) -> list[Any]:
        """One pipeline of EVALSHAs; a call Redis answers with an error gets that error alone. Scripts Redis lost
        (a restart) are loaded and their calls sent once more. Calls that queued behind a pipeline that failed
        meanwhile fail at once (the breaker is open) rather than wait out another socket timeout."""
        if breaker and time.monotonic() < self._down_until:
            raise RedisConnectionError("redis is skipped for now (circuit breaker open)")
        replies = await self._evalsha(calls)
        lost = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            for script in {calls[n][0] for n in lost}:
                if self._lean is None:
                    await self.redis.script_load(script.script)
                    continue
                _only(await self._lean.execute([(b"SCRIPT", b"LOAD", script.script)]))
            for n, reply in zip(lost, await self._evalsha([calls[n] for n in lost]), strict=True):
                replies[n] = reply
        return replies

    async def _evalsha(self, calls: list[_ScriptCall]) -> list[Any]:
        if self._lean is not None:
            return await self._lean.execute(
                [(b"EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args in calls])
        async with self.redis.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    def _unlock(self, call: _ScriptCall, reply: Any) -> None:
        """A claim whose caller was cancelled while its pipeline was on the wire: drop the lock it took, so the key
        does not answer 409 for LOCK_MAX seconds with nobody behind it."""
        script, keys, args = call
        if script is not self._claim_script or not isinstance(reply, list) or reply[:1] != [b"acquired"]:
            return
        follow_up(self._unlocking, self._drop_lock(keys, args[2], b"", publish=False),
                  "dropping an abandoned claim's Redis lock (it expires by itself)")

    async def _drop_lock(self, keys: list[str], token: str, message: str | bytes, *, publish: bool) -> Any:
        """The settle script with nothing to cache: drop the lock if ``token`` still holds it."""
        return await self._script(self._settle_script, keys,
                                  [token, b"", 1, self.channel, message, UNKNOWN_EPOCH, "1" if publish else "0"])

    def _fast(self, operation: str) -> _FastStep:
        """``with self._fast(operation) as step``: run a Redis step only when ``step.usable``; on any Redis error
        note it, open the breaker and carry on without it (the error is swallowed and ``step.usable`` turns
        false). A class, not ``asynccontextmanager``: an async generator per step cost more than the step's
        own bookkeeping (two steps per first request)."""
        return _FastStep(self, operation)

    def _fast_failed(self, operation: str, exc: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.store_children("redis", operation).error()
        if not self._degraded:  # one line per outage, not one per request
            log.warning("redis %s failed (%s); serving from %s alone until it answers again",
                        operation, type(exc).__name__, self.durable.backend)
        self._degraded = True
        self._down_until = time.monotonic() + BREAKER_COOLDOWN

    # ------------------------------------------------------------------ operations

    async def _fast_claim(self, tenant: str, key: str, fingerprint: str, token: str,
                          lease: float) -> _Fast | None:
        with self._fast("claim") as step:
            if step.usable:
                keys = self._keys(tenant, key)
                args = [f"{token} {fingerprint} {int((time.time() + lease) * 1000)}",
                        int(min(lease, LOCK_MAX) * 1000), token, self._epoch_ms]  # token: a fresh epoch too
                reply = await self._script(self._claim_script, keys, args)
                kind = reply[0].decode()
                if kind == "completed":  # written only after the durable store completed: authoritative
                    copy = self._copy(tenant, key, reply)
                    if copy is not None:
                        return copy
                    # A copy that does not decode: Redis answered, so no breaker (one bad key would otherwise
                    # send every key to the durable store, again at each retry of it, until the copy expired).
                    # Claim again, dropping that copy if it still stands: the claim then reads the epoch and
                    # takes the lock as for a copy that expired, the durable store decides, and a completed
                    # record's copy is written anew, fenced by that epoch (_repair). Only the cache is dropped,
                    # never a lock.
                    reply = await self._script(self._claim_script, keys, [*args, reply[1]])
                    kind = reply[0].decode()
                    if kind == "completed":  # garbled again meanwhile: the durable store answers, nothing kept
                        return self._copy(tenant, key, reply) or _Fast("garbled")
                if kind == "acquired":
                    return _Fast(kind, epoch=_epoch(reply[1]))
                lock = _lock(reply)
                if lock is None:  # a lock this proxy did not write: Redis answered, so no breaker either
                    self._not_ours(tenant, key)
                    return _Fast("foreign", epoch=_epoch(reply[3]))
                lock_fp, deadline = lock
                if lock_fp != fingerprint:
                    # The lock names the fingerprint of whoever took it, before the durable store decided: only
                    # the durable record may answer 422 (the lock holder may be a wrong payload about to be
                    # refused, while this request is the genuine retry of a completed record).
                    return _Fast("foreign", epoch=_epoch(reply[3]))
                # The lease's end as its owner's replica counted it (the lock itself may expire sooner), and "now"
                # on that same clock, from the time the lock has left on Redis's own (PTTL: a duration, immune to
                # skew between hosts): a waiter whose clock is ahead of the owner's does not see a lease that is
                # still alive as run out, and look again every 10 ms until the owner is done. The lock lived
                # min(lease, LOCK_MAX) from the claim, so the lease has what the lock has left plus the rest of
                # the route's lease past LOCK_MAX (the same route, the same lease).
                lock_left = int(reply[2]) / 1000  # (>= 0: see _lock)
                if min(lease, LOCK_MAX) - lock_left < YOUNG_LOCK:  # its claim may not be decided yet
                    return _Fast("young", epoch=_epoch(reply[3]))
                lease_left = lock_left + max(lease - LOCK_MAX, 0.0)
                lease_end = deadline / 1000 if deadline is not None else time.time() + lock_left
                now = lease_end - lease_left if deadline is not None else lease_end - lock_left
                return _Fast(kind, Record(
                    tenant=tenant, key=key, fingerprint=lock_fp, state=State.IN_FLIGHT,
                    lease_token=None, lease_expires_at=lease_end, response=None,
                    created_at=now, completed_at=None, expires_at=lease_end,
                ), now=now)
        # Sent and failed (a reply later than SOCKET_TIMEOUT, a connection cut after the write): the script may
        # have run and the lock be ours, with nobody to drop it. Skipped (the breaker rests): nothing was sent.
        return _Fast("unknown") if step.tried else None

    def _copy(self, tenant: str, key: str, reply: list[Any]) -> _Fast | None:
        """The completed record a claim's reply carries; None (logged, counted) when its copy does not decode."""
        try:
            record = _decode(tenant, key, reply[1], self.codec)
        except _GARBLED as exc:
            log.error("redis copy of record %s does not decode (%s); dropping it, answering from %s",
                      record_hash(tenant, key), type(exc).__name__, self.durable.backend,
                      extra={"record": record_hash(tenant, key), "backend": self.backend})
            if self.metrics is not None:
                self.metrics.store_children(self.backend, "copy").error()
            return None
        # "Now" on the clock the record's times were written by (the completing replica's), from the time its
        # copy has left on Redis's own (PTTL: a duration, immune to skew between hosts). A copy of it kept in
        # memory then never outlives it, whatever this host's clock says. (The copy's time left is at most the
        # record's.)
        left = int(reply[2]) if len(reply) > 2 else -1
        now = record.expires_at - left / 1000 if left >= 0 else time.time()
        return _Fast("completed", record, now=now)

    def _not_ours(self, tenant: str, key: str) -> None:
        log.error("redis lock of record %s is not one idemproxy writes (unreadable, or without expiry); asking %s",
                  record_hash(tenant, key), self.durable.backend,
                  extra={"record": record_hash(tenant, key), "backend": self.backend})
        if self.metrics is not None:
            self.metrics.store_children(self.backend, "lock").error()

    async def claim(
        self, tenant: str, key: str, fingerprint: str, *, lease: float, ttl: float,
        token: str | None = None,
    ) -> Claim:
        token = token or new_token()
        asked = time.monotonic()
        fast = await self._fast_claim(tenant, key, fingerprint, token, lease)
        if fast is not None and fast.record is not None:
            return Claim(record=fast.record, owned=False, now=time.time() if fast.now is None else fast.now,
                         sent=asked)
        # Redis granted the lock, could not answer, or named another fingerprint: the durable store decides
        # (guarantee 4), and its claim's lease counts from when its statement was written (Claim.sent), after this
        # Redis step. A lock Redis may have granted is dropped as one it did (fenced by the token: harmless
        # if it never was), in the background if Redis still fails then.
        locked = fast is not None and fast.kind in ("acquired", "unknown")
        epoch = fast.epoch if fast is not None else UNKNOWN_EPOCH
        try:
            claim = await self.durable.claim(
                tenant, key, fingerprint, lease=lease, ttl=ttl, token=token
            )
        except BaseException:
            if locked:  # nothing changed anywhere: drop our lock quietly (no wake-up for anyone)
                await self._settle(tenant, key, token, publish=False, locked=True)
            raise
        if claim.owned:
            return claim.with_epoch(epoch, locked)
        if fast is not None:
            await self._repair(tenant, key, token, epoch, claim, locked)
        return claim

    async def _repair(self, tenant: str, key: str, token: str, epoch: str, claim: Claim, locked: bool) -> None:
        """Redis had lost what the durable store knows (restart, eviction, expired cache): refill the replay
        cache for a completed record, and drop a lock we took for an owner Redis had forgotten. A completed
        record is announced (when routes wait): a waiter that met our lock while we asked would otherwise sleep
        out its whole wait for an owner that does not exist; woken, it finds the copy. A lock dropped for an
        in-flight owner is not: nothing changed, and a wake-up would make a waiter spin. (The lock is not handed
        to the owner: our read may already be stale, and a stale hand-over would answer 409 after it settled.)"""
        record = claim.record
        if record.state is State.COMPLETED:
            await self._settle(tenant, key, token, payload=_encode(record, self.codec),
                               ttl=record.expires_at - claim.now, epoch=epoch,
                               publish=self.announcing and locked, locked=locked)
        elif locked:
            await self._settle(tenant, key, token, publish=False, locked=True)

    async def _settle(
        self, tenant: str, key: str, token: str, *, payload: bytes = b"", ttl: float = 0.0,
        epoch: str = UNKNOWN_EPOCH, publish: bool = True, locked: bool = False,
    ) -> None:
        """Cache ``payload`` (if any, and only if the epoch is still ``epoch``), drop the lock if ``token``
        holds it, and wake waiters when ``publish``. ``locked``: Redis granted ``token`` the lock, so a settle
        that fails leaves it behind, to be dropped in the background."""
        cache_ms = max(1, int(min(self.config.replay_cache_ttl, ttl) * 1000))
        with self._fast("settle") as step:
            if step.usable:
                await self._script(
                    self._settle_script, self._keys(tenant, key),
                    [token, payload, cache_ms, self.channel, self.watchers.message(tenant, key), epoch,
                     "1" if publish else "0"],
                )
        if locked and not step.usable:  # failed, or skipped while the breaker rests: the lock still stands
            self._drop_later(tenant, key, token, publish)

    def _drop_later(self, tenant: str, key: str, token: str, publish: bool) -> None:
        if self._closing.is_set():
            return  # (it expires by itself within LOCK_MAX)
        stale = self._stale_locks
        if len(stale) >= STALE_LOCKS_MAX:
            del stale[next(iter(stale))]  # the oldest: its lock expires soonest anyway
        stale[(tenant, key, token)] = (time.monotonic() + LOCK_MAX, publish)
        if self._unlocker is None or self._unlocker.done():
            self._unlocker = asyncio.create_task(self._drop_stale_locks(), name="idemproxy-redis-unlocker")

    async def _drop_stale_locks(self) -> None:
        """Drop, fenced by their tokens, the locks failed settles left, once Redis answers again."""
        stale = self._stale_locks
        while stale:
            await asyncio.sleep(STALE_LOCK_RETRY)
            now = time.monotonic()
            for name in [name for name, (until, _) in stale.items() if until <= now]:
                del stale[name]
            batch = list(stale.items())[:PIPELINE_MAX]
            if not batch:
                return
            with self._fast("settle") as step:
                if step.usable:
                    results = await asyncio.gather(*(
                        self._drop_lock(self._keys(tenant, key), token, self.watchers.message(tenant, key),
                                        publish=publish)
                        for (tenant, key, token), (_, publish) in batch), return_exceptions=True)
                    for (name, _), result in zip(batch, results, strict=True):
                        if not isinstance(result, BaseException):
                            stale.pop(name, None)
                    failed = [result for result in results if isinstance(result, BaseException)]
                    if failed:
                        raise failed[0]  # noted as any Redis failure: the breaker rests, the rest waits

    def announce_completions(self, on: bool) -> None:
        super().announce_completions(on)
        self.durable.announce_completions(on)

    async def complete(self, claim: Claim, response: StoredResponse, *, ttl: float) -> bool:
        done = await self.durable.complete(claim, response, ttl=ttl)
        payload = b""
        if done:  # only a response the durable store accepted may ever be replayed from the cache
            now = time.time()
            record = claim.record
            payload = _encode(Record(  # a field-by-field dataclasses.replace would walk the fields
                tenant=record.tenant, key=record.key, fingerprint=record.fingerprint, state=State.COMPLETED,
                lease_token=None, lease_expires_at=None, response=response, created_at=record.created_at,
                completed_at=now, expires_at=now + ttl,
            ), self.codec)
        await self._settle(claim.record.tenant, claim.record.key, claim.token, payload=payload, ttl=ttl,
                           epoch=UNKNOWN_EPOCH if claim.cache_epoch is None else claim.cache_epoch,
                           publish=self.announcing, locked=claim.cache_lock)
        return done

    async def release(self, claim: Claim) -> bool:
        done = await self.durable.release(claim)
        await self._settle(claim.record.tenant, claim.record.key, claim.token, locked=claim.cache_lock)
        return done

    async def get(self, tenant: str, key: str) -> Record | None:
        return await self.durable.get(tenant, key)

    async def forget(self, tenant: str, key: str) -> bool:
        """Purge Redis, delete the durable record, purge Redis again (renewing the epoch each time).

        When this returns, no replay of the record can come from Redis: a completion or cache refill that read
        the record before the delete carries an older epoch and is refused. Redis must answer both purges
        (the breaker is bypassed): if it cannot, the release fails with 503 rather than report a release that a
        stale cache entry could still contradict.
        """
        await self._purge(tenant, key)
        done = await self.durable.forget(tenant, key)
        await self._purge(tenant, key)
        return done

    async def clear_copies(self, tenant: str, key: str) -> None:
        """Purge Redis (renewing the epoch, announcing it to every replica), never the durable record: the retry
        of a release that failed between its purges finds the record gone, and must still clear a copy that a
        read put back in Redis meanwhile. Like ``forget``, it fails (503) while Redis cannot be reached."""
        await self._purge(tenant, key)
        self.watchers.notify(tenant, key)  # this process at once (the announcement reaches it too, later)

    async def _purge(self, tenant: str, key: str) -> None:
        call: _ScriptCall = (self._forget_script, self._keys(tenant, key),
                             [self.channel, self.watchers.message(tenant, key), new_token(), self._epoch_ms])
        try:
            try:
                await self._purge_once(call)
            except self._dead_connection:
                # A connection that died while idle (Redis restarted, a cut that has healed; on a cluster, one a
                # topology refresh closed under us) fails its first command; redis-py's pipeline does not retry
                # it. The script is idempotent: send it once more, on a fresh connection. A Redis that is really
                # gone fails this one too.
                await self._purge_once(call)
        except self._errors as exc:
            if self.metrics is not None:
                self.metrics.store_children("redis", "forget").error()
            raise StoreUnavailable(
                "Redis could not be cleared; retry the release when it answers again."
            ) from exc

    async def _purge_once(self, call: _ScriptCall) -> None:
        if self._pipelines is None:  # a cluster: the script alone, on its slot's node
            await self._script(*call)
        else:  # straight to Redis, past the queue and the breaker
            _only(await self._pipeline([call], breaker=False))

    async def clock(self) -> float:
        return await self.durable.clock()

    def notifications_live(self) -> bool:
        """Releases reach this process through the subscriber; it is live while Redis answered it lately."""
        return not self._closing.is_set() and time.monotonic() - self._heard < SUBSCRIBER_LIVE_WINDOW

    async def sweep(self, limit: int) -> int:
        return await self.durable.sweep(limit)  # Redis entries expire by their own TTL

    async def maintain(self) -> object | None:
        return await self.durable.maintain()

    async def health(self) -> Health:
        """Both stores asked at once, each bounded on its own: a PostgreSQL that hangs must not hide that Redis
        answers (the app's own bound, 2 s, would otherwise drop both from ``/readyz``)."""
        health, redis = await asyncio.gather(self._durable_health(), self._redis_health())
        health.details["redis"] = redis
        return health

    async def _durable_health(self) -> Health:
        try:
            return await asyncio.wait_for(self.durable.health(), DURABLE_PROBE_TIMEOUT)
        except TimeoutError:
            return Health(ready=False, details={self.durable.backend: "unavailable (no answer)"})

    async def _redis_health(self) -> str:
        try:
            if self._lean is None:
                await asyncio.wait_for(self.redis.ping(), SOCKET_TIMEOUT * 2)
            else:
                _only(await asyncio.wait_for(self._lean.execute([(b"PING",)]), SOCKET_TIMEOUT * 2))
        except self._errors:
            return "unavailable (degraded: served from PostgreSQL alone, slower)"
        return "ok"
