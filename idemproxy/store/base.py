"""The store interface: durable idempotency records, knowing nothing of HTTP.

A record per (tenant, key) moves through two states::

    (absent) --claim--> IN_FLIGHT --complete(token)--> COMPLETED --ttl--> (expired: claimable)
                            |  \\--release(token)--> (absent)
                            \\--lease runs out--> claimable by a retry with the same fingerprint

``claim`` is the one decision point: it either makes the caller the owner (a fresh lease token, the record
IN_FLIGHT) or returns the record that stands. ``complete`` and ``release`` are fenced by the lease token, so
an owner that stalled past its lease and was taken over can never overwrite its successor. Backends
implement these operations atomically (one SQL statement, one Lua script, one SQLite transaction);
the engine decides what a record means for the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from types import FunctionType
from typing import Any, ClassVar, TypeVar, cast

from idemproxy.metrics import Metrics, StoreMetrics
from idemproxy.problems import RecordUnreadable, StoreUnavailable

_T = TypeVar("_T")

# A shared store does not hand an in-flight record whose lease ran out to the first retry that finds it: it gives
# the lease this much more, once (the record "in its grace"), and the next claim after that takes it over. The
# owner may be alive and holding the executed answer, its completion refused by a store that was away longer than
# the lease and retried at most MAX_RETRY_GAP (0.5 s) apart: when the store comes back, a retry reaching another
# replica first would otherwise take the key over and execute it a second time. The request that meets a record
# in its grace waits it out and claims again (engine.py); a crashed owner's key is taken over this much later.
TAKEOVER_GRACE = 1.0


def quick_init(cls: type[_T]) -> type[_T]:
    """Give a frozen dataclass an ``__init__`` that writes the new instance's ``__dict__`` directly, with the same
    signature, defaults and default factories. The generated one sets each field through ``object.__setattr__``
    (to get past the frozen ``__setattr__``): 1.5 µs for a ten-field record against 0.4 µs, and a first request
    makes about eight of these. The price: the instance's dict is a real one from the start, so each field read
    costs about 17 ns more and an instance 64 bytes more (replays.py counts it); measured together, a first request
    and a replay each take 2.1 % fewer instructions. Only for plain ones (a ``__dict__`` in every class of the
    MRO, no ``__post_init__``, no field that is a data descriptor, the dataclass's own ``__init__`` taking exactly
    the fields, in order): anything else is refused at import.
    (tests/test_store.py::test_quick_init_builds_what_the_dataclass_init_builds)"""
    every = fields(cls)  # type: ignore[arg-type]
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    taken = list(inspect.signature(cls.__init__).parameters)[1:]  # (InitVars, init=False fields, kw_only show here)
    if (not params.frozen or not params.init  # (init=False: an __init__ of the class's own, kept)
            or any("__slots__" in vars(base) for base in cls.__mro__[:-1])  # (a parent's slots: not in __dict__)
            or hasattr(cls, "__post_init__") or taken != [f.name for f in every]
            or any(f.kw_only or f.name.startswith("__quick") for f in every)
            or any(hasattr(inspect.getattr_static(cls, f.name, None), "__set__") for f in every)):  # descriptors
        raise TypeError(f"quick_init: {cls.__name__} is not a plain frozen dataclass")
    names: dict[str, object] = {"__quick_factory__": object()}  # (no field can be named so: see above)
    signature, body = [], []
    for f in every:
        if f.default is not MISSING:
            names[f"__quick_default_{f.name}"] = f.default
            signature.append(f"{f.name}=__quick_default_{f.name}")
            body.append(f"    __quick_dict__[{f.name!r}] = {f.name}")
        elif f.default_factory is not MISSING:
            names[f"__quick_factory_{f.name}"] = f.default_factory
            signature.append(f"{f.name}=__quick_factory__")
            body.append(f"    __quick_dict__[{f.name!r}] = "
                        f"__quick_factory_{f.name}() if {f.name} is __quick_factory__ else {f.name}")
        else:
            signature.append(f.name)
            body.append(f"    __quick_dict__[{f.name!r}] = {f.name}")
    source = (f"def __init__(__quick_self__, {', '.join(signature)}):\n"
              "    __quick_dict__ = __quick_self__.__dict__\n" + "\n".join(body) + "\n")
    exec(source, names)  # (built from the class's own field names, as dataclasses builds its own)
    init = cast(FunctionType, names["__init__"])
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


class State(StrEnum):
    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"


@quick_init
@dataclass(frozen=True)
class StoredResponse:
    """What a replay sends back; ``body`` None means it was larger than ``max_stored_response``."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes | None


