"""Completed records kept in this process, so a hot replay needs no network at all.

A completed record never changes until it expires or an operator releases it, so a copy can answer replays
(and 422s) while:

- its time is not up: an entry lives at most ``LIFETIME`` seconds, and never past the record's own expiry
  minus a second (the time left is taken at the read from the store's clock: PostgreSQL's, or on the Redis
  fast path the copy's PTTL, a duration; then counted on this process's monotonic clock, so clock skew
  between hosts does not matter);
- no release has been announced: every change notification the store delivers (Redis pub/sub, PostgreSQL
  LISTEN, or in-process for the embedded store) evicts the key, and a release on this replica evicts it at
  once. While notifications are not flowing (from the subscriber's first error, or after 2.5 s without a sign
  of life from Redis or the LISTEN connection) the cache is bypassed, and it is emptied when they come back,
  since some may have been missed.

``max_bytes`` counts what an entry really holds (``_size``); the fences (at most ``FENCES`` keys) come on top.

The race this guards against: a read of the record starts, a release is announced and processed, and only
then does the read come back and want to be cached. Each key's last invalidation is stamped with a counter;
a copy is cached only if its key was not invalidated after the read began (``begin``/``put``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from idemproxy.store.base import Claim, Record, State

LIFETIME = 30.0  # seconds an entry may answer without the store being asked again
MAX_ENTRY = 64 * 1024  # bytes: larger answers are not kept here
FENCES = 10_000  # recently invalidated keys remembered individually; older ones share one floor

_Key = tuple[str, str]


# What an entry holds besides its strings' and body's bytes, measured with tracemalloc on CPython 3.11: the
# record and response objects, the entry's tuples, the body's and each string's object header and the ordered
# dict's node (about 780 bytes, the record's and the response's own dicts included, and up to 350 more: the
# dict's spare room, the allocator's rounding), and per stored header its pair and two strings (about 155).
# Counted, so that ``replay_memory`` bounds what the cache really holds, not only its bodies
# (tests/test_replays.py).
ENTRY_OVERHEAD = 1130
HEADER_OVERHEAD = 160


def _held(text: str) -> int:
    """Bytes a string's characters take: one each when ASCII, else up to four (CPython stores a string at the
    width of its widest character; ``isascii`` is a flag read, not a scan)."""
    return len(text) if text.isascii() else 4 * len(text)


def _size(record: Record) -> int:
    response = record.response
    assert response is not None and response.body is not None
    return (len(response.body) + _held(record.tenant) + _held(record.key) + len(record.fingerprint)
            + ENTRY_OVERHEAD + sum(_held(k) + _held(v) + HEADER_OVERHEAD for k, v in response.headers))


class ReplayCache:
    def __init__(self, max_bytes: int, live: Callable[[], bool]) -> None:
        self.max_bytes = max_bytes
        self.live = live  # whether the store's change notifications flow right now
        self._entries: OrderedDict[_Key, tuple[Record, float, int]] = OrderedDict()  # record, deadline, size
        self._bytes = 0
        self._counter = 0
        self._fences: OrderedDict[_Key, int] = OrderedDict()
        self._floor = 0
        self.hits = 0

    def begin(self) -> int:
        """Call before reading a record that may be cached; pass the result to ``put``."""
        return self._counter

    def get(self, tenant: str, key: str) -> Record | None:
        entry = self._entries.get((tenant, key))
        if entry is None:
            return None
        record, deadline, _ = entry
        if time.monotonic() >= deadline or not self.live():
            self._evict((tenant, key))
            return None
        self._entries.move_to_end((tenant, key))
        self.hits += 1
        return record

    def put(self, claim: Claim, seen: int) -> None:
        """Keep a completed, replayable record read (or written) by a claim that began at ``seen``."""
        record = claim.record
        if (self.max_bytes <= 0 or record.state is not State.COMPLETED or record.response is None
                or record.response.body is None or not self.live()):
            return
        key = (record.tenant, record.key)
        if self._fences.get(key, self._floor) > seen:  # invalidated while it was being read
            return
        size = _size(record)
        lifetime = min(LIFETIME, record.expires_at - claim.now - 1.0)
        if size > MAX_ENTRY or lifetime <= 0:
            return
        self._evict(key)
        self._entries[key] = (record, time.monotonic() + lifetime, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            self._evict(next(iter(self._entries)))

    def invalidate(self, tenant: str | None, key: str | None) -> None:
        """A change notification: one key, or (None, None) for "anything may have changed"."""
        self._counter += 1
        if tenant is None or key is None:
            self._entries.clear()
            self._bytes = 0
            self._fences.clear()
            self._floor = self._counter
            return
        self._evict((tenant, key))
        self._fences[(tenant, key)] = self._counter
        self._fences.move_to_end((tenant, key))
        if len(self._fences) > FENCES:
            _, oldest = self._fences.popitem(last=False)
            self._floor = max(self._floor, oldest)

    def _evict(self, key: _Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[2]
