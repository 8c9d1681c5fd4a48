"""The fingerprint: JSON that differs only in member order, whitespace or escaping has one fingerprint; any other
difference an upstream could read (a digit, a repeated name, an encoding, a header byte) gives another, and no
body crashes it. Property tests state it; the cases of issue #14 pin it; the end-to-end tests go through a real
proxy with bytes sent over a real socket."""

from __future__ import annotations

import asyncio
import codecs
import io
import json
import random
import re
import sys
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import idemproxy.fingerprint
from idemproxy.fingerprint import MAX_DEPTH, OFFLOAD_BYTES, Fingerprinter, canonical_json, fingerprint
from tests.conftest import ProxyFactory
from tests.rawhttp import RawResponse, build_request, send_raw
from tests.upstream import RecordingUpstream

CHARGE_BODY = b'{"amount": 1000, "currency": "eur"}'

scalars = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=12)
documents = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


def fp(body: bytes, canonical: bool = True) -> str:
    return fingerprint("POST", "/v1/charges", (), body, canonical=canonical)


def shuffled(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [shuffled(v, rng) for v in value]
    return value


@settings(max_examples=200, deadline=None)
@given(doc=documents, seed=st.integers(0, 2**32), indent=st.sampled_from([None, 0, 2, "\t"]))
def test_key_order_and_whitespace_do_not_change_the_fingerprint(doc: Any, seed: int, indent: Any) -> None:
    compact = json.dumps(doc, separators=(",", ":")).encode()
    other = json.dumps(shuffled(doc, random.Random(seed)), indent=indent).encode()
    assert fp(compact) == fp(other)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every leaf's path in a JSON document."""
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in paths(v, (*prefix, k))]
    if isinstance(value, list) and value:
        return [p for i, v in enumerate(value) for p in paths(v, (*prefix, i))]
    return [prefix]


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, *rest = path
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], tuple(rest), new)}
    return [replaced(v, tuple(rest), new) if i == head else v for i, v in enumerate(value)]


@settings(max_examples=200, deadline=None)
@given(doc=documents, data=st.data())
def test_any_value_change_changes_the_fingerprint(doc: Any, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(paths(doc)))
    old = doc
    for part in path:
        old = old[part]
    new = data.draw(scalars.filter(lambda v: v != old or type(v) is not type(old)))
    changed = replaced(doc, path, new)
    assert fp(json.dumps(doc).encode()) != fp(json.dumps(changed).encode())


def test_method_path_headers_and_raw_bodies_all_count() -> None:
    base = fingerprint("POST", "/a?x=1", (("x-h", ["1"]),), b"raw", canonical=True)
    assert base != fingerprint("PATCH", "/a?x=1", (("x-h", ["1"]),), b"raw", canonical=True)
    assert base != fingerprint("POST", "/a?x=2", (("x-h", ["1"]),), b"raw", canonical=True)
    assert base != fingerprint("POST", "/a?x=1", (("x-h", ["2"]),), b"raw", canonical=True)
    assert base != fingerprint("POST", "/a?x=1", (("x-h", ["1"]),), b"raw ", canonical=True)
    assert fp(b'{"a":1}', canonical=False) != fp(b'{"a": 1}', canonical=False)  # byte-exact when off


# --------------------------------------------------------------------------- canonical JSON, exactly
#
# A JSON text is drawn as a tree; the same tree can be written many ways (member order, whitespace, how each
# character of a string is escaped, how an exponent is spelled). ``meaning`` is the value an upstream reads,
# computed from the tree without json's decoder: objects as sets of members, numbers as their sign, digits
# before and after the point and exponent as written (only the exponent's spelling is forgotten: 1e2, 1E+02),
# strings as their characters. A tree that repeats a member name or holds a lone surrogate has no canonical
# form: such a body is hashed byte for byte.

Tree = tuple[str, Any]
SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
                 "\t": "\\t"}
NUMBER = re.compile(r"(-?)(0|[1-9][0-9]*)(?:\.([0-9]+))?(?:[eE]([+-]?[0-9]+))?")


@st.composite
def number_texts(draw: st.DrawFn) -> str:
    sign = draw(st.sampled_from(["", "-"]))
    whole = draw(st.sampled_from(["0", "1", "9", "100", "12345678901234567890"]) | st.integers(0, 10**30).map(str))
    frac = draw(st.none() | st.text("0123456789", min_size=1, max_size=20))
    exp = draw(st.none() | st.integers(-500, 500))
    text = sign + whole + ("" if frac is None else "." + frac)
    if exp is not None:
        marker = draw(st.sampled_from(["e", "E"]))
        plus = "+" if exp >= 0 and draw(st.booleans()) else ""
        text += marker + plus + str(exp)
    return text


