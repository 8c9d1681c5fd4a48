"""Stored responses at rest: the codec's frames, then sealing and compression on every real backend."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import redis as sync_redis
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idemproxy.config import CompressionConfig, EncryptionConfig, Secret, load_config
from idemproxy.metrics import Metrics
from idemproxy.problems import RecordUnreadable
from idemproxy.store import State, Store, StoredResponse, build_store
from idemproxy.store.codec import (
    COMPRESSED,
    FRAMED,
    MAGIC,
    OUTCOME_BOUND,
    SEALED,
    Codec,
    headers_json,
    json_encoder,
    key_id,
)
from idemproxy.store.redis import RedisFrontedStore
from tests.conftest import BACKENDS, ProxyFactory, StorageFactory
from tests.upstream import RecordingUpstream

FP = "f" * 64
KEY_A, KEY_B = (base64.b64encode(os.urandom(32)).decode() for _ in range(2))
CARD_BODY = b'{"cardholder": "Jane Q Public", "token": "tok_live_SECRET123", "amount": 4200}'
CARD_HEADER = "fp_HEADERSECRET"
CARD = StoredResponse(status=201, headers=(("Content-Type", "application/json"), ("X-Card-Fp", CARD_HEADER)),
                      body=CARD_BODY)


def codec(*keys: str, compress: bool = False, max_body: int = 1024 * 1024, metrics: Metrics | None = None) -> Codec:
    encryption = EncryptionConfig(Secret(keys[0]), tuple(Secret(k) for k in keys[1:])) if keys else None
    return Codec(CompressionConfig() if compress else None, encryption, max_body=max_body, metrics=metrics)


# ---------------------------------------------------------------------------------------------- the frames


@pytest.mark.parametrize(("keys", "compress", "flags"), [
    ((), True, COMPRESSED), ((KEY_A,), False, SEALED), ((KEY_A,), True, SEALED | COMPRESSED),
])
def test_frames_round_trip_and_say_how_they_were_written(keys: tuple[str, ...], compress: bool, flags: int) -> None:
    c = codec(*keys, compress=compress)
    body = CARD_BODY * 50
    frame = c.pack("t", "k", CARD.headers, body)
    assert frame.startswith(MAGIC) and frame[len(MAGIC)] == flags
    assert c.unpack("t", "k", frame, backend="postgres") == (CARD.headers, body)
    if keys:
        assert frame[len(MAGIC) + 1:len(MAGIC) + 9] == key_id(base64.b64decode(KEY_A))
        assert b"tok_live_SECRET123" not in frame and CARD_HEADER.encode() not in frame


def test_below_min_size_is_not_compressed() -> None:
    c = codec(compress=True)
    assert c.pack("t", "k", (), b"x" * 100)[len(MAGIC)] == 0
    assert c.pack("t", "k", (), b"x" * 2000)[len(MAGIC)] == COMPRESSED


def test_with_both_off_columns_are_written_as_before_and_old_columns_always_read() -> None:
    plain, sealed = codec(), codec(KEY_A, compress=True)
    headers, body = plain.to_columns("t", "k", CARD.headers, CARD.body)
    assert json.loads(headers) == [list(pair) for pair in CARD.headers] and body == CARD_BODY
    assert sealed.from_columns("t", "k", headers, body, backend="embedded") == (CARD.headers, CARD_BODY)
    framed_headers, frame = sealed.to_columns("t", "k", CARD.headers, CARD.body)
    assert framed_headers == FRAMED and frame.startswith(MAGIC)


def unreadable_count(metrics: Metrics, backend: str) -> float:
    value: float = metrics.records_unreadable.labels(backend)._value.get()
    return value


@pytest.mark.parametrize("damage", ["tamper", "other_key", "other_tenant", "unknown_key", "flags", "unknown_flags",
                                    "unsealed_flags"])
def test_a_sealed_value_that_does_not_open_is_refused_logged_and_counted(
    damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics()
    c = codec(KEY_A, metrics=metrics)
    frame = c.pack("t", "k", CARD.headers, CARD_BODY)
    tenant, key, reader = "t", "k", c
    if damage == "tamper":
        frame = frame[:-20] + bytes([frame[-20] ^ 1]) + frame[-19:]
    elif damage == "other_key":
        key = "k2"
    elif damage == "other_tenant":
        tenant = "t2"
    elif damage == "unknown_key":
        reader = codec(KEY_B, metrics=metrics)
    elif damage == "unknown_flags":  # refused before it is opened, and the log still names the key it names
        frame = frame[:len(MAGIC)] + bytes([frame[len(MAGIC)] | 0x08]) + frame[len(MAGIC) + 1:]
    elif damage == "flags":
        frame = frame[:len(MAGIC)] + bytes([SEALED | COMPRESSED]) + frame[len(MAGIC) + 1:]
    else:  # read as a value in clear, its key id still where a seal keeps it (the log said "key id -")
        frame = frame[:len(MAGIC)] + bytes([0]) + frame[len(MAGIC) + 1:]
    with caplog.at_level(logging.ERROR, "idemproxy.store.codec"), pytest.raises(RecordUnreadable) as refused:
        reader.unpack(tenant, key, frame, backend="embedded")
    assert refused.value.status == 503 and refused.value.code == "store_unavailable"
    assert unreadable_count(metrics, "embedded") == 1
    assert key_id(base64.b64decode(KEY_A)).hex() in caplog.text
    assert "tok_live" not in caplog.text and CARD_HEADER not in caplog.text and "Jane" not in caplog.text


@pytest.mark.parametrize("length", [len(MAGIC) + 1 + 5, len(MAGIC) + 1 + 8, len(MAGIC) + 1 + 8 + 12 + 15])
def test_a_truncated_sealed_value_is_logged_as_truncated_not_as_sealed_with_an_unknown_key(
    length: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A sealed value cut short (a partial write, a truncated copy) within its key id was logged as "sealed with a
    key that is not configured" naming a key id that is only a prefix of the real one: the operator would look for
    a key removed in a rotation (audit, 2026-11-27). It is logged as truncated, with the key id only when whole."""
    metrics = Metrics()
    c = codec(KEY_A, metrics=metrics)
    frame = c.pack("t", "k", CARD.headers, CARD_BODY)[:length]
    with caplog.at_level(logging.ERROR, "idemproxy.store.codec"), pytest.raises(RecordUnreadable):
        c.unpack("t", "k", frame, backend="redis")
    assert "truncated" in caplog.text and "not configured" not in caplog.text
    whole = key_id(base64.b64decode(KEY_A)).hex()
    assert (whole in caplog.text) == (length >= len(MAGIC) + 1 + 8)
    assert "key id -" in caplog.text or whole in caplog.text
    assert unreadable_count(metrics, "redis") == 1


