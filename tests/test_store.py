"""One store suite, run on every backend: the claim state machine, fencing, expiry, sweeping, notifications."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import MISSING, FrozenInstanceError, InitVar, dataclass, field, fields, make_dataclass, replace
from typing import Any

import pytest

from idemproxy.config import load_config
from idemproxy.store import State, Store, StoredResponse, build_store
from idemproxy.store.base import Claim, Record, new_token, quick_init
from idemproxy.store.redis import _Fast
from tests.conftest import BACKENDS, StorageFactory, empty_records

FP, OTHER_FP = "f" * 64, "0" * 64
OK = StoredResponse(status=201, headers=(("Content-Type", "application/json"), ("X-A", "1")), body=b'{"id": 1}')


ONE_TABLE = "postgres-one-table"  # `partitions: none`: today's single table; the others run on daily partitions


@pytest.fixture(params=(*BACKENDS, ONE_TABLE))
async def store(request: pytest.FixtureRequest, storage: StorageFactory, pg_one_table_dsn: str) -> AsyncIterator[Store]:
    if request.param == ONE_TABLE:
        section = {"postgres": {"dsn": await empty_records(pg_one_table_dsn), "partitions": "none"}}
    else:
        section = storage(request.param)
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"}, "storage": section})
    backend = build_store(config.storage)
    await backend.open()
    yield backend
    await backend.close()


async def until(deadline: float) -> None:
    await asyncio.sleep(max(deadline - time.time(), 0) + 0.02)


async def test_first_claim_owns_and_a_second_sees_it_in_flight(store: Store) -> None:
    first = await store.claim("t", "k", FP, lease=30, ttl=60)
    assert first.owned and first.record.state is State.IN_FLIGHT and first.token
    second = await store.claim("t", "k", FP, lease=30, ttl=60)
    assert not second.owned and second.record.state is State.IN_FLIGHT
    assert second.record.lease_alive(second.now)
    assert second.record.lease_expires_at is not None
    assert 25 < second.record.lease_expires_at - second.now <= 30
    other = await store.claim("t", "k", OTHER_FP, lease=30, ttl=60)
    assert not other.owned and other.record.fingerprint == FP


async def test_a_claims_lease_is_counted_from_an_instant_between_its_call_and_its_answer(store: Store) -> None:
    """Claim.sent, which the engine counts the lease from, is given by every store (the instant its deciding
    statement left), and the lease ends ``lease`` after it. That it is never after the store started the lease is
    tests/test_batch.py's (an owner whose statement waited on a lock)."""
    called = time.monotonic()
    claim = await store.claim("t", "k", FP, lease=30, ttl=60)
    answered = time.monotonic()
    assert claim.owned and called <= claim.sent <= answered
    assert claim.lease_end() == pytest.approx(claim.sent + 30, abs=0.001)


async def test_complete_then_claim_returns_the_stored_response(store: Store) -> None:
    claim = await store.claim("t", "k", FP, lease=30, ttl=60)
    assert await store.complete(claim, OK, ttl=60)
    again = await store.claim("t", "k", FP, lease=30, ttl=60)
    assert not again.owned and again.record.state is State.COMPLETED
    assert again.record.response == OK
    record = await store.get("t", "k")
    assert record is not None and record.response == OK and record.lease_token is None


async def test_body_too_large_is_stored_without_body(store: Store) -> None:
    claim = await store.claim("t", "big", FP, lease=30, ttl=60)
    assert await store.complete(claim, StoredResponse(status=200, headers=(), body=None), ttl=60)
    again = await store.claim("t", "big", FP, lease=30, ttl=60)
    assert again.record.response is not None and again.record.response.body is None
    assert again.record.response.status == 200


async def test_tenants_do_not_share_records(store: Store) -> None:
    claim = await store.claim("alice", "k", FP, lease=30, ttl=60)
    await store.complete(claim, OK, ttl=60)
    bob = await store.claim("bob", "k", OTHER_FP, lease=30, ttl=60)
    assert bob.owned
    assert await store.get("carol", "k") is None


async def test_release_frees_the_key(store: Store) -> None:
    claim = await store.claim("t", "k", FP, lease=30, ttl=60)
    assert await store.release(claim)
    assert await store.get("t", "k") is None
    assert (await store.claim("t", "k", OTHER_FP, lease=30, ttl=60)).owned


