"""The admin API on the admin port: look at one record, or release / forget it (bearer token required).

Records are addressed by tenant id (as the access log shows it: the SHA-256 of the tenant credential, or the
static tenant) and key, so one tenant's path can only ever name that tenant's record. Every action is logged.
"""

from __future__ import annotations

import hmac
import logging
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from idemproxy.config import Secret
from idemproxy.engine import short_hash
from idemproxy.problems import RecordNotFound, RecordUnreadable, Unauthorized, loggable_path
from idemproxy.store.base import Record, State, Store

log = logging.getLogger("idemproxy.admin")

# On every answer of the admin port. `idemproxy keys` sends its token only to a server whose /healthz carries it:
# pointed at the proxy port by mistake, the token would reach the upstream, whose 2xx would pass for success.
ADMIN_MARK = "Idemproxy-Admin"


def _iso(epoch: float | None) -> str | None:
    return datetime.fromtimestamp(epoch, UTC).isoformat() if epoch is not None else None


def describe(record: Record, now: float) -> dict[str, Any]:
    """What an operator may see of a record (never the lease token, never the stored body)."""
    response = record.response
    return {
        "tenant": record.tenant,
        "key": record.key,
        "state": record.state.value,
        "fingerprint": record.fingerprint,
        "lease_alive": record.lease_alive(now),
        "lease_expires_at": _iso(record.lease_expires_at),
        "created_at": _iso(record.created_at),
        "completed_at": _iso(record.completed_at),
        "expires_at": _iso(record.expires_at),
        "expired": record.expired(now),
        "stored_status": response.status if response else None,
        "stored_body_bytes": len(response.body) if response and response.body is not None else None,
        "replayable": bool(response and response.body is not None),
    }


class AdminAPI:
    def __init__(self, store: Store, token: Secret) -> None:
        self.store = store
        self.token = token

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/admin/keys/{tenant}/{key:.+}", self.show)
        app.router.add_delete("/admin/keys/{tenant}/{key:.+}", self.delete)

    def _authorize(self, request: web.Request) -> None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # (the header's bytes as received: undecodable ones arrive escaped, and are a wrong token, not a 500)
        expected = self.token.reveal().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected):
            # The path names a raw key (/admin/keys/{tenant}/{key}): logged as its hash, as every line does.
            tenant = loggable_path(request).removeprefix("/admin/keys/").partition("/")[0]
            log.warning("admin %s refused: bad or missing token (tenant=%s key_hash=%s)", request.method, tenant,
                        short_hash(request.match_info.get("key", "")),
                        extra={"admin_action": "refused", "remote": request.remote})
            raise Unauthorized("A valid admin bearer token is required.")

    @staticmethod
    def _address(request: web.Request) -> tuple[str, str]:
        """The tenant and key named by the path. One holding a NUL names no record (no key or tenant id can
        hold one) and would be refused by PostgreSQL as a value, not answered as an outage: 404 here."""
        tenant, key = request.match_info["tenant"], request.match_info["key"]
        if "\x00" in tenant or "\x00" in key:
            raise RecordNotFound("No record for this tenant and key.")
        return tenant, key

    async def show(self, request: web.Request) -> web.Response:
        self._authorize(request)
        tenant, key = self._address(request)
        record = await self.store.get(tenant, key)
        self._log("show", tenant, key, found=record is not None)
        if record is None:
            raise RecordNotFound("No record for this tenant and key.")
        return web.json_response(describe(record, await self.store.clock()))

    async def delete(self, request: web.Request) -> web.Response:
        """Release a stuck in-flight record or forget a completed one: the next request executes anew."""
        self._authorize(request)
        tenant, key = self._address(request)
        state = await self._state(tenant, key)
        if state is None:
            # No durable record, and none is deleted (one created since the read is not the operator's to
            # delete under a 404). But the retry of a release that failed between its two Redis purges (the
            # record deleted, the second purge refused) must still clear a copy that a read put back in Redis
            # meanwhile, or that copy would answer for up to replay_cache_ttl.
            await self.store.clear_copies(tenant, key)
        if state is None or not await self.store.forget(tenant, key):
            self._log("delete", tenant, key, found=False)
            raise RecordNotFound("No record for this tenant and key.")
        self._log("delete", tenant, key, found=True, state=state)
        return web.json_response({"deleted": True, "state": state})

    async def _state(self, tenant: str, key: str) -> str | None:
        try:
            record = await self.store.get(tenant, key)
        except RecordUnreadable:
            # Its stored response does not open (a removed encryption key): the operator may still let the
            # key execute anew. Only a completed record holds a response.
            return State.COMPLETED.value
        return record.state.value if record is not None else None

    def _log(self, action: str, tenant: str, key: str, **fields: Any) -> None:
        log.warning("admin %s tenant=%s key_hash=%s %s", action, tenant, short_hash(key), fields,
                    extra={"admin_action": action, "tenant": tenant, "key_hash": short_hash(key), **fields})