strings = st.text(st.characters(codec=None), max_size=8) | st.sampled_from(["", "a", "é", "😀", "\ud800", "\udcff"])
names = st.sampled_from(["a", "b", "amount", "é", "😀", "\u0000"]) | st.text(max_size=3)

trees: st.SearchStrategy[Tree] = st.recursive(
    st.tuples(st.just("num"), number_texts())
    | st.tuples(st.just("str"), strings)
    | st.tuples(st.just("lit"), st.sampled_from(["true", "false", "null"])),
    lambda children: st.tuples(st.just("arr"), st.lists(children, max_size=4))
    | st.tuples(st.just("obj"), st.lists(st.tuples(names, children), max_size=4)),
    max_leaves=16,
)


def meaning(tree: Tree) -> Any:
    """What an upstream reads from any writing of ``tree``; None when it has no canonical form."""
    kind, value = tree
    if kind == "num":
        sign, whole, frac, exp = NUMBER.fullmatch(value).groups()  # type: ignore[union-attr]
        return ("num", sign == "-", whole, frac, None if exp is None else int(exp))
    if kind == "str":
        return None if any(0xD800 <= ord(ch) <= 0xDFFF for ch in value) else ("str", value)
    if kind == "lit":
        return value
    parts = [meaning(child) for child in (value if kind == "arr" else [v for _, v in value])]
    if None in parts:
        return None
    if kind == "arr":
        return ("arr", *parts)
    keys = [meaning(("str", k)) for k, _ in value]
    if None in keys or len(set(keys)) != len(keys):
        return None
    return ("obj", frozenset(zip(keys, parts, strict=True)))


def write(tree: Tree, rng: random.Random) -> str:
    """One of the many JSON texts of ``tree``."""
    kind, value = tree
    ws = "".join(rng.choice(" \t\n\r") for _ in range(rng.choice([0, 0, 0, 1, 2])))
    if kind in ("num", "lit"):
        return ws + str(value)
    if kind == "str":
        return ws + write_string(value, rng)
    if kind == "arr":
        return ws + "[" + ",".join(write(child, rng) for child in value) + ws + "]"
    members = list(value)
    rng.shuffle(members)
    return ws + "{" + ",".join(write_string(k, rng) + ws + ":" + write(v, rng) for k, v in members) + ws + "}"


def write_string(text: str, rng: random.Random) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        must = ch in '"\\' or code < 0x20 or 0xD800 <= code <= 0xDFFF
        if not must and rng.random() < 0.7:
            out.append(ch)
        elif ch in SHORT_ESCAPES and rng.random() < 0.5:
            out.append(SHORT_ESCAPES[ch])
        elif code > 0xFFFF:
            high, low = divmod(code - 0x10000, 0x400)
            out.append(f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04X}")
        else:
            out.append(f"\\u{code:04x}" if rng.random() < 0.5 else f"\\u{code:04X}")
    return '"' + "".join(out) + '"'


def read_meaning(canonical: bytes) -> Any:
    """The meaning of a canonical body, read back with json (numbers as their text: exact)."""

    def obj(pairs: list[tuple[str, Any]]) -> Any:
        keys = [("str", k) for k, _ in pairs]
        assert len(set(keys)) == len(keys), "a canonical object repeats a name"
        return ("obj", frozenset((key, v) for key, (_, v) in zip(keys, pairs, strict=True)))

    def num(text: str) -> Any:
        sign, whole, frac, exp = NUMBER.fullmatch(text).groups()  # type: ignore[union-attr]
        assert exp is None or re.fullmatch(r"[+-](0|[1-9][0-9]*)", exp), "an exponent spelled two ways"
        return ("num", sign == "-", whole, frac, None if exp is None else int(exp))

    def convert(value: Any) -> Any:
        if isinstance(value, list):
            return ("arr", *(convert(v) for v in value))
        if isinstance(value, str):
            return ("str", value)
        if value is True or value is False or value is None:
            return json.dumps(value)
        return value

    return convert(json.loads(canonical, object_pairs_hook=lambda p: obj([(k, convert(v)) for k, v in p]),
                              parse_float=num, parse_int=num))


