"""The request fingerprint: what makes two requests with one key "the same payload".

Two requests share a fingerprint only when an upstream cannot tell their payloads apart. The canonical
JSON form therefore forgets exactly what JSON says carries no meaning (member order, whitespace between
tokens, how a string is escaped, how an exponent is spelled) and nothing else: numbers keep their digits as
written, and a body that is not plain UTF-8 JSON, repeats a member name, nests deeper than ``MAX_DEPTH`` or
holds a string no UTF-8 can carry (a lone surrogate escape such as ``"\\ud800"``) is hashed byte for byte.
docs/fingerprint.md has the rules with examples.

Large bodies (``OFFLOAD_BYTES`` and more) are fingerprinted on a thread of their own
(:meth:`Fingerprinter.large`): decoding and re-encoding a hostile megabyte of JSON costs about a second of CPU,
which the event loop must not spend while every other client waits.
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
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


# The decoder hands every number, object and array over as a tuple (canonical text, nesting depth), innermost
# first. A number's canonical text is its source text with only the exponent's spelling normalised: no two
# numbers merge unless they are written with the same digits (1e2, 1E2 and 1e+2 do; 1, 1.0, 1e0 and 1.00 do
# not, nor do 1000 and 1.000e3, which a parser reads as an integer and a float).
_Node = tuple[str, int]


def _integer(text: str) -> _Node:
    return text, 0


def _fraction(text: str) -> _Node:
    """A number with a fraction or an exponent: the exponent written ``E``, its sign always, no leading zeros
    (``1e2``, ``1E02`` and ``1e+2`` are ``1E+2``; ``1e-0`` is ``1E+0``). Decimal, which wrote these before,
    wrote ``1E+2`` and ``1.5E+3`` so too, but not ``1e-05`` (``0.00001``) or ``0.0000001`` (``1E-7``)."""
    cut = text.find("e")
    if cut < 0:
        cut = text.find("E")
        if cut < 0:
            return text, 0
    exponent = text[cut + 1:]
    digits = exponent.lstrip("+-").lstrip("0")
    if not digits:
        return text[:cut] + "E+0", 0
    return text[:cut] + ("E-" if exponent[0] == "-" else "E+") + digits, 0


def _canonical(value: Any, level: int) -> _Node:
    """A decoded value's canonical text and nesting depth.

    ``level``: how many arrays enclose ``value`` in the walk that reached it.
    """
    kind = type(value)
    if kind is str:
        return _quote(value), 0
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
        if kind is tuple:
            text, inner = item
        elif kind is str:
            append(_quote(item))
            continue
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
            continue
        if kind is tuple:
            text, inner = value
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
    object_pairs_hook=_object, parse_float=_fraction, parse_int=_integer, parse_constant=_no_constants
)


def canonical_json(body: bytes) -> bytes | None:
    """``body`` in canonical JSON form, or None when it is to be hashed byte for byte.

    Canonical: members sorted by their decoded names, no whitespace, strings re-escaped as
    ``json.dumps(ensure_ascii=False)`` does, numbers as written but for the exponent's spelling (1e2 is 1E+2).
    None for anything but UTF-8 JSON without a BOM, and for JSON with a repeated member name, nesting deeper
    than MAX_DEPTH, a lone surrogate or NaN/Infinity.
    """
    if body.startswith(codecs.BOM_UTF8):
        return None
    try:
        text, _ = _canonical(_decoder.decode(body.decode("utf-8")), 0)
        return text.encode("utf-8")  # a lone surrogate escape fails here: UnicodeEncodeError
    except (ValueError, RecursionError):
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


# A header's value slot when it was sent once but empty, and before the lines of a header sent more than once:
# lengths no framed value can have (2**64 - 1, 2**64 - 2), so neither can equal another form. An absent header
# is framed as an empty value always was, and a header sent once with a value as it always was: the common
# forms kept their fingerprints when "sent empty" and "several lines" started to count.
_EMPTY = b"\xff" * 8
_LINES = b"\xff" * 7 + b"\xfe"
_NONE = len(b"").to_bytes(8, "big")

Headers = Iterable[tuple[str, Sequence[str]]]
"""Each chosen header's name and the values of its lines as received (none when it is absent)."""


