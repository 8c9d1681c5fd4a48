"""A real upstream HTTP server for tests: it records every request it executed and misbehaves on demand.

A request steers it with headers (so concurrent tests never share state):
  X-Test-Delay: seconds      wait before answering (after recording the execution)
  X-Test-Status: code        answer with this status
  X-Test-Hang: 1             never answer (until the test ends)
  X-Test-Drop: 1             close the connection without answering (after executing)
  X-Test-Size: bytes         answer with a body of this many bytes
  X-Test-Set-Cookie: value   add a Set-Cookie header
  X-Test-Hop: 1              answer with hop-by-hop headers (Connection-named, Keep-Alive)
  X-Test-Server: value       answer with this Server header
  X-Test-No-Server: 1        answer with no Server header at all (not even aiohttp's)
  X-Test-Replayed: value     answer with Idempotent-Replayed: value (an upstream with idempotency of its own)
  X-Test-No-Type: 1          answer with no Content-Type (aiohttp would add application/octet-stream)
  X-Test-Interim: 1          send interim answers first: a 100 nobody asked for, then a 103 Early Hints
                             (101: a 101 Switching Protocols instead; hints: a 103 every 100 ms for 10 s;
                             flood: 101 of them at once; close: one 103 saying Connection: close; odd: a 100
                             and a 103 whose reason phrases hold a control character)
  X-Test-Coding: codings     answer with a chunked body under "Transfer-Encoding: <codings>" (raw bytes), then close
  X-Test-Cut: 1              answer with a head declaring 10 bytes of body, send 4 and close (raw bytes)
  X-Test-Phrase: 1           answer with a reason phrase holding a control character, then close (raw bytes)
  X-Test-Head: bytes         answer with about this many bytes of extra headers (X-Head-0, X-Head-1, ... of 4 KiB)
The paths /stream/upload and /stream/download?size=N stream huge bodies without keeping them;
/stream/broken?size=N declares N bytes and hangs up halfway.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from dataclasses import dataclass, field

from aiohttp import web
from multidict import CIMultiDict


@dataclass
class Executed:
    method: str
    path_qs: str
    headers: CIMultiDict[str]
    body: bytes
    serial: int


@dataclass
class RecordingUpstream:
    executed: list[Executed] = field(default_factory=list)
    url: str = ""
    _serial: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _hangs: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024**3, handler_args={"auto_decompress": False})
        app.router.add_post("/stream/upload", self.upload)
        app.router.add_get("/stream/download", self.download)
        app.router.add_get("/stream/broken", self.broken)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_response_prepare.append(_server_header)
        return app

    def count(self, key: str | None = None, path: str | None = None) -> int:
        return sum(
            1 for e in self.executed
            if (key is None or e.headers.get("Idempotency-Key") == key)
            and (path is None or e.path_qs.split("?")[0] == path)
        )

    def release_hangs(self) -> None:
        self._hangs.set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        serial = next(self._serial)
        self.executed.append(Executed(request.method, request.raw_path, CIMultiDict(request.headers),
                                      body, serial))
        h = request.headers
        if "X-Test-Interim" in h:
            await self.interim(request, h["X-Test-Interim"])
        if "X-Test-Delay" in h:
            await asyncio.sleep(float(h["X-Test-Delay"]))
        if "X-Test-Hang" in h:
            await self._hangs.wait()
        if "X-Test-Drop" in h:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        status = int(h.get("X-Test-Status", "201" if request.method == "POST" else "200"))
        if "X-Test-Coding" in h or "X-Test-Cut" in h or "X-Test-Phrase" in h:
            return await self.raw(request, status, h.get("X-Test-Coding"), serial if "X-Test-Phrase" in h else None)
        headers = {"X-Upstream-Serial": str(serial), "X-Custom": "kept"}
        if "X-Test-Hop" in h:  # hop-by-hop headers the proxy must not pass on
            headers.update({"Connection": "X-Up-Private", "X-Up-Private": "1", "Keep-Alive": "timeout=5"})
        if "X-Test-Set-Cookie" in h:
            headers["Set-Cookie"] = h["X-Test-Set-Cookie"]
        if "X-Test-Replayed" in h:
            headers["Idempotent-Replayed"] = h["X-Test-Replayed"]
        if "X-Test-Head" in h:
            size = int(h["X-Test-Head"])
            headers.update({f"X-Head-{n}": "h" * 4096 for n in range(-(-size // 4096))})
        if "X-Test-Size" in h:
            return web.Response(status=status, body=b"x" * int(h["X-Test-Size"]), headers=headers)
        if "X-Test-Trickle" in h:  # "<chunks>,<seconds>": that many 2 KiB chunks, one every <seconds>
            chunks, every = h["X-Test-Trickle"].split(",")
            return await self.trickle(request, status, headers, int(chunks), float(every))
        payload = {"serial": serial, "method": request.method, "path": request.raw_path,
                   "body": body.decode(errors="replace")}
        return web.Response(status=status, text=json.dumps(payload), content_type="application/json",
                            headers=headers)

    @staticmethod
    async def interim(request: web.Request, kind: str) -> None:
        """1xx answers before the final one, written raw (aiohttp's server has no API for them)."""
        if kind == "101":  # switching protocols nobody asked for
            await request.writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n")
        elif kind == "flood":
            await request.writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n" * 101)
        elif kind == "odd":  # (phrases llhttp lets through, not valid HTTP/1.1: RFC 9112 §4)
            await request.writer.write(b"HTTP/1.1 100 Con\x01tinue\r\n\r\nHTTP/1.1 103 Early\x1bHints\r\n"
                                       b"Link: </a.css>; rel=preload\r\n\r\n")
        elif kind == "close":  # (llhttp refused whatever followed such a 1xx, the final answer too)
            await request.writer.write(b"HTTP/1.1 103 Early Hints\r\nConnection: close\r\n\r\n")
        elif kind == "hints":  # hints that go on and on, the answer withheld (until the client hangs up)
            assert request.transport is not None
            for _ in range(100):
                if request.transport.is_closing():
                    return
                await request.writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
                await asyncio.sleep(0.1)
        else:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n"
                                       b"Link: </caf\xc3\xa9.css>; rel=preload\r\nConnection: X-Hop\r\n"
                                       b"X-Hop: 1\r\nKeep-Alive: timeout=5\r\n\r\n")

    @staticmethod
    async def raw(request: web.Request, status: int, codings: str | None, phrased: int | None) -> web.StreamResponse:
        """Written raw, then the connection closed: a chunked answer under other codings too (aiohttp's server
        names chunked alone), an answer whose reason phrase holds a control character (``phrased``: its serial;
        llhttp lets any byte but CR and LF through, aiohttp writes none), or an answer whose body breaks off after 4
        of its 10 bytes."""
        if phrased is not None:
            body = json.dumps({"serial": phrased}).encode()
            await request.writer.write(b"HTTP/1.1 %d Cre\x01ated\r\nContent-Type: application/json\r\n"
                                       b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body))
        elif codings is None:
            await request.writer.write(b"HTTP/1.1 %d Done\r\nContent-Length: 10\r\n\r\nhalf" % status)
        else:
            await request.writer.write(b"HTTP/1.1 %d Done\r\nTransfer-Encoding: %s\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                                       % (status, codings.encode()))
        assert request.transport is not None
        request.transport.close()
        return web.Response()

    @staticmethod
    async def trickle(request: web.Request, status: int, headers: dict[str, str], chunks: int,
                      every: float) -> web.StreamResponse:
        """An answer whose body keeps coming, slowly: each gap short, the whole longer than a timeout."""
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = chunks * 2048
        await response.prepare(request)
        for n in range(chunks):
            if n:
                await asyncio.sleep(every)
            await response.write(bytes([65 + n % 26]) * 2048)
        await response.write_eof()
        return response

    async def upload(self, request: web.Request) -> web.Response:
        digest = hashlib.sha256()
        size = 0
        async for chunk in request.content.iter_chunked(1 << 16):
            digest.update(chunk)
            size += len(chunk)
        self.executed.append(Executed(request.method, request.raw_path, CIMultiDict(request.headers),
                                      b"", next(self._serial)))
        return web.json_response({"size": size, "sha256": digest.hexdigest()})

    async def download(self, request: web.Request) -> web.StreamResponse:
        size = int(request.query["size"])
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = size
        await response.prepare(request)
        block = bytes(range(256)) * 256  # 64 KiB
        sent = 0
        while sent < size:
            part = block[: min(len(block), size - sent)]
            await response.write(part)
            sent += len(part)
        await response.write_eof()
        return response


    async def broken(self, request: web.Request) -> web.StreamResponse:
        """Declares ``size`` bytes, sends half of them, then closes the connection."""
        size = int(request.query["size"])
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = size
        await response.prepare(request)
        await response.write(b"b" * (size // 2))
        assert request.transport is not None
        request.transport.close()
        return response


async def _server_header(request: web.BaseRequest, response: web.StreamResponse) -> None:
    if "X-Test-Server" in request.headers:
        response.headers["Server"] = request.headers["X-Test-Server"]
    elif "X-Test-No-Server" in request.headers:
        response.headers.popall("Server", None)
    if "X-Test-No-Type" in request.headers:
        response.headers.popall("Content-Type", None)


def pattern_sha256(size: int) -> str:
    """The digest of what /stream/download?size=N sends."""
    digest = hashlib.sha256()
    block = bytes(range(256)) * 256
    sent = 0
    while sent < size:
        part = block[: min(len(block), size - sent)]
        digest.update(part)
        sent += len(part)
    return digest.hexdigest()
