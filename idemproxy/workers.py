"""``--workers N``: N server processes sharing the ports through SO_REUSEPORT.

Each worker is this same program with ``--reuse-port``; prometheus-client's multiprocess mode (a shared
directory of value files) lets any worker's ``/metrics`` report the sum over all of them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from types import FrameType

from idemproxy.config import Config

log = logging.getLogger("idemproxy.workers")


# What this process sends its workers. Not the operator's own SIGTERM/SIGINT: a worker often gets that one
# directly as well (a signal to the process group, as Ctrl-C and `kill -- -PGID` send; systemd's default
# KillMode signals every process of the unit), and would count the forwarded copy as the operator's second
# signal, which means "exit at once, without draining".
DRAIN = signal.SIGUSR1  # drain as on a first SIGTERM; never counts as a second one
ABORT = signal.SIGUSR2  # the operator signalled twice: exit at once


def run_workers(config: Config, argv: list[str]) -> int:
    """Start the workers, tell them to drain on SIGTERM/SIGINT (to exit at once on a second), and wait; exit
    non-zero if any failed."""
    with tempfile.TemporaryDirectory(prefix="idemproxy-metrics-") as metrics_dir:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        command = [sys.executable, "-m", "idemproxy", *argv, "--workers", "1", "--reuse-port"]
        children = [subprocess.Popen(command, env=env) for _ in range(config.workers)]
        log.info("started %d workers: %s", len(children), [c.pid for c in children])
        signalled = 0

        def forward(_signum: int, _frame: FrameType | None) -> None:
            nonlocal signalled
            signalled += 1
            for child in children:
                if child.poll() is None:
                    child.send_signal(DRAIN if signalled == 1 else ABORT)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        codes = [child.wait() for child in children]
    return max(codes, default=0)
