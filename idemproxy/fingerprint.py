"""The request fingerprint: what makes two requests with one key "the same payload".

Two requests share a fingerprint only when an upstream cannot tell their payloads apart. The canonical
JSON form therefore forgets exactly what JSON says carries no meaning (member order, whitespace between
tokens, how a string is escaped) and nothing else: numbers keep their exact digits, and a body that is not
plain UTF-8 JSON, repeats a member name, nests deeper than ``MAX_DEPTH`` or holds a string no UTF-8 can
carry (a lone surrogate escape such as ``"\\ud800"``) is hashed byte for byte. docs/fingerprint.md has the
rules with examples.
"""

from __future__ import annotations

import codecs
import decimal
import hashlib
import json
from collections.abc import Callable, Iterable
from decimal import Decimal
from operator import itemgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hashlib import _Hash

# Deeper bodies are hashed raw. A fixed cap keeps the result independent of how deep the caller's stack
# happens to be (json's C scanner raises RecursionError somewhere near the interpreter's limit) and bounds
# the copying of nested members to MAX_DEPTH passes over the body.
MAX_DEPTH = 64

# json's own escaper (the C one when available), as json.dumps(..., ensure_ascii=False) uses it: it escapes
# '"', '\\' and control characters and leaves every other character as itself.
_quote: Callable[[str], str] = json.encoder.encode_basestring
_LITERALS = {True: "true", False: "false", None: "null"}
_by_name = itemgetter(0)


class _Refused(ValueError):
    """JSON that is hashed raw instead: a repeated member name, too deep, or NaN/Infinity."""


# The decoder hands every number over as a Decimal made from its source text: exact, so no two numbers merge
# unless they spell one decimal with the same digits (1e2, 1E2 and 1e+2 do; 1, 1.0 and 1.00 do not). An
# object or array becomes a tuple (canonical text, nesting depth), innermost first.
_Node = tuple[str, int]


def _canonical(value: Any, level: int) -> _Node:
    """A decoded value's canonical text and nesting depth.

    ``level``: how many arrays enclose ``value`` in the walk that reached it.
    """
    kind = type(value)
    if kind is str:
        return _quote(value), 0
    if kind is Decimal:
        return str(value), 0
    if kind is tuple:
        return value  # type: ignore[no-any-return]
    if kind is list:
        if level >= MAX_DEPTH:
            raise _Refused("nested too deep")
        return _array(value, level + 1)
    return _LITERALS[value], 0


def _array(items: list[Any], level: int) -> _Node:
    # Arrays have no decoder hook, so nested arrays are walked here, top down; ``level`` stops the walk
    # at MAX_DEPTH. Objects inside them are canonical already. Scalars are inlined: this loop runs once
    # per array element of every body.
    depth = 0
    parts: list[str] = []
    append = parts.append
    for item in items:
        kind = type(item)
        if kind is Decimal:
            append(str(item))
        elif kind is str:
            append(_quote(item))
        else:
            text, inner = _canonical(item, level)
            append(text)
            if inner > depth:
                depth = inner
    if depth >= MAX_DEPTH:
        raise _Refused("nested too deep")
    return "[" + ",".join(parts) + "]", depth + 1


def _object(pairs: list[tuple[str, Any]]) -> _Node:
    """The decoder's hook for every object, innermost first: members sorted by name, duplicates refused."""
    pairs.sort(key=_by_name)
    depth = 0
    parts: list[str] = []
    append = parts.append
    previous = None
    for name, value in pairs:
        if name == previous:
            raise _Refused("duplicate member name")
        previous = name
        kind = type(value)
        if kind is str:
            append(_quote(name) + ":" + _quote(value))
        elif kind is Decimal:
            append(_quote(name) + ":" + str(value))
        else:
            text, inner = _canonical(value, 0)
            append(_quote(name) + ":" + text)
            if inner > depth:
                depth = inner
    if depth >= MAX_DEPTH:
        raise _Refused("nested too deep")
    return "{" + ",".join(parts) + "}", depth + 1


def _no_constants(name: str) -> Any:
    raise _Refused(f"{name} is not JSON")


_decoder = json.JSONDecoder(
    object_pairs_hook=_object, parse_float=Decimal, parse_int=Decimal, parse_constant=_no_constants
)
# A number Decimal cannot hold (an exponent past about 10**18) must raise rather than become NaN, whatever
# the thread's decimal context says.
_STRICT = decimal.Context(traps=[decimal.InvalidOperation])


