"""PostgreSQL: the source of truth. One row per (tenant, key); its primary key decides who forwards."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import asyncpg

from idemproxy.config import PostgresConfig
from idemproxy.metrics import Metrics
from idemproxy.problems import StoreRejected, StoreUnavailable
from idemproxy.store.base import (
    KEEPALIVE_COUNT,
    KEEPALIVE_IDLE,
    KEEPALIVE_INTERVAL,
    TAKEOVER_GRACE,
    Claim,
    Health,
    Record,
    State,
    Store,
    StoredResponse,
    keep_alive,
    new_token,
    step_bounds,
)
from idemproxy.store.batch import Batcher, CallTimeout, follow_up
from idemproxy.store.codec import Codec

log = logging.getLogger("idemproxy.store.postgres")
# each failed attempt to reach the server at start (a one-shot command such as `migrate` keeps it quiet)
attempts_log = logging.getLogger("idemproxy.store.postgres.connect")
T = TypeVar("T")

TABLE = "idemproxy_records"
NOTIFY_CHANNEL = "idemproxy_changed"
# Arbitrary constants naming our advisory locks (pg_advisory_lock takes a bigint).
MIGRATION_LOCK = 0x1DE4_0001
SWEEP_LOCK = 0x1DE4_0002
MAINTAIN_LOCK = 0x1DE4_0003  # partition maintenance: session-level, held across its DDL transactions
OPERATION_TIMEOUT = 5.0  # seconds: a hung database must become a 503, never a hung request
# The server gives up on a statement before we do: one we stopped waiting for (a connection dropped at
# OPERATION_TIMEOUT) must not go on waiting for a lock and land later. A completion that landed after its
# client's attempt timed out made the retry find the key completed, so the first-time client was told its
# answer was a replay ("completion refused: the key was taken over"), though nothing took it over.
STATEMENT_TIMEOUT = OPERATION_TIMEOUT - 0.5
# A transaction of ours left open between statements this long is ended by the server. Ours send each statement
# right after the last (DDL of partition maintenance under an ACCESS EXCLUSIVE lock on the records table, the
# sweep, migrations): one idle that long has lost its client, to a network gone dark or a process standing still,
# and the server, hearing nothing, would hold its locks until its TCP keepalive (two hours by default): every
# claim of every replica would wait behind them and fail.
IDLE_IN_TRANSACTION_TIMEOUT = OPERATION_TIMEOUT


def _at_most(setting: str, seconds: float) -> str:
    """``set_config(setting)`` to ``seconds``, unless the session already has a shorter one (not 0: none)."""
    ms = int(seconds * 1000)
    return (f"set_config('{setting}', CASE WHEN current_setting('{setting}')::interval = interval '0' "
            f"OR current_setting('{setting}')::interval > interval '{ms} ms' "
            f"THEN '{ms}ms' ELSE current_setting('{setting}') END, false)")


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
_GRACE = f"make_interval(secs => {TAKEOVER_GRACE})"
_CLAIM = f"""
WITH graced AS (
    -- The first claim to find the lease run out gives it TAKEOVER_GRACE more, once: the owner may still land
    -- its completion (base.TAKEOVER_GRACE). The token stays, so that completion is not refused.
    -- Counted from when it is written (clock_timestamp(), read per row: after the row's lock was had), not from
    -- the transaction's start: a claim that queued on the row's lock would otherwise write a grace already over.
    UPDATE {TABLE} AS g SET lease_expires_at = clock_timestamp() + {_GRACE}, claim_kind = 'grace',
           expires_at = greatest(g.expires_at, clock_timestamp() + {_GRACE})
     WHERE g.tenant = $1 AND g.key = $2 AND g.state = 'in_flight' AND g.lease_expires_at <= now()
       AND g.fingerprint = $3 AND g.claim_kind <> 'grace'
    RETURNING {", ".join("g." + c.strip() for c in _COLUMNS.split(","))}
), claimed AS (
    INSERT INTO {TABLE} AS r (tenant, key, fingerprint, state, lease_token, lease_expires_at,
                              claim_kind, created_at, expires_at)
    SELECT $1, $2, $3, 'in_flight', $4, now() + make_interval(secs => $5), 'new', now(),
           now() + make_interval(secs => $6)
     WHERE NOT EXISTS (SELECT 1 FROM graced)
    ON CONFLICT (tenant, key) DO UPDATE SET
        fingerprint = EXCLUDED.fingerprint, state = 'in_flight',
        lease_token = EXCLUDED.lease_token, lease_expires_at = EXCLUDED.lease_expires_at,
        status = NULL, headers = NULL, body = NULL, body_stored = NULL, completed_at = NULL,
        created_at = now(), expires_at = EXCLUDED.expires_at,
        claim_kind = CASE WHEN r.state = 'in_flight'
                               AND (r.expires_at > now() OR (r.fingerprint = EXCLUDED.fingerprint
                                                             AND (r.expires_at <= r.lease_expires_at
                                                                  OR r.claim_kind = 'grace')))
                          THEN 'takeover' ELSE 'expired' END
    WHERE (r.expires_at <= now() AND NOT (r.state = 'in_flight' AND r.lease_expires_at > now()))
       OR (r.state = 'in_flight' AND r.lease_expires_at <= now()
           AND r.fingerprint = EXCLUDED.fingerprint)
    RETURNING {", ".join("r." + c.strip() for c in _COLUMNS.split(","))}, true AS owned
)
SELECT *, now() AS db_now FROM claimed
UNION ALL
SELECT *, false AS owned, now() AS db_now FROM graced
UNION ALL
SELECT {_COLUMNS}, false AS owned, now() AS db_now FROM {TABLE}
 WHERE tenant = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claimed) AND NOT EXISTS (SELECT 1 FROM graced)
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


# ---------------------------------------------------------------- the daily-partitioned layout
#
# Records live in partitions by *expiry day* (UTC), so a partition is droppable exactly when its day has passed:
# every record in it has expired. A completion or a replacing claim that moves expires_at moves the row to its new
# day (PostgreSQL moves rows between partitions on UPDATE). A claim sets expires_at to at least the lease's end,
# so no in-flight lease outlives its partition. Records beyond the partitions created ahead land in a DEFAULT
# partition and are moved out when their day's partition is created.
#
# Uniqueness of (tenant, key) across partitions. A unique index on a partitioned table must contain the partition
# key, so (tenant, key, expires_at) would let a claim at 23:59:59.999 (expiring in day D) and a retry at
# 00:00:00.001 (expiring in day D+1) both insert. Instead every write of a record runs in a function that first
# takes a transaction-scoped advisory lock on a 64-bit hash of (tenant, key): writers of one key queue on it, and
# each statement after the lock takes a fresh snapshot (plpgsql, READ COMMITTED), so the lookup across all
# partitions sees whatever the previous holder committed, whichever day it landed in. The lock is released at
# commit, which for a single autocommitted SELECT is right after the function returns: still one round trip.
# A hash collision only makes two unrelated keys queue behind each other. Rejected alternatives: a key-derived
# partition key (hash partitions cannot be dropped by day), and an unpartitioned key registry (a second table
# with its own row-by-row expiry: exactly the DELETE traffic partitions are meant to avoid).
PARTITION_DAYS_AHEAD = 7  # partitions created ahead: TTLs up to a week never touch the default partition
DEFAULT_PARTITION = f"{TABLE}_pdefault"
DDL_LOCK_TIMEOUT = "1s"  # partition DDL waits at most this for its lock, so claims never queue behind it long

_KEY_LOCK = "PERFORM pg_advisory_xact_lock(hashtextextended(p_tenant || chr(31) || p_key, 0));"
_NOTIFY = "IF n > 0 AND p_channel IS NOT NULL THEN PERFORM pg_notify(p_channel, p_payload); END IF;"

PARTITIONED_SCHEMA = f"""
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
    expires_at       timestamptz NOT NULL
) PARTITION BY RANGE (expires_at);
CREATE INDEX {TABLE}_tenant_key ON {TABLE} (tenant, key);
CREATE TABLE {DEFAULT_PARTITION} PARTITION OF {TABLE} DEFAULT;
"""

_COMPLETE_ROW = f"""UPDATE {TABLE} SET state = 'completed', status = p_status, headers = p_headers, body = p_body,
           body_stored = p_body_stored, completed_at = now(), expires_at = now() + make_interval(secs => p_ttl),
           lease_token = NULL, lease_expires_at = NULL
     WHERE tenant = p_tenant AND key = p_key AND lease_token = p_token AND state = 'in_flight'"""

