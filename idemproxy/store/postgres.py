"""PostgreSQL: the source of truth. One row per (tenant, key); its primary key decides who forwards."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any

import asyncpg

from idemproxy.config import PostgresConfig
from idemproxy.metrics import Metrics
from idemproxy.problems import StoreRejected, StoreUnavailable
from idemproxy.store.base import Claim, Health, Record, State, Store, StoredResponse, new_token
from idemproxy.store.codec import Codec

log = logging.getLogger("idemproxy.store.postgres")

TABLE = "idemproxy_records"
NOTIFY_CHANNEL = "idemproxy_changed"
# Arbitrary constants naming our advisory locks (pg_advisory_lock takes a bigint).
MIGRATION_LOCK = 0x1DE4_0001
SWEEP_LOCK = 0x1DE4_0002
OPERATION_TIMEOUT = 5.0  # seconds: a hung database must become a 503, never a hung request

MIGRATIONS: tuple[str, ...] = (
    f"""
    CREATE TABLE {TABLE} (
        tenant           text        NOT NULL,
        key              text        NOT NULL,
        fingerprint      text        NOT NULL,
        state            text        NOT NULL CHECK (state IN ('in_flight', 'completed')),
        lease_token      text,
        lease_expires_at timestamptz,
        status           integer,
        headers          text,
        body             bytea,
        body_stored      boolean,
        claim_kind       text        NOT NULL DEFAULT 'new',
        created_at       timestamptz NOT NULL DEFAULT now(),
        completed_at     timestamptz,
        expires_at       timestamptz NOT NULL,
        PRIMARY KEY (tenant, key)
    );
    CREATE INDEX {TABLE}_expires_at ON {TABLE} (expires_at);
    """,
)

_COLUMNS = (
    "tenant, key, fingerprint, state, lease_token, lease_expires_at, status, headers, body, "
    "body_stored, claim_kind, created_at, completed_at, expires_at"
)

# The whole claim in one statement. The INSERT either creates the record, or takes over one that expired or
# whose lease ran out (same fingerprint only: a different payload is a 422, never a takeover); otherwise the
# second SELECT returns the record that stands.
#
# Race: under READ COMMITTED the second SELECT reads the statement's snapshot. When the conflicting row was
# committed by another transaction *after* that snapshot was taken, ON CONFLICT sees it (it waits for and
# locks the row) but the SELECT does not, and the statement returns no row at all. The caller then runs
# it again; the next snapshot sees the row.
_CLAIM = f"""
WITH claimed AS (
    INSERT INTO {TABLE} AS r (tenant, key, fingerprint, state, lease_token, lease_expires_at,
                              claim_kind, created_at, expires_at)
    VALUES ($1, $2, $3, 'in_flight', $4, now() + make_interval(secs => $5), 'new', now(),
            now() + make_interval(secs => $6))
    ON CONFLICT (tenant, key) DO UPDATE SET
        fingerprint = EXCLUDED.fingerprint, state = 'in_flight',
        lease_token = EXCLUDED.lease_token, lease_expires_at = EXCLUDED.lease_expires_at,
        status = NULL, headers = NULL, body = NULL, body_stored = NULL, completed_at = NULL,
        created_at = now(), expires_at = EXCLUDED.expires_at,
        claim_kind = CASE WHEN r.state = 'in_flight' AND r.expires_at > now()
                          THEN 'takeover' ELSE 'expired' END
    WHERE (r.expires_at <= now() AND NOT (r.state = 'in_flight' AND r.lease_expires_at > now()))
       OR (r.state = 'in_flight' AND r.lease_expires_at <= now()
           AND r.fingerprint = EXCLUDED.fingerprint)
    RETURNING {", ".join("r." + c.strip() for c in _COLUMNS.split(","))}, true AS owned
)
SELECT *, now() AS db_now FROM claimed
UNION ALL
SELECT {_COLUMNS}, false AS owned, now() AS db_now FROM {TABLE}
 WHERE tenant = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claimed)
"""

# Fenced by the token: after a takeover the old owner's token matches nothing.
_COMPLETE = f"""
UPDATE {TABLE} SET state = 'completed', status = $4, headers = $5, body = $6, body_stored = $7,
       completed_at = now(), expires_at = now() + make_interval(secs => $8),
       lease_token = NULL, lease_expires_at = NULL
 WHERE tenant = $1 AND key = $2 AND lease_token = $3 AND state = 'in_flight'
