"""The request fingerprint: what makes two requests with one key "the same payload"."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any


def canonical_json(body: bytes) -> bytes | None:
    """``body`` as canonical JSON (sorted keys, no whitespace), or None when it is not JSON."""
    try:
        value: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def fingerprint(
    method: str,
    path_qs: str,
    headers: Iterable[tuple[str, str]],
    body: bytes,
    *,
    canonical: bool,
) -> str:
    """SHA-256 (hex) over method, raw path+query, the chosen headers and the body.

    Each part is length-prefixed so that no two different requests can share one byte stream.
    With ``canonical``, a JSON body is hashed in canonical form so key order and whitespace are
    ignored; any other body is hashed byte for byte.
    """
    digest = hashlib.sha256()

    def part(data: bytes) -> None:
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)

    part(method.upper().encode())
    part(path_qs.encode("latin-1", "replace"))
    for name, value in headers:
        part(name.lower().encode("latin-1", "replace"))
        part(value.encode("latin-1", "replace"))
    if canonical:
        normal = canonical_json(body)
        if normal is not None:
            part(b"json")
            part(normal)
            return digest.hexdigest()
    part(b"raw")
    part(body)
    return digest.hexdigest()
