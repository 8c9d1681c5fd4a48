"""Prometheus metrics, exactly as CONTRACT "Metrics" names them.

Each app owns a registry so that several proxies in one process (tests) do not mix their counts; with
``--workers N`` the values live in prometheus-client's multiprocess files and ``render`` aggregates them.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.values import MutexValue

# From 100 µs, so the proxy's own sub-millisecond overhead is resolved, up past the longest upstream call.
BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

OUTCOMES = (
    "passthrough", "forwarded", "replayed", "in_flight", "payload_mismatch", "missing_key",
    "invalid_key", "missing_tenant", "body_too_large", "upstream_error", "store_error",
)

# Redis operations counted in idemproxy_store_errors_total only when they fail (never timed, so no success creates
# their series): a lost subscription, a garbled replay-cache copy, a lock of a form idemproxy never writes, an
# admin release's purge. Their series are exported at 0 from the start: one that first appears at 1 has no rate()
# in Prometheus, and IdempotencyStoreErrors would miss its first error.
REDIS_ERROR_ONLY_OPERATIONS = ("subscribe", "copy", "lock", "forget")


class Metrics:
    """The metric set of one proxy."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[str, str, str], RequestMetrics] = {}
        self._store_children: dict[tuple[str, str], StoreMetrics] = {}
        r = self.registry
        self.requests = Counter(
            "idemproxy_requests", "Requests by route, method and outcome",
            ["route", "method", "outcome"], registry=r,
        )
        self.request_duration = Histogram(
            "idemproxy_request_duration_seconds", "Time from request to response, by outcome",
            ["outcome"], buckets=BUCKETS, registry=r,
        )
        self.overhead = Histogram(
            "idemproxy_overhead_seconds", "Time in the proxy minus time waiting on the upstream",
            ["outcome"], buckets=BUCKETS, registry=r,
        )
        self.upstream_duration = Histogram(
            "idemproxy_upstream_duration_seconds", "Time waiting on the upstream",
            buckets=BUCKETS, registry=r,
        )
        self.observe_upstream = observer(self.upstream_duration)
        self.store_duration = Histogram(
            "idemproxy_store_duration_seconds", "Store operation latency",
            ["backend", "operation"], buckets=BUCKETS, registry=r,
        )
        self.store_errors = Counter(
            "idemproxy_store_errors", "Store operations that failed",
            ["backend", "operation"], registry=r,
        )
        self.in_flight = Gauge(
            "idemproxy_in_flight_requests", "Covered requests being forwarded now",
            registry=r, multiprocess_mode="livesum",
        )
        self.lease_takeovers = Counter(
            "idemproxy_lease_takeovers", "In-flight records taken over after their lease ran out",
            registry=r,
        )
        self.settle_retries = Counter(
            "idemproxy_settle_retries", "Completions and releases retried because the store failed after the forward",
            ["operation"], registry=r,
        )
        self.pending_settles = Gauge(
            "idemproxy_pending_settles", "Completions and releases waiting for the store to come back",
            registry=r, multiprocess_mode="livesum",
        )
        self.settles_dropped = Counter(
            "idemproxy_settles_dropped", "Pending completions or releases dropped (bound or shutdown)", registry=r,
        )
        self.store_up = Gauge(
            "idemproxy_store_up", "1 while the store answers, 0 while it does not (by backend)",
            ["backend"], registry=r, multiprocess_mode="livemin",
        )
        self.records_unreadable = Counter(
            "idemproxy_records_unreadable", "Stored responses that did not open (unknown key, tampered, moved)",
            ["backend"], registry=r,
        )
        self.records_expired = Counter(
            "idemproxy_records_expired", "Records removed or replaced after their TTL", registry=r,
        )

        self.partitions_dropped = Counter(
            "idemproxy_partitions_dropped", "Daily PostgreSQL partitions dropped whole once every record expired",
            registry=r,
        )
        self.partitions = Gauge(
            "idemproxy_partitions", "Daily PostgreSQL partitions standing (as of the last maintenance)",
            registry=r, multiprocess_mode="livemax",
        )

    def per_request(self, route: str, method: str, outcome: str) -> RequestMetrics:
        """The labelled children every request updates, looked up once per label set (``labels()`` costs a
        lock and a dict lookup each time; methods, routes and outcomes are few)."""
        key = (route, method, outcome)
        children = self._children.get(key)
        if children is None:
            if len(self._children) >= 1024:  # odd methods from hostile clients: do not grow without bound
                self._children.clear()
            children = self._children[key] = RequestMetrics(
                self.requests.labels(route, method, outcome),
                self.request_duration.labels(outcome),
                self.overhead.labels(outcome),
            )
        return children

    def store_children(self, backend: str, operation: str) -> StoreMetrics:
        """The labelled children of one store operation, looked up once (as ``per_request``)."""
        key = (backend, operation)
        children = self._store_children.get(key)
        if children is None:  # operations are a fixed few: no bound needed
            children = self._store_children[key] = StoreMetrics(
                self.store_duration.labels(backend, operation), self.store_errors.labels(backend, operation),
            )
        return children

    def render(self) -> bytes:
        """The Prometheus text exposition (aggregated over workers in multiprocess mode)."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        return generate_latest(self.registry)


class RequestMetrics:
    """What one request counts, for one (route, method, outcome): the request, its duration, its overhead."""

    __slots__ = ("count", "duration", "overhead")

    def __init__(self, requests: Counter, duration: Histogram, overhead: Histogram) -> None:
        self.count = incrementer(requests)
        self.duration = observer(duration)
        self.overhead = observer(overhead)


class StoreMetrics:
    """What one store operation counts: its duration, its failures."""

    __slots__ = ("duration", "error")

    def __init__(self, duration: Histogram, errors: Counter) -> None:
        self.duration = observer(duration)
        self.error = incrementer(errors)


# Every request updates about ten values (three histograms and four store timings, a counter, the in-flight gauge);
# prometheus-client's public methods check on each call what a child of a label set always passes, walk the buckets
# in Python, and take a lock per value. The shortcuts below update the very same values. A value of this process
# alone (``MutexValue``) is written without its lock, which only guards writers on several threads: the metrics
# given a shortcut (request counts and durations, store timings and errors, the in-flight gauge) are written on the
# event loop's thread alone, and the exposition, also on the loop, reads each float whole. A metric written from
# another thread must keep the public, locked method and never get a shortcut: the embedded store's SQLite worker
# counts unreadable records (``records_unreadable``, codec.py) that way. Multiprocess values (``--workers``: a
# shared file) keep their own ``inc``, and a missing private name falls back to the public method.


def _unshared(value: object) -> bool:
    """A value held in this process alone: its lock-free update is safe from the loop's thread."""
    return type(value) is MutexValue


