"""The core the test proxies share: an HTTP reverse proxy on loopback, in front of a real S3
or GCS server, one request per connection, on its own event loop in a daemon thread of the
test process (``stop()`` ends it; there is no process to kill).

A subclass decides what each request meets (``_one_request``); :meth:`LoopbackProxy.forward`
passes a request on byte for byte (the Host header and every signed header untouched, so SigV4
stays valid) and returns the server's answer, which goes back with ``Connection: close``.
"""
from __future__ import annotations

import asyncio
import threading


async def read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def headers_of(head: bytes) -> dict[str, str]:
    """A request's or response's headers, names lower-cased."""
    out = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        if ":" in line:
            key, _, value = line.partition(":")
            out[key.strip().lower()] = value.strip()
    return out


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str], until_close: bool) -> bytes:
    """The body as it came (chunked framing kept); ``until_close``: with neither framing, the
    body runs to the end of the connection (a response), else it is empty (a request)."""
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


def with_connection_close(head: bytes) -> bytes:
    lines = [line for line in head.split(b"\r\n") if line and not line.lower().startswith(b"connection:")]
    return b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n"


def error_response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    """A whole answer the proxy gives instead of the server (``status``: b"503 Slow Down")."""
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


class LoopbackProxy:
    """Listens on a free loopback port (``endpoint``) and forwards to ``upstream_port``."""

    name = "proxy"

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=self.name)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"the {self.name} did not start")

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
        async def close() -> None:
            self._server.close()
            # connections still open (a client's idle keep-alive): ended here, not left pending
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._one_request(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def forward(self, head: bytes, body: bytes) -> tuple[bytes, int, bytes]:
        """The request sent to the server; its answer's head, status and body (interim 1xx
        answers skipped: they are the proxy's to give, not the server's)."""
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            up_writer.write(head + body)
            await up_writer.drain()
            while True:
                response_head = await read_head(up_reader)
                if not response_head.startswith((b"HTTP/1.1 1", b"HTTP/1.0 1")):
                    break
            status = int(response_head.split(b" ", 2)[1])
            no_body = head.split(b" ", 1)[0].upper() == b"HEAD" or status in (204, 304)
            response_body = b"" if no_body else await read_body(up_reader, headers_of(response_head), until_close=True)
        finally:
            up_writer.close()
        return response_head, status, response_body
