"""A TCP relay a test can cut: the network between the proxies and a store, made of real sockets.

``Relay(host, port)`` listens on a free 127.0.0.1 port and forwards bytes both ways to ``host:port``. Its port is
opened by the thread that makes it, in that thread's network namespace (tests/netns.py); it connects to the
target from a thread of its own, in the namespace the process started in, with its own event loop, so neither a
test's blocking calls nor a proxy in a subprocess can stall it. Every method is thread-safe and returns once the
relay's loop has done the work (bounded waits):

- ``cut()``      closes every open connection at once (both sides) and, until ``restore()``, closes each new
                 one as soon as it is accepted: a network partition as the peers see it (EOF / reset).
- ``stall()``    keeps connections open but forwards nothing, and accepts new ones without connecting them
                 to the target: a black hole, for timeouts. ``restore()`` lets the held bytes flow again.
                 ``held`` counts the clients' reads it held back (a client's write that never reached the target).
- ``linger()``   bytes flow both ways, but a target that closes its end (a server ending the session after
                 its last word, a FATAL) is not seen to close by the client until ``restore()``: the client
                 has read the server's goodbye while its socket still looks open.
- ``strand()``   every connection open now stops for good: held open, nothing forwarded either way, no close
                 passed on (the old server of a failover that went dark: no RST, no FIN); connections opened
                 afterwards are forwarded as usual (to the server that took over). ``restore()`` keeps them so.
- ``end_next_at(n)`` ends the next connection accepted at its client's n-th read (a session the server ended as
                 it was set up).
- ``restore()``  back to forwarding.
- ``close()``    closes everything and stops the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tests import netns

_T = TypeVar("_T")

CHUNK = 64 * 1024
CALL_TIMEOUT = 10.0  # seconds a method waits for the relay's loop


class _Link:
    """One relayed connection: the accepted client side and, once connected, the target side."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.target: asyncio.StreamWriter | None = None
        self.stranded = asyncio.Event()  # set: this link forwards nothing more, ever (``Relay.strand``)
        self.ends_at: int | None = None  # the client's read that ends this link (``Relay.end_next_at``)
        self.reads = 0

    def abort(self) -> None:
        for writer in (self.client, self.target):
            if writer is not None:
                writer.transport.abort()

    async def close(self) -> None:
        """An orderly end: what is still buffered is sent before the sockets close."""
        for writer in (self.client, self.target):
            if writer is not None:
                writer.close()
        for writer in (self.client, self.target):
            if writer is not None:
                with contextlib.suppress(OSError, TimeoutError):
                    await asyncio.wait_for(writer.wait_closed(), 2)


