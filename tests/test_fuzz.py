"""No request makes the proxy answer 500: seeded random requests over a real socket to a real proxy (embedded
store) in front of a real upstream. Every answer must be the upstream's or one of the contract's problems
(``bad_request`` for a request that is not HTTP at all, which aiohttp's parser refuses).

Short by default (a few seconds). The long form: IDEMPROXY_FUZZ_REQUESTS=100000 (and -s to see the figures).
A failure names its seed; IDEMPROXY_FUZZ_SEED=<seed> replays the same requests.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import json
import os
import random
import time
from dataclasses import dataclass, field

import pytest

from tests.conftest import ProxyFactory
from tests.rawhttp import RawResponse, build_request, send_raw
from tests.upstream import RecordingUpstream

REQUESTS = int(os.environ.get("IDEMPROXY_FUZZ_REQUESTS", "1500"))
CONCURRENCY = 12

# code → status, as the contract lists them (the problem every covered request may meet).
PROBLEMS = {
    "missing_key": 400, "invalid_key": 400, "missing_tenant": 401, "in_flight": 409, "body_too_large": 413,
    "payload_mismatch": 422, "upstream_unreachable": 502, "upstream_reset": 502, "response_not_replayable": 502,
    "store_unavailable": 503, "upstream_timeout": 504, "bad_request": 400,
}
HOSTILE_BODIES = [
    b'{"amount":"\\ud800"}', b'{"\\udc00":1}', b'["\\ud83d"]',
    b'{"amount":12345678901234567890.1}', b'{"amount":12345678901234567890.2}',
    b'{"amount":100.10000000000000001}', b'{"amount":100.1}', b'{"amount":1e400}', b'{"amount":2e400}',
    b'{"amount":1,"amount":2}', b'{"amount":2}', b'{"a":NaN}', b'{"a":-Infinity}', b'{"a":1e999999999999999999}',
    codecs.BOM_UTF8 + b'{"amount":2}', '{"amount":2}'.encode("utf-16"), '{"amount":2}'.encode("utf-32-le"),
    b"1" * 5000, b"", b"null", b'"\\u0000"', b"\xff\xfe\xfd", b"{", b"[1,]", b'{"a":1}\x0b',
]


@dataclass
class Case:
    """One request, and whether it is malformed HTTP (which aiohttp's parser refuses: a bad_request problem)."""

    raw: bytes
    malformed: bool = False
    head: bool = False


@dataclass
class Tally:
    statuses: collections.Counter[int | str] = field(default_factory=collections.Counter)
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    replayed: int = 0
    bad: list[str] = field(default_factory=list)


def json_body(rng: random.Random) -> bytes:
    if rng.random() < 0.3:
        return rng.choice(HOSTILE_BODIES)
    if rng.random() < 0.002:  # deep nesting (a few per thousand: they are big)
        depth = rng.choice([100, 1000, 20_000, 200_000])
        if rng.random() < 0.5:
            return b"[" * depth + b"]" * depth
        return b'{"a":' * depth + b"1" + b"}" * depth
    payload = {"amount": rng.choice([1000, 2500, rng.randrange(10**20)]), "currency": rng.choice(["eur", "usd"])}
    if rng.random() < 0.5:
        payload["metadata"] = {"order": rng.choice(["1", "2", "ж", "😀"]), "n": rng.random()}
    items = list(payload.items())
    rng.shuffle(items)
    return json.dumps(dict(items), indent=rng.choice([None, 1]), ensure_ascii=rng.random() < 0.5).encode()


def body_for(rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.75:
        return json_body(rng)
    if roll < 0.9:
        return rng.randbytes(rng.randrange(64))
    return b"amount=1000&currency=eur"


def random_bytes_value(rng: random.Random) -> bytes:
    """A header value: visible ASCII, UTF-8, or obs-text bytes that are not UTF-8 at all."""
    kind = rng.random()
    if kind < 0.5:
        return bytes(rng.randrange(0x21, 0x7F) for _ in range(rng.randrange(1, 12)))
    if kind < 0.8:
        return rng.choice(["Ж", "Ω", "😀", "é", "acct_ж"]).encode()
    return bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randrange(1, 6)))