async def past_the_grace(store: Store, tenant: str, key: str, fp: str, lease: float, ttl: float) -> Claim:
    """A claim of a record whose lease ran out: a shared store gives it TAKEOVER_GRACE first (the owner's token
    kept), and the claim after that takes it over."""
    claim = await store.claim(tenant, key, fp, lease=lease, ttl=ttl)
    if claim.grace:
        assert store.backend != "embedded" and not claim.owned
        await until(claim.record.lease_expires_at or 0)
        claim = await store.claim(tenant, key, fp, lease=lease, ttl=ttl)
    return claim


async def test_fenced_zombie_cannot_overwrite_the_new_owner(store: Store) -> None:
    zombie = await store.claim("t", "z", FP, lease=0.2, ttl=60)
    await until(zombie.record.lease_expires_at or 0)
    heir = await past_the_grace(store, "t", "z", FP, lease=30, ttl=60)
    assert heir.owned and heir.took_over and heir.token != zombie.token
    stale = StoredResponse(status=500, headers=(), body=b"zombie")
    assert not await store.complete(zombie, stale, ttl=60)
    assert not await store.release(zombie)
    assert await store.complete(heir, OK, ttl=60)
    record = await store.get("t", "z")
    assert record is not None and record.response == OK


async def test_a_lapsed_lease_is_given_a_grace_in_which_its_owner_still_completes(store: Store) -> None:
    """A shared store's first claim past the lease does not take the record over: the owner may hold the answer,
    its completion held up by the store itself (away longer than the lease), and land it within the grace. The
    claim after the grace takes the record over; the embedded store (one process) takes it over at once."""
    owner = await store.claim("t", "g", FP, lease=0.2, ttl=60)
    await until(owner.record.lease_expires_at or 0)
    first = await store.claim("t", "g", FP, lease=30, ttl=60)
    if store.backend == "embedded":
        assert first.owned and first.took_over and not first.grace
        return
    assert not first.owned and first.grace and first.record.state is State.IN_FLIGHT
    assert first.record.lease_token == owner.token  # the owner's completion is not refused
    assert 0.5 < (first.record.lease_expires_at or 0) - first.now <= 1.0 + 0.05
    again = await store.claim("t", "g", FP, lease=30, ttl=60)  # within the grace: the record stands
    assert not again.owned and again.grace
    assert await store.complete(owner, OK, ttl=60)
    after = await store.claim("t", "g", FP, lease=30, ttl=60)
    assert not after.owned and not after.grace and after.record.state is State.COMPLETED
    assert after.record.response == OK
    # a grace given once: the claim after it takes over (the owner never came back)
    gone = await store.claim("t", "h", FP, lease=0.2, ttl=60)
    await until(gone.record.lease_expires_at or 0)
    heir = await past_the_grace(store, "t", "h", FP, lease=30, ttl=60)
    assert heir.owned and heir.took_over
    assert not await store.complete(gone, OK, ttl=60)


async def test_a_claim_asked_again_with_its_token_finds_its_own_record_while_its_lease_lives(store: Store) -> None:
    """PostgreSQL asks a claim again, with its token, when its first try may have landed with its reply lost: a
    record in flight under that token is the claim's own, with the lease the first try started; one whose lease ran
    out is not (it is given its grace, as for any claim), and nor is one another claim holds."""
    if store.backend == "embedded":
        pytest.skip("only a store across a network asks a claim again")
    token = new_token()
    first = await store.claim("t", "again", FP, lease=30, ttl=60, token=token)
    again = await store.claim("t", "again", FP, lease=30, ttl=60, token=token)
    assert first.owned and again.owned and again.token == token and not again.took_over
    assert again.record.lease_expires_at == first.record.lease_expires_at
    assert again.lease_end() <= first.lease_end() + 0.05
    assert not (await store.claim("t", "again", FP, lease=30, ttl=60)).owned  # another claim's token
    assert await store.complete(again, OK, ttl=60)
    done = await store.claim("t", "again", FP, lease=30, ttl=60, token=token)
    assert not done.owned and done.record.response == OK
    lapsed = await store.claim("t", "lapsed", FP, lease=0.2, ttl=60, token=token)
    await until(lapsed.record.lease_expires_at or 0)
    late = await store.claim("t", "lapsed", FP, lease=30, ttl=60, token=token)
    assert not late.owned and late.grace and late.record.lease_token == token


async def test_takeover_needs_the_same_fingerprint(store: Store) -> None:
    owner = await store.claim("t", "k", FP, lease=0.2, ttl=60)
    await until(owner.record.lease_expires_at or 0)
    other = await store.claim("t", "k", OTHER_FP, lease=30, ttl=60)
    assert not other.owned and other.record.fingerprint == FP


