"""Tracing (``tracing.enabled``): spans through the SDK's in-memory exporter, against a real in-process proxy and
the real recording upstream; and with tracing off, no OpenTelemetry at all."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from idemproxy.engine import short_hash
from idemproxy.tracing import OtelTracer
from tests.conftest import ProxyFactory, RunningProxy
from tests.upstream import RecordingUpstream

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN_ID = 0x00F067AA0BA902B7
CLIENT_TRACEPARENT = f"00-{TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"
TRACING = {"enabled": True, "exporter": "none"}  # spans made and propagated; the test collects them


async def traced(make_proxy: ProxyFactory) -> tuple[RunningProxy, InMemorySpanExporter]:
    running = await make_proxy("embedded", tracing=TRACING)
    tracer = running.proxy.tracer
    assert isinstance(tracer, OtelTracer)
    exporter = InMemorySpanExporter()
    tracer.provider.add_span_processor(SimpleSpanProcessor(exporter))
    return running, exporter


async def spans_of(exporter: InMemorySpanExporter, trace_id: int, *names: str) -> dict[str, ReadableSpan]:
    """The finished spans of one trace by name, once those in ``names`` have ended (the server span ends just
    after the answer leaves)."""
    for _ in range(100):
        found = {s.name: s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id}
        if all(name in found for name in names):
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"spans {names} not all finished: {sorted(found)}")


def server_span(exporter: InMemorySpanExporter, trace_id: int | None = None) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans()
            if s.kind is SpanKind.SERVER and (trace_id is None or s.context.trace_id == trace_id)]


def traceparent_ids(value: str) -> tuple[int, int]:
    version, trace_id, parent_id, _flags = value.split("-")
    assert version == "00"
    return int(trace_id, 16), int(parent_id, 16)


async def test_a_clients_trace_is_continued_through_claim_forward_and_settle(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy, exporter = await traced(make_proxy)
    resp, _ = await proxy.post("/v1/charges", key="k-1", body={"amount": 1},
                               headers={"traceparent": CLIENT_TRACEPARENT})
    assert resp.status == 201
    spans = await spans_of(exporter, TRACE_ID, "POST", "idemproxy.claim", "idemproxy.forward", "idemproxy.settle")
    server = spans["POST"]
    assert server.kind is SpanKind.SERVER
    assert server.parent is not None and server.parent.span_id == CLIENT_SPAN_ID and server.parent.is_remote
    for name, kind in (("idemproxy.claim", SpanKind.INTERNAL), ("idemproxy.forward", SpanKind.CLIENT),
                       ("idemproxy.settle", SpanKind.INTERNAL)):
        child = spans[name]
        assert child.kind is kind, name
        assert child.parent is not None and child.parent.span_id == server.context.span_id, name
    assert server.attributes is not None
    assert server.attributes["idemproxy.outcome"] == "forwarded"
    assert server.attributes["http.response.status_code"] == 201
    assert server.attributes["http.request.method"] == "POST"
    assert spans["idemproxy.claim"].attributes == {"idemproxy.owned": True}
    assert spans["idemproxy.forward"].attributes == {"http.response.status_code": 201}
    # The upstream continues the trace under the forward span (the client's own traceparent is replaced).
    received = upstream.executed[-1].headers.getall("traceparent")
    assert len(received) == 1
    assert traceparent_ids(received[0]) == (TRACE_ID, spans["idemproxy.forward"].context.span_id)


async def test_without_a_traceparent_the_trace_starts_at_the_proxy(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy, exporter = await traced(make_proxy)
    resp, _ = await proxy.post("/v1/charges", key="k-1", body={"amount": 1})
    assert resp.status == 201
    trace_id, parent_id = traceparent_ids(upstream.executed[-1].headers["traceparent"])
    spans = await spans_of(exporter, trace_id, "POST", "idemproxy.forward")
    assert spans["POST"].parent is None
    assert parent_id == spans["idemproxy.forward"].context.span_id


async def test_a_replay_is_claimed_but_not_forwarded(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy, exporter = await traced(make_proxy)
    await proxy.post("/v1/charges", key="k-1", body={"amount": 1})
    resp, _ = await proxy.post("/v1/charges", key="k-1", body={"amount": 1},
                               headers={"traceparent": CLIENT_TRACEPARENT})
    assert resp.headers["Idempotent-Replayed"] == "true"
    assert len(upstream.executed) == 1
    spans = await spans_of(exporter, TRACE_ID, "POST", "idemproxy.claim")
    assert set(spans) == {"POST", "idemproxy.claim"}
    assert spans["idemproxy.claim"].attributes == {"idemproxy.owned": False}
    attributes = spans["POST"].attributes
    assert attributes is not None and attributes["idemproxy.outcome"] == "replayed"


async def test_a_4xx_answer_is_not_a_span_error_and_an_upstream_reset_is(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy, exporter = await traced(make_proxy)
    await proxy.post("/v1/charges", key="k-1", body={"amount": 1})
    mismatch, _ = await proxy.post("/v1/charges", key="k-1", body={"amount": 2},
                                   headers={"traceparent": CLIENT_TRACEPARENT})
    assert mismatch.status == 422
    server = (await spans_of(exporter, TRACE_ID, "POST"))["POST"]
    assert server.status.status_code is StatusCode.UNSET
    assert server.attributes is not None and server.attributes["idemproxy.outcome"] == "payload_mismatch"

    other_trace = TRACE_ID + 1
    reset, _ = await proxy.post("/v1/charges", key="k-2", body={"amount": 1}, headers={
        "traceparent": f"00-{other_trace:032x}-{CLIENT_SPAN_ID:016x}-01", "X-Test-Drop": "1"})
    assert reset.status == 502
    spans = await spans_of(exporter, other_trace, "POST", "idemproxy.forward", "idemproxy.settle")
    forward = spans["idemproxy.forward"]
    assert forward.status.status_code is StatusCode.ERROR
    assert forward.attributes == {"error.type": "UpstreamReset"}
    assert spans["POST"].status.status_code is StatusCode.ERROR  # a 5xx answer


async def test_a_passthrough_request_is_traced_and_propagated(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy, exporter = await traced(make_proxy)
    resp, _ = await proxy.post("/v1/charges", method="GET", headers={"traceparent": CLIENT_TRACEPARENT})
    assert resp.status == 200
    spans = await spans_of(exporter, TRACE_ID, "GET", "idemproxy.forward")
    assert set(spans) == {"GET", "idemproxy.forward"}
    assert spans["GET"].attributes is not None and spans["GET"].attributes["idemproxy.outcome"] == "passthrough"
    assert traceparent_ids(upstream.executed[-1].headers["traceparent"]) == (
        TRACE_ID, spans["idemproxy.forward"].context.span_id)


async def test_a_client_that_does_not_sample_is_not_recorded_but_still_propagated(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy, exporter = await traced(make_proxy)
    resp, _ = await proxy.post("/v1/charges", key="k-1", body={"amount": 1},
                               headers={"traceparent": f"00-{TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-00"})
    assert resp.status == 201
    received = upstream.executed[-1].headers["traceparent"]
    assert received.startswith(f"00-{TRACE_ID:032x}-") and received.endswith("-00")
    await asyncio.sleep(0.1)
    assert exporter.get_finished_spans() == ()


async def test_no_raw_key_or_credential_in_any_span(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy, exporter = await traced(make_proxy)
    key, credential = "order-7f3a-SECRETKEY", "Bearer sk_live_SECRETCREDENTIAL"
    for _ in range(2):  # forwarded, then replayed
        await proxy.post("/v1/charges", key=key, tenant=credential, body={"card": "SECRETBODY"},
                         headers={"traceparent": CLIENT_TRACEPARENT})
    spans = await spans_of(exporter, TRACE_ID, "POST", "idemproxy.claim", "idemproxy.forward", "idemproxy.settle")
    assert len(server_span(exporter, TRACE_ID)) == 2
    for span in exporter.get_finished_spans():
        shown = span.name + repr(dict(span.attributes or {})) + repr([e.attributes for e in span.events])
        for secret in ("SECRETKEY", "SECRETCREDENTIAL", "SECRETBODY"):
            assert secret not in shown, (span.name, secret)
    assert spans["POST"].attributes is not None
    assert spans["POST"].attributes["idemproxy.key_hash"] == short_hash(key)


async def test_off_adds_no_traceparent_and_passes_a_clients_own_through(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await make_proxy("embedded")
    assert not proxy.proxy.tracer.enabled
    await proxy.post("/v1/charges", key="k-1", body={"amount": 1})
    await proxy.post("/v1/charges", method="GET")
    assert all("traceparent" not in e.headers for e in upstream.executed)
    await proxy.post("/v1/charges", key="k-2", body={"amount": 1}, headers={"traceparent": CLIENT_TRACEPARENT})
    await proxy.post("/v1/charges", method="GET", headers={"traceparent": CLIENT_TRACEPARENT})
    assert [e.headers.getall("traceparent") for e in upstream.executed[2:]] == [[CLIENT_TRACEPARENT]] * 2


_OFF_SCRIPT = """
import asyncio, socket, sys, tempfile
import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
import idemproxy.cli
from idemproxy.app import Proxy
from idemproxy.config import load_config