def key_header(rng: random.Random) -> list[tuple[bytes, bytes]]:
    roll = rng.random()
    if roll < 0.1:
        return []
    if roll < 0.4:  # a key of its own: its retries (below) are replays
        return [(b"Idempotency-Key", b"k-%x" % rng.getrandbits(64))]
    if roll < 0.75:  # a key many requests share: mismatches and 409s
        return [(b"Idempotency-Key", b"k-%d" % rng.randrange(40))]
    value = rng.choice([
        b"", b'"k-1"', b'"k-\\"q"', b'"open', b"x" * 300, b"k\xff", "ключ".encode(),
        b"%d" % rng.randrange(10), b'"a\\b"',
    ])
    return [(b"Idempotency-Key", value)] * rng.choice([1, 1, 2])


def upstream_controls(rng: random.Random) -> list[tuple[bytes, bytes]]:
    """Headers the test upstream obeys: delays (for 409s), statuses (release and store), drops, sizes."""
    headers = []
    if rng.random() < 0.1:
        headers.append((b"X-Test-Delay", rng.choice([b"0.01", b"0.05"])))
    if rng.random() < 0.1:
        headers.append((b"X-Test-Status", b"%d" % rng.choice([200, 400, 404, 409, 429, 502, 503, 504])))
    if rng.random() < 0.01:
        headers.append((b"X-Test-Drop", b"1"))
    if rng.random() < 0.05:
        headers.append((b"X-Test-Size", b"%d" % rng.choice([0, 10, 5000])))
    if rng.random() < 0.05:
        headers.append((b"X-Test-Set-Cookie", b"s=1"))
    if rng.random() < 0.05:
        headers.append((b"X-Test-Hop", b"1"))
    return headers


def other_headers(rng: random.Random) -> list[tuple[bytes, bytes]]:
    headers = []
    if rng.random() < 0.8:
        headers.append((b"Authorization", b"Bearer t%d" % rng.randrange(3)))
    if rng.random() < 0.6:
        headers.append((b"X-Account", random_bytes_value(rng)))
    if rng.random() < 0.3:
        headers.append((b"Content-Type", rng.choice([b"application/json", b"text/plain", b"application/json; x=\xff"])))
    for _ in range(rng.randrange(3)):
        name = rng.choice([b"X-Random", b"Connection", b"X-Forwarded-For", b"Accept", b"Cookie", b"X-Request-Id"])
        headers.append((name, random_bytes_value(rng)))
    return headers


def target(rng: random.Random) -> tuple[bytes, bool]:
    """A request target, and whether it is malformed (bytes a target may not hold)."""
    prefix = rng.choice([b"/v1/charges", b"/v1/refunds", b"/v1/events", b"/v1/small", b"/", b"//x", b"/a/../b"])
    tail = b"".join(rng.choice([b"", b"/", b"%2F", b"%00", b"%ff", b"%e2%82%ac", b"a", b"~", b";p", b"@", b":"])
                    for _ in range(rng.randrange(4)))
    query = rng.choice([b"", b"?x=1", b"?x=2", b"?x=%ff&y", b"?", b"?a=b=c&&"])
    if rng.random() < 0.02:
        return prefix + rng.choice([b"\xff", b"\xd0\x96", b" x", b"\x00", b"\x7f"]) + query, True
    return prefix + tail + query, False


def make_case(seed: int, index: int) -> Case:
    """Request ``index`` of the run with ``seed`` (the same bytes whatever the concurrency)."""
    rng = random.Random(f"{seed}:{index}")
    if index and rng.random() < 0.3:
        return make_case(seed, rng.randrange(index))  # a retry: an earlier request again, byte for byte
    return fresh_case(rng)


