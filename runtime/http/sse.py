"""Server-sent events: `data: {json}` frames ending with `data: [DONE]`.

Starlette's StreamingResponse watches the connection; when the client leaves it cancels the generator,
whose `metered` stream then aborts the request on the scheduler.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    # no-cache / no buffering: proxies must pass every event at once
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