@settings(max_examples=300, deadline=None)
@given(tree=trees, seed=st.integers(0, 2**32))
def test_the_canonical_form_means_exactly_what_the_body_means(tree: Tree, seed: int) -> None:
    body = write(tree, random.Random(seed)).encode("utf-8", "surrogatepass")
    canonical = canonical_json(body)
    if meaning(tree) is None:
        assert canonical is None
    else:
        assert canonical is not None and read_meaning(canonical) == meaning(tree)
        assert canonical_json(canonical) == canonical  # a fixed point


@settings(max_examples=300, deadline=None)
@given(tree=trees, seeds=st.tuples(st.integers(0, 2**32), st.integers(0, 2**32)))
def test_order_whitespace_and_escapes_never_change_the_fingerprint(tree: Tree, seeds: tuple[int, int]) -> None:
    assume(meaning(tree) is not None)
    one, two = (write(tree, random.Random(seed)).encode() for seed in seeds)
    assert fp(one) == fp(two)


def nudged(tree: Tree, rng: random.Random) -> Tree:
    """``tree`` with some leaves respelled or changed slightly: 1e2 → 1E+02 (same), 100.1 → 100.10 (not)."""
    kind, value = tree
    if kind == "arr":
        return kind, [nudged(child, rng) for child in value]
    if kind == "obj":
        return kind, [(nudged(("str", k), rng)[1], nudged(v, rng)) for k, v in value]
    if rng.random() < 0.6:
        return tree
    if kind == "str":
        return kind, value + rng.choice(["", "a", "\x00", "\ud800"])
    if kind == "lit":
        return kind, rng.choice(["true", "false", "null"])
    sign, whole, frac, exp = NUMBER.fullmatch(value).groups()  # type: ignore[union-attr]
    change = rng.choice(["marker", "plus", "lead", "zero", "digit", "sign", "exp"])
    if change == "marker" and exp is not None:
        return kind, value.replace("e", "E") if "e" in value else value.replace("E", "e")
    if change == "plus" and exp is not None and not exp.startswith("-"):
        return kind, value.replace("+", "") if "+" in value else value.replace("e", "e+").replace("E", "E+")
    if change == "lead" and exp is not None:
        return kind, re.sub(r"([eE][+-]?)", r"\g<1>0", value)
    if change == "zero":
        return kind, f"{sign}{whole}.{frac or ''}0" + (f"e{exp}" if exp is not None else "")
    if change == "digit":
        return kind, f"{sign}{whole}" + (f".{frac[:-1]}{(int(frac[-1]) + 1) % 10}" if frac else "")
    if change == "sign":
        return kind, value[1:] if sign else "-" + value
    return kind, f"{sign}{whole}" + (f".{frac}" if frac else "") + f"e{int(exp or 0) + rng.choice([-1, 1])}"


@settings(max_examples=300, deadline=None)
@given(tree=trees, seeds=st.tuples(st.integers(0, 2**32), st.integers(0, 2**32), st.integers(0, 2**32)))
def test_bodies_share_a_fingerprint_only_when_they_mean_the_same(
    tree: Tree, seeds: tuple[int, int, int]
) -> None:
    other = nudged(tree, random.Random(seeds[2]))
    one, two = (write(t, random.Random(s)).encode("utf-8", "surrogatepass")
                for t, s in ((tree, seeds[0]), (other, seeds[1])))
    same = meaning(tree) is not None and meaning(tree) == meaning(other)
    assert (fp(one) == fp(two)) == (same or one == two)


# --------------------------------------------------------------------------- the cases of issue #14