def fresh_case(rng: random.Random) -> Case:
    method = rng.choice([b"POST"] * 6 + [b"PATCH"] * 2 + [b"PUT", b"GET", b"DELETE", b"OPTIONS", b"HEAD"])
    malformed = False
    if rng.random() < 0.01:
        method, malformed = rng.choice([b"post", b"FOO", b"P\xffST", b""]), True
    path, bad_target = target(rng)
    headers = key_header(rng) + other_headers(rng) + upstream_controls(rng)
    rng.shuffle(headers)
    body = body_for(rng)
    if rng.random() < 0.05:  # chunked instead of Content-Length
        headers.append((b"Transfer-Encoding", b"chunked"))
        body = (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
    return Case(build_request(method, path, headers, body), malformed or bad_target, head=method == b"HEAD")


def check(case: Case, response: RawResponse) -> str | None:
    """None when the answer is allowed; otherwise what is wrong with it."""
    if "x-upstream-serial" in response.headers:
        return None  # the upstream's own answer (executed now, or replayed)
    if response.status == 500:
        return "500 from the proxy"
    if response.headers.get("content-type") == "application/problem+json":
        if case.head:
            return None
        code = json.loads(response.body).get("code")
        if PROBLEMS.get(code) != response.status:
            return f"problem {code!r} with status {response.status}"
        return None
    return f"status {response.status} that is neither the upstream's nor a problem"


async def run(url: str, seed: int, count: int, tally: Tally, upstream: RecordingUpstream) -> None:
    indexes = iter(range(count))

    async def worker() -> None:
        for index in indexes:
            case = make_case(seed, index)
            try:
                response = await send_raw(url, case.raw)
            except ConnectionResetError as exc:
                # aiohttp refuses bytes that are not HTTP and closes with the body unread: the kernel resets.
                if not case.malformed:
                    tally.bad.append(f"request {index}: {exc!r}: {case.raw[:300]!r} ({len(case.raw)} bytes)")
                tally.statuses["reset"] += 1
                continue
            tally.statuses[response.status] += 1
            tally.replayed += response.headers.get("idempotent-replayed") == "true"
            if response.headers.get("content-type") == "application/problem+json" and not case.head:
                tally.codes[str(json.loads(response.body).get("code"))] += 1
            problem = check(case, response)
            if problem is not None:
                tally.bad.append(f"request {index}: {problem}: {case.raw[:300]!r} -> {response.body[:200]!r}")
            if index % 1000 == 0:
                upstream.executed.clear()  # the recorder keeps every body; nothing here reads them

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


@pytest.mark.timeout(max(60, REQUESTS // 20))
async def test_no_request_makes_the_proxy_answer_500(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    seed = int(os.environ.get("IDEMPROXY_FUZZ_SEED") or random.randrange(2**32))
    proxy = await make_proxy(
        "embedded",
        idempotency={"fingerprint_headers": ["X-Account"]},
        routes=[{"prefix": "/v1/refunds", "required": True}, {"prefix": "/v1/events", "enabled": False},
                {"prefix": "/v1/small", "max_request_body": "1KiB"}],
    )
    print(f"\nfuzz: IDEMPROXY_FUZZ_SEED={seed} IDEMPROXY_FUZZ_REQUESTS={REQUESTS}")
    tally = Tally()
    started = time.perf_counter()
    await run(proxy.url, seed, REQUESTS, tally, upstream)
    elapsed = time.perf_counter() - started
    print(f"fuzz: {REQUESTS} requests in {elapsed:.1f}s ({REQUESTS / elapsed:.0f}/s); {tally.replayed} replays\n"
          f"  statuses={dict(sorted(tally.statuses.items(), key=str))}\n  problems={dict(tally.codes.most_common())}")
    assert not tally.bad, f"IDEMPROXY_FUZZ_SEED={seed}: {len(tally.bad)} bad answers:\n" + "\n".join(tally.bad[:20])
