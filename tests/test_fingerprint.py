"""Property tests: JSON that differs only in key order or whitespace has one fingerprint; a value change differs."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from idemproxy.fingerprint import fingerprint

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
    base = fingerprint("POST", "/a?x=1", (("x-h", "1"),), b"raw", canonical=True)
    assert base != fingerprint("PATCH", "/a?x=1", (("x-h", "1"),), b"raw", canonical=True)
    assert base != fingerprint("POST", "/a?x=2", (("x-h", "1"),), b"raw", canonical=True)
    assert base != fingerprint("POST", "/a?x=1", (("x-h", "2"),), b"raw", canonical=True)
    assert base != fingerprint("POST", "/a?x=1", (("x-h", "1"),), b"raw ", canonical=True)
    assert fp(b'{"a":1}', canonical=False) != fp(b'{"a": 1}', canonical=False)  # byte-exact when off
