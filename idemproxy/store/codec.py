"""How a stored response's headers and body are written: in clear, compressed (zstd) or sealed (AES-256-GCM).

With ``storage.compression`` and ``storage.encryption`` both off, values are written exactly as before (headers
as JSON text, body as raw bytes). With either on, a completed record's headers and body are packed into one
*frame*::

    b"IDP1" | flags (1 byte) | key id (8 bytes) + nonce (12 bytes), when sealed | payload
    payload, once opened and decompressed = len(headers JSON) (4 bytes, big endian) | headers JSON | body

flags: ``COMPRESSED`` (zstd) and ``SEALED`` (AES-256-GCM, the tag at the end). Each value says how it was
written, so plain, compressed and sealed records mix in one store and a switch on or off needs no migration.
The key id is the first 8 bytes of SHA-256 of the key: a value names the key that opens it, so old keys can stay
readable (``previous_keys``) while a new one seals. The associated data binds a sealed frame to its record's
tenant and key, its flags and its key id: a frame copied onto another record, or re-flagged, does not open.

Where a backend keeps a frame (PostgreSQL and SQLite: the headers column holds :data:`FRAMED` and the frame is
the body column; the Redis cache: a head without ``h``), the old plain format cannot be mistaken for it.

A value that does not open is never replayed: :meth:`Codec.unpack` logs the key id and a hash of the record's
(tenant, key) — never its content — counts it, and raises :class:`~idemproxy.problems.RecordUnreadable`
(503 ``store_unavailable``). Decompression is bounded, so a hostile stored value cannot exhaust memory.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import struct
from collections.abc import Callable
from typing import Any

import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from idemproxy.config import CompressionConfig, EncryptionConfig, Secret, StorageConfig
from idemproxy.metrics import Metrics
from idemproxy.problems import RecordUnreadable

log = logging.getLogger("idemproxy.store.codec")

MAGIC = b"IDP1"
COMPRESSED = 0x01
SEALED = 0x02
# Sealed, and bound to what the record keeps beside the frame: the status, whether the body was kept and the
# fingerprint (so a declined charge's 402 rewritten to 200 in the store does not open, nor does an earlier answer
# of the same key put back beside a new payload's record). Older versions refuse such a frame (503).
OUTCOME_BOUND = 0x04
KEY_ID_BYTES = 8
TAG_BYTES = 16  # AES-GCM's authentication tag, at the end of a sealed frame
NONCE_BYTES = 12  # 96-bit random nonces: collision odds stay negligible far past any record count we store
FRAMED = "@frame"  # the headers column of a record whose headers and body are one frame in the body column
# What a decompressed frame may hold besides the body: every header of a response, with room to spare.
HEADERS_MARGIN = 256 * 1024
MAX_WINDOW = 8 * 1024 * 1024  # zstd window a frame may ask for (ours use at most 2 MiB at level <= 19 here)
_LENGTH = struct.Struct(">I")
_OUTCOME = struct.Struct(">I?")
UNKNOWN_STATUS = 0xFFFFFFFF  # a reader that does not know the status: never authenticates a bound frame

# (status, body kept, fingerprint) of a completed record: what its record keeps beside the frame. The fingerprint
# makes a frame of an earlier completion of the same key (released, or expired, then run with another payload)
# not open beside the new payload's record.
Outcome = tuple[int, bool, str]

Headers = tuple[tuple[str, str], ...]


class Unreadable(Exception):
    """A frame that does not open; ``key_id`` is the key it names, when it names one."""

    def __init__(self, reason: str, key_id: bytes | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.key_id = key_id


def key_id(key: bytes) -> bytes:
    """The id a sealed value carries for ``key`` (not secret: a hash prefix of 32 random bytes)."""
    return hashlib.sha256(key).digest()[:KEY_ID_BYTES]


def json_encoder(item_separator: str = ", ", key_separator: str = ": ") -> Callable[[Any], str]:
    """``json.JSONEncoder(separators=...).encode``, byte for byte, for the plain values stored here (str, int,
    float, bool, None, lists, tuples, dicts with str keys; never circular). ``encode`` builds the C encoder anew
    on every call, a third of a small record's encoding; this one is built once. Where the C encoder is missing
    or does not match the public method on a sample, the public method is returned."""
    base = json.JSONEncoder(separators=(item_separator, key_separator))
    public = base.encode
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return public
    try:
        encoder = make(None, base.default, json.encoder.encode_basestring_ascii, None, key_separator,
                       item_separator, False, False, True)
        sample = {"f": "é\n\"", "h": (("a", "b"), ["c", "d"]), "s": 201, "c": 1763990000.123456, "b": True,
                  "n": None, "x": float("inf")}
        if "".join(encoder(sample, 0)) != public(sample):
            return public
    except Exception:  # another Python's C encoder takes other arguments
        return public

    def encode(value: Any) -> str:
        return "".join(encoder(value, 0))

    return encode


headers_json: Callable[[Headers], str] = json_encoder()  # pairs as JSON arrays, tuples or lists alike


def parse_headers(text: str | bytes | None) -> Headers:
    return tuple((str(k), str(v)) for k, v in json.loads(text or "[]"))


def _associated(tenant: str, key: str, prefix: bytes, outcome: Outcome | None) -> bytes:
    """What a sealed frame is bound to: its record (length-prefixed, so no two (tenant, key) pairs collide) and,
    with OUTCOME_BOUND, the status, body-kept flag and fingerprint stored beside it."""
    t, k = (part.encode("utf-8", "surrogateescape") for part in (tenant, key))
    bound = prefix + _LENGTH.pack(len(t)) + t + _LENGTH.pack(len(k)) + k
    if prefix[len(MAGIC)] & OUTCOME_BOUND:
        status, kept, fingerprint = outcome if outcome is not None else (UNKNOWN_STATUS, False, "")
        if type(status) is not int or not 0 <= status < UNKNOWN_STATUS:  # (a float or text from a hand-edited copy)
            status = UNKNOWN_STATUS
        fp = str(fingerprint).encode("utf-8", "surrogateescape")
        bound += _OUTCOME.pack(status, bool(kept)) + _LENGTH.pack(len(fp)) + fp
    return bound


def _column_bytes(body: object) -> bytes:
    """The body column's value as bytes. SQLite keeps whatever storage class a value was written with: a TEXT
    value there (one bit of the file's record header tells a BLOB from a TEXT) comes back as str."""
    if body is None:
        return b""
    if isinstance(body, str):
        return body.encode("utf-8", "surrogateescape")
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    return str(body).encode()  # (a number written there by hand)


def record_hash(tenant: str, key: str) -> str:
    """A log-safe name for a record: neither the tenant nor the key can be read from it."""
    return hashlib.sha256(f"{tenant}\x1f{key}".encode("utf-8", "surrogateescape")).hexdigest()[:12]


def _named_key(frame: bytes) -> bytes | None:
    """The key id a frame names, when its flags say it is sealed (whatever else they say)."""
    split = len(MAGIC) + 1 + KEY_ID_BYTES
    if len(frame) >= split and frame[len(MAGIC)] & SEALED:
        return frame[len(MAGIC) + 1:split]
    return None


class Codec:
    """Packs stored responses per the storage config and reads back every format ever written."""

    def __init__(
        self, compression: CompressionConfig | None = None, encryption: EncryptionConfig | None = None, *,
        max_body: int = 1024 * 1024, metrics: Metrics | None = None,
    ) -> None:
        self.compression = compression
        self.metrics = metrics
        self.max_payload = _LENGTH.size + HEADERS_MARGIN + max_body
        # zstd contexts are not thread-safe: one codec serves one store, which packs on the event loop and
        # unpacks either there (PostgreSQL, Redis) or on its single SQLite thread (embedded), never both.
        self._compressor = zstandard.ZstdCompressor(level=compression.level) if compression else None
        self._decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        self._keys: dict[bytes, AESGCM] = {}
        self._sealing: tuple[bytes, AESGCM] | None = None
        if encryption is not None:
            for secret in (encryption.key, *encryption.previous_keys):
                if secret:
                    self._keys.setdefault(*self._cipher(secret))
            if encryption.key:  # without one, previous_keys only read (turning encryption off)
                self._sealing = self._cipher(encryption.key)

    @classmethod
    def from_config(cls, storage: StorageConfig, *, max_body: int, metrics: Metrics | None = None) -> Codec:
        return cls(storage.compression, storage.encryption, max_body=max_body, metrics=metrics)

    @staticmethod
    def _cipher(secret: Secret) -> tuple[bytes, AESGCM]:
        raw = base64.b64decode(secret.reveal())
        return key_id(raw), AESGCM(raw)

    @property
    def framing(self) -> bool:
        """Whether new values are written as frames (compression or encryption on)."""
        return self._compressor is not None or self._sealing is not None

    def describe(self) -> str:
        """One log-safe line for the start-up log: what new values get, which key ids are readable."""
        parts = [f"compression zstd from {self.compression.min_size} bytes" if self.compression else "no compression"]
        if self._sealing is not None:
            others = [k.hex() for k in self._keys if k != self._sealing[0]]
            parts.append(f"encryption AES-256-GCM with key id {self._sealing[0].hex()}"
                         + (f" (also reading key ids {', '.join(others)})" if others else ""))
        else:
            parts.append("no encryption" + (f" (reading key ids {', '.join(k.hex() for k in self._keys)})"
                                            if self._keys else ""))
        return "stored responses: " + "; ".join(parts)

    # ------------------------------------------------------------------ frames

    def pack(self, tenant: str, key: str, headers: Headers, body: bytes, outcome: Outcome | None = None) -> bytes:
        """One frame holding ``headers`` and ``body``, compressed and sealed as configured; a sealed frame is
        bound to ``outcome`` (the status, body-kept flag and fingerprint stored beside it) when given."""
        head = headers_json(headers).encode()
        payload = _LENGTH.pack(len(head)) + head + body
        flags = 0
        # Never compress what reading back would refuse (headers beyond the margin): such a value is kept raw.
        compress = self.compression is not None and self.compression.min_size <= len(payload) <= self.max_payload
        if self._compressor is not None and compress:
            payload = self._compressor.compress(payload)
            flags |= COMPRESSED
        if self._sealing is None:
            return MAGIC + bytes([flags]) + payload
        flags |= SEALED | (OUTCOME_BOUND if outcome is not None else 0)
        kid, cipher = self._sealing
        nonce = os.urandom(NONCE_BYTES)
        prefix = MAGIC + bytes([flags]) + kid
        return prefix + nonce + cipher.encrypt(nonce, payload, _associated(tenant, key, prefix, outcome))

    def unpack(self, tenant: str, key: str, frame: bytes, *, backend: str, outcome: Outcome | None = None
               ) -> tuple[Headers, bytes]:
        """The headers and body a frame holds, or :class:`RecordUnreadable` (logged and counted). ``outcome``:
        what the record says beside the frame, which a bound frame must have been sealed with."""
        try:
            return self._unpack(tenant, key, frame, outcome)
        except Unreadable as exc:
            if exc.key_id is None:  # its flags altered: a configured key's id may still stand where a seal keeps it
                named = frame[len(MAGIC) + 1:len(MAGIC) + 1 + KEY_ID_BYTES]
                exc.key_id = named if named in self._keys else None
            raise self._unreadable(tenant, key, backend, exc) from None

    def _unpack(self, tenant: str, key: str, frame: bytes, outcome: Outcome | None) -> tuple[Headers, bytes]:
        if len(frame) < len(MAGIC) + 1 or not frame.startswith(MAGIC):
            raise Unreadable("not a frame")
        flags = frame[len(MAGIC)]
        if flags & ~(COMPRESSED | SEALED | OUTCOME_BOUND) or (flags & OUTCOME_BOUND and not flags & SEALED):
            raise Unreadable(f"unknown flags {flags:#x}", _named_key(frame))
        payload = frame[len(MAGIC) + 1:]
        if flags & SEALED:
            payload = self._open(tenant, key, frame, outcome)
        if flags & COMPRESSED:
            payload = self._decompress(payload)
        if len(payload) < _LENGTH.size:
            raise Unreadable("truncated payload")
        (head_length,) = _LENGTH.unpack_from(payload)
        head_end = _LENGTH.size + head_length
        try:
            headers = parse_headers(payload[_LENGTH.size:head_end])
        except (ValueError, TypeError, RecursionError) as exc:
            raise Unreadable(f"headers not readable ({type(exc).__name__})") from None
        return headers, payload[head_end:]

    def _open(self, tenant: str, key: str, frame: bytes, outcome: Outcome | None) -> bytes:
        split = len(MAGIC) + 1 + KEY_ID_BYTES
        kid = frame[len(MAGIC) + 1:split]
        if len(frame) < split + NONCE_BYTES + TAG_BYTES:  # cut short: not a key that is missing (its id may be cut)
            raise Unreadable("truncated", kid if len(kid) == KEY_ID_BYTES else None)
        cipher = self._keys.get(kid)
        if cipher is None:
            raise Unreadable("sealed with a key that is not configured", kid)
        nonce, sealed = frame[split:split + NONCE_BYTES], frame[split + NONCE_BYTES:]
        try:
            return cipher.decrypt(nonce, sealed, _associated(tenant, key, frame[:split], outcome))
        except (InvalidTag, ValueError):
            raise Unreadable("does not authenticate (tampered, or copied from another record)", kid) from None

    def _decompress(self, data: bytes) -> bytes:
        # A frame header may announce any size, and decompress() would allocate it: check it first.
        try:
            size = zstandard.frame_content_size(data)
            if size > self.max_payload:
                raise Unreadable(f"announces {size} bytes decompressed, over the limit of {self.max_payload}")
            return self._decompressor.decompress(data, max_output_size=self.max_payload, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise Unreadable(f"compressed data not readable ({exc})") from None

    def _unreadable(self, tenant: str, key: str, backend: str, exc: Unreadable) -> RecordUnreadable:
        kid = exc.key_id.hex() if exc.key_id else "-"
        log.error("stored response of record %s (%s) cannot be read: %s; key id %s; answering 503, never "
                  "replaying or forwarding it", record_hash(tenant, key), backend, exc.reason, kid,
                  extra={"record": record_hash(tenant, key), "key_id": kid, "backend": backend})
        if self.metrics is not None:
            self.metrics.records_unreadable.labels(backend).inc()
        return RecordUnreadable(
            "The stored response for this idempotency key cannot be read; it will not be replayed or executed "
            "again. The operator has been told (key id in the log).",
        )

    # ------------------------------------------------------------------ two-column backends

    def to_columns(self, tenant: str, key: str, headers: Headers, body: bytes | None, status: int | None = None,
                   fingerprint: str = "") -> tuple[str, bytes]:
        """The (headers text, body bytes) columns of PostgreSQL and SQLite for a completed response (``body``
        None: not kept); a sealed frame is bound to ``status``, that, and ``fingerprint`` when the status is
        given."""
        if not self.framing:
            return headers_json(headers), body or b""
        outcome = None if status is None else (status, body is not None, fingerprint)
        return FRAMED, self.pack(tenant, key, headers, body or b"", outcome)

    def from_columns(
        self, tenant: str, key: str, headers: str | None, body: bytes | None, *, backend: str,
        outcome: Outcome | None = None,
    ) -> tuple[Headers, bytes]:
        """Read back what :meth:`to_columns` wrote, in any format ever written (old rows hold JSON text)."""
        raw = _column_bytes(body)
        if headers == FRAMED:
            return self.unpack(tenant, key, raw, backend=backend, outcome=outcome)
        try:
            parsed = parse_headers(headers)
        except (ValueError, TypeError, RecursionError) as exc:  # the marker or the headers changed in the store
            raise self._unreadable(tenant, key, backend, Unreadable(
                f"headers column not readable ({type(exc).__name__})", _named_key(raw))) from None
        return parsed, self.plain_body(tenant, key, raw, backend=backend)

    def without_status(self, tenant: str, key: str, body: object, *, backend: str) -> RecordUnreadable:
        """A completed record whose status is gone (its column emptied in the store): it cannot be replayed, and a
        sealed value beside it is not beside the status it was sealed with. Logged and counted as :meth:`unpack`
        does."""
        return self._unreadable(tenant, key, backend, Unreadable(
            "a completed record without a status", _named_key(_column_bytes(body))))

    def plain_body(self, tenant: str, key: str, body: bytes, *, backend: str) -> bytes:
        """``body`` of a record marked as written in clear, unless, while any key is configured, it is a sealed
        frame (ours, or sealed with a key rotated out since): then the record's format marker was changed
        (tampering), and the sealed bytes would be replayed as its body. (An upstream answer that itself starts
        with the frame's magic bytes and a sealed flag would be refused too: not seen in practice.)"""
        if self._keys and body.startswith(MAGIC):
            kid = _named_key(body)
            if kid is not None and len(body) >= len(MAGIC) + 1 + KEY_ID_BYTES + NONCE_BYTES + TAG_BYTES:
                raise self._unreadable(tenant, key, backend, Unreadable(
                    "a sealed value under the marker of a value in clear (tampered)", kid))
        return body


PLAIN = Codec()  # compression and encryption off: values as written before either existed
