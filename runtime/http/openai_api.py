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
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from radixk3.config import ConfigError
from radixk3.tokenizer import Tokenizer
from radixk3.vision.image_processor import ProcessedImage
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
from runtime.messages import Bootstrap
from runtime.sampling_params import SamplingParams
from runtime.tokenizer.chat_format import K3
from runtime.tokenizer.image_input import ImageLimits, load_images
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


def _completion_logprobs(tok: Tokenizer, ids: list[int], lps: Sequence[float | None],
                         tops: Sequence[list[Any] | None], offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs (as vLLM returns them): a token's text offset is where it starts in the text
    its tokens spell, from `offset`. A prompt's first token has no logprob: null, and null top logprobs."""
    out = CompletionLogprobs()
    for k, (t, lp) in enumerate(zip(ids, lps, strict=False)):
        piece = token_text(tok, t)
        out.tokens.append(piece)
        out.token_logprobs.append(lp)
        row = tops[k] if k < len(tops) else None
        out.top_logprobs.append(None if row is None else {token_text(tok, i): v for i, v in row})
        out.text_offset.append(offset)
        offset += len(piece)
    return out


def _echo_text(tok: Tokenizer, raw: str | list[int]) -> str:
    """The prompt as `echo` repeats it: the string sent, or the text of the ids sent (special tokens named)."""
    return raw if isinstance(raw, str) else tok.decode(raw, skip_special_tokens=False)


def _echoed_logprobs(tok: Tokenizer, prompt_ids: list[int], s: Sample | StreamChunk, output_ids: list[int],
                     offset: int) -> CompletionLogprobs:
    """The logprobs of `prompt_ids`, the prompt tokens whose input logprobs `s` holds, then of its outputs."""
    return _completion_logprobs(tok, [*prompt_ids, *output_ids], [*s.input_logprobs, *s.logprobs],
                                [*s.input_top_logprobs, *s.top_logprobs], offset)


# --- shared plumbing -----------------------------------------------------------------------------------


def _check_limits(st: ServerState, params: SamplingParams, prompts: int, top: int, top_param: str,
                  text_chars: list[int], text_param: str) -> None:
    """The door's limits, before any prompt is encoded: n, the samples of all prompts against the queue, the
    top logprobs, and the texts by their length."""
    st.tm.check_room(params.n * prompts, prompts, "n" if prompts == 1 else "prompt")
    st.tm.limits.check_top_logprobs(top, top_param)
    for chars in text_chars:
        st.tm.limits.check_text(chars, params.max_new_tokens, text_param)


async def submit(st: ServerState, prompts: list[list[int]], params: SamplingParams, rid: str | None,
                 logprobs: bool = False, top: int = 0, prompt_logprobs: bool = False,
                 images: Sequence[Sequence[ProcessedImage]] | None = None, bootstrap: Bootstrap | None = None,
                 stream: bool = True) -> tuple[list[RequestHandle], list[RequestTimer]]:
    """The prompts submitted (their grammar checked first), each with its metrics timer; one prompt keeps `rid`.
    `images`: each prompt's images, whose pad runs its ids hold; `bootstrap`: P/D disaggregation's room;
    `stream` False: the reply is sent whole (its tokens come from the scheduler in a few chunks)."""
    await st.tm.check_grammars([params])  # parsed in a thread: a large grammar never stalls other requests
    rids = [rid] if rid is not None and len(prompts) == 1 else [
        None if rid is None else f"{rid}-p{i}" for i in range(len(prompts))]
    handles = submit_all(st.tm, st.live, prompts, [params] * len(prompts), rids, images=images,
                         return_logprob=logprobs, logprob_start_len=0 if prompt_logprobs else -1,
                         top_logprobs_num=top, bootstrap=bootstrap, stream=stream)
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
    handles, timers = await submit(st, prompts, params, req.rid, want_lp, req.logprobs or 0,
                                    prompt_logprobs=want_lp and req.echo, bootstrap=req.bootstrap(len(prompts)),
                                    stream=bool(req.stream))
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    echoes = [_echo_text(st.tokenizer, p) if req.echo else "" for p in raw]
    if req.stream:
        return sse_response(_completion_stream(st, req, prompts, echoes, handles, timers, cid, created))
    groups = await _full(request, handles, timers)
    if groups is None:
        return Response(status_code=499)
    choices = [CompletionChoice(index=i * req.n + s.index, text=echoes[i] + s.text, finish_reason=s.finished,
                                logprobs=_echoed_logprobs(st.tokenizer, prompts[i] if req.echo else [], s,
                                                          s.output_ids, 0) if want_lp else None)
               for i, g in enumerate(groups) for s in g]
    body = CompletionResponse(id=cid, created=created, model=st.model_name, choices=choices, usage=_usage(groups))
    return OrjsonResponse(body.model_dump())


async def _completion_stream(st: ServerState, req: CompletionRequest, prompts: list[list[int]], echoes: list[str],
                             handles: list[RequestHandle], timers: list[RequestTimer], cid: str, created: int
                             ) -> AsyncIterator[bytes]:
    """With `echo`, a choice's first event starts with the prompt's text, and its prompt logprobs come, in
    prompt order, before the output tokens of the events that carry them."""
    groups = [[Sample(j) for j in range(req.n)] for _ in handles]
    offsets = [0] * (len(handles) * req.n)
    echoed = [0] * (len(handles) * req.n)  # prompt tokens whose logprobs a choice has sent
    started = [False] * (len(handles) * req.n)
    try:
        async for index, c in _chunks(handles, timers, req.n):
            prompt = index // req.n
            groups[prompt][c.index].add(c)
            if c.finished == "error":
                yield _chunk_error(c)
                continue
            text = c.text if started[index] else echoes[prompt] + c.text
            started[index] = True
            lp = None
            if req.logprobs is not None:
                n_in = len(c.input_logprobs)
                lp = _echoed_logprobs(st.tokenizer, prompts[prompt][echoed[index]:echoed[index] + n_in], c,
                                      c.token_ids, offsets[index])
                echoed[index] += n_in
                if lp.tokens:  # the next event's tokens start where this one's end, as in the whole response
                    offsets[index] = lp.text_offset[-1] + len(lp.tokens[-1])
            choice = CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=c.finished)
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
    plan = await plan_chat(st, req)
    handles, timers = await submit(st, [plan.prompt], plan.params, req.rid, req.logprobs, req.top_logprobs or 0,
                                   images=[plan.images], bootstrap=req.bootstrap(1), stream=bool(req.stream))
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        return sse_response(_chat_stream(st, req, handles, timers, cid, created, plan.chat))
    groups = await _full(request, handles, timers)
    if groups is None:
        return Response(status_code=499)
    choices = [_chat_choice(st.tokenizer, req, plan.chat, s) for s in groups[0]]
    body = ChatCompletionResponse(id=cid, created=created, model=st.model_name, choices=choices, usage=_usage(groups))
    return OrjsonResponse(body.model_dump())


