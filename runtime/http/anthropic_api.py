"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and `POST /v1/messages/count_tokens`, over
the chat route's rendering, engine and reply parsers (`runtime.http.anthropic_chat`).

A stream is Anthropic's named server-sent events: `message_start`, a `ping`, each content block's
`content_block_start` / `content_block_delta` (text_delta, thinking_delta, input_json_delta) /
`content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`; a failure after the status
line is an `error` event. Errors on these paths are in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}` (`AnthropicErrors` rewrites the server's one error body, wherever it was raised).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.datastructures import MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.http.anthropic_chat import BlockStream, chat_request, reply_blocks, stop_reason
from runtime.http.anthropic_protocol import CountTokensOut, CountTokensRequest, MessageOut, MessagesRequest, Usage
from runtime.http.api_errors import OrjsonResponse, parse_body, request_failed, stream_failed
from runtime.http.handles import ClientDisconnected, collect_all, failed, metered, unless_disconnected
from runtime.http.metrics import RequestTimer
from runtime.http.openai_api import ChatPlan, plan_chat, render_chat, submit
from runtime.http.openai_protocol import DeltaMessage
from runtime.http.sse import named_event, sse_response
from runtime.http.state import ServerState, state_of
from runtime.tokenizer.chat_format import K3
from runtime.tokenizer.manager import RequestHandle
from runtime.tokenizer.request_stream import Sample

PATH = "/v1/messages"
router = APIRouter(prefix="/v1")


def _thinks_by_default(st: ServerState) -> bool:
    return st.chat_format.family == K3


@router.post("/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    st = state_of(request)
    req = await parse_body(request, CountTokensRequest)
    st.check_model(req.model)
    chat = await render_chat(st, chat_request(req, _thinks_by_default(st)))
    return OrjsonResponse(CountTokensOut(input_tokens=len(chat.ids(st.tokenizer))).model_dump())


@router.post("/messages")
async def messages(request: Request) -> Response:
    st = state_of(request)
    req = await parse_body(request, MessagesRequest)
    st.check_model(req.model)
    plan = await plan_chat(st, chat_request(req, _thinks_by_default(st)))
    [handle], [timer] = await submit(st, [plan.prompt], plan.params, None, stream=bool(req.stream))
    mid = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return sse_response(_stream(st, req, plan, handle, timer, mid))
    try:
        [[sample]] = await unless_disconnected(request, collect_all([handle], [timer]))
    except ClientDisconnected:
        return Response(status_code=499)
    if (err := failed([sample])) is not None:
        raise err
    message, finish = plan.chat.message(st.tokenizer, sample)
    reason, sequence = stop_reason(finish, sample.matched_stop, req.stop_sequences)
    body = MessageOut(id=mid, model=st.model_name, content=reply_blocks(message), stop_reason=reason,
                      stop_sequence=sequence, usage=_usage(sample, len(plan.prompt)))
    return OrjsonResponse(body.model_dump())


def _usage(s: Sample, prompt_tokens: int) -> Usage:
    cached = min(s.cached_tokens, prompt_tokens)
    return Usage(input_tokens=prompt_tokens - cached, output_tokens=len(s.output_ids),
                 cache_read_input_tokens=cached)


async def _stream(st: ServerState, req: MessagesRequest, plan: ChatPlan, handle: RequestHandle,
                  timer: RequestTimer, mid: str) -> AsyncIterator[bytes]:
    reply = plan.reply(st.tokenizer)
    blocks, sample = BlockStream(), Sample(0)
    start = MessageOut(id=mid, model=st.model_name, content=[], usage=Usage(input_tokens=len(plan.prompt),
                                                                            output_tokens=0))
    yield named_event({"type": "message_start", "message": start.model_dump()})
    yield named_event({"type": "ping"})
    try:
        async for c in metered(handle, timer):
            sample.add(c)
            if c.finished == "error":
                err = request_failed(c)
                yield named_event(anthropic_error(err.status, err.message))
                return
            delta = DeltaMessage(content=c.text) if reply is None else reply.push(c.text, c.finished, c.token_ids)
            for e in blocks.push(delta):
                yield named_event(e)
        for e in blocks.finish():
            yield named_event(e)
        finish = sample.finished if reply is None else reply.finish_reason(sample.finished)
        reason, sequence = stop_reason(finish, sample.matched_stop, req.stop_sequences)
        usage = _usage(sample, len(plan.prompt)).model_dump()
        yield named_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                      "usage": usage})
        yield named_event({"type": "message_stop"})
    except Exception as e:  # the status line is sent already: the failure goes into the stream
        err = stream_failed(e)
        yield named_event(anthropic_error(err.status, err.message))


# --- errors -------------------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicErrors:
    """On the Messages paths, the server's error bodies (`{"error": {"message", ...}}`, from the routes, the
    error handlers or the access middleware: it must wrap them all) rewritten in Anthropic's shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def reshaping(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the whole body is in
                return
            if start is None:
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            body = _reshaped(start["status"], body)
            headers = MutableHeaders(scope=start)
            headers["content-length"] = str(len(body))
            await send(start)
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaping)


def _reshaped(status: int, body: bytes) -> bytes:
    try:
        error = orjson.loads(body)["error"]
        return orjson.dumps(anthropic_error(status, error["message"]))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body  # not our error body (a 499 has none)