def test_a_bound_frame_opens_only_beside_the_outcome_it_was_sealed_with() -> None:
    """The status, the body-kept flag and the fingerprint are stored beside the frame (columns, the Redis copy's
    header), in clear; a sealed frame is bound to them, so rewriting them is tampering, and so is putting back a
    frame of an earlier completion of the same key for another payload. Its flag is in the associated data too:
    clearing it does not unbind the frame. Frames of earlier versions (no binding) still open."""
    c = codec(KEY_A)
    bound = c.pack("t", "k", CARD.headers, CARD_BODY, (402, True, FP))
    assert bound[len(MAGIC)] == SEALED | OUTCOME_BOUND
    assert c.unpack("t", "k", bound, backend="postgres", outcome=(402, True, FP)) == (CARD.headers, CARD_BODY)
    unbound = bound[:len(MAGIC)] + bytes([SEALED]) + bound[len(MAGIC) + 1:]
    for frame, outcome in [(bound, (200, True, FP)), (bound, (402, False, FP)), (bound, (402, True, "e" * 64)),
                           (bound, None), (unbound, (402, True, FP))]:
        with pytest.raises(RecordUnreadable):
            c.unpack("t", "k", frame, backend="postgres", outcome=outcome)
    for status in (402.0, "402", None, True):  # a clear-text status of another type (a hand-edited Redis copy)
        with pytest.raises(RecordUnreadable):
            c.unpack("t", "k", bound, backend="redis", outcome=(status, True, FP))  # type: ignore[arg-type]
    earlier = c.pack("t", "k", CARD.headers, CARD_BODY)  # as written before the binding
    assert earlier[len(MAGIC)] == SEALED
    assert c.unpack("t", "k", earlier, backend="postgres", outcome=(201, True, FP)) == (CARD.headers, CARD_BODY)
    assert codec(compress=True).pack("t", "k", (), CARD_BODY * 50, (201, True, FP))[len(MAGIC)] == COMPRESSED