@quick_init
@dataclass(frozen=True)
class Record:
    tenant: str
    key: str
    fingerprint: str
    state: State
    lease_token: str | None
    lease_expires_at: float | None  # epoch seconds
    response: StoredResponse | None
    created_at: float
    completed_at: float | None
    expires_at: float

    def lease_alive(self, now: float) -> bool:
        return (
            self.state is State.IN_FLIGHT
            and self.lease_expires_at is not None
            and self.lease_expires_at > now
        )

    def expired(self, now: float) -> bool:
        return self.expires_at <= now and not self.lease_alive(now)


@quick_init
@dataclass(frozen=True)
class Claim:
    """The result of :meth:`Store.claim`: the record that now stands, and whether the caller owns it."""

    record: Record
    owned: bool
    now: float  # the store's clock when it decided (lease and expiry are judged against it)
    # This process's monotonic clock at an instant no later than the store read its clock (``now``) for this
    # claim: just before the statement that decided it was written (each store gives it). The lease is counted
    # from it, so this process's idea of the lease never ends after the store's; and on the monotonic clock, never
    # the wall clock, so a clock step cannot stretch a forward or a retry past the lease. Not from the claim's
    # call: a Redis step, a wait in a batch queue or for a pooled connection all come before the store's clock
    # starts the lease, and would otherwise be taken from it.
    sent: float = field(compare=False)
    took_over: bool = False  # owned by taking over an in-flight record whose lease ran out
    replaced_expired: bool = False  # owned by replacing a record whose TTL had passed
    cache_epoch: str | None = None  # a cache in front of the durable store: what it read first (redis.py)
    cache_lock: bool = False  # that cache took a lock for this claim (redis.py), which its settle must drop
    grace: bool = False  # not owned: an in-flight record in its TAKEOVER_GRACE (its lease had run out)

    def lease_left(self) -> float:
        """Seconds until the lease runs out, measured on this process's monotonic clock."""
        expires = self.record.lease_expires_at
        if expires is None:
            return 0.0
        return expires - self.now - (time.monotonic() - self.sent)

    def lease_end(self) -> float:
        """When the lease runs out, as an instant of this process's monotonic clock (no clock is read: a pause
        of the process between computing it and using it cannot move it)."""
        expires = self.record.lease_expires_at
        if expires is None:
            return self.sent
        return self.sent + expires - self.now

    @property
    def token(self) -> str:
        assert self.owned and self.record.lease_token is not None
        return self.record.lease_token

    # ``dataclasses.replace`` walks the fields on every call; this runs on every first request.
    # (tests/test_store.py checks that it carries every other field.)
    def with_epoch(self, cache_epoch: str, cache_lock: bool = False) -> Claim:
        """This claim, with what the cache in front of the durable store read first, and whether it locked."""
        return Claim(self.record, self.owned, self.now, self.sent, self.took_over, self.replaced_expired,
                     cache_epoch, cache_lock, self.grace)


class _Measured:
    __slots__ = ("_children", "_started")

    def __init__(self, children: StoreMetrics | None) -> None:
        self._children = children
        self._started = 0.0

    async def __aenter__(self) -> None:
        self._started = time.perf_counter()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object) -> None:
        children = self._children
        if children is not None:
            # A record that does not open is counted as such (codec.py), not as a store that failed to answer.
            if isinstance(exc, StoreUnavailable) and not isinstance(exc, RecordUnreadable):
                children.error()
            children.duration(time.perf_counter() - self._started)


TOKEN_BYTES = 16
_TOKEN_BATCH = 256  # tokens per system call


class _Tokens:
    """Random bytes from the OS (``os.urandom``), fetched 256 tokens at a time: one system call per token cost
    a first request about 2 % of its CPU. A forked child starts with none of its parent's."""

    def __init__(self) -> None:
        self._buffer = b""
        self._offset = 0
        self._lock = threading.Lock()  # (tokens are drawn on the loop's thread; the lock keeps it safe anywhere)

    def forget(self) -> None:
        self._buffer, self._offset = b"", 0
        self._lock = threading.Lock()  # a lock held by another thread at the fork stays held in the child

    def next(self) -> str:
        with self._lock:
            offset = self._offset
            if offset + TOKEN_BYTES > len(self._buffer):
                self._buffer, offset = os.urandom(TOKEN_BYTES * _TOKEN_BATCH), 0
            self._offset = offset + TOKEN_BYTES
            return self._buffer[offset:offset + TOKEN_BYTES].hex()


