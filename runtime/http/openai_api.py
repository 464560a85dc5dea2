"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

A request of p prompts and n samples is p engine submissions of n samples each; choice `i * n + j` is sample
j of prompt i. Streams are server-sent events ending with `data: [DONE]`, with a final usage chunk when
`stream_options.include_usage` is set.

A completion's string prompt is raw (the caller owns the template: marker strings become their special ids, as
in SGLang); a chat's messages are text, encoded ordinarily between the markers its renderer placed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from radixk3.tokenizer import Tokenizer
from runtime.http.api_errors import APIError, OrjsonResponse, parse_body, request_failed, stream_failed
from runtime.http.chat_reply import ChatReply, ReplyParser, whole_reply
from runtime.http.handles import (
    ClientDisconnected,
    collect_all,
    failed,
    merged,
    metered,
    submit_all,
    unless_disconnected,
)
from runtime.http.k3_chat import K3Chat, k3_sampling, plan_k3_chat
from runtime.http.metrics import RequestTimer
from runtime.http.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from runtime.http.sse import DONE, event, sse_response
from runtime.http.state import ServerState, state_of
from runtime.http.template_chat import (
    TemplateChat,
    plan_template_chat,
    template_sampling,
)
from runtime.sampling_params import SamplingParams
from runtime.tokenizer.chat_format import K3
from runtime.tokenizer.manager import RequestHandle
from runtime.tokenizer.request_stream import Sample, StreamChunk, token_text

router = APIRouter(prefix="/v1")


def _usage(groups: Sequence[Sequence[Sample]]) -> Usage:
    prompt = sum(g[0].prompt_tokens for g in groups)
    completion = sum(len(s.output_ids) for g in groups for s in g)
    cached = sum(max(s.cached_tokens for s in g) for g in groups)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# --- logprobs ------------------------------------------------------------------------------------------


def _chat_logprobs(tok: Tokenizer, ids: list[int], lps: list[float], tops: list[list[Any]]) -> ChoiceLogprobs:
    content = []
    for k, (t, lp) in enumerate(zip(ids, lps, strict=False)):
        top = [TopLogprob(token=token_text(tok, i), logprob=v, bytes=list(tok.token_bytes(i, False)))
               for i, v in (tops[k] if k < len(tops) else [])]
        content.append(TokenLogprob(token=token_text(tok, t), logprob=lp, bytes=list(tok.token_bytes(t, False)),
                                    top_logprobs=top))
    return ChoiceLogprobs(content=content)