async def test_an_earlier_answer_of_the_key_put_back_beside_a_new_payload_does_not_open(tmp_path: Path) -> None:
    """A key released (or expired) and run again with another payload gets a new sealed value; the earlier one
    (same tenant, key and status) written back by someone with write access to the store opened, and the new
    payload's retry was replayed the old payload's answer (review, 2026-11-27)."""
    section = with_codec({"embedded": {"path": str(tmp_path / "s.sqlite3")}}, KEY_A)
    old = StoredResponse(status=201, headers=(), body=b'{"charge": "ch_OLD", "amount": 100}')
    new = StoredResponse(status=201, headers=(), body=b'{"charge": "ch_NEW", "amount": 999900}')
    async with opened(section) as store:
        await completed(store, "k", old)
        db = sqlite3.connect(section["embedded"]["path"])
        try:
            saved = db.execute("SELECT headers, body FROM records WHERE tenant = 't' AND key = 'k'").fetchone()
        finally:
            db.close()
        assert await store.forget("t", "k")
        claim = await store.claim("t", "k", "e" * 64, lease=30, ttl=600)
        assert claim.owned and await store.complete(claim, new, ttl=600)
        db = sqlite3.connect(section["embedded"]["path"])
        try:
            assert db.execute("UPDATE records SET headers = ?, body = ? WHERE tenant = 't' AND key = 'k'",
                              saved).rowcount == 1
            db.commit()
        finally:
            db.close()
        with pytest.raises(RecordUnreadable):
            await store.claim("t", "k", "e" * 64, lease=30, ttl=600)


def test_previous_keys_open_what_they_sealed_and_the_primary_seals() -> None:
    old = codec(KEY_A).pack("t", "k", CARD.headers, CARD_BODY)
    rotated = codec(KEY_B, KEY_A)
    assert rotated.unpack("t", "k", old, backend="redis") == (CARD.headers, CARD_BODY)
    new = rotated.pack("t", "k", CARD.headers, CARD_BODY)
    assert new[len(MAGIC) + 1:len(MAGIC) + 9] == key_id(base64.b64decode(KEY_B))
    with pytest.raises(RecordUnreadable):
        codec(KEY_A).unpack("t", "k", new, backend="redis")


@pytest.mark.parametrize("content_size", [True, False])
def test_decompression_is_bounded(content_size: bool) -> None:
    """A hostile compressed value (a tiny frame of 64 MiB of zeros) is refused, announced size or not."""
    bomb = zstandard.ZstdCompressor(write_content_size=content_size).compress(bytes(64 * 1024 * 1024))
    assert len(bomb) < 64 * 1024
    frame = MAGIC + bytes([COMPRESSED]) + bomb
    with pytest.raises(RecordUnreadable):
        codec(max_body=1024 * 1024).unpack("t", "k", frame, backend="postgres")
    # the same frame under a bound that holds it opens: the refusal above is the bound, not the frame
    assert len(codec(max_body=65 * 1024 * 1024).unpack("t", "k", frame, backend="postgres")[1]) > 60 * 1024 * 1024


def test_a_response_as_large_as_max_stored_response_still_opens() -> None:
    c = codec(compress=True, max_body=200 * 1024)
    headers = tuple((f"X-H{i}", "v" * 200) for i in range(100))
    body = os.urandom(200 * 1024)
    assert c.unpack("t", "k", c.pack("t", "k", headers, body), backend="postgres") == (headers, body)


# ---------------------------------------------------------------------------------------------- real stores


def with_codec(section: dict[str, Any], *keys: str, compress: bool = False) -> dict[str, Any]:
    section = dict(section)
    if keys:
        section["encryption"] = {"key": keys[0], "previous_keys": list(keys[1:])}
    if compress:
        section["compression"] = {"min_size": "1KiB"}
    return section


@contextlib.asynccontextmanager
async def opened(section: dict[str, Any], metrics: Metrics | None = None) -> AsyncIterator[Store]:
    config = load_config({"upstream": {"url": "http://127.0.0.1:1"}, "storage": section})
    store = build_store(config.storage, metrics)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def completed(store: Store, key: str, response: StoredResponse = CARD, tenant: str = "t") -> None:
    claim = await store.claim(tenant, key, FP, lease=30, ttl=600)
    assert claim.owned
    assert await store.complete(claim, response, ttl=600)


async def replayed(store: Store, key: str, tenant: str = "t") -> StoredResponse | None:
    claim = await store.claim(tenant, key, FP, lease=30, ttl=600)
    assert not claim.owned and claim.record.state is State.COMPLETED
    return claim.record.response