async def test_expired_record_is_claimable_again(store: Store) -> None:
    claim = await store.claim("t", "k", FP, lease=0.1, ttl=0.3)
    await store.complete(claim, OK, ttl=0.3)
    record = await store.get("t", "k")
    assert record is not None
    await until(record.expires_at)
    fresh = await store.claim("t", "k", OTHER_FP, lease=30, ttl=60)
    assert fresh.owned and fresh.replaced_expired and not fresh.took_over


def rows_swept(store: Store) -> None:
    durable = getattr(store, "durable", store)
    if getattr(durable, "layout", None) == "daily":
        pytest.skip("daily partitions are dropped whole, not swept by rows: tests/test_partitions.py")


async def test_the_layout_is_the_configured_one(store: Store, request: pytest.FixtureRequest) -> None:
    durable = getattr(store, "durable", store)
    expected = {"redis": "daily", "postgres": "daily", ONE_TABLE: "none"}.get(request.node.callspec.params["store"])
    assert getattr(durable, "layout", None) == expected


async def test_sweep_removes_expired_records_and_keeps_live_leases(store: Store) -> None:
    rows_swept(store)
    done = await store.claim("t", "expired", FP, lease=0.1, ttl=0.2)
    await store.complete(done, OK, ttl=0.2)
    await store.claim("t", "leased", FP, lease=30, ttl=0.2)  # TTL over, lease alive: never swept
    await store.complete(await store.claim("t", "live", FP, lease=30, ttl=60), OK, ttl=60)
    await until(time.time() + 0.25)
    assert await store.sweep(100) == 1
    assert await store.get("t", "expired") is None
    assert await store.get("t", "leased") is not None
    assert await store.get("t", "live") is not None


async def test_sweep_works_in_bounded_batches(store: Store) -> None:
    rows_swept(store)
    for i in range(5):
        claim = await store.claim("t", f"b{i}", FP, lease=0.05, ttl=0.1)
        await store.complete(claim, OK, ttl=0.1)
    await until(time.time() + 0.15)
    assert await store.sweep(2) == 2
    assert await store.sweep(10) == 3


async def test_forget_deletes_any_state(store: Store) -> None:
    await store.claim("t", "k", FP, lease=30, ttl=60)
    assert await store.forget("t", "k")
    assert not await store.forget("t", "k")
    assert (await store.claim("t", "k", FP, lease=30, ttl=60)).owned


async def test_watchers_are_woken_by_completion(store: Store) -> None:
    claim = await store.claim("t", "w", FP, lease=30, ttl=60)
    with store.watch("t", "w") as changed:
        await store.complete(claim, OK, ttl=60)
        await asyncio.wait_for(changed, 5)


async def test_concurrent_claims_have_exactly_one_owner(store: Store) -> None:
    claims = await asyncio.gather(*(store.claim("t", "race", FP, lease=30, ttl=60) for _ in range(30)))
    assert sum(c.owned for c in claims) == 1


async def test_health_reports_ready(store: Store) -> None:
    health = await store.health()
    assert health.ready


@pytest.mark.parametrize("settle", [0, 1, 20])
async def test_redis_subscriber_stops_by_itself_on_close(storage: StorageFactory, redis_url: str, settle: int) -> None:
    """redis-py's pub/sub read can swallow a cancellation; a subscriber that outlived close() hung the process exit."""
    import redis.asyncio as aioredis

    from idemproxy.store.redis import RedisFrontedStore

    config = load_config({"upstream": {"url": "http://127.0.0.1:1"}, "storage": storage("redis")})
    store = build_store(config.storage)
    assert isinstance(store, RedisFrontedStore)
    await store.open()
    client = aioredis.from_url(redis_url)
    for _ in range(settle * 10):  # from "still connecting" to "parked on the socket"
        if (await client.pubsub_numsub(store.channel))[0][1] == 1:
            break
        await asyncio.sleep(0.01)
    await client.aclose()
    task = store._subscriber
    assert task is not None
    await store.close()
    assert task.done() and not task.cancelled()