PARTITIONED_FUNCTIONS = f"""
CREATE OR REPLACE FUNCTION idemproxy_claim(
    p_tenant text, p_key text, p_fp text, p_token text, p_lease double precision, p_ttl double precision,
    p_now timestamptz DEFAULT NULL)  -- p_now: tests only, to stand at a chosen instant (midnight)
RETURNS TABLE (rec {TABLE}, owned boolean, db_now timestamptz) LANGUAGE plpgsql AS $$
DECLARE
    t timestamptz := coalesce(p_now, now());
    r {TABLE};
    kind text;
    until timestamptz;
BEGIN
    {_KEY_LOCK}
    SELECT * INTO r FROM {TABLE} x WHERE x.tenant = p_tenant AND x.key = p_key;
    IF NOT FOUND THEN
        kind := 'new';
    ELSIF r.state = 'in_flight' AND r.lease_expires_at <= t AND r.fingerprint = p_fp AND r.claim_kind <> 'grace'
    THEN
        -- The first claim to find the lease run out gives it TAKEOVER_GRACE more, once: the owner may still land
        -- its completion (base.TAKEOVER_GRACE). The token stays, so that completion is not refused.
        -- Counted from when it is written, not from t (the transaction's start, maybe long before the key's lock
        -- was had): otherwise a claim that queued on the lock would write a grace already (partly) over. Read once:
        -- the lease and the expiry end at the same instant (the takeover after it is then counted as one).
        until := greatest(t, clock_timestamp()) + {_GRACE};
        UPDATE {TABLE} x SET lease_expires_at = until, claim_kind = 'grace', expires_at = greatest(x.expires_at, until)
         WHERE x.tenant = p_tenant AND x.key = p_key
        RETURNING * INTO r;
        RETURN QUERY SELECT r, false, t;
        RETURN;
    ELSIF (r.expires_at <= t AND NOT (r.state = 'in_flight' AND r.lease_expires_at > t))
       OR (r.state = 'in_flight' AND r.lease_expires_at <= t AND r.fingerprint = p_fp) THEN
        -- An in-flight record whose ttl ended no later than its lease stood for its lease: the same request
        -- after it takes the record over (a second execution, maybe), whatever its ttl said.
        kind := CASE WHEN r.state = 'in_flight'
                          AND (r.expires_at > t OR (r.fingerprint = p_fp AND (r.expires_at <= r.lease_expires_at
                                                                               OR r.claim_kind = 'grace')))
                     THEN 'takeover' ELSE 'expired' END;
        DELETE FROM {TABLE} x WHERE x.tenant = p_tenant AND x.key = p_key;
    ELSE
        RETURN QUERY SELECT r, false, t;
        RETURN;
    END IF;
    INSERT INTO {TABLE} (tenant, key, fingerprint, state, lease_token, lease_expires_at, claim_kind,
                         created_at, expires_at)
    VALUES (p_tenant, p_key, p_fp, 'in_flight', p_token, t + make_interval(secs => p_lease), kind, t,
            t + make_interval(secs => greatest(p_ttl, p_lease)))
    RETURNING * INTO r;
    RETURN QUERY SELECT r, true, t;
END $$;

CREATE OR REPLACE FUNCTION idemproxy_complete(
    p_tenant text, p_key text, p_token text, p_status integer, p_headers text, p_body bytea,
    p_body_stored boolean, p_ttl double precision, p_expires timestamptz, p_channel text DEFAULT NULL,
    p_payload text DEFAULT NULL)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE n integer;
BEGIN
    {_KEY_LOCK}
    -- p_expires, the expires_at the claim returned, prunes the UPDATE to that day's partition (measured: a third
    -- of the statement's cost). Only a missing match pays for looking through every partition.
    {_COMPLETE_ROW} AND expires_at BETWEEN p_expires - interval '1 second' AND p_expires + interval '1 second';
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n = 0 THEN
        {_COMPLETE_ROW};
        GET DIAGNOSTICS n = ROW_COUNT;
    END IF;
    {_NOTIFY}
    RETURN n;
END $$;

CREATE OR REPLACE FUNCTION idemproxy_release(
    p_tenant text, p_key text, p_token text, p_channel text DEFAULT NULL, p_payload text DEFAULT NULL)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE n integer;
BEGIN
    {_KEY_LOCK}
    DELETE FROM {TABLE} WHERE tenant = p_tenant AND key = p_key AND lease_token = p_token;
    GET DIAGNOSTICS n = ROW_COUNT;
    {_NOTIFY}
    RETURN n;
END $$;

CREATE OR REPLACE FUNCTION idemproxy_forget(
    p_tenant text, p_key text, p_channel text DEFAULT NULL, p_payload text DEFAULT NULL)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE n integer;
BEGIN
    {_KEY_LOCK}
    DELETE FROM {TABLE} WHERE tenant = p_tenant AND key = p_key;
    GET DIAGNOSTICS n = ROW_COUNT;
    {_NOTIFY}
    RETURN n;
END $$;
"""

# Group commit (store/batch.py): the claims, or the completions, of concurrent requests in one statement and one
# transaction, each decided as the per-key function above decides it (the claims of keys no record stands for, and
# of keys whose record stands, are decided for the whole batch in one statement; every other call runs the per-key
# function). Keys are taken in one global order (the hash their advisory lock is named by), so two batches, or a
# batch and a single-key call, never wait on each other in a cycle. The same key twice in one batch is applied in
# queue order: the second sees the first's row.
BATCH_FUNCTIONS = f"""
CREATE OR REPLACE FUNCTION idemproxy_claim_many(
    p_tenants text[], p_keys text[], p_fps text[], p_tokens text[], p_leases double precision[],
    p_ttls double precision[])
RETURNS TABLE (idx integer, rec {TABLE}, owned boolean, db_now timestamptz) LANGUAGE plpgsql AS $$
DECLARE
    i integer;
    h bigint;
    v_now timestamptz := now();
    done integer[];
    done_rows {TABLE}[];
    done_owned boolean[];
BEGIN
    -- Every key's lock first, in the global order (the per-key calls below take them again: a transaction holds
    -- an advisory lock once taken), so the statement after them sees whatever their last holders committed.
    FOR h IN SELECT DISTINCT hashtextextended(a.t || chr(31) || a.k, 0) FROM unnest(p_tenants, p_keys) AS a(t, k)
              ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(h);
    END LOOP;
    -- One statement decides the two common cases for the whole batch, exactly as idemproxy_claim would one call at
    -- a time (the executor's start-up is most of a small statement, and the per-key path costs three):
    --   fresh:  no record stands for the key: created here, a row as idemproxy_claim makes one (kind 'new',
    --           counted from the transaction's start), by the key's first call in the batch;
    --   stands: a record stands that no call of the batch may replace (completed, or in flight with its lease
    --           alive, or lapsed under another payload): each call of its key is told so, as it is.
    -- Every other call (a key's later calls after its first created it, a record some call of the batch may take
    -- over or replace) goes through idemproxy_claim afterwards, in the same order as ever.
    WITH a AS (
        SELECT a.n::integer AS n, a.t, a.k, a.fp, a.tok, a.lease, a.ttl
          FROM unnest(p_tenants, p_keys, p_fps, p_tokens, p_leases, p_ttls) WITH ORDINALITY
               AS a(t, k, fp, tok, lease, ttl, n)
    ), seen AS (
        -- (LATERAL ... LIMIT 1: one lookup per call by the (tenant, key) index of each partition, as the planner
        -- judges them: a partition it believes tiny may be read whole)
        SELECT a.*, x.r,
               row_number() OVER (PARTITION BY a.t, a.k ORDER BY a.n) AS nth,
               -- idemproxy_claim's test for taking a record over or replacing it (NULL, as in its IF: no)
               bool_or(coalesce(((x.r).expires_at <= v_now
                                 AND NOT ((x.r).state = 'in_flight' AND (x.r).lease_expires_at > v_now))
                             OR ((x.r).state = 'in_flight' AND (x.r).lease_expires_at <= v_now
                                 AND (x.r).fingerprint = a.fp), false))
                   OVER (PARTITION BY a.t, a.k) AS replaceable
          FROM a LEFT JOIN LATERAL (SELECT y AS r FROM {TABLE} y WHERE y.tenant = a.t AND y.key = a.k LIMIT 1) x
            ON true
    ), fresh AS (
        SELECT s.* FROM seen s WHERE (s.r).tenant IS NULL AND s.nth = 1
    ), made AS (
        INSERT INTO {TABLE} AS r (tenant, key, fingerprint, state, lease_token, lease_expires_at, claim_kind,
                                  created_at, expires_at)
        SELECT f.t, f.k, f.fp, 'in_flight', f.tok, v_now + make_interval(secs => f.lease), 'new', v_now,
               v_now + make_interval(secs => greatest(f.ttl, f.lease))
          FROM fresh f
        RETURNING r AS made_row
    )
    SELECT coalesce(array_agg(o.n), '{{}}'), array_agg(o.r), array_agg(o.mine) INTO done, done_rows, done_owned
      FROM (SELECT f.n, m.made_row AS r, true AS mine
              FROM made m JOIN fresh f ON f.t = (m.made_row).tenant AND f.k = (m.made_row).key
            UNION ALL
            SELECT s.n, s.r, false FROM seen s WHERE (s.r).tenant IS NOT NULL AND NOT s.replaceable) AS o;
    -- An owner's clock is the transaction's start, which its lease was counted from; a record that stands is
    -- judged (a cached copy's lifetime, lease_expires_in) by the clock when it was read, later in the batch.
    RETURN QUERY SELECT done[j], done_rows[j], done_owned[j],
                        CASE WHEN done_owned[j] THEN v_now ELSE clock_timestamp() END
                   FROM generate_subscripts(done, 1) AS j;
    IF cardinality(done) = cardinality(p_keys) THEN
        RETURN;
    END IF;
    -- Every other call, as idemproxy_claim decides it, in the same order as ever.
    FOR i IN SELECT u.n::integer FROM unnest(p_tenants, p_keys) WITH ORDINALITY AS u(t, k, n)
              WHERE NOT (u.n::integer = ANY(done))
              ORDER BY hashtextextended(u.t || chr(31) || u.k, 0), u.n LOOP
        -- An owner's clock is the transaction's start, which its lease was counted from; a record that stands is
        -- judged (a cached copy's lifetime, lease_expires_in) by the clock when it was read, later in the batch.
        RETURN QUERY SELECT i, c.rec, c.owned, CASE WHEN c.owned THEN c.db_now ELSE clock_timestamp() END
          FROM idemproxy_claim(p_tenants[i], p_keys[i], p_fps[i], p_tokens[i], p_leases[i], p_ttls[i]) AS c;
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION idemproxy_complete_many(
    p_tenants text[], p_keys text[], p_tokens text[], p_statuses integer[], p_headers text[], p_bodies bytea[],
    p_body_stored boolean[], p_ttls double precision[], p_expires timestamptz[], p_channel text DEFAULT NULL,
    p_payloads text[] DEFAULT NULL)
RETURNS TABLE (idx integer, changed integer) LANGUAGE plpgsql AS $$
DECLARE i integer;
BEGIN
    FOR i IN SELECT u.n::integer FROM unnest(p_tenants, p_keys) WITH ORDINALITY AS u(t, k, n)
              ORDER BY hashtextextended(u.t || chr(31) || u.k, 0), u.n LOOP
        idx := i;
        changed := idemproxy_complete(p_tenants[i], p_keys[i], p_tokens[i], p_statuses[i], p_headers[i],
                                      p_bodies[i], p_body_stored[i], p_ttls[i], p_expires[i], p_channel,
                                      p_payloads[i]);
        RETURN NEXT;
    END LOOP;
END $$;
"""

