"""The embedded store: one SQLite file (WAL) for a single proxy process, no servers needed.

Every SQLite call runs on one dedicated thread, so the event loop never blocks on disk and all writes are
serialised: a claim is one ``BEGIN IMMEDIATE`` transaction on that thread, which makes it atomic against
every other operation of this process. Another process on the same file would break that, so the file is
held with an exclusive lock and a second process is refused at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from idemproxy.config import EmbeddedConfig
from idemproxy.metrics import Metrics
from idemproxy.problems import StoreUnavailable
from idemproxy.store.base import Claim, Health, Record, State, Store, StoredResponse, new_token
from idemproxy.store.codec import Codec

log = logging.getLogger("idemproxy.store.embedded")
T = TypeVar("T")

PROBE_BUSY_MS = 1000  # how long a health check waits for the write lock (a claim waits 5 s, sqlite3's default)
# A write waits at most this for the write lock (another process holding the file), counted from its call: one
# queued behind a batch waiting out its own busy wait gets only what is left (sqlite3's default busy timeout). A
# batch waits what is left of its oldest write's: a write that joined it late may fail sooner than this.
WRITE_WAIT = 5.0
BUSY_SLACK = 0.5  # a batch whose oldest write queued less than this keeps the full busy timeout (no PRAGMA)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    tenant TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL, state TEXT NOT NULL,
    lease_token TEXT, lease_expires_at REAL, status INTEGER, headers TEXT, body BLOB,
    body_stored INTEGER, created_at REAL NOT NULL, completed_at REAL, expires_at REAL NOT NULL,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS records_expires_at ON records (expires_at);
"""
_COLUMNS = (
    "tenant, key, fingerprint, state, lease_token, lease_expires_at, status, headers, body, "
    "body_stored, created_at, completed_at, expires_at"
)


_Queued = tuple[Callable[[sqlite3.Connection], Any], "asyncio.Future[Any]", float]  # (write, its future, queued at)


class StoreLocked(Exception):
    """Another process holds the embedded store file."""


def _record(row: sqlite3.Row, codec: Codec | None) -> Record:
    """The record of ``row``; with ``codec`` None, without its response (what a claim decides on)."""
    response = None
    if row["status"] is not None and codec is not None:
        headers, body = codec.from_columns(row["tenant"], row["key"], row["headers"], row["body"],
                                           backend=EmbeddedStore.backend,
                                           outcome=(row["status"], bool(row["body_stored"]), row["fingerprint"]))
        response = StoredResponse(status=row["status"], headers=headers, body=body if row["body_stored"] else None)
    elif codec is not None and row["state"] == State.COMPLETED.value:
        raise codec.without_status(row["tenant"], row["key"], row["body"], backend=EmbeddedStore.backend)
    return Record(
        tenant=row["tenant"], key=row["key"], fingerprint=row["fingerprint"],
        state=State(row["state"]), lease_token=row["lease_token"],
        lease_expires_at=row["lease_expires_at"], response=response, created_at=row["created_at"],
        completed_at=row["completed_at"], expires_at=row["expires_at"],
    )