def _completion_logprobs(tok: Tokenizer, ids: list[int], lps: list[float], tops: list[list[Any]],
                         offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for k, (t, lp) in enumerate(zip(ids, lps, strict=False)):
        piece = token_text(tok, t)
        out.tokens.append(piece)
        out.token_logprobs.append(lp)
        out.top_logprobs.append({token_text(tok, i): v for i, v in tops[k]} if k < len(tops) else None)
        out.text_offset.append(offset)
        offset += len(piece)
    return out


# --- shared plumbing -----------------------------------------------------------------------------------


def _check_limits(st: ServerState, params: SamplingParams, prompts: int, top: int, top_param: str,
                  text_chars: list[int], text_param: str) -> None:
    """The door's limits, before any prompt is encoded: n, the samples of all prompts against the queue, the
    top logprobs, and the texts by their length."""
    st.tm.check_room(params.n * prompts, prompts, "n" if prompts == 1 else "prompt")
    st.tm.limits.check_top_logprobs(top, top_param)
    for chars in text_chars:
        st.tm.limits.check_text(chars, params.max_new_tokens, text_param)


async def _submit(st: ServerState, prompts: list[list[int]], params: SamplingParams, rid: str | None,
                  logprobs: bool, top: int) -> tuple[list[RequestHandle], list[RequestTimer]]:
    await st.tm.check_grammars([params])  # parsed in a thread: a large grammar never stalls other requests
    rids = [rid] if rid is not None and len(prompts) == 1 else [
        None if rid is None else f"{rid}-p{i}" for i in range(len(prompts))]
    handles = submit_all(st.tm, st.live, prompts, [params] * len(prompts), rids,
                         return_logprob=logprobs, top_logprobs_num=top)
    return handles, [st.metrics.timer() for _ in handles]


async def _full(request: Request, handles: list[RequestHandle], timers: list[RequestTimer]
                ) -> list[list[Sample]] | None:
    try:
        groups = await unless_disconnected(request, collect_all(handles, timers))
    except ClientDisconnected:
        return None
    if (err := failed(s for g in groups for s in g)) is not None:
        raise err
    return groups


async def _chunks(handles: list[RequestHandle], timers: list[RequestTimer], n: int
                  ) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(choice index, chunk) of every sample of every prompt, as they come."""
    async for i, chunk in merged([metered(h, t) for h, t in zip(handles, timers, strict=True)]):
        yield i * n + chunk.index, chunk


def _stream_error(e: BaseException) -> bytes:
    return event(stream_failed(e).body())


def _chunk_error(c: StreamChunk) -> bytes:
    return event(request_failed(c).body())


# --- routes --------------------------------------------------------------------------------------------


@router.get("/models")
async def models(request: Request) -> Response:
    st = state_of(request)
    card = ModelCard(id=st.model_name, created=st.started, root=st.model_path,
                     max_model_len=st.tm.context_length)
    return OrjsonResponse(ModelList(data=[card]).model_dump())


@router.post("/completions")
async def completions(request: Request) -> Response:
    st = state_of(request)
    req = await parse_body(request, CompletionRequest)
    st.check_model(req.model)
    params = st.tm.parse_sampling(req.sampling(req.max_tokens))
    raw = req.prompts()
    _check_limits(st, params, len(raw), req.logprobs or 0, "logprobs",
                  [len(p) for p in raw if isinstance(p, str)], "prompt")
    prompts = [st.tokenizer.encode(p, add_bos=True) if isinstance(p, str) else list(p) for p in raw]
    want_lp = req.logprobs is not None
    handles, timers = await _submit(st, prompts, params, req.rid, want_lp, req.logprobs or 0)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        return sse_response(_completion_stream(st, req, handles, timers, cid, created))
    groups = await _full(request, handles, timers)
    if groups is None:
        return Response(status_code=499)
    choices = [CompletionChoice(index=i * req.n + s.index, text=s.text, finish_reason=s.finished,
                                logprobs=_completion_logprobs(st.tokenizer, s.output_ids, s.logprobs, s.top_logprobs, 0)
                                if want_lp else None)
               for i, g in enumerate(groups) for s in g]
    body = CompletionResponse(id=cid, created=created, model=st.model_name, choices=choices, usage=_usage(groups))
    return OrjsonResponse(body.model_dump())


async def _completion_stream(st: ServerState, req: CompletionRequest, handles: list[RequestHandle],
                             timers: list[RequestTimer], cid: str, created: int) -> AsyncIterator[bytes]:
    groups = [[Sample(j) for j in range(req.n)] for _ in handles]
    offsets = [0] * (len(handles) * req.n)
    try:
        async for index, c in _chunks(handles, timers, req.n):
            groups[index // req.n][c.index].add(c)
            if c.finished == "error":
                yield _chunk_error(c)
                continue
            lp = None
            if req.logprobs is not None:
                lp = _completion_logprobs(st.tokenizer, c.token_ids, c.logprobs, c.top_logprobs, offsets[index])
                offsets[index] += len(c.text)
            choice = CompletionChoice(index=index, text=c.text, logprobs=lp, finish_reason=c.finished)
            yield event(CompletionResponse(id=cid, created=created, model=st.model_name, choices=[choice]
                                           ).model_dump(exclude_none=True))
        if req.include_usage:
            yield event(CompletionResponse(id=cid, created=created, model=st.model_name, choices=[],
                                           usage=_usage(groups)).model_dump())
    except Exception as e:  # the status line is sent already: the failure goes into the stream
        yield _stream_error(e)
    yield DONE


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    st = state_of(request)
    req = await parse_body(request, ChatCompletionRequest)
    st.check_model(req.model)
    k3, tpl = None, None
    if st.chat_format.templated:  # the checkpoint's own template (runtime.tokenizer.chat_format)
        tpl = await asyncio.to_thread(plan_template_chat, req, st.chat_format, st.args.max_grammar_bytes)
    elif _renders_k3(st, req):  # a forced call's grammar is built off the loop
        k3 = await asyncio.to_thread(plan_k3_chat, req, st.args.max_grammar_bytes)
    params = st.tm.parse_sampling(_chat_sampling(req, k3, tpl))
    top = req.top_logprobs or 0
    _check_limits(st, params, 1, top, "top_logprobs", [sum(len(m.text()) for m in req.messages)], "messages")
    # Messages are text: markers only where rendered.
    prompt = tpl.ids(st.tokenizer) if tpl is not None else _chat_prompt(st.tokenizer, req, k3)
    handles, timers = await _submit(st, [prompt], params, req.rid, req.logprobs, top)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        return sse_response(_chat_stream(st, req, handles, timers, cid, created, k3, tpl))
    groups = await _full(request, handles, timers)
    if groups is None:
        return Response(status_code=499)
    choices = [_chat_choice(st.tokenizer, req, k3, tpl, s) for s in groups[0]]
    body = ChatCompletionResponse(id=cid, created=created, model=st.model_name, choices=choices, usage=_usage(groups))
    return OrjsonResponse(body.model_dump())


def _renders_k3(st: ServerState, req: ChatCompletionRequest) -> bool:
    """Without a template (`runtime.tokenizer.chat_format`): K3's own encoding (`runtime.tokenizer.k3_encoding`)
    for every chat of a K3 model; for another model only for a request that needs K3's markup (tools, reasoning),
    if its tokenizer has the markers; else the model's own framing (`Tokenizer.chat_prompt`)."""
    if st.chat_format.family == K3:
        return True
    if req.is_k3 and not st.tokenizer.has_xtml:
        raise APIError(400, "tools and thinking need K3's markup tokens (<|open|>, <|close|>, <|sep|>, "
                       "<|end_of_msg|>), which this model's tokenizer lacks", "invalid_request_error", param="tools")
    return req.is_k3


def _chat_prompt(tok: Tokenizer, req: ChatCompletionRequest, k3: K3Chat | None) -> list[int]:
    if k3 is not None:
        return k3.prompt.ids(tok)
    if req.continue_final_message:
        raise APIError(400, "continue_final_message needs a chat template or K3's encoding; this model has neither",
                       "invalid_request_error", param="continue_final_message")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in req.messages]
    return tok.chat_prompt(messages).ids(tok)


