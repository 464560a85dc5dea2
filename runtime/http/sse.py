"""Server-sent events: `data: {json}` frames ending with `data: [DONE]`.

Starlette's StreamingResponse watches the connection; when the client leaves it cancels the generator,
whose `metered` stream then aborts the request on the scheduler.

JSON leaves U+2028, U+2029 and U+0085 raw inside strings, but clients that split a stream on Unicode line
breaks (Python's `str.splitlines`, httpx's `iter_lines`) would cut a `data:` line there and get broken JSON:
every event writes them as JSON escapes, which any JSON parser reads back as the same characters.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"

# Their UTF-8 bytes, which in valid UTF-8 can only be these characters (a lead byte starts each sequence).
_LINE_BREAK_ESCAPES = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def event(obj: Any) -> bytes:
    data = orjson.dumps(obj)
    for raw, escaped in _LINE_BREAK_ESCAPES:
        data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def named_event(obj: dict[str, Any]) -> bytes:
    """An event named by its `type` (`event: TYPE` before its data), as Anthropic's and OpenAI's Responses streams
    send them."""
    return f"event: {obj['type']}\n".encode() + event(obj)


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    # no-cache / no buffering: proxies must pass every event at once
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
