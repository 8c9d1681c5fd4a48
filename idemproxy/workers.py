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


def run_workers(config: Config, argv: list[str]) -> int:
    """Start the workers, pass SIGTERM/SIGINT on to them, and wait; exit non-zero if any failed."""
    with tempfile.TemporaryDirectory(prefix="idemproxy-metrics-") as metrics_dir:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        command = [sys.executable, "-m", "idemproxy", *argv, "--workers", "1", "--reuse-port"]
        children = [subprocess.Popen(command, env=env) for _ in range(config.workers)]
        log.info("started %d workers: %s", len(children), [c.pid for c in children])

        def forward(signum: int, _frame: FrameType | None) -> None:
            for child in children:
                if child.poll() is None:
                    child.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        codes = [child.wait() for child in children]
    return max(codes, default=0)
