"""The native, SGLang-compatible API: /generate, /health, /health_generate, /flush_cache, /abort_request,
/pause_generation, /continue_generation (the server's info routes are `runtime.http.server_info`'s).

`/generate` takes `text` or `input_ids`, one prompt or a batch, and returns `{"text", "output_ids",
"meta_info"}` per sample (a list for a batch or n > 1). Streamed, each event is one sample's (see `_stream`),
with its `index` (sample j of prompt i of a batch: the samples of the prompts before i, plus j). Every field of
SGLang's request (GenerateReqInput, and the router's additions) is known: the ones served are `GenerateRequest`'s,
the others are declined by `runtime.http.sglang_fields` (accepted at their default, a 400 naming them otherwise).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any, ClassVar, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator
from starlette.responses import Response

from radixk3.config import ConfigError
from radixk3.vision.image_processor import ProcessedImage
from runtime.errors import InvalidRequest
from runtime.http.api_errors import APIError, OrjsonResponse, parse_body, request_failed, stream_failed
from runtime.http.handles import (
    ClientDisconnected,
    Sample,
    collect_all,
    failed,
    merged,
    metered,
    submit_all,
    unless_disconnected,
)
from runtime.http.metrics import RequestTimer
from runtime.http.pd_fields import BootstrapFields
from runtime.http.sglang_fields import GENERATE_DECLINED, Declined, DeclinesSGLangFields
from runtime.http.sse import DONE, event, sse_response
from runtime.http.state import ServerState, state_of
from runtime.sampling_params import SamplingParams
from runtime.tokenizer.image_input import ImageLimits, expand_text_images, load_images
from runtime.tokenizer.manager import RequestHandle
from runtime.tokenizer.request_stream import StreamCursor

router = APIRouter()

NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class GenerateRequest(DeclinesSGLangFields, BootstrapFields):
    declined: ClassVar[Mapping[str, Declined]] = GENERATE_DECLINED

    text: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    # Checked field by field by the engine (runtime.sampling_params), against the model.
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: StrictBool = False
    rid: NonEmptyStr | list[NonEmptyStr] | None = None
    # SGLang sends these as null for "not asked": null is their default.
    return_logprob: StrictBool | None = None
    logprob_start_len: StrictInt | None = None
    top_logprobs_num: StrictInt | None = None
    return_text_in_logprobs: StrictBool = False
    # SGLang's spelling: one prompt's image or images (data: URLs, base64, or http(s) URLs with --allow-image-urls),
    # one per <|kimi_image_placeholder|> in its text; a batch: one entry (an image, a list, or null) per prompt.
    image_data: StrictStr | list[StrictStr | list[StrictStr] | None] | None = None
    # sglang-router's additions: the model as the OpenAI routes take its names; log_metrics=false keeps the
    # request out of /metrics (SGLang's health checks send it); no_logs: this server logs no request's content.
    model: StrictStr | None = None
    log_metrics: StrictBool = True
    no_logs: StrictBool = False

    @model_validator(mode="after")
    def _shape(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        n = len(self.prompts()) if self.is_batch else 1
        if self.is_batch and self.image_data is not None and (
                not isinstance(self.image_data, list) or len(self.image_data) != n):
            raise ValueError(f"image_data must hold one entry per prompt ({n})")
        for name in ("sampling_params", "rid"):
            value = getattr(self, name)
            if isinstance(value, list) and (not self.is_batch or len(value) != n):
                raise ValueError(f"{name} is a list of {len(value)} but the request has "
                                 f"{f'a batch of {n} prompts' if self.is_batch else 'a single prompt'}")
        return self

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or bool(self.input_ids and isinstance(self.input_ids[0], list))

    def prompts(self) -> list[str] | list[list[int]]:
        p: Any = self.text if self.text is not None else self.input_ids
        return p if self.is_batch else [p]

    @property
    def logprob_options(self) -> dict[str, Any]:
        """The logprob options as `submit_all` takes them, SGLang's null read as its default."""
        return {"return_logprob": bool(self.return_logprob),
                "logprob_start_len": -1 if self.logprob_start_len is None else self.logprob_start_len,
                "top_logprobs_num": self.top_logprobs_num or 0,
                "return_text_in_logprobs": self.return_text_in_logprobs}

    def images(self) -> list[list[tuple[str, str]]]:
        """Each prompt's images as (name, data), the names as errors give them."""
        d = self.image_data
        if d is None:
            return [[] for _ in self.prompts()]
        if not self.is_batch:
            return [[("image_data", d)] if isinstance(d, str) else [(f"image_data[{i}]", x) for i, x in enumerate(d)
                                                                      if isinstance(x, str)]]
        assert isinstance(d, list)
        return [[] if x is None else [(f"image_data[{p}]", x)] if isinstance(x, str)
                else [(f"image_data[{p}][{i}]", y) for i, y in enumerate(x)] for p, x in enumerate(d)]

    def per_prompt(self, name: str, n: int) -> list[Any]:
        value = getattr(self, name)
        return list(value) if isinstance(value, list) else [value] * n