@pytest.mark.parametrize(
    ("one", "two"),
    [
        (b'{"amount":12345678901234567890.1}', b'{"amount":12345678901234567890.2}'),  # past float precision
        (b'{"amount":100.10000000000000001}', b'{"amount":100.1}'),
        (b'{"amount":1e400}', b'{"amount":2e400}'),  # both Infinity as floats
        (b'{"amount":1.0}', b'{"amount":1}'),  # equal in value, spelled differently: kept apart (safe)
        (b'{"amount":1000}', b'{"amount":1.000e3}'),  # an integer and a float to every parser
        (b'{"amount":1000}', b'{"amount":1e3}'),
        (b'{"amount":1}', b'{"amount":1e0}'),
        (b'{"amount":15e2}', b'{"amount":1.5e3}'),  # the digits are not the same as written
        (b'{"amount":0.0000001}', b'{"amount":1e-7}'),
        (b'{"amount":-0}', b'{"amount":0}'),
        (b'{"amount":1,"amount":2}', b'{"amount":2}'),  # a repeated name is never merged
        (b'{"amount":2,"amount":1}', b'{"amount":1,"amount":2}'),  # nor reordered
        (b'{"a":"\\u0041","\\u0061":1}', b'{"a":"A"}'),
        (codecs.BOM_UTF8 + b'{"amount":1}', b'{"amount":1}'),
        ('{"amount":1}'.encode("utf-16"), b'{"amount":1}'),
        ('{"amount":1}'.encode("utf-16-le"), b'{"amount":1}'),
        ('{"amount":1}'.encode("utf-32"), b'{"amount":1}'),
        (b'{"a":"\\ud800"}', b'{"a":"\\udc00"}'),
        (b'{"a":NaN}', b'{"a":Infinity}'),
        (b'{"a":1e999999999999999999999}', b'{"a":2e999999999999999999999}'),  # past any float
        (b'{"a":1}\x0b', b'{"a":1}'),  # not JSON whitespace
        (b'{"a":1}\xc2\xa0', b'{"a":1}'),
    ],
)
def test_payloads_an_upstream_can_tell_apart_never_share_a_fingerprint(one: bytes, two: bytes) -> None:
    assert fp(one) != fp(two)


@pytest.mark.parametrize(
    ("one", "two"),
    [
        (b'{"amount":1E+2,"currency":"eur"}', b'{ "currency" : "eur" , "amount" : 1e2 }'),
        (b'[1e2, 1.5e-7, -2E0]', b'[1E+002,1.5E-07,-2e+0]'),  # the exponent's spelling only
        (b'[1e-0]', b'[1e+00]'),
        (b'{"note":"\\u00e9\\/\\n"}', '{"note":"é/\\n"}'.encode()),
        (b'{"emoji":"\\ud83d\\ude00"}', '{"emoji":"😀"}'.encode()),
        (b'[12345678901234567890.1]', b'[ 12345678901234567890.1 ]'),
    ],
)
def test_spelling_differences_json_gives_no_meaning_share_a_fingerprint(one: bytes, two: bytes) -> None:
    assert fp(one) == fp(two)


@pytest.mark.parametrize(
    "body",
    [
        b'{"a":"\\ud800"}', b'["\\udfff", "x"]', b'{"\\ud800":1}',
        b"[" * 200_000 + b"]" * 200_000,
        b'{"a":' * 200_000 + b"1" + b"}" * 200_000,
        b"[" * 200_000,
        b"1" * 5000, b'{"a":1,"a":{"b":[NaN]}}',
        b"\xff\xfe\x00", codecs.BOM_UTF8, b"",
    ],
)
def test_hostile_bodies_are_hashed_raw_and_never_crash(body: bytes) -> None:
    assert canonical_json(body) is None or body == b"1" * 5000
    assert fp(body) == fp(body)


def nested(depth: int) -> bytes:
    """``depth`` levels, objects and arrays alternating."""
    opening = "".join('{"k":' if level % 2 else "[" for level in range(depth))
    closing = "".join("}" if level % 2 else "]" for level in reversed(range(depth)))
    return (opening + "1" + closing).encode()


def at_stack_depth(frames: int, call: Any) -> Any:
    return call() if frames == 0 else at_stack_depth(frames - 1, call)


def test_nesting_has_a_fixed_cap_whatever_the_callers_stack() -> None:
    """Up to MAX_DEPTH levels are canonical, deeper ones raw: the same answer at any stack depth, so a retry
    of one body never gets another fingerprint because it was hashed from a deeper call."""
    limit = sys.getrecursionlimit()
    for frames in (0, limit // 2, limit - MAX_DEPTH * 3):
        assert at_stack_depth(frames, lambda: canonical_json(nested(MAX_DEPTH))) is not None
        assert at_stack_depth(frames, lambda: canonical_json(nested(MAX_DEPTH + 1))) is None
        assert at_stack_depth(frames, lambda: canonical_json(nested(900))) is None
    assert canonical_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None
    assert canonical_json(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)) is None


def test_numbers_keep_their_digits_and_only_the_exponent_is_respelled() -> None:
    assert canonical_json(b'[1e2, 0.5, 123456789.123456789, -0, 1E-7, 1.000e3, 1e-0, 7e0010]') == (
        b"[1E+2,0.5,123456789.123456789,-0,1E-7,1.000E+3,1E+0,7E+10]")
    # Past what a float or a Decimal holds, still exact and never slow.
    assert canonical_json(b'{"a": 1e999999999999999999999}') == b'{"a":1E+999999999999999999999}'
    assert canonical_json(b"[" + b"9" * 100_000 + b"]") == b"[" + b"9" * 100_000 + b"]"


