"""A fault-injecting HTTP reverse proxy on loopback, in front of a real S3 or GCS server.

Requests are forwarded as ``http_proxy.py`` forwards them. With probability
``rate`` a request instead meets one fault: a 503 SlowDown, a 500, a connection reset, a
response whose body is cut short, or a delay before forwarding. ``down=True`` refuses service
entirely (every connection reset at once); ``down_from_first_write=True`` lets reads through
and then does the same from the first upload on. Runs in a background thread with its own loop.
"""
from __future__ import annotations

import asyncio
import random
from collections import Counter

from .http_proxy import LoopbackProxy, error_response, headers_of, read_body, read_head, with_connection_close

FAULTS = ("slowdown_503", "error_500", "reset", "truncated_body", "delay")

_SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message></Error>")
_INTERNAL = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>InternalError</Code>"
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")


class FaultProxy(LoopbackProxy):
    name = "fault-proxy"

    def __init__(self, upstream_port: int, rate: float = 0.1, seed: int = 0,
                 faults: tuple[str, ...] = FAULTS, max_delay: float = 1.0) -> None:
        self.rate = rate
        self.faults = faults
        self.max_delay = max_delay
        self.down = False
        self.down_from_first_write = False  # go down for good at the first PUT/POST (mid-save)
        self.random = random.Random(seed)
        self.counts: Counter = Counter()
        super().__init__(upstream_port)

    def _pick(self) -> tuple[str | None, float]:
        """The fault for the next request, and its delay: drawn together, in the order the
        requests arrive, so that a seed gives the same faults in the same order every run
        (a delay drawn later, while other requests draw theirs, shifted every draw after it)."""
        if self.down:
            return "down", 0.0
        if self.random.random() < self.rate:
            fault = self.random.choice(self.faults)
            return fault, self.random.uniform(0.1, self.max_delay) if fault == "delay" else 0.0
        return None, 0.0

    async def _one_request(self, reader, writer) -> None:
        head = await read_head(reader)
        headers = headers_of(head)
        if self.down_from_first_write and head.split(b" ", 1)[0] in (b"PUT", b"POST"):
            self.down = True
        fault, delay = self._pick()
        self.counts["requests"] += 1
        if fault:
            self.counts[fault] += 1
        if fault in ("down", "reset"):
            writer.transport.abort()  # RST, no response
            return
        if "100-continue" in headers.get("expect", "").lower():
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        body = await read_body(reader, headers, until_close=False)
        if fault in ("slowdown_503", "error_500"):
            status, payload = (b"503 Slow Down", _SLOWDOWN) if fault == "slowdown_503" else \
                (b"500 Internal Server Error", _INTERNAL)
            writer.write(error_response(status, b"application/xml", payload))
            await writer.drain()
            return
        if fault == "delay":
            await asyncio.sleep(delay)
        response_head, _, response_body = await self.forward(head, body)
        if fault == "truncated_body" and len(response_body) > 1:
            writer.write(with_connection_close(response_head) + response_body[: len(response_body) // 2])
            await writer.drain()
            writer.transport.abort()
            return
        writer.write(with_connection_close(response_head) + response_body)
        await writer.drain()
