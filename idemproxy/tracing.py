"""Optional OpenTelemetry tracing (``pip install 'idemproxy[otel]'``), off unless ``tracing.enabled``.

The engine calls one small interface: ``server_span`` (continued from the client's W3C ``traceparent``),
``span`` for a step (claim, forward, settle), and ``inject`` to pass the current span on to the upstream.
Off, every call returns the same do-nothing object and idemproxy never imports OpenTelemetry: tracing costs a
method call and nothing else. On, the SDK is imported once, at start, with a provider of this proxy's own
(never the process-wide global, so nothing else in the process is traced by accident).

Attributes carry the outcome, route and status, and the key only as ``short_hash`` (like the access log):
never the raw key, a tenant credential or a body.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Mapping, MutableMapping
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from idemproxy.config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span as OtelSpan
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace import Tracer as ApiTracer

AttributeValue = str | bool | int | float
HTTP_STATUS = "http.response.status_code"
INSTALL_HINT = "pip install 'idemproxy[otel]'"


class TracingUnavailable(RuntimeError):
    """``tracing.enabled`` is set but the OpenTelemetry packages are not installed."""


class Span(Protocol):
    def __enter__(self) -> Span: ...

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def set_attribute(self, key: str, value: AttributeValue) -> None: ...


class _NoSpan:
    """The span of tracing off: one shared instance that does nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        return None


_NO_SPAN = _NoSpan()


class Tracer:
    """Tracing off: spans are no-ops and nothing is added to upstream requests."""

    enabled = False

    def server_span(self, method: str, route: str | None, headers: Mapping[str, str]) -> Span:
        """The span of one request, continued from the client's ``traceparent`` in ``headers``."""
        return _NO_SPAN

    def span(self, name: str, *, client: bool = False) -> Span:
        """A step of the current request (``client``: a call to the upstream)."""
        return _NO_SPAN

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Set ``traceparent`` (and ``tracestate``) for the current span in upstream request ``headers``."""

    async def shutdown(self) -> None:
        """Export what is buffered, then stop."""


def build_tracer(config: TracingConfig) -> Tracer:
    """The tracer ``config`` asks for; raises :class:`TracingUnavailable` when the SDK is missing."""
    return OtelTracer(config) if config.enabled else Tracer()


def require(config: TracingConfig) -> None:
    """Fail at start, in one line, when tracing is on but cannot work (before any worker is started)."""
    if config.enabled:
        _import_sdk(config)


def _import_sdk(config: TracingConfig) -> None:
    key = "tracing.enabled"
    try:
        importlib.import_module("opentelemetry.sdk.trace")

        if config.exporter == "otlp":
            key = "tracing.exporter: otlp"
            importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    except ImportError as exc:
        raise TracingUnavailable(
            f"{key} needs OpenTelemetry, which is not installed ({exc.name}): {INSTALL_HINT}"
        ) from None


class _OtelSpan:
    """A started OpenTelemetry span, current while inside ``with``."""

    __slots__ = ("_manager", "_server", "_span")

    def __init__(
        self, tracer: ApiTracer, name: str, kind: SpanKind, context: Context | None = None,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        from opentelemetry.trace import SpanKind

        # Exceptions are summarised here (error.type), never recorded with their messages and stacks.
        self._manager = tracer.start_as_current_span(
            name, context=context, kind=kind, attributes=attributes,
            record_exception=False, set_status_on_exception=False,
        )
        self._server = kind is SpanKind.SERVER
        self._span: OtelSpan | None = None

    def __enter__(self) -> _OtelSpan:
        self._span = self._manager.__enter__()
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if typ is not None and self._span is not None:
            from opentelemetry.trace import StatusCode

            self._span.set_attribute("error.type", typ.__name__)
            # A server span is an error only for a 5xx answer (a 409 or 422 is the proxy working).
            if not self._server:
                self._span.set_status(StatusCode.ERROR)
        self._manager.__exit__(typ, exc, tb)

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        assert self._span is not None
        self._span.set_attribute(key, value)
        if self._server and key == HTTP_STATUS and isinstance(value, int) and value >= 500:
            from opentelemetry.trace import StatusCode

            self._span.set_status(StatusCode.ERROR)


class OtelTracer(Tracer):
    """Tracing on: spans through a provider of this proxy's own; W3C TraceContext in and out."""

    enabled = True

    def __init__(self, config: TracingConfig) -> None:
        _import_sdk(config)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name})
        )
        exporter = _exporter(config)
        if exporter is not None:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer("idemproxy")
        self._propagator: TextMapPropagator = TraceContextTextMapPropagator()

    def server_span(self, method: str, route: str | None, headers: Mapping[str, str]) -> Span:
        from opentelemetry.trace import SpanKind

        attributes: dict[str, AttributeValue] = {"http.request.method": method}
        if route:
            attributes["http.route"] = route
        name = f"{method} {route}" if route else method
        return _OtelSpan(self._tracer, name, SpanKind.SERVER, self._propagator.extract(headers), attributes)

    def span(self, name: str, *, client: bool = False) -> Span:
        from opentelemetry.trace import SpanKind

        return _OtelSpan(self._tracer, name, SpanKind.CLIENT if client else SpanKind.INTERNAL)

    def inject(self, headers: MutableMapping[str, str]) -> None:
        # Replaces a traceparent the client sent: the upstream's parent is this proxy's forward span.
        self._propagator.inject(headers)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.provider.shutdown)  # blocks while the batch exporter flushes


def _exporter(config: TracingConfig) -> SpanExporter | None:
    if config.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(service_name=config.service_name)
    if config.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # typed here: without the exporter package installed (the test extra has none) mypy sees Any
        otlp: SpanExporter = OTLPSpanExporter(endpoint=config.endpoint or None)
        return otlp
    return None