def test_ordinary_bodies_keep_the_fingerprint_they_had_before_issue_14() -> None:
    """Integers, short decimals, strings and literals canonicalise to the bytes the float-based version gave,
    so a retry that spans the upgrade is still a replay, not a 422."""
    body = (b'{"amount": 1000, "currency": "eur", "capture": true, "ratio": 0.5, "note": "caf\\u00e9 \\"A\\"",'
            b' "metadata": {"order_id": "6735", "tags": ["a", null]}}')
    assert canonical_json(body) == json.dumps(
        json.loads(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()
    # Both digests as the version before issue #14 (commit bd901cc) computed them.
    assert fp(body) == "aafa23ceb0643ca89d1f681ffe4231c0dc244367c8b5e99e285c3645fe625c79"
    assert fingerprint("post", "/v1/charges?expand=customer", [("X-Account", ["acct_1"])], b'{"b": [1, 2], "a": "x"}',
                       canonical=True) == "fde97207e216ad183d5ba1ab9a62d1935298d64243fec07685445ca7f41b00ff"
    # A fingerprint header absent, as 0b551a7 computed it (the header then hashed as "", as one sent empty).
    assert fingerprint("post", "/v1/charges", [("X-Account", [])], b'{"b": [1, 2], "a": "x"}',
                       canonical=True) == "3c8638bb131891a531e9d8665638c34ec1bf019c68ef42f37af252a09566b03d"
    # Numbers 0b551a7 wrote the same way (as Decimal did): the common spellings of JSON encoders.
    assert canonical_json(b"[1000, 0.5, 100.10, 1e2, 1.5e3, 1e+16, 1.5e-07, 1e-7, -0, 2.50]") == (
        b"[1000,0.5,100.10,1E+2,1.5E+3,1E+16,1.5E-7,1E-7,-0,2.50]")


# --------------------------------------------------------------------------- the memo (a retry's same bytes)


@settings(max_examples=200, deadline=None)
@given(doc=documents, seed=st.integers(0, 2**32), data=st.data())
def test_the_memo_answers_exactly_what_fingerprint_answers(doc: Any, seed: int, data: st.DataObject) -> None:
    """Same body under other methods, targets, header values and modes, a reordering, raw bodies; each asked
    twice in a random order, with a memo small enough to forget: never an answer fingerprint() would not give."""
    body = json.dumps(doc).encode()
    reordered = json.dumps(shuffled(doc, random.Random(seed)), indent=1).encode()
    requests = [
        (method, target, headers, payload, canonical)
        for method in ("POST", "PATCH")
        for target in ("/v1/charges", "/v1/charges?x=1")
        for headers in ((), (("x-account", ["a"]),), (("x-account", ["b"]),), (("x-other", ["a"]),),
                        (("x-account", []),), (("x-account", ["a", "b"]),))
        for payload in (body, reordered, body + b" ", b"\xff" + body)
        for canonical in (True, False)
    ]
    order = data.draw(st.permutations(requests + requests))
    memo = Fingerprinter(entries=data.draw(st.integers(1, 8)))
    for method, target, headers, payload, canonical in order:
        assert memo(method, target, headers, payload, canonical=canonical) == fingerprint(
            method, target, headers, payload, canonical=canonical)
    assert len(memo._memo) <= memo.entries


async def test_a_large_body_on_the_thread_gets_exactly_what_fingerprint_gives() -> None:
    """Bodies of OFFLOAD_BYTES and more go through ``Fingerprinter.large``; every part counts there as it does
    in :func:`fingerprint` (a version that dropped the target or the headers on the thread passed every other
    test: its memo only ever compared the thread with itself)."""
    body = json.dumps({"amount": 1000, "items": [{"sku": f"s{i}", "qty": i} for i in range(900)]}).encode()
    reordered = json.dumps({"items": json.loads(body)["items"], "amount": 1000}, indent=2).encode()
    assert len(body) >= OFFLOAD_BYTES
    requests = [
        (method, target, headers, payload, canonical)
        for method in ("POST", "PATCH")
        for target in ("/v1/charges", "/v1/charges?x=1")
        for headers in ((), (("x-account", ["a"]),), (("x-account", ["b"]),), (("x-account", []),),
                        (("x-account", [""]),), (("x-account", ["a", "b"]),))
        for payload in (body, reordered, body + b" ", b"\xff" + body)
        for canonical in (True, False)
    ]
    expected = [fingerprint(*request[:4], canonical=request[4]) for request in requests]
    # Raw mode: every request its own; canonical mode adds one per head (the three JSON bodies are one; the
    # non-UTF-8 one hashes raw, as in raw mode).
    assert len(set(expected)) == len(requests) // 2 + len(requests) // 8
    memo = Fingerprinter(entries=16)
    order = list(range(len(requests))) * 2
    random.Random(7).shuffle(order)
    for index in order:
        method, target, headers, payload, canonical = requests[index]
        assert await memo.large(method, target, headers, payload, canonical=canonical) == expected[index]
    assert memo.hits > 0 and len(memo._memo) <= memo.entries


def test_a_retry_of_the_same_bytes_skips_the_canonical_form(monkeypatch: pytest.MonkeyPatch) -> None:
    forms: list[bytes] = []

    def counted(body: bytes) -> bytes | None:
        forms.append(body)
        return canonical_json(body)

    monkeypatch.setattr(idemproxy.fingerprint, "canonical_json", counted)
    memo = Fingerprinter(entries=2)
    one, reordered, other = b'{"a": 1, "b": 2}', b'{"b":2,"a":1}', b'{"a": 2}'
    first = memo("POST", "/v1/charges", (), one, canonical=True)
    assert memo("POST", "/v1/charges", (), one, canonical=True) == first
    assert (forms, memo.hits) == ([one], 1)  # the same bytes: found
    assert memo("POST", "/v1/charges", (), reordered, canonical=True) == first
    assert forms == [one, reordered]  # other bytes, same meaning: computed, same answer
    assert memo("POST", "/v1/charges", (("x-account", ["a"]),), one, canonical=True) != first
    assert forms == [one, reordered, one]  # the same body under another header: another entry
    memo("POST", "/v1/charges", (), other, canonical=True)
    assert memo("POST", "/v1/charges", (), one, canonical=True) == first
    assert forms[-1] == one and len(forms) == 5  # two entries kept: the oldest was forgotten
    memo("POST", "/v1/charges", (), one, canonical=False)
    assert len(forms) == 5  # the raw mode never needs the canonical form


# --------------------------------------------------------------------------- method, path, headers


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ("Ж", "Ω"),  # outside latin-1: both were b"?"
        ("\udcff", "?"),  # the byte 0xFF (obs-text; aiohttp hands it over as a surrogate escape) vs "?"
        ("\udcff", "ÿ"),  # the byte 0xFF vs U+00FF (bytes C3 BF)
        ("\udcff\udcfe", "\udcfe\udcff"),
    ],
)
def test_header_values_are_hashed_as_their_wire_bytes(one: str, two: str) -> None:
    def with_header(value: str) -> str:
        return fingerprint("POST", "/v1/charges", (("x-account", [value]),), b"{}", canonical=True)

    assert with_header(one) != with_header(two)