@router.post("/generate")
async def generate(request: Request) -> Response:
    st = state_of(request)
    req = await parse_body(request, GenerateRequest)
    if req.model is not None:
        st.check_model(req.model)
    prompts = req.prompts()
    sps = _sampling_params(st, req, len(prompts))
    # The limits, before any prompt is encoded: samples in all against the queue, texts by their length.
    field = "text" if req.text is not None else "input_ids"
    st.tm.check_room(sum(sp.n for sp in sps), len(prompts), field if req.is_batch else "n")
    st.tm.limits.check_top_logprobs(req.top_logprobs_num or 0)
    for p, sp in zip(prompts, sps, strict=True):
        if isinstance(p, str):
            st.tm.limits.check_text(len(p), sp.max_new_tokens, "text")
    images = await _images(st, req)
    ids = [expand_text_images(p, ims, st.tokenizer, param=field).ids if ims and isinstance(p, str)
           else st.tokenizer.encode(p, add_bos=True) if isinstance(p, str) else list(p)
           for p, ims in zip(prompts, images, strict=True)]
    await st.tm.check_grammars(sps)  # parsed in a thread: a large grammar never stalls other requests
    handles = submit_all(st.tm, st.live, ids, sps, req.per_prompt("rid", len(ids)), images=images,
                         bootstrap=req.bootstrap(len(ids) if req.is_batch else 1), stream=bool(req.stream),
                         **req.logprob_options)
    timers = [st.metrics.timer(req.log_metrics) for _ in handles]
    if req.stream:
        return sse_response(_stream(st, req, ids, handles, timers))
    try:
        per_prompt = await unless_disconnected(request, collect_all(handles, timers))
    except ClientDisconnected:
        return Response(status_code=499)
    samples = [s for group in per_prompt for s in group]
    if (err := failed(samples)) is not None:
        raise err
    out = [handles[i].result_of(s) for i, group in enumerate(per_prompt) for s in group]
    return OrjsonResponse(out[0] if len(out) == 1 and not req.is_batch else out)


async def _images(st: ServerState, req: GenerateRequest) -> list[list[ProcessedImage]]:
    """Each prompt's images decoded and processed off the event loop; a 400 naming a bad one."""
    per_prompt = req.images()
    if not any(per_prompt):
        return [[] for _ in per_prompt]
    try:
        st.tm.procs.config.check_images(sum(len(x) for x in per_prompt))
    except ConfigError as e:
        raise InvalidRequest(str(e), param="image_data") from None
    limits = ImageLimits.of(st.args)
    return [await asyncio.to_thread(load_images, [d for _, d in found], limits, [n for n, _ in found])
            for found in per_prompt]


def _sampling_params(st: ServerState, req: GenerateRequest, n: int) -> list[SamplingParams]:
    """Each prompt's parsed sampling parameters; one object given for all is parsed once."""
    if isinstance(req.sampling_params, list):
        return [st.tm.parse_sampling(sp) for sp in req.sampling_params]
    return [st.tm.parse_sampling(req.sampling_params)] * n