async def raw_bytes(backend: str, section: dict[str, Any], store: Store, tenant: str, key: str) -> bytes:
    """Everything the backend holds for (tenant, key), read behind the proxy's back."""
    if backend == "embedded":
        path = Path(section["embedded"]["path"])
        return b"".join(p.read_bytes() for p in (path, Path(f"{path}-wal")) if p.exists())
    conn = await asyncpg.connect(section["postgres"]["dsn"])
    try:
        row = await conn.fetchrow("SELECT * FROM idemproxy_records WHERE tenant = $1 AND key = $2", tenant, key)
    finally:
        await conn.close()
    assert row is not None
    held = b"".join(v if isinstance(v, bytes) else str(v).encode() for v in row.values())
    if isinstance(store, RedisFrontedStore):
        client = sync_redis.Redis.from_url(section["redis"]["url"])
        try:
            cached = client.get(store._keys(tenant, key)[1])
        finally:
            client.close()
        assert isinstance(cached, bytes) and cached, "the replay cache holds the record"
        held += cached
    return held


@pytest.mark.parametrize("backend", BACKENDS)
async def test_with_encryption_on_the_response_is_nowhere_in_clear(backend: str, storage: StorageFactory) -> None:
    section = storage(backend)
    clear = StoredResponse(status=200, headers=(("X-Card-Fp", "fp_CONTROL"),), body=b'{"token": "tok_CONTROL"}')
    async with opened(section) as store:  # the control: the same reader does find what is stored in clear
        await completed(store, "clear", clear)
        held = await raw_bytes(backend, section, store, "t", "clear")
        assert b"tok_CONTROL" in held and b"fp_CONTROL" in held
    async with opened(with_codec(section, KEY_A)) as store:
        await completed(store, "sealed")
        held = await raw_bytes(backend, section, store, "t", "sealed")
        assert b"tok_live_SECRET123" not in held and b"Jane Q Public" not in held
        assert CARD_HEADER.encode() not in held
        assert await replayed(store, "sealed") == CARD


@pytest.mark.parametrize("backend", BACKENDS)
async def test_records_written_with_both_off_replay_after_turning_them_on(
    backend: str, storage: StorageFactory
) -> None:
    section = storage(backend)
    async with opened(section) as store:
        await completed(store, "old")
    async with opened(with_codec(section, KEY_A, compress=True)) as store:
        assert await replayed(store, "old") == CARD
        await completed(store, "new")
        assert await replayed(store, "new") == CARD
        assert await store.get("t", "old") == await store.get("t", "old")  # read twice: nothing rewritten


@pytest.mark.parametrize("backend", BACKENDS)
async def test_rotation_keeps_old_records_readable_until_their_key_is_removed(
    backend: str, storage: StorageFactory
) -> None:
    section = storage(backend)
    async with opened(with_codec(section, KEY_A)) as store:
        await completed(store, "sealed-by-a")
    async with opened(with_codec(section, KEY_B, KEY_A)) as store:  # step 2: B seals, A still opens
        assert await replayed(store, "sealed-by-a") == CARD
        await completed(store, "sealed-by-b")
    metrics = Metrics()
    async with opened(with_codec(section, KEY_B), metrics) as store:  # step 3: A removed
        assert await replayed(store, "sealed-by-b") == CARD
        with pytest.raises(RecordUnreadable):
            await store.claim("t", "sealed-by-a", FP, lease=30, ttl=600)
    assert unreadable_count(metrics, backend) == 1


async def copy_stored_value(backend: str, section: dict[str, Any], store: Store, source: str, target: str) -> None:
    """What someone with write access to the store could do: move one record's sealed value onto another."""
    if isinstance(store, RedisFrontedStore):
        client = sync_redis.Redis.from_url(section["redis"]["url"])
        try:
            value = client.get(store._keys("t", source)[1])
            assert value
            client.set(store._keys("t", target)[1], value, px=600_000)
        finally:
            client.close()
        return
    await update_one_row(backend, section, (
        f"UPDATE {{table}} SET headers = (SELECT headers FROM {{table}} WHERE tenant = 't' AND key = '{source}'), "
        f"body = (SELECT body FROM {{table}} WHERE tenant = 't' AND key = '{source}') "
        f"WHERE tenant = 't' AND key = '{target}'"))


