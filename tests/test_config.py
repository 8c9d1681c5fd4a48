from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from yarl import URL

from idemproxy.config import (
    AmbiguousPath,
    ConfigError,
    SecretURL,
    advisories,
    dump_yaml,
    load_config,
    load_config_file,
    normalised_path,
    parse_duration,
    parse_size,
)
from tests.conftest import ProxyFactory
from tests.proxyproc import ProxyProcess
from tests.upstream import RecordingUpstream

UP = {"url": "http://127.0.0.1:9000"}


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "idemproxy", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60)


def errors_of(raw: Any, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(raw, env=env or {})
    return info.value.errors


def test_defaults_match_the_contract() -> None:
    config = load_config({"upstream": UP}, env={})
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", 8080)
    assert config.listen.keepalive_timeout == 3630  # aiohttp's: longer than any load balancer's idle timeout
    assert config.listen.header_timeout == 60  # nginx's client_header_timeout
    assert config.listen.body_timeout == 60  # nginx's client_body_timeout
    assert config.listen.send_timeout == 60  # nginx's send_timeout
    assert (config.admin.host, config.admin.port) == ("127.0.0.1", 9090)
    assert config.upstream.timeout == 30 and config.upstream.connect_timeout == 5
    assert config.upstream.max_connections == 512 and config.upstream.forward_key is True
    assert config.tenant.from_ == "header" and config.tenant.header == "Authorization"
    assert config.tenant.hash and config.tenant.required
    idem = config.idempotency
    assert idem.methods == ("POST", "PATCH") and idem.header == "Idempotency-Key"
    assert idem.ttl == 86400 and idem.lease == 60 and idem.wait_timeout == 10
    assert idem.release_statuses == (408, 409, 425, 429, 503)
    assert idem.on_unknown_outcome == "keep_lease" and idem.in_flight == "reject"
    assert idem.max_request_body == 1024 * 1024 and idem.max_stored_response == 1024 * 1024
    assert idem.strip_replay_headers == ("Set-Cookie",) and idem.key_max_length == 255
    assert config.storage.backend == "embedded" and config.storage.on_store_error == "fail_closed"


def test_the_contract_example_loads() -> None:
    raw = yaml.safe_load(Path(__file__).parent.joinpath("..", "config.example.yaml").read_text())
    config = load_config(raw, env={"IDEMPROXY_ADMIN_TOKEN": "s3cret"})
    assert config.storage.backend == "postgres" and config.storage.redis is not None
    assert config.admin.token.reveal() == "s3cret"
    charges = config.route_for("/v1/charges/ch_1")
    assert charges is not None and charges.idempotency.required and charges.idempotency.ttl == 72 * 3600
    events = config.route_for("/v1/events")
    assert events is not None and not events.enabled
    assert config.route_for("/v2/other") is None


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("30s", 30), ("24h", 86400), ("5m", 300), (12, 12), ("1.5s", 1.5), ("2d", 172800)],
)
def test_durations(text: Any, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "size"), [("512KiB", 524288), ("1MiB", 1048576), (100, 100), ("2KB", 2000)]
)
def test_sizes(text: Any, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"upstream": {**UP, "timeout": "soon"}}, "upstream.timeout: 'soon' is not a duration"),
        ({"upstream": {"url": "ftp://x"}}, "upstream.url: 'ftp://x' is not an http(s) URL"),
        ({}, "upstream.url: is required"),
        ({"upstream": UP, "listen": {"port": 70000}}, "listen.port: 70000 is out of range"),
        ({"upstream": UP, "listen": {"prot": 1}}, "listen.prot: unknown key"),
        ({"upstream": UP, "bogus": 1}, "bogus: unknown key"),
        ({"upstream": UP, "idempotency": {"max_request_body": "big"}},
         "idempotency.max_request_body: 'big' is not a size"),
        ({"upstream": UP, "idempotency": {"in_flight": "queue"}},
         "idempotency.in_flight: 'queue' is not one of reject, wait"),
        ({"upstream": UP, "idempotency": {"release_statuses": [408, 700]}},
         "idempotency.release_statuses[1]: 700 is out of range"),
        ({"upstream": UP, "idempotency": {"store_5xx": "maybe"}},
         "idempotency.store_5xx: 'maybe' is not a boolean"),
        ({"upstream": {**UP, "timeout": "90s"}},
         "idempotency.lease: 60s must be longer than upstream.timeout"),
        ({"upstream": UP, "routes": [{"prefix": "v1/charges"}]},
         "routes[0].prefix: 'v1/charges' must be a path starting with '/'"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "lease": "10s"}]},
         "routes[0].lease: 10s must be longer than upstream.timeout"),
        ({"upstream": {**UP, "timeout": "60s"}},  # no margin: the answer would be stored after the lease
         "idempotency.lease: 60s must be longer than upstream.timeout (60s), or a slow request"),
        ({"upstream": UP, "idempotency": {"key_max_length": 3000}},  # PostgreSQL could not index it
         "idempotency.key_max_length: 3000 is out of range (1..1024)"),
        ({"upstream": UP, "idempotency": {"settle_timeout": "soon"}},
         "idempotency.settle_timeout: 'soon' is not a duration"),
        # a zero that would turn every covered request into a 504 or a 502, or make every record expire at once
        ({"upstream": {**UP, "timeout": 0}}, "upstream.timeout: 0 is not a duration above zero"),
        ({"upstream": {**UP, "connect_timeout": "0s"}},
         "upstream.connect_timeout: '0s' is not a duration above zero"),
        ({"upstream": UP, "idempotency": {"ttl": "0ms"}}, "idempotency.ttl: '0ms' is not a duration above zero"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "ttl": 0}]}, "routes[0].ttl: 0 is not a duration above zero"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "upstream": {**UP, "timeout": "0s"}}]},
         "routes[0].upstream.timeout: '0s' is not a duration above zero"),
        ({"upstream": UP, "idempotency": {"settle_timeout": 0}},
         "idempotency.settle_timeout: 0 is not a duration above zero"),
        ({"upstream": UP, "listen": {"header_timeout": "0ms"}},
         "listen.header_timeout: '0ms' is not a duration above zero"),
        ({"upstream": UP, "listen": {"body_timeout": 0}}, "listen.body_timeout: 0 is not a duration above zero"),
        ({"upstream": UP, "listen": {"send_timeout": "0s"}}, "listen.send_timeout: '0s' is not a duration above zero"),
        # zero is aiohttp's "no keep-alive timeout": an idle connection kept for as long as the client likes
        ({"upstream": UP, "listen": {"keepalive_timeout": 0}},
         "listen.keepalive_timeout: 0 is not a duration above zero"),
        ({"upstream": UP, "listen": {"keepalive_timeout": "soon"}},
         "listen.keepalive_timeout: 'soon' is not a duration"),
        # zero cut every in-flight request and pending completion at shutdown: executed answers never stored
        ({"upstream": UP, "shutdown_timeout": "0s"}, "shutdown_timeout: '0s' is not a duration above zero"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "wait_timeout": "0s"}]},
         "routes[0].wait_timeout: '0s' is not a duration above zero"),
        # YAML's .nan and .inf are numbers: nan passed every comparison, so `timeout: .nan` made every forward a
        # 500 after the upstream executed, and a ttl no timestamp can hold failed every claim
        ({"upstream": {**UP, "timeout": float("nan")}}, "upstream.timeout: nan is not a duration"),
        ({"upstream": UP, "idempotency": {"lease": float("inf")}}, "idempotency.lease: inf is not a duration"),
        ({"upstream": UP, "idempotency": {"ttl": "99999999999d"}},
         "idempotency.ttl: '99999999999d' is not a duration (at most 100 years)"),
        ({"upstream": UP, "drain_delay": float("nan")}, "drain_delay: nan is not a duration"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://h/d", "migrate": True}}},
         "storage.postgres.migrate: True is not one of auto, off"),
        ({"upstream": UP, "storage": {"pending_settles": {"max_count": 0}}},
         "storage.pending_settles.max_count: 0 is out of range"),
        ({"upstream": UP, "storage": {"pending_settles": {"max_bytes": "512KiB"}}},
         "storage.pending_settles.max_bytes: 524288 bytes cannot hold one stored answer"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "colour": "red"}]},
         "routes[0].colour: unknown key"),
        ({"upstream": UP, "storage": {"redis": {"url": "redis://h:6379/0"}}},
         "storage.redis: Redis alone is refused"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "mysql://x"}}},
         "storage.postgres.dsn: 'mysql://x' is not a postgresql:// DSN"),
        ({"upstream": UP, "storage": {"on_store_error": "shrug"}},
         "storage.on_store_error: 'shrug' is not one of fail_closed, fail_open"),
        ({"upstream": UP, "tenant": {"from": "cookie"}},
         "tenant.from: 'cookie' is not one of header, static"),
        ({"upstream": {"url": "${UPSTREAM_URL}"}},
         "upstream.url: environment variable UPSTREAM_URL is not set"),
        ({"upstream": UP, "workers": 4}, "workers: 4 workers need storage.postgres"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "lease": "10s", "upstream": {**UP, "timeout": "10s"}}]},
         "routes[0].lease: 10s must be longer than routes[0].upstream.timeout (10s)"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "upstream": {"timeout": "1s"}}]},
         "routes[0].upstream.url: is required"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "upstream": {**UP, "pool": 3}}]},
         "routes[0].upstream.pool: unknown key"),
        ({"upstream": UP, "forwarded": {"trusted_proxies": ["10.0.0.0/8", "lb.internal"]}},
         "forwarded.trusted_proxies[1]: 'lb.internal' is not an IP address or CIDR network"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "methods": ["POST", "P OST"]}]},
         "routes[0].methods[1]: 'P OST' is not a valid HTTP token"),
        ({"upstream": UP, "routes": [{"prefix": "/a"}, {"ttl": "1h"}]}, "routes[1].prefix: is required"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "enable": False}]},
         "routes[0].enable: unknown key (known: prefix, enabled, upstream, header,"),
        ({"upstream": UP, "request_id": {"header": "X Request"}},
         "request_id.header: 'X Request' is not a valid HTTP token"),
        ({"upstream": UP, "drain_delay": "later"}, "drain_delay: 'later' is not a duration"),
        ({"upstream": UP, "admin": {"ready_requires_store": "perhaps"}},
         "admin.ready_requires_store: 'perhaps' is not a boolean"),
        ({"upstream": UP, "idempotency": {"in_flight_status": 429}},
         "idempotency.in_flight_status: 429 is not one of 409, 425, 202"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "mismatch_status": 418}]},
         "routes[0].mismatch_status: 418 is not one of 422, 409, 400"),
        ({"upstream": UP, "storage": {"postgres": {"partitions": "hourly"}}},
         "storage.postgres.partitions: 'hourly' is not one of daily, none"),
        ({"upstream": UP, "storage": {"postgres": {}, "redis": {"cluster": "maybe"}}},
         "storage.redis.cluster: 'maybe' is not a boolean"),
        ({"upstream": UP, "listen": {"port": 8080.9}}, "listen.port: 8080.9 is not an integer"),  # never cut
        ({"upstream": {**UP, "max_connections": 1.5}}, "upstream.max_connections: 1.5 is not an integer"),
        ({"upstream": UP, "idempotency": {"release_statuses": [429.9]}},
         "idempotency.release_statuses[0]: 429.9 is not an integer"),
        ({"upstream": UP, "listen": {"port": float("inf")}}, "listen.port: inf is not an integer"),
    ],
)
def test_bad_configs_name_the_key_and_value(raw: dict[str, Any], expected: str) -> None:
    errors = errors_of(raw)
    assert any(expected in error for error in errors), errors


