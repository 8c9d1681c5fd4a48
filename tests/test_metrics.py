"""The per-request shortcuts count exactly what prometheus-client's public methods count."""

from __future__ import annotations

import math
import re

from idemproxy.metrics import BUCKETS, Metrics, adder


def exposition(metrics: Metrics) -> str:
    return re.sub(r"(?m)^.*_created.*\n", "", metrics.render().decode())  # creation times differ


def test_the_hot_path_shortcuts_count_what_the_public_methods_count() -> None:
    amounts = [0.0, 1e-9, 5e-5, *BUCKETS, *(math.nextafter(b, 0) for b in BUCKETS),
               *(math.nextafter(b, math.inf) for b in BUCKETS), 61.0, 1e9]
    fast, public = Metrics(), Metrics()
    up, down = adder(fast.in_flight), adder(fast.in_flight, -1)
    for _ in range(5):
        up()
        public.in_flight.inc()
    down()
    public.in_flight.dec()
    for outcome in ("replayed", "forwarded"):
        counted = fast.per_request("/v1", "POST", outcome)
        for amount in amounts:
            counted.count()
            counted.duration(amount)
            counted.overhead(amount / 2)
            fast.observe_upstream(amount)
            public.requests.labels("/v1", "POST", outcome).inc()
            public.request_duration.labels(outcome).observe(amount)
            public.overhead.labels(outcome).observe(amount / 2)
            public.upstream_duration.observe(amount)
    text = exposition(fast)
    assert 'idemproxy_request_duration_seconds_bucket{le="0.0001",outcome="replayed"}' in text
    assert "idemproxy_in_flight_requests 4.0" in text
    assert text == exposition(public)