async def update_one_row(backend: str, section: dict[str, Any], update: str) -> None:
    """Run ``update`` (``{table}``: the records table) on the durable store itself; it must change one row."""
    if backend == "embedded":
        db = sqlite3.connect(section["embedded"]["path"])
        try:
            assert db.execute(update.format(table="records")).rowcount == 1
            db.commit()
        finally:
            db.close()
        return
    conn = await asyncpg.connect(section["postgres"]["dsn"])
    try:
        assert await conn.execute(update.format(table="idemproxy_records")) == "UPDATE 1"
    finally:
        await conn.close()


def edit_redis_head(section: dict[str, Any], store: RedisFrontedStore, key: str,
                    edit: Callable[[dict[str, Any]], None]) -> None:
    """Change the clear-text head of (t, key)'s Redis copy, its frame untouched, behind the proxy's back."""
    client = sync_redis.Redis.from_url(section["redis"]["url"])
    try:
        name = store._keys("t", key)[1]
        value = client.get(name)
        assert isinstance(value, bytes)
        raw_head, _, frame = value.partition(b"\n")
        head = json.loads(raw_head)
        edit(head)
        client.set(name, json.dumps(head).encode() + b"\n" + frame, px=600_000)
    finally:
        client.close()


async def relabel_as_clear(backend: str, section: dict[str, Any], store: Store, key: str) -> None:
    """What someone with write access to the store could do: mark a sealed record as one written in clear, so
    that its sealed bytes would be read as the body (and replayed, unopened)."""
    if isinstance(store, RedisFrontedStore):
        edit_redis_head(section, store, key, lambda head: head.update(h=[]))
        return
    await update_one_row(backend, section, f"UPDATE {{table}} SET headers = '[]' WHERE tenant = 't' AND key = '{key}'")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_sealed_value_relabelled_as_clear_is_refused_not_replayed(
    backend: str, storage: StorageFactory
) -> None:
    section = with_codec(storage(backend), KEY_A)
    metrics = Metrics()
    async with opened(section, metrics) as store:
        await completed(store, "relabelled")
        await relabel_as_clear(backend, section, store, "relabelled")
        with pytest.raises(RecordUnreadable):
            await store.claim("t", "relabelled", FP, lease=30, ttl=600)
    assert unreadable_count(metrics, backend) == 1
    async with opened(with_codec(storage(backend), KEY_B), metrics) as store:  # A rotated out since
        with pytest.raises(RecordUnreadable):
            await store.claim("t", "relabelled", FP, lease=30, ttl=600)
    assert unreadable_count(metrics, backend) == 2
    async with opened(storage(backend)) as store:  # with encryption off, a body in clear is what it says
        looks_sealed = StoredResponse(status=200, headers=(), body=MAGIC + b"\x02not a frame of ours")
        await completed(store, "clear", looks_sealed)
        assert await replayed(store, "clear") == looks_sealed


async def rewrite_outcome(backend: str, section: dict[str, Any], store: Store, key: str, field: str) -> None:
    """What someone with write access to the store could do: make a declined charge's 402 a 200 beside its sealed
    value, or say a body was kept that was not (and the other way round)."""
    if isinstance(store, RedisFrontedStore):
        edit_redis_head(section, store, key, lambda head: head.update(s=200) if field == "status"
                        else head.update(b=not head["b"]))
        return
    change = "status = 200" if field == "status" else "body_stored = NOT body_stored"
    await update_one_row(backend, section, f"UPDATE {{table}} SET {change} WHERE tenant = 't' AND key = '{key}'")


@pytest.mark.parametrize("field", ["status", "body_kept"])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_status_or_body_flag_rewritten_beside_a_sealed_value_is_refused(
    backend: str, field: str, storage: StorageFactory
) -> None:
    """A record's status sat outside the seal: a 402 decline rewritten to 200 in the store was replayed as 200
    with the genuine sealed body (audit, 2026-11-27). A sealed value is now bound to both."""
    section = with_codec(storage(backend), KEY_A)
    declined = StoredResponse(status=402, headers=(("Content-Type", "application/json"),),
                              body=b'{"error": "card_declined"}')
    metrics = Metrics()
    async with opened(section, metrics) as store:
        await completed(store, "declined", declined)
        assert await replayed(store, "declined") == declined
        await rewrite_outcome(backend, section, store, "declined", field)
        with pytest.raises(RecordUnreadable):
            await store.claim("t", "declined", FP, lease=30, ttl=600)
    assert unreadable_count(metrics, backend) == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_sealed_value_copied_onto_another_record_is_refused(backend: str, storage: StorageFactory) -> None:
    section = with_codec(storage(backend), KEY_A)
    other = StoredResponse(status=201, headers=(), body=b'{"id": "victim"}')
    async with opened(section) as store:
        await completed(store, "attacker")
        await completed(store, "victim", other)
        await copy_stored_value(backend, section, store, "attacker", "victim")
        with pytest.raises(RecordUnreadable):
            await store.claim("t", "victim", FP, lease=30, ttl=600)
        assert await replayed(store, "attacker") == CARD