def test_the_readme_gateway_example_loads() -> None:
    readme = Path(__file__).parent.joinpath("..", "README.md").read_text()
    block = readme.split("## As a gateway", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    env = {"IDEMPROXY_ADMIN_TOKEN": "t", "IDEMPROXY_POSTGRES_DSN": "postgresql://u:p@db:5432/idem"}
    config = load_config(yaml.safe_load(block), env=env)
    assert len(config.routes) == 3
    assert len({config.upstream_for(r).url for r in config.routes}) == 2


def test_gateway_keys_and_their_defaults() -> None:
    config = load_config({"upstream": {**UP, "timeout": "50s"}, "routes": [
        # its own upstream is quick, so a short lease is fine although the top-level timeout is long
        {"prefix": "/fast", "lease": "10s", "upstream": {"url": "http://fast:1", "timeout": "5s"}},
        {"prefix": "/slow"},
    ], "forwarded": {"trusted_proxies": ["10.0.0.0/8", "2001:db8::1"]}, "drain_delay": "2s"}, env={})
    fast, slow = config.routes
    assert fast.upstream is not None and config.upstream_for(fast).url == "http://fast:1"
    assert config.upstream_for(fast).max_connections == 512  # the upstream defaults, not the top-level's
    assert config.upstream_for(slow) is config.upstream and config.upstream_for(None) is config.upstream
    assert [str(n) for n in config.forwarded.trusted_proxies] == ["10.0.0.0/8", "2001:db8::1/128"]
    assert config.drain_delay == 2 and config.request_id.header == "X-Request-Id"
    assert config.admin.ready_requires_store is False
    assert (config.idempotency.in_flight_status, config.idempotency.mismatch_status) == (409, 422)
    assert load_config({"upstream": UP}, env={}).drain_delay == 5
    plain = yaml.safe_load(dump_yaml(config))
    assert plain["routes"][0]["upstream"]["url"] == "http://fast:1" and "upstream" not in plain["routes"][1]
    assert plain["forwarded"]["trusted_proxies"] == ["10.0.0.0/8", "2001:db8::1/128"]


def test_storage_at_scale_keys_and_their_defaults() -> None:
    config = load_config({"upstream": UP, "storage": {"postgres": {}, "redis": {}}}, env={})
    assert config.storage.postgres is not None and config.storage.postgres.partitions == "daily"
    assert config.storage.redis is not None and config.storage.redis.cluster is False
    config = load_config({"upstream": UP, "storage": {"postgres": {"partitions": "none"},
                                                      "redis": {"cluster": True}}}, env={})
    assert config.storage.postgres is not None and config.storage.postgres.partitions == "none"
    assert config.storage.redis is not None and config.storage.redis.cluster is True
    plain = yaml.safe_load(dump_yaml(config))
    assert plain["storage"]["postgres"]["partitions"] == "none" and plain["storage"]["redis"]["cluster"] is True
    # a cluster's url may name several nodes, any of which answering is enough to learn the cluster from
    nodes = "rediss://:pw@[2001:db8::1]:6380,c2:6379,c3/0"
    config = load_config({"upstream": UP, "storage": {"postgres": {}, "redis": {"url": nodes, "cluster": True}}},
                         env={})
    assert config.storage.redis is not None and config.storage.redis.url.reveal() == nodes


def test_top_level_upstream_timeout_is_checked_only_against_routes_using_it() -> None:
    raw = {"upstream": {**UP, "timeout": "50s"},
           "routes": [{"prefix": "/a", "lease": "10s"},
                      {"prefix": "/b", "lease": "10s", "upstream": {**UP, "timeout": "5s"}}]}
    errors = errors_of(raw)
    assert [e for e in errors if "lease" in e] == [
        "routes[0].lease: 10s must be longer than upstream.timeout (50s), or a slow request "
        "loses its lease before its answer is stored"
    ]


def test_the_contract_bounds_the_lease_by_the_timeout_alone_and_a_small_margin_is_a_warning(tmp_path: Path) -> None:
    raw = {"upstream": {**UP, "timeout": "1s"}, "idempotency": {"lease": "2s", "ttl": "1s"},
           "routes": [{"prefix": "/a", "lease": "10s"}]}
    config = load_config(raw, env={})  # timeout < lease, ttl < lease: valid
    assert config.idempotency.lease == 2 and config.idempotency.ttl == 1
    assert advisories(config) == [
        "idempotency.lease: 2s leaves 1s over upstream.timeout (1s), under the 2s advised: a completion slower "
        "than that may lose the lease to a retry, which would forward again"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = check_config(path)
    assert result.returncode == 0
    assert result.stderr.splitlines() == [f"idemproxy: warning: {advisories(config)[0]}"]
    assert advisories(load_config({"upstream": UP}, env={})) == []  # the defaults: 30 s timeout, 60 s lease


def test_every_error_is_reported_at_once() -> None:
    errors = errors_of({"upstream": {"url": "nope", "timeout": "x"}, "listen": {"port": "y"}})
    assert len(errors) >= 3


def test_env_substitution_types_whole_values_and_keeps_defaults() -> None:
    env = {"PORT": "8181", "FORWARD": "false", "HOST": "10.0.0.9"}
    config = load_config(
        {"upstream": {"url": "http://${HOST}:9000", "forward_key": "${FORWARD}"},
         "listen": {"port": "${PORT}"}, "admin": {"token": "${TOKEN:-}"},
         "idempotency": {"ttl": "${TTL:-2h}"}},
        env=env,
    )
    assert config.upstream.url == "http://10.0.0.9:9000" and config.upstream.forward_key is False
    assert config.listen.port == 8181 and config.idempotency.ttl == 7200
    assert not config.admin.token


def test_a_default_stands_for_a_variable_unset_or_empty_as_in_the_shell() -> None:
    raw = {"upstream": {"url": "${UP:-http://127.0.0.1:9000}"}, "listen": {"port": "${PORT:-8181}"},
           "idempotency": {"header": "${HEADER}"}}
    for env in ({}, {"UP": "", "PORT": ""}):
        config = load_config(raw, env={**env, "HEADER": "Idem-Key"})
        assert config.upstream.url == "http://127.0.0.1:9000" and config.listen.port == 8181
    config = load_config(raw, env={"UP": "http://10.0.0.9:9000", "PORT": "9191", "HEADER": "Idem-Key"})
    assert config.upstream.url == "http://10.0.0.9:9000" and config.listen.port == 9191
    with pytest.raises(ConfigError, match=r"idempotency\.header: '' is not a valid HTTP token"):
        load_config(raw, env={"HEADER": ""})  # no default: set but empty is empty


def test_migrate_off_reads_as_yaml_writes_it_bare() -> None:
    raw = yaml.safe_load("upstream: {url: http://127.0.0.1:9000}\n"
                         "storage: {postgres: {dsn: postgresql://h/d, migrate: off}}\n")
    assert raw["storage"]["postgres"]["migrate"] is False  # YAML 1.1's reading of a bare off
    config = load_config(raw, env={})
    assert config.storage.postgres is not None and config.storage.postgres.migrate == "off"


def test_secrets_are_masked_in_repr_and_check_config(tmp_path: Path) -> None:
    raw = {
        "upstream": UP,
        "admin": {"token": "tok-SECRET"},
        "storage": {"postgres": {"dsn": "postgresql://app:pw-SECRET@db:5432/idem"},
                    "redis": {"url": "redis://:rpw-SECRET@cache:6379/0"}},
    }
    config = load_config(raw, env={})
    assert "SECRET" not in repr(config)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    assert "SECRET" not in result.stdout + result.stderr
    assert "postgresql://app:***@db:5432/idem" in result.stdout
    assert yaml.safe_load(result.stdout)["upstream"]["url"] == UP["url"]


def test_check_config_shows_the_client_pace_limits(tmp_path: Path) -> None:
    """listen.header_timeout, body_timeout, send_timeout and keepalive_timeout as in effect: given, or their
    defaults."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"upstream": UP, "listen": {"body_timeout": "90s", "send_timeout": "2m",
                                                               "keepalive_timeout": "75s"}}))
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    listen = yaml.safe_load(result.stdout)["listen"]
    assert (listen["header_timeout"], listen["body_timeout"], listen["send_timeout"],
            listen["keepalive_timeout"]) == (60, 90, 120, 75)


def test_passwords_given_as_query_parameters_are_masked_too(tmp_path: Path) -> None:
    raw = {
        "upstream": UP,
        "storage": {"postgres": {"dsn": "postgresql://app@db/idem?password=pw-SECRET&sslmode=disable"
                                        "&sslpassword=ssl-SECRET"},
                    "redis": {"url": "redis://default:rpw-SECRET@cache:6379/0?password=q-SECRET"}},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    assert "SECRET" not in result.stdout + result.stderr
    shown = yaml.safe_load(result.stdout)["storage"]
    assert shown["postgres"]["dsn"] == "postgresql://app@db/idem?password=***&sslmode=disable&sslpassword=***"
    assert shown["redis"]["url"] == "redis://default:***@cache:6379/0?password=***"
    assert "SECRET" not in repr(load_config(raw, env={}))


async def test_a_token_in_an_upstream_or_collector_url_is_masked_in_check_config_and_the_log(
    tmp_path: Path, proxy_process: Callable[..., ProxyProcess]
) -> None:
    """An API gateway's or a collector's ``?token=`` used to be shown whole: these URLs are plain strings, not
    secrets, so only the stores' URLs were masked. An upstream URL's query is refused now (it was never sent),
    and the refusal masks it too."""
    raw = {
        "upstream": {"url": "http://127.0.0.1:1/base?api_token=up-SECRET&region=eu"},
        "routes": [{"prefix": "/b", "upstream": {"url": "http://127.0.0.1:2/?token=route-SECRET"}}],
        "tracing": {"enabled": False, "exporter": "otlp", "endpoint": "http://otel:4318/v1/traces?token=otel-SECRET"},
        "storage": {"embedded": {"path": str(tmp_path / "s.sqlite3")}},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    refused = check_config(path)
    assert refused.returncode == 1 and "SECRET" not in refused.stdout + refused.stderr
    assert "upstream.url: 'http://127.0.0.1:1/base?api_token=***&region=eu' has a query" in refused.stderr
    assert "routes[0].upstream.url: 'http://127.0.0.1:2/?token=***' has a query" in refused.stderr
    raw["upstream"] = {"url": "http://127.0.0.1:1/base"}
    raw["routes"] = [{"prefix": "/b", "upstream": {"url": "http://127.0.0.1:2/"}}]
    path.write_text(yaml.safe_dump(raw))
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    assert "SECRET" not in result.stdout + result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["tracing"]["endpoint"] == "http://otel:4318/v1/traces?token=***"
    assert load_config(raw, env={}).tracing.endpoint.endswith("otel-SECRET")  # (masked when shown, never when used)
    raw["tracing"] = {"enabled": False, "exporter": "otlp",
                      "endpoint": "http://otel:4318/v1/traces?api_token=otel-SECRET"}
    proc = proxy_process(raw)
    await proc.start()
    proc.stop()
    log = proc.log_path.read_text()
    assert "serving on" in log and "api_token=***" in log and "SECRET" not in log


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"upstream": {"url": "http://127.0.0.1:99999"}},
         "upstream.url: 'http://127.0.0.1:99999' is not a valid URL (check the host and the port)"),
        ({"upstream": {"url": "http://api:abc"}}, "upstream.url: 'http://api:abc' is not a valid URL"),
        ({"upstream": {"url": "http://[::1"}}, "upstream.url: 'http://[::1' is not a valid URL"),
        ({"upstream": {"url": "http://api:0"}}, "upstream.url: 'http://api:0' has port 0"),
        ({"upstream": {"url": "http://api:1\n/x"}}, "upstream.url: 'http://api:1\\n/x' holds whitespace"),
        ({"upstream": {"url": "http://user:pw-SECRET@api:1"}},
         "upstream.url: 'http://user:***@api:1' holds credentials, which are never sent upstream"),
        ({"upstream": UP, "routes": [{"prefix": "/a", "upstream": {"url": "https://u:pw-SECRET@[::1"}}]},
         "routes[0].upstream.url: 'https://u:***@[::1' is not a valid URL"),
        ({"upstream": {"url": "ftp://u:pw-SECRET@api:1"}}, "upstream.url: 'ftp://u:***@api:1' is not an http(s) URL"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "host=db user=app password=pw-SECRET dbname=idem"}}},
         "storage.postgres.dsn: 'host=db user=app password=*** dbname=idem' is not a postgresql:// DSN"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "host=db password='pw SECRET' sslpassword=SECRET"}}},
         "storage.postgres.dsn: 'host=db password=*** sslpassword=***' is not a postgresql:// DSN"),
        ({"upstream": {"url": "${UNSET_UPSTREAM}"}}, "upstream.url: environment variable UNSET_UPSTREAM is not set"),
        ({"upstream": {"url": "ftp://api:1"}}, "upstream.url: 'ftp://api:1' is not an http(s) URL with a host"),
        ({"upstream": {"url": "http://u:pw#SECRET@api:1"}}, "upstream.url: 'http://u:***@api:1' is not a valid URL"),
        # the stores' URLs as well (they passed check-config, then `serve` died with "unexpected ValueError")
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://app:pw-SECRET@[::1:5432/idem"}}},
         "storage.postgres.dsn: 'postgresql://app:***@[::1:5432/idem' is not a valid URL"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://app:pw-SECRET@db:abc/idem"}}},
         "storage.postgres.dsn: 'postgresql://app:***@db:abc/idem' is not a valid URL"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://app@db1:5432,db2:99999/idem"}}},
         "storage.postgres.dsn: 'postgresql://app@db1:5432,db2:99999/idem' is not a valid URL"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://h/d"},
                                      "redis": {"url": "redis://:pw-SECRET@cache:99999/0"}}},
         "storage.redis.url: 'redis://:***@cache:99999/0' is not a valid URL"),
        # what the url may say depends on cluster (each passed check-config, then `serve` died with "unexpected")
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://h/d"},
                                      "redis": {"url": "redis://:pw-SECRET@c1:6379,c2:6379/0"}}},
         "storage.redis.url: 'redis://:***@c1:6379,c2:6379/0' names 2 hosts: only a Redis Cluster's url may"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://h/d"},
                                      "redis": {"url": "redis://:pw-SECRET@c1:6379/3", "cluster": True}}},
         "storage.redis.url: 'redis://:***@c1:6379/3': a Redis Cluster has database 0 only"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://h/d"},
                                      "redis": {"url": "redis://c1:6379/0?db=2", "cluster": True}}},
         "storage.redis.url: 'redis://c1:6379/0?db=2': a Redis Cluster has database 0 only"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://h/d"},
                                      "redis": {"url": "unix:///run/redis.sock", "cluster": True}}},
         "storage.redis.url: 'unix:///run/redis.sock': a Redis Cluster is not reached through a unix socket"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://h/d"},
                                      "redis": {"url": "redis://c1:6379,,c2:6379/0", "cluster": True}}},
         "storage.redis.url: 'redis://c1:6379,,c2:6379/0' has an empty host in its list of nodes"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://h/d"},
                                      "redis": {"url": "redis://:pw-SECRET@cache/0?db=zero"}}},
         "storage.redis.url: 'redis://:***@cache/0?db=zero': Invalid value for 'db' in connection URL"),
        ({"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://h/d"},
                                      "redis": {"url": "redis://cache/0?socket_timeout=soon"}}},
         "storage.redis.url: 'redis://cache/0?socket_timeout=soon': Invalid value for 'socket_timeout'"),
    ],
)
def test_a_bad_url_is_one_error_naming_the_key_and_no_secret(raw: dict[str, Any], expected: str) -> None:
    """Every bad URL is refused by check-config (not first at serve, as a port past 65535 was), once (an unset
    ${NAME} or a refused URL is not also reported as missing), and never shows a password."""
    errors = errors_of(raw)
    assert len(errors) == 1 and errors[0].startswith(expected), errors
    assert "SECRET" not in errors[0]


@pytest.mark.parametrize(
    "raw",
    [
        {"upstream": UP, "storage": {"postgres": "postgresql://app:pw-SECRET@db/app"}},
        {"upstream": UP, "storage": {"postgres": {"dsn": "postgresql://h/d"}, "redis": "redis://:pw-SECRET@c:6379"}},
        {"upstream": UP, "storage": {"encryption": "pw-SECRET"}},
        {"upstream": UP, "storage": "postgresql://app:pw-SECRET@db/app"},
        {"upstream": "http://u@api:1", "admin": "pw-SECRET"},
        {"upstream": UP, "routes": "pw-SECRET"},
        {"upstream": UP, "routes": ["pw-SECRET"]},
        "postgresql://app:pw-SECRET@db/app",
    ],
)
def test_a_value_where_a_section_is_due_is_refused_by_its_kind_never_shown(raw: Any) -> None:
    """A secret written one level too high (the DSN where `postgres: {dsn: ...}` is due) was echoed whole in the
    "is not a mapping" error, by check-config and at start (audit, 2026-11-27)."""
    errors = errors_of(raw)
    assert errors and all("SECRET" not in error for error in errors), errors
    assert any("a string, not a" in error for error in errors), errors


@pytest.mark.parametrize("raw", [
    {"upstream": UP, "storage": {"postgres": {"postgresql://app:pw-SECRET@db:5432/app": None}}},
    {"upstream": UP, "storage": {"postgresql://app:pw-SECRET@db:5432/app": None}},
    {"upstream": UP, "storage": {"redis": {"redis://:pw-SECRET@cache:6379/0": None},
                                 "postgres": {"dsn": "postgresql://db/app"}}},
    {"upstream": UP, "postgresql://app:pw-SECRET@db/app": None},
])
def test_a_value_written_as_a_key_is_not_echoed(raw: dict[str, Any]) -> None:
    """`postgres: {postgresql://app:pw@db/app}` (the `dsn: ` forgotten, in braces) makes the DSN a key, and an
    unknown key's path showed it whole (review, 2026-11-27): a key that is not a plain name is not shown."""
    errors = errors_of(raw)
    assert errors and all("SECRET" not in error for error in errors), errors
    assert any("a key that is not a name" in error for error in errors), errors


def test_several_postgresql_hosts_in_one_dsn_are_accepted() -> None:
    config = load_config({"upstream": UP, "storage": {"postgres": {
        "dsn": "postgresql://app:pw@db1:5432,db2,[::1]:5433/idem?target_session_attrs=read-write"}}})
    assert config.storage.postgres is not None


@pytest.mark.parametrize(
    ("url", "shown"),
    [("postgresql://u:pw/SECRET@db/idem", "postgresql://u:***@db/idem"),
     ("redis://u:pw?SECRET@cache:6379/0", "redis://u:***@cache:6379/0"),
     ("postgresql://u:pw#SECRET@db:5432/idem", "postgresql://u:***@db:5432/idem"),
     ("redis://cache:6379/0", "redis://cache:6379/0")],
)
def test_a_password_holding_url_delimiters_is_masked_too(url: str, shown: str) -> None:
    """urllib ends the authority at an unescaped / ? or #, and then finds no password at all."""
    assert SecretURL(url).masked() == shown


def test_an_unset_variable_is_the_one_error_of_its_key() -> None:
    errors = errors_of({"upstream": UP, "shutdown_timeout": "${NOPE1}", "storage": {"on_store_error": "${NOPE2}"},
                        "routes": [{"prefix": "${NOPE3}"}, {"prefix": "/a", "enabled": "${NOPE4}"}]})
    assert errors == [f"{path}: environment variable {name} is not set (use ${{{name}:-default}})" for path, name in (
        ("shutdown_timeout", "NOPE1"), ("storage.on_store_error", "NOPE2"), ("routes[0].prefix", "NOPE3"),
        ("routes[1].enabled", "NOPE4"))], errors


def test_an_upstream_url_from_the_environment_may_end_in_a_newline() -> None:
    config = load_config({"upstream": {"url": "${UP_URL}"}}, env={"UP_URL": "http://api:9000\n"})
    assert config.upstream.url == "http://api:9000"


def test_a_file_that_is_not_yaml_is_one_line_that_quotes_none_of_it(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text('upstream: {url: "http://x:1"\nadmin: {token: "tok-SECRET"}\n')
    result = check_config(path)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"idemproxy: invalid configuration: {path}: not valid YAML at line 2: expected ',' or '}}', but got '<scalar>'"]


def test_a_reference_stands_where_a_plain_word_may_in_a_flow_mapping_too(tmp_path: Path) -> None:
    # As the contract writes it: `admin: {..., token: ${IDEMPROXY_ADMIN_TOKEN:-}}`.
    path = tmp_path / "c.yaml"
    path.write_text("upstream: {url: http://127.0.0.1:9000, timeout: ${T:-10s}}\n"
                    "admin: {host: 127.0.0.1, port: 9090, token: ${IDEMPROXY_ADMIN_TOKEN:-}}  # comment ${NOPE}\n"
                    "tenant: {from: static, static: '${A}-x'}\n")
    config = load_config_file(path, env={"A": "t"})
    assert not config.admin.token and config.upstream.timeout == 10 and config.tenant.static == "t-x"
    # A value from the environment is never parsed as YAML: it cannot add keys or change the structure.
    config = load_config_file(path, env={"A": "t", "IDEMPROXY_ADMIN_TOKEN": "a}, port: 1, x: {", "T": "3s"})
    assert config.admin.token.reveal() == "a}, port: 1, x: {" and config.admin.port == 9090
    assert config.upstream.timeout == 3
    path.write_text("upstream: {url: http://h:1, timeout: ${T}}\n")
    with pytest.raises(ConfigError, match=r"upstream\.timeout: environment variable T is not set"):
        load_config_file(path, env={})


def test_check_config_prints_every_error_and_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("upstream: {url: http://x:1, timeout: soon}\nlisten: {port: -1}\n")
    result = check_config(path)
    assert result.returncode == 1
    assert "upstream.timeout: 'soon' is not a duration" in result.stderr
    assert "listen.port: -1 is out of range" in result.stderr


def test_unreadable_and_invalid_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config_file(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("upstream: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config_file(broken)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"upstream: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config_file(binary)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"upstream": {"url": "http://a:1"}, "listen": {"port": 1000}}))
    config = load_config_file(path, env={}, overrides={"upstream.url": "http://b:2", "listen.port": 2000})
    assert config.upstream.url == "http://b:2" and config.listen.port == 2000


# --------------------------------------------------------------------------- text YAML would retype


def from_yaml(text: str, env: dict[str, str] | None = None) -> Any:
    upstream = "" if "upstream:" in text else "upstream: {url: 'http://127.0.0.1:9000'}\n"
    return load_config(yaml.safe_load(upstream + text), env=env or {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tenant: {static: 0012345}", "tenant.static: 5349 is not a string: YAML read the unquoted value as a "
                                      "number; quote it"),
        ("tenant: {static: on}", "tenant.static: True is not a string: YAML read the unquoted value as a boolean; "
                                 "quote it"),
        ("tenant: {static: 1.50}", "tenant.static: 1.5 is not a string"),
        ("tenant: {static: 2024-01-02}", "YAML read the unquoted value as a date; quote it"),
        ("storage: {redis: {url: 'redis://r:6379/0', key_prefix: 007}, postgres: {dsn: 'postgresql://h/db'}}",
         "storage.redis.key_prefix: 7 is not a string"),
        ("listen: {host: 10}", "listen.host: 10 is not a string"),
        ("idempotency: {fingerprint_headers: [X-Account, 42]}",
         "idempotency.fingerprint_headers[1]: 42 is not a string"),
        ("storage: {embedded: {path: yes}}", "storage.embedded.path: True is not a string"),
    ],
)
def test_a_string_yaml_typed_as_a_number_or_boolean_is_refused_not_converted(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_yaml(text)
    assert any(expected in error for error in info.value.errors), info.value.errors


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("admin: {token: 0012345}", "admin.token"),
        ("admin: {token: 12_345}", "admin.token"),
        ("admin: {token: on}", "admin.token"),
        ("storage: {postgres: {dsn: 5432}}", "storage.postgres.dsn"),
        ("storage: {redis: {url: 6379}, postgres: {dsn: 'postgresql://h/db'}}", "storage.redis.url"),
    ],
)
def test_a_secret_yaml_typed_as_a_number_or_boolean_is_refused_without_showing_it(text: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_yaml(text)
    [error] = [e for e in info.value.errors if e.startswith(path)]
    assert "quote it" in error and "not shown" in error
    assert not any(digits in error for digits in ("5349", "12345", "5432", "6379", "True"))


def test_quoted_values_are_kept_as_written() -> None:
    config = from_yaml("admin: {token: '0012345'}\ntenant: {static: \"on\"}\nlog: {access: off}")
    assert config.admin.token.reveal() == "0012345" and config.tenant.static == "on"
    assert config.log.access == "OFF"  # unquoted off is YAML's false: the documented way to say off


@pytest.mark.parametrize("value", ["0012345", "on", "1e3", "12_345", "true", "5349", "0x1F", "~", "null"])
def test_a_whole_value_from_the_environment_stays_the_string_it_gave(value: str) -> None:
    config = from_yaml("admin: {token: '${TOKEN}'}\ntenant: {static: '${TENANT}'}",
                       env={"TOKEN": value, "TENANT": value})
    assert config.admin.token.reveal() == value and config.tenant.static == value


def test_typed_fields_still_read_their_type_from_environment_text() -> None:
    config = from_yaml(
        "listen: {port: '${PORT}'}\nupstream: {url: 'http://u:1', forward_key: '${FWD}', timeout: '${T}'}\n"
        "idempotency: {release_statuses: ['${S}'], required: '${REQ}', max_request_body: '${SIZE}'}",
        env={"PORT": "08080", "FWD": "off", "T": "1.5", "S": "429", "REQ": "yes", "SIZE": "2KiB"},
    )
    assert config.listen.port == 8080 and config.upstream.forward_key is False and config.upstream.timeout == 1.5
    idem = config.idempotency
    assert idem.release_statuses == (429,) and idem.required is True and idem.max_request_body == 2048


def test_a_list_may_be_one_environment_reference_read_as_items_separated_by_commas() -> None:
    """"Any value may be ${ENV_NAME}": a list too. The text is split on commas (in brackets or not), never read
    as YAML; each item is then checked as one written in the file would be."""
    config = from_yaml(
        "idempotency: {methods: '${METHODS}', release_statuses: '${STATUSES:-[408, 429]}', "
        "fingerprint_headers: '${FP:-}'}\nforwarded: {trusted_proxies: '${LB}'}\n"
        "routes: [{prefix: /v1, methods: '${METHODS}'}]",
        env={"METHODS": "post, PUT", "LB": "10.0.0.0/8,192.168.0.1/32"},
    )
    idem = config.idempotency
    assert idem.methods == ("POST", "PUT") and config.routes[0].idempotency.methods == ("POST", "PUT")
    assert idem.release_statuses == (408, 429) and idem.fingerprint_headers == ()
    assert [str(net) for net in config.forwarded.trusted_proxies] == ["10.0.0.0/8", "192.168.0.1/32"]
    bad = errors_of({"upstream": UP, "idempotency": {"release_statuses": "${S}", "methods": "x${M}"}},
                    env={"S": "408, soon", "M": "POST"})
    # an item is checked as one written in the file; a reference that is only part of the text is no list
    assert bad == ["idempotency.release_statuses[1]: 'soon' is not an integer",
                   "idempotency.methods: 'xPOST' is not a list"]
    assert errors_of({"upstream": UP, "idempotency": {"methods": "POST"}}) == [
        "idempotency.methods: 'POST' is not a list"]  # a plain word written in the file is still no list


def test_check_config_prints_values_given_as_one_environment_reference(tmp_path: Path) -> None:
    """A value that is one whole ``${NAME}`` reference (the container's own config, deploy/docker/config.yaml,
    is made of them) was kept as the list-reading text type, which check-config could not print: it exited 1 with
    "unexpected RepresenterError" for the image's default config (audit Q, 2026-11-27)."""
    path = tmp_path / "refs.yaml"
    path.write_text("upstream: {url: '${AUDITQ_UNSET_U:-http://127.0.0.1:9000}'}\n"
                    "tenant: {from: '${AUDITQ_UNSET_F:-static}', static: '${AUDITQ_UNSET_S:-t1}'}\n"
                    "idempotency: {header: '${AUDITQ_UNSET_H:-Idempotency-Key}', methods: '${AUDITQ_UNSET_M:-POST}'}\n"
                    "storage: {redis: {url: '${AUDITQ_UNSET_R:-redis://redis:6379/0}'},\n"
                    "          postgres: {dsn: '${AUDITQ_UNSET_P:-postgresql://u:pw@db/idem}'}}\n")
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["upstream"]["url"] == "http://127.0.0.1:9000" and printed["tenant"]["static"] == "t1"
    assert printed["storage"]["redis"]["url"] == "redis://redis:6379/0"
    assert printed["storage"]["postgres"]["dsn"] == "postgresql://u:***@db/idem"
    assert printed["idempotency"]["methods"] == ["POST"]
    image = check_config(Path(__file__).resolve().parent.parent / "deploy/docker/config.yaml")
    assert image.returncode == 0, image.stderr


STORE_KEY = "q83vEjRWeJq8/+7dzLuqmHZUMhBQzOEPzwpQJRfNq4A="  # base64 of 32 bytes


def test_compression_and_encryption_are_off_unless_configured() -> None:
    config = load_config({"upstream": UP}, env={})
    assert config.storage.compression is None and config.storage.encryption is None
    on = load_config({"upstream": UP, "storage": {"compression": {}, "encryption": {"key": STORE_KEY}}}, env={})
    assert on.storage.compression is not None and on.storage.compression.min_size == 1024
    assert on.storage.encryption is not None and on.storage.encryption.previous_keys == ()


@pytest.mark.parametrize(
    ("encryption", "env", "expected"),
    [
        ({}, {}, "storage.encryption.key: is required"),
        ({"key": "${IDEMPROXY_STORE_KEY}"}, {}, "storage.encryption.key: environment variable IDEMPROXY_STORE_KEY"),
        ({"key": "${IDEMPROXY_STORE_KEY}"}, {"IDEMPROXY_STORE_KEY": "not base64!"},
         "storage.encryption.key: the value (a secret, not shown) is not valid base64"),
        ({"key": "${K}"}, {"K": "c2hvcnQ="}, "storage.encryption.key: decodes to 5 bytes, not 32"),
        ({"key": STORE_KEY, "previous_keys": [STORE_KEY, "c2hvcnQ="]}, {},
         "storage.encryption.previous_keys[1]: decodes to 5 bytes, not 32"),
        ({"key": STORE_KEY, "previous_keys": STORE_KEY}, {}, "storage.encryption.previous_keys: is not a list"),
        ({"key": STORE_KEY, "rotate": True}, {}, "storage.encryption.rotate: unknown key"),
    ],
)
def test_encryption_key_errors_name_the_key_path_never_the_key(
    encryption: dict[str, Any], env: dict[str, str], expected: str
) -> None:
    errors = errors_of({"upstream": UP, "storage": {"encryption": encryption}}, env=env)
    assert any(expected in error for error in errors), errors
    assert not any("not base64!" in error or "c2hvcnQ" in error for error in errors)


def test_compression_errors_name_the_key_path() -> None:
    errors = errors_of({"upstream": UP, "storage": {"compression": {"min_size": "big", "level": 40}}})
    assert any("storage.compression.min_size: 'big' is not a size" in e for e in errors), errors
    assert any("storage.compression.level: 40 is out of range" in e for e in errors), errors


def test_store_keys_are_masked_in_check_config(tmp_path: Path) -> None:
    previous = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"upstream": UP, "storage": {
        "encryption": {"key": "${IDEMPROXY_STORE_KEY}", "previous_keys": [previous]}}}))
    result = subprocess.run([sys.executable, "-m", "idemproxy", "check-config", str(path)], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "IDEMPROXY_STORE_KEY": STORE_KEY})
    assert result.returncode == 0, result.stderr
    assert STORE_KEY not in result.stdout and previous not in result.stdout
    assert yaml.safe_load(result.stdout)["storage"]["encryption"] == {"key": "***", "previous_keys": ["***"]}