def _head(method: str, path_qs: str, headers: Headers) -> list[bytes]:
    """The framed small parts: method, raw path+query, then each chosen header's name and lines."""
    head = [_framed(_wire_bytes(method.upper())), _framed(_wire_bytes(path_qs))]
    for name, values in headers:
        head.append(_framed(_wire_bytes(name.lower())))
        if len(values) == 1:
            head.append(_framed(_wire_bytes(values[0])) if values[0] else _EMPTY)
        elif not values:
            head.append(_NONE)
        else:  # each line as it came: two lines `a` and `b` are not the one line `a,b`
            head.append(_LINES + len(values).to_bytes(8, "big"))
            head.extend(_framed(_wire_bytes(value)) for value in values)
    return head


def _digest(head: list[bytes], form: bytes, body: bytes) -> _Hash:
    # The small parts go to the hash in one update, the body (perhaps large, never copied) in a second.
    digest = hashlib.sha256(b"".join([*head, _framed(form), len(body).to_bytes(8, "big")]))
    digest.update(body)
    return digest


def fingerprint(method: str, path_qs: str, headers: Headers, body: bytes, *, canonical: bool) -> str:
    """SHA-256 (hex) over method, raw path+query, the chosen headers and the body.

    Each part is length-prefixed so that no two different requests can share one byte stream. Text parts
    are hashed as the bytes that came over the wire; a header absent, sent empty, or sent as several lines
    are three different things. With ``canonical``, a JSON body is hashed in canonical form (see
    :func:`canonical_json`); any other body is hashed byte for byte.
    """
    head = _head(method, path_qs, headers)
    normal = canonical_json(body) if canonical else None
    if normal is not None:
        return _digest(head, b"json", normal).hexdigest()
    return _digest(head, b"raw", body).hexdigest()


MEMO_ENTRIES = 4096  # canonical fingerprints remembered per process (about 1 MiB)
OFFLOAD_BYTES = 16 * 1024  # bodies this large and larger are fingerprinted on the canonical-form thread

# One thread for every large body of the process: a second hostile body waits for the first rather than take
# the interpreter from the event loop as well (a thread runs Python only while it holds the GIL; with one
# thread beside the loop, the loop gets it back at least every switch interval, 5 ms).
_thread: ThreadPoolExecutor | None = None


def _canonical_thread() -> ThreadPoolExecutor:
    global _thread
    if _thread is None:
        _thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idemproxy-canonical")
    return _thread


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

    def __call__(self, method: str, path_qs: str, headers: Headers, body: bytes, *, canonical: bool) -> str:
        return self._keep(*self._work(method, path_qs, headers, body, canonical))

    async def large(self, method: str, path_qs: str, headers: Headers, body: bytes, *, canonical: bool) -> str:
        """The same as calling it, with the hashing and the canonical form done on the canonical-form thread.

        For bodies of ``OFFLOAD_BYTES`` and more: the loop goes on serving while the thread works. The thread
        only reads the memo (one dict lookup, atomic); the loop alone writes it.
        """
        return self._keep(*await asyncio.get_running_loop().run_in_executor(
            _canonical_thread(), self._work, method, path_qs, list(headers), body, canonical))

    def _work(
        self, method: str, path_qs: str, headers: Headers, body: bytes, canonical: bool
    ) -> tuple[bytes | None, str]:
        """The fingerprint, and the raw digest to remember it under: None when the memo had it, empty in raw
        mode (nothing to remember)."""
        head = _head(method, path_qs, headers)
        raw = _digest(head, b"raw", body)
        if not canonical:
            return b"", raw.hexdigest()
        seen = raw.digest()
        known = self._memo.get(seen)
        if known is not None:
            return None, known
        normal = canonical_json(body)
        return seen, raw.hexdigest() if normal is None else _digest(head, b"json", normal).hexdigest()

    def _keep(self, seen: bytes | None, result: str) -> str:
        """On the loop: count a memo hit, or remember a new canonical result; ``result`` either way."""
        if seen is None:
            self.hits += 1
        elif seen and seen not in self._memo:  # in the memo already: two large bodies alike on the thread
            memo = self._memo
            if len(memo) >= self.entries:
                del memo[next(iter(memo))]
            memo[seen] = result
        return result