_P_CLAIM = "SELECT (c.rec).*, c.owned, c.db_now FROM idemproxy_claim($1, $2, $3, $4, $5, $6) AS c"
_P_CLAIM_MANY = (
    "SELECT c.idx, (c.rec).*, c.owned, c.db_now FROM idemproxy_claim_many($1, $2, $3, $4, $5, $6) AS c"
)
_P_COMPLETE_MANY = (
    "SELECT c.idx, c.changed FROM idemproxy_complete_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) AS c"
)
# A batch of one call (every call at low load) runs the per-key function the batch functions loop over, and returns
# the same columns: no arrays to encode (asyncpg checks each element against collections.abc) and no loop to plan.
# The claim's db_now rule is idemproxy_claim_many's, copied: a migration changing one must change both (pinned by
# tests/test_batch.py::test_an_owner_counts_from_its_transaction_start_a_standing_record_from_when_it_was_read).
_P_CLAIM_ONE = (
    "SELECT 1 AS idx, (c.rec).*, c.owned, CASE WHEN c.owned THEN c.db_now ELSE clock_timestamp() END AS db_now "
    "FROM idemproxy_claim($1, $2, $3, $4, $5, $6) AS c"
)
_P_COMPLETE_ONE = "SELECT 1 AS idx, idemproxy_complete($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) AS changed"
# One statement timeout or cut fails every call of its batch, so batches stay small: at most this many calls, and
# completions at most BATCH_BYTES of stored answers (a larger single answer goes alone).
BATCH_MAX = 64
BATCH_BYTES = 4 * 1024 * 1024
BATCHES_IN_FLIGHT = 2  # statements of one kind on the wire at once; calls made meanwhile wait for the next
# Connections a batch leaves aside for the next batch instead of giving them back to the pool (a checkout and
# release cost about 30 us of CPU, half a small statement's): at most one per batch on the wire, never the pool's
# last one, none while another operation waits for a connection, all given back when one finds the pool empty (a
# release, a read or a health check never waits for them), and one not used again within SPARE_IDLE seconds goes
# back.
SPARE_IDLE = 1.0
_P_CHANGE = {
    "complete": "SELECT idemproxy_complete($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    "release": "SELECT idemproxy_release($1, $2, $3, $4, $5)",
    "forget": "SELECT idemproxy_forget($1, $2, $3, $4)",
}


def _counted(statement: str, params: int, notify: bool) -> str:
    """``statement`` returning how many rows it changed; with ``notify``, it also NOTIFYs once per changed
    row (parameters ``$params+1``, ``$params+2``: channel and payload), in the same round trip."""
    per_row = f"pg_notify(${params + 1}, ${params + 2})" if notify else "1"
    return f"WITH changed AS ({statement} RETURNING 1) SELECT count(*) FROM (SELECT {per_row} FROM changed) AS c"


# Bounded batch; SKIP LOCKED keeps the sweeper off rows a claim is updating right now. ``standing``: the in-flight
# records kept though their ttl has passed.
def _sweep(table: str, standing: str) -> str:
    return f"""
DELETE FROM {table} WHERE ctid IN (
    SELECT ctid FROM {table}
     WHERE expires_at <= now()
       AND NOT (state = 'in_flight' AND ({standing}))
     LIMIT $1 FOR UPDATE SKIP LOCKED)
"""


# A lapsed in-flight record past its ttl (a ttl shorter than the lease, or an owner that never came back) is not
# deleted before it has had its TAKEOVER_GRACE, as a claim would give it: its owner may be alive, holding the executed
# answer, its completion retried at most 0.5 s apart after the store was away longer than the lease. A sweep that
# deleted it outright would let the next retry find no record and execute again. The sweep gives it the grace (as
# the claim's "graced" step does), and a later sweep deletes it.
_SWEEP_GRACE = f"""
UPDATE {TABLE} AS g SET lease_expires_at = now() + {_GRACE}, claim_kind = 'grace',
       expires_at = greatest(g.expires_at, now() + {_GRACE})
 WHERE ctid IN (
    SELECT ctid FROM {TABLE}
     WHERE expires_at <= now() AND state = 'in_flight' AND lease_expires_at <= now() AND claim_kind <> 'grace'
     LIMIT $1 FOR UPDATE SKIP LOCKED)
"""
_SWEEP = _sweep(TABLE, "lease_expires_at > now() OR claim_kind <> 'grace'")

# The daily layout deletes row by row only in the default partition (records beyond the partitions created ahead,
# or left over from before a conversion): normally empty, and what it holds expires days ahead (no grace there).
_SWEEP_DEFAULT = _sweep(DEFAULT_PARTITION, "lease_expires_at > now()")

_DB_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, asyncio.TimeoutError)
# The request's own data was refused (a value too long to index, say): permanent, so never "unavailable".
_DATA_ERRORS = (asyncpg.DataError, asyncpg.ProgramLimitExceededError)  # on a claim: the key or tenant itself
LISTEN_RETRY = 1.0  # seconds between attempts to re-establish LISTEN after its connection was lost
# A server restarting, failing over or full, by SQLSTATE: 08 connection, 57 starting or shutting down (or a
# statement cancelled: a migration lock waited on past the timeout), 53 out of resources, 25006 a standby (read-only)
# where a primary is wanted.
_TRANSIENT_AT_CONNECT = (asyncpg.PostgresConnectionError, asyncpg.OperatorInterventionError,
                         asyncpg.InsufficientResourcesError, asyncpg.ReadOnlySQLTransactionError)
# Raised by the driver before or without the server: the DSN's own options, its certificate files, TLS. (Not
# FileNotFoundError: that is also a unix socket whose server is not up yet.)
_REFUSED_BY_CLIENT = (asyncpg.ClientConfigurationError, ssl.SSLError, PermissionError, IsADirectoryError)
# Every failure connecting can raise: a multi-host DSN whose hosts are none of the kind asked (a failover) is
# neither a PostgreSQL nor an interface error.
_CONNECT_ERRORS = (*_DB_ERRORS, ConnectionError, asyncpg.exceptions.TargetServerAttributeNotMatched)
OPEN_RETRY_FIRST = 0.5  # seconds before the first attempt to open a store that was unreachable at start
OPEN_RETRY_MAX = 5.0  # seconds between attempts at most (the wait doubles from OPEN_RETRY_FIRST)
OPEN_WARN_INTERVAL = 60.0  # seconds between warnings that it is still not reachable
LISTEN_PING = 1.0  # seconds between signs of life asked of the LISTEN connection (a SELECT 1), and its timeout
# After a statement of ours got no answer in its time, the pool's other connections are replaced (the idle ones at
# once, those in use when given back), at most once per this many seconds (see PostgresStore._silent).
EXPIRE_INTERVAL = OPERATION_TIMEOUT
# A statement on the wire this long with no answer is one the server would have cancelled itself and said so
# (STATEMENT_TIMEOUT, and a margin for the answer's way back): a claim that ran out of its time sooner (it waited
# for a pooled connection first) tells nothing of the server.
SILENT_AFTER = STATEMENT_TIMEOUT + 0.25
# A claim whose connection was lost once its statement was written (cut, or ended by the server: its goodbye read
# after the write) may have landed, its reply lost. It is asked again with the same token (PostgresStore._claim_again)
# while this much of its OPERATION_TIMEOUT is left: the server gives up on the new statement (STATEMENT_TIMEOUT after
# it arrives) before the claim's caller does, as on the first, so none lands after its caller was told it failed and
# had it released. In practice: a connection lost within 0.25 s of the call, which is how a cut or a goodbye fails.
CLAIM_AGAIN_WITHIN = SILENT_AFTER
# Those losses: the connection's end as the driver or the OS tells it, or the server's own goodbye (57P01 an operator
# or a failover, 57P02 a crash, 57P05 idle_session_timeout). Not a timeout, and not an error the server answered with
# (read-only after a demotion, a permission, a statement timeout): the statement is then known to have rolled back,
# and asking again on a new connection would only fail the same way.
_LOST = (asyncpg.PostgresConnectionError, asyncpg.AdminShutdownError, asyncpg.CrashShutdownError,
         asyncpg.IdleSessionTimeoutError, ConnectionError)


def _lost(exc: StoreUnavailable) -> bool:
    """Whether a claim failed by losing its connection once its statement was written (``_LOST``): it may have
    landed, and may be asked again."""
    return exc.maybe_applied and isinstance(exc.__cause__, _LOST)
# Unacknowledged data ends a connection after this long (base.keep_alive): past the driver's own timeout, so a
# statement with no answer is still told by that (PostgresStore._silent), and the kernel ends what it leaves.
USER_TIMEOUT = OPERATION_TIMEOUT + 1


def _count_at_most(setting: str, value: int) -> str:
    """``set_config(setting)`` to ``value``, unless the session already has a smaller one. 0 is the system's, and
    -1 the system's unknown to the server (tcp_keepalives_idle and _interval on Windows, always): both replaced,
    -1 never set back (out of the setting's range: the statement, and so every pooled connection, would fail)."""
    return (f"set_config('{setting}', CASE WHEN current_setting('{setting}')::int <= 0 "
            f"OR current_setting('{setting}')::int > {value} THEN '{value}' ELSE current_setting('{setting}') END, "
            "false)")