def test_tracing_is_off_by_default_and_configurable() -> None:
    assert load_config({"upstream": UP}, env={}).tracing.enabled is False
    tracing = load_config({"upstream": UP, "tracing": {
        "enabled": True, "service_name": "pay-proxy", "exporter": "otlp", "endpoint": "http://otel:4318/v1/traces",
    }}, env={}).tracing
    assert (tracing.enabled, tracing.service_name, tracing.exporter) == (True, "pay-proxy", "otlp")
    assert tracing.endpoint == "http://otel:4318/v1/traces"
    unset = load_config({"upstream": UP, "tracing": {"endpoint": "${OTEL_URL:-}"}}, env={}).tracing
    assert unset.endpoint == ""  # the exporter's own default


@pytest.mark.parametrize(
    ("tracing", "expected"),
    [
        ({"enabled": True, "sampler": "always"}, "tracing.sampler: unknown key"),
        ({"exporter": "jaeger"}, "tracing.exporter: 'jaeger' is not one of otlp, console, none"),
        ({"enabled": "maybe"}, "tracing.enabled: 'maybe' is not a boolean"),
        ({"endpoint": "otel:4318"}, "tracing.endpoint: 'otel:4318' is not an http(s) URL"),
        ({"exporter": "console", "endpoint": "http://otel:4318"},
         "tracing.endpoint: is only used with exporter: otlp (not console)"),
        # a collector's credentials go in OTEL_EXPORTER_OTLP_HEADERS (docs/operating.md); the collector is no
        # "upstream" and the client's headers have nothing to do with it (the upstream URL's message said so)
        ({"endpoint": "https://u:pw@otel:4318/v1/traces"},
         "tracing.endpoint: 'https://u:***@otel:4318/v1/traces' holds credentials: give the collector's in "
         "OTEL_EXPORTER_OTLP_HEADERS"),
    ],
)
def test_tracing_errors_name_the_key(tracing: dict[str, Any], expected: str) -> None:
    assert any(expected in error for error in errors_of({"upstream": UP, "tracing": tracing}))