def test_a_header_absent_empty_or_in_several_lines_is_told_apart() -> None:
    """The upstream sees each of these: a header it did not get, an empty one, two lines, one joined line."""
    def with_lines(*lines: str) -> str:
        return fingerprint("POST", "/v1/charges", (("x-account", list(lines)),), b"{}", canonical=True)

    forms = [with_lines(), with_lines(""), with_lines("a", "b"), with_lines("a,b"), with_lines("a, b"),
             with_lines("a"), with_lines("a", "b", ""), with_lines("a,b", ""), with_lines("", "a,b")]
    assert len(set(forms)) == len(forms)


def test_the_path_is_hashed_as_its_wire_bytes() -> None:
    # aiohttp's pure-Python parser hands a non-UTF-8 target over with surrogate escapes; "/a\udcff" was "/a?".
    assert fingerprint("POST", "/a\udcff", (), b"", canonical=True) != fingerprint("POST", "/a?", (), b"",
                                                                                   canonical=True)
    assert fingerprint("POST", "/\ud800", (), b"", canonical=True)  # not from any wire, still no crash


# --------------------------------------------------------------------------- end to end


def charge(key: bytes, account: bytes, body: bytes = b'{"amount":1000}') -> bytes:
    headers = [(b"Authorization", b"Bearer t1"), (b"Idempotency-Key", key), (b"X-Account", account),
               (b"Content-Type", b"application/json")]
    return build_request(b"POST", b"/v1/charges", headers, body)