async def _stream(st: ServerState, req: GenerateRequest, prompt_ids: list[list[int]], handles: list[RequestHandle],
                  timers: list[RequestTimer]) -> AsyncIterator[bytes]:
    """Events of every sample of every prompt as they come; sample j of prompt i is `index` offset_i + j.

    An event sends only what is new (SGLang's incremental streaming output), so a stream's bytes grow with its
    tokens, not with their square; a client rebuilds the whole result by concatenating its events' lists:
    - `text`: the sample's text so far, as SGLang's default stream sends it: SGLang's `RuntimeEndpoint` (and
      our `frontend_lang.RuntimeEndpoint`) reads `data["text"][len(seen):]`, `bench_serving` keeps the last
      event's `text` as the output;
    - `output_ids`: the new token ids (SGLang's incremental shape; none of those clients reads them);
    - `meta_info`: the counts so far (`completion_tokens`, which `bench_serving` reads per event, `prompt_tokens`,
      `cached_tokens`) and `finish_reason` / `error` at the end; with `return_logprob`, `output_token_logprobs`
      and `output_top_logprobs` of the new tokens only, `input_token_logprobs` once, in the first event
      with output (empty lists in the others), and `output_token_logprobs_length`, the output logprobs sent
      so far (SGLang's frontend checks it against `completion_tokens`).
    """
    offsets = [sum(len(h.rids) for h in handles[:i]) for i in range(len(handles))]
    samples = [[Sample(j) for j in range(len(h.rids))] for h in handles]
    cursors = [[StreamCursor() for _ in h.rids] for h in handles]
    try:
        async for i, chunk in merged([metered(h, t) for h, t in zip(handles, timers, strict=True)]):
            s = samples[i][chunk.index]
            s.add(chunk)
            if chunk.finished == "error":
                yield event(request_failed(s).body())
                continue
            out = handles[i].result_of(s, cursors[i][chunk.index])
            if req.return_logprob:  # the output logprobs sent so far, which SGLang's streams count
                out["meta_info"]["output_token_logprobs_length"] = len(s.logprobs)
            yield event(out | {"index": offsets[i] + chunk.index})
    except Exception as e:  # the engine went away mid-stream: say so in the stream, the status is sent already
        yield event(stream_failed(e).body())
    yield DONE


@router.get("/health")
async def health(request: Request) -> Response:
    st = state_of(request)
    if st.tm.dead is not None or st.procs.closed:
        raise APIError(503, f"the engine is down: {st.tm.dead or 'shut down'}", "server_error")
    if (stuck := st.tm.stuck) is not None:  # until the stuck process recovers
        raise APIError(503, f"the engine is stuck: {stuck}", "server_error")
    return OrjsonResponse({"status": "ok"})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy only if one token can be generated within 30 s."""
    st = state_of(request)
    handle = st.tm.submit([st.tokenizer.bos_id], {"max_new_tokens": 1, "temperature": 0}, deadline=30.0)
    try:
        [result] = await unless_disconnected(request, handle.result())
    except ClientDisconnected:
        return Response(status_code=499)
    except TimeoutError as e:
        raise APIError(503, f"generation is stuck: {e}", "server_error") from None
    if result["meta_info"]["finish_reason"]["type"] == "error":
        raise APIError(503, f"generation fails: {result['meta_info']['error']}", "server_error")
    return OrjsonResponse({"status": "ok"})


@router.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    st = state_of(request)
    if not await st.tm.flush_cache(timeout=10.0):
        raise APIError(409, "the cache was not flushed: requests are running or queued; retry when idle",
                       code="busy")
    return OrjsonResponse({"success": True, "message": "the radix cache is flushed"})


class PauseGeneration(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Literal["abort", "retract", "in_place"] = "abort"


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    """SGLang's pause (RL weight updates): no step runs until /continue_generation; requests sent meanwhile
    queue. `abort` (the default) aborts every request in flight, `in_place` keeps the running ones where they
    are, `retract` frees their memory and recomputes them after. An empty body takes the default."""
    st = state_of(request)
    req = await parse_body(request, PauseGeneration) if (await request.body()).strip() else PauseGeneration()
    await st.tm.pause_generation(req.mode, timeout=10.0)
    return OrjsonResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    await state_of(request).tm.continue_generation(timeout=10.0)
    return OrjsonResponse({"message": "Generation continued successfully.", "status": "ok"})


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rid: NonEmptyStr | None = None
    abort_all: StrictBool = False

    @model_validator(mode="after")
    def _one(self) -> AbortRequest:
        if (self.rid is None) == (not self.abort_all):
            raise ValueError("give rid, or abort_all=true")
        return self


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """Abort a request by the `rid` it was given (each of its n samples), or every request."""
    st = state_of(request)
    req = await parse_body(request, AbortRequest)
    handles = list(st.live.values()) if req.abort_all else [h for h in (st.live.get(req.rid),) if h is not None]
    if not handles and not req.abort_all:
        st.tm.abort(req.rid)  # a sample's own id ("rid-1"), or one that has just finished: ignored then
    for h in handles:
        h.abort()
    return OrjsonResponse({"success": True, "aborted": sum(len(h.rids) for h in handles)})