@pytest.mark.parametrize(
    ("path", "expected"),
    [("//v1/charges", "/v1/charges"), ("/v1/./charges/", "/v1/charges/"), ("/v1/x/../charges", "/v1/charges"),
     ("/../v1", "/v1"), ("/v1/..", "/"), ("/a/b/..", "/a/"), ("//", "/"), ("/", "/")],
)
def test_a_path_is_normalised_as_an_upstream_would(path: str, expected: str) -> None:
    assert normalised_path(path) == expected
    config = load_config({"upstream": UP, "routes": [{"prefix": "/v1/charges/", "ttl": "1h"}]}, env={})
    if path.startswith("/v1/charges/") == expected.startswith("/v1/charges/"):
        assert (config.route_for(path) is not None) == expected.startswith("/v1/charges/")
    else:
        with pytest.raises(AmbiguousPath):
            config.route_for(path)


def test_every_bad_item_of_a_list_is_named() -> None:
    errors = errors_of({"upstream": UP, "idempotency": {"release_statuses": [408, "x", 99, 503],
                                                        "methods": ["POST", "a b"]},
                        "forwarded": {"trusted_proxies": ["10.0.0.0/8", "nope", "300.1.1.1"]}})
    assert errors == [
        "idempotency.release_statuses[1]: 'x' is not an integer",
        "idempotency.release_statuses[2]: 99 is out of range (100..599)",
        "idempotency.methods[1]: 'a b' is not a valid HTTP token",
        "forwarded.trusted_proxies[1]: 'nope' is not an IP address or CIDR network",
        "forwarded.trusted_proxies[2]: '300.1.1.1' is not an IP address or CIDR network",
    ], errors


