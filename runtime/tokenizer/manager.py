"""The tokenizer process's side of the ZeroMQ link, asyncio-native (as SGLang's TokenizerManager).

`TokenizerManager` runs on the event loop it is started on (uvicorn's in the server, a background loop
thread inside the sync `Engine`). It validates a request at the door, sends it to the scheduler and returns
a `RequestHandle` at once; one receive task reads the scheduler's replies from a `zmq.asyncio` socket and
hands each chunk to its request's queue, with no thread hop (a consumer on another event loop is woken
with `call_soon_threadsafe`). A consumer that goes away (handle aborted, task cancelled, stream closed or
garbage-collected, per-chunk timeout or total deadline expired) aborts its requests on the scheduler, which
frees their memory. Metrics and flush replies are matched to their request by id.

With `--dp M` (without DP attention) there are M engine replicas, each with its own scheduler, workers and
radix cache, and one PUSH socket to each; their replies share one PULL. A `DPRouter` chooses each request's
replica (`--load-balance-method`); an abort goes to the request's replica; metrics are gathered from every
replica and added up; a flush goes to all. One replica behaves exactly as an engine without DP.

With `--watchdog-timeout` a watch task fails the requests pending on a scheduler that has fallen silent and
aborts them there; what is stuck (that, or a step the scheduler reports stuck) refuses new requests until it
recovers (`stuck`, which /health reports; `runtime.tokenizer.scheduler_watch`).

`submit`, `abort`, `get_metrics`, `flush_cache` and `close` are called on the manager's loop; `abort` may be
called from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from radixk3.config import ConfigError
from radixk3.vision.image_processor import ProcessedImage
from runtime.disagg.door import check_disaggregated
from runtime.dp_router import CacheAwareConfig, DPRouter
from runtime.engine_processes import EngineProcesses
from runtime.errors import EngineError, EngineOverloaded, InvalidRequest
from runtime.grammar import GrammarKey, check_grammar
from runtime.messages import (
    AbortReq,
    Bootstrap,
    ContinueReq,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    Heartbeat,
    MetricsOut,
    MetricsReq,
    PauseOut,
    PauseReq,
    TokenOut,
    TokenOuts,
    combine_metrics,
    decode,
    encode,
)
from runtime.pool_layout import pool_layout, serving_dtype
from runtime.request_limits import RequestLimits
from runtime.sampling_params import (
    INT64_MAX,
    SamplingParams,
    check_bool,
    check_output_options,
    check_prompt_ids,
)
from runtime.server_args import ServerArgs
from runtime.tokenizer.image_input import PromptImages, expand_text_images, locate_images
from runtime.tokenizer.request_stream import Sample, SampleStream, StreamChunk, StreamCursor
from runtime.tokenizer.scheduler_watch import SchedulerWatch

SHUT_DOWN = "the engine is shut down"
CHECKED_GRAMMARS = 1024  # grammars remembered as valid, so a repeated one is not parsed again


class _Sink:
    """A handle's queue, on its consumer's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StreamChunk | BaseException] = asyncio.Queue()


def _put_all(items: list[tuple[_Sink, StreamChunk | BaseException]]) -> None:
    for sink, item in items:
        sink.queue.put_nowait(item)


@dataclass
class Submission:
    """One prompt's request, validated and built by `TokenizerManager.prepare`, not yet sent."""

    rid: str  # the id it was given (its samples: `rids`)
    rids: list[str]
    prompt_ids: list[int]
    params: SamplingParams
    msgs: list[GenerateReq]
    return_logprob: bool
    text_in_logprobs: bool


@dataclass
class _Entry:
    sample: SampleStream
    sink: _Sink
    replica: int