async def test_a_compressible_200k_response_costs_a_fraction_in_redis(storage: StorageFactory) -> None:
    section = storage("redis")
    rows = [{"id": f"txn_{i:06d}", "amount": i * 7 % 10_000, "currency": "EUR", "status": "succeeded",
             "customer": f"cus_{i % 97:04d}"} for i in range(2000)]
    body = json.dumps({"data": rows}).encode()
    assert 190 * 1024 < len(body) < 230 * 1024
    response = StoredResponse(status=200, headers=(("Content-Type", "application/json"),), body=body)
    usage = {}
    for name, sec in (("raw", section), ("zstd", with_codec(section, compress=True))):
        async with opened(sec) as store:
            assert isinstance(store, RedisFrontedStore)
            await completed(store, name, response)
            usage[name] = await store.redis.memory_usage(store._keys("t", name)[1])
            assert await replayed(store, name) == response
    assert usage["raw"] > len(body)
    assert usage["zstd"] < len(body) / 5, usage


# ---------------------------------------------------------------------------------------------- through the proxy


async def post_charge(proxy: Any, key: str) -> tuple[int, dict[str, Any]]:
    resp, body = await proxy.post("/v1/charges", key=key, body={"amount": 4200})
    return resp.status, json.loads(body)


@pytest.mark.parametrize("on_store_error", ["fail_closed", "fail_open"])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_record_whose_key_was_removed_is_503_and_never_executed_again(
    backend: str, on_store_error: str, make_proxy: ProxyFactory, storage: StorageFactory,
    upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture,
) -> None:
    section = {**storage(backend), "on_store_error": on_store_error}
    first = await make_proxy(storage_section=with_codec(section, KEY_A))
    assert (await post_charge(first, "pay-1"))[0] == 201
    assert (await post_charge(first, "pay-1"))[0] == 201  # replayed
    assert upstream.count() == 1
    await first.server.close()  # the embedded file is single-process
    second = await make_proxy(storage_section=with_codec(section, KEY_B))
    with caplog.at_level(logging.ERROR, "idemproxy.store.codec"):
        status, problem = await post_charge(second, "pay-1")
    assert (status, problem["code"]) == (503, "store_unavailable")
    assert upstream.count() == 1, "an unreadable record was executed again"
    assert key_id(base64.b64decode(KEY_A)).hex() in caplog.text
    metrics = second.proxy.metrics.render().decode()
    assert f'idemproxy_records_unreadable_total{{backend="{backend}"}} 1.0' in metrics
    # The claim that read it took nothing: no release to retry in the background (it counted one, and
    # filled the pending-settle bound and its alerts, for every request that met such a record).
    await second.proxy.engine.settler.flush(5, 1)
    registry = second.proxy.metrics.registry
    assert not registry.get_sample_value("idemproxy_settle_retries_total", {"operation": "release"})
    assert (await post_charge(second, "pay-2"))[0] == 201  # other keys are served as usual