@pytest.mark.parametrize("name", ["Connection", "te", "Transfer-Encoding", "Expect", "Proxy-Authorization"])
def test_a_fingerprint_header_that_never_reaches_the_upstream_is_refused(name: str) -> None:
    """What is hashed is what is forwarded: a header this hop drops cannot tell two requests apart upstream."""
    with pytest.raises(ConfigError) as info:
        from_yaml(f"routes: [{{prefix: /v1, fingerprint_headers: [X-Account, {name}]}}]")
    assert any(error.startswith("routes[0].fingerprint_headers[1]: ") and "never reaches the upstream" in error
               for error in info.value.errors), info.value.errors
    assert from_yaml("idempotency: {fingerprint_headers: [X-Account, Host]}").idempotency.fingerprint_headers == (
        "X-Account", "Host")


@pytest.mark.parametrize(("section", "expected"), [
    ("idempotency: {fingerprint_headers: [X-Forwarded-For]}",
     "idempotency.fingerprint_headers[0]: 'X-Forwarded-For' is written by this hop for each attempt"),
    ("routes: [{prefix: /v1, fingerprint_headers: [X-Account, traceparent]}]",
     "routes[0].fingerprint_headers[1]: 'traceparent' is written by this hop for each attempt"),
    ("idempotency: {fingerprint_headers: [x-request-id]}",
     "idempotency.fingerprint_headers: 'X-Request-Id' is request_id.header"),
    ("request_id: {header: X-Trace}\nroutes: [{prefix: /v1, fingerprint_headers: [X-TRACE]}]",
     "routes[0].fingerprint_headers: 'X-Trace' is request_id.header"),
])
def test_a_fingerprint_header_this_hop_writes_for_each_attempt_is_refused(section: str, expected: str) -> None:
    """Hashed, a header this hop writes anew for every attempt (the peer's address appended, the trace, the
    request id it makes when the client's is missing or malformed) would make every retry a 422."""
    with pytest.raises(ConfigError) as info:
        from_yaml(section)
    assert any(error.startswith(expected) for error in info.value.errors), info.value.errors