class RequestHandle:
    """The request(s) of one `submit`: n samples, ids `rids` (sample i is `rids[i]`)."""

    def __init__(self, tm: TokenizerManager, rids: list[str], sink: _Sink, prompt_ids: list[int],
                 return_logprob: bool, text_in_logprobs: bool, timeout: float | None, deadline_at: float | None
                 ) -> None:
        self.rids = rids
        self._tm = tm
        self._sink = sink
        self.prompt_ids = prompt_ids
        self.return_logprob = return_logprob
        self.text_in_logprobs = text_in_logprobs
        self._timeout = timeout
        self._deadline_at = deadline_at  # on the consumer loop's clock
        self._open = set(rids)
        self._started = False

    @property
    def finished(self) -> bool:
        return not self._open

    def abort(self) -> None:
        """Abort every sample that has not finished (the scheduler frees their memory); thread-safe."""
        if self._open:
            self._tm.abort(*sorted(self._open))

    async def _next(self) -> StreamChunk:
        wait = self._timeout
        if self._deadline_at is not None:
            left = self._deadline_at - self._sink.loop.time()
            wait = left if wait is None else min(wait, left)
        try:
            async with asyncio.timeout(None if wait is None else max(wait, 0.0)):
                item = await self._sink.queue.get()
        except TimeoutError:
            deadline = self._deadline_at is not None and self._sink.loop.time() >= self._deadline_at
            what = "passed its deadline" if deadline else f"produced nothing for {self._timeout}s"
            raise TimeoutError(f"request {', '.join(self.rids)} {what}") from None
        if isinstance(item, BaseException):
            raise item
        return item

    async def stream(self) -> AsyncIterator[StreamChunk]:
        """Chunks of all samples as they come (interleaved); each sample ends with a chunk with `finished`.
        Leaving early (break, close, cancellation, timeout) aborts the samples still running."""
        if self._started:
            raise RuntimeError("a request handle is consumed once")
        self._started = True
        try:
            while self._open:
                chunk = await self._next()
                if chunk.finished is not None:
                    self._open.discard(chunk.rid)
                yield chunk
        finally:
            try:
                self.abort()
            except EngineError:
                pass  # shut down or dead: nothing runs any more

    async def samples(self) -> list[Sample]:
        """Every sample, once all have finished, in sample order."""
        samples = [Sample(i) for i in range(len(self.rids))]
        async for chunk in self.stream():
            samples[chunk.index].add(chunk)
        return samples

    async def result(self) -> list[dict[str, Any]]:
        """One dict per sample, in the shape `Engine.generate` (and `/generate`) returns."""
        return [self.result_of(s) for s in await self.samples()]

    def result_of(self, sample: Sample, cursor: StreamCursor | None = None) -> dict[str, Any]:
        """The sample's result; with a stream's `cursor`, only what follows it (`Sample.result`)."""
        return sample.result(self.prompt_ids, self._tm.tokenizer, return_logprob=self.return_logprob,
                             text_in_logprobs=self.text_in_logprobs, cursor=cursor)

    def __del__(self) -> None:
        # Dropped without being consumed to the end: nobody will read the output, so free the memory.
        if getattr(self, "_open", None):
            try:
                self.abort()
            except Exception:
                pass