@dataclass(frozen=True)
class RenderedChat:
    """A chat rendered in the model's chat format: K3's encoding, a Jinja template's, or neither (the model's
    own framing); the same for every API that speaks in chats (chat completions, Anthropic's Messages)."""

    req: ChatCompletionRequest
    k3: K3Chat | None
    tpl: TemplateChat | None

    def ids(self, tok: Tokenizer) -> list[int]:
        # Messages are text: markers only where rendered.
        return self.tpl.ids(tok) if self.tpl is not None else _chat_prompt(tok, self.req, self.k3)

    def sampling(self) -> dict[str, Any]:
        return _chat_sampling(self.req, self.k3, self.tpl)

    def parser(self) -> ReplyParser | None:
        return _parser(self.k3, self.tpl)

    def reply(self, tok: Tokenizer) -> ChatReply | None:
        """A reader of one choice's streamed text, when the chat's replies are parsed."""
        parser = self.parser()
        return None if parser is None else ChatReply(parser, tok, separate_reasoning=self.req.separate_reasoning,
                                                     stream_reasoning=self.req.stream_reasoning)

    def message(self, tok: Tokenizer, s: Sample) -> tuple[AssistantMessage, str | None]:
        """A whole (non-streamed) choice's message and finish reason."""
        if (parser := self.parser()) is None:
            return AssistantMessage(content=s.text), s.finished
        return whole_reply(parser, tok, s.text, s.finished, s.output_ids,
                           separate_reasoning=self.req.separate_reasoning)