@pytest.mark.parametrize("marker", ["@frbme", "[[1]]", "5"])
@pytest.mark.parametrize("backend", ["postgres", "embedded"])  # the durable stores, where the marker is a column
async def test_a_changed_byte_in_the_frame_marker_is_503_and_logged_not_a_500(
    backend: str, marker: str, make_proxy: ProxyFactory, storage: StorageFactory, upstream: RecordingUpstream,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A sealed record's headers column holds the marker "@frame"; one byte of it changed in the store (or any
    text there that is not a header list) made the replay a 500 internal_error with a traceback in the log, not
    the 503 store_unavailable and the error line naming the key id of a record that does not open (audit,
    2026-11-27)."""
    section = with_codec(storage(backend), KEY_A)
    proxy = await make_proxy(storage_section=section)
    assert (await post_charge(proxy, "pay-1"))[0] == 201
    await update_one_row(backend, section, f"UPDATE {{table}} SET headers = '{marker}' WHERE key = 'pay-1'")
    with caplog.at_level(logging.ERROR, "idemproxy.store.codec"):
        status, problem = await post_charge(proxy, "pay-1")
    assert (status, problem["code"]) == (503, "store_unavailable")
    assert upstream.count() == 1, "an unreadable record was executed again"
    assert key_id(base64.b64decode(KEY_A)).hex() in caplog.text
    assert "tok_live" not in caplog.text
    metrics = proxy.proxy.metrics.render().decode()
    assert f'idemproxy_records_unreadable_total{{backend="{backend}"}} 1.0' in metrics


@pytest.mark.parametrize("sealed", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_completed_record_whose_status_was_emptied_is_503_not_a_500(
    backend: str, sealed: bool, make_proxy: ProxyFactory, storage: StorageFactory, upstream: RecordingUpstream,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The status stands beside a sealed value, which is bound to it; a completed record whose status column was
    emptied (NULL) in the store was read as a completed record without a response, and its replay was a 500
    internal_error (an AssertionError with Redis in front). It is a record that does not open (audit,
    2026-11-27)."""
    section = with_codec(storage(backend), *([KEY_A] if sealed else []))
    proxy = await make_proxy(storage_section=section)
    assert (await post_charge(proxy, "pay-1"))[0] == 201
    await update_one_row(backend, section, "UPDATE {table} SET status = NULL WHERE key = 'pay-1'")
    if backend == "redis":  # the durable record is read once the replay cache no longer holds its copy
        client = sync_redis.Redis.from_url(section["redis"]["url"])
        try:
            for name in client.scan_iter(section["redis"]["key_prefix"] + "*"):
                client.delete(name)
        finally:
            client.close()
    with caplog.at_level(logging.ERROR, "idemproxy.store.codec"):
        status, problem = await post_charge(proxy, "pay-1")
    assert (status, problem["code"]) == (503, "store_unavailable")
    assert upstream.count() == 1, "an unreadable record was executed again"
    if sealed:
        assert key_id(base64.b64decode(KEY_A)).hex() in caplog.text


@pytest.mark.parametrize("sealed", [True, False])
async def test_a_body_column_turned_to_text_in_the_embedded_file_is_never_a_500(
    sealed: bool, make_proxy: ProxyFactory, storage: StorageFactory, upstream: RecordingUpstream,
) -> None:
    """SQLite keeps the storage class a value was written with, and one bit of the file tells a BLOB from a TEXT:
    a body column read back as str made the replay a 500 internal_error (TypeError in bytes()). A sealed record
    so changed does not open (503); one in clear replays the text it holds (audit, 2026-11-27)."""
    section = with_codec(storage("embedded"), *([KEY_A] if sealed else []))
    proxy = await make_proxy(storage_section=section)
    assert (await post_charge(proxy, "pay-1"))[0] == 201
    await update_one_row("embedded", section, "UPDATE {table} SET body = 'as text' WHERE key = 'pay-1'")
    resp, body = await proxy.post("/v1/charges", key="pay-1", body={"amount": 4200})
    if sealed:
        assert (resp.status, json.loads(body)["code"]) == (503, "store_unavailable")
    else:
        assert (resp.status, body) == (201, b"as text")
    assert upstream.count() == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_expired_record_whose_key_was_removed_is_claimable_again(
    backend: str, storage: StorageFactory
) -> None:
    """Step 3 of a rotation drops the old key once the TTL has passed: its records must not block their keys."""
    section = storage(backend)
    async with opened(with_codec(section, KEY_A)) as store:
        claim = await store.claim("t", "short", FP, lease=0.2, ttl=0.3)
        assert await store.complete(claim, CARD, ttl=0.3)
    await asyncio.sleep(0.4)
    async with opened(with_codec(section, KEY_B)) as store:
        again = await store.claim("t", "short", FP, lease=30, ttl=600)
        assert again.owned and again.replaced_expired