@pytest.mark.parametrize(("first", "second"), [("Ж".encode(), "Ω".encode()), (b"\xff", b"\xfe")])
async def test_a_fingerprint_header_outside_latin_1_is_a_mismatch_not_a_replay(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, first: bytes, second: bytes
) -> None:
    proxy = await make_proxy("embedded", idempotency={"fingerprint_headers": ["X-Account"]})
    executed = await send_raw(proxy.url, charge(b"k-acct", first))
    assert executed.status == 201 and executed.headers["idempotent-replayed"] == "false"
    other = await send_raw(proxy.url, charge(b"k-acct", second))
    assert other.status == 422 and json.loads(other.body)["code"] == "payload_mismatch"
    again = await send_raw(proxy.url, charge(b"k-acct", first))
    assert again.status == 201 and again.headers["idempotent-replayed"] == "true"
    assert upstream.count(key="k-acct") == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b'{"amount":12345678901234567890.1}', b'{"amount":12345678901234567890.2}'),
        (b'{"amount":1,"amount":2}', b'{"amount":2}'),
        (codecs.BOM_UTF8 + b'{"amount":2}', b'{"amount":2}'),
    ],
)
async def test_a_payload_the_upstream_reads_differently_is_a_mismatch_not_a_replay(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, first: bytes, second: bytes
) -> None:
    proxy = await make_proxy("embedded")
    assert (await send_raw(proxy.url, charge(b"k-body", b"a", first))).status == 201
    other = await send_raw(proxy.url, charge(b"k-body", b"a", second))
    assert other.status == 422 and json.loads(other.body)["code"] == "payload_mismatch"
    assert upstream.count(key="k-body") == 1