@pytest.mark.parametrize("url", ["http://api.internal:9000/v1?key=x", "http://api.internal/base#frag",
                                 "http://api.internal/?"])
def test_an_upstream_url_with_a_query_or_a_fragment_is_refused_not_dropped(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_yaml(f"upstream: {{url: '{url}'}}\nroutes: [{{prefix: /a, upstream: {{url: '{url}'}}}}]")
    assert any(error.startswith("upstream.url: ") and "query or a fragment" in error for error in info.value.errors)
    assert any(error.startswith("routes[0].upstream.url: ") for error in info.value.errors), info.value.errors
    assert from_yaml("upstream: {url: 'http://api.internal:9000/base/'}").upstream.url == "http://api.internal:9000/base"


def test_the_effective_config_check_config_prints_reads_back_as_the_same_config(tmp_path: Path) -> None:
    """What check-config prints is the effective config: given back to it, it is the same config. A section that is
    off (no PostgreSQL, no Redis, no compression, no encryption) was printed as ``null``, which the loader reads as
    the section on with its defaults: the embedded store's printout read back as Redis and PostgreSQL at their
    default URLs, compression on and encryption without a key (exit 1)."""
    first = tmp_path / "first.yaml"
    first.write_text("upstream: {url: http://127.0.0.1:9000}\n"
                     "routes: [{prefix: /v1/charges, required: true, upstream: {url: 'http://127.0.0.1:9100'}}]\n")
    printed = check_config(first)
    assert printed.returncode == 0, printed.stderr
    again = tmp_path / "again.yaml"
    again.write_text(printed.stdout)
    reread = check_config(again)
    assert reread.returncode == 0, reread.stderr
    assert reread.stdout == printed.stdout
    assert load_config_file(again, env={}) == load_config_file(first, env={})
    with_stores = tmp_path / "stores.yaml"
    with_stores.write_text("upstream: {url: http://127.0.0.1:9000}\n"
                           "storage: {postgres: {dsn: 'postgresql://db/idem'}, compression: {min_size: 2KiB}}\n")
    printed = check_config(with_stores)
    assert printed.returncode == 0, printed.stderr
    again.write_text(printed.stdout)
    assert load_config_file(again, env={}) == load_config_file(with_stores, env={})


def test_the_admin_port_cannot_be_the_proxy_port(tmp_path: Path) -> None:
    """check-config passed admin.port equal to listen.port. `serve` then failed with "address already in use" (its
    own admin port), and with --workers (SO_REUSEPORT) it started: the proxy and the admin API shared the port,
    the kernel handing each connection to one or the other (502s on /healthz, the admin API on the proxy port)."""
    path = tmp_path / "same.yaml"
    path.write_text("upstream: {url: http://127.0.0.1:9000}\nlisten: {port: 8080}\nadmin: {port: 8080}\n")
    result = check_config(path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "idemproxy: invalid configuration: admin.port: 8080 is listen.port too (on an address both listen on): "
        "the proxy and its admin API need ports of their own"]
    for listen, admin in (({"host": "127.0.0.1", "port": 8080}, {"host": "127.0.0.1", "port": 8080}),
                          ({"host": "::", "port": 8080}, {"host": "127.0.0.1", "port": 8080})):
        assert [e.partition(":")[0] for e in errors_of({"upstream": UP, "listen": listen, "admin": admin})] == [
            "admin.port"]
    # two addresses of their own, or ports the system picks, are fine
    load_config({"upstream": UP, "listen": {"host": "10.0.0.5", "port": 8080},
                 "admin": {"host": "127.0.0.1", "port": 8080}}, env={})
    load_config({"upstream": UP, "listen": {"port": 0}, "admin": {"port": 0}}, env={})



@pytest.mark.parametrize(("listen", "admin"), [
    ("localhost", "127.0.0.1"), ("::1", "LOCALHOST"), ("127.1", "127.0.0.1"), ("0x7f.0.0.1", "127.0.0.1"),
    ("127.000.000.001", "127.0.0.1"), ("0:0::1", "::1"), ("0", "10.0.0.5"), ("0:0::0", "::1"),
])
def test_the_admin_port_cannot_be_the_proxy_port_under_another_spelling(listen: str, admin: str) -> None:
    """check-config compared listen.host and admin.host as written: `localhost` and `127.0.0.1` (or `127.1`, the
    resolver's short form; or `0`, the wildcard) passed, and `serve` then failed with "address already in use" on
    its own admin port (with --workers, the two shared it). Names are compared without a resolver: `localhost` is
    the loopback addresses, an address is read as the system's resolver reads it, and `0`, `0:0::0` are wildcards."""
    raw = {"upstream": UP, "listen": {"host": listen, "port": 8080}, "admin": {"host": admin, "port": 8080}}
    [error] = errors_of(raw)
    assert error.startswith("admin.port: 8080 is listen.port too (on an address both listen on"), error
    if "0" not in (listen, admin) and "0:0::0" not in (listen, admin):
        assert f"{admin} and {listen} are one address" in error, error
    # other addresses, or other names (which only a resolver could compare: `serve` compares them as bound)
    for other in (("127.0.0.2", "127.0.0.1"), ("::ffff:127.0.0.1", "127.0.0.1"), ("api.internal", "127.0.0.1"),
                  ("2001:db8::1", "::1")):
        load_config({"upstream": UP, "listen": {"host": other[0], "port": 8080},
                     "admin": {"host": other[1], "port": 8080}}, env={})
    # a host refused is one error, not a collision of its default (0.0.0.0) besides
    assert errors_of({"upstream": UP, "listen": {"host": 127.1, "port": 8080}, "admin": {"port": 8080}}) == [
        "listen.host: 127.1 is not a string: YAML read the unquoted value as a number; quote it"]

@pytest.mark.parametrize(("raw", "path"), [
    ({"upstream": "http://api:9000"}, "upstream"),
    ({"upstream": UP, "routes": [{"prefix": "/v1/payouts", "upstream": "http://payouts:9000"}]}, "routes[0].upstream"),
    ({"upstream": UP, "routes": [{"prefix": "/v1/payouts", "upstream": ["http://payouts:9000"]}]},
     "routes[0].upstream"),
])
def test_an_upstream_written_as_its_url_is_one_error(raw: dict[str, Any], path: str) -> None:
    """`upstream: http://api:9000` (the `url:` forgotten) was two errors, "not a mapping" and "url is required",
    for one mistake (review of routes[].upstream, 2026-11-27)."""
    errors = errors_of(raw)
    assert len(errors) == 1 and errors[0].startswith(f"{path}: a "), errors
    assert "not a mapping" in errors[0]
    # a section that is a mapping keeps both its errors: a bad field and the url missing are two mistakes
    assert errors_of({"upstream": {"timeout": "soon"}}) == [
        "upstream.timeout: 'soon' is not a duration (use e.g. 500ms, 30s, 24h)",
        "upstream.url: is required (the API to put idempotency in front of)"]


@pytest.mark.parametrize(("prefix", "decoded"), [("/v1/caf%C3%A9", "/v1/café"), ("/v1/a%20b", "/v1/a b"),
                                                 ("/v1/x%2Fy", "/v1/x/y")])
def test_a_prefix_written_percent_encoded_is_refused(prefix: str, decoded: str) -> None:
    """Routes match the decoded path (``/v1/%63harges`` falls under /v1/charges), so a prefix written as a path is
    sent, percent-encoded, matched nothing: a `required` route never applied, silently (audit, 2026-11-27)."""
    assert errors_of({"upstream": UP, "routes": [{"prefix": prefix, "required": True}]}) == [
        f"routes[0].prefix: {prefix!r} is matched against the decoded path (%-escapes read as the characters they "
        f"stand for): write it decoded ({decoded!r})"]
    route = load_config({"upstream": UP, "routes": [{"prefix": decoded, "required": True}]}, env={}).routes[0]
    assert route.prefix == decoded


def test_a_prefix_whose_escapes_stay_in_the_decoded_path_is_taken() -> None:
    """An escape that is no UTF-8 (``%E9``, a Latin-1 path) stays in the path routes match (aiohttp's
    ``request.path`` leaves it as written), so a prefix holding one matches as written: refusing it as "not decoded"
    and naming ``'/legacy/caf\ufffd'``, which no path holds, broke a route that had served (review, 2026-11-27)."""
    config = load_config({"upstream": UP, "routes": [{"prefix": "/legacy/caf%E9", "enabled": False}]}, env={})
    assert config.routes[0].prefix == "/legacy/caf%E9"
    assert config.route_for(URL.build(path="/legacy/caf%E9/x", encoded=True).path) is config.routes[0]
    # what the request path decodes is still refused, the error naming the prefix as that path holds it
    assert errors_of({"upstream": UP, "routes": [{"prefix": "/v1/caf%C3%A9/%E9"}]}) == [
        "routes[0].prefix: '/v1/caf%C3%A9/%E9' is matched against the decoded path (%-escapes read as the "
        "characters they stand for): write it decoded ('/v1/café/%E9')"]


@pytest.mark.parametrize("prefix", ["/v1//charges", "/v1/./charges", "/v1/x/../charges", "/v1/charges/.",
                                    "/v1;v=2/charges", "/v1\\charges"])
def test_a_prefix_no_path_could_reach_unambiguously_is_refused(prefix: str) -> None:
    """A path under a prefix with a repeated slash, a dot segment, a ``;`` parameter or a backslash reads as another
    route once an upstream resolves it (``Config.route_for``), so every request under it was refused with 400
    ``bad_request``, a route that could never serve (audit, 2026-11-27)."""
    errors = errors_of({"upstream": UP, "routes": [{"prefix": prefix, "required": True}]})
    assert len(errors) == 1 and errors[0].startswith(f"routes[0].prefix: {prefix!r} "), errors
    assert "every request under it" in errors[0]
    for fine in ("/.well-known/", "/v1/charges..x", "/v1/charges/"):  # no such segment: taken
        config = load_config({"upstream": UP, "routes": [{"prefix": fine, "required": True}]}, env={})
        assert config.route_for(fine + "x") is config.routes[0]


def test_a_key_given_twice_is_refused_naming_its_path_not_silently_dropped(tmp_path: Path) -> None:
    # YAML keeps the last of two equal keys without a word: a second `idempotency:` block would silently undo the
    # first one's ttl, a second `lease:` the first. Each key given twice is named by its path and its lines.
    path = tmp_path / "c.yaml"
    path.write_text("upstream: {url: http://127.0.0.1:9000}\n"
                    "idempotency:\n  ttl: 72h\n  lease: 90s\n  lease: 40s\n"
                    "routes:\n  - {prefix: /v1/charges, required: true, required: false}\n"
                    "idempotency: {in_flight: wait}\n")
    result = check_config(path)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "idemproxy: invalid configuration: idempotency: given twice (lines 2 and 8); YAML would keep only the "
        "last: write it once",
        "idemproxy: invalid configuration: idempotency.lease: given twice (lines 4 and 5); YAML would keep only "
        "the last: write it once",
        "idemproxy: invalid configuration: routes[0].required: given twice (lines 7 and 7); YAML would keep only "
        "the last: write it once",
    ]
    # A merge key's keys may still be overridden (that is what `<<` is for), and an alias is no repetition.
    path.write_text("upstream: &up {url: http://127.0.0.1:9000, timeout: 10s}\n"
                    "idempotency: &idem {ttl: 1h, lease: 30s}\n"
                    "routes:\n  - {prefix: /a, <<: *idem, ttl: 2h}\n  - {prefix: /b, upstream: *up}\n")
    config = load_config_file(path, env={})
    assert config.routes[0].idempotency.ttl == 7200 and config.routes[0].idempotency.lease == 30
    assert config.routes[1].upstream is not None and config.routes[1].upstream.timeout == 10


