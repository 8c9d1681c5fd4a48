"""The in-process replay cache (``idemproxy.replays``) on its own: what its memory bound really bounds."""

from __future__ import annotations

import gc
import time
import tracemalloc

import pytest

from idemproxy.replays import ReplayCache
from idemproxy.store.base import Claim, Record, State, StoredResponse

BUDGET = 1024 * 1024


def _tenant(text: str) -> str:
    return text * (64 if text.isascii() else 256)


def _claim(n: int, key_length: int, body: bytes, text: str = "v") -> Claim:
    now = time.time()
    wide = not text.isascii()
    headers = tuple((f"X-Header-{j}", f"{text * (64 if wide else 8)}-{j}-{n}") for j in range(6))
    record = Record(
        tenant=_tenant(text), key=f"{n}-".ljust(key_length, "k"), fingerprint="f" * 64, state=State.COMPLETED,
        lease_token=None, lease_expires_at=None, response=StoredResponse(201, headers, body),
        created_at=now, completed_at=now, expires_at=now + 3600,
    )
    return Claim(record=record, owned=False, now=now, sent=time.monotonic())


def _allocated_here() -> int:
    """Bytes traced now that were allocated by idemproxy's code or this file's (what the cache holds is made by
    these): not by another thread of the process, such as a pytest-xdist worker's channel to its controller.
    Live objects only: CPython's free lists (of 2-tuples, floats, ...) keep objects that were freed, and tracemalloc
    counts them where they were made, so how full those lists were when tracing began moved the figure for the
    same fill (0.86 to 1.12 times the budget; a CI-like run failed at 1.11). ``gc.collect()`` empties them (and
    any cyclic garbage): called before tracing starts and before each look, it leaves what is really held."""
    gc.collect()
    here = (tracemalloc.Filter(True, "*/idemproxy/*"), tracemalloc.Filter(True, __file__))
    return sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(here).statistics("filename"))


@pytest.mark.parametrize(("key_length", "body_size", "text"), [
    (16, 1, "v"), (255, 1, "v"), (1024, 1, "v"), (64, 2000, "v"),
    (64, 1, "\u00e9"), (64, 1, "\U0001f600"),  # a tenant (unhashed) and header values in wider characters
])
def test_replay_memory_bounds_what_the_cache_holds(key_length: int, body_size: int, text: str) -> None:
    """``storage.replay_memory`` is what the copies cost in memory (records, keys, headers, bookkeeping), not only
    their bodies: a budget counted in body bytes alone held 6-9 times itself with small answers and long keys,
    and one counted in characters 1.4-3.3 times itself with characters outside ASCII."""
    cache = ReplayCache(BUDGET, lambda: True)
    gc.collect()  # (the free lists empty as tracing starts: an object taken from one would not be counted)
    tracemalloc.start()
    try:
        before = _allocated_here()
        for n in range(BUDGET // 200):  # more than fit: the oldest make way
            cache.put(_claim(n, key_length, b"x" * body_size, text), cache.begin())
        held = _allocated_here() - before
    finally:
        tracemalloc.stop()
    newest = f"{BUDGET // 200 - 1}-".ljust(key_length, "k")
    assert cache.get(_tenant(text), newest) is not None  # the newest is kept
    assert held <= BUDGET * 1.1, f"{held / BUDGET:.2f} times the budget"
    assert held >= BUDGET * 0.3  # (and the budget is used, not wasted by counting too much)