# One statement as each pooled connection opens. The timeouts above; and the server's own TCP keepalive on our
# session, as ours on its (base.keep_alive): a replica that went dark holding a session-level advisory lock (partition
# maintenance, migrations at start) or a connection slot is let go in seconds, not after the server's two hours.
# (Over a unix socket the server ignores them. tcp_user_timeout came in PostgreSQL 12.)
_KEEPALIVES = (
    f"{_count_at_most('tcp_keepalives_idle', KEEPALIVE_IDLE)}, "
    f"{_count_at_most('tcp_keepalives_interval', KEEPALIVE_INTERVAL)}, "
    f"{_count_at_most('tcp_keepalives_count', KEEPALIVE_COUNT)}, "
    f"CASE WHEN current_setting('server_version_num')::int >= 120000 "
    f"THEN {_count_at_most('tcp_user_timeout', int(USER_TIMEOUT * 1000))} END"
)
_SESSION_SQL = (
    f"SELECT {_at_most('statement_timeout', STATEMENT_TIMEOUT)}, "
    f"{_at_most('idle_in_transaction_session_timeout', IDLE_IN_TRANSACTION_TIMEOUT)}, {_KEEPALIVES}"
)
# The connections not pooled: the keepalives alone. ``idemproxy migrate``'s (a conversion's statements run long),
# so an operator's machine gone dark mid-migration lets go of the migration lock, which every replica starting
# waits for, in seconds; and the LISTEN connection's, so a replica gone dark frees its connection slot.
_KEEPALIVE_SQL = f"SELECT {_KEEPALIVES}"
LISTEN_LIVE_WINDOW = 2.5  # seconds without an answer on it after which notifications count as lost


async def _no_reset(_conn: Any) -> None:
    """Skip asyncpg's reset query on every release: it would cost a round trip per operation, and this
    store leaves no session state behind (no LISTEN, cursors or session-level locks on pool connections)."""


# A queued claim: tenant, key, fingerprint, token, lease, ttl.
_ClaimCall = tuple[str, str, str, str, float, float]
# A claim's row, and when its statement was first written (monotonic): the lease is counted from then (Claim.sent).
_Claimed = tuple[Any, float]
# A queued completion: tenant, key, token, status, headers, body, body stored, ttl, expiry seen, notify payload.
_CompleteCall = tuple[str, str, str, int, str, bytes, bool, float, datetime, str | None]


def _claim_statement(calls: list[_ClaimCall]) -> tuple[str, list[Any]]:
    if len(calls) == 1:
        return _P_CLAIM_ONE, list(calls[0])
    return _P_CLAIM_MANY, [list(column) for column in zip(*calls, strict=True)]


async def _claimed(conn: Any, statement: str, *args: Any) -> Any:
    """The one-statement claim's row (``PostgresStore._claim``)."""
    for _ in range(5):  # see the race described at _CLAIM
        row = await conn.fetchrow(statement, *args)
        if row is not None:
            return row
    raise StoreUnavailable("The idempotency store could not settle a claim.")


