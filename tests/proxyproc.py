"""The proxy as a real subprocess started through its CLI, so tests can kill -9 it and read its memory."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.servers import free_port


async def wait_ready(
    admin_url: str, proc: subprocess.Popen[Any], timeout: float = 30, log: Callable[[], str] = lambda: ""
) -> None:
    """Poll /readyz until the process answers 200; fail early, with its log, if it exits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        while loop.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"proxy exited {proc.returncode}:\n{log()}")
            try:
                async with session.get(f"{admin_url}/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"proxy not ready within {timeout}s:\n{log()}")


class ProxyProcess:
    def __init__(self, config: dict[str, Any], workdir: Path, name: str = "proxy") -> None:
        self.port = free_port()
        self.admin_port = free_port()
        # No drain delay unless a test asks for one: stopping a test's proxy need not wait for load balancers.
        config = {"drain_delay": "0s", **config,
                  "listen": {**config.get("listen", {}), "host": "127.0.0.1", "port": self.port},
                  "admin": {"host": "127.0.0.1", "port": self.admin_port, **config.get("admin", {})}}
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def start(self, timeout: float = 30, wait: bool = True) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "idemproxy", "serve", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        if wait:
            await self.wait_ready(timeout)

    async def wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        await wait_ready(self.admin_url, self.proc, timeout, self.log)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(30)

    def peak_rss_bytes(self) -> int:
        """VmHWM: the peak resident set size of the process so far, from /proc."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc status")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
