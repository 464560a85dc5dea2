"""The HTTP server: FastAPI on uvicorn (uvloop, httptools) in the tokenizer process.

`create_app(args)` builds the app; its lifespan starts the scheduler and worker processes and the
TokenizerManager on uvicorn's event loop, and stops them after the server has drained. `run_server(args)`
serves until SIGTERM or SIGINT: uvicorn stops accepting connections and lets in-flight requests finish for
`graceful_shutdown_timeout` seconds; then the app ends the rest itself, in the API's words (uvicorn would
cancel them: a plain-text 500, or a stream cut without its end): each is aborted on its scheduler and its
client gets the 503 error body, or in a stream an error event and `data: [DONE]`. The lifespan then shuts
the engine down and the process exits 0. A connection gets `timeout_request_head` seconds for each request's
head, and an idle one `timeout_keep_alive` seconds for the next request to begin (`runtime.http.head_timeout`).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.engine_processes import EngineProcesses
from runtime.errors import EngineError, ShuttingDown
from runtime.http.api_errors import APIError, install_error_handlers
from runtime.http.head_timeout import head_timeout_protocol
from runtime.http.native_api import router as native_router
from runtime.http.openai_api import router as openai_router
from runtime.http.server_info import router as server_info_router
from runtime.http.state import ServerState, served_model_name, state_of
from runtime.server_args import ServerArgs
from runtime.tokenizer.manager import TokenizerManager

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (load balancers' probes)
# How long a scrape waits for the schedulers' counters before it serves the last ones (Prometheus gives a scrape
# 10 s by default).
METRICS_TIMEOUT_S = 5.0
# After the grace period, how long uvicorn still waits for the connections to close (the app's last words to
# its clients) before it cancels what is left.
CLOSING_S = 5.0


class AccessMiddleware:
    """Bearer API key on every path but /health, and the request body size limit (413), checked on the
    declared Content-Length and again on the bytes actually received (chunked bodies declare none)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = None if api_key is None else api_key.encode()
        self.limit = max_body_bytes

    def _authorized(self, header: bytes) -> bool:
        # `Bearer <key>`; the scheme is case-insensitive and one or more spaces follow it (RFC 7235).
        scheme, _, key = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(key.lstrip(b" "), self.expected or b"")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")  # the bytes as sent
            if not self._authorized(given):
                what = "a wrong API key" if given else "no API key"
                err = APIError(401, f"the request has {what}; send the header 'Authorization: Bearer <key>'",
                               "authentication_error", code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._too_large(declared).response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise self._too_large(f"more than {received}")
            return message

        await self.app(scope, limited, send)

    def _too_large(self, size: str) -> APIError:
        return APIError(413, f"the request body ({size} bytes) exceeds the limit of {self.limit} bytes "
                             "(--max-body-bytes)", param="body", code="body_too_large")


def create_app(args: ServerArgs) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        procs = await asyncio.to_thread(EngineProcesses, args)  # spawns and waits for the children
        tm = TokenizerManager(args, procs)
        try:
            await tm.start()
            app.state.server = ServerState(args, procs, tm)
            print(f"radixk3: serving {served_model_name(args)} on http://{args.host}:{args.port}",
                  file=sys.stderr, flush=True)
            yield
        finally:
            await tm.close()
            await asyncio.to_thread(procs.shutdown)

    app = FastAPI(title="radixk3", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(native_router)
    app.include_router(openai_router)
    app.include_router(server_info_router)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        st = state_of(request)
        body = st.metrics.render(await _scheduler_metrics(st))
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(AccessMiddleware, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
    return app


async def _scheduler_metrics(st: ServerState) -> dict[str, Any] | None:
    """The schedulers' counters for a scrape, or None (the last ones are served, with their staleness) when a
    scheduler is known to be silent, does not answer within METRICS_TIMEOUT_S, or the engine is down."""
    if any(st.tm.watch.silent):
        return None
    try:
        return await st.tm.get_metrics(timeout=METRICS_TIMEOUT_S)
    except (TimeoutError, EngineError):
        return None


class _Server(uvicorn.Server):
    """uvicorn's server, which tells the app when its shutdown begins."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


def _end_in_flight_after(app: FastAPI, grace: float) -> None:
    """In `grace` seconds, fail what is still in flight with ShuttingDown: the routes answer with that error
    and end their streams, and the requests are aborted on their schedulers."""
    st: ServerState | None = getattr(app.state, "server", None)
    if st is None:  # the engine never started
        return
    err = ShuttingDown(f"the server is shutting down and the request did not finish within the grace period of "
                       f"{grace:g} s (--graceful-shutdown-timeout); it is aborted")
    asyncio.get_running_loop().call_later(grace, st.tm.fail_pending, err)


def run_server(args: ServerArgs) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean shutdown, 1 if the engine or the socket failed to start."""
    app = create_app(args)
    grace = args.graceful_shutdown_timeout
    config = uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop",
                            http=head_timeout_protocol(args.timeout_request_head, args.timeout_keep_alive),
                            ws="none", lifespan="on",
                            log_level=args.log_level, access_log=False, timeout_graceful_shutdown=grace + CLOSING_S,
                            # uvicorn's own idle timer (whole seconds) is covered by the head timeout
                            timeout_keep_alive=math.ceil(args.timeout_keep_alive))
    server = _Server(config, lambda: _end_in_flight_after(app, grace))
    # uvicorn re-raises the signal it stopped on once it has shut down; with these no-op handlers underneath,
    # that ends in a clean exit instead of death by SIGTERM.
    previous: dict[int, Any] = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0 if server.started else 1