def canonical_json(body: bytes) -> bytes | None:
    """``body`` in canonical JSON form, or None when it is to be hashed byte for byte.

    Canonical: members sorted by their decoded names, no whitespace, strings re-escaped as
    ``json.dumps(ensure_ascii=False)`` does, numbers exact (as Decimal writes them: 1e2 is 1E+2). None for
    anything but UTF-8 JSON without a BOM, and for JSON with a repeated member name, nesting deeper than
    MAX_DEPTH, a lone surrogate, NaN/Infinity or an exponent no Decimal holds.
    """
    if body.startswith(codecs.BOM_UTF8):
        return None
    try:
        context = decimal.getcontext()
        # Decimal(text) heeds only the context's InvalidOperation trap and str(Decimal) only its capitals: a
        # context that agrees with _STRICT on both (the default one does) gives the same result, and entering
        # _STRICT costs a quarter of a small body's canonical form.
        if context.traps[decimal.InvalidOperation] and context.capitals == _STRICT.capitals:
            text, _ = _canonical(_decoder.decode(body.decode("utf-8")), 0)
        else:
            with decimal.localcontext(_STRICT):
                text, _ = _canonical(_decoder.decode(body.decode("utf-8")), 0)
        return text.encode("utf-8")  # a lone surrogate escape fails here: UnicodeEncodeError
    except (ValueError, ArithmeticError, RecursionError):
        # RecursionError: nesting far past MAX_DEPTH reaches the interpreter's limit inside the decoder.
        return None


def _wire_bytes(text: str) -> bytes:
    """The bytes a header value or request target came as (aiohttp decodes them utf-8/surrogateescape)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no wire bytes decode to: still one distinct encoding, no crash
        return text.encode("utf-8", "surrogatepass")


def _framed(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def _head(method: str, path_qs: str, headers: Iterable[tuple[str, str]]) -> list[bytes]:
    """The framed small parts: method, raw path+query, then each chosen header's name and value."""
    head = [_framed(_wire_bytes(method.upper())), _framed(_wire_bytes(path_qs))]
    for name, value in headers:
        head.append(_framed(_wire_bytes(name.lower())))
        head.append(_framed(_wire_bytes(value)))
    return head


def _digest(head: list[bytes], form: bytes, body: bytes) -> _Hash:
    # The small parts go to the hash in one update, the body (perhaps large, never copied) in a second.
    digest = hashlib.sha256(b"".join([*head, _framed(form), len(body).to_bytes(8, "big")]))
    digest.update(body)
    return digest


def fingerprint(
    method: str,
    path_qs: str,
    headers: Iterable[tuple[str, str]],
    body: bytes,
    *,
    canonical: bool,
) -> str:
    """SHA-256 (hex) over method, raw path+query, the chosen headers and the body.

    Each part is length-prefixed so that no two different requests can share one byte stream. Text parts
    are hashed as the bytes that came over the wire. With ``canonical``, a JSON body is hashed in canonical
    form (see :func:`canonical_json`); any other body is hashed byte for byte.
    """
    head = _head(method, path_qs, headers)
    normal = canonical_json(body) if canonical else None
    if normal is not None:
        return _digest(head, b"json", normal).hexdigest()
    return _digest(head, b"raw", body).hexdigest()


MEMO_ENTRIES = 4096  # canonical fingerprints remembered per process (about 1 MiB)


class Fingerprinter:
    """:func:`fingerprint`, remembering the canonical results of the bytes it saw last.

    A retry sends the same bytes again, and the canonical form (decode, sort, re-encode) is most of a
    fingerprint's cost. The result depends on nothing but the request's method, target, chosen headers and
    body bytes, and the raw fingerprint is a SHA-256 over exactly those; so the raw fingerprint names the
    canonical one, and a retry of the same bytes pays a hash of them instead of the canonical form. A retry
    whose bytes differ (members reordered, other whitespace) is not found and pays the canonical form, with
    the same result as ever. The oldest of ``entries`` results makes way first.
    """

    def __init__(self, entries: int = MEMO_ENTRIES) -> None:
        self.entries = entries
        self._memo: dict[bytes, str] = {}
        self.hits = 0

    def __call__(
        self, method: str, path_qs: str, headers: Iterable[tuple[str, str]], body: bytes, *, canonical: bool,
    ) -> str:
        head = _head(method, path_qs, headers)
        raw = _digest(head, b"raw", body)
        if not canonical:
            return raw.hexdigest()
        seen = raw.digest()
        known = self._memo.get(seen)
        if known is not None:
            self.hits += 1
            return known
        normal = canonical_json(body)
        result: str = raw.hexdigest() if normal is None else _digest(head, b"json", normal).hexdigest()
        if len(self._memo) >= self.entries:
            del self._memo[next(iter(self._memo))]
        self._memo[seen] = result
        return result
