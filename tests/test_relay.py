"""The cuttable TCP relay the storm test puts between the proxies and their stores."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable

import pytest

from tests.relay import Relay


class Echo:
    """An echo server in the test's loop that counts the connections it saw end."""

    def __init__(self) -> None:
        self.ended = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except OSError:
            pass
        finally:
            self.ended += 1
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def echo() -> AsyncIterator[Echo]:
    server = Echo()
    await server.start()
    yield server
    await server.close()


@contextlib.asynccontextmanager
async def connected(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), 5)


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """What arrives before the connection ends (EOF or reset)."""
    try:
        return await asyncio.wait_for(reader.read(), 5)
    except ConnectionError:
        return b""


async def wait_for(condition: Callable[[], bool], timeout: float = 5) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_cut_severs_established_connections_and_refuses_new_ones_until_restore(echo: Echo) -> None:
    with Relay("127.0.0.1", echo.port, name="echo") as relay:
        async with connected(relay.port) as (reader, writer):
            assert await round_trip(reader, writer, b"ping") == b"ping"
            assert relay.open_connections() == 1

            relay.cut()
            assert await read_until_closed(reader) == b""  # the established connection is gone
            await wait_for(lambda: echo.ended == 1)  # ... on the target's side too
            await wait_for(lambda: relay.open_connections() == 0)  # and the relay let go of both ends

        async with connected(relay.port) as (reader, writer):  # accepted, then closed at once
            assert await read_until_closed(reader) == b""
        assert relay.refused >= 1 and echo.ended == 1

        relay.restore()
        async with connected(relay.port) as (reader, writer):
            assert await round_trip(reader, writer, b"again") == b"again"


async def test_stall_holds_bytes_until_restore(echo: Echo) -> None:
    with Relay("127.0.0.1", echo.port, name="echo") as relay:
        async with connected(relay.port) as (reader, writer):
            assert await round_trip(reader, writer, b"one") == b"one"
            relay.stall()
            writer.write(b"two")
            await writer.drain()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.readexactly(3), 0.3)
            async with connected(relay.port) as (late_reader, late_writer):  # a new one is held, not refused
                late_writer.write(b"late")
                relay.restore()
                assert await asyncio.wait_for(late_reader.readexactly(4), 5) == b"late"
            assert await asyncio.wait_for(reader.readexactly(3), 5) == b"two"



async def test_strand_silences_the_open_connections_for_good_and_forwards_new_ones(echo: Echo) -> None:
    with Relay("127.0.0.1", echo.port, name="echo") as relay:
        async with connected(relay.port) as (reader, writer):
            assert await round_trip(reader, writer, b"one") == b"one"
            relay.strand()
            async with connected(relay.port) as (new_reader, new_writer):  # the address answers again at once
                assert await round_trip(new_reader, new_writer, b"new") == b"new"
            writer.write(b"two")
            writer.write_eof()  # neither its bytes nor its end of file reach the target
            await writer.drain()
            relay.restore()  # (a stranded connection stays so)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.3)  # no byte, no close, no reset comes back
            assert relay.open_connections() == 1 and relay.stranded == 1
            await wait_for(lambda: echo.ended == 1)  # (the new connection's end; the stranded one's never came)
            relay.cut()
            assert await read_until_closed(reader) == b""
        await wait_for(lambda: relay.open_connections() == 0)


async def test_linger_passes_the_targets_last_bytes_and_holds_its_close_until_restore(echo: Echo) -> None:
    with Relay("127.0.0.1", echo.port, name="echo") as relay:
        async with connected(relay.port) as (reader, writer):
            assert await round_trip(reader, writer, b"one") == b"one"
            relay.linger()
            writer.write(b"bye")
            writer.write_eof()  # the echo answers and closes its end
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(3), 5) == b"bye"
            await wait_for(lambda: relay.lingering == 1)  # its close came and is held
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.3)
            relay.restore()
            assert await asyncio.wait_for(reader.read(), 5) == b""

async def test_relays_a_large_stream_with_half_close_intact(echo: Echo) -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB
    with Relay("127.0.0.1", echo.port, name="echo") as relay:
        async with connected(relay.port) as (reader, writer):
            async def send() -> None:
                writer.write(payload)
                await writer.drain()
                writer.write_eof()

            sent = asyncio.ensure_future(send())
            received = await asyncio.wait_for(reader.read(), 10)
            await sent
        assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
        await wait_for(lambda: relay.open_connections() == 0)


async def test_close_ends_connections_and_the_thread(echo: Echo) -> None:
    relay = Relay("127.0.0.1", echo.port, name="echo")
    async with connected(relay.port) as (reader, writer):
        assert await round_trip(reader, writer, b"x") == b"x"
        relay.close()
        assert await read_until_closed(reader) == b""
    assert not relay._thread.is_alive()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", relay.port)
    relay.close()  # twice is fine