_tokens = _Tokens()
os.register_at_fork(after_in_child=_tokens.forget)


def step_bounds(timeout: float | None) -> Callable[[float], float]:
    """For a ``close(timeout)``: the bound of each step (its own bound, ``step``), cut to what is left of
    ``timeout`` from now (None: each step keeps its own bound)."""
    if timeout is None:
        return lambda step: step
    deadline = time.monotonic() + timeout
    return lambda step: min(step, max(deadline - time.monotonic(), 0.0))


# TCP keepalive on the stores' own connections (the drivers set none): a server gone dark without a word (a host
# powered off, an address moved by a failover: packets dropped, no reset) is found by the kernel on an idle
# connection within about KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_COUNT seconds (or the user timeout, where
# there is one) and the connection closed, so the next request opens a new one instead of waiting out its timeout
# on it. A server that is alive answers the probes from its kernel, however slow its statements: no false alarm.
# Each idle connection costs one probe and its acknowledgement every KEEPALIVE_IDLE seconds.
KEEPALIVE_IDLE = 2
KEEPALIVE_INTERVAL = 1
KEEPALIVE_COUNT = 3


def keep_alive(transport: Any, user_timeout: float) -> None:
    """TCP keepalive on ``transport``'s socket, and TCP_USER_TIMEOUT (Linux): data it sent that stays
    unacknowledged ``user_timeout`` seconds ends the connection (a graceful close to a dark server, say, which
    would otherwise wait out the kernel's retransmissions, about 15 minutes). Nothing for a unix socket."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", int(user_timeout * 1000))):
        option = getattr(socket, name, None)  # (not every platform has each)
        if option is not None:
            options.append((socket.IPPROTO_TCP, option, value))
    for level, option, value in options:
        with contextlib.suppress(OSError):  # (an option the platform refuses: the connection is good without it)
            sock.setsockopt(level, option, value)


def new_token() -> str:
    """A lease token: 128 bits from the OS's CSPRNG, unguessable, so no other request can complete or release a
    record it does not own."""
    return _tokens.next()


class Watchers:
    """In-process futures woken when a (tenant, key) record changes; fed by each backend's notifications."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], set[asyncio.Future[None]]] = {}
        # Called on every change: (tenant, key), or (None, None) when anything may have changed.
        self.listeners: list[Callable[[str | None, str | None], None]] = []

    @contextlib.contextmanager
    def watch(self, tenant: str, key: str) -> Iterator[asyncio.Future[None]]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault((tenant, key), set())
        waiting.add(future)
        try:
            yield future
        finally:
            waiting.discard(future)
            if not waiting:
                self._waiting.pop((tenant, key), None)

    @staticmethod
    def message(tenant: str, key: str) -> str:
        """The (tenant, key) as sent between processes (LISTEN/NOTIFY, Redis pub/sub)."""
        return f"{tenant}\x1f{key}"

    def notify_message(self, message: str) -> None:
        """Wake the waiters of a (tenant, key) received from another process."""
        tenant, _, key = message.partition("\x1f")
        self.notify(tenant, key)

    def notify(self, tenant: str, key: str) -> None:
        for listener in self.listeners:
            listener(tenant, key)
        for future in self._waiting.get((tenant, key), ()):
            if not future.done():
                future.set_result(None)

    def notify_all(self) -> None:
        """Wake every waiter (notifications may have been missed, e.g. while LISTEN was reconnecting)."""
        for listener in self.listeners:
            listener(None, None)
        for waiting in self._waiting.values():
            for future in waiting:
                if not future.done():
                    future.set_result(None)


@dataclass
class Health:
    """What ``/readyz`` reports: ready means the durable store answers."""

    ready: bool
    details: dict[str, str] = field(default_factory=dict)


