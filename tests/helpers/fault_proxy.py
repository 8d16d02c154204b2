"""A fault-injecting HTTP reverse proxy on loopback, in front of a real S3 or GCS server.

Requests are forwarded byte for byte (the Host header and every signed header untouched, so
SigV4 stays valid); responses are relayed with ``Connection: close``. With probability
``rate`` a request instead meets one fault: a 503 SlowDown, a 500, a connection reset, a
response whose body is cut short, or a delay before forwarding. ``down=True`` refuses service
entirely (every connection reset at once); ``down_from_first_write=True`` lets reads through
and then does the same from the first upload on. Runs in a background thread with its own loop.
"""
from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter

FAULTS = ("slowdown_503", "error_500", "reset", "truncated_body", "delay")

_SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message></Error>")
_INTERNAL = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>InternalError</Code>"
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    out = {}
    for line in lines:
        if ":" in line:
            key, _, value = line.partition(":")
            out[key.strip().lower()] = value.strip()
    return out


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], until_close: bool) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raw = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            raw += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    line = await reader.readuntil(b"\r\n")
                    raw += line
                    if line == b"\r\n":
                        return bytes(raw)
            raw += await reader.readexactly(size + 2)
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read() if until_close else b""


def _with_connection_close(head: bytes) -> bytes:
    lines = [line for line in head.split(b"\r\n") if line and not line.lower().startswith(b"connection:")]
    return b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n"


class FaultProxy:
    def __init__(self, upstream_port: int, rate: float = 0.1, seed: int = 0,
                 faults: tuple[str, ...] = FAULTS, max_delay: float = 1.0) -> None:
        self.upstream_port = upstream_port
        self.rate = rate
        self.faults = faults
        self.max_delay = max_delay
        self.down = False
        self.down_from_first_write = False  # go down for good at the first PUT/POST (mid-save)
        self.random = random.Random(seed)
        self.counts: Counter = Counter()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fault-proxy")
        self._thread.start()
        self._ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        async def close():
            self._server.close()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _pick(self) -> str | None:
        if self.down:
            return "down"
        if self.random.random() < self.rate:
            return self.random.choice(self.faults)
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._one_request(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    async def _one_request(self, reader, writer) -> None:
        head = await _read_head(reader)
        headers = _headers(head)
        if self.down_from_first_write and head.split(b" ", 1)[0] in (b"PUT", b"POST"):
            self.down = True
        fault = self._pick()
        self.counts["requests"] += 1
        if fault:
            self.counts[fault] += 1
        if fault in ("down", "reset"):
            writer.transport.abort()  # RST, no response
            return
        if "100-continue" in headers.get("expect", "").lower():
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        body = await _read_body(reader, headers, until_close=False)
        if fault in ("slowdown_503", "error_500"):
            status, payload = (b"503 Slow Down", _SLOWDOWN) if fault == "slowdown_503" else \
                (b"500 Internal Server Error", _INTERNAL)
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\nContent-Length: "
                         + str(len(payload)).encode() + b"\r\nConnection: close\r\n\r\n" + payload)
            await writer.drain()
            return
        if fault == "delay":
            await asyncio.sleep(self.random.uniform(0.1, self.max_delay))
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            up_writer.write(head + body)
            await up_writer.drain()
            while True:
                response_head = await _read_head(up_reader)
                if not response_head.startswith(b"HTTP/1.1 1") and not response_head.startswith(b"HTTP/1.0 1"):
                    break  # skip interim 1xx responses
            response_headers = _headers(response_head)
            status = int(response_head.split(b" ", 2)[1])
            method = head.split(b" ", 1)[0].upper()
            no_body = method == b"HEAD" or status in (204, 304)
            response_body = b"" if no_body else await _read_body(up_reader, response_headers, until_close=True)
        finally:
            up_writer.close()
        if fault == "truncated_body" and len(response_body) > 1:
            writer.write(_with_connection_close(response_head) + response_body[: len(response_body) // 2])
            await writer.drain()
            writer.transport.abort()
            return
        writer.write(_with_connection_close(response_head) + response_body)
        await writer.drain()