"""
_RELEASE = f"DELETE FROM {TABLE} WHERE tenant = $1 AND key = $2 AND lease_token = $3"
_GET = f"SELECT {_COLUMNS} FROM {TABLE} WHERE tenant = $1 AND key = $2"
_FORGET = f"DELETE FROM {TABLE} WHERE tenant = $1 AND key = $2"


def _counted(statement: str, params: int, notify: bool) -> str:
    """``statement`` returning how many rows it changed; with ``notify``, it also NOTIFYs once per changed
    row (parameters ``$params+1``, ``$params+2``: channel and payload), in the same round trip."""
    per_row = f"pg_notify(${params + 1}, ${params + 2})" if notify else "1"
    return f"WITH changed AS ({statement} RETURNING 1) SELECT count(*) FROM (SELECT {per_row} FROM changed) AS c"
# Bounded batch; SKIP LOCKED keeps the sweeper off rows a claim is updating right now.
_SWEEP = f"""
DELETE FROM {TABLE} WHERE ctid IN (
    SELECT ctid FROM {TABLE}
     WHERE expires_at <= now()
       AND NOT (state = 'in_flight' AND lease_expires_at > now())
     LIMIT $1 FOR UPDATE SKIP LOCKED)
"""

_DB_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, asyncio.TimeoutError)
# The request's own data was refused (a value too long to index, say): permanent, so never "unavailable".
_DATA_ERRORS = (asyncpg.DataError, asyncpg.ProgramLimitExceededError)  # on a claim: the key or tenant itself
LISTEN_RETRY = 1.0  # seconds between attempts to re-establish LISTEN after its connection was lost


async def _no_reset(_conn: Any) -> None:
    """Skip asyncpg's reset query on every release: it would cost a round trip per operation, and this
    store leaves no session state behind (no LISTEN, cursors or session-level locks on pool connections)."""


def _epoch(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _record(row: Any, codec: Codec) -> Record:
    response = None
    if row["status"] is not None:
        headers, body = codec.from_columns(row["tenant"], row["key"], row["headers"], row["body"],
                                           backend=PostgresStore.backend)
        response = StoredResponse(status=row["status"], headers=headers, body=body if row["body_stored"] else None)
    return Record(
        tenant=row["tenant"],
        key=row["key"],
        fingerprint=row["fingerprint"],
        state=State(row["state"]),
        lease_token=row["lease_token"],
        lease_expires_at=_epoch(row["lease_expires_at"]),
        response=response,
        created_at=row["created_at"].timestamp(),
        completed_at=_epoch(row["completed_at"]),
        expires_at=row["expires_at"].timestamp(),
    )


def _unavailable(operation: str, exc: BaseException, *, maybe_applied: bool = True) -> StoreUnavailable:
    log.warning("postgres %s failed: %s: %s", operation, type(exc).__name__, exc)
    return StoreUnavailable("The idempotency store (PostgreSQL) is unavailable.", maybe_applied=maybe_applied)


async def _first(*waits: Any) -> None:
    """Wait until the first of several awaitables finishes; cancel the rest."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def migrate(conn: Any) -> list[int]:
    """Apply the missing migrations under an advisory lock (safe when replicas start together)."""
    applied: list[int] = []
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS idemproxy_schema "
            "(version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        current = await conn.fetchval("SELECT coalesce(max(version), 0) FROM idemproxy_schema")
        for version, sql in enumerate(MIGRATIONS, start=1):
            if version <= current:
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute("INSERT INTO idemproxy_schema (version) VALUES ($1)", version)
            applied.append(version)
            log.info("applied schema migration %d", version)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
    return applied


async def connect_with_retries(
    connect: Callable[[], Any], what: str, attempts: int = 5, delay: float = 0.5
) -> Any:
    """Open a connection or pool, retrying a few times with backoff and a log line for each failure."""
    for attempt in range(1, attempts + 1):
        try:
            return await connect()
        except (*_DB_ERRORS, ConnectionError) as exc:
            if attempt == attempts:
                raise StoreUnavailable(f"{what} is not reachable") from exc
            log.warning("%s not reachable (attempt %d/%d): %s", what, attempt, attempts, type(exc).__name__)
            await asyncio.sleep(delay * attempt)
    raise AssertionError("unreachable")


