"""Command line: parse, load config, set up logging, run."""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import json
import logging
import os
import secrets
import signal
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from email.message import Message
from typing import Any, NoReturn

from idemproxy import __version__
from idemproxy.config import (
    KEY_MAX_LENGTH_LIMIT,
    STORE_KEY_BYTES,
    Config,
    ConfigError,
    TenantConfig,
    advisories,
    dump_yaml,
    load_config_file,
)
from idemproxy.logs import setup_logging
from idemproxy.problems import InvalidKey, MissingTenant, StoreUnavailable
from idemproxy.tracing import TracingUnavailable, require

log = logging.getLogger("idemproxy")


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (the contract: every error of the CLI is one line), not the
    usage block argparse prints before it. Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see: {self.prog} --help)\n")


# What TENANT is: the access log's `tenant` is the id, except with tenant.hash: false, where the id is the raw value
# and the log shows only a hash of it (docs/operating.md, Logs).
TENANT_IS = "the access log's tenant, or with tenant.hash: false the raw value, of which the log shows only a hash"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="idemproxy", description="Idempotency-Key semantics in front of any HTTP API."
    )
    parser.add_argument("--version", action="version", version=f"idemproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", type=_config_path, help="YAML config file (default: built-in defaults)")
    serve.add_argument("--upstream", help="upstream URL (overrides upstream.url)")
    serve.add_argument("--port", type=int, help="proxy port (overrides listen.port)")
    serve.add_argument("--admin-port", type=int, help="admin port (overrides admin.port)")
    serve.add_argument("--workers", type=int, help="worker processes sharing the port (SO_REUSEPORT)")
    serve.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)

    check = sub.add_parser("check-config", help="validate a config file and print it, secrets masked")
    check.add_argument("file", type=_config_path)

    migrate = sub.add_parser("migrate", help="create or upgrade the PostgreSQL schema")
    migrate.add_argument("--config", type=_config_path, required=True)

    keys = sub.add_parser("keys", help="show or release one idempotency record via the admin API")
    keys.add_argument("action", choices=("show", "release"))
    keys.add_argument("tenant", help=f"tenant id: {TENANT_IS}; or the credential, with --credential")
    keys.add_argument("key", help="the Idempotency-Key")
    keys.add_argument("--config", type=_config_path, help="read the admin address and token from this file")
    keys.add_argument("--admin-url", type=_admin_url, help="e.g. http://127.0.0.1:9090 (default: from the config)")
    keys.add_argument("--token", help="admin token (default: admin.token, or $IDEMPROXY_ADMIN_TOKEN)")
    keys.add_argument("--credential", action="store_true",
                      help="TENANT is the raw tenant header value; make the tenant id of it as the proxy does")

    sub.add_parser("gen-key", help="print a new storage.encryption key (base64 of 32 random bytes)")

    demo = sub.add_parser("demo", help="a sample payments API behind idemproxy, on the embedded store")
    demo.add_argument("--port", type=_port, default=8080, help="proxy port (default 8080)")
    demo.add_argument("--upstream-port", type=_port, default=9000, help="sample API port (default 9000)")
    demo.add_argument("--admin-port", type=_port, default=9090, help="admin port: /metrics (default 9090)")
    demo.add_argument("--store", help="embedded store file, kept (default: a new one each run, removed at exit: "
                                      "the sample API forgets its charges when stopped)")
    demo.add_argument("--api-only", action="store_true",
                      help="run only the sample payments API, on 0.0.0.0 (for docker compose)")
    return parser


def _given(fix: str) -> Callable[[str], str]:
    """An argument that names something and may not be empty: ``--config "$CONFIG"`` with CONFIG unset was read as
    the current directory ("cannot read the file (Is a directory)", naming no file), and an empty --config or
    --admin-url of ``keys`` was ignored for the default, then blamed. Refused, saying what to ``fix``."""

    def given(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"is empty; {fix}")
        return text

    return given


