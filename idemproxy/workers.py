"""``--workers N``: N server processes sharing the ports through SO_REUSEPORT.

Each worker is this same program with ``--reuse-port``; prometheus-client's multiprocess mode (a shared
directory of value files) lets any worker's ``/metrics`` report the sum over all of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from types import FrameType

from prometheus_client.multiprocess import mark_process_dead

from idemproxy.config import Config

log = logging.getLogger("idemproxy.workers")


# What this process sends its workers. Not the operator's own SIGTERM/SIGINT: a worker often gets that one
# directly as well (a signal to the process group, as Ctrl-C and `kill -- -PGID` send; systemd's default
# KillMode signals every process of the unit), and would count the forwarded copy as the operator's second
# signal, which means "exit at once, without draining".
DRAIN = signal.SIGUSR1  # drain as on a first SIGTERM; never counts as a second one
ABORT = signal.SIGUSR2  # the operator signalled twice: exit at once
PARENT_ENV = "IDEMPROXY_WORKERS_PARENT"  # a worker's parent pid, so the worker can tell when it is orphaned
# A worker that dies unasked is replaced, unless it died this soon after it started: then it cannot start (the
# port, the config's files), and starting it again and again would only hide that; the others drain and the
# parent exits with its code.
START_GRACE = 5.0
_PR_SET_PDEATHSIG = 1


def drain_when_orphaned() -> None:
    """In a worker, once it handles DRAIN: have Linux send DRAIN when the parent dies (kill -9 included), so a
    worker never serves on as an orphan, holding the port with the old config, beside the workers of the parent
    a supervisor starts next."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(DRAIN))
    if os.getppid() != int(parent):  # it died before the prctl
        os.kill(os.getpid(), DRAIN)


def _as_said(code: int, signalled: bool) -> int:
    """A worker's exit status as a shell says it (killed by signal N: 128 + N); 0 for one the operator's signal
    (or the DRAIN this process forwards when the operator signals it alone) reached before it handled signals:
    it was still starting."""
    if signalled and code in (-signal.SIGTERM, -signal.SIGINT, -DRAIN):
        return 0
    return 128 - code if code < 0 else code


def run_workers(config: Config, argv: list[str]) -> int:
    """Start the workers, tell them to drain on SIGTERM/SIGINT (to exit at once on a second), and wait. A worker
    that dies unasked (killed, crashed) is replaced and its live gauges dropped from the summed metrics (its
    requests in flight, its store_up); exit non-zero if any failed."""
    with tempfile.TemporaryDirectory(prefix="idemproxy-metrics-") as metrics_dir:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir, PARENT_ENV: str(os.getpid())}
        # (--reuse-port makes it a worker; its config keeps the real worker count, which its start-up line shows)
        command = [sys.executable, "-m", "idemproxy", *argv, "--reuse-port"]
        started: dict[int, float] = {}

        def spawn() -> subprocess.Popen[bytes]:
            child = subprocess.Popen(command, env=env)
            started[child.pid] = time.monotonic()
            return child

        children: list[subprocess.Popen[bytes]] = []
        signalled = 0

        def tell(child: subprocess.Popen[bytes]) -> None:
            # os.kill, not Popen.send_signal: that polls, and a poll in a signal handler could reap a worker the
            # loop below then waits for in vain. Only the loop reaps, so a worker not yet seen exit is alive or
            # a zombie keeping its pid.
            if signalled and child.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # (reaped just now, its returncode not yet set)
                    os.kill(child.pid, DRAIN if signalled == 1 else ABORT)

        def forward(_signum: int, _frame: FrameType | None) -> None:
            nonlocal signalled
            signalled += 1
            for child in children:
                tell(child)

        def start(index: int) -> None:
            child = spawn()
            children[index:index + 1] = [child]  # (a new one at the end, or in the place of one that died)
            tell(child)  # (if the operator's signal came while it was being started: forward() may not have seen it)

        # Before the first worker: a SIGTERM while they start must drain them, not kill this process at once (its
        # default action) and leave them orphaned.
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        for _ in range(config.workers):
            start(len(children))
        log.info("started %d workers: %s", len(children), [c.pid for c in children])
        failed = 0
        while any(child.returncode is None for child in children):
            pid, status = os.waitpid(-1, 0)
            index = next((i for i, child in enumerate(children) if child.pid == pid), None)
            if index is None:
                continue
            code = children[index].returncode = os.waitstatus_to_exitcode(status)
            mark_process_dead(pid, metrics_dir)  # type: ignore[no-untyped-call]
            # Killed -9 (the OOM killer, an operator) is no failure to start, however soon: one that cannot start
            # exits with its one-line error. START_GRACE counts from the spawn, and a worker serves well before.
            killed = code == -signal.SIGKILL
            code = _as_said(code, bool(signalled))
            lived = time.monotonic() - started.pop(pid)
            if not signalled and (killed or lived >= START_GRACE):
                log.error("worker %d exited (%d) unasked; starting another", pid, code)
                start(index)
                continue
            failed = failed or code
            if not signalled:
                log.error("worker %d exited (%d) within %gs of its start; stopping the others", pid, code,
                          START_GRACE)
                forward(signal.SIGTERM, None)
    return failed