class Relay:
    def __init__(self, target_host: str, target_port: int, name: str = "relay") -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.name = name
        self.port = 0
        self.accepted = 0  # connections accepted while forwarding (counted in the relay's loop)
        self.refused = 0  # connections accepted and closed at once while cut
        self.stranded = 0  # connections left open and silent by strand()
        self.held = 0  # reads from a client held back by stall() (the bytes a client wrote into the black hole)
        self._mode = "open"  # open | cut | stalled | muted | lingering
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()  # every stream opened, aborted at shutdown
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._answering: asyncio.Event | None = None  # clear while muted: the target's bytes are held
        self._closes: asyncio.Event | None = None  # clear while lingering: a target's end of file is held
        self._severed: asyncio.Event | None = None  # set by cut: stranded links end with the others
        self.lingering = 0  # targets that closed while lingering (their end of file held back from the client)
        self.ended = 0  # connections ended by end_next_at
        self._ends_at: int | None = None  # set by end_next_at: for the next connection accepted
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"relay-{name}", daemon=True)
        self._thread.start()
        # Made here, in the caller's network namespace. IPPROTO_TCP named, as asyncio's own listeners do: the
        # connections accepted then get TCP_NODELAY from asyncio (with proto 0 they would not, and Nagle's wait
        # would hold a server's last bytes back).
        listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listening.bind(("127.0.0.1", 0))
        self.port = int(listening.getsockname()[1])
        self._call(self._listen(listening))

    # ------------------------------------------------------------------ public, any thread

    @property
    def mode(self) -> str:
        return self._mode

    def cut(self) -> None:
        self._call(self._cut())

    def stall(self) -> None:
        self._call(self._stall())

    def mute(self) -> None:
        """Requests go on reaching the target, its answers are held (until ``restore``): the target did the
        work, and its client waits for a reply that comes late, if ever."""
        self._call(self._mute())

    def strand(self) -> None:
        """The connections open now go silent for good (both ways, sockets open, nothing sent, no close passed
        on); new ones are forwarded."""
        self._call(self._strand())

    def end_next_at(self, read: int) -> None:
        """The next connection accepted is ended (both sides reset) when its client's ``read``-th read comes, which
        is not forwarded: with a PostgreSQL client not using TLS, 2 is the first statement after the start-up (a
        pool's set-up of a new connection), as a server ending sessions as they come would end it."""
        self._call(self._end_next_at(read))

    def linger(self) -> None:
        """Bytes go on flowing; a target's end of file is held back from its client (until ``restore``)."""
        self._call(self._linger())

    def restore(self) -> None:
        self._call(self._restore())

    def open_connections(self) -> int:
        return self._call(self._count())

    def client_ports(self) -> list[int]:
        """The clients' own ports of the connections open now (to drop their packets: tests/netns.py)."""
        return self._call(self._client_ports())

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self._shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CALL_TIMEOUT)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the relay's thread

    def _run(self) -> None:
        netns.at_home()  # (made inside a private network: the target is reached from outside it)
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        pending = [task for task in asyncio.all_tasks(self._loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.run_until_complete(self._loop.shutdown_default_executor())

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT)

    async def _listen(self, listening: socket.socket) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._answering = asyncio.Event()
        self._answering.set()
        self._closes = asyncio.Event()
        self._closes.set()
        self._severed = asyncio.Event()
        self._server = await asyncio.start_server(self._accept, sock=listening)

    async def _count(self) -> int:
        return len(self._links)

    async def _client_ports(self) -> list[int]:
        return [int(link.client.get_extra_info("peername")[1]) for link in self._links]

    async def _cut(self) -> None:
        self._mode = "cut"
        assert self._flowing is not None and self._answering is not None
        self._flowing.set()  # held pumps wake up, see their transports gone and end
        self._answering.set()
        assert self._closes is not None and self._severed is not None
        self._closes.set()
        self._severed.set()
        self._abort_all()

    async def _stall(self) -> None:
        self._mode = "stalled"
        assert self._flowing is not None
        self._flowing.clear()

    async def _strand(self) -> None:
        for link in self._links:
            if not link.stranded.is_set():
                link.stranded.set()
                self.stranded += 1

    async def _end_next_at(self, read: int) -> None:
        self._ends_at = read

    async def _mute(self) -> None:
        self._mode = "muted"
        assert self._answering is not None
        self._answering.clear()

    async def _linger(self) -> None:
        self._mode = "lingering"
        assert self._closes is not None
        self._closes.clear()

    async def _restore(self) -> None:
        self._mode = "open"
        assert self._flowing is not None and self._answering is not None and self._closes is not None
        assert self._severed is not None
        self._severed.clear()  # (links a cut severed are gone; one stranded from now on stays so)
        self._flowing.set()
        self._answering.set()
        self._closes.set()

    async def _shutdown(self) -> None:
        self._mode = "cut"
        if self._severed is not None:
            self._severed.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._abort_all()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in self._writers:  # whatever a cancelled task left open
            writer.transport.abort()
        await asyncio.sleep(0.05)  # aborts close their sockets in callbacks: let them run before the loop stops

    def _abort_all(self) -> None:
        for link in list(self._links):
            link.abort()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._mode == "cut":
            self.refused += 1
            writer.transport.abort()
            return
        self.accepted += 1
        self._writers.add(writer)
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(writer)
        link.ends_at, self._ends_at = self._ends_at, None
        self._links.add(link)
        try:
            assert self._flowing is not None
            await self._flowing.wait()  # stalled: hold the connection, connect nothing
            if self._mode == "cut":
                return
            try:
                target_reader, link.target = await asyncio.open_connection(self.target_host, self.target_port)
                self._writers.add(link.target)
            except OSError:
                return  # the target is down: the client sees its connection closed
            if self._mode == "cut":  # cut while connecting
                return
            await asyncio.gather(self._pump(reader, link.target, link),
                                 self._pump(target_reader, writer, link, answers=True))
        finally:
            self._links.discard(link)
            if self._mode != "cut":
                await link.close()
            link.abort()
            self._writers.discard(writer)
            if link.target is not None:
                self._writers.discard(link.target)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link, answers: bool = False
    ) -> None:
        """Copy one direction until EOF or an error; EOF is passed on as a half-close. ``answers``: the target's
        direction, held while muted. A stranded link passes on nothing from then on: no byte, no EOF, no reset."""
        assert self._flowing is not None and self._answering is not None and self._closes is not None
        try:
            while data := await reader.read(CHUNK):
                if not answers and self._client_read(link):
                    return
                await self._flowing.wait()
                if answers:
                    await self._answering.wait()
                if writer.transport.is_closing():
                    return
                if link.stranded.is_set():
                    await self._forever()
                    return
                writer.write(data)
                await writer.drain()
            if answers and not self._closes.is_set():
                self.lingering += 1
                await self._closes.wait()
            if link.stranded.is_set():
                await self._forever()
                return
            if writer.can_write_eof() and not writer.transport.is_closing():
                writer.write_eof()
        except (OSError, RuntimeError):
            if link.stranded.is_set():
                await self._forever()
                return
            writer.transport.abort()  # a broken side ends the other direction too (its read sees EOF)

    def _client_read(self, link: _Link) -> bool:
        """Count a read from ``link``'s client; True: it ends the link here (``end_next_at``)."""
        assert self._flowing is not None
        link.reads += 1
        if link.reads == link.ends_at:
            self.ended += 1
            link.abort()
            return True
        if not self._flowing.is_set():
            self.held += 1
        return False

    async def _forever(self) -> None:
        """A stranded link's pump: wait until the relay is cut or closed (which aborts both sockets)."""
        assert self._severed is not None
        await self._severed.wait()