_config_path = _given("give the path of a YAML config file")
_admin_url = _given("give the proxy's admin port, such as http://127.0.0.1:9090")


def _port(text: str) -> int:
    """A demo port: the demo has no config file whose key an error could name, so its flag is named."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port (1..65535)")
    return port


_FLAGS = {"upstream.url": "upstream", "listen.port": "port", "admin.port": "admin_port", "workers": "workers"}


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    pairs = {key: getattr(args, name) for key, name in _FLAGS.items()}
    return {key: value for key, value in pairs.items() if value is not None}


class ReaderGone(Exception):
    """Whoever read this command's output stopped reading it (``idemproxy keys show ... | head -1``)."""


def emit(text: str) -> None:
    """A command's output, on stdout. A reader that stops early ends the command quietly, as it ends `cat` or `git
    log` (killed by SIGPIPE): no error line, no traceback, and the status a shell reports for them (``main``)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit, and would say "Exception ignored ... BrokenPipeError": whatever is
        # still buffered goes nowhere instead.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise ReaderGone from None


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def _load(path: str | None, overrides: dict[str, Any] | None = None) -> Config:
    """The configuration; an error in a value a flag gave names the flag (``--port (listen.port): ...``)."""
    try:
        return load_config_file(path, overrides=overrides)
    except ConfigError as error:
        raise ConfigError([_by_flag(line, overrides or {}) for line in error.errors]) from None


def _by_flag(line: str, overrides: dict[str, Any]) -> str:
    for key in overrides:
        if line.startswith(f"{key}:"):
            return f"--{_FLAGS[key].replace('_', '-')} ({key}){line[len(key):]}"
    return line


def cmd_serve(args: argparse.Namespace) -> int:
    # No file: the defaults plus the flags (CONTRACT "Command line"), the tenant from Authorization included.
    config = _load(args.config, _overrides(args))
    setup_logging(config.log)
    require(config.tracing)  # before any worker starts: one clear line instead of one traceback each
    from idemproxy.app import CannotListen, check_ports, serve

    try:
        if config.workers > 1 and not args.reuse_port:
            from idemproxy.workers import run_workers

            _run(check_ports(config))  # (a taken port: one line, not one per worker)
            return run_workers(config, sys.argv[1:])
        _run(serve(config, reuse_port=args.reuse_port))
    except CannotListen as exc:  # a port a flag gave is named by that flag, as a bad value of it is (_by_flag)
        said = str(exc)
        for section, flag in (("listen", args.port), ("admin", args.admin_port)):
            keys = f"{section}.host / {section}.port: "
            if flag is not None and said.startswith(keys):
                name = "--port" if section == "listen" else "--admin-port"
                said = f"{section}.host / {name} ({section}.port): {said[len(keys):]}"
        raise CannotListen(said) from exc
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    config = _load(args.file)
    require(config.tracing)  # what `serve` refuses at start (the otel extra missing) is no valid config here either
    emit(dump_yaml(config))
    for note in advisories(config):
        print(f"idemproxy: warning: {note}", file=sys.stderr)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    config = _load(args.config)
    setup_logging(config.log)
    if config.storage.postgres is None:
        print("idemproxy: storage.postgres is not configured; nothing to migrate", file=sys.stderr)
        return 1
    from idemproxy.store.postgres import apply_migrations, attempts_log

    # A one-shot command: PostgreSQL unreachable is its one error line, not a warning per attempt before it.
    attempts_log.setLevel(logging.ERROR)

    async def run() -> None:
        assert config.storage.postgres is not None
        applied, shape = await apply_migrations(config.storage.postgres)
        partitions = "daily partitions" if shape == "daily" else "one table"
        emit(f"schema up to date (applied: {applied or 'none'}; records: {partitions})\n")

    _run(run())
    return 0


def cmd_gen_key(_args: argparse.Namespace) -> int:
    """The key on stdout (``export IDEMPROXY_STORE_KEY=$(idemproxy gen-key)``); its id, as logs name it, on stderr."""
    from idemproxy.store.codec import key_id

    key = secrets.token_bytes(STORE_KEY_BYTES)
    emit(base64.b64encode(key).decode() + "\n")
    print(f"key id {key_id(key).hex()} (what sealed records and logs name; not secret)", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from idemproxy.demo import run_api, run_demo

    if args.api_only:
        _run(run_api(args.upstream_port))
    elif args.store is not None:
        _run(run_demo(args.port, args.upstream_port, args.admin_port, args.store))
    else:  # records of an earlier run would replay charges the new sample API never made, and no 409 would show
        with tempfile.TemporaryDirectory(prefix="idemproxy-demo-") as directory:
            _run(run_demo(args.port, args.upstream_port, args.admin_port, os.path.join(directory, "demo.sqlite3")))
    return 0


class CLIError(Exception):
    """An error the command line reports in one line (no traceback) and exits 1 for."""


def cmd_keys(args: argparse.Namespace) -> int:
    config = _load(args.config) if args.config else None
    admin_url = (args.admin_url or (
        _admin_base(config.admin.host, config.admin.port) if config else "http://127.0.0.1:9090"
    )).rstrip("/")
    try:
        parts = urllib.parse.urlsplit(admin_url)
        hostname = parts.hostname
    except ValueError:  # (a broken IPv6 host, a port that is not a number)
        hostname = None
    if not hostname or parts.scheme not in ("http", "https"):
        named = "--admin-url" if args.admin_url else "admin.host (--config): its URL"
        raise CLIError(f"{named} {admin_url[:100]!r} is not an http(s) URL; give the proxy's admin port, such "
                       "as http://127.0.0.1:9090")
    token = (args.token or (config.admin.token.reveal() if config else "") or os.environ.get(
        "IDEMPROXY_ADMIN_TOKEN", ""
    )).strip()  # (as admin.token is read: the newline a secret file ends in is not part of it)
    if not token.isascii() or not token.isprintable():
        raise CLIError("--token (or admin.token, or $IDEMPROXY_ADMIN_TOKEN) must be printable ASCII, as the "
                       "proxy's admin.token is sent in an HTTP header")
    tenant = args.tenant
    if args.credential:  # the tenant id the proxy makes of this credential (without a config: the defaults)
        from idemproxy.engine import tenant_id  # (the rule the proxy uses, loaded only here: it brings aiohttp)

        try:
            tenant = tenant_id(config.tenant if config else TenantConfig(), args.tenant)
        except MissingTenant as exc:
            raise CLIError(f"--credential: {exc.detail}") from exc
    if not tenant or not args.key:  # no admin route matches /admin/keys/t/: its 404 would read as "API off"
        raise CLIError(f"TENANT and KEY must not be empty (TENANT: {TENANT_IS}; KEY: the Idempotency-Key as "
                       "sent)")
    from idemproxy.engine import parse_key  # (as tenant_id above)

    try:  # the key as the proxy reads the header: '"k"' (an sf-string) is the key k, its record k's
        key = parse_key([args.key], KEY_MAX_LENGTH_LIMIT)
    except InvalidKey as exc:
        raise CLIError(f"KEY: {exc.detail}") from exc
    path = "/admin/keys/" + "/".join(urllib.parse.quote(part, safe="") for part in (tenant, key))
    request = urllib.request.Request(
        admin_url + path, method="GET" if args.action == "show" else "DELETE",
        headers={"Authorization": f"Bearer {token}"},
    )
    emit(json.dumps(_admin_call(request, admin_url), indent=2) + "\n")
    return 0


def _admin_base(host: str, port: int) -> str:
    """The admin port named by the config, as a URL: a wildcard address is reached on loopback, and an IPv6
    address goes in brackets (``http://[::1]:9090``; ``http://::1:9090`` is no URL)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _admin_call(request: urllib.request.Request, admin_url: str) -> Any:
    """One admin API call; every way it can fail becomes a one-line CLIError naming what to fix. The token is
    sent only once the address has shown itself to be idemproxy's admin port (``admin.ADMIN_MARK``): the proxy
    port, given by mistake, would forward it upstream and pass the upstream's answer off as the admin API's."""
    from idemproxy.admin import ADMIN_MARK

    _, headers, _ = _fetch(urllib.request.Request(admin_url + "/healthz"), admin_url)
    if headers.get(ADMIN_MARK) is None:
        raise CLIError(f"{admin_url} is not idemproxy's admin port (its /healthz answer lacks the {ADMIN_MARK} "
                       "header), so the token was not sent; check --admin-url (the proxy's admin.host:admin.port)")
    status, _, body = _fetch(request, admin_url)
    if status >= 300:
        raise CLIError(_admin_refusal(status, body, admin_url))
    try:
        return json.loads(body)
    except ValueError as exc:
        raise CLIError(f"{admin_url} did not answer JSON; is that idemproxy's admin port?") from exc


# The admin port is reached directly: never through an HTTP proxy the environment names ($http_proxy), which would
# not reach a loopback admin port, or would be handed the admin token.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _fetch(request: urllib.request.Request, admin_url: str) -> tuple[int, Message[str, str], bytes]:
    """Status, headers and body of one call (an error status is an answer too); no answer is a CLIError."""
    try:
        with _DIRECT.open(request, timeout=10) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read() or b""
        except OSError:
            body = b""
        return exc.code, exc.headers, body
    except urllib.error.URLError as exc:
        raise CLIError(f"admin API at {admin_url} not reachable ({exc.reason}); check --admin-url") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise CLIError(f"admin API at {admin_url} broke off ({type(exc).__name__}); "
                       "is that idemproxy's admin port?") from exc


def _admin_refusal(status: int, body: bytes, admin_url: str) -> str:
    try:
        problem = json.loads(body)
    except ValueError:
        problem = None
    reason = http.client.responses.get(status, "")
    # No admin route for /admin/keys/TENANT/KEY (neither is empty): the admin API is off. (A proxy before this one
    # answered that 404 as text/plain, not as the problem unknown_path.)
    if status == 404 and (not isinstance(problem, dict) or problem.get("code") == "unknown_path"):
        return f"404: the admin API is off at {admin_url}: set admin.token in the proxy's config to turn it on"
    if not isinstance(problem, dict):  # not one of the admin API's problem answers
        return f"admin API at {admin_url} answered {status} {reason}".rstrip()
    if status == 401:
        return "401: admin token refused: pass --token, or set admin.token or $IDEMPROXY_ADMIN_TOKEN"
    if problem.get("code") == "not_found":
        return f"404: no record for this tenant and key (TENANT: {TENANT_IS}; or use --credential)"
    return f"admin API answered {status}: {problem.get('detail', reason)}"


COMMANDS = {
    "keys": cmd_keys,
    "serve": cmd_serve,
    "check-config": cmd_check_config,
    "migrate": cmd_migrate,
    "demo": cmd_demo,
    "gen-key": cmd_gen_key,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        for error in exc.errors:  # one line each, whole in itself
            print(f"idemproxy: invalid configuration: {error}", file=sys.stderr)
        return 1
    except StoreUnavailable as exc:
        print(f"idemproxy: {exc.detail}", file=sys.stderr)
        return 1
    except (CLIError, TracingUnavailable) as exc:
        print(f"idemproxy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except ReaderGone:  # 141: what a shell reports for `cat` or `git log` in its place (killed by SIGPIPE)
        return 128 + signal.SIGPIPE
    except Exception as exc:
        from idemproxy.store.embedded import StoreLocked

        if isinstance(exc, StoreLocked | OSError):
            print(f"idemproxy: {exc}", file=sys.stderr)
            return 1
        if os.environ.get("IDEMPROXY_TRACEBACK"):
            raise
        print(f"idemproxy: unexpected {type(exc).__name__}: {exc} (IDEMPROXY_TRACEBACK=1 shows where)",
              file=sys.stderr)
        return 1
