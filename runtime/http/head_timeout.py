"""uvicorn's httptools protocol with a deadline on each request's head (request line and headers).

uvicorn arms its keep-alive timer only once a response is complete, and any byte received disarms it: a
connection that never completes its first request's head, or trickles it a byte at a time, stays open for
ever, and a few hundred of them (slowloris) hold the server's sockets. Its h11 protocol is no better here: its
`h11_max_incomplete_event_size` bounds the size of an incomplete head, not its time. So this protocol gives a
connection `head_timeout` seconds, from its opening or from its previous response, to deliver the next
request's complete head, and closes it otherwise. Bodies and responses are not timed here: a request that is
being served is the app's.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadTimeoutProtocol(HttpToolsProtocol):
    head_timeout: float = 5.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def on_headers_complete(self) -> None:
        self._head_arrived()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # else the next request, whose head has come already, starts now
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._head_arrived()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_late)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def head_timeout_protocol(seconds: float) -> type[HeadTimeoutProtocol]:
    """The protocol class with this deadline, for uvicorn's `Config(http=...)`."""
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout": seconds})
