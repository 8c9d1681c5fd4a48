"""Deployment artefacts: alert rules and dashboard queries are valid PromQL over metrics the proxy exports.

(The Dockerfile, compose file and Kubernetes manifests are checked by hadolint, the compose-spec schema and
kubernetes-validate --strict in `make validate`, part of `make test`.)
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from idemproxy.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
RULES = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
DASHBOARD = json.loads((ROOT / "deploy/grafana/dashboards/idemproxy.json").read_text())
ALERTS = [rule for group in RULES["groups"] for rule in group["rules"]]
QUERIES = [t["expr"] for panel in DASHBOARD["panels"] for t in panel["targets"]]


def exported_series() -> set[str]:
    """Every series name the proxy exposes (a sample of each labelled family is enough to name them)."""
    metrics = Metrics()
    metrics.requests.labels("other", "POST", "forwarded").inc()
    for histogram in (metrics.request_duration, metrics.overhead):
        histogram.labels("forwarded").observe(0.001)
    metrics.upstream_duration.observe(0.01)
    metrics.store_duration.labels("redis", "claim").observe(0.001)
    metrics.store_errors.labels("redis", "claim").inc()
    metrics.records_unreadable.labels("postgres").inc()
    text = metrics.render().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bidemproxy_[a-z_]+", expr))


@pytest.mark.parametrize("expr", [r["expr"] for r in ALERTS] + QUERIES)
def test_queries_parse_and_use_only_exported_metrics(expr: str) -> None:
    promql_parser.parse(expr)  # raises on a syntax error
    names = metric_names(expr)
    assert names, expr
    assert names <= exported_series(), names - exported_series()


def test_alerts_cover_the_operational_promises() -> None:
    by_name: dict[str, Any] = {rule["alert"]: rule for rule in ALERTS}
    assert set(by_name) == {
        "IdempotencyConflictRateHigh", "IdempotencyInFlightRateHigh", "IdempotencyOverheadHigh",
        "IdempotencyStoreErrors", "IdempotencyLeaseTakeovers", "IdempotencyAnswersNotStored",
        "IdempotencySettlesDropped", "IdempotencyRecordsUnreadable", "IdempotencyRedisEntriesNotOurs",
    }
    # A garbled Redis copy or a lock idemproxy never writes is counted as a Redis store error, but Redis answered
    # and the key was answered from PostgreSQL: a warning of its own, not the critical "store failing" page.
    assert 'operation!~"copy|lock"' in by_name["IdempotencyStoreErrors"]["expr"]
    entries = by_name["IdempotencyRedisEntriesNotOurs"]
    assert 'operation=~"copy|lock"' in entries["expr"] and entries["labels"]["severity"] == "warning"
    assert "idemproxy_records_unreadable_total" in by_name["IdempotencyRecordsUnreadable"]["expr"]
    assert "idemproxy_pending_settles" in by_name["IdempotencyAnswersNotStored"]["expr"]
    assert "idemproxy_settles_dropped_total" in by_name["IdempotencySettlesDropped"]["expr"]
    assert "> 0.01" in by_name["IdempotencyConflictRateHigh"]["expr"]
    assert "> 0.05" in by_name["IdempotencyInFlightRateHigh"]["expr"]
    overhead = by_name["IdempotencyOverheadHigh"]["expr"]
    assert "0.99" in overhead and "> 0.005" in overhead
    for rule in ALERTS:
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]


def test_dashboard_shows_what_operators_need() -> None:
    titles = " ".join(panel["title"].lower() for panel in DASHBOARD["panels"])
    for topic in ("outcome", "overhead", "upstream", "store", "conflicts", "takeovers"):
        assert topic in titles, topic
    assert len({panel["id"] for panel in DASHBOARD["panels"]}) == len(DASHBOARD["panels"])


def test_the_container_config_is_valid() -> None:
    from idemproxy.config import load_config

    config = load_config(yaml.safe_load((ROOT / "deploy/docker/config.yaml").read_text()), env={})
    assert config.storage.backend == "postgres" and config.storage.redis is not None
    assert config.admin.host == "0.0.0.0"  # Prometheus and the HEALTHCHECK reach it


def test_the_container_config_says_which_variables_it_reads() -> None:
    """The image's config is documented only by its own header: it said "every value can be set from the
    environment", though most (ports, log format, in_flight...) cannot. It names each variable it reads."""
    text = (ROOT / "deploy/docker/config.yaml").read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    body = text[len(header):] if text.startswith(header) else text
    read = set(re.findall(r"\$\{([A-Z_]+)", body))
    assert read and read == set(re.findall(r"\b(IDEMPROXY_[A-Z_]+)", header)), (read, header)
    assert "every value" not in header


