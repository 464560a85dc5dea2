"""uvicorn's httptools protocol with deadlines on each request's head (request line and headers).

uvicorn arms its keep-alive timer only once a response is complete, and any byte received disarms it: a
connection that never completes its first request's head, or trickles it a byte at a time, stays open for
ever, and a few hundred of them (slowloris) hold the server's sockets. Its h11 protocol is no better here: its
`h11_max_incomplete_event_size` bounds the size of an incomplete head, not its time. So this protocol splits the
two as nginx does (`client_header_timeout`, `keepalive_timeout`): a new connection, or a request whose head has
begun, gets `head_timeout` seconds to deliver the complete head; an idle connection after a response gets
`keep_alive` seconds for the next request to begin, then the head deadline from its first byte. A connection
that misses a deadline is closed. It also bounds the head's size (`MAX_HEAD_BYTES`, as h11's
`h11_max_incomplete_event_size` and Node's 16 KiB header limit do): within its deadline a client could otherwise
send gigabytes of headers, which httptools hands to uvicorn to keep. A head over the bound gets a 431 and the
connection is closed. Bodies and responses are not timed here: a request that is being served is the app's.
"""

from __future__ import annotations

import asyncio

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from runtime.http.api_errors import error_body

MAX_HEAD_BYTES = 64 << 10  # a request line and headers larger than this get 431 (nginx's default allows 32 KiB)


class HeadTimeoutProtocol(HttpToolsProtocol):
    head_timeout: float = 60.0
    keep_alive: float = 5.0
    max_head_bytes: int = MAX_HEAD_BYTES
    _head_timer: asyncio.TimerHandle | None = None
    _in_head: bool = False  # a request's head has begun and is not complete
    _idle: bool = False  # the timer is the keep-alive one (no byte of the next request yet)
    _head_bytes: int = 0  # the current head's bytes so far

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head(self.head_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            self._head_too_large()

    # The head's bytes as the parser reads them (the request line, then each header), from a message's start
    # until its headers are complete; a body, read or left unread, is not counted.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        if self._idle:  # the next request began on an idle connection: from now on, the head's deadline
            self._await_head(self.head_timeout)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._head_bytes += len(name) + len(value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_arrived()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # else the next request, whose head has come already, starts now
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._await_head(self.keep_alive, idle=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def _await_head(self, seconds: float, idle: bool = False) -> None:
        self._head_arrived()
        self._idle = idle
        self._head_timer = self.loop.call_later(seconds, self._head_late)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


    def _head_too_large(self) -> None:
        self._head_arrived()
        body = orjson.dumps(error_body(f"the request line and headers exceed {self.max_head_bytes} bytes",
                                       "invalid_request_error", "headers"))
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def head_timeout_protocol(head_timeout: float, keep_alive: float) -> type[HeadTimeoutProtocol]:
    """The protocol class with these deadlines, for uvicorn's `Config(http=...)`."""
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout": head_timeout,
                                                                  "keep_alive": keep_alive})