def max_request_tokens(args: ServerArgs, procs: EngineProcesses) -> int:
    """The most tokens (prompt + new) one request may hold: its KV pages and two state blocks (its live
    state and a spare checkpoint) must fit the pool alone, as the scheduler requires."""
    layout = pool_layout(procs.config, args)
    g = layout.geometry(procs.pool_bytes)  # the size the ranks allocated, as the scheduler's pool
    if g.num_state_slots < 2:
        return 0
    room = g.state_base + (g.num_state_slots - 2) * g.state_block_bytes
    return min(g.num_pages, room // g.page_bytes) * layout.page_size


class TokenizerManager:
    def __init__(self, args: ServerArgs, procs: EngineProcesses) -> None:
        self.args = args
        self.procs = procs
        self.tokenizer = procs.tokenizer
        self.vocab_size = procs.vocab_size
        self.sampling_defaults = procs.sampling_defaults  # under each request's own (--sampling-defaults)
        self.context_length = max_request_tokens(args, procs)
        self.limits = RequestLimits(args, self.context_length, self.tokenizer.max_token_bytes)
        self._reqs: dict[str, _Entry] = {}
        self._waiters: dict[str, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._closed = False
        self.dead: EngineError | None = None
        self._refusal: EngineError | None = None  # set by fail_pending: new requests are refused with it
        # Chunks for consumers on other event loops, handed over once per burst of replies (one wake-up).
        self._foreign: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, StreamChunk | BaseException]]] = {}
        # Digests of grammars checked at the door (not their sources: up to --max-grammar-bytes each).
        self._grammars_ok: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.num_replicas: int = procs.num_replicas
        self.router = DPRouter(self.num_replicas, args.load_balance_method, CacheAwareConfig())

    # --- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._actx = zmq.asyncio.Context()
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.procs.endpoint("sched_out"))
        self._ctx = zmq.Context()
        self._push: list[zmq.Socket] = []  # one per replica
        for i in range(self.num_replicas):
            push = self._ctx.socket(zmq.PUSH)  # sync sends on this loop's thread: never block (no HWM)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(self.procs.endpoint(f"sched_in_{i}"))
            self._push.append(push)
        self._task = asyncio.create_task(self._receive(), name="radixk3-tokenizer-manager")
        self.watch = SchedulerWatch(self.num_replicas, self.args.watchdog_timeout, self._loop.time())
        if self.watch.enabled:
            self._watch_task = asyncio.create_task(self._watch_schedulers(), name="radixk3-scheduler-watch")
        self.procs.on_death(self._on_death)

    async def close(self) -> None:
        """Stop receiving; every pending request and waiter fails with EngineError. The processes are the
        caller's to shut down (`EngineProcesses.shutdown`)."""
        if self._closed:
            return
        self._closed = True
        for task in (self._task, self._watch_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._fail_all(EngineError(SHUT_DOWN))
        self._pull.close(linger=0)
        for push in self._push:
            push.close(linger=0)
        self._actx.term()
        self._ctx.term()

    def _on_death(self, err: EngineError) -> None:  # the watcher thread
        self.dead = err
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._fail_all, err)
            except RuntimeError:
                pass

    def _deliver(self, sink: _Sink, item: StreamChunk | BaseException) -> None:
        if sink.loop is self._loop:
            sink.queue.put_nowait(item)
            return
        if not self._foreign:
            self._loop.call_soon(self._hand_over)  # type: ignore[union-attr]
        self._foreign.setdefault(sink.loop, []).append((sink, item))

    def _hand_over(self) -> None:
        foreign, self._foreign = self._foreign, {}
        for loop, items in foreign.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the consumer's loop is closed: nobody is waiting any more
                pass

    def _fail_all(self, err: EngineError) -> None:
        reqs, self._reqs = self._reqs, {}
        for rid, entry in reqs.items():
            self.router.finished(rid)
            self._deliver(entry.sink, err)
        waiters, self._waiters = self._waiters, {}
        for fut in waiters.values():
            if not fut.done():
                fut.set_exception(err)

    def _check_open(self) -> None:
        """Alive, not shutting down, not stuck: new requests are taken."""
        self._check_alive()
        if self._refusal is not None:
            raise self._refusal
        self._check_not_stuck()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self._closed or self.procs.closed:
            raise EngineError(SHUT_DOWN)
        if self._loop is None:
            raise EngineError("the tokenizer manager is not started")

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError("call the tokenizer manager on the event loop it was started on")

    # --- receiving -------------------------------------------------------------------------------------
    async def _receive(self) -> None:
        try:
            while True:
                self._dispatch(decode(await self._pull.recv_multipart()))
                for _ in range(4096):  # what else has arrived, in this turn of the loop (no await yields)
                    if not self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    self._dispatch(decode(await self._pull.recv_multipart()))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never leave requests waiting on a receiver that is gone
            self.dead = EngineError(f"the tokenizer manager's receiver failed: {type(e).__name__}: {e}")
            self._fail_all(self.dead)
            raise

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, TokenOuts):
            for out in msg.outs:
                self._token_out(out)
        elif isinstance(msg, TokenOut):
            self._token_out(msg)
        elif isinstance(msg, MetricsOut):
            self._resolve(msg.req_id, msg.metrics)
        elif isinstance(msg, FlushCacheOut):
            self._resolve(msg.req_id, msg.flushed)
        elif isinstance(msg, PauseOut):
            self._resolve(msg.req_id, msg.paused)
        elif isinstance(msg, Heartbeat):
            self.watch.heard(msg.replica, msg.stuck, self._loop.time())  # type: ignore[union-attr]

    def _token_out(self, out: TokenOut) -> None:
        entry = self._reqs.get(out.rid)
        if entry is None:
            return  # already failed or forgotten
        if out.finished is not None:
            del self._reqs[out.rid]
            self.router.finished(out.rid)
        self._deliver(entry.sink, entry.sample.chunk(out))

    # --- the schedulers' watchdog ----------------------------------------------------------------------
    @property
    def stuck(self) -> str | None:
        """What the watchdogs find stuck (a scheduler silent with requests pending, or a step its ranks do not
        finish), until it recovers; None: nothing."""
        return self.watch.stuck if hasattr(self, "watch") else None

    def _check_not_stuck(self) -> None:
        if (why := self.stuck) is not None:
            raise EngineError(f"the engine is stuck: {why}")

    async def _watch_schedulers(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.args.heartbeat_interval
        skipped = False
        while True:
            slept_from = loop.time()
            await asyncio.sleep(interval)
            if loop.time() - slept_from > 2 * interval and not skipped:
                skipped = True  # this loop itself was held up: let the receiver read the heartbeats waiting first
                continue
            skipped = False
            pending = collections.Counter(e.replica for e in self._reqs.values())
            for i in self.watch.check(pending, loop.time(), self.procs.describe_scheduler):
                self._fail_replica(i, EngineError(self.watch.silent[i]))

    def _fail_replica(self, replica: int, err: EngineError) -> None:
        """Fail the requests pending on one replica, and abort them there: if its scheduler comes back, it
        drops them and frees their memory."""
        for rid in [r for r, e in self._reqs.items() if e.replica == replica]:
            entry = self._reqs.pop(rid)
            self.router.finished(rid)
            self._deliver(entry.sink, err)
            self._send(AbortReq(rid), replica)

    def fail_pending(self, err: EngineError) -> None:
        """Fail every pending request and waiter with `err`, abort the requests on their schedulers (which frees
        their memory), and refuse new ones with it: the server's shutdown grace period is over."""
        if self._closed:
            return
        self._refusal = err
        for replica in range(self.num_replicas):
            self._fail_replica(replica, err)
        self._fail_all(err)  # what is left: the waiters for metrics or a flush

    def _resolve(self, req_id: str, value: Any) -> None:
        fut = self._waiters.pop(req_id, None)
        if fut is not None and not fut.done():  # a reply nobody waits for any more is dropped
            fut.set_result(value)

    def _send(self, msg: Any, replica: int) -> None:
        self._push[replica].send_multipart(encode(msg), flags=zmq.NOBLOCK)

    # --- requests --------------------------------------------------------------------------------------
    def parse_sampling(self, sampling_params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """A request's sampling parameters parsed and validated against the model and the limits (`--max-n`):
        the door, once per request (a `SamplingParams` is one this method returned)."""
        if isinstance(sampling_params, SamplingParams):
            return sampling_params
        if sampling_params is None or isinstance(sampling_params, dict):
            # A null field is not given: the model's default stays beneath it.
            sampling_params = self.sampling_defaults | {k: v for k, v in (sampling_params or {}).items()
                                                        if v is not None}
        params = SamplingParams.from_dict(sampling_params, self.vocab_size)
        self.limits.check_n(params.n)
        return params

    async def check_grammars(self, params: Iterable[SamplingParams]) -> None:
        """Parse the grammars (regex / json_schema / ebnf) of these parsed sampling params in a thread, never on
        this loop; raises InvalidRequest for a bad one. Valid ones are remembered: `submit` then skips them."""
        for p in params:
            if p.grammar is not None and (key := GrammarKey(*p.grammar)).digest() not in self._grammars_ok:
                await asyncio.to_thread(check_grammar, key, self.args.max_grammar_bytes)
                self._grammar_ok(key)

    def _grammar_ok(self, key: GrammarKey) -> None:
        digest = key.digest()
        self._grammars_ok[digest] = None
        self._grammars_ok.move_to_end(digest)
        while len(self._grammars_ok) > CHECKED_GRAMMARS:
            self._grammars_ok.popitem(last=False)

    def check_room(self, samples: int, prompts: int, param: str) -> None:
        """Whether a request or batch of `samples` sequences over `prompts` prompts fits the queue: never
        (InvalidRequest naming `param`), or not now, beside the requests pending (EngineOverloaded). `send` checks
        it; a route may check it first, before it encodes the prompts."""
        self.limits.check_samples(samples, prompts, param)
        if len(self._reqs) + samples > self.args.max_queued_requests:
            raise EngineOverloaded(f"{len(self._reqs)} requests pending and {samples} asked for (the limit is "
                                   f"{self.args.max_queued_requests}); try again later")

    def prepare(self, prompt: str | list[int], sampling_params: SamplingParams | dict[str, Any] | None = None, *,
                rid: str | None = None, return_logprob: bool = False, logprob_start_len: int = -1,
                top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                images: Sequence[ProcessedImage] = (), images_param: str = "image_data",
                bootstrap: Bootstrap | None = None, stream: bool = True) -> Submission:
        """Validate one prompt's request against the model and the limits, and build its messages; nothing is
        registered or sent (`send`). `images` (`image_input.load_images`'s) replace the prompt's
        `<|kimi_image_placeholder|>` ids in order (`images_param` names them in errors). `stream` False: the
        consumer reads only whole results, so the scheduler sends the first token, then the tokens every
        `output_processor.NON_STREAM_INTERVAL` and at the end, not one chunk a token. Raises InvalidRequest
        (bad input, or a request that can never fit), EngineError (shut down)."""
        self._check_thread()
        self._check_open()
        params = self.parse_sampling(sampling_params)  # checks n before anything is built per sample
        self.limits.check_samples(params.n, 1, "n")
        check_output_options(return_logprob, logprob_start_len, top_logprobs_num, self.vocab_size)
        self.limits.check_top_logprobs(top_logprobs_num)
        check_bool("return_text_in_logprobs", return_text_in_logprobs)
        if isinstance(prompt, str):
            self.limits.check_text(len(prompt), params.max_new_tokens, "prompt")
        prompt_images = self._prompt_images(prompt, images, images_param) if images else None
        ids = self._prompt_ids(prompt) if prompt_images is None else prompt_images.ids
        if params.grammar is not None and (key := GrammarKey(*params.grammar)).digest() not in self._grammars_ok:
            # Not checked by `check_grammars` (a direct caller): parse it here; no tokenizer, so it is cheap.
            check_grammar(key, self.args.max_grammar_bytes)
            self._grammar_ok(key)
        self.limits.check_tokens(len(ids), params.max_new_tokens, "prompt" if isinstance(prompt, str) else "input_ids")
        if rid is None:
            rid = uuid.uuid4().hex
        elif not isinstance(rid, str) or not rid:
            raise InvalidRequest(f"rid must be a non-empty string, got {rid!r}", param="rid")
        n = params.n
        check_disaggregated(self.args.disaggregation_mode, bootstrap, params, return_logprob, logprob_start_len,
                            len(ids), top_logprobs_num)
        if bootstrap is not None and n != 1:
            raise InvalidRequest("a bootstrap room pairs one sample: n > 1 in P/D disaggregation is not supported yet",
                                 param="n")
        rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        with_images = {} if prompt_images is None else {"images": prompt_images.refs,
                                                         "image_patches": prompt_images.patches}
        msgs = [GenerateReq(r, ids, params.for_sample(i), return_logprob, logprob_start_len, top_logprobs_num,
                            stream=stream, bootstrap=bootstrap, **with_images) for i, r in enumerate(rids)]
        return Submission(rid, rids, ids, params, msgs, return_logprob, return_text_in_logprobs)

    def send(self, subs: Sequence[Submission], *, consumer: asyncio.AbstractEventLoop | None = None,
             timeout: float | None = None, deadline: float | None = None) -> list[RequestHandle]:
        """Register and send prepared requests, all or none: the batch is checked as a whole against the queue
        before any of it is sent (no await in between, so nothing else is admitted meanwhile). `consumer`: the
        event loop that reads the handles (default: this one). `timeout`: seconds the consumer waits for each
        chunk; `deadline`: seconds from now the whole request may take; either expiring aborts the request and
        raises TimeoutError in the consumer. Raises InvalidRequest (an id in use; a batch that can never fit),
        EngineOverloaded (the queue has no room for the batch now), EngineError (shut down)."""
        self._check_thread()
        self._check_open()
        _check_seconds("timeout", timeout)
        _check_seconds("deadline", deadline)
        rids = [r for sub in subs for r in sub.rids]
        self.check_room(len(rids), len(subs), "n" if len(subs) == 1 else "prompt")
        batch: set[str] = set()
        for sub in subs:
            if any(r in self._reqs or r in batch for r in sub.rids):
                raise InvalidRequest(f"request id {sub.rid!r} is already in use", param="rid")
            batch.update(sub.rids)
        consumer = consumer if consumer is not None else asyncio.get_running_loop()
        # Encoded before anything is registered: a failure leaves nothing.
        frames = [[encode(m) for m in sub.msgs] for sub in subs]
        deadline_at = None if deadline is None else consumer.time() + deadline
        handles = []
        for sub, sub_frames in zip(subs, frames, strict=True):
            sink = _Sink(consumer)
            params = sub.params
            for i, (r, f) in enumerate(zip(sub.rids, sub_frames, strict=True)):
                replica = self.router.route(r, sub.prompt_ids, params.max_new_tokens)
                sample = SampleStream(r, i, self.tokenizer, params)
                self._reqs[r] = _Entry(sample, sink, replica)
                self._push[replica].send_multipart(f, flags=zmq.NOBLOCK)
            if deadline is not None:
                # The deadline holds even for a handle nobody reads: abort and tell the consumer when it passes.
                self._loop.call_later(deadline, self._expire, sub.rids)  # type: ignore[union-attr]
            handles.append(RequestHandle(self, sub.rids, sink, sub.prompt_ids, sub.return_logprob,
                                         sub.text_in_logprobs, timeout, deadline_at))
        return handles

    def submit(self, prompt: str | list[int], sampling_params: SamplingParams | dict[str, Any] | None = None, *,
               consumer: asyncio.AbstractEventLoop | None = None, rid: str | None = None,
               return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
               return_text_in_logprobs: bool = False, timeout: float | None = None, deadline: float | None = None,
               ) -> RequestHandle:
        """`prepare` and `send` one prompt's request (n samples = n requests, ids `rid` or `f"{rid}-{i}"`);
        returns at once. `sampling_params`: a dict (parsed here) or what `parse_sampling` returned. Raises
        InvalidRequest (bad input, or a request that can never fit), EngineOverloaded (queue full), EngineError
        (shut down)."""
        sub = self.prepare(prompt, sampling_params, rid=rid, return_logprob=return_logprob,
                           logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                           return_text_in_logprobs=return_text_in_logprobs)
        return self.send([sub], consumer=consumer, timeout=timeout, deadline=deadline)[0]

    def _expire(self, rids: list[str]) -> None:
        live = [r for r in rids if r in self._reqs]
        if not live:
            return
        sink = self._reqs[live[0]].sink
        self._abort_now(live)
        self._deliver(sink, TimeoutError(f"request {', '.join(rids)} passed its deadline"))

    def _prompt_images(self, prompt: Any, images: Sequence[ProcessedImage], param: str) -> PromptImages:
        """The prompt's ids with its images in place (`image_input`), and where they are."""
        try:
            self.procs.config.check_images(len(images))
        except ConfigError as e:
            raise InvalidRequest(str(e), param=param) from None
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty", param="prompt")
            return expand_text_images(prompt, images, self.tokenizer, param=param)
        return locate_images(self._prompt_ids(prompt), images, self.tokenizer, param)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty", param="prompt")
            return self.tokenizer.encode(prompt, add_bos=True)
        if isinstance(prompt, list | tuple):
            return check_prompt_ids(list(prompt), self.vocab_size)
        raise InvalidRequest(f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                             param="prompt")

    def abort(self, *rids: str) -> None:
        """Abort requests by id (unknown or finished ids are ignored); from any thread."""
        self._check_alive()
        if threading.get_ident() == self._thread:
            self._abort_now(list(rids))
        else:
            try:
                self._loop.call_soon_threadsafe(self._abort_now, list(rids))  # type: ignore[union-attr]
            except RuntimeError:
                raise EngineError(SHUT_DOWN) from None

    def _abort_now(self, rids: list[str]) -> None:
        if self._closed:
            return
        for r in rids:
            if (entry := self._reqs.get(r)) is not None:  # its final chunk ("abort") comes back from the scheduler
                self._send(AbortReq(r), entry.replica)

    async def _ask(self, msg_type: Callable[[str], Any], timeout: float | None) -> list[Any]:
        """Send `msg_type(req_id)` to every replica; their replies in replica order."""
        self._check_thread()
        self._check_alive()
        req_ids = [f"q{next(self._ids)}" for _ in range(self.num_replicas)]
        futs = [self._loop.create_future() for _ in req_ids]  # type: ignore[union-attr]
        self._waiters.update(zip(req_ids, futs, strict=True))
        try:
            for i, req_id in enumerate(req_ids):
                self._send(msg_type(req_id), i)
            async with asyncio.timeout(timeout):
                return list(await asyncio.gather(*futs))
        finally:
            for req_id in req_ids:
                self._waiters.pop(req_id, None)

    async def get_metrics(self, timeout: float | None = 10.0) -> dict[str, Any]:
        """The scheduler's counters (running, queued, prefill tokens computed, cached tokens, state checkpoint
        hits/misses, pool bytes per side, evictions, retractions, checkpoints), plus pending requests here.
        With several replicas every count is their sum (so cached / prompt tokens is the engine's hit rate),
        a high-water mark their max, and `replicas` lists each replica's own counters."""
        per = await self._ask(MetricsReq, timeout)
        metrics = per[0] if len(per) == 1 else combine_metrics(per) | {"replicas": per}
        return metrics | {"pending_requests": len(self._reqs)}

    async def pause_generation(self, mode: str = "abort", timeout: float | None = 10.0) -> None:
        """SGLang's pause: every replica plans no step until `continue_generation`; requests sent meanwhile
        queue. `in_place` keeps the running requests' memory, `retract` gives it back (they are recomputed
        after), `abort` aborts every request in flight."""
        await self._ask(lambda req_id: PauseReq(req_id, mode), timeout)

    async def continue_generation(self, timeout: float | None = 10.0) -> None:
        await self._ask(ContinueReq, timeout)

    async def flush_cache(self, timeout: float | None = 10.0) -> bool:
        """Empty the radix cache of every replica that has nothing running or queued; returns whether all
        did."""
        return all(await self._ask(FlushCacheReq, timeout))

    def model_info(self) -> dict[str, Any]:
        self._check_alive()
        cfg, args = self.procs.config, self.args
        return {
            "model_path": args.model_id,
            "vocab_size": cfg.vocab_size,
            "context_length": self.context_length,
            "dtype": serving_dtype(cfg, args),
            "page_size": args.page_size,
            "max_running_requests": args.max_running_requests,
            "max_queued_requests": args.max_queued_requests,
            "eos_token_id": cfg.eos_token_id,
            "is_generation": True,
        }


def _check_seconds(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0 \
            or value > INT64_MAX:
        raise InvalidRequest(f"{name} must be a positive number of seconds, got {value!r}", param=name)