@pytest.mark.parametrize("text", ["rec: &a [1, *a]\n", "idempotency: &i {ttl: 5s, x: *i}\n",
                                  "x: " + "[" * 3000 + "]" * 3000 + "\n"])
def test_a_value_holding_itself_or_nested_too_deeply_is_one_line_naming_the_file(text: str, tmp_path: Path
                                                                                   ) -> None:
    # An alias inside the value it names is valid YAML, and a value that holds itself (or 3000 brackets deep)
    # ran the loader out of stack: "unexpected RecursionError", naming neither the file nor what to fix.
    path = tmp_path / "c.yaml"
    path.write_text("upstream: {url: http://127.0.0.1:9000}\n" + text)
    result = check_config(path)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"idemproxy: invalid configuration: {path}: a value is nested too deeply, or holds itself through an alias "
        "(`*name` inside the value anchored `&name`): write it out"]


@pytest.mark.parametrize("name", ["Content-Length", "Transfer-Encoding", "connection", "Keep-Alive"])
@pytest.mark.parametrize("section", ["idempotency.replay_header", "routes[0].replay_header", "request_id.header"])
def test_a_header_the_proxy_writes_into_responses_cannot_be_a_framing_header(section: str, name: str) -> None:
    # The proxy writes replay_header ("true"/"false") and request_id.header (the id, taken from the request) into
    # every response: named Content-Length, the response's framing was replaced (an unhandled exception and an
    # empty reply; with request_id.header the request's own length framed a longer answer, whose rest was read as
    # the next response); named Transfer-Encoding, the answer had two framings. Refused, naming the key.
    raw: dict[str, Any] = {"upstream": UP, "routes": [{"prefix": "/a"}]}
    key, _, field = section.rpartition(".")
    if key == "routes[0]":
        raw["routes"][0][field] = name
    else:
        raw[key] = {field: name}
    assert errors_of(raw) == [f"{section}: {name!r} frames the HTTP message (this hop writes it): name another "
                              "header"]


@pytest.mark.parametrize("name", ["Host", "Content-Type", "content-encoding", "Date", "Server", "Set-Cookie",
                                  "X-Forwarded-For", "traceparent", "Location", "Retry-After", "X-Forwarded-Prefix",
                                  "X-Forwarded-Port", "x-forwarded-ssl", "X_Forwarded_Host", "X-Real-IP",
                                  "X-Original-URL", "X-Rewrite-URL"])
@pytest.mark.parametrize("section", ["idempotency.replay_header", "request_id.header"])
def test_a_header_the_proxy_writes_into_responses_cannot_be_one_with_a_meaning_of_its_own(section: str,
                                                                                         name: str) -> None:
    # Named Host, the request id reached no upstream (Host names it) and every answer carried a Host header; named
    # Content-Type, the id (or "true") replaced the upstream's content type in every answer. And a well-formed
    # incoming request id is kept and sent upstream under request_id.header, after the headers only a proxy may
    # write (the X-Forwarded-* family, X-Real-IP, X-Original-URL...) were dropped from the client's: named
    # X-Forwarded-Prefix or X-Real-IP, the id header let any client write them (a prefix the upstream builds its
    # redirects from, the address it rate-limits by). Refused, naming the key.
    key, _, field = section.rpartition(".")
    assert errors_of({"upstream": UP, key: {field: name}}) == [
        f"{section}: {name!r} has a meaning of its own in requests or answers, which this header would replace: "
        "name another header"]


