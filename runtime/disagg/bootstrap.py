"""The bootstrap server a prefill server runs on --disaggregation-bootstrap-port (SGLang's shape): its engine
ranks register their control address (PUT /route), and a decode server looks one up (GET /route) for the
bootstrap_host:bootstrap_port a request names. In radixk3 the scheduler speaks for all the ranks of its engine,
so it registers once, as engine rank 0, with the layout every one of its ranks shares.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, HTTPException, Request

from runtime.disagg.protocol import BootstrapEntry

LOOKUP_TIMEOUT_S = 5.0


def bootstrap_app() -> FastAPI:
    app = FastAPI()
    routes: dict[int, dict[str, Any]] = {}

    @app.put("/route")
    async def put_route(request: Request) -> dict[str, str]:
        body = await request.json()
        if body.get("role") != "Prefill":
            raise HTTPException(400, "only prefill ranks register here")
        routes[int(body["engine_rank"])] = body
        return {"status": "ok"}

    @app.get("/route")
    async def get_route(engine_rank: int = 0) -> dict[str, Any]:
        if engine_rank == -1:  # the prefill server's parallel layout, as SGLang's decode asks it first
            if not routes:
                raise HTTPException(404, "no prefill rank has registered yet")
            first = routes[min(routes)]
            return {k: first[k] for k in ("tp_size", "page_size", "fingerprint")}
        if engine_rank not in routes:
            raise HTTPException(404, f"prefill engine rank {engine_rank} has not registered")
        return routes[engine_rank]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


class BootstrapServer:
    """The bootstrap server in a thread of the prefill scheduler's process."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._server = uvicorn.Server(uvicorn.Config(bootstrap_app(), host=host, port=port, log_level="warning",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="pd-bootstrap", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap server could not listen on {host}:{port}")
            time.sleep(0.01)

    def register(self, entry: BootstrapEntry) -> None:
        body = {"role": "Prefill", "engine_rank": 0, "dp_size": 1, "rank_ip": entry.rank_ip,
                "rank_port": entry.rank_port, "tp_size": entry.tp_size, "page_size": entry.page_size,
                "fingerprint": entry.fingerprint, "proposer": entry.proposer}
        httpx.put(f"http://{self.host}:{self.port}/route", json=body, timeout=LOOKUP_TIMEOUT_S).raise_for_status()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)


def lookup(host: str, port: int) -> BootstrapEntry:
    """The control address and layout of the prefill server whose bootstrap server is at host:port."""
    r = httpx.get(f"http://{host}:{port}/route", params={"engine_rank": 0}, timeout=LOOKUP_TIMEOUT_S)
    r.raise_for_status()
    b = r.json()
    return BootstrapEntry(b["rank_ip"], int(b["rank_port"]), int(b["tp_size"]), int(b["page_size"]),
                          b["fingerprint"], b.get("proposer", "none"))