def _chat_sampling(req: ChatCompletionRequest, k3: K3Chat | None, tpl: TemplateChat | None) -> dict[str, Any]:
    sampling = req.sampling(req.max_new_tokens)
    if tpl is not None:
        return template_sampling(tpl, sampling)
    return sampling if k3 is None else k3_sampling(k3, sampling)


def _parser(k3: K3Chat | None, tpl: TemplateChat | None) -> ReplyParser | None:
    """The reader of one choice's text, when the chat's replies are parsed."""
    if k3 is not None:
        return k3.parser()
    if tpl is not None and tpl.parses:
        return tpl.parser()
    return None


def _reply(tok: Tokenizer, req: ChatCompletionRequest, k3: K3Chat | None, tpl: TemplateChat | None
           ) -> ChatReply | None:
    parser = _parser(k3, tpl)
    return None if parser is None else ChatReply(parser, tok, separate_reasoning=req.separate_reasoning,
                                                 stream_reasoning=req.stream_reasoning)


def _chat_choice(tok: Tokenizer, req: ChatCompletionRequest, k3: K3Chat | None, tpl: TemplateChat | None,
                 s: Sample) -> ChatChoice:
    message, finish = AssistantMessage(content=s.text), s.finished
    if (parser := _parser(k3, tpl)) is not None:
        message, finish = whole_reply(parser, tok, s.text, s.finished, s.output_ids,
                                      separate_reasoning=req.separate_reasoning)
    lp = _chat_logprobs(tok, s.output_ids, s.logprobs, s.top_logprobs) if req.logprobs else None
    return ChatChoice(index=s.index, message=message, finish_reason=finish, logprobs=lp)


async def _chat_stream(st: ServerState, req: ChatCompletionRequest, handles: list[RequestHandle],
                       timers: list[RequestTimer], cid: str, created: int, k3: K3Chat | None,
                       tpl: TemplateChat | None) -> AsyncIterator[bytes]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        body = ChatCompletionChunk(id=cid, created=created, model=st.model_name, choices=choices, usage=usage)
        return event(body.model_dump(exclude_none=usage is None))

    groups = [[Sample(j) for j in range(req.n)]]
    replies = [_reply(st.tokenizer, req, k3, tpl) for _ in range(req.n)]
    try:
        # The role comes first, as OpenAI sends it, before any text.
        yield chunk([ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
                     for j in range(req.n)])
        async for index, c in _chunks(handles, timers, req.n):
            groups[0][c.index].add(c)
            if c.finished == "error":
                yield _chunk_error(c)
                continue
            lp = _chat_logprobs(st.tokenizer, c.token_ids, c.logprobs, c.top_logprobs) if req.logprobs else None
            delta = DeltaMessage(content=c.text) if c.text or c.finished is None else DeltaMessage()
            finish = c.finished
            if (reply := replies[c.index]) is not None:
                delta, finish = reply.push(c.text, c.finished, c.token_ids), reply.finish_reason(c.finished)
            yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish)])
        if req.include_usage:
            yield chunk([], _usage(groups))
    except Exception as e:
        yield _stream_error(e)
    yield DONE