def _epoch(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _record(row: Any, codec: Codec) -> Record:
    response = None
    if row["status"] is not None:
        headers, body = codec.from_columns(row["tenant"], row["key"], row["headers"], row["body"],
                                           backend=PostgresStore.backend,
                                           outcome=(row["status"], bool(row["body_stored"]), row["fingerprint"]))
        response = StoredResponse(status=row["status"], headers=headers, body=body if row["body_stored"] else None)
    elif row["state"] == State.COMPLETED.value:
        raise codec.without_status(row["tenant"], row["key"], row["body"], backend=PostgresStore.backend)
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


def _own(row: Any, token: str) -> bool:
    """Whether the record a claim met is its own: in flight under its token, its lease alive (not in a grace
    another claim gave it). Only a claim asked again can meet one (PostgresStore.claim): its first try landed, its
    reply lost. Tokens are unique to a claim, and a record keeps its token until completed, released or replaced."""
    return bool(row["state"] == State.IN_FLIGHT.value and row["lease_token"] == token
                and row["claim_kind"] != "grace" and row["lease_expires_at"] > row["db_now"])


class _EndedInSetUp(Exception):
    """The server ended a connection the pool had opened, during its set-up (``_init_connection``): an operator or a
    failover ending every session as it came. (One that closes before the set-up, as a TCP front with no server
    behind it does, is not one: that is a failure to connect, and a 503.)"""


class _Unsent(StoreUnavailable):
    """A pooled connection the server had ended while it sat idle (pg_terminate_backend, idle_session_timeout, a
    restart or failover, a pooler recycling it): the driver had read the server's goodbye, not yet the socket's
    close, and refused the operation before sending any of it. Nothing reached the server: the operation may run
    again on another connection (``PostgresStore._live``)."""

    def __init__(self, detail: str = "The idempotency store (PostgreSQL) is unavailable.") -> None:
        super().__init__(detail, maybe_applied=False)  # (a detail: the batcher copies it for each caller)


def _unsent(exc: BaseException) -> bool:
    """Whether the driver refused an operation before writing any of it, its connection already dead: the
    protocol left mid-state by a message the server sent unasked (its FATAL goodbye), or the connection
    closed. (A connection that failed after its statement was written is never one: that statement may have been
    applied, its reply lost.)"""
    if isinstance(exc, asyncpg.InternalClientError):
        said = str(exc)
        return said.startswith("cannot switch to state") or said == "not connected"
    return isinstance(exc, asyncpg.InterfaceError) and str(exc).endswith("connection is closed")


def _unavailable(
    operation: str, exc: BaseException, *, maybe_applied: bool = True, quiet: bool = False
) -> StoreUnavailable:
    if not quiet:  # (quiet: the caller says it, as the background opener does once a minute)
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


def _partition_name(day: date) -> str:
    return f"{TABLE}_p{day:%Y%m%d}"


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


async def layout(conn: Any) -> str | None:
    """The records table as it is: ``daily`` (partitioned), ``none`` (one table), or None (no schema yet)."""
    kind = await conn.fetchval("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)", TABLE)
    return None if kind is None else ("daily" if kind == "p" else "none")


async def _db_today(conn: Any) -> date:
    today: date = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    return today


async def _partitions(conn: Any) -> list[str]:
    rows = await conn.fetch(
        "SELECT c.relname::text AS name FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = to_regclass($1) ORDER BY 1", TABLE,
    )
    return [row["name"] for row in rows]


async def create_partition(conn: Any, day: date) -> bool:
    """Create the partition of records expiring on ``day`` (UTC) unless it exists; True when created.

    Rows of that day already in the default partition are moved into it first (ATTACH would refuse otherwise).
    The whole table is locked meanwhile, before anything else, so no statement can miss a row in transit: locking
    only the default partition let a claim planned before the ATTACH (its partition list read then) wait on the
    default partition, read it after the move and find the record in neither place (a second execution). A claim
    waiting on the table lists the partitions once it has it. The pause is that of the move and the ATTACH's scan
    of the default partition, normally empty; DROP of a passed day takes the same lock."""
    name = _partition_name(day)
    if await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", name):
        return False
    low, high = _midnight(day), _midnight(day + timedelta(days=1))
    async with conn.transaction():
        await conn.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
        await conn.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
        await conn.execute(f"CREATE TABLE {name} (LIKE {TABLE} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
        await conn.execute(
            f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} WHERE expires_at >= $1 AND expires_at < $2 "
            f"RETURNING {_COLUMNS}) INSERT INTO {name} ({_COLUMNS}) SELECT {_COLUMNS} FROM moved", low, high,
        )
        await conn.execute(
            f"ALTER TABLE {TABLE} ATTACH PARTITION {name} "
            f"FOR VALUES FROM ('{low.isoformat()}') TO ('{high.isoformat()}')"
        )
    return True


@dataclass(frozen=True)
class Maintenance:
    """What one partition maintenance pass did."""

    created: tuple[str, ...]
    dropped: tuple[str, ...]
    rows_dropped: int  # estimated (pg_class.reltuples): counting would read the whole partition
    partitions: int  # daily partitions standing afterwards


async def maintain_partitions(conn: Any, today: date | None = None) -> Maintenance:
    """Create the partitions of today and the next PARTITION_DAYS_AHEAD days; drop every partition whose day has
    passed (each record in it has expired: expires_at < its day's end <= now). Run by one replica at a time.

    A step that cannot get its lock within DDL_LOCK_TIMEOUT (a long transaction holds the table) is skipped with
    a warning and tried again at the next pass: it is not a store failure."""
    today = today or await _db_today(conn)
    days = [today + timedelta(days=n) for n in range(PARTITION_DAYS_AHEAD + 1)]
    created = [
        _partition_name(day) for day in days
        if await _in_time(create_partition(conn, day), f"create {_partition_name(day)}")
    ]
    dropped: list[str] = []
    rows = 0
    for name in await _partitions(conn):
        if name == DEFAULT_PARTITION or name >= _partition_name(today):  # names sort as their days
            continue
        estimate = await _in_time(_drop_partition(conn, name), f"drop {name}")
        if estimate is not None:
            rows += estimate
            dropped.append(name)
    standing = sum(1 for name in await _partitions(conn) if name != DEFAULT_PARTITION)
    return Maintenance(tuple(created), tuple(dropped), rows, standing)


async def _drop_partition(conn: Any, name: str) -> int:
    """DROP one partition; returns its estimated row count (pg_class.reltuples: counting would read it all)."""
    async with conn.transaction():
        # DROP of a partition locks the parent briefly; the timeout keeps claims from queueing behind a DROP that
        # itself waits on a long transaction.
        await conn.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
        rows = await conn.fetchval("SELECT reltuples FROM pg_class WHERE oid = $1::regclass", name)
        await conn.execute(f"DROP TABLE {name}")
    return int(max(rows, 0))


async def _in_time(step: Awaitable[T], what: str) -> T | None:
    try:
        return await step
    except asyncpg.LockNotAvailableError:
        log.warning("partition maintenance: %s waited over %s for its lock; retried at the next sweep",
                    what, DDL_LOCK_TIMEOUT)
        return None


async def _convert_to_daily(conn: Any) -> None:
    """Turn the single table into the daily-partitioned one, in one transaction: every record is copied exactly
    once (writers are locked out until commit, then see the new table), and the old table is dropped."""
    old = f"{TABLE}_unpartitioned"
    async with conn.transaction():
        await conn.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
        await conn.execute(f"ALTER TABLE {TABLE} RENAME TO {old}")
        await conn.execute(PARTITIONED_SCHEMA)
        today = await _db_today(conn)
        await maintain_partitions(conn, today)  # records that expired before today go to default, swept by rows
        copied = int((await conn.execute(f"INSERT INTO {TABLE} ({_COLUMNS}) SELECT {_COLUMNS} FROM {old}")).split()[-1])
        await conn.execute(f"DROP TABLE {old}")
    if copied:  # an operator's conversion of a table in use: worth a warning
        log.warning("converted %s to daily partitions (%d records)", TABLE, copied)
    else:  # a new schema (or an empty table): nothing to warn about on a first start
        log.info("%s laid out in daily partitions", TABLE)


async def migrate(conn: Any, partitions: str = "daily", *, convert: bool = True) -> list[int]:
    """Apply the missing migrations under an advisory lock (safe when replicas start together).

    With ``partitions`` daily, a new (or empty) single table becomes partitioned; one holding records is converted
    only when ``convert`` (``idemproxy migrate``), never by a replica starting up. ``none`` keeps one table."""
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
        await _apply_layout(conn, partitions, convert)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
    return applied


async def _apply_layout(conn: Any, partitions: str, convert: bool) -> None:
    current = await layout(conn)
    if partitions == "daily" and current == "none":
        if convert or not await conn.fetchval(f"SELECT EXISTS (SELECT 1 FROM {TABLE})"):
            await _convert_to_daily(conn)
            current = "daily"
        else:
            log.warning("storage.postgres.partitions is daily but %s is one table holding records: it stays so "
                        "until `idemproxy migrate` converts it", TABLE)
    elif partitions == "none" and current == "daily":
        log.warning("storage.postgres.partitions is none but %s is partitioned: partitions are kept (there is "
                    "no conversion back)", TABLE)
    if current == "daily":
        await conn.execute(PARTITIONED_FUNCTIONS)  # CREATE OR REPLACE: a newer version's functions win
        await conn.execute(BATCH_FUNCTIONS)


def server_of(dsn: str) -> str:
    """``PostgreSQL at host:port`` as the driver would read it (never the user or password), for messages.

    As libpq and asyncpg do, a host or port the URL leaves out comes from its ``?host=`` / ``?port=`` options,
    then from PGHOST / PGPORT; a unix socket, or several hosts, are named only as ``PostgreSQL``."""
    try:
        parts = urlsplit(dsn)
        options = parse_qs(parts.query)
        host: str | None = parts.hostname or _last(options.get("host")) or os.environ.get("PGHOST")
        port: object = parts.port or _last(options.get("port")) or os.environ.get("PGPORT") or 5432
    except ValueError:
        return "PostgreSQL"
    if not host or host.startswith("/") or "," in host or "," in str(port):
        return "PostgreSQL"
    return f"PostgreSQL at {f'[{host}]' if ':' in host else host}:{port}"


def _last(values: list[str] | None) -> str | None:
    return values[-1] if values else None


def unreachable(exc: BaseException | None) -> bool:
    """Whether a failed connect means the server could not be reached, or could not take us yet (a refused, reset
    or timed-out connection, a name that does not resolve, a server starting up or out of connections): worth
    waiting for. False when it answered and refused what the DSN asks (credentials, a database that does not
    exist): a configuration error, which no wait mends."""
    if isinstance(exc, asyncpg.PostgresError):
        return isinstance(exc, _TRANSIENT_AT_CONNECT)
    if isinstance(exc, _REFUSED_BY_CLIENT) or (type(exc) is ConnectionError and "rejected SSL upgrade" in str(exc)):
        return False  # the DSN's own options (sslmode, a certificate file) or a server without TLS where it asks
    if isinstance(exc, OSError) and _reading_the_dsn(exc):
        return False  # a file the DSN names (sslrootcert, sslcert, sslkey) that is not there: no wait mends it
    return isinstance(exc, _CONNECT_ERRORS)


def _reading_the_dsn(exc: BaseException) -> bool:
    """Whether ``exc`` came from the driver reading the DSN and the files it names, before any connection was
    tried (a missing ``sslrootcert`` is a FileNotFoundError, as a unix socket not there yet is, but from there)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_parse_connect_dsn_and_args":
            return True
        tb = tb.tb_next
    return False


def _refusal(exc: BaseException) -> str:
    """What a connect that ``unreachable`` calls a configuration error says, after the server's name."""
    said = "refused the connection" if isinstance(exc, asyncpg.PostgresError) else "cannot be connected to"
    if isinstance(exc, OSError) and _reading_the_dsn(exc):
        said = "cannot be connected to: a file the DSN names (sslrootcert, sslcert, sslkey) cannot be read"
    return f"{said}: {exc} ({type(exc).__name__}; check storage.postgres.dsn)"


def _not_opened(what: str, exc: BaseException) -> str:
    """What a server that was reached, but on which the store could not be set up (the migrations refused), said."""
    rights = " and its role's rights" if isinstance(exc, asyncpg.PostgresError) else ""  # (the server said no)
    return f"{what} could not be opened: {exc} ({type(exc).__name__}; check storage.postgres.dsn{rights})"


async def connect_with_retries(
    connect: Callable[[], Any], what: str, attempts: int = 5, delay: float = 0.5
) -> Any:
    """Open a connection or pool, retrying a few times with backoff and a log line for each failure. A server
    that answers and refuses (``unreachable`` is False) is not asked again: the error names what it said."""
    for attempt in range(1, attempts + 1):
        try:
            return await connect()
        except _CONNECT_ERRORS as exc:
            if not unreachable(exc):
                raise StoreUnavailable(f"{what} {_refusal(exc)}", maybe_applied=False) from exc
            if attempt == attempts:
                raise StoreUnavailable(f"{what} is not reachable after {attempts} attempts "
                                       f"({type(exc).__name__}; check storage.postgres.dsn)",
                                       maybe_applied=False) from exc
            attempts_log.warning("%s not reachable (attempt %d/%d): %s", what, attempt, attempts,
                                 type(exc).__name__)
            await asyncio.sleep(delay * attempt)
    raise AssertionError("unreachable")


class PostgresStore(Store):
    backend = "postgres"
    # The server ends a statement STATEMENT_TIMEOUT after it arrived, and a margin for its way there. (Not a bound
    # on a commit that stalls, as on a synchronous standby gone, nor on a pooler queueing the statement first.)
    claim_settled_within = STATEMENT_TIMEOUT + 0.5

    def __init__(
        self, config: PostgresConfig, metrics: Metrics | None = None, *, listen: bool = False,
        codec: Codec | None = None, wait_for_server: bool = False,
    ) -> None:
        super().__init__(metrics)
        self.config = config
        self.codec = codec or Codec()
        self.listen = listen  # LISTEN/NOTIFY wakes `wait` mode when no Redis carries notifications
        # A server still unreachable after open()'s attempts: open() returns anyway and the store opens in the
        # background once the server answers (every operation meanwhile: StoreUnavailable). Else open() raises.
        self.wait_for_server = wait_for_server
        self._pool: Any = None
        # Operations may use the pool: set once the layout is known (open() done). Before it, the SQL of the
        # wrong layout could run, and a single-table INSERT into a partitioned parent would skip the per-key lock.
        self._usable = False
        self._opening: asyncio.Task[None] | None = None
        self._listener: Any = None
        self._heard = float("-inf")  # when the LISTEN connection last answered (monotonic)
        self._listen_task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self.statements = 0  # statements sent, for diagnostics and the round-trip budget tests
        self.layout = "none"  # as found at open: "daily" (partitioned, functions) or "none" (one table)
        # Group commit (daily layout, once its batch functions exist): claims and completions of concurrent
        # requests go out together.
        self.batching = False
        self._claims: Batcher[_ClaimCall, _Claimed] = Batcher(
            self._claim_batch, max_batch=BATCH_MAX, max_in_flight=BATCHES_IN_FLIGHT, abandoned=self._unclaim,
            # bounded from the call, not from its batch leaving: queued behind stalled batches, a claim would
            # otherwise wait out their timeouts and then its own
            timeout=OPERATION_TIMEOUT)
        self._completes: Batcher[_CompleteCall, int] = Batcher(
            self._complete_batch, max_batch=BATCH_MAX, max_in_flight=BATCHES_IN_FLIGHT,
            weigh=lambda call: len(call[4]) + len(call[5]), max_weight=BATCH_BYTES)
        self._unclaiming: set[asyncio.Task[Any]] = set()
        # Pooled connections kept between batches, with when each was last used (monotonic), newest last.
        self._spares: list[tuple[Any, float]] = []
        self._max_spares = min(2 * BATCHES_IN_FLIGHT, config.pool_max - 1)
        self._waiting = 0  # operations other than batches waiting for a pooled connection
        self._spare_timer: asyncio.TimerHandle | None = None
        self._returning: set[asyncio.Task[Any]] = set()
        self._expired = float("-inf")  # when the pool's connections were last expired (monotonic)
        self._on_wire: dict[int, float] = {}  # batches whose statement was written, by id: when (monotonic)

    async def _init_connection(self, conn: Any) -> None:
        keep_alive(conn._transport, USER_TIMEOUT)  # (asyncpg has no option for it, nor a public transport)
        # A SET, not a startup parameter: connection poolers refuse startup parameters they do not know. A
        # stricter timeout the operator set (on the role, the database, the DSN's options) is kept.
        try:
            await conn.execute(_SESSION_SQL)
        except Exception as exc:
            if isinstance(exc, asyncpg.ConnectionDoesNotExistError) or _unsent(exc):
                raise _EndedInSetUp() from exc  # (the server is there: it ended this session as it began)
            raise
        conn.add_query_logger(self._count_statement)

    def _count_statement(self, _query: Any) -> None:
        self.statements += 1

    async def open(self) -> None:
        what, connected = server_of(self.config.dsn.reveal()), False
        try:
            self._pool = await connect_with_retries(self._create_pool, what)
            connected = True
            await self._set_up()  # (a failure here: connected, then lost it: a restart, a failover, a lock wait)
        except StoreUnavailable as exc:
            cause = exc.__cause__
            if not (self.wait_for_server and unreachable(cause)):
                if connected and cause is not None:  # say what the server said (a role that may not migrate)
                    raise StoreUnavailable(_not_opened(what, cause), maybe_applied=False) from cause
                raise
            said = f"{what} could not be opened ({type(cause).__name__}: {cause})" if connected else exc.detail
            log.error("%s: serving without it; requests that need the store get 503 store_unavailable until it "
                      "answers (tried again every %g s at most)", said, OPEN_RETRY_MAX)
            self._opening = asyncio.create_task(self._open_when_reachable(), name="idemproxy-pg-open")

    def _create_pool(self) -> Awaitable[Any]:
        return asyncpg.create_pool(  # type: ignore[no-any-return]
            self.config.dsn.reveal(), min_size=self.config.pool_min, max_size=self.config.pool_max,
            command_timeout=OPERATION_TIMEOUT, timeout=OPERATION_TIMEOUT,
            init=self._init_connection, reset=_no_reset,
        )

    async def _set_up(self) -> None:
        """On a pool just opened: the migrations (``migrate: auto``) and the layout; then operations may run. On
        failure the pool is closed again."""
        try:
            async with self._conn("open") as conn:
                if self.config.migrate == "auto":
                    await migrate(conn, self.config.partitions, convert=False)
                elif await layout(conn) is None:  # (every operation would fail on it: not a store to serve from)
                    raise StoreUnavailable(
                        f"{server_of(self.config.dsn.reveal())} has no idemproxy schema and "
                        "storage.postgres.migrate is off: run `idemproxy migrate --config FILE` first (or set "
                        "migrate: auto)", maybe_applied=False)
                await self._learn_layout(conn)
        except BaseException:
            pool, self._pool = self._pool, None
            pool.terminate()
            raise
        self._usable = True
        if self.listen:
            self._listen_task = asyncio.create_task(self._keep_listening(), name="idemproxy-pg-listen")

    async def _open_when_reachable(self) -> None:
        """open() for a server that was unreachable at start: try again with backoff (0.5 s up to
        OPEN_RETRY_MAX) until the store is open or closing. A line a minute while it is not: a warning while the
        server cannot be reached, an error once it answers and refuses (the first refusal said at once)."""
        what = server_of(self.config.dsn.reveal())
        delay, warned, refused = OPEN_RETRY_FIRST, time.monotonic(), False
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), delay)
            if self._closing.is_set():
                return
            delay = min(delay * 2, OPEN_RETRY_MAX)
            connected = False
            try:
                self._pool = await self._create_pool()
                connected = True
                await self._set_up()
            except Exception as exc:  # whatever it is, the opener goes on: a store that never opens is worse
                cause = (exc.__cause__ or exc) if isinstance(exc, StoreUnavailable) else exc
                now = time.monotonic()
                if now - warned < OPEN_WARN_INTERVAL and (refused or unreachable(cause)):
                    continue  # said lately
                warned = now
                refused = not unreachable(cause)
                if refused and not connected:  # it answers now, and refuses: a configuration error
                    log.error("%s %s; serving without it", what, _refusal(cause))
                elif refused:  # the migrations or the layout failed on a server that answers
                    log.error("%s could not be opened: %s (%s); serving without it", what, cause,
                              type(cause).__name__)
                else:
                    log.warning("%s still not reachable (%s)", what, type(cause).__name__)
                continue
            log.warning("%s answers: the idempotency store is open", what)
            return

    async def _learn_layout(self, conn: Any) -> None:
        """The table's layout, and whether the batch functions are there (a schema last migrated by an older
        version has the per-key functions only, until `idemproxy migrate` runs: then every call goes alone)."""
        self.layout = await layout(conn) or "none"
        self.batching = self.layout == "daily" and bool(await conn.fetchval(
            "SELECT to_regproc('idemproxy_claim_many') IS NOT NULL AND to_regproc('idemproxy_complete_many') "
            "IS NOT NULL"))
        if self.layout == "daily" and not self.batching:
            log.warning("the schema has no batch functions (migrated by an older version): claims and completions "
                        "go one statement each until `idemproxy migrate` is run")

    async def close(self, timeout: float | None = None) -> None:
        self._closing.set()
        within = step_bounds(timeout)
        if self._opening is not None:  # (a pool it was opening meanwhile is closed below)
            await asyncio.wait({self._opening}, timeout=within(OPERATION_TIMEOUT + 1))
            self._opening.cancel()
            await asyncio.wait({self._opening}, timeout=within(1))  # its cleanup (terminating a pool) runs now
        await self._claims.close(within(OPERATION_TIMEOUT))
        await self._completes.close(within(OPERATION_TIMEOUT))
        if self._unclaiming:
            await asyncio.wait(set(self._unclaiming), timeout=within(OPERATION_TIMEOUT))
        self._return_spares(float("inf"))
        if self._returning:
            await asyncio.wait(set(self._returning), timeout=within(OPERATION_TIMEOUT))
        if self._listen_task is not None:
            await asyncio.wait({self._listen_task}, timeout=within(3))
            self._listen_task.cancel()
        pool = self._pool
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), timeout=within(5))
            except _DB_ERRORS:
                pool.terminate()  # connections still busy then (a batch on a hung store) are cut, not waited for

    async def _keep_listening(self) -> None:
        """Hold a LISTEN connection; re-establish it whenever it is lost (a PostgreSQL restart, a cut), and
        wake every waiter then, since notifications sent meanwhile were missed."""
        while not self._closing.is_set():
            try:
                conn = await asyncpg.connect(self.config.dsn.reveal(), timeout=OPERATION_TIMEOUT)
            except Exception as exc:  # whatever it is, the listener goes on: one stopped for good is worse
                log.warning("LISTEN connection failed (%s); wait mode looks again (up to every 1 s) until it is "
                            "back", type(exc).__name__)
            else:
                await self._listen_on(conn)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), LISTEN_RETRY)

    async def _listen_on(self, conn: Any) -> None:
        """Listen on ``conn`` until it is lost, stops answering, or the store closes. A link that fails without
        an error (a partition: no FIN, no RST) is found by asking it for a sign of life every second; until one
        comes within ``LISTEN_LIVE_WINDOW`` the notifications count as lost (``notifications_live``), as the
        Redis subscriber's do."""
        keep_alive(conn._transport, USER_TIMEOUT)  # (its close to a dark server, too, is then bounded)
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        self._listener = conn
        try:
            await conn.execute(_KEEPALIVE_SQL)
            await conn.add_listener(NOTIFY_CHANNEL, self._on_notify)
            self._heard = time.monotonic()
            self.watchers.notify_all()  # anything that changed while we were not listening
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_first(lost.wait(), self._closing.wait()), LISTEN_PING)
                if lost.is_set() or self._closing.is_set():
                    break
                # Its answer also proves that notifications committed before it were delivered: a session
                # gets them at the end of each of its transactions, before the answer.
                await conn.fetchval("SELECT 1", timeout=LISTEN_PING)
                self._heard = time.monotonic()
        # Not only the driver's interface and the server's errors: a session the server ended while idle has the
        # driver refuse the next statement with an error of its own (InternalClientError, its protocol left
        # mid-state by the goodbye), which stopped the listener for good.
        except Exception as exc:
            log.warning("LISTEN failed (%s)", type(exc).__name__)
        finally:
            self._heard = float("-inf")
            self._listener = None
            try:
                await asyncio.wait_for(conn.close(timeout=2), 3)
            except Exception:
                conn.terminate()  # (a stalled link does not answer a polite close)
        if not self._closing.is_set():
            log.warning("LISTEN connection lost; re-establishing it")

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self.watchers.notify_message(payload)

    @contextlib.asynccontextmanager
    async def _conn(self, operation: str) -> AsyncIterator[Any]:
        """A pooled connection for one operation, timed and counted (``measured``)."""
        async with self.measured(operation), self._connection(operation) as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def _connection(
        self, operation: str, *, spare: bool = False, wait: float = OPERATION_TIMEOUT
    ) -> AsyncIterator[Any]:
        """A pooled connection. Every failure is translated here: the request's own data refused →
        StoreRejected; anything else the driver or the server can do (refused or dropped connections, timeouts,
        shutdown, an exhausted pool, a protocol state error) → StoreUnavailable. A connection interrupted in the
        middle of an operation (error, timeout or cancellation) is terminated, never handed out again: a
        pooled connection with an operation still pending fails the next user with "another operation is in
        progress". With ``spare`` (batches), a connection an earlier batch left aside is taken first, and this
        one is left aside in turn when all went well. ``wait``: for a connection from the pool, at most."""
        if not self._usable and operation != "open":  # not open yet (unreachable at start): nothing was sent
            raise StoreUnavailable("The idempotency store (PostgreSQL) is unavailable.", maybe_applied=False)
        conn = self._spare() if spare else None
        if conn is None:
            if not spare:
                self._waiting += 1  # (meanwhile, a batch that ends gives its connection back: it may be ours)
            try:
                if not spare and self._spares and self._pool_exhausted():
                    self._return_spares(float("inf"))  # the pool is empty: what batches left aside is ours first
                conn = await self._pool.acquire(timeout=wait)
            except _EndedInSetUp as exc:  # nothing of the operation was sent: another connection may take it
                log.info("postgres %s: a connection the server ended as the pool set it up was discarded (%s)",
                         operation, exc.__cause__)
                raise _Unsent() from exc
            except Exception as exc:
                raise _unavailable(operation, exc, maybe_applied=False, quiet=self._opening_quietly(operation)) \
                    from exc
            finally:
                if not spare:
                    self._waiting -= 1
        try:
            yield conn
        except BaseException as exc:
            await self._discard(operation, conn, exc)
            raise
        if spare and len(self._spares) < self._max_spares and not self._waiting and not self._closing.is_set():
            self._keep_spare(conn)
            return
        with contextlib.suppress(Exception):
            await self._pool.release(conn, timeout=OPERATION_TIMEOUT)

    async def _discard(self, operation: str, conn: Any, exc: BaseException) -> None:
        """``conn``, interrupted by ``exc``, terminated and given back; ``exc`` translated (raised from here)."""
        # asyncpg may already have taken back a connection closed mid-operation: then terminate() on
        # our handle refuses, and the connection is gone anyway.
        with contextlib.suppress(Exception):
            conn.terminate()
        with contextlib.suppress(Exception):
            await self._pool.release(conn, timeout=OPERATION_TIMEOUT)
        if isinstance(exc, TimeoutError):  # the driver's: a statement with no answer in OPERATION_TIMEOUT
            await self._silent(operation)
        if isinstance(exc, _DATA_ERRORS) and operation == "claim":  # the request's own key or tenant
            raise StoreRejected("The idempotency key or tenant cannot be stored.") from exc
        if isinstance(exc, Exception) and not isinstance(exc, StoreUnavailable):
            if _unsent(exc):
                log.info("postgres %s: a pooled connection the server had ended was discarded before use (%s)",
                         operation, exc)
                raise _Unsent() from exc
            raise _unavailable(operation, exc, quiet=self._opening_quietly(operation)) from exc

    async def _silent(self, operation: str) -> None:
        """A statement of ours got no answer within its time: the server, or the path to it, may be gone without a
        word (a failover that moved the address and left the old host dark drops packets, no reset). Each pooled
        connection to it would be found only by its own timeout when next used: one failed request each, one
        after the other. So the pool's connections are all replaced: the idle ones and those batches kept aside are
        closed at once (the pool opens pool_min anew, to wherever the address leads now), one in use is closed
        when given back (Pool.expire_connections).

        A false alarm (a server merely slow: PostgreSQL cancels our statements itself at STATEMENT_TIMEOUT, so one
        that outlasts it is rare) costs one new connection per pooled one, so it is done at most once per
        EXPIRE_INTERVAL. A claim whose time ran out is one only when its statement was on the wire SILENT_AFTER:
        one that waited for a busy pool first tells nothing of the server."""
        now = time.monotonic()
        if self._pool is None or now - self._expired < EXPIRE_INTERVAL:
            return
        self._expired = now
        log.warning("postgres %s got no answer in time: the pool's connections are replaced, the idle ones now, "
                    "those in use when given back (the server may have gone silent: a failover, a link that drops "
                    "packets)", operation)
        await self._pool.expire_connections()
        # The idle ones, and those batches kept aside, are closed here and now (a connection closed outright: its
        # server, if it hears, ends the session as for a polite close). The pool would close an expired idle one
        # politely as it next handed it out, in a task of its own that nobody awaits: to a silent server, that close
        # fails after its 5 s and asyncio logs the unheard error with a traceback. A connection kept aside, given
        # back politely, held its pool slot those 5 s.
        for holder in getattr(self._pool, "_holders", ()):  # (asyncpg has no public way to them)
            conn = getattr(holder, "_con", None)
            if conn is not None and getattr(holder, "_in_use", True) is None:
                conn.terminate()
        for conn, _ in self._spares:
            with contextlib.suppress(Exception):
                conn.terminate()  # (its slot is free again once given back, below)
        self._return_spares(float("inf"))

    def _unanswered(self) -> bool:
        """Whether a batch's statement has been on the wire SILENT_AFTER with no answer."""
        return min(self._on_wire.values(), default=float("inf")) <= time.monotonic() - SILENT_AFTER

    def _opening_quietly(self, operation: str) -> bool:
        """The background opener's own set-up: its failures are logged by it, once a minute."""
        return operation == "open" and self._opening is not None

    def _spare(self) -> Any:
        """The connection a batch left aside most lately, if one is still open (a connection that closed, the
        server gone say, went back to the pool by itself: its handle then refuses every call)."""
        while self._spares:
            conn, _ = self._spares.pop()
            with contextlib.suppress(asyncpg.InterfaceError):
                if not conn.is_closed():
                    return conn
        return None

    def _keep_spare(self, conn: Any) -> None:
        self._spares.append((conn, time.monotonic()))
        if self._spare_timer is None:
            self._spare_timer = asyncio.get_running_loop().call_later(SPARE_IDLE, self._return_idle_spares)

    def _return_idle_spares(self) -> None:
        self._spare_timer = None
        self._return_spares(time.monotonic() - SPARE_IDLE)
        if self._spares:
            self._spare_timer = asyncio.get_running_loop().call_later(SPARE_IDLE, self._return_idle_spares)

    def _return_spares(self, used_before: float) -> None:
        """Give back to the pool the connections left aside that were last used before ``used_before``."""
        idle = [conn for conn, used in self._spares if used < used_before]
        self._spares = [(conn, used) for conn, used in self._spares if used >= used_before]
        for conn in idle:
            self._give_back(conn)
        if not self._spares and self._spare_timer is not None:
            self._spare_timer.cancel()
            self._spare_timer = None

    def _pool_exhausted(self) -> bool:
        pool = self._pool
        return bool(pool.get_idle_size() == 0 and pool.get_size() >= pool.get_max_size())

    def _give_back(self, conn: Any) -> None:
        follow_up(self._returning, self._pool.release(conn, timeout=OPERATION_TIMEOUT),
                  "giving a connection back to the pool")

    async def _live(self, operation: str, run: Callable[[Any], Awaitable[T]], *, spare: bool = False) -> T:
        """``run`` an operation on a pooled connection; on another one when that was found dead before anything of
        the operation was sent (``_Unsent``). A dead connection is discarded as it is found, and the pool holds at
        most ``pool_max`` (those kept aside included), so that many more tries reach a new one even when the
        server ended them all at once; a failure of any other kind is final.

        The tries share one budget, OPERATION_TIMEOUT from the call, as a claim's wait and statement do: each try
        waits for its connection only as long as is left of it, and none starts once it is spent (each could
        otherwise wait its own 5 s for a connection and be handed a dead one again: pool_max times 5 s). A
        statement once sent is not cut short: it keeps its own bound, past which the server has given up on it,
        so it cannot land after its caller was told it failed (a completion that did was then read as refused)."""
        began = time.monotonic()
        wait = OPERATION_TIMEOUT
        for tries_left in range(self.config.pool_max, -1, -1):
            try:
                async with self._connection(operation, spare=spare, wait=wait) as conn:
                    return await run(conn)
            except _Unsent:
                wait = began + OPERATION_TIMEOUT - time.monotonic()
                if not tries_left or wait <= 0:
                    raise
        raise AssertionError("unreachable")

    async def _change(self, operation: str, statement: str, *args: Any) -> bool:
        """Run a fenced write; True when it changed the record (and then woke LISTENing waiters)."""
        announce = self.listen and (self.announcing or operation != "complete")
        notify: tuple[str | None, ...] = (NOTIFY_CHANNEL, self.watchers.message(args[0], args[1])) if announce else ()
        if self.layout == "daily":
            sql = _P_CHANGE[operation]
            notify = notify or (None, None)
        else:
            sql = _counted(statement, len(args), announce)
        async with self.measured(operation):
            changed: int = await self._live(operation, lambda conn: conn.fetchval(sql, *args, *notify))
        return changed == 1

    async def claim(
        self, tenant: str, key: str, fingerprint: str, *, lease: float, ttl: float,
        token: str | None = None,
    ) -> Claim:
        token = token or new_token()
        began = time.monotonic()
        try:
            row, written = await self._claim(tenant, key, fingerprint, token, lease, ttl)
        except StoreUnavailable as exc:
            if self.layout == "none" and isinstance(exc.__cause__, asyncpg.InvalidColumnReferenceError):
                # `idemproxy migrate` converted the table under this running replica: ON CONFLICT (tenant, key)
                # finds no unique index on the partitioned table. Learn the new layout and claim again, once.
                await self._refresh_layout()
                row, written = await self._claim(tenant, key, fingerprint, token, lease, ttl)
            elif _lost(exc):
                row, written = await self._claim_again(tenant, key, fingerprint, token, lease, ttl, began, exc)
            else:
                raise
        owned = bool(row["owned"]) or _own(row, token)
        return Claim(
            record=_record(row, self.codec),
            owned=owned,
            now=row["db_now"].timestamp(),
            sent=written,
            took_over=owned and row["claim_kind"] == "takeover",
            replaced_expired=owned and row["claim_kind"] == "expired",
            grace=not owned and row["state"] == "in_flight" and row["claim_kind"] == "grace",
        )

    async def _claim_again(
        self, tenant: str, key: str, fingerprint: str, token: str, lease: float, ttl: float, began: float,
        failed: StoreUnavailable,
    ) -> _Claimed:
        """A claim whose connection was lost once its statement was written (``failed``: cut, or ended by the server)
        may have landed, its reply lost: it is asked again with the same token, on another connection, in what is
        left of its OPERATION_TIMEOUT from ``began``, while that is CLAIM_AGAIN_WITHIN (a record in flight under its
        token is its own: ``_own``). As ``_live`` tries again, at most ``pool_max`` times: a server that ended every
        pooled connection may have ended the next one too. Each failure is raised as one that may have landed: the
        first try may have, whatever came of the others, and its caller then releases it."""
        for _ in range(self.config.pool_max):
            left = began + OPERATION_TIMEOUT - time.monotonic()
            if left < CLAIM_AGAIN_WITHIN:
                break
            log.info("postgres claim: asked again with its token (the try before may have landed)")
            try:
                return await self._claim_alone(tenant, key, fingerprint, token, lease, ttl, left)
            except StoreUnavailable as again:
                # nothing of it sent (no server to ask), or an answer (the statement rolled back): the earlier tries
                # still may have landed
                if not _lost(again):
                    break
                failed = again
        raise failed

    async def _claim(
        self, tenant: str, key: str, fingerprint: str, token: str, lease: float, ttl: float
    ) -> _Claimed:
        if self.batching:
            async with self.measured("claim"):
                try:
                    return await self._claims.call((tenant, key, fingerprint, token, lease, ttl))
                except CallTimeout as exc:  # (5 s after the call: the batcher's timeout)
                    if exc.sent and self._unanswered():  # (its batch may have waited for a connection all along)
                        await self._silent("claim")
                    raise _unavailable("claim", exc, maybe_applied=exc.sent) from exc
        return await self._claim_alone(tenant, key, fingerprint, token, lease, ttl, OPERATION_TIMEOUT)

    async def _claim_alone(
        self, tenant: str, key: str, fingerprint: str, token: str, lease: float, ttl: float, budget: float
    ) -> _Claimed:
        """The claim in a statement of its own, within ``budget`` seconds."""
        statement = _P_CLAIM if self.layout == "daily" else _CLAIM
        sent = False  # (a claim still waiting for the pool when its time ran out was never sent)
        written = first = float("inf")  # when it was (monotonic), and first was
        async with self.measured("claim"):  # (outside the timeout: its 503 is counted as a store error)
            try:
                # the pool's wait and the statement share the 5 s: a claim that got the last connection late must
                # not then wait a whole statement timeout more
                async with asyncio.timeout(budget):

                    async def attempt(conn: Any) -> _Claimed:
                        nonlocal sent, written, first
                        sent, written = True, time.monotonic()
                        first = min(first, written)  # (a try again is one whose first was never sent: _live)
                        try:
                            return await _claimed(conn, statement, tenant, key, fingerprint, token, lease,
                                                  ttl), first
                        except Exception as exc:
                            sent = not _unsent(exc)  # (refused before it was written: the next try decides)
                            raise

                    return await self._live("claim", attempt)
            except TimeoutError as exc:  # (the connection, interrupted, was discarded by _connection)
                if sent and time.monotonic() - written >= SILENT_AFTER:  # (not when it waited for the pool first)
                    await self._silent("claim")
                raise _unavailable("claim", exc, maybe_applied=sent) from exc

    async def _refresh_layout(self) -> None:
        before = self.layout
        async with self._conn("open") as conn:
            await self._learn_layout(conn)
        if self.layout != before:
            log.warning("%s is now %s; following it", TABLE, "partitioned" if self.layout == "daily" else "one table")

    async def _batch(
        self, operation: str, statement_for: Callable[[list[Any]], tuple[str, list[Any]]], calls: list[Any]
    ) -> tuple[list[Any], float]:
        """One statement for a batch of calls (``statement_for`` gives it and its arguments): the rows it returned,
        by call (``idx`` counts from 1), and when it was first written (monotonic: before the server read its clock
        for any of them). When the statement refused one call's own data, the batch failed as a whole: each call is
        then sent alone, so only that one fails."""
        statement, arguments = statement_for(calls)
        batch = id(arguments)
        written = float("inf")

        def run(conn: Any) -> Awaitable[Any]:
            nonlocal written
            now = self._on_wire[batch] = time.monotonic()  # (a claim whose time runs out meanwhile looks: _unanswered)
            written = min(written, now)  # (a try again is one whose first was never sent: _live)
            return conn.fetch(statement, *arguments)  # type: ignore[no-any-return]

        try:
            try:
                rows = await self._live(operation, run, spare=True)
            finally:
                self._on_wire.pop(batch, None)
        except (StoreRejected, StoreUnavailable) as exc:
            if len(calls) == 1 or not isinstance(exc.__cause__, _DATA_ERRORS):
                raise
            alone: list[Any] = []
            for call in calls:
                try:
                    alone.extend((await self._batch(operation, statement_for, [call]))[0])
                except (StoreRejected, StoreUnavailable) as one:
                    alone.append(one)
            return alone, written
        by_call = {row["idx"]: row for row in rows}
        return [by_call.get(n) or StoreUnavailable("The idempotency store gave no answer for this call.")
                for n in range(1, len(calls) + 1)], written

    def _unclaim(self, call: _ClaimCall, outcome: _Claimed | BaseException) -> None:
        """A claim whose caller was cancelled while its batch was on the wire: if it made that caller the owner,
        nobody will forward or release it, so release it now (fenced by its token), not after a whole lease."""
        if isinstance(outcome, BaseException) or not outcome[0]["owned"]:
            return
        tenant, key, _, token, _, _ = call
        follow_up(self._unclaiming, self._change("release", _RELEASE, tenant, key, token),
                  "releasing an abandoned claim (it keeps its lease until it runs out)")

    async def _claim_batch(self, calls: list[_ClaimCall]) -> list[_Claimed | BaseException]:
        """Each call's row with when its statement was written (``_Claimed``), or the exception it alone raised."""
        rows, written = await self._batch("claim", _claim_statement, calls)
        return [row if isinstance(row, BaseException) else (row, written) for row in rows]

    async def _complete_batch(self, calls: list[_CompleteCall]) -> list[Any]:
        rows, _ = await self._batch("complete", self._complete_statement, calls)
        return [row if isinstance(row, BaseException) else int(row["changed"]) for row in rows]

    def _complete_statement(self, calls: list[_CompleteCall]) -> tuple[str, list[Any]]:
        channel = NOTIFY_CHANNEL if self.listen and self.announcing else None
        if len(calls) == 1:
            *fields, payload = calls[0]
            return _P_COMPLETE_ONE, [*fields, channel, payload]
        columns: list[list[Any]] = [list(column) for column in zip(*calls, strict=True)]
        payloads = columns.pop()
        return _P_COMPLETE_MANY, [*columns, channel, payloads]

    async def complete(self, claim: Claim, response: StoredResponse, *, ttl: float) -> bool:
        tenant, key, token = claim.record.tenant, claim.record.key, claim.token
        headers, body = self.codec.to_columns(tenant, key, response.headers, response.body, response.status,
                                              claim.record.fingerprint)
        where = (datetime.fromtimestamp(claim.record.expires_at, UTC),) if self.layout == "daily" else ()
        if self.batching:
            async with self.measured("complete"):
                changed = await self._completes.call((
                    tenant, key, token, response.status, headers, body, response.body is not None, ttl, *where,
                    self.watchers.message(tenant, key) if self.listen and self.announcing else None,
                ))
            return changed == 1
        return await self._change(
            "complete", _COMPLETE, tenant, key, token, response.status, headers,
            body, response.body is not None, ttl, *where,
        )

    async def release(self, claim: Claim) -> bool:
        return await self._change("release", _RELEASE, claim.record.tenant, claim.record.key, claim.token)

    async def get(self, tenant: str, key: str) -> Record | None:
        async with self.measured("get"):
            row = await self._live("get", lambda conn: conn.fetchrow(_GET, tenant, key))
        return _record(row, self.codec) if row is not None else None

    async def forget(self, tenant: str, key: str) -> bool:
        done = await self._change("forget", _FORGET, tenant, key)
        self.watchers.notify(tenant, key)  # this process at once; others by NOTIFY or Redis
        return done

    def notifications_live(self) -> bool:
        """With LISTEN (PostgreSQL alone), live while its connection stands and answered lately."""
        listener = self._listener
        return (listener is not None and not listener.is_closed()
                and time.monotonic() - self._heard < LISTEN_LIVE_WINDOW)

    async def sweep(self, limit: int) -> int:
        """One batch of expired rows deleted, by one replica at a time (a transaction-scoped advisory lock).

        In the daily layout only the default partition is swept by rows; whole days go by :meth:`maintain`.
        The layout is looked up again first: the single-table DELETE by ctid, run on a partitioned table, would
        match rows of every partition that share a ctid."""
        async with self._conn("sweep") as conn, conn.transaction():
            if not await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", SWEEP_LOCK):
                return 0
            self.layout = await layout(conn) or self.layout
            if self.layout == "daily":
                result = await conn.execute(_SWEEP_DEFAULT, limit)
            else:
                await conn.execute(_SWEEP_GRACE, limit)
                result = await conn.execute(_SWEEP, limit)
        return int(result.split()[-1])

    async def maintain(self) -> Maintenance | None:
        """Partition maintenance (daily layout): create ahead, drop expired days; one replica at a time (a
        session-level advisory lock, released before the connection goes back to the pool). None when another
        replica holds the lock or the layout has no partitions."""
        if self.layout != "daily":
            return None
        async with self._conn("maintain") as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", MAINTAIN_LOCK):
                return None
            try:
                done = await maintain_partitions(conn)
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", MAINTAIN_LOCK)
        for name in done.created:
            log.info("created partition %s", name)
        for name in done.dropped:
            log.info("dropped partition %s (about %d records, all expired)", name, done.rows_dropped)
        if self.metrics is not None:
            self.metrics.partitions_dropped.inc(len(done.dropped))
            self.metrics.partitions.set(done.partitions)
        return done

    async def clock(self) -> float:
        async with self._conn("clock") as conn:
            return float(await conn.fetchval("SELECT extract(epoch FROM now())"))

    async def health(self) -> Health:
        try:
            async with self.measured("ping"):  # (a pooled connection the server had ended: no sign it is away)
                await self._live("ping", lambda conn: conn.fetchval("SELECT 1"))
        except StoreUnavailable:
            return Health(ready=False, details={"postgres": "unavailable"})
        return Health(ready=True, details={"postgres": "ok"})