@dataclass(frozen=True)
class ChatPlan:
    """A chat ready to submit: its prompt's ids and its sampling parameters, checked against the door's limits."""

    chat: RenderedChat
    prompt: list[int]
    params: SamplingParams
    images: list[ProcessedImage] = field(default_factory=list)  # the image parts', whose pad runs `prompt` holds

    def reply(self, tok: Tokenizer) -> ChatReply | None:
        """A reader of one choice's text, when the chat's replies are parsed."""
        return self.chat.reply(tok)


async def render_chat(st: ServerState, req: ChatCompletionRequest, images: Sequence[ProcessedImage] = ()
                      ) -> RenderedChat:
    """The chat in the model's format (a 400 for what the format cannot render), its image parts expanded for
    `images` (K3's encoding only); a forced call's grammar is built off the event loop."""
    k3, tpl = None, None
    if images and (st.chat_format.templated or not _renders_k3(st, req)):
        raise APIError(400, "images need K3's chat encoding; this model's chat format cannot place them",
                       "invalid_request_error", param="messages")
    if st.chat_format.templated:  # the checkpoint's own template (runtime.tokenizer.chat_format)
        tpl = await asyncio.to_thread(plan_template_chat, req, st.chat_format, st.args.max_grammar_bytes)
    elif _renders_k3(st, req):
        k3 = await asyncio.to_thread(plan_k3_chat, req, st.args.max_grammar_bytes, [im.slot for im in images])
    return RenderedChat(req, k3, tpl)


async def chat_images(st: ServerState, req: ChatCompletionRequest) -> list[ProcessedImage]:
    """The chat's image parts, in the order its prompt places them, decoded and processed off the event loop; a
    400 naming the part (`messages[i].content[j]`) for a bad one."""
    found = [(f"messages[{i}].content[{j}]", url) for i, m in enumerate(req.messages) for j, url in m.image_urls()]
    if not found:
        return []
    for i, m in enumerate(req.messages):
        if m.role == "tool" and m.image_urls():
            raise APIError(400, "a tool message cannot carry an image part", "invalid_request_error",
                           param=f"messages[{i}]")
    try:
        st.tm.procs.config.check_images(len(found))
    except ConfigError as e:
        raise APIError(400, str(e), "invalid_request_error", param=found[0][0]) from None
    return await asyncio.to_thread(load_images, [u for _, u in found], ImageLimits.of(st.args), [n for n, _ in found])


async def plan_chat(st: ServerState, req: ChatCompletionRequest) -> ChatPlan:
    """The chat rendered, its sampling parameters parsed and the door's limits checked: ready to submit."""
    images = await chat_images(st, req)
    chat = await render_chat(st, req, images)
    params = st.tm.parse_sampling(chat.sampling())
    _check_limits(st, params, 1, req.top_logprobs or 0, "top_logprobs",
                  [sum(len(m.text()) for m in req.messages)], "messages")
    return ChatPlan(chat, chat.ids(st.tokenizer), params, images)


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


def _chat_choice(tok: Tokenizer, req: ChatCompletionRequest, chat: RenderedChat, s: Sample) -> ChatChoice:
    message, finish = chat.message(tok, s)
    lp = _chat_logprobs(tok, s.output_ids, s.logprobs, s.top_logprobs) if req.logprobs else None
    return ChatChoice(index=s.index, message=message, finish_reason=finish, logprobs=lp)


async def _chat_stream(st: ServerState, req: ChatCompletionRequest, handles: list[RequestHandle],
                       timers: list[RequestTimer], cid: str, created: int, chat: RenderedChat
                       ) -> AsyncIterator[bytes]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        body = ChatCompletionChunk(id=cid, created=created, model=st.model_name, choices=choices, usage=usage)
        return event(body.model_dump(exclude_none=usage is None))

    groups = [[Sample(j) for j in range(req.n)]]
    replies = [chat.reply(st.tokenizer) for _ in range(req.n)]
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
