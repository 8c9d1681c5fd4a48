"""A lean Redis connection for the fast path's script pipelines: one socket, replies matched first in, first out.

redis-py's pipeline costs about 100 µs of CPU per round trip on top of the socket work (a pool checkout, a lock,
command objects, response callbacks), twice per first request. The fast path only ever sends batches of EVALSHA
to one Redis, so this module does that one thing on an ``asyncio.Protocol``, with hiredis (the C reply parser
redis-py uses too) reading the replies.

Matching replies to callers is the part that must not go wrong (a reply handed to the wrong caller would replay
another key's answer; redis-py's CVE-2023-28858 was that). So:
- a batch is written whole with one ``transport.write`` (never interleaved with another) and its waiter queued in
  the same step; Redis answers commands on one connection in order, so the waiters' order is the replies' order;
- a waiter whose caller stopped waiting stays in the queue and its replies are read and dropped;
- anything that breaks that order (a protocol error, a cut, a timeout with replies still owed) closes the
  connection and fails every waiter on it; the next batch opens a new connection.

Errors are redis-py's exception types, so the store's breaker treats both clients alike. URLs with options this
client does not implement (TLS, client names, socket options) keep redis-py's pipeline (see ``supports``).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit

import hiredis
from redis.asyncio.connection import parse_url
from redis.exceptions import (
    AuthenticationError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = bytes | str | int
# hiredis's stub types the argument as a 1-tuple; it takes a command of any length.
_pack_command = cast(Callable[[tuple[Arg, ...]], bytes], hiredis.pack_command)


class _ProtocolError(RedisConnectionError):
    """Bytes that are not RESP: the stream can no longer be trusted."""


# What redis-py's parse_url may say that this client does too (read the same way, by the same function).
_SETTINGS = frozenset({"host", "port", "db", "username", "password", "path", "connection_class"})


def supports(url: str) -> bool:
    """Whether ``url`` says nothing this client does not implement: plain TCP or a unix socket, a database
    number, a user and a password; no TLS and no query options but ``db``."""
    if urlsplit(url).scheme not in ("redis", "unix"):
        return False
    try:
        return set(parse_url(url)) <= _SETTINGS
    except ValueError:  # redis-py would refuse it too, at its first command
        return False


def pack(commands: list[tuple[Arg, ...]]) -> bytes:
    """RESP arrays of bulk strings, as Redis reads commands, written by hiredis in C (what redis-py uses when
    hiredis is there). A str is UTF-8, strictly (a lone surrogate raises UnicodeEncodeError, as redis-py); a bool
    or None raises TypeError."""
    if len(commands) == 1:
        return _pack_command(commands[0])
    return b"".join([_pack_command(command) for command in commands])


def _reply(value: Any) -> Any:
    """hiredis's error replies as redis-py's exceptions (NOSCRIPT as NoScriptError, which the store reloads on)."""
    if isinstance(value, hiredis.ReplyError):
        text = str(value)
        if text.startswith("NOSCRIPT"):
            return NoScriptError(text)
        return ResponseError(text)
    return value


class _Waiter:
    __slots__ = ("future", "owed", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], owed: int) -> None:
        self.future = future
        self.owed = owed
        self.replies: list[Any] = []


class _Connection(asyncio.Protocol):
    def __init__(self, timeout: float, client: RespClient) -> None:
        self.client = client
        self.reader = hiredis.Reader()
        self.transport: asyncio.Transport | None = None
        self.waiters: collections.deque[_Waiter] = collections.deque()
        self.closed = False
        self.timeout = timeout
        # The watchdog's deadlines are on the loop's clock, as its timers are (uvloop's is libuv's, in ms).
        self.loop = asyncio.get_running_loop()
        self.heard = self.loop.time()  # when bytes last arrived (a slow answer that moves is not a timeout)
        self.watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def send(self, data: bytes, owed: int) -> asyncio.Future[list[Any]]:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise RedisConnectionError("connection to redis is closed")
        future: asyncio.Future[list[Any]] = self.loop.create_future()
        if not self.waiters:
            self.heard = self.loop.time()  # the clock for this batch's answer starts now
        self.waiters.append(_Waiter(future, owed))
        self.transport.write(data)
        if self.watchdog is None:
            self.watchdog = self.loop.call_at(self.heard + self.timeout, self._watch)
        return future

    def _watch(self) -> None:
        """Replies are owed and no byte came for ``timeout``: Redis is stuck (or the link is), fail them all."""
        self.watchdog = None
        if not self.waiters or self.closed:
            return
        due = self.heard + self.timeout
        if self.loop.time() >= due:
            self.fail(RedisTimeoutError(f"no reply from redis within {self.timeout:g} s"))
        else:
            self.watchdog = self.loop.call_at(due, self._watch)

    def data_received(self, data: bytes) -> None:
        self.heard = self.loop.time()
        try:
            self.reader.feed(data)
            while (value := self.reader.gets()) is not False:
                if not self.waiters:
                    raise _ProtocolError("redis sent a reply nobody asked for")
                waiter = self.waiters[0]
                waiter.replies.append(_reply(value))
                if len(waiter.replies) == waiter.owed:
                    self.waiters.popleft()
                    if waiter.future.done():  # its caller stopped waiting: the replies are dropped
                        self.client.dropped += 1
                    else:
                        waiter.future.set_result(waiter.replies)
        except (hiredis.ProtocolError, _ProtocolError) as exc:
            self.fail(_ProtocolError(f"unreadable reply from redis ({exc})"))

    def eof_received(self) -> bool | None:
        self.fail(RedisConnectionError("redis closed the connection"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"connection to redis lost ({exc or 'closed'})"))

    def fail(self, exc: Exception) -> None:
        """Close the connection and fail every waiter on it: their replies can no longer be told apart."""
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        if self.transport is not None:
            self.transport.abort()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(_fresh(exc))


def _fresh(exc: Exception) -> Exception:
    return type(exc)(*exc.args)


class RespClient:
    """Batches of commands over one lazily opened connection; a cut or a timeout fails the batches on it and the
    next batch reconnects. ``timeout``: for the connect and handshake, and for owed replies to make progress (no
    byte for that long fails them: a slow answer that moves is not a timeout)."""

    def __init__(self, url: str, timeout: float) -> None:
        settings = parse_url(url)  # exactly what redis-py would connect to, and as whom
        self._timeout = timeout
        self._unix: str | None = settings.get("path")
        self._host: str = settings.get("host", "localhost")
        self._port: int = settings.get("port", 6379)
        self._db: int = settings.get("db", 0)
        username, password = settings.get("username"), settings.get("password")
        # redis-py's rule: AUTH user password (the password may be empty) or AUTH password, when either is given
        self._auth: tuple[str, ...] = ((username, password or "") if username else (password or "",)) if (
            username or password) else ()
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self._closed = False
        self.connects = 0  # connections opened, for tests
        self.dropped = 0  # batches whose caller stopped waiting after they were sent: replies read and dropped

    async def execute(self, commands: list[tuple[Arg, ...]]) -> list[Any]:
        """Send ``commands`` as one pipeline; one reply per command, an error reply as its exception instance.

        A connection found broken before the batch was written is replaced first. One that breaks after is not
        written to again: the batch fails with ``ConnectionError`` (the commands may or may not have run)."""
        if not commands:
            return []
        data = pack(commands)
        connection = await self._open()
        return await connection.send(data, len(commands))

    async def _open(self) -> _Connection:
        if self._closed:
            raise RedisConnectionError("the redis client is closed")
        connection = self._connection
        if connection is not None and not connection.closed:
            return connection
        if self._connecting is None or self._connecting.done():  # one attempt at a time, shared by its callers
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(lambda attempt: attempt.cancelled() or attempt.exception())
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        connection: _Connection | None = None
        try:
            async with asyncio.timeout(self._timeout):
                if self._unix is not None:
                    _, connection = await loop.create_unix_connection(lambda: _Connection(self._timeout, self),
                                                                     self._unix)
                else:
                    _, connection = await loop.create_connection(lambda: _Connection(self._timeout, self),
                                                                self._host, self._port)
                await self._handshake(connection)
        except BaseException as exc:
            if connection is not None:
                connection.fail(RedisConnectionError("the connection did not complete its handshake"))
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"redis did not accept a connection within {self._timeout:g} s") from None
            if isinstance(exc, Exception) and not isinstance(exc, RedisError):  # a bad host name too
                raise RedisConnectionError(f"cannot connect to redis ({type(exc).__name__}: {exc})") from exc
            raise
        if self._closed:  # closed while this connect was under way
            connection.fail(RedisConnectionError("the redis client is closed"))
            raise RedisConnectionError("the redis client is closed")
        self.connects += 1
        self._connection = connection
        return connection

    async def _handshake(self, connection: _Connection) -> None:
        handshake: list[tuple[Arg, ...]] = []
        if self._auth:
            handshake.append((b"AUTH", *self._auth))
        if self._db:
            handshake.append((b"SELECT", self._db))
        if not handshake:
            return
        replies = await connection.send(pack(handshake), len(handshake))
        if self._auth and isinstance(replies[0], ResponseError) and len(self._auth) == 2 \
                and "wrong number of arguments" in str(replies[0]):
            # a user and a password, but Redis older than 6 takes a password alone (redis-py does the same)
            [replies[0]] = await connection.send(pack([(b"AUTH", self._auth[1])]), 1)
        for n, reply in enumerate(replies):
            if isinstance(reply, ResponseError):
                raise AuthenticationError(str(reply)) if self._auth and n == 0 else reply

    def close(self) -> None:
        """Close the connection for good; batches still waiting fail with ConnectionError, later ones at once."""
        self._closed = True  # a connect under way finishes on its own (within the timeout) and closes what it opened
        if self._connection is not None:
            self._connection.fail(RedisConnectionError("the redis client is closing"))
            self._connection = None