def incrementer(counter: Counter) -> Callable[[], None]:
    """``counter.inc()`` for a counter without labels or a labelled child."""
    return adder(counter)


def adder(metric: Counter | Gauge, amount: float = 1.0) -> Callable[[], None]:
    """``metric.inc(amount)`` (a gauge's ``dec()`` is ``adder(gauge, -1)``) for a metric without labels or a
    labelled child."""
    value = getattr(metric, "_value", None)
    if _unshared(value):
        def add_unshared() -> None:
            value._value += amount  # type: ignore[union-attr]

        return add_unshared
    if value is None or not hasattr(value, "inc"):
        return lambda: metric.inc(amount)  # a gauge takes a negative amount

    def add() -> None:
        value.inc(amount)

    return add


def observer(histogram: Histogram) -> Callable[[float], None]:
    """``histogram.observe`` for a histogram without labels or a labelled child (no exemplars), for the
    finite durations the proxy measures: the bucket is found by bisection, as the first bound >= amount."""
    bounds, buckets, total = (getattr(histogram, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        return histogram.observe
    upper = list(bounds)
    if _unshared(total) and all(_unshared(bucket) for bucket in buckets):
        def observe_unshared(amount: float) -> None:
            total._value += amount
            buckets[bisect_left(upper, amount)]._value += 1

        return observe_unshared

    def observe(amount: float) -> None:
        total.inc(amount)
        buckets[bisect_left(upper, amount)].inc(1)

    return observe