async def test_a_lone_surrogate_escape_is_forwarded_and_replayed_not_500(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    body = b'{"name":"\\ud800"}'
    first = await send_raw(proxy.url, charge(b"k-sur", b"a", body))
    again = await send_raw(proxy.url, charge(b"k-sur", b"a", body))
    assert (first.status, again.status) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true" and again.body == first.body
    assert upstream.executed[0].body == body


def with_headers(key: bytes, extra: list[tuple[bytes, bytes]], body: bytes = b'{"amount":1000}') -> bytes:
    headers = [(b"Authorization", b"Bearer t1"), (b"Idempotency-Key", key), (b"Content-Type", b"application/json")]
    return build_request(b"POST", b"/v1/charges", headers + extra, body)


async def test_a_fingerprint_header_this_hop_drops_counts_as_absent(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """Named in ``Connection``, a header never reaches the upstream: a retry that names the same account without
    ``Connection`` would run on that account, so it must not get the answer of a charge that ran without it."""
    proxy = await make_proxy("embedded", idempotency={"fingerprint_headers": ["X-Account"]})
    dropped = [(b"X-Account", b"acct_2"), (b"Connection", b"X-Account")]
    first = await send_raw(proxy.url, with_headers(b"k-conn", dropped))
    assert first.status == 201 and "X-Account" not in upstream.executed[0].headers
    named = await send_raw(proxy.url, with_headers(b"k-conn", [(b"X-Account", b"acct_2")]))
    assert named.status == 422 and json.loads(named.body)["code"] == "payload_mismatch"
    same = await send_raw(proxy.url, with_headers(b"k-conn", []))  # what the upstream got
    assert same.status == 201 and same.headers["idempotent-replayed"] == "true"
    assert upstream.count(key="k-conn") == 1


async def test_a_forwarded_header_this_hop_sets_is_hashed_as_forwarded(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """From a peer not in trusted_proxies, this hop sets X-Forwarded-Host from the host the client asked for and
    replaces the client's own. Hashed as received, a charge for shop-b was replayed shop-a's answer, and a forged
    X-Forwarded-Host the upstream never saw made a retry a 422 (audit, 2026-11-27)."""
    proxy = await make_proxy("embedded", idempotency={"fingerprint_headers": ["X-Forwarded-Host"]})
    headers = [(b"Authorization", b"Bearer t1"), (b"Idempotency-Key", b"k-xfh"), (b"Content-Type", b"application/json")]
    body = b'{"amount":1000}'

    async def charge(target: bytes, extra: list[tuple[bytes, bytes]]) -> RawResponse:
        return await send_raw(proxy.url, build_request(b"POST", target, headers + extra, body))

    assert (await charge(b"http://shop-a.test/v1/charges", [])).status == 201
    other_shop = await charge(b"http://shop-b.test/v1/charges", [])
    assert other_shop.status == 422 and json.loads(other_shop.body)["code"] == "payload_mismatch"
    forged = await charge(b"http://shop-a.test/v1/charges", [(b"X-Forwarded-Host", b"elsewhere.test")])
    assert forged.status == 201 and forged.headers["idempotent-replayed"] == "true"
    assert [e.headers["X-Forwarded-Host"] for e in upstream.executed] == ["shop-a.test"]


async def test_host_in_fingerprint_headers_is_hashed_as_the_client_sent_it(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """Host is the one header this hop replaces by its own (the upstream's) and passes on as X-Forwarded-Host:
    read from the forwarded headers, every Host hashed as absent and shop-b was replayed shop-a's answer (review,
    2026-11-27)."""
    proxy = await make_proxy("embedded", idempotency={"fingerprint_headers": ["Host"]})

    def charge(host: bytes) -> bytes:
        return (b"POST /v1/charges HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\nAuthorization: Bearer t1\r\n"
                b"Idempotency-Key: k-host\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")

    assert (await send_raw(proxy.url, charge(b"shop-a.test"))).status == 201
    other = await send_raw(proxy.url, charge(b"shop-b.test"))
    assert other.status == 422 and json.loads(other.body)["code"] == "payload_mismatch"
    assert upstream.count(key="k-host") == 1


@pytest.mark.parametrize(("first", "second"), [
    ([(b"X-Account", b"")], []),  # sent empty, not sent
    ([(b"X-Account", b"a"), (b"X-Account", b"b")], [(b"X-Account", b"a,b")]),  # two lines, one line
])
async def test_what_the_upstream_can_tell_apart_in_a_fingerprint_header_is_a_mismatch(
    make_proxy: ProxyFactory, upstream: RecordingUpstream, first: list[tuple[bytes, bytes]],
    second: list[tuple[bytes, bytes]],
) -> None:
    proxy = await make_proxy("embedded", idempotency={"fingerprint_headers": ["X-Account"]})
    assert (await send_raw(proxy.url, with_headers(b"k-h", first))).status == 201
    other = await send_raw(proxy.url, with_headers(b"k-h", second))
    assert other.status == 422 and json.loads(other.body)["code"] == "payload_mismatch"
    again = await send_raw(proxy.url, with_headers(b"k-h", first))
    assert again.status == 201 and again.headers["idempotent-replayed"] == "true"
    assert upstream.count(key="k-h") == 1


async def test_a_large_bodys_canonical_form_holds_up_no_other_client(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """A megabyte of nested arrays costs about half a second of CPU to put in canonical form. Done on the
    event loop, it stalled every other client of the proxy for that long (a few bodies at once: seconds); on
    the canonical-form thread, replays go on being answered meanwhile. Counted, not timed: how many replays
    complete, one after another, before the large request reaches the upstream (two megabytes here: on the
    loop, 7-9 replays got through while the body was still arriving; on the thread, 75-109)."""
    proxy = await make_proxy("embedded", idempotency={"max_request_body": "2MiB", "max_stored_response": "4MiB"})
    assert (await proxy.post("/v1/charges", key="k-small", body=CHARGE_BODY))[0].status == 201
    unit = b"[" * 60 + b"]" * 60
    hostile = b"[" + b",".join([unit] * (2 * 1024 * 1024 // (len(unit) + 1) - 1)) + b"]"
    assert len(hostile) <= 2 * 1024 * 1024 and canonical_json(hostile) is not None
    async def post_large() -> tuple[int, str]:  # from a file-like object: aiohttp warns of 2 MiB of bytes
        headers = {"Idempotency-Key": "k-large", "Authorization": "Bearer t1"}
        async with proxy.session.post(proxy.url + "/v1/charges", data=io.BytesIO(hostile), headers=headers) as resp:
            await resp.read()
            return resp.status, resp.headers["Idempotent-Replayed"]

    large = asyncio.create_task(post_large())
    replays = 0
    while not upstream.count(key="k-large") and not large.done():
        resp, _ = await proxy.post("/v1/charges", key="k-small", body=CHARGE_BODY)
        assert resp.headers["Idempotent-Replayed"] == "true"
        replays += 1
    assert await large == (201, "false")
    assert replays >= 40, replays
    # The thread's answer is the one the loop would have given: the same bytes again are a replay.
    assert await post_large() == (201, "true") and upstream.count(key="k-large") == 1