@pytest.mark.parametrize("path", ["deploy/k8s/gateway.yaml", "deploy/k8s/sidecar.yaml"])
def test_kubernetes_configmaps_hold_valid_configs(path: str) -> None:
    from idemproxy.config import load_config

    docs = [d for d in yaml.safe_load_all((ROOT / path).read_text()) if d and d["kind"] == "ConfigMap"]
    env = {"IDEMPROXY_ADMIN_TOKEN": "t", "IDEMPROXY_POSTGRES_DSN": "postgresql://u:p@db:5432/idem"}
    for doc in docs:
        load_config(yaml.safe_load(doc["data"]["config.yaml"]), env=env)


@pytest.mark.parametrize("path", ["deploy/k8s/gateway.yaml", "deploy/k8s/sidecar.yaml"])
def test_kubernetes_shapes_drain_and_are_locked_down(path: str) -> None:
    from idemproxy.config import load_config

    docs = [d for d in yaml.safe_load_all((ROOT / path).read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "Deployment", "NetworkPolicy"} <= kinds
    env = {"IDEMPROXY_ADMIN_TOKEN": "t", "IDEMPROXY_POSTGRES_DSN": "postgresql://u:p@db:5432/idem"}
    config = next(load_config(yaml.safe_load(d["data"]["config.yaml"]), env=env) for d in docs
                  if d["kind"] == "ConfigMap")
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= config.drain_delay + config.shutdown_timeout + 5
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
        assert "memory" in container["resources"]["limits"]
    proxy = next(c for c in pod["containers"] if c["name"] == "idemproxy")
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/healthz"
    probe = proxy["readinessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] < config.drain_delay  # seen before the port closes
    for other in (c for c in pod["containers"] if c is not proxy):  # a sidecar's app outlives the drain
        assert other["lifecycle"]["preStop"]["sleep"]["seconds"] >= config.drain_delay + config.shutdown_timeout


@pytest.mark.parametrize("storage", [
    {"embedded": {"path": "idemproxy.sqlite3"}},
    {"postgres": {"dsn": "postgresql://u@db/idem"}},
    {"postgres": {"dsn": "postgresql://u@db/idem"}, "redis": {"url": "redis://redis:6379/0"}},
], ids=["embedded", "postgres", "postgres+redis"])
def test_alerts_on_one_event_see_the_first_one(storage: dict[str, Any]) -> None:
    """An alert that fires on any one event (`increase(...) > 0`, no `for`) needs its series exported at 0 before
    that event: a series that first appears at 1 has no increase in Prometheus, so the first event (often the only
    one) would never fire it. Each such counter is there, at 0, for every backend the proxy uses, before it serves."""
    from idemproxy.app import Proxy
    from idemproxy.config import load_config

    proxy = Proxy(load_config({"upstream": {"url": "http://api:9000"}, "storage": storage}, env={}))
    backends = {"postgres"} if "postgres" in storage else {"embedded"}
    backends |= {"redis"} if "redis" in storage else set()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in proxy.metrics.render().decode().splitlines() if line and not line.startswith("#")}
    on_one_event = [rule for rule in ALERTS if "for" not in rule and "increase(" in rule["expr"]]
    assert {rule["alert"] for rule in on_one_event} >= {"IdempotencyRecordsUnreadable", "IdempotencyLeaseTakeovers"}
    for rule in on_one_event:
        for name in metric_names(rule["expr"]):
            operations = re.search(r'backend="redis",operation=~"([a-z|]+)"', rule["expr"])
            if operations:  # a Redis alert on some operations: each one's series, where Redis is used
                wanted = {f'{name}{{backend="redis",operation="{op}"}}' for op in operations[1].split("|")
                          if "redis" in backends}
            elif "by (backend)" in rule["expr"]:
                wanted = {f'{name}{{backend="{backend}"}}' for backend in backends}
            else:
                wanted = {name}
            assert all(samples.get(series) == 0 for series in wanted), (rule["alert"], wanted - samples.keys())


def test_the_readme_layout_names_every_module() -> None:
    """README's Layout table is where a reader looks for a module: each one of the package is named there (a
    module added without a line was missing from it for days: the stores' group commit and own Redis
    connection, the settler, the replay memory, the fingerprint, the metrics)."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1]
    named = set(re.findall(r"`(?:idemproxy/(?:store/)?)?([a-z_]+\.py)`", layout))
    package = ROOT / "idemproxy"
    modules = {p.name for p in [*package.glob("*.py"), *(package / "store").glob("*.py")]}
    assert modules - {"__init__.py", "__main__.py"} <= named, modules - named


def test_store_errors_counted_only_when_they_happen_are_exported_before_the_first() -> None:
    """IdempotencyStoreErrors (`rate(idemproxy_store_errors_total[5m]) > 0` for 2 min: "any store error") sees
    an operation's first error only if its series was there before it. Timed operations have theirs from their
    first call; the Redis operations docs/operating.md names, which are counted only when they fail (a lost
    subscription, a garbled copy, a foreign lock), are exported at 0 from the start."""
    from idemproxy.app import Proxy
    from idemproxy.config import load_config

    row = next(line for line in (ROOT / "docs/operating.md").read_text().splitlines()
               if line.startswith("| `idemproxy_store_errors_total`"))
    operations = re.findall(r"`([a-z]+)`:", row)
    assert {"subscribe", "copy", "lock"} <= set(operations), row
    proxy = Proxy(load_config({"upstream": {"url": "http://api:9000"}, "storage": {
        "postgres": {"dsn": "postgresql://u@db/idem"}, "redis": {"url": "redis://redis:6379/0"}}}, env={}))
    registry = proxy.metrics.registry
    for operation in operations:
        labels = {"backend": "redis", "operation": operation}
        assert registry.get_sample_value("idemproxy_store_errors_total", labels) == 0, operation


def test_the_image_healthcheck_reaches_the_admin_port_directly(tmp_path: Path) -> None:
    """The Dockerfile's HEALTHCHECK asks /healthz with urllib, which goes through $http_proxy when one is set; Docker
    sets it in every container from the client's proxy settings (~/.docker/config.json), and then the check asked
    the corporate proxy for 127.0.0.1:9090 and the container went unhealthy. (`idemproxy keys` had the same fault.)"""
    import http.server
    import os
    import subprocess
    import sys
    import threading

    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    line = next(line for line in (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
                if line.startswith("HEALTHCHECK"))
    command = json.loads(line.split(" CMD ", 1)[1])
    assert command[:2] == ["python", "-c"] and "127.0.0.1:9090/healthz" in command[2], command
    server = http.server.HTTPServer(("127.0.0.1", 0), Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as dead:  # a proxy that refuses every connection
        dead.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
        try:
            script = command[2].replace("127.0.0.1:9090", f"127.0.0.1:{server.server_port}")
            env = {**os.environ, "http_proxy": proxy, "HTTP_PROXY": proxy, "no_proxy": "", "NO_PROXY": ""}
            result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                    timeout=30, cwd=tmp_path)
        finally:
            server.shutdown()
            server.server_close()
    assert result.returncode == 0, result.stderr