def test_the_replay_header_cannot_be_the_request_id_header() -> None:
    # Both written into every response: the request id overwrote the replay marker, which silently vanished.
    assert errors_of({"upstream": UP, "idempotency": {"replay_header": "X-Request-Id"}}) == [
        "idempotency.replay_header: 'X-Request-Id' is request_id.header too: each would overwrite the other in "
        "every response"]
    assert errors_of({"upstream": UP, "request_id": {"header": "x-idem"},
                      "routes": [{"prefix": "/a", "replay_header": "X-Idem"}]}) == [
        "routes[0].replay_header: 'X-Idem' is request_id.header too: each would overwrite the other in every "
        "response"]
    # A route that inherits the defaults' replay_header shares its one error.
    assert errors_of({"upstream": UP, "idempotency": {"replay_header": "X-Request-Id"},
                      "routes": [{"prefix": "/a"}]}) == [
        "idempotency.replay_header: 'X-Request-Id' is request_id.header too: each would overwrite the other in "
        "every response"]


@pytest.mark.parametrize(("raw", "error"), [
    ({"request_id": {"header": "authorization"}},
     "request_id.header: 'authorization' carries a credential (tenant.header, Authorization or Cookie)"),
    ({"request_id": {"header": "X-Api-Key"}, "tenant": {"header": "x-api-key"}},
     "request_id.header: 'X-Api-Key' carries a credential (tenant.header, Authorization or Cookie)"),
    ({"request_id": {"header": "Authorization"}, "tenant": {"from": "static"}},
     "request_id.header: 'Authorization' carries a credential (tenant.header, Authorization or Cookie)"),
    ({"request_id": {"header": "Cookie"}},
     "request_id.header: 'Cookie' carries a credential (tenant.header, Authorization or Cookie)"),
    ({"request_id": {"header": "idempotency-key"}},
     "request_id.header: 'idempotency-key' is idempotency.header (the idempotency key)"),
    ({"request_id": {"header": "X-Route-Key"}, "routes": [{"prefix": "/a", "header": "x-route-key"}]},
     "request_id.header: 'X-Route-Key' is routes[0].header (the idempotency key)"),
])
def test_the_request_id_header_cannot_carry_the_tenant_credential_or_the_key(raw: dict[str, Any], error: str) -> None:
    # The request id is echoed in every response, written to the access log, and replaced upstream by this hop's
    # own id when malformed. Named Authorization (the tenant header), a credential with no space (sk_live_...) came
    # back in every response and stood in clear in the access log; "Bearer ..." (a space: malformed as an id)
    # reached the upstream as a random id. Named the key header, the raw key stood in the access log. Refused.
    errors = errors_of({"upstream": UP, **raw})
    assert [e.split(":")[0] for e in errors] == ["request_id.header"]
    assert errors[0].startswith(error)
    assert errors[0].endswith("; name another header")


def test_a_request_id_header_that_is_only_another_tenant_header_name_is_kept() -> None:
    # With the tenant named by X-Api-Key, X-Request-Id (the default) and a static tenant's unused header pass.
    assert load_config({"upstream": UP, "tenant": {"header": "X-Api-Key"}}, env={}).request_id.header == "X-Request-Id"
    assert load_config({"upstream": UP, "tenant": {"from": "static", "header": "X-Tenant"},
                        "request_id": {"header": "X-Tenant"}}, env={}).request_id.header == "X-Tenant"


@pytest.mark.parametrize("name", ["api_key", "apikey", "x-api-key", "key", "auth", "Authorization",
                                  "credential", "signature"])
def test_an_api_key_in_a_collector_url_is_masked_like_a_token(name: str, tmp_path: Path) -> None:
    # `?token=` and `?api_token=` were masked, but a collector's `?api_key=` (or `apikey`, `auth`) was printed whole
    # by check-config and in the start-up line.
    raw = {"upstream": UP, "tracing": {"endpoint": f"https://otel.example:4318/v1/traces?{name}=k-SECRET&region=eu"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["tracing"]["endpoint"] == (
        f"https://otel.example:4318/v1/traces?{name}=***&region=eu")



@pytest.mark.parametrize(("section", "written", "expected"), [
    ("storage.redis", "storage:\n  postgres: {dsn: 'postgresql://db/idem'}\n  redis:\n    # url: redis://cache:6379/0\n",
     "storage.redis: has no value (is every key under it commented out?): give its url, or remove storage.redis "
     "to run without Redis"),
    ("storage.postgres", "storage:\n  postgres:\n    # dsn: postgresql://db/idem\n",
     "storage.postgres: has no value (is every key under it commented out?): give its dsn, or remove "
     "storage.postgres for the embedded store"),
    ("storage.compression", "storage:\n  compression:\n    # min_size: 4KiB\n",
     "storage.compression: has no value (is every key under it commented out?): write `compression: {}` for its "
     "defaults, or remove it to store responses as they are"),
    ("routes[0].upstream", "routes:\n  - prefix: /v1/payouts\n    upstream:\n      # url: http://payouts:9000\n",
     "routes[0].upstream: has no value (is every key under it commented out?): give its url, or remove "
     "routes[0].upstream for the top-level upstream"),
    ("storage.compression", "storage: {compression: false}\n",
     "storage.compression: a boolean, not a mapping (the value is not shown)"),
    ("storage.redis", "storage: {postgres: {dsn: 'postgresql://db/idem'}, redis: '${REDIS_URL:-}'}\n",
     "storage.redis: a string, not a mapping (the value is not shown)"),
])
def test_a_section_that_turns_something_on_is_refused_with_no_value(
    tmp_path: Path, section: str, written: str, expected: str
) -> None:
    """Written with nothing under it (every key commented out: YAML's null), storage.redis was Redis at
    127.0.0.1:6379, storage.postgres a PostgreSQL on localhost, a route's upstream the top-level one (its requests
    sent to the API of other routes); `compression: false` (or `redis: ""`) turned compression (Redis) on."""
    path = tmp_path / "c.yaml"
    path.write_text("upstream: {url: http://127.0.0.1:9000}\n" + written)
    with pytest.raises(ConfigError) as refused:
        load_config_file(path, env={})
    assert refused.value.errors == [expected]
    # `{}` is still the section with its defaults, as config.example.yaml says
    on = load_config({"upstream": UP, "storage": {"postgres": {}, "redis": {}, "compression": {}}}, env={})
    assert on.storage.redis is not None and on.storage.postgres is not None and on.storage.compression is not None



async def test_max_request_body_0_is_a_route_whose_keyed_requests_carry_no_body(
    make_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """What config.example.yaml says of `max_request_body: 0`: a keyed request may carry no body (any body is 413,
    never forwarded), for endpoints that take none; it is not "no limit" (as nginx's client_max_body_size 0 is)."""
    proxy = await make_proxy("embedded", routes=[{"prefix": "/v1/captures", "max_request_body": 0}])
    resp, body = await proxy.post("/v1/captures", key="c-1", body={"amount": 1})
    assert resp.status == 413 and json.loads(body)["code"] == "body_too_large"
    resp, _ = await proxy.post("/v1/captures", key="c-2")
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "false"
    resp, _ = await proxy.post("/v1/charges", key="c-3", body={"amount": 1})  # (the other routes: 1 MiB)
    assert resp.status == 201
    assert [e.headers["Idempotency-Key"] for e in upstream.executed] == ["c-2", "c-3"]


# Imported by Python at start from the first sys.path entry that has it: OpenTelemetry as if never installed.
_WITHOUT_OTEL = """
import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
"""


@pytest.mark.parametrize("exporter", ["otlp", "console", "none"])
def test_check_config_refuses_tracing_enabled_without_opentelemetry_as_serve_does(
    tmp_path: Path, exporter: str
) -> None:
    """`check-config` passed `tracing.enabled: true` without the otel extra installed, and `serve` then refused to
    start on it: a config checked in CI failed at the deploy."""
    (tmp_path / "sitecustomize.py").write_text(_WITHOUT_OTEL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parent.parent)])}
    config = tmp_path / "c.yaml"
    said = []
    for command in (["check-config", str(config)], ["serve", "--config", str(config)]):
        for enabled in ("true", "false"):
            config.write_text(f"upstream: {{url: http://127.0.0.1:9000}}\n"
                              f"tracing: {{enabled: {enabled}, exporter: {exporter}}}\n")
            if enabled == "false" and command[0] == "serve":
                continue  # (it would serve)
            result = subprocess.run([sys.executable, "-m", "idemproxy", *command], capture_output=True, text=True,
                                    timeout=60, env=env, cwd=tmp_path)
            if enabled == "false":  # off: nothing of OpenTelemetry is needed
                assert result.returncode == 0 and result.stderr == "", result
                continue
            assert result.returncode == 1 and result.stdout == "", result
            said.append(result.stderr)
    assert said[0] == said[1] == ("idemproxy: tracing.enabled needs OpenTelemetry, which is not installed "
                                  "(opentelemetry): pip install 'idemproxy[otel]'\n")