class Store(ABC):
    """A durable record store. All times are epoch seconds; ``lease`` and ``ttl`` are seconds."""

    backend: ClassVar[str]
    # Seconds after a claim failed by which, as a rule, no statement of it can still land: each was written before
    # it failed, and the server gives each up within its own bound. 0: none can land after its call returned (a
    # store in this process). A claim that may have landed unanswered is released once more then (engine).
    claim_settled_within: float = 0.0

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self.watchers = Watchers()
        self.announcing = True

    def announce_completions(self, on: bool) -> None:
        """Whether a completion is announced to other processes (Redis PUBLISH, PostgreSQL NOTIFY). Only requests
        waiting for an owner (``in_flight: wait``) listen for it: no process keeps a copy of a record in flight, so
        no cache needs it. Releases and admin deletes are always announced."""
        self.announcing = on

    @abstractmethod
    async def open(self) -> None:
        """Connect (with bounded retries) and prepare the schema; called once at start."""

    @abstractmethod
    async def close(self, timeout: float | None = None) -> None:
        """Release every connection; called once at shutdown. With ``timeout``, within it: what is still busy
        then (a statement on a store that does not answer) is cut, not waited for."""

    @abstractmethod
    async def claim(
        self, tenant: str, key: str, fingerprint: str, *, lease: float, ttl: float,
        token: str | None = None,
    ) -> Claim:
        """Own the record, or return the one that stands.

        The caller becomes the owner (lease ``token``, or a fresh one when None; state IN_FLIGHT;
        lease ``lease`` seconds;
        record kept ``ttl`` seconds) when no record exists, when the record expired, or when it is IN_FLIGHT
        with its lease run out *and* the same fingerprint (a takeover). Otherwise nothing changes and the
        standing record is returned with ``owned`` False. A store shared by several processes (PostgreSQL) first
        gives such a record TAKEOVER_GRACE more (returned with ``grace``), and takes it over only at a claim after
        that; a store of one process (embedded) has no other replica to wait for and takes it over at once.
        """

    @abstractmethod
    async def complete(self, claim: Claim, response: StoredResponse, *, ttl: float) -> bool:
        """Store ``response`` and mark the record COMPLETED for ``ttl`` seconds, if ``claim``'s token
        still owns it.

        Returns False, changing nothing, when the lease was taken over (the fence).
        """

    @abstractmethod
    async def release(self, claim: Claim) -> bool:
        """Delete the IN_FLIGHT record if ``claim``'s token still owns it, so the key can be used again."""

    @abstractmethod
    async def get(self, tenant: str, key: str) -> Record | None:
        """The record as stored (even if expired but not yet swept), or None."""

    @abstractmethod
    async def forget(self, tenant: str, key: str) -> bool:
        """Delete the record whatever its state (operator action); True when one existed."""

    async def clear_copies(self, tenant: str, key: str) -> None:
        """Drop every copy of the key's record that a cache in front of the durable store may hold, and touch
        nothing durable (a release that found no record: a record created meanwhile is not the operator's to
        delete). Here, this process's copies; a store with a shared cache clears that too."""
        self.watchers.notify(tenant, key)

    @abstractmethod
    async def sweep(self, limit: int) -> int:
        """Delete up to ``limit`` expired records, never an IN_FLIGHT one whose lease is alive."""

    async def maintain(self) -> object | None:
        """Housekeeping beyond row sweeping (PostgreSQL's daily partitions); None when there is none to do."""
        return None

    @abstractmethod
    async def health(self) -> Health:
        """Ask the backend whether it answers."""

    async def clock(self) -> float:
        """The store's clock (epoch seconds), against which leases and expiry are judged."""
        return time.time()

    def notifications_live(self) -> bool:
        """Whether every change (a release above all) reaches ``watchers`` now: only then may a process keep
        copies of records (``idemproxy.replays``)."""
        return False

    @contextlib.contextmanager
    def watch(self, tenant: str, key: str) -> Iterator[asyncio.Future[None]]:
        """A future resolved when the record may have changed (completed, released, forgotten).

        Register it *before* reading the record, so a change in between is not missed.
        """
        with self.watchers.watch(tenant, key) as future:
            yield future

    def measured(self, operation: str) -> _Measured:
        """``async with``: time an operation and count its failure; the backend translates its own errors
        inside. (A class, not ``asynccontextmanager``: an async generator per store call costs more than the
        timing.)"""
        return _Measured(None if self.metrics is None else self.metrics.store_children(self.backend, operation))
