"""HTTP/1.1 by hand over a real socket: bytes no well-behaved client would send (non-UTF-8 header values, odd
methods, any body), and the answer read back whatever its framing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated name keeps its last value
    body: bytes


def build_request(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """One request with ``Connection: close`` and a Content-Length (unless the headers bring their own)."""
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: proxy.test", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    if not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in headers):
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def send_raw(url: str, request: bytes, timeout: float = 30.0) -> RawResponse:
    """Send ``request`` as is on a new connection and read the answer until the server closes it."""
    return parse_response(await send_raw_bytes(url, request, timeout))


async def send_raw_bytes(url: str, request: bytes, timeout: float = 30.0) -> bytes:
    """:func:`send_raw`, the bytes unparsed (every answer, interim ones too, as they came)."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def parse_response(data: bytes) -> RawResponse:
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return RawResponse(status, headers, body)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return bytes(out)


async def raw_exchange(port: int, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send bytes exactly as written (aiohttp's client cannot send these targets); read a Connection: close answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode("latin-1", "surrogateescape") + body)
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    status_line, _, rest = raw.partition(b"\r\n")
    header_block, _, payload = rest.partition(b"\r\n\r\n")
    headers = dict(line.decode().split(": ", 1) for line in header_block.split(b"\r\n") if line)
    return int(status_line.split()[1]), headers, payload
