"""`idemproxy demo` as a user meets it: start it, read the curl lines it prints, run them, check the answers."""

from __future__ import annotations

import asyncio
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.servers import free_port


def parse_curl(line: str) -> dict[str, Any]:
    """The URL, headers and body of a printed `curl -si URL -H ... -d ...` command."""
    words = shlex.split(line)
    assert words[0] == "curl"
    request: dict[str, Any] = {"headers": {}, "data": None}
    it = iter(words[1:])
    for word in it:
        if word == "-H":
            name, _, value = next(it).partition(":")
            request["headers"][name.strip()] = value.strip()
        elif word == "-d":
            request["data"] = next(it)
        elif word.startswith("http"):
            request["url"] = word
    return request


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    ports = [str(free_port()) for _ in range(3)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "idemproxy", "demo", "--port", ports[0], "--upstream-port", ports[1],
         "--admin-port", ports[2], "--store", str(tmp_path / "demo.sqlite3")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "Stop with Ctrl-C" in line:
            break
    else:
        raise AssertionError("demo exited:\n" + "".join(lines))
    yield proc, lines
    proc.terminate()
    proc.communicate(timeout=20)  # drains and closes the pipe


async def send(session: aiohttp.ClientSession, request: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    async with session.post(request["url"], data=request["data"], headers=request["headers"]) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def test_the_printed_scenarios_behave_as_described(demo: tuple[subprocess.Popen[str], list[str]]) -> None:
    _, lines = demo
    text = "".join(lines)
    curls = [parse_curl(m) for m in re.findall(r"curl -si [^;&\n)]+", text)]
    assert len(curls) == 5, text
    first, replay, mismatch, busy_a, busy_b = curls
    async with aiohttp.ClientSession() as session:
        status, headers, charge = await send(session, first)
        assert status == 201 and headers["Idempotent-Replayed"] == "false"
        assert headers["Server"] == "demo-payments"  # the sample API's own, as proxied (no aiohttp banner)
        assert charge["id"].startswith("ch_") and charge["amount"] == 1000

        status, headers, again = await send(session, replay)
        assert status == 201 and headers["Idempotent-Replayed"] == "true" and again == charge

        status, headers, problem = await send(session, mismatch)
        assert status == 422 and problem["code"] == "payload_mismatch" and "Server" not in headers

        # scenario 4: the second request starts while the first (200 ms) is still running
        one = asyncio.ensure_future(send(session, busy_a))
        await asyncio.sleep(0.05)
        status, headers, problem = await send(session, busy_b)
        assert status == 409 and problem["code"] == "in_flight" and "Retry-After" in headers
        status, _, created = await one
        assert status == 201 and created["id"] != charge["id"]

        # the sample API executed exactly two charges
        base = first["url"].rsplit("/v1/", 1)[0]
        for n, expected in ((1, 200), (2, 200), (3, 404)):
            async with session.get(f"{base}/v1/charges/ch_{n:06d}") as resp:
                assert resp.status == expected


@pytest.mark.parametrize("flag", ["--port", "--upstream-port", "--admin-port"])
def test_a_port_in_use_or_out_of_range_names_the_flag_to_change(flag: str, tmp_path: Path) -> None:
    # `make demo` on a machine where 8080, 9000 or 9090 is taken is a first try's likeliest failure: the line must
    # say which of the demo's flags to change, not only an address (or a config key the user never wrote).
    ports = {name: free_port() for name in ("--port", "--upstream-port", "--admin-port")}

    def run(port: str) -> subprocess.CompletedProcess[str]:
        args = [str(item) for name, value in ports.items() for item in (name, port if name == flag else value)]
        return subprocess.run([sys.executable, "-m", "idemproxy", "demo", *args, "--store",
                               str(tmp_path / "demo.sqlite3")], capture_output=True, text=True, timeout=60)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[flag]))
        taken.listen()
        busy = run(str(ports[flag]))
    assert busy.returncode == 1 and "Traceback" not in busy.stderr
    assert busy.stderr.splitlines()[-1] == (
        f"idemproxy: {flag}: cannot listen on 127.0.0.1:{ports[flag]} (address already in use); "
        f"give another port with {flag} N")
    wrong = run("99999")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.splitlines() == [
        f"idemproxy demo: argument {flag}: 99999 is not a port (1..65535) (see: idemproxy demo --help)"]


def test_a_store_that_cannot_be_opened_names_the_flag_to_change(tmp_path: Path) -> None:
    # As a port: the demo has no config file, so "storage.embedded.path: ..." named a key the user never wrote;
    # docs/contract.md: every CLI error names what to fix, "a flag by its name".
    store = tmp_path / "no-such-dir" / "demo.sqlite3"
    ports = [str(free_port()) for _ in range(3)]
    result = subprocess.run([sys.executable, "-m", "idemproxy", "demo", "--port", ports[0], "--upstream-port",
                             ports[1], "--admin-port", ports[2], "--store", str(store)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    line = result.stderr.splitlines()[-1]
    assert line.startswith(f"idemproxy: --store: {str(store)!r} cannot be opened as the embedded store ("), line
    assert "storage.embedded.path" not in result.stderr


async def test_a_second_run_shows_the_printed_scenarios_again(tmp_path: Path) -> None:
    # The sample API forgets its charges when the demo stops, but the store kept its records (24 h) in the working
    # directory: on a second `make demo` step 1 answered "Idempotent-Replayed: true" (a charge the API no longer
    # had) where it prints "false", and step 4's double submit got two replays instead of a 409.
    for run in (1, 2):
        ports = [str(free_port()) for _ in range(3)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "idemproxy", "demo", "--port", ports[0], "--upstream-port", ports[1],
             "--admin-port", ports[2]], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "Stop with Ctrl-C" in line:
                    break
            text = "".join(lines)
            curls = [parse_curl(m) for m in re.findall(r"curl -si [^;&\n)]+", text)]
            assert len(curls) == 5, text
            async with aiohttp.ClientSession() as session:
                status, headers, _ = await send(session, curls[0])
                assert (run, status, headers["Idempotent-Replayed"]) == (run, 201, "false")
                one = asyncio.ensure_future(send(session, curls[3]))
                await asyncio.sleep(0.05)
                status, _, problem = await send(session, curls[4])
                assert (run, status, problem["code"]) == (run, 409, "in_flight")
                assert (await one)[0] == 201
        finally:
            proc.terminate()
            proc.communicate(timeout=20)
        assert proc.returncode == 0
