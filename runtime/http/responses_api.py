"""The OpenAI Responses API (`/v1/responses`, as Codex and the `openai` client's `responses` use it) over the chat
route's rendering, sampling and reply parsers (`runtime.http.responses_chat` makes the chat request).

A response is one sample. Streams are server-sent events named by their type, numbered by `sequence_number`:
`response.created`, `response.in_progress`, each output item's events (`runtime.http.responses_output`), then
`response.completed` (or `response.incomplete` when `max_output_tokens` cut the reply or an abort cancelled it,
`response.failed` when the engine failed it). A stored response (`store`, on by default) continues through
`previous_response_id` while the server keeps it (`runtime.http.responses_store`); an id it does not hold is a 404.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from radixk3.tokenizer import Tokenizer
from runtime.errors import InvalidRequest
from runtime.http.api_errors import APIError, OrjsonResponse, bad_request, parse_body, request_failed, stream_failed
from runtime.http.handles import ClientDisconnected, collect_all, failed, metered, unless_disconnected
from runtime.http.metrics import RequestTimer
from runtime.http.openai_api import ChatPlan, plan_chat, submit
from runtime.http.openai_protocol import DeltaMessage
from runtime.http.responses_chat import chat_request, in_responses_terms, output_messages
from runtime.http.responses_output import Event, OutputBuilder
from runtime.http.responses_protocol import (
    IncompleteDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from runtime.http.responses_store import stored
from runtime.http.sse import named_event, sse_response
from runtime.http.state import ServerState, state_of
from runtime.tokenizer.manager import RequestHandle
from runtime.tokenizer.request_stream import Sample

router = APIRouter(prefix="/v1")


def _not_found(rid: str, param: str | None = None) -> APIError:
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id {rid!r} not found (this server keeps stored responses in memory only)",
                    "invalid_request_error", param, "previous_response_not_found" if param else "response_not_found")


class _Turn:
    """One response on its way: the chat plan, the echo of the request, the conversation it continues."""

    def __init__(self, st: ServerState, req: ResponsesRequest, plan: ChatPlan, history: list[dict[str, Any]]
                 ) -> None:
        self.st, self.req, self.plan, self.history = st, req, plan, history
        self.id = f"resp_{uuid.uuid4().hex}"
        self.body = ResponseObject.echoing(req, self.id, int(time.time()), st.model_name)
        self.out = OutputBuilder(req.seals_reasoning)
        self.reader = plan.reply(st.tokenizer)

    def push(self, text: str, finished: str | None, ids: list[int]) -> list[Event]:
        if self.reader is None:  # the model's own framing: the text is the reply
            return self.out.push(DeltaMessage(content=text or None))
        return self.out.push(self.reader.push(text, finished, ids))

    async def finish(self, s: Sample) -> list[Event]:
        """The last items' events; the response finished, and stored when asked."""
        finish = s.finished if self.reader is None else self.reader.finish_reason(s.finished)
        # An abort (`/abort_request`) cancels it; max_output_tokens leaves it incomplete.
        status = {"length": "incomplete", "abort": "cancelled"}.get(finish or "", "completed")
        complete = status == "completed"
        events = self.out.finish(complete)
        body = self.body
        body.status = status  # type: ignore[assignment]
        body.incomplete_details = IncompleteDetails(reason="max_output_tokens") if finish == "length" else None
        body.completed_at = int(time.time()) if complete else None
        body.output = self.out.items
        # Off the loop: a long reply is decoded and read a few times over.
        reasoning = await asyncio.to_thread(_reasoning_tokens, self.plan, self.st.tokenizer, s.output_ids, self.out)
        body.usage = ResponseUsage.of(s.prompt_tokens, len(s.output_ids), s.cached_tokens, reasoning)
        if body.store:
            self.st.responses.put(self.id, stored(body.model_dump(), self.history + output_messages(self.out.items)))
        return events