async def migration_connection(config: PostgresConfig) -> Any:
    """The connection ``idemproxy migrate`` works on, watched by TCP keepalive at both ends as pooled ones are."""
    conn = await connect_with_retries(
        lambda: asyncpg.connect(config.dsn.reveal(), timeout=OPERATION_TIMEOUT), server_of(config.dsn.reveal())
    )
    try:
        keep_alive(conn._transport, USER_TIMEOUT)
        await conn.execute(_KEEPALIVE_SQL)
    except BaseException as exc:
        conn.terminate()
        if isinstance(exc, (asyncpg.PostgresError, *_CONNECT_ERRORS)):
            raise StoreUnavailable(_not_opened(server_of(config.dsn.reveal()), exc), maybe_applied=False) from exc
        raise
    return conn


async def apply_migrations(config: PostgresConfig) -> tuple[list[int], str]:
    """``idemproxy migrate``: one connection, the migrations and the layout (a single table holding records is
    converted to daily partitions when so configured), done (safe to run twice). Returns (applied, layout)."""
    conn = await migration_connection(config)
    try:
        applied = await migrate(conn, config.partitions, convert=True)
        return applied, await layout(conn) or "none"
    except (asyncpg.PostgresError, *_CONNECT_ERRORS) as exc:
        raise StoreUnavailable(_not_opened(server_of(config.dsn.reveal()), exc), maybe_applied=False) from exc
    finally:
        await conn.close()
