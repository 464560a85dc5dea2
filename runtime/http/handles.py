"""How the HTTP routes consume a request handle: chunks metered for /metrics, samples assembled, and the
request aborted when its client goes away (a closed stream, a disconnect while waiting for a full response).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, MutableMapping, Sequence
from typing import Any, TypeVar

from starlette.requests import Request

from radixk3.vision.image_processor import ProcessedImage
from runtime.http.api_errors import APIError, request_failed
from runtime.http.metrics import RequestTimer
from runtime.sampling_params import SamplingParams
from runtime.tokenizer.manager import RequestHandle, TokenizerManager
from runtime.tokenizer.request_stream import Sample, StreamChunk

T = TypeVar("T")


def failed(samples: Iterable[Sample]) -> APIError | None:
    """The error of the first sample that failed, if one did."""
    bad = next((s for s in samples if s.finished == "error"), None)
    return None if bad is None else request_failed(bad)


async def metered(handle: RequestHandle, timer: RequestTimer) -> AsyncIterator[StreamChunk]:
    """The handle's chunks, timed; if the consumer stops early, the request is aborted (memory freed)."""
    left = len(handle.rids)
    try:
        async for chunk in handle.stream():
            timer.chunk(chunk.index, len(chunk.token_ids))
            if chunk.finished is not None:
                timer.finish(chunk.finished, chunk.prompt_tokens)
                left -= 1
            yield chunk
    finally:
        if left > 0:  # the consumer left (disconnect, cancel): abort, and count the samples as aborted
            handle.abort()
            for _ in range(left):
                timer.finish("abort", 0)


async def collect(handle: RequestHandle, timer: RequestTimer) -> list[Sample]:
    samples = [Sample(i) for i in range(len(handle.rids))]
    async for chunk in metered(handle, timer):
        samples[chunk.index].add(chunk)
    return samples


async def collect_all(handles: Sequence[RequestHandle], timers: Sequence[RequestTimer]) -> list[list[Sample]]:
    tasks = [asyncio.ensure_future(collect(h, t)) for h, t in zip(handles, timers, strict=True)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:  # one failed or we were cancelled: the others must not run on unattended
            t.cancel()


class ClientDisconnected(Exception):
    """The client closed the connection before its full response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnected (with `work` cancelled, aborting its requests) if the client
    leaves first. For full (non-streaming) responses; Starlette watches streaming ones itself."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled (shutdown): so is the work
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientDisconnected()
    return task.result()


_END = object()


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index; leaving early (or one stream
    failing) cancels the others, which aborts their requests."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, _END, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is _END:
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


def submit_all(tm: TokenizerManager, live: MutableMapping[str, RequestHandle], prompts: Sequence[list[int] | str],
               params: Sequence[SamplingParams], rids: Sequence[str | None],
               images: Sequence[Sequence[ProcessedImage]] | None = None, **kw: Any) -> list[RequestHandle]:
    """Submit every prompt of a batch, or none: each is validated (`TokenizerManager.prepare`), then the batch is
    checked as a whole against the queue and sent (`send`), so a refused batch leaves nothing running and never
    takes the room of a request beside it. Each handle is listed in `live` (weak values) under its request id,
    for /abort_request."""
    images = images if images is not None else [()] * len(prompts)
    subs = [tm.prepare(ids, sp, rid=rid or uuid.uuid4().hex, images=ims, **kw)
            for ids, sp, rid, ims in zip(prompts, params, rids, images, strict=True)]
    handles = tm.send(subs)
    for sub, handle in zip(subs, handles, strict=True):
        live[sub.rid] = handle
    return handles