async def test_a_value_postgresql_cannot_index_is_rejected_never_unavailable(storage: StorageFactory) -> None:
    """A permanent data error must not become "store unavailable" (503 forever, or unguarded with fail_open)."""
    from idemproxy.problems import StoreRejected, StoreUnavailable

    config = load_config({"upstream": {"url": "http://127.0.0.1:1"}, "storage": storage("postgres")})
    backend = build_store(config.storage)
    await backend.open()
    try:
        with pytest.raises(StoreRejected) as refused:
            # random text: a repeated character would be compressed below the btree limit
            await backend.claim(secrets.token_urlsafe(3000), secrets.token_urlsafe(3000), FP, lease=30, ttl=60)
        assert not isinstance(refused.value, StoreUnavailable)
        assert (await backend.claim("t", "k", FP, lease=30, ttl=60)).owned  # the pool is fine afterwards
    finally:
        await backend.close()


async def test_embedded_leases_ignore_wall_clock_steps(
    storage: StorageFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"}, "storage": storage("embedded")})
    backend = build_store(config.storage)
    await backend.open()
    try:
        first = await backend.claim("t", "k", FP, lease=30, ttl=60)
        assert first.owned
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600)  # NTP steps the clock an hour ahead
        again = await backend.claim("t", "k", FP, lease=30, ttl=60)
        assert not again.owned, "a live lease was taken over because the wall clock jumped"
    finally:
        await backend.close()


