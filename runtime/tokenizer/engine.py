"""The offline API: `Engine(model=..., **server_args)`. The calling process is the tokenizer process: it
starts the scheduler and worker processes (`EngineProcesses`) and runs a `TokenizerManager` on an event loop
in a background thread. The sync methods wait on that loop; `async_generate` / `async_stream` run on the
caller's own event loop, each chunk handed straight to it.

A script may start an Engine at top level, without `if __name__ == "__main__":`: the children are spawned
without re-running the script (see `engine_processes.main_module_hidden`).
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from radixk3.tokenizer import Tokenizer
from radixk3.vision.image_processor import ProcessedImage
from runtime.engine_processes import EngineProcesses
from runtime.errors import EngineError, EngineOverloaded, InvalidRequest
from runtime.server_args import ServerArgs
from runtime.tokenizer.image_input import ImageLimits, load_images
from runtime.tokenizer.manager import SHUT_DOWN, RequestHandle, TokenizerManager
from runtime.tokenizer.request_stream import StreamChunk

__all__ = ["Engine", "EngineError", "EngineOverloaded", "StreamChunk"]

T = TypeVar("T")
Prompts = str | list[int] | list[str] | list[list[int]]


def whole(kw: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """The options of a call that returns whole results: its requests are not streamed (the scheduler sends their
    tokens in a few chunks), unless `timeout` bounds the wait for each chunk, which then keeps its meaning."""
    if "stream" in kw:  # SGLang's Engine.generate(stream=True) returns an iterator; here that is `stream`
        raise TypeError("stream is not an option of a call that returns whole results: use Engine.stream / "
                        "async_stream for chunks")
    return kw | {"timeout": timeout, "stream": timeout is not None}


class Engine:
    def __init__(self, model: str | None = None, *, startup_timeout: float = 120.0, **kwargs: Any) -> None:
        self.args = ServerArgs(model=model, **kwargs)
        self.procs = EngineProcesses(self.args, startup_timeout)
        self.tokenizer: Tokenizer = self.procs.tokenizer
        self._lock = threading.Lock()
        self._closed = False
        self._submitted: dict[str, RequestHandle] = {}  # handles of `submit`, until `wait` takes them
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="radixk3-engine-loop")
        self._thread.start()
        self.tm = TokenizerManager(self.args, self.procs)
        try:
            self._call(self.tm.start())
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)

    # --- the loop thread -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise self.tm.dead or EngineError(SHUT_DOWN)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the engine's loop and wait; an interrupt while waiting cancels it (which aborts)."""
        if self._closed:
            coro.close()
            self._check_open()
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    async def _on_loop(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return fn(*args, **kw)

    async def _images(self, image_data: Any, count: int, single: bool) -> list[list[ProcessedImage]]:
        """`image_data` as SGLang's Engine takes it (one prompt: an image or a list of them; a batch: one entry,
        an image or a list, per prompt), decoded and processed off this loop, per prompt."""
        if image_data is None:
            return [[] for _ in range(count)]
        if single:
            per_prompt = [image_data]
        elif isinstance(image_data, list) and len(image_data) == count:
            per_prompt = list(image_data)
        else:
            raise InvalidRequest(f"image_data must hold one entry per prompt ({count})", param="image_data")
        items = [[] if x is None else list(x) if isinstance(x, list | tuple) else [x] for x in per_prompt]
        limits = ImageLimits.of(self.args)
        return [await asyncio.to_thread(load_images, its, limits,
                                        [f"image_data[{i}]" if single else f"image_data[{p}][{i}]"
                                         for i in range(len(its))])
                for p, its in enumerate(items)]

    async def _submit_for(self, consumer: asyncio.AbstractEventLoop, prompt: str | list[int],
                          sampling: dict[str, Any] | None, kw: dict[str, Any]) -> RequestHandle:
        """`TokenizerManager.submit` with the options in `kw`, its grammar parsed off this loop first (other
        requests' chunks keep flowing)."""
        params = self.tm.parse_sampling(sampling)
        await self.tm.check_grammars([params])
        (images,) = await self._images(kw.pop("image_data", None), 1, True)
        timing = {k: kw.pop(k) for k in ("timeout", "deadline") if k in kw}
        sub = self.tm.prepare(prompt, params, images=images, **kw)
        return self.tm.send([sub], consumer=consumer, **timing)[0]

    async def _submit_many(self, consumer: asyncio.AbstractEventLoop, prompts: Prompts,
                           sampling_params: dict[str, Any] | list[dict[str, Any]] | None, kw: dict[str, Any]
                           ) -> tuple[bool, list[RequestHandle]]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts)
                                              and isinstance(prompts[0], int))
        batch: list[Any] = [prompts] if single else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params)} sampling_params")
        rids = kw.pop("rid", None)
        rids = [rids] if single or rids is None else list(rids)
        if rids != [None] and len(rids) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(rids)} rids")
        parsed = [self.tm.parse_sampling(sp) for sp in params]
        await self.tm.check_grammars(parsed)  # off this loop; then the batch is sent all or none
        images = await self._images(kw.pop("image_data", None), len(batch), single)
        options = {k: v for k, v in kw.items() if k not in ("timeout", "deadline")}
        subs = [self.tm.prepare(p, sp, rid=rids[i] if rids != [None] else None, images=images[i], **options)
                for i, (p, sp) in enumerate(zip(batch, parsed, strict=True))]
        handles = self.tm.send(subs, consumer=consumer, timeout=kw.get("timeout"), deadline=kw.get("deadline"))
        return single, handles

    @staticmethod
    async def _results(single: bool, handles: list[RequestHandle]) -> dict[str, Any] | list[dict[str, Any]]:
        """All results (one dict for a single prompt of one sample); the first failure (a timeout, a
        cancellation) cancels the rest, which aborts them."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(h.result()) for h in handles]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None  # the first failure, as a plain exception
        results = [r for t in tasks for r in t.result()]
        return results[0] if single and len(results) == 1 else results

    # --- lifecycle -------------------------------------------------------------------------------------
    @property
    def dead(self) -> EngineError | None:
        return self.tm.dead if hasattr(self, "tm") else self.procs.dead

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self.tm.close(), self._loop).result(timeout=10)
            except Exception:
                pass  # never started, or the loop is gone: nothing is left to fail
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self.procs.shutdown()
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- sync API --------------------------------------------------------------------------------------
    def generate(self, prompts: Prompts, sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                 timeout: float | None = None, **kw: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (a dict, or a list of n dicts for n > 1) or a batch (a list, n per prompt),
        all submitted at once. `timeout` bounds the wait for each chunk; expiring aborts every request of
        the call, as does `deadline` (seconds the whole request may take). `rid` (a str, or one per prompt)
        names the requests, so another thread can abort them; also `return_logprob`, `logprob_start_len`,
        `top_logprobs_num`, `return_text_in_logprobs` as in `TokenizerManager.submit`. `image_data` (SGLang's
        spelling; a model with a vision tower): a prompt's images (data: URLs, base64, bytes, PIL images), one
        per `<|kimi_image_placeholder|>` in its prompt, in order; for a batch, one entry per prompt."""

        async def run() -> dict[str, Any] | list[dict[str, Any]]:
            single, handles = await self._submit_many(self._loop, prompts, sampling_params, whole(kw, timeout))
            return await self._results(single, handles)

        return self._call(run())

    def submit(self, prompt: str | list[int], sampling_params: dict[str, Any] | None = None, **kw: Any) -> list[str]:
        """Send one request (n samples) and return its ids at once; `wait(ids)` collects the results."""
        handle = self._call(self._submit_for(self._loop, prompt, sampling_params, whole(kw, kw.get("timeout"))))
        self._submitted[handle.rids[0]] = handle
        return list(handle.rids)

    def wait(self, rids: list[str], timeout: float | None = None) -> list[dict[str, Any]]:
        """The results of a `submit`, one dict per sample; `timeout` bounds the whole wait (then aborts)."""
        handle = self._submitted.pop(rids[0], None)
        if handle is None or handle.rids != list(rids):
            raise KeyError(f"no submitted request with ids {rids} (each submit is waited for once)")

        async def run() -> list[dict[str, Any]]:
            try:
                async with asyncio.timeout(timeout):
                    return await handle.result()
            except TimeoutError:
                raise TimeoutError(f"request {', '.join(rids)} did not finish within {timeout}s") from None

        return self._call(run())

    def stream(self, prompt: str | list[int], sampling_params: dict[str, Any] | None = None,
               timeout: float | None = None, **kw: Any) -> Iterator[StreamChunk]:
        """StreamChunks of one request (all n samples, tagged with `index`) as they are produced; each sample
        ends with a chunk with `finished` set. Closing the iterator, or dropping it, aborts the request."""
        handle = self._call(self._submit_for(self._loop, prompt, sampling_params, kw | {"timeout": timeout}))
        return self._iterate(handle)

    def _iterate(self, handle: RequestHandle) -> Iterator[StreamChunk]:
        agen = handle.stream()

        async def step() -> StreamChunk:
            return await agen.__anext__()

        try:
            while True:
                try:
                    chunk = self._call(step())
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            self._close_stream(handle, agen)

    def _close_stream(self, handle: RequestHandle, agen: AsyncIterator[StreamChunk]) -> None:
        try:
            handle.abort()
        except EngineError:
            return
        if threading.get_ident() == self._thread.ident or not self._loop.is_running():
            return  # collected on the loop thread itself: the abort above is enough, never wait here
        try:
            asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop).result(timeout=5)  # type: ignore[attr-defined]
        except Exception:
            pass

    def abort(self, rid: str) -> None:
        """Abort a request by id (its result or stream ends with finish reason "abort")."""
        self._check_open()
        self.tm.abort(rid)

    def get_metrics(self, timeout: float = 10.0) -> dict[str, Any]:
        """The scheduler's counters: running, queued, prefill tokens computed, cached tokens, state checkpoint
        hits/misses, pool bytes per side, evictions, retractions, checkpoints."""
        return self._call(self.tm.get_metrics(timeout))

    def flush_cache(self) -> bool:
        return self._call(self.tm.flush_cache())

    def model_info(self) -> dict[str, Any]:
        return self._call(self._on_loop(self.tm.model_info))

    # --- async API (on the caller's event loop) --------------------------------------------------------
    async def _submit_here(self, prompts: Prompts, sampling_params: Any, kw: dict[str, Any]
                           ) -> tuple[bool, list[RequestHandle]]:
        self._check_open()
        here = asyncio.get_running_loop()
        fut = asyncio.run_coroutine_threadsafe(self._submit_many(here, prompts, sampling_params, kw), self._loop)
        return await asyncio.wrap_future(fut)

    async def async_generate(self, prompts: Prompts,
                             sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                             timeout: float | None = None, **kw: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """`generate` on the caller's event loop; cancelling the awaiting task aborts the requests."""
        single, handles = await self._submit_here(prompts, sampling_params, whole(kw, timeout))
        return await self._results(single, handles)

    async def async_stream(self, prompt: str | list[int], sampling_params: dict[str, Any] | None = None,
                           timeout: float | None = None, **kw: Any) -> AsyncIterator[StreamChunk]:
        """`stream` on the caller's event loop, each chunk handed straight to it; cancelling the iterating
        task or closing the iterator aborts the request."""
        _, (handle,) = await self._submit_here(prompt, sampling_params, kw | {"timeout": timeout})
        inner = handle.stream()
        try:
            async for chunk in inner:
                yield chunk
        finally:
            await inner.aclose()  # type: ignore[attr-defined]