class PostgresStore(Store):
    backend = "postgres"

    def __init__(
        self, config: PostgresConfig, metrics: Metrics | None = None, *, listen: bool = False,
        codec: Codec | None = None,
    ) -> None:
        super().__init__(metrics)
        self.config = config
        self.codec = codec or Codec()
        self.listen = listen  # LISTEN/NOTIFY wakes `wait` mode when no Redis carries notifications
        self._pool: Any = None
        self._listener: Any = None
        self._listen_task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self.statements = 0  # statements sent, for diagnostics and the round-trip budget tests

    async def _init_connection(self, conn: Any) -> None:
        conn.add_query_logger(self._count_statement)

    def _count_statement(self, _query: Any) -> None:
        self.statements += 1

    async def open(self) -> None:
        dsn = self.config.dsn.reveal()
        self._pool = await connect_with_retries(
            lambda: asyncpg.create_pool(
                dsn, min_size=self.config.pool_min, max_size=self.config.pool_max,
                command_timeout=OPERATION_TIMEOUT, timeout=OPERATION_TIMEOUT,
                init=self._init_connection, reset=_no_reset,
            ),
            "PostgreSQL",
        )
        if self.config.migrate == "auto":
            async with self._pool.acquire() as conn:
                await migrate(conn)
        if self.listen:
            self._listen_task = asyncio.create_task(self._keep_listening(), name="idemproxy-pg-listen")

    async def close(self) -> None:
        self._closing.set()
        if self._listen_task is not None:
            await asyncio.wait({self._listen_task}, timeout=3)
            self._listen_task.cancel()
        if self._pool is not None:
            try:
                await asyncio.wait_for(self._pool.close(), timeout=5)
            except _DB_ERRORS:
                self._pool.terminate()  # connections still busy after 5 s are cut, not waited for

    async def _keep_listening(self) -> None:
        """Hold a LISTEN connection; re-establish it whenever it is lost (a PostgreSQL restart, a cut), and
        wake every waiter then, since notifications sent meanwhile were missed."""
        while not self._closing.is_set():
            try:
                conn = await asyncpg.connect(self.config.dsn.reveal(), timeout=OPERATION_TIMEOUT)
            except _DB_ERRORS as exc:
                log.warning("LISTEN connection failed (%s); wait mode falls back to its deadline until it is "
                            "back", type(exc).__name__)
            else:
                await self._listen_on(conn)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), LISTEN_RETRY)

    async def _listen_on(self, conn: Any) -> None:
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        self._listener = conn
        try:
            await conn.add_listener(NOTIFY_CHANNEL, self._on_notify)
            self.watchers.notify_all()  # anything that changed while we were not listening
            await _first(lost.wait(), self._closing.wait())
        except _DB_ERRORS as exc:
            log.warning("LISTEN failed (%s)", type(exc).__name__)
        finally:
            self._listener = None
            with contextlib.suppress(*_DB_ERRORS):
                await asyncio.wait_for(conn.close(timeout=2), 3)
        if not self._closing.is_set():
            log.warning("LISTEN connection lost; re-establishing it")

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self.watchers.notify_message(payload)

    @contextlib.asynccontextmanager
    async def _conn(self, operation: str) -> AsyncIterator[Any]:
        """A pooled connection. Every failure is translated here: the request's own data refused →
        StoreRejected; anything else the driver or the server can do (refused or dropped connections, timeouts,
        shutdown, an exhausted pool, a protocol state error) → StoreUnavailable. A connection interrupted in the
        middle of an operation (error, timeout or cancellation) is terminated, never handed out again: a
        pooled connection with an operation still pending fails the next user with "another operation is in
        progress"."""
        async with self.measured(operation):
            try:
                conn = await self._pool.acquire(timeout=OPERATION_TIMEOUT)
            except Exception as exc:
                raise _unavailable(operation, exc, maybe_applied=False) from exc
            try:
                yield conn
            except BaseException as exc:
                # asyncpg may already have taken back a connection closed mid-operation: then terminate() on
                # our handle refuses, and the connection is gone anyway.
                with contextlib.suppress(Exception):
                    conn.terminate()
                if isinstance(exc, _DATA_ERRORS) and operation == "claim":  # the request's own key or tenant
                    raise StoreRejected("The idempotency key or tenant cannot be stored.") from exc
                if isinstance(exc, Exception) and not isinstance(exc, StoreUnavailable):
                    raise _unavailable(operation, exc) from exc
                raise
            finally:
                with contextlib.suppress(Exception):
                    await self._pool.release(conn, timeout=OPERATION_TIMEOUT)

    async def _change(self, operation: str, statement: str, *args: Any) -> bool:
        """Run a fenced write; True when it changed the record (and then woke LISTENing waiters)."""
        sql = _counted(statement, len(args), self.listen)
        notify = (NOTIFY_CHANNEL, self.watchers.message(args[0], args[1])) if self.listen else ()
        async with self._conn(operation) as conn:
            changed: int = await conn.fetchval(sql, *args, *notify)
        return changed == 1

    async def claim(
        self, tenant: str, key: str, fingerprint: str, *, lease: float, ttl: float,
        token: str | None = None,
    ) -> Claim:
        token = token or new_token()
        async with self._conn("claim") as conn:
            for _ in range(5):  # see the race described at _CLAIM
                row = await conn.fetchrow(_CLAIM, tenant, key, fingerprint, token, lease, ttl)
                if row is not None:
                    break
            else:
                raise StoreUnavailable("The idempotency store could not settle a claim.")
        owned = bool(row["owned"])
        return Claim(
            record=_record(row, self.codec),
            owned=owned,
            now=row["db_now"].timestamp(),
            took_over=owned and row["claim_kind"] == "takeover",
            replaced_expired=owned and row["claim_kind"] == "expired",
        )

    async def complete(self, claim: Claim, response: StoredResponse, *, ttl: float) -> bool:
        tenant, key, token = claim.record.tenant, claim.record.key, claim.token
        headers, body = self.codec.to_columns(tenant, key, response.headers, response.body)
        return await self._change(
            "complete", _COMPLETE, tenant, key, token, response.status, headers,
            body, response.body is not None, ttl,
        )

    async def release(self, claim: Claim) -> bool:
        return await self._change("release", _RELEASE, claim.record.tenant, claim.record.key, claim.token)

    async def get(self, tenant: str, key: str) -> Record | None:
        async with self._conn("get") as conn:
            row = await conn.fetchrow(_GET, tenant, key)
        return _record(row, self.codec) if row is not None else None

    async def forget(self, tenant: str, key: str) -> bool:
        done = await self._change("forget", _FORGET, tenant, key)
        self.watchers.notify(tenant, key)  # this process at once; others by NOTIFY or Redis
        return done

    def notifications_live(self) -> bool:
        """With LISTEN (PostgreSQL alone), live while its connection stands."""
        return self._listener is not None and not self._listener.is_closed()

    async def sweep(self, limit: int) -> int:
        """One batch, by one replica at a time (a transaction-scoped advisory lock)."""
        async with self._conn("sweep") as conn, conn.transaction():
            if not await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", SWEEP_LOCK):
                return 0
            result = await conn.execute(_SWEEP, limit)
        return int(result.split()[-1])

    async def clock(self) -> float:
        async with self._conn("clock") as conn:
            return float(await conn.fetchval("SELECT extract(epoch FROM now())"))

    async def health(self) -> Health:
        try:
            async with self._conn("ping") as conn:
                await conn.fetchval("SELECT 1")
        except StoreUnavailable:
            return Health(ready=False, details={"postgres": "unavailable"})
        return Health(ready=True, details={"postgres": "ok"})


async def apply_migrations(config: PostgresConfig) -> list[int]:
    """``idemproxy migrate``: one connection, the migrations, done (safe to run twice)."""
    conn = await connect_with_retries(
        lambda: asyncpg.connect(config.dsn.reveal(), timeout=OPERATION_TIMEOUT), "PostgreSQL"
    )
    try:
        return await migrate(conn)
    finally:
        await conn.close()