async def main():
    app = web.Application()
    async def answer(request):
        return web.Response(text="ok")
    app.router.add_route("*", "/{tail:.*}", answer)
    upstream = TestServer(app, host="127.0.0.1")
    await upstream.start_server()
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config({"upstream": {"url": str(upstream.make_url("")).rstrip("/")},
                              "tenant": {"from": "static"}, "log": {"access": "off"},
                              "storage": {"embedded": {"path": tmp + "/store.sqlite3"}}})
        runner = Proxy(config).runner()
        await runner.setup()
        site = web.SockSite(runner, socket.create_server(("127.0.0.1", 0)))
        await site.start()
        url = "http://127.0.0.1:%d/x" % site._sock.getsockname()[1]
        async with aiohttp.ClientSession() as session:
            for method, headers in (("POST", {"Idempotency-Key": "k"}), ("POST", {"Idempotency-Key": "k"}),
                                    ("GET", {"traceparent": "CLIENT_TRACEPARENT"})):
                async with session.request(method, url, headers=headers) as resp:
                    assert resp.status == 200, resp.status
        await runner.cleanup()
    await upstream.close()
    print(sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry"))

asyncio.run(main())
""".replace("CLIENT_TRACEPARENT", CLIENT_TRACEPARENT)


def test_off_imports_no_opentelemetry() -> None:
    result = subprocess.run([sys.executable, "-c", _OFF_SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("blocked", "exporter", "named"),
    [("opentelemetry", "none", "tracing.enabled"),
     ("opentelemetry.exporter", "otlp", "tracing.exporter: otlp")],
)
def test_enabled_without_the_package_fails_at_start_in_one_line(
    tmp_path: Path, blocked: str, exporter: str, named: str
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"upstream: {{url: 'http://127.0.0.1:9'}}\ntracing: {{enabled: true, exporter: {exporter}}}\n"
                      f"storage: {{embedded: {{path: '{tmp_path / 'store.sqlite3'}'}}}}\n")
    script = (f"import sys; sys.modules[{blocked!r}] = None\n"  # as if not installed
              f"from idemproxy.cli import main; sys.exit(main(['serve', '--config', {str(config)!r}]))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"idemproxy: {named} needs OpenTelemetry")
    assert lines[0].endswith("pip install 'idemproxy[otel]'")