class EmbeddedStore(Store):
    backend = "embedded"

    def __init__(self, config: EmbeddedConfig, metrics: Metrics | None = None, *, codec: Codec | None = None) -> None:
        super().__init__(metrics)
        self.path = config.path
        self.codec = codec or Codec()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idemproxy-sqlite")
        self._db: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file opened
        self._gone_said = False
        self._queued: list[_Queued] = []  # writes waiting for the next group commit
        self._committing = False
        # Leases are timed on the monotonic clock, anchored to the wall clock once at start: a wall-clock step
        # while running can neither shorten a live lease (an early takeover) nor stretch it. Across a restart
        # the anchor is read again, as it must be for records kept on disk.
        self._wall0 = time.time()
        self._mono0 = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first call, kept (see _running)

    def _running(self) -> asyncio.AbstractEventLoop:
        """The store's event loop, asked for once: on CPython 3.11 asyncio.get_running_loop() makes a getpid()
        system call each time (two writes a first request)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _now(self, at: float | None = None) -> float:
        """This store's clock, now or at the instant ``at`` of the monotonic clock it runs on."""
        return self._wall0 + ((time.monotonic() if at is None else at) - self._mono0)

    async def clock(self) -> float:
        return self._now()

    def notifications_live(self) -> bool:
        return True  # one process: every change notifies in-process

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        try:
            self._acquire_file_lock()
        except OSError as exc:
            raise self._cannot_open(exc) from exc
        try:
            await self._run("open", self._open_db)
        except StoreUnavailable as exc:
            self._release_file_lock()
            raise self._cannot_open(exc.__cause__ or exc) from exc
        except BaseException:
            self._release_file_lock()
            raise
        log.warning(
            "embedded store %s: single-instance only (one process); use PostgreSQL (+ Redis) to run "
            "several replicas", self.path,
        )

    def _cannot_open(self, cause: BaseException) -> StoreUnavailable:
        """At start, an error that names the setting to fix (the message is the command line's one line)."""
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        return StoreUnavailable(
            f"storage.embedded.path: {self.path!r} cannot be opened as the embedded store ({reason}); name a file "
            "in a directory this process may write", maybe_applied=False)

    def _acquire_file_lock(self) -> None:
        # The file as it resolves, not as written: the same file through a symlink (a volume, a "current" link)
        # takes the same lock.
        lock_path = f"{os.path.realpath(self.path)}.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLocked(
                f"the embedded store {self.path} is in use by another idemproxy process; it is "
                "single-instance only (configure storage.postgres to run several)"
            ) from None
        self._lock_fd = fd

    def _release_file_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def _open_db(self) -> None:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: a completed record is on disk before the client sees its response, even on power loss.
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        info = os.stat(self.path)
        self._identity = (info.st_dev, info.st_ino)
        self._db = db

    def _check_file(self) -> None:
        """On the SQLite thread, before a write or a health check: the file opened is still the one at the path.
        Unlinked (or replaced) under a running process, it takes every write and loses all of them at the next
        start: that is a store failure, not a store."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            info = None
        if info is None or (info.st_dev, info.st_ino) != self._identity:
            if not self._gone_said:
                self._gone_said = True
                log.error("embedded store %s: the file was removed or replaced while open; nothing more is "
                          "written to it, every claim is 503 (restart the proxy)", self.path)
            raise sqlite3.OperationalError("the embedded store file was removed or replaced")

    async def close(self, timeout: float | None = None) -> None:
        # (``timeout`` not applied: the SQLite thread cannot be cut; its file is local, there is no server to
        # hang on.)
        if self._db is not None:
            await self._run("close", self._db.close)
            self._db = None
        self._executor.shutdown(wait=True)
        self._release_file_lock()

    async def _run(self, operation: str, fn: Callable[[], T]) -> T:
        async with self.measured(operation):
            loop = self._running()
            try:
                return await loop.run_in_executor(self._executor, fn)
            except (sqlite3.Error, OSError) as exc:  # the transaction rolled back: nothing was applied
                raise StoreUnavailable("The idempotency store (embedded) is unavailable.",
                                       maybe_applied=False) from exc

    def _probe(self) -> None:
        """On the SQLite thread: take the write lock and give it back (no fsync: nothing was written), waiting
        for it at most PROBE_BUSY_MS, inside the app's bound for a health check."""
        db = self._db
        if db is None:
            return
        self._check_file()
        (busy,) = db.execute("PRAGMA busy_timeout").fetchone()
        db.execute(f"PRAGMA busy_timeout = {PROBE_BUSY_MS}")
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("ROLLBACK")
        finally:
            db.execute(f"PRAGMA busy_timeout = {int(busy)}")

    async def _write(self, operation: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in a write transaction, shared with every write queued meanwhile (group commit).

        With synchronous=FULL each commit is an fsync; concurrent requests' claims and completions queued
        while one transaction commits go into the next one together, one fsync for all of them. Each runs in
        a savepoint of its own, so one that fails leaves the others' work intact.
        """
        async with self.measured(operation):
            loop = self._running()
            future: asyncio.Future[Any] = loop.create_future()
            self._queued.append((fn, future, time.monotonic()))
            if not self._committing:
                self._committing = True
                loop.call_soon(self._commit_queued)  # after this loop turn: its other writes join the batch
            try:
                return cast(T, await future)
            except (sqlite3.Error, OSError) as exc:  # rolled back: nothing of it was applied
                raise StoreUnavailable("The idempotency store (embedded) is unavailable.",
                                       maybe_applied=False) from exc

    def _commit_queued(self) -> None:
        batch, self._queued = self._queued, []
        if not batch:
            self._committing = False
            return
        done = self._running().run_in_executor(self._executor, self._apply, batch)
        done.add_done_callback(lambda result: self._hand_out(batch, result))

    def _hand_out(self, batch: list[_Queued], result: asyncio.Future[list[tuple[bool, Any]]]) -> None:
        error = result.exception() if not result.cancelled() else sqlite3.OperationalError("write cancelled")
        outcomes = [(False, error)] * len(batch) if error is not None else result.result()
        for (_, future, _), (ok, value) in zip(batch, outcomes, strict=True):
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)
        self._commit_queued()

    def _apply(self, batch: list[_Queued]) -> list[tuple[bool, Any]]:
        """On the SQLite thread: one transaction, a savepoint per write."""
        db = self._db
        assert db is not None
        outcomes: list[tuple[bool, Any]] = []
        self._check_file()
        # The busy wait for the write lock gets what is left of the oldest write's WRITE_WAIT: writes queued
        # while the batch before waited out its busy timeout must not wait a whole one more.
        left = WRITE_WAIT - (time.monotonic() - batch[0][2])  # (queued in order: the first is the oldest)
        lowered = left < WRITE_WAIT - BUSY_SLACK
        if lowered:
            db.execute(f"PRAGMA busy_timeout = {max(int(left * 1000), 0)}")
        try:
            db.execute("BEGIN IMMEDIATE")
        finally:
            if lowered:
                db.execute(f"PRAGMA busy_timeout = {int(WRITE_WAIT * 1000)}")
        try:
            for fn, _, _ in batch:
                db.execute("SAVEPOINT write")
                try:
                    outcomes.append((True, fn(db)))
                except Exception as exc:
                    db.execute("ROLLBACK TO write")
                    outcomes.append((False, exc))
                db.execute("RELEASE write")
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        return outcomes

    # ------------------------------------------------------------------ operations

    async def claim(
        self, tenant: str, key: str, fingerprint: str, *, lease: float, ttl: float,
        token: str | None = None,
    ) -> Claim:
        token = token or new_token()

        def claim(db: sqlite3.Connection) -> Claim:
            sent = time.monotonic()  # (this store's clock runs on it: the lease starts exactly then)
            now = self._now(sent)
            row = db.execute(f"SELECT {_COLUMNS} FROM records WHERE tenant=? AND key=?",
                             (tenant, key)).fetchone()
            # Decided on without the response: an expired record is replaced even when it no longer opens.
            current = _record(row, None) if row is not None else None
            took_over = replaced = False
            if current is not None:
                if current.expired(now) and not (
                        # in flight, its ttl no longer than its lease: it stood for its lease, and the same
                        # request after that takes it over (a second execution, maybe), whatever its ttl said
                        current.state is State.IN_FLIGHT and current.fingerprint == fingerprint
                        and current.expires_at <= (current.lease_expires_at or 0.0)):
                    replaced = True
                elif current.expired(now):
                    took_over = True
                elif (current.state is State.IN_FLIGHT and not current.lease_alive(now)
                      and current.fingerprint == fingerprint):
                    took_over = True
                else:
                    return Claim(record=_record(row, self.codec), owned=False, now=now, sent=sent)
            record = Record(
                tenant=tenant, key=key, fingerprint=fingerprint, state=State.IN_FLIGHT,
                lease_token=token, lease_expires_at=now + lease, response=None, created_at=now,
                completed_at=None, expires_at=now + ttl,
            )
            db.execute(
                "INSERT OR REPLACE INTO records (tenant, key, fingerprint, state, lease_token, "
                "lease_expires_at, created_at, expires_at) VALUES (?,?,?,?,?,?,?,?)",
                (tenant, key, fingerprint, record.state.value, token, record.lease_expires_at,
                 now, record.expires_at),
            )
            return Claim(record=record, owned=True, now=now, sent=sent, took_over=took_over,
                         replaced_expired=replaced)

        return await self._write("claim", claim)

    async def complete(self, claim: Claim, response: StoredResponse, *, ttl: float) -> bool:
        record = claim.record
        headers, body = self.codec.to_columns(record.tenant, record.key, response.headers, response.body,
                                              response.status, record.fingerprint)

        def complete(db: sqlite3.Connection) -> bool:
            now = self._now()
            cursor = db.execute(
                "UPDATE records SET state='completed', status=?, headers=?, body=?, body_stored=?, "
                "completed_at=?, expires_at=?, lease_token=NULL, lease_expires_at=NULL "
                "WHERE tenant=? AND key=? AND lease_token=? AND state='in_flight'",
                (response.status, headers, body, response.body is not None, now,
                 now + ttl, record.tenant, record.key, claim.token),
            )
            return cursor.rowcount == 1

        done = await self._write("complete", complete)
        self.watchers.notify(record.tenant, record.key)
        return done

    async def release(self, claim: Claim) -> bool:
        record = claim.record
        done = await self._delete("release", "tenant=? AND key=? AND lease_token=?",
                                  (record.tenant, record.key, claim.token))
        self.watchers.notify(record.tenant, record.key)
        return done

    async def forget(self, tenant: str, key: str) -> bool:
        done = await self._delete("forget", "tenant=? AND key=?", (tenant, key))
        self.watchers.notify(tenant, key)
        return done

    async def _delete(self, operation: str, where: str, args: tuple[Any, ...]) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            return db.execute(f"DELETE FROM records WHERE {where}", args).rowcount == 1

        return await self._write(operation, delete)

    async def get(self, tenant: str, key: str) -> Record | None:
        def get() -> Record | None:
            assert self._db is not None
            row = self._db.execute(f"SELECT {_COLUMNS} FROM records WHERE tenant=? AND key=?",
                                   (tenant, key)).fetchone()
            return _record(row, self.codec) if row is not None else None

        return await self._run("get", get)

    async def sweep(self, limit: int) -> int:
        def sweep(db: sqlite3.Connection) -> int:
            now = self._now()
            cursor = db.execute(
                "DELETE FROM records WHERE rowid IN (SELECT rowid FROM records WHERE expires_at <= ? "
                "AND NOT (state='in_flight' AND lease_expires_at > ?) LIMIT ?)",
                (now, now, limit),
            )
            return cursor.rowcount

        return await self._write("sweep", sweep)

    async def health(self) -> Health:
        """Whether a claim could write now: ``SELECT 1`` never touched the file, and answered "ok" while another
        process held the database locked and every claim failed after its 5 s busy wait."""
        try:
            await self._run("ping", self._probe)
        except StoreUnavailable:
            return Health(ready=False, details={"embedded": "unavailable"})
        return Health(ready=self._db is not None, details={"embedded": "ok"})