@pytest.mark.parametrize("backend", BACKENDS)
async def test_encryption_turned_off_with_previous_keys_still_opens_what_was_sealed(
    backend: str, storage: StorageFactory
) -> None:
    section = storage(backend)
    async with opened(with_codec(section, KEY_A)) as store:
        await completed(store, "sealed")
    reading_only = {**section, "encryption": {"previous_keys": [KEY_A]}}
    async with opened(reading_only) as store:
        assert await replayed(store, "sealed") == CARD
        await completed(store, "clear")
        assert b"tok_live_SECRET123" in await raw_bytes(backend, section, store, "t", "clear")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_operator_can_release_a_record_that_does_not_open(
    backend: str, make_proxy: ProxyFactory, storage: StorageFactory, upstream: RecordingUpstream
) -> None:
    """Never executed again *by the proxy*; the admin release is the operator's explicit decision to allow it."""
    from aiohttp import ClientSession
    from aiohttp.test_utils import TestServer

    section = storage(backend)
    first = await make_proxy(storage_section=with_codec(section, KEY_A))
    assert (await post_charge(first, "pay-1"))[0] == 201
    await first.server.close()
    second = await make_proxy(storage_section=with_codec(section, KEY_B), admin={"token": "admin-token"})
    assert (await post_charge(second, "pay-1"))[0] == 503
    tenant = second.proxy.engine.resolve_tenant_value("Bearer t1")
    admin = TestServer(second.proxy.admin_app(), host="127.0.0.1")
    await admin.start_server()
    try:
        async with ClientSession(headers={"Authorization": "Bearer admin-token"}) as session:
            async with session.get(admin.make_url(f"/admin/keys/{tenant}/pay-1")) as shown:
                assert shown.status == 503
            async with session.delete(admin.make_url(f"/admin/keys/{tenant}/pay-1")) as deleted:
                assert deleted.status == 200 and (await deleted.json())["state"] == "completed"
    finally:
        await admin.close()
    assert (await post_charge(second, "pay-1"))[0] == 201
    assert upstream.count() == 2


def test_a_payload_over_the_read_bound_is_stored_uncompressed_so_it_always_reads_back() -> None:
    c = codec(compress=True, max_body=1024)
    headers = tuple((f"X-H{i}", "v" * 1000) for i in range(300))  # 300 KB of headers: over the margin
    frame = c.pack("t", "k", headers, b"x" * 1024)
    assert frame[len(MAGIC)] == 0
    assert c.unpack("t", "k", frame, backend="postgres") == (headers, b"x" * 1024)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_response_too_large_to_store_keeps_its_status_and_headers_when_sealed(
    backend: str, storage: StorageFactory
) -> None:
    metrics = Metrics()
    section = with_codec(storage(backend), KEY_A, compress=True)
    too_large = StoredResponse(status=200, headers=(("X-Card-Fp", CARD_HEADER),), body=None)
    async with opened(section, metrics) as store:
        await completed(store, "big", too_large)
        assert await replayed(store, "big") == too_large
        await completed(store, "card")
    async with opened(with_codec(storage(backend), KEY_B), metrics) as store:
        with pytest.raises(RecordUnreadable):
            await store.claim("t", "card", FP, lease=30, ttl=600)
    assert unreadable_count(metrics, backend) == 1
    assert metrics.store_errors.labels(backend, "claim")._value.get() == 0, "the store answered; only the record failed"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=st.integers(0, 15), rest=st.binary(max_size=300), tamper=st.booleans())
def test_arbitrary_stored_bytes_either_open_or_are_refused_never_crash(flags: int, rest: bytes, tamper: bool) -> None:
    """Whatever someone writes into the store, reading it is a replay or a 503, never a 500."""
    c = codec(KEY_A, compress=True)
    frame = MAGIC + bytes([flags]) + rest
    if tamper:  # a valid compressed frame whose payload was edited
        frame = MAGIC + bytes([COMPRESSED]) + zstandard.ZstdCompressor().compress(b"\x00\x00\x00\x05[[[[[" + rest)
    try:
        c.unpack("t", "k", frame, backend="postgres")
    except RecordUnreadable:
        pass
    deep = MAGIC + bytes([0]) + (b"\x00\x01\x00\x00" + b"[" * 65536)
    with pytest.raises(RecordUnreadable):
        c.unpack("t", "k", deep, backend="postgres")


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats()
    | st.text(st.characters(exclude_categories=())),  # lone surrogates too (surrogateescape'd header bytes)
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_JSON_VALUES)
def test_the_encoders_built_once_write_what_json_writes(value: Any) -> None:
    """Stored headers and the Redis record header go through a C encoder built once (``json_encoder``): the
    same text as the public encoders, byte for byte, and the fast path is the one in use on this Python."""
    compact = json_encoder(",", ":")
    assert compact.__qualname__ == headers_json.__qualname__ == "json_encoder.<locals>.encode"
    assert headers_json(value) == json.dumps(value)
    assert compact(value) == json.JSONEncoder(separators=(",", ":")).encode(value)