def _reasoning_tokens(plan: ChatPlan, tok: Tokenizer, ids: list[int], out: OutputBuilder) -> int:
    """The output tokens before the reply's first text or call (its thinking and the markup that ends it): the
    shortest prefix whose reading gives more than reasoning, found by bisection."""
    if not any(item.type == "reasoning" for item in out.items):
        return 0

    def past_reasoning(k: int) -> bool:
        reader = plan.reply(tok)
        assert reader is not None
        d = reader.push(tok.decode(ids[:k], skip_special_tokens=False), None, ids[:k])
        return bool(d.content or d.tool_calls)

    lo, hi = 0, len(ids)  # past_reasoning(hi) may be false: then it is all reasoning
    if not past_reasoning(hi):
        return len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if past_reasoning(mid) else (mid + 1, hi)
    return lo - 1 if lo > 0 else 0


async def _start(st: ServerState, req: ResponsesRequest) -> tuple[_Turn, RequestHandle, RequestTimer]:
    conversation: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = st.responses.get(req.previous_response_id)
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        conversation = list(previous.conversation)
    chat, added = chat_request(req, conversation)
    try:
        plan = await plan_chat(st, chat)
        turn = _Turn(st, req, plan, conversation + added)
        [handle], [timer] = await submit(st, [plan.prompt], plan.params, req.request_id or turn.id,
                                         stream=bool(req.stream))
    except APIError as e:
        raise in_responses_terms(e) from None
    except InvalidRequest as e:  # the engine's checks (a prompt over the context, ...), in its names
        raise in_responses_terms(bad_request(str(e), e.param)) from None
    return turn, handle, timer


@router.post("/responses")
async def create_response(request: Request) -> Response:
    st = state_of(request)
    req = await parse_body(request, ResponsesRequest)
    st.check_model(req.model)
    turn, handle, timer = await _start(st, req)
    if req.stream:
        return sse_response(_stream(turn, handle, timer))
    try:
        groups = await unless_disconnected(request, collect_all([handle], [timer]))
    except ClientDisconnected:
        return Response(status_code=499)
    if (err := failed(groups[0])) is not None:
        raise in_responses_terms(err)
    s = groups[0][0]
    turn.push(s.text, s.finished or "length", s.output_ids)
    await turn.finish(s)
    return OrjsonResponse(turn.body.model_dump())


async def _stream(turn: _Turn, handle: RequestHandle, timer: RequestTimer) -> AsyncIterator[bytes]:
    seq = 0

    def numbered(e: Event) -> bytes:
        nonlocal seq
        seq += 1
        return named_event(e | {"sequence_number": seq - 1})

    yield numbered({"type": "response.created", "response": turn.body.model_dump()})
    yield numbered({"type": "response.in_progress", "response": turn.body.model_dump()})
    s = Sample(0)
    try:
        async for c in metered(handle, timer):
            s.add(c)
            if c.finished == "error":
                raise request_failed(c)
            for e in turn.push(c.text, c.finished, c.token_ids):
                yield numbered(e)
        for e in await turn.finish(s):
            yield numbered(e)
        kind = "response.completed" if turn.body.status == "completed" else "response.incomplete"
        yield numbered({"type": kind, "response": turn.body.model_dump()})
    except Exception as e:  # the status line is sent already: the failure goes into the stream
        err = e if isinstance(e, APIError) else stream_failed(e)
        turn.body.status = "failed"
        turn.body.error = ResponseError(code="invalid_prompt" if err.status == 400 else "server_error",
                                        message=err.message)
        turn.body.output = turn.out.items
        yield numbered({"type": "response.failed", "response": turn.body.model_dump()})


@router.get("/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    item = state_of(request).responses.get(response_id)
    if item is None:
        raise _not_found(response_id)
    return OrjsonResponse(item.body)


@router.delete("/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    if not state_of(request).responses.delete(response_id):
        raise _not_found(response_id)
    return OrjsonResponse({"id": response_id, "object": "response.deleted", "deleted": True})
