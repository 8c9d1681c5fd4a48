"""The leak check (`-p tests.leakcheck`, on in `make test`) names the test that leaves a socket or a transport
open."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SAMPLE = '''
import asyncio
import socket

KEPT = []


def test_keeps_a_socket():
    KEPT.append(socket.socket())


async def test_keeps_a_connection():
    server = await asyncio.start_server(lambda reader, writer: KEPT.append(writer), "127.0.0.1", 0)
    KEPT.append(await asyncio.open_connection(*server.sockets[0].getsockname()[:2]))
    server.close()


async def test_closes_what_it_opens():
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()
    with socket.socket():
        pass
'''


def run_sample(tmp_path: Path, *plugin: str) -> str:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
         "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function", "test_sample.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return result.stdout + result.stderr


def test_the_test_that_leaves_a_socket_open_errors_in_its_teardown(tmp_path: Path) -> None:
    output = run_sample(tmp_path, "-p", "tests.leakcheck")
    assert "ERROR at teardown of test_keeps_a_socket" in output, output
    assert "ERROR at teardown of test_keeps_a_connection" in output, output
    assert "_SelectorSocketTransport" in output and 'test_sample.py", line 9, in test_keeps_a_socket' in output
    assert "3 passed, 2 errors" in output, output  # the clean test passes


def test_without_it_the_leaks_pass_unseen(tmp_path: Path) -> None:
    output = run_sample(tmp_path)
    assert "3 passed" in output and "error" not in output.lower(), output