async def test_an_embedded_claim_that_waited_for_the_write_lock_counts_its_lease_from_after_the_wait(
    storage: StorageFactory
) -> None:
    """A claim waits for the file's write lock (another process writing) before it reads the store's clock: the
    lease starts then, and the wait is not taken from it."""
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"}, "storage": storage("embedded")})
    assert config.storage.embedded is not None
    backend = build_store(config.storage)
    await backend.open()
    other = sqlite3.connect(config.storage.embedded.path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        claiming = asyncio.ensure_future(backend.claim("t", "k", FP, lease=30, ttl=60))
        await asyncio.sleep(0.3)
        let_go = time.monotonic()
        other.execute("COMMIT")
        claim = await claiming
        assert claim.owned and claim.sent >= let_go
        assert claim.lease_end() == pytest.approx(claim.sent + 30, abs=0.001)
    finally:
        other.close()
        await backend.close()


async def test_embedded_group_commit_keeps_each_write_apart(storage: StorageFactory) -> None:
    """Writes queued in one loop turn share a transaction (one fsync); one that fails rolls back alone."""
    from idemproxy.problems import StoreUnavailable
    from idemproxy.store.embedded import EmbeddedStore

    config = load_config({"upstream": {"url": "http://127.0.0.1:1"}, "storage": storage("embedded")})
    backend = build_store(config.storage)
    assert isinstance(backend, EmbeddedStore)
    await backend.open()
    try:
        def broken(db: Any) -> None:
            db.execute("INSERT INTO records (tenant, key, fingerprint, state, created_at, expires_at) "
                       "VALUES ('t', 'half', 'f', 'in_flight', 0, 9e9)")
            db.execute("SELECT * FROM no_such_table")  # fails after writing: its insert must not survive

        first, bad, last = await asyncio.gather(
            backend.claim("t", "a", FP, lease=30, ttl=60),
            backend._write("broken", broken),
            backend.claim("t", "b", FP, lease=30, ttl=60),
            return_exceptions=True,
        )
        assert isinstance(bad, StoreUnavailable)
        assert not isinstance(first, BaseException) and first.owned
        assert not isinstance(last, BaseException) and last.owned
        assert await backend.get("t", "half") is None
        assert await backend.get("t", "a") is not None and await backend.get("t", "b") is not None
    finally:
        await backend.close()


def test_lease_tokens_are_distinct_128_bit_and_a_forked_child_draws_its_own() -> None:
    tokens = [new_token() for _ in range(3 * 256 + 5)]  # across several refills of the batch
    assert len(set(tokens)) == len(tokens)
    assert all(re.fullmatch(r"[0-9a-f]{32}", token) for token in tokens)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first token must not be the one its parent draws next
        os.write(write, new_token().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert re.fullmatch(r"[0-9a-f]{32}", child) and child != new_token()


def test_a_claims_copies_carry_every_other_field() -> None:
    """Claim.with_epoch builds the copy field by field (cheaper than dataclasses.replace): it must equal replace()
    on a claim whose every field is set, and a field added to Claim must be added to it (this list fails until it
    is)."""
    record = Record(tenant="t", key="k", fingerprint="f", state=State.IN_FLIGHT, lease_token="tok",
                    lease_expires_at=5.0, response=StoredResponse(201, (("a", "b"),), b"x"), created_at=1.0,
                    completed_at=None, expires_at=9.0)
    claim = Claim(record=record, owned=True, now=2.0, sent=3.0, took_over=True, replaced_expired=True,
                  cache_epoch="e1", cache_lock=True, grace=True)
    assert [f.name for f in fields(Claim)] == ["record", "owned", "now", "sent", "took_over", "replaced_expired",
                                               "cache_epoch", "cache_lock", "grace"]

    def values(c: Claim) -> list[object]:
        return [getattr(c, f.name) for f in fields(Claim)]

    assert values(claim.with_epoch("e2")) == values(replace(claim, cache_epoch="e2", cache_lock=False))
    assert values(claim.with_epoch("e2", True)) == values(replace(claim, cache_epoch="e2", cache_lock=True))


@quick_init
@dataclass(frozen=True)
class _Awkward:  # field names the generated code must not trip on, a default and a factory
    self: str
    d: str
    names: str = "n"
    signature: list[str] = field(default_factory=list)


@pytest.mark.parametrize("cls", [StoredResponse, Record, Claim, _Fast, _Awkward], ids=lambda c: c.__name__)
def test_quick_init_builds_what_the_dataclass_init_builds(cls: type[Any]) -> None:
    """The hot records' ``__init__`` is quick_init's, not the dataclass's: it must take the same arguments, by
    position or by name, apply the same defaults (a default factory called per instance), build an equal
    instance and leave it frozen. Compared with a twin the dataclass decorator builds from the same fields."""
    specs: list[Any] = []
    for f in fields(cls):
        if f.default is not MISSING:
            specs.append((f.name, f.type, field(default=f.default)))
        elif f.default_factory is not MISSING:
            specs.append((f.name, f.type, field(default_factory=f.default_factory)))
        else:
            specs.append((f.name, f.type))
    twin = make_dataclass("Twin", specs, frozen=True)
    values = [f"v{n}" for n in range(len(specs))]  # distinct per field: a field set from another's argument shows
    by_name = {f.name: v for f, v in zip(fields(cls), values, strict=True)}
    for made, expected in ((cls(*values), twin(*values)), (cls(**by_name), twin(**by_name))):
        assert vars(made) == vars(expected)
        with pytest.raises(FrozenInstanceError):
            made.owned = True
    required = [v for f, v in zip(fields(cls), values, strict=True)
                if f.default is MISSING and f.default_factory is MISSING]
    made, expected = cls(*required), twin(*required)
    for f in fields(cls):
        assert getattr(made, f.name) == getattr(expected, f.name)
        if f.default_factory is not MISSING:
            assert getattr(cls(*required), f.name) is not getattr(made, f.name)  # called again for each instance
    for f in fields(cls):  # a value given for a factory's field is kept, even one the factory would replace
        if f.default_factory is not MISSING:
            assert getattr(cls(**{**by_name, f.name: None}), f.name) is None
    with pytest.raises(TypeError):
        cls(*values, "one too many")
    with pytest.raises(TypeError):  # (dataclasses.replace relies on it to refuse a misspelt field)
        cls(**by_name, unknown=1)
    if required:
        with pytest.raises(TypeError):
            cls(*required[:-1])


def test_quick_init_refuses_what_it_cannot_build_alike() -> None:
    @dataclass
    class Mutable:
        a: int

    @dataclass(frozen=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class Slotted:
        a: int

    @dataclass(frozen=True)
    class Derived:
        a: int
        b: int = field(init=False, default=0)

    @dataclass(frozen=True, kw_only=True)
    class Named:
        a: int

    @dataclass(frozen=True)
    class Passed:
        a: int
        b: InitVar[int] = 0

    @dataclass(frozen=True, init=False)
    class Own:
        a: str

        def __init__(self, a: str) -> None:
            object.__setattr__(self, "a", a.lower())

    @dataclass(frozen=True, slots=True)
    class SlottedParent:
        a: int

    @dataclass(frozen=True)
    class SlottedChild(SlottedParent):
        b: int

    class Positive:
        def __set_name__(self, owner: type, name: str) -> None:
            self.name = f"_{name}"

        def __get__(self, instance: object, owner: type) -> int:
            return 0 if instance is None else int(getattr(instance, self.name))

        def __set__(self, instance: object, value: int) -> None:
            object.__setattr__(instance, self.name, max(value, 0))

    @dataclass(frozen=True)
    class Described:
        n: Positive = Positive()  # noqa: RUF009 (the point: a descriptor as a field's default)

    for cls in (Mutable, Checked, Slotted, Derived, Named, Passed, Own, SlottedChild, Described):
        with pytest.raises(TypeError, match=cls.__name__):
            quick_init(cls)
